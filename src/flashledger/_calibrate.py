"""The native step's choices, made by measurement on the machine it runs on.

Which matmul back end runs the step's tile products (its own AVX-512 or AVX2 kernel,
PyTorch's BLAS, OpenBLAS from the ``scipy-openblas32`` package where it is
installed) and which tiles the loop uses by default depend on the CPU: MKL
runs float32 GEMM through its AVX2 code on AMD EPYC and its AVX-512 code on
Intel Xeon, so what wins on one loses on the other. So, per dtype, a short
calibration (about a second per stage) runs real forward + backward passes with each
candidate, in interleaved rounds, and keeps the fastest (by each candidate's
fastest round: on a shared machine other work only ever adds time, and a median
lets a burst of it that falls on one candidate's rounds decide); then forward
passes alone choose the forward's back end and tiles (a forward, as inference
runs it, can prefer another kernel: its products are Q Kᵀ and P V only). Each
dtype is measured once on a machine, when a process first runs it (a process
that runs float32 alone measures float32 alone: about 2 s on a quiet 2-core AMD
EPYC, float64 about 4.5, each half dtype about half a second more), under a
file lock (concurrent processes wait for one measurement), and cached beside
the compiled library, keyed by CPU model, ISA flags, thread count and PyTorch
version (the library's own key) and by any setting that holds the BLAS libraries
to other code (``STEERING``: ``MKL_ENABLE_INSTRUCTIONS=AVX2`` measures another
MKL); afterwards the same machine always runs the same choice.
Each choice records how much of the CPU other processes took while it was
measured (``/proc/stat``): a choice made on a busy machine (a test run, a build
beside it) is measured again by the first process that finds the machine quiet
(about a quarter of a second to look), and a busy measurement never replaces a
quieter one.
``FLASHLEDGER_GEMM`` (``own``, ``blas``, ``openblas``) forces the back end.

bfloat16 and float16 inputs have two paths (``HALF_PATHS``): ``half`` keeps
them in their dtype and runs the products on MKL's half gemm (AMX or AVX512-BF16
where the CPU has them), ``float32`` runs the float32 step with float32's choice,
reading them in their dtype and widening each row as a pass needs it; bfloat16 has
a third where the CPU has AMX, ``amx``: ``half`` with the forward's products on the
step's own AMX tile code (K and V laid out once per pass, no gemm call per tile). Which one is faster depends on the CPU and its MKL
(a CPU without bfloat16 arithmetic emulates it), so it is measured the same
way, per half dtype, against float32's choice; where PyTorch's library has no
half gemm the float32 path runs unmeasured. ``FLASHLEDGER_HALF`` (``half``,
``float32``, and ``amx``, which float16 takes as ``half``) forces the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from ._native import Kernels

__all__ = [
    "BUSY",
    "DTYPES",
    "GEMMS",
    "HALF_PATHS",
    "TILE_CANDIDATES",
    "Choice",
    "OthersShare",
    "choose",
    "cpu_info",
    "cpu_model",
    "forward_note",
    "gemm_name",
    "others_share",
    "scores_note",
]

GEMMS = ("own", "blas", "openblas")
"""The matmul back ends: the step's own kernel, PyTorch's BLAS, OpenBLAS."""
HALF_PATHS = ("half", "amx", "float32")
"""How bfloat16/float16 inputs run: in their dtype on MKL's half gemm, bfloat16 also with
the forward's products on AMX's tiles, or as float32."""
TILE_CANDIDATES = ((512, 512), (256, 256), (256, 512))
"""Default tiles measured, the first also the one each back end is measured at."""
FORWARD_TILE_CANDIDATES = ((256, 256), (256, 512), (512, 512), (128, 512), (256, 1024))
"""The forward's own tiles, measured on the forward's back end by forward passes alone (a
forward without a backward, as inference runs it, may prefer other tiles: wider key tiles
spend less per tile on the running state)."""
FORWARD_GEMM_TILES = (256, 512)
"""The tiles every back end's forward is measured at, to choose the forward's back end."""
FALLBACK_TILES = (512, 512)
"""The default tiles where nothing was measured (the PyTorch step)."""

_ROUNDS = 3
BUSY = 0.1
"""Above this share of all CPUs' time taken by other processes while a choice was measured,
the machine was busy: the choice is measured again once it is quiet."""
_FORMAT = 5  # the cache's layout (2: the tile stage's rates apart, "tiles 512x512"; 3: the
# problem at L = 2048, H = threads; 4: settings in STEERING keyed apart, so a plain entry
# that one of them may have measured is measured again; 5: a backward's score products'
# back end measured, scores_gemm)
_LOOK_S = 0.25  # how long a cached busy choice looks at the machine before measuring again
STEERING = (
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "MKL_DEBUG_CPU_TYPE",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ATEN_CPU_CAPABILITY",
    "OPENBLAS_CORETYPE",
)
"""Environment variables that change which code the BLAS libraries (MKL, oneDNN, OpenBLAS) or
PyTorch's kernels run, and so the rates a calibration measures: a choice made with one of
them set is saved under a key that names it."""

# The measured problem: B = 1, H = threads, L x L, d = 64. As many flops as L = 1024 with
# 4 x threads heads, on rows four times as long: the per-tile and per-head costs (the running
# state, Kᵀ and Vᵀ laid out) weigh about as at L = 4096, so that the tiles' order matches
# theirs there (at L = 1024 a 512-wide tile is half a row and 256 x 256 read level with it).
_L, _D = 2048, 64


@dataclass(frozen=True)
class Choice:
    """What the native step runs for one dtype, and why."""

    gemm: str  # "own", "blas" or "openblas"; bfloat16/float16: "half" or "float32"
    block_q: int
    block_k: int
    how: str  # "calibrated", "cached", "FLASHLEDGER_GEMM=..." or "FLASHLEDGER_HALF=..."
    rates: dict[str, float] = field(default_factory=dict)
    """GFLOP/s of every candidate measured (forward + backward), e.g. ``"own 512x512"``; the
    forward's tile candidates alone as ``"forward 256x512"``."""
    forward_block_q: int = 0
    forward_block_k: int = 0
    """The default tiles of a forward pass (0: ``block_q``, ``block_k``, as before a
    forward's own were measured)."""
    busy: float = 0.0
    """The share of all CPUs' time other processes took while this was measured (0 where
    ``/proc/stat`` cannot be read); above ``BUSY`` the rates are those of a busy machine."""
    forward_gemm: str = ""
    """float32/float64: the back end of a forward pass, measured by forward passes alone
    (``""``: ``gemm``, as for the half paths and before it was measured)."""
    scores_gemm: str = ""
    """float32/float64 on a BLAS: ``"own"`` where a backward's score products (``S = Q
    K_jᵀ`` again, ``dP = dO V_jᵀ``) run on the own kernel, measured by forward + backward
    passes at the chosen tiles (``""``: on ``gemm``)."""

    @property
    def forward_tiles(self) -> tuple[int, int]:
        """``(block_q, block_k)`` of a forward pass."""
        if self.forward_block_q and self.forward_block_k:
            return self.forward_block_q, self.forward_block_k
        return self.block_q, self.block_k

    def describe(self) -> str:
        """E.g. ``"own matmul kernel, tiles 512x512 (calibrated)"``, or with a forward's
        own tiles and back end ``"..., tiles 256x256, forward 256x512 on own matmul kernel
        (calibrated)"``."""
        tiles = (self.block_q, self.block_k)
        more = forward_note(tiles, self.forward_tiles, self.gemm, self.forward_gemm or self.gemm)
        more += scores_note(self.gemm, self.scores_gemm or self.gemm)
        return f"{gemm_name(self.gemm)}, tiles {tiles[0]}x{tiles[1]}{more} ({self.how})"

    def busy_note(self) -> str:
        """``""`` on a quiet machine, else e.g. ``"measured while other processes took 48% of
        the CPU"``."""
        if self.busy <= BUSY:
            return ""
        return f"measured while other processes took {self.busy:.0%} of the CPU"


def forward_note(
    tiles: tuple[int, int], forward_tiles: tuple[int, int], gemm: str, forward_gemm: str
) -> str:
    """What a forward pass runs apart from the rest of the step: ``""`` where nothing, else
    e.g. ``", forward 256x1024 on own matmul kernel"``."""
    on = "" if forward_gemm == gemm else f" on {gemm_name(forward_gemm)}"
    if forward_tiles == tiles and not on:
        return ""
    return f", forward {forward_tiles[0]}x{forward_tiles[1]}{on}"


def scores_note(gemm: str, scores_gemm: str) -> str:
    """Where a backward's score products run apart from the rest of its matmuls: ``""``
    where they do not, else e.g. ``", backward's score products on own matmul kernel"``."""
    return "" if scores_gemm == gemm else f", backward's score products on {gemm_name(scores_gemm)}"


def gemm_name(gemm: str) -> str:
    """A back end (or half path) in words."""
    return {
        "own": "own matmul kernel",
        "blas": "PyTorch's BLAS",
        "openblas": "OpenBLAS",
        "half": "in its dtype on MKL's half gemm",
        "amx": "in its dtype, forward on AMX tiles, backward on MKL's half gemm",
        "float32": "on the float32 step, widened as read",
    }[gemm]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


_ISA = (  # flags worth naming: what the kernels and the BLAS can use
    ("avx2", "AVX2"),
    ("fma", "FMA"),
    ("avx512f", "AVX-512"),
    ("avx512_bf16", "AVX512-BF16"),
    ("avx512_fp16", "AVX512-FP16"),
    ("amx_bf16", "AMX-BF16"),
    ("amx_fp16", "AMX-FP16"),
)


def cpu_info() -> dict[str, str]:
    """The CPU as ``/proc/cpuinfo`` names it: model, vendor, family/model/stepping and the
    ISA extensions that matter here (e.g. ``"AVX2 FMA AVX-512 AVX512-BF16 AMX-BF16"``)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key and key not in fields:
                fields[key] = val.strip()
            if key == "flags":
                break
    flags = set(fields.get("flags", "").split())
    ident = ", ".join(
        f"{name} {fields[key]}"
        for key, name in (("cpu family", "family"), ("model", "model"), ("stepping", "stepping"))
        if key in fields
    )
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "vendor": fields.get("vendor_id", ""),
        "id": ident,
        "isa": " ".join(name for flag, name in _ISA if flag in flags),
    }


_local = threading.local()
_lock = threading.Lock()


def calibrating() -> bool:
    """True inside this thread's calibration (its passes must not calibrate again)."""
    return getattr(_local, "on", False)


DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""The dtypes with a choice, in the order measured (the half paths' float32 candidate runs
with float32's choice)."""
_HALF = (torch.bfloat16, torch.float16)


def choose(
    kern: Kernels, cache: Path, dtypes: Sequence[torch.dtype] = DTYPES
) -> dict[torch.dtype, Choice]:
    """The choice for each of ``dtypes`` (and float32's where a half dtype is among them:
    the half paths are measured against it) at this thread count: read from ``cache`` (a
    JSON file), or measured and saved there, dtype by dtype (a process that runs float32
    alone measures float32 alone). ``FLASHLEDGER_GEMM`` forces float32's and float64's back
    end, ``FLASHLEDGER_HALF`` bfloat16's and float16's path (then only the tiles are
    measured, and saved apart)."""
    half = any(dt in _HALF for dt in dtypes)
    want = [dt for dt in DTYPES if dt in dtypes or (half and dt == torch.float32)]
    names = {_name(dt): kern.gemm_names(dt) for dt in DTYPES}
    forced: dict[str, str | None] = {}
    warned = set()
    for dt in DTYPES:  # a setting that names no candidate here is measured instead
        variable, f = _variable(dt), os.environ.get(_variable(dt))
        if f == "amx" and dt == torch.float16 and "half" in names[_name(dt)]:
            f = "half"  # AMX's path is bfloat16's; float16 keeps its dtype on the half gemm
        if f is not None and f not in names[_name(dt)]:
            if variable not in warned and dt in want:
                warnings.warn(
                    f"{variable}={f!r} is not one of {', '.join(names[_name(dt)])} here; "
                    "choosing by measurement",
                    stacklevel=3,
                )
                warned.add(variable)
            f = None
        forced[_name(dt)] = f
    # choices made under a forced setting, or with the BLAS libraries held to other code, are
    # saved apart (MKL held to AVX2 for a test run must not decide the next plain process)
    settings = {f"{_variable(dt)}={f}" for dt in DTYPES if (f := forced[_name(dt)]) is not None}
    settings |= {f"{v}={os.environ[v]}" for v in STEERING if os.environ.get(v)}
    key = " ".join([str(kern.max_threads()), *sorted(settings)])
    out: dict[torch.dtype, Choice] = {}
    with _lock, _file_lock(cache):
        saved = _read(cache)
        if saved.get("candidates") != names or saved.get("format") != _FORMAT:
            saved = {}  # other back ends, or another layout or problem: measured again
        by = saved.get("by_threads")
        mine = by.get(key) if isinstance(by, dict) else None
        mine = dict(mine) if isinstance(mine, dict) else {}
        now: float | None = None  # the share others take now, looked at once if at all
        changed = False
        for dt in want:
            before = _usable(mine.get(_name(dt)), dt, names[_name(dt)])
            if before is not None and before.busy > BUSY and now is None:
                now = others_share(_LOOK_S)
            if before is not None and (before.busy <= BUSY or (now or 0.0) > BUSY):
                # measured on a quiet machine, or the machine is still busy
                out[dt] = replace(before, how="cached")
                continue
            f = forced[_name(dt)]
            cands = names[_name(dt)] if f is None else [f]
            _local.on = True
            try:
                with OthersShare() as others:
                    if dt in _HALF:
                        c = _measure_half(kern, dt, cands, out[torch.float32])
                    else:
                        c = _measure(kern, dt, cands)
            finally:
                _local.on = False
            c = replace(c, busy=round(others.share, 3))
            if before is not None and before.busy <= c.busy:
                out[dt] = replace(before, how="cached")  # the quieter measurement stands
                continue
            mine[_name(dt)] = asdict(c)
            out[dt] = c
            changed = True
        if changed:
            if not isinstance(saved.get("by_threads"), dict):
                saved["by_threads"] = {}
            saved["by_threads"][key] = mine
            saved.update(cpu=cpu_model(), torch=torch.__version__, candidates=names, format=_FORMAT)
            _write(cache, saved)
    return {
        dt: c if (f := forced[_name(dt)]) is None else replace(c, how=f"{_variable(dt)}={f}")
        for dt, c in out.items()
    }


def _variable(dt: torch.dtype) -> str:
    """The environment variable that forces ``dt``'s choice."""
    return "FLASHLEDGER_HALF" if dt in _HALF else "FLASHLEDGER_GEMM"


def _cpu_ticks() -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks of all CPUs since boot (``/proc/stat``: busy is all but
    idle and iowait, so a virtual machine's stolen time counts as busy); None where
    unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    if not fields or fields[0] != "cpu" or len(ticks) < 5:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


class OthersShare:
    """A context that measures the share of all CPUs' time other processes took while it
    was open: the busy ticks of ``/proc/stat`` less this process's own CPU time, over all
    the ticks; ``share`` is 0.0 where ``/proc/stat`` cannot be read."""

    share: float = 0.0

    def __enter__(self) -> OthersShare:
        self._ticks, self._own = _cpu_ticks(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        ticks, own = _cpu_ticks(), time.process_time() - self._own
        if ticks is None or self._ticks is None or ticks[1] <= self._ticks[1]:
            return
        hz = os.sysconf("SC_CLK_TCK")
        busy, total = (ticks[0] - self._ticks[0]) / hz, (ticks[1] - self._ticks[1]) / hz
        self.share = min(1.0, max(0.0, (busy - own) / total))


def others_share(seconds: float) -> float:
    """The share of all CPUs' time other processes take now, looked at for ``seconds``."""
    with OthersShare() as others:
        time.sleep(seconds)
    return others.share


def _usable(saved: Any, dt: torch.dtype, names: list[str]) -> Choice | None:
    """``dt``'s cached choice (a dict from the file) if it is well formed, on a back end (of
    ``names``) available now, with its forward's own tiles and (float32, float64) back end
    (a choice saved before they were measured is measured again); its ``busy`` 1.0,
    unknown, where it was saved before that was recorded (measured again when quiet).
    None otherwise (a damaged entry is measured again)."""
    try:
        c = Choice(**saved)
        busy = float(saved.get("busy", 1.0))
        ok = (
            c.gemm in names
            and c.forward_block_q > 0
            and c.forward_block_k > 0
            and (dt in _HALF or c.forward_gemm in names)
            and c.scores_gemm in ("", *names)
        )
    except (TypeError, ValueError):
        return None
    return replace(c, busy=1.0 if math.isnan(busy) else busy) if ok else None


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _inputs(kern: Kernels, dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    """``n`` tensors ``(1, threads, L, d)`` of the measured problem, in ``dtype``."""
    heads = kern.max_threads()
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(1, heads, _L, _D, generator=gen, dtype=torch.float64).to(dtype)
        for _ in range(n)
    ]


C = TypeVar("C")


def _fastest_of(
    runs: dict[C, Callable[[], None]], flop: float, rounds: int
) -> tuple[C, dict[C, float]]:
    """The key of the fastest of ``runs`` (a warm-up each: pages, caches, the BLAS's own
    buffers; then ``rounds`` interleaved rounds, each judged by its fastest round) and
    each one's rate there (GFLOP/s for ``flop`` per run)."""
    times: dict[C, list[float]] = {c: [] for c in runs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for c, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[c].append(time.perf_counter() - t0)
    best = {c: min(t) for c, t in times.items()}
    return min(best, key=lambda c: best[c]), {c: round(flop / t / 1e9, 1) for c, t in best.items()}


_Cand = tuple[str, int, int]  # (back end, block_q, block_k)


def _fastest(
    kern: Kernels, dtype: torch.dtype, cands: list[_Cand], *, backward: bool = True
) -> tuple[_Cand, dict[_Cand, float]]:
    """The fastest of ``cands`` for ``dtype`` inputs: forward + backward passes of every
    candidate (``backward=False``: forward passes alone, one round more), interleaved
    rounds, each candidate's fastest round; and each candidate's rate (GFLOP/s) at it."""
    from .blocked import blocked_backward, blocked_forward  # the loop the step serves

    q, k, v, do = _inputs(kern, dtype, 4)
    # forward 4·L²·d·H, backward 2.5 x that
    flop = 4.0 * _L * _L * _D * q.shape[1] * (3.5 if backward else 1.0)

    def run(gemm: str, bq: int, bk: int) -> Callable[[], None]:
        def once() -> None:
            kern.set_gemm(dtype, gemm)
            f = blocked_forward(q, k, v, block_q=bq, block_k=bk)
            if backward:
                blocked_backward(q, k, v, f.o, f.lse, do, block_q=bq, block_k=bk)

        return once

    return _fastest_of({c: run(*c) for c in cands}, flop, _ROUNDS if backward else _ROUNDS + 1)


def _with_forward(kern: Kernels, dtype: torch.dtype, choice: Choice, names: list[str]) -> Choice:
    """``choice`` with its forward's back end (of ``names``; float32/float64) and tiles
    measured, and those in force."""
    rates = dict(choice.rates)
    fwd = choice.gemm
    if dtype not in _HALF and len(names) > 1:  # every back end at FORWARD_GEMM_TILES
        bq, bk = FORWARD_GEMM_TILES
        (fwd, _, _), by = _fastest(kern, dtype, [(g, bq, bk) for g in names], backward=False)
        rates.update({f"forward {g} {bq}x{bk}": r for (g, _, _), r in by.items()})
    cands = [(fwd, bq, bk) for bq, bk in FORWARD_TILE_CANDIDATES]  # then the tiles on it
    (_, fq, fk), by = _fastest(kern, dtype, cands, backward=False)
    rates.update({f"forward {bq}x{bk}": r for (_, bq, bk), r in by.items()})
    if dtype not in _HALF:
        kern.set_gemm(dtype, choice.gemm, forward=fwd, scores=choice.scores_gemm or None)
    return replace(
        choice,
        forward_block_q=fq,
        forward_block_k=fk,
        rates=rates,
        forward_gemm="" if dtype in _HALF else fwd,
    )


def _measure(kern: Kernels, dtype: torch.dtype, names: list[str]) -> Choice:
    """float32/float64: every back end at the first tile candidate, then the tile
    candidates on the fastest; then the forward's own back end, and its tiles on that."""
    bq, bk = TILE_CANDIDATES[0]
    gemm = names[0]
    rates: dict[str, float] = {}
    if len(names) > 1:
        (gemm, _, _), by = _fastest(kern, dtype, [(g, bq, bk) for g in names])
        rates = {f"{g} {bq}x{bk}": r for (g, bq, bk), r in by.items()}
    return _tiles_then_forward(kern, dtype, gemm, rates, names)


def _tiles_then_forward(
    kern: Kernels, dtype: torch.dtype, gemm: str, rates: dict[str, float], names: list[str]
) -> Choice:
    """The tile candidates on back end (or half path) ``gemm``, their rates added to
    ``rates`` under keys of their own (the first candidate's would be the back-end stage's,
    measured in other rounds), the fastest in force; then the forward's own back end (of
    ``names``) and tiles (``_with_forward``)."""
    (gemm, bq, bk), by = _fastest(kern, dtype, [(gemm, q, k) for q, k in TILE_CANDIDATES])
    rates = {**rates, **{f"tiles {q}x{k}": r for (_, q, k), r in by.items()}}
    kern.set_gemm(dtype, gemm)
    choice = Choice(gemm=gemm, block_q=bq, block_k=bk, how="calibrated", rates=rates)
    return _with_forward(kern, dtype, _with_scores(kern, dtype, choice, names), names)


def _with_scores(kern: Kernels, dtype: torch.dtype, choice: Choice, names: list[str]) -> Choice:
    """``choice`` (float32/float64 on a BLAS, where the own kernel is built and among
    ``names``) with a backward's score products on the own kernel where forward + backward
    passes at its tiles ran faster so (interleaved rounds, each side's fastest), and that
    in force; ``choice`` itself elsewhere."""
    if dtype in _HALF or choice.gemm == "own" or "own" not in names:
        return choice
    from .blocked import blocked_backward, blocked_forward

    q, k, v, do = _inputs(kern, dtype, 4)
    flop = 4.0 * _L * _L * _D * q.shape[1] * 3.5
    bq, bk = choice.block_q, choice.block_k

    def run(scores: str) -> Callable[[], None]:
        def once() -> None:
            kern.set_gemm(dtype, choice.gemm, scores=scores)
            f = blocked_forward(q, k, v, block_q=bq, block_k=bk)
            blocked_backward(q, k, v, f.o, f.lse, do, block_q=bq, block_k=bk)

        return once

    best, by = _fastest_of({g: run(g) for g in (choice.gemm, "own")}, flop, _ROUNDS)
    kern.set_gemm(dtype, choice.gemm, scores=best)
    rates = {**choice.rates, **{f"scores {g} {bq}x{bk}": r for g, r in by.items()}}
    return replace(choice, rates=rates, scores_gemm="" if best == choice.gemm else best)


def _measure_half(kern: Kernels, dtype: torch.dtype, paths: list[str], base: Choice) -> Choice:
    """bfloat16/float16: the ``half`` path (at the first tile candidate) against the
    ``float32`` path (at float32's choice ``base``), interleaved rounds, fastest rounds; then the
    tiles of the ``half`` path when it wins. Nothing to measure when only ``float32`` is
    possible (no half gemm here)."""
    if paths == ["float32"]:
        kern.set_gemm(dtype, "float32")
        return replace(
            base, gemm="float32", how="calibrated", rates={}, forward_gemm="", scores_gemm=""
        )
    cands = [
        (p, *(TILE_CANDIDATES[0] if p != "float32" else (base.block_q, base.block_k)))
        for p in paths
    ]
    (path, bq, bk), by = _fastest(kern, dtype, cands)
    rates = {f"{p} {bq}x{bk}": r for (p, bq, bk), r in by.items()}
    if path == "float32":  # float32's choice, forward tiles and all
        kern.set_gemm(dtype, path)
        return replace(
            base, gemm="float32", how="calibrated", rates=rates, forward_gemm="", scores_gemm=""
        )
    return _tiles_then_forward(kern, dtype, path, rates, [path])


@contextlib.contextmanager
def _file_lock(cache: Path) -> Iterator[None]:
    """Hold ``cache``'s lock file (another process calibrating waits); no lock where the
    directory cannot be written."""
    try:
        fd = os.open(str(cache) + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(cache: Path) -> dict[str, Any]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(cache: Path, data: dict[str, Any]) -> None:
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, cache)
