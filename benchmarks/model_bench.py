"""A whole transformers model with flashledger's attention against the same model with SDPA.

Two measurements, each in one process, the two backends interleaved round by
round (their order alternating), medians reported with their ratio:

1. training step: forward + backward of a random-initialised Llama
   (default 4 layers, hidden 512, 8 query / 2 key-value heads, sequence 2048,
   float32, batch 1; loss = next-token cross-entropy);
2. decode: greedy generation of 128 tokens after a 2048-token prompt with a
   KV cache (prefill included, as ``generate`` runs it; the prefill alone is
   timed too, so the decode steps' share can be read off).

It also checks that both backends give the same greedy tokens and prints the
CPU model, thread count and versions. A few seconds' run:

    .venv/bin/python benchmarks/model_bench.py --quick

The full measurement (about 5 minutes on 2 cores; run it on a quiet machine):

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/model_bench.py --rounds 5 \\
        --json benchmarks/results/model_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import flashledger as fl
from flashledger.integrations.transformers import random_model, register

BACKENDS = ("sdpa", "flashledger")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's word where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    runs: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds of each run per round, the runs alternating their order round by round."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            out[n].append(_timed(runs[n]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048, help="training sequence and prompt length")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after the prompt")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per backend")
    p.add_argument("--skip", choices=("train", "decode"), action="append", default=[])
    p.add_argument("--quick", action="store_true", help="a tiny configuration that runs in seconds")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.new_tokens, args.rounds = 2, 128, 256, 16, 3
    dtype = getattr(torch, args.dtype)
    name = register()
    build = dict(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=1024,
        max_positions=args.seq + args.new_tokens,
        dtype=dtype,
    )
    models = {
        "sdpa": random_model("llama", attn_implementation="sdpa", **build),
        "flashledger": random_model("llama", attn_implementation=name, **build),
    }
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1024, (1, args.seq), generator=gen)
    head = (
        f"Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
        f"{args.dtype}, batch 1 | CPU: {cpu_model()}, {torch.get_num_threads()} threads | "
        f"torch {torch.__version__}, native step: {fl.native_status()}"
    )
    print(head)
    report: dict[str, Any] = {"config": vars(args), "cpu": cpu_model(), "header": head}

    def table(title: str, times: dict[str, list[float]], target: float) -> None:
        med = {n: statistics.median(t) for n, t in times.items()}
        ratio = med["flashledger"] / med["sdpa"]
        print(f"\n{title}  (median of {args.rounds}, seconds)")
        for n in BACKENDS:
            spread = f"{min(times[n]):.3f}..{max(times[n]):.3f}"
            print(f"  {n:<12} {med[n]:8.3f}   [{spread}]")
        verdict = "within" if ratio <= target else "over"
        print(f"  flashledger / sdpa = {ratio:.3f}  ({verdict} the {target}x target)")
        report[title] = {"median_s": med, "rounds_s": times, "ratio": ratio, "target": target}

    if "train" not in args.skip:
        for m in models.values():
            m.train()

        def step(m: Any) -> Callable[[], None]:
            def run() -> None:
                m.zero_grad(set_to_none=True)
                m(input_ids=ids, labels=ids).loss.backward()

            return run

        times = interleaved({n: step(m) for n, m in models.items()}, args.rounds)
        table(f"forward + backward, seq {args.seq}", times, 1.05)
        for m in models.values():
            m.zero_grad(set_to_none=True)
            m.eval()

    if "decode" not in args.skip:
        tokens: dict[str, torch.Tensor] = {}

        def decode(n: str, m: Any, new: int) -> Callable[[], None]:
            def run() -> None:
                with torch.no_grad():
                    tokens[n] = m.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=new,
                        min_new_tokens=new,
                        do_sample=False,
                        pad_token_id=0,
                    )

            return run

        prefill = interleaved({n: decode(n, m, 1) for n, m in models.items()}, args.rounds)
        table(f"prefill {args.seq} (+1 token)", prefill, 1.05)
        times = interleaved(
            {n: decode(n, m, args.new_tokens) for n, m in models.items()}, args.rounds
        )
        table(f"generate {args.new_tokens} tokens after {args.seq}", times, 1.1)
        per = {
            n: (statistics.median(times[n]) - statistics.median(prefill[n])) / (args.new_tokens - 1)
            for n in BACKENDS
        }
        print(
            f"  decode step alone (generate - prefill) / {args.new_tokens - 1}: "
            f"sdpa {per['sdpa'] * 1e3:.2f} ms, flashledger {per['flashledger'] * 1e3:.2f} ms, "
            f"ratio {per['flashledger'] / per['sdpa']:.3f}"
        )
        same = bool(torch.equal(tokens["sdpa"], tokens["flashledger"]))
        print(f"  greedy tokens equal: {'yes' if same else 'no'}")
        report["decode_step_s"] = per
        report["tokens_equal"] = same

    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
        print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
