"""Features through every path: dense oracle, blocked fwd+bwd (traced and not), the autograd op.

Dropout, softcap, ALiBi, additive bias (with dBias), a differentiable LSE,
variable length, split-KV, gradcheck and low-precision inputs. Each is checked
against PyTorch autograd of the naive formula (tests/naive.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
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
    tile_classes_from_dense,
)

import flashledger as fl
from flashledger import _native

TOL = 1e-12
f64 = torch.float64


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=f64, generator=gen)


def check_all_paths(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    assert_close: Callable[..., None],
    *,
    naive_kw: dict[str, Any],
    bias: torch.Tensor | None = None,
    tiles: tuple[tuple[int, int], ...] = ((3, 2), (1, 4)),
    **opts: Any,
) -> fl.ReferenceForward:
    """Oracle == naive autograd; blocked (both orders, traced or not) and the op == oracle."""
    ref = fl.reference_forward(q, k, v, bias=bias, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, bias=bias, **opts)
    o_n, lse_n, (dq_n, dk_n, dv_n, db_n) = naive_with_grads(q, k, v, do, bias=bias, **naive_kw)
    assert_close(ref.o, o_n.reshape(ref.o.shape), rtol=TOL, name="oracle O vs autograd")
    assert_close(ref.lse, lse_n.reshape(ref.lse.shape), rtol=TOL, name="oracle LSE vs autograd")
    want = {"dQ": dq_n, "dK": dk_n, "dV": dv_n}
    for name, t in (("dQ", refb.dq), ("dK", refb.dk), ("dV", refb.dv)):
        assert_close(t, want[name], rtol=TOL, name=f"oracle {name} vs autograd")
    if bias is not None:
        assert_close(refb.dbias, db_n, rtol=TOL, name="oracle dBias vs autograd")
        want["dBias"] = db_n
    for bq, bk in tiles:
        for order in ("fa2", "fa1"):
            runs = []
            # the fast path with its native step (where it applies), with the PyTorch step,
            # and traced
            for trace, step in ((False, "native"), (False, "pytorch"), (True, "pytorch")):
                kw = dict(bias=bias, block_q=bq, block_k=bk, loop_order=order, trace=trace)
                with _native.disabled() if step == "pytorch" else contextlib.nullcontext():
                    fwd = fl.blocked_forward(q, k, v, **opts, **kw)
                    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, **kw)
                where = f"({order}, tiles {bq}x{bk}, trace={trace}, {step} step)"
                assert_close(fwd.o, ref.o, rtol=TOL, name=f"blocked O {where}")
                assert_close(fwd.lse, ref.lse, rtol=TOL, name=f"blocked LSE {where}")
                got = {"dQ": bwd.dq, "dK": bwd.dk, "dV": bwd.dv}
                if bias is not None:
                    got["dBias"] = bwd.dbias
                for name, t in got.items():
                    assert not bool(torch.isnan(t).any()), f"NaN in blocked {name} {where}"
                    assert_close(t, want[name], rtol=TOL, name=f"blocked {name} {where}")
                runs.append((fwd, bwd))
            (fn, bn), (f0, b0), (f1, b1) = runs
            assert torch.equal(f0.o, f1.o) and torch.equal(b0.dq, b1.dq), "tracing changed a result"
            assert fn.ledger.counters == f0.ledger.counters == f1.ledger.counters
            assert bn.ledger.counters == b0.ledger.counters == b1.ledger.counters
    # the autograd op
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    bleaf = None if bias is None else bias.detach().clone().requires_grad_(True)
    o = fl.flash_attention(*leaves, bias=bleaf, block_q=tiles[0][0], block_k=tiles[0][1], **opts)
    assert_close(o, ref.o, rtol=TOL, name="flash_attention O")
    (o * do).sum().backward()
    for name, leaf in zip(("dQ", "dK", "dV"), leaves):
        assert_close(leaf.grad, want[name], rtol=TOL, name=f"flash_attention {name}")
    if bleaf is not None:
        assert_close(bleaf.grad, want["dBias"], rtol=TOL, name="flash_attention dBias")
    return ref


def _qkvd(
    gen: torch.Generator,
    b: int = 2,
    hq: int = 4,
    hkv: int = 2,
    lq: int = 7,
    lk: int = 9,
    d: int = 5,
    dv: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``, v ``(B, Hkv, Lk, d_v)``, dO ``(B, Hq, Lq, d_v)``."""
    return (
        _randn(gen, b, hq, lq, d),
        _randn(gen, b, hkv, lk, d),
        _randn(gen, b, hkv, lk, dv),
        _randn(gen, b, hq, lq, dv),
    )


# -- dropout --------------------------------------------------------------------------------
@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2], ids=lambda c: c.name)
def test_dropout_through_every_path(conv, gen, assert_close):
    q, k, v, do = _qkvd(gen)
    mask = fl.Causal("bottom_right") & fl.KeyPadding([9, 5])
    ref = fl.reference_forward(q, k, v, mask=mask, dropout_p=0.25, seed=11, conventions=conv)
    assert ref.keep is not None and ref.keep.shape == (2, 4, 7, 9)
    visible = mask.dense(7, 9, batch=2, heads=4)
    check_all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        naive_kw=dict(visible=visible, keep=ref.keep, dropout_p=0.25),
        mask=mask,
        dropout_p=0.25,
        seed=11,
        conventions=conv,
    )
    # the LSE is computed before dropout
    plain = fl.reference_forward(q, k, v, mask=mask, conventions=conv)
    assert_close(ref.lse, plain.lse, rtol=0.0, name="LSE with and without dropout")
    assert_close(ref.o, (ref.p * ref.keep / 0.75) @ v.repeat_interleave(2, 1), rtol=TOL, name="O")


def test_dropout_same_seed_same_mask_for_every_tiling(gen, assert_same):
    q, k, v, _ = _qkvd(gen, lq=11, lk=10)
    ref = fl.reference_forward(q, k, v, dropout_p=0.4, seed=3)
    for bq, bk, order in [(1, 1, "fa2"), (4, 3, "fa2"), (11, 10, "fa1"), (5, 7, "fa1")]:
        res = fl.blocked_forward(
            q, k, v, dropout_p=0.4, seed=3, block_q=bq, block_k=bk, loop_order=order, trace=True
        )
        keep = torch.zeros_like(ref.keep)
        for r in res.ledger.records:
            (q0, q1), (k0, k1) = r.q_range, r.k_range
            keep[..., q0:q1, k0:k1] = r.keep
        assert_same(keep, ref.keep, name=f"keep mask with tiles {bq}x{bk} ({order})")
    other = fl.reference_forward(q, k, v, dropout_p=0.4, seed=4).keep
    frac = float((other != ref.keep).float().mean())
    assert frac > 0.3, f"seeds 3 and 4 give masks differing in only {frac:.3f} of entries"
    # batch and head enter the hash: the (b, h) slices are not copies of each other
    assert not torch.equal(ref.keep[0, 0], ref.keep[0, 1])
    assert not torch.equal(ref.keep[0, 0], ref.keep[1, 0])


@pytest.mark.parametrize(
    ("conv", "p", "rate"),
    [
        (fl.SEED, 0.17, 0.83),
        (fl.SEED, 0.5, 0.5),
        (fl.FLASH_ATTN_2, 0.17, (math.floor(0.83 * 255) + 1) / 256),
        (fl.FLASH_ATTN_2, 0.9, (math.floor(0.1 * 255) + 1) / 256),
    ],
    ids=["bernoulli-0.17", "bernoulli-0.5", "fa2_8bit-0.17", "fa2_8bit-0.9"],
)
def test_dropout_keep_rate(conv, p, rate):
    x = torch.zeros(2, 4, 256, 256, dtype=torch.float32)
    keep = fl.reference_forward(x, x, x[..., :1], dropout_p=p, seed=9, conventions=conv).keep
    frac = float(keep.float().mean())
    assert abs(frac - rate) < 0.01, f"{conv.dropout_keep}: kept {frac:.4f}, expected {rate:.4f}"
    if conv.dropout_keep == "fa2_8bit" and p == 0.17:
        assert abs(rate - 0.828) < 5e-4
        assert abs(frac - 0.828) < 0.01
    assert abs(frac - rate) < 5 * math.sqrt(rate * (1 - rate) / keep.numel()) + 1e-4


@pytest.mark.parametrize("p", [0.17, 0.5, 0.9])
def test_each_keep_test_is_its_documented_rule_at_every_position(p):
    """The keep mask the reference returns is, entry by entry, the rule dropout.py
    documents on the 32 bits ``random_bits`` gives each (batch, head, query, key):
    ``u < round((1 - p) 2^32)`` (bernoulli) and ``(u & 255) <= floor((1 - p) 255)``
    (flash-attn 2's byte test), its threshold byte itself kept; the rates alone could not
    tell ``<=`` from ``<``."""
    from flashledger.dropout import random_bits

    q, k = torch.zeros(2, 3, 64, 4), torch.zeros(2, 3, 96, 4)
    b, h, i, j = (torch.arange(n).view(*([1] * a), n, *([1] * (3 - a))) for a, n in
                  enumerate((2, 3, 64, 96)))  # fmt: skip
    u = random_bits(5, b, h, i, j)  # (2, 3, 64, 96) in [0, 2^32)
    for conv, want in (
        (fl.SEED, u < round((1 - p) * 2**32)),
        (fl.FLASH_ATTN_2, (u & 255) <= math.floor((1 - p) * 255)),
    ):
        keep = fl.reference_forward(q, k, k, dropout_p=p, seed=5, conventions=conv).keep
        assert keep is not None and torch.equal(keep, want), conv.name
    threshold = (u & 255) == math.floor((1 - p) * 255)
    assert int(threshold.sum()) > 0, "no entry on the threshold byte: the case tests nothing"


# -- softcap, ALiBi, bias ---------------------------------------------------------------------
def test_softcap_through_every_path(gen, assert_close):
    q, k, v, do = _qkvd(gen)
    q, k = 3 * q, 3 * k  # scores well into tanh's curve
    mask = fl.SlidingWindow(3, 1, align="bottom_right")
    ref = check_all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        naive_kw=dict(visible=mask.dense(7, 9), softcap=2.5),
        mask=mask,
        softcap=2.5,
    )
    finite = ref.s[torch.isfinite(ref.s)]
    assert float(finite.abs().max()) < 2.5, "softcapped scores stay inside (-c, c)"


def test_alibi_slopes_schedule():
    got8 = fl.alibi_slopes(8)
    assert got8.tolist() == [2.0**-n for n in range(1, 9)]
    # non-power-of-two: the 4-head schedule, then every other slope of the 8-head one
    got6 = fl.alibi_slopes(6)
    assert got6.tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert fl.alibi_slopes(1).tolist() == [2.0**-8]
    got12 = fl.alibi_slopes(12).tolist()
    assert got12[:8] == [2.0**-n for n in range(1, 9)]
    want12 = [2.0 ** -(n + 0.5) for n in range(4)]
    assert all(math.isclose(a, b, rel_tol=1e-15) for a, b in zip(got12[8:], want12)), got12
    assert fl.alibi_slopes(4, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("per_batch", [False, True], ids=["(H,)", "(B,H)"])
def test_alibi_through_every_path(per_batch, gen, assert_close):
    q, k, v, do = _qkvd(gen, lq=9, lk=6)
    slopes = fl.alibi_slopes(4)
    if per_batch:
        slopes = torch.stack([slopes, 2 * slopes.flip(0)])  # (B, H)
    mask = fl.Causal("bottom_right")
    check_all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        naive_kw=dict(visible=mask.dense(9, 6), alibi_slopes=slopes),
        mask=mask,
        alibi_slopes=slopes,
    )


@pytest.mark.parametrize(
    "shape",
    [(9,), (7, 9), (4, 1, 9), (2, 1, 1, 9), (2, 4, 7, 9), (1, 4, 7, 1)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_bias_through_every_path_with_dbias(shape, gen, assert_close):
    q, k, v, do = _qkvd(gen)
    bias = _randn(gen, *shape)
    if shape[-1] == 9:
        bias[..., 2] = -math.inf  # a key blocked by the bias
    if shape == (2, 4, 7, 9):
        bias[1, 2, 3] = -math.inf  # a row that sees nothing through the bias alone
    ref = check_all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        naive_kw=dict(masked_row_lse=0.0),
        bias=bias,
        conventions=fl.SDPA_CPU,
    )
    if shape == (2, 4, 7, 9):
        assert float(ref.lse[1, 2, 3]) == 0.0, "a row blocked by the bias follows the convention"
        assert bool((ref.o[1, 2, 3] == 0).all())


def test_features_combined_with_a_mask(gen, assert_close):
    q, k, v, do = _qkvd(gen, lq=10, lk=8)
    dense = torch.rand(2, 4, 10, 8, generator=gen) < 0.7
    dense[0, :, 2] = False
    mask = fl.DenseMask(dense) & fl.Causal("bottom_right")
    slopes = fl.alibi_slopes(4)
    bias = _randn(gen, 1, 4, 10, 8)
    # flash-attn 2's LSE and dropout edges, with softcap and dropout together (which the
    # FLASH_ATTN_2 preset itself refuses, as flash-attn 2 does)
    conv = dataclasses.replace(
        fl.FLASH_ATTN_2, name="fa2_with_softcap_dropout", softcap_with_dropout=True
    )
    ref = fl.reference_forward(q, k, v, mask=mask, dropout_p=0.2, seed=2, conventions=conv)
    check_all_paths(
        q,
        k,
        v,
        do,
        assert_close,
        naive_kw=dict(
            visible=mask.dense(10, 8, batch=2, heads=4),
            softcap=1.5,
            alibi_slopes=slopes,
            keep=ref.keep,
            dropout_p=0.2,
            masked_row_lse=math.inf,
            alibi_key_index=True,  # causal: flash-attn 2 adds +slope·j
        ),
        bias=bias,
        tiles=((4, 3),),
        mask=mask,
        softcap=1.5,
        alibi_slopes=slopes,
        dropout_p=0.2,
        seed=2,
        conventions=conv,
    )


# -- differentiable LSE --------------------------------------------------------------------
@pytest.mark.parametrize(
    "conv", [fl.SEED, fl.FLEX_ATTENTION, fl.FLASH_ATTN_2, fl.SDPA_CPU], ids=lambda c: c.name
)
def test_lse_gradient_follows_the_conventions(conv, gen, assert_close):
    q, k, v, do = _qkvd(gen)
    dlse = _randn(gen, 2, 4, 7)
    mask = fl.Causal("top_left") & fl.KeyPadding([9, 0])  # batch 1: every row fully masked
    visible = mask.dense(7, 9, batch=2, heads=4)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    o, lse = fl.flash_attention(
        *leaves, mask=mask, conventions=conv, block_q=3, block_k=4, return_lse=True
    )
    loss = (o * do).sum() + torch.where(torch.isinf(lse), 0.0, lse * dlse).sum()
    loss.backward()
    use = conv.lse_differentiable
    _, lse_n, grads = naive_with_grads(
        q, k, v, do, dlse=dlse if use else None, visible=visible, masked_row_lse=conv.masked_row_lse
    )
    assert_close(lse, lse_n, rtol=TOL, name="LSE")
    for name, leaf, want in zip(("dQ", "dK", "dV"), leaves, grads):
        assert_close(leaf.grad, want, rtol=TOL, name=f"{name} ({conv.name}, dLSE used: {use})")
    if use:
        # the LSE term matters: without it the gradient differs
        _, _, plain = naive_with_grads(q, k, v, do, visible=visible)
        assert float((leaves[0].grad - plain[0]).abs().max()) > 1e-3


# -- variable length ----------------------------------------------------------------------
SEQS = [  # (lengths of queries, lengths of keys)
    ([3, 5, 4], [3, 5, 4]),
    ([2, 0, 6, 3], [5, 4, 0, 3]),  # an empty query sequence, an empty key sequence
    ([7, 1], [2, 6]),  # Lq > Lk in a sequence: bottom-right leaves rows fully masked
]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("seqs", SEQS, ids=["equal", "with-empty", "lq>lk"])
@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2, fl.SDPA_CPU], ids=lambda c: c.name)
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "causal"])
def test_varlen_equals_each_sequence_on_its_own(seqs, conv, masked, gen, assert_close):
    lq_s, lk_s = seqs
    h, d, dv = 3, 4, 2
    q, k = _randn(gen, h, sum(lq_s), d), _randn(gen, h, sum(lk_s), d)
    v, do = _randn(gen, h, sum(lk_s), dv), _randn(gen, h, sum(lq_s), dv)
    slopes = fl.alibi_slopes(h)
    cq, ck = _cu(lq_s), _cu(lk_s)
    opts: dict[str, Any] = dict(
        mask=fl.Causal() if masked else None, conventions=conv, softcap=4.0, alibi_slopes=slopes
    )
    fwd = fl.blocked_forward(
        q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, block_q=2, block_k=3, **opts
    )
    assert fwd.o.shape == (h, sum(lq_s), dv) and fwd.lse.shape == (h, sum(lq_s))
    bwd = fl.blocked_backward(
        q, k, v, fwd.o, fwd.lse, do, cu_seqlens_q=cq, cu_seqlens_k=ck, block_q=2, block_k=3, **opts
    )
    ref = fl.reference_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **opts)
    assert_close(fwd.o, ref.o, rtol=TOL, name="varlen O vs varlen oracle")
    dk = torch.zeros_like(k)
    dv_ = torch.zeros_like(v)
    visible = torch.zeros(sum(lq_s), sum(lk_s), dtype=torch.bool)
    for n, (a, b) in enumerate(zip(lq_s, lk_s)):
        qs, ks = slice(int(cq[n]), int(cq[n + 1])), slice(int(ck[n]), int(ck[n + 1]))
        if a == 0:
            continue
        where = f"sequence {n} ({a} queries, {b} keys)"
        if b == 0:
            assert bool((fwd.o[:, qs] == 0).all()), f"{where}: O must be 0"
            assert_close(
                fwd.lse[:, qs],
                torch.full((h, a), conv.masked_row_lse, dtype=f64),
                rtol=0.0,
                name=where,
            )
            assert bool((bwd.dq[:, qs] == 0).all()), f"{where}: dQ must be 0"
            continue
        vis = (
            causal_visible(a, b, conv.causal_align)
            if masked
            else torch.ones(a, b, dtype=torch.bool)
        )
        visible[qs, ks] = vis
        o_n, lse_n, (dq_n, dk_n, dv_n, _) = naive_with_grads(
            q[:, qs],
            k[:, ks],
            v[:, ks],
            do[:, qs],
            visible=vis,
            softcap=4.0,
            alibi_slopes=slopes,
            masked_row_lse=conv.masked_row_lse,
            alibi_key_index=masked and conv.alibi_causal == "key_index",
        )
        assert_close(fwd.o[:, qs], o_n[0], rtol=TOL, name=f"O of {where}")
        assert_close(fwd.lse[:, qs], lse_n[0], rtol=TOL, name=f"LSE of {where}")
        assert_close(bwd.dq[:, qs], dq_n, rtol=TOL, name=f"dQ of {where}")
        dk[:, ks], dv_[:, ks] = dk_n, dv_n
    assert_close(bwd.dk, dk, rtol=TOL, name="varlen dK")
    assert_close(bwd.dv, dv_, rtol=TOL, name="varlen dV")
    # tiles between different sequences are skipped; counters follow the block-diagonal mask
    classes = tile_classes_from_dense(visible, 2, 3)
    kinds = [[["empty", "partial", "full"][int(c)] for c in row] for row in classes.tolist()]
    assert fwd.ledger.tile_kinds == kinds
    c = fwd.ledger.counters
    assert c.qk_dots_visible == int(visible.sum()) * h
    assert c.tiles_skipped == int((classes == 0).sum())
    assert c.tiles_run == int((classes != 0).sum())


@st.composite
def varlen_cases(draw: Any) -> dict:
    n = draw(st.integers(1, 4))
    lq_s = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    lk_s = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    if sum(lq_s) == 0:
        lq_s[0] = 1
    if sum(lk_s) == 0:
        lk_s[-1] = 1
    h = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tq, tk = sum(lq_s), sum(lk_s)
    kind = draw(st.sampled_from(["none", "causal", "window", "dense", "window&dense"]))
    dense = torch.rand(h, tq, tk, generator=gen) < 0.6
    window = fl.SlidingWindow(draw(st.integers(0, 3)), draw(st.sampled_from([None, 0, 2])))
    mask = {
        "none": None,
        "causal": fl.Causal(),
        "window": window,
        "dense": fl.DenseMask(dense),
        "window&dense": window & fl.DenseMask(dense),
    }[kind]
    return dict(
        lq_s=lq_s,
        lk_s=lk_s,
        q=torch.randn(h, tq, 3, dtype=f64, generator=gen),
        k=torch.randn(h, tk, 3, dtype=f64, generator=gen),
        v=torch.randn(h, tk, 2, dtype=f64, generator=gen),
        do=torch.randn(h, tq, 2, dtype=f64, generator=gen),
        mask=mask,
        dense=dense if "dense" in kind else None,
        window=window if "window" in kind else None,
        conv=draw(st.sampled_from(list(fl.PRESETS.values()))),
        softcap=draw(st.sampled_from([None, 2.0])),
        block_q=draw(st.integers(1, 12)),
        block_k=draw(st.integers(1, 12)),
    )


@settings(max_examples=30, deadline=None)
@given(case=varlen_cases())
def test_varlen_property_equals_each_sequence_on_its_own(case, assert_close):
    lq_s, lk_s, conv = case["lq_s"], case["lk_s"], case["conv"]
    q, k, v, do = case["q"], case["k"], case["v"], case["do"]
    cq, ck = _cu(lq_s), _cu(lk_s)
    opts: dict[str, Any] = dict(
        mask=case["mask"],
        conventions=conv,
        softcap=case["softcap"],
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
    )
    tiles = dict(block_q=case["block_q"], block_k=case["block_k"])
    fwd = fl.blocked_forward(q, k, v, **opts, **tiles)
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, **tiles)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for n in range(len(lq_s)):
        qs, ks = slice(int(cq[n]), int(cq[n + 1])), slice(int(ck[n]), int(ck[n + 1]))
        if lq_s[n] == 0:
            continue
        where = f"sequence {n} ({lq_s[n]} queries, {lk_s[n]} keys)"
        if lk_s[n] == 0:
            assert bool((fwd.o[:, qs] == 0).all()), f"{where}: O must be 0"
            want = torch.full((q.shape[0], lq_s[n]), conv.masked_row_lse, dtype=f64)
            assert_close(fwd.lse[:, qs], want, rtol=0.0, name=f"LSE of {where}")
            continue
        mask = None
        one_conv = conv
        if case["window"] is not None:
            mask = case["window"]
            if conv.window_rewrite == "flash_attn_2":
                # flash-attn 2 reads the sides against max_seqlen_k, not this sequence's length
                sides = fa2_sides(mask.left, mask.right, max(lk_s))
                mask = fl.SlidingWindow(*(None if x < 0 else x for x in sides))
                one_conv = dataclasses.replace(conv, window_rewrite="none")
        elif case["mask"] is not None and case["dense"] is None:
            mask = case["mask"]
        if case["dense"] is not None:
            part = fl.DenseMask(case["dense"][:, qs, ks])
            mask = part if mask is None else mask & part
        one = dict(mask=mask, conventions=one_conv, softcap=case["softcap"])
        ref = fl.reference_forward(q[:, qs], k[:, ks], v[:, ks], **one)
        refb = fl.reference_backward(q[:, qs], k[:, ks], v[:, ks], ref.o, ref.lse, do[:, qs], **one)
        assert_close(fwd.o[:, qs], ref.o, rtol=TOL, name=f"O of {where}")
        assert_close(fwd.lse[:, qs], ref.lse, rtol=TOL, name=f"LSE of {where}")
        assert_close(bwd.dq[:, qs], refb.dq, rtol=TOL, name=f"dQ of {where}")
        dk[:, ks], dv[:, ks] = refb.dk, refb.dv
    assert_close(bwd.dk, dk, rtol=TOL, name="varlen dK")
    assert_close(bwd.dv, dv, rtol=TOL, name="varlen dV")
    for name, t in (("O", fwd.o), ("dQ", bwd.dq), ("dK", bwd.dk), ("dV", bwd.dv)):
        assert not bool(torch.isnan(t).any()), f"NaN in varlen {name}"


def test_varlen_through_the_autograd_op_and_2d_layout(gen, assert_close):
    cq, ck = _cu([4, 3]), _cu([2, 5])
    q, k, v, do = _randn(gen, 7, 3), _randn(gen, 7, 3), _randn(gen, 7, 2), _randn(gen, 7, 2)
    opts = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, mask=fl.Causal("bottom_right"))
    ref = fl.reference_forward(q, k, v, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    assert ref.o.shape == (7, 2) and ref.lse.shape == (7,)
    assert bool(torch.isneginf(ref.lse[:2]).all()), "rows 0, 1 see no key (bottom-right, 4 > 2)"
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o = fl.flash_attention(*leaves, **opts, block_q=3, block_k=2)
    (o * do).sum().backward()
    assert_close(o, ref.o, rtol=TOL, name="O")
    for name, leaf, want in zip(("dQ", "dK", "dV"), leaves, (refb.dq, refb.dk, refb.dv)):
        assert_close(leaf.grad, want, rtol=TOL, name=name)


# -- split-KV --------------------------------------------------------------------------------
@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2, fl.SDPA_CPU], ids=lambda c: c.name)
def test_split_kv_equals_the_unsplit_result(conv, gen, assert_close):
    q, k, v, _ = _qkvd(gen, lq=6, lk=11)
    dense = torch.rand(2, 4, 6, 11, generator=gen) < 0.6
    dense[1, 3, 4] = False
    opts: dict[str, Any] = dict(
        mask=fl.Causal("top_left") & fl.DenseMask(dense) & fl.KeyPadding([11, 8]),
        conventions=conv,
        alibi_slopes=fl.alibi_slopes(4),
        bias=_randn(gen, 6, 11),
        softcap=3.0 if conv.softcap_with_dropout else None,  # flash-attn 2 refuses the pair
        dropout_p=0.3,
        seed=21,
    )
    whole = fl.blocked_forward(q, k, v, block_q=4, block_k=3, **opts)
    ref = fl.reference_forward(q, k, v, **opts)
    empty = torch.isneginf(ref.s).all(-1)
    assert bool(empty.any()), "the case must include fully-masked rows"
    for n in range(1, 12):
        part = fl.split_kv_forward(q, k, v, num_splits=n, block_q=4, block_k=3, **opts)
        assert_close(part.o, ref.o, rtol=TOL, name=f"O with {n} splits")
        assert_close(part.lse, ref.lse, rtol=TOL, name=f"LSE with {n} splits")
        assert not bool(torch.isnan(part.o).any())
        c = part.ledger.counters
        assert c.qk_dots_visible == whole.ledger.counters.qk_dots_visible, f"{n} splits"
        assert c.dropped == whole.ledger.counters.dropped, f"{n} splits"


@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2, fl.SDPA_CPU], ids=lambda c: c.name)
def test_placed_chunks_merge_to_the_whole(conv, gen, assert_close):
    """Key chunks run with global placement and raw LSE, merged by the one merge."""
    q, k, v, _ = _qkvd(gen, lq=6, lk=10)
    opts: dict[str, Any] = dict(
        mask=fl.Causal(), conventions=conv, alibi_slopes=fl.alibi_slopes(4), dropout_p=0.2, seed=4
    )
    ref = fl.reference_forward(q, k, v, **opts)
    o = lse = None
    for k0, k1 in [(0, 3), (3, 4), (4, 10)]:
        place = fl.Placement(k_offset=k0, lq_total=6, lk_total=10)
        part = fl.blocked_forward(
            q, k[..., k0:k1, :], v[..., k0:k1, :], **opts, placement=place, raw_lse=True
        )
        if o is None:
            o, lse = part.o, part.lse
        else:
            o, lse = fl.merge_partials(o, lse, part.o, part.lse)
    assert_close(o, ref.o, rtol=TOL, name="merged O")
    raw = torch.where(torch.isneginf(ref.s).all(-1), -math.inf, ref.lse)
    assert_close(lse, raw, rtol=TOL, name="merged LSE (raw: -inf on fully-masked rows)")


# -- gradcheck ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts",
    [
        dict(mask=fl.Causal("bottom_right")),
        dict(softcap=1.3, alibi_slopes=torch.tensor([0.5, 0.25], dtype=f64)),
        dict(mask=fl.SlidingWindow(1, 1), dropout_p=0.3, seed=1, conventions=fl.FLASH_ATTN_2),
    ],
    ids=["causal", "softcap+alibi", "window+dropout"],
)
def test_gradcheck_flash_attention_with_bias(opts, gen):
    q = _randn(gen, 1, 2, 4, 3).requires_grad_(True)
    k = _randn(gen, 1, 1, 5, 3).requires_grad_(True)
    v = _randn(gen, 1, 1, 5, 2).requires_grad_(True)
    bias = _randn(gen, 1, 2, 4, 5).requires_grad_(True)

    differentiable_lse = opts.get("conventions", fl.SEED).lse_differentiable

    def f(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        o, lse = fl.flash_attention(
            q, k, v, bias=bias, block_q=3, block_k=2, return_lse=True, **opts
        )
        # flash-attn conventions ignore a gradient on the LSE: only O is checked there
        return (o, lse) if differentiable_lse else o

    assert torch.autograd.gradcheck(f, (q, k, v, bias), fast_mode=True)


# -- dtypes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2), (torch.float32, 2e-6)],
    ids=["float16", "bfloat16", "float32"],
)
def test_low_precision_inputs(dtype, rtol, gen, assert_close):
    q, k, v, do = (x.to(dtype) for x in _qkvd(gen, lq=33, lk=40, d=8, dv=8))
    mask = fl.Causal("bottom_right")
    fwd = fl.blocked_forward(q, k, v, mask=mask, block_q=8, block_k=16, trace=True)
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, mask=mask, block_q=8, block_k=16)
    assert fwd.o.dtype == dtype and bwd.dq.dtype == dtype and bwd.dk.dtype == dtype
    assert fwd.lse.dtype == torch.float32, "statistics stay in the float32 accumulator"
    rec = fwd.ledger.records[0]
    assert rec.acc.dtype == torch.float32 and rec.s.dtype == torch.float32
    # the oracle on the very same (rounded) inputs, in float64
    ref = fl.reference_forward(q, k, v, mask=mask)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask)
    assert_close(fwd.o, ref.o, rtol=rtol, name=f"O in {dtype}")
    assert_close(fwd.lse, ref.lse, rtol=1e-5, name=f"LSE in {dtype}")
    for name, got, want in (
        ("dQ", bwd.dq, refb.dq),
        ("dK", bwd.dk, refb.dk),
        ("dV", bwd.dv, refb.dv),
    ):
        assert_close(got, want, rtol=2 * rtol, name=f"{name} in {dtype}")
    # and no worse than a plain same-dtype PyTorch implementation (flash-attn's yardstick)
    naive_o, _ = naive_attention(q, k, v, visible=mask.dense(33, 40))
    assert naive_o.dtype == dtype
    err_pt = float((naive_o.double() - ref.o).abs().max())
    err = float((fwd.o.double() - ref.o).abs().max())
    assert err <= 2 * err_pt + 1e-6, f"blocked error {err:.3g} vs same-dtype naive {err_pt:.3g}"
    o = fl.flash_attention(q, k, v, mask=mask, block_q=8, block_k=16)
    assert o.dtype == dtype
    assert_close(o, ref.o, rtol=rtol, name=f"flash_attention O in {dtype}")


# -- properties combining features ---------------------------------------------------------
@st.composite
def feature_cases(draw: Any, max_len: int) -> dict:
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dense = torch.rand(b, hq, lq, lk, generator=gen) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    mask = draw(
        st.sampled_from(
            [
                None,
                fl.Causal(),
                fl.Causal("bottom_right") & fl.DenseMask(dense),
                fl.SlidingWindow(draw(st.integers(0, 4)), draw(st.integers(0, 4))),
                fl.KeyPadding(draw(st.lists(st.integers(0, lk), min_size=b, max_size=b))),
                fl.DenseMask(dense),
            ]
        )
    )
    bias = None
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(lk,), (lq, lk), (b, hq, lq, lk), (1, hq, 1, lk)]))
        bias = torch.randn(shape, dtype=f64, generator=gen)
        bias[torch.rand(shape, generator=gen) < 0.1] = -math.inf
    slopes = None
    if draw(st.booleans()):
        slopes = fl.alibi_slopes(hq) if draw(st.booleans()) else torch.rand(b, hq, dtype=f64)
    conv = draw(st.sampled_from(list(fl.PRESETS.values())))
    softcap = draw(st.sampled_from([None, 0.5, 5.0]))
    dropout_p = draw(st.sampled_from([0.0, 0.0, 0.3, 0.9]))
    if softcap is not None and not conv.softcap_with_dropout:
        dropout_p = 0.0  # refused together (tested in test_flash_attn_edges.py)
    return dict(
        q=torch.randn(b, hq, lq, d, dtype=f64, generator=gen),
        k=torch.randn(b, hkv, lk, d, dtype=f64, generator=gen),
        v=torch.randn(b, hkv, lk, dv, dtype=f64, generator=gen),
        do=torch.randn(b, hq, lq, dv, dtype=f64, generator=gen),
        opts=dict(
            mask=mask,
            bias=bias,
            alibi_slopes=slopes,
            softcap=softcap,
            dropout_p=dropout_p,
            seed=draw(st.integers(0, 1000)),
            conventions=conv,
        ),
        block_q=draw(st.integers(1, max_len + 2)),
        block_k=draw(st.integers(1, max_len + 2)),
    )


def _check_features(case: dict, assert_close: Any, outputs_close: Any) -> None:
    q, k, v, do, opts = case["q"], case["k"], case["v"], case["do"], case["opts"]
    tiles = dict(block_q=case["block_q"], block_k=case["block_k"])
    ref = fl.reference_forward(q, k, v, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    for order in ("fa2", "fa1"):
        fwd = fl.blocked_forward(q, k, v, **opts, **tiles, loop_order=order)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, **tiles, loop_order=order)
        outputs_close((fwd, bwd), (ref, refb), rtol=TOL, name=order)
        if opts["bias"] is not None:
            assert not bool(torch.isnan(bwd.dbias).any()), "NaN in dBias"
            assert_close(bwd.dbias, refb.dbias, rtol=TOL, name=f"dBias ({order})")
    split = fl.split_kv_forward(q, k, v, num_splits=min(3, k.shape[-2]), **opts, **tiles)
    assert_close(split.o, ref.o, rtol=TOL, name="split-KV O")
    assert_close(split.lse, ref.lse, rtol=TOL, name="split-KV LSE")


@settings(max_examples=40, deadline=None)
@given(case=feature_cases(max_len=12))
def test_features_with_masks_gqa_and_ragged_tiles(case, assert_close, outputs_close):
    _check_features(case, assert_close, outputs_close)


@pytest.mark.slow
@settings(max_examples=500, deadline=None)
@given(case=feature_cases(max_len=40))
def test_features_with_masks_gqa_and_ragged_tiles_sweep(case, assert_close, outputs_close):
    _check_features(case, assert_close, outputs_close)
