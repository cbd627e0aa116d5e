"""The ``ring`` command: run the in-process twin, print its ledger and the oracle check.

``add_cli_arguments(parser)`` adds the options to an ``argparse`` parser;
``run_cli(args)`` runs them and returns the exit status (0 when every result
matches the float64 dense oracle and the communication equals its closed
form, 1 otherwise). Bad option values raise ``ValueError`` naming the option
and what it allows.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from ._checks import check_size
from ._limits import check_fits
from ._progress import int_arg, join_dash_values
from ._ring_core import simulate_ring
from ._ring_layout import LAYOUTS, num_chunks
from .conventions import PRESETS, preset_arg
from .ledger import jsonable
from .masks import Causal, Mask, SlidingWindow
from .reference import reference_backward, reference_forward

__all__ = ["add_cli_arguments", "run_cli"]

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_TOL = {"float64": 1e-10, "float32": 1e-4}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ring command (``--world 4 --layout zigzag --seq 64 --d 16 --causal``)."""
    parser.add_argument("--world", type=int_arg(1), default=4, help="number of ranks W (default 4)")
    parser.add_argument(
        "--layout", choices=LAYOUTS, default="zigzag", help="sharding layout (default zigzag)"
    )
    parser.add_argument(
        "--seq", type=int_arg(1), default=64, help="query sequence length Lq (default 64)"
    )
    parser.add_argument(
        "--seq-k", type=int_arg(1), default=None, help="key sequence length Lk (default: Lq)"
    )
    parser.add_argument("--d", type=int_arg(1), default=16, help="head dim d (default 16)")
    parser.add_argument("--d-v", type=int_arg(1), default=None, help="value head dim (default: d)")
    parser.add_argument("--batch", type=int_arg(1), default=1, help="batch size B (default 1)")
    parser.add_argument("--heads", type=int_arg(1), default=1, help="query heads (default 1)")
    parser.add_argument(
        "--kv-heads", type=int_arg(1), default=None, help="key/value heads, divides --heads (GQA)"
    )
    parser.add_argument("--causal", action="store_true", help="causal mask")
    parser.add_argument(
        "--align",
        choices=("top_left", "bottom_right"),
        default=None,
        help="causal / window alignment when Lq != Lk (default: the conventions')",
    )
    parser.add_argument(
        "--window",
        default=None,
        metavar="LEFT,RIGHT",
        help="sliding window, keys c-LEFT..c+RIGHT (-1 = unbounded), e.g. 8,0",
    )
    parser.add_argument("--block-q", type=int_arg(1), default=8, help="query tile rows (default 8)")
    parser.add_argument(
        "--block-k", type=int_arg(1), default=8, help="key tile columns (default 8)"
    )
    parser.add_argument(
        "--conventions", type=preset_arg, default="seed", metavar="PRESET",
        help=f"conventions preset: {', '.join(sorted(PRESETS))} (default seed)",
    )  # fmt: skip
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability p")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float64", help="input dtype")
    parser.add_argument("--seed", type=int_arg(0), default=0, help="seed of the random inputs")
    parser.add_argument(
        "--forward-only", action="store_true", help="skip the backward pass (no gradients)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _mask(args: argparse.Namespace) -> Mask | None:
    if args.align is not None and not args.causal and args.window is None:
        raise ValueError(
            f"--align {args.align} aligns a causal mask or a window, and there is neither: it "
            "would be ignored; add --causal or --window LEFT,RIGHT, or drop --align"
        )
    mask: Mask | None = Causal(align=args.align) if args.causal else None
    if args.window is not None:
        parts = str(args.window).split(",")
        try:
            left, right = (int(p) for p in parts)
        except ValueError:
            raise ValueError(
                f"--window must be two integers LEFT,RIGHT (-1 = unbounded), got {args.window!r}"
            ) from None
        for side, value in (("LEFT", left), ("RIGHT", right)):
            if value < -1:
                raise ValueError(
                    f"--window {side} must be -1 (unbounded) or an integer >= 0, got {value}"
                )
        win = SlidingWindow(left, right, align=args.align)
        mask = win if mask is None else mask & win
    return mask


def _worst(a: torch.Tensor, b: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Largest |a - b| and its index; equal infinities count as 0."""
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(a), (a - b).abs()).nan_to_num(nan=float("inf"))
    flat = int(diff.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return float(diff.reshape(-1)[flat]), idx


def run_cli(args: argparse.Namespace) -> int:
    """Run the twin with ``args`` (from a parser given ``add_cli_arguments``); print; exit code."""
    w = check_size("--world", args.world)
    if args.layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, got {args.layout!r}")
    n = num_chunks(w, args.layout)
    lq = check_size("--seq", args.seq)
    lk = lq if args.seq_k is None else check_size("--seq-k", args.seq_k)
    for name, length in (("--seq", lq), ("--seq-k", lk)):
        if length < n:
            raise ValueError(
                f"{name} must be >= {n}: the {args.layout} layout on {w} ranks cuts the "
                f"sequence into {n} chunks of at least one position, got {length}"
            )
    d = check_size("--d", args.d)
    dv = d if args.d_v is None else check_size("--d-v", args.d_v)
    b = check_size("--batch", args.batch)
    hq = check_size("--heads", args.heads)
    hkv = hq if args.kv_heads is None else check_size("--kv-heads", args.kv_heads)
    if hq % hkv != 0:
        raise ValueError(f"--kv-heads ({hkv}) must divide --heads ({hq})")
    bq, bk = check_size("--block-q", args.block_q), check_size("--block-k", args.block_k)
    if args.dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {args.dtype!r}")
    if args.conventions not in PRESETS:
        raise ValueError(
            f"--conventions must be one of {', '.join(sorted(PRESETS))}, got {args.conventions!r}"
        )
    if not 0.0 <= float(args.dropout) < 1.0:
        raise ValueError(f"--dropout must be a number in [0, 1), got {args.dropout!r}")
    seed = check_size("--seed", args.seed, low=0)
    scores = b * hq * lq * lk  # the dense reference's: S, P and their gradients, float64
    check_fits(
        f"--seq {lq}: the dense reference the ring is checked against ({scores:,} scores)",
        4 * 8 * scores,
        "lower --seq, --seq-k, --heads or --batch",
    )
    mask = _mask(args)
    dt = _DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(b, hq, lq, d), rand(b, hkv, lk, d), rand(b, hkv, lk, dv)
    do = None if args.forward_only else rand(b, hq, lq, dv)
    opts: dict[str, Any] = dict(
        mask=mask, conventions=args.conventions, dropout_p=float(args.dropout), seed=seed
    )
    res = simulate_ring(
        q.to(dt),
        k.to(dt),
        v.to(dt),
        world_size=w,
        layout=args.layout,
        do=None if do is None else do.to(dt),
        block_q=bq,
        block_k=bk,
        **opts,
    )
    ref = reference_forward(q, k, v, **opts)
    diffs = {"o": _worst(res.o.double(), ref.o), "lse": _worst(res.lse.double(), ref.lse)}
    if do is not None:
        refb = reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
        for name, got, want in (
            ("dq", res.dq, refb.dq),
            ("dk", res.dk, refb.dk),
            ("dv", res.dv, refb.dv),
        ):
            assert got is not None
            diffs[name] = _worst(got.double(), want)
    tol = _TOL[args.dtype]
    comm_ok = res.ledger.comm_matches()
    ok = comm_ok and all(err <= tol for err, _ in diffs.values())
    if args.json:
        payload = {
            "ledger": res.ledger.to_dict(),
            "check": {
                "oracle": "float64 dense reference",
                "tolerance": tol,
                "max_abs_diff": {name: err for name, (err, _) in diffs.items()},
                "worst_index": {name: list(idx) for name, (_, idx) in diffs.items()},
                "comm_matches_closed_form": comm_ok,
            },
            "ok": ok,
        }
        print(json.dumps(jsonable(payload), indent=2))
        return 0 if ok else 1
    print(res.ledger)
    print()
    print(f"check against the float64 dense oracle (max |difference|, tolerance {tol:g})")
    for name, (err, idx) in diffs.items():
        verdict = "ok" if err <= tol else "FAIL"
        print(f"  {name:<4} {err:.3g} at {idx}  {verdict}")
    print(f"communication equals the closed form: {'yes' if comm_ok else 'NO'}")
    print(f"result: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def _main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashledger.ring", description="Ring attention, simulated in-process."
    )
    add_cli_arguments(parser)
    try:
        return run_cli(parser.parse_args(join_dash_values(sys.argv[1:], ("--window",))))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
