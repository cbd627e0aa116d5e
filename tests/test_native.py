"""The native tile step (``flashledger._native``): availability, switches and its arithmetic.

Against the float64 oracle (1e-12, the ``conftest.assert_close`` rule) and the
PyTorch step, at tiles large enough that partial tiles run in several 64-row
blocks with trimmed key spans and that few heads split their rows across
threads; extreme scores underflow as in the PyTorch step.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import subprocess
import sys
import threading
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashledger as fl
from flashledger import _calibrate, _native

TOL = 1e-12
f64 = torch.float64


def _both(q, k, v, do, **opts):
    fwd = fl.blocked_forward(q, k, v, **opts)
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
    return fwd, bwd


def test_native_step_is_built_where_ci_runs():
    """CI installs a C compiler, so the native step must be on there (not silently off)."""
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        pytest.skip("only required in CI")
    assert _native.kernels() is not None, _native.native_status()
    assert _native.native_status().startswith("native tile step: on ("), _native.native_status()


def test_switches_turn_the_native_step_off(native_calls, monkeypatch, gen):
    q, k, v, do = (torch.randn(1, 2, 70, 8, dtype=f64, generator=gen) for _ in range(4))
    calls = native_calls
    _both(q, k, v, do, block_q=32, block_k=32)
    assert calls == {"forward": 1, "backward": 1}
    with _native.disabled():
        assert _native.kernels() is None
        _both(q, k, v, do, block_q=32, block_k=32)
    _both(q, k, v, do, block_q=32, block_k=32, trace=True)  # traced: the PyTorch step
    _both(q, k, v, do, block_q=32, block_k=32, dropout_p=0.1)  # dropout: the PyTorch step

    def doubled(s, b, h, q_idx, kv_idx):  # a score_mod that does not add a term
        return 2 * s

    _both(q, k, v, do, block_q=32, block_k=32, score_mod=doubled)  # the PyTorch step
    assert calls == {"forward": 1, "backward": 1}
    _both(q, k, v, do, block_q=32, block_k=32, softcap=3.0)  # a softcap: native
    assert calls == {"forward": 2, "backward": 2}
    monkeypatch.setenv("FLASHLEDGER_NATIVE", "0")
    assert _native.kernels() is None
    assert _native.native_status() == "native tile step: off (FLASHLEDGER_NATIVE=0)"
    _both(q, k, v, do, block_q=32, block_k=32)
    assert calls == {"forward": 2, "backward": 2}


def test_a_failed_build_falls_back_to_the_pytorch_step(monkeypatch, tmp_path, gen, assert_close):
    monkeypatch.setattr(_native, "_loaded", None)  # forget this process's build
    monkeypatch.delenv("FLASHLEDGER_NATIVE", raising=False)  # make test-backends sets it to 0
    monkeypatch.setenv("FLASHLEDGER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that always fails
    assert _native.kernels() is None
    status = _native.native_status()
    assert status.startswith("native tile step: off (could not build it: false failed"), status
    assert status.endswith("the PyTorch step runs instead"), status
    q, k, v, do = (torch.randn(1, 2, 50, 8, dtype=f64, generator=gen) for _ in range(4))
    fwd, _ = _both(q, k, v, do, mask=fl.Causal())
    assert_close(fwd.o, fl.reference_forward(q, k, v, mask=fl.Causal()).o, rtol=TOL, name="O")


def test_a_cached_build_is_reused(native, monkeypatch):
    """The library is cached under a key of source, flags, compiler, CPU and PyTorch."""
    status = _native.native_status()
    path = status[status.rindex("; ") + 2 : -1]
    assert path.endswith(".so") and os.path.exists(path), status


def test_a_damaged_cached_library_is_rebuilt(native, tmp_path):
    """A cached library that is not byte for byte the one built (here: truncated) is
    rebuilt on the next load, not loaded, and the native step stays on."""
    env = {**os.environ, "FLASHLEDGER_CACHE_DIR": str(tmp_path)}
    code = "import flashledger as fl; print(fl.native_status())"

    def status() -> str:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        return done.stdout.decode().strip()

    assert status().startswith("native tile step: on ("), status
    (lib,) = tmp_path.glob("native-*.so")
    good = lib.read_bytes()
    lib.write_bytes(good[: len(good) // 2])
    assert not _native._intact(lib)
    assert status().startswith("native tile step: on ("), "a truncated library was loaded"
    assert _native._intact(lib) and lib.stat().st_size == len(good)


LENGTHS = st.sampled_from([1, 2, 63, 64, 65, 97, 113, 200, 300])


@st.composite
def problems(draw: Any) -> dict[str, Any]:
    b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    lq, lk = draw(LENGTHS), draw(LENGTHS)
    d, dv = draw(st.sampled_from([1, 8, 24, 64])), draw(st.sampled_from([1, 16, 24]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kinds = ["none", "causal", "causal-br", "window", "padding", "dense", "mask_mod"]

    def one(kind: str) -> Any:
        if kind == "causal":
            return fl.Causal()
        if kind == "causal-br":
            return fl.Causal("bottom_right")
        if kind == "window":
            return fl.SlidingWindow(draw(st.integers(0, 80)), draw(st.integers(-1, 10)))
        if kind == "padding":
            return fl.KeyPadding(draw(st.lists(st.integers(0, lk), min_size=b, max_size=b)))
        if kind == "dense":
            t = torch.rand(b, hkv * g, lq, lk, generator=gen) < 0.6
            t[..., : max(1, lq // 3), :] = False  # whole 64-row blocks with nothing visible
            return t
        if kind == "mask_mod":  # periodic stripes by head: no span bound follows them
            return fl.MaskMod(lambda b_, h, q, kv: (q * 7 + kv * 13 + h) % 3 != 0)
        return None

    kind = draw(st.sampled_from(kinds))
    mask = one(kind)
    if mask is not None and draw(st.integers(0, 2)) == 0:  # composed with a second mask
        kind2 = draw(st.sampled_from(kinds[1:]))
        other = one(kind2)
        if isinstance(mask, torch.Tensor) and isinstance(other, torch.Tensor):
            other = fl.DenseMask(other)
        op = draw(st.sampled_from(["&", "|"]))
        mask = (mask & other) if op == "&" else (mask | other)
    tiles = (draw(st.sampled_from([1, 64, 65, 128, 512])), draw(st.sampled_from([3, 64, 100, 512])))
    return dict(
        shape=(b, hkv, g, lq, lk, d, dv),
        mask=mask,
        scale=draw(st.sampled_from([None, 0.3, 1.0])),
        tiles=tiles,
        seed=seed,
    )


@settings(max_examples=60, deadline=None)
@given(problems())
def test_native_step_equals_the_oracle_and_the_pytorch_step(native, outputs_close, p):
    b, hkv, g, lq, lk, d, dv = p["shape"]
    gen = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(b, hkv * g, lq, d, dtype=f64, generator=gen)
    k = torch.randn(b, hkv, lk, d, dtype=f64, generator=gen)
    v = torch.randn(b, hkv, lk, dv, dtype=f64, generator=gen)
    do = torch.randn(b, hkv * g, lq, dv, dtype=f64, generator=gen)
    opts = dict(mask=p["mask"], scale=p["scale"], block_q=p["tiles"][0], block_k=p["tiles"][1])
    ref = fl.reference_forward(q, k, v, mask=p["mask"], scale=p["scale"])
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=p["mask"], scale=p["scale"])
    fwd, bwd = _both(q, k, v, do, **opts)
    with _native.disabled():
        tfwd, tbwd = _both(q, k, v, do, **opts)
    where = f"{p['shape']}, {type(p['mask']).__name__}, tiles {p['tiles']}"
    outputs_close((fwd, bwd), (ref, refb), rtol=TOL, name=f"native vs oracle, {where}")
    outputs_close((fwd, bwd), (tfwd, tbwd), rtol=TOL, name=f"native vs PyTorch step, {where}")
    assert fwd.ledger.counters == tfwd.ledger.counters
    assert bwd.ledger.counters == tbwd.ledger.counters


def test_float32_native_step_is_as_accurate_as_the_pytorch_step(native, gen, assert_close):
    q, k, v, do = (torch.randn(2, 4, 600, 64, dtype=torch.float32, generator=gen) for _ in range(4))
    ref = fl.reference_forward(*(t.double() for t in (q, k, v)), mask=fl.Causal())
    refb = fl.reference_backward(
        *(t.double() for t in (q, k, v)), ref.o, ref.lse, do.double(), mask=fl.Causal()
    )
    fwd, bwd = _both(q, k, v, do, mask=fl.Causal())
    with _native.disabled():
        tfwd, tbwd = _both(q, k, v, do, mask=fl.Causal())
    for name, got, step, want in (
        ("O", fwd.o, tfwd.o, ref.o),
        ("dQ", bwd.dq, tbwd.dq, refb.dq),
        ("dK", bwd.dk, tbwd.dk, refb.dk),
        ("dV", bwd.dv, tbwd.dv, refb.dv),
    ):
        err = float((got.double() - want).abs().max())
        err_step = float((step.double() - want).abs().max())
        assert err <= 2 * err_step + 1e-6, (
            f"{name}: native {err:.3g} vs PyTorch step {err_step:.3g}"
        )
        assert_close(got, want, rtol=2e-5, name=f"float32 native {name}")


@pytest.mark.parametrize(
    ("lq", "d", "tiles"),
    [
        (300, 4, None),  # the tiles this machine's calibration chose
        (300, 4, (128, 128)),  # several key tiles a row: split into parts where threads idle
        (300, 5, None),  # a scale that is not a power of two
        (64, 64, None),  # one query tile of 64 rows: the forward reads K in place
    ],
)
def test_float32_native_gradients_at_large_shared_scores_keep_the_pytorch_step_s_error(
    native, lq, d, tiles
):
    """Scores near 1e3 with q and k clustered around one direction (float32, causal): the
    gradient of q is a sum over a row's keys of dS times keys that share most of their
    value, so it holds only what cancels in Σ_j dS_j = Σ_j P_j (dP_j - D). A rounding
    that is one factor for the whole row (λ's, its base change) cancels; a score that the
    backward forms a unit in the last place of |s| apart from the forward's, key by key,
    does not, and dQ takes |k̄| times it (the backward in natural units against a
    base-2 forward: 24 x the PyTorch step's error; a BLAS rounding the factor scale·log2 e
    into an operand, K read in place by the forward and not by the backward, or a
    forward's key splits merged from their rounded LSEs did the same). Both steps round
    the same sums; the native one's scores carry one rounding more, the same in both
    passes (the base change): each error within 3 x the PyTorch step's on the same
    inputs, plus 8 units in the last place of the gradient's largest entry for the last
    roundings of the sums."""
    gen = torch.Generator().manual_seed(0)
    base = 1e3  # the largest scores, scale · q·k ≈ base
    center = (base / d**0.5) ** 0.5  # scale · d · center² = base

    def clustered() -> torch.Tensor:
        return center * (1 + 0.07 * torch.randn(1, 2, lq, d, generator=gen))

    q, k = clustered(), clustered()
    v, do = (torch.randn(1, 2, lq, d, generator=gen) for _ in range(2))
    mask = fl.Causal()
    qd, kd, vd = (t.double() for t in (q, k, v))
    ref = fl.reference_forward(qd, kd, vd, mask=mask)
    want = fl.reference_backward(qd, kd, vd, ref.o, ref.lse, do.double(), mask=mask)
    assert float(ref.lse.abs().max()) > 0.5 * base  # the scores are as large as meant
    opts: dict[str, Any] = dict(mask=mask)
    if tiles is not None:
        opts.update(block_q=tiles[0], block_k=tiles[1])
    _, bwd = _both(q, k, v, do, **opts)
    with _native.disabled():
        _, step = _both(q, k, v, do, **opts)
    eps = torch.finfo(torch.float32).eps
    for name in ("dq", "dk", "dv"):
        exact = getattr(want, name)
        err = float((getattr(bwd, name).double() - exact).abs().max())
        err_step = float((getattr(step, name).double() - exact).abs().max())
        bound = 3 * err_step + 8 * eps * float(exact.abs().max())
        assert err <= bound, (
            f"{name}: native {err:.3g} from the float64 oracle, the PyTorch step "
            f"{err_step:.3g} (bound {bound:.3g})"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, f64])
def test_many_small_weights_are_summed_not_cut(native_calls, dtype):
    """One key at score 0 and 2000 at -15 (each weight e^-15 = 3e-7 of the first, 6e-4
    together): a step that cut small probabilities (below 2^-20, say) would drop them and
    return O = 0; the weights the step keeps reach 2^-100 (float64 2^-1000) under a row's
    largest. The scores are exact in every dtype (d = 1, q = 1, k = 0 or -15, scale 1)."""
    lk = 2001
    q = torch.ones(1, 2, 3, 1)
    k = torch.full((1, 2, lk, 1), -15.0)
    k[:, :, 0] = 0.0
    v = torch.ones(1, 2, lk, 1)
    v[:, :, 0] = 0.0
    o = fl.flash_attention(*(t.to(dtype) for t in (q, k, v)), scale=1.0)
    assert native_calls["forward"] == 1
    small = (lk - 1) * math.exp(-15.0)
    want = torch.full_like(o, small / (1 + small), dtype=f64)
    rtol = {torch.float32: 1e-5, f64: 1e-13}.get(dtype, 4 * torch.finfo(dtype).eps)
    err = float(((o.double() - want) / want).abs().max())
    assert err <= rtol, f"O ({dtype}): relative error {err:.3g} > {rtol:.3g} of {want[0, 0, 0, 0]}"


def test_extreme_scores_underflow_exactly_as_in_the_pytorch_step(native, gen, assert_close):
    """Scores in the thousands: most weights underflow to exactly 0, none overflows."""
    q, k, v, do = (torch.randn(1, 2, 130, 16, dtype=f64, generator=gen) for _ in range(4))
    q = q * 300.0
    fwd, bwd = _both(q, k, v, do, block_q=64, block_k=64, mask=fl.Causal())
    with _native.disabled():
        tfwd, tbwd = _both(q, k, v, do, block_q=64, block_k=64, mask=fl.Causal())
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    assert bool(torch.isfinite(fwd.o).all()) and bool(torch.isfinite(bwd.dq).all())
    for name, got, step, want in (
        ("O", fwd.o, tfwd.o, ref.o),
        ("LSE", fwd.lse, tfwd.lse, ref.lse),
        ("dQ", bwd.dq, tbwd.dq, None),
    ):
        assert_close(got, step, rtol=TOL, name=f"{name}, native vs PyTorch step")
        if want is not None:
            assert_close(got, want, rtol=TOL, name=f"{name}, native vs oracle")


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_the_softmax_s_exp2_is_within_a_unit_in_the_last_place(native, dtype) -> None:
    """The step's 2^x (float64 on AVX-512: a table of 2^(j/16) and a degree-6 polynomial;
    elsewhere one polynomial on [-1/2, 1/2]) against mpmath: within one unit in the last
    place over the exponents the softmax forms (0 down to the cut, densely around the
    table's steps and the rounding's ties) and positive ones; exact at the integers;
    exactly 0 below the cut (-1000 in float64, -100 in float32) and for -inf; above the
    largest exponent inf (AVX-512) or the largest power of two (the clamped form); NaN
    stays NaN."""
    mpmath = pytest.importorskip("mpmath")
    g = torch.Generator().manual_seed(5)
    cut = -1000.0 if dtype == f64 else -100.0
    steps = torch.arange(-64, 65, dtype=f64) / 32  # j/16 and the ties half-way between
    near = (steps[:, None] + torch.tensor([-1e-13, 0.0, 1e-13], dtype=f64)).flatten()
    x = torch.cat(
        [
            near,
            torch.rand(6000, generator=g, dtype=f64) * cut,  # the softmax's exponents
            torch.rand(2000, generator=g, dtype=f64) * 2 - 1,
            torch.rand(500, generator=g, dtype=f64) * (100 if dtype == f64 else 60),
        ]
    ).to(dtype)
    got = native.exp2(x)
    mpmath.mp.dps = 40
    want = torch.tensor(
        [float(mpmath.power(2, mpmath.mpf(float(v)))) for v in x.tolist()], dtype=f64
    )
    w = want.to(dtype)
    ulp = (w.nextafter(torch.tensor(math.inf, dtype=dtype)) - w).to(f64)
    err = (got.to(f64) - want.to(f64)).abs() / ulp
    worst = int(err.argmax())
    # without FMA (the SSE and AVX forms) each Horner step rounds its product and its sum
    # apart: half a unit more from the last product, the earlier ones scaled by |f| <= 1/2
    bound = 1.0 if native.fused else 2.0
    assert float(err.max()) <= bound, (
        f"2^{x[worst].item()!r} = {got[worst].item()!r}, want {want[worst].item()!r}: "
        f"{err[worst].item():.2f} units in the last place"
    )
    ints = torch.arange(-60, 61, dtype=dtype)
    assert torch.equal(native.exp2(ints), torch.pow(2.0, ints.to(f64)).to(dtype))
    special = torch.tensor([cut - 1, cut - 1e-3, -math.inf, 2000.0, math.nan], dtype=dtype)
    out = native.exp2(special).tolist()
    assert out[:3] == [0.0, 0.0, 0.0] and math.isnan(out[4])
    top = 2.0 ** (1023 if dtype == f64 else 127)  # the clamped form's; AVX-512 saturates
    assert out[3] in (math.inf, top), out[3]
    with pytest.raises(ValueError, match=r"2\^x of float32 or float64 values, not torch.bfloat16"):
        native.exp2(x.to(torch.bfloat16))


def test_non_contiguous_inputs_run_on_both_steps(gen, assert_close):
    """Heads sliced out of a larger tensor (strided K/V) are laid out once, for either step."""
    q, k, v, do = (torch.randn(2, 4, 97, 24, dtype=f64, generator=gen) for _ in range(4))
    k, v = k[:, ::2], v[:, 1::2]  # (2, 2, 97, 24), strided
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    for ctx in (_native.disabled(), contextlib.nullcontext()):
        with ctx:
            fwd = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=32, block_k=16)
        assert_close(fwd.o, ref.o, rtol=TOL, name="O from strided K/V")


@pytest.mark.parametrize(
    "name", ["causal", "window", "padding", "varlen", "window&padding", "dense&causal"]
)
def test_interval_masks_run_without_mask_tiles(
    native, native_calls, monkeypatch, gen, outputs_close, name
):
    """Causal, window, padding and varlen masks (and their intersections) are intervals per
    row: the native step reads them directly, so no boolean tile is built, and the visible
    dots it counts equal the PyTorch step's. A dense mask still builds its tiles."""
    from flashledger import masks

    b, hq, hkv, lq, lk, d = 2, 4, 2, 300, 260, 16
    opts: dict[str, Any] = dict(block_q=128, block_k=64)
    if name == "causal":
        opts["mask"] = fl.Causal("bottom_right")
    elif name == "window":
        opts["mask"] = fl.SlidingWindow(40, 3)
    elif name == "padding":
        opts["mask"] = fl.KeyPadding([260, 0])  # the second batch sees nothing
    elif name == "varlen":
        b, lk = 1, lq
        opts.update(
            cu_seqlens_q=torch.tensor([0, 90, 300], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 130, 300], dtype=torch.int32),
            mask=fl.Causal(),
        )
    elif name == "window&padding":
        opts["mask"] = fl.SlidingWindow(70, 0) & fl.KeyPadding([200, 133])
    else:
        dense = torch.rand(b, hq, lq, lk, generator=gen) < 0.5
        opts["mask"] = fl.Causal() & dense
    lead_q, lead_k = ((b, hq), (b, hkv)) if "cu_seqlens_q" not in opts else ((hq,), (hkv,))
    q, do = (torch.randn(*lead_q, lq, d, dtype=f64, generator=gen) for _ in range(2))
    k, v = (torch.randn(*lead_k, lk, d, dtype=f64, generator=gen) for _ in range(2))
    with _native.disabled():
        want_f, want_b = _both(q, k, v, do, **opts)
    built = []
    block = masks.IntervalBound.block

    def spy(self: Any, *args: Any) -> torch.Tensor:
        built.append(args)
        return block(self, *args)

    monkeypatch.setattr(masks.IntervalBound, "block", spy)
    fwd, bwd = _both(q, k, v, do, **opts)
    assert native_calls == {"forward": 1, "backward": 1}
    if name == "dense&causal":
        assert built, "a dense mask is read from its tiles"
    else:
        assert built == [], f"{name}: the native step built {len(built)} mask tiles"
    assert fwd.ledger.counters.tiles_partial > 0
    assert fwd.ledger.counters == want_f.ledger.counters
    assert bwd.ledger.counters == want_b.ledger.counters
    outputs_close((fwd, bwd), (want_f, want_b), rtol=TOL, name=f"{name}: native vs PyTorch step")


def test_scratch_is_kept_between_passes_up_to_a_bound(native, monkeypatch, gen, assert_close):
    """The tile buffers and the forward's laid-out Kᵀ go back to the pool and are reused
    by the next pass (no fresh pages); a backward lets the forward's Kᵀ go (its items lay
    out their own key tiles); a buffer above the bound is not kept; results are
    unaffected."""
    _native.release_scratch()
    pool = _native._pool.bufs
    q, k, v, do = (torch.randn(1, 2, 200, 16, dtype=f64, generator=gen) for _ in range(4))
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=64, block_k=64)
    bufs = dict(pool)
    assert {("work", f64), ("kv_t", f64)} <= set(bufs)
    fwd = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=64, block_k=64)
    assert all(pool[key] is buf for key, buf in bufs.items()), "reallocated"
    assert_close(fwd.o, ref.o, rtol=TOL, name="O with reused scratch")
    fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, mask=fl.Causal(), block_q=64, block_k=64)
    assert ("kv_t", f64) not in pool, "the backward lets its Kᵀ go"
    assert _native.release_scratch() > 0 and not pool
    monkeypatch.setattr(_native, "SCRATCH_KEEP_BYTES", 1024)
    big = _native._pool.take("work", 4096, f64)
    _native._pool.give("work", big)
    assert big.numel() == 4096 and ("work", f64) not in pool


def test_scratch_kept_is_bounded_whatever_the_threads(native, gen, assert_close):
    """Passes running in many threads at once each take scratch of their own; what stays
    kept afterwards is one buffer per (slot, dtype), not one set per thread."""
    _native.release_scratch()
    q, k, v = (torch.randn(1, 2, 300, 16, dtype=f64, generator=gen) for _ in range(3))
    ref = fl.reference_forward(q, k, v)
    errors: list[BaseException] = []
    outs: list[torch.Tensor] = []
    start = threading.Barrier(8)

    def run() -> None:
        try:
            start.wait()
            for _ in range(3):
                outs.append(fl.blocked_forward(q, k, v, block_q=64, block_k=64).o)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for o in outs:
        assert_close(o, ref.o, rtol=TOL, name="O from a concurrent pass")
    assert set(_native._pool.bufs) == {("work", f64), ("kv_t", f64)}, set(_native._pool.bufs)


@pytest.mark.parametrize("dt", [torch.float32, f64])
def test_k_laid_out_per_key_tile_reads_as_the_whole_length(native, monkeypatch, gen, dt):
    """A forward lays Kᵀ out per key tile where every tile of the schedule lies in one
    (``Schedule.key_tile``), each tile's rows a short stride apart (a backward's items lay
    out each key tile's Kᵀ_j and Vᵀ_j themselves). On the own kernel, whose sums do not
    depend on where their operands lie, every result equals the one read from the layout of
    the whole key length bit for bit: a ragged last tile, Lq != Lk, GQA, causal partial
    tiles, a dense mask with fully-masked rows, ALiBi."""
    if not native.own_built:
        pytest.skip("no own kernel here: a BLAS's sums may depend on the operands' layout")
    b, hkv, g, lq, lk, d = 2, 2, 2, 150, 203, 24
    q = torch.randn(b, hkv * g, lq, d, dtype=dt, generator=gen)
    k, v = (torch.randn(b, hkv, lk, d, dtype=dt, generator=gen) for _ in range(2))
    do = torch.randn(b, hkv * g, lq, d, dtype=dt, generator=gen)
    dense = torch.rand(b, hkv * g, lq, lk, generator=gen) < 0.6
    dense[..., :5, :] = False  # fully-masked rows
    slopes = torch.rand(hkv * g, dtype=f64, generator=gen)
    tiles: list[int] = []
    key_tile = _native.Schedule.key_tile
    with _gemms_kept(native):
        native.set_gemm(dt, "own")
        for name, opts in {
            "none": {},
            "causal": dict(mask=fl.Causal()),
            "dense": dict(mask=dense),
            "alibi": dict(alibi_slopes=slopes),
        }.items():
            monkeypatch.setattr(
                _native.Schedule, "key_tile", lambda s, n: tiles.append(key_tile(s, n)) or tiles[-1]
            )
            tiles.clear()
            got = _both(q, k, v, do, block_q=64, block_k=48, **opts)
            assert tiles and set(tiles) == {48}, (name, tiles)  # 203 keys: 4 x 48 and 11
            monkeypatch.setattr(_native.Schedule, "key_tile", lambda s, n: 0)
            want = _both(q, k, v, do, block_q=64, block_k=48, **opts)
            for x, y, what in zip(
                (got[0].o, got[0].lse, got[1].dq, got[1].dk, got[1].dv),
                (want[0].o, want[0].lse, want[1].dq, want[1].dk, want[1].dv),
                ("O", "LSE", "dQ", "dK", "dV"),
            ):
                same = (x == y) | (x.isnan() & y.isnan())
                assert bool(same.all()), f"{name} {dt} {what}: {int((~same).sum())} values differ"


def test_a_key_tile_layout_is_taken_only_where_the_tiles_fit_it(native):
    """``Schedule.key_tile``: the widest tile's keys when each tile lies in one aligned block
    of them and there are two blocks or more, else 0; a pass given a Kᵀ laid out before
    checks its layout against the tensor it transposes and the schedule's tiles."""
    sched = _native.Schedule()
    for k0 in range(0, 100, 32):
        sched.add(0, 8, k0, min(k0 + 32, 100), None)
    assert sched.key_tile(100) == 32 and sched.fits(32) and not sched.fits(24)
    assert sched.key_tile(32) == 0  # one block: the whole length is that layout
    sched.add(0, 8, 20, 40, None)  # a tile across the boundary at 32
    assert sched.key_tile(100) == 0
    assert _native.Schedule().key_tile(100) == 0
    k = torch.randn(3, 100, 5)
    ok = _native.Schedule()
    for k0 in range(0, 100, 32):
        ok.add(0, 8, k0, min(k0 + 32, 100), None)
    assert _native._layout_tile(native.transposed_k(k, 32), k, ok) == 32
    assert _native._layout_tile(native.transposed_k(k), k, ok) == 0
    assert native.transposed_k(k, 32).shape == (3, 4, 5, 32)
    assert native.transposed_k(k, 100).shape == (3, 5, 100)  # one tile: the whole length
    assert torch.equal(native.transposed_k(k, 32)[:, 3, :, :4], k[:, 96:].mT)
    assert torch.equal(native.transposed_k(k, 32)[:, 1], k[:, 32:64].mT)
    for bad in (native.transposed_k(k, 16), torch.zeros(3, 5, 99), torch.zeros(3, 4, 5, 31)):
        with pytest.raises(ValueError, match="transposed K or V"):
            _native._layout_tile(bad, k, ok)


@pytest.mark.parametrize("dt", [torch.float32, f64, torch.bfloat16, torch.float16])
def test_a_transpose_copies_every_value_across_the_register_blocks_and_their_edges(native, gen, dt):
    """``transposed``: every value where ``x.mT`` has it, per tile of rows or whole, for
    shapes that cut the 8 x 8 (float64 4 x 4) register blocks anywhere: rows and columns
    below, at and past a block, ragged last tiles, several matrices. The buffer starts as
    NaN, so a value left unwritten shows."""
    for n, rows, cols in ((1, 1, 1), (2, 7, 3), (3, 9, 8), (1, 63, 12), (2, 65, 17), (1, 130, 64)):
        x = torch.randn(n, rows, cols, generator=gen, dtype=f64).to(dt)
        for tile in (0, 4, 32, 100):
            buf = torch.full((native.transposed_numel(x, tile),), float("nan"), dtype=dt)
            out = native.transposed(x, buf, tile)
            if 0 < tile < rows:
                tiles = -(-rows // tile)
                assert out.shape == (n, tiles, cols, tile)
                whole = out.permute(0, 1, 3, 2).reshape(n, tiles * tile, cols)[:, :rows]
            else:
                assert out.shape == (n, cols, rows)
                whole = out.mT
            assert torch.equal(whole, x), (n, rows, cols, tile)


def test_large_scratch_is_its_own_base_on_huge_page_boundaries(native, gen, assert_close):
    """Scratch of a 2 MiB page or more is a base tensor of the asked dtype and size, starting
    on a 2 MiB boundary where the system maps anonymous memory (Linux), and writable; a
    smaller one is plain. A forward + backward at a length whose Kᵀ crosses the threshold
    gives its buffers back under the input dtype (a view's base, not the mapping's bytes),
    and the next pass reuses them; results are unaffected."""
    big = _native.scratch(_native.HUGE_PAGE // 4 + 3, torch.float32)
    assert big._base is None and big.dtype == torch.float32
    assert big.numel() == _native.HUGE_PAGE // 4 + 3
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % _native.HUGE_PAGE == 0, hex(big.data_ptr())
    big.fill_(2.5)
    assert big.sum().item() == 2.5 * big.numel()
    small = _native.scratch(1000, f64)
    assert small._base is None and small.numel() == 1000 and small.dtype == f64
    _native.release_scratch()
    # Kᵀ: H 2 x d 64 x padded(4200) float64 = 4.3 MB, above HUGE_PAGE
    q, k, v, do = (torch.randn(1, 2, 4200, 64, dtype=f64, generator=gen) for _ in range(4))
    fwd = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=512, block_k=512)
    kept = _native._pool.bufs.get(("kv_t", f64))
    assert kept is not None and kept._base is None, set(_native._pool.bufs)
    assert kept.numel() * kept.element_size() >= _native.HUGE_PAGE
    again = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=512, block_k=512)
    assert _native._pool.bufs.get(("kv_t", f64)) is kept, "reallocated"
    assert torch.equal(again.o, fwd.o) and torch.equal(again.lse, fwd.lse)
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    assert_close(fwd.o, ref.o, rtol=TOL, name="O on huge-page scratch")
    bwd = fl.blocked_backward(
        q, k, v, fwd.o, fwd.lse, do, mask=fl.Causal(), block_q=512, block_k=512
    )
    want = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=fl.Causal())
    for name in ("dq", "dk", "dv"):
        assert_close(getattr(bwd, name), getattr(want, name), rtol=TOL, name=name)
    assert _native.release_scratch() > 0 and not _native._pool.bufs


@contextlib.contextmanager
def _gemms_kept(native: _native.Kernels) -> Any:
    """Put back each dtype's matmul back end (and its forward's, and its backward score
    products') afterwards."""
    before = {
        dt: (native.gemm(dt), native.gemm(dt, forward=True), native.gemm(dt, scores=True))
        for dt in _calibrate.DTYPES
    }
    try:
        yield
    finally:
        for dt, (name, fwd, sco) in before.items():
            apart = dict(forward=None if fwd == name else fwd, scores=None if sco == name else sco)
            native.set_gemm(dt, name, **apart)


@pytest.fixture(params=list(_calibrate.GEMMS))
def gemm(request: Any, native: _native.Kernels) -> Any:
    """The step's matmuls on each back end there is here: its own kernel (AVX-512
    or AVX2), PyTorch's BLAS, OpenBLAS."""
    if request.param not in native.gemm_names():
        pytest.skip(f"no {request.param} back end here ({native.gemm_names()})")
    with _gemms_kept(native):
        for dt in (torch.float32, torch.float64):
            native.set_gemm(dt, request.param)
        yield request.param


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    m=st.integers(1, 140),
    n=st.integers(1, 20),
    k=st.integers(1, 140),
    dtype=st.sampled_from([torch.float32, f64]),
    a_cols=st.booleans(),
    pad=st.integers(0, 17),
    alpha=st.sampled_from([1.0, 0.3]),
    beta=st.sampled_from([0.0, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_step_matmul_equals_torch(native, gemm, m, n, k, dtype, a_cols, pad, alpha, beta, seed):
    """Every block shape of the kernel (row tails under masks, 1-6 columns), both layouts
    of ``a`` (the two ways the step reads its B operand), padded rows, alpha, beta."""
    gen = torch.Generator().manual_seed(seed)
    a = (
        torch.randn(k, m, dtype=dtype, generator=gen).T
        if a_cols
        else torch.randn(m, k, dtype=dtype, generator=gen)
    )
    b = torch.randn(k, n + pad, dtype=dtype, generator=gen)[:, :n]  # rows padded
    c_rows = torch.randn(m, n + pad, dtype=dtype, generator=gen)
    c = c_rows[:, :n]
    want = alpha * (a.double() @ b.double()) + beta * c.double()
    before = c_rows[:, n:].clone()  # the padding
    native.matmul(a, b, c, alpha=alpha, beta=beta)
    tol = (1e-5 if dtype == torch.float32 else 1e-13) * (k + 1)
    err = (c.double() - want).abs() / (1 + want.abs())
    worst = int(err.argmax())
    assert err.max() <= tol, (
        f"{gemm} matmul {m}x{k}x{n}: worst entry {divmod(worst, n)}: {c.flatten()[worst]} vs "
        f"{want.flatten()[worst]}"
    )
    assert torch.equal(c_rows[:, n:], before), "wrote past the row's n columns"


def test_step_matmul_rejects_bad_operands(native):
    a, b, c = torch.zeros(3, 4), torch.zeros(4, 5), torch.zeros(3, 5)
    with pytest.raises(ValueError, match="do not chain"):
        native.matmul(a, b, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="beta must be 0 or 1"):
        native.matmul(a, b, c, beta=0.5)
    with pytest.raises(ValueError, match="one dtype"):
        native.matmul(a, b.double(), c)
    with pytest.raises(ValueError, match="unit column strides"):
        native.matmul(a, b.T.contiguous().T, c)
    with pytest.raises(ValueError, match="row- or column-major"):
        native.matmul(torch.zeros(3, 8)[:, ::2], b, c)


def test_own_kernel_is_offered_wherever_the_cpu_has_avx2_and_fma(native):
    """The step's own kernel is built for AVX-512 and for AVX2 with FMA (the library is
    compiled for the CPU it runs on, or the target FLASHLEDGER_NATIVE_ARCH names): wherever
    the build has AVX2 and FMA, ``own`` is a back end, and it is the first one the
    calibration measures; without them (the SSE and AVX forms) it is none."""
    macros = native.isa_macros()
    assert "__SSE2__" in macros, f"no instruction-set macros recorded for {native.target}"
    if native.target == "native":  # built for this CPU: its ISA as /proc/cpuinfo names it
        isa = set(_calibrate.cpu_info()["isa"].split())
        assert ({"AVX2", "FMA"} <= isa) == ({"__AVX2__", "__FMA__"} <= macros), (isa, macros)
    if not {"__AVX2__", "__FMA__"} <= macros:
        assert not native.own_built and "own" not in native.gemm_names(torch.float32)
        assert native.vector_bytes < 64 and not native.fused, (native.vector_bytes, macros)
        return
    assert native.own_built, f"no own kernel built for {native.target} ({sorted(macros)})"
    assert native.fused and native.vector_bytes == (64 if "__AVX512F__" in macros else 32)
    for dt in (torch.float32, f64):
        assert native.gemm_names(dt)[0] == "own", native.gemm_names(dt)
    assert native.gemm_names(torch.bfloat16)[0] != "own"  # the half builds have none


def test_step_matmul_rate_is_measured(native):
    assert native.matmul_rate(torch.float32, n=64, seconds=0.02) > 0


@pytest.mark.parametrize("d, dv", [(24, 40), (1, 1)])
@pytest.mark.parametrize("kind", ["none", "causal", "dense", "softcap"])
def test_native_step_on_either_matmul_equals_the_oracle(
    native, gemm, outputs_close, kind, d, dv, gen
):
    """The step with its own kernel and with BLAS: lengths that break every tiling, GQA,
    a ragged last tile, head dims that leave kernel row tails (and single columns),
    fully-masked rows; a softcap (its tanh's scratch lies between dP and the own kernel's
    transposed Q and dO)."""
    b, hkv, g, lq, lk = 2, 2, 2, 113, 97
    q = torch.randn(b, hkv * g, lq, d, dtype=f64, generator=gen)
    k = torch.randn(b, hkv, lk, d, dtype=f64, generator=gen)
    v = torch.randn(b, hkv, lk, dv, dtype=f64, generator=gen)
    do = torch.randn(b, hkv * g, lq, dv, dtype=f64, generator=gen)
    mask: Any = {"none": None, "causal": fl.Causal("bottom_right")}.get(kind)
    if kind == "dense":
        mask = torch.rand(b, hkv * g, lq, lk, generator=gen) < 0.5
        mask[..., :7, :] = False  # fully-masked rows
    extra = {"softcap": 2.5} if kind == "softcap" else {}
    opts = dict(mask=mask, block_q=64, block_k=48, **extra)
    ref = fl.reference_forward(q, k, v, mask=mask, **extra)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask, **extra)
    fwd, bwd = _both(q, k, v, do, **opts)
    outputs_close((fwd, bwd), (ref, refb), rtol=TOL, name=f"{gemm} matmuls, {kind}")


@pytest.fixture
def small_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibration on small passes (the machinery, not the speed, is under test), with
    no back end forced from outside (``make test-backend`` sets FLASHLEDGER_GEMM) and no
    setting that keys the cache apart (``make test-backends`` runs with MKL held to AVX2;
    the libraries keep the code they loaded), on a machine that reads as quiet (the tests
    beside it must not decide what is measured)."""
    monkeypatch.setattr(_calibrate, "_cpu_ticks", lambda: None)
    for variable in ("FLASHLEDGER_GEMM", "FLASHLEDGER_HALF", *_calibrate.STEERING):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(_calibrate, "_L", 96)
    monkeypatch.setattr(_calibrate, "TILE_CANDIDATES", ((64, 64), (32, 48)))


def test_the_choice_is_measured_once_then_read_back(native, tmp_path, small_calibration):
    """Per dtype, every back end and tile candidate is measured, the fastest kept and
    saved, then every back end's forward alone and the forward's own tile candidates on the
    fastest; the next time (another process: the file) the same choice is read back, and
    put in force."""
    cache = tmp_path / "choices.json"
    with _gemms_kept(native):
        first = _calibrate.choose(native, cache)
        again = _calibrate.choose(native, cache)
    for dt in (torch.float32, torch.float64):
        c = first[dt]
        assert c.how == "calibrated" and again[dt].how == "cached"
        assert again[dt] == replace(c, how="cached")
        names = native.gemm_names()
        fq, fk = _calibrate.FORWARD_GEMM_TILES
        # each stage's rates under keys of their own: the back ends (at the first tile
        # candidate), the tiles on the winner, on a BLAS a backward's score products on it
        # or on the own kernel (at those tiles), the forward's back ends, its tiles on that
        tiles = f"{c.block_q}x{c.block_k}"
        mixed = c.gemm != "own" and "own" in names
        stages = {
            "gemm": {g: f"{g} 64x64" for g in names} if len(names) > 1 else {},
            "tiles": {t: f"tiles {t}" for t in ("64x64", "32x48")},
            "scores": {g: f"scores {g} {tiles}" for g in (c.gemm, "own")} if mixed else {},
            "forward gemm": {g: f"forward {g} {fq}x{fk}" for g in names} if len(names) > 1 else {},
            "forward tiles": {
                f"{q}x{k}": f"forward {q}x{k}" for q, k in _calibrate.FORWARD_TILE_CANDIDATES
            },
        }
        assert c.gemm in names and (c.block_q, c.block_k) in ((64, 64), (32, 48))
        assert c.forward_tiles in _calibrate.FORWARD_TILE_CANDIDATES
        kept = {
            "gemm": c.gemm,
            "tiles": f"{c.block_q}x{c.block_k}",
            "scores": c.scores_gemm or c.gemm,
            "forward gemm": c.forward_gemm,
            "forward tiles": f"{c.forward_block_q}x{c.forward_block_k}",
        }
        assert c.scores_gemm in (("", "own") if mixed else ("",))
        _stages_kept(c, stages, kept)
        # the choice in force: a back end apart for the forward, and for a backward's score
        # products, where each won there
        with _gemms_kept(native):
            native.set_gemm(dt, c.gemm, forward=c.forward_gemm, scores=c.scores_gemm or None)
            assert native.gemm(dt) == c.gemm and native.gemm(dt, forward=True) == c.forward_gemm
            assert native.gemm(dt, scores=True) == (c.scores_gemm or c.gemm)
    for dt in (torch.bfloat16, torch.float16):
        assert again[dt] == replace(first[dt], how="cached")
        _half_stages_kept(first[dt], first[torch.float32], native.gemm_names(dt))
    # a choice saved before the forward's tiles, or its back end, were measured is measured
    # again
    for fields in (("forward_block_q", "forward_block_k"), ("forward_gemm",)):
        saved = json.loads(cache.read_text())
        for mine in saved["by_threads"].values():
            for c in mine.values():
                for f in fields:
                    c.pop(f)
        cache.write_text(json.dumps(saved))
        with _gemms_kept(native):
            assert _calibrate.choose(native, cache)[torch.float32].how == "calibrated", fields
    # a cache of the earlier layout (the tile stage's rates under the back-end stage's
    # keys, the winner's overwritten) is measured again
    saved = json.loads(cache.read_text())
    assert saved.pop("format") == _calibrate._FORMAT
    cache.write_text(json.dumps(saved))
    with _gemms_kept(native):
        assert _calibrate.choose(native, cache)[torch.float32].how == "calibrated"
    saved = json.loads(cache.read_text())
    assert saved["cpu"] == _calibrate.cpu_model() and saved["torch"] == torch.__version__
    assert set(saved["by_threads"]) == {str(native.max_threads())}
    assert saved["format"] == _calibrate._FORMAT


def _half_stages_kept(c: _calibrate.Choice, base: _calibrate.Choice, paths: list[str]) -> None:
    """A half dtype's choice ``c`` (float32's is ``base``) kept the fastest of each stage it
    measured: every path in ``paths`` (``half`` at the first tile candidate, ``float32`` at
    float32's tiles), then where a half path won, its tiles and its forward's tiles."""
    assert c.gemm in paths
    if paths == ["float32"]:  # no half gemm here: nothing measured
        assert c.rates == {} and (c.block_q, c.block_k) == (base.block_q, base.block_k)
        return
    at = {p: "64x64" if p != "float32" else f"{base.block_q}x{base.block_k}" for p in paths}
    stages = {"path": {p: f"{p} {at[p]}" for p in paths}}
    kept = {"path": c.gemm}
    if c.gemm != "float32":
        stages["tiles"] = {t: f"tiles {t}" for t in ("64x64", "32x48")}
        stages["forward tiles"] = {
            f"{q}x{k}": f"forward {q}x{k}" for q, k in _calibrate.FORWARD_TILE_CANDIDATES
        }
        kept["tiles"] = f"{c.block_q}x{c.block_k}"
        kept["forward tiles"] = f"{c.forward_block_q}x{c.forward_block_k}"
    else:  # float32's choice, tiles and all
        assert (c.block_q, c.block_k, c.forward_tiles) == (
            base.block_q,
            base.block_k,
            base.forward_tiles,
        )
    _stages_kept(c, stages, kept)


def _stages_kept(
    c: _calibrate.Choice, stages: dict[str, dict[str, str]], kept: dict[str, str]
) -> None:
    """``c``'s rates are exactly the keys of ``stages`` (per stage: candidate -> key; a stage
    without candidates was not measured), each positive, and the candidate ``kept`` of
    each stage measured fastest there (rates rounded: ties equal)."""
    want = {key for keys in stages.values() for key in keys.values()}
    assert set(c.rates) == want and all(r > 0 for r in c.rates.values()), c.rates
    for stage, keys in stages.items():
        if keys:
            best = max(c.rates[key] for key in keys.values())
            assert c.rates[keys[kept[stage]]] == best, (stage, kept[stage], c.rates)


def test_a_forced_half_path_keeps_its_fastest_tiles(
    native, tmp_path, small_calibration, monkeypatch
):
    """With ``FLASHLEDGER_HALF=half`` the half dtypes run in their dtype: the path is not
    measured against float32, but its tiles and its forward's tiles are, and the fastest of
    each kept (the forced setting named as how the choice was made)."""
    if "half" not in native.gemm_names(torch.bfloat16):
        pytest.skip("no half gemm in this PyTorch")
    monkeypatch.setenv("FLASHLEDGER_HALF", "half")
    with _gemms_kept(native):
        got = _calibrate.choose(native, tmp_path / "choices.json")
    for dt in (torch.bfloat16, torch.float16):
        c = got[dt]
        assert c.gemm == "half" and c.how == "FLASHLEDGER_HALF=half", c
        _half_stages_kept(c, got[torch.float32], ["half"])


def test_each_dtype_is_measured_when_first_asked_for(native, tmp_path, small_calibration):
    """The calibration measures the dtypes asked for (a half dtype's against float32's,
    so float32's too) and leaves the others' saved choices as they are; a file written
    with other candidates or another layout loses every entry, of every thread count."""
    cache = tmp_path / "choices.json"

    def saved() -> dict[str, Any]:
        return json.loads(cache.read_text())["by_threads"][str(native.max_threads())]

    with _gemms_kept(native):
        got = _calibrate.choose(native, cache, [torch.float64])
        assert set(got) == {torch.float64} and got[torch.float64].how == "calibrated"
        assert set(saved()) == {"float64"}
        f64 = saved()["float64"]
        got = _calibrate.choose(native, cache, [torch.bfloat16])
        assert set(got) == {torch.float32, torch.bfloat16}
        assert {c.how for c in got.values()} == {"calibrated"}
        assert set(saved()) == {"float32", "float64", "bfloat16"}
        assert saved()["float64"] == f64  # untouched
        got = _calibrate.choose(native, cache)
        assert set(got) == set(_calibrate.DTYPES)
        hows = {_calibrate._name(dt): c.how for dt, c in got.items()}
        assert hows == {
            "float32": "cached",
            "float64": "cached",
            "bfloat16": "cached",
            "float16": "calibrated",
        }
        # an entry for another thread count, in a file of an earlier layout: all measured
        # again, and the other thread count's entry dropped with the rest
        data = json.loads(cache.read_text())
        data["by_threads"]["99"] = data["by_threads"][str(native.max_threads())]
        data["format"] = _calibrate._FORMAT - 1
        cache.write_text(json.dumps(data))
        got = _calibrate.choose(native, cache, [torch.float32])
        assert got[torch.float32].how == "calibrated"
        data = json.loads(cache.read_text())
        assert set(data["by_threads"]) == {str(native.max_threads())}
        assert set(saved()) == {"float32"} and data["format"] == _calibrate._FORMAT


def test_the_step_chooses_a_dtype_when_it_first_runs_it(
    native, tmp_path, small_calibration, monkeypatch
):
    """A process that runs float32 alone measures float32 alone: a dtype's choice is made
    when its tiles, its back end or a pass of it are first asked for; a ``set_gemm``
    made before that is not replaced by the choice made later (it is made first)."""
    others = [g for g in native.gemm_names() if g != "blas"]
    if not others:
        pytest.skip(f"one matmul back end here ({native.gemm_names()})")
    monkeypatch.setenv("FLASHLEDGER_GEMM", "blas")  # what float32/float64 choose
    cache = tmp_path / "choices.json"
    kern = _native.Kernels(native._lib, native._gemms, cache)  # the same library, no choices
    with _gemms_kept(native):
        assert kern.choices == {}
        kern.tiles(torch.float32)
        assert set(kern.choices) == {torch.float32}
        saved = json.loads(cache.read_text())["by_threads"]
        assert [set(mine) for mine in saved.values()] == [{"float32"}]
        kern.set_gemm(torch.float64, others[0])  # chosen first (blas), then set
        assert set(kern.choices) == {torch.float32, torch.float64}
        q, k, v, do = (torch.randn(1, 2, 40, 8, dtype=torch.float16) for _ in range(4))
        with mock.patch.object(_native, "_load", return_value=(kern, "")):
            f = fl.blocked_forward(q, k, v, block_q=16, block_k=16)
            fl.blocked_backward(q, k, v, f.o, f.lse, do, block_q=16, block_k=16)
        assert set(kern.choices) == {torch.float32, torch.float64, torch.float16}
        kern.choose()  # every dtype: bfloat16 the last
        assert set(kern.choices) == set(_calibrate.DTYPES)
        assert kern.gemm(torch.float64) == others[0] and kern.gemm(torch.float32) == "blas"


def test_the_forward_runs_on_its_own_back_end_and_the_backward_on_the_other(native, gen):
    """With a forward back end apart (``set_gemm(dt, name, forward=...)``), a forward pass
    runs every product on it and a backward pass on ``name``: each equals, bit for bit, the
    pass run with that back end for everything (the own kernel's products are the same
    calls either way; a BLAS's run under the same thread count and shapes)."""
    if "own" not in native.gemm_names():
        pytest.skip(f"no own kernel here ({native.gemm_names()})")
    other = next(g for g in native.gemm_names() if g != "own")
    q, k, v, do = (torch.randn(1, 4, 300, 64, generator=gen) for _ in range(4))
    opts = dict(block_q=128, block_k=256, mask=fl.Causal())

    def run(name: str, forward: str | None = None) -> tuple[Any, Any]:
        native.set_gemm(torch.float32, name, forward=forward)
        f = fl.blocked_forward(q, k, v, **opts)
        b = fl.blocked_backward(q, k, v, ref_o, ref_lse, do, **opts)
        return f, b

    with _gemms_kept(native):
        native.set_gemm(torch.float32, other)
        first = fl.blocked_forward(q, k, v, **opts)
        ref_o, ref_lse = first.o, first.lse  # one forward's outputs for every backward
        own_f, own_b = run("own")
        mixed_f, mixed_b = run(other, forward="own")
        assert torch.equal(mixed_f.o, own_f.o) and torch.equal(mixed_f.lse, own_f.lse)
        assert native.gemm(torch.float32, forward=True) == "own"
        mixed_f, mixed_b = run("own", forward=other)
        assert torch.equal(mixed_b.dq, own_b.dq), "the backward left the own kernel"
        assert torch.equal(mixed_b.dk, own_b.dk) and torch.equal(mixed_b.dv, own_b.dv)
        assert native.gemm(torch.float32) == "own"
        native.set_gemm(torch.float32, "own")  # one back end again: the forward's follows
        assert native.gemm(torch.float32, forward=True) == "own"
    with pytest.raises(ValueError, match="no matmul back end 'nonesuch'"):
        native.set_gemm(torch.float32, "own", forward="nonesuch")


@pytest.mark.parametrize("dt", [torch.float32, f64])
def test_a_backward_s_score_products_run_on_the_own_kernel_beside_a_blas(
    native, gen, dt, assert_close
):
    """With ``set_gemm(dt, blas, scores="own")`` a backward's score products (S again and
    dP) run on the own kernel and the rest on the BLAS: the own kernel counts them (none
    with the BLAS alone, none with the own kernel for everything); dS (a bias's gradient,
    formed from those two products) is bit for bit the all-own pass's, and every gradient
    agrees with the oracle. A forward is not touched; a later ``set_gemm`` without
    ``scores`` puts them back on the back end; a half dtype has no such setting."""
    names = native.gemm_names(dt)
    if "own" not in names or len(names) < 2:
        pytest.skip(f"no own kernel beside a BLAS here ({names})")
    other = next(g for g in names if g != "own")
    b, h, lq, lk, d = 1, 2, 200, 170, 64
    q, do = (torch.randn(b, h, lq, d, generator=gen, dtype=f64) for _ in range(2))
    k, v = (torch.randn(b, h, lk, d, generator=gen, dtype=f64) for _ in range(2))
    bias = torch.randn(b, h, lq, lk, generator=gen, dtype=f64)
    q, k, v, do, bias = (x.to(dt) for x in (q, k, v, do, bias))
    opts = dict(block_q=128, block_k=96, mask=fl.Causal(), bias=bias)

    def run(name: str, scores: str | None) -> tuple[Any, int]:
        native.set_gemm(dt, name, scores=scores)
        native.scores_own_products(dt)
        fl.blocked_forward(q, k, v, **opts)
        assert native.scores_own_products(dt) == 0, "a forward ran a backward's products"
        got = fl.blocked_backward(q, k, v, f.o, f.lse, do, **opts)  # one forward's O, LSE
        return got, native.scores_own_products(dt)

    with _gemms_kept(native):
        f = fl.blocked_forward(q, k, v, **opts)
        own, n_own = run("own", None)
        blas, n_blas = run(other, None)
        mixed, n_mixed = run(other, "own")
        assert native.gemm(dt, scores=True) == "own" and native.gemm(dt) == other
        assert f"{_native._SUFFIX[dt]} scores own" in native.settings()
        assert n_own == n_blas == 0 and n_mixed > 0, (n_own, n_blas, n_mixed)
        assert torch.equal(mixed.dbias, own.dbias), "dS is not the own kernel's"
        native.set_gemm(dt, other)  # scores on the back end again
        assert native.gemm(dt, scores=True) == other
        assert f"{_native._SUFFIX[dt]} scores own" not in native.settings()
    ref = fl.reference_forward(
        q.double(), k.double(), v.double(), mask=fl.Causal(), bias=bias.double()
    )
    want = fl.reference_backward(
        q.double(),
        k.double(),
        v.double(),
        ref.o,
        ref.lse,
        do.double(),
        mask=fl.Causal(),
        bias=bias.double(),
    )
    for name in ("dq", "dk", "dv", "dbias"):
        got, plain, exact = (getattr(r, name).double() for r in (mixed, blas, want))
        if dt == f64:
            assert_close(got, exact, rtol=TOL, name=f"{name}, score products on the own kernel")
        else:  # float32: as near the oracle as the pass on the BLAS alone
            err, err_blas = float((got - exact).abs().max()), float((plain - exact).abs().max())
            assert err <= 2 * err_blas + 1e-6, f"{name}: {err:.3g}, the BLAS pass {err_blas:.3g}"
    third = [g for g in names if g not in ("own", other)]  # OpenBLAS beside PyTorch's BLAS
    if third:
        with pytest.raises(ValueError, match="score products run on the own kernel or on"):
            native.set_gemm(dt, other, scores=third[0])
    with pytest.raises(ValueError, match="no matmul back end 'x'"):
        native.set_gemm(dt, other, scores="x")
    with pytest.raises(ValueError, match=r"no matmul back end 'own' for torch\.bfloat16"):
        native.set_gemm(torch.bfloat16, native.gemm(torch.bfloat16), scores="own")


def test_a_choice_no_longer_possible_is_measured_again(native, tmp_path, small_calibration):
    cache = tmp_path / "choices.json"
    gone = {"gemm": "nonesuch", "block_q": 64, "block_k": 64, "how": "calibrated", "rates": {}}
    by = {str(native.max_threads()): {"float32": gone, "float64": gone}}
    cache.write_text(json.dumps({"by_threads": by}))
    with _gemms_kept(native):
        got = _calibrate.choose(native, cache)
    assert set(got) == set(_calibrate.DTYPES)
    assert all(c.how == "calibrated" and c.gemm in native.gemm_names(dt) for dt, c in got.items())
    cache.write_text("{not json")  # a damaged file is measured again too
    with _gemms_kept(native):
        assert _calibrate.choose(native, cache)[torch.float32].how == "calibrated"
    # and a damaged entry (a field of the wrong type) alone, the others read back
    saved = json.loads(cache.read_text())
    saved["by_threads"][str(native.max_threads())]["float32"]["forward_block_q"] = "x"
    cache.write_text(json.dumps(saved))
    with _gemms_kept(native):
        got = _calibrate.choose(native, cache, [torch.float32, torch.float64])
    assert got[torch.float32].how == "calibrated" and got[torch.float64].how == "cached"


def test_others_share_is_the_busy_time_less_this_process_own(monkeypatch):
    """Over an interval: the busy ticks of /proc/stat (all CPUs) less this process's CPU
    time, over all ticks; nothing to say where /proc/stat cannot be read."""
    hz = os.sysconf("SC_CLK_TCK")
    ticks = iter([(100, 1000), (100 + 2 * hz, 1000 + 4 * hz)])  # 2 s busy of 4 s (2 CPUs, 2 s)
    clock = iter([10.0, 10.5])  # half a second of it this process's own
    monkeypatch.setattr(_calibrate, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(_calibrate.time, "process_time", lambda: next(clock))
    with _calibrate.OthersShare() as others:
        pass
    assert others.share == pytest.approx(1.5 / 4)
    monkeypatch.setattr(_calibrate, "_cpu_ticks", lambda: None)
    monkeypatch.setattr(_calibrate.time, "process_time", lambda: 0.0)
    with _calibrate.OthersShare() as others:
        pass
    assert others.share == 0.0


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat here")
def test_others_share_sees_busy_processes():
    """With a busy process on every CPU, others take most of the machine."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 1)]
    try:
        share = _calibrate.others_share(0.5)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert 0.5 < share <= 1.0, share


def test_a_choice_made_on_a_busy_machine_is_measured_again_once_it_is_quiet(
    native, tmp_path, monkeypatch, small_calibration
):
    """A choice measured while other processes took much of the CPU is saved with that
    share, kept while the machine stays busy, measured again when it is quiet; a busier
    measurement never replaces a quieter one."""
    cache = tmp_path / "choices.json"
    load = {"measuring": 0.6, "now": 0.5}

    def exit_(self: _calibrate.OthersShare, *exc: object) -> None:
        self.share = load["measuring"]

    monkeypatch.setattr(_calibrate.OthersShare, "__exit__", exit_)
    monkeypatch.setattr(_calibrate, "others_share", lambda seconds: load["now"])

    def saved_busy() -> set[float]:
        mine = json.loads(cache.read_text())["by_threads"][str(native.max_threads())]
        return {c["busy"] for c in mine.values()}

    with _gemms_kept(native):
        got = _calibrate.choose(native, cache)
        assert {c.how for c in got.values()} == {"calibrated"} and saved_busy() == {0.6}
        assert (
            got[torch.float32].busy_note() == "measured while other processes took 60% of the CPU"
        )
        assert _calibrate.choose(native, cache)[torch.float32].how == "cached"  # still busy
        load.update(now=0.0, measuring=0.8)  # quiet to look at, busier while measuring
        assert _calibrate.choose(native, cache)[torch.float32].how == "cached"
        assert saved_busy() == {0.6}
        load.update(measuring=0.02)
        got = _calibrate.choose(native, cache)
        assert {c.how for c in got.values()} == {"calibrated"} and saved_busy() == {0.02}
        assert got[torch.float32].busy_note() == ""

        def look(seconds: float) -> float:
            raise AssertionError("a quiet choice is read back without looking at the machine")

        monkeypatch.setattr(_calibrate, "others_share", look)
        assert _calibrate.choose(native, cache)[torch.float32].how == "cached"
        # a choice saved before the share was recorded: unknown, measured again when quiet
        saved = json.loads(cache.read_text())
        for mine in saved["by_threads"].values():
            for c in mine.values():
                c.pop("busy")
        cache.write_text(json.dumps(saved))
        monkeypatch.setattr(_calibrate, "others_share", lambda seconds: 0.0)
        assert _calibrate.choose(native, cache)[torch.float32].how == "calibrated"
        assert saved_busy() == {0.02}
        saved["by_threads"][str(native.max_threads())]["float32"]["busy"] = "x"  # damaged
        cache.write_text(json.dumps(saved))
        assert _calibrate.choose(native, cache)[torch.float32].how == "calibrated"


FLOATS = (torch.float32, torch.float64)


def test_flashledger_gemm_forces_the_back_end(native, tmp_path, monkeypatch, small_calibration):
    cache = tmp_path / "choices.json"
    monkeypatch.setenv("FLASHLEDGER_GEMM", "blas")
    with _gemms_kept(native):
        got = {dt: c for dt, c in _calibrate.choose(native, cache).items() if dt in FLOATS}
        assert all(c.gemm == "blas" and c.how == "FLASHLEDGER_GEMM=blas" for c in got.values())
        fwd = {f"forward {q}x{k}" for q, k in _calibrate.FORWARD_TILE_CANDIDATES}
        assert all(set(c.rates) == {"tiles 64x64", "tiles 32x48"} | fwd for c in got.values())
        monkeypatch.setenv("FLASHLEDGER_GEMM", "mkl")
        with pytest.warns(UserWarning, match="FLASHLEDGER_GEMM='mkl' is not one of"):
            got = _calibrate.choose(native, cache)
    assert all(c.how == "calibrated" for c in got.values())  # measured: not the forced one
    with pytest.raises(ValueError, match=r"no matmul back end 'mkl' for torch\.float32 here"):
        native.set_gemm(torch.float32, "mkl")


def test_a_choice_made_with_mkl_held_to_other_code_is_saved_apart(
    native, tmp_path, monkeypatch, small_calibration
):
    """MKL_ENABLE_INSTRUCTIONS=AVX2 (a test run on the AVX2 code) measures another MKL: its
    choices are kept under a key of their own, and a plain process measures for itself
    instead of inheriting them."""
    cache = tmp_path / "choices.json"
    plain = str(native.max_threads())
    with _gemms_kept(native):
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        held = _calibrate.choose(native, cache, [torch.float32])
        assert held[torch.float32].how == "calibrated"
        saved = json.loads(cache.read_text())["by_threads"]
        assert set(saved) == {f"{plain} MKL_ENABLE_INSTRUCTIONS=AVX2"}
        assert _calibrate.choose(native, cache, [torch.float32])[torch.float32].how == "cached"
        monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
        got = _calibrate.choose(native, cache, [torch.float32])
        assert got[torch.float32].how == "calibrated"  # not the AVX2 run's choice
        saved = json.loads(cache.read_text())["by_threads"]
        assert set(saved) == {plain, f"{plain} MKL_ENABLE_INSTRUCTIONS=AVX2"}
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "")  # set but empty: the plain key
        assert _calibrate.choose(native, cache, [torch.float32])[torch.float32].how == "cached"


def test_a_pass_gives_the_same_bits_whoever_runs_its_items(native, gen):
    """A pass hands its work items to threads as they free up; no item shares rows of the
    state, dK/dV or dQ with another, and parts are added in order, so the result does not
    depend on which thread ran what: passes run at once from several threads (one
    OpenMP team each) give the bits of a pass run alone."""
    q = torch.randn(2, 4, 150, 24, dtype=torch.float32, generator=gen)
    k, v = (torch.randn(2, 1, 190, 24, dtype=torch.float32, generator=gen) for _ in range(2))
    do = torch.randn(2, 4, 150, 24, dtype=torch.float32, generator=gen)
    opts = dict(mask=fl.Causal("bottom_right"), block_q=32, block_k=48)
    want_f, want_b = _both(q, k, v, do, **opts)
    got: list[tuple[fl.ForwardResult, fl.BackwardResult]] = []
    threads = [
        threading.Thread(target=lambda: got.append(_both(q, k, v, do, **opts))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3
    for fwd, bwd in got:
        for name, a, b in (
            ("O", fwd.o, want_f.o),
            ("LSE", fwd.lse, want_f.lse),
            ("dQ", bwd.dq, want_b.dq),
            ("dK", bwd.dk, want_b.dk),
            ("dV", bwd.dv, want_b.dv),
        ):
            assert torch.equal(a, b), f"{name} differs between runs of the same pass"


@pytest.mark.parametrize("lq", [1, 3, 16])
def test_decode_rows_run_stacked_and_split(native, monkeypatch, gen, outputs_close, lq):
    """A few query rows against many keys (decode): the group's query heads run as one
    block of rows and each row's key tiles are split into parts merged with the one
    merge. O, LSE and the gradients (bottom-right causal and key padding, GQA) equal the
    oracle; the counters equal the PyTorch step's."""
    from flashledger import blocked

    seen: list[dict[str, Any]] = []
    real = native.forward

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(native, "forward", spy)
    q = torch.randn(1, 8, lq, 32, dtype=f64, generator=gen)
    k, v = (torch.randn(1, 2, 1000, 32, dtype=f64, generator=gen) for _ in range(2))
    mask = fl.Causal("bottom_right") & fl.KeyPadding([990])
    do = torch.randn(1, 8, lq, 32, dtype=f64, generator=gen)
    fwd, bwd = _both(q, k, v, do, mask=mask, block_q=64, block_k=128)
    assert seen and seen[0]["stacked"] and seen[0]["splits"] > 1, seen
    ref = fl.reference_forward(q, k, v, mask=mask)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask)
    with _native.disabled():
        want = blocked.blocked_forward(q, k, v, mask=mask, block_q=64, block_k=128)
    outputs_close((fwd, bwd), (ref, refb), rtol=TOL, name=f"decode Lq={lq}")
    assert fwd.ledger.counters == want.ledger.counters


@pytest.mark.parametrize("d", [40, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_reads_a_half_precision_cache_in_place(native, monkeypatch, gen, dtype, d):
    """A bfloat16/float16 KV cache is read in place (no float32 copy of K or V: the step
    widens it in registers as it reads it; a bfloat16 q's own rows go beside, for
    AVX512-BF16's pair dot products where the step has them and d is a multiple of 32):
    O within one rounding to the dtype of the PyTorch step's (which widens the whole of K
    and V first), the LSE (float32) within float32 error."""
    from flashledger import blocked

    seen: list[tuple[torch.dtype, torch.dtype, bool]] = []
    real = native.forward

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any) -> Any:
        seen.append((k.dtype, v.dtype, kw.get("q16") is not None))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(native, "forward", spy)
    q = torch.randn(2, 8, 2, d, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 700, d, generator=gen).to(dtype) for _ in range(2))
    mask = fl.Causal("bottom_right")
    got = blocked.blocked_forward(q, k, v, mask=mask, block_k=128)
    assert seen == [(dtype, dtype, dtype == torch.bfloat16)], seen
    with _native.disabled():
        want = blocked.blocked_forward(q, k, v, mask=mask, block_k=128)
    assert got.o.dtype == dtype and got.lse.dtype == torch.float32
    diff = (got.o.float() - want.o.float()).abs()
    bound = torch.finfo(dtype).eps * want.o.float().abs() + torch.finfo(dtype).tiny
    worst = int(torch.argmax(diff - bound))
    assert bool((diff <= bound).all()), (
        f"O[{worst}]: {got.o.flatten()[worst]} vs {want.o.flatten()[worst]} (one rounding allowed)"
    )
    assert torch.allclose(got.lse, want.lse, rtol=1e-5, atol=1e-5)
    assert got.ledger.counters == want.ledger.counters


@pytest.mark.parametrize("lk", [1, 31, 32, 33, 97, 700])
@pytest.mark.parametrize(("g", "lq"), [(1, 1), (4, 1), (5, 4), (8, 6)], ids=lambda x: str(x))
def test_a_bfloat16_caches_scores_on_amx_keep_the_rule(native, g, lq, lk):
    """Where the step has AMX, a bfloat16 cache read in place with bfloat16 q forms its
    scores on the tiles (K's rows as A operands, 32 keys at a time, the last ``lk % 32`` on
    the pair dot products; 1 to 48 rows of a group, past one 16-row block): O and the
    LSE within verify's rule of the float64 oracle, on the tiles and on the pair products
    alike (the two sum the same exact products in float, in another order)."""
    from flashledger._verify_cases import Shape
    from flashledger.verify import assert_attention_close, make_case

    if not native.amx_dot:
        pytest.skip("no AMX tiles in this native step")
    assert "a bfloat16 cache read in place: scores on AMX tiles" in _native.native_status()
    seen: list[bool] = []
    real = _native.ForwardPass.run_rows

    def spy(self: _native.ForwardPass, *a: Any, **kw: Any) -> Any:
        seen.append(self.amx_dot and kw.get("q16") is not None)
        return real(self, *a, **kw)

    lses: list[torch.Tensor] = []

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Any) -> Any:
        with torch.no_grad():
            out = fl.flash_attention(q, k, v, mask=c.mask, scale=c.scale, return_lse=True)
        lses.append(out[1])
        return out

    case = make_case(Shape(1, 2 * g, 2, lq, lk + lq, 128), "causal_bottom_right", torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native.ForwardPass, "run_rows", spy)
        for on in (True, False):
            native.set_amx_dot(on)
            try:
                assert_attention_close(fn, cases=[case], check_grads=False)
            finally:
                native.set_amx_dot(True)
    assert seen == [True, False], seen
    # the LSE (float32) of the two orders within float32 error of the scores: a score off by
    # a factor or a row of Sᵀ read for another shows here, below bfloat16's rule for O
    diff = (lses[0] - lses[1]).abs()
    worst = int(torch.argmax(diff))
    assert torch.allclose(lses[0], lses[1], rtol=1e-5, atol=1e-5), (
        f"LSE[{worst}] on AMX {lses[0].flatten()[worst]} vs pairs {lses[1].flatten()[worst]}"
    )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    path=st.sampled_from(_calibrate.HALF_PATHS),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    g=st.integers(1, 3),
    lq=st.sampled_from([1, 2, 16, 97, 113]),
    lk=st.sampled_from([1, 97, 113, 300]),
    d=st.sampled_from([8, 24, 64]),
    mask=st.sampled_from(
        ["none", "causal_top_left", "causal_bottom_right", "padding", "empty_rows"]
    ),
    seed=st.integers(0, 2**16),
)
def test_half_inputs_on_the_native_step_keep_the_rule(
    native, native_calls, dtype, path, b, hkv, g, lq, lk, d, mask, seed
):
    """bfloat16/float16 inputs on the native step, on either path (``half``: products on
    MKL's half gemm with P and dS rounded to the dtype; ``float32``: converted up front;
    decode rows reading the cache in place), accumulating in float32, against the float64
    oracle under verify's rule: error within 2x (O, LSE) / 3x (gradients) of naive
    attention in the same dtype, plus the floor; no NaN on fully-masked rows."""
    from flashledger._verify_cases import Shape

    if path not in native.gemm_names(dtype):
        pytest.skip(f"no {path} path for {dtype} here")
    from flashledger.verify import assert_attention_close, make_case

    case = make_case(Shape(b, hkv * g, hkv, lq, lk, d), mask, dtype, seed=seed)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Any) -> Any:
        return fl.flash_attention(
            q,
            k,
            v,
            mask=c.mask,
            scale=c.scale,
            conventions=c.conventions,
            block_q=32,
            block_k=48,
            return_lse=True,
        )

    before = dict(native_calls)
    kept = native.gemm(dtype)
    native.set_gemm(dtype, path)
    try:
        assert_attention_close(fn, cases=[case])
    finally:
        native.set_gemm(dtype, kept)
    assert (
        native_calls["forward"] > before["forward"]
        and native_calls["backward"] > before["backward"]
    )


def test_a_key_tile_no_query_sees_wider_than_every_tile_run(native, gen, outputs_close):
    """The backward zeroes dK, dV of a key tile no query sees without touching scratch
    sized for the tiles that run (here the only tile run is one key wide, the skipped key
    tile four: scratch for four would overrun)."""
    mask = torch.tensor([[False, False, False, False, True]])
    for _ in range(50):
        q, do = (torch.randn(2, 3, 1, 1, dtype=f64, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 3, 5, 1, dtype=f64, generator=gen) for _ in range(2))
        ref = fl.reference_forward(q, k, v, mask=mask, scale=0.3)
        refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask, scale=0.3)
        fwd, bwd = _both(q, k, v, do, mask=mask, scale=0.3, block_q=5, block_k=4)
        outputs_close((fwd, bwd), (ref, refb), rtol=TOL, name="one key seen")


@pytest.mark.parametrize(
    "shape",
    [(1, 8, 2, 1, 700), (1, 2, 2, 12, 12), (2, 4, 2, 97, 113)],
    ids=["decode", "tiny", "gqa-ragged"],
)
def test_a_python_thread_runs_on_pytorchs_thread_count(native, gen, shape):
    """The native step runs on ``torch.get_num_threads()`` threads, also from a Python
    thread (OpenMP keeps a team size per thread, and a new one does not inherit
    ``torch.set_num_threads``): a pass from a Python thread cuts its work (row chunks, key
    splits) as the main thread's does and gives the same bits, forward and backward (the
    ring's in-process twin, threads, and its processes agree on this)."""
    b, hq, hkv, lq, lk = shape
    q = torch.randn(b, hq, lq, 16, generator=gen)
    k, v = (torch.randn(b, hkv, lk, 16, generator=gen) for _ in range(2))
    do = torch.randn(b, hq, lq, 16, generator=gen)
    opts = dict(block_q=4 if lq > 1 else 64, block_k=32, mask=fl.Causal("bottom_right"))

    def run() -> tuple[tuple[torch.Tensor, ...], int]:
        fwd = fl.blocked_forward(q, k, v, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
        return (fwd.o, fwd.lse, bwd.dq, bwd.dk, bwd.dv), native.max_threads()

    before = torch.get_num_threads()
    try:
        for n in sorted({1, max(2, before)}):
            torch.set_num_threads(n)
            main, threads = run()
            assert threads == n
            other: list[tuple[tuple[torch.Tensor, ...], int]] = []
            t = threading.Thread(target=lambda out=other: out.append(run()))
            t.start()
            t.join()
            assert other[0][1] == n, f"a Python thread ran on {other[0][1]} threads, not {n}"
            for name, a, c in zip(("o", "lse", "dq", "dk", "dv"), main, other[0][0]):
                assert torch.equal(a, c), f"{name}: a Python thread's pass differs ({n} threads)"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_to_a_half_dtype_matches_pytorch(native, gen, dtype):
    """P and dS are rounded to the input dtype as PyTorch rounds (nearest, ties to even;
    subnormals kept; overflow to inf; NaN stays NaN), in the vector body and the tail."""
    fi = torch.finfo(dtype)
    special = torch.tensor(
        [0.0, -0.0, 1.0, fi.max, fi.max * 1.01, -fi.max * 1.01, fi.tiny, fi.tiny / 3,
         -fi.tiny / 7, 1e-40, -1e-42, float("inf"), float("-inf"), 1 + fi.eps / 2,
         1 + 3 * fi.eps / 2, 1 + fi.eps / 2 + 1e-7],
        dtype=torch.float32,
    )  # fmt: skip
    x = torch.cat(
        [
            special,
            torch.randn(1000, generator=gen)
            * 10.0 ** torch.randint(-45, 6, (1000,), generator=gen),
        ]
    )
    for n in (x.numel(), 16 * 7 + 5):  # whole vectors and a tail
        got = native.round_to(x[:n], dtype)
        want = x[:n].to(dtype)
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        worst = int((~same).nonzero()[0]) if not bool(same.all()) else -1
        assert bool(same.all()), f"{x[worst].item()!r}: got {got[worst]}, want {want[worst]}"
    nan = native.round_to(torch.tensor([float("nan")] * 20), dtype)
    assert bool(nan.isnan().all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_gemm_sums_the_rounded_operands_in_float32(native, gen, dtype):
    """``matmul`` with half operands and a float32 result (MKL's half gemm) gives the
    float32 product of the same half values, within float32 summation error."""
    if "half" not in native.gemm_names(dtype):
        pytest.skip(f"PyTorch's library has no half gemm for {dtype} here")
    a = torch.randn(70, 130, generator=gen).to(dtype)
    b = torch.randn(130, 45, generator=gen).to(dtype)
    c = torch.empty(70, 45)
    native.matmul(a, b, c)
    want = a.double() @ b.double()
    bound = 130 * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs())
    err = (c.double() - want).abs()
    assert bool((err <= bound).all()), f"worst {float((err - bound).max())} over the bound"


def test_flashledger_half_forces_the_path(native, tmp_path, monkeypatch, small_calibration):
    """FLASHLEDGER_HALF=float32 converts half inputs whatever was measured; a value that is
    not a path here warns and measures."""
    monkeypatch.setenv("FLASHLEDGER_HALF", "float32")
    with _gemms_kept(native):
        got = _calibrate.choose(native, tmp_path / "c.json")
    for dt in (torch.bfloat16, torch.float16):
        assert got[dt].gemm == "float32" and got[dt].how == "FLASHLEDGER_HALF=float32"
    monkeypatch.setenv("FLASHLEDGER_HALF", "tiles")
    with _gemms_kept(native), pytest.warns(UserWarning, match="FLASHLEDGER_HALF='tiles'"):
        got = _calibrate.choose(native, tmp_path / "d.json")
    assert {got[dt].gemm for dt in (torch.bfloat16, torch.float16)} <= set(_calibrate.HALF_PATHS)


def test_flashledger_half_amx_is_bfloat16s_path(native, tmp_path, monkeypatch, small_calibration):
    """FLASHLEDGER_HALF=amx: bfloat16 on AMX's tiles and float16 in its dtype on the half
    gemm where the CPU has AMX; elsewhere a warning, and the paths are measured."""
    monkeypatch.setenv("FLASHLEDGER_HALF", "amx")
    if "amx" not in native.gemm_names(torch.bfloat16):
        with _gemms_kept(native), pytest.warns(UserWarning, match="FLASHLEDGER_HALF='amx'"):
            got = _calibrate.choose(native, tmp_path / "c.json")
        assert got[torch.bfloat16].gemm in _calibrate.HALF_PATHS
        return
    with _gemms_kept(native):
        got = _calibrate.choose(native, tmp_path / "c.json")
    assert got[torch.bfloat16].gemm == "amx" and got[torch.float16].gemm == "half"
    assert got[torch.bfloat16].how == "FLASHLEDGER_HALF=amx"
    assert "AMX tiles" in got[torch.bfloat16].describe()


@pytest.mark.parametrize(
    "shape",
    [
        (1, 2, 2, 97, 1, 64, 64),
        (2, 4, 2, 47, 31, 32, 16),
        (1, 3, 1, 97, 113, 64, 48),
        (1, 2, 2, 300, 257, 128, 128),
        (1, 1, 1, 80, 1000, 64, 64),
    ],
    ids=["one-key", "gqa-ragged-32", "ragged-dv48", "d128", "long-keys"],
)
@pytest.mark.parametrize("mask", ["none", "causal_bottom_right", "padding", "empty_rows"])
@pytest.mark.parametrize("scale", [0.0, -0.3, 2.5])
def test_the_amx_forward_keeps_the_rule(native, native_calls, gen, shape, mask, scale):
    """bfloat16 on AMX's tiles (where the CPU has them): shapes that break its 16-row and
    32-key blocks (a ragged last row block, keys that start mid-block in partial tiles,
    one key, GQA) and tiles of 32 x 48 keys, at the default scale, a negative one (the
    products are scaled after the tiles, before the mask) and a large one (scores in the
    hundreds: the row's maximum must weigh exactly 1), under verify's rule against the
    float64 oracle, and no NaN on fully masked rows; the pass really ran on the tiles (its
    K and V laid out in AMX's pair layout)."""
    if "amx" not in native.gemm_names(torch.bfloat16):
        pytest.skip("no AMX here")
    from flashledger._verify_cases import Shape
    from flashledger.verify import assert_attention_close, make_case

    b, hq, hkv, lq, lk, d, dv = shape
    case = make_case(
        Shape(b, hq, hkv, lq, lk, d, dv), mask, torch.bfloat16, scale=scale, seed=lq * lk
    )
    packed = []
    real = native.fn("fl_pack_amx", "bf16")

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Any) -> Any:
        return fl.flash_attention(
            q, k, v, mask=c.mask, scale=c.scale, conventions=c.conventions,
            block_q=32, block_k=48, return_lse=True,
        )  # fmt: skip

    kept = native.gemm(torch.bfloat16)
    native.set_gemm(torch.bfloat16, "amx")
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, native, "fn", native.fn)
            native.fn = lambda name, suffix: (  # type: ignore[method-assign]
                (lambda *a: packed.append(a) or real(*a))
                if name == "fl_pack_amx"
                else _native.Kernels.fn(native, name, suffix)
            )
            assert_attention_close(fn, cases=[case])
    finally:
        native.set_gemm(torch.bfloat16, kept)
    assert packed, "the forward did not run on AMX's tiles"


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from([torch.float32, torch.float64]),
    splits=st.integers(2, 16),
    heads=st.integers(1, 5),
    lq=st.integers(1, 9),
    dv=st.sampled_from([1, 7, 64]),
    empty=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_the_native_merge_of_key_splits_is_the_one_merge(
    native, dtype, splits, heads, lq, dv, empty, seed
):
    """``merge_splits`` (the decode path's merge of its key splits, in C) gives what
    ``online.merge_partials`` gives for the same stacked parts: parts that saw no key
    (LSE -inf) weigh nothing, a row no part saw gives O = 0 and LSE -inf, and the rest
    agree to a few units in the last place."""
    from flashledger import online

    g = torch.Generator().manual_seed(seed)
    o = torch.randn(splits, heads, lq, dv, generator=g, dtype=dtype)
    lse = torch.randn(splits, heads, lq, generator=g, dtype=dtype) * 30
    gone = torch.rand(splits, heads, lq, generator=g) < empty
    gone[:, 0, 0] = True  # a row that no part saw
    lse[gone] = -math.inf
    o[gone] = 0.0
    want_o, want_lse = online.merge_partials(o, lse)
    got_o, got_lse = native.merge_splits(o.clone(), lse.clone())
    assert got_o.shape == want_o.shape and got_lse.shape == want_lse.shape
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
    assert bool((got_o[0, 0] == 0).all()) and bool(torch.isneginf(got_lse[0, 0]))
    eps = torch.finfo(dtype).eps
    for name, a, b in (("o", got_o, want_o), ("lse", got_lse, want_lse)):
        fin = torch.isfinite(b)
        err = (a[fin] - b[fin]).abs()
        bound = 4 * splits * eps * (b[fin].abs() + o.abs().amax())
        worst = int(torch.argmax(err - bound)) if err.numel() else 0
        assert bool((err <= bound).all()), f"{name}: {a[fin][worst]} vs {b[fin][worst]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_full_tile_s_maxima_from_the_product_are_the_pass_s(native, gen, dtype):
    """The own kernel hands a forward's full tiles their rows' score maxima as it writes S
    back: O, the LSE and the rows' maxima are bit for bit those the pass over S gives, with
    tiles ragged at both ends, a causal mask's partial tiles beside full ones, GQA, a narrow
    head, and scores all negative (where a ragged key vector's unused lanes, left in,
    would be the maximum); and the product gave them (its count of blocks)."""
    if "own" not in native.gemm_names(dtype):
        pytest.skip("no own kernel here")
    cases = [  # lq, lk, d, hq, hk, mask, scores all negative
        (113, 97, 24, 2, 2, None, False),
        (200, 300, 64, 4, 2, fl.Causal(), False),
        (97, 113, 80, 2, 1, None, True),
        (40, 257, 16, 1, 1, None, True),
        (64, 96, 64, 2, 2, None, False),
    ]
    with _gemms_kept(native):
        native.set_gemm(dtype, native.gemm(dtype), forward="own")
        for lq, lk, d, hq, hk, mask, negative in cases:
            q = torch.randn(1, hq, lq, d, generator=gen, dtype=dtype)
            k = torch.randn(1, hk, lk, d, generator=gen, dtype=dtype)
            v = torch.randn(1, hk, lk, d, generator=gen, dtype=dtype)
            if negative:
                q, k = q.abs() + 0.5, -(k.abs() + 0.5)
            opts: dict[str, Any] = dict(mask=mask, block_q=32, block_k=48, row_max=True)
            native.product_maxima_blocks(dtype)
            got = fl.blocked_forward(q, k, v, **opts)
            blocks = native.product_maxima_blocks(dtype)
            native.set_product_maxima(dtype, False)
            try:
                want = fl.blocked_forward(q, k, v, **opts)
                assert native.product_maxima_blocks(dtype) == 0
            finally:
                native.set_product_maxima(dtype, True)
            where = f"lq={lq} lk={lk} d={d} mask={mask}"
            assert blocks > 0, f"{where}: no block took its maxima from the product"
            assert got.row_max is not None and want.row_max is not None
            if negative:
                assert bool((got.row_max < 0).all()), where
            for name, a, b in (("o", got.o, want.o), ("lse", got.lse, want.lse)):
                assert torch.equal(a, b), f"{where}: {name} differs"
            assert torch.equal(got.row_max, want.row_max), f"{where}: row maxima differ"
    with pytest.raises(ValueError, match="only the float32 and float64 steps"):
        native.set_product_maxima(torch.bfloat16, True)
    with pytest.raises(ValueError, match="only the float32 and float64 steps"):
        native.product_maxima_blocks(torch.float16)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from([torch.float32, torch.float64]),
    rows=st.integers(1, 300),
    n=st.sampled_from([1, 3, 16, 17, 64, 100, 256]),
    seed=st.integers(0, 2**16),
)
def test_the_native_row_dots_are_d_within_the_sum_s_bound(native, dtype, rows, n, seed):
    """``row_dots`` (D = rowsum(dO ⊙ O), one native pass over both) agrees with the sum
    formed in float64 within the bound of an n-term dot product in ``dtype`` (n·u·Σ|x y|,
    whatever order the lanes take), and the backward reads it: its D is this call's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, n, generator=g, dtype=dtype)
    y = torch.randn(2, rows, n, generator=g, dtype=dtype) * 1e3
    got = native.row_dots(x, y)
    assert got.shape == (2, rows) and got.dtype == dtype
    exact = (x.double() * y.double()).sum(-1)
    bound = (n + 1) * torch.finfo(dtype).eps * (x.double() * y.double()).abs().sum(-1)
    err = (got.double() - exact).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"D{list(divmod(worst, rows))} = {got.flatten()[worst]}, float64 {exact.flatten()[worst]}"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_native_row_dots_widen_half_rows_as_read(native, gen, dtype):
    """Half rows are widened as read (exact) and summed in float32 as float32 rows are:
    the same sums, bit for bit, as the call on the rows converted up front."""
    for n in (1, 17, 64, 100):
        x, y = (torch.randn(3, 41, n, generator=gen).to(dtype) for _ in range(2))
        got = native.row_dots(x, y)
        assert got.dtype == torch.float32
        assert torch.equal(got, native.row_dots(x.float(), y.float())), n


def test_the_native_backward_reads_the_native_row_dots(native, native_calls, gen):
    """The native backward's D is ``row_dots`` of dO and O bit for bit; a traced backward
    (the PyTorch step) keeps the tensor form's, which agrees within the sum's bound."""
    q, k, v, do = (torch.randn(1, 2, 97, 24, generator=gen) for _ in range(4))
    fwd = fl.blocked_forward(q, k, v, mask=fl.Causal())
    want = native.row_dots(do.contiguous(), fwd.o.contiguous())
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, mask=fl.Causal())
    assert native_calls["backward"] == 1 and torch.equal(bwd.D, want)
    traced = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, mask=fl.Causal(), trace=True)
    assert torch.equal(traced.D, (do * fwd.o).sum(-1))
    bound = 25 * torch.finfo(torch.float32).eps * (do * fwd.o).abs().sum(-1)
    assert bool(((traced.D - bwd.D).abs() <= bound).all())


def test_the_native_row_dots_refuse_what_they_cannot_read(native):
    x = torch.randn(3, 8)
    for a, b, what in (
        (x.half(), x.bfloat16(), "one floating dtype alike"),
        (x, x.double(), "one floating dtype alike"),
        (x.int(), x.int(), "one floating dtype alike"),
        (x, x[:, :4], "one shape"),
        (x.t(), x.t(), "contiguous"),
    ):
        with pytest.raises(ValueError, match=what):
            native.row_dots(a, b)


@pytest.mark.parametrize("path", ["half", "amx"])
def test_the_half_step_checks_o_as_it_writes_it(native, gen, path):
    """The half step writes O in its dtype and checks O and the LSE as it writes them: a
    result that is finite needs no second look and equals the one checked afterwards (the
    float32 O the pass wrote before, rounded); scores that overflow float32 are still
    reported with the row they reach, as the check after the pass reports them."""
    if path not in native.gemm_names(torch.bfloat16):
        pytest.skip(f"no {path} path here")
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen).bfloat16() for _ in range(3))
    kept = native.gemm(torch.bfloat16)
    native.set_gemm(torch.bfloat16, path)
    try:
        got = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=64, block_k=64)
        plain = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=64, block_k=64, raw_lse=True)
        assert got.o.dtype == torch.bfloat16 and torch.equal(got.o, plain.o)
        assert torch.equal(got.lse, plain.lse)
        q_big = q.clone()
        q_big[0, 1, 150] *= 1e30
        with pytest.raises(ValueError, match=r"o\[0, 1, 150, :\]"):
            fl.blocked_forward(q_big, k * 1e10, v, block_q=64, block_k=64)
    finally:
        native.set_gemm(torch.bfloat16, kept)


def test_o_in_a_half_dtype_comes_from_one_merged_part_of_the_half_step(native, gen):
    """``ForwardPass.run(out_dtype=...)`` refuses what it cannot write: a float pass, or a
    pass of several parts."""
    q, k, v = (x[0] for x in (torch.randn(1, 2, 8, 8, generator=gen) for _ in range(3)))
    sched = _native.Schedule()
    sched.add(0, 8, 0, 4, None)
    sched.add(0, 8, 4, 8, None)
    sched.end_row(0, 8)
    for splits in (1, 2):
        fp = _native.ForwardPass(
            native, q, k, v, sched, group=1, scale=0.5, heads_per_batch=2, intervals=None,
            chunk=8, splits=splits, stacked=False, keys_in_place=False,
        )  # fmt: skip
        with pytest.raises(ValueError, match="merged pass of one part of the half step"):
            fp.run(q, k, v, merge=True, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["half", "float32"])
def test_half_inputs_get_dk_and_dv_in_their_dtype_from_the_pass(
    native, gen, monkeypatch, dtype, path
):
    """Half inputs, on either path: the backward pass writes dK and dV in the inputs' dtype
    itself (no float32 copy of either, no conversion after), the same bits as the float32
    values the same pass writes without it, rounded as PyTorch rounds them; dQ (summed over
    the key tiles) stays float32; a key tile no query sees is zeros; the call returns them."""
    if path not in native.gemm_names(dtype):
        pytest.skip(f"no {path} path for {dtype} here")
    seen: list[tuple[Any, ...]] = []
    real = native.backward

    def twice(*args: Any, out_dtype: Any = None, **kw: Any) -> Any:
        got = real(*args, out_dtype=out_dtype, **kw)
        seen.append((out_dtype, got, real(*args, out_dtype=None, **kw)))
        return got

    monkeypatch.setattr(native, "backward", twice)
    q = torch.randn(2, 4, 97, 24, generator=gen).to(dtype)  # GQA, ragged tiles
    k, v = (torch.randn(2, 2, 113, 24, generator=gen).to(dtype) for _ in range(2))
    do = torch.randn(2, 4, 97, 24, generator=gen).to(dtype)
    opts = dict(mask=fl.Causal(), block_q=32, block_k=16)  # keys 97.. are seen by no query
    kept = native.gemm(dtype)
    native.set_gemm(dtype, path)
    try:
        fwd = fl.blocked_forward(q, k, v, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
    finally:
        native.set_gemm(dtype, kept)
    assert [s[0] for s in seen] == [dtype]
    (dq, dk, dv), (dq32, dk32, dv32) = seen[0][1:]
    assert dq.dtype == dk32.dtype == dv32.dtype == torch.float32
    assert dk.dtype == dv.dtype == dtype
    assert torch.equal(dq, dq32)
    for name, got, wide in (("dk", dk, dk32), ("dv", dv, dv32)):
        want = wide.to(dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (
            f"{name}: {int((got != want).sum())} values differ from PyTorch's rounding"
        )
    assert not dk32[:, 112:].any() and not dk[:, 112:].any()
    assert torch.equal(bwd.dk, dk.view(2, 2, 113, 24)) and torch.equal(
        bwd.dv, dv.view(2, 2, 113, 24)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case",
    [
        dict(hq=4, hk=2, lq=97, lk=113, d=24, dv=24, opts=dict(mask=fl.Causal())),
        dict(hq=2, hk=2, lq=70, lk=90, d=16, dv=8, opts=dict(softcap=5.0)),
        dict(hq=2, hk=1, lq=65, lk=80, d=16, dv=16, opts=dict(alibi_slopes=[0.5, 0.25])),
        dict(hq=2, hk=2, lq=33, lk=50, d=16, dv=16, opts=dict(bias=True)),
        dict(hq=1, hk=1, lq=40, lk=37, d=272, dv=264, opts={}),  # rows past 256 columns
    ],
    ids=["gqa-causal", "softcap", "alibi", "bias", "wide-head"],
)
def test_half_inputs_on_the_float32_step_are_widened_as_read(native, gen, monkeypatch, dtype, case):
    """Half inputs on the float32 path are read in their dtype, each row widened as a pass
    reads it (no float32 copy of q, k, v or dO, no Kᵀ or Vᵀ of the whole sequence in the
    backward): the results are bit for bit those of the float32 step on the inputs
    converted (O and the gradients rounded as PyTorch rounds them)."""
    if "float32" not in native.gemm_names(dtype):
        pytest.skip(f"no float32 path for {dtype} here")
    hq, hk, lq, lk, d, dv = (case[n] for n in ("hq", "hk", "lq", "lk", "d", "dv"))
    q = torch.randn(2, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(2, hk, lk, d, generator=gen).to(dtype)
    v = torch.randn(2, hk, lk, dv, generator=gen).to(dtype)
    do = torch.randn(2, hq, lq, dv, generator=gen).to(dtype)
    opts: dict[str, Any] = dict(case["opts"], block_q=32, block_k=16)
    if "bias" in opts:
        opts["bias"] = torch.randn(lq, lk, generator=gen).to(dtype)
    if "alibi_slopes" in opts:
        opts["alibi_slopes"] = torch.tensor(opts["alibi_slopes"])
    calls: list[tuple[str, bool, tuple[torch.dtype, ...]]] = []
    for name in ("forward", "backward"):
        real = getattr(native, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append((_name, kw.get("widen", False), tuple(a.dtype for a in args[:3])))
            return _real(*args, **kw)

        monkeypatch.setattr(native, name, spy)
    kept = native.gemm(dtype)
    native.set_gemm(dtype, "float32")
    try:
        fwd = fl.blocked_forward(q, k, v, **opts)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
        wide = {
            n: x.float() if isinstance(x, torch.Tensor) and n == "bias" else x
            for n, x in opts.items()
        }
        q32, k32, v32 = (x.float() for x in (q, k, v))
        f32 = fl.blocked_forward(q32, k32, v32, **wide)
        b32 = fl.blocked_backward(q32, k32, v32, fwd.o.float(), fwd.lse, do.float(), **wide)
    finally:
        native.set_gemm(dtype, kept)
    half = [c for c in calls if c[2][0] == dtype]
    assert [c[0] for c in half] == ["forward", "backward"] and all(c[1] for c in half), calls
    assert all(dt == dtype for c in half for dt in c[2])  # no float32 copy handed to the step
    assert torch.equal(fwd.lse, f32.lse)
    pairs = [("o", fwd.o, f32.o), ("dq", bwd.dq, b32.dq), ("dk", bwd.dk, b32.dk)]
    for name, got, want in [*pairs, ("dv", bwd.dv, b32.dv)]:
        assert got.dtype == dtype, name
        want = want.to(dtype)
        diff = got.view(torch.int16) != want.view(torch.int16)
        assert not diff.any(), (
            f"{name}: {int(diff.sum())} values differ, first at {diff.nonzero()[0].tolist()}"
        )


def test_a_widening_pass_takes_one_half_dtype(native):
    """``widen`` reads q, k, v (and dO) of one half dtype, Kᵀ laid out; anything else is
    refused with what was given."""
    sched = _one_tile()
    q, k, v = (torch.zeros(1, 8, 16, dtype=torch.float16) for _ in range(3))
    common = dict(group=1, scale=0.25, heads_per_batch=1)
    with pytest.raises(ValueError, match=r"one half dtype .* got torch.float16, torch.float32"):
        native.forward(q, k.float(), v, sched, chunk=8, widen=True, **common)
    with pytest.raises(ValueError, match="one half dtype"):
        native.forward(q.float(), k.float(), v.float(), sched, chunk=8, widen=True, **common)
    with pytest.raises(ValueError, match="keys in place"):
        native.forward(q, k, v, sched, chunk=8, widen=True, keys_in_place=True, **common)
    lam, dd = torch.zeros(1, 8), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="dout"):
        native.backward(q, k, v, q.float(), lam, dd, _one_tile(), widen=True, **common)


def _one_tile() -> _native.Schedule:
    """A schedule of one full 8 x 8 tile."""
    sched = _native.Schedule()
    sched.add(0, 8, 0, 8, None)
    sched.end_row(0, 8)
    return sched


def test_a_forward_takes_its_own_measured_tiles(native, gen, monkeypatch):
    """Without tiles given, a forward pass runs the forward's own measured tiles and a
    backward the forward + backward ones; with a mask_mod (whose evaluations are kept per
    tile for the backward) both run the latter; tiles given win everywhere."""
    dt = torch.float64
    native.choose(dt)
    c = native.choices[dt]
    mine = replace(c, block_q=32, block_k=48, forward_block_q=64, forward_block_k=16)
    monkeypatch.setitem(native.choices, dt, mine)
    q, k, v, do = (torch.randn(1, 2, 100, 8, dtype=dt, generator=gen) for _ in range(4))
    f = fl.blocked_forward(q, k, v, mask=fl.Causal())
    b = fl.blocked_backward(q, k, v, f.o, f.lse, do, mask=fl.Causal())
    assert (f.ledger.block_q, f.ledger.block_k) == (64, 16)
    assert (b.ledger.block_q, b.ledger.block_k) == (32, 48)
    mm = fl.MaskMod(lambda b_, h, qi, ki: qi >= ki)
    f = fl.blocked_forward(q, k, v, mask=mm)
    assert (f.ledger.block_q, f.ledger.block_k) == (32, 48)
    f = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=20, block_k=30)
    assert (f.ledger.block_q, f.ledger.block_k) == (20, 30)
    assert native.tiles(dt, forward=True) == (64, 16) and native.tiles(dt) == (32, 48)
    assert "tiles 32x48, forward 64x16" in _native.native_status()


def test_finiteness_checks_run_natively_once_the_step_is_loaded(native):
    """A contiguous float32/float64 check reads the tensor in one native pass in this
    thread (no PyTorch reduction: each is a parallel region, which waits a time slice when
    another process keeps the cores busy) and answers as isfinite().all() does; anything
    else, or the native step off, takes the reduction."""
    from flashledger._checks import all_finite

    assert _native.kernels() is not None and _native.loaded() is not None
    for dt in (torch.float32, torch.float64):
        x = torch.randn(3, 5, 64, dtype=dt)
        specials = (0.0, -0.0, math.nan, math.inf, -math.inf, torch.finfo(dt).max, 1e-310)
        with mock.patch.object(torch.Tensor, "sum", side_effect=AssertionError("a reduction")):
            for value in specials:
                y = x.clone()
                y[2, 4, 63] = value
                assert all_finite(y) == bool(torch.isfinite(y).all()), (dt, value)
                assert all_finite(y[1:]) == bool(torch.isfinite(y[1:]).all()), (dt, value)
    y = torch.randn(4, 8).mT  # not contiguous: the reduction reads it
    y[3, 2] = math.nan
    assert not all_finite(y)
    with _native.disabled():
        assert _native.loaded() is None
        assert all_finite(torch.ones(8)) and not all_finite(torch.tensor([1.0, math.inf]))
