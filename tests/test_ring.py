"""Ring attention's in-process twin, layouts, ledger and CLI hooks (no processes spawned)."""

from __future__ import annotations

import argparse
import json
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import flashledger as fl
from flashledger._ring_core import _Options, _rank_run, _RankRun, _RingFunction
from flashledger._ring_transport import LocalHub, LocalTransport, RingAborted
from flashledger.ledger import jsonable
from flashledger.ring import (
    Layout,
    RingLedger,
    RingResult,
    RingSetup,
    add_cli_arguments,
    ring_attention,
    ring_comm_totals,
    run_cli,
    shard_sequence,
    simulate_ring,
    unshard_sequence,
)

F64 = torch.float64


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str) -> None:
    """Max |got - want| <= tol; equal infinities count as equal; names the worst element."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.to(F64), want.to(F64)
    assert not bool(torch.isnan(got).any()), f"{name}: NaN at {torch.nonzero(torch.isnan(got))[0]}"
    same = got == want
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs()).nan_to_num(nan=math.inf)
    flat = int(diff.argmax())
    worst = float(diff.reshape(-1)[flat])
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    assert worst <= tol, (
        f"{name}: max |diff| = {worst:.3g} > {tol:g} at {idx}: "
        f"got {float(got[idx])!r}, want {float(want[idx])!r}"
    )


def make(
    b: int, hq: int, hkv: int, lq: int, lk: int, d: int, seed: int = 0, dv: int | None = None
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(b, hq, lq, d, generator=g, dtype=F64)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=F64)
    v = torch.randn(b, hkv, lk, dv, generator=g, dtype=F64)
    do = torch.randn(b, hq, lq, dv, generator=g, dtype=F64)
    dlse = torch.randn(b, hq, lq, generator=g, dtype=F64)
    return q, k, v, do, dlse


def check_against_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    world_size: int,
    layout: str,
    dlse: torch.Tensor | None = None,
    tol: float = 1e-12,
    block: int = 4,
    **opts: object,
) -> fl.ring.RingResult:
    res = simulate_ring(
        q,
        k,
        v,
        world_size=world_size,
        layout=layout,  # type: ignore[arg-type]
        do=do,
        dlse=dlse,
        block_q=block,
        block_k=block,
        **opts,  # type: ignore[arg-type]
    )
    conv = fl.conventions.get_conventions(opts.get("conventions", fl.SEED))  # type: ignore[arg-type]
    ref = fl.reference_forward(q, k, v, **opts)  # type: ignore[arg-type]
    refb = fl.reference_backward(
        q,
        k,
        v,
        ref.o,
        ref.lse,
        do,
        dlse=dlse if conv.lse_differentiable else None,
        **opts,  # type: ignore[arg-type]
    )
    tag = f"W={world_size} {layout}"
    assert_close(res.o, ref.o, tol, f"{tag} o")
    assert_close(res.lse, ref.lse, tol, f"{tag} lse")
    assert res.dq is not None and res.dk is not None and res.dv is not None
    assert_close(res.dq, refb.dq, tol, f"{tag} dq")
    assert_close(res.dk, refb.dk, tol, f"{tag} dk")
    assert_close(res.dv, refb.dv, tol, f"{tag} dv")
    assert res.ledger.comm_matches(), f"{tag}: {res.ledger.comm_totals()} != closed form"
    return res


# ---------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("w", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [8, 13, 29])
def test_shard_then_unshard_is_the_identity(layout: str, w: int, length: int) -> None:
    x = torch.arange(2 * length * 3, dtype=F64).reshape(2, length, 3)
    rows = torch.arange(length, dtype=F64).expand(2, length)
    shards = [shard_sequence(x, r, w, layout) for r in range(w)]  # type: ignore[arg-type]
    row_shards = [shard_sequence(rows, r, w, layout, dim=-1) for r in range(w)]  # type: ignore[arg-type]
    assert sum(s.shape[-2] for s in shards) == length
    assert max(s.shape[-2] for s in shards) - min(s.shape[-2] for s in shards) <= 2
    assert torch.equal(unshard_sequence(shards, layout), x)  # type: ignore[arg-type]
    assert torch.equal(unshard_sequence(row_shards, layout, dim=-1), rows)  # type: ignore[arg-type]


def test_zigzag_rank_holds_chunk_r_then_chunk_2w_minus_1_minus_r() -> None:
    x = torch.arange(16).view(16, 1)
    want = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}
    for r, rows in want.items():
        got = shard_sequence(x, r, 4, "zigzag").view(-1).tolist()
        assert got == rows, f"rank {r}: {got} != {rows}"
    assert shard_sequence(x, 1, 4, "contiguous").view(-1).tolist() == [4, 5, 6, 7]
    # uneven: 10 positions in 4 chunks of 2, 3, 2, 3 (boundaries floor(c * 10 / 4))
    uneven = [
        shard_sequence(torch.arange(10).view(10, 1), r, 2, "zigzag").view(-1).tolist()
        for r in range(2)
    ]
    assert uneven == [[0, 1, 7, 8, 9], [2, 3, 4, 5, 6]]


def test_sharding_rejects_what_it_cannot_cut() -> None:
    x = torch.zeros(7, 2)
    with pytest.raises(ValueError, match=r"zigzag layout on 4 rank\(s\).*must be >= 8"):
        shard_sequence(x, 0, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be 'contiguous' or 'zigzag'"):
        shard_sequence(x, 0, 2, "ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        shard_sequence(x, 0, 0)
    with pytest.raises(ValueError, match=r"shard 0 has shape \(4, 2\).*must hold 3 positions"):
        unshard_sequence([torch.zeros(4, 2), torch.zeros(2, 2)], "contiguous")


# ---------------------------------------------------------------------------------------
# the twin against the dense oracle
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("w", [1, 2, 3, 4])
def test_twin_equals_oracle_causal_gqa_uneven(layout: str, w: int) -> None:
    q, k, v, do, dlse = make(2, 4, 2, 27, 27, 8, seed=w)
    res = check_against_oracle(
        q, k, v, do, dlse=dlse, world_size=w, layout=layout, mask=fl.Causal()
    )
    # every visible (query, key) pair was computed exactly once, forward and backward
    visible = int(fl.Causal().dense(27, 27).sum()) * 2 * 4
    for p in ("forward", "backward"):
        seen = sum(x.counters.qk_dots_visible for x in res.ledger.rank_work(p))
        assert seen == visible, f"{p}: {seen} visible QK dots booked, the mask has {visible}"


MASKS = {
    "none": {},
    "window": {"mask": fl.SlidingWindow(5, 2)},
    "keypadding": {"mask": fl.KeyPadding([20, 9])},
    "dense": {"mask": torch.rand(24, 24, generator=torch.Generator().manual_seed(3)) > 0.3},
    "modifiers": {
        "mask": fl.Causal(),
        "dropout_p": 0.25,
        "seed": 7,
        "softcap": 3.0,
        "alibi_slopes": fl.alibi_slopes(2),
        "bias": torch.randn(24, 24, generator=torch.Generator().manual_seed(4), dtype=F64),
    },
    # flash-attn 2's edges: real lengths, windows read against seqlen_k, +slope·j ALiBi
    "padding-fa2": {
        "mask": fl.Causal() & fl.SlidingWindow(3, -1) & fl.Padding([24, 17], [24, 9]),
        "conventions": "flash_attn_2",
        "alibi_slopes": fl.alibi_slopes(2),
    },
    "keep-mask": {
        "mask": fl.SlidingWindow(4, 4),
        "dropout_p": 0.2,
        "dropout_mask": torch.rand(2, 1, 24, 24, generator=torch.Generator().manual_seed(5)) < 0.8,
    },
}


@pytest.mark.parametrize("case", sorted(MASKS))
@pytest.mark.parametrize(("w", "layout"), [(2, "contiguous"), (3, "zigzag"), (4, "zigzag")])
def test_twin_equals_oracle_masks_and_modifiers(case: str, w: int, layout: str) -> None:
    q, k, v, do, _ = make(2, 2, 2, 24, 24, 8, seed=11)
    check_against_oracle(q, k, v, do, world_size=w, layout=layout, **MASKS[case])


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_twin_cross_attention_bottom_right_has_fully_masked_rows(layout: str) -> None:
    # Lq = 30 > Lk = 18: bottom-right causal hides every key from the first 12 rows
    q, k, v, do, dlse = make(1, 2, 1, 30, 18, 8, seed=5, dv=6)
    res = check_against_oracle(
        q, k, v, do, dlse=dlse, world_size=3, layout=layout, mask=fl.Causal("bottom_right")
    )
    assert bool(torch.isneginf(res.lse[..., :12]).all()), "rows 0..11 see no key: LSE -inf"
    assert bool((res.o[..., :12, :] == 0).all()) and bool((res.dq[..., :12, :] == 0).all())  # type: ignore[index]


@pytest.mark.parametrize("preset", sorted(fl.PRESETS))
def test_fully_masked_rows_merge_without_nan_under_every_preset(preset: str) -> None:
    conv = fl.PRESETS[preset]
    # batch 1 sees no key at all; in batch 0 a window leaves rows 0..3 without a key
    rows_from_4 = (torch.arange(16).view(16, 1) >= 4).expand(16, 16)  # (Lq, Lk)
    mask = fl.KeyPadding([12, 0]) & fl.SlidingWindow(None, 2) & fl.DenseMask(rows_from_4)
    q, k, v, do, dlse = make(2, 2, 2, 16, 16, 8, seed=2)
    res = check_against_oracle(
        q, k, v, do, dlse=dlse, world_size=4, layout="zigzag", conventions=conv, mask=mask
    )
    masked = torch.zeros(2, 2, 16, dtype=torch.bool)
    masked[1] = True
    masked[0, :, :4] = True
    want = torch.full((int(masked.sum()),), conv.masked_row_lse, dtype=F64)
    assert torch.equal(res.lse[masked], want), f"{preset}: masked rows' LSE {res.lse[masked]}"
    assert bool(torch.isfinite(res.lse[~masked]).all())
    for name, t in (("o", res.o), ("dq", res.dq)):
        assert t is not None and bool((t[masked] == 0).all()), (
            f"{preset}: {name} not 0 on masked rows"
        )
    assert res.dk is not None and bool((res.dk[1] == 0).all()), "batch 1 adds nothing to dK"


@pytest.mark.parametrize(
    ("dtype", "tol", "itemsize"), [(torch.float32, 1e-4, 4), (torch.bfloat16, 5e-2, 2)]
)
def test_twin_low_precision_accumulates_in_float32(
    dtype: torch.dtype, tol: float, itemsize: int
) -> None:
    q, k, v, do, _ = make(1, 2, 2, 20, 20, 8, seed=9)
    res = simulate_ring(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        world_size=2,
        layout="zigzag",
        do=do.to(dtype),
        mask=fl.Causal(),
        block_q=4,
        block_k=4,
    )
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=fl.Causal())
    assert res.o.dtype == dtype and res.lse.dtype == torch.float32
    assert res.dk is not None and res.dk.dtype == dtype
    assert_close(res.o, ref.o, tol, "o")
    assert_close(res.dk, refb.dk, tol, "dk")
    s = res.ledger.setup  # K/V travel in the input dtype, dK/dV accumulators in float32
    assert s is not None and (s.itemsize, s.grad_itemsize) == (itemsize, 4)
    assert res.ledger.comm_matches()


def test_twin_is_deterministic_and_forward_only_books_one_pass() -> None:
    q, k, v, do, _ = make(1, 1, 1, 18, 18, 4, seed=1)
    a = simulate_ring(
        q, k, v, world_size=3, layout="zigzag", do=do, mask=fl.Causal(), block_q=4, block_k=4
    )
    b = simulate_ring(
        q, k, v, world_size=3, layout="zigzag", do=do, mask=fl.Causal(), block_q=4, block_k=4
    )
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{name} differs between runs"
    assert a.ledger == b.ledger
    f = simulate_ring(
        q, k, v, world_size=3, layout="zigzag", mask=fl.Causal(), block_q=4, block_k=4
    )
    assert f.dq is None and f.ledger.passes == ["forward"]
    assert torch.equal(f.o, a.o)
    assert f.ledger.comm_totals() == ring_comm_totals(world_size=3, lk=18, d=4, backward=False)


# ---------------------------------------------------------------------------------------
# the ledger
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("w", "layout", "lk"),
    [(1, "zigzag", 9), (2, "contiguous", 9), (3, "zigzag", 31), (4, "contiguous", 17)],
)
def test_comm_totals_equal_the_closed_form(w: int, layout: str, lk: int) -> None:
    q, k, v, do, _ = make(2, 3, 1, 12, lk, 4, seed=3, dv=6)
    res = simulate_ring(q, k, v, world_size=w, layout=layout, do=do, block_q=4, block_k=4)  # type: ignore[arg-type]
    want = ring_comm_totals(world_size=w, lk=lk, d=4, d_v=6, batch=2, heads_kv=1, itemsize=8)
    got = res.ledger.comm_totals()
    assert got == want, f"observed {got} != closed form {want}"
    assert want.hops == (w * (w - 1) * 2 + w * w if w > 1 else 0)
    hops = res.ledger.hops
    for p, payload in (("forward", "kv"), ("backward", "kv"), ("backward", "dkv")):
        mine = [h for h in hops if h.pass_name == p and h.payload == payload]
        for step in {h.step for h in mine}:
            at = [h for h in mine if h.step == step]
            assert sorted(h.sender for h in at) == list(range(w)), f"{p} {payload} step {step}"
            assert sorted(h.shard for h in at) == list(range(w)), "each shard moves once a step"
            assert all(h.receiver == (h.sender + 1) % w for h in at)
    if w > 1:  # each shard's gradients end at its owner after a full circle
        last = [h for h in hops if h.payload == "dkv" and h.step == w - 1]
        assert all(h.receiver == h.shard for h in last), last


def test_zigzag_balances_causal_work_and_contiguous_does_not() -> None:
    q, k, v, _, _ = make(1, 1, 1, 64, 64, 4, seed=0)
    zz = simulate_ring(
        q, k, v, world_size=4, layout="zigzag", mask=fl.Causal(), block_q=8, block_k=8
    )
    ct = simulate_ring(
        q, k, v, world_size=4, layout="contiguous", mask=fl.Causal(), block_q=8, block_k=8
    )
    zz_runs = [r.counters.tiles_run for r in zz.ledger.rank_work()]
    ct_runs = [r.counters.tiles_run for r in ct.ledger.rank_work()]
    assert zz_runs == [9, 9, 9, 9], zz_runs  # chunks c and 7-c: (c + 1) + (8 - c) tiles
    assert ct_runs == [3, 7, 11, 15], ct_runs  # rank r: tiles 2r, 2r+1 of the causal triangle
    assert zz.ledger.balance() == 1.0 and ct.ledger.balance() == pytest.approx(15 / 9)
    # lock-step time: zigzag 3 + 2 + 2 + 2 (the ideal 36 / 4), contiguous 3 + 4 + 4 + 4
    assert (zz.ledger.critical_path(), ct.ledger.critical_path()) == (9, 15)
    assert "forward 1.67 (critical path 15 tile steps, ideal 9)" in str(ct.ledger)
    for led in (zz.ledger, ct.ledger):  # every rank books its 16 rows x 64 keys: 2 x 8 tiles
        for r in led.rank_work():
            assert r.counters.tiles_run + r.counters.tiles_skipped == 16, r
    skipped_pairs = [r.pairs_skipped for r in ct.ledger.rank_work()]
    assert skipped_pairs == [3, 2, 1, 0], "contiguous causal skips the shards above the diagonal"


def test_ledger_renders_text_dict_and_html() -> None:
    q, k, v, do, _ = make(1, 1, 1, 12, 12, 4)
    led = simulate_ring(
        q, k, v, world_size=2, layout="zigzag", do=do, mask=fl.Causal(), block_q=3, block_k=3
    ).ledger
    text = str(led)
    assert "ring attention: 2 rank(s), zigzag layout, Lq = Lk = 12 in 4 chunks" in text
    assert "backward  dK/dV    4     1536" in text, text
    assert "forward   0     0 -> 1              K/V      0      384" in text
    d = json.loads(json.dumps(led.to_dict()))
    assert d["comm"]["match"] is True and len(d["hops"]) == 2 + 2 + 4
    assert d["ranks"]["forward"][0]["chunks"] == [0, 3]
    html = led._repr_html_()
    assert html.count("<table>") == 5 and "dK/dV" in html
    assert str(RingLedger()) == "ring attention ledger: empty"
    with pytest.raises(ValueError, match="has not recorded a ring call"):
        RingLedger().to_dict()


def test_ledger_combine_rejects_different_calls() -> None:
    q, k, v, _, _ = make(1, 1, 1, 8, 8, 4)
    a = simulate_ring(q, k, v, world_size=2, block_q=4, block_k=4).ledger
    b = simulate_ring(q, k, v, world_size=2, layout="zigzag", block_q=4, block_k=4).ledger
    with pytest.raises(ValueError, match="different ring calls"):
        RingLedger.combine([a, b])


# ---------------------------------------------------------------------------------------
# the autograd op, with in-memory wires (CPU autograd runs on the calling thread)
# ---------------------------------------------------------------------------------------
def test_autograd_op_on_threads_equals_the_twin() -> None:
    w, layout = 3, "zigzag"
    q, k, v, do, dlse = make(1, 2, 1, 18, 18, 4, seed=8)
    twin = simulate_ring(
        q,
        k,
        v,
        world_size=w,
        layout=layout,
        do=do,
        dlse=dlse,
        mask=fl.Causal(),
        block_q=4,
        block_k=4,
    )
    hub = LocalHub(w, timeout=30.0)
    opts = _Options.build(
        "ring_attention", {"mask": fl.Causal(), "conventions": fl.SEED}, block_q=4, block_k=4
    )
    out: dict[int, tuple[torch.Tensor, ...]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            xs = [shard_sequence(x, r, w, layout).requires_grad_() for x in (q, k, v)]
            run = _RankRun(LocalTransport(hub, r), layout, opts, RingLedger())
            o, lse = _RingFunction.apply(*xs, run)
            torch.autograd.backward(
                [o, lse],
                [shard_sequence(do, r, w, layout), shard_sequence(dlse, r, w, layout, dim=-1)],
            )
            out[r] = (o.detach(), *(x.grad for x in xs))
        except BaseException as e:
            errors.append(e)
            hub.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for i, (name, want) in enumerate(
        (("o", twin.o), ("dq", twin.dq), ("dk", twin.dk), ("dv", twin.dv))
    ):
        got = unshard_sequence([out[r][i] for r in range(w)], layout)
        assert want is not None and torch.equal(got, want), f"{name} differs from the twin"


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors() -> None:
    q, k, v, do, _ = make(1, 1, 1, 8, 8, 4)
    with pytest.raises(RuntimeError, match=r"torchrun.*simulate_ring"):
        ring_attention(q, k, v)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        simulate_ring(q, k, v, world_size=0)
    with pytest.raises(ValueError, match="layout must be"):
        simulate_ring(q, k, v, world_size=2, layout="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Lq = 8 is too short .* must be >= 12"):
        simulate_ring(q, k, v, world_size=6, layout="zigzag")
    with pytest.raises(ValueError, match="does not compute a gradient for bias"):
        simulate_ring(q, k, v, world_size=2, bias=torch.zeros(8, 8, dtype=F64, requires_grad=True))
    with pytest.raises(ValueError, match="do must be a tensor shaped like the output"):
        simulate_ring(q, k, v, world_size=2, do=do[..., :5, :])
    with pytest.raises(ValueError, match="mask of shape"):
        simulate_ring(q, k, v, world_size=2, mask=torch.ones(4, 8, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be None"):
        simulate_ring(q, k, v, world_size=2, mask="causal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale must be a finite number"):
        simulate_ring(q, k, v, world_size=2, scale=math.inf)
    with pytest.raises(ValueError, match="q contains NaN"):
        simulate_ring(q.clone().fill_(math.nan), k, v, world_size=2)


# ---------------------------------------------------------------------------------------
# ranks that disagree: every rank raises together, naming who differs (in-memory wires)
# ---------------------------------------------------------------------------------------
def _disagreeing_ring(
    w: int, per_rank: Any, *, backward: Any = None, shards: Any = None, hub_timeout: float = 10.0
) -> list[BaseException | None]:
    """Run ``ring_attention``'s per-rank code on ``w`` threads, rank ``r`` with the arguments
    ``per_rank(r)`` (options, and ``layout``/``block_q``/``block_k``); with ``backward(r)``
    the upstream gradient of rank r's output; with ``shards(r, [q, k, v])`` rank r's shards
    as that returns them. Returns each rank's exception. A rank that
    failed alone would leave the others waiting: they would raise TimeoutError after
    ``hub_timeout`` seconds (the wires are not aborted on purpose)."""
    q, k, v, do, _ = make(1, 2, 1, 12, 12, 4, seed=3)
    hub = LocalHub(w, timeout=hub_timeout)
    errors: list[BaseException | None] = [None] * w

    def rank(r: int) -> None:
        kw = dict(per_rank(r))
        layout = kw.pop("layout", "zigzag")
        lay = layout if layout in ("zigzag", "contiguous") else "zigzag"
        xs = [shard_sequence(x, r, w, lay).requires_grad_() for x in (q, k, v)]
        if shards is not None:
            xs = shards(r, xs)
        try:
            run = _rank_run(
                LocalTransport(hub, r),
                layout=layout,
                block_q=kw.pop("block_q", 4),
                block_k=kw.pop("block_k", 4),
                ledger=None,
                opts=kw,
            )
            o, _ = _RingFunction.apply(*xs, run)
            if backward is not None:
                o.backward(backward(r, shard_sequence(do, r, w, lay)))
        except BaseException as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * hub_timeout)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return errors


def _expect(errors: list[BaseException | None], own: dict[int, str], others: list[str]) -> None:
    """Rank r in ``own`` raised its own error containing own[r]; every other rank raised a
    ValueError containing each of ``others``."""
    for r, e in enumerate(errors):
        assert e is not None, f"rank {r} did not raise"
        assert not isinstance(e, (TimeoutError, RingAborted)), f"rank {r} waited: {e}"
        if r in own:
            assert own[r] in str(e), f"rank {r}: {e}"
        else:
            assert isinstance(e, ValueError), f"rank {r}: {type(e).__name__}: {e}"
            for text in others:
                assert text in str(e), f"rank {r}: {text!r} not in {e}"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"softcap": -1.0}, "softcap must be None or a finite number > 0, got -1.0"),
        ({"block_q": 0}, "block_q must be an integer in 1.."),
        ({"layout": "diagonal"}, "layout must be"),
        ({"dropout_p": 1.5}, "dropout_p must be a number in [0, 1)"),
        ({"seed": 2**64}, "seed must be an integer >= 0 and < 2**64"),
        ({"mask": "causal"}, "mask must be None"),
        ({"bias": torch.zeros(12, 12, dtype=torch.int64)}, "bias must have a floating dtype"),
        ({"alibi_slopes": torch.full((2,), math.nan, dtype=F64)}, "alibi_slopes contains NaN"),
        ({"nonsense": 1}, "unexpected keyword argument 'nonsense'"),
    ],
    ids=lambda x: next(iter(x)) if isinstance(x, dict) else "",
)
def test_one_ranks_invalid_option_makes_every_rank_raise(bad: dict[str, Any], message: str) -> None:
    errors = _disagreeing_ring(3, lambda r: bad if r == 1 else {})
    _expect(errors, {1: message}, ["rank(s) [1] rejected their inputs or options", message])


def test_a_layout_mismatch_is_named_by_the_layouts() -> None:
    errors = _disagreeing_ring(2, lambda r: {"layout": "contiguous"} if r == 1 else {})
    _expect(errors, {}, ["layout: rank 0 has zigzag, rank 1 has contiguous"])


def test_a_shard_of_the_wrong_length_lists_what_every_rank_holds() -> None:
    """The global length is the sum of the shards, so which rank is off cannot be known:
    the message lists every rank's count and the cut (it blamed rank 0, whose shard was
    right)."""

    def one_key_short(r: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return xs if r == 0 else [xs[0], xs[1][..., :-1, :], xs[2][..., :-1, :]]

    errors = _disagreeing_ring(2, lambda r: {"layout": "contiguous"}, shards=one_key_short)
    for r, e in enumerate(errors):
        assert isinstance(e, ValueError), f"rank {r}: {e!r}"
        assert "the ranks hold [6, 5] keys (11 in all)" in str(e), str(e)
        assert "cuts 11 keys as [6, 5]" not in str(e) and "rank 0 must" not in str(e), str(e)


SHARED = {"mask": fl.Causal(), "scale": 0.4, "alibi_slopes": fl.alibi_slopes(2)}


@pytest.mark.parametrize(
    ("field", "other", "words"),
    [
        ("mask", None, ["mask: rank 2 has None, ranks 0, 1 have Causal(align=None)"]),
        ("mask", fl.Causal("bottom_right"), ["rank 2 has Causal(align='bottom_right')"]),
        ("scale", 0.5, ["scale: rank 2 has 0.5, ranks 0, 1 have 0.4"]),
        ("conventions", "flash_attn_2", ["conventions: rank 2 has flash_attn_2"]),
        ("seed", 7, ["seed: rank 2 has 7, ranks 0, 1 have 0"]),
        ("dropout_p", 0.1, ["dropout_p: rank 2 has 0.1, ranks 0, 1 have 0.0"]),
        ("softcap", 2.0, ["softcap: rank 2 has 2.0, ranks 0, 1 have None"]),
        ("alibi_slopes", fl.alibi_slopes(2) * 2, ["alibi_slopes: rank 2 has tensor of shape (2,)"]),
        (
            "bias",
            torch.zeros(1, 2, 12, 12, dtype=F64),
            ["bias: rank 2 has tensor of shape (1, 2, 12, 12)"],
        ),
        ("bias", torch.zeros(5, 5, dtype=F64), ["bias: rank 2 has tensor of shape (5, 5)"]),
        (
            "mask",
            fl.DenseMask(torch.ones(12, 12, dtype=torch.bool).tril()),
            ["rank 2 has DenseMask("],
        ),
        ("block_k", 3, ["block_k: rank 2 has 3, ranks 0, 1 have 4"]),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_a_rank_with_other_options_is_named_on_every_rank(
    field: str, other: Any, words: list[str]
) -> None:
    """O was off by 0.84 with no error when one rank had another mask or scale."""
    errors = _disagreeing_ring(3, lambda r: {**SHARED, field: other} if r == 2 else SHARED)
    _expect(errors, {}, ["the ranks were given different options", *words])
    assert len({str(e) for e in errors}) == 1, "every rank raises the same message"


def test_options_checked_against_the_global_shapes_fail_on_every_rank() -> None:
    """The same bias of the wrong global shape on every rank: each rank's own check fails
    after the agreement, and all of them raise."""
    bias = torch.zeros(1, 2, 12, 11, dtype=F64)
    errors = _disagreeing_ring(3, lambda r: {"bias": bias})
    _expect(
        errors, {r: "is not broadcastable to (B, H, Lq, Lk) = (1, 2, 12, 12)" for r in range(3)}, []
    )


def test_a_bad_gradient_on_one_rank_stops_every_rank_in_the_backward() -> None:
    def grad(r: int, do: torch.Tensor) -> torch.Tensor:
        return do.clone().fill_(math.nan) if r == 0 else do

    errors = _disagreeing_ring(3, lambda r: {"mask": fl.Causal()}, backward=grad)
    _expect(
        errors,
        {0: "do (the gradient of o) contains NaN"},
        ["rank(s) [0] rejected their gradients in the backward", "contains NaN"],
    )


def test_a_half_gradient_past_its_range_stops_every_rank() -> None:
    """float16 shards whose gradients fit float32's sums but not float16's range: the rank
    whose converted gradient is infinite names it, and every rank raises with it (none is
    left waiting, none returns infinities)."""

    def half(r: int, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        q, k, v = (x.detach() for x in xs)
        return [x.half().requires_grad_() for x in (q, k, 300 * v)]

    def grad(r: int, do: torch.Tensor) -> torch.Tensor:
        return (3000 * do if r == 1 else do).half()

    errors = _disagreeing_ring(3, lambda r: {}, backward=grad, shards=half)
    for r, e in enumerate(errors):
        assert isinstance(e, ValueError), f"rank {r}: {type(e).__name__}: {e}"
        assert "overflows float16 (largest finite value 65504)" in str(e), f"rank {r}: {e}"
    assert re.search(r"the gradient d[qkv]\[", str(errors[1])), errors[1]


def test_equal_options_given_differently_agree() -> None:
    """The digest compares values, not spellings: 0 and 0.0, a preset and its name."""
    errors = _disagreeing_ring(
        3,
        lambda r: (
            {"dropout_p": 0, "conventions": "seed", "seed": 0}
            if r == 0
            else {"dropout_p": 0.0, "conventions": fl.SEED}
        ),
    )
    assert errors == [None, None, None], errors


# ---------------------------------------------------------------------------------------
# CLI hooks
# ---------------------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    return p.parse_args(list(argv))


def test_cli_prints_ledger_and_oracle_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run_cli(_args("--world", "3", "--layout", "zigzag", "--seq", "24", "--d", "8", "--causal"))
        == 0
    )
    out = capsys.readouterr().out
    assert "ring attention: 3 rank(s), zigzag layout" in out
    assert "backward  dK/dV    9" in out
    assert "communication equals the closed form: yes" in out and "result: ok" in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "--world",
        "2",
        "--seq",
        "20",
        "--seq-k",
        "12",
        "--d",
        "4",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--causal",
        "--align",
        "bottom_right",
        "--window",
        "3,0",
        "--conventions",
        "flash_attn_2",
        "--json",
    )
    assert run_cli(_args(*argv)) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is True and d["check"]["comm_matches_closed_form"] is True
    assert max(d["check"]["max_abs_diff"].values()) <= 1e-10
    assert d["ledger"]["setup"]["lq"] == 20 and d["ledger"]["setup"]["lk"] == 12


def test_cli_window_side_may_be_negative(capsys: pytest.CaptureFixture[str]) -> None:
    """``--window -1,0`` (unbounded left) reaches the parser as a value, not an option."""
    from flashledger.cli import main

    argv = ["ring", "--world", "2", "--seq", "12", "--d", "4", "--json"]
    assert main([*argv, "--window", "-1,0"]) == 0
    window = json.loads(capsys.readouterr().out)
    assert main([*argv, "--causal"]) == 0
    causal = json.loads(capsys.readouterr().out)
    assert window["ok"] is True
    assert window["ledger"] == causal["ledger"], "keys 0..i is the causal mask: same work and hops"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--world", "0"), "--world must be an integer in 1..2147483647"),
        (("--world", "4", "--seq", "7"), "--seq must be >= 8"),
        (("--heads", "3", "--kv-heads", "2"), r"--kv-heads \(2\) must divide --heads \(3\)"),
        (("--window", "a,b"), "--window must be two integers"),
        (("--dropout", "1.5"), r"--dropout must be a number in \[0, 1\)"),
        (("--block-q", "0"), "--block-q must be an integer in 1..2147483647"),
    ],
)
def test_cli_bad_options_raise_value_error(argv: tuple[str, ...], message: str) -> None:
    """``run_cli`` checks a namespace built without the parser too (the parser refuses a
    size below 1 itself, naming the option)."""
    with pytest.raises(ValueError, match=message):
        run_cli(_namespace(*argv))


def _namespace(*argv: str) -> argparse.Namespace:
    """The parser's namespace for the options, sizes taken as given (not checked by it)."""
    args = _args()
    for name, value in zip(argv[::2], argv[1::2]):
        key = name.removeprefix("--").replace("-", "_")
        setattr(args, key, int(value) if value.lstrip("-").isdigit() else value)
    return args


# ---------------------------------------------------------------------------------------
# per-step states: RingLedger(record_states=True) keeps each rank's running state
# ---------------------------------------------------------------------------------------
STATE_CASES: dict[str, tuple[int, int, int, int, int, int, int, int, Layout, fl.Mask]] = {
    # (B, Hq, Hkv, Lq, Lk, d, d_v, W, layout, mask)
    "causal-zigzag-gqa-uneven": (1, 2, 1, 17, 17, 4, 3, 3, "zigzag", fl.Causal()),
    "window-contiguous": (2, 1, 1, 13, 13, 4, 4, 4, "contiguous", fl.SlidingWindow(3, 1)),
    # Lq > Lk, bottom-right: rows 0..7 never see a key (LSE -inf, O 0 at every step)
    "cross-masked-rows": (1, 1, 1, 22, 14, 4, 5, 3, "zigzag", fl.Causal("bottom_right")),
    "one-rank": (1, 2, 2, 9, 9, 3, 3, 1, "contiguous", fl.Causal()),
}


@dataclass(frozen=True)
class _StateRun:
    """One ``simulate_ring(..., record_states=True)`` call and its inputs."""

    res: RingResult
    q: torch.Tensor  # (B, Hq, Lq, d)
    k: torch.Tensor  # (B, Hkv, Lk, d)
    v: torch.Tensor  # (B, Hkv, Lk, d_v)
    do: torch.Tensor  # (B, Hq, Lq, d_v)
    mask: fl.Mask
    w: int
    layout: Layout

    @property
    def setup(self) -> RingSetup:
        assert self.res.ledger.setup is not None
        return self.res.ledger.setup

    def shard(self, x: torch.Tensor, rank: int, *, dim: int = -2) -> torch.Tensor:
        return shard_sequence(x, rank, self.w, self.layout, dim=dim)


def _state_run(case: str, *, backward: bool) -> _StateRun:
    b, hq, hkv, lq, lk, d, dv, w, layout, mask = STATE_CASES[case]
    q, k, v, do, _ = make(b, hq, hkv, lq, lk, d, seed=lq + w, dv=dv)
    res = simulate_ring(
        q,
        k,
        v,
        world_size=w,
        layout=layout,
        do=do if backward else None,
        mask=mask,
        block_q=3,
        block_k=3,
        record_states=True,
    )
    return _StateRun(res, q, k, v, do, mask, w, layout)


def _positions(bounds: tuple[int, ...], chunks: list[int]) -> list[int]:
    """Global positions of ``chunks`` (in the order given)."""
    return [i for c in chunks for i in range(bounds[c], bounds[c + 1])]


def _seen(s: RingSetup, rank: int, step: int) -> list[int]:
    """Key positions of the K/V shards ``rank`` held in ring steps ``0..step``."""
    w = s.world_size
    return _positions(s.k_bounds, [c for t in range(step + 1) for c in s.chunks_of((rank - t) % w)])


def _dense_parts(x: _StateRun) -> dict[str, torch.Tensor]:
    """Scores, probabilities (from the raw LSE over every key) and dS of the dense problem,
    K and V repeated over the query heads of their group: ``(B, Hq, Lq, Lk | d | d_v)``."""
    ref = fl.reference_forward(x.q, x.k, x.v, mask=x.mask)
    s = ref.s  # (B, Hq, Lq, Lk), masked = -inf
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Lq), -inf on rows that see no key
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    group = x.q.shape[1] // x.k.shape[1]
    ke, ve = x.k.repeat_interleave(group, dim=1), x.v.repeat_interleave(group, dim=1)
    o = p @ ve  # (B, Hq, Lq, d_v)
    dd = (x.do * o).sum(-1)  # D: (B, Hq, Lq)
    ds = p * (x.do @ ve.transpose(-1, -2) - dd[..., None])  # (B, Hq, Lq, Lk)
    scale = torch.tensor(x.q.shape[-1] ** -0.5, dtype=F64)
    return {"s": s, "p": p, "ds": ds, "k": ke, "v": ve, "scale": scale}


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_forward_states_are_the_dense_partials_over_the_shards_received(case: str) -> None:
    x = _state_run(case, backward=False)
    led, w, s = x.res.ledger, x.w, x.setup
    assert led.record_states and len(led.states) == w * w, "one state per rank and step"
    dense = _dense_parts(x)
    for step in range(w):
        for r in range(w):
            st = led.state("forward", step, r)
            assert st.shard == (r - step) % w, f"rank {r} step {step} held shard {st.shard}"
            assert st.dq is None and st.dk is None and st.o is not None and st.lse is not None
            assert st.o.dtype == F64 and st.o.device.type == "cpu"
            rows, keys = _positions(s.q_bounds, list(s.chunks_of(r))), _seen(s, r, step)
            scores = dense["s"][..., rows, :][..., keys]  # (B, Hq, rows_r, keys seen)
            lse = torch.logsumexp(scores, dim=-1)  # (B, Hq, rows_r)
            p = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(scores - lse[..., None]))
            tag = f"{case} rank {r} after step {step}"
            assert_close(st.lse, lse, 1e-12, f"{tag}: lse")
            assert_close(st.o, p @ dense["v"][..., keys, :], 1e-12, f"{tag}: o")
    for r in range(w):  # the last state is the rank's result, bit for bit
        st = led.state("forward", w - 1, r)
        assert st.o is not None and st.lse is not None
        assert torch.equal(st.o, x.shard(x.res.o, r)), f"rank {r}: last o is not the result"
        assert torch.equal(st.lse, x.shard(x.res.lse, r, dim=-1)), f"rank {r}: last lse"


@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_backward_states_are_the_dense_partial_gradients(case: str) -> None:
    x = _state_run(case, backward=True)
    led, w, s, res = x.res.ledger, x.w, x.setup, x.res
    assert res.dq is not None and res.dk is not None and res.dv is not None
    assert len(led.states) == 2 * w * w and led.passes == ["forward", "backward"]
    dense = _dense_parts(x)
    b, hq = x.q.shape[0], x.q.shape[1]

    def by_kv_head(t: torch.Tensor) -> torch.Tensor:  # (B, Hq, ...) -> summed over each group
        return t.reshape(b, s.heads_kv, hq // s.heads_kv, *t.shape[2:]).sum(2)

    for step in range(w):
        for r in range(w):
            st = led.state("backward", step, r)
            src = (r - step) % w
            assert st.shard == src and st.o is None and st.dq is not None
            assert st.dk is not None and st.dv is not None and st.dq.device.type == "cpu"
            tag = f"{case} rank {r} after step {step}"
            rows, keys = _positions(s.q_bounds, list(s.chunks_of(r))), _seen(s, r, step)
            ds = dense["ds"][..., rows, :][..., keys]  # (B, Hq, rows_r, keys seen)
            assert_close(st.dq, dense["scale"] * ds @ dense["k"][..., keys, :], 1e-12, f"{tag}: dq")
            # the accumulators of shard src hold ranks src, src + 1, ..., r: step + 1 ranks
            visited = [c for t in range(step + 1) for c in s.chunks_of((src + t) % w)]
            qrows = _positions(s.q_bounds, visited)
            skeys = _positions(s.k_bounds, list(s.chunks_of(src)))
            ds_in = dense["ds"][..., qrows, :][..., skeys]  # (B, Hq, rows visited, keys of src)
            p_in = dense["p"][..., qrows, :][..., skeys]
            dk = by_kv_head(dense["scale"] * ds_in.transpose(-1, -2) @ x.q[..., qrows, :])
            dv = by_kv_head(p_in.transpose(-1, -2) @ x.do[..., qrows, :])
            assert_close(st.dk, dk, 1e-12, f"{tag}: dK of shard {src}")
            assert_close(st.dv, dv, 1e-12, f"{tag}: dV of shard {src}")
    for r in range(w):  # the last states: dQ is the result; the accumulators are the owner's
        st = led.state("backward", w - 1, r)
        owner = (r + 1) % w
        assert st.shard == owner and st.dq is not None and st.dk is not None and st.dv is not None
        assert torch.equal(st.dq, x.shard(res.dq, r)), f"rank {r}: last dq is not the result"
        for name, got, full in (("dk", st.dk, res.dk), ("dv", st.dv, res.dv)):
            want = x.shard(full, owner)
            assert torch.equal(got, want), f"rank {r} passes on {name} != rank {owner}'s result"


def _op_on_threads(w: int, layout: Layout, record_states: bool) -> list[RingLedger]:
    """Each rank's ledger from the autograd op (``ring_attention``'s path), in-memory wires."""
    q, k, v, do, _ = make(1, 2, 1, 14, 14, 4, seed=12)
    hub = LocalHub(w, timeout=30.0)
    opts = _Options.build(
        "ring_attention", {"mask": fl.Causal(), "conventions": fl.SEED}, block_q=3, block_k=3
    )
    ledgers = [RingLedger(record_states=record_states) for _ in range(w)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            xs = [shard_sequence(x, r, w, layout).requires_grad_() for x in (q, k, v)]
            run = _RankRun(LocalTransport(hub, r), layout, opts, ledgers[r])
            o, _lse = _RingFunction.apply(*xs, run)
            o.backward(shard_sequence(do, r, w, layout))
        except BaseException as e:
            errors.append(e)
            hub.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return ledgers


def test_op_records_the_same_states_as_the_twin() -> None:
    w = 3
    layout: Layout = "zigzag"
    q, k, v, do, _ = make(1, 2, 1, 14, 14, 4, seed=12)
    twin = simulate_ring(
        q,
        k,
        v,
        world_size=w,
        layout=layout,
        do=do,
        mask=fl.Causal(),
        block_q=3,
        block_k=3,
        record_states=True,
    ).ledger
    ledgers = _op_on_threads(w, layout, record_states=True)
    assert [len(x.states) for x in ledgers] == [2 * w] * w, "one state per pass and step"
    assert all(x.rank == r for r, led in enumerate(ledgers) for x in led.states)
    combined = RingLedger.combine(ledgers)
    assert combined == twin, "the op's states (or hops, pairs) differ from the twin's"
    assert combined.states[0] == twin.states[0] and combined.states[0] != twin.states[1]
    plain = RingLedger.combine(_op_on_threads(w, layout, record_states=False))
    assert plain.states == [] and not plain.record_states, "states are off by default"
    assert (plain.hops, plain.pairs) == (twin.hops, twin.pairs), "recording changes nothing else"
    with pytest.raises(ValueError, match="some ledgers record per-step states"):
        RingLedger.combine([ledgers[0], plain])


def test_states_off_by_default_and_rendered_when_on() -> None:
    q, k, v, do, _ = make(1, 1, 1, 12, 12, 4)

    def run(record: bool) -> RingLedger:
        return simulate_ring(
            q,
            k,
            v,
            world_size=2,
            layout="zigzag",
            do=do,
            block_q=3,
            block_k=3,
            record_states=record,
        ).ledger

    off, on = run(False), run(True)
    assert off.states == [] and "states" not in off.to_dict()
    assert "per-step states" not in str(off)
    with pytest.raises(ValueError, match=r"records no per-step states; pass RingLedger\("):
        off.state("forward", 0, 0)
    with pytest.raises(ValueError, match=r"to_dict\(states=True\): this RingLedger records no"):
        off.to_dict(states=True)
    assert "per-step states recorded (rank x step): 8 (forward 4, backward 4)" in str(on)
    assert "per-step states recorded" in on._repr_html_()
    d = json.loads(json.dumps(jsonable(on.to_dict(states=True))))
    assert [(x["pass_name"], x["step"], x["rank"], x["shard"]) for x in d["states"][:4]] == [
        ("forward", 0, 0, 0),
        ("forward", 0, 1, 1),
        ("forward", 1, 0, 1),
        ("forward", 1, 1, 0),
    ]
    first = d["states"][0]
    assert set(first) == {"pass_name", "step", "rank", "shard", "o", "lse"}
    assert on.states[0].lse is not None and first["lse"] == on.states[0].lse.tolist()
    assert set(d["states"][-1]) == {"pass_name", "step", "rank", "shard", "dq", "dk", "dv"}
    assert {k: v for k, v in on.to_dict().items()} == off.to_dict(), "the rest is unchanged"
    with pytest.raises(ValueError, match="no state recorded for pass 'backward', step 2"):
        on.state("backward", 2, 0)
    fwd = simulate_ring(q, k, v, world_size=2, record_states=True, block_q=3, block_k=3).ledger
    with pytest.raises(ValueError, match="a forward-only call has no backward"):
        fwd.state("backward", 0, 0)
    with pytest.raises(ValueError, match="record_states must be True or False, got 'yes'"):
        simulate_ring(q, k, v, world_size=2, record_states="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="record_states must be True or False, got 1"):
        RingLedger(record_states=1)  # type: ignore[arg-type]


def test_states_keep_the_accumulation_dtype() -> None:
    q, k, v, do, _ = make(1, 1, 1, 10, 10, 4, seed=4)
    h = torch.float16
    res = simulate_ring(
        q.to(h),
        k.to(h),
        v.to(h),
        world_size=2,
        do=do.to(h),
        block_q=4,
        block_k=4,
        record_states=True,
    )
    for st in res.ledger.states:
        for name, t in st.tensors().items():
            assert t.dtype == torch.float32, f"{st.pass_name} step {st.step} {name}: {t.dtype}"
    last = res.ledger.state("forward", 1, 0)
    assert last.o is not None and torch.equal(
        last.o.to(h), shard_sequence(res.o, 0, 2, "contiguous")
    )


@pytest.mark.parametrize(
    ("timeout", "said"),
    [
        (8.0, "did not arrive within 8 s (timeout=8)"),
        (None, "did not arrive within the process group's timeout (timeout=None)"),
    ],
)
def test_a_wait_that_times_out_says_which_timeout(timeout: float | None, said: str) -> None:
    """With ``timeout=None`` the process group's own timeout ends the wait: the error is
    the TimeoutError that names what did not arrive, not a formatting error of None."""
    from flashledger._ring_transport import _wait

    class _Late:
        def wait(self, timeout: object = None) -> None:
            raise RuntimeError("[gloo] Timed out waiting 6000ms for recv operation to complete")

    with pytest.raises(TimeoutError, match=re.escape(said)) as exc:
        _wait(_Late(), timeout, "the K/V shard of step 2")
    assert "ring attention: the K/V shard of step 2" in str(exc.value)
