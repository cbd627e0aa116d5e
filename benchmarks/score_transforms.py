"""Score transforms on the native step (ALiBi, a softcap, an additive bias) and a dense
boolean mask, against the plain call and the PyTorch step.

The native step computes ALiBi's term and a softcap in its passes and adds a bias's term
laid out per tile (``blocked._ScoreTerms``); this times forward + backward (causal, float32
by default) of

- the plain call (``mask=fl.Causal()``), the baseline of every ratio;
- ALiBi (``alibi_slopes=fl.alibi_slopes(H)``) on the native step and on the PyTorch step;
- a softcap (``softcap=30``, Gemma 2's attention cap) on both steps;
- a dense learnable bias ``(1, H, L, L)`` (its gradient too) on both steps;
- the causal mask given as a dense ``(L, L)`` bool tensor (the same visible keys as the
  plain call: what the dense form costs, its tile classes found from the tensor),

in interleaved rounds (each round's ratio against the same round's plain call; medians).

    python benchmarks/score_transforms.py --length 4096 --rounds 5
    python benchmarks/score_transforms.py --cases bias --rounds 7   # the bias alone
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import flashledger as fl
from flashledger import _calibrate, _native

CASES = ("ALiBi", "softcap", "bias", "dense mask")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-bias", action="store_true", help="skip the dense bias (L² memory)")
    parser.add_argument("--softcap", type=float, default=30.0, help="the softcap's c (> 0)")
    parser.add_argument(
        "--cases",
        nargs="*",
        choices=CASES,
        default=list(CASES),
        help="cases to time beside the plain call (default: all)",
    )
    args = parser.parse_args()
    if args.length < 1 or args.heads < 1 or args.dim < 1 or args.rounds < 1:
        parser.error("--length, --heads, --dim and --rounds must be positive integers")
    if not args.softcap > 0:
        parser.error(f"--softcap must be positive, got {args.softcap}")
    dt = getattr(torch, args.dtype)
    n, h, d = args.length, args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, dtype=dt).requires_grad_() for _ in range(3))
    do = torch.randn(1, h, n, d, generator=gen, dtype=dt)
    slopes = fl.alibi_slopes(h, dtype=dt)

    def fwd_bwd(**opts: Any) -> Callable[[], None]:
        wrt = [q, k, v] + ([opts["bias"]] if "bias" in opts else [])

        def run() -> None:
            o = fl.flash_attention(q, k, v, **{"mask": fl.Causal(), **opts})
            torch.autograd.grad(o, wrt, do)

        return run

    def on_pytorch_step(run: Callable[[], None]) -> Callable[[], None]:
        def off() -> None:
            with _native.disabled():
                run()

        return off

    cases = {"plain": fwd_bwd()}
    wanted = set(args.cases) - ({"bias"} if args.no_bias else set())
    if "ALiBi" in wanted:
        cases["ALiBi, native step"] = fwd_bwd(alibi_slopes=slopes)
        cases["ALiBi, PyTorch step"] = on_pytorch_step(fwd_bwd(alibi_slopes=slopes))
    if "softcap" in wanted:
        cases["softcap, native step"] = fwd_bwd(softcap=args.softcap)
        cases["softcap, PyTorch step"] = on_pytorch_step(fwd_bwd(softcap=args.softcap))
    if "bias" in wanted:
        bias = torch.randn(1, h, n, n, generator=gen, dtype=dt).requires_grad_()
        cases["bias, native step"] = fwd_bwd(bias=bias)
        cases["bias, PyTorch step"] = on_pytorch_step(fwd_bwd(bias=bias))
    if "dense mask" in wanted:
        dense = torch.ones(n, n, dtype=torch.bool).tril()  # causal, as a tensor
        cases["dense mask, native"] = fwd_bwd(mask=dense)
    for run in cases.values():  # warm-up (and the native step's build)
        run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    print(
        f"score transforms, forward + backward, causal: L={n} H={h} d={d} {args.dtype}, "
        f"{args.rounds} rounds; {_calibrate.cpu_model() or platform.machine()}, "
        f"{torch.get_num_threads()} threads"
    )
    base = times["plain"]
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        print(
            f"{name:<22} {statistics.median(ts) * 1e3:9.1f} ms  "
            f"{statistics.median(ratios):6.2f} x plain  (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
