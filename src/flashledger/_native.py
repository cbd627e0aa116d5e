"""The native tile step: one C call per (query tile, key tile) step, for every head.

The blocked loop (schedule, skipping, masks, ledger) stays in Python; with
tracing off, on CPU, for float32/float64 plain scores without dropout, each
step's arithmetic (``_native.c``: scores, online update or gradient rebuild,
matmuls) runs as one call, threads over heads, the tile kept in a per-thread
buffer. Same math as the PyTorch step, its own rounding.

The C source is compiled on first use (a C compiler with OpenMP is needed;
about a second) against the OpenMP runtime and the BLAS PyTorch has loaded,
and cached under ``$FLASHLEDGER_CACHE_DIR`` (default
``~/.cache/flashledger``). Without a compiler, or on a platform where that
cannot be arranged, the loop keeps its PyTorch step: ``native_status()``
(``flashledger.native_status()``) says which and why. ``FLASHLEDGER_NATIVE=0``
turns the native step off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["Kernels", "TileCall", "disabled", "kernels", "native_status"]

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-march=native", "-fPIC", "-fopenmp", "-fno-math-errno"]
_lock = threading.Lock()
_loaded: tuple[Kernels | None, str] | None = None
_off = threading.local()


_POINTERS = "q k kt v vt acc_t m ell dout lse dd dq_t dk_t dv_t work"
_SIZES = "heads group lq lk d dv work_stride"


class _Args(ctypes.Structure):
    """Mirror of ``struct fl_args`` in ``_native.c``."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS.split()]
        + [(name, ctypes.c_longlong) for name in _SIZES.split()]
        + [("scale", ctypes.c_double)]
        + [("scale_exact", ctypes.c_longlong)]
    )


class TileCall:
    """The fixed arguments of one pass (pointers and sizes); tensors are kept alive here."""

    def __init__(self, kern: Kernels, dtype: torch.dtype, keep: list[torch.Tensor], args: _Args):
        self._suffix = "f32" if dtype == torch.float32 else "f64"
        self._fwd = kern.fn("fl_forward_tile", self._suffix)
        self._bwd = kern.fn("fl_backward_tile", self._suffix)
        self._keep = keep
        self._args = args
        self._ref = ctypes.byref(args)

    def forward(
        self, q0: int, q1: int, k0: int, k1: int, chunk: int, vis: tuple[int, int, int] | None
    ) -> None:
        """One forward step over queries ``[q0, q1)`` and keys ``[k0, k1)``, every head."""
        ptr, sn, sg = vis if vis is not None else (None, 0, 0)
        self._fwd(self._ref, q0, q1, k0, k1, chunk, ptr, sn, sg)

    def backward(
        self, q0: int, q1: int, k0: int, k1: int, vis: tuple[int, int, int] | None
    ) -> None:
        """One backward step; dK_j, dV_j accumulate per query head in the pass's buffers."""
        ptr, sn, sg = vis if vis is not None else (None, 0, 0)
        self._bwd(self._ref, q0, q1, k0, k1, ptr, sn, sg)


class Kernels:
    """The loaded library."""

    def __init__(self, lib: ctypes.CDLL, gemms: dict[str, int]) -> None:
        self._lib = lib
        ll, vp = ctypes.c_longlong, ctypes.c_void_p
        for suffix, gemm in gemms.items():
            getattr(lib, f"fl_set_gemm_{suffix}").argtypes = [vp]
            getattr(lib, f"fl_set_gemm_{suffix}")(gemm)
            fwd = getattr(lib, f"fl_forward_tile_{suffix}")
            fwd.argtypes = [vp, ll, ll, ll, ll, ll, vp, ll, ll]
            fwd.restype = None
            bwd = getattr(lib, f"fl_backward_tile_{suffix}")
            bwd.argtypes = [vp, ll, ll, ll, ll, vp, ll, ll]
            bwd.restype = None
        self.vector_bytes = int(lib.fl_vector_bytes_f32())

    def fn(self, name: str, suffix: str) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return getattr(self._lib, f"{name}_{suffix}")

    def max_threads(self) -> int:
        """OpenMP threads a parallel region started from this thread would use."""
        return int(self._lib.fl_max_threads_f32())

    def call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        group: int,
        scale: float,
        work_per_thread: int,
        **state: torch.Tensor,
    ) -> TileCall:
        """Arguments of one pass. ``q`` ``(H, Lq, d)``, ``k`` ``(Hk, Lk, d)``, ``v`` ``(Hk,
        Lk, d_v)`` with ``H = Hk·group``; ``state``: the forward's ``acc_t, m, ell`` or the
        backward's ``dout, lse, dd, dq_t, dk_t, dv_t`` (contiguous, the same dtype; see
        ``struct fl_args`` in ``_native.c`` for the shapes)."""
        forward = "acc_t" in state
        # the forward reads Vᵀ (for accᵀ += Vᵀ Pᵀ), the backward Kᵀ (for dQᵀ += Kᵀ dSᵀ)
        kt = k if forward else k.mT.contiguous()  # Kᵀ (Hk, d, Lk), backward only
        vt = v.mT.contiguous() if forward else v  # Vᵀ (Hk, d_v, Lk), forward only
        keep = [q, k, v, kt, vt, *state.values()]
        assert all(t.is_contiguous() and t.dtype == q.dtype for t in keep)
        work = torch.empty(self.max_threads() * work_per_thread, dtype=q.dtype)
        keep.append(work)
        args = _Args(
            q=q.data_ptr(),
            k=k.data_ptr(),
            kt=None if forward else kt.data_ptr(),
            v=v.data_ptr(),
            vt=vt.data_ptr() if forward else None,
            work=work.data_ptr(),
            heads=q.shape[0],
            group=group,
            lq=q.shape[1],
            lk=k.shape[1],
            d=q.shape[2],
            dv=v.shape[2],
            work_stride=work_per_thread,
            scale=scale,
            scale_exact=int(math.frexp(scale)[0] == 0.5),
            **{name: t.data_ptr() for name, t in state.items()},
        )
        return TileCall(self, q.dtype, keep, args)


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
    """The native step, built and loaded on first use; None where it cannot run."""
    if getattr(_off, "depth", 0) or os.environ.get("FLASHLEDGER_NATIVE", "1") == "0":
        return None
    return _load()[0]


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
    return f"native tile step: on ({why})"


def _load() -> tuple[Kernels | None, str]:
    global _loaded
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
        gemms = {
            "f32": ctypes.cast(blas.sgemm_, ctypes.c_void_p).value,
            "f64": ctypes.cast(blas.dgemm_, ctypes.c_void_p).value,
        }
    except AttributeError:
        return None, "PyTorch's library does not export sgemm_/dgemm_"
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    parts = [_SOURCE.read_text(), " ".join(_FLAGS), version, str(gomp), torch.__version__]
    key = hashlib.sha256("\0".join([*parts, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(
        os.environ.get("FLASHLEDGER_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashledger"
    )
    lib_path = cache / f"native-{key}.so"
    if not lib_path.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            _compile(cc, gomp, lib_path)
        except OSError:  # an unwritable cache: build for this process only
            lib_path = Path(tempfile.mkdtemp(prefix="flashledger-")) / lib_path.name
            _compile(cc, gomp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    kern = Kernels(lib, {k: v for k, v in gemms.items() if v is not None})
    isa = {64: "AVX-512", 32: "AVX2"}.get(kern.vector_bytes, "SSE")
    return kern, f"{isa}, {kern.max_threads()} threads, {lib_path}"


def _compile(cc: str, gomp: Path, out: Path) -> None:
    """Compile float32 and float64 objects and link them against the loaded libgomp."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = []
        for name, flag in (("f32", "0"), ("f64", "1")):
            obj = Path(tmp) / f"{name}.o"
            cmd = [cc, *_FLAGS, f"-DFL_DOUBLE={flag}", "-c", str(_SOURCE), "-o", str(obj)]
            _run(cmd)
            objs.append(str(obj))
        tmp_lib = Path(tmp) / out.name
        rpath = f"-Wl,-rpath,{gomp.parent}"
        _run([cc, "-shared", *objs, str(gomp), rpath, "-o", str(tmp_lib)])
        os.replace(tmp_lib, out)  # atomic: concurrent builders never see half a file


class _BuildError(RuntimeError):
    pass


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise _BuildError(f"{Path(cmd[0]).name} failed: {done.stderr.strip()[-300:]}")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
