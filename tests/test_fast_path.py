"""The fast path (tracing off) is the traced loop without its records, at benchmark tile sizes.

Every case runs the blocked forward and backward with ``trace=False`` and
``trace=True``. With the PyTorch tile step the two must be identical bit for
bit; with the native tile step (``_native``: CPU, float32/float64, plain
scores, no dropout) they must agree to roundoff. Counters are always equal,
and every result must equal the float64 oracle to 1e-12 (the rule of
``conftest.assert_close``). Tiles include the defaults and ragged ones;
lengths are chosen so that the defaults tile them raggedly too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashledger as fl
from flashledger import _native, bench, cli
from flashledger.blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q

TOL = 1e-12
f64 = torch.float64
TILES = [(DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K), (64, 64), (128, 32), (37, 100)]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = f64) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, generator=gen)


def _case(name: str, gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Inputs ``(q, k, v, do)`` and options of one named feature combination."""
    b, hq, hkv, lq, lk, d, dv = 1, 2, 2, 300, 280, 16, 16
    opts: dict[str, Any] = {}
    if name == "causal-br":
        opts["mask"] = fl.Causal("bottom_right")
    elif name == "window+padding":
        b = 2
        opts["mask"] = fl.SlidingWindow(70, 5) & fl.KeyPadding([280, 133])
    elif name == "gqa+dense":
        hq, hkv = 4, 2
        dense = torch.rand(b, hq, lq, lk, generator=gen) < 0.7
        dense[0, 1, 10] = False  # a fully-masked row
        opts["mask"] = dense
    elif name == "scale-not-power-of-two":
        d = dv = 24  # 1/sqrt(24) is applied after the matmul, as the reference does
    elif name == "d!=dv+scale":
        dv, opts["scale"] = 9, 0.3
    elif name == "dropout":
        opts.update(dropout_p=0.2, seed=11, mask=fl.Causal())
    elif name == "softcap+alibi":
        opts.update(softcap=2.5, alibi_slopes=fl.alibi_slopes(hq, dtype=f64))
    elif name == "softcap+window":  # a softcap alone: capped in the native passes
        opts.update(softcap=1.5, mask=fl.SlidingWindow(90, 20))
    elif name == "bias":
        opts["bias"] = _randn(gen, 1, hq, lq, lk)
    elif name == "alibi+varlen":  # per-sequence slopes, bottom-right causal in each
        b, lk = 1, lq
        opts.update(
            cu_seqlens_q=torch.tensor([0, 120, 300], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 160, 300], dtype=torch.int32),
            mask=fl.Causal("bottom_right"),
            alibi_slopes=_randn(gen, 2, hq).abs(),
        )
    elif name == "varlen":
        b, lk = 1, lq
        opts.update(
            cu_seqlens_q=torch.tensor([0, 120, 300], dtype=torch.int32),
            cu_seqlens_k=torch.tensor([0, 160, 300], dtype=torch.int32),
            mask=fl.Causal("bottom_right"),
        )
    elif name == "conventions":
        opts.update(conventions=fl.FLASH_ATTN_2, mask=fl.Causal())
    elif name != "plain":
        raise ValueError(name)
    lead_q, lead_k = ((b, hq), (b, hkv)) if "cu_seqlens_q" not in opts else ((hq,), (hkv,))
    q = _randn(gen, *lead_q, lq, d)
    k = _randn(gen, *lead_k, lk, d)
    v = _randn(gen, *lead_k, lk, dv)
    do = _randn(gen, *lead_q, lq, dv)
    return (q, k, v, do), opts


NATIVE_CASES = {  # the cases whose tile step runs natively (no softcap, no dropout)
    "plain", "causal-br", "window+padding", "gqa+dense", "scale-not-power-of-two",
    "d!=dv+scale", "softcap+alibi", "alibi+varlen", "bias", "softcap+window", "varlen",
    "conventions",
}  # fmt: skip

CASES = [
    "plain",
    "causal-br",
    "window+padding",
    "gqa+dense",
    "scale-not-power-of-two",
    "d!=dv+scale",
    "dropout",
    "softcap+alibi",
    "softcap+window",
    "alibi+varlen",
    "bias",
    "varlen",
    "conventions",
]


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    trace: bool,
    dlse: torch.Tensor | None = None,
    **opts: Any,
) -> tuple[fl.ForwardResult, fl.BackwardResult]:
    fwd = fl.blocked_forward(q, k, v, trace=trace, **opts)
    bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, dlse=dlse, trace=trace, **opts)
    return fwd, bwd


def _outputs(fwd: fl.ForwardResult, bwd: fl.BackwardResult) -> dict[str, torch.Tensor | None]:
    return {
        "O": fwd.o,
        "LSE": fwd.lse,
        "dQ": bwd.dq,
        "dK": bwd.dk,
        "dV": bwd.dv,
        "dBias": bwd.dbias,
        "D": bwd.D,
    }


def _first_difference(t: torch.Tensor, s: torch.Tensor) -> tuple[int, ...] | None:
    same = (t == s) | (torch.isnan(t) & torch.isnan(s))
    if bool(same.all()):
        return None
    return tuple(int(i) for i in torch.nonzero(~same)[0].tolist())


@pytest.mark.parametrize("step", ["pytorch", "native"])
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("name", CASES)
def test_fast_path_equals_traced_path_and_oracle(name, tiles, step, gen, assert_close, request):
    (q, k, v, do), opts = _case(name, gen)
    bq, bk = tiles
    ref = fl.reference_forward(q, k, v, **opts)
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
    if step == "native":
        calls = request.getfixturevalue("native_calls")
        fast = _run(q, k, v, do, trace=False, block_q=bq, block_k=bk, **opts)
        runs = (1, 1) if name in NATIVE_CASES else (0, 0)
        assert (calls["forward"], calls["backward"]) == runs, f"native passes {calls}"
    else:
        with _native.disabled():
            fast = _run(q, k, v, do, trace=False, block_q=bq, block_k=bk, **opts)
    traced = _run(q, k, v, do, trace=True, block_q=bq, block_k=bk, **opts)
    assert not fast[0].ledger.records and not fast[1].ledger.records, "fast path kept records"
    assert traced[0].ledger.records and traced[1].ledger.records, "traced path kept no records"
    got, seen = _outputs(*fast), _outputs(*traced)
    want = {"O": ref.o, "LSE": ref.lse, "dQ": refb.dq, "dK": refb.dk, "dV": refb.dv}
    want.update(dBias=refb.dbias, D=refb.D)
    for key, t in got.items():
        s = seen[key]
        if t is None or s is None:
            assert t is None and s is None and want[key] is None, f"{key}: present on one path only"
            continue
        where = f"{key} ({name}, {bq}x{bk}, {step} step)"
        if step == "pytorch" or name not in NATIVE_CASES:
            idx = _first_difference(t, s)
            if idx is not None:
                raise AssertionError(
                    f"{where}: fast {t[idx].item()!r} != traced {s[idx].item()!r} at {idx}; "
                    "tracing must not change the arithmetic"
                )
        else:
            assert_close(t, s, rtol=1e-13, name=f"{where} vs traced")
        assert_close(t, want[key], rtol=TOL, name=f"fast {where}")
    for p in range(2):
        assert fast[p].ledger.counters == traced[p].ledger.counters, (
            f"counters differ ({'forward' if p == 0 else 'backward'}): "
            f"{fast[p].ledger.counters} vs {traced[p].ledger.counters}"
        )


@pytest.mark.parametrize("loop_order", ["fa2", "fa1"])
def test_fast_path_with_lse_gradient_and_loop_orders(loop_order, gen, assert_close):
    (q, k, v, do), opts = _case("causal-br", gen)
    dlse = _randn(gen, *q.shape[:-1])
    opts.update(block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, loop_order=loop_order)
    ref = fl.reference_forward(q, k, v, mask=opts["mask"])
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, dlse=dlse, mask=opts["mask"])
    nfwd, nbwd = _run(q, k, v, do, trace=False, dlse=dlse, **opts)
    with _native.disabled():
        fwd, bwd = _run(q, k, v, do, trace=False, dlse=dlse, **opts)
    tfwd, tbwd = _run(q, k, v, do, trace=True, dlse=dlse, **opts)
    for key, n, t, s, w in (
        ("O", nfwd.o, fwd.o, tfwd.o, ref.o),
        ("dQ", nbwd.dq, bwd.dq, tbwd.dq, refb.dq),
        ("dK", nbwd.dk, bwd.dk, tbwd.dk, refb.dk),
        ("dV", nbwd.dv, bwd.dv, tbwd.dv, refb.dv),
    ):
        assert torch.equal(t, s), f"{key} ({loop_order}): tracing changed the result"
        assert_close(t, w, rtol=TOL, name=f"{key} with dLSE ({loop_order})")
        assert_close(n, w, rtol=TOL, name=f"{key} with dLSE ({loop_order}, native step)")


@pytest.mark.parametrize("name", ["plain", "scale-not-power-of-two", "softcap+alibi", "bias"])
def test_backward_rebuilds_the_scores_of_the_forward_bit_for_bit(name, gen):
    """``P = exp(S - λ)`` is rebuilt from exactly the ``S`` that produced ``λ``."""
    (q, k, v, do), opts = _case(name, gen)
    fwd, bwd = _run(q, k, v, do, trace=True, block_q=64, block_k=96, **opts)
    forward_s = {(r.q_tile, r.k_tile): r.s for r in fwd.ledger.records}
    assert len(forward_s) == len(bwd.ledger.records) > 1
    for r in bwd.ledger.records:
        s = forward_s[(r.q_tile, r.k_tile)]
        assert r.s is not None and s is not None
        diff = r.s != s
        assert not bool(diff.any()), (
            f"tile Q{r.q_tile} x K{r.k_tile} ({name}): backward S differs from the forward's "
            f"at {tuple(torch.nonzero(diff)[0].tolist())}"
        )


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_fast_counters_match_the_closed_forms(tiles, gen):
    """No mask: every tile full; with a causal mask, visible dots count the lower triangle."""
    b, h, lq, lk, d = 2, 3, 300, 280, 16
    q, k, v, do = (_randn(gen, b, h, n, d) for n in (lq, lk, lk, lq))
    bq, bk = tiles
    tq, tk = math.ceil(lq / bq), math.ceil(lk / bk)
    fwd, bwd = _run(q, k, v, do, trace=False, block_q=bq, block_k=bk)
    for c, extra in ((fwd.ledger.counters, b * h * lq * tk), (bwd.ledger.counters, 0)):
        assert (c.tiles_run, c.tiles_full, c.tiles_partial, c.tiles_skipped) == (
            tq * tk,
            tq * tk,
            0,
            0,
        )
        assert c.qk_dots_visible == c.qk_dots_computed == b * h * lq * lk
        assert c.exps == b * h * lq * lk + extra, f"exps {c.exps}"
    fwd, bwd = _run(q, k, v, do, trace=False, block_q=bq, block_k=bk, mask=fl.Causal())
    visible = b * h * sum(min(i + 1, lk) for i in range(lq))
    for c in (fwd.ledger.counters, bwd.ledger.counters):
        assert c.qk_dots_visible == visible, f"visible {c.qk_dots_visible} != {visible}"
        assert c.tiles_run + c.tiles_skipped == tq * tk
        assert c.qk_dots_computed >= visible


@pytest.mark.parametrize(
    ("dtype", "acc", "rtol"),
    [
        (torch.float64, torch.float64, TOL),
        (torch.float32, torch.float32, 2e-5),
        (torch.float16, torch.float32, 4e-3),
        (torch.bfloat16, torch.float32, 3e-2),
    ],
    ids=["float64", "float32", "float16", "bfloat16"],
)
def test_dtypes_keep_their_accumulator(dtype, acc, rtol, gen, assert_close):
    """float64 stays float64; float32, float16 and bfloat16 accumulate in float32."""
    x = [_randn(gen, 2, 300, 16) for _ in range(4)]
    q, k, v, do = (t.to(dtype) for t in x)
    fwd, bwd = _run(q, k, v, do, trace=False, mask=fl.Causal())
    assert fwd.o.dtype == dtype and bwd.dq.dtype == dtype and bwd.dv.dtype == dtype
    assert fwd.lse.dtype == acc and bwd.D.dtype == acc, (fwd.lse.dtype, bwd.D.dtype)
    q64, k64, v64, do64 = (t.to(f64) for t in (q, k, v, do))
    ref = fl.reference_forward(q64, k64, v64, mask=fl.Causal())
    refb = fl.reference_backward(q64, k64, v64, ref.o, ref.lse, do64, mask=fl.Causal())
    assert_close(fwd.o, ref.o, rtol=rtol, atol=rtol, name=f"O ({dtype})")
    assert_close(fwd.lse, ref.lse, rtol=rtol, atol=rtol, name=f"LSE ({dtype})")
    assert_close(bwd.dq, refb.dq, rtol=4 * rtol, atol=4 * rtol, name=f"dQ ({dtype})")


def test_flash_attention_default_tiles_match_the_oracle(gen, assert_close):
    q = _randn(gen, 1, 4, 333, 16).requires_grad_(True)
    k = _randn(gen, 1, 2, 333, 16).requires_grad_(True)
    v = _randn(gen, 1, 2, 333, 16).requires_grad_(True)
    do = _randn(gen, 1, 4, 333, 16)
    o = fl.flash_attention(q, k, v, mask=fl.Causal())
    o.backward(do)
    ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=fl.Causal())
    assert_close(o, ref.o, rtol=TOL, name="O")
    for name, got, want in (
        ("dQ", q.grad, refb.dq),
        ("dK", k.grad, refb.dk),
        ("dV", v.grad, refb.dv),
    ):
        assert got is not None
        assert_close(got, want, rtol=TOL, name=name)


# -- the benchmark machinery (no timing is asserted) -----------------------------------------
def test_bench_shares_of_the_peak_pair_each_round_with_its_own_peak() -> None:
    """A round that ran at half speed because the machine did (its peak halved too) is
    as efficient as the others: the share is the rounds' median of time-paired shares."""
    row: dict[str, Any] = {
        "fwdbwd_gflop": 100.0,
        "flashledger": {"fwd_ms": 1.0, "fwdbwd_ms": 1000.0, "fwdbwd_gflops": 100.0},
        "sdpa": {"fwd_ms": 1.0, "fwdbwd_ms": 1000.0, "fwdbwd_gflops": 100.0},
        "matmuls": {"fwd_ms": 1.0, "fwdbwd_ms": 1.0},
        "rounds_gemm_gflops": [200.0, 100.0, 200.0],
        "rounds_fma_gflops": [400.0, 200.0, 400.0],
    }
    for method in ("flashledger", "sdpa"):  # 100 GFLOP in 0.5 s, 1 s (the slow round), 0.5 s
        row[method]["fwd_rounds_ms"] = [1.0, 1.0, 1.0]
        row[method]["fwdbwd_rounds_ms"] = [500.0, 1000.0, 500.0]
        row[method]["peak_extra_mb"] = None
    bench._derive(row, peak=1000.0, step_mm=None, fma=1000.0)  # start-of-run peaks: unused
    assert row["pct_gemm_peak"] == pytest.approx(100.0)  # 200 GFLOP/s of 200, 100 of 100
    assert row["pct_fma_peak"] == pytest.approx(50.0)
    assert row["sdpa_pct_fma_peak"] == pytest.approx(50.0)
    assert (row["gemm_peak_gflops"], row["fma_peak_gflops"]) == (200.0, 400.0)
    del row["rounds_fma_gflops"]  # no native step: the start-of-run FMA peak, if any
    bench._derive(row, peak=1000.0, step_mm=None, fma=None)
    assert row["pct_fma_peak"] is None and row["fma_peak_gflops"] is None


def _bench_args(*argv: str) -> Any:
    parser = cli._Parser(prog="flashledger bench")
    bench.add_cli_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_runs_a_tiny_configuration_and_writes_json_and_png(
    tmp_path: Path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "250")  # a wide plain table, whatever the runner's terminal
    # a steering variable is named beside the figures (this one changes nothing once the
    # threads are up)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    args = _bench_args(
        "--lengths", "128", "--dtypes", "float32", "--causal", "no", "--repeats", "1",
        "--tiles", "64x64", "--out", str(tmp_path),
    )  # fmt: skip
    assert bench.run_cli(args) == 0
    out = capsys.readouterr().out
    assert "f+b ms FL/SDPA" in out and "traced path" in out, out
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report) >= {"machine", "settings", "gemm_peak_gflops", "results", "traced"}
    assert report["machine"]["threads"] == torch.get_num_threads()
    env = report["machine"]["environment"]
    assert env["OMP_NUM_THREADS"] == str(torch.get_num_threads()), env
    assert "COLUMNS" not in env  # only what steers the run
    assert f"set: {' '.join(f'{k}={v}' for k, v in env.items())}" in " ".join(out.split())
    assert report["gemm_peak_gflops"]["float32"] > 0
    step_mm = report["step_matmul_gflops"]["float32"]
    assert (step_mm is None) == (_native.kernels() is None), step_mm
    assert (row_pct := report["results"][0]["pct_step_matmul"]) is None or row_pct > 0
    (row,) = report["results"]
    assert (row["length"], row["dtype"], row["causal"], row["block_q"]) == (
        128,
        "float32",
        False,
        64,
    )
    assert row["matmuls"]["fwd_ms"] > 0 and row["matmuls"]["fwdbwd_ms"] > 0
    keys = ("ratio_fwd", "ratio_fwdbwd", "floor_fwd", "floor_fwdbwd", "pct_gemm_peak")
    for key in (*keys, "max_abs_diff_o_vs_sdpa"):
        assert isinstance(row[key], float) and math.isfinite(row[key]), (key, row[key])
    assert row["mem_ratio"] is None or row["mem_ratio"] >= 0, row["mem_ratio"]
    for key in ("fwd", "fwdbwd"):  # one round: the range is that round's ratio
        fl_t, sd_t = row["flashledger"][f"{key}_rounds_ms"], row["sdpa"][f"{key}_rounds_ms"]
        assert len(fl_t) == len(sd_t) == 1
        assert row[f"ratio_{key}_range"] == pytest.approx([fl_t[0] / sd_t[0]] * 2)
    assert row["max_abs_diff_o_vs_sdpa"] < 1e-4, "the benchmark timed a wrong answer"
    # the peaks were timed in the round, and the shares are of those
    (gemm_round,) = row["rounds_gemm_gflops"]
    assert gemm_round > 0 and row["gemm_peak_gflops"] == gemm_round
    fl_s = row["flashledger"]["fwdbwd_rounds_ms"][0] / 1e3
    assert row["pct_gemm_peak"] == pytest.approx(100 * row["fwdbwd_gflop"] / fl_s / gemm_round)
    assert (row["rounds_fma_gflops"] is None) == (_native.kernels() is None)
    for method in bench.METHODS:
        entry = row[method]
        assert entry["fwd_ms"] > 0 and entry["fwdbwd_ms"] > 0 and entry["rounds"] == 1
        assert entry["peak_extra_mb"] is not None and entry["peak_extra_mb"] >= 0
    assert row["fwdbwd_gflop"] == pytest.approx(3.5 * 4 * 4 * 128 * 128 * 64 / 1e9)
    traced = report["traced"]
    assert traced["traced_ms"] > 0 and traced["fast_ms"] > 0 and traced["length"] == 64
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_paired_ratios_and_their_cell():
    assert bench.paired_ratios([2.0, 3.0, 1.0], [4.0, 3.0, 2.0]) == [0.5, 1.0, 0.5]
    with pytest.raises(ValueError):
        bench.paired_ratios([1.0, 2.0], [1.0])  # rounds must pair up
    assert bench._ratio_cell(0.914, [0.881, 0.953]) == "0.91 (0.88-0.95)"
    assert bench._ratio_cell(0.914, [0.914, 0.914]) == "0.91"
    assert bench._ratio_cell(0.914, None) == "0.91"


class _CountMatmuls(TorchDispatchMode):
    """Counts the aten matmul calls (``bmm``, ``baddbmm``, in place or not) made inside it."""

    NAMES = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_")

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.NAMES:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("length", "block_q", "block_k"), [(96, 32, 32), (100, 48, 24)])
def test_bench_matmul_floor_issues_exactly_the_loops_matmuls(causal, length, block_q, block_k):
    cfg = bench.Config(
        length=length, dtype="float64", causal=causal, heads=2, head_dim=16,
        block_q=block_q, block_k=block_k,
    )  # fmt: skip
    floor_fwd, floor_both = bench.matmul_floor_runners(cfg)
    counts = {}
    for name, run in (("floor_fwd", floor_fwd), ("floor_both", floor_both)):
        with _CountMatmuls() as c:
            run()
        counts[name] = c.calls
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (_randn(gen, 1, 2, length, 16) for _ in range(4))
    opts: dict[str, Any] = dict(
        mask=fl.Causal() if causal else None, block_q=block_q, block_k=block_k
    )
    with _native.disabled():  # the floor issues the PyTorch step's matmuls
        with _CountMatmuls() as c:
            fwd = fl.blocked_forward(q, k, v, **opts)
        loop_fwd = c.calls
        with _CountMatmuls() as c:
            fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
        loop_bwd = c.calls
    tiles_run = fwd.ledger.counters.tiles_run
    assert loop_fwd == 2 * tiles_run and loop_bwd == 5 * tiles_run, (loop_fwd, loop_bwd)
    assert counts == {"floor_fwd": loop_fwd, "floor_both": loop_fwd + loop_bwd}, counts


def test_bench_skips_naive_above_its_limits_and_parses_quick():
    cfg = bench.Config(length=16384, dtype="float32", causal=False)
    args = _bench_args("--quick", "--naive-max-length", "8192")
    assert args.quick and not bench._naive_allowed(cfg, args)
    assert bench._naive_allowed(bench.Config(length=1024, dtype="float32", causal=True), args)
    assert cfg.fwd_flops == 4 * 4 * 16384**2 * 64
    assert (
        bench.Config(length=16384, dtype="float32", causal=True).fwdbwd_flops
        == 3.5 * cfg.fwd_flops / 2
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lengths", "0"], "--lengths"),
        (["--dtypes", "float8"], "float32, float64, bfloat16, float16"),
        (["--tiles", "128"], "BQxBK"),
        (["--tiles", "64x99999999999999999999"], "1..2147483647"),
        (["--lengths", "1024,2147483648"], "1..262144 (no empty item"),
        (["--heads", "-2"], "--heads"),
        (["--causal", "maybe"], "no, yes or both"),
        (["--tiles", "-1x4"], "expected tiles as BQxBK"),
        (["--lengths", "-5"], "expected comma-separated integers"),
        (["--quick", "--lengths", "64"], "--quick runs its own subset"),
        (["--quick", "--dtypes", "float64", "--decode"], "leave out --dtypes"),
        (["--quick", "--contention"], "not of --contention"),
    ],
)
def test_bench_bad_options_exit_2_with_one_line(argv, needle, capsys):
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("argv", "lengths", "dtypes", "repeats"),
    [
        ([], bench.FULL_LENGTHS, bench.DEFAULT_DTYPES, 5),
        (["--quick"], bench.QUICK_LENGTHS, ("float32",), 3),
        (["--quick", "--repeats", "7"], bench.QUICK_LENGTHS, ("float32",), 7),
        (["--decode"], bench.DECODE_LENGTHS, bench.DECODE_DTYPES, 5),
        (["--decode", "--quick"], bench.QUICK_LENGTHS, ("float32",), 3),
        (["--decode", "--lengths", "96", "--dtypes", "float64"], (96,), ("float64",), 5),
    ],
)
def test_bench_sizes_left_out_take_the_defaults_of_the_benchmark_asked_for(
    argv, lengths, dtypes, repeats
):
    """Lengths, dtypes and rounds given are kept (--quick with --repeats too); left out they
    are the attention benchmark's, --decode's, or --quick's subset of either."""
    args = _bench_args(*argv)
    bench._resolve_sizes(args)
    assert (tuple(args.lengths), tuple(args.dtypes), args.repeats) == (lengths, dtypes, repeats)


def test_bench_out_must_be_a_directory_and_is_checked_first(tmp_path, capsys):
    afile = tmp_path / "results"
    afile.write_text("")
    assert cli.main(["bench", "--quick", "--out", str(afile)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--out {afile} is a file; it names the directory for bench.json/.png")
    parser = cli._Parser(prog="flashledger bench")
    bench.add_cli_arguments(parser)
    assert parser.parse_args([]).out == Path("flashledger-bench"), "never the published results"


def test_bench_memory_subprocess_reports_a_peak():
    cfg = bench.Config(length=1024, dtype="float64", causal=True, heads=2, head_dim=16)
    mem = bench.measure_memory("flashledger", cfg)
    assert mem["method"] == "flashledger"
    # at least the outputs O, dQ, dK, dV must have been resident
    assert mem["peak_extra_bytes"] >= 4 * 2 * 1024 * 16 * 8, mem


def test_bench_memory_warms_up_with_the_measured_call_and_counts_the_scratch(monkeypatch):
    """The warm-up is the call measured (a shorter one runs other kernels, whose code pages
    a long call would fault in while measured), and the native step's scratch kept from it
    is let go before the mark is reset, so that the buffers a pass needs count."""
    cfg = bench.Config(length=600, dtype="float32", causal=True, heads=1, head_dim=8)
    events: list[object] = []

    def fn(q, k, v):
        events.append(tuple(q.shape))
        return (q * 2).requires_grad_()

    monkeypatch.setattr(bench, "attention_fn", lambda method, c: fn)
    monkeypatch.setattr(bench._native, "release_scratch", lambda: events.append("release") or 0)
    got = bench.measure_memory_here("flashledger", cfg)
    assert got["method"] == "flashledger"
    assert events == [(1, 1, 600, 8), "release", (1, 1, 600, 8)], events


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_the_benchmark_runs_the_tiles_a_call_takes_by_default(native, dtype):
    """``flashledger bench`` times the tiles flashledger takes when none are given: for
    bfloat16/float16 those of the path the calibration chose (in the dtype, or float32's),
    not the accumulation dtype's."""
    from flashledger import _problem, blocked

    dt = getattr(torch, dtype)
    x = torch.zeros(1, 2, 8, 4, dtype=dt)
    pb = _problem.build_problem(x, x, x)
    want = blocked._resolve_tiles(pb, native, None, None)
    assert bench.resolved_tiles(dtype, None, None) == want
    assert bench.resolved_tiles(dtype, 64, None) == (64, want[1])
