"""The dense oracle against PyTorch autograd of the naive formula, and the seed's example."""

from __future__ import annotations

import math

import pytest
import torch
from naive import as4d, causal_visible, naive_with_grads

import flashledger as fl
from flashledger.examples import five_position_example

TOL = 1e-12


# -- the seed's five-position example ---------------------------------------------------
def test_seed_five_positions_blocked_equals_oracle_and_autograd(assert_close):
    ex = five_position_example()
    q, k, v, g = ex["q"], ex["k"], ex["v"], ex["g"]
    mask = fl.Causal()
    fwd = fl.blocked_forward(q, k, v, mask=mask, block_q=2, block_k=2)
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, g, mask=mask, block_q=2, block_k=2)
    ref = fl.reference_forward(q, k, v, mask=mask)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, g, mask=mask)
    o_n, lse_n, (dq_n, dk_n, dv_n, _) = naive_with_grads(
        q, k, v, g, visible=causal_visible(5, 5, "top_left")
    )
    d_n = (as4d(g) * o_n).sum(-1)
    for name, got, oracle, naive in [
        ("O", fwd.o, ref.o, o_n[0, 0]),
        ("LSE", fwd.lse, ref.lse, lse_n[0, 0]),
        ("D", bwd.D, refb.D, d_n[0, 0]),
        ("dQ", bwd.dq, refb.dq, dq_n),
        ("dK", bwd.dk, refb.dk, dk_n),
        ("dV", bwd.dv, refb.dv, dv_n),
    ]:
        assert_close(got, oracle, rtol=TOL, name=f"blocked {name} vs oracle")
        assert_close(got, naive.detach(), rtol=TOL, name=f"blocked {name} vs autograd")
        assert_close(oracle, naive.detach(), rtol=TOL, name=f"oracle {name} vs autograd")


def test_seed_five_positions_ledger_books_the_page_numbers():
    ex = five_position_example()
    q, k, v, g = ex["q"], ex["k"], ex["v"], ex["g"]
    fwd = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=2, block_k=2, trace=True)
    bwd = fl.blocked_backward(
        q, k, v, fwd.o, fwd.lse, g, mask=fl.Causal(), block_q=2, block_k=2, trace=True
    )
    for name, c in (("forward", fwd.ledger.counters), ("backward", bwd.ledger.counters)):
        got = (c.qk_dots_visible, c.qk_dots_computed, c.tiles_run, c.tiles_skipped)
        assert got == (15, 17, 6, 3), f"{name}: (visible, computed, run, skipped) = {got}"
        assert (c.tiles_full, c.tiles_partial) == (4, 2), f"{name}: {c}"
    # the page's storage figures: P has 25 entries, the LSE 5, a 2x2 tile at most 4
    assert fwd.lse.numel() == 5
    assert max(r.p.numel() for r in fwd.ledger.records) == 4
    assert len(fwd.ledger.records) == 6 and len(bwd.ledger.records) == 6
    assert fwd.ledger.tile_kinds == [
        ["partial", "empty", "empty"],
        ["full", "partial", "empty"],
        ["full", "full", "full"],
    ]


def test_seed_five_positions_backward_rebuilds_probabilities_from_lse(assert_close):
    ex = five_position_example()
    q, k, v, g = ex["q"], ex["k"], ex["v"], ex["g"]
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    bwd = fl.blocked_backward(
        q, k, v, ref.o, ref.lse, g, mask=fl.Causal(), block_q=2, block_k=2, trace=True
    )
    for r in bwd.ledger.records:
        (q0, q1), (k0, k1) = r.q_range, r.k_range
        assert_close(r.p, ref.p[q0:q1, k0:k1], rtol=TOL, name=f"rebuilt P of step {r.index}")


# -- the oracle against autograd --------------------------------------------------------
CASES = {
    "2d-none": dict(shape_q=(7, 3), shape_kv=(9, 3), dv=3, mask=None),
    "3d-causal-tl": dict(shape_q=(2, 6, 4), shape_kv=(2, 6, 4), dv=5, mask=fl.Causal("top_left")),
    "4d-gqa-br": dict(
        shape_q=(2, 4, 8, 5), shape_kv=(2, 2, 5, 5), dv=3, mask=fl.Causal("bottom_right")
    ),
    "4d-mqa-window": dict(
        shape_q=(1, 3, 9, 2), shape_kv=(1, 1, 11, 2), dv=4, mask=fl.SlidingWindow(2, 1)
    ),
    "4d-padding": dict(
        shape_q=(2, 2, 5, 3), shape_kv=(2, 2, 6, 3), dv=3, mask=fl.KeyPadding([0, 4])
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_reference_equals_autograd_of_naive(case, preset, gen, assert_close):
    c = CASES[case]
    q = torch.randn(c["shape_q"], dtype=torch.float64, generator=gen)
    k = torch.randn(c["shape_kv"], dtype=torch.float64, generator=gen)
    v = torch.randn((*c["shape_kv"][:-1], c["dv"]), dtype=torch.float64, generator=gen)
    lq, lk = q.shape[-2], k.shape[-2]
    g = torch.randn((*q.shape[:-1], c["dv"]), dtype=torch.float64, generator=gen)
    mask = c["mask"]
    batch = q.shape[0] if q.ndim == 4 else 1
    heads = q.shape[-3] if q.ndim >= 3 else 1
    visible = None
    if mask is not None:
        visible = mask.dense(lq, lk, batch=batch, heads=heads, causal_align=preset.causal_align)
    ref = fl.reference_forward(q, k, v, mask=mask, conventions=preset)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, g, mask=mask, conventions=preset)
    o_n, lse_n, (dq, dk, dv, _) = naive_with_grads(
        q, k, v, g, visible=visible, masked_row_lse=preset.masked_row_lse
    )
    assert_close(ref.o, o_n.reshape(ref.o.shape), rtol=TOL, name="O")
    assert_close(ref.lse, lse_n.reshape(ref.lse.shape), rtol=TOL, name="LSE")
    assert_close(refb.dq, dq, rtol=TOL, name="dQ")
    assert_close(refb.dk, dk, rtol=TOL, name="dK")
    assert_close(refb.dv, dv, rtol=TOL, name="dV")
    assert_close(refb.D, (ref.o * g).sum(-1), rtol=TOL, name="D = rowsum(dO * O)")


def test_reference_scores_and_probabilities(gen, assert_close):
    q = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 8, 4, dtype=torch.float64, generator=gen)
    v = torch.randn(2, 8, 3, dtype=torch.float64, generator=gen)
    mask = fl.Causal("bottom_right") & fl.SlidingWindow(1, None, align="bottom_right")
    ref = fl.reference_forward(q, k, v, mask=mask, scale=0.7)
    vis = mask.dense(6, 8)
    s = 0.7 * q @ k.transpose(-1, -2)
    assert_close(ref.s, torch.where(vis, s, -math.inf), rtol=TOL, name="S (masked -inf)")
    assert_close(ref.p, torch.softmax(ref.s, dim=-1), rtol=TOL, name="P")
    assert_close(ref.o, ref.p @ v, rtol=TOL, name="O = P V")
    assert_close(ref.lse, torch.logsumexp(ref.s, dim=-1), rtol=TOL, name="LSE")
    assert ref.keep is None


def test_reference_fully_masked_rows_follow_the_conventions(preset, gen, assert_close):
    q = torch.randn(3, 5, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(3, 6, 4, dtype=torch.float64, generator=gen)
    v = torch.randn(3, 6, 2, dtype=torch.float64, generator=gen)
    g = torch.randn(3, 5, 2, dtype=torch.float64, generator=gen)
    vis = torch.rand(3, 5, 6, generator=gen) < 0.6
    vis[:, 1] = False  # row 1 sees nothing in any head
    vis[2, 3] = False
    vis[:, :, 5] = False  # key 5 is never visible
    ref = fl.reference_forward(q, k, v, mask=vis, conventions=preset)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, g, mask=vis, conventions=preset)
    empty = ~vis.any(-1)  # (H, Lq)
    assert bool(empty[:, 1].all()) and bool(empty[2, 3])
    assert bool((ref.o[empty] == 0).all()), "fully-masked rows must have O = 0"
    assert bool((ref.p[empty] == 0).all()), "fully-masked rows must have P = 0"
    want = torch.full_like(ref.lse[empty], preset.masked_row_lse)
    assert_close(ref.lse[empty], want, rtol=0.0, name=f"LSE of masked rows ({preset.name})")
    assert bool(torch.isfinite(ref.lse[~empty]).all())
    assert bool((refb.dq[empty] == 0).all()), "fully-masked rows must have dQ = 0"
    assert bool((refb.dk[:, 5] == 0).all()) and bool((refb.dv[:, 5] == 0).all())
    for name, t in (("o", ref.o), ("dq", refb.dq), ("dk", refb.dk), ("dv", refb.dv)):
        assert not bool(torch.isnan(t).any()), f"NaN in {name}"


def test_reference_differentiable_lse_equals_autograd(gen, assert_close):
    q = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    k = torch.randn(2, 7, 3, dtype=torch.float64, generator=gen)
    v = torch.randn(2, 7, 3, dtype=torch.float64, generator=gen)
    g = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    dlse = torch.randn(2, 5, dtype=torch.float64, generator=gen)
    mask = fl.Causal("top_left")
    ref = fl.reference_forward(q, k, v, mask=mask)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, g, dlse=dlse, mask=mask)
    _, _, (dq, dk, dv, _) = naive_with_grads(
        q, k, v, g, dlse=dlse, visible=causal_visible(5, 7, "top_left")
    )
    assert_close(refb.dq, dq, rtol=TOL, name="dQ with dLSE")
    assert_close(refb.dk, dk, rtol=TOL, name="dK with dLSE")
    assert_close(refb.dv, dv, rtol=TOL, name="dV with dLSE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_computes_in_the_requested_dtype(dtype, gen, assert_close):
    q = torch.randn(4, 6, 3, generator=gen)
    ref = fl.reference_forward(q, q, q, mask=fl.Causal(), dtype=dtype)
    assert ref.o.dtype == dtype and ref.lse.dtype == dtype and ref.p.dtype == dtype
    exact = fl.reference_forward(q.double(), q.double(), q.double(), mask=fl.Causal())
    rtol = 1e-5 if dtype == torch.float32 else 1e-13
    assert_close(ref.o, exact.o, rtol=rtol, name=f"O in {dtype}")


def test_reference_layouts_agree(gen, assert_close):
    q = torch.randn(6, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    v = torch.randn(7, 2, dtype=torch.float64, generator=gen)
    r2 = fl.reference_forward(q, k, v, mask=fl.Causal("bottom_right"))
    r4 = fl.reference_forward(
        q[None, None], k[None, None], v[None, None], mask=fl.Causal("bottom_right")
    )
    assert r2.o.shape == (6, 2) and r2.lse.shape == (6,) and r2.p.shape == (6, 7)
    assert r4.o.shape == (1, 1, 6, 2) and r4.lse.shape == (1, 1, 6)
    assert_close(r4.o[0, 0], r2.o, rtol=0.0, name="O 4-D vs 2-D")
    assert_close(r4.lse[0, 0], r2.lse, rtol=0.0, name="LSE 4-D vs 2-D")


# -- the closeness rule every engine test uses ------------------------------------------------
def test_assert_close_names_the_worst_entry(assert_close):
    want = torch.tensor([[1.0, 2.0], [-math.inf, 300.0]], dtype=torch.float64)
    got = want.clone()
    got[1, 1] = 300.0 + 1e-10  # within 1e-12 * 300
    assert_close(got, want, rtol=1e-12, name="close")
    got[0, 1] = 2.0 + 1e-9
    got[1, 1] = 300.5
    with pytest.raises(AssertionError) as info:
        assert_close(got, want, rtol=1e-12, name="probe")
    msg = str(info.value)
    assert "probe: 2 of 4 entries off" in msg and "index (1, 1)" in msg
    assert "actual 300.5" in msg and "expected 300.0" in msg
    got = want.clone()
    got[0, 0] = math.nan
    with pytest.raises(AssertionError, match=r"index \(0, 0\): actual nan"):
        assert_close(got, want, rtol=1.0, name="nan")
    got = want.clone()
    got[1, 0] = 0.0
    with pytest.raises(AssertionError, match=r"index \(1, 0\): actual 0.0, expected -inf"):
        assert_close(got, want, rtol=1.0, atol=1.0, name="inf")


def _case() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 100, 32, generator=gen) for _ in range(4))


def test_autocast_does_not_leak_into_the_loops_or_the_reference() -> None:
    q, k, v, do = _case()
    m = fl.Causal()
    plain_f = fl.blocked_forward(q, k, v, mask=m, loop_order="fa1", block_q=32, block_k=32)
    plain_b = fl.blocked_backward(
        q, k, v, plain_f.o, plain_f.lse, do, mask=m, loop_order="fa1", block_q=32, block_k=32
    )
    plain_r = fl.reference_forward(q, k, v, mask=m, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f = fl.blocked_forward(q, k, v, mask=m, loop_order="fa1", block_q=32, block_k=32)
        b = fl.blocked_backward(
            q, k, v, f.o, f.lse, do, mask=m, loop_order="fa1", block_q=32, block_k=32
        )
        r = fl.reference_forward(q, k, v, mask=m, dtype=torch.float32)
    assert r.o.dtype == torch.float32 and r.lse.dtype == torch.float32
    # the same arithmetic as without autocast, bit for bit
    assert torch.equal(f.o, plain_f.o) and torch.equal(f.lse, plain_f.lse)
    assert torch.equal(b.dq, plain_b.dq) and torch.equal(b.dk, plain_b.dk)
    assert torch.equal(r.o, plain_r.o)
