"""FlexAttention's programming model: ``mask_mod``, ``score_mod``, ``BlockMask``, ``flex_attention``.

Forward against torch's own FlexAttention (CPU eager) within 1e-12 in
float64; gradients (q, k, v and the tensors a score_mod captures) against the
dense autograd oracle of tests/naive.py (the mods called per element under
``torch.vmap``, as Flex's eager path calls them) within 1e-11. Mods of the
kinds attention-gym ships; lengths that are no multiple of any tile
(1, 97, 113; Lq != Lk), GQA, fully-masked rows.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import flex_visible, naive_flex, naive_flex_scores, tile_classes_from_dense

import flashledger as fl
from flashledger import _maskmod, masks
from flashledger._mods import find_captured

F64 = torch.float64
FWD = 1e-12
GRAD = 1e-11
Tensor = torch.Tensor

flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "flex_attention called without torch.compile"
        yield


# ----------------------------------------------------------------------------------------
# mods of the kinds attention-gym ships
# ----------------------------------------------------------------------------------------
def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return q >= kv


def sliding_window(size: int) -> Callable[..., Tensor]:
    def window(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (q - kv < size)

    return window


def prefix_lm(prefix: Tensor) -> Callable[..., Tensor]:
    def mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv < prefix[b]) | (q >= kv)

    return mask


def document(lengths: list[int]) -> Callable[..., Tensor]:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


def dilated(window: int, dilation: int) -> Callable[..., Tensor]:
    def mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        diff = q - kv
        return (diff >= 0) & (diff < window * dilation) & (diff % dilation == 0)

    return mask


def neighbourhood(width: int, radius: int) -> Callable[..., Tensor]:
    """natten-style: tokens of a ``? x width`` image see a ``(2r+1)^2`` neighbourhood."""

    def mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        qx, qy, kx, ky = q // width, q % width, kv // width, kv % width
        return ((qx - kx).abs() <= radius) & ((qy - ky).abs() <= radius)

    return mask


def strict_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return kv < q  # row 0 sees no key


def alibi(slopes: Tensor) -> Callable[..., Tensor]:
    def score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + slopes[h] * (kv - q)

    return score


def softcap(cap: float) -> Callable[..., Tensor]:
    def score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return cap * torch.tanh(s / cap)

    return score


def rel_bias(table: Tensor, lk: int) -> Callable[..., Tensor]:
    def score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + table[h, q - kv + lk]

    return score


def _inputs(
    b: int, hq: int, hk: int, lq: int, lk: int, d: int = 8, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, lq, d, generator=g, dtype=F64),
        torch.randn(b, hk, lk, d, generator=g, dtype=F64),
        torch.randn(b, hk, lk, d, generator=g, dtype=F64),
        torch.randn(b, hq, lq, d, generator=g, dtype=F64),
    )


def _table(hq: int, lq: int, lk: int, seed: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(0.3 * torch.randn(hq, lq + lk + 1, generator=g, dtype=F64))


SHAPES = {  # (B, Hq, Hkv, Lq, Lk)
    "B2 GQA 97x113": (2, 4, 2, 97, 113),
    "MQA 113x97": (1, 4, 1, 113, 97),
    "one query": (1, 2, 2, 1, 113),
    "one key": (2, 2, 2, 97, 1),
}


def _case(name: str, shape: tuple[int, ...]) -> tuple[Any, Any, tuple[Tensor, ...]]:
    """``(mask_mod, score_mod, learned tensors)`` of a named case for a shape."""
    b, hq, hk, lq, lk = shape
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(hq)], dtype=F64)
    table = _table(hq, lq, lk)
    docs = [max(1, lk // 3), max(1, lk // 4)]
    docs.append(max(lq, lk) - sum(docs))
    cases: dict[str, tuple[Any, Any, tuple[Tensor, ...]]] = {
        "causal": (causal, None, ()),
        "sliding window": (sliding_window(17), None, ()),
        "prefix LM": (prefix_lm(torch.tensor([5, 40])[:b]), None, ()),
        "document": (document(docs), None, ()),
        "dilated window": (dilated(6, 3), None, ()),
        "2-D neighbourhood": (neighbourhood(11, 2), None, ()),
        "ALiBi": (causal, alibi(slopes), ()),
        "tanh softcap": (None, softcap(2.5), ()),
        "relative-position table": (None, rel_bias(table, lk), (table,)),
        "document + table + softcap": (
            document(docs),
            lambda s, b_, h, q, kv: 3.0 * torch.tanh(rel_bias(table, lk)(s, b_, h, q, kv) / 3.0),
            (table,),
        ),
        "window + ALiBi": (sliding_window(9), alibi(slopes), ()),
        "strict causal (empty row) + table": (strict_causal, rel_bias(table, lk), (table,)),
    }
    return cases[name]


CASE_NAMES = [
    "causal",
    "sliding window",
    "prefix LM",
    "document",
    "dilated window",
    "2-D neighbourhood",
    "ALiBi",
    "tanh softcap",
    "relative-position table",
    "document + table + softcap",
    "window + ALiBi",
    "strict causal (empty row) + table",
]


def _torch_flex(
    q: Tensor, k: Tensor, v: Tensor, mask_mod: Any, score_mod: Any
) -> tuple[Tensor, Tensor]:
    bm = None
    if mask_mod is not None:
        bm = flex_mod.create_block_mask(
            mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device="cpu"
        )
    with torch.no_grad():
        o, aux = flex_mod.flex_attention(
            q, k, v, score_mod, bm, enable_gqa=True, return_aux=flex_mod.AuxRequest(lse=True)
        )
    return o, aux.lse


# ----------------------------------------------------------------------------------------
# flex_attention against torch's FlexAttention and the dense oracle
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASE_NAMES)
def test_forward_equals_torch_flex_attention(name, assert_close):
    shape = SHAPES["B2 GQA 97x113"]
    mask_mod, score_mod, _ = _case(name, shape)
    q, k, v, _ = _inputs(*shape)
    o_t, lse_t = _torch_flex(q, k, v, mask_mod, score_mod)
    bm = None
    if mask_mod is not None:
        bm = flex_mod.create_block_mask(mask_mod, shape[0], None, shape[3], shape[4], device="cpu")
    for tiles in ((512, 512), (32, 16)):
        o, lse = fl.flex_attention(
            q, k, v, score_mod, bm, enable_gqa=True, return_lse=True,
            block_q=tiles[0], block_k=tiles[1],
        )  # fmt: skip
        assert_close(o, o_t, rtol=FWD, name=f"O {name} tiles {tiles}")
        assert_close(lse, lse_t, rtol=FWD, name=f"LSE {name} tiles {tiles}")
        assert o.dtype == o_t.dtype and lse.dtype == lse_t.dtype


def _dense_row_max(q: Tensor, k: Tensor, mask_mod: Any, score_mod: Any) -> Tensor:
    """Each row's largest final score, dense (-inf where the mask hides every key)."""
    s, visible = naive_flex_scores(q, k, mask_mod=mask_mod, score_mod=score_mod)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    return s.amax(dim=-1)  # (B, H, Lq)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_return_aux_gives_the_lse_and_each_rows_largest_score(name, assert_close):
    """``return_aux=AuxRequest(...)`` as in torch 2.9+: the LSE of ``return_lse`` and the
    rows' largest scores after the score_mod and the mask (torch's CPU path refuses
    ``max_scores``; the dense oracle decides), on the native step (no score_mod) and the
    PyTorch step, with tiles that split the blocks."""
    shape = SHAPES["B2 GQA 97x113"]
    mask_mod, score_mod, _ = _case(name, shape)
    q, k, v, _ = _inputs(*shape)
    want = _dense_row_max(q, k, mask_mod, score_mod)
    bm = None
    if mask_mod is not None:
        bm = flex_mod.create_block_mask(mask_mod, shape[0], None, shape[3], shape[4], device="cpu")
    both = flex_mod.AuxRequest(lse=True, max_scores=True)
    for tiles in ((512, 512), (32, 16)):
        kw: dict[str, Any] = dict(enable_gqa=True, block_q=tiles[0], block_k=tiles[1])
        o, aux = fl.flex_attention(q, k, v, score_mod, bm, return_aux=both, **kw)
        o_l, lse = fl.flex_attention(q, k, v, score_mod, bm, return_lse=True, **kw)
        assert isinstance(aux, flex_mod.AuxOutput), type(aux)
        assert torch.equal(o, o_l) and torch.equal(aux.lse, lse), "return_aux's LSE is return_lse's"
        assert aux.max_scores.dtype == lse.dtype and not aux.max_scores.requires_grad
        assert_close(aux.max_scores, want, rtol=FWD, name=f"max_scores {name} tiles {tiles}")
        _, only = fl.flex_attention(
            q, k, v, score_mod, bm, return_aux=flex_mod.AuxRequest(max_scores=True), **kw
        )
        assert only.lse is None and torch.equal(only.max_scores, aux.max_scores)


def test_row_max_on_every_path(assert_close, native_calls):
    """``blocked_forward(row_max=True)``: the native pass (one part, and split parts for a
    decode-shaped call), the PyTorch step (FA2 and FA1 orders) and the half step all
    report the rows' largest scores; a row that sees no key reports -inf."""
    q, k, v, _ = _inputs(2, 4, 2, 97, 113)
    lagged = fl.MaskMod(lambda b, h, qi, ki: (ki <= qi - 5) & (ki > qi - 14))  # rows 0-4: none
    mask = (lagged & fl.Causal()) | fl.MaskMod(lambda b, h, qi, ki: (h == 1) & (ki < 3))
    vis = mask.dense(97, 113, batch=2, heads=4).expand(2, 4, 97, 113)  # (B, H, Lq, Lk)
    assert not bool(vis.any(-1).all()), "a row sees no key"

    def seen(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return vis[b, h, qi, ki]

    want = _dense_row_max(q, k, seen, None)
    got = {}
    for order in ("fa2", "fa1"):
        r = fl.blocked_forward(q, k, v, mask=mask, row_max=True, loop_order=order)
        got[order] = r.row_max
    got["observed"] = fl.blocked_forward(q, k, v, mask=mask, row_max=True, trace=True).row_max
    for path, m in got.items():
        assert_close(m, want, rtol=FWD, name=f"row_max {path}")
    assert native_calls["forward"] >= 1, "the native pass ran"
    dec = fl.blocked_forward(q[:, :, :1], k, v, row_max=True, block_k=16)  # parts split
    assert_close(dec.row_max, _dense_row_max(q[:, :, :1], k, None, None), rtol=FWD, name="decode")
    assert fl.blocked_forward(q, k, v, mask=mask).row_max is None, "only when asked for"
    # the half step: its scores from bfloat16 inputs, summed in float32
    qh, kh, vh = (x.to(torch.bfloat16) for x in (q, k, v))
    half = fl.blocked_forward(qh, kh, vh, mask=mask, row_max=True).row_max
    ref = _dense_row_max(qh.double(), kh.double(), seen, None)
    assert half.dtype == torch.float32
    assert_close(half, ref, rtol=2e-6, name="row_max bfloat16")
    # packed sequences: each row's largest score within its own sequence
    qp, kp, vp = (x[0, 0] for x in (q, k, v))  # (97, d), (113, d)
    cq, ck = (
        torch.tensor([0, 40, 97], dtype=torch.int32),
        torch.tensor([0, 50, 113], dtype=torch.int32),
    )
    packed = fl.blocked_forward(
        qp, kp, vp, mask=fl.Causal(), cu_seqlens_q=cq, cu_seqlens_k=ck, row_max=True
    )
    seq_q, seq_k = torch.arange(97) >= 40, torch.arange(113) >= 50
    pos_q, pos_k = torch.arange(97) - 40 * seq_q, torch.arange(113) - 50 * seq_k
    same = seq_q[:, None] == seq_k[None, :]
    causal = pos_k[None, :] <= pos_q[:, None]  # top-left, the default alignment
    s = (qp @ kp.T) / math.sqrt(qp.shape[-1])
    want_p = s.masked_fill(~(same & causal), -math.inf).amax(-1)
    assert_close(packed.row_max, want_p, rtol=FWD, name="row_max packed")
    with pytest.raises(TypeError, match="row_max must be True or False"):
        fl.blocked_forward(q, k, v, row_max=1)  # type: ignore[arg-type]


def test_return_aux_and_kernel_options_errors(assert_close):
    q, k, v, _ = _inputs(1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="return_lse=True or return_aux, not both"):
        fl.flex_attention(q, k, v, return_lse=True, return_aux=flex_mod.AuxRequest(lse=True))
    with pytest.raises(TypeError, match=r"return_aux must be an AuxRequest"):
        fl.flex_attention(q, k, v, return_aux=True)
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        fl.flex_attention(q, k, v, kernel_options=[("BLOCK_M", 64)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"may not set OUTPUT_MAX: ask .* with return_aux"):
        fl.flex_attention(q, k, v, kernel_options={"OUTPUT_MAX": True})
    # the Triton kernels' settings change nothing on CPU, as in torch's CPU path
    plain = fl.flex_attention(q, k, v)
    tuned = fl.flex_attention(q, k, v, None, None, None, False, False, {"BLOCK_M": 64})
    assert torch.equal(plain, tuned)
    # no gradient into max_scores; o and the LSE keep theirs
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o, aux = fl.flex_attention(*leaves, return_aux=flex_mod.AuxRequest(lse=True, max_scores=True))
    assert aux.max_scores.grad_fn is None and aux.lse.grad_fn is not None
    (o.sum() + aux.lse.sum()).backward()
    assert all(x.grad is not None for x in leaves)
    with torch.no_grad():  # a decode-shaped call without a graph takes the same path
        _, one = fl.flex_attention(
            q[:, :, :1], k, v, return_aux=flex_mod.AuxRequest(max_scores=True)
        )
    assert_close(
        one.max_scores, _dense_row_max(q[:, :, :1], k, None, None), rtol=FWD, name="decode"
    )


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("shape", [s for n, s in SHAPES.items() if n != "B2 GQA 97x113"])
def test_forward_on_shapes_that_break_tiling(name, shape, assert_close):
    """Lq = 1, Lk = 1, Lq > Lk with MQA: against the dense oracle (torch's FlexAttention on
    these too in ``flashledger verify``)."""
    mask_mod, score_mod, _ = _case(name, shape)
    q, k, v, _ = _inputs(*shape)
    o_n, lse_n = naive_flex(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
    mask = None if mask_mod is None else fl.MaskMod(mask_mod)
    for tiles in ((512, 512), (32, 16), (7, 5)):
        o, lse = fl.flash_attention(
            q, k, v, mask=mask, score_mod=score_mod, conventions=fl.FLEX_ATTENTION,
            return_lse=True, block_q=tiles[0], block_k=tiles[1],
        )  # fmt: skip
        assert_close(o, o_n, rtol=FWD, name=f"O {name} tiles {tiles}")
        assert_close(lse, lse_n, rtol=FWD, name=f"LSE {name} tiles {tiles}")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_gradients_equal_the_dense_oracle(name, assert_close):
    shape = SHAPES["B2 GQA 97x113"]
    mask_mod, score_mod, learned = _case(name, shape)
    q, k, v, do = _inputs(*shape, seed=3)
    bm = None
    if mask_mod is not None:
        bm = flex_mod.create_block_mask(
            mask_mod, 2, None, 97, 113, device="cpu", BLOCK_SIZE=(16, 32)
        )
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o, lse = fl.flex_attention(
        *leaves, score_mod, bm, enable_gqa=True, return_lse=True, block_q=32, block_k=64
    )
    dlse = torch.randn(lse.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    loss = (o * do).sum() + torch.where(torch.isinf(lse), 0.0, lse * dlse).sum()
    got = torch.autograd.grad(loss, [*leaves, *learned])
    oracle_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_n, lse_n = naive_flex(*oracle_leaves, mask_mod=mask_mod, score_mod=score_mod)
    loss_n = (o_n * do).sum() + torch.where(torch.isinf(lse_n), 0.0, lse_n * dlse).sum()
    want = torch.autograd.grad(loss_n, [*oracle_leaves, *learned])
    assert_close(o, o_n, rtol=FWD, name=f"O {name}")
    for what, a, b in zip(["dQ", "dK", "dV", "d table"], got, want):
        assert not bool(torch.isnan(a).any()), f"NaN in {what} ({name})"
        assert_close(a, b, rtol=GRAD, name=f"{what} {name}")


def test_fully_masked_rows_give_zero_output_and_gradients(assert_close):
    q, k, v, do = _inputs(1, 2, 2, 20, 20)

    def docs(b, h, qi, kv):
        return (qi >= 5) & (kv >= 5) & (qi >= kv)  # rows 0..4 see no key

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o, lse = fl.flash_attention(
        *leaves, mask=fl.MaskMod(docs), conventions=fl.FLEX_ATTENTION, return_lse=True,
        block_q=3, block_k=4,
    )  # fmt: skip
    o.backward(do)
    assert bool((o[:, :, :5] == 0).all()) and bool(torch.isneginf(lse[:, :, :5]).all())
    assert bool((leaves[0].grad[:, :, :5] == 0).all())
    assert bool((leaves[1].grad[:, :, :5] == 0).all()) and not bool(torch.isnan(o).any())
    o_t, lse_t = _torch_flex(q, k, v, docs, None)
    assert_close(o, o_t, rtol=FWD, name="O with empty rows")
    assert_close(lse, lse_t, rtol=FWD, name="LSE with empty rows")


# ----------------------------------------------------------------------------------------
# every entry point takes MaskMod and score_mod
# ----------------------------------------------------------------------------------------
def test_every_entry_point_takes_mask_mod_and_score_mod(assert_close):
    shape = (2, 4, 2, 97, 113)
    mask_mod, score_mod, (table,) = _case("document + table + softcap", shape)
    q, k, v, do = _inputs(*shape, seed=9)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_n, lse_n = naive_flex(*leaves, mask_mod=mask_mod, score_mod=score_mod)
    want = torch.autograd.grad((o_n * do).sum(), [*leaves, table])
    opts: dict[str, Any] = {"mask": fl.MaskMod(mask_mod), "score_mod": score_mod}

    def check(where: str, o: Tensor, grads: tuple[Tensor, ...] | None = None) -> None:
        assert_close(o, o_n, rtol=FWD, name=f"O ({where})")
        for what, a, b in zip(["dQ", "dK", "dV", "d table"], grads or (), want):
            assert_close(a, b, rtol=GRAD, name=f"{what} ({where})")

    ref = fl.reference_forward(q, k, v, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    assert [t for t, _ in refb.captured_grads] == [table]
    check("reference", ref.o, (refb.dq, refb.dk, refb.dv, refb.captured_grads[0][1]))
    assert_close(ref.lse, lse_n, rtol=FWD, name="reference LSE")
    for order, trace, tiles in (
        ("fa2", False, (32, 16)),
        ("fa1", True, (16, 32)),
        ("fa2", True, (7, 5)),
    ):
        kw = dict(block_q=tiles[0], block_k=tiles[1], loop_order=order, trace=trace)
        with torch.no_grad():  # the blocked loop records no graph (flash_attention does)
            fwd = fl.blocked_forward(q, k, v, **opts, **kw)
            bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, **kw)
        assert [t for t, _ in bwd.captured_grads] == [table]
        check(
            f"blocked {order} trace={trace}",
            fwd.o,
            (bwd.dq, bwd.dk, bwd.dv, bwd.captured_grads[0][1]),
        )
    o = fl.flash_attention(*leaves, block_q=64, block_k=32, **opts)
    check("flash_attention", o, torch.autograd.grad((o * do).sum(), [*leaves, table]))
    with torch.no_grad():
        split = fl.split_kv_forward(q, k, v, num_splits=3, block_q=32, block_k=16, **opts)
    check("split_kv_forward", split.o)
    ring = fl.simulate_ring(
        q, k, v, world_size=3, layout="zigzag", do=do, block_q=16, block_k=16, **opts
    )
    assert [t for t, _ in ring.captured_grads] == [table]
    check("simulate_ring", ring.o, (ring.dq, ring.dk, ring.dv, ring.captured_grads[0][1]))


def test_varlen_with_mask_mod_and_score_mod(assert_close):
    """With cu_seqlens, q_idx/kv_idx are positions in the packed sequence."""
    q, k, v, do = _inputs(1, 2, 2, 50, 50)
    cu = torch.tensor([0, 20, 50])
    table = _table(2, 50, 50)
    score_mod = rel_bias(table, 50)
    opts: dict[str, Any] = {"mask": fl.MaskMod(dilated(5, 2)), "score_mod": score_mod}
    with pytest.raises(ValueError, match="tensors the score_mod captures"):
        fl.blocked_forward(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, **opts)
    with torch.no_grad():
        fwd = fl.blocked_forward(
            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, block_q=8, block_k=8, **opts
        )
    seq = torch.tensor([0] * 20 + [1] * 30)

    def packed(b, h, qi, kv):
        return dilated(5, 2)(b, h, qi, kv) & (seq[qi] == seq[kv])

    o_n, _ = naive_flex(q, k, v, mask_mod=packed, score_mod=score_mod)
    assert_close(fwd.o, o_n[0], rtol=FWD, name="varlen O")


# ----------------------------------------------------------------------------------------
# captured tensors
# ----------------------------------------------------------------------------------------
class RelBias(torch.nn.Module):
    """A module whose method is the score_mod (its table a module attribute)."""

    def __init__(self, heads: int, span: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(
            torch.linspace(-1, 1, heads * span, dtype=F64).view(heads, span)
        )
        self.span = span

    def score_mod(self, s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + self.table[h, (q - kv) % self.span]


GLOBAL_GATE = torch.nn.Parameter(torch.tensor([0.5, -0.25], dtype=F64))


def _gated(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return s * (1 + GLOBAL_GATE[h])


def test_gradients_reach_every_kind_of_captured_tensor(assert_close):
    q, k, v, do = _inputs(1, 2, 2, 40, 33, seed=11)
    param = torch.nn.Parameter(torch.tensor([0.3, -0.7], dtype=F64))
    weight = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))
    module = RelBias(2, 16)
    box = {"bias": torch.nn.Parameter(torch.tensor(0.25, dtype=F64))}
    frozen = torch.tensor([1.0, 2.0], dtype=F64)  # captured, no grad: no gradient asked

    def build() -> tuple[Callable[..., Tensor], list[Tensor]]:
        derived = param * weight  # a non-leaf derived from parameters, made once per step

        def score_mod(s, b, h, qi, kv):
            s = module.score_mod(s, b, h, qi, kv) - derived[h] * (qi - kv).abs() / 10
            s = _gated(s, b, h, qi, kv) + box["bias"] * frozen[h]
            return functools.partial(torch.clamp, min=-30.0)(s)

        return score_mod, [param, weight, module.table, GLOBAL_GATE, box["bias"]]

    score_mod, learned = build()
    found = find_captured(score_mod, dtype=F64, device=torch.device("cpu"))
    assert not any(t is frozen for t in found)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o = fl.flash_attention(*leaves, mask=fl.Causal(), score_mod=score_mod, block_q=8, block_k=16)
    got = torch.autograd.grad((o * do).sum(), [*leaves, *learned])
    score_mod, _ = build()  # the oracle's own derived tensor
    oracle_leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_n, _ = naive_flex(*oracle_leaves, mask_mod=causal, score_mod=score_mod)
    want = torch.autograd.grad((o_n * do).sum(), [*oracle_leaves, *learned])
    names = ["dQ", "dK", "dV", "d param", "d weight", "d module.table", "d global", "d dict entry"]
    for what, a, b in zip(names, got, want):
        assert float(b.abs().max()) > 0, f"{what}: the oracle gradient is zero, the test is void"
        assert_close(a, b, rtol=GRAD, name=what)


def test_a_score_mod_result_that_is_not_a_fresh_tensor_stays_the_callers(assert_close):
    """The loop rescales and exponentiates the tile's scores in place. A score_mod may return
    a tensor it captured, a view of one, a broadcast (one element behind many) or a
    rearranged view of the score itself: none is written to, and every call gives the
    formula's O (the captured tensor came back overwritten, and a second call differed)."""
    q, k, v, do = _inputs(1, 2, 1, 6, 6, seed=5)
    table = torch.randn(1, 2, 6, 6, dtype=F64)
    half = torch.tensor([0.5, -0.25], dtype=F64)
    mods: dict[str, Callable[..., Tensor]] = {
        # the whole captured table when the tile is the whole call, else its entries
        "captured": lambda s, b, h, qi, kv: (
            table if s.shape == table.shape else table[b, h, qi, kv]
        ),
        "view": lambda s, b, h, qi, kv: (
            table[0:1] if s.shape == table.shape else table[b, h, qi, kv]
        ),
        "broadcast": lambda s, b, h, qi, kv: torch.broadcast_to(half[h], s.shape),
        "flipped": lambda s, b, h, qi, kv: s.flip(-1) if s.shape == table.shape else s,
    }
    for name, mod in mods.items():
        before = table.clone(), half.clone()
        want, _ = naive_flex(q, k, v, score_mod=mod)
        if name == "flipped":  # the tile's own scores, reversed along the keys
            s = torch.einsum("bhqd,bhkd->bhqk", q, k.expand(1, 2, 6, 8)) / math.sqrt(8)
            want = torch.softmax(s.flip(-1), dim=-1) @ v.expand(1, 2, 6, 8)
        for run in range(2):
            o = fl.blocked_forward(q, k, v, score_mod=mod, block_q=6, block_k=6).o
            assert_close(o, want, rtol=FWD, name=f"{name}: blocked_forward O, call {run}")
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            o = fl.flash_attention(*leaves, score_mod=mod, block_q=6, block_k=6)
            assert_close(o, want, rtol=FWD, name=f"{name}: flash_attention O, call {run}")
            torch.autograd.grad((o * do).sum(), leaves)
        assert torch.equal(table, before[0]) and torch.equal(half, before[1]), (
            f"{name}: the score_mod's captured tensor was written to"
        )


def test_find_captured_names_the_tensor_the_score_mod_uses():
    param = torch.nn.Parameter(torch.ones(3, dtype=F64))
    derived = param * 2  # captured as it is (not walked down to param)

    def score_mod(s, b, h, q, kv):
        return s + derived[h]

    found = find_captured(score_mod, dtype=F64, device=torch.device("cpu"))
    assert len(found) == 1 and found[0] is derived

    class Opaque(torch.autograd.Function):  # hides its input from the function mode
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x * 3

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g * 3

    def hidden(s, b, h, q, kv):
        return s + Opaque.apply(param)[h]

    assert any(t is param for t in find_captured(hidden, dtype=F64, device=torch.device("cpu")))


def test_gradcheck_with_a_learnable_table():
    q, k, v, _ = _inputs(1, 2, 1, 6, 7, d=3, seed=2)
    table = _table(2, 6, 7)

    def fn(q_, k_, v_, t_):
        def score_mod(s, b, h, qi, kv):
            return s + t_[h, qi - kv + 7]

        o, lse = fl.flash_attention(
            q_, k_, v_, mask=fl.MaskMod(causal), score_mod=score_mod, block_q=2, block_k=3,
            conventions=fl.FLEX_ATTENTION, return_lse=True,
        )  # fmt: skip
        return o, torch.where(torch.isinf(lse), 0.0, lse)

    args = tuple(x.clone().requires_grad_(True) for x in (q, k, v, table.detach()))
    assert torch.autograd.gradcheck(fn, args, atol=1e-8, fast_mode=True)


# ----------------------------------------------------------------------------------------
# the mask model: classification, composition, the native step
# ----------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(1, 40),
    lk=st.integers(1, 40),
    bq=st.integers(1, 16),
    bk=st.integers(1, 16),
    density=st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    op=st.sampled_from(["alone", "& causal", "| window", "| padding", "& mod", "| mod"]),
    seed=st.integers(0, 2**16),
)
def test_mask_mod_tile_classes_equal_the_dense_ones(lq, lk, bq, bk, density, op, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(2, lq, lk, generator=g) < density  # per batch

    def from_table(b, h, q, kv):
        return table[b, q, kv]

    other = torch.rand(lq, lk, generator=g) < 0.5
    mod = fl.MaskMod(from_table)
    dense = table[:, None]  # (B, 1, Lq, Lk)
    mask, want = {
        "alone": (mod, dense),
        "& causal": (mod & fl.Causal(), dense & fl.Causal().dense(lq, lk)),
        "| window": (mod | fl.SlidingWindow(3, 1), dense | fl.SlidingWindow(3, 1).dense(lq, lk)),
        "| padding": (
            fl.KeyPadding([lk // 2, 0]) | mod,
            dense | fl.KeyPadding([lk // 2, 0]).dense(lq, lk, batch=2),
        ),
        "& mod": (mod & fl.MaskMod(lambda b, h, q, kv: other[q, kv]), dense & other),
        "| mod": (mod | fl.MaskMod(lambda b, h, q, kv: other[q, kv]), dense | other),
    }[op]
    got = mask.tile_classes(lq, lk, bq, bk, batch=2, heads=3)
    assert torch.equal(got, tile_classes_from_dense(want, bq, bk)), f"{op}: {got.tolist()}"
    assert torch.equal(
        mask.dense(lq, lk, batch=2, heads=3).expand(2, 3, lq, lk), want.expand(2, 3, lq, lk)
    )


def test_or_tile_rules_for_closed_form_masks():
    a, b = fl.Causal(), fl.SlidingWindow(None, 0, align="bottom_right")
    classes = (a | fl.SlidingWindow(0, None)).tile_classes(16, 16, 4, 4)
    assert bool((classes == masks.FULL).all()), "causal | anti-causal covers every tile"
    got = (a | b).tile_classes(10, 16, 4, 4)
    want = tile_classes_from_dense(a.dense(10, 16) | b.dense(10, 16), 4, 4)
    assert torch.equal(got, want)
    # full if either is full, empty only if both are
    ca, cb = a.tile_classes(10, 16, 4, 4), b.tile_classes(10, 16, 4, 4)
    assert bool((got[(ca == masks.FULL) | (cb == masks.FULL)] == masks.FULL).all())
    assert torch.equal(got == masks.EMPTY, (ca == masks.EMPTY) & (cb == masks.EMPTY))


def test_classification_is_chunked_and_skips_what_the_closed_form_decides(monkeypatch):
    shapes: list[tuple[int, ...]] = []

    def seen(b, h, q, kv):
        shapes.append(tuple(torch.broadcast_shapes(q.shape, kv.shape)))
        return q >= kv

    monkeypatch.setattr(masks, "CLASSIFY_CHUNK", 64 * 64 * 3)
    fl.MaskMod(seen).tile_classes(1000, 1000, 64, 64)
    assert max(s[-2] * s[-1] for s in shapes) <= 64 * 64 * 3, "memory per call is bounded"
    assert sum(s[-2] * s[-1] for s in shapes) == 1000 * 1000
    shapes.clear()
    (fl.MaskMod(seen) & fl.SlidingWindow(10, 0)).tile_classes(1000, 1000, 64, 64)
    assert sum(s[-2] * s[-1] for s in shapes) < 1000 * 1000 // 4, "only tiles the window opens"


def test_mask_mod_runs_the_native_step_like_a_dense_mask(native_calls):
    q, k, v, do = (x.float() for x in _inputs(1, 4, 2, 300, 280, d=16))
    mod = fl.MaskMod(document([100, 90, 110]))
    dense = mod.dense(300, 280)
    a = fl.blocked_forward(q, k, v, mask=mod, block_q=64, block_k=64)
    b = fl.blocked_forward(q, k, v, mask=dense, block_q=64, block_k=64)
    assert torch.equal(a.o, b.o) and torch.equal(a.lse, b.lse), "the same bytes to the same step"
    ga = fl.blocked_backward(q, k, v, a.o, a.lse, do.float(), mask=mod, block_q=64, block_k=64)
    gb = fl.blocked_backward(q, k, v, b.o, b.lse, do.float(), mask=dense, block_q=64, block_k=64)
    assert torch.equal(ga.dq, gb.dq) and torch.equal(ga.dk, gb.dk) and torch.equal(ga.dv, gb.dv)
    assert native_calls == {"forward": 2, "backward": 2}
    fl.blocked_forward(q, k, v, mask=mod, score_mod=softcap(3.0), block_q=64, block_k=64)
    assert native_calls["forward"] == 2, "a score_mod runs the PyTorch step"


def test_scalar_style_mods_fall_back_to_vmap(assert_close):
    q, k, v, _ = _inputs(2, 2, 2, 30, 30)
    per_bh = torch.tensor([[3, 5], [7, 2]])
    slopes = torch.tensor([[0.1, 0.2], [0.3, 0.4]], dtype=F64)

    def scalar_mask(b, h, qi, kv):  # indexes b then h: fine for scalars, wrong when broadcast
        return (qi - kv).abs() <= per_bh[b][h]

    def scalar_score(s, b, h, qi, kv):
        return s - slopes[b][h] * (qi - kv).abs()

    got = fl.blocked_forward(
        q, k, v, mask=fl.MaskMod(scalar_mask), score_mod=scalar_score, block_q=8, block_k=8
    )
    o_n, _ = naive_flex(q, k, v, mask_mod=scalar_mask, score_mod=scalar_score)
    assert_close(got.o, o_n, rtol=FWD, name="vmapped mods")


# ----------------------------------------------------------------------------------------
# BlockMask
# ----------------------------------------------------------------------------------------
def test_block_mask_with_other_block_sizes_than_the_tiles(assert_close):
    q, k, v, _ = _inputs(2, 2, 2, 97, 113)
    mm = document([40, 30, 43])
    o_n, _ = naive_flex(q, k, v, mask_mod=mm)
    for block in ((128, 128), (16, 32), (7, 9)):
        bm = flex_mod.create_block_mask(mm, None, None, 97, 113, device="cpu", BLOCK_SIZE=block)
        for tiles in ((512, 512), (16, 32), (20, 24)):
            o = fl.flex_attention(q, k, v, block_mask=bm, block_q=tiles[0], block_k=tiles[1])
            assert_close(o, o_n, rtol=FWD, name=f"blocks {block}, tiles {tiles}")
        # the ledger's classes, for tiles equal to the blocks: the block mask's own
        res = fl.blocked_forward(q, k, v, mask=fl.MaskMod(bm), block_q=block[0], block_k=block[1])
        dense = flex_visible(mm, 1, 1, 97, 113)
        want = tile_classes_from_dense(dense, *block)
        ragged_q = (torch.arange(want.shape[0]) * block[0] + block[0] > 97)[:, None]
        ragged_k = (torch.arange(want.shape[1]) * block[1] + block[1] > 113)[None, :]
        want[(ragged_q | ragged_k) & (want == masks.FULL)] = masks.PARTIAL  # Flex pads with False
        kinds = [["empty", "partial", "full"][int(c)] for c in want.reshape(-1)]
        assert [x for row in res.ledger.tile_kinds for x in row] == kinds
        # the blocks are the classes; the partial tiles' visibility is evaluated once,
        # where the bounds leave it open (by sub-blocks, up front: then kept for the
        # passes) or else by the loop, tile by tile, never more than the tiles hold
        c = res.ledger.counters
        part = torch.tensor([k == "partial" for k in kinds]).view(want.shape)
        rows = torch.clamp(97 - torch.arange(want.shape[0]) * block[0], max=block[0])
        cols = torch.clamp(113 - torch.arange(want.shape[1]) * block[1], max=block[1])
        area = int((rows[:, None] * cols[None, :] * part).sum()) * 2 * 2  # x batch x heads
        assert c.mask_mod_classify_evals + c.mask_mod_evals <= area
        if block == (128, 128):  # sub-blocks of 16 fit: all kept up front
            assert 0 < c.mask_mod_classify_evals < area // 2
            assert c.mask_mod_evals == 0
        else:
            assert c.mask_mod_classify_evals == 0


def test_block_mask_blocks_rule_over_its_mask_mod(assert_close):
    """from_kv_blocks with the default (all-true) mask_mod: exactly the listed blocks are
    attended, as Flex's kernels compute (its eager path applies the mask_mod alone)."""
    q, k, v, do = _inputs(1, 2, 2, 256, 256)
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    bm = flex_mod.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128)
    visible = torch.zeros(256, 256, dtype=torch.bool)
    visible[:128, 128:] = True
    visible[128:, :] = True
    want = fl.reference_forward(q, k, v, mask=visible)
    for tiles in ((512, 512), (64, 96)):
        o = fl.flex_attention(q, k, v, block_mask=bm, block_q=tiles[0], block_k=tiles[1])
        assert_close(o, want.o, rtol=FWD, name=f"block-sparse O, tiles {tiles}")


def test_block_mask_kinds_per_head_rule_inside_tiles_of_several_blocks(assert_close):
    """A BlockMask whose blocks differ by head (partial, full and empty blocks), with a
    mask_mod that disagrees with its full blocks (it sees only even keys), under tiles
    that each span several blocks: full blocks are attended whole, empty ones not at all,
    partial ones where the mask_mod says so, head by head."""
    q, k, v, _ = _inputs(1, 2, 2, 96, 96)
    blk = 32
    # head 0: block row i lists partial block i and full block (i + 1) % 3;
    # head 1: partial block 0 and full block 2 in every row
    num = torch.ones(1, 2, 3, dtype=torch.int32)  # one listed block per block row
    idx = torch.zeros(1, 2, 3, 3, dtype=torch.int32)  # (width 3: as many as block columns)
    idx[0, 0, :, 0] = torch.tensor([0, 1, 2])
    fidx = torch.zeros(1, 2, 3, 3, dtype=torch.int32)
    fidx[0, 0, :, 0], fidx[0, 1, :, 0] = torch.tensor([1, 2, 0]), 2
    fnum = num.clone()

    def even_keys(b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        return ki % 2 == 0

    bm = flex_mod.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=blk, mask_mod=even_keys)
    visible = torch.zeros(2, 96, 96, dtype=torch.bool)
    keys = torch.arange(96)
    for h in range(2):
        for i in range(3):
            rows = slice(i * blk, (i + 1) * blk)
            p, f = int(idx[0, h, i, 0]), int(fidx[0, h, i, 0])
            visible[h, rows, p * blk : (p + 1) * blk] = (keys[p * blk : (p + 1) * blk] % 2) == 0
            visible[h, rows, f * blk : (f + 1) * blk] = True
    want = fl.reference_forward(q, k, v, mask=visible[None])
    for tiles in ((64, 64), (48, 80), (96, 96)):
        o = fl.flex_attention(q, k, v, block_mask=bm, block_q=tiles[0], block_k=tiles[1])
        assert_close(o, want.o, rtol=FWD, name=f"per-head blocks, tiles {tiles}")


def test_a_block_mask_s_grid_and_counts_are_derived_once_and_follow_its_changes(
    monkeypatch, assert_close
):
    """A BlockMask used call after call has its grid and its tiles' counts derived once (it
    is made once and used every step); an in-place change of its blocks, or a new tensor
    set on it, is seen by the next call, which then equals a fresh BlockMask's result."""
    q, k, v, _ = _inputs(1, 2, 2, 256, 256)
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    bm = flex_mod.BlockMask.from_kv_blocks(num.clone(), idx, BLOCK_SIZE=128)
    made = []
    real = _maskmod.block_grid
    monkeypatch.setattr(_maskmod, "block_grid", lambda *a, **kw: made.append(1) or real(*a, **kw))
    first = fl.flex_attention(q, k, v, block_mask=bm, block_q=64, block_k=64)
    again = fl.flex_attention(q, k, v, block_mask=bm, block_q=64, block_k=64)
    assert len(made) == 1, f"the grid was derived {len(made)} times for two calls"
    assert torch.equal(first, again)
    bm.kv_num_blocks[0, 0, 1] = 1  # in place: block row 1 now lists block 0 only
    changed = fl.flex_attention(q, k, v, block_mask=bm, block_q=64, block_k=64)
    fresh = flex_mod.BlockMask.from_kv_blocks(bm.kv_num_blocks.clone(), idx.clone(), BLOCK_SIZE=128)
    want = fl.flex_attention(q, k, v, block_mask=fresh, block_q=64, block_k=64)
    assert len(made) == 3, "an in-place change of the blocks was not seen"
    assert_close(changed, want, rtol=FWD, name="after an in-place change")
    assert not torch.equal(changed, first), "the change made no difference to check"
    bm.kv_num_blocks = num.clone()  # a new tensor: back to the first blocks
    assert torch.equal(fl.flex_attention(q, k, v, block_mask=bm, block_q=64, block_k=64), first)
    assert len(made) == 4
    version = bm.kv_num_blocks._version
    bm.kv_num_blocks.data[0, 0, 1] = 1  # through .data: its version counter stays
    assert bm.kv_num_blocks._version == version, "the write moved the counter"
    assert_close(
        fl.flex_attention(q, k, v, block_mask=bm, block_q=64, block_k=64),
        want,
        rtol=FWD,
        name="after a change through .data",
    )
    assert len(made) == 5, "a change through .data was not seen"


def test_block_mask_errors():
    q, k, v, _ = _inputs(2, 2, 2, 64, 64)
    bm = flex_mod.create_block_mask(causal, 2, None, 64, 64, device="cpu")
    with pytest.raises(
        ValueError, match=r"made for \(Lq, Lk\) = \(64, 64\) but the inputs have \(32, 64\)"
    ):
        fl.flex_attention(q[:, :, :32], k, v, block_mask=bm)
    with pytest.raises(ValueError, match="sliced"):
        fl.MaskMod(bm[0])
    with pytest.raises(ValueError, match="batch x heads 2 x 1; the inputs need 1 batch entries"):
        fl.flex_attention(q[:1], k[:1], v[:1], block_mask=bm)
    with pytest.raises(ValueError, match="need 1 or 3 batch entries and 1 or 2 heads"):
        fl.flex_attention(*(torch.cat([x, x[:1]]) for x in (q, k, v)), block_mask=bm)
    with pytest.raises(
        TypeError, match=r"block_mask must be a torch\.nn\.attention\.flex_attention\.BlockMask"
    ):
        fl.flex_attention(q, k, v, block_mask=causal)  # type: ignore[arg-type]


def test_flex_attention_argument_errors(assert_close):
    q, k, v, _ = _inputs(1, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fl.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="key has 2 heads and value 1; they must have the same"):
        fl.flex_attention(q, k, v[:, :1], enable_gqa=True)  # not the GQA hint: it would not help
    with pytest.raises(ValueError, match=r"query must be 4-D \(B, H, L, E\)"):
        fl.flex_attention(q[0], k[0], v[0], enable_gqa=True)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        fl.flex_attention(q, k, v, score_mod=3, enable_gqa=True)  # type: ignore[arg-type]
    # a key/value batch of 1 broadcasts over a block mask's batch, as in Flex
    qb = q.expand(2, -1, -1, -1)
    bm = flex_mod.create_block_mask(causal, 2, None, 16, 16, device="cpu")
    o = fl.flex_attention(qb, k, v, block_mask=bm, enable_gqa=True)
    o_n, _ = naive_flex(qb, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), mask_mod=causal)
    assert_close(o, o_n, rtol=FWD, name="broadcast K/V batch")


def test_bad_mods_are_named():
    q, k, v, _ = _inputs(1, 2, 2, 16, 16)
    with pytest.raises(
        ValueError,
        match=r"mask_mod 'floaty' returned a torch.float64 tensor; a mask_mod returns bool",
    ):

        def floaty(b, h, qi, kv):
            return (qi - kv).to(F64)

        fl.blocked_forward(q, k, v, mask=fl.MaskMod(floaty))
    with pytest.raises(ValueError, match=r"score_mod .to_int. returned a torch\.int32 tensor"):

        def to_int(s, b, h, qi, kv):
            return qi - kv

        fl.blocked_forward(q, k, v, score_mod=to_int)
    with pytest.raises(ValueError, match="score_mod 'broken' raised KeyError: 'no such table'"):

        def broken(s, b, h, qi, kv):
            raise KeyError("no such table")

        fl.blocked_forward(q, k, v, score_mod=broken)
    with pytest.raises(TypeError, match="MaskMod needs a mask_mod callable"):
        fl.MaskMod(torch.ones(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cannot unite a mask with None"):
        fl.Causal() | None  # type: ignore[operator]


# ----------------------------------------------------------------------------------------
# the ledger and its closed form
# ----------------------------------------------------------------------------------------
def test_classifying_without_span_bounds_evaluates_every_position_once(monkeypatch):
    """With the span bounds off, classifying evaluates the mask_mod at every position once
    per (b, h), and the classes and outputs are the same."""
    q, k, v, _ = _inputs(2, 4, 2, 97, 113)
    mm = document([40, 30, 43])
    opts = dict(mask=fl.MaskMod(mm), block_q=16, block_k=32)
    with torch.no_grad():
        on = fl.blocked_forward(q, k, v, **opts)
        monkeypatch.setattr(_maskmod, "SPAN_BOUNDS", False)
        off = fl.blocked_forward(q, k, v, **opts)
    assert off.ledger.counters.mask_mod_classify_evals == 97 * 113 * 2 * 4
    assert on.ledger.counters.mask_mod_classify_evals < 97 * 113 * 2 * 4 / 2
    assert torch.equal(on.o, off.o) and torch.equal(on.lse, off.lse)
    assert on.ledger.tile_kinds == off.ledger.tile_kinds


KEYS = (
    "mask_mod_classify_evals",
    "mask_mod_tiles_bounded",
    "mask_mod_tiles",
    "mask_mod_evals",
    "score_mod_tiles",
    "score_mod_evals",
)


@pytest.mark.parametrize("keep", ["all kept", "none kept"])
@pytest.mark.parametrize("which", ["MaskMod", "MaskMod & window", "BlockMask", "score_mod only"])
def test_counters_equal_the_closed_form(which, keep, monkeypatch):
    if keep == "none kept":
        monkeypatch.setattr(masks, "KEEP_BYTES", 0)
    shape = (2, 4, 2, 97, 113)
    q, k, v, do = _inputs(*shape)
    mm = document([40, 30, 43])
    table = _table(4, 97, 113)
    mask: Any = {
        "MaskMod": fl.MaskMod(mm),
        "MaskMod & window": fl.MaskMod(mm) & fl.SlidingWindow(20, 0),
        "BlockMask": fl.MaskMod(
            flex_mod.create_block_mask(mm, None, None, 97, 113, device="cpu", BLOCK_SIZE=(16, 32))
        ),
        "score_mod only": fl.Causal(),
    }[which]
    sm = rel_bias(table, 113)
    opts = dict(mask=mask, score_mod=sm, block_q=16, block_k=32)
    with torch.no_grad():
        fwd = fl.blocked_forward(q, k, v, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
    sw = fl.storage_and_work(
        lq=97,
        lk=113,
        d=8,
        heads=4,
        kv_heads=2,
        batch=2,
        block_q=16,
        block_k=32,
        mask=mask,
        score_mod=sm,
    )
    want = {key: getattr(sw, key) for key in KEYS}
    for led in (fwd.ledger, bwd.ledger):
        got = {key: getattr(led.counters, key) for key in KEYS}
        assert got == want, f"{which}, {keep}, {led.pass_name}: {got} != {want}"
    c = fwd.ledger.counters
    assert c.score_mod_tiles == c.tiles_run and c.score_mod_evals == c.qk_dots_computed
    if which != "score_mod only":
        assert sw.mask_mod_tiles == (c.tiles_partial - sw.mask_mod_tiles_kept) * 1
        assert (sw.mask_mod_tiles_kept == 0) == (keep == "none kept" or which == "BlockMask")
        assert (c.mask_mod_classify_evals == 0) == (which == "BlockMask")
    if which == "MaskMod":
        # the span bounds decide every tile but the partial ones (a document mask's bounds
        # are tight): those are evaluated, each position once, per (b, h)
        exact = tile_classes_from_dense(flex_visible(mm, 2, 4, 97, 113), 16, 32)
        rows = torch.tensor([min(16, 97 - 16 * i) for i in range(exact.shape[0])])
        cols = torch.tensor([min(32, 113 - 32 * j) for j in range(exact.shape[1])])
        area = int((rows[:, None] * cols[None, :] * (exact == masks.PARTIAL)).sum())
        assert 0 < area < 97 * 113
        assert c.mask_mod_classify_evals == area * 2 * 4
        assert c.mask_mod_tiles_bounded == int((exact != masks.PARTIAL).sum()) > 0
    if which in ("BlockMask", "score_mod only"):
        assert c.mask_mod_tiles_bounded == 0, "nothing classified by evaluation"
    text = str(fwd.ledger)
    assert f"score_mod: {c.score_mod_evals} positions in {c.score_mod_tiles} tile calls" in text
    assert fwd.ledger.to_dict()["counters"]["score_mod_tiles"] == c.score_mod_tiles


def test_the_loop_calls_the_mods_once_per_tile_on_the_tile(monkeypatch):
    """Never an L x L evaluation in the blocked loop, and flash_attention's backward
    reuses the forward's classes and kept tiles."""
    monkeypatch.setattr(masks, "KEEP_BYTES", 0)  # every partial tile evaluated in the loop
    calls: dict[str, list[tuple[int, ...]]] = {"mask": [], "score": []}

    def mm(b, h, qi, kv):
        calls["mask"].append(tuple(torch.broadcast_shapes(qi.shape, kv.shape)))
        return qi >= kv

    def sm(s, b, h, qi, kv):
        calls["score"].append(tuple(s.shape))
        return s * 0.5

    q, k, v, do = _inputs(1, 2, 2, 100, 100)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o = fl.flash_attention(*leaves, mask=fl.MaskMod(mm), score_mod=sm, block_q=32, block_k=32)
    after_forward = len(calls["mask"])
    n_fwd = len(calls["score"])
    o.backward(do)
    assert max(s[-2] * s[-1] for s in calls["score"]) <= 32 * 32 and calls["score"][1:]
    runs = 4 * 5 // 2  # causal 4 x 4 tiles: 10 run (4 partial, 6 full)
    # two probes: whether the callable takes broadcast indices, and whether it adds a term
    # to the score (on the first 2 x 2 positions; this one does not: the PyTorch step runs)
    assert n_fwd == runs + 2 and len(calls["score"]) == 2 * runs + 2
    assert sum(s[-2:] == (2, 2) for s in calls["score"]) == 1
    # classification: one call per row of tiles (4); each pass: the 4 partial tiles
    assert after_forward == 4 + 4 and len(calls["mask"]) == 4 + 2 * 4, "no second classification"


# ----------------------------------------------------------------------------------------
# README-style training loop (tiny): a learnable bias trained by flashledger's gradients
# ----------------------------------------------------------------------------------------
def test_a_learnable_bias_trains():
    q, k, v, _ = _inputs(1, 2, 2, 24, 24)
    target, _ = naive_flex(
        q, k, v, mask_mod=causal, score_mod=alibi(torch.tensor([0.5, 0.25], dtype=F64))
    )
    table = torch.nn.Parameter(torch.zeros(2, 49, dtype=F64))
    bm = flex_mod.create_block_mask(causal, None, None, 24, 24, device="cpu")
    opt = torch.optim.Adam([table], lr=0.1)
    losses = []
    for _ in range(30):
        o = fl.flex_attention(
            q, k, v, score_mod=rel_bias(table, 24), block_mask=bm, block_q=8, block_k=8
        )
        loss = ((o - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0], losses[::5]


@settings(max_examples=25, deadline=None)
@given(
    lq=st.integers(1, 30),
    lk=st.integers(1, 30),
    bq=st.integers(1, 12),
    bk=st.integers(1, 12),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    density=st.sampled_from([0.0, 0.4, 1.0]),
    mod=st.sampled_from(["none", "table", "softcap", "alibi"]),
    order=st.sampled_from(["fa2", "fa1"]),
    seed=st.integers(0, 2**16),
)
def test_blocked_mods_equal_the_oracle_property(
    lq, lk, bq, bk, heads, density, mod, order, seed, assert_close
):
    """Random shapes, tiles, masks and score_mods: the blocked loop (forward and backward,
    the table's gradient too) equals the dense autograd oracle (the native step runs the
    fa2 cases without a score_mod)."""
    hq, hk = heads
    q, k, v, do = _inputs(2, hq, hk, lq, lk, d=4, seed=seed)
    g = torch.Generator().manual_seed(seed)
    table = torch.rand(2, lq, lk, generator=g) < density

    def mask_mod(b, h, qi, kv):
        return table[b, qi, kv]

    bias = _table(hq, lq, lk, seed=seed)
    score_mod = {
        "none": None,
        "table": rel_bias(bias, lk),
        "softcap": softcap(1.5),
        "alibi": alibi(torch.linspace(0.1, 1.0, hq, dtype=F64)),
    }[mod]
    opts: dict[str, Any] = dict(mask=fl.MaskMod(mask_mod), score_mod=score_mod)
    kw: dict[str, Any] = dict(block_q=bq, block_k=bk, loop_order=order)
    with torch.no_grad():
        fwd = fl.blocked_forward(q, k, v, **opts, **kw)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, **kw)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_n, lse_n = naive_flex(*leaves, mask_mod=mask_mod, score_mod=score_mod)
    learned = [bias] if mod == "table" else []
    want = torch.autograd.grad((o_n * do).sum(), [*leaves, *learned])
    got = [bwd.dq, bwd.dk, bwd.dv] + [gr for _, gr in bwd.captured_grads]
    assert_close(fwd.o, o_n, rtol=FWD, name="O")
    assert_close(fwd.lse, lse_n, rtol=FWD, name="LSE")
    for what, a, b in zip(["dQ", "dK", "dV", "d table"], got, want):
        assert_close(a, b, rtol=GRAD, name=what)


# ----------------------------------------------------------------------------------------
# random block masks through fl.flex_attention, against torch's eager Flex
# ----------------------------------------------------------------------------------------
MASK_MODS: dict[str, Callable[..., Tensor]] = {
    "causal": causal,
    "window": sliding_window(20),
    "prefix": prefix_lm(torch.tensor([30, 5])),
    "document": document([40, 1, 60, 200]),  # covers lengths up to 301
    "dilated": dilated(8, 3),
    "by head": lambda b, h, q, kv: kv <= q + 10 * h,
    "by batch": lambda b, h, q, kv: kv % (b + 2) == 0,
    "hash": lambda b, h, q, kv: (q * 7 + kv * 13 + h) % 3 != 0,
}
DEPENDS_ON_B_OR_H = {"prefix", "by head", "by batch", "hash"}


def _flex_property_case(data: Any, assert_close: Callable[..., None]) -> None:
    b, hk = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    g = data.draw(st.sampled_from([1, 2]))
    lq = data.draw(st.sampled_from([1, 17, 97, 128, 200, 301]))
    lk = data.draw(st.sampled_from([1, 17, 97, 128, 200, 301]))
    d = data.draw(st.sampled_from([8, 16]))
    names = data.draw(st.lists(st.sampled_from(sorted(MASK_MODS)), max_size=2, unique=True))
    mm = None
    if names:
        mm = MASK_MODS[names[0]]
        if len(names) == 2:
            combine = data.draw(st.sampled_from([flex_mod.and_masks, flex_mod.or_masks]))
            mm = combine(mm, MASK_MODS[names[1]])
    table = _table(hk * g, lq, lk, seed=data.draw(st.integers(0, 99)))
    mod = data.draw(st.sampled_from(["none", "table", "softcap", "alibi", "where"]))
    score_mod = {
        "none": None,
        "table": rel_bias(table, lk),
        "softcap": softcap(2.0),
        "alibi": alibi(torch.linspace(0.1, 1.0, hk * g, dtype=F64)),
        # a score_mod that masks: its -inf must weigh nothing, as a mask_mod's does
        "where": lambda s, b, h, q, kv: torch.where(kv <= q + 3, s, -math.inf),
    }[mod]
    block_mask = None
    if mm is not None:
        # a block mask made without B or H is made for b = h = 0: only for mods that
        # do not read them (Flex's own rule; flashledger follows the blocks)
        full = any(n in DEPENDS_ON_B_OR_H for n in names)
        sizes = data.draw(st.sampled_from([16, 32, 128, (16, 64)]))
        bs = b if full or data.draw(st.booleans()) else None
        hs = hk * g if full or data.draw(st.booleans()) else None
        block_mask = flex_mod.create_block_mask(mm, bs, hs, lq, lk, device="cpu", BLOCK_SIZE=sizes)
        ours = fl.create_block_mask(mm, bs, hs, lq, lk, device="cpu", BLOCK_SIZE=sizes)
        _same_block_mask(ours, block_mask, f"{names}, B {bs}, H {hs}, {sizes}")
    tiles = data.draw(
        st.sampled_from([{}, dict(block_q=32, block_k=48), dict(block_q=7, block_k=64)])
    )
    q, k, v, do = _inputs(b, hk * g, hk, lq, lk, d=d, seed=data.draw(st.integers(0, 2**16)))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    kw: dict[str, Any] = dict(score_mod=score_mod, block_mask=block_mask, enable_gqa=g > 1)
    o, lse = fl.flex_attention(*leaves, **kw, return_lse=True, **tiles)
    with torch.no_grad():
        o_t, lse_t = flex_mod.flex_attention(q, k, v, **kw, return_lse=True)
    assert_close(o, o_t, rtol=FWD, name="O vs torch's flex_attention")
    assert_close(lse, lse_t, rtol=FWD, name="LSE vs torch's flex_attention")
    learned = [table] if mod == "table" else []
    got = torch.autograd.grad((o * do).sum(), [*leaves, *learned])
    ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_n, _ = naive_flex(*ref, mask_mod=mm, score_mod=score_mod)
    want = torch.autograd.grad((o_n * do).sum(), [*ref, *learned])
    for what, a, w in zip(["dQ", "dK", "dV", "d table"], got, want):
        assert not bool(torch.isnan(a).any()), f"NaN in {what}"
        assert_close(a, w, rtol=GRAD, name=what)


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_flex_attention_on_random_block_masks_equals_torch_and_the_oracle(data, assert_close):
    """Random mask_mods (alone, ``and_masks``, ``or_masks``; some reading b or h), block
    masks of random block sizes (some made without B or H; ``fl.create_block_mask``
    builds the same, field for field), random score_mods, GQA, lengths no tile divides:
    O and the LSE equal torch's eager ``flex_attention`` within 1e-12, the gradients (q, k, v, a captured table) the dense oracle's within 1e-11."""
    _flex_property_case(data, assert_close)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_flex_attention_on_random_block_masks_sweep(data, assert_close):
    """The property above, 200 cases."""
    _flex_property_case(data, assert_close)


# ----------------------------------------------------------------------------------------
# fl.create_block_mask: torch's BlockMask, from the span bounds and the open blocks
# ----------------------------------------------------------------------------------------
BLOCK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _same_block_mask(got: Any, want: Any, where: str) -> None:
    assert tuple(got.BLOCK_SIZE) == tuple(want.BLOCK_SIZE), where
    assert tuple(got.seq_lengths) == tuple(want.seq_lengths), where
    assert got.mask_mod is want.mask_mod, where
    for field in BLOCK_FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), f"{field} ({where})"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, f"{field} ({where})"
            assert torch.equal(a, b), f"{field} differs ({where}):\n{a}\n{b}"


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_create_block_mask_equals_torchs(name):
    """Every mask_mod of the zoo, for no batch/head (b = h = 0) and for 2 x 3, lengths one
    block, ragged, Lq != Lk, square and rectangular blocks, full blocks apart or not:
    the same BlockMask as torch's create_block_mask, field for field."""
    mm = MASK_MODS[name]
    for bh in ((None, None), (2, 3)):
        for lengths in ((1, 1), (97, 113), (301, 17), (256, 256)):
            for block in (128, (16, 64), 7):
                for separate in (True, False):
                    kw = dict(device="cpu", BLOCK_SIZE=block, separate_full_blocks=separate)
                    got = fl.create_block_mask(mm, *bh, *lengths, **kw)
                    want = flex_mod.create_block_mask(mm, *bh, *lengths, **kw)
                    _same_block_mask(got, want, f"{name} B, H {bh}, {lengths}, {block}")


def test_create_block_mask_takes_torchs_arguments_in_torchs_order():
    """Code written for torch passes ``_compile`` (by name or as the eighth argument) and
    ``separate_full_blocks`` after it: the same BlockMask as torch's from the same call;
    ``compute_dq_write_order=True`` (torch's GPU backward) and a non-bool flag are
    refused by name."""
    mm = MASK_MODS[sorted(MASK_MODS)[0]]
    for args, kw in (
        (("cpu", 16, True), {}),
        (("cpu", 16, False, False), {}),
        ((), {"device": "cpu", "BLOCK_SIZE": 16, "_compile": True}),
        ((), {"device": "cpu", "BLOCK_SIZE": 16, "_compile": False, "dq_kv_order": False}),
    ):
        got = fl.create_block_mask(mm, 2, 3, 97, 113, *args, **kw)
        want = flex_mod.create_block_mask(mm, 2, 3, 97, 113, *args, **kw)
        _same_block_mask(got, want, f"{args} {kw}")
    with pytest.raises(ValueError, match="compute_dq_write_order=True is not built"):
        fl.create_block_mask(mm, 1, 1, 8, 8, "cpu", compute_dq_write_order=True)
    with pytest.raises(TypeError, match="_compile must be True or False, got 'yes'"):
        fl.create_block_mask(mm, 1, 1, 8, 8, "cpu", 16, "yes")


def test_create_block_mask_of_combined_and_scalar_style_mods():
    """``and_masks`` / ``or_masks`` of zoo mods (one reads h), a mask_mod that only works
    on scalars (evaluated under torch.vmap, as torch evaluates every one), and mask_mods
    that read only the keys or only the queries (their result broadcasts over the other,
    and full blocks must still count every position)."""
    per_bh = torch.tensor([[3, 5, 1], [7, 2, 0]])

    def scalar_mask(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return (qi - kv).abs() <= per_bh[b][h]

    kept = torch.arange(40, 140)

    def kv_only(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return torch.isin(kv, kept)  # no span bound: evaluated; one row broadcast to all

    def q_only(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return torch.isin(qi, kept)

    mods = {
        "and": flex_mod.and_masks(MASK_MODS["document"], MASK_MODS["by head"]),
        "or": flex_mod.or_masks(MASK_MODS["window"], MASK_MODS["dilated"]),
        "scalar": scalar_mask,
        "keys only": kv_only,
        "queries only": q_only,
    }
    for name, mm in mods.items():
        for block in (32, (8, 16)):
            got = fl.create_block_mask(mm, 2, 3, 97, 150, device="cpu", BLOCK_SIZE=block)
            want = flex_mod.create_block_mask(mm, 2, 3, 97, 150, device="cpu", BLOCK_SIZE=block)
            _same_block_mask(got, want, f"{name}, {block}")


def test_create_block_mask_in_small_chunks(monkeypatch):
    """The open blocks of a row evaluated a few at a time (a bound on the positions per
    call, counted for every batch entry and head until a call shows that the mask_mod
    broadcasts over them): the same BlockMask."""
    from flashledger import _blockmask

    monkeypatch.setattr(_blockmask, "_CHUNK", 3000)
    for name in ("hash", "document", "by head"):
        mm = MASK_MODS[name]
        for bh in ((None, None), (2, 3)):
            got = fl.create_block_mask(mm, *bh, 97, 300, device="cpu", BLOCK_SIZE=(16, 32))
            want = flex_mod.create_block_mask(mm, *bh, 97, 300, device="cpu", BLOCK_SIZE=(16, 32))
            _same_block_mask(got, want, f"{name}, B, H {bh}")


def test_create_block_mask_evaluates_only_the_blocks_the_bounds_leave_open(monkeypatch):
    """At L = 1024 in 128-blocks the bounds decide every full and every empty block of a
    causal mask and of a packed-document one, so exactly the partial blocks' positions
    are evaluated (the diagonal's 8 for causal; 17 for the documents), where torch
    evaluates all 1024²."""
    from flashledger import _blockmask

    callers: list[Any] = []

    class Counting(_blockmask.TileCaller):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            callers.append(self)

    monkeypatch.setattr(_blockmask, "TileCaller", Counting)
    for mm, partial, full in ((causal, 8, 28), (document([100, 400, 524]), 17, 7)):
        bm = fl.create_block_mask(mm, None, None, 1024, 1024, device="cpu")
        assert int(bm.kv_num_blocks.sum()) == partial
        assert int(bm.full_kv_num_blocks.sum()) == full
        assert callers[-1].positions == partial * 128 * 128


def test_create_block_mask_drives_both_flex_attentions(assert_close):
    """The block mask flashledger builds runs in fl.flex_attention and in torch's own
    flex_attention, with the same results as torch's block mask."""
    q, k, v, _ = _inputs(2, 4, 2, 200, 200)
    mm = flex_mod.and_masks(MASK_MODS["document"], MASK_MODS["by head"])
    ours = fl.create_block_mask(mm, 2, 4, 200, 200, device="cpu", BLOCK_SIZE=64)
    theirs = flex_mod.create_block_mask(mm, 2, 4, 200, 200, device="cpu", BLOCK_SIZE=64)
    want = flex_mod.flex_attention(q, k, v, block_mask=theirs, enable_gqa=True)
    assert_close(
        flex_mod.flex_attention(q, k, v, block_mask=ours, enable_gqa=True),
        want,
        rtol=FWD,
        name="torch's flex_attention with fl's block mask",
    )
    assert_close(
        fl.flex_attention(q, k, v, block_mask=ours, enable_gqa=True),
        want,
        rtol=FWD,
        name="fl.flex_attention with fl's block mask",
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("not callable", None, None, 8, 8), {}, TypeError, "mask_mod must be callable"),
        ((causal, 0, None, 8, 8), {}, ValueError, "B must be an integer >= 1, got 0"),
        ((causal, None, 2.0, 8, 8), {}, ValueError, "H must be an integer >= 1"),
        ((causal, None, None, 0, 8), {}, ValueError, "Q_LEN must be an integer >= 1"),
        ((causal, None, None, 8, -1), {}, ValueError, "KV_LEN must be an integer >= 1"),
        ((causal, None, None, 8, 8), {"BLOCK_SIZE": 0}, ValueError, r"BLOCK_SIZE \(q\)"),
        ((causal, None, None, 8, 8), {"BLOCK_SIZE": (8, 8, 8)}, ValueError, "an int or"),
        (
            (lambda b, h, q, kv: (q - kv).float(), None, None, 8, 8),
            {},
            ValueError,
            "returned a torch.float32 tensor; a mask_mod returns bool",
        ),
    ],
)
def test_create_block_mask_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fl.create_block_mask(*args, device="cpu", **kwargs)


@pytest.mark.parametrize("uses_score", ["ignored", "detached"])
def test_captured_grad_when_score_mod_does_not_differentiate_the_score(uses_score: str) -> None:
    """A score_mod whose output does not depend on the score through autograd (a learned
    attention map that replaces it, or ``score.detach() * w``) still gives its captured
    tensors their gradient: the dense autograd result, not zero."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64) for n in (10, 12, 12))
    w = torch.tensor([0.7, -0.3], dtype=torch.float64, requires_grad=True)

    def score_mod(s: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if uses_score == "ignored":
            return w[h] * (qi - ki).to(s.dtype)
        return s.detach() * w[h]

    go = torch.randn(1, 2, 10, 4, dtype=torch.float64)
    out = fl.flex_attention(q, k, v, score_mod=score_mod)
    (got,) = torch.autograd.grad((out * go).sum(), w)
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(2).view(1, 2, 1, 1)
    qi, ki = torch.arange(10).view(1, 1, 10, 1), torch.arange(12).view(1, 1, 1, 12)
    s = score_mod(q @ k.mT / 2.0, b, h, qi, ki)
    (want,) = torch.autograd.grad((torch.softmax(s, -1) @ v * go).sum(), w)
    assert want.abs().min() > 0.1  # a real gradient, not one that cancels
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


@pytest.mark.parametrize("kind", [np.int64, np.int32, lambda n: torch.tensor(n)])
def test_create_block_mask_takes_numpy_and_tensor_integers(kind: Any) -> None:
    """NumPy and 0-d tensor integers, as torch's create_block_mask takes them."""
    want = flex_mod.create_block_mask(causal, 2, 3, 40, 24, device="cpu", BLOCK_SIZE=16)
    got = fl.create_block_mask(
        causal, kind(2), kind(3), kind(40), kind(24), device="cpu", BLOCK_SIZE=16
    )
    assert got.seq_lengths == (40, 24) and all(type(n) is int for n in got.seq_lengths)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_create_block_mask_refuses_what_is_not_an_integer_of_at_least_1(bad: Any) -> None:
    with pytest.raises(ValueError, match="Q_LEN must be an integer >= 1"):
        fl.create_block_mask(causal, None, None, bad, 16, device="cpu")
