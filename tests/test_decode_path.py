"""A decode step's fixed cost: what a call of a few rows reuses, skips and still checks.

A model runs one attention call per layer and token, each a few query rows against
the KV cache; most of such a call is Python, not arithmetic. These tests pin what
keeps that cost down without changing a result, a counter or an error: frames
(validated shapes and options, geometry, bound mask) reused by calls that repeat them,
no autograd node where no gradient can flow, and a native pass of full tiles handed
no mask intervals.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import flashledger as fl
from flashledger import _native, _problem, blocked
from flashledger.ledger import Ledger

f64 = torch.float64


def _decode_inputs(
    gen: torch.Generator, b: int = 2, lq: int = 1, lk: int = 70, dtype: torch.dtype = f64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(b, 4, lq, 8, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, 2, lk, 8, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v


def test_calls_that_repeat_their_shapes_and_options_share_a_frame(gen):
    """The second call with the same shapes, dtypes, devices and options reuses the first
    one's geometry and bound mask; new inputs of those shapes give their own results."""
    q, k, v = _decode_inputs(gen)
    mask = fl.Causal("bottom_right")
    a = _problem.build_problem(q, k, v, mask=mask, scale=0.5)
    b = _problem.build_problem(q * 2, k, v, mask=fl.Causal("bottom_right"), scale=0.5)
    assert a.geo is b.geo and a.mask is b.mask and a.smod is b.smod
    assert torch.equal(b.q, (q * 2).view_as(b.q))
    other = _problem.build_problem(q, k, v, mask=fl.Causal("top_left"), scale=0.5)
    assert other.mask is not a.mask
    rescaled = _problem.build_problem(q, k, v, mask=mask, scale=0.25)
    assert rescaled.smod is not a.smod and rescaled.smod.scale == 0.25
    longer = _problem.build_problem(q, torch.cat([k, k], 2), torch.cat([v, v], 2), mask=mask)
    assert longer.geo is not a.geo and longer.geo.lk == 140


@pytest.mark.parametrize(
    ("opts", "error"),
    [
        (dict(scale=True), "scale must be a finite number"),
        (dict(dropout_p=False), "dropout_p must be a number"),
        (dict(seed=True), "seed must be an integer"),
        (dict(softcap=True), "softcap must be None or a finite number"),
    ],
)
def test_a_kept_frame_never_stands_in_for_a_bad_option(opts, error, gen):
    """``True == 1`` and ``False == 0.0``: a frame kept for a good value must not let the
    bool through (the options are keyed with their types)."""
    q, k, v = _decode_inputs(gen)
    good = {name: 1 if name != "dropout_p" else 0.0 for name in opts}
    fl.blocked_forward(q, k, v, **good)
    for _ in range(2):
        with pytest.raises(ValueError, match=error):
            fl.blocked_forward(q, k, v, **opts)


def test_bad_inputs_raise_on_every_call(gen):
    q, k, v = _decode_inputs(gen)
    fl.blocked_forward(q, k, v, mask=fl.Causal("bottom_right"))
    for _ in range(2):
        with pytest.raises(ValueError, match="k and v must agree"):
            fl.blocked_forward(q, k, v[..., :-1, :], mask=fl.Causal("bottom_right"))
        with pytest.raises(TypeError, match="share one dtype"):
            fl.blocked_forward(q, k.float(), v, mask=fl.Causal("bottom_right"))


def test_frames_are_kept_only_for_few_rows_and_value_options(gen):
    """A mask holding a tensor, a tensor option or many rows builds its frame afresh (a
    frame is kept only when nothing in it could change behind the key), and the cache
    keeps a bounded number of frames."""
    q, k, v = _decode_inputs(gen)
    pad = fl.KeyPadding([70, 50])
    assert _problem.build_problem(q, k, v, mask=pad).mask is not (
        _problem.build_problem(q, k, v, mask=pad).mask
    )
    slopes = fl.alibi_slopes(4, dtype=f64)
    assert (
        _problem.build_problem(q, k, v, alibi_slopes=slopes).geo
        is not _problem.build_problem(q, k, v, alibi_slopes=slopes).geo
    )
    many = torch.randn(1, 4, _problem._FRAME_ROWS + 1, 8, dtype=f64, generator=gen)
    assert (
        _problem.build_problem(many, many[:, :2], many[:, :2]).geo
        is not _problem.build_problem(many, many[:, :2], many[:, :2]).geo
    )
    for lk in range(1, _problem._FRAMES.size + 10):
        _problem.build_problem(q, k[..., :lk, :], v[..., :lk, :])
    assert len(_problem._FRAMES._frames) == _problem._FRAMES.size


def test_no_autograd_node_where_no_gradient_can_flow(gen):
    """Under no_grad, or with no input that requires a gradient, the op runs its forward
    alone: the same bits as through autograd, no graph, and its ledger still booked."""
    q, k, v = _decode_inputs(gen, lq=3)
    mask = fl.Causal("bottom_right")
    booked: list[Ledger] = []
    opts: dict[str, Any] = dict(mask=mask, block_q=None, block_k=None, loop_order="fa2")
    from flashledger.autograd import _FlashAttention

    qg = q.clone().requires_grad_(True)
    o_graph, lse_graph = _FlashAttention.apply(qg, k, v, None, opts, booked.append)
    assert o_graph.grad_fn is not None
    with torch.no_grad():
        o_plain, lse_plain = _FlashAttention.apply(qg, k, v, None, opts, booked.append)
    o_free, _ = _FlashAttention.apply(q, k, v, None, opts, booked.append)
    for o in (o_plain, o_free):
        assert o.grad_fn is None and not o.requires_grad
        assert torch.equal(o, o_graph.detach())
    assert torch.equal(lse_plain, lse_graph.detach())
    assert [led.pass_name for led in booked] == ["forward"] * 3
    assert booked[0].counters == booked[1].counters == booked[2].counters


@pytest.mark.parametrize(("lq", "partial"), [(1, False), (5, True)])
def test_a_pass_of_full_tiles_gets_no_mask_intervals(
    native, monkeypatch, gen, assert_close, lq, partial
):
    """One row against the cache (bottom-right causal) sees every key: its tiles are full
    and the native step is handed no intervals; five rows have a partial tile, and get
    them. Results and counters equal the PyTorch step's."""
    seen: list[Any] = []
    real = native.forward

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append(kw["intervals"])
        return real(*a, **kw)

    monkeypatch.setattr(native, "forward", spy)
    q, k, v = _decode_inputs(gen, lq=lq)
    mask = fl.Causal("bottom_right")
    got = fl.blocked_forward(q, k, v, mask=mask, block_k=32)
    assert len(seen) == 1 and (seen[0] is not None) == partial, seen
    assert (got.ledger.counters.tiles_partial > 0) == partial
    with _native.disabled():
        want = fl.blocked_forward(q, k, v, mask=mask, block_k=32)
    assert got.ledger.counters == want.ledger.counters
    assert_close(got.o, want.o, rtol=1e-12, name=f"O, decode Lq={lq}")
    assert_close(got.lse, want.lse, rtol=1e-12, name=f"LSE, decode Lq={lq}")


def test_the_conventions_lse_of_empty_rows_is_still_reported(gen):
    """The conventions' LSE replaces -inf only where a row saw no key (the check that
    finds such rows says so; rows that see keys are untouched)."""
    q, k, v = _decode_inputs(gen, lq=4, lk=3)
    mask = fl.Causal("top_left") & fl.SlidingWindow(1, 0, align="top_left")
    fa2 = fl.blocked_forward(q, k, v, mask=mask, conventions="flash_attn_2")
    seed = fl.blocked_forward(q, k, v, mask=mask)
    assert torch.equal(fa2.o, seed.o)
    assert bool(torch.isfinite(seed.lse).all()), "every row sees a key here"
    assert torch.equal(fa2.lse, seed.lse)
    empty = fl.blocked_forward(q, k, v, mask=fl.Causal("bottom_right"), conventions="flash_attn_2")
    rows = torch.isinf(empty.lse)
    assert bool(rows.any()) and bool((empty.lse[rows] == math.inf).all())


def test_decode_helpers_keep_their_layout():
    """``_native_rows`` hands the step a view when the tensor is already what it reads."""
    x = torch.randn(2, 3, 1, 5, 4, dtype=f64)
    pb = _problem.build_problem(x[:, :, 0], x[:, :, 0], x[:, :, 0])
    flat = blocked._native_rows(pb, x)
    assert flat.shape == (6, 5, 4) and flat.data_ptr() == x.data_ptr()
    strided = x.transpose(-1, -2)
    assert torch.equal(blocked._native_rows(pb, strided), strided.reshape(6, 4, 5))


def test_decode_rounds_hold_enough_calls_to_outlast_the_clock():
    """``bench.calls_per_round``: each runner is warmed up, then timed call by call (at
    least three, and a quarter of the round), and a round holds enough calls for the
    fastest runner's median call to last the time asked for: a call of 5 ms at most 4 in
    20 ms, a call of a few microseconds hundreds, and a runner whose first calls are cold
    is paced by its warm ones."""
    import time

    from flashledger import bench

    calls = {"slow": 0, "fast": 0, "cold": 0}

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.005)

    def fast() -> None:
        calls["fast"] += 1

    def cold() -> None:  # the warm-up and the first timed call take 5 ms, then 0.2 ms
        calls["cold"] += 1
        time.sleep(0.005 if calls["cold"] <= 2 else 0.0002)

    assert 1 <= bench.calls_per_round({"slow": slow}, 0.02) <= 4
    assert calls["slow"] == 4  # the warm-up and three timed calls (15 ms: past 5)
    assert bench.calls_per_round({"slow": slow, "fast": fast}, 0.02) > 100
    assert calls["fast"] >= 4
    paced = bench.calls_per_round({"cold": cold}, 0.02)
    assert paced > 8, f"{paced} calls: paced by the cold first call (5 ms: 4), not 0.2 ms"
    assert bench.calls_per_round({"slow": slow}, 0.0) == 1


def test_decode_benchmark_reports_the_fixed_cost_and_the_sweep(tmp_path, capsys):
    """``flashledger bench --decode``: the fixed cost of a call (Lk = 64: flashledger, SDPA,
    the native pass and what is around it) and the Lk sweep, in one process, into
    decode.json; the native pass's timer leaves the step as it found it."""
    import json

    from flashledger import bench, cli

    kern = _native.kernels()
    code = cli.main(
        ["bench", "--decode", "--lengths", "96", "--dtypes", "float32", "--repeats", "3",
         "--calls", "2", "--no-memory", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "decode's fixed cost" in out and "ratio" in out
    report = json.loads((tmp_path / "decode.json").read_text())
    fixed, sweep = report["fixed_cost"], report["results"]
    assert [(r["dtype"], r["batch"], r["lk"]) for r in fixed] == [
        ("float32", 1, bench.FIXED_COST_LK),
        ("float32", 8, bench.FIXED_COST_LK),
    ]
    assert [(r["lk"], r["batch"]) for r in sweep] == [(96, 1), (96, 8)]
    for r in sweep:  # a round of a 96-key call holds many calls (it takes microseconds)
        assert isinstance(r["calls_per_round"], int) and r["calls_per_round"] > 1, r
        assert r["ratio"] == pytest.approx(r["flashledger"]["ms"] / r["sdpa"]["ms"])
    for r in fixed:
        assert r["flashledger_us"] > 0 and r["sdpa_us"] > 0
        assert r["ratio"] == pytest.approx(r["flashledger_us"] / r["sdpa_us"])
        if kern is None:
            assert r["native_pass_us"] is None and r["around_us"] is None
        else:
            assert 0 < r["native_pass_us"] < r["flashledger_us"]
            assert r["around_us"] == pytest.approx(r["flashledger_us"] - r["native_pass_us"])
    if kern is not None:
        real = _native.ForwardPass.run
        with bench.native_pass_timer() as spent:
            fl.flash_attention(*_decode_inputs(torch.Generator().manual_seed(0), dtype=f64))
        assert len(spent) == 1 and _native.ForwardPass.run is real, "the timer is gone"
