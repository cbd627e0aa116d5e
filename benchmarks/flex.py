"""FlexAttention's programming model in flashledger: what a mask_mod or score_mod costs.

Each case times forward + backward (``flash_attention``, float32 by default)
against its baseline in the same process, round by round (median of the
rounds), and prints the ratio with its target:

- ``MaskMod(causal)``: a causal mask_mod against ``fl.Causal()`` (target 1.2x);
- ``BlockMask(causal)``: ``fl.flex_attention`` with a ``create_block_mask`` block
  mask (made once, outside the timing, as Flex code does) against
  ``fl.Causal()`` (target 1.2x);
- ``MaskMod(document)``: causal attention inside packed documents as a mask_mod,
  against the same documents as variable-length sequences (``cu_seqlens``,
  ``fl.Causal()``) (target 1.2x); ``BlockMask(document)``: the same mask_mod
  through ``create_block_mask`` once (the classification then costs nothing per
  call);
- ``score_mod(rel. bias)``: a learnable relative-position bias table as a
  score_mod (with ``fl.Causal()``, gradients for the table too) against the
  plain causal path (target 3x);

(with the range of the rounds' own ratios, each round's flex time over that
round's baseline) and the cost of classifying the mask_mod's tiles alone (``MaskMod.tile_classes``)
and of torch's ``create_block_mask`` beside ``fl.create_block_mask`` (the same
``BlockMask``), for reference. For the score_mod case it also times the
score_mod's own work alone, as the step calls it (once per computed tile in the
forward, once with its vector-Jacobian product in the backward, on the step's tiles):
in eager PyTorch no implementation that calls the callable can take less, so that
time over the plain path's is a floor under the ratio, and with the attention's own
arithmetic on top (the plain path is the fastest flashledger has) the ratio is at least
that floor plus one. The score_mod case is also timed with the table read through
PyTorch's own indexing (``_gather.ENABLED = False``; by default flashledger runs a
score_mod's integer-array indexing as a gather whose gradient is a scatter-add), and
with that gather on ``torch.take`` instead of the native library's loop
(``_gather.NATIVE = False``), to show what each is worth.

    .venv/bin/python benchmarks/flex.py                  # L = 4096, H = 4, d = 64
    .venv/bin/python benchmarks/flex.py --length 1024 --rounds 3   # a quick look
    .venv/bin/python benchmarks/flex.py --torch-eager    # also torch's eager forward

Ratios, not times, are the result: measure on a quiet machine and name its CPU.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch

import flashledger as fl
from flashledger import _calibrate, _gather
from flashledger.bench import paired_ratios

TARGETS = {
    "MaskMod(causal)": 1.2,
    "BlockMask(causal)": 1.2,
    "MaskMod(document)": 1.2,
    "BlockMask(document)": 1.2,
    "score_mod(rel. bias)": 3.0,
}


def _timed(
    runners: dict[str, Callable[[], None]],
    rounds: int,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds of each runner: one warm-up each, then ``rounds`` rounds of all
    (each round's seconds go to ``samples`` when given)."""
    for run in runners.values():
        run()
    if samples is None:
        samples = {}
    samples.update({name: [] for name in runners})
    for _ in range(rounds):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def _fwd_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Callable[..., torch.Tensor]
) -> Callable[[], None]:
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]

    def run() -> None:
        for x in leaves:
            x.grad = None
        o = call(*leaves)
        o.backward(torch.ones_like(o))

    return run


def _score_mod_alone(
    score_mod: Callable[..., torch.Tensor],
    captured: torch.Tensor,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
) -> Callable[[], None]:
    """The score_mod's own work in a causal forward + backward, through the step's own
    calls (``_mods.UserScore``): on each causal tile of the PyTorch step's default size,
    once without gradients (``apply``, the forward) and once with its vector-Jacobian
    product for the scores and ``captured`` (``forward`` + ``vjp``, the backward)."""
    from flashledger._mods import UserScore
    from flashledger.blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

    h, n, _ = shape
    gen = torch.Generator().manual_seed(1)
    user = UserScore.bind(score_mod, batch=1, heads=h, dtype=dtype, device=torch.device("cpu"))
    user.use_captured((captured,))
    tiles = []
    for q0 in range(0, n, DEFAULT_BLOCK_Q):
        q1 = min(q0 + DEFAULT_BLOCK_Q, n)
        for k0 in range(0, q1, DEFAULT_BLOCK_K):  # causal: key tiles up to the diagonal
            k1 = min(k0 + DEFAULT_BLOCK_K, n)
            s = torch.randn(1, h, q1 - q0, k1 - k0, generator=gen, dtype=dtype)
            tiles.append((s, torch.arange(q0, q1), torch.arange(k0, k1)))

    def run() -> None:
        for s, rows, keys in tiles:
            user.apply(s, rows, keys)
        user.reset_grads()
        for s, rows, keys in tiles:
            _, ctx = user.forward(s, rows, keys)
            user.vjp(ctx, torch.ones_like(s))

    return run


def _with_gather(run: Callable[[], None], switch: str) -> Callable[[], None]:
    """``run`` with ``_gather.<switch>`` False: ``ENABLED`` (a score_mod's indexing
    through PyTorch's own ``__getitem__``) or ``NATIVE`` (the rewrite's gathers on
    ``torch.take`` and ``scatter_add_``)."""

    def off() -> None:
        setattr(_gather, switch, False)
        try:
            run()
        finally:
            setattr(_gather, switch, True)

    return off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--documents", type=int, default=8, help="packed documents")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--cases", nargs="*", choices=list(TARGETS), default=list(TARGETS), help="cases to run"
    )
    parser.add_argument(
        "--torch-eager",
        action="store_true",
        help="also time torch's eager flex_attention forward with the score_mod (3 rounds)",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    from torch.nn.attention.flex_attention import create_block_mask

    dt = getattr(torch, args.dtype)
    n, h, d = args.length, args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, dtype=dt) for _ in range(3))

    def causal(
        b: torch.Tensor, hh: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        return qi >= ki

    # documents of random lengths that tile the sequence
    cuts = torch.sort(torch.randperm(n - 1, generator=gen)[: args.documents - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]).to(torch.int32)
    doc = torch.repeat_interleave(torch.arange(args.documents), torch.diff(cu).long())

    def document(
        b: torch.Tensor, hh: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        return (doc[qi] == doc[ki]) & (qi >= ki)

    table = torch.zeros(h, 2 * n - 1, dtype=dt, requires_grad=True)

    def rel_bias(
        score: torch.Tensor, b: torch.Tensor, hh: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        return score + table[hh, qi - ki + n - 1]

    t0 = time.perf_counter()
    bm = create_block_mask(causal, None, None, n, n, device="cpu")
    t_create_first = time.perf_counter() - t0
    bm_doc = create_block_mask(document, None, None, n, n, device="cpu")
    classify = {"classify": lambda: fl.MaskMod(causal).tile_classes(n, n, 512, 512)}
    t_classify = _timed(classify, 5)["classify"]  # warmed up: the first call pays imports
    builders = {  # torch's eager create_block_mask and flashledger's, warmed up, interleaved
        f"{who} {name}": functools.partial(make, mm, None, None, n, n, device="cpu")
        for name, mm in (("causal", causal), ("document", document))
        for who, make in (("torch", create_block_mask), ("fl", fl.create_block_mask))
    }
    t_build = _timed(builders, 5)

    flash = fl.flash_attention
    cases: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
        "MaskMod(causal)": (
            _fwd_bwd(q, k, v, lambda a, b, c: flash(a, b, c, mask=fl.MaskMod(causal))),
            _fwd_bwd(q, k, v, lambda a, b, c: flash(a, b, c, mask=fl.Causal())),
        ),
        "BlockMask(causal)": (
            _fwd_bwd(q, k, v, lambda a, b, c: fl.flex_attention(a, b, c, block_mask=bm)),
            _fwd_bwd(q, k, v, lambda a, b, c: flash(a, b, c, mask=fl.Causal())),
        ),
        "MaskMod(document)": (
            _fwd_bwd(q, k, v, lambda a, b, c: flash(a, b, c, mask=fl.MaskMod(document))),
            _fwd_bwd(
                q[0],
                k[0],
                v[0],
                lambda a, b, c: flash(a, b, c, mask=fl.Causal(), cu_seqlens_q=cu, cu_seqlens_k=cu),
            ),
        ),
        "BlockMask(document)": (
            _fwd_bwd(q, k, v, lambda a, b, c: fl.flex_attention(a, b, c, block_mask=bm_doc)),
            _fwd_bwd(
                q[0],
                k[0],
                v[0],
                lambda a, b, c: flash(a, b, c, mask=fl.Causal(), cu_seqlens_q=cu, cu_seqlens_k=cu),
            ),
        ),
        "score_mod(rel. bias)": (
            _fwd_bwd(q, k, v, lambda a, b, c: flash(a, b, c, mask=fl.Causal(), score_mod=rel_bias)),
            _fwd_bwd(q, k, v, lambda a, b, c: flash(a, b, c, mask=fl.Causal())),
        ),
    }
    print(
        f"flashledger Flex benchmark: L={n} H={h} d={d} {args.dtype}, forward + backward, "
        f"median of {args.rounds}; {_calibrate.cpu_model() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, native step: {fl.native_status()}"
    )
    print(f"{'case':<22} {'baseline ms':>12} {'flex ms':>10} {'ratio':>7} {'target':>7}")
    floor = None
    for name, (run, base) in cases.items():
        if name not in args.cases:
            continue
        runners = {"flex": run, "base": base}
        if name == "score_mod(rel. bias)":
            runners["alone"] = _score_mod_alone(rel_bias, table, (h, n, d), dt)
            runners["take lane"] = _with_gather(run, "NATIVE")
            runners["pytorch indexing"] = _with_gather(run, "ENABLED")
        per: dict[str, list[float]] = {}
        got = _timed(runners, args.rounds, per)
        ratio = got["flex"] / got["base"]
        paired = paired_ratios(per["flex"], per["base"])
        ok = "ok" if ratio <= TARGETS[name] else "OVER"
        print(
            f"{name:<22} {got['base'] * 1e3:>12.1f} {got['flex'] * 1e3:>10.1f} "
            f"{ratio:>7.2f} {TARGETS[name]:>6.1f}x {ok}  (rounds {min(paired):.2f}-{max(paired):.2f})"
        )
        if "alone" in got:
            floor = (got["alone"], got["alone"] / got["base"])
        if "take lane" in got:
            take = got["take lane"]
            print(
                f"{'  gathers on torch.take':<22} {got['base'] * 1e3:>12.1f} "
                f"{take * 1e3:>10.1f} {take / got['base']:>7.2f}  (the native gather and "
                f"scatter-add off: {take / got['flex']:.2f}x the time with them)"
            )
        if "pytorch indexing" in got:
            plain_ix = got["pytorch indexing"]
            print(
                f"{'  with PyTorch indexing':<22} {got['base'] * 1e3:>12.1f} "
                f"{plain_ix * 1e3:>10.1f} {plain_ix / got['base']:>7.2f}  (the gather rewrite "
                f"off: {plain_ix / got['flex']:.2f}x the time with it)"
            )
    if floor is not None:
        print(
            f"the score_mod alone on the step's tiles (forward, and backward with its VJP): "
            f"{floor[0] * 1e3:.1f} ms, {floor[1]:.2f}x the plain path: a floor under its ratio"
        )
        print(
            f"with the attention's own arithmetic on top (at best the plain path's), a call "
            f"takes at least {floor[1] + 1:.2f}x the plain path"
        )
    if args.torch_eager:  # forwards only: torch's eager Flex has no backward on CPU
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        fwd = {
            "torch eager flex_attention": lambda: torch_flex(
                q, k, v, score_mod=rel_bias, block_mask=bm
            ),
            "fl.flex_attention": lambda: fl.flex_attention(
                q, k, v, score_mod=rel_bias, block_mask=bm
            ),
            "fl plain causal": lambda: flash(q, k, v, mask=fl.Causal()),
        }
        with torch.no_grad():
            got = _timed(fwd, 3)
        print(
            "forward alone, score_mod(rel. bias) with the causal BlockMask (median of 3): "
            + ", ".join(f"{name} {t * 1e3:.0f} ms" for name, t in got.items())
        )
    print(
        f"classifying MaskMod(causal) alone (512 x 512 tiles, median of 5): "
        f"{t_classify * 1e3:.1f} ms; torch's create_block_mask(causal), its first call: "
        f"{t_create_first * 1e3:.1f} ms"
    )
    for name in ("causal", "document"):
        t_torch, t_fl = t_build[f"torch {name}"], t_build[f"fl {name}"]
        print(
            f"create_block_mask({name}), 128-blocks, median of 5: torch {t_torch * 1e3:.1f} ms, "
            f"fl.create_block_mask {t_fl * 1e3:.1f} ms ({t_torch / t_fl:.0f}x faster; "
            "the same BlockMask)"
        )


if __name__ == "__main__":
    main()
