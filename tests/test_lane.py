"""The planned lane (``_lane``): an unobserved call (a decode step, a short prefill),
planned once per shape, gives the general path's results bit for bit, takes only the
calls it may, and hands back every result it cannot vouch for.

The general path runs the same call when a ledger sink is attached (a sink observes
the call, so the lane leaves it alone): the two are compared with ``torch.equal``, the
same native pass on the same operands, on any CPU and matmul back end.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashledger as fl
from flashledger import _lane, _native
from flashledger.autograd import _FlashAttention
from flashledger.conventions import SEED

f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """One entry per call of ``_lane``'s function ``name`` from now on."""
    calls: list[int] = []
    real = getattr(_lane, name)

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(_lane, name, counted)
    return calls


@pytest.fixture
def lane_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call the lane ran (its pass), whatever came of it."""
    return _counted(monkeypatch, "_run")


def _opts(**kw: Any) -> dict[str, Any]:
    """The op's options as ``flash_attention`` passes them."""
    base: dict[str, Any] = dict(conventions=SEED, block_q=None, block_k=None, loop_order="fa2")
    return {**base, **kw}


def _both(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict[str, Any]
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(lane's (o, lse), the general path's)`` of one call, under no_grad."""
    with torch.no_grad():
        lane = _FlashAttention.apply(q, k, v, None, opts)
        general = _FlashAttention.apply(q, k, v, None, opts, lambda ledger: None)
    return lane, general


def _inputs(
    gen: torch.Generator, b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dv: int, dt: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=f64).to(dt)
    k = torch.randn(b, hkv, lk, d, generator=gen, dtype=f64).to(dt)
    v = torch.randn(b, hkv, lk, dv, generator=gen, dtype=f64).to(dt)
    return q, k, v


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    b=st.sampled_from([1, 2]),
    heads=st.sampled_from([(1, 1), (4, 2), (8, 2), (6, 6)]),
    lq=st.sampled_from([1, 2, 3, 8, 40, 97, 300]),
    lk=st.sampled_from([1, 7, 97, 113, 600, 2100]),
    dims=st.sampled_from([(8, 8), (64, 64), (12, 20)]),
    dt=st.sampled_from([f32, f64, bf16, f16]),
    block_q=st.sampled_from([None, 64]),
    block_k=st.sampled_from([None, 32, 128]),
    layout=st.sampled_from(["4d", "3d", "transposed"]),
    mask=st.sampled_from(
        [None, "causal", fl.Causal("top_left"), fl.SlidingWindow(16, 0, "bottom_right")]
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_lane_gives_the_general_paths_bits(
    native, lane_runs, b, heads, lq, lk, dims, dt, block_q, block_k, layout, mask, seed
):
    """Any shape it takes (GQA, ragged last query and key tiles, one key, Lq != Lk, 3-D
    inputs, a transposed q as transformers passes it, every dtype with a half cache read
    in place, causal and window masks with partial tiles): o and lse equal the general
    path's exactly, in its dtypes and shapes. A call where a row sees no key (bottom-right
    masks with Lq > Lk), or of half inputs with more rows than a pass reads the cache in
    place for, is the general path's."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    d, dv = dims
    q, k, v = _inputs(gen, b, hq, hkv, lq, lk, d, dv, dt)
    if layout == "3d":
        b, hkv = 1, hq
        q, k, v = q[0], _inputs(gen, 1, hq, hq, lq, lk, d, dv, dt)[1][0], None
        v = torch.randn(hq, lk, dv, generator=gen, dtype=f64).to(dt)
    elif layout == "transposed":  # (B, Lq, H, d) projections seen as (B, H, Lq, d)
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    before = len(lane_runs)
    mask = fl.Causal("bottom_right") if mask == "causal" else mask
    opts = _opts(block_q=block_q, block_k=block_k, mask=mask)
    (o, lse), (o_ref, lse_ref) = _both(q, k, v, opts)
    row_without_keys = mask is not None and mask.align == "bottom_right" and lq > lk
    taken = not row_without_keys and (dt in (f32, f64) or hq // hkv * lq <= 64)
    assert len(lane_runs) - before == int(taken)
    assert o.dtype == o_ref.dtype == dt and o.shape == o_ref.shape == (*q.shape[:-1], dv)
    assert lse.dtype == lse_ref.dtype and lse.shape == lse_ref.shape == q.shape[:-1]
    assert torch.equal(o, o_ref), float((o.double() - o_ref.double()).abs().max())
    assert torch.equal(lse, lse_ref), float((lse.double() - lse_ref.double()).abs().max())


def test_a_decode_step_of_a_causal_cache_takes_the_lane(native, lane_runs, gen):
    """One row and a few rows against the cache with ``Causal("bottom_right")``, the mask
    a model's decode step gives: planned once, run on the lane, the general path's bits."""
    for lq in (1, 4):
        q, k, v = _inputs(gen, 1, 32, 8, lq, 1000, 64, 64, f32)
        for _ in range(2):
            (o, lse), (o_ref, lse_ref) = _both(q, k, v, _opts(mask=fl.Causal("bottom_right")))
            assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert len(lane_runs) == 4


@pytest.mark.parametrize("dt", [f32, bf16])
def test_a_key_split_a_row_cannot_see_merges_in_the_pass(native, lane_runs, gen, dt):
    """Key splits are merged and checked in the pass's own call: with 64-key tiles over
    193 keys and a window of 16, two tiles run, one a part; the first of two rows (its
    window ending one key before the last) sees nothing of the second part (its LSE there
    -inf), and the merged result is finite, taken, and the general path's bits."""
    q, k, v = _inputs(gen, 1, 8, 2, 2, 193, 64, 64, dt)
    opts = _opts(mask=fl.SlidingWindow(16, 0, "bottom_right"), block_k=64)
    _, (o_ref, lse_ref) = _both(q, k, v, opts)
    with torch.no_grad():
        got = _lane.forward(q, k, v, opts)  # None: handed back as not finite
    assert got is not None and len(lane_runs) == 2
    plan = next(reversed(_lane._PLANS._frames.values()))
    assert isinstance(plan, _lane._Plan) and plan.run.o_shape[0] == 2, plan
    o, lse = got
    assert bool(torch.isfinite(lse).all())
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


@pytest.mark.parametrize("dt", [f32, f64])
def test_a_prefill_takes_the_lane_with_k_laid_out(native, lane_runs, gen, dt):
    """A causal prefill (GQA, a ragged last query and key tile, q transposed as transformers
    passes it) and the longest call the lane plans: a pass that lays Kᵀ out, planned once,
    run on each call's own values, the general path's bits."""
    for lq, mask, block_q in ((700, fl.Causal("bottom_right"), 256), (_lane.LANE_ROWS, None, None)):
        before, kept = len(lane_runs), []
        for scale in (1.0, -2.0):
            q, k, v = _inputs(gen, 2, 8, 2, lq, lq, 32, 16, dt)
            q = q.transpose(1, 2).contiguous().transpose(1, 2) * scale
            (o, lse), (o_ref, lse_ref) = _both(q, k, v, _opts(mask=mask, block_q=block_q))
            assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), (lq, scale)
            kept.append(next(reversed(_lane._PLANS._frames.values())))  # the one just run
        assert len(lane_runs) - before == 2
        assert kept[1] is kept[0], "the second call planned again"
        assert isinstance(kept[0], _lane._Plan)
        assert not kept[0].run.in_place, "the plan reads Kᵀ laid out, not K in place"


@pytest.mark.parametrize("conventions", [SEED, fl.FLASH_ATTN_2])
def test_a_training_steps_forward_takes_the_lane_and_its_gradients_stand(
    native, lane_runs, gen, conventions
):
    """With a gradient to flow, the forward nobody observes runs on the lane (the backward
    on the general path, the mask bound again): O, LSE and dq, dk, dv, through the LSE too
    where the conventions differentiate it, equal those of the same step whose forward a
    ledger sink observes, bit for bit; a forward that overflows is still explained."""
    q0, k0, v0 = _inputs(gen, 2, 8, 2, 300, 340, 32, 16, f32)
    do, dlse = torch.randn(2, 8, 300, 16, generator=gen), torch.randn(2, 8, 300, generator=gen)
    opts = _opts(mask=fl.Causal("bottom_right"), block_q=128, conventions=conventions)
    got = []
    for sink in (None, lambda ledger: None):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        before = len(lane_runs)
        o, lse = _FlashAttention.apply(q, k, v, None, opts, sink)
        assert len(lane_runs) - before == int(sink is None)
        torch.autograd.backward((o, lse), (do, dlse))
        got.append((o.detach(), lse.detach(), q.grad, k.grad, v.grad))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *got, strict=True):
        assert torch.equal(a, b), (name, float((a - b).abs().max()))
    q, k, v = (x.clone().requires_grad_() for x in (q0 * 1e20, k0 * 1e20, v0))
    with pytest.raises(ValueError, match=r"o\[\d, \d, \d+, :\]"):
        fl.flash_attention(q, k, v, mask=fl.Causal("bottom_right"))


def test_repeated_calls_reuse_one_plan_and_read_their_own_tensors(native, lane_runs, gen):
    """A second call of the same shapes runs the kept plan on its own values."""
    q, k, v = _inputs(gen, 2, 8, 2, 1, 300, 16, 16, f32)
    opts = _opts(scale=0.3)
    (o1, _), _ = _both(q, k, v, opts)
    plans = len(_lane._PLANS._frames)
    (o2, lse2), (o2_ref, lse2_ref) = _both(q * 2, k.flip(2), v, opts)
    assert len(_lane._PLANS._frames) == plans, "the second call planned nothing"
    assert len(lane_runs) == 2
    assert not torch.equal(o1, o2)
    assert torch.equal(o2, o2_ref) and torch.equal(lse2, lse2_ref)


@pytest.fixture
def frame_keys(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per plan-cache key the lane built (a call not run as a repeat)."""
    return _counted(monkeypatch, "_frame_key")


def test_a_repeat_of_the_last_call_runs_its_plan_without_the_cache_key(
    native, lane_runs, frame_keys, gen
):
    """The next layer's or token's call (same shapes, dtypes and options, each with its
    type; a mask equal in value) runs the last call's plan on its own tensors, without
    building the plan cache's key: the general path's bits. Another shape, an option of
    another value or type, or an option that is not a plain value builds the key."""
    q, k, v = _inputs(gen, 1, 8, 2, 1, 300, 16, 16, f32)
    with torch.no_grad():
        fl.flash_attention(q, k, v, mask=fl.Causal("bottom_right"), scale=0.25)
        assert len(frame_keys) == 1
        for step in range(3):  # a fresh mask object of the same value each call
            q2, k2 = q * (step + 2), k.flip(2)
            o = fl.flash_attention(q2, k2, v, mask=fl.Causal("bottom_right"), scale=0.25)
            general = _opts(mask=fl.Causal("bottom_right"), scale=0.25)
            o_ref, _ = _FlashAttention.apply(q2, k2, v, None, general, lambda ledger: None)
            assert torch.equal(o, o_ref)
        assert len(frame_keys) == 1, "the repeats ran without a key"
        keys = len(frame_keys)
        for other in (
            dict(mask=fl.Causal("bottom_right"), scale=0.5),  # another value
            dict(mask=fl.Causal("top_left"), scale=0.25),  # another mask
            dict(mask=fl.Causal("bottom_right"), scale=1),  # after scale=0.5: a new value
            dict(mask=fl.Causal("bottom_right"), scale=True),  # equal to 1, another type
        ):
            if other["scale"] is True:
                with pytest.raises(ValueError, match="scale must be a finite number"):
                    fl.flash_attention(q, k, v, **other)
            else:
                fl.flash_attention(q, k, v, **other)
        assert len(frame_keys) == keys + 4
        fl.flash_attention(q[..., :8], k[..., :8], v, scale=0.25)  # another shape
        fl.flash_attention(q, k, v, scale=torch.tensor(0.25))  # a tensor option: no signature
        fl.flash_attention(q, k, v, scale=torch.tensor(0.25))
        assert len(frame_keys) == keys + 4 + 3
    assert len(lane_runs) == 1 + 3 + 3 + 1  # (scale=True is refused; a tensor scale is not taken)


def test_repeats_from_several_threads_run_their_own_plans(native, gen):
    """Threads that alternate two call shapes (the last call's plan shared between them):
    each call gets the bits of its own shape's plan."""
    calls = [_inputs(gen, 1, 8, 2, 1, n, 16, 16, f32) for n in (300, 700)]
    with torch.no_grad():
        want = [fl.flash_attention(q, k, v) for q, k, v in calls]
    bad: list[int] = []

    def work(first: int) -> None:
        with torch.no_grad():
            for i in range(60):
                j = (first + i) % 2
                if not torch.equal(fl.flash_attention(*calls[j]), want[j]):
                    bad.append(j)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_the_plan_follows_the_thread_count_and_the_matmul_back_end(native, lane_runs, gen):
    """The work split depends on the threads a pass runs on, the tiles on the back end in
    force: a plan is kept for each, and each gives its general path's bits."""
    q, k, v = _inputs(gen, 1, 8, 2, 1, 1500, 32, 32, f32)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            (o, lse), (o_ref, lse_ref) = _both(q, k, v, _opts())
            assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), n
    finally:
        torch.set_num_threads(threads)
    was = [native.gemm(f32), native.gemm(f32, forward=True), native.gemm(f32, scores=True)]
    try:
        for name in native.gemm_names(f32):
            native.set_gemm(f32, name)
            (o, lse), (o_ref, lse_ref) = _both(q, k, v, _opts())
            assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), name
    finally:
        native.set_gemm(f32, was[0], forward=was[1], scores=was[2])
    assert len(lane_runs) >= 2


@pytest.mark.parametrize(
    "case",
    [
        "mask",
        "softcap",
        "dropout",
        "alibi",
        "sink",
        "many rows",
        "half rows",
        "no key",
        "fa1",
        "native off",
    ],
)
def test_the_lane_leaves_every_other_call_to_the_general_path(native, lane_runs, gen, case):
    """Masks that hold tensors, score changes, dropout, an observer (a ledger sink), more
    query rows than the lane plans, half inputs with too many rows to read the cache in
    place, a row that sees no key (its result is the conventions'), the FA1 order or the
    native step switched off: the general path runs the call (and its result stands,
    finite where a row sees a key)."""
    lq = {"many rows": _lane.LANE_ROWS + 1, "half rows": 40, "no key": 300}.get(case, 1)
    q, k, v = _inputs(gen, 1, 4, 2, lq, 200, 8, 8, bf16 if case == "half rows" else f64)
    opts = _opts()
    sink = None
    if case == "no key":  # rows 0-99 see no key
        opts["mask"] = fl.Causal("bottom_right")
    elif case == "mask":
        opts["mask"] = fl.KeyPadding([150])
    elif case == "softcap":
        opts["softcap"] = 5.0
    elif case == "dropout":
        opts.update(dropout_p=0.1, seed=3)
    elif case == "alibi":
        opts["alibi_slopes"] = fl.alibi_slopes(4, dtype=f64)
    elif case == "sink":
        sink = lambda ledger: None  # noqa: E731
    elif case == "fa1":
        opts["loop_order"] = "fa1"
    if case == "native off":
        with _native.disabled():
            o, _ = _FlashAttention.apply(q, k, v, None, opts, sink)
    else:
        o, _ = _FlashAttention.apply(q, k, v, None, opts, sink)
    assert not lane_runs, case
    assert bool(torch.isfinite(o[..., 100:, :] if case == "no key" else o).all())


@pytest.mark.parametrize("dt", [f32, bf16])
def test_a_result_that_is_not_finite_is_explained_by_the_general_path(native, lane_runs, gen, dt):
    """Scores that overflow float32, or a NaN in the cache: the lane runs, finds the
    result not finite (in bfloat16, as the pass writes it) and hands the call back; the
    error names the row or the input, as without the lane."""
    q, k, v = _inputs(gen, 1, 4, 2, 1, 50, 8, 8, dt)
    with pytest.raises(ValueError, match=r"o\[0, \d, 0, :\]") as lane_err:
        fl.flash_attention(q * 1e20, k * 1e20, v)
    assert lane_runs
    with pytest.raises(ValueError) as general_err:
        _FlashAttention.apply(q * 1e20, k * 1e20, v, None, _opts(), lambda ledger: None)
    assert str(lane_err.value) == str(general_err.value)
    v_nan = v.clone()
    v_nan[0, 1, 7, 3] = float("nan")
    with pytest.raises(ValueError, match="v") as nan_err:
        fl.flash_attention(q, k, v_nan)
    assert "NaN" in str(nan_err.value) or "nan" in str(nan_err.value)


def test_bad_inputs_raise_on_every_call_with_a_plan_kept(native, gen):
    """A plan kept for good shapes never stands in for bad ones: the general path's error,
    every time."""
    q, k, v = _inputs(gen, 1, 4, 2, 1, 50, 8, 8, f32)
    fl.flash_attention(q, k, v)
    for _ in range(2):
        with pytest.raises(ValueError, match="k and v must agree"):
            fl.flash_attention(q, k, v[..., :-1, :])
        with pytest.raises(TypeError, match="share one dtype"):
            fl.flash_attention(q, k.double(), v)


def test_a_forward_pass_runs_only_the_operands_it_was_planned_for(native, gen):
    """``ForwardPass.run`` refuses tensors of other sizes or dtypes, or not contiguous,
    rather than read past them."""
    q, k, v = (x[0] for x in _inputs(gen, 1, 4, 4, 1, 64, 8, 8, f32))
    sched = _native.Schedule()
    sched.add(0, 1, 0, 64, None)
    sched.end_row(0, 1)
    fp = _native.ForwardPass(
        native, q, k, v, sched, group=1, scale=0.5, heads_per_batch=4, intervals=None,
        chunk=1, splits=1, stacked=True, keys_in_place=True,
    )  # fmt: skip
    o, lse = fp.run(q, k, v, merge=True)
    assert o.shape == (4, 1, 8) and lse.shape == (4, 1)
    with pytest.raises(ValueError, match="planned for"):
        fp.run(q, k[:, :32].contiguous(), v)
    with pytest.raises(ValueError, match="planned for"):
        fp.run(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="contiguous"):
        fp.run(q, k.transpose(1, 2).contiguous().transpose(1, 2), v)


@pytest.mark.parametrize("dt", [bf16, f16])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_pass_reading_q_from_its_half_rows_gives_the_bits_of_q_widened_first(
    native, gen, dt, splits
):
    """``ForwardPass.run_rows`` with q left out (its rows in the cache's half dtype, widened
    by the pass; d = 12: no pair instruction) and O rounded by the pass equals ``run`` on
    q widened by PyTorch, O rounded by PyTorch's conversion, with one part and with key
    splits merged; a row overflowing float32 gives None; and the pass refuses a q16 of
    another dtype or size, and a float pass without q."""
    hq, lk, d = 4, 70, 12
    q16 = torch.randn(hq, 1, d, generator=gen, dtype=f64).to(dt)
    k, v = (torch.randn(2, lk, d, generator=gen, dtype=f64).to(dt) for _ in range(2))
    q = q16.float()
    sched = _native.Schedule()
    for s in range(splits):
        sched.add(0, 1, s * lk // splits, (s + 1) * lk // splits, None)
    sched.end_row(0, 1)
    fp = _native.ForwardPass(
        native, q, k, v, sched, group=2, scale=0.3, heads_per_batch=hq, intervals=None,
        chunk=2, splits=splits, stacked=True, keys_in_place=True, keep_scratch=True,
    )  # fmt: skip
    o_ref, lse_ref = fp.run(q, k, v, merge=True, rows=(1, hq, 1))
    for _ in range(2):  # the second run on the pass's own scratch
        got = fp.run_rows(None, k, v, (1, hq, 1), q16=q16)
        assert got is not None
        o, lse = got
        assert o.dtype == dt and o.shape == (1, hq, 1, d) and lse.dtype == f32
        assert torch.equal(o, o_ref.to(dt)) and torch.equal(lse, lse_ref)
    big = (q16.float() * 1e30).to(dt) if dt == bf16 else q16
    k_big = (k.float() * 1e30).to(dt) if dt == bf16 else k.clone().fill_(float("inf"))
    assert fp.run_rows(None, k_big, v, (1, hq, 1), q16=big) is None
    with pytest.raises(ValueError, match="q16 must hold"):
        fp.run_rows(None, k, v, (1, hq, 1), q16=q16.float())
    with pytest.raises(ValueError, match="q16 must hold"):
        fp.run_rows(None, k, v, (1, hq, 1), q16=q16[:2])
    q32, k32, v32 = q, k.float(), v.float()
    fp32 = _native.ForwardPass(
        native, q32, k32, v32, sched, group=2, scale=0.3, heads_per_batch=hq, intervals=None,
        chunk=2, splits=splits, stacked=True, keys_in_place=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="half cache"):
        fp32.run_rows(None, k32, v32, (1, hq, 1), q16=q16)


def test_all_finite_reads_every_value(native):
    """``Kernels.all_finite``: NaN and both infinities found anywhere, vector body or tail."""
    for dt in (f32, f64):
        for n in (1, 15, 16, 17, 1000):
            x = torch.zeros(n, dtype=dt)
            assert native.all_finite(x)
            for bad in (float("nan"), float("inf"), -float("inf")):
                for at in {0, n // 2, n - 1}:
                    y = x.clone()
                    y[at] = bad
                    assert not native.all_finite(y), (dt, n, bad, at)
    with pytest.raises(ValueError, match="contiguous float32 or float64"):
        native.all_finite(torch.zeros(4, dtype=bf16))


@pytest.mark.parametrize(
    ("opts", "error"),
    [
        (dict(scale=True), "scale must be a finite number"),
        (dict(dropout_p=False), "dropout_p must be a number"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=True), "seed must be an integer"),
        (dict(block_k=0), "block_k"),
    ],
)
def test_a_kept_plan_never_stands_in_for_a_bad_option(native, gen, opts, error):
    """The lane keys its plans by every option it reads, with its type: a plan kept for
    ``scale=1``, ``seed=0``, ``dropout_p=0.0`` does not let ``True``, ``-1`` or ``False``
    through, nor a block size the loop refuses (given to the op directly, as the
    transformers integration does)."""
    q, k, v = _inputs(gen, 1, 4, 2, 1, 50, 8, 8, f32)
    good = _opts(scale=1, seed=0, dropout_p=0.0, block_k=32)
    with torch.no_grad():
        _FlashAttention.apply(q, k, v, None, good)
        for _ in range(2):
            with pytest.raises(ValueError, match=error):
                _FlashAttention.apply(q, k, v, None, {**good, **opts})


def test_a_cache_slice_that_is_not_contiguous_gives_the_same_bits(native, lane_runs, gen):
    """K/V as a view of a larger cache (the first Lk slots of a static cache, strided
    along the keys): laid out once, the general path's bits."""
    q, k, v = _inputs(gen, 2, 8, 2, 1, 300, 32, 32, f32)
    k_view, v_view = k[:, :, :200], v[:, :, :200]
    assert not k_view.is_contiguous()
    (o, lse), (o_ref, lse_ref) = _both(q, k_view, v_view, _opts(mask=fl.Causal("bottom_right")))
    assert len(lane_runs) == 1
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    (o2, _), _ = _both(q, k_view.contiguous(), v_view.contiguous(), _opts())
    assert torch.equal(o, o2)
