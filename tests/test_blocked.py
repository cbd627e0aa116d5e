"""The blocked loop, observed: ledger records against the dense matrix, counters against the mask."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from naive import tile_classes_from_dense

import flashledger as fl
from flashledger import _native

TOL = 1e-12
B, HQ, HKV, LQ, LK, D, DV = 2, 4, 2, 13, 11, 5, 3


def _inputs(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(B, HQ, LQ, D, dtype=torch.float64, generator=gen)
    k = torch.randn(B, HKV, LK, D, dtype=torch.float64, generator=gen)
    v = torch.randn(B, HKV, LK, DV, dtype=torch.float64, generator=gen)
    do = torch.randn(B, HQ, LQ, DV, dtype=torch.float64, generator=gen)
    return q, k, v, do


def _masks(gen: torch.Generator) -> dict[str, fl.Mask | None]:
    dense = torch.rand(B, HQ, LQ, LK, generator=gen) < 0.5
    dense[0, 1, 4] = False  # a fully-masked row
    dense[:, :, 9:] = False  # the last rows see nothing
    return {
        "none": None,
        "causal-br": fl.Causal("bottom_right"),
        "window": fl.SlidingWindow(2, 1, align="top_left"),
        "padding": fl.KeyPadding([0, 7]),
        "dense": fl.DenseMask(dense),
        "dense&causal": fl.DenseMask(dense) & fl.Causal("top_left"),
    }


MASKS = ["none", "causal-br", "window", "padding", "dense", "dense&causal"]
TILES = [(4, 3), (1, 1), (5, 11), (13, 2), (40, 40)]


def _visible(mask: fl.Mask | None) -> torch.Tensor:
    """Dense visibility ``(B, HQ, LQ, LK)``."""
    if mask is None:
        return torch.ones(B, HQ, LQ, LK, dtype=torch.bool)
    return mask.dense(LQ, LK, batch=B, heads=HQ).expand(B, HQ, LQ, LK)


# -- ledger truth -------------------------------------------------------------------------
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("loop_order", ["fa2", "fa1"])
def test_forward_records_equal_prefix_sums_of_the_dense_scores(
    mask_name, loop_order, gen, assert_close
):
    q, k, v, _ = _inputs(gen)
    mask = _masks(gen)[mask_name]
    res = fl.blocked_forward(
        q, k, v, mask=mask, block_q=4, block_k=3, loop_order=loop_order, trace=True
    )
    s = fl.reference_forward(q, k, v, mask=mask).s  # (B, HQ, LQ, LK), masked -inf
    vrep = v.repeat_interleave(HQ // HKV, dim=1)  # (B, HQ, LK, DV)
    assert res.ledger.records, "trace=True must record the tile steps"
    # The ledger's maxima are maxima of the scores the loop computed (``r.s``), exactly; the
    # dense scores come from another matmul call, whose summation order (and so whose last
    # bit) any BLAS may choose differently, so they are compared within TOL.
    seen: dict[int, list[torch.Tensor]] = {}  # q tile -> the tiles of scores read so far
    for r in res.ledger.records:
        (q0, q1), (k0, k1) = r.q_range, r.k_range
        read = s[..., q0:q1, :k1]  # every key tile up to this one has been read (or was empty)
        m = read.amax(-1)  # (B, HQ, bq)
        m_safe = torch.where(torch.isneginf(m), 0.0, m)
        e = torch.exp(read - m_safe[..., None])  # (B, HQ, bq, k1)
        ell = e.sum(-1)
        acc = e @ vrep[..., :k1, :]
        where = f"step {r.index} ({loop_order}, Q{r.q_tile} x K{r.k_tile}, {mask_name})"
        assert_close(r.m_after, m, rtol=TOL, name=f"m after {where}")
        assert_close(r.ell, ell, rtol=TOL, name=f"ell after {where}")
        o = acc / torch.where(ell == 0, 1.0, ell)[..., None]
        assert_close(r.o, o, rtol=TOL, name=f"prefix o after {where}")
        if loop_order == "fa2":
            assert_close(r.acc, acc, rtol=TOL, name=f"acc after {where}")
        else:
            assert r.acc is None
        assert_close(r.s, s[..., q0:q1, k0:k1], rtol=TOL, name=f"s of {where}")
        assert_close(r.block_max, r.s.amax(-1), rtol=0.0, name=f"max {where}")
        before = seen.setdefault(r.q_tile, [])
        prev = torch.cat(before, -1).amax(-1) if before else torch.full_like(m, -math.inf)
        assert_close(r.m_before, prev, rtol=0.0, name=f"m before {where}")
        assert_close(r.m_after, torch.maximum(prev, r.block_max), rtol=0.0, name=f"m {where}")
        before.append(r.s)
        prev = s[..., q0:q1, :k0].amax(-1) if k0 > 0 else torch.full_like(m, -math.inf)
        alpha = torch.where(torch.isneginf(prev), 0.0, torch.exp(prev - m_safe))
        assert_close(r.alpha, alpha, rtol=TOL, name=f"alpha of {where}")
        assert_close(
            r.p, torch.exp(s[..., q0:q1, k0:k1] - m_safe[..., None]), rtol=TOL, name=f"P~ {where}"
        )
        for name, t in (("m", r.m_after), ("ell", r.ell), ("o", r.o), ("p", r.p)):
            assert not bool(torch.isnan(t).any()), f"NaN in {name} at {where}"


@pytest.mark.parametrize("loop_order", ["fa2", "fa1"])
def test_forward_records_with_dropout_weigh_values_not_ell(loop_order, gen, assert_close):
    q, k, v, _ = _inputs(gen)
    mask = fl.Causal("top_left")
    opts = dict(mask=mask, dropout_p=0.35, seed=8)
    res = fl.blocked_forward(
        q, k, v, **opts, block_q=5, block_k=4, loop_order=loop_order, trace=True
    )
    ref = fl.reference_forward(q, k, v, **opts)
    vrep = v.repeat_interleave(HQ // HKV, dim=1)  # (B, HQ, LK, DV)
    for r in res.ledger.records:
        (q0, q1), (k0, k1) = r.q_range, r.k_range
        read = ref.s[..., q0:q1, :k1]
        m = read.amax(-1)
        e = torch.exp(read - torch.where(torch.isneginf(m), 0.0, m)[..., None])
        ell = e.sum(-1)  # the denominator never sees dropout
        kept = e * ref.keep[..., q0:q1, :k1] / 0.65  # (B, HQ, bq, k1)
        o = (kept @ vrep[..., :k1, :]) / torch.where(ell == 0, 1.0, ell)[..., None]
        where = f"step {r.index} ({loop_order})"
        assert_close(r.ell, ell, rtol=TOL, name=f"ell after {where}")
        assert_close(r.o, o, rtol=TOL, name=f"prefix o after {where}")
        assert torch.equal(r.keep, ref.keep[..., q0:q1, k0:k1]), f"keep mask of {where}"
    assert_close(res.o, ref.o, rtol=TOL, name="O with dropout")


@pytest.mark.parametrize("mask_name", MASKS)
def test_backward_records_rebuild_the_reference_blocks(mask_name, gen, assert_close):
    q, k, v, do = _inputs(gen)
    mask = _masks(gen)[mask_name]
    ref = fl.reference_forward(q, k, v, mask=mask)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask)
    res = fl.blocked_backward(
        q, k, v, ref.o, ref.lse, do, mask=mask, block_q=4, block_k=3, trace=True
    )
    vrep = v.repeat_interleave(HQ // HKV, dim=1)
    dp = do @ vrep.transpose(-1, -2)  # (B, HQ, LQ, LK)
    ds = ref.p * (dp - refb.D[..., None])
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    seen = []
    for r in res.ledger.records:
        (q0, q1), (k0, k1) = r.q_range, r.k_range
        where = f"backward step {r.index} (Q{r.q_tile} x K{r.k_tile}, {mask_name})"
        seen.append((r.k_tile, r.q_tile))
        assert_close(r.p, ref.p[..., q0:q1, k0:k1], rtol=TOL, name=f"P of {where}")
        assert_close(r.dp, dp[..., q0:q1, k0:k1], rtol=TOL, name=f"dP of {where}")
        assert_close(r.ds, ds[..., q0:q1, k0:k1], rtol=TOL, name=f"dS of {where}")
        dq[..., q0:q1, :] += r.dq
        dk[..., k0:k1, :] += r.dk
        dv[..., k0:k1, :] += r.dv
    assert seen == sorted(seen), "backward runs key tiles outside, query tiles inside"
    assert_close(dq, refb.dq, rtol=TOL, name="sum of dQ contributions")
    assert_close(dk, refb.dk, rtol=TOL, name="sum of dK contributions")
    assert_close(dv, refb.dv, rtol=TOL, name="sum of dV contributions")
    assert_close(res.dq, refb.dq, rtol=TOL, name="dQ")


def test_loop_orders_visit_tiles_in_their_order(gen):
    q, k, v, _ = _inputs(gen)
    fa2 = fl.blocked_forward(q, k, v, block_q=4, block_k=3, trace=True)
    fa1 = fl.blocked_forward(q, k, v, block_q=4, block_k=3, loop_order="fa1", trace=True)
    order2 = [(r.q_tile, r.k_tile) for r in fa2.ledger.records]
    order1 = [(r.q_tile, r.k_tile) for r in fa1.ledger.records]
    assert order2 == [(i, j) for i in range(4) for j in range(4)]
    assert order1 == [(i, j) for j in range(4) for i in range(4)]
    assert [r.index for r in fa1.ledger.records] == list(range(16))
    assert fa1.ledger.loop_order == "fa1" and fa2.ledger.loop_order == "fa2"


# -- counters against the mask -----------------------------------------------------------
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize(("bq", "bk"), TILES)
def test_counters_equal_what_the_mask_says(mask_name, bq, bk, gen):
    q, k, v, do = _inputs(gen)
    mask = _masks(gen)[mask_name]
    vis = _visible(mask)
    classes = tile_classes_from_dense(vis, bq, bk)
    tq, tk = classes.shape
    area = torch.zeros(tq, tk, dtype=torch.int64)
    rows = torch.zeros(tq, tk, dtype=torch.int64)
    for a in range(tq):
        for b in range(tk):
            nr, nc = min(bq, LQ - a * bq), min(bk, LK - b * bk)
            area[a, b], rows[a, b] = nr * nc, nr
    run = classes != 0
    want = {
        "qk_dots_visible": int(vis.sum()),
        "qk_dots_computed": int(area[run].sum()) * B * HQ,
        "tiles_run": int(run.sum()),
        "tiles_skipped": int((~run).sum()),
        "tiles_full": int((classes == 2).sum()),
        "tiles_partial": int((classes == 1).sum()),
        "dropped": 0,
    }
    for order in ("fa2", "fa1"):
        fwd = fl.blocked_forward(q, k, v, mask=mask, block_q=bq, block_k=bk, loop_order=order)
        got = fwd.ledger.counters.to_dict()
        assert {key: got[key] for key in want} == want, f"forward {order}: {got}"
        assert got["exps"] == want["qk_dots_computed"] + int(rows[run].sum()) * B * HQ
        assert fwd.ledger.tile_kinds == [
            [["empty", "partial", "full"][int(c)] for c in row] for row in classes.tolist()
        ]
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, mask=mask, block_q=bq, block_k=bk)
    got = bwd.ledger.counters.to_dict()
    assert {key: got[key] for key in want} == want, f"backward: {got}"
    assert got["exps"] == want["qk_dots_computed"]


def test_counters_book_the_dropped_entries(gen):
    q, k, v, do = _inputs(gen)
    mask = _masks(gen)["dense&causal"]
    ref = fl.reference_forward(q, k, v, mask=mask, dropout_p=0.3, seed=5)
    dropped = int((~ref.keep & _visible(mask)).sum())
    assert dropped > 0
    fwd = fl.blocked_forward(q, k, v, mask=mask, dropout_p=0.3, seed=5, block_q=4, block_k=3)
    bwd = fl.blocked_backward(
        q, k, v, fwd.o, fwd.lse, do, mask=mask, dropout_p=0.3, seed=5, block_q=4, block_k=3
    )
    assert fwd.ledger.counters.dropped == dropped
    assert bwd.ledger.counters.dropped == dropped


def test_counters_are_kept_without_tracing_and_records_only_with_it(gen, assert_close):
    q, k, v, _ = _inputs(gen)
    native = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=4, block_k=3)
    with _native.disabled():
        plain = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=4, block_k=3)
    traced = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=4, block_k=3, trace=True)
    assert plain.ledger.records == [] and native.ledger.records == []
    assert native.ledger.counters == plain.ledger.counters == traced.ledger.counters
    assert len(traced.ledger.records) == traced.ledger.counters.tiles_run
    # the PyTorch step is the traced arithmetic bit for bit; the native step rounds on its own
    assert torch.equal(plain.o, traced.o) and torch.equal(plain.lse, traced.lse)
    assert_close(native.o, traced.o, rtol=1e-13, name="O, native step vs traced")
    assert_close(native.lse, traced.lse, rtol=1e-13, name="LSE, native step vs traced")


# -- observers and renderers --------------------------------------------------------------
class _Collect:
    def __init__(self, wants_tensors: bool) -> None:
        self.wants_tensors = wants_tensors
        self.fwd: list[fl.ForwardTileStep] = []
        self.bwd: list[fl.BackwardTileStep] = []

    def forward_tile(self, step: fl.ForwardTileStep) -> None:
        self.fwd.append(step)

    def backward_tile(self, step: fl.BackwardTileStep) -> None:
        self.bwd.append(step)


@pytest.mark.parametrize("wants_tensors", [True, False])
def test_observer_sees_every_step_in_loop_order(wants_tensors, gen):
    q, k, v, do = _inputs(gen)
    obs = _Collect(wants_tensors)
    mask = fl.Causal("top_left")
    fwd = fl.blocked_forward(q, k, v, mask=mask, block_q=4, block_k=3, observer=obs)
    fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, mask=mask, block_q=4, block_k=3, observer=obs)
    run = fwd.ledger.counters.tiles_run
    assert [s.index for s in obs.fwd] == list(range(run))
    assert [s.index for s in obs.bwd] == list(range(run))
    assert fwd.ledger.records == [], "an observer alone does not fill the ledger's records"
    kinds = {s.kind for s in obs.fwd}
    assert kinds == {"full", "partial"}
    if wants_tensors:
        assert all(s.s is not None and s.m_after is not None for s in obs.fwd)
        assert all(s.p is not None and s.dq is not None for s in obs.bwd)
    else:
        assert all(s.s is None and s.m_after is None for s in obs.fwd)
        assert all(s.p is None and s.ds is None for s in obs.bwd)


def test_ledger_renders_as_text_json_and_html(gen):
    q = torch.randn(5, 2, dtype=torch.float64, generator=gen)
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[0] = False  # row 0 sees nothing: its m stays -inf
    res = fl.blocked_forward(q, q, q, mask=mask, block_q=2, block_k=2, trace=True)
    text = str(res.ledger)
    assert "forward ledger" in text and "skipped" in text and "-inf" in text
    assert len(text.splitlines()) == 2 + len(res.ledger.records)
    d = res.ledger.to_dict()
    again = json.loads(json.dumps(d))
    assert again["counters"] == res.ledger.counters.to_dict()
    assert again["records"][0]["m_after"][0] == "-inf"
    assert len(again["records"]) == len(res.ledger.records)
    html = res.ledger._repr_html_()
    assert html.count("<table>") == 2 and "qk_dots_visible" in html
    rows = res.ledger.rows()
    assert rows[0]["tile"] == "Q0 x K0" and rows[0]["kind"] == res.ledger.records[0].kind


def test_long_ledger_shows_head_and_tail_in_a_notebook():
    q = torch.randn(1, 1, 160, 4, dtype=torch.float64)
    led = fl.blocked_forward(q, q, q, block_q=8, block_k=8, trace=True).ledger  # 400 steps
    html = led._repr_html_()
    steps = [int(x) for x in re.findall(r"<tr><td>(\d+)</td><td>Q", html)]
    assert steps == [*range(1, 31), *range(371, 401)], "first 30 and last 30 steps"
    assert "340 more records (all 400 in <code>ledger.records</code>" in html
    assert len(str(led).splitlines()) == 2 + 400, "print(ledger) keeps every step"


# -- fa1 == fa2 == oracle, any tiling ------------------------------------------------------
@pytest.mark.parametrize(("bq", "bk"), TILES)
@pytest.mark.parametrize("mask_name", MASKS)
def test_both_loop_orders_equal_the_oracle(bq, bk, mask_name, gen, assert_close):
    q, k, v, do = _inputs(gen)
    mask = _masks(gen)[mask_name]
    ref = fl.reference_forward(q, k, v, mask=mask)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask)
    for order in ("fa2", "fa1"):
        fwd = fl.blocked_forward(q, k, v, mask=mask, block_q=bq, block_k=bk, loop_order=order)
        bwd = fl.blocked_backward(
            q, k, v, fwd.o, fwd.lse, do, mask=mask, block_q=bq, block_k=bk, loop_order=order
        )
        assert_close(fwd.o, ref.o, rtol=TOL, name=f"O ({order})")
        assert_close(fwd.lse, ref.lse, rtol=TOL, name=f"LSE ({order})")
        for name, got, want in (
            ("dQ", bwd.dq, refb.dq),
            ("dK", bwd.dk, refb.dk),
            ("dV", bwd.dv, refb.dv),
            ("D", bwd.D, refb.D),
        ):
            assert_close(got, want, rtol=TOL, name=f"{name} ({order})")


def test_default_tiles_and_layouts(gen, assert_close):
    q = torch.randn(3, 200, 4, dtype=torch.float64, generator=gen)
    res = fl.blocked_forward(q, q, q, mask=fl.Causal())
    from flashledger.blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

    kern = _native.kernels()  # the native step's default tiles are its calibration's (a forward's)
    bq, bk = kern.tiles(torch.float64, forward=True) if kern else (DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K)
    assert (res.ledger.block_q, res.ledger.block_k) == (bq, bk)
    traced = fl.blocked_forward(q, q, q, mask=fl.Causal(), trace=True)  # the PyTorch step's
    assert (traced.ledger.block_q, traced.ledger.block_k) == (DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K)
    want = (-(-200 // bq), -(-200 // bk))
    assert (res.ledger.tiles_q, res.ledger.tiles_k) == want
    assert res.o.shape == (3, 200, 4) and res.lse.shape == (3, 200)
    ref = fl.reference_forward(q, q, q, mask=fl.Causal())
    assert_close(res.o, ref.o, rtol=TOL, name="O with default tiles")
    one = fl.blocked_forward(q[0], q[0], q[0], mask=fl.Causal(), block_q=7, block_k=9)
    assert one.o.shape == (200, 4) and one.lse.shape == (200,)
    assert_close(one.o, ref.o[0], rtol=TOL, name="O of a 2-D call")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_the_ledger_books_bytes_of_the_input_dtype(dtype, order, gen):
    """Slow-memory traffic is booked in elements, and in bytes: the inputs' dtype for Q, K,
    V, O and the gradients (half inputs move half the bytes of float32), float32 at least
    for the statistics m, ℓ, the LSE and D, which the loop keeps so; both passes together
    move the bytes ``memory_traffic`` books for the problem (half inputs booked their
    statistics at 2 bytes, and the two disagreed)."""
    q, k, v, do = (torch.randn(1, 2, 70, 8, generator=gen).to(dtype) for _ in range(4))
    opts = dict(mask=fl.Causal(), block_q=32, block_k=32, loop_order=order)
    stat = max(4, dtype.itemsize)
    for trace in (False, True):
        fwd = fl.blocked_forward(q, k, v, trace=trace, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, trace=trace, **opts)
        assert fwd.lse.dtype.itemsize == stat and bwd.D.dtype.itemsize == stat
        for led in (fwd.ledger, bwd.ledger):
            c = led.counters
            assert led.element_bytes == dtype.itemsize and led.stat_bytes == stat
            assert 0 < c.stat_elements_written <= c.elements_written
            assert (led.bytes_read, led.bytes_written) == (
                (c.elements_read - c.stat_elements_read) * dtype.itemsize
                + c.stat_elements_read * stat,
                (c.elements_written - c.stat_elements_written) * dtype.itemsize
                + c.stat_elements_written * stat,
            )
            d = led.to_dict()
            assert d["bytes_read"] == led.bytes_read and f"{led.bytes_read} and" in str(led)
        traffic = fl.memory_traffic(
            lq=70, lk=70, d=8, block_q=32, block_k=32, mask=fl.Causal(), schedule=order,
            dtype=dtype, heads=2,
        )  # fmt: skip
        moved = sum(x.bytes_read + x.bytes_written for x in (fwd.ledger, bwd.ledger))
        assert moved == traffic.total_bytes, (moved, traffic.total_bytes)


def test_a_large_traced_ledger_prints_readably() -> None:
    """L = 256 in 64-wide tiles: each cell shows a row vector's ends and a P tile's shape
    and range, not 64 or 4096 numbers; ``repr`` is one line; the rows say which batch
    element and head they show when there are several. Every value stays in ``records``."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 256, 8, dtype=torch.float64, generator=g) for _ in range(4))
    f = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=64, block_k=64, trace=True)
    b = fl.blocked_backward(
        q, k, v, f.o, f.lse, do, mask=fl.Causal(), block_q=64, block_k=64, trace=True
    )
    for led in (f.ledger, b.ledger):
        text = str(led)
        assert len(text) < 500 * (len(led.records) + 2), len(text)  # was ~2,300 a row
        assert "rows show batch 0, head 0 of 1 x 2 (the counters count all)" in text
        assert repr(led).startswith(f"Ledger({led.pass_name}, tiles 64x64") and "\n" not in repr(
            led
        )
        assert len(led._repr_html_()) < 40_000
    assert "(64 values)" in str(f.ledger)
    first = b.ledger.records[0]
    assert first.p is not None and tuple(first.p.shape[-2:]) == (64, 64)  # kept whole
    p0 = first.p[0, 0]
    assert f"64x64 tile, 0..{float(p0.max()):.6g}" in str(b.ledger)
    small = fl.blocked_forward(q[0, 0], k[0, 0], v[0, 0], block_q=2, block_k=2, trace=True)
    assert "rows show" not in str(small.ledger) and "…" not in str(small.ledger)
