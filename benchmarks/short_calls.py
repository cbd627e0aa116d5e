"""Short unobserved forwards: the planned lane against the general path and SDPA.

A call nobody observes (no gradient, no ledger sink, no trace) of at most
``flashledger._lane.LANE_ROWS`` query rows runs a pass planned once per shape; the same
call with a ledger sink runs the general path, which plans it on every call. Both run
the same native pass (their results are equal bit for bit, checked here), so their
ratio is the per-call work around the pass. Each length: the three calls interleaved
round by round (order alternating), medians of the per-round ratios. B = 1, under
``no_grad``, no mask and causal.

    .venv/bin/python benchmarks/short_calls.py
    .venv/bin/python benchmarks/short_calls.py --lengths 64,512 --heads 32 --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashledger import bench
from flashledger.autograd import _FlashAttention
from flashledger.conventions import SEED
from flashledger.masks import Causal

CALLS = ("lane", "general", "sdpa")


def _calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> dict[str, Any]:
    opts = dict(conventions=SEED, block_q=None, block_k=None, loop_order="fa2")
    opts["mask"] = Causal("bottom_right") if causal else None

    def lane() -> tuple[torch.Tensor, torch.Tensor]:
        return _FlashAttention.apply(q, k, v, None, opts)

    def general() -> tuple[torch.Tensor, torch.Tensor]:  # a sink observes: no plan kept
        return _FlashAttention.apply(q, k, v, None, opts, lambda ledger: None)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return {"lane": lane, "general": general, "sdpa": sdpa}


def measure(length: int, causal: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per call of each of ``CALLS`` at one length, interleaved, and their ratios."""
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(length)
    q, k, v = (
        torch.randn(1, args.heads, length, args.head_dim, generator=gen, dtype=dtype)
        for _ in range(3)
    )
    calls: dict[str, Callable[[], Any]] = _calls(q, k, v, causal)
    rounds = args.rounds or max(10, min(200, int(2e9 / (length**2 * args.heads * args.head_dim))))
    times: dict[str, list[float]] = {n: [] for n in CALLS}
    with torch.no_grad():
        (o, lse), (o_ref, lse_ref) = calls["lane"](), calls["general"]()
        if not (torch.equal(o, o_ref) and torch.equal(lse, lse_ref)):
            raise SystemExit(f"L = {length}: the lane's result differs from the general path's")
        for fn in calls.values():
            fn()
        for r in range(rounds):
            for n in CALLS if r % 2 == 0 else CALLS[::-1]:
                t0 = time.perf_counter()
                calls[n]()
                times[n].append(time.perf_counter() - t0)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    return {
        "length": length,
        "mask": "causal" if causal else "none",
        "rounds": rounds,
        "median_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "lane_over_sdpa": ratio("lane", "sdpa"),
        "general_over_sdpa": ratio("general", "sdpa"),
        "lane_over_general": ratio("lane", "general"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="64,128,256,512,1024,2048", help="Lq = Lk, comma-separated")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--rounds", type=int, default=0, help="rounds per length (0: by length)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths takes comma-separated integers, got {args.lengths!r}")
    if any(n < 1 for n in lengths) or args.heads < 1 or args.head_dim < 1:
        p.error("lengths, --heads and --head-dim must be at least 1")
    machine = bench.machine_info()
    print(
        f"CPU: {machine['cpu']} ({machine['cpu_id']}, {machine['isa']}), "
        f"{machine['threads']} threads, torch {machine['torch']}"
    )
    print(f"B = 1, H = {args.heads}, d = {args.head_dim}, {args.dtype}, no_grad")
    print("     L  mask   | lane/SDPA  general/SDPA  lane/general | lane ms  general ms  SDPA ms")
    rows = []
    for causal in (False, True):
        for length in lengths:
            row = measure(length, causal, args)
            ms = row["median_ms"]
            print(
                f"{length:6d}  {row['mask']:<6} | {row['lane_over_sdpa']:9.2f}  "
                f"{row['general_over_sdpa']:12.2f}  {row['lane_over_general']:12.2f} | "
                f"{ms['lane']:7.3f}  {ms['general']:9.3f}  {ms['sdpa']:7.3f}",
                flush=True,
            )
            rows.append(row)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"machine": machine, "settings": vars(args), "rows": rows}, fh, indent=2)
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
