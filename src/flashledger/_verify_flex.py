"""Verify rows for FlexAttention's programming model (``mask_mod``, ``score_mod``, ``BlockMask``).

Cases of the kinds attention-gym collects (causal, sliding window, prefix LM,
document packing, dilated window, 2-D neighbourhood, ALiBi, tanh softcap, a
learnable relative-position table, combinations, a fully-masked row), each
with its own inputs drawn from a fixed seed. Six checks per case:

- ``flashledger Flex fwd``: flashledger's ``flex_attention`` (its tiles
  64 x 32 against the block mask's 128 x 128) against torch's FlexAttention
  eager forward on CPU, float64: O and LSE within ``FORWARD_BOUND`` (normwise:
  ``|a - b| <= bound * max(1, max|b|)``);
- ``flashledger Flex max``: its ``max_scores`` (``return_aux``; torch's CPU path
  refuses them) against the dense final scores' row maxima, within
  ``FORWARD_BOUND``;
- ``flashledger MaskMod``: the same forward through ``flash_attention`` with
  ``MaskMod(mask_mod)`` (the mask_mod classified blockwise, tiles the other way round);
- ``flashledger Flex grads``: its gradients (q, k, v and the tensors the
  score_mod captures) against a dense float64 autograd oracle that calls the
  mods under ``torch.vmap``, as Flex's eager path does, within
  ``BACKWARD_BOUND``;
- ``MaskMod tiles``: ``MaskMod(mask_mod)``'s tile classes against those of
  ``create_block_mask`` for the same tiles (a ragged edge tile demoted to
  partial, as Flex pads with False);
- ``fl.create_block_mask``: the ``BlockMask`` it builds against torch's
  ``create_block_mask``'s (16 x 32 blocks): every block's kind, then every
  index tensor equal.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._maskmod import MaskMod
from ._mods import MaskModFn, ScoreModFn, _vmapped
from ._verify_report import VerifyRow, count_row
from ._verify_systems import block_mask_classes, padded_as_flex
from .autograd import flash_attention
from .conventions import FLEX_ATTENTION

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "BACKWARD_BOUND",
    "FORWARD_BOUND",
    "FlexCase",
    "dense_flex",
    "dense_scores",
    "flex_cases",
    "flex_rows",
]

FORWARD_BOUND = 1e-12
"""flashledger's float64 O and LSE against torch's FlexAttention (normwise)."""
BACKWARD_BOUND = 1e-11
"""flashledger's float64 gradients against the dense autograd oracle (normwise)."""
TILES = (64, 32)
"""flashledger's tiles in these rows (the block masks keep Flex's 128 x 128)."""

Tensor = torch.Tensor


@dataclass(frozen=True)
class FlexCase:
    """One FlexAttention problem: shapes, mods and the tensors the score_mod learns."""

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    mask_mod: MaskModFn | None
    score_mod: ScoreModFn | None
    learned: tuple[Tensor, ...] = ()  # captured by the score_mod, requiring grad
    seed: int = 0

    def inputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``q, k, v, do`` in float64 from the case's seed."""
        g = torch.Generator().manual_seed(1000 + self.seed)
        b, hq, hk, lq, lk, d = (
            self.batch, self.heads_q, self.heads_kv, self.len_q, self.len_k, self.head_dim,
        )  # fmt: skip
        f64 = torch.float64
        return (
            torch.randn(b, hq, lq, d, generator=g, dtype=f64),
            torch.randn(b, hk, lk, d, generator=g, dtype=f64),
            torch.randn(b, hk, lk, d, generator=g, dtype=f64),
            torch.randn(b, hq, lq, d, generator=g, dtype=f64),
        )


def flex_cases(*, quick: bool) -> list[FlexCase]:
    """The cases: lengths that are no multiple of any tile, ``Lq != Lk``, GQA, batch 2."""
    g = torch.Generator().manual_seed(7)
    f64 = torch.float64
    out: list[FlexCase] = []
    lq, lk = 97, 113

    def add(name: str, mm: MaskModFn | None, sm: ScoreModFn | None, *learned: Tensor,
            batch: int = 2, hq: int = 4, hk: int = 2, q_len: int = lq, k_len: int = lk) -> None:  # fmt: skip
        out.append(FlexCase(name, batch, hq, hk, q_len, k_len, 8, mm, sm, learned, len(out)))

    def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return q >= kv

    def window(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (q - kv <= 20)

    prefix = torch.tensor([10, 60])

    def prefix_lm(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= prefix[b]) | (q >= kv)

    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 25, 40, lk - 95]))

    def document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (doc[q] == doc[kv]) & (q >= kv)

    def dilated(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        diff = q - kv
        return (diff >= 0) & (diff < 8 * 3) & (diff % 3 == 0)

    side = 7  # a 7 x 14 image of 98 tokens

    def neighbourhood(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        qx, qy, kx, ky = q // 14, q % 14, kv // 14, kv % 14
        return ((qx - kx).abs() <= 2) & ((qy - ky).abs() <= 2)

    def strict(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv < q  # row 0 sees no key

    slopes = torch.tensor([2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4], dtype=f64)

    def alibi(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + slopes[h] * (kv - q)

    def softcap(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return 2.0 * torch.tanh(s / 2.0)

    table = (0.3 * torch.randn(4, lq + lk, generator=g, dtype=f64)).requires_grad_(True)

    def rel_bias(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + table[h, q - kv + lk]

    learned_slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=f64, requires_grad=True)
    scale_param = torch.tensor(0.7, dtype=f64, requires_grad=True)
    derived = learned_slopes * scale_param  # a tensor derived from parameters

    def learned_alibi(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s - derived[h] * (q - kv).abs()

    def doc_rel_cap(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return 3.0 * torch.tanh((s + table[h, q - kv + lk]) / 3.0)

    # quick: three cases (each new pair of mods costs torch a compilation of its eager graph)
    add("document+table+softcap", document, doc_rel_cap, table)
    add("prefix LM+ALiBi", prefix_lm, alibi)
    add("strict causal+table", strict, rel_bias, table)  # row 0 sees no key
    if not quick:
        add("causal", causal, None)
        add("2-D neighbourhood", neighbourhood, None, q_len=side * 14, k_len=side * 14, hq=2, hk=2)
        add("sliding window", window, None)
        add("prefix LM", prefix_lm, None, batch=2)
        add("document", document, None)
        add("dilated window", dilated, None)
        add("ALiBi (causal)", causal, alibi)
        add("tanh softcap", None, softcap)
        add("table", None, rel_bias, table)
        add("derived ALiBi", window, learned_alibi, learned_slopes, scale_param)
        add("window+softcap", window, softcap, hq=4, hk=1)
        add("causal", causal, None, q_len=lk, k_len=lq)
    return out


def dense_scores(case: FlexCase, q: Tensor, k: Tensor, *, scale: float | None = None) -> Tensor:
    """The final scores ``(B, H, Lq, Lk)``, dense: through the score_mod, -inf where the
    mask_mod hides a key; the mods under ``torch.vmap`` (Flex's eager convention)."""
    kx = k.repeat_interleave(case.heads_q // case.heads_kv, dim=1)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ kx.transpose(-1, -2)) * sc  # (B, H, Lq, Lk)
    idx = [torch.arange(n) for n in s.shape]
    if case.score_mod is not None:
        s = _vmapped(case.score_mod, "score_mod")(s, *idx)
    if case.mask_mod is not None:
        s = s.masked_fill(~_vmapped(case.mask_mod, "mask_mod")(*idx), -math.inf)
    return s


def dense_flex(
    case: FlexCase, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """The dense float64 oracle: ``(O, LSE)`` with every score, the mods under ``torch.vmap``
    (Flex's eager convention), a fully-masked row O = 0 and LSE -inf; differentiable."""
    vx = v.repeat_interleave(case.heads_q // case.heads_kv, dim=1)
    s = dense_scores(case, q, k, scale=scale)  # (B, H, Lq, Lk)
    top = s.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(top)
    e = torch.exp(s - torch.where(empty, 0.0, top))
    ell = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(empty, 1.0, ell)
    lse = torch.where(empty, -math.inf, top + torch.log(ell)).squeeze(-1)
    return p @ vx, lse


def _rel_error(got: Tensor, want: Tensor) -> float:
    """``max |got - want| / max(1, max |want|)`` over the finite entries (equal infinities: 0)."""
    a, b = got.detach().double(), want.detach().double()
    same = a == b
    diff = torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=math.inf))
    finite = b[torch.isfinite(b)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return float(diff.max()) / scale if diff.numel() else 0.0


def _worst(pairs: list[tuple[str, Tensor, Tensor]]) -> tuple[str, float]:
    errors = [(name, _rel_error(a, b)) for name, a, b in pairs]
    return max(errors, key=lambda e: e[1])


def _row(
    system: str, case: FlexCase, checked: str, worst: tuple[str, float], bound: float
) -> VerifyRow:
    name, err = worst
    ok = err <= bound
    return VerifyRow(
        system=system,
        convention=FLEX_ATTENTION.name,
        case=f"{case.name} B{case.batch} H{case.heads_q}/{case.heads_kv} {case.len_q}x{case.len_k}",
        dtype="float64",
        checked=checked,
        worst=name,
        error=err,
        bound=bound,
        status="passed" if ok else "failed",
        unit="rel",
        detail="" if ok else f"{case.name}: {name} is {err:.3g} (normwise) from the reference",
    )


def _block_mask(case: FlexCase, block: int | tuple[int, int] = 128) -> BlockMask | None:
    from torch.nn.attention.flex_attention import create_block_mask

    if case.mask_mod is None:
        return None
    return create_block_mask(
        case.mask_mod, case.batch, None, case.len_q, case.len_k, device="cpu", BLOCK_SIZE=block
    )


def _torch_flex(case: FlexCase, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    from torch.nn.attention import flex_attention as flex

    bm = _block_mask(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            o, aux = flex.flex_attention(
                q, k, v, case.score_mod, bm, enable_gqa=True,
                return_aux=flex.AuxRequest(lse=True),
            )  # fmt: skip
    assert aux.lse is not None
    return o, aux.lse


def _tile_row(case: FlexCase) -> VerifyRow:
    """create_block_mask's classes for flashledger's tiles against ``MaskMod``'s."""
    assert case.mask_mod is not None
    bq, bk = TILES
    bm = _block_mask(case, (bq, bk))
    assert bm is not None
    theirs = block_mask_classes(bm)
    ours = MaskMod(case.mask_mod).tile_classes(
        case.len_q, case.len_k, bq, bk, batch=case.batch, heads=case.heads_q
    )
    ours = padded_as_flex(ours, case.len_q, case.len_k, bq, bk)
    diff = int((ours != theirs).sum())
    return count_row(
        "MaskMod tiles", FLEX_ATTENTION.name, f"{case.name} {case.len_q}x{case.len_k} @{bq}x{bk}",
        "tile classes", diff, f"{diff} tiles differ: {theirs.tolist()} vs {ours.tolist()}" if diff else "",
    )  # fmt: skip


def _block_mask_row(case: FlexCase) -> VerifyRow:
    """``fl.create_block_mask`` against torch's ``create_block_mask``: the blocks' kinds,
    then the index tensors' layout (every field equal)."""
    from ._blockmask import create_block_mask
    from ._maskmod import block_grid

    assert case.mask_mod is not None
    block = (16, 32)  # blocks small enough for the cases' lengths to hold every kind
    theirs = _block_mask(case, block)
    ours = create_block_mask(
        case.mask_mod, case.batch, None, case.len_q, case.len_k, device="cpu", BLOCK_SIZE=block
    )
    assert theirs is not None
    a, b = block_grid(ours), block_grid(theirs)
    diff = int((a != b).sum()) if a.shape == b.shape else max(a.numel(), b.numel())
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")  # fmt: skip
    unequal = [
        f
        for f in fields
        if (getattr(ours, f) is None) != (getattr(theirs, f) is None)
        or (getattr(ours, f) is not None and not torch.equal(getattr(ours, f), getattr(theirs, f)))
    ]
    detail = ""
    if diff:
        detail = f"{diff} blocks differ in kind: {a.tolist()} vs {b.tolist()}"
    elif unequal:
        detail = f"the same blocks, laid out differently in {', '.join(unequal)}"
    where = f"{case.name} {case.len_q}x{case.len_k} @{block[0]}x{block[1]}"
    return count_row("fl.create_block_mask", FLEX_ATTENTION.name, where, "BlockMask", diff, detail)


def flex_rows(*, quick: bool) -> list[VerifyRow]:
    """The forward, backward and tile rows of every case (see the module docstring)."""
    from torch.nn.attention.flex_attention import AuxRequest

    from ._flex import flex_attention

    rows = []
    for case in flex_cases(quick=quick):
        q, k, v, do = case.inputs()
        bm = _block_mask(case)
        o_t, lse_t = _torch_flex(case, q, k, v)
        lq, lk, lv = (x.clone().requires_grad_(True) for x in (q, k, v))
        leaves = [lq, lk, lv]
        o, aux = flex_attention(
            lq, lk, lv, case.score_mod, bm, enable_gqa=True,
            return_aux=AuxRequest(lse=True, max_scores=True), block_q=TILES[0], block_k=TILES[1],
        )  # fmt: skip
        lse = aux.lse
        rows.append(
            _row("flashledger Flex fwd", case, "O LSE",
                 _worst([("O", o, o_t), ("LSE", lse, lse_t)]), FORWARD_BOUND)
        )  # fmt: skip
        with torch.no_grad():  # torch's CPU path refuses max_scores: the dense scores decide
            top = dense_scores(case, q, k).amax(dim=-1)  # (B, H, Lq)
        rows.append(
            _row("flashledger Flex max", case, "max_scores",
                 _worst([("max", aux.max_scores, top)]), FORWARD_BOUND)
        )  # fmt: skip
        # the same through flash_attention with MaskMod (the mask_mod classified blockwise),
        # tiles the other way round
        o2, lse2 = flash_attention(
            q, k, v, mask=None if case.mask_mod is None else MaskMod(case.mask_mod),
            score_mod=case.score_mod, conventions=FLEX_ATTENTION, block_q=TILES[1],
            block_k=TILES[0], return_lse=True,
        )  # fmt: skip
        rows.append(
            _row("flashledger MaskMod", case, "O LSE",
                 _worst([("O", o2, o_t), ("LSE", lse2, lse_t)]), FORWARD_BOUND)
        )  # fmt: skip
        inputs = (*leaves, *case.learned)
        got = torch.autograd.grad(o, inputs, do, allow_unused=True, retain_graph=True)
        oq = [x.clone().requires_grad_(True) for x in (q, k, v)]
        want_o, _ = dense_flex(case, *oq)
        want = torch.autograd.grad(want_o, (*oq, *case.learned), do, allow_unused=True)
        names = ["dQ", "dK", "dV"] + [f"dC{i}" for i in range(len(case.learned))]
        pairs = [
            (n, a if a is not None else torch.zeros(1), b if b is not None else torch.zeros(1))
            for n, a, b in zip(names, got, want)
        ]
        rows.append(
            _row("flashledger Flex grads", case, " ".join(names), _worst(pairs), BACKWARD_BOUND)
        )
        if case.mask_mod is not None:
            rows.append(_tile_row(case))
            rows.append(_block_mask_row(case))
    return rows
