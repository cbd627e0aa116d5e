"""``trace=``: records of every k-th step, and a budget checked before the loop runs.

Ledger records hold each step's tensors, so they grow as ``B·H·Lq·Lk``. The loop
computes their size in closed form before it starts: the tests check that figure
against the bytes the records really hold, that ``every=k`` keeps exactly the
records of the full trace whose index is a multiple of k, and that a trace over its
budget is refused before the first step, with the size and a ``Trace`` that fits.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any

import pytest
import torch

import flashledger as fl
from flashledger import blocked

F64 = torch.float64


def _inputs(
    gen: torch.Generator, b: int = 2, hq: int = 4, hkv: int = 2, lq: int = 13, lk: int = 11
):
    q = torch.randn(b, hq, lq, 5, dtype=F64, generator=gen)
    k = torch.randn(b, hkv, lk, 5, dtype=F64, generator=gen)
    v = torch.randn(b, hkv, lk, 3, dtype=F64, generator=gen)
    do = torch.randn(b, hq, lq, 3, dtype=F64, generator=gen)
    return q, k, v, do


def _record_bytes(records: list[Any]) -> int:
    """The bytes of tensor data the records hold (every tensor field, each counted once)."""
    total = 0
    for r in records:
        for f in fields(r):
            x = getattr(r, f.name)
            if isinstance(x, torch.Tensor):
                total += x.numel() * x.element_size()
    return total


class _Steps:
    """Counts the steps the loop runs (indices only)."""

    wants_tensors = False

    def __init__(self) -> None:
        self.seen = 0

    def forward_tile(self, step: Any) -> None:
        self.seen += 1

    def backward_tile(self, step: Any) -> None:
        self.seen += 1


CASES = {
    "plain-fa2": dict(block_q=4, block_k=3),
    "causal-fa1": dict(mask=fl.Causal("bottom_right"), block_q=5, block_k=2, loop_order="fa1"),
    "window-dropout": dict(mask=fl.SlidingWindow(3, 0), dropout_p=0.2, block_q=3, block_k=4),
    "padding-softcap": dict(mask=fl.KeyPadding([0, 7]), softcap=3.0, block_q=6, block_k=6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("every", [1, 3])
def test_closed_form_size_equals_the_records_bytes(case, every, gen):
    q, k, v, do = _inputs(gen)
    opts: dict[str, Any] = CASES[case]
    trace = fl.Trace(every=every, max_bytes=None)
    fwd = fl.blocked_forward(q, k, v, trace=trace, **opts)
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, trace=trace, **opts)
    pb = blocked.build_problem(
        q, k, v, **{n: x for n, x in opts.items() if n not in ("block_q", "block_k", "loop_order")}
    )
    bq, bk = opts["block_q"], opts["block_k"]
    qt, kt = blocked._tiles(13, bq), blocked._tiles(11, bk)
    classes = blocked._classes(pb, bq, bk)
    order = opts.get("loop_order", "fa2")
    for name, res in (("forward " + order, fwd), ("backward", bwd)):
        want, kept, run = blocked._record_bytes(pb, classes, qt, kt, name, every)
        led = res.ledger
        assert run == led.counters.tiles_run, (name, run, led.counters.tiles_run)
        assert kept == len(led.records) == -(-run // every), (name, kept, len(led.records))
        assert [r.index for r in led.records] == list(range(0, run, every))
        assert want == _record_bytes(led.records), (name, want, _record_bytes(led.records))
        assert led.record_every == every and led.to_dict()["record_every"] == every


@pytest.mark.parametrize("loop_order", ["fa2", "fa1"])
def test_every_kth_step_keeps_the_full_traces_records(loop_order, gen):
    q, k, v, do = _inputs(gen)
    opts: dict[str, Any] = dict(mask=fl.Causal(), block_q=3, block_k=2, loop_order=loop_order)
    full_f = fl.blocked_forward(q, k, v, trace=True, **opts)
    full_b = fl.blocked_backward(q, k, v, full_f.o, full_f.lse, do, trace=True, **opts)
    some_f = fl.blocked_forward(q, k, v, trace=4, **opts)
    some_b = fl.blocked_backward(q, k, v, full_f.o, full_f.lse, do, trace=4, **opts)
    assert torch.equal(some_f.o, full_f.o) and torch.equal(some_b.dq, full_b.dq)
    assert some_f.ledger.counters == full_f.ledger.counters
    for full, some in ((full_f.ledger, some_f.ledger), (full_b.ledger, some_b.ledger)):
        want = [r for r in full.records if r.index % 4 == 0]
        assert len(some.records) == len(want) >= 2
        for a, b in zip(some.records, want):
            for f in fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                assert same, f"record {a.index} field {f.name} differs from the full trace's"
        assert "records of every 4th step" in str(some)


def test_a_trace_over_its_budget_is_refused_before_the_first_step(gen):
    q, k, v, do = _inputs(gen)
    opts: dict[str, Any] = dict(block_q=2, block_k=2)
    need = _record_bytes(fl.blocked_forward(q, k, v, trace=True, **opts).ledger.records)
    steps = _Steps()
    with pytest.raises(ValueError) as info:
        fl.blocked_forward(q, k, v, trace=fl.Trace(max_bytes=need // 3), observer=steps, **opts)
    msg = str(info.value)
    assert steps.seen == 0, "the budget is checked before the loop runs"
    assert f"{need / 2**10:.3g} KiB" in msg and "over the trace budget" in msg, msg
    assert "(42 of 42 tile steps" in msg and "B·H = 8 heads" in msg, msg
    hint = msg.split("trace=flashledger.Trace(every=")[1]
    every = int(hint.split(")")[0])
    fits = fl.blocked_forward(q, k, v, trace=fl.Trace(every=every, max_bytes=need // 3), **opts)
    assert 0 < _record_bytes(fits.ledger.records) <= need // 3
    fwd = fl.blocked_forward(q, k, v)
    with pytest.raises(ValueError, match="the backward ledger would record"):
        fl.blocked_backward(
            q, k, v, fwd.o, fwd.lse, do, trace=fl.Trace(max_bytes=1000), observer=steps, **opts
        )
    assert steps.seen == 0


class _Stop:
    """Fails at the first step: a trace that is not refused up front would reach it."""

    wants_tensors = False

    def forward_tile(self, step: Any) -> None:
        raise RuntimeError("the loop ran")


def test_default_budget_refuses_a_trace_of_gigabytes_up_front():
    """Records grow to GiB at L = 8192 (d = 64, 64-wide tiles; 2.04 GiB in float64): refused
    with the default budget of 1 GiB, and a Trace that fits is named."""
    x = torch.zeros(1, 1, 8192, 64, dtype=F64)
    with pytest.raises(ValueError) as info:
        fl.blocked_forward(x, x, x, block_q=64, block_k=64, trace=True, observer=_Stop())
    msg = str(info.value)
    assert "would record 2.04 GiB" in msg and "over the trace budget of 1 GiB" in msg, msg
    assert "(16,384 of 16,384 tile steps" in msg and "Trace(every=3)" in msg, msg
    assert "keeps every 3rd step: 696 MiB" in msg, msg


def test_trace_values():
    q, k, v, _ = (torch.randn(4, 2, dtype=F64) for _ in range(4))
    for bad, exc, text in (
        (0, ValueError, "Trace.every must be an integer in 1.."),
        (-2, ValueError, "Trace.every"),
        ("yes", TypeError, "trace must be True/False, an integer k"),
        (2.0, TypeError, "trace must be"),
    ):
        with pytest.raises(exc, match=re.escape(text)):
            fl.blocked_forward(q, k, v, trace=bad)
    with pytest.raises(
        ValueError, match=re.escape("Trace.max_bytes must be an integer >= 0 or None")
    ):
        fl.Trace(max_bytes=-1)
    with pytest.raises(ValueError, match=r"Trace\.max_bytes"):
        fl.Trace(max_bytes=math.inf)  # type: ignore[arg-type]
    assert fl.blocked_forward(q, k, v, trace=False).ledger.records == []


def test_a_budget_that_holds_one_step_names_the_trace_that_keeps_it(gen):
    """Three key tiles of one query tile, a budget of one and a half steps: the doubling from
    every=2 (two steps, over) passes the step count, yet every=3 keeps the first step alone,
    which fits. The refusal names it instead of saying even one step is over the budget."""
    q, k, v, _ = _inputs(gen, b=1, hq=1, hkv=1, lq=4, lk=12)
    opts: dict[str, Any] = dict(block_q=4, block_k=4)
    one = _record_bytes(fl.blocked_forward(q, k, v, trace=fl.Trace(every=3), **opts).ledger.records)
    budget = one * 3 // 2
    with pytest.raises(ValueError) as info:
        fl.blocked_forward(q, k, v, trace=fl.Trace(max_bytes=budget), **opts)
    msg = str(info.value)
    assert "even one step's record is over the budget" not in msg, msg
    assert "trace=flashledger.Trace(every=3)" in msg, msg
    kept = fl.blocked_forward(q, k, v, trace=fl.Trace(every=3, max_bytes=budget), **opts)
    assert len(kept.ledger.records) == 1
    with pytest.raises(ValueError, match="even one step's record is over the budget"):
        fl.blocked_forward(q, k, v, trace=fl.Trace(max_bytes=one - 1), **opts)


def test_a_notebook_ledger_says_which_steps_its_records_keep():
    """trace=k keeps every k-th step: the notebook view says so, as print() does, and its gap
    row counts records, not steps."""
    q = k = v = torch.randn(1, 1, 64, 4, dtype=torch.float64)
    led = fl.blocked_forward(q, k, v, block_q=2, block_k=2, trace=4).ledger
    assert "records of every 4th step" in str(led).splitlines()[0]
    page = led._repr_html_()
    assert "records of every 4th step" in page
    assert "more records" in page and "more steps" not in page
