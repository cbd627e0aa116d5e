"""The native step's choices, made by measurement on the machine it runs on.

Which matmul back end runs the step's tile products (its own AVX-512 kernel,
PyTorch's BLAS, OpenBLAS from the ``scipy-openblas32`` package where it is
installed) and which tiles the loop uses by default depend on the CPU: MKL
runs float32 GEMM through its AVX2 code on AMD EPYC and its AVX-512 code on
Intel Xeon, so what wins on one loses on the other. So, per dtype, a short
calibration (about a second) runs real forward + backward passes with each
candidate, in interleaved rounds, and keeps the fastest (median). It runs
once, when the step is first used on a machine, under a file lock (concurrent
processes wait for one measurement), and is cached beside the compiled
library, keyed by CPU model, ISA flags, thread count and PyTorch version (the
library's own key); afterwards the same machine always runs the same choice.
``FLASHLEDGER_GEMM`` (``own``, ``blas``, ``openblas``) forces the back end.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._native import Kernels

__all__ = ["GEMMS", "TILE_CANDIDATES", "Choice", "choose", "cpu_info", "cpu_model"]

GEMMS = ("own", "blas", "openblas")
"""The matmul back ends: the step's own kernel, PyTorch's BLAS, OpenBLAS."""
TILE_CANDIDATES = ((512, 512), (256, 256), (256, 512))
"""Default tiles measured, the first also the one each back end is measured at."""
FALLBACK_TILES = (512, 512)
"""The default tiles where nothing was measured (the PyTorch step)."""

_ROUNDS = 3
_L, _D = 1024, 64  # the measured problem: B = 1, H = 4 x threads heads, L x L, d = 64


@dataclass(frozen=True)
class Choice:
    """What the native step runs for one dtype, and why."""

    gemm: str  # "own", "blas" or "openblas"
    block_q: int
    block_k: int
    how: str  # "calibrated", "cached" or "FLASHLEDGER_GEMM=..."
    rates: dict[str, float] = field(default_factory=dict)
    """GFLOP/s of every candidate measured (forward + backward), e.g. ``"own 512x512"``."""

    def describe(self) -> str:
        names = {"own": "own matmul kernel", "blas": "PyTorch's BLAS", "openblas": "OpenBLAS"}
        return f"{names[self.gemm]}, tiles {self.block_q}x{self.block_k} ({self.how})"


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


def choose(kern: Kernels, cache: Path) -> dict[torch.dtype, Choice]:
    """The choice for float32 and float64 at this thread count: read from ``cache`` (a
    JSON file), or measured and saved there. ``FLASHLEDGER_GEMM`` forces the back end
    (then only the tiles are measured, and saved apart)."""
    forced = os.environ.get("FLASHLEDGER_GEMM")
    names = kern.gemm_names()
    if forced is not None and forced not in names:
        warnings.warn(
            f"FLASHLEDGER_GEMM={forced!r} is not one of {', '.join(names)} here; "
            "choosing by measurement",
            stacklevel=3,
        )
        forced = None
    key = str(kern.max_threads()) + ("" if forced is None else f" {forced}")
    with _lock, _file_lock(cache):
        saved = _read(cache)
        mine = saved.get("by_threads", {}).get(key)
        if saved.get("candidates") == names and _usable(mine, names):  # else: measure again
            how = "cached"
        else:
            _local.on = True
            try:
                gemms = names if forced is None else [forced]
                mine = {_name(dt): asdict(_measure(kern, dt, gemms)) for dt in _DTYPES}
            finally:
                _local.on = False
            saved.setdefault("by_threads", {})[key] = mine
            saved.update(cpu=cpu_model(), torch=torch.__version__, candidates=names)
            _write(cache, saved)
            how = "calibrated"
    out = {}
    for dt in _DTYPES:
        c = {**mine[_name(dt)], "how": how if forced is None else f"FLASHLEDGER_GEMM={forced}"}
        out[dt] = Choice(**c)
    return out


_DTYPES = (torch.float32, torch.float64)


def _usable(mine: Any, names: list[str]) -> bool:
    """A cached choice for both dtypes, well formed, on a back end available now."""
    try:
        return all(Choice(**mine[_name(dt)]).gemm in names for dt in _DTYPES)
    except (TypeError, KeyError):
        return False


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _measure(kern: Kernels, dtype: torch.dtype, names: list[str]) -> Choice:
    """Forward + backward passes of every candidate, interleaved rounds, medians."""
    from .blocked import blocked_backward, blocked_forward  # the loop the step serves

    heads = 4 * kern.max_threads()
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, _L, _D, dtype=dtype, generator=gen) for _ in range(4))
    flop = 4.0 * _L * _L * _D * heads * 3.5  # forward 4·L²·d·H, backward 2.5 x that

    def run(gemm: str, bq: int, bk: int) -> float:
        kern.set_gemm(dtype, gemm)
        t0 = time.perf_counter()
        f = blocked_forward(q, k, v, block_q=bq, block_k=bk)
        blocked_backward(q, k, v, f.o, f.lse, do, block_q=bq, block_k=bk)
        return time.perf_counter() - t0

    def best(cands: list[tuple[str, int, int]]) -> tuple[tuple[str, int, int], dict[str, float]]:
        times: dict[tuple[str, int, int], list[float]] = {c: [] for c in cands}
        for c in cands:  # warm-up: pages, caches, the BLAS's own buffers
            run(*c)
        for _ in range(_ROUNDS):
            for c in cands:
                times[c].append(run(*c))
        med = {c: statistics.median(t) for c, t in times.items()}
        rates = {f"{g} {bq}x{bk}": round(flop / t / 1e9, 1) for (g, bq, bk), t in med.items()}
        return min(med, key=lambda c: med[c]), rates

    bq, bk = TILE_CANDIDATES[0]
    gemm = names[0]
    rates: dict[str, float] = {}
    if len(names) > 1:
        (gemm, _, _), rates = best([(g, bq, bk) for g in names])
    (gemm, bq, bk), more = best([(gemm, bq, bk) for bq, bk in TILE_CANDIDATES])
    rates.update(more)
    kern.set_gemm(dtype, gemm)
    return Choice(gemm=gemm, block_q=bq, block_k=bk, how="calibrated", rates=rates)


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
