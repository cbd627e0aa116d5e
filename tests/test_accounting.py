"""Closed-form storage, work and traffic against hand figures and the loop's own counters."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashledger import (
    Causal,
    DenseMask,
    KeyPadding,
    SlidingWindow,
    blocked_backward,
    blocked_forward,
)
from flashledger.accounting import (
    SCHEDULES,
    memory_traffic,
    paper_tiles,
    storage_and_work,
    traffic_sweep,
)
from flashledger.masks import Mask

SEED = dict(lq=5, lk=5, d=2, block_q=2, block_k=2, mask=Causal())


def _mismatches(expected: dict[str, int], observed: dict[str, int]) -> str:
    """The figures that differ, worst (largest gap) first."""
    bad = [(k, expected[k], observed[k]) for k in expected if expected[k] != observed[k]]
    bad.sort(key=lambda x: -abs(x[1] - x[2]))
    return "; ".join(f"{k}: closed form {a} != observed {b}" for k, a, b in bad)


def _run(
    *,
    lq: int,
    lk: int,
    d: int,
    d_v: int,
    heads: int,
    kv_heads: int,
    batch: int,
    block_q: int,
    block_k: int,
    mask: Mask | None,
    loop_order: str,
    conventions: str = "seed",
) -> tuple[Any, Any]:
    """Counters of the blocked forward and backward on random inputs of this shape."""
    gen = torch.Generator().manual_seed(lq * 131 + lk)
    q = torch.randn(batch, heads, lq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, lk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, lk, d_v, generator=gen, dtype=torch.float64)
    g = torch.randn(batch, heads, lq, d_v, generator=gen, dtype=torch.float64)
    opts: dict[str, Any] = dict(
        mask=mask, block_q=block_q, block_k=block_k, loop_order=loop_order,
        conventions=conventions,
    )  # fmt: skip
    fwd = blocked_forward(q, k, v, **opts)
    bwd = blocked_backward(q, k, v, fwd.o, fwd.lse, g, **opts)
    return fwd.ledger.counters, bwd.ledger.counters


# ----------------------------------------------------------------------------------------
# the seed's figures (section 05), derived by hand
# ----------------------------------------------------------------------------------------
def test_seed_storage_and_work_figures() -> None:
    sw = storage_and_work(**SEED)
    got = {
        "full_p_elements": sw.full_p_elements,
        "lse_elements": sw.lse_elements,
        "temp_block_capacity": sw.temp_block_capacity,
        "qk_dots_forward": sw.qk_dots_forward,
        "qk_dots_backward": sw.qk_dots_backward,
        "qk_dots_computed": sw.qk_dots_computed,
        "tiles_run": sw.tiles_run,
        "tiles_skipped": sw.tiles_skipped,
    }
    want = {
        "full_p_elements": 25,
        "lse_elements": 5,
        "temp_block_capacity": 4,
        "qk_dots_forward": 15,
        "qk_dots_backward": 15,
        "qk_dots_computed": 17,
        "tiles_run": 6,
        "tiles_skipped": 3,
    }
    assert got == want, _mismatches(want, got)
    # tiles: (0,0) and (1,1) straddle the diagonal; (2,2) is the 1x1 diagonal tile, full
    assert (sw.tiles_full, sw.tiles_partial, sw.tiles_total) == (4, 2, 9)
    assert sw.common_elements == {"q": 10, "k": 10, "v": 10, "o": 10}
    assert sw.gradient_elements == {"g": 10, "dq": 10, "dk": 10, "dv": 10}
    assert sw.saved_elements == 20
    # 17 computed dots + one rescale per row per tile run (rows 2+2+1+2+1+1 = 9)
    assert (sw.exps_forward, sw.exps_backward) == (26, 17)
    assert (sw.flops_forward, sw.flops_backward) == (17 * 8, 17 * 20)


def test_seed_matches_the_loop() -> None:
    fwd, bwd = _run(
        lq=5, lk=5, d=2, d_v=2, heads=1, kv_heads=1, batch=1, block_q=2, block_k=2,
        mask=Causal(), loop_order="fa2",
    )  # fmt: skip
    sw = storage_and_work(**SEED)
    assert (fwd.qk_dots_visible, bwd.qk_dots_visible) == (sw.qk_dots_forward, sw.qk_dots_backward)
    assert (fwd.tiles_run, fwd.tiles_skipped) == (sw.tiles_run, sw.tiles_skipped)


def test_storage_scales_with_batch_heads_gqa_and_dtype() -> None:
    sw = storage_and_work(
        lq=7, lk=9, d=4, d_v=3, heads=4, kv_heads=2, batch=3, block_q=4, block_k=4,
        dtype=torch.float16,
    )  # fmt: skip
    bh, bkv = 12, 6
    assert sw.full_p_elements == bh * 7 * 9
    assert sw.lse_elements == bh * 7
    assert sw.common_elements == {"q": bh * 28, "k": bkv * 36, "v": bkv * 27, "o": bh * 21}
    assert sw.gradient_elements == {"g": bh * 21, "dq": bh * 28, "dk": bkv * 36, "dv": bkv * 27}
    assert sw.qk_dots_forward == sw.qk_dots_computed == bh * 63  # no mask: every pair
    assert sw.bytes_per_element == 2
    assert sw.to_dict()["bytes"]["full_p"] == bh * 63 * 2
    assert sw.temp_block_capacity == 16


@pytest.mark.parametrize(
    ("dtype", "size", "stat"),
    [(torch.float16, 2, 4), (torch.bfloat16, 2, 4), (torch.float32, 4, 4), (torch.float64, 8, 8)],
)
def test_statistics_are_booked_in_float32_at_least(
    dtype: torch.dtype, size: int, stat: int
) -> None:
    """The LSE and D (and FA1's m and ℓ) are kept in float32 for half-precision inputs, as
    the loop keeps them and as flash-attn and SDPA return the LSE: booked at 4 bytes, P and
    every other tensor at the inputs' size."""
    sw = storage_and_work(lq=7, lk=9, d=4, heads=2, block_q=4, block_k=4, dtype=dtype)
    out = sw.to_dict()
    assert (out["bytes_per_element"], out["stat_bytes_per_element"]) == (size, stat)
    assert out["bytes"]["lse"] == out["bytes"]["d"] == 2 * 7 * stat
    assert out["bytes"]["full_p"] == 2 * 63 * size
    assert out["bytes"]["saved"] == sw.saved_bytes == 2 * 63 * size - 2 * 7 * stat
    for schedule in SCHEDULES:
        t = memory_traffic(lq=7, lk=9, d=4, heads=2, block_q=4, block_k=4, dtype=dtype,
                           schedule=schedule)  # fmt: skip
        tout = t.to_dict()
        stats = 0
        for side, (reads, writes) in (
            ("forward", (t.forward_reads, t.forward_writes)),
            ("backward", (t.backward_reads, t.backward_writes)),
        ):
            for key, moved in (("bytes_read", reads), ("bytes_written", writes)):
                n_stat = sum(n for name, n in moved.items() if name in {"m", "ell", "lse", "D"})
                stats += n_stat
                want = (sum(moved.values()) - n_stat) * size + n_stat * stat
                assert tout[side][key] == want, (schedule, side, key)
        assert tout["total_bytes"] == t.total_bytes == t.total * size + stats * (stat - size)
        assert (stats > 0) == (schedule != "standard"), schedule


def test_temp_block_is_clipped_to_the_lengths() -> None:
    assert storage_and_work(lq=3, lk=5, d=2, block_q=64, block_k=64).temp_block_capacity == 15


# ----------------------------------------------------------------------------------------
# JSON schemas (stable key sets)
# ----------------------------------------------------------------------------------------
STORAGE_KEYS = {
    "config", "bytes_per_element", "stat_bytes_per_element", "common_elements", "full_p_elements", "lse_elements",
    "saved_elements", "gradient_elements", "d_elements", "temp_block_capacity",
    "qk_dots_forward", "qk_dots_backward", "qk_dots_computed", "tiles_total", "tiles_run",
    "tiles_skipped", "tiles_full", "tiles_partial", "exps_forward", "exps_backward",
    "flops_forward", "flops_backward", "mask_mod_classify_evals", "mask_mod_tiles_bounded",
    "mask_mod_tiles_kept",
    "mask_mod_tiles", "mask_mod_evals", "score_mod_tiles", "score_mod_evals", "bytes",
}  # fmt: skip
STORAGE_CONFIG_KEYS = {
    "lq", "lk", "d", "d_v", "heads", "kv_heads", "batch", "block_q", "block_k", "mask",
    "conventions", "dtype",
}  # fmt: skip
TRAFFIC_KEYS = {
    "schedule", "config", "bytes_per_element", "stat_bytes_per_element", "forward", "backward",
    "total_elements",
    "total_bytes",
}  # fmt: skip
TRAFFIC_CONFIG_KEYS = {
    "lq", "lk", "d", "d_v", "heads", "kv_heads", "batch", "sram_elements", "block_q", "block_k",
    "mask", "conventions", "dtype",
}  # fmt: skip


def test_storage_json_schema_is_stable() -> None:
    out = storage_and_work(**SEED).to_dict()
    assert set(out) == STORAGE_KEYS, set(out) ^ STORAGE_KEYS
    assert set(out["config"]) == STORAGE_CONFIG_KEYS, set(out["config"]) ^ STORAGE_CONFIG_KEYS
    assert set(out["common_elements"]) == {"q", "k", "v", "o"}
    assert set(out["gradient_elements"]) == {"g", "dq", "dk", "dv"}
    assert set(out["bytes"]) == {
        "common", "full_p", "lse", "saved", "gradients", "d", "temp_block"
    }  # fmt: skip
    assert out["config"]["mask"] == "causal"


def test_traffic_json_schema_is_stable() -> None:
    for schedule in SCHEDULES:
        out = memory_traffic(**SEED, schedule=schedule).to_dict()
        assert set(out) == TRAFFIC_KEYS, (schedule, set(out) ^ TRAFFIC_KEYS)
        assert set(out["config"]) == TRAFFIC_CONFIG_KEYS, set(out["config"]) ^ TRAFFIC_CONFIG_KEYS
        for side in ("forward", "backward"):
            assert set(out[side]) == {
                "reads", "writes", "elements_read", "elements_written", "bytes_read",
                "bytes_written",
            }  # fmt: skip
            assert out[side]["elements_read"] == sum(out[side]["reads"].values())
        assert out["total_elements"] * 8 == out["total_bytes"]


# ----------------------------------------------------------------------------------------
# memory traffic: hand figures, the tile rule, the sweep
# ----------------------------------------------------------------------------------------
def test_standard_traffic_by_hand() -> None:
    t = memory_traffic(lq=5, lk=5, d=2, schedule="standard")
    # forward: read Q, K (10 + 10), S (25), P (25), V (10); write S, P (25 + 25), O (10)
    assert t.forward_reads == {"q": 10, "k": 10, "s": 25, "p": 25, "v": 10}
    assert t.forward_writes == {"s": 25, "p": 25, "o": 10}
    # backward: P twice (dV, dS), dO twice (dV, dP), V, dP, dS twice (dQ, dK), K, Q
    assert t.backward_read == 2 * 25 + 2 * 10 + 10 + 25 + 2 * 25 + 10 + 10
    assert t.backward_writes == {"dv": 10, "dp": 25, "ds": 25, "dq": 10, "dk": 10}
    assert t.config["block_q"] is None


def test_fa2_seed_traffic_by_hand() -> None:
    t = memory_traffic(**SEED, schedule="fa2")
    # K/V read once per tile run: keys 2+2+2+2+2+1 = 11 -> 22 each; Q once per query tile
    assert t.forward_reads == {"q": 10, "k": 22, "v": 22}
    assert t.forward_writes == {"o": 10, "lse": 5}


def test_paper_tile_rule() -> None:
    assert paper_tiles(sram_elements=1024, d=64) == (4, 4)  # Bc = ceil(1024 / 256)
    assert paper_tiles(sram_elements=65536, d=64) == (64, 256)  # Br capped at d
    assert paper_tiles(sram_elements=1000, d=64) == (4, 4)  # ceil(1000 / 256) = 4
    t = memory_traffic(lq=64, lk=64, d=8, schedule="fa1", sram_elements=100)
    assert (t.config["block_q"], t.config["block_k"]) == (4, 4)  # ceil(100 / 32)


def test_fa1_traffic_follows_n2d2_over_m() -> None:
    n, d = 2048, 64
    std = [memory_traffic(lq=n, lk=n, d=d, schedule="standard", sram_elements=m).total
           for m in (1024, 4096)]  # fmt: skip
    assert std[0] == std[1], "standard attention's traffic must not depend on M"
    for m in (1024, 2048, 4096):
        small = memory_traffic(lq=n, lk=n, d=d, schedule="fa1", sram_elements=m).total
        large = memory_traffic(lq=n, lk=n, d=d, schedule="fa1", sram_elements=2 * m).total
        assert 1.9 < small / large <= 2.0, f"M={m}: halving M multiplied FA1 by {small / large}"
    # the N²d²/M term: 4N²d²/M key tiles' worth of Q, O, m, ℓ traffic dominates at small M
    m = 1024
    t = memory_traffic(lq=n, lk=n, d=d, schedule="fa1", sram_elements=m).total
    model = n * n * d * d / m
    assert 20 < t / model < 35, f"FA1 traffic / (N²d²/M) = {t / model}"


def test_standard_traffic_follows_nd_plus_n2() -> None:
    d = 64
    for n in (512, 1024, 2048):
        t = memory_traffic(lq=n, lk=n, d=d, schedule="standard").total
        assert t == 11 * n * n + 12 * n * d, f"N={n}: {t} != 11N² + 12Nd"


def test_sweep_reports_the_crossover() -> None:
    sweep = traffic_sweep(d=32, n=1024, sram_values=(512, 1024, 2048, 4096), lengths=(256, 512))
    assert [r["sram_elements"] for r in sweep.by_sram] == [512, 1024, 2048, 4096]
    fa1 = [r["fa1"] for r in sweep.by_sram]
    assert all(a > b for a, b in itertools.pairwise(fa1)), f"FA1 must fall as M grows: {fa1}"
    for n, m in sweep.crossover_sram.items():
        # just below the crossover FA1 moves more than standard; at it, no more
        std = memory_traffic(lq=n, lk=n, d=32, schedule="standard").total
        at = memory_traffic(lq=n, lk=n, d=32, schedule="fa1", sram_elements=m).total
        below = memory_traffic(lq=n, lk=n, d=32, schedule="fa1", sram_elements=m - 128).total
        assert at <= std < below, f"N={n}: crossover M={m} wrong ({below}, {std}, {at})"
        assert 2 * 32**2 < m < 4 * 32**2, f"N={n}: crossover M={m} far from ~2.6 d²"
    assert len(sweep.crossover_lines()) == len(sweep.crossover_sram)


# ----------------------------------------------------------------------------------------
# renderers
# ----------------------------------------------------------------------------------------
def test_renderers_show_the_same_rows() -> None:
    from rich.console import Console

    sw = storage_and_work(**SEED)
    text = str(sw)
    assert "P" in text and " 25 " in text and "full-P path keeps" in text
    html = sw._repr_html_()
    assert html.startswith("<table>") and "<td>25</td>" in html and "<td>17</td>" in html
    con = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    con.print(sw)
    rendered = con.export_text()
    assert "temporary tile" in rendered and "17" in rendered
    t = memory_traffic(**SEED, schedule="fa1")
    assert "total" in str(t) and "<td>84</td>" in t._repr_html_()


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(lq=0, lk=5, d=2, block_q=2, block_k=2), ValueError,
         r"lq must be an integer in 1\.\.2147483647"),
        (dict(lq=2**31, lk=5, d=2, block_q=2, block_k=2), ValueError, r"1\.\.2147483647"),
        (dict(lq=5, lk=5, d=True, block_q=2, block_k=2), TypeError, "d must be an integer"),
        (dict(lq=2**20, lk=2**20, d=64, block_q=64, block_k=64, mask=Causal()), ValueError,
         "at most 16,777,216, got 16,384 x 16,384"),
        (dict(lq=2**25, lk=8, d=64, block_q=2**25, block_k=8, mask=Causal()), ValueError,
         "Lq and Lk must be at most 16,777,216"),
        (dict(lq=5, lk=5, d=2.5, block_q=2, block_k=2), TypeError, "d must be an integer"),
        (dict(lq=5, lk=5, d=2, block_q=0, block_k=2), ValueError, "block_q"),
        (dict(lq=5, lk=5, d=2, heads=3, kv_heads=2, block_q=2, block_k=2), ValueError,
         "multiple of kv_heads"),
        (dict(lq=5, lk=5, d=2, block_q=2, block_k=2, dtype=torch.int32), TypeError,
         "floating torch dtype"),
        (dict(lq=5, lk=5, d=2, block_q=2, block_k=2, conventions="nope"), ValueError,
         "unknown preset"),
    ],
)  # fmt: skip
def test_storage_bad_input(kwargs: dict[str, Any], exc: type[Exception], words: str) -> None:
    with pytest.raises(exc, match=words):
        storage_and_work(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(schedule="fa3", block_q=2, block_k=2), "schedule must be one of"),
        (dict(schedule="fa1"), "needs sram_elements"),
        (dict(schedule="fa1", block_q=2), "needs sram_elements"),
        (dict(schedule="fa2", sram_elements=64, block_q=2), "not both"),
        (dict(schedule="fa2", sram_elements=0), "sram_elements must be an integer in 1.."),
    ],
)
def test_traffic_bad_input(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        memory_traffic(lq=5, lk=5, d=2, **kwargs)


# ----------------------------------------------------------------------------------------
# property test: closed forms equal the counters of the loop that ran
# ----------------------------------------------------------------------------------------
@st.composite
def _masks(draw: st.DrawFn, lq: int, lk: int, batch: int, heads: int) -> Mask | None:
    kind = draw(
        st.sampled_from(["none", "causal", "causal_br", "window", "padding", "dense", "and"])
    )
    if kind == "none":
        return None
    if kind == "causal":
        return Causal()
    if kind == "causal_br":
        return Causal(align="bottom_right")
    window = SlidingWindow(draw(st.integers(-1, 4)), draw(st.integers(-1, 3)))
    if kind == "window":
        return window
    lengths = draw(st.lists(st.integers(0, lk), min_size=batch, max_size=batch))
    if kind == "padding":
        return KeyPadding(lengths)
    bits = draw(st.lists(st.booleans(), min_size=heads * lq * lk, max_size=heads * lq * lk))
    dense = DenseMask(torch.tensor(bits, dtype=torch.bool).reshape(heads, lq, lk))
    return dense if kind == "dense" else dense & window


@st.composite
def _configs(draw: st.DrawFn) -> dict[str, Any]:
    lq, lk = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    batch = draw(st.integers(1, 2))
    return dict(
        lq=lq, lk=lk, d=draw(st.integers(1, 3)), d_v=draw(st.integers(1, 3)),
        heads=heads, kv_heads=kv_heads, batch=batch,
        block_q=draw(st.integers(1, lq + 1)), block_k=draw(st.integers(1, lk + 1)),
        mask=draw(_masks(lq, lk, batch, heads)),
        loop_order=draw(st.sampled_from(["fa1", "fa2"])),
        conventions=draw(st.sampled_from(["seed", "flash_attn_2"])),
    )  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs())
def test_closed_forms_equal_observed_counters(cfg: dict[str, Any]) -> None:
    fwd, bwd = _run(**cfg)
    order = cfg.pop("loop_order")
    t = memory_traffic(**cfg, schedule=order)
    sw = storage_and_work(**cfg)
    closed = {
        "forward elements_read": t.forward_read,
        "forward elements_written": t.forward_written,
        "backward elements_read": t.backward_read,
        "backward elements_written": t.backward_written,
        "qk_dots_forward": sw.qk_dots_forward,
        "qk_dots_backward": sw.qk_dots_backward,
        "qk_dots_computed (forward)": sw.qk_dots_computed,
        "qk_dots_computed (backward)": sw.qk_dots_computed,
        "tiles_run": sw.tiles_run,
        "tiles_skipped": sw.tiles_skipped,
        "tiles_full": sw.tiles_full,
        "tiles_partial": sw.tiles_partial,
        "exps_forward": sw.exps_forward,
        "exps_backward": sw.exps_backward,
    }
    observed = {
        "forward elements_read": fwd.elements_read,
        "forward elements_written": fwd.elements_written,
        "backward elements_read": bwd.elements_read,
        "backward elements_written": bwd.elements_written,
        "qk_dots_forward": fwd.qk_dots_visible,
        "qk_dots_backward": bwd.qk_dots_visible,
        "qk_dots_computed (forward)": fwd.qk_dots_computed,
        "qk_dots_computed (backward)": bwd.qk_dots_computed,
        "tiles_run": fwd.tiles_run,
        "tiles_skipped": fwd.tiles_skipped,
        "tiles_full": fwd.tiles_full,
        "tiles_partial": fwd.tiles_partial,
        "exps_forward": fwd.exps,
        "exps_backward": bwd.exps,
    }
    assert closed == observed, f"{cfg}: {_mismatches(closed, observed)}"
    assert bwd.tiles_run == fwd.tiles_run and bwd.tiles_skipped == fwd.tiles_skipped


def test_visible_count_uses_no_dense_matrix_for_long_causal() -> None:
    # 2^17 x 2^17 would be 16 GiB of bools; the interval form counts it exactly
    n = 1 << 17
    sw = storage_and_work(lq=n, lk=n, d=64, block_q=4096, block_k=4096, mask=Causal())
    assert sw.qk_dots_forward == n * (n + 1) // 2
    assert sw.tiles_run == 32 * 33 // 2 and sw.tiles_partial == 32
    assert math.isclose(sw.qk_dots_computed / sw.qk_dots_forward, 33 / 32, rel_tol=1e-3)


def test_byte_sizes_stay_under_1000_of_their_unit() -> None:
    """A size is printed in the unit that keeps it under 1000 (no ``1e+03 MiB``)."""
    from flashledger.accounting import _bytes

    cases = {
        999: "999 B", 1024: "1 KiB", 999 * 1024: "999 KiB", 1000 * 1024: "0.977 MiB",
        1000 * 2**20: "0.977 GiB", 2**40: "1 TiB", 1536: "1.5 KiB",
    }  # fmt: skip
    for x, want in cases.items():
        assert _bytes(x) == want, (x, _bytes(x))
    sw = storage_and_work(lq=11449, lk=11449, d=64, block_q=64, block_k=64)
    assert "e+" not in str(sw), str(sw)
