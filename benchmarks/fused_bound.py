"""How close any forward built from separate PyTorch kernels can come to SDPA.

The blocked forward's matmuls alone (the floor), then the floor with one more
PyTorch kernel per tile: ``amax`` (one read pass), ``softmax`` (PyTorch's most
fused element-wise kernel: max, exp, sum and normalisation in one call, more
than the online step needs) and in-place ``exp``. Each is timed against SDPA
and flashledger's own forward, round by round in one process (median of 5).

    .venv/bin/python benchmarks/fused_bound.py [L ...]     # default 4096 8192

B = 1, H = 4, d = 64, float32, no mask, 256 x 256 tiles.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable

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


def measure(length: int) -> dict[str, float]:
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
    lengths = [int(x) for x in argv] or [4096, 8192]
    print(f"forward, float32, B={B} H={H} d={D}, tiles {TILE}x{TILE}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for length in lengths:
        med = measure(length)
        print(f"\nL = {length}")
        for name, t in med.items():
            print(f"  {name:14s} {t * 1e3:8.1f} ms   {t / med['sdpa']:.3f} x SDPA")


if __name__ == "__main__":
    main(sys.argv[1:])
