"""The flash-attn edge rows of ``verify``: the emulation of flash-attn's source, and the rows."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from naive import causal_visible, fa2_sides, naive_attention, window_visible

import flashledger as fl
from flashledger._verify_flash_attn import _row, emulate_flash_attn, flash_attn_edge_rows

F64 = torch.float64


def qkv(gen: torch.Generator, lq: int, lk: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 2, n, 6, generator=gen, dtype=F64) for n in (lq, lk, lk))


@pytest.mark.parametrize(("lq", "lk"), [(7, 7), (12, 5), (5, 12), (1, 6)])
def test_emulation_equals_the_documented_formulas(lq, lk, gen, assert_close):
    q, k, v = qkv(gen, lq, lk)
    for kw, vis in (
        ({}, None),
        ({"causal": True}, causal_visible(lq, lk, "bottom_right")),
        ({"window": (2, 1)}, window_visible(lq, lk, *fa2_sides(2, 1, lk), "bottom_right")),
        ({"window": (3, -1)}, window_visible(lq, lk, *fa2_sides(3, None, lk), "bottom_right")),
    ):
        o, lse = emulate_flash_attn(q, k, v, **kw)
        wo, wl = naive_attention(q, k, v, visible=vis, masked_row_lse=math.inf)
        assert_close(o, wo, rtol=1e-13, name=f"O {kw}")
        assert_close(lse, wl, rtol=1e-13, name=f"LSE {kw}")
    slopes = torch.rand(1, 2, generator=gen, dtype=F64)
    o, lse = emulate_flash_attn(q, k, v, causal=True, alibi_slopes=slopes)
    wo, wl = naive_attention(
        q, k, v, visible=causal_visible(lq, lk, "bottom_right"), alibi_slopes=slopes,
        masked_row_lse=math.inf, alibi_key_index=True,
    )  # fmt: skip
    assert_close(o, wo, rtol=1e-13, name="O causal ALiBi")
    assert_close(lse, wl, rtol=1e-13, name="LSE causal ALiBi (+slope·j)")


def test_emulation_refuses_softcap_with_dropout(gen):
    q, k, v = qkv(gen, 3, 3)
    with pytest.raises(ValueError, match="softcap together with dropout"):
        emulate_flash_attn(q, k, v, softcap=2.0, dropout_p=0.1)


def test_flash_attn_3_masked_rows_read_minus_infinity(gen):
    q, k, v = qkv(gen, 6, 2)
    _, lse = emulate_flash_attn(q, k, v, version=3, causal=True)
    assert bool(torch.isneginf(lse[..., :4]).all()) and bool(torch.isfinite(lse[..., 4:]).all())


def test_every_edge_row_passes_and_shows_the_seed_difference():
    rows = flash_attn_edge_rows(quick=True)
    systems = {r.system for r in rows}
    assert {
        "flash-attn 2 window -1",
        "flash-attn 2 side ≥ Lk",
        "flash-attn 2 ALiBi LSE",
        "flash-attn 3 windows",
        "flash-attn 2 cap+drop",
        "flash-attn 3 cap+drop",
    } <= systems, systems
    bad = [r for r in rows if r.status != "passed"]
    assert not bad, [r.detail for r in bad]
    for r in rows:
        if r.convention == "flash_attn_2" and r.checked == "O LSE":
            gap = r.case.split("seed: ")[1].split()  # ["O", x, "LSE", y]
            assert max(float(gap[1]), float(gap[3])) > 0.1, r.case
        elif r.system == "flash-attn 3 windows":
            assert r.case.endswith("seed: same"), r.case


def test_a_preset_without_the_edge_fails_its_row(gen):
    q, k, v = qkv(gen, 24, 12)
    want = emulate_flash_attn(q, k, v, window=(7, -1))
    plain = dataclasses.replace(fl.FLASH_ATTN_2, name="no_rewrite", window_rewrite="none")
    got = fl.blocked_forward(q, k, v, mask=fl.SlidingWindow(7, -1), conventions=plain)
    row = _row("edge", plain, "window (7, -1)", (got.o, got.lse), want)
    assert row.status == "failed" and "from the emulated kernel" in row.detail
