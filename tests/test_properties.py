"""Property tests (float64): blocked == dense oracle == autograd of the naive formula.

Random shapes (Lq, Lk in 1..97, d in 1..33, d_v possibly != d, GQA heads,
batch 1..2, any layout), random tiles (1..40 each side, ragged edges), random
masks of every kind and their ``&`` combinations (fully-masked rows included),
every conventions preset and both loop orders. "Equal" is the elementwise
rule of ``conftest.assert_close``: ``|a - b| <= 1e-12 * max(1, |b|)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import causal_visible, fa2_sides, naive_attention, padding_visible, window_visible

import flashledger as fl

TOL = 1e-12
ALL_PRESETS = [fl.SEED, fl.FLASH_ATTN_2, fl.FLASH_ATTN_3, fl.FLEX_ATTENTION, fl.SDPA_CPU]
SIDE = st.one_of(st.none(), st.just(-1), st.integers(0, 20))
ALIGN = st.sampled_from([None, "top_left", "bottom_right"])

Visible = Callable[[fl.Conventions], torch.Tensor]  # the preset -> (B|1, H|1, Lq, Lk)


@st.composite
def masks(draw: Any, b: int, hq: int, lq: int, lk: int) -> tuple[Any, Visible | None]:
    """A mask of any kind, or an ``&`` of two, and its formula (resolved per alignment)."""

    def one() -> tuple[Any, Visible]:
        kind = draw(st.sampled_from(["causal", "window", "padding", "dense", "tensor"]))
        if kind == "causal":
            align = draw(ALIGN)
            return fl.Causal(align), lambda c: causal_visible(lq, lk, align or c.causal_align)

        if kind == "window":
            align, left, right = draw(ALIGN), draw(SIDE), draw(SIDE)

            def window(c: fl.Conventions) -> torch.Tensor:
                sides = (left, right)
                if c.window_rewrite == "flash_attn_2":
                    sides = fa2_sides(left, right, lk)
                return window_visible(lq, lk, *sides, align or c.causal_align)

            return fl.SlidingWindow(left, right, align=align), window
        if kind == "padding":
            lens = draw(st.lists(st.integers(0, lk + 2), min_size=b, max_size=b))
            pad = draw(st.sampled_from(["right", "left"]))
            return fl.KeyPadding(lens, side=pad), lambda c: padding_visible(lq, lk, lens, pad)
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        shape = draw(st.sampled_from([(lq, lk), (hq, lq, lk), (b, hq, lq, lk), (b, 1, lq, lk)]))
        t = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.1, 0.5, 0.9, 1.0]))
        rows = torch.rand(shape[:-1], generator=gen) < draw(st.sampled_from([0.0, 0.2]))
        t[rows] = False  # fully-masked rows
        return (fl.DenseMask(t) if kind == "dense" else t), lambda c: t

    if draw(st.integers(0, 5)) == 0:
        return None, None
    m, vis = one()
    if draw(st.booleans()):
        m2, vis2 = one()
        m = (m & m2) if isinstance(m, fl.Mask) else (m2 & m)
        return m, lambda c: vis(c) & vis2(c)
    return m, vis


@st.composite
def problems(draw: Any, max_len: int = 97, max_d: int = 33, max_block: int = 40) -> dict:
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    d = draw(st.integers(1, max_d))
    dv = draw(st.one_of(st.just(d), st.integers(1, max_d)))
    ranks = [4] + ([3] if b == 1 else []) + ([2] if b == 1 and hq == 1 else [])
    ndim = draw(st.sampled_from(ranks))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([1.0, 3.0]))
    lead_q, lead_k = (b, hq)[4 - ndim :], (b, hkv)[4 - ndim :]
    mask, visible = draw(masks(b, hq, lq, lk))
    return dict(
        q=torch.randn(*lead_q, lq, d, dtype=torch.float64, generator=gen) * spread,
        k=torch.randn(*lead_k, lk, d, dtype=torch.float64, generator=gen) * spread,
        v=torch.randn(*lead_k, lk, dv, dtype=torch.float64, generator=gen),
        do=torch.randn(*lead_q, lq, dv, dtype=torch.float64, generator=gen),
        mask=mask,
        visible=visible,
        scale=draw(st.sampled_from([None, None, 0.3, 2.0])),
        block_q=draw(st.integers(1, max_block)),
        block_k=draw(st.integers(1, max_block)),
        b=b,
        hq=hq,
    )


def _as4(x: torch.Tensor) -> torch.Tensor:
    while x.ndim < 4:
        x = x.unsqueeze(0)
    return x


def check_problem(pr: dict, conv: fl.Conventions, assert_close: Callable[..., None]) -> None:
    """Blocked (both orders) == oracle == naive autograd; no NaN; masked rows per convention."""
    q, k, v, do, mask = pr["q"], pr["k"], pr["v"], pr["do"], pr["mask"]
    opts = dict(mask=mask, scale=pr["scale"], conventions=conv)
    tiles = dict(block_q=pr["block_q"], block_k=pr["block_k"])
    ref = fl.reference_forward(q, k, v, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    # naive formula with autograd, visibility from the formulas of CONVENTIONS.md
    vis = None if pr["visible"] is None else _as4(pr["visible"](conv))
    leaves = [_as4(x).detach().clone().requires_grad_(True) for x in (q, k, v)]
    o_n, lse_n = naive_attention(
        *leaves, visible=vis, scale=pr["scale"], masked_row_lse=conv.masked_row_lse
    )
    dq_n, dk_n, dv_n = torch.autograd.grad((o_n * _as4(do)).sum(), leaves)
    naive = {
        "O": o_n.detach().reshape(ref.o.shape),
        "LSE": lse_n.detach().reshape(ref.lse.shape),
        "dQ": dq_n.reshape(q.shape),
        "dK": dk_n.reshape(k.shape),
        "dV": dv_n.reshape(v.shape),
    }
    oracle = {"O": ref.o, "LSE": ref.lse, "dQ": refb.dq, "dK": refb.dk, "dV": refb.dv}
    for name in oracle:
        assert_close(oracle[name], naive[name], rtol=TOL, name=f"oracle {name} vs autograd")
    # fully-masked rows: O = 0 and the preset's LSE
    empty = torch.isneginf(ref.s).all(-1)  # (..., Lq)
    if vis is not None:
        b, hq, lq = pr["b"], pr["hq"], q.shape[-2]
        want_empty = ~vis.expand(b, hq, lq, k.shape[-2]).any(-1)
        assert torch.equal(empty, want_empty.reshape(empty.shape)), "fully-masked rows differ"
    masked_lse = torch.full_like(ref.lse[empty], conv.masked_row_lse)
    for order in ("fa2", "fa1"):
        fwd = fl.blocked_forward(q, k, v, **opts, **tiles, loop_order=order)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, **tiles, loop_order=order)
        got = {"O": fwd.o, "LSE": fwd.lse, "dQ": bwd.dq, "dK": bwd.dk, "dV": bwd.dv}
        for name, t in got.items():
            assert not bool(torch.isnan(t).any()), f"NaN in blocked {name} ({order})"
            assert_close(t, oracle[name], rtol=TOL, name=f"blocked {name} ({order}) vs oracle")
            assert_close(t, naive[name], rtol=TOL, name=f"blocked {name} ({order}) vs autograd")
        assert_close(bwd.D, refb.D, rtol=TOL, name=f"D ({order})")
        assert_close(fwd.lse[empty], masked_lse, rtol=0.0, name=f"LSE of masked rows ({order})")
        assert bool((fwd.o[empty] == 0).all()), f"fully-masked rows must have O = 0 ({order})"
        assert bool((bwd.dq[empty] == 0).all()), f"fully-masked rows must have dQ = 0 ({order})"


@pytest.mark.parametrize("conv", ALL_PRESETS, ids=lambda c: c.name)
@settings(max_examples=12, deadline=None)
@given(pr=problems())
def test_blocked_equals_oracle_and_autograd(conv, pr, assert_close):
    check_problem(pr, conv, assert_close)


@pytest.mark.parametrize("conv", ALL_PRESETS, ids=lambda c: c.name)
@settings(max_examples=25, deadline=None)
@given(pr=problems(max_len=12, max_d=4, max_block=5))
def test_blocked_equals_oracle_small_shapes(conv, pr, assert_close):
    """Small shapes: many tiles per row, masks with many fully-masked rows."""
    check_problem(pr, conv, assert_close)


@pytest.mark.slow
@pytest.mark.parametrize("conv", ALL_PRESETS, ids=lambda c: c.name)
@settings(max_examples=300, deadline=None)
@given(pr=problems())
def test_blocked_equals_oracle_and_autograd_sweep(conv, pr, assert_close):
    check_problem(pr, conv, assert_close)
