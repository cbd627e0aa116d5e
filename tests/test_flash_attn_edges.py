"""flash-attn's last edges, each checked from its described behaviour.

- windows as flash-attn 2 rewrites them (a -1 side is ``seqlen_k``, a side at or
  past ``seqlen_k`` is -1), and flash-attn 3's rewriting, which keeps the meaning;
- the LSE flash-attn 2 returns under causal + ALiBi (``+slope·j``: O unchanged,
  LSE larger by ``slope·(i + Lk - Lq)``);
- softcap refused together with dropout;
- an outside keep mask (``dropout_mask=``) and ``return_attn_probs``;
- per-sequence ALiBi slopes with ``cu_seqlens``;
- padding aligned to each sequence's real lengths (``Padding``, ``seqused_q``,
  ``seqused_k``), on the interval fast path.

The expected values come from tests/naive.py (plain PyTorch, no flashledger),
per sequence where the edge is about sequences.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import (
    causal_visible,
    fa2_sides,
    naive_attention,
    naive_with_grads,
    window_visible,
)

import flashledger as fl
from flashledger import _native
from flashledger._problem import build_problem
from flashledger.masks import IntervalBound

F64 = torch.float64
TOL = 1e-12


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def qkvd(
    gen: torch.Generator, b: int, hq: int, hkv: int, lq: int, lk: int, d: int = 5, dv: int = 4
):
    return (
        randn(gen, b, hq, lq, d),
        randn(gen, b, hkv, lk, d),
        randn(gen, b, hkv, lk, dv),
        randn(gen, b, hq, lq, dv),
    )


def all_paths(q, k, v, do, assert_close, *, want_o, want_lse, tiles=((3, 4), (5, 2)), **opts):
    """Reference and blocked (both orders, split-KV) against the expected O and LSE; the blocked
    backward against the reference backward."""
    ref = fl.reference_forward(q, k, v, **opts)
    assert_close(ref.o, want_o, rtol=TOL, name="reference O")
    assert_close(ref.lse, want_lse, rtol=TOL, name="reference LSE")
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    for bq, bk in tiles:
        for order in ("fa2", "fa1"):
            fwd = fl.blocked_forward(q, k, v, block_q=bq, block_k=bk, loop_order=order, **opts)
            where = f"{order} {bq}x{bk}"
            assert_close(fwd.o, want_o, rtol=TOL, name=f"blocked O ({where})")
            assert_close(fwd.lse, want_lse, rtol=TOL, name=f"blocked LSE ({where})")
            bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, block_q=bq, block_k=bk, **opts)
            for name, got, want in (
                ("dQ", bwd.dq, refb.dq),
                ("dK", bwd.dk, refb.dk),
                ("dV", bwd.dv, refb.dv),
            ):
                assert not bool(torch.isnan(got).any()), f"NaN in {name} ({where})"
                assert_close(got, want, rtol=TOL, name=f"blocked {name} ({where})")
    if "cu_seqlens_q" not in opts:
        split = fl.split_kv_forward(
            q, k, v, num_splits=min(3, k.shape[-2]), block_q=4, block_k=3, **opts
        )
        assert_close(split.o, want_o, rtol=TOL, name="split-KV O")
        assert_close(split.lse, want_lse, rtol=TOL, name="split-KV LSE")
    return ref, refb


# ============================================================================================
# 4. windows as flash-attn 2 takes them
# ============================================================================================
@pytest.mark.parametrize(
    ("window", "lq", "lk"),
    [((7, -1), 24, 12), ((-1, 3), 12, 24), ((-1, 30), 24, 12), ((2, 12), 30, 12), ((12, 0), 9, 12)],
)
def test_flash_attn_2_rewrites_window_sides(window, lq, lk, gen, assert_close):
    q, k, v, do = qkvd(gen, 2, 2, 1, lq, lk)
    left, right = window
    mask = fl.SlidingWindow(left, right)
    vis = window_visible(
        lq,
        lk,
        *fa2_sides(None if left < 0 else left, None if right < 0 else right, lk),
        "bottom_right",
    )
    o, lse = naive_attention(q, k, v, visible=vis, masked_row_lse=math.inf)
    all_paths(
        q, k, v, do, assert_close, want_o=o, want_lse=lse, mask=mask, conventions=fl.FLASH_ATTN_2
    )
    assert torch.equal(mask.dense(lq, lk, conventions=fl.FLASH_ATTN_2), vis)
    # flash-attn 3 keeps the documented meaning (its rewriting changes no visible pair)
    plain = window_visible(lq, lk, left, right, "bottom_right")
    assert torch.equal(mask.dense(lq, lk, conventions=fl.FLASH_ATTN_3), plain)


def test_the_rewrite_changes_o_where_the_issue_measured_it(gen, assert_close):
    """(512, 256), window (7, -1): flash-attn 2 bounds the right side at seqlen_k."""
    q, k, v, _ = qkvd(gen, 1, 2, 2, 512, 256, d=16, dv=16)
    w = fl.SlidingWindow(7, -1)
    fa2 = fl.blocked_forward(q, k, v, mask=w, conventions=fl.FLASH_ATTN_2, block_q=128, block_k=128)
    br = dataclasses_replace(fl.SEED, causal_align="bottom_right")
    seed = fl.blocked_forward(q, k, v, mask=w, conventions=br, block_q=128, block_k=128)
    rows = slice(0, 255)  # rows i < Lq - Lk - 1 = 255 lose keys j > i
    assert float((fa2.o[..., rows, :] - seed.o[..., rows, :]).abs().max()) > 0.1
    assert_close(
        fa2.o[..., 255:, :], seed.o[..., 255:, :], rtol=TOL, name="rows that keep their keys"
    )


def dataclasses_replace(conv: fl.Conventions, **kw: Any) -> fl.Conventions:
    import dataclasses

    return dataclasses.replace(conv, name=f"{conv.name}_variant", **kw)


@settings(max_examples=80, deadline=None)
@given(
    lq=st.integers(1, 30), lk=st.integers(1, 30),
    left=st.one_of(st.just(-1), st.integers(0, 40)), right=st.one_of(st.just(-1), st.integers(0, 40)),
)  # fmt: skip
def test_window_rewriting_property(lq, lk, left, right):
    mask = fl.SlidingWindow(left, right)
    sides = fa2_sides(None if left < 0 else left, None if right < 0 else right, lk)
    want = window_visible(lq, lk, *sides, "bottom_right")
    assert torch.equal(mask.dense(lq, lk, conventions=fl.FLASH_ATTN_2), want), (sides,)
    plain = window_visible(lq, lk, left, right, "bottom_right")
    assert torch.equal(mask.dense(lq, lk, conventions=fl.FLASH_ATTN_3), plain)
    # flash-attn 3's own rewriting (a side past seqlen - 1 is -1, then -1 is seqlen - 1) keeps it
    l3 = -1 if left >= lk - 1 else left
    r3 = -1 if right >= lq - 1 else right
    l3, r3 = (lk - 1 if l3 < 0 else l3), (lq - 1 if r3 < 0 else r3)
    assert torch.equal(window_visible(lq, lk, l3, r3, "bottom_right"), plain)


def test_varlen_rewrites_against_the_longest_sequence(gen, assert_close):
    lq_s, lk_s = [12, 2], [2, 5]  # max_seqlen_k = 5
    h = 2
    q, k, v, do = (
        randn(gen, h, 14, 4),
        randn(gen, h, 7, 4),
        randn(gen, h, 7, 3),
        randn(gen, h, 14, 3),
    )
    cq, ck = torch.tensor([0, 12, 14]), torch.tensor([0, 2, 7])
    mask = fl.SlidingWindow(1, -1)
    want_o, want_lse = torch.zeros(h, 14, 3, dtype=F64), torch.zeros(h, 14, dtype=F64)
    for s in range(2):
        qs, ks = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        vis = window_visible(lq_s[s], lk_s[s], *fa2_sides(1, None, 5), "bottom_right")
        o, lse = naive_attention(
            q[None, :, qs], k[None, :, ks], v[None, :, ks], visible=vis, masked_row_lse=math.inf
        )
        want_o[:, qs], want_lse[:, qs] = o[0], lse[0]
    assert bool(torch.isinf(want_lse[:, :5]).all()), "rows 0-4 of sequence 0 see no key"
    all_paths(
        q, k, v, do, assert_close, want_o=want_o, want_lse=want_lse, mask=mask,
        conventions=fl.FLASH_ATTN_2, cu_seqlens_q=cq, cu_seqlens_k=ck,
    )  # fmt: skip


# ============================================================================================
# 5. the LSE flash-attn 2 returns under causal + ALiBi
# ============================================================================================
@pytest.mark.parametrize(("lq", "lk"), [(7, 7), (5, 11), (11, 5), (1, 9)])
@pytest.mark.parametrize(
    "mask",
    [fl.Causal(), fl.SlidingWindow(None, 0), fl.Causal() & fl.SlidingWindow(-1, 4)],
    ids=["causal", "window(-1,0)", "causal&window(-1,4)"],
)
def test_causal_alibi_lse_is_shifted_by_slope_times_the_diagonal(lq, lk, mask, gen, assert_close):
    q, k, v, do = qkvd(gen, 2, 4, 2, lq, lk)
    slopes = torch.rand(2, 4, generator=gen, dtype=F64)
    vis = causal_visible(lq, lk, "bottom_right")
    o, lse_seed = naive_attention(
        q, k, v, visible=vis, alibi_slopes=slopes, masked_row_lse=math.inf
    )
    # flash-attn 2's kernel adds +slope·j: the same O, LSE + slope·(i + Lk - Lq)
    o_fa, lse_fa = naive_attention(
        q, k, v, visible=vis, alibi_slopes=slopes, masked_row_lse=math.inf, alibi_key_index=True
    )
    assert_close(o_fa, o, rtol=TOL, name="the +slope·j form keeps O")
    c = torch.arange(lq, dtype=F64) + lk - lq  # (Lq,) the diagonal
    shift = slopes[:, :, None] * c  # (B, H, Lq)
    finite = torch.isfinite(lse_seed)
    assert_close(lse_fa[finite], (lse_seed + shift)[finite], rtol=TOL, name="LSE shift")
    ref, refb = all_paths(
        q, k, v, do, assert_close, want_o=o, want_lse=lse_fa, mask=mask, alibi_slopes=slopes,
        conventions=fl.FLASH_ATTN_2,
    )  # fmt: skip
    # the gradients are those of the documented mathematics
    seed = dataclasses_replace(fl.SEED, causal_align="bottom_right")
    sref = fl.reference_forward(q, k, v, mask=mask, alibi_slopes=slopes, conventions=seed)
    sb = fl.reference_backward(
        q, k, v, sref.o, sref.lse, do, mask=mask, alibi_slopes=slopes, conventions=seed
    )
    for name, a, b in (("dQ", refb.dq, sb.dq), ("dK", refb.dk, sb.dk), ("dV", refb.dv, sb.dv)):
        assert_close(a, b, rtol=TOL, name=f"{name}: flash-attn 2 vs seed")


@pytest.mark.parametrize(
    "mask",
    [None, fl.SlidingWindow(2, 0), fl.SlidingWindow(3, 1), fl.Causal("top_left")],
    ids=["none", "local(2,0)", "local(3,1)", "top-left"],
)
def test_no_shift_without_flash_attn_causal(mask, gen, assert_close):
    q, k, v, _ = qkvd(gen, 1, 2, 2, 6, 9)
    slopes = fl.alibi_slopes(2)
    fa2 = fl.reference_forward(q, k, v, mask=mask, alibi_slopes=slopes, conventions=fl.FLASH_ATTN_2)
    plain = fl.reference_forward(
        q,
        k,
        v,
        mask=mask,
        alibi_slopes=slopes,
        conventions=dataclasses_replace(fl.FLASH_ATTN_2, alibi_causal="distance"),
    )
    assert_close(fa2.lse, plain.lse, rtol=0.0, name="LSE")


def test_causal_alibi_shift_per_sequence_with_varlen(gen, assert_close):
    lq_s, lk_s, h = [3, 6, 4], [5, 2, 4], 2
    cq = torch.tensor([0, 3, 9, 13])
    ck = torch.tensor([0, 5, 7, 11])
    q, k, v = randn(gen, h, 13, 4), randn(gen, h, 11, 4), randn(gen, h, 11, 3)
    slopes = torch.rand(3, h, generator=gen, dtype=F64)  # one row per sequence
    opts: dict[str, Any] = dict(
        mask=fl.Causal(), alibi_slopes=slopes, cu_seqlens_q=cq, cu_seqlens_k=ck
    )
    fa2 = fl.blocked_forward(q, k, v, conventions=fl.FLASH_ATTN_2, block_q=2, block_k=3, **opts)
    seed = fl.blocked_forward(
        q,
        k,
        v,
        conventions=dataclasses_replace(fl.FLASH_ATTN_2, alibi_causal="distance"),
        block_q=2,
        block_k=3,
        **opts,
    )
    assert_close(fa2.o, seed.o, rtol=TOL, name="O")
    for s in range(3):
        rows = slice(int(cq[s]), int(cq[s + 1]))
        c = torch.arange(lq_s[s], dtype=F64) + lk_s[s] - lq_s[s]
        want = seed.lse[:, rows] + slopes[s][:, None] * c
        fin = torch.isfinite(seed.lse[:, rows])
        assert_close(fa2.lse[:, rows][fin], want[fin], rtol=TOL, name=f"LSE of sequence {s}")


# ============================================================================================
# 7. softcap with dropout
# ============================================================================================
@pytest.mark.parametrize("conv", [fl.FLASH_ATTN_2, fl.FLASH_ATTN_3], ids=lambda c: c.name)
def test_softcap_with_dropout_is_refused(conv, gen):
    q, k, v, do = qkvd(gen, 1, 2, 2, 4, 4)
    keep = torch.rand(4, 4, generator=gen) < 0.5
    for drop in ({"dropout_p": 0.1}, {"dropout_mask": keep}):
        for fn in (fl.reference_forward, fl.blocked_forward, fl.flash_attention):
            with pytest.raises(
                ValueError, match=rf"conventions '{conv.name}' refuse softcap together with dropout"
            ):
                fn(q, k, v, softcap=2.0, conventions=conv, **drop)
    # either alone is fine, and the seed takes the pair
    fl.blocked_forward(q, k, v, softcap=2.0, conventions=conv)
    fl.blocked_forward(q, k, v, dropout_p=0.1, conventions=conv)
    fl.blocked_forward(q, k, v, softcap=2.0, dropout_p=0.1)


# ============================================================================================
# 6. an outside keep mask, and return_attn_probs
# ============================================================================================
@st.composite
def keep_cases(draw: Any) -> dict:
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    lq, lk = draw(st.sampled_from([1, 2, 7, 13])), draw(st.sampled_from([1, 3, 9, 14]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = draw(st.sampled_from([(b, hq, lq, lk), (lq, lk), (1, hq, lq, lk), (b, 1, 1, lk)]))
    keep = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    return dict(
        q=randn(gen, b, hq, lq, 4), k=randn(gen, b, hkv, lk, 4), v=randn(gen, b, hkv, lk, 3),
        do=randn(gen, b, hq, lq, 3), keep=keep, p=draw(st.sampled_from([0.0, 0.2, 0.6])),
        mask=draw(st.sampled_from([None, fl.Causal("bottom_right"), fl.SlidingWindow(1, 1)])),
        conv=draw(st.sampled_from(list(fl.PRESETS.values()))),
        bq=draw(st.integers(1, 8)), bk=draw(st.integers(1, 8)),
    )  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(case=keep_cases())
def test_outside_keep_mask_through_every_path(case, assert_close):
    q, k, v, do, keep, p, conv = (
        case["q"],
        case["k"],
        case["v"],
        case["do"],
        case["keep"],
        case["p"],
        case["conv"],
    )
    b, hq, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = case["mask"]
    vis = None if mask is None else mask.dense(lq, lk, conventions=conv)
    full_keep = keep.expand(b, hq, lq, lk)
    o, lse, grads = naive_with_grads(
        q, k, v, do, visible=vis, keep=full_keep, dropout_p=p, masked_row_lse=conv.masked_row_lse
    )
    opts: dict[str, Any] = dict(mask=mask, conventions=conv, dropout_p=p, dropout_mask=keep)
    ref, refb = all_paths(
        q, k, v, do, assert_close, want_o=o, want_lse=lse, tiles=((case["bq"], case["bk"]),), **opts
    )
    for name, got, want in zip(("dQ", "dK", "dV"), (refb.dq, refb.dk, refb.dv), grads):
        assert_close(got, want, rtol=TOL, name=f"reference {name} vs autograd")
    assert torch.equal(ref.keep, full_keep)
    # the ledger books the dropped entries that were visible
    fwd = fl.blocked_forward(q, k, v, block_q=case["bq"], block_k=case["bk"], **opts)
    visible = (
        torch.ones(b, hq, lq, lk, dtype=torch.bool) if vis is None else vis.expand(b, hq, lq, lk)
    )
    assert fwd.ledger.counters.dropped == int((~full_keep & visible).sum())
    # the autograd op sees the same mask in its backward
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fl.flash_attention(*leaves, block_q=case["bq"], block_k=case["bk"], **opts)
    (out * do).sum().backward()
    for name, leaf, want in zip(("dQ", "dK", "dV"), leaves, grads):
        assert_close(leaf.grad, want, rtol=TOL, name=f"flash_attention {name}")


def test_keep_mask_without_dropout_p_drops_unscaled(gen, assert_close):
    """As flash-attn's test reference: kept entries scaled by 1/(1 - dropout_p), here 1."""
    q, k, v, _ = qkvd(gen, 1, 1, 1, 5, 6)
    keep = torch.rand(5, 6, generator=gen) < 0.5
    got = fl.blocked_forward(q, k, v, dropout_mask=keep, block_q=2, block_k=4)
    want, _ = naive_attention(q, k, v, keep=keep, dropout_p=0.0)
    assert_close(got.o, want, rtol=TOL, name="O")


def test_keep_mask_replaces_the_counter_based_one(gen):
    q, k, v, _ = qkvd(gen, 1, 1, 1, 6, 6)
    ones = torch.ones(6, 6, dtype=torch.bool)
    kept = fl.reference_forward(q, k, v, dropout_p=0.5, dropout_mask=ones, seed=3)
    nothing = fl.reference_forward(q, k, v)
    assert torch.allclose(kept.o, 2 * nothing.o, rtol=1e-14), "keep all, scale 1/(1-p) = 2"
    assert kept.keep is not None and bool(kept.keep.all())


def test_bad_keep_masks_are_named(gen):
    q, k, v, _ = qkvd(gen, 1, 2, 2, 4, 5)
    with pytest.raises(TypeError, match="dropout_mask must be a bool tensor"):
        fl.blocked_forward(q, k, v, dropout_mask=torch.ones(4, 5))
    with pytest.raises(ValueError, match=r"dropout_mask of shape \(4, 4\) is not broadcastable"):
        fl.reference_forward(q, k, v, dropout_mask=torch.ones(4, 4, dtype=torch.bool))


def test_return_attn_probs_as_the_test_reference_returns_them(gen, assert_close):
    q, k, v, _ = qkvd(gen, 2, 2, 1, 6, 5)
    q16, k16, v16 = q.float(), k.float(), v.float()
    vis = torch.rand(2, 1, 6, 5, generator=gen) < 0.7
    vis[0, 0, 2] = False  # a fully-masked row
    keep = torch.rand(2, 2, 6, 5, generator=gen) < 0.6
    res = fl.reference_forward(
        q16, k16, v16, mask=vis, dropout_p=0.3, dropout_mask=keep, return_attn_probs=True
    )
    assert res.attn_probs is not None and res.attn_probs.dtype == torch.float32
    s = (q @ k.transpose(-1, -2).repeat_interleave(2, dim=1)) / math.sqrt(5)
    s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # the fully-masked row as 0
    assert_close(res.attn_probs, p, rtol=1e-6, name="attn_probs")
    assert bool((res.attn_probs[0, :, 2] == 0).all())
    assert bool((res.attn_probs[~vis.expand(2, 2, 6, 5)] == 0).all())
    # dropped entries keep their value: the probabilities are taken before dropout
    assert float(res.attn_probs[~keep & vis].abs().sum()) > 0
    assert_close(
        res.o,
        (res.attn_probs.double() * keep / 0.7) @ v.repeat_interleave(2, dim=1),
        rtol=1e-6,
        name="O from them",
    )
    assert fl.reference_forward(q, k, v).attn_probs is None
    with pytest.raises(TypeError, match="return_attn_probs"):
        fl.reference_forward(q, k, v, return_attn_probs=1)  # type: ignore[arg-type]


# ============================================================================================
# 2. per-sequence ALiBi slopes with cu_seqlens
# ============================================================================================
def test_per_sequence_slopes_with_varlen_equal_each_sequence_alone(gen, assert_close):
    lq_s, h = [4, 0, 7, 3], 4  # keys per sequence: 6, 3, 5, 3
    cq = torch.tensor([0, 4, 4, 11, 14])
    ck = torch.tensor([0, 6, 9, 14, 17])
    q, k, v, do = (
        randn(gen, h, 14, 5),
        randn(gen, 2, 17, 5),
        randn(gen, 2, 17, 3),
        randn(gen, h, 14, 3),
    )
    slopes = torch.rand(4, h, generator=gen, dtype=F64)
    for mask in (None, fl.Causal(), fl.SlidingWindow(2, 1)):
        opts: dict[str, Any] = dict(
            mask=mask, alibi_slopes=slopes, cu_seqlens_q=cq, cu_seqlens_k=ck, softcap=3.0
        )
        fwd = fl.blocked_forward(q, k, v, block_q=3, block_k=2, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, block_q=3, block_k=2, **opts)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for s in range(4):
            qs, ks = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
            if lq_s[s] == 0:
                continue
            one = dict(mask=mask, alibi_slopes=slopes[s : s + 1], softcap=3.0)
            want = fl.reference_forward(q[None, :, qs], k[None, :, ks], v[None, :, ks], **one)
            wb = fl.reference_backward(
                q[None, :, qs],
                k[None, :, ks],
                v[None, :, ks],
                want.o,
                want.lse,
                do[None, :, qs],
                **one,
            )
            assert_close(fwd.o[:, qs], want.o[0], rtol=TOL, name=f"O of sequence {s} ({mask!r})")
            assert_close(fwd.lse[:, qs], want.lse[0], rtol=TOL, name=f"LSE of sequence {s}")
            assert_close(bwd.dq[:, qs], wb.dq[0], rtol=TOL, name=f"dQ of sequence {s}")
            dk[:, ks], dv[:, ks] = wb.dk[0], wb.dv[0]
        assert_close(bwd.dk, dk, rtol=TOL, name=f"dK ({mask!r})")
        assert_close(bwd.dv, dv, rtol=TOL, name=f"dV ({mask!r})")
    with pytest.raises(ValueError, match=r"\(n, H\), one row per sequence = \(4, 4\)"):
        fl.blocked_forward(
            q, k, v, alibi_slopes=torch.rand(3, h, dtype=F64), cu_seqlens_q=cq, cu_seqlens_k=ck
        )


# ============================================================================================
# 3. padding aligned to each sequence's real lengths
# ============================================================================================
def per_sequence(
    q, k, v, q_lens, k_lens, *, mask_kind, align, slopes=None, conv=fl.SEED, window=(2, 1)
):
    """Each batch element cut to its real lengths, attended on its own; padded rows O = 0."""
    b, hq, lq, _ = q.shape
    o = torch.zeros(b, hq, lq, v.shape[-1], dtype=F64)
    lse = torch.full((b, hq, lq), conv.masked_row_lse, dtype=F64)
    for i in range(b):
        a, n = q_lens[i], k_lens[i]
        if a == 0 or n == 0:
            continue
        if mask_kind == "causal":
            vis = causal_visible(a, n, align)
        elif mask_kind == "window":
            sides = window
            if conv.window_rewrite == "flash_attn_2":
                sides = fa2_sides(*window, max(k_lens))
            vis = window_visible(a, n, *sides, align)
        else:
            vis = None
        sl = None if slopes is None else slopes[i : i + 1]
        key_index = (
            mask_kind == "causal" and align == "bottom_right" and conv.alibi_causal == "key_index"
        )
        oi, li = naive_attention(
            q[i : i + 1, :, :a],
            k[i : i + 1, :, :n],
            v[i : i + 1, :, :n],
            visible=vis,
            alibi_slopes=sl,
            masked_row_lse=conv.masked_row_lse,
            alibi_key_index=key_index and sl is not None,
        )
        o[i, :, :a], lse[i, :, :a] = oi[0], li[0]
    return o, lse


MASK_KINDS = {
    "none": lambda: None,
    "causal": lambda: fl.Causal(),
    "window": lambda: fl.SlidingWindow(2, 1),
}


@pytest.mark.parametrize("kind", sorted(MASK_KINDS))
@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2, fl.FLASH_ATTN_3], ids=lambda c: c.name)
def test_padding_aligns_to_the_real_lengths(kind, conv, gen, assert_close):
    q, k, v, do = qkvd(gen, 3, 4, 2, 9, 11)
    q_lens, k_lens = [9, 4, 6], [7, 11, 0]
    slopes = torch.rand(3, 4, generator=gen, dtype=F64)
    base = MASK_KINDS[kind]()
    mask = fl.Padding(q_lens, k_lens) if base is None else base & fl.Padding(q_lens, k_lens)
    o, lse = per_sequence(
        q, k, v, q_lens, k_lens, mask_kind=kind, align=conv.causal_align, slopes=slopes, conv=conv
    )
    ref, refb = all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        want_o=o,
        want_lse=lse,
        mask=mask,
        alibi_slopes=slopes,
        conventions=conv,
    )
    # padded rows and keys take no part in the gradients
    assert bool((refb.dq[1, :, 4:] == 0).all()) and bool((refb.dk[0, :, 7:] == 0).all())
    # the same through the options
    opt = fl.blocked_forward(
        q, k, v, mask=base, seqused_q=torch.tensor(q_lens), seqused_k=torch.tensor(k_lens),
        alibi_slopes=slopes, conventions=conv, block_q=4, block_k=4,
    )  # fmt: skip
    if conv.window_rewrite == "none" or kind != "window":  # Padding rewrites against max(k_lens)
        assert_close(opt.o, o, rtol=TOL, name="seqused O")
        assert_close(opt.lse, lse, rtol=TOL, name="seqused LSE")


def test_key_padding_keeps_the_padded_diagonal(gen):
    """The issue's observation: KeyPadding & Causal aligns to the padded Lk, Padding to the real one."""
    q, k, v, _ = qkvd(gen, 2, 2, 2, 6, 10)
    br = fl.Causal("bottom_right")
    kp = fl.reference_forward(q, k, v, mask=br & fl.KeyPadding([10, 6]))
    pad = fl.reference_forward(q, k, v, mask=br & fl.Padding(k_lens=[10, 6]))
    assert torch.equal(kp.o[0], pad.o[0]), "batch 0 is unpadded"
    assert float((kp.o[1] - pad.o[1]).abs().max()) > 0.1
    # padding: row 0 of batch 1 sees keys 0..1 (c = 0 + 6 - 6); key padding: keys 0..5 (c = 4)
    assert pad.p[1, 0, 0].nonzero().flatten().tolist() == [0]
    assert kp.p[1, 0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]


def test_seqused_with_cu_seqlens_uses_the_first_keys_of_each_slot(gen, assert_close):
    cq, ck = torch.tensor([0, 3, 8]), torch.tensor([0, 6, 10])
    used_k, used_q = torch.tensor([4, 2]), torch.tensor([3, 4])
    q, k, v = randn(gen, 2, 8, 4), randn(gen, 2, 10, 4), randn(gen, 2, 10, 3)
    slopes = fl.alibi_slopes(2)
    got = fl.blocked_forward(
        q, k, v, mask=fl.Causal(), alibi_slopes=slopes, cu_seqlens_q=cq, cu_seqlens_k=ck,
        seqused_k=used_k, seqused_q=used_q, conventions=fl.FLASH_ATTN_2, block_q=2, block_k=3,
    )  # fmt: skip
    for s in range(2):
        a, n = int(used_q[s]), int(used_k[s])
        qs = slice(int(cq[s]), int(cq[s]) + a)
        ks = slice(int(ck[s]), int(ck[s]) + n)
        want = fl.reference_forward(
            q[:, qs],
            k[:, ks],
            v[:, ks],
            mask=fl.Causal(),
            alibi_slopes=slopes,
            conventions=fl.FLASH_ATTN_2,
        )
        assert_close(got.o[:, qs], want.o, rtol=TOL, name=f"O of sequence {s}")
        assert_close(got.lse[:, qs], want.lse, rtol=TOL, name=f"LSE of sequence {s}")
        rest = slice(int(cq[s]) + a, int(cq[s + 1]))
        assert bool((got.o[:, rest] == 0).all()) and bool(torch.isinf(got.lse[:, rest]).all())


def test_padding_keeps_the_interval_fast_path(gen, native_calls, assert_close):
    q, k, v, do = qkvd(gen, 2, 4, 2, 40, 50, d=16, dv=16)
    for mask, extra in (
        (fl.Causal() & fl.Padding([30, 40], [50, 20]), {}),
        (fl.SlidingWindow(5, 3) & fl.Padding(k_lens=[17, 50]), {}),
        (fl.Causal(), {"seqused_k": torch.tensor([9, 50])}),
    ):
        pb = build_problem(q, k, v, mask=mask, conventions=fl.FLASH_ATTN_2, **extra)
        assert isinstance(pb.mask, IntervalBound), f"{mask!r}: {type(pb.mask).__name__}"
        before = dict(native_calls)
        fast = fl.blocked_forward(
            q, k, v, mask=mask, conventions=fl.FLASH_ATTN_2, block_q=16, block_k=16, **extra
        )
        assert native_calls["forward"] == before["forward"] + 1, "the native step ran"
        with _native.disabled():
            slow = fl.blocked_forward(
                q, k, v, mask=mask, conventions=fl.FLASH_ATTN_2, block_q=16, block_k=16, **extra
            )
        assert_close(fast.o, slow.o, rtol=1e-12, name=f"native vs PyTorch step ({mask!r})")
        assert fast.ledger.counters == slow.ledger.counters


PAD_ERRORS = {
    "with seqused": (dict(mask=fl.Padding(k_lens=[3]), seqused_k=torch.tensor([3])), "give one"),
    "with cu_seqlens": (dict(mask=fl.Padding(k_lens=[3]), cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 5])), "cannot be combined with cu_seqlens"),
    "two": (dict(mask=fl.Padding(k_lens=[3]) & fl.Padding(q_lens=[2])), "one Padding"),
    "too long": (dict(mask=fl.Padding(k_lens=[6])), r"Padding k_lens\[0\] = 6 is outside 0..5"),
    "count": (dict(mask=fl.Padding(q_lens=[1, 2, 3])), "needs one per batch element"),
    "seqused count": (dict(seqused_k=torch.tensor([1, 2])), "seqused_k has 2 entries"),
    "seqused range": (dict(seqused_q=torch.tensor([5])), r"seqused_q\[0\] = 5 is outside 0..4"),
    "seqused float": (dict(seqused_k=torch.tensor([1.0])), "1-D integer"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PAD_ERRORS))
def test_padding_errors_are_named(case, gen):
    q, k, v, _ = qkvd(gen, 1, 1, 1, 4, 5)
    kw, words = PAD_ERRORS[case]
    if "cu_seqlens_q" in kw:
        q, k, v = q[0], k[0], v[0]
    with pytest.raises(ValueError, match=words):
        fl.blocked_forward(q, k, v, **kw)


def test_padding_needs_a_length_and_integers():
    with pytest.raises(ValueError, match="needs q_lens, k_lens or both"):
        fl.Padding()
    with pytest.raises(ValueError, match="1-D integer"):
        fl.Padding(k_lens=[1.5])
    with pytest.raises(ValueError, match=">= 0"):
        fl.Padding(q_lens=[-1])


@st.composite
def padded_cases(draw: Any) -> dict:
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 2))
    lq, lk = draw(st.integers(1, 13)), draw(st.integers(1, 13))
    q_lens = [draw(st.integers(0, lq)) for _ in range(b)]
    k_lens = [draw(st.integers(0, lk)) for _ in range(b)]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return dict(
        q=randn(gen, b, hq, lq, 3), k=randn(gen, b, hkv, lk, 3), v=randn(gen, b, hkv, lk, 2),
        do=randn(gen, b, hq, lq, 2), q_lens=q_lens, k_lens=k_lens,
        kind=draw(st.sampled_from(sorted(MASK_KINDS))), alibi=draw(st.booleans()),
        conv=draw(st.sampled_from(list(fl.PRESETS.values()))), slopes=torch.rand(b, hq, generator=gen, dtype=F64),
        bq=draw(st.integers(1, 6)), bk=draw(st.integers(1, 6)),
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(case=padded_cases())
def test_padding_property(case, assert_close):
    q, k, v, do, conv = case["q"], case["k"], case["v"], case["do"], case["conv"]
    base = MASK_KINDS[case["kind"]]()
    pad = fl.Padding(case["q_lens"], case["k_lens"])
    mask = pad if base is None else base & pad
    slopes = case["slopes"] if case["alibi"] else None
    o, lse = per_sequence(
        q,
        k,
        v,
        case["q_lens"],
        case["k_lens"],
        mask_kind=case["kind"],
        align=conv.causal_align,
        slopes=slopes,
        conv=conv,
    )
    all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        want_o=o,
        want_lse=lse,
        tiles=((case["bq"], case["bk"]),),
        mask=mask,
        alibi_slopes=slopes,
        conventions=conv,
    )


def test_the_ring_takes_padding_but_refuses_seqused(gen):
    q, k, v, _ = qkvd(gen, 1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="does not take seqused_k"):
        fl.simulate_ring(q, k, v, world_size=2, seqused_k=torch.tensor([5]))


def test_padding_dense_and_tiles_are_the_formula(assert_same):
    m = fl.Causal("bottom_right") & fl.Padding([5, 2], [3, 6])
    got = m.dense(6, 7, batch=2)  # (B, 1, Lq, Lk)
    for b, (a, n) in enumerate(((5, 3), (2, 6))):
        want = torch.zeros(6, 7, dtype=torch.bool)
        want[:a, :n] = causal_visible(a, n, "bottom_right")
        assert_same(got[b, 0], want, name=f"batch {b}")
    classes = m.tile_classes(6, 7, 2, 3, batch=2)
    dense = got.expand(2, 1, 6, 7)
    for i in range(3):
        for j in range(3):
            tile = dense[..., 2 * i : 2 * i + 2, 3 * j : 3 * j + 3]
            want_c = 0 if not bool(tile.any()) else (2 if bool(tile.all()) else 1)
            assert int(classes[i, j]) == want_c, (i, j)


@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2], ids=lambda c: c.name)
def test_lengths_that_break_tiling(conv, gen, assert_close):
    """97 queries, 113 keys, real lengths 97/50 and 113/71, GQA, a keep mask, ragged tiles."""
    q, k, v, do = qkvd(gen, 2, 3, 1, 97, 113, d=8, dv=8)
    pad = fl.Padding([97, 50], [113, 71])
    keep = torch.rand(2, 3, 97, 113, generator=gen) < 0.85
    slopes = torch.rand(2, 3, generator=gen, dtype=F64)
    o, lse = per_sequence(
        q,
        k,
        v,
        [97, 50],
        [113, 71],
        mask_kind="causal",
        align=conv.causal_align,
        slopes=slopes,
        conv=conv,
    )
    all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        want_o=o,
        want_lse=lse,
        tiles=((32, 32), (64, 48)),
        mask=fl.Causal() & pad,
        alibi_slopes=slopes,
        conventions=conv,
    )
    opts: dict[str, Any] = dict(
        mask=fl.Causal() & pad, conventions=conv, dropout_p=0.15, dropout_mask=keep
    )
    ref = fl.reference_forward(q, k, v, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    for bq, bk in ((32, 32), (64, 48)):
        fwd = fl.blocked_forward(q, k, v, block_q=bq, block_k=bk, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, block_q=bq, block_k=bk, **opts)
        for name, a, b in (
            ("O", fwd.o, ref.o),
            ("dQ", bwd.dq, refb.dq),
            ("dK", bwd.dk, refb.dk),
            ("dV", bwd.dv, refb.dv),
        ):
            assert_close(a, b, rtol=TOL, name=f"{name} with the keep mask ({bq}x{bk})")
