"""Ring attention edges: what every rank must agree on (masks under |, a dropout mask, a
score_mod that fails on one rank), a second backward of a retained graph, and the closed
form of what a ring sends."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import flashledger as fl
from flashledger import _ring_core
from flashledger._mods import find_captured
from flashledger._ring_core import _Options, _rank_run, _RankRun, _RingFunction
from flashledger._ring_transport import LocalHub, LocalTransport
from flashledger.ring import (
    RingLedger,
    ring_attention,
    ring_comm_totals,
    shard_sequence,
    simulate_ring,
)

F64 = torch.float64
L = 8


def _run_ranks(rank: Any, w: int, *, timeout: float) -> list[threading.Thread]:
    """``rank(r)`` on a thread per rank of a ``w``-rank ring, joined within ``timeout`` s."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return threads


def _ring(w: int, per_rank: Any) -> list[BaseException | None]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, L, 4, generator=g, dtype=F64) for _ in range(3))
    hub = LocalHub(w, timeout=10.0)
    errors: list[BaseException | None] = [None] * w

    def rank(r: int) -> None:
        xs = [shard_sequence(x, r, w) for x in (q, k, v)]
        try:
            run = _rank_run(
                LocalTransport(hub, r),
                layout="contiguous",
                block_q=4,
                block_k=4,
                ledger=None,
                opts=per_rank(r),
            )
            _RingFunction.apply(*xs, run)
        except BaseException as e:
            errors[r] = e

    threads = _run_ranks(rank, w, timeout=40)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return errors


g = torch.Generator().manual_seed(1)
MASKS = torch.rand(2, L, L, generator=g) > 0.5
KEEP = torch.rand(2, 1, 1, L, L, generator=g) > 0.3


@pytest.mark.parametrize(
    ("per_rank", "words"),
    [
        (lambda r: {"mask": fl.Causal() | fl.DenseMask(MASKS[r])}, "mask: rank 1 has (Causal"),
        (lambda r: {"mask": fl.DenseMask(MASKS[r]) | fl.Causal()}, "mask: rank 1 has (DenseMask"),
        (lambda r: {"dropout_p": 0.3, "dropout_mask": KEEP[r]}, "dropout_mask: rank 1 has"),
        (
            lambda r: {"dropout_p": 0.3, **({"dropout_mask": KEEP[0]} if r == 0 else {})},
            "rank 0 has tensor of shape (1, 1, 8, 8), bool",
        ),
    ],
    ids=["causal|dense", "dense|causal", "dropout_mask", "dropout_mask-on-one-rank"],
)
def test_ranks_with_other_masks_under_or_or_other_keep_masks_all_raise(
    per_rank: Any, words: str
) -> None:
    errors = _ring(2, per_rank)
    for r, e in enumerate(errors):
        assert isinstance(e, ValueError), f"rank {r} computed with no error: {e!r}"
        assert "the ranks were given different options" in str(e) and words in str(e), str(e)


def test_equal_or_masks_and_keep_masks_still_agree() -> None:
    errors = _ring(
        2,
        lambda r: {
            "mask": fl.Causal() | fl.DenseMask(MASKS[0].clone()),
            "dropout_p": 0.3,
            "dropout_mask": KEEP[0].clone(),
        },
    )
    assert errors == [None, None], errors


def test_a_score_mod_failing_its_probe_on_one_rank_stops_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w, L = 3, 12
    hub = LocalHub(w, timeout=5.0)
    # group=r stands for rank r's process group: its transport is an in-memory one
    monkeypatch.setattr(
        _ring_core, "DistTransport", lambda group, timeout: LocalTransport(hub, group)
    )
    table = torch.zeros(2 * L, dtype=F64, requires_grad=True)

    def good(s: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return s + table[qi - kv + L]

    def bad(s: Any, b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return s + table[qi - kv + L, 0]  # IndexError on every call

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 4, generator=g, dtype=F64) for _ in range(3))
    errors: list[BaseException | None] = [None] * w

    def rank(r: int) -> None:
        xs = [shard_sequence(x, r, w).requires_grad_() for x in (q, k, v)]
        try:
            ring_attention(*xs, group=r, score_mod=bad if r == 1 else good, timeout=5)
        except BaseException as e:
            errors[r] = e

    _run_ranks(rank, w, timeout=30)
    assert isinstance(errors[1], ValueError), errors[1]
    assert "score_mod 'bad' raised IndexError" in str(errors[1]), errors[1]
    for r in (0, 2):
        e = errors[r]
        assert isinstance(e, ValueError), f"rank {r} waited or went on: {e!r}"
        assert "rank(s) [1] rejected their inputs or options" in str(e), str(e)
        assert "score_mod 'bad' raised IndexError" in str(e), str(e)


def test_retain_graph_second_backward_does_not_double_count_captured_grads() -> None:
    w, L, d = 2, 12, 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, L, d, generator=g, dtype=F64) for _ in range(3))
    table0 = torch.randn(2 * L, generator=g, dtype=F64)
    tables: dict[int, torch.Tensor] = {}

    def rel(s, b, h, qi, kv):  # type: ignore[no-untyped-def]
        return s + tables[threading.get_ident()][qi - kv + L]

    # single process: two backward passes of one graph
    tables[threading.get_ident()] = t_one = table0.clone().requires_grad_()
    o = fl.flash_attention(q, k, v, score_mod=rel)
    o.sum().backward(retain_graph=True)
    o.sum().backward()
    want = t_one.grad
    assert want is not None

    hub = LocalHub(w, timeout=30.0)
    opts = _Options.build("ring_attention", {"score_mod": rel}, block_q=4, block_k=4)
    shares: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            tables[threading.get_ident()] = t = table0.clone().requires_grad_()
            xs = [shard_sequence(x, r, w).requires_grad_() for x in (q, k, v)]
            run = _RankRun(LocalTransport(hub, r), "contiguous", opts, RingLedger())
            captured = find_captured(rel, dtype=F64, device=q.device)
            o_r, _ = _RingFunction.apply(*xs, run, *captured)
            o_r.sum().backward(retain_graph=True)
            o_r.sum().backward()
            assert t.grad is not None
            shares[r] = t.grad
        except BaseException as e:
            errors.append(e)
            hub.abort()

    _run_ranks(rank, w, timeout=60)
    assert not errors, errors
    got = sum(shares.values())
    # float64, 2 ranks: the same sums in another order, rounding far below one backward's share
    tol = 64 * torch.finfo(F64).eps * float(want.abs().max())
    assert torch.allclose(got, want, rtol=0, atol=tol), float((got - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_closed_form_defaults_equal_what_the_ring_sent(dtype: torch.dtype) -> None:
    q = torch.randn(1, 8, 4, dtype=dtype)
    res = simulate_ring(q, q, q, world_size=2, do=torch.randn(1, 8, 4, dtype=dtype))
    want = ring_comm_totals(world_size=2, lk=8, d=4, itemsize=q.element_size())
    assert res.ledger.comm_totals() == want


@pytest.mark.parametrize("bad", [{"d_v": -4}, {"d_v": 0}, {"grad_itemsize": 0}])
def test_closed_form_refuses_impossible_sizes(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be None or an integer >= 1"):
        ring_comm_totals(world_size=2, lk=8, d=4, **bad)
