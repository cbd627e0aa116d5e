"""The native step: one C call runs one whole pass (forward or backward) of the loop.

The blocked loop (schedule, skipping, masks, ledger) stays in Python; with
tracing off, on CPU, for scores without dropout (float32 and float64: plain,
a softcap, ALiBi, a bias, an additive score_mod; plain scores in
bfloat16/float16 too, below), the
schedule it builds (which tiles run, in which order, which are partial, with
their visibility) goes to ``_native.c``, which runs the pass's arithmetic
(scores, online update or gradient rebuild, matmuls) in one parallel region:
work items (query tile, head, rows; or K/V head, key tiles) handed out to threads
as they free up, each tile in a per-thread buffer. Same math as the PyTorch step,
its own rounding. The matmuls run on the back end the calibration measured
fastest on this machine (``_calibrate``): the step's own kernel (where the
compiler targets AVX-512, or AVX2 with FMA), the BLAS gemm PyTorch uses, or
OpenBLAS; ``FLASHLEDGER_GEMM`` forces one.

bfloat16 and float16 inputs take one of two paths, chosen by measurement
(``_calibrate``): the float32 step, reading the inputs in their dtype and
widening each row as a pass needs it (``widen``: the results of the inputs
converted up front, bit for bit, without float32 copies of them), or the half
step, every product on MKL's mixed gemm (``gemm_bf16bf16f32_`` /
``gemm_f16f16f32_`` in PyTorch's library: half operands, float32 sums), P and dS
rounded to the dtype before the products that read them, everything else
float32 (``FLASHLEDGER_HALF=half`` or ``float32`` forces one; without MKL's half
gemm the float32 path runs).

The C source is compiled on first use (a C compiler with OpenMP is needed;
a few seconds, four objects side by side) against the OpenMP runtime and the BLAS PyTorch has loaded,
and cached under ``$FLASHLEDGER_CACHE_DIR`` (default
``~/.cache/flashledger``) with its SHA-256 beside it (checked before every
load). Without a compiler, or on a platform where that cannot be arranged, the
loop keeps its PyTorch step: ``native_status()``
(``flashledger.native_status()``) says which and why. ``FLASHLEDGER_NATIVE=0``
turns the native step off. ``FLASHLEDGER_NATIVE_ARCH`` builds it for another
target than this CPU (a ``gcc -march`` value whose instructions this CPU has, e.g.
``x86-64-v3``: the AVX2 form an AMD EPYC without AVX-512 runs, on a CPU with it),
cached and calibrated apart.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import hashlib
import itertools
import math
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import _calibrate
from ._checks import power_of_two

__all__ = [
    "Alibi",
    "ForwardPass",
    "Kernels",
    "Schedule",
    "TermView",
    "disabled",
    "kernels",
    "native_status",
    "release_scratch",
]

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-march=native", "-fPIC", "-fopenmp", "-fno-math-errno"]
# the instruction sets _native.c branches on: a target given by FLASHLEDGER_NATIVE_ARCH
# must not define one that -march=native does not
_ISA_MACROS = (
    "__SSE2__",
    "__AVX__",
    "__AVX2__",
    "__FMA__",
    "__F16C__",
    "__AVX512F__",
    "__AVX512BF16__",
    "__AVX512FP16__",
    "__AMX_TILE__",
    "__AMX_BF16__",
)
_lock = threading.Lock()
_loaded: tuple[Kernels | None, str] | None = None
_off = threading.local()


_POINTERS = (
    "q k kt v o lse dout lam dd dq dk dvo work iv_lo iv_hi k16 v16 q16 tiles row_start bounds "
    "seen o16 bad kp vp mx al_slope al_center dk16 dv16 dout16"
)
_SIZES = (
    "heads group lq lk d dv work_stride hq iv_bstride rows chunk splits stacked half amx alibi "
    "kt_tile amx_dot merge dot_scores"
)
_HALF = {torch.bfloat16: 1, torch.float16: 2}
_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16"}
_HALF_GEMMS = {"bf16": "gemm_bf16bf16f32_", "f16": "gemm_f16f16f32_"}
HALF_PATHS = _calibrate.HALF_PATHS


def _layout_tile(t: torch.Tensor, x: torch.Tensor, sched: Schedule) -> int:
    """The tile of ``t``, the transpose of ``x`` ``(Hk, Lk, n)`` as ``Kernels.transposed``
    lays it out: 0 for ``(Hk, n, Lk)``, else the ``tile`` of ``(Hk, tiles, n, tile)``, which
    every tile of ``sched`` must lie within. Raises ValueError for any other tensor."""
    hk, lk, n = x.shape
    if t.dim() == 3 and tuple(t.shape) == (hk, n, lk):
        return 0
    tile = t.shape[-1] if t.dim() == 4 else 0
    if 0 < tile < lk and tuple(t.shape) == (hk, -(-lk // tile), n, tile) and sched.fits(tile):
        return tile
    raise ValueError(
        f"a transposed K or V {tuple(t.shape)} is not one Kernels.transposed lays out for "
        f"{tuple(x.shape)}: ({hk}, {n}, {lk}), or ({hk}, tiles, {n}, tile) per tile of keys "
        "that every tile of the schedule lies within"
    )


class _Args(ctypes.Structure):
    """Mirror of ``struct fl_args`` in ``_native.c``."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS.split()]
        + [(name, ctypes.c_longlong) for name in _SIZES.split()]
        + [("scale", ctypes.c_double)]
        + [("scale_exact", ctypes.c_longlong)]
        + [("softcap", ctypes.c_double)]
    )


GATHER_DIMS = 8
"""Index tensors a native gather takes (``struct fl_gather``)."""


class _GatherArgs(ctypes.Structure):
    """Mirror of ``struct fl_gather`` in ``_native.c``."""

    _fields_ = [
        ("n", ctypes.c_longlong * 4),
        ("dims", ctypes.c_longlong),
        ("base", ctypes.c_longlong),
        ("idx", ctypes.c_void_p * GATHER_DIMS),
        ("is32", ctypes.c_longlong * GATHER_DIMS),
        ("st", (ctypes.c_longlong * 4) * GATHER_DIMS),
        ("size", ctypes.c_longlong * GATHER_DIMS),
        ("stride", ctypes.c_longlong * GATHER_DIMS),
    ]


def _gather_args(
    shape: tuple[int, ...],
    base: int,
    terms: list[tuple[torch.Tensor, int, int]],
) -> _GatherArgs:
    """The gather of ``shape`` (at most 4 dims) at ``base + Σ wrap(i) · stride`` over the
    ``terms`` ``(index tensor (int64 or int32, broadcasting to shape), size, stride)``."""
    g = _GatherArgs()
    pad = 4 - len(shape)
    for j, n in enumerate((1,) * pad + tuple(shape)):
        g.n[j] = n
    g.dims, g.base = len(terms), base
    for t, (index, size, stride) in enumerate(terms):
        g.idx[t] = index.data_ptr()
        g.is32[t] = int(index.dtype == torch.int32)
        for j, st in enumerate((0,) * pad + tuple(index.expand(shape).stride())):
            g.st[t][j] = st
        g.size[t], g.stride[t] = size, stride
    return g


@dataclass(frozen=True)
class TermView:
    """A tile's additive term, or its dS, read or written by the pass where it lies
    (``Schedule.add``): head ``h``'s row ``i`` of the tile at element ``heads[h] + i ·
    row_stride`` after ``address`` (a byte address in ``base``, the tile's first row and
    key), its keys contiguous."""

    base: torch.Tensor  # the tensor holding the values (kept alive with the schedule)
    address: int  # data address of the tile's (row 0, key 0) element of head offset 0
    row_stride: int  # elements between rows (0: one row for all)
    heads: torch.Tensor  # (H,) int64 element offsets of each query head's values


class Schedule:
    """The tiles one pass runs, in order, grouped in rows: the forward's query tiles (each
    a list of key tiles), or the backward's key tiles (each a list of query tiles).

    ``add`` one tile that runs (a partial tile with its visibility: ``(address, stride per
    K/V head, stride per group member)`` of its uint8 bytes, or address 0 for the pass's
    intervals; ``alive``: the tensor holding the bytes, kept until the pass is over), then
    ``end_row(lo, hi)`` with the row's query (forward) or key (backward) range, tiles or
    none. After the pass ``seen[t]`` holds partial tile ``t``'s visible dots (counted by
    the step as it reads the intervals or bytes, all heads). A tile may carry ``term``, an
    additive term of its scores (a score_mod's, natural units), and (backward) ``ds``,
    where the pass writes dS of the final scores: each ``(H, rows, cols)`` contiguous in
    the pass's float dtype, kept alive with the schedule; or either as a ``TermView``, read
    or written by the pass where it lies (a bias, its gradient: no copy per tile).
    """

    def __init__(self) -> None:
        self._tiles: list[tuple[int, ...]] = []
        self._row_start = [0]
        self._bounds: list[int] = []
        self._alive: list[torch.Tensor] = []
        self.seen: list[int] = []
        self.terms = 0  # tiles carrying an additive term of their scores

    def add(
        self,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        vis: tuple[int, int, int] | None,
        alive: torch.Tensor | None = None,
        term: torch.Tensor | TermView | None = None,
        ds: torch.Tensor | TermView | None = None,
    ) -> None:
        ptr, sn, sg = vis if vis is not None else (0, 0, 0)
        at = [0, 0]
        views = [0, 0, 0, 0]  # (row stride, head offsets' address) of the term's, of ds's
        for n, x in enumerate((term, ds)):
            if isinstance(x, TermView):
                at[n], views[2 * n : 2 * n + 2] = x.address, (x.row_stride, x.heads.data_ptr())
                self._alive += (x.base, x.heads)
            elif x is not None:
                shape = (q1 - q0, k1 - k0)
                if x.ndim != 3 or tuple(x.shape[1:]) != shape or not x.is_contiguous():
                    raise ValueError(
                        f"a tile's term and dS are contiguous (H, {shape[0]}, {shape[1]})"
                    )
                at[n] = x.data_ptr()
                self._alive.append(x)
        self.terms += at[0] != 0
        self._tiles.append((q0, q1, k0, k1, int(vis is not None), ptr, sn, sg, *at, *views))
        if alive is not None:
            self._alive.append(alive)

    def end_row(self, lo: int, hi: int) -> None:
        self._row_start.append(len(self._tiles))
        self._bounds += (lo, hi)

    @property
    def rows(self) -> int:
        return len(self._bounds) // 2

    def widest(self) -> tuple[int, int]:
        """The largest ``(q1 - q0, k1 - k0)`` of any tile (0, 0 when none)."""
        if not self._tiles:
            return 0, 0
        return max(t[1] - t[0] for t in self._tiles), max(t[3] - t[2] for t in self._tiles)

    def key_tile(self, lk: int) -> int:
        """Keys per tile of the transposed K and V a pass lays out (``Kernels.transposed_k``):
        the widest tile's keys when every tile lies within one aligned block of them and
        there are two blocks or more (of ``lk`` keys); else 0, one layout of all the keys."""
        bk = self.widest()[1]
        return bk if 0 < bk < lk and self.fits(bk) else 0

    def fits(self, tile: int) -> bool:
        """Whether every tile's keys lie within one block ``[j·tile, (j + 1)·tile)``."""
        return all(t[2] // tile == (t[3] - 1) // tile for t in self._tiles if t[3] > t[2])

    def longest_row(self) -> int:
        """The most tiles in one row."""
        return max(b - a for a, b in itertools.pairwise(self._row_start)) if self.rows else 0

    def _arrays(self) -> list[array.array[int]]:
        """The schedule as C arrays of int64: tiles (n x 14), row starts (rows + 1),
        bounds (rows x 2) and ``seen`` (n, zeros); plain buffers, no tensors (a decode
        step's schedule is a few numbers, and four small tensors cost more than its C work)."""
        n = max(1, len(self._tiles))
        return [
            array.array("q", itertools.chain.from_iterable(self._tiles or [(0,) * 14])),
            array.array("q", self._row_start),
            array.array("q", self._bounds or [0, 0]),
            array.array("q", bytes(8 * n)),
        ]


class Kernels:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL, gemms: dict[str, dict[str, int]], choices: Path) -> None:
        """``gemms``: each BLAS back end's ``{"f32": sgemm_, "f64": dgemm_}`` addresses (and
        for PyTorch's, ``"bf16"``/``"f16"``: MKL's half gemms, where exported);
        ``choices``: the calibration's cache file."""
        self._lib = lib
        self._gemms = gemms
        self._choices_file = choices
        self._padded: dict[tuple[torch.dtype, int], int] = {}
        self.choices: dict[torch.dtype, _calibrate.Choice] = {}  # by dtype, as first used
        ll, vp, i, d = ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int, ctypes.c_double
        for suffix in _SUFFIX.values():
            getattr(lib, f"fl_set_gemm_{suffix}").argtypes = [vp]
            getattr(lib, f"fl_set_forward_gemm_{suffix}").argtypes = [vp]
            getattr(lib, f"fl_set_forward_own_gemm_{suffix}").argtypes = [i]
            if suffix in gemms["blas"]:
                getattr(lib, f"fl_set_gemm_{suffix}")(gemms["blas"][suffix])
            for name in ("fl_forward", "fl_backward"):
                getattr(lib, f"{name}_{suffix}").argtypes = [vp]
                getattr(lib, f"{name}_{suffix}").restype = None
            tr = getattr(lib, f"fl_transpose_{suffix}")
            tr.argtypes = [vp, vp, ll, ll, ll, ll, ll]
            tr.restype = None
            getattr(lib, f"fl_padded_{suffix}").argtypes = [ll]
            getattr(lib, f"fl_padded_{suffix}").restype = ll
            getattr(lib, f"fl_set_own_gemm_{suffix}").argtypes = [i]
            getattr(lib, f"fl_set_scores_own_gemm_{suffix}").argtypes = [i]
            getattr(lib, f"fl_set_scores_own_gemm_{suffix}").restype = i
            getattr(lib, f"fl_scores_own_products_{suffix}").restype = ll
            getattr(lib, f"fl_set_product_maxima_{suffix}").argtypes = [i]
            getattr(lib, f"fl_set_product_maxima_{suffix}").restype = i
            getattr(lib, f"fl_product_maxima_blocks_{suffix}").restype = ll
            getattr(lib, f"fl_set_threads_{suffix}").argtypes = [i]
            getattr(lib, f"fl_merge_splits_{suffix}").argtypes = [vp, vp, ll, ll, ll]
            getattr(lib, f"fl_merge_splits_{suffix}").restype = None
            getattr(lib, f"fl_all_finite_{suffix}").argtypes = [vp, ll]
            getattr(lib, f"fl_all_finite_{suffix}").restype = i
            getattr(lib, f"fl_row_dots_{suffix}").argtypes = [vp, vp, vp, ll, ll, ll]
            getattr(lib, f"fl_row_dots_{suffix}").restype = None
            getattr(lib, f"fl_set_threads_{suffix}").restype = None
            # m n k alpha A lda B sbk sbn beta C ldc
            mm = [i, i, i, d, vp, ll, vp, ll, ll, d, vp, ll]
            getattr(lib, f"fl_matmul_{suffix}").argtypes = mm
            getattr(lib, f"fl_matmul_{suffix}").restype = None
            getattr(lib, f"fl_matmul_rate_{suffix}").argtypes = [vp, vp, i, i]
            getattr(lib, f"fl_matmul_rate_{suffix}").restype = None
            if suffix in ("f32", "f64"):
                getattr(lib, f"fl_fma_peak_{suffix}").argtypes = [ll]
                getattr(lib, f"fl_fma_peak_{suffix}").restype = d
                getattr(lib, f"fl_fma_flops_per_rep_{suffix}").restype = d
                for fn in ("fl_tanh", "fl_exp2"):
                    getattr(lib, f"{fn}_{suffix}").argtypes = [vp, vp, ll]
                    getattr(lib, f"{fn}_{suffix}").restype = None
            else:
                getattr(lib, f"fl_round_{suffix}").argtypes = [vp, vp, ll]
                getattr(lib, f"fl_round_{suffix}").restype = None
            if suffix in ("f32", "f64"):
                getattr(lib, f"fl_gather_{suffix}").argtypes = [vp, vp, vp]
                getattr(lib, f"fl_gather_{suffix}").restype = i
                getattr(lib, f"fl_scatter_add_{suffix}").argtypes = [vp, ll, vp, vp]
                getattr(lib, f"fl_scatter_add_{suffix}").restype = i
            getattr(lib, f"fl_pack_amx_{suffix}").argtypes = [vp, vp, vp, vp, ll, ll, ll, ll]
            getattr(lib, f"fl_pack_amx_{suffix}").restype = None
            getattr(lib, f"fl_amx_on_{suffix}").restype = i
        lib.fl_transpose_wide_f32.argtypes = [vp, vp, ll, ll, ll, ll, ll, ll]
        lib.fl_transpose_wide_f32.restype = None
        self.vector_bytes = int(lib.fl_vector_bytes_f32())
        # fused multiply-adds (FMA) in the step's vector arithmetic
        self.fused = bool(lib.fl_fused_f32())
        # the -march it was compiled for, and by which compiler (set by _build_and_load)
        self.target, self.cc = "native", ""
        # the own matmul kernel: built for AVX-512, or AVX2 with FMA
        self.own_built = bool(lib.fl_own_built_f32())
        # built with AMX's instructions, and the kernel lets this process use its tiles
        self.amx = bool(lib.fl_amx_on_bf16())
        # a bfloat16 cache read in place (decode) with bfloat16 q: its scores on AMX's tiles
        # (the float32 step built with them, and the tiles granted; ``set_amx_dot``)
        self.amx_dot = bool(lib.fl_amx_on_f32())
        self._gemm = {suffix: "blas" for suffix in ("f32", "f64")}
        self._forward_gemm: dict[str, str] = {}  # float32/float64: the forward's, where apart
        self._scores_gemm: dict[str, str] = {}  # float32/float64: a backward's score products'
        # half inputs: on the float32 step until the calibration (or a setting) says else
        self._gemm.update({suffix: "float32" for suffix in _HALF_GEMMS})
        # settings(), made again whole by every change (_set_gemm): a reader on another
        # thread sees the tuple before a change or the one after it
        self._settings = self._settings_now()

    def gemm_names(self, dtype: torch.dtype = torch.float32) -> list[str]:
        """How the ``dtype`` step's matmuls can run here. float32/float64: ``own`` (built for
        AVX-512, or AVX2 with FMA), ``blas`` (PyTorch's), ``openblas`` (with the
        ``scipy-openblas32`` package). bfloat16/float16 (``HALF_PATHS``): ``half`` (in the
        dtype, on MKL's half gemm, where PyTorch's library exports it), for bfloat16 ``amx``
        (the same, with the forward's products on AMX's tiles, where the CPU has them) and
        ``float32`` (the float32 step, each row widened as a pass reads it)."""
        if dtype in _HALF:
            have = _suffix(dtype) in self._gemms["blas"]
            amx = have and self.amx and dtype == torch.bfloat16
            return [p for p in HALF_PATHS if p == "float32" or (have and p != "amx") or amx]
        own = ["own"] if self.own_built else []
        return own + [name for name in _calibrate.GEMMS if name in self._gemms]

    def set_gemm(
        self,
        dtype: torch.dtype,
        name: str,
        *,
        forward: str | None = None,
        scores: str | None = None,
    ) -> None:
        """Run the ``dtype`` step's matmuls on back end ``name`` (see ``gemm_names``), those
        of its forward passes on ``forward`` (float32/float64; default: ``name`` too), a
        backward's score products (``S = Q K_jᵀ`` again and ``dP = dO V_jᵀ``) on ``scores``
        (float32/float64: ``"own"`` or ``name``; default: ``name``). The calibration's
        choice for ``dtype`` is made first (where it was not yet), so that it does not
        replace this setting later."""
        self.choose(dtype)
        self._set_gemm(dtype, name, forward, scores)

    def _set_gemm(self, dtype: torch.dtype, name: str, fwd: str | None, sco: str | None) -> None:
        names = self.gemm_names(dtype)
        for n in (name, fwd, sco):
            if n is not None and n not in names:
                raise ValueError(f"no matmul back end {n!r} for {dtype} here; one of {names}")
        suffix = _suffix(dtype)
        if (fwd is not None or sco is not None) and dtype in _HALF:
            raise ValueError(
                f"{dtype} has no forward or score products' back end of its own; pass only a path"
            )
        if sco not in (None, name, "own"):
            raise ValueError(
                f"a backward's score products run on the own kernel or on {name!r}, not {sco!r}"
            )
        if dtype not in _HALF:
            apart = sco is not None and sco != name  # "own" beside a BLAS
            self.fn("fl_set_scores_own_gemm", suffix)(int(apart))
            if apart:
                self._scores_gemm[suffix] = "own"
            else:
                self._scores_gemm.pop(suffix, None)
            if name != "own":
                self.fn("fl_set_gemm", suffix)(self._gemms[name][suffix])
            self.fn("fl_set_own_gemm", suffix)(int(name == "own"))
            if fwd is not None and fwd != name:  # the forward's apart
                if fwd != "own":
                    self.fn("fl_set_forward_gemm", suffix)(self._gemms[fwd][suffix])
                self.fn("fl_set_forward_own_gemm", suffix)(int(fwd == "own"))
                self._forward_gemm[suffix] = fwd
            else:
                self.fn("fl_set_forward_own_gemm", suffix)(-1)
                self._forward_gemm.pop(suffix, None)
        self._gemm[suffix] = name
        self._settings = self._settings_now()

    def set_product_maxima(self, dtype: torch.dtype, on: bool) -> None:
        """Where a float32/float64 forward's full tiles take their rows' score maxima: from
        the own kernel's write-back of S as it forms it (``on``, the default: no pass over
        S for them), or from a pass over S, as every other tile (the two agree bit for
        bit; the tests compare them)."""
        self.fn("fl_set_product_maxima", _float_suffix(dtype))(int(bool(on)))

    def product_maxima_blocks(self, dtype: torch.dtype) -> int:
        """Blocks of rows of ``dtype`` forwards whose maxima came from the product since the
        last call (which starts the count again)."""
        return int(self.fn("fl_product_maxima_blocks", _float_suffix(dtype))())

    def scores_own_products(self, dtype: torch.dtype) -> int:
        """A float32/float64 backward's score products the own kernel ran beside a BLAS
        (``set_gemm(..., scores="own")``) since the last call (which starts the count
        again)."""
        return int(self.fn("fl_scores_own_products", _float_suffix(dtype))())

    def settings(self) -> tuple[str, ...]:
        """The matmul back end in force for each dtype (and a forward's and a backward's score
        products', where apart): with the thread count, what a planned pass depends on
        besides its shapes (``ForwardPass``)."""
        return self._settings

    def _settings_now(self) -> tuple[str, ...]:
        fwd = tuple(f"{s} forward {n}" for s, n in sorted(self._forward_gemm.items()))
        sco = tuple(f"{s} scores {n}" for s, n in sorted(self._scores_gemm.items()))
        amx = ("bf16 cache scores amx",) if self.amx_dot else ()
        return (*self._gemm.values(), *fwd, *sco, *amx)

    def set_amx_dot(self, on: bool) -> None:
        """Whether a forward reading a bfloat16 cache in place with bfloat16 q (decode) forms
        its scores on AMX's tiles (``on``, the default where the step was built with them
        and the kernel grants them) or on AVX512-BF16's pair dot products; both sum exact
        products in float, in another order. Raises ValueError for ``on`` where the step
        has no AMX."""
        if on and not bool(self.fn("fl_amx_on", "f32")()):
            raise ValueError(
                "this native step has no AMX tiles (built without them, or not granted)"
            )
        self.amx_dot = bool(on)
        self._settings = self._settings_now()

    def gemm(self, dtype: torch.dtype, *, forward: bool = False, scores: bool = False) -> str:
        """The back end running the ``dtype`` step's matmuls now; ``forward``: those of a
        forward pass; ``scores``: a backward's score products."""
        self.choose(dtype)
        suffix = _suffix(dtype)
        if forward:
            return self._forward_gemm.get(suffix, self._gemm[suffix])
        if scores:
            return self._scores_gemm.get(suffix, self._gemm[suffix])
        return self._gemm[suffix]

    def half_step(self, dtype: torch.dtype) -> bool:
        """True when ``dtype`` (bfloat16/float16) inputs run in their dtype (the ``half``
        path), False when they run on the float32 step (or ``dtype`` is not half)."""
        self.choose(dtype)
        return dtype in _HALF and self._gemm[_suffix(dtype)] in ("half", "amx")

    def round_to(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous float32 ``x`` rounded to ``dtype`` (bfloat16/float16) as the half step
        rounds P and dS (vectors and the scalar tail)."""
        if x.dtype != torch.float32 or dtype not in _HALF:
            raise ValueError(f"rounds float32 to bfloat16 or float16, not {x.dtype} to {dtype}")
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=dtype)
        self.fn("fl_round", _suffix(dtype))(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def tanh(self, x: torch.Tensor) -> torch.Tensor:
        """``tanh`` of a float32/float64 ``x`` as the step's softcap computes it (tests)."""
        return self._elementwise("fl_tanh", "tanh", x)

    def exp2(self, x: torch.Tensor) -> torch.Tensor:
        """``2^x`` of a float32/float64 ``x`` as the step's softmax computes it (tests)."""
        return self._elementwise("fl_exp2", "2^x", x)

    def isa_macros(self) -> set[str]:
        """The instruction-set macros (``__AVX2__``, ``__AVX512F__``, ...) of the target the
        step was compiled for: the branches of ``_native.c`` it runs."""
        return (_isa_macros(self.cc, self.target) if self.cc else None) or set()

    def _elementwise(self, fn: str, what: str, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{what} of float32 or float64 values, not {x.dtype}")
        x = x.contiguous()
        out = torch.empty_like(x)
        self.fn(fn, _suffix(x.dtype))(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def use_own_gemm(self, on: bool) -> bool:
        """Run both dtypes' matmuls on the step's own kernel (``on``, where it was built:
        AVX-512, or AVX2 with FMA) or on PyTorch's BLAS gemm. Returns whether the own kernel
        runs."""
        for dt in (torch.float32, torch.float64):
            self.set_gemm(dt, "own" if on and "own" in self.gemm_names() else "blas")
        return self.own_gemm

    @property
    def own_gemm(self) -> bool:
        """True when both dtypes (float32, float64) run on the own kernel."""
        return all(self._gemm[s] == "own" for s in ("f32", "f64"))

    def choose(self, *dtypes: torch.dtype) -> None:
        """Make (or read back) the calibration's choices for ``dtypes`` (default: every dtype
        of ``_calibrate.DTYPES``; float32's too for a half dtype) and put them in force. A
        dtype is chosen once per process, when first used: a dtype already chosen keeps what
        is in force (a ``set_gemm`` after its choice)."""
        every = _calibrate.DTYPES
        want = [dt for dt in (dtypes or every) if dt in every and dt not in self.choices]
        if not want or _calibrate.calibrating():
            return
        for dt, c in _calibrate.choose(self, self._choices_file, want).items():
            if dt not in self.choices:
                self._set_gemm(dt, c.gemm, c.forward_gemm or None, c.scores_gemm or None)
                self.choices[dt] = c

    def tiles(self, dtype: torch.dtype, *, forward: bool = False) -> tuple[int, int]:
        """The default ``(block_q, block_k)`` for ``dtype``: the calibration's (a half dtype
        converted to float32 takes float32's); ``forward``: those of a forward pass (its own
        where the calibration measured them)."""
        self.choose(dtype)  # a half dtype's choice makes float32's too
        if dtype in _HALF and not self.half_step(dtype):
            dtype = torch.float32
        c = self.choices.get(dtype)
        if c is None:
            return _calibrate.FALLBACK_TILES
        return c.forward_tiles if forward else (c.block_q, c.block_k)

    def fn(self, name: str, suffix: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return getattr(self._lib, f"{name}_{suffix}")

    def matmul(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        *,
        alpha: float = 1.0,
        beta: float = 0.0,
    ) -> None:
        """``c = alpha · a @ b + beta · c`` on the step's matmul (see ``use_own_gemm``), in
        this thread. ``a`` ``(m, k)`` row- or column-major; ``b`` ``(k, n)`` and ``c`` ``(m, n)``
        with unit column stride (rows may be padded); one float dtype, or ``a``, ``b``
        bfloat16/float16 and ``c`` float32 (MKL's half gemm); ``beta`` 0 or 1."""
        (m, k), n = a.shape, b.shape[1]
        if b.shape[0] != k or c.shape != (m, n):
            raise ValueError(
                f"shapes do not chain: a {tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}"
            )
        if beta not in (0.0, 1.0):
            raise ValueError(f"beta must be 0 or 1, got {beta}")
        half = a.dtype in _HALF and c.dtype == torch.float32
        if not (a.dtype == b.dtype and (half or a.dtype == c.dtype)) or a.dtype not in _SUFFIX:
            raise ValueError(
                "a, b and c must share one dtype, float32 or float64 (or a, b bfloat16 or "
                f"float16 with c float32), got {a.dtype}, {b.dtype}, {c.dtype}"
            )
        if half and _suffix(a.dtype) not in self._gemms["blas"]:
            raise ValueError(f"PyTorch's library has no {_HALF_GEMMS[_suffix(a.dtype)]} here")
        # strides as the kernel reads them (a dimension of size 1 may report any stride)
        ldb = b.stride(0) if k > 1 else n
        ldc = c.stride(0) if m > 1 else n
        if (n > 1 and (b.stride(1) != 1 or c.stride(1) != 1)) or ldb < n or ldc < n:
            raise ValueError("b and c need unit column strides (rows may be padded)")
        if (k == 1 or a.stride(1) == 1) and (m == 1 or a.stride(0) >= k):
            sbk, sbn = 1, a.stride(0) if m > 1 else k  # row-major a
        elif (m == 1 or a.stride(0) == 1) and (k == 1 or a.stride(1) >= m):
            sbk, sbn = a.stride(1) if k > 1 else m, 1  # column-major a
        else:
            raise ValueError("a must be row- or column-major")
        # row-major c = a b is column-major cᵀ = bᵀ aᵀ: the kernel's A is b, its B is a
        fn = self.fn("fl_matmul", _suffix(a.dtype))
        args = (b.data_ptr(), ldb, a.data_ptr(), sbk, sbn, beta, c.data_ptr(), ldc)
        fn(n, m, k, alpha, *args)

    def matmul_rate(self, dtype: torch.dtype, *, n: int = 512, seconds: float = 0.5) -> float:
        """GFLOP/s of the step's matmul on all threads: each runs ``n x n x n`` products on
        buffers of its own (a tile step's size), as the tile steps run theirs; the best of
        five timings of at least ``seconds`` / 5 each. A half ``dtype`` measures MKL's half
        gemm (operands in ``dtype``, float32 results)."""
        threads = self.max_threads()
        gen = torch.Generator().manual_seed(0)
        sz = n * self.padded(dtype, n)  # rows padded as the step pads its tiles
        ab = torch.randn(threads * 2 * sz, generator=gen, dtype=torch.float64).to(dtype)
        c = torch.zeros(threads * sz, dtype=torch.float32 if dtype in _HALF else dtype)
        fn = self.fn("fl_matmul_rate", _suffix(dtype))
        fn(ab.data_ptr(), c.data_ptr(), n, 1)  # warm up (pages, caches)
        flop, reps, best = 2.0 * n**3 * threads, 1, 0.0
        for _ in range(5):
            while True:
                t0 = time.perf_counter()
                fn(ab.data_ptr(), c.data_ptr(), n, reps)
                dt = time.perf_counter() - t0
                if dt >= seconds / 5:
                    break
                reps *= 2
            best = max(best, flop * reps / dt / 1e9)
        return best

    def padded(self, dtype: torch.dtype, x: int) -> int:
        """The row stride the step gives ``x`` elements of ``dtype`` (whole vectors plus
        one: no power-of-two stride, whose rows would share a few cache sets)."""
        key = (dtype, x)
        if key not in self._padded:
            self._padded[key] = int(self.fn("fl_padded", _suffix(dtype))(x))
        return self._padded[key]

    def transposed(self, x: torch.Tensor, buf: torch.Tensor, tile: int = 0) -> torch.Tensor:
        """``x.mT`` of a contiguous ``(n, rows, cols)`` (any float dtype the step runs), on the
        step's threads, in the flat scratch ``buf`` (``transposed_numel`` elements at least;
        ``x`` in bfloat16/float16 and ``buf`` float32: widened as laid out, exactly).
        ``tile`` 0: laid out with row stride ``padded(rows)``, returns ``(n, cols, rows)``;
        else each ``tile`` rows apart, row stride ``padded(tile)``: returns ``(n, tiles, cols,
        tile)`` (views; the last tile's columns past ``rows`` are not written)."""
        n, rows, cols = x.shape
        wide = x.dtype in _HALF and buf.dtype == torch.float32
        if buf.dtype != x.dtype and not wide:
            raise ValueError(f"{x.dtype} is laid out in {x.dtype} (or widened to float32)")
        tile, tiles, ld = self._tiling(x, tile, buf.dtype)
        out = buf[: n * tiles * cols * ld].view(n, tiles, cols, ld)
        ptrs = (x.data_ptr(), out.data_ptr(), n, rows, cols, ld, tile)
        if wide:
            self.fn("fl_transpose_wide", "f32")(*ptrs, _HALF[x.dtype])
        else:
            self.fn("fl_transpose", _suffix(x.dtype))(*ptrs)
        return out[..., :tile] if tile else out[:, 0, :, :rows]

    def transposed_numel(
        self, x: torch.Tensor, tile: int = 0, dtype: torch.dtype | None = None
    ) -> int:
        """Elements of the buffer ``transposed(x, buf, tile)`` lays out (``buf`` in
        ``dtype``, default ``x``'s)."""
        n, _, cols = x.shape
        _, tiles, ld = self._tiling(x, tile, dtype or x.dtype)
        return n * tiles * cols * ld

    def _tiling(self, x: torch.Tensor, tile: int, dtype: torch.dtype) -> tuple[int, int, int]:
        """``(tile, tiles, row stride)`` of ``x`` ``(n, rows, cols)`` transposed per ``tile``
        rows into ``dtype``: tile 0 (one tile of all the rows) where ``tile`` does not split
        them."""
        rows = x.shape[1]
        tile = tile if 0 < tile < rows else 0
        return tile, -(-rows // tile) if tile else 1, self.padded(dtype, tile or rows)

    def transposed_k(
        self, k: torch.Tensor, tile: int = 0, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Kᵀ as a forward reads it (S = Q Kᵀ), in the buffer the last forward gave back (``k``
        ``(Hk, Lk, d)``, contiguous): ``(Hk, d, Lk)`` with rows ``padded(Lk)`` apart, or per
        ``tile`` keys (``Schedule.key_tile``) ``(Hk, tiles, d, tile)``, views; in ``dtype``
        (default ``k``'s; float32 for a half ``k`` widened as read)."""
        dt = dtype or k.dtype
        buf = _pool.take("kv_t", self.transposed_numel(k, tile, dt), dt)
        return self.transposed(k, buf, tile)

    def give_back_kt(self, kt: torch.Tensor) -> None:
        """Hand the buffer of a ``transposed_k`` back for the next forward (a backward lets
        it go: its items lay out their own key tiles)."""
        _pool.give("kv_t", kt if kt._base is None else kt._base)

    def max_threads(self) -> int:
        """OpenMP threads a parallel region started from this thread uses: PyTorch's
        (``torch.get_num_threads()``), set on the calling thread when it differs."""
        n = torch.get_num_threads()
        if int(self._lib.fl_max_threads_f32()) != n:
            self._lib.fl_set_threads_f32(n)
        return n

    def _run_backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sched: Schedule,
        *,
        group: int,
        scale: float,
        heads_per_batch: int,
        intervals: tuple[torch.Tensor, torch.Tensor] | None,
        alibi: Alibi | None,
        softcap: float | None,
        work_per_thread: int,
        sizes: dict[str, int],
        halves: tuple[torch.Tensor, torch.Tensor] | None = None,
        widen: bool = False,
        **tensors: torch.Tensor,
    ) -> list[int]:
        """Run the backward in one native call (each work item lays out the Kᵀ_j and Vᵀ_j
        of its key tiles itself); returns ``seen``. ``halves``: dK and dV in a half dtype,
        written instead of ``dk``, ``dvo``. ``widen``: half q, k, v, dout on the float32
        step, widened as read."""
        acc = torch.float32 if q.dtype in _HALF else q.dtype  # sums and results
        lay = acc if widen else q.dtype  # the build the pass runs on
        # the Kᵀ a forward left in the pool for the next forward: no backward reads it, and
        # kept it would sit beside this pass's buffers (a single forward's is let go so)
        _pool.discard("kv_t", lay)
        assert all(t.is_contiguous() for t in (q, k, v, *tensors.values()))
        assert tensors["dout"].dtype == q.dtype == k.dtype == v.dtype
        assert all(t.dtype == acc for n, t in tensors.items() if n != "dout")
        assert halves is None or acc == torch.float32
        work = _pool.take("work", self.max_threads() * work_per_thread, acc)
        args, buffers = _static_args(
            q,
            k,
            v,
            sched,
            group,
            scale,
            heads_per_batch,
            intervals,
            work_per_thread,
            sizes,
            alibi=alibi,
            softcap=softcap,
            dtype=lay,
        )
        args.q, args.k, args.v, args.work = (t.data_ptr() for t in (q, k, v, work))
        for n, t in tensors.items():
            setattr(args, n, t.data_ptr())
        if halves is not None:
            dk16, dv16 = halves  # (dk and dvo stay unset: the pass writes these only)
            args.dk16, args.dv16, args.half = dk16.data_ptr(), dv16.data_ptr(), _HALF[dk16.dtype]
        if widen:  # the rows read in their dtype only
            args.q16, args.k16, args.v16, args.dout16 = args.q, args.k, args.v, args.dout
            args.q = args.k = args.v = args.dout = None
            args.half = _HALF[q.dtype]
        if sched.terms and lay in _HALF:
            raise ValueError("a tile's term is read by a float32/float64 pass")
        self.fn("fl_backward", _suffix(lay))(ctypes.byref(args))
        del sched._alive[:]
        _pool.give("work", work)
        sched.seen = buffers[3].tolist()
        del buffers  # alive until the call returned
        return sched.seen

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sched: Schedule,
        *,
        group: int,
        scale: float,
        heads_per_batch: int,
        intervals: tuple[torch.Tensor, torch.Tensor] | None = None,
        chunk: int,
        splits: int = 1,
        stacked: bool = False,
        keys_in_place: bool = False,
        merge: bool = False,
        q16: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        o_finite: list[bool] | None = None,
        row_max: list[torch.Tensor] | None = None,
        alibi: Alibi | None = None,
        softcap: float | None = None,
        kt: torch.Tensor | None = None,
        widen: bool = False,
        laid_out: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass of ``sched`` (rows: query tiles) in one native call.

        ``q`` ``(H, Lq, d)``, ``k`` ``(Hk, Lk, d)``, ``v`` ``(Hk, Lk, d_v)`` contiguous, one
        float dtype (bfloat16/float16: the half step, see ``half_step``), ``H = Hk·group =
        B·heads_per_batch``; work items of ``chunk`` rows;
        each row's tiles in ``splits`` parts attended apart; ``stacked``: one query tile
        covering Lq, a group's heads as one block of rows; ``keys_in_place`` (decode): K
        read as it is laid out, no Kᵀ, and ``k``, ``v`` may then be bfloat16 or float16
        with ``q`` in float32 (widened in registers as they are read). ``intervals``: an interval
        mask's ``(lo, hi)``, int64 ``(B|1, Lq)``, row ``i`` seeing local keys ``lo[i] <= j <
        hi[i]`` (read for partial tiles given no bytes). Returns each part's ``o`` ``(S, H,
        Lq, d_v)`` and ``lse`` ``(S, H, Lq)`` (natural units, -inf where a part saw no key),
        float32 for half inputs; with ``merge``, the parts merged by ``merge_splits``'s
        rule, in the pass, from each part's running max and row sum rather than its rounded
        LSE (a part's LSE carries a rounding of a few units in the last place of ``|λ|``,
        which would weigh its keys apart from the other parts' ones): ``o`` ``(H, Lq,
        d_v)``, ``lse`` ``(H, Lq)``; ``q16``, ``out_dtype``, ``o_finite`` and
        ``row_max`` as ``ForwardPass.run``'s. ``ForwardPass`` holds the same call for
        repeating it. A tile of ``sched`` may carry an additive term of its scores
        (``Schedule.add``; float32/float64, not stacked, keys not in place); ``alibi``
        (``Alibi``; float32/float64) adds ALiBi's to every tile's; ``softcap`` (c > 0,
        float32/float64) caps the scores, ``c · tanh(s / c)``, before any term. ``kt``:
        Kᵀ as ``transposed_k`` gives it, made once for a forward run in several calls
        (float32/float64, keys not in place; else laid out here). ``widen``: q, k, v in one
        half dtype run on the float32 step, widened as the pass reads them (Q's rows per
        work item, V's per tile, Kᵀ laid out widened; ``kt`` then float32): the float32
        step's results on the inputs converted, with no float32 copy of any of them.
        ``laid_out``: a list the pass appends the bytes of the K/V layout it writes to (Kᵀ,
        or AMX's pairs); nothing when it reads K and V as they are or is given ``kt``.
        """
        fp = ForwardPass(
            self,
            q,
            k,
            v,
            sched,
            group=group,
            scale=scale,
            heads_per_batch=heads_per_batch,
            intervals=intervals,
            chunk=chunk,
            splits=splits,
            stacked=stacked,
            keys_in_place=keys_in_place,
            alibi=alibi,
            softcap=softcap,
            widen=widen,
        )
        o, lse = fp.run(
            q,
            k,
            v,
            merge=merge,
            q16=q16,
            out_dtype=out_dtype,
            o_finite=o_finite,
            row_max=row_max,
            kt=kt,
            laid_out=laid_out,
        )
        del sched._alive[:]  # the partial tiles' bytes, read by the call
        return o, lse

    def all_finite(self, x: torch.Tensor) -> bool:
        """True when no value of the contiguous float32/float64 ``x`` is NaN or infinite
        (one pass in this thread, no tensor operation)."""
        if x.dtype not in (torch.float32, torch.float64) or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous float32 or float64 tensor, got {x.dtype}")
        return bool(self.fn("fl_all_finite", _suffix(x.dtype))(x.data_ptr(), x.numel()))

    def row_dots(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``D = rowsum(x ⊙ y)`` of two contiguous ``(..., n)`` tensors of one shape and
        dtype, float32 or float64 (summed in it), or bfloat16 or float16 (widened as read,
        summed in float32): ``(...)`` in the dtype of the sums, the rows in parallel on
        PyTorch's threads, one pass over both."""
        half = _HALF.get(x.dtype, 0)
        if y.dtype != x.dtype or not (half or x.dtype in (torch.float32, torch.float64)):
            raise ValueError(
                f"x and y must be one floating dtype alike (float32, float64, bfloat16, "
                f"float16), got {x.dtype}, {y.dtype}"
            )
        if x.shape != y.shape or x.dim() == 0 or not (x.is_contiguous() and y.is_contiguous()):
            raise ValueError(
                f"x and y must be contiguous tensors of one shape with a last dimension, got "
                f"{tuple(x.shape)} and {tuple(y.shape)}"
            )
        dt = torch.float32 if half else x.dtype
        out = torch.empty(x.shape[:-1], dtype=dt)
        self.max_threads()
        fn = self.fn("fl_row_dots", _suffix(dt))
        fn(x.data_ptr(), y.data_ptr(), out.data_ptr(), out.numel(), x.shape[-1], half)
        return out

    def merge_splits(self, o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key splits of ``forward`` merged, by ``online.merge_partials``'s rule, in one
        native call: ``o`` ``(S, H, Lq, d_v)`` and ``lse`` ``(S, H, Lq)`` (contiguous, as
        ``forward`` gives them; merged in place) -> ``(H, Lq, d_v)``, ``(H, Lq)``."""
        splits, heads, lq, dv = o.shape
        if lse.shape != (splits, heads, lq) or not (o.is_contiguous() and lse.is_contiguous()):
            raise ValueError(f"o {tuple(o.shape)} and lse {tuple(lse.shape)} are not one pass's")
        if o.dtype not in (torch.float32, torch.float64) or lse.dtype != o.dtype:
            raise ValueError(f"o and lse are float32 or float64, got {o.dtype}, {lse.dtype}")
        if splits > 64:
            raise ValueError(f"at most 64 parts, got {splits}")
        fn = self.fn("fl_merge_splits", _suffix(o.dtype))
        fn(o.data_ptr(), lse.data_ptr(), heads * lq, dv, splits)
        return o[0], lse[0]

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dout: torch.Tensor,
        lam: torch.Tensor,
        dd: torch.Tensor,
        sched: Schedule,
        *,
        group: int,
        scale: float,
        heads_per_batch: int,
        intervals: tuple[torch.Tensor, torch.Tensor] | None = None,
        splits: int = 1,
        alibi: Alibi | None = None,
        softcap: float | None = None,
        out_dtype: torch.dtype | None = None,
        widen: bool = False,
        dot_scores: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward pass of ``sched`` (rows: key tiles) in one native call: ``(dq,
        dk, dv)`` ``(H, Lq, d)``, ``(Hk, Lk, d)``, ``(Hk, Lk, d_v)``. ``dout`` ``(H, Lq,
        d_v)``; ``lam`` (the LSE, +inf on empty rows) and ``dd`` (D) ``(H, Lq)``; work
        items are (K/V head, one of ``splits`` parts of the key tiles). Half inputs (q, k,
        v, dout in bfloat16/float16: the half step) give float32 gradients. Tiles may carry
        an additive term of their scores and where dS goes (``Schedule.add``); ``alibi``
        adds ALiBi's to every tile's scores and ``softcap`` caps them (as ``forward``). Rows
        of dK and dV of key tiles the schedule leaves out are not written. Each work item
        lays out the Kᵀ_j and Vᵀ_j of its key tiles in its own scratch as it starts them (no
        Kᵀ, Vᵀ of the whole sequence). ``out_dtype`` (bfloat16 or float16, with float32
        sums: the half step in that dtype, or its inputs on the float32 step): dK and dV
        come in it, rounded by the pass as PyTorch's
        conversion rounds (no float32 dK, dV, no conversion after; dQ, summed over the key
        tiles, stays float32); a value past the dtype's range comes as inf, for the
        caller's check. ``widen``: half q, k, v, dout run on the float32 step, each row
        widened to float32 as the pass reads it (each key tile's K_j, Kᵀ_j and Vᵀ_j by
        the item that runs it, a block's Q and dO rows by the block): the float32 step's
        results on the inputs converted, with no float32 copy of any of them.

        The pass rebuilds ``P`` from the scores formed as the forward formed them, in its
        base-2 units, with the same factors and terms, so that over a row ``P`` is the
        forward's but for one factor (``λ``'s rounding, which ``D`` cancels);
        ``dot_scores`` (float32/float64 passes): the forward read K in place (``forward``'s
        ``keys_in_place``), and its dot products are summed in that pass's order."""
        self.choose(q.dtype)  # the back end this dtype's calibration chose, in force
        heads, lq, d = q.shape
        hk, lk, dv = v.shape
        acc = torch.float32 if q.dtype in _HALF else q.dtype
        if widen and not (q.dtype in _HALF and q.dtype == k.dtype == v.dtype == dout.dtype):
            raise ValueError(
                "widen reads q, k, v and dout of one half dtype (bfloat16 or float16), got "
                f"{q.dtype}, {k.dtype}, {v.dtype}, {dout.dtype}"
            )
        if out_dtype is not None and (out_dtype not in _HALF or acc != torch.float32):
            raise ValueError(
                f"dK and dV come in bfloat16 or float16 from a pass with float32 sums, not "
                f"{out_dtype} from a {q.dtype} pass"
            )
        if out_dtype is not None and q.dtype in _HALF and out_dtype != q.dtype:
            raise ValueError(f"the {q.dtype} half step writes dK and dV in {q.dtype}")
        dq = torch.zeros(splits, heads, lq, d, dtype=acc)  # (S, H, Lq, d)
        dk = torch.empty(hk, lk, d, dtype=out_dtype or acc)  # (Hk, Lk, d)
        dv_ = torch.empty(hk, lk, dv, dtype=out_dtype or acc)  # (Hk, Lk, d_v)
        halves = None if out_dtype is None else (dk, dv_)
        bq, bk = sched.widest()
        lay = acc if widen else q.dtype  # the operands as the pass reads them
        lb = self.padded(lay, max(bk, 1))
        work = (d + dv) * lb + (3 if softcap else 2) * bq * lb  # dK_jᵀ, dV_jᵀ; S, dP (, t)
        if lay in _HALF:
            work += 2 * _units(bq * lb, q.dtype, acc)  # P, dS in the input dtype
        else:  # Qᵀ and dOᵀ of a block of rows, for the own kernel
            work += _units((d + dv) * self.padded(lay, max(bq, 1)) + 16, lay, acc)
        work += _units((d + dv) * lb, lay, acc)  # at the end: the item's Kᵀ_j, Vᵀ_j
        if widen:  # before them: a block's Q and dO rows; after: K_j's rows, widened
            work += bq * (d + dv) + bk * d
        self._run_backward(
            q,
            k,
            v,
            sched,
            group=group,
            scale=scale,
            heads_per_batch=heads_per_batch,
            intervals=intervals,
            alibi=alibi,
            softcap=softcap,
            work_per_thread=work,
            sizes=dict(chunk=0, splits=splits, stacked=0, dot_scores=int(dot_scores)),
            dout=dout,
            lam=lam,
            dd=dd,
            halves=halves,
            widen=widen,
            dq=dq,
            **({} if halves else dict(dk=dk, dvo=dv_)),
        )
        return dq[0], dk, dv_

    def gather(
        self,
        src: torch.Tensor,
        shape: tuple[int, ...],
        base: int,
        terms: list[tuple[torch.Tensor, int]],
    ) -> torch.Tensor | None:
        """``src`` (float32 or float64, CPU) read at ``base + Σ_t wrap(i_t) · src.stride(d_t)``
        over ``terms`` ``(i_t (int64 or int32, broadcasting to shape), d_t)`` (at most
        ``GATHER_DIMS`` of them; ``shape`` at most 4 dims): a new contiguous tensor of
        ``shape``, ``src[..., i_t, ...]`` for one index tensor per dim; None when an index
        is out of range (wrapped once, as Python wraps negative indices)."""
        args = _gather_args(shape, base, [(i, src.shape[dim], src.stride(dim)) for i, dim in terms])
        out = torch.empty(shape, dtype=src.dtype)
        if self.fn("fl_gather", _suffix(src.dtype))(
            src.data_ptr(), out.data_ptr(), ctypes.byref(args)
        ):
            return None
        return out

    def scatter_add(
        self,
        dst: torch.Tensor,
        grad: torch.Tensor,
        base: int,
        terms: list[tuple[torch.Tensor, int]],
    ) -> bool:
        """``dst`` (contiguous) ``+= grad`` at the flat indices ``gather`` reads (``grad``
        of the gather's shape, contiguous, ``dst``'s dtype): the gradient of a gather from a
        tensor shaped as ``dst``. The sums run in a fixed order for a given thread count.
        False (``dst`` then unspecified) when an index is out of range."""
        args = _gather_args(
            tuple(grad.shape), base, [(i, dst.shape[dim], dst.stride(dim)) for i, dim in terms]
        )
        fn = self.fn("fl_scatter_add", _suffix(dst.dtype))
        return not fn(dst.data_ptr(), dst.numel(), grad.data_ptr(), ctypes.byref(args))

    def fma_runner(
        self, dtype: torch.dtype, *, seconds: float = 0.03
    ) -> tuple[Callable[[], None], float]:
        """The register FMA loop of ``fma_peak`` as a call of about ``seconds`` (its
        repetitions fixed here, from a first timing) and the FLOPs one call does: a
        benchmark times it round by round, beside what it measures."""
        suffix = _suffix(dtype)
        fn, per = self.fn("fl_fma_peak", suffix), self.fn("fl_fma_flops_per_rep", suffix)()
        reps = 16
        fn(reps)
        while True:
            t0 = time.perf_counter()
            fn(reps)
            if time.perf_counter() - t0 >= seconds or reps >= 1 << 24:
                break
            reps *= 2
        return (lambda: fn(reps)), per * reps * self.max_threads()

    def fma_peak(self, dtype: torch.dtype, *, seconds: float = 0.2) -> float:
        """GFLOP/s of fused multiply-adds on registers only, on every thread: the peak no
        kernel can beat (best of three timings of at least ``seconds`` / 3 each)."""
        suffix = _suffix(dtype)
        fn, per = self.fn("fl_fma_peak", suffix), self.fn("fl_fma_flops_per_rep", suffix)()
        threads, reps, best = self.max_threads(), 64, 0.0
        fn(reps)
        for _ in range(3):
            while True:
                t0 = time.perf_counter()
                fn(reps)
                dt = time.perf_counter() - t0
                if dt >= seconds / 3:
                    break
                reps *= 2
            best = max(best, per * reps * threads / dt / 1e9)
        return best


def _static_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sched: Schedule,
    group: int,
    scale: float,
    heads_per_batch: int,
    intervals: tuple[torch.Tensor, torch.Tensor] | None,
    work_per_thread: int,
    sizes: dict[str, int],
    half: int = 0,
    alibi: Alibi | None = None,
    softcap: float | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[_Args, list[Any]]:
    """A pass's ``_Args`` with every size set and the addresses of its schedule, interval
    mask and ALiBi rows (the operands' are the caller's to set), and the buffers those point
    into, alive as long as the arguments are used: ``[tiles, row_start, bounds, seen, iv_lo,
    iv_hi, slopes, centers]``. ``dtype``: the build the pass runs on (default ``q``'s;
    float32 for half operands widened as read)."""
    dt = dtype or q.dtype
    iv_lo = iv_hi = None
    if intervals is not None:
        iv_lo, iv_hi = (t.to(torch.int64).contiguous() for t in intervals)  # (B|1, Lq)
    if (alibi is not None or softcap is not None) and dt not in (torch.float32, torch.float64):
        raise ValueError(f"ALiBi and a softcap are applied by float32/float64 passes, not {dt}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"a softcap's c is positive, got {softcap!r}")
    slopes = centers = None
    if alibi is not None:
        slopes, centers = _alibi_rows(alibi, q.shape[:2], dt)
    arrays = sched._arrays()
    tiles, row_start, bounds, seen = (a.buffer_info()[0] for a in arrays)
    args = _Args(
        iv_lo=None if iv_lo is None else iv_lo.data_ptr(),
        iv_hi=None if iv_hi is None else iv_hi.data_ptr(),
        tiles=tiles,
        row_start=row_start,
        bounds=bounds,
        seen=seen,
        heads=q.shape[0],
        group=group,
        lq=q.shape[1],
        lk=k.shape[1],
        d=q.shape[2],
        dv=v.shape[2],
        work_stride=work_per_thread,
        hq=heads_per_batch,
        iv_bstride=0 if iv_lo is None or iv_lo.shape[0] == 1 else iv_lo.shape[1],
        rows=sched.rows,
        scale=scale,
        scale_exact=int(power_of_two(scale)),
        half=half,
        alibi=0 if alibi is None else alibi.form,
        softcap=0.0 if softcap is None else float(softcap),
        al_slope=None if slopes is None else slopes.data_ptr(),
        al_center=None if centers is None else centers.data_ptr(),
        **sizes,
    )
    return args, [*arrays, iv_lo, iv_hi, slopes, centers]


@dataclass(frozen=True)
class Alibi:
    """ALiBi's term as a pass computes it (``add_alibi`` in ``_native.c``): row ``i`` of
    ``(H, Lq)`` adds ``-slope[i] · |center[i] - j|`` (``form`` 1) or ``slope[i] · (j -
    center[i])`` (form 2, flash-attn 2's causal form) at local key ``j``; ``slope`` in the
    pass's float dtype, ``center`` int64 (both broadcastable to ``(H, Lq)``)."""

    slope: torch.Tensor
    center: torch.Tensor
    form: int


def _alibi_rows(
    alibi: Alibi, rows: torch.Size, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``alibi``'s slopes and centers as contiguous ``rows`` ``(H, Lq)`` of a ``dtype``
    pass."""
    if alibi.form not in (1, 2):
        raise ValueError(f"ALiBi's form is 1 or 2, got {alibi.form}")
    slope = alibi.slope.to(dtype).expand(rows).contiguous()
    center = alibi.center.to(torch.int64).expand(rows).contiguous()
    return slope, center


class ForwardPass:
    """One forward pass of ``Kernels.forward`` with everything but the operands fixed:
    sizes, schedule, work split and scratch size, set once from the shapes and dtypes of
    ``q``, ``k``, ``v`` (their values are not read). ``run(q, k, v)`` runs it on tensors
    of those sizes and dtypes (contiguous, laid out as the planned ones), as often as
    asked: a decode step repeats its shapes on every layer and token (``_lane``), and
    ``Kernels.forward`` builds one per call. Arguments as ``Kernels.forward``'s; the
    schedule's partial tiles' bytes must stay alive while the pass is run.
    ``keep_scratch``: keep a scratch buffer of at most ``SPARE_BYTES`` for the next run
    (else it goes back to the shared pool)."""

    def __init__(
        self,
        kern: Kernels,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sched: Schedule,
        *,
        group: int,
        scale: float,
        heads_per_batch: int,
        intervals: tuple[torch.Tensor, torch.Tensor] | None,
        chunk: int,
        splits: int,
        stacked: bool,
        keys_in_place: bool,
        keep_scratch: bool = False,
        alibi: Alibi | None = None,
        softcap: float | None = None,
        widen: bool = False,
    ) -> None:
        kern.choose(q.dtype, k.dtype)  # the back ends the calibration chose, in force
        self.kern, self.in_place, self.keep_scratch = kern, keys_in_place, keep_scratch
        if widen and (keys_in_place or q.dtype not in _HALF or not q.dtype == k.dtype == v.dtype):
            raise ValueError(
                "widen reads q, k and v of one half dtype (bfloat16 or float16) with Kᵀ laid "
                f"out, got {q.dtype}, {k.dtype}, {v.dtype}"
                + (" and keys in place" if keys_in_place else "")
            )
        # a float32 q reading a half K/V cache in place (widened as it is read), or half q, k,
        # v on the float32 step (``widen``: widened as read); the half step itself has q, k,
        # v all in the half dtype
        half = _HALF.get(k.dtype, 0) if (keys_in_place and q.dtype != k.dtype) or widen else 0
        assert k.dtype == v.dtype == (q.dtype if not half else k.dtype)
        self.wide = widen
        self.dtypes = (q.dtype, k.dtype, v.dtype)
        self.sizes = (q.numel(), k.numel(), v.numel())
        self.acc = torch.float32 if q.dtype in _HALF else q.dtype  # sums, state, results
        heads, lq, d = q.shape
        dv = v.shape[2]
        self.o_shape, self.lse_shape = (splits, heads, lq, dv), (splits, heads, lq)
        bk = sched.widest()[1]
        # the bfloat16 step's S and P V on AMX's tiles (the ``amx`` path), where they fit
        self.amx = (
            q.dtype == torch.bfloat16
            and not keys_in_place
            and not widen
            and kern.gemm(q.dtype) == "amx"
            and d % 32 == 0
            and dv % 16 == 0
        )
        if self.amx:  # whole 16-row blocks, up to 31 columns either side of a tile's, a stage
            c16, lb = -(-chunk // 16) * 16, kern.padded(q.dtype, bk + 64)
            work = 2 * chunk + c16 * dv + 32 + c16 * lb + c16 + 16
            work += _units(c16 * lb + 64, q.dtype, self.acc) + _units(16 * d, q.dtype, self.acc)
        else:
            lb = kern.padded(self.acc if widen else q.dtype, bk)  # S's (and P's) row stride
            work = chunk * (2 + dv) + chunk * lb + chunk  # m, ℓ, acc; S/P; α
            if q.dtype in _HALF and not widen:
                work += _units(chunk * lb, q.dtype, self.acc)  # P in the input dtype
            # the rows' score maxima from the own kernel's products, a vector a row, aligned
            lanes = kern.vector_bytes // self.acc.itemsize
            work += chunk * lanes + 64 // self.acc.itemsize
        if half:  # q's rows widened from the cache's dtype (``run_rows``), 64-byte aligned
            work += chunk * d + 64 // self.acc.itemsize
        # a bfloat16 cache's scores on AMX (with q16): the rows as B operands, Sᵀ's stage
        self.amx_dot = keys_in_place and half == 1 and kern.amx_dot and d % 32 == 0
        if self.amx_dot:
            work += _units(-(-chunk // 16) * 16 * d, torch.bfloat16, self.acc) + 512 + 16
        if widen:  # a tile's V rows widened, 64-byte aligned
            work += bk * dv + 64 // self.acc.itemsize
        self.work = work
        self.half = half
        # both passes read Kᵀ (for S = Q Kᵀ), per tile of keys where the schedule's tiles
        # allow; a forward with keys in place (decode) reads K as it is, in its own dtype;
        # the Kᵀ buffer goes back to the pool for the next pass
        self.kt_tile = 0 if keys_in_place or self.amx else sched.key_tile(k.shape[1])
        sizes = dict(chunk=chunk, splits=splits, stacked=int(stacked))
        self._args, self._buffers = _static_args(
            q,
            k,
            v,
            sched,
            group,
            scale,
            heads_per_batch,
            intervals,
            work,
            sizes,
            half,
            alibi,
            softcap,
            dtype=self.acc if widen else None,
        )
        self._args.amx = int(self.amx)
        self._args.amx_dot = int(self.amx_dot)
        self._n_tiles = len(self._buffers[3])
        self._sched = sched  # its partial tiles' bytes
        self._fn = kern.fn("fl_forward", _suffix(self.acc if widen else q.dtype))
        # a pass run again and again (``_lane``'s plans) keeps one small scratch buffer of
        # its own: taken and put back by one list operation each (atomic under the GIL)
        self._spare: list[torch.Tensor] = []

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        merge: bool = False,
        rows: tuple[int, ...] | None = None,
        q16: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        o_finite: list[bool] | None = None,
        row_max: list[torch.Tensor] | None = None,
        kt: torch.Tensor | None = None,
        laid_out: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each part's ``(o (S, H, Lq, d_v), lse (S, H, Lq))``, as ``Kernels.forward``; with
        ``merge``, the parts merged as ``Kernels.forward`` merges them: ``(o (H, Lq,
        d_v), lse (H, Lq))``, or with ``rows`` (a shape of ``H·Lq`` rows, e.g. the caller's
        ``(B, Hq, Lq)``) ``o`` ``(*rows, d_v)`` and ``lse`` ``rows``, the same memory.
        ``q16``: with a bfloat16 cache read in place, q's rows in bfloat16, contiguous,
        exactly ``q``'s values (the call's q was bfloat16): the dot products then run on
        AVX512-BF16's pair instruction where the step was built for it. ``out_dtype``: the
        half step's own dtype, for a merged pass of one part: O comes in it, rounded by the
        pass as PyTorch's conversion rounds (no float32 O, no conversion after). ``o_finite``:
        a list the pass appends True to when it saw every value of O and the LSE finite as
        it wrote them (one part only; else nothing is appended). ``row_max``: a list the pass
        appends each row's largest score to (the running max ``m`` it ended with, natural
        units, -inf for a row that saw no key; shaped as the returned ``lse``: the parts'
        largest when merged). ``kt``: Kᵀ laid out before and ``laid_out`` as
        ``Kernels.forward``'s."""
        self._check(q, k, v, rows)
        if kt is not None and (self.in_place or self.amx):
            raise ValueError("kt is Kᵀ from transposed_k, for a pass that lays it out")
        if kt is not None and kt.dtype != (self.acc if self.wide else q.dtype):
            raise ValueError(f"kt in {kt.dtype} for a pass reading Kᵀ in {self.acc}")
        kt_tile = self.kt_tile if kt is None else _layout_tile(kt, k, self._sched)
        if q16 is not None and self.half == 1:
            self._check_q16(q16, torch.bfloat16)
        splits, dv = self.o_shape[0], self.o_shape[3]
        at = (splits, *rows) if merge and rows is not None else self.lse_shape
        lse = torch.empty(at, dtype=self.acc)  # (S, H, Lq)
        bad = ctypes.c_longlong(0) if splits == 1 else None
        o16 = o = None
        if out_dtype is not None and out_dtype != self.acc:
            if not (merge and splits == 1 and out_dtype == q.dtype and q.dtype in _HALF):
                raise ValueError(
                    f"O comes in {out_dtype} from a merged pass of one part of the half step "
                    f"in that dtype only (this pass: {q.dtype}, {splits} part(s))"
                )
            o16 = torch.empty((*at[1:], dv), dtype=out_dtype)  # (H, Lq, d_v)
        else:
            o = torch.empty((*at, dv), dtype=self.acc)  # (S, H, Lq, d_v)
        q16 = q16 if self.half == 1 else None
        mx = None if row_max is None else torch.empty(at, dtype=self.acc)  # (S, H, Lq)
        narrow = q.dtype in _HALF and not self.wide  # the half step's
        if self._sched.terms and (self.amx or self.in_place or narrow):
            raise ValueError("a tile's term is read by a float32/float64 pass with Kᵀ laid out")
        self._launch(
            q,
            k,
            v,
            o,
            lse,
            q16=q16,
            o16=o16,
            bad=bad,
            mx=mx,
            kt=kt,
            kt_tile=kt_tile,
            merge=merge,
            laid_out=laid_out,
        )  # with ``merge``, the parts merged into part 0 in the same call (``forward``'s)
        if o_finite is not None and bad is not None and not bad.value:
            o_finite.append(True)
        if row_max is not None and mx is not None:
            row_max.append(mx.amax(dim=0) if merge else mx)
        if o16 is not None:
            return o16, lse[0]
        assert o is not None
        if not merge:
            return o, lse
        return o[0], lse[0]

    def run_rows(
        self,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: tuple[int, ...],
        *,
        q16: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The merged pass in the caller's layout, checked: ``o`` ``(*rows, d_v)`` and
        ``lse`` ``rows`` as ``run(..., merge=True, rows=rows)`` gives them, or None when a
        value of either is not finite. ``q`` None: a call whose q, K and V all come in the
        half dtype of a cache read in place, q's rows in ``q16`` only; the pass widens them
        itself and ``o`` comes in that dtype (rounded as PyTorch's conversion rounds).
        The pass checks the values (with one part as it writes them) and rounds them: a
        decode step's call costs no tensor operation besides its results (``_lane``)."""
        splits, dv = self.o_shape[0], self.o_shape[3]
        if q is None:
            if not self.half:
                raise ValueError("q may be left out only of a pass reading a half cache in place")
            if q16 is None:
                raise ValueError("q16 must hold q's rows when q is left out")
        self._check(q, k, v, rows)
        half_dtype = (torch.bfloat16, torch.float16)[self.half - 1] if self.half else None
        if q16 is not None:
            if half_dtype is None:
                raise ValueError("q16 is read by a pass reading a half cache in place only")
            self._check_q16(q16, half_dtype)
        # with parts, merged into part 0, checked (a part may see no key) and rounded in the
        # pass; q left out: O in the half dtype (a float O only for the parts to merge)
        parts = (splits,) if splits > 1 else ()  # one part: the results as they are
        o16 = None if q is not None else torch.empty((*rows, dv), dtype=half_dtype)
        o = torch.empty((*parts, *rows, dv), dtype=self.acc) if o16 is None or parts else None
        lse = torch.empty((*parts, *rows), dtype=self.acc)
        bad = ctypes.c_longlong(0)
        self._launch(q, k, v, o, lse, q16=q16, o16=o16, bad=bad, merge=splits > 1)
        if bad.value:
            return None
        lse = lse[0] if parts else lse
        if o16 is not None:
            return o16, lse
        assert o is not None
        return (o[0] if parts else o), lse

    def _check(
        self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, rows: tuple[int, ...] | None
    ) -> None:
        q_dtype, q_numel = (self.dtypes[0], self.sizes[0]) if q is None else (q.dtype, q.numel())
        if (q_dtype, k.dtype, v.dtype) != self.dtypes or (
            q_numel,
            k.numel(),
            v.numel(),
        ) != self.sizes:
            raise ValueError(
                f"this pass was planned for q, k, v of {self.sizes} elements of {self.dtypes}, "
                f"got {(q_numel, k.numel(), v.numel())} of {(q_dtype, k.dtype, v.dtype)}"
            )
        if not ((q is None or q.is_contiguous()) and k.is_contiguous() and v.is_contiguous()):
            raise ValueError("q, k and v must be contiguous")
        heads, lq = self.o_shape[1:3]
        if rows is not None and math.prod(rows) != heads * lq:
            raise ValueError(f"rows {rows} do not hold the pass's {heads * lq} rows")

    def _check_q16(self, q16: torch.Tensor, dtype: torch.dtype) -> None:
        if q16.dtype != dtype or q16.numel() != self.sizes[0]:
            raise ValueError(f"q16 must hold q's {self.sizes[0]} values in {dtype}")
        if not q16.is_contiguous():
            raise ValueError("q16 must be contiguous")

    def _launch(
        self,
        q: torch.Tensor | None,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor | None,
        lse: torch.Tensor,
        *,
        q16: torch.Tensor | None = None,
        o16: torch.Tensor | None = None,
        bad: ctypes.c_longlong | None = None,
        mx: torch.Tensor | None = None,
        kt: torch.Tensor | None = None,
        kt_tile: int = 0,
        merge: bool = False,
        laid_out: list[int] | None = None,
    ) -> None:
        """The C call on checked operands and results (``q`` None: its rows from ``q16``;
        ``mx``: where each row's final running max goes, shaped as ``lse``; ``kt``: Kᵀ laid
        out before, per ``kt_tile`` keys or (0) whole; ``merge``: the parts merged into part
        0 after the work items, as ``Kernels.forward`` merges them, and with ``bad`` the
        merged values checked; ``laid_out``: the bytes of a K/V layout written here are
        appended to it)."""
        args = _Args.from_buffer_copy(self._args)
        seen = array.array("q", bytes(8 * self._n_tiles))
        args.seen = seen.buffer_info()[0]
        kt_buf = None
        if self.in_place:
            args.k16, args.v16 = (k.data_ptr(), v.data_ptr()) if args.half else (None, None)
            args.q16 = None if q16 is None else q16.data_ptr()
        elif self.amx:  # K and V in AMX's pair layout, keys padded to a multiple of 32
            hk, lk, d = k.shape
            l32, dv = -(-lk // 32) * 32, v.shape[2]
            kt_buf = _pool.take("kv_t", hk * l32 * (d + dv), k.dtype)
            args.kp, args.vp = kt_buf.data_ptr(), kt_buf[hk * l32 * d :].data_ptr()
            self.kern.fn("fl_pack_amx", "bf16")(
                k.data_ptr(), v.data_ptr(), args.kp, args.vp, hk, lk, d, dv
            )
            if laid_out is not None:
                laid_out.append((k.numel() + v.numel()) * k.element_size())
        elif kt is not None:
            args.kt, args.kt_tile = kt.data_ptr(), kt_tile
        else:  # Kᵀ, per tile of keys or whole (widened to float32 with ``widen``)
            kt_buf = self.kern.transposed_k(k, self.kt_tile, self.acc if self.wide else None)
            args.kt, args.kt_tile = kt_buf.data_ptr(), self.kt_tile
            if laid_out is not None:
                laid_out.append(k.numel() * kt_buf.element_size())  # padding aside
        need = self.kern.max_threads() * self.work
        try:
            work = self._spare.pop()
        except IndexError:
            work = None
        if work is None or work.numel() < need:
            work = _pool.take("work", need, self.acc)
        args.q = None if q is None else q.data_ptr()
        args.k, args.v = k.data_ptr(), v.data_ptr()
        if self.wide:  # the rows read in their half dtype only
            args.q16, args.k16, args.v16 = args.q, args.k, args.v
            args.q = args.k = args.v = None
        args.work, args.lse = work.data_ptr(), lse.data_ptr()
        args.o = None if o is None else o.data_ptr()
        args.o16 = None if o16 is None else o16.data_ptr()
        args.bad = None if bad is None else ctypes.addressof(bad)
        args.mx = None if mx is None else mx.data_ptr()
        args.merge = int(merge)
        self._fn(ctypes.byref(args))
        if self.keep_scratch and work.numel() * work.element_size() <= SPARE_BYTES:
            if not self._spare:
                self._spare.append(work)
        else:
            _pool.give("work", work)
        if kt_buf is not None and not self.wide:
            # (a widening pass lets its float32 Kᵀ go: its backward lays out each key tile's
            # itself, and kept for the next forward it would sit beside the backward's buffers)
            self.kern.give_back_kt(kt_buf)
        if self._n_tiles:
            self._sched.seen = seen.tolist()


SCRATCH_KEEP_BYTES = 64 << 20  # the largest scratch buffer kept between passes
SPARE_BYTES = 1 << 20  # the largest one a repeated pass keeps for itself (``keep_scratch``)
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64); scratch this large is laid out on them


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat buffer of ``numel`` elements for the step's large scratch (Kᵀ,
    Vᵀ, the tile buffers), on transparent huge pages where the system gives them.

    A tile's QKᵀ reads Kᵀ's ``d`` rows ``padded(Lk)`` apart: at Lk = 4096 each of the 64
    rows lies on a page of its own, more pages per microkernel block than the first-level
    data TLB holds. On 2 MiB pages the rows of a tile share one or two. Measured (Intel Xeon
    family 6 model 167, float32, L 4096 and 8192, one process alternating the two layouts
    over 12 rounds, seven runs): the forward's time 0.91-0.985 of the small pages', forward
    + backward 0.93-0.995. Below ``HUGE_PAGE``, or where anonymous mappings or
    ``MADV_HUGEPAGE`` are missing (not Linux), a plain ``torch.empty``; where transparent
    huge pages are off the advice is ignored and the mapping has small pages. The buffer is
    its own base tensor (the mapping goes with it); only its whole 2 MiB spans are advised,
    so its resident size stays its own.
    """
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(numel, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(numel, dtype=dtype)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    off = -start % HUGE_PAGE  # the first 2 MiB boundary (a whole number of pages)
    with contextlib.suppress(OSError):  # no huge pages here: the buffer works on small ones
        region.madvise(advice, off, nbytes // HUGE_PAGE * HUGE_PAGE)
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=off)


class _ScratchPool:
    """Scratch buffers of finished passes, kept for the next pass of any thread.

    A pass takes its buffers out (``take``: the pool's one when large enough, else a
    fresh one) and gives back those worth keeping when it ends (``give``): fresh memory
    costs a page fault per 4 KiB when first written (1-2 % of a float32 forward at
    L = 4096). The pool keeps at most one buffer per (slot, dtype), the largest, and
    none above ``SCRATCH_KEEP_BYTES``, so however many threads ran passes at once, what
    stays between passes is bounded (a few buffers, not one set per thread);
    ``release_scratch()`` empties it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            buf = self.bufs.pop((slot, dtype), None)
        if buf is None or buf.numel() < numel:
            buf = None  # free the smaller one first
            buf = scratch(numel, dtype)
        return buf

    def give(self, slot: str, buf: torch.Tensor) -> None:
        if buf.numel() * buf.element_size() > SCRATCH_KEEP_BYTES:
            return
        key = (slot, buf.dtype)
        with self._lock:
            old = self.bufs.get(key)
            if old is None or old.numel() < buf.numel():
                self.bufs[key] = buf

    def discard(self, slot: str, dtype: torch.dtype) -> None:
        """Let go of the buffer kept for ``(slot, dtype)``, if any."""
        with self._lock:
            self.bufs.pop((slot, dtype), None)

    def release(self) -> int:
        """Drop every kept buffer; returns the bytes let go."""
        with self._lock:
            freed = sum(b.numel() * b.element_size() for b in self.bufs.values())
            self.bufs.clear()
        return freed


_pool = _ScratchPool()


def release_scratch() -> int:
    """Let go of the scratch the native step keeps between passes (e.g. when a server
    goes idle); returns the bytes released. The next pass allocates afresh."""
    return _pool.release()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch tile step in this thread (e.g. to compare it with the native one)."""
    before = getattr(_off, "depth", 0)
    _off.depth = before + 1
    try:
        yield
    finally:
        _off.depth = before


def kernels() -> Kernels | None:
    """The native step, built and loaded on first use (each dtype's matmul back end and
    tiles chosen when that dtype is first run: ``Kernels.choose``); None where it cannot
    run."""
    if getattr(_off, "depth", 0) or os.environ.get("FLASHLEDGER_NATIVE", "1") == "0":
        return None
    return _load()[0]


def loaded() -> Kernels | None:
    """The native step if it is already built and loaded and on in this thread, else None
    (never builds it: a caller that can do without it, such as a finiteness check, does not
    start the build and the calibration)."""
    done = _loaded
    if done is None:
        return None
    return kernels()  # loaded: no build (and None where the step is off)


def native_status() -> str:
    """One line: whether the native tile step is on (with the library's path), or why not.

    >>> import flashledger as fl
    >>> fl.native_status().startswith("native tile step: ")
    True
    """
    if os.environ.get("FLASHLEDGER_NATIVE", "1") == "0":
        return "native tile step: off (FLASHLEDGER_NATIVE=0)"
    kern, why = _load()
    if kern is None:
        return f"native tile step: off ({why}); the PyTorch step runs instead"
    kern.choose()
    head, path = why.rsplit(", ", 1)
    parts = []
    for dt in _calibrate.DTYPES:
        bq, bk = kern.tiles(dt)
        fq, fk = kern.tiles(dt, forward=True)
        how = _calibrate.gemm_name(kern.gemm(dt))
        fwd = _calibrate.forward_note(
            (bq, bk), (fq, fk), kern.gemm(dt), kern.gemm(dt, forward=True)
        )
        fwd += _calibrate.scores_note(kern.gemm(dt), kern.gemm(dt, scores=True))
        tiles = "" if kern.gemm(dt) == "float32" else f", tiles {bq}x{bk}{fwd}"
        c = kern.choices.get(dt)
        busy = f" ({note})" if c is not None and (note := c.busy_note()) else ""
        parts.append(f"{str(dt)[6:]}: {how}{tiles}{busy}")
    if kern.amx_dot:
        parts.append("a bfloat16 cache read in place: scores on AMX tiles")
    return f"native tile step: on ({head}; {'; '.join(parts)}; {path})"


def _load() -> tuple[Kernels | None, str]:
    global _loaded
    loaded = _loaded  # (set once, whole: read without the lock once it is)
    if loaded is not None:
        return loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = _build_and_load()
            except Exception as exc:  # a failed build must never break attention
                _loaded = (None, f"could not build it: {exc}")
        return _loaded


def _torch_lib() -> Path:
    return Path(torch.__file__).parent / "lib"


def _loaded_openmp() -> Path | None:
    """The GNU OpenMP runtime this process has mapped (PyTorch's), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if "libgomp" in Path(path).name:
            return Path(path)
    return None


def _build_and_load() -> tuple[Kernels | None, str]:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"built only on Linux x86-64, this is {sys.platform} {platform.machine()}"
    if not torch.backends.mkl.is_available():
        return None, "PyTorch was built without MKL"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None, "no C compiler (gcc) found"
    torch.zeros(64).add_(1)  # make sure PyTorch's OpenMP runtime is loaded
    gomp = _loaded_openmp()
    if gomp is None:
        return None, "PyTorch's OpenMP runtime (libgomp) is not loaded"
    blas = ctypes.CDLL(str(_torch_lib() / "libtorch_cpu.so"))
    try:
        gemms = {"blas": {"f32": _address(blas.sgemm_), "f64": _address(blas.dgemm_)}}
    except AttributeError:
        return None, "PyTorch's library does not export sgemm_/dgemm_"
    for suffix, symbol in _HALF_GEMMS.items():  # MKL's half gemms, where exported
        with contextlib.suppress(AttributeError):
            gemms["blas"][suffix] = _address(getattr(blas, symbol))
    openblas = _openblas()
    if openblas is not None:
        gemms["openblas"] = openblas
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags, arch = _target(cc)
    parts = [_SOURCE.read_text(), " ".join(flags), version, str(gomp), torch.__version__]
    parts += [_calibrate.cpu_model(), _cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = Path(
        os.environ.get("FLASHLEDGER_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashledger"
    )
    lib_path = cache / f"native-{key}.so"
    if not _intact(lib_path):  # missing, or not the file that was built (truncated, edited)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            _compile(cc, flags, gomp, lib_path)
        except OSError:  # an unwritable cache: build for this process only
            lib_path = Path(tempfile.mkdtemp(prefix="flashledger-")) / lib_path.name
            _compile(cc, flags, gomp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    kern = Kernels(lib, gemms, lib_path.with_suffix(".json"))
    kern.target, kern.cc = arch or "native", cc
    isa = {64: "AVX-512", 32: "AVX2" if kern.fused else "AVX"}.get(kern.vector_bytes, "SSE")
    if arch:
        isa += f" (FLASHLEDGER_NATIVE_ARCH={arch})"
    return kern, f"{isa}, {kern.max_threads()} threads, {lib_path}"


def _target(cc: str) -> tuple[list[str], str]:
    """The compiler flags, and the target ``FLASHLEDGER_NATIVE_ARCH`` named ("" for this
    CPU's own, ``-march=native``). A target the compiler does not know, or one with an
    instruction set this CPU lacks (its code would stop on an illegal instruction), is
    refused with a warning that says why, and the step is built for this CPU."""
    arch = os.environ.get("FLASHLEDGER_NATIVE_ARCH", "").strip()
    if arch in ("", "native"):
        return _FLAGS, ""
    if (have := _isa_macros(cc)) is None:
        return _FLAGS, ""  # the compiler does not run: the build says so
    why = ""
    if not all(c.isalnum() or c in "-_." for c in arch):
        why = "is not a -march value (letters, digits, '-', '_', '.')"
    elif (want := _isa_macros(cc, arch)) is None:
        why = f"is not a target {Path(cc).name} knows (-march={arch})"
    elif lack := [m.strip("_") for m in _ISA_MACROS if m in want - have]:
        why = f"uses {', '.join(lack)}, which this CPU does not have"
    if why:
        warnings.warn(
            f"FLASHLEDGER_NATIVE_ARCH={arch!r} {why}; the native step is built for this CPU "
            "(-march=native). Allowed: 'native', or a target within this CPU's instructions "
            "(e.g. x86-64-v3 for the AVX2 form)",
            stacklevel=2,
        )
        return _FLAGS, ""
    flags = [f for f in _FLAGS if f != "-march=native"]
    return [*flags, f"-march={arch}", "-mtune=native"], arch


def _isa_macros(cc: str, arch: str = "native") -> set[str] | None:
    """The instruction-set macros ``cc -march=<arch>`` predefines (``_ISA_MACROS``); None
    where the compiler refuses the target."""
    done = subprocess.run(
        [cc, f"-march={arch}", "-dM", "-E", "-x", "c", os.devnull],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        return None
    defined = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return defined & set(_ISA_MACROS)


def _address(fn: Any) -> int:
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    assert addr is not None
    return addr


def _openblas() -> dict[str, int] | None:
    """OpenBLAS's ``sgemm_``/``dgemm_`` from the ``scipy-openblas32`` package, run on one
    thread per call (the step's threads are the parallelism); None without the package."""
    try:
        import scipy_openblas32  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        path = Path(scipy_openblas32.get_lib_dir()) / scipy_openblas32.get_library(fullname=True)
        # OpenBLAS reads its thread count when it loads: with one it starts no pool of
        # threads (which would wait, spinning, beside the step's own)
        before = os.environ.get("OPENBLAS_NUM_THREADS")
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        try:
            lib = ctypes.CDLL(str(path))
        finally:
            if before is None:
                del os.environ["OPENBLAS_NUM_THREADS"]
            else:
                os.environ["OPENBLAS_NUM_THREADS"] = before
        lib.scipy_openblas_set_num_threads(1)
        return {"f32": _address(lib.scipy_sgemm_), "f64": _address(lib.scipy_dgemm_)}
    except (OSError, AttributeError):
        return None


def _suffix(dtype: torch.dtype) -> str:
    return _SUFFIX[dtype]


def _float_suffix(dtype: torch.dtype) -> str:
    """The float32/float64 build's suffix; a ValueError for another dtype (what only those
    builds have: the own kernel's row maxima, its score products beside a BLAS)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"only the float32 and float64 steps have this, not {dtype}")
    return _SUFFIX[dtype]


def _units(n: int, dtype: torch.dtype, acc: torch.dtype) -> int:
    """Scratch (in ``acc`` elements) for ``n`` elements of ``dtype`` carved 64-byte aligned."""
    return -(-n * dtype.itemsize // acc.itemsize) + 64 // acc.itemsize


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(lib: Path) -> bool:
    """The cached library exists and is byte for byte the one built: its SHA-256 equals
    the one written beside it (``.sha256``) when it was built."""
    try:
        return _digest(lib) == lib.with_suffix(".sha256").read_text().strip()
    except OSError:
        return False


def _compile(cc: str, flags: list[str], gomp: Path, out: Path) -> None:
    """Compile the float32, float64, bfloat16 and float16 objects (one source: -DFL_DOUBLE,
    -DFL_HALF), link them against the loaded libgomp, and write the library's SHA-256
    beside it (checked before every load: ``_intact``)."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, cmds = [], []
        for name, double, half in (("f32", 0, 0), ("f64", 1, 0), ("bf16", 0, 1), ("f16", 0, 2)):
            obj = Path(tmp) / f"{name}.o"
            defs = [f"-DFL_DOUBLE={double}", f"-DFL_HALF={half}"]
            cmds.append([cc, *flags, *defs, "-c", str(_SOURCE), "-o", str(obj)])
            objs.append(str(obj))
        _run_all(cmds)  # the four objects at once (a few seconds each)
        tmp_lib = Path(tmp) / out.name
        rpath = f"-Wl,-rpath,{gomp.parent}"
        _run([cc, "-shared", *objs, str(gomp), rpath, "-o", str(tmp_lib)])
        tmp_sum = Path(tmp) / "digest"
        tmp_sum.write_text(_digest(tmp_lib) + "\n")
        # atomic: concurrent builders never see half a file; the digest goes first, so a
        # reader that sees the new library also sees its digest (identical builds agree)
        os.replace(tmp_sum, out.with_suffix(".sha256"))
        os.replace(tmp_lib, out)


class _BuildError(RuntimeError):
    pass


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise _BuildError(f"{Path(cmd[0]).name} failed: {done.stderr.strip()[-300:]}")


def _run_all(cmds: list[list[str]]) -> None:
    """Run the commands side by side; the first failure's message is raised."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in cmds
    ]
    errors = [p.communicate()[1] for p in procs]  # each waits for its process
    for c, p, err in zip(cmds, procs, errors):
        if p.returncode:
            raise _BuildError(f"{Path(c[0]).name} failed: {err.strip()[-300:]}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
