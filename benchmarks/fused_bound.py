"""How close any forward built from separate PyTorch kernels can come to SDPA.

The blocked forward's matmuls alone (the floor), then the floor with one more
PyTorch kernel per tile: ``amax`` (one read pass), ``softmax`` (PyTorch's most
fused element-wise kernel: max, exp, sum and normalisation in one call, more
than the online step needs) and in-place ``exp``. Last, when a C compiler is
at hand, a complete online forward whose element-wise step is one native
function (C, OpenMP over rows, glibc's vectorised ``exp2f``: row max, rescale
factor, exponentials and row sum in one pass per row; no mask, no ledger),
the cheapest step a Python-driven loop of matmuls could call. Each is timed
against SDPA and flashledger's own forward, round by round in one process
(median of 5).

    .venv/bin/python benchmarks/fused_bound.py [L ...]     # default 4096 8192

B = 1, H = 4, d = 64, float32, no mask, 256 x 256 tiles.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import flashledger as fl

B, H, D, TILE, ROUNDS = 1, 4, 64, 256, 5


def tile_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v_t: torch.Tensor,
    step: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[], None]:
    """The forward's two matmuls per tile with ``step`` between them (no online state)."""
    n, length, d = q.shape
    s = torch.empty(n, TILE, TILE)  # S (B·H, bq, bk)
    alpha = 1.0 / math.sqrt(d)

    def run() -> None:
        for q0 in range(0, length, TILE):
            acc_t = torch.zeros(n, d, TILE)  # accᵀ (B·H, d, bq)
            for k0 in range(0, length, TILE):
                torch.baddbmm(s, q[:, q0 : q0 + TILE], k[:, k0 : k0 + TILE].mT, beta=0.0,
                              alpha=alpha, out=s)  # fmt: skip
                acc_t.baddbmm_(v_t[..., k0 : k0 + TILE], step(s).mT)

    return run


NATIVE_STEP = r"""
#include <math.h>
/* One online-softmax step on rows of a tile already scaled by scale·log2(e):
   m <- max(m, rowmax s); alpha = 2^(m_old - m); s <- 2^(s - m); ell <- alpha ell + rowsum s. */
void fwd_step(float *restrict s, float *restrict m, float *restrict ell, float *restrict alpha,
              long rows, long cols) {
    #pragma omp parallel for schedule(static)
    for (long r = 0; r < rows; ++r) {
        float *row = s + r * cols, top = -INFINITY, sum = 0.f;
        #pragma omp simd reduction(max : top)
        for (long j = 0; j < cols; ++j) top = row[j] > top ? row[j] : top;
        float m_new = m[r] > top ? m[r] : top, a = exp2f(m[r] - m_new);
        #pragma omp simd reduction(+ : sum)
        for (long j = 0; j < cols; ++j) { row[j] = exp2f(row[j] - m_new); sum += row[j]; }
        m[r] = m_new; ell[r] = a * ell[r] + sum; alpha[r] = a;
    }
}
"""


def native_forward(
    q: torch.Tensor, k: torch.Tensor, v_t: torch.Tensor, workdir: Path
) -> Callable[[], torch.Tensor] | None:
    """The online forward with the element-wise step in C; ``None`` without a C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src, lib_path = workdir / "step.c", workdir / "step.so"
    src.write_text(NATIVE_STEP)
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
    if subprocess.run([cc, *flags, str(src), "-o", str(lib_path), "-lmvec"]).returncode:
        return None
    lib = ctypes.CDLL(str(lib_path))
    lib.fwd_step.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2
    n, length, d = q.shape
    s = torch.empty(n, TILE, TILE)  # S (B·H, bq, bk), in log2 units
    c = math.log2(math.e) / math.sqrt(d)

    def run() -> torch.Tensor:
        o = torch.empty(n, length, d)  # (B·H, L, d)
        for q0 in range(0, length, TILE):
            acc_t = torch.zeros(n, d, TILE)  # accᵀ (B·H, d, bq)
            m = torch.full((n, TILE), -math.inf)  # (B·H, bq)
            ell, alpha = torch.zeros(n, TILE), torch.empty(n, TILE)  # (B·H, bq)
            for k0 in range(0, length, TILE):
                torch.baddbmm(s, q[:, q0 : q0 + TILE], k[:, k0 : k0 + TILE].mT, beta=0.0,
                              alpha=c, out=s)  # fmt: skip
                lib.fwd_step(s.data_ptr(), m.data_ptr(), ell.data_ptr(), alpha.data_ptr(),
                             n * TILE, TILE)  # fmt: skip
                acc_t.mul_(alpha[:, None, :]).baddbmm_(v_t[..., k0 : k0 + TILE], s.mT)
            o[:, q0 : q0 + TILE] = (acc_t / ell[:, None, :]).mT
        return o

    return run


def measure(length: int, workdir: Path) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    q4, k4, v4 = (torch.randn(B, H, length, D, generator=gen) for _ in range(3))
    q, k = q4.reshape(B * H, length, D), k4.reshape(B * H, length, D)
    v_t = v4.reshape(B * H, length, D).mT.contiguous()  # Vᵀ (B·H, d, L)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runners: dict[str, Callable[[], object]] = {
        "sdpa": lambda: sdpa(q4, k4, v4),
        "matmuls alone": tile_loop(q, k, v_t, lambda s: s),
        "+ amax": tile_loop(q, k, v_t, lambda s: (s.amax(dim=-1), s)[1]),
        "+ softmax": tile_loop(q, k, v_t, lambda s: torch.softmax(s, dim=-1)),
        "+ exp_": tile_loop(q, k, v_t, lambda s: s.exp_()),
        "flashledger": lambda: fl.flash_attention(q4, k4, v4),
    }
    native = native_forward(q, k, v_t, workdir)
    if native is not None:
        err = (native().view_as(q4) - sdpa(q4, k4, v4)).abs().max().item()
        assert err < 1e-5, f"the native step's output is off by {err:.3g}"
        runners["native C step"] = native
    else:
        print("  (no native C step: it needs a C compiler with OpenMP and glibc's libmvec)")
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.no_grad():
        for run in runners.values():
            run()
        for _ in range(ROUNDS):
            for name, run in runners.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "lengths", nargs="*", type=int, help=f"sequence lengths, multiples of {TILE} "
        "(default 4096 8192)"
    )  # fmt: skip
    lengths = ap.parse_args(argv).lengths or [4096, 8192]
    if any(n < TILE or n % TILE for n in lengths):
        ap.error(f"lengths must be multiples of {TILE}, got {lengths}")
    print(f"forward, float32, B={B} H={H} d={D}, tiles {TILE}x{TILE}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        meds = [(length, measure(length, Path(tmp))) for length in lengths]
    for length, med in meds:
        print(f"\nL = {length}")
        for name, t in med.items():
            print(f"  {name:14s} {t * 1e3:8.1f} ms   {t / med['sdpa']:.3f} x SDPA")


if __name__ == "__main__":
    main(sys.argv[1:])
