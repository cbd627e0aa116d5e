"""``flashledger bench``: the blocked loop against PyTorch's CPU flash kernel, measured.

For each configuration (sequence length ``L``, dtype, causal or not; batch
``B``, heads ``H`` and head dim ``d`` fixed) the same process times, in
interleaved rounds so that a busy machine slows both sides alike (the naive
method, shown for contrast, in rounds of its own after them, since its
multi-GB allocations slow whatever runs next to them):

- ``flashledger``: ``flash_attention`` (the blocked loop, tracing off) with
  the chosen tiles; its tile step is the native one when it is on (the report
  says so: ``machine.native_step``);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (on CPU its
  flash kernel, ``_scaled_dot_product_flash_attention_for_cpu``);
- ``naive``: the materialised ``softmax(S) V`` (skipped above ``--naive-max-length``
  or when its estimated memory exceeds ``--naive-max-gb``).

Forward alone (under ``no_grad``) and forward + backward are timed; the
median is reported, and beside each ratio of medians the range of the
rounds' own ratios (each round's flashledger time over that round's SDPA
time: a wide range says the machine was busy while it ran). Attention FLOPs: ``4·B·H·L²·d`` forward, 2.5× that
backward, halved for causal. The GEMM peak (PyTorch's square 2048 matmul into
a preallocated output) is measured in the same run, so "% of peak" compares
like with like; so is the rate of the native step's own matmul (``512³``
products on every thread, as its tile steps run them; "% step mm"): where
the step's kernel outruns PyTorch's GEMM, that is the higher bar.

Peak extra memory is measured per method in a fresh subprocess
(``python -m flashledger.bench --measure-memory ...``): the resident-set
high-water mark during one forward + backward, minus the resident set once
the inputs exist (tracemalloc would not see PyTorch's allocations). On Linux
the high-water mark is reset just before the call (``/proc/self/clear_refs``),
and glibc is told to map every block of 128 KiB or more on its own
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set and
the mark counts live memory. The same call runs once first: thread pools,
library workspaces and the code pages of the kernels it runs are not the
method's (docs/perf.md); the native step's scratch kept from it is let go, so
that the buffers a pass needs are counted.

Results: a table on standard output, ``bench.json`` and ``bench.png`` (time
and memory against ``L``, log scales) in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import _calibrate, _native
from ._limits import MAX_SIZE
from ._progress import figure_png, int_arg, make_console, output_problem, progress, write_file
from ._text import shown
from .autograd import flash_attention
from .blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blocked_backward, blocked_forward
from .masks import Causal

__all__ = ["add_cli_arguments", "main", "run_cli"]

METHODS = ("flashledger", "sdpa", "naive")
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DEFAULT_DTYPES = ("float32", "float64")
FULL_LENGTHS = (4096, 8192, 16384)
QUICK_LENGTHS = (1024, 2048)
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3
GEMM_N = 2048  # square GEMM used for the peak


# ----------------------------------------------------------------------------------------
# the three methods
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One benchmark configuration."""

    length: int  # L = Lq = Lk
    dtype: str  # "float32" | "float64"
    causal: bool
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    block_q: int | None = None  # None: the native step's calibrated tiles (512 without it)
    block_k: int | None = None

    @property
    def fwd_flops(self) -> float:
        """``4·B·H·L²·d``, halved for causal."""
        f = 4.0 * self.batch * self.heads * self.length**2 * self.head_dim
        return f / 2 if self.causal else f

    @property
    def fwdbwd_flops(self) -> float:
        """Forward + backward (backward = 2.5× forward)."""
        return 3.5 * self.fwd_flops

    def naive_bytes(self) -> int:
        """Rough peak of the naive method: about five ``B·H·L²`` matrices alive at once."""
        item = torch.finfo(DTYPES[self.dtype]).bits // 8
        return 5 * self.batch * self.heads * self.length**2 * item

    def label(self) -> str:
        c = "causal" if self.causal else "full"
        return f"L={self.length} {self.dtype} {c}"

    def tiles(self, *, forward: bool = False) -> tuple[int, int]:
        """The tiles flashledger runs: as given, or its defaults for this dtype (``forward``:
        a forward pass's)."""
        return resolved_tiles(self.dtype, self.block_q, self.block_k, forward=forward)


def resolved_tiles(
    dtype: str, block_q: int | None, block_k: int | None, *, forward: bool = False
) -> tuple[int, int]:
    """``block_q``, ``block_k`` as given, or the tiles flashledger takes by default for
    ``dtype``: the native step's calibrated ones (for bfloat16/float16 those of the path
    its calibration chose: in the dtype, or float32's; ``forward``: a forward pass's own),
    512 x 512 where it is off."""
    kern = _native.kernels()
    dt = getattr(torch, dtype)
    if kern is None:
        bq, bk = DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K
    else:
        bq, bk = kern.tiles(dt, forward=forward)
    return (bq if block_q is None else block_q), (bk if block_k is None else block_k)


def tiles_label(fwd: tuple[int, int], both: tuple[int, int]) -> str:
    """``"256x512"``, or with a forward's own tiles ``"256x1024/256x512"`` (forward /
    forward + backward)."""
    one = "{}x{}".format(*both)
    return one if fwd == both else "{}x{}/".format(*fwd) + one


def make_inputs(cfg: Config, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` (requiring grad) and ``do``, each ``(B, H, L, d)``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.batch, cfg.heads, cfg.length, cfg.head_dim)
    dt = DTYPES[cfg.dtype]
    q, k, v, do = (torch.randn(shape, generator=gen, dtype=dt) for _ in range(4))
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), do


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The materialised formula: ``softmax(q kᵀ / sqrt(d)) v``."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, L, L)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, dim=-1) @ v


def attention_fn(method: str, cfg: Config) -> Callable[..., torch.Tensor]:
    """``fn(q, k, v) -> o`` for one method."""
    if method == "flashledger":  # the given tiles, or each pass its defaults
        mask = Causal() if cfg.causal else None
        bq, bk = cfg.block_q, cfg.block_k
        return lambda q, k, v: flash_attention(  # type: ignore[return-value]
            q, k, v, mask=mask, block_q=bq, block_k=bk
        )
    if method == "sdpa":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return lambda q, k, v: sdpa(q, k, v, is_causal=cfg.causal)
    if method == "naive":
        return lambda q, k, v: _naive(q, k, v, cfg.causal)
    raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")


def _clear_grads(*xs: torch.Tensor) -> None:
    for x in xs:
        x.grad = None


def _fwd_runner(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn(q, k, v)

    return run


def _fwdbwd_runner(
    fn: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
) -> Callable[[], None]:
    def run() -> None:
        fn(q, k, v).backward(do)

    return run


def matmul_floor_runners(cfg: Config) -> tuple[Callable[[], None], Callable[[], None]]:
    """The blocked loop's matmuls alone, as ``(forward, forward + backward)`` runners.

    The same batched calls as the PyTorch tile step (``(B·H, bq, ·)`` operands,
    the same transposed accumulators, ``baddbmm`` into reused buffers), the
    same count (2 per tile run forward, 5 backward; causal skips the tiles
    above the diagonal), with no element-wise work, no mask and no bookkeeping.
    Its time is a floor for any loop built from separate PyTorch kernels:
    whatever such a loop does between its matmuls comes on top. (The native
    step makes the same matmuls per head and per core, from inside its loop.)
    """
    dt = DTYPES[cfg.dtype]
    gen = torch.Generator().manual_seed(3)
    n, length, d = cfg.batch * cfg.heads, cfg.length, cfg.head_dim
    q, k, do = (torch.randn(n, length, d, generator=gen, dtype=dt) for _ in range(3))
    v_t = torch.randn(n, d, length, generator=gen, dtype=dt)  # Vᵀ, as the forward keeps it
    bq_, bk_ = cfg.tiles()
    qtiles = [(s, min(s + bq_, length)) for s in range(0, length, bq_)]
    ktiles = [(s, min(s + bk_, length)) for s in range(0, length, bk_)]
    bq, bk = qtiles[0][1], ktiles[0][1]
    s_buf, dp_buf = (torch.empty(n * bq * bk, dtype=dt) for _ in range(2))
    dkt_buf, dvt_buf = (torch.empty(n * d * bk, dtype=dt) for _ in range(2))
    dqt = torch.empty(n * length * d, dtype=dt)
    alpha = 1.0 / math.sqrt(d)

    def runs(i: int, j: int) -> bool:  # causal: the tile has a key at or before its last query
        return not cfg.causal or ktiles[j][0] < qtiles[i][1]

    def forward() -> None:
        for i, (q0, q1) in enumerate(qtiles):
            r = q1 - q0
            acc_t = torch.zeros(n, d, r, dtype=dt)  # accᵀ
            for j, (k0, k1) in enumerate(ktiles):
                if not runs(i, j):
                    continue
                s = s_buf[: n * r * (k1 - k0)].view(n, r, k1 - k0)  # S (B·H, bq, bk)
                torch.baddbmm(s, q[:, q0:q1], k[:, k0:k1].mT, beta=0.0, alpha=alpha, out=s)
                acc_t.baddbmm_(v_t[..., k0:k1], s.mT)

    def backward() -> None:
        dqt.zero_()
        for j, (k0, k1) in enumerate(ktiles):
            c = k1 - k0
            kt_c = k[:, k0:k1].mT.contiguous()
            dkt = dkt_buf[: n * d * c].view(n, d, c).zero_()  # dKᵀ_j (B·H, d, bk)
            dvt = dvt_buf[: n * d * c].view(n, d, c).zero_()  # dVᵀ_j (B·H, d, bk)
            for i, (q0, q1) in enumerate(qtiles):
                if not runs(i, j):
                    continue
                r = q1 - q0
                s = s_buf[: n * r * c].view(n, r, c)  # S (B·H, bq, bk)
                dp = dp_buf[: n * r * c].view(n, r, c)  # dP (B·H, bq, bk)
                torch.baddbmm(s, q[:, q0:q1], kt_c, beta=0.0, alpha=alpha, out=s)
                torch.bmm(do[:, q0:q1], v_t[..., k0:k1], out=dp)
                dqt[n * q0 * d : n * q1 * d].view(n, d, r).baddbmm_(kt_c, dp.mT, alpha=alpha)
                dkt.baddbmm_(q[:, q0:q1].mT, dp, alpha=alpha)
                dvt.baddbmm_(do[:, q0:q1].mT, s)

    def both() -> None:
        forward()
        backward()

    return forward, both


# ----------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------
def gemm_runner(dtype: str) -> tuple[Callable[[], None], float]:
    """A square ``2048`` matmul into a preallocated output, and its FLOPs."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(GEMM_N, GEMM_N, generator=gen, dtype=dt)
    b = torch.randn(GEMM_N, GEMM_N, generator=gen, dtype=dt)
    c = torch.empty(GEMM_N, GEMM_N, dtype=dt)

    def run() -> None:
        torch.mm(a, b, out=c)

    return run, 2.0 * GEMM_N**3


def gemm_peak(dtype: str, *, repeats: int = 5) -> float:
    """GFLOP/s of a square ``2048`` matmul into a preallocated output (median)."""
    run, flops = gemm_runner(dtype)
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return flops / statistics.median(times) / 1e9


def peak_runners(dtype: str) -> dict[str, tuple[Callable[[], None], float]]:
    """``{"gemm": ..., "fma": ...}``: the two peaks as calls to time in every round beside
    the attention (``(call, FLOPs)``; no ``"fma"`` when the native step is off). On a
    shared machine the peaks move by 2-3x within seconds; a share of a peak measured
    minutes earlier says little."""
    out = {"gemm": gemm_runner(dtype)}
    kern = _native.kernels()
    if kern is not None:
        out["fma"] = kern.fma_runner(torch.float64 if dtype == "float64" else torch.float32)
    return out


def step_matmul_rate(dtype: str) -> float | None:
    """GFLOP/s of the native step's matmul on every thread (``Kernels.matmul_rate``, on
    the back end it chose for the dtype it computes in); None when the native step is off."""
    kern = _native.kernels()
    acc = torch.float64 if dtype == "float64" else torch.float32
    return None if kern is None else kern.matmul_rate(acc)


def fma_peak(dtype: str) -> float | None:
    """GFLOP/s of fused multiply-adds on registers only, every thread (``Kernels.fma_peak``):
    the machine's physical limit for the dtype flashledger computes in (float32 for half
    inputs); None when the native step (which carries the microbenchmark) is off."""
    kern = _native.kernels()
    acc = torch.float64 if dtype == "float64" else torch.float32
    return None if kern is None else kern.fma_peak(acc)


def time_interleaved(
    runners: dict[str, Callable[[], None]],
    *,
    repeats: int,
    budget_s: float,
    reset: Callable[[], None],
    advance: Callable[[float], None],
) -> dict[str, dict[str, Any]]:
    """Median seconds per runner: one warm-up each, then rounds that call every runner once.

    Rounds stop after ``repeats``, or earlier (never before 3) once ``budget_s``
    seconds have gone by. ``reset`` runs between calls, untimed. Each runner's
    ``samples_s`` holds its seconds round by round (the same index: the same round).
    """
    for run in runners.values():
        run()
        reset()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    start = time.perf_counter()
    for rnd in range(repeats):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - t0)
            reset()
        advance(1.0)
        if rnd + 1 >= 3 and time.perf_counter() - start > budget_s:
            advance(float(repeats - rnd - 1))
            break
    return {
        name: {
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "rounds": len(ts),
            "samples_s": ts,
        }
        for name, ts in samples.items()
    }


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` round by round: two methods timed in the same rounds, each ratio
    taken between calls made moments apart (a busy spell slows both)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def max_abs_diff(cfg: Config, a: str, b: str, inputs: Sequence[torch.Tensor]) -> float:
    """Largest ``|O_a - O_b|``: the benchmark times correct code."""
    q, k, v = inputs[:3]
    with torch.no_grad():
        oa = attention_fn(a, cfg)(q, k, v)
        ob = attention_fn(b, cfg)(q, k, v)
    return float((oa - ob).abs().max())


# ----------------------------------------------------------------------------------------
# memory (fresh subprocess)
# ----------------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _maxrss_kb() -> int:
    import resource  # POSIX only; the fallback where /proc is missing

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS


def measure_memory_here(method: str, cfg: Config) -> dict[str, Any]:
    """Peak extra resident memory of one forward + backward, in this (fresh) process."""
    fn = attention_fn(method, cfg)
    # the same call once first: thread pools, library workspaces and the code pages of the
    # kernels it runs (a first call at another length can take other ones) are not the
    # method's; the native step's kept scratch is let go after it, so a pass's buffers count
    warm = make_inputs(cfg)
    fn(*warm[:3]).backward(warm[3])
    del warm
    _native.release_scratch()
    q, k, v, do = make_inputs(cfg)
    rss = _status_kb("VmRSS")
    reset = False
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the high-water mark to the current resident set
        reset = True
    except OSError:
        pass
    baseline = rss if rss is not None else _maxrss_kb()
    fn(q, k, v).backward(do)
    hwm = _status_kb("VmHWM") if reset else None
    peak = hwm if hwm is not None else _maxrss_kb()
    return {
        "method": method,
        "peak_extra_bytes": max(0, peak - baseline) * 1024,
        "high_water_mark_reset": reset,
    }


def measure_memory(method: str, cfg: Config, *, timeout_s: float = 1800.0) -> dict[str, Any]:
    """Run ``measure_memory_here`` in a fresh interpreter and return its JSON."""
    cmd = [
        sys.executable,
        "-m",
        "flashledger.bench",
        "--measure-memory",
        method,
        "--lengths",
        str(cfg.length),
        "--dtypes",
        cfg.dtype,
        "--causal",
        "yes" if cfg.causal else "no",
        "--batch",
        str(cfg.batch),
        "--heads",
        str(cfg.heads),
        "--head-dim",
        str(cfg.head_dim),
    ]
    if cfg.block_q is not None or cfg.block_k is not None:
        cmd += ["--tiles", "{}x{}".format(*cfg.tiles())]
    # glibc: every block of 128 KiB or more gets its own mapping, returned to the system when
    # freed, so the high-water mark counts live tensors, not reused free lists
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=env
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"memory measurement of {method} at {cfg.label()} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------------
# the traced path
# ----------------------------------------------------------------------------------------
def traced_overhead(
    *, length: int = 64, head_dim: int = 16, heads: int = 1, block: int = 64, repeats: int = 30
) -> dict[str, Any]:
    """Forward + backward with ledger records on vs off, at explorer sizes (float64)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, do = (
        torch.randn(heads, length, head_dim, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    opts: dict[str, Any] = dict(mask=Causal(), block_q=block, block_k=block)

    def run(trace: bool) -> Callable[[], None]:
        def go() -> None:
            fwd = blocked_forward(q, k, v, trace=trace, **opts)
            blocked_backward(q, k, v, fwd.o, fwd.lse, do, trace=trace, **opts)

        return go

    res = time_interleaved(
        {"fast": run(False), "traced": run(True)},
        repeats=repeats,
        budget_s=10.0,
        reset=lambda: None,
        advance=lambda _: None,
    )
    fast, traced = res["fast"]["median_s"], res["traced"]["median_s"]
    return {
        "length": length,
        "head_dim": head_dim,
        "heads": heads,
        "block": block,
        "dtype": "float64",
        "mask": "causal",
        "fast_ms": 1e3 * fast,
        "traced_ms": 1e3 * traced,
        "ratio": traced / fast,
    }


# ----------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """The CPU (model, vendor, ISA), PyTorch, threads and the native step's choices (back
    end and tiles per dtype, and the rates of every candidate its calibration measured)."""
    cpu = _calibrate.cpu_info()
    kern = _native.kernels()
    choices = {}
    if kern is not None:
        kern.choose()  # every dtype's, measured here where not yet
        choices = {str(dt)[6:]: asdict(c) for dt, c in kern.choices.items()}
    return {
        "cpu": cpu["model"],
        "cpu_vendor": cpu["vendor"],
        "cpu_id": cpu["id"],
        "isa": cpu["isa"],
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "native_step": _native.native_status(),
        "native_choices": choices,
        "environment": environment(),
    }


# what changes which code runs (the native step's, PyTorch's kernels', the BLAS libraries')
# or how the threads wait: a run made with one of them set says so beside its figures
_ENVIRONMENT = (
    "FLASHLEDGER_NATIVE",
    "FLASHLEDGER_NATIVE_ARCH",
    "FLASHLEDGER_GEMM",
    "FLASHLEDGER_HALF",
    *_calibrate.STEERING,
    "OMP_WAIT_POLICY",
    "OMP_NUM_THREADS",
)


def environment() -> dict[str, str]:
    """The environment variables set in this process that steer what the run measures
    (``_ENVIRONMENT``: the native step's target and back ends, PyTorch's CPU capability, MKL,
    oneDNN and OpenBLAS held to other code, OpenMP's waiting), e.g. a run held to AVX2."""
    return {v: os.environ[v] for v in _ENVIRONMENT if os.environ.get(v)}


def environment_note(machine: dict[str, Any]) -> str:
    """``"; set: A=1 B=2"`` for a report's machine run with such variables, else ``""``."""
    held = machine.get("environment") or {}
    return "; set: " + " ".join(f"{k}={v}" for k, v in held.items()) if held else ""


def _configs(args: argparse.Namespace) -> list[Config]:
    return [
        Config(
            length=n,
            dtype=dt,
            causal=c,
            batch=args.batch,
            heads=args.heads,
            head_dim=args.head_dim,
            block_q=bq,
            block_k=bk,
        )
        for dt in args.dtypes
        for c in args.causal
        for n in args.lengths
        for bq, bk in (args.tiles or [(None, None)])
    ]


def _naive_allowed(cfg: Config, args: argparse.Namespace) -> bool:
    return (
        not args.no_naive
        and cfg.length <= args.naive_max_length
        and cfg.naive_bytes() <= args.naive_max_gb * 2**30
    )


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every configuration; returns the JSON-ready report."""

    configs = _configs(args)
    methods = {
        cfg: [m for m in METHODS if m != "naive" or _naive_allowed(cfg, args)] for cfg in configs
    }
    steps = sum(
        2 * args.repeats * (2 if "naive" in ms else 1) + (0 if args.no_memory else len(ms))
        for ms in methods.values()
    )
    report: dict[str, Any] = {
        "machine": machine_info(),
        "settings": {
            "lengths": list(args.lengths),
            "dtypes": list(args.dtypes),
            "causal": list(args.causal),
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "tiles": [list(t) for t in args.tiles] if args.tiles else "calibrated",
            "repeats": args.repeats,
            "budget_s": args.budget_s,
            "memory": not args.no_memory,
        },
        "gemm_peak_gflops": {dt: gemm_peak(dt) for dt in args.dtypes},
        "step_matmul_gflops": {dt: step_matmul_rate(dt) for dt in args.dtypes},
        "fma_peak_gflops": {dt: fma_peak(dt) for dt in args.dtypes},
        "results": [],
    }
    with progress("bench", total=steps + 1) as advance:
        for cfg in configs:
            row = _measure(cfg, methods[cfg], args, advance)
            _derive(
                row,
                report["gemm_peak_gflops"][cfg.dtype],
                report["step_matmul_gflops"][cfg.dtype],
                report["fma_peak_gflops"][cfg.dtype],
            )
            report["results"].append(row)
        report["traced"] = traced_overhead()
        advance(1.0)
    return report


def _time_config(
    cfg: Config, methods: Sequence[str], args: argparse.Namespace, advance: Callable[[float], None]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]], float]:
    """Forward and forward + backward times of every method, in one process, interleaved."""
    q, k, v, do = make_inputs(cfg)
    fns = {m: attention_fn(m, cfg) for m in methods}
    diff = max_abs_diff(cfg, "flashledger", "sdpa", (q, k, v))
    common: dict[str, Any] = dict(
        repeats=args.repeats,
        budget_s=args.budget_s,
        reset=lambda: _clear_grads(q, k, v),
        advance=advance,
    )
    floor_fwd, floor_fb = matmul_floor_runners(cfg)
    # flashledger, SDPA and the matmul floor share rounds; the naive method gets rounds of
    # its own: its multi-GB allocations and frees slow whatever runs next to them
    pair = {m: f for m, f in fns.items() if m != "naive"}
    fwd = time_interleaved(
        {**{m: _fwd_runner(f, q, k, v) for m, f in pair.items()}, "matmuls": floor_fwd}, **common
    )
    peaks = peak_runners(cfg.dtype)
    fb = time_interleaved(
        {
            **{m: _fwdbwd_runner(f, q, k, v, do) for m, f in pair.items()},
            "matmuls": floor_fb,
            **{f"peak {name}": run for name, (run, _) in peaks.items()},
        },
        **common,
    )
    for name, (_, flops) in peaks.items():  # the round's peak rate, beside its timings
        fb[f"peak {name}"]["gflops"] = [flops / t / 1e9 for t in fb[f"peak {name}"]["samples_s"]]
    if "naive" in fns:
        fwd |= time_interleaved({"naive": _fwd_runner(fns["naive"], q, k, v)}, **common)
        fb |= time_interleaved({"naive": _fwdbwd_runner(fns["naive"], q, k, v, do)}, **common)
    return fwd, fb, diff


def _measure(
    cfg: Config, methods: Sequence[str], args: argparse.Namespace, advance: Callable[[float], None]
) -> dict[str, Any]:
    """Times (one process, interleaved) and peak memories (subprocesses) of one configuration."""
    fwd, fb, diff = _time_config(cfg, methods, args, advance)  # the inputs are freed on return
    row: dict[str, Any] = {
        "length": cfg.length,
        "dtype": cfg.dtype,
        "causal": cfg.causal,
        "batch": cfg.batch,
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "block_q": cfg.tiles()[0],
        "block_k": cfg.tiles()[1],
        "forward_block_q": cfg.tiles(forward=True)[0],
        "forward_block_k": cfg.tiles(forward=True)[1],
        "fwd_gflop": cfg.fwd_flops / 1e9,
        "fwdbwd_gflop": cfg.fwdbwd_flops / 1e9,
        "max_abs_diff_o_vs_sdpa": diff,
        "matmuls": {  # the loop's matmuls alone (``matmul_floor_runners``)
            "fwd_ms": 1e3 * fwd["matmuls"]["median_s"],
            "fwdbwd_ms": 1e3 * fb["matmuls"]["median_s"],
        },
        # the peaks, timed in each forward + backward round beside the attention
        "rounds_gemm_gflops": fb["peak gemm"]["gflops"],
        "rounds_fma_gflops": fb["peak fma"]["gflops"] if "peak fma" in fb else None,
    }
    for m in METHODS:
        if m not in methods:
            row[m] = None
            continue
        entry: dict[str, Any] = {
            "fwd_ms": 1e3 * fwd[m]["median_s"],
            "fwdbwd_ms": 1e3 * fb[m]["median_s"],
            "rounds": fb[m]["rounds"],
            "fwdbwd_gflops": cfg.fwdbwd_flops / fb[m]["median_s"] / 1e9,
            "peak_extra_mb": None,
            "fwd_rounds_ms": [1e3 * t for t in fwd[m]["samples_s"]],
            "fwdbwd_rounds_ms": [1e3 * t for t in fb[m]["samples_s"]],
        }
        if not args.no_memory:
            entry["peak_extra_mb"] = measure_memory(m, cfg)["peak_extra_bytes"] / 2**20
            advance(1.0)
        row[m] = entry
    return row


def _round_shares(row: dict[str, Any], method: str, peaks: Sequence[float]) -> float:
    """The median over the rounds of ``method``'s forward + backward GFLOP/s as a
    percentage of the peak timed in the same round."""
    flops = row["fwdbwd_gflop"] * 1e9
    times = row[method]["fwdbwd_rounds_ms"]
    return statistics.median(
        100.0 * flops / (t / 1e3) / 1e9 / p for t, p in zip(times, peaks, strict=True)
    )


def _derive(
    row: dict[str, Any], peak: float, step_mm: float | None, fma: float | None = None
) -> None:
    """Ratios against SDPA (of the medians, and the range of the rounds' paired ratios),
    the shares of the GEMM peak, of the step's matmul rate and of the machine's FMA peak.

    The GEMM and FMA shares use the peaks timed in each round beside the attention
    (``rounds_*_gflops``, the median of the rounds' shares) where the row has them;
    ``peak`` and ``fma`` (measured once, at the start) otherwise."""
    fl, sd = row["flashledger"], row["sdpa"]
    row["ratio_fwd"] = fl["fwd_ms"] / sd["fwd_ms"]
    row["ratio_fwdbwd"] = fl["fwdbwd_ms"] / sd["fwdbwd_ms"]
    for key in ("fwd", "fwdbwd"):
        pr = paired_ratios(fl[f"{key}_rounds_ms"], sd[f"{key}_rounds_ms"])
        row[f"ratio_{key}_range"] = [min(pr), max(pr)]
    mm = row["matmuls"]
    row["floor_fwd"] = mm["fwd_ms"] / sd["fwd_ms"]
    row["floor_fwdbwd"] = mm["fwdbwd_ms"] / sd["fwdbwd_ms"]
    row["pct_step_matmul"] = None if not step_mm else 100.0 * fl["fwdbwd_gflops"] / step_mm
    for key, start in (("gemm", peak), ("fma", fma)):
        rounds = row.get(f"rounds_{key}_gflops")
        if rounds:
            row[f"{key}_peak_gflops"] = statistics.median(rounds)
            row[f"pct_{key}_peak"] = _round_shares(row, "flashledger", rounds)
            row[f"sdpa_pct_{key}_peak"] = _round_shares(row, "sdpa", rounds)
        else:
            row[f"{key}_peak_gflops"] = start
            row[f"pct_{key}_peak"] = None if not start else 100.0 * fl["fwdbwd_gflops"] / start
            row[f"sdpa_pct_{key}_peak"] = None if not start else 100.0 * sd["fwdbwd_gflops"] / start
    if fl["peak_extra_mb"] is not None and sd["peak_extra_mb"]:
        row["mem_ratio"] = fl["peak_extra_mb"] / sd["peak_extra_mb"]
    else:
        row["mem_ratio"] = None


# ----------------------------------------------------------------------------------------
# a busy machine
# ----------------------------------------------------------------------------------------
CONTENTION_CASES = ((1024, 128, 64), (1024, 128, None), (4096, 64, None))
"""(L, d, tiles) of the contention benchmark: the 64-wide tiles make many steps."""


@contextlib.contextmanager
def busy_process() -> Iterator[subprocess.Popen[bytes]]:
    """One other process keeping a core busy for as long as the block runs (``yes >
    /dev/null``, or a Python loop where there is no ``yes``)."""
    cmd = [shutil.which("yes") or sys.executable]
    if cmd[0] == sys.executable:
        cmd += ["-c", "while True: pass"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.2)  # let it start spinning
        yield proc
    finally:
        proc.kill()
        proc.wait()


def contention(repeats: int = 5) -> list[dict[str, Any]]:
    """Forward + backward of flashledger and SDPA (float32, B=1, H=4), on the quiet
    machine and with one other busy process, in alternating phases of interleaved
    rounds: each method's slowdown (median busy / median quiet) and their ratio."""
    rows = []
    for length, d, tile in CONTENTION_CASES:
        cfg = Config(
            length=length, dtype="float32", causal=False, head_dim=d, block_q=tile, block_k=tile
        )
        q, k, v, do = make_inputs(cfg)
        runners = {
            m: _fwdbwd_runner(attention_fn(m, cfg), q, k, v, do) for m in ("flashledger", "sdpa")
        }
        common: dict[str, Any] = dict(
            repeats=repeats,
            budget_s=30.0,
            reset=functools.partial(_clear_grads, q, k, v),
            advance=lambda _: None,
        )
        quiet: dict[str, list[float]] = {m: [] for m in runners}
        busy: dict[str, list[float]] = {m: [] for m in runners}
        for _ in range(2):  # alternate, so a drift of the machine hits both conditions
            for m, r in time_interleaved(runners, **common).items():
                quiet[m].append(r["median_s"])
            with busy_process():
                for m, r in time_interleaved(runners, **common).items():
                    busy[m].append(r["median_s"])
        row: dict[str, Any] = {
            "length": length,
            "head_dim": d,
            "tiles": tiles_label(cfg.tiles(forward=True), cfg.tiles()),
        }
        for m in runners:
            q_ms, b_ms = 1e3 * statistics.median(quiet[m]), 1e3 * statistics.median(busy[m])
            row[m] = {"quiet_ms": q_ms, "busy_ms": b_ms, "slowdown": b_ms / q_ms}
        row["slowdown_ratio"] = row["flashledger"]["slowdown"] / row["sdpa"]["slowdown"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------
# decode: a few query rows against a long KV cache
# ----------------------------------------------------------------------------------------
DECODE_LENGTHS = (1024, 8192, 32768)
DECODE_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DecodeConfig:
    """One decode configuration: ``lq`` new query rows against ``lk`` cached keys."""

    lk: int
    dtype: str
    batch: int = 1
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    lq: int = 1

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads_q * self.lq * self.lk * self.head_dim

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(5)
        dt = DTYPES[self.dtype]
        q = torch.randn(self.batch, self.heads_q, self.lq, self.head_dim, generator=gen, dtype=dt)
        k, v = (
            torch.randn(self.batch, self.heads_kv, self.lk, self.head_dim, generator=gen, dtype=dt)
            for _ in range(2)
        )
        return q, k, v


def decode_fn(method: str, cfg: DecodeConfig) -> Callable[..., torch.Tensor]:
    """``fn(q, k, v) -> o`` for decode: the new rows see every cached key up to their own
    position (causal, bottom-right: the KV-cache alignment), GQA without repeating K/V."""
    if method == "flashledger":
        mask = Causal("bottom_right")
        return lambda q, k, v: flash_attention(q, k, v, mask=mask)  # type: ignore[return-value]
    if method == "sdpa":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if cfg.lq == 1:  # one row sees the whole cache
            return lambda q, k, v: sdpa(q, k, v, enable_gqa=True)
        keep = torch.ones(cfg.lq, cfg.lk, dtype=torch.bool).tril(cfg.lk - cfg.lq)
        return lambda q, k, v: sdpa(q, k, v, attn_mask=keep, enable_gqa=True)
    raise ValueError(f"unknown decode method {method!r}; allowed: flashledger, sdpa")


DECODE_ROUND_S = 0.02  # the least time a decode round spends on each method


def calls_per_round(runners: dict[str, Callable[[], None]], least_s: float) -> int:
    """Calls of each runner per round so that the fastest one's round lasts ``least_s``
    (at least 1): a call of a fraction of a millisecond, timed alone, reads the clock's and
    the scheduler's noise as much as its own time. Each runner's pace is the median of its
    calls timed one by one after a warm-up call, at least three and until they have taken
    a quarter of ``least_s``: a first call that is still slow (cold caches) does not set it
    (from one timed call, rounds of 20 ms came out at 11-20 ms)."""
    fastest = math.inf
    for run in runners.values():
        run()
        times: list[float] = []
        while len(times) < 3 or sum(times) < least_s / 4:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        fastest = min(fastest, statistics.median(times))
    return max(1, math.ceil(least_s / max(fastest, 1e-9)))


def _repeated(run: Callable[[], None], calls: int) -> Callable[[], None]:
    def runs() -> None:
        for _ in range(calls):
            run()

    return runs


def decode(
    lengths: Sequence[int],
    dtypes: Sequence[str],
    batches: Sequence[int],
    *,
    repeats: int,
    memory: bool,
) -> list[dict[str, Any]]:
    """Decode (forward only, no grad) of flashledger and SDPA: interleaved rounds of
    ``calls_per_round`` calls of each method back to back, medians of the rounds' time
    per call; with ``memory`` the peak extra memory of each in a fresh process."""
    rows = []
    for dt in dtypes:
        for b in batches:
            for lk in lengths:
                cfg = DecodeConfig(lk=lk, dtype=dt, batch=b)
                q, k, v = cfg.inputs()
                runners = {
                    m: _fwd_runner(decode_fn(m, cfg), q, k, v) for m in ("flashledger", "sdpa")
                }
                with torch.no_grad():
                    o_fl, o_sdpa = (decode_fn(m, cfg)(q, k, v).float() for m in runners)
                diff = float((o_fl - o_sdpa).abs().max())
                calls = calls_per_round(runners, DECODE_ROUND_S)
                res = time_interleaved(
                    {m: _repeated(run, calls) for m, run in runners.items()},
                    repeats=repeats,
                    budget_s=30.0,
                    reset=lambda: None,
                    advance=lambda _: None,
                )
                row: dict[str, Any] = {
                    **asdict(cfg),
                    "max_abs_diff_o_vs_sdpa": diff,
                    "calls_per_round": calls,
                }
                for m, r in res.items():
                    per_call = r["median_s"] / calls
                    row[m] = {
                        "ms": 1e3 * per_call,
                        "gflops": cfg.flops / per_call / 1e9,
                        "peak_extra_mb": measure_decode_memory(m, cfg) / 2**20 if memory else None,
                    }
                row["ratio"] = row["flashledger"]["ms"] / row["sdpa"]["ms"]
                rows.append(row)
    return rows


FIXED_COST_LK = 64  # keys of the fixed-cost measurement: the arithmetic is a few microseconds


@contextlib.contextmanager
def native_pass_timer() -> Iterator[list[float]]:
    """Seconds of every native forward pass (``_native.ForwardPass.run`` or ``run_rows``:
    the C call, its scratch and results, the merge of key splits, and ``run_rows``'
    checks) run while the block is open, in this process; nothing when the native step
    is off."""
    spent: list[float] = []
    if _native.kernels() is None:
        yield spent
        return
    names = ("run", "run_rows")
    real = {name: getattr(_native.ForwardPass, name) for name in names}

    def timer(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(self: _native.ForwardPass, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)

        return timed

    for name in names:  # until the block ends
        setattr(_native.ForwardPass, name, timer(real[name]))
    try:
        yield spent
    finally:
        for name in names:
            setattr(_native.ForwardPass, name, real[name])


def decode_fixed_cost(
    dtypes: Sequence[str], batches: Sequence[int], *, rounds: int, calls: int
) -> list[dict[str, Any]]:
    """What a decode call costs around its arithmetic: one row against ``FIXED_COST_LK``
    keys, flashledger and SDPA interleaved in ``rounds`` rounds of ``calls`` calls each
    (their order alternating), medians in microseconds per call; ``native_pass_us`` is the
    time inside the native pass (operands laid out + the C call) and ``around_us`` the
    rest of flashledger's call (validation, schedule, ledger, merge, checks)."""
    rows = []
    for dt in dtypes:
        for b in batches:
            cfg = DecodeConfig(lk=FIXED_COST_LK, dtype=dt, batch=b)
            q, k, v = cfg.inputs()
            fns = {m: decode_fn(m, cfg) for m in ("flashledger", "sdpa")}
            per: dict[str, list[float]] = {"flashledger": [], "sdpa": [], "native_pass": []}
            with torch.no_grad():
                for fn in fns.values():
                    for _ in range(max(1, calls // 10)):  # warm-up: pools, caches, frames
                        fn(q, k, v)
                for r in range(rounds):
                    for m in fns if r % 2 == 0 else list(fns)[::-1]:
                        with native_pass_timer() as spent:
                            t0 = time.perf_counter()
                            for _ in range(calls):
                                fns[m](q, k, v)
                            per[m].append((time.perf_counter() - t0) / calls)
                        if m == "flashledger":
                            per["native_pass"].append(sum(spent) / calls if spent else math.nan)
            med = {m: 1e6 * statistics.median(t) for m, t in per.items()}
            native = not math.isnan(med["native_pass"])
            rows.append(
                {
                    **asdict(cfg),
                    "calls": calls,
                    "rounds": rounds,
                    "flashledger_us": med["flashledger"],
                    "sdpa_us": med["sdpa"],
                    "ratio": med["flashledger"] / med["sdpa"],
                    "native_pass_us": med["native_pass"] if native else None,
                    "around_us": med["flashledger"] - med["native_pass"] if native else None,
                }
            )
    return rows


def measure_decode_memory(method: str, cfg: DecodeConfig) -> int:
    """Peak extra resident bytes of one decode call, in a fresh interpreter."""
    code = (
        "import json, sys, torch; from flashledger import bench; "
        f"cfg = bench.DecodeConfig(**{asdict(cfg)!r}); "
        f"print(json.dumps(bench.decode_memory_here({method!r}, cfg)))"
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"memory measurement of {method} decode at Lk={cfg.lk} failed: {tail}")
    return int(json.loads(proc.stdout.strip().splitlines()[-1]))


def decode_memory_here(method: str, cfg: DecodeConfig) -> int:
    """Peak extra resident bytes of one decode call in this (fresh) process."""
    fn = decode_fn(method, cfg)
    with torch.no_grad():
        small = DecodeConfig(**{**asdict(cfg), "lk": 256})
        fn(*small.inputs())  # thread pools and workspaces are not the method's
        q, k, v = cfg.inputs()
        base = _status_kb("VmRSS") or _maxrss_kb()
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        fn(q, k, v)
    peak = _status_kb("VmHWM") or _maxrss_kb()
    return max(0, peak - base) * 1024


# ----------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio_cell(ratio: float, spread: Sequence[float] | None) -> str:
    """``0.91 (0.88-0.95)``: the ratio of the medians, and the rounds' paired ratios'
    range where there were several rounds."""
    if not spread or spread[0] == spread[1]:
        return f"{ratio:.2f}"
    return f"{ratio:.2f} ({spread[0]:.2f}-{spread[1]:.2f})"


def print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    peaks = report["gemm_peak_gflops"]
    table = Table(
        title="flashledger (FL) vs SDPA's CPU flash kernel: medians; ratio < 1: FL is faster "
        "(in brackets: the range of the rounds' ratios, each round's FL over its SDPA); "
        "tiles: forward/forward + backward where the forward has its own; "
        "matmuls alone: the tiles' matmuls as batched PyTorch calls, nothing else, / SDPA",
        caption=f"{report['machine']['cpu']} ({report['machine'].get('isa', '')}), "
        f"{report['machine']['threads']} threads{environment_note(report['machine'])}. "
        "% FMA and % GEMM: of the peaks timed in each round beside the attention (median of "
        "the rounds' shares; FMA/GEMM GFLOP/s: the rounds' median peaks). Peaks at the start of the run: FMA on registers "
        + ", ".join(f"{dt} {_fmt(v, '.0f')}" for dt, v in report.get("fma_peak_gflops", {}).items())
        + " GFLOP/s; PyTorch's 2048² matmul "
        + ", ".join(f"{dt} {v:.0f}" for dt, v in peaks.items())
        + "; the native step's matmul (512³ on every thread) "
        + ", ".join(f"{dt} {_fmt(v, '.0f')}" for dt, v in report["step_matmul_gflops"].items()),
    )
    cols = [
        "L", "dtype", "causal", "tiles", "fwd ms FL/SDPA", "ratio", "f+b ms FL/SDPA", "ratio",
        "matmuls alone f/f+b", "naive f+b ms", "GFLOP/s", "% FMA FL/SDPA", "% GEMM",
        "FMA/GEMM GFLOP/s", "% step mm", "MB FL/SDPA/naive", "ratio",
    ]  # fmt: skip
    rows = []
    for r in report["results"]:
        fl, sd, nv = r["flashledger"], r["sdpa"], r["naive"]
        rows.append(
            (
                str(r["length"]),
                r["dtype"],
                "yes" if r["causal"] else "no",
                tiles_label(
                    (
                        r.get("forward_block_q", r["block_q"]),
                        r.get("forward_block_k", r["block_k"]),
                    ),
                    (r["block_q"], r["block_k"]),
                ),
                f"{fl['fwd_ms']:.1f}/{sd['fwd_ms']:.1f}",
                _ratio_cell(r["ratio_fwd"], r.get("ratio_fwd_range")),
                f"{fl['fwdbwd_ms']:.1f}/{sd['fwdbwd_ms']:.1f}",
                _ratio_cell(r["ratio_fwdbwd"], r.get("ratio_fwdbwd_range")),
                f"{r['floor_fwd']:.2f}/{r['floor_fwdbwd']:.2f}",
                _fmt(None if nv is None else nv["fwdbwd_ms"], ".1f"),
                f"{fl['fwdbwd_gflops']:.0f}",
                _fmt(r.get("pct_fma_peak"), ".0f") + "/" + _fmt(r.get("sdpa_pct_fma_peak"), ".0f"),
                f"{r['pct_gemm_peak']:.0f}",
                _fmt(r.get("fma_peak_gflops"), ".0f")
                + "/"
                + _fmt(r.get("gemm_peak_gflops"), ".0f"),
                _fmt(r["pct_step_matmul"], ".0f"),
                "/".join(
                    _fmt(None if x is None else x["peak_extra_mb"], ".0f") for x in (fl, sd, nv)
                ),
                _fmt(r["mem_ratio"], ".2f"),
            )
        )
    for i, c in enumerate(cols):  # headers wrap; a cell stays on one line
        width = max([len(x[i]) for x in rows] + [len(w) for w in c.split()])
        table.add_column(c, justify="right", min_width=width)
    for row in rows:
        table.add_row(*row)
    console = make_console()
    console.print(table)
    console.print(report["machine"].get("native_step", ""))
    tr = report.get("traced")
    if tr:
        console.print(
            f"traced path (ledger records on), L={tr['length']}, d={tr['head_dim']}, "
            f"tiles {tr['block']}, causal, float64, forward + backward: "
            f"{tr['traced_ms']:.2f} ms vs {tr['fast_ms']:.2f} ms untraced "
            f"({tr['ratio']:.2f}x)"
        )


def plot(report: dict[str, Any], path: Path) -> bool:
    """Time and peak extra memory against L (log scales); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = report["results"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 8), squeeze=False)
    colors = {"flashledger": "tab:blue", "sdpa": "tab:orange", "naive": "tab:gray"}
    for col, dt in enumerate(dtypes):
        for causal, style in ((False, "-"), (True, "--")):
            sel = sorted(
                (r for r in rows if r["dtype"] == dt and r["causal"] == causal),
                key=lambda r: r["length"],
            )
            tiles = list(dict.fromkeys((r["block_q"], r["block_k"]) for r in sel))
            sel = [r for r in sel if (r["block_q"], r["block_k"]) == tiles[0]] if tiles else []
            if not sel:
                continue
            for m in METHODS:
                pts = [(r["length"], r[m]) for r in sel if r[m] is not None]
                if not pts:
                    continue
                label = f"{m}{' causal' if causal else ''}"
                xs = [p[0] for p in pts]
                axes[0][col].plot(
                    xs, [p[1]["fwdbwd_ms"] for p in pts], style, marker="o",
                    color=colors[m], label=label,
                )  # fmt: skip
                mem = [(x, e["peak_extra_mb"]) for x, e in pts if e["peak_extra_mb"]]
                if mem:
                    axes[1][col].plot(
                        [x for x, _ in mem], [y for _, y in mem], style, marker="o",
                        color=colors[m], label=label,
                    )  # fmt: skip
        for ax, ylabel in (
            (axes[0][col], "forward + backward (ms)"),
            (axes[1][col], "peak extra memory (MB)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        axes[0][col].set_title(f"{dt}: time (B=1, H={rows[0]['heads']}, d={rows[0]['head_dim']})")
        axes[1][col].set_title(f"{dt}: peak extra memory, forward + backward")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    png = figure_png(fig)
    plt.close(fig)
    write_file(path, png)
    return True


# ----------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------
MAX_LENGTH = 65536
"""Longest sequence of the attention benchmark (SDPA alone takes minutes a call beyond)."""
MAX_DECODE_LENGTH = 262144
"""Longest KV cache of the decode benchmark (B = 8 in float32: 8.6 GiB of keys and values)."""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(_positive_int(x) for x in text.split(","))
    except argparse.ArgumentTypeError:
        vals = ()
    if not vals:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers in 1..{MAX_DECODE_LENGTH} (no empty item; "
            f"the attention benchmark takes lengths up to {MAX_LENGTH}), got {shown(text)}"
        )
    return _once(vals, text)


def _once(vals: tuple[Any, ...], text: str, name: Callable[[Any], str] = str) -> tuple[Any, ...]:
    """``vals`` when no item repeats (a repeat would run and report a configuration twice)."""
    twice = sorted({name(x) for x in vals if vals.count(x) > 1})
    if twice:
        raise argparse.ArgumentTypeError(
            f"{', '.join(twice)} given more than once in {shown(text)}; name each once"
        )
    return vals


def _dtype_list(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(","))
    bad = [x for x in vals if x not in DTYPES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(DTYPES)}, got {shown(text)}"
        )
    return _once(vals, text)


def _causal(text: str) -> tuple[bool, ...]:
    choices = {"no": (False,), "yes": (True,), "both": (False, True)}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected no, yes or both, got {text!r}")
    return choices[text]


def _tiles(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in text.split(","):
        bits = part.strip().lower().split("x")
        try:
            bq, bk = (_positive_int(bits[0]), _positive_int(bits[1]))
        except (argparse.ArgumentTypeError, IndexError):
            bq = bk = 0
        if len(bits) != 2 or not bq:
            raise argparse.ArgumentTypeError(
                f"expected tiles as BQxBK (integers in 1..{MAX_SIZE}), comma-separated, "
                f"got {shown(text)}"
            )
        out.append((bq, bk))
    return _once(tuple(out), text, lambda t: f"{t[0]}x{t[1]}")


_positive_int = int_arg(1)


def _positive_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        val = -1.0
    if not (val > 0 and math.isfinite(val)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return val


def _out_dir(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; name the directory for the results")
    return Path(text)


def _unused_options(args: argparse.Namespace) -> list[str]:
    """The options given (away from their defaults) that the benchmark asked for does not
    read: ``--calls`` is ``--decode``'s; ``--decode`` has its own heads, head dim, batch
    and no tiles or mask; ``--contention`` its own fixed set."""
    defaults = argparse.ArgumentParser()
    add_cli_arguments(defaults)
    base = vars(defaults.parse_args([]))
    shape = ["causal", "batch", "heads", "head_dim", "tiles", "budget_s"]
    naive = ["naive_max_length", "naive_max_gb", "no_naive"]
    if args.decode:
        unread = [*shape, *naive]
    elif args.contention:
        unread = ["lengths", "dtypes", *shape, *naive, "no_memory", "calls"]
    else:
        unread = ["calls", *(naive[:2] if args.no_naive else [])]
    return [
        "--" + name.replace("_", "-")
        for name in unread
        if getattr(args, name) != base[name] and not (name == "calls" and args.decode)
    ]


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashledger bench``."""
    parser.add_argument(
        "--lengths", type=_int_list, default=None, metavar="L,L,...",
        help="sequence lengths (Lq = Lk) (default: "
        f"{','.join(map(str, FULL_LENGTHS))}; --decode: {','.join(map(str, DECODE_LENGTHS))})",
    )  # fmt: skip
    parser.add_argument(
        "--dtypes", type=_dtype_list, default=None, metavar="DT,...",
        help="any of float32, float64, bfloat16, float16 (comma-separated) (default: "
        f"{','.join(DEFAULT_DTYPES)}; --decode: {','.join(DECODE_DTYPES)})",
    )  # fmt: skip
    parser.add_argument(
        "--causal", type=_causal, default="both", metavar="no|yes|both",
        help="causal mask: no, yes or both",
    )  # fmt: skip
    parser.add_argument("--batch", type=_positive_int, default=1, help="batch size B")
    parser.add_argument("--heads", type=_positive_int, default=4, help="heads H")
    parser.add_argument("--head-dim", type=_positive_int, default=64, help="head dim d")
    parser.add_argument(
        "--tiles", type=_tiles, default=None, metavar="BQxBK,...",
        help="flashledger tile sizes (several: a tile sweep; default: the tiles the native "
        "step chose by measurement on this machine)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=_positive_int, default=None,
        help=f"timed rounds per configuration (default: {DEFAULT_REPEATS}; --quick: "
        f"{QUICK_REPEATS})",
    )  # fmt: skip
    parser.add_argument(
        "--budget-s", type=_positive_float, default=120.0, metavar="S",
        help="stop adding rounds (after 3) once a configuration's pass has taken this long",
    )  # fmt: skip
    parser.add_argument(
        "--naive-max-length", type=_positive_int, default=8192, metavar="L",
        help="skip the naive method above this length",
    )  # fmt: skip
    parser.add_argument(
        "--naive-max-gb", type=_positive_float, default=8.0, metavar="GB",
        help="skip the naive method when its matrices would need more than this",
    )  # fmt: skip
    parser.add_argument("--no-naive", action="store_true", help="skip the naive method")
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-memory subprocesses"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="one-minute subset: L = 1024, 2048, float32, both masks, 3 rounds (with "
        "--decode: Lk = 1024, 2048, float32); its own lengths and dtypes, so not with "
        "--lengths or --dtypes",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=_out_dir, default=Path("flashledger-bench"), metavar="DIR",
        help="directory for bench.json and bench.png (default ./flashledger-bench; the "
        "repository's published results are written with --out benchmarks/results)",
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report instead of the table"
    )
    parser.add_argument(
        "--decode", action="store_true",
        help="the decode benchmark instead: first the fixed cost of a call (Lq = 1 against "
        f"Lk = {FIXED_COST_LK}, --calls per round), then Lq = 1 against Lk = --lengths (default "
        f"{','.join(map(str, DECODE_LENGTHS))}), 32/8 heads, d = 128, B = 1 and 8, --dtypes "
        "(default float32,bfloat16), flashledger and SDPA in the same process; writes "
        "decode.json",
    )  # fmt: skip
    parser.add_argument(
        "--calls", type=_positive_int, default=200, metavar="N",
        help=f"--decode: calls per round of the fixed-cost measurement (Lk = {FIXED_COST_LK})",
    )  # fmt: skip
    parser.add_argument(
        "--contention", action="store_true",
        help="the busy-machine benchmark instead: forward + backward quiet and with one other "
        "busy process (yes > /dev/null), the slowdown of each method; writes contention.json",
    )  # fmt: skip
    parser.add_argument("--measure-memory", choices=METHODS, help=argparse.SUPPRESS)


def _resolve_sizes(args: argparse.Namespace) -> None:
    """``args.lengths``, ``dtypes``, ``repeats`` as given, or the defaults of the benchmark
    asked for (the attention benchmark, ``--decode``, either under ``--quick``)."""
    given = [f for f, v in (("--lengths", args.lengths), ("--dtypes", args.dtypes)) if v]
    if args.quick and given:
        raise ValueError(
            f"--quick runs its own subset (L = {', '.join(map(str, QUICK_LENGTHS))}, float32): "
            f"leave out {' and '.join(given)}, or drop --quick"
        )
    if args.quick and args.contention:
        raise ValueError("--quick is a subset of the attention and decode benchmarks, not of "
                         "--contention, which has its own fixed set")  # fmt: skip
    if args.lengths is None:
        lengths = DECODE_LENGTHS if args.decode else FULL_LENGTHS
        args.lengths = QUICK_LENGTHS if args.quick else lengths
    if args.dtypes is None:
        dtypes = DECODE_DTYPES if args.decode else DEFAULT_DTYPES
        args.dtypes = ("float32",) if args.quick else dtypes
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else DEFAULT_REPEATS


def run_cli(args: argparse.Namespace) -> int:
    """Run ``flashledger bench``; returns the exit status."""
    if args.measure_memory:
        if len(args.lengths or ()) != 1 or len(args.dtypes or ()) != 1 or len(args.causal) != 1:
            raise ValueError("--measure-memory needs exactly one length, dtype and causal setting")
        (bq, bk) = args.tiles[0] if args.tiles else (None, None)
        cfg = Config(
            length=args.lengths[0],
            dtype=args.dtypes[0],
            causal=args.causal[0],
            batch=args.batch,
            heads=args.heads,
            head_dim=args.head_dim,
            block_q=bq,
            block_k=bk,
        )
        print(json.dumps(measure_memory_here(args.measure_memory, cfg)))
        return 0
    if args.decode and args.contention:
        raise ValueError("--decode and --contention are two benchmarks: run one at a time")
    unused = _unused_options(args)
    if unused:
        which = (
            "--decode (Lq = 1, 32/8 heads, d = 128, B = 1 and 8, no mask or tiles)"
            if args.decode
            else "--contention (its own fixed set, --repeats rounds)"
            if args.contention
            else "--no-naive"
            if "--calls" not in unused
            else "this benchmark (--calls is --decode's)"
        )
        raise ValueError(
            f"{', '.join(unused)} would be ignored by {which}: drop "
            f"{'it' if len(unused) == 1 else 'them'}"
        )
    _resolve_sizes(args)
    top = MAX_DECODE_LENGTH if args.decode else MAX_LENGTH
    if max(args.lengths) > top:
        raise ValueError(
            f"--lengths: {max(args.lengths)} is over {top}, the longest "
            f"{'KV cache the decode benchmark' if args.decode else 'sequence this benchmark'} "
            f"runs; allowed: 1..{top}"
        )
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; it names the directory for bench.json/.png")
    try:  # before the run: a bad path fails now, not later
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the directory ({exc.strerror})") from None
    if args.decode or args.contention:
        return _run_side_benchmark(args, out)
    for name in ("bench.json", "bench.png"):
        problem = output_problem(out / name)
        if problem:
            raise ValueError(f"--out {out}: cannot write {name} there: {problem}")
    report = run_benchmark(args)
    write_file(out / "bench.json", (json.dumps(report, indent=2) + "\n").encode())
    plotted = plot(report, out / "bench.png")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
        note = (
            "" if plotted else " (no plot: install the plot extra, pip install 'flashledger[plot]')"
        )
        print(
            f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if plotted else "") + note
        )
    return 0


def _run_side_benchmark(args: argparse.Namespace, out: Path) -> int:
    """``--decode`` or ``--contention``: run it, print its table, write its JSON."""
    from rich.table import Table

    name = "decode.json" if args.decode else "contention.json"
    problem = output_problem(out / name)
    if problem:
        raise ValueError(f"--out {out}: cannot write {name} there: {problem}")
    machine = machine_info()
    head = f"{machine['cpu']} ({machine['isa']}), {machine['threads']} threads, torch {machine['torch']}"
    head += environment_note(machine)
    report: dict[str, Any] = {"machine": machine}
    tables: list[Any] = []
    if args.decode:
        lengths, dtypes = args.lengths, args.dtypes
        fixed = decode_fixed_cost(dtypes, (1, 8), rounds=args.repeats, calls=args.calls)
        report["fixed_cost"] = fixed
        tables.append(_fixed_cost_table(fixed, head))
        rows = decode(lengths, dtypes, (1, 8), repeats=args.repeats, memory=not args.no_memory)
        table = Table(
            title="decode: Lq = 1 against a KV cache of Lk keys, 32 query / 8 K/V heads, d = 128; "
            "per call, medians of rounds of calls (each about "
            f"{DECODE_ROUND_S * 1e3:.0f} ms or more), ratio < 1: flashledger is faster",
            caption=head,
        )
        for c in ("Lk", "dtype", "B", "ms FL/SDPA", "ratio", "GFLOP/s FL/SDPA", "MB FL/SDPA"):
            table.add_column(c, justify="right")
        for r in rows:
            fl, sd = r["flashledger"], r["sdpa"]
            table.add_row(
                str(r["lk"]), r["dtype"], str(r["batch"]),
                f"{fl['ms']:.2f}/{sd['ms']:.2f}", f"{r['ratio']:.2f}",
                f"{fl['gflops']:.0f}/{sd['gflops']:.0f}",
                f"{_fmt(fl['peak_extra_mb'], '.1f')}/{_fmt(sd['peak_extra_mb'], '.1f')}",
            )  # fmt: skip
    else:
        rows = contention(args.repeats)
        table = Table(
            title="a busy machine: forward + backward (float32, B=1, H=4) quiet and with one "
            "other busy process; slowdown = busy / quiet; ratio = FL's slowdown / SDPA's",
            caption=head,
        )
        for c in (
            "L",
            "d",
            "tiles",
            "FL ms quiet/busy",
            "slowdown",
            "SDPA ms quiet/busy",
            "slowdown",
            "ratio",
        ):
            table.add_column(c, justify="right")
        for r in rows:
            fl, sd = r["flashledger"], r["sdpa"]
            table.add_row(
                str(r["length"]), str(r["head_dim"]), r["tiles"],
                f"{fl['quiet_ms']:.1f}/{fl['busy_ms']:.1f}", f"{fl['slowdown']:.2f}",
                f"{sd['quiet_ms']:.1f}/{sd['busy_ms']:.1f}", f"{sd['slowdown']:.2f}",
                f"{r['slowdown_ratio']:.2f}",
            )  # fmt: skip
    report["results"] = rows
    tables.append(table)
    write_file(out / name, (json.dumps(report, indent=2) + "\n").encode())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        console = make_console()
        for t in tables:
            console.print(t)
        print(f"wrote {out / name}")
    return 0


def _fixed_cost_table(rows: list[dict[str, Any]], caption: str) -> Any:
    from rich.table import Table

    table = Table(
        title=f"decode's fixed cost: Lq = 1 against Lk = {FIXED_COST_LK} keys (a few microseconds "
        "of arithmetic), 32 query / 8 K/V heads, d = 128; microseconds per call, medians; "
        "native pass = operands laid out + the C call, around = the rest of the call",
        caption=caption,
    )
    for c in ("dtype", "B", "us FL/SDPA", "ratio", "native pass", "around", "FL - SDPA"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(
            r["dtype"], str(r["batch"]), f"{r['flashledger_us']:.0f}/{r['sdpa_us']:.0f}",
            f"{r['ratio']:.2f}", _fmt(r["native_pass_us"], ".0f"), _fmt(r["around_us"], ".0f"),
            f"{r['flashledger_us'] - r['sdpa_us']:.0f}",
        )  # fmt: skip
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flashledger.bench``: the same options as ``flashledger bench``."""
    parser = argparse.ArgumentParser(prog="python -m flashledger.bench", description=__doc__)
    add_cli_arguments(parser)
    try:
        return run_cli(parser.parse_args(argv))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"python -m flashledger.bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
