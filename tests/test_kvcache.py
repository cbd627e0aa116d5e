"""Attention over a KV cache against a dense reference built from the same semantics.

The reference here is written from the behaviour (flash-attn's
``flash_attn_with_kvcache``), element by element: the cache after the append
is written with Python loops into a copy, each sequence's keys are read from
its own positions (through the block table for a paged cache), rotary
embeddings are applied pair by pair, and the attention is the naive formula
of tests/naive.py on that sequence alone, with its own bottom-right diagonal.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import fa2_sides, naive_attention
from torch.utils._python_dispatch import TorchDispatchMode

import flashledger as fl

F64 = torch.float64
TOL = 1e-12


# -- the reference ---------------------------------------------------------------------------
def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int, inter: bool
) -> torch.Tensor:
    """One vector ``x`` ``(d,)`` rotated at table row ``pos``, pair by pair."""
    out = x.clone()
    half = cos.shape[1]
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if inter else (i, i + half)
        c, s = float(cos[pos, i]), float(sin[pos, i])
        out[a] = x[a] * c - x[b] * s
        out[b] = x[a] * s + x[b] * c
    return out


def slot(p: int, b: int, row: int, table: torch.Tensor | None, page: int) -> tuple[int, int]:
    """Cache (row, position) of logical position ``p`` of sequence ``b``."""
    if table is None:
        return row, p
    return int(table[b, p // page]), p % page


def kv_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    seqlens: list[int],
    rows: list[int] | None = None,
    leftpad: list[int] | None = None,
    table: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    interleaved: bool = True,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    alibi: torch.Tensor | None = None,
    softcap: float | None = None,
    conv: fl.Conventions = fl.SEED,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, lse, k_cache after, v_cache after)``, all in flashledger's (B, H, L, d) layout."""
    b_n, hq, lq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    page = k_cache.shape[2]
    capacity = table.shape[1] * page if table is not None else k_cache.shape[2]
    rows = list(range(b_n)) if rows is None else rows
    leftpad = [0] * b_n if leftpad is None else leftpad
    kc, vc = k_cache.clone(), v_cache.clone()
    l_new = 0 if k is None else k.shape[2]
    # the append, rotated keys
    for b in range(b_n):
        for t in range(l_new):
            p = seqlens[b] + t
            r, off = slot(p, b, rows[b], table, page)
            for h in range(hkv):
                kv = k[b, h, t]  # type: ignore[index]
                if cos is not None:
                    kv = rotate(kv, cos, sin, p, interleaved)  # type: ignore[arg-type]
                kc[r, h, off] = kv
                vc[r, h, off] = v[b, h, t]  # type: ignore[index]
    # flash-attn 2 reads the window against the capacity; then "causal" pins the right side
    left, right = window
    if conv.window_rewrite == "flash_attn_2" and (left >= 0 or right >= 0):
        left, right = fa2_sides(None if left < 0 else left, None if right < 0 else right, capacity)
    if causal:
        right = 0
    windowed = causal or left >= 0 or right >= 0
    o = torch.zeros(b_n, hq, lq, dv, dtype=q.dtype)
    lse = torch.full((b_n, hq, lq), conv.masked_row_lse, dtype=q.dtype)
    for b in range(b_n):
        n = seqlens[b] + l_new - leftpad[b]
        qb = q[b].clone()
        if cos is not None:
            for i in range(lq):
                p = seqlens[b] + (i if windowed else 0)
                for h in range(hq):
                    qb[h, i] = rotate(q[b, h, i], cos, sin, p, interleaved)  # type: ignore[arg-type]
        if n == 0:
            continue
        keys = [slot(leftpad[b] + j, b, rows[b], table, page) for j in range(n)]
        kb = torch.stack([kc[r, :, off] for r, off in keys], dim=1)  # (Hkv, n, d)
        vb = torch.stack([vc[r, :, off] for r, off in keys], dim=1)  # (Hkv, n, d_v)
        vis = torch.ones(lq, n, dtype=torch.bool)
        for i in range(lq):
            c = i + n - lq
            for j in range(n):
                ok = (left < 0 or j >= c - left) and (right < 0 or j <= c + right)
                vis[i, j] = ok
        slopes = None if alibi is None else (alibi if alibi.ndim == 1 else alibi[b])
        ob, lb = naive_attention(
            qb[None],
            kb[None],
            vb[None],
            visible=vis,
            softcap=softcap,
            alibi_slopes=slopes,
            masked_row_lse=conv.masked_row_lse,
            alibi_key_index=slopes is not None
            and causal
            and left < 0
            and conv.alibi_causal == "key_index",
        )
        o[b], lse[b] = ob[0], lb[0]
    return o, lse, kc, vc


def tables(gen: torch.Generator, rows: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(rows, half, generator=gen, dtype=F64) * 2 * math.pi
    return angle.cos(), angle.sin()


def paged_copy(
    cache: torch.Tensor, page: int, gen: torch.Generator, spare: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cache as shuffled pages ``(pages, H, page, d)`` and its block table."""
    b, h, cap, d = cache.shape
    per = cap // page
    n = b * per + spare
    order = torch.randperm(n, generator=gen)
    pages = torch.randn(n, h, page, d, generator=gen, dtype=cache.dtype)
    table = order[: b * per].view(b, per)
    for i in range(b):
        for s in range(per):
            pages[table[i, s]] = cache[i, :, s * page : (s + 1) * page]
    return pages, table


def check(
    got: fl.KVCacheResult,
    want: tuple[torch.Tensor, ...],
    caches: tuple[torch.Tensor, torch.Tensor],
    assert_close: Any,
    where: str,
) -> None:
    o, lse, kc, vc = want
    assert_close(got.o, o, rtol=TOL, name=f"O ({where})")
    assert_close(got.lse, lse, rtol=TOL, name=f"LSE ({where})")
    assert torch.equal(caches[0], kc), f"k_cache after the append ({where})"
    assert torch.equal(caches[1], vc), f"v_cache after the append ({where})"


def make(
    gen: torch.Generator,
    b: int,
    hq: int,
    hkv: int,
    lq: int,
    cap: int,
    d: int,
    dv: int,
    l_new: int,
    rows: int | None = None,
):
    rows = b if rows is None else rows
    q = torch.randn(b, hq, lq, d, generator=gen, dtype=F64)
    kc = torch.randn(rows, hkv, cap, d, generator=gen, dtype=F64)
    vc = torch.randn(rows, hkv, cap, dv, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, l_new, d, generator=gen, dtype=F64) if l_new else None
    v = torch.randn(b, hkv, l_new, dv, generator=gen, dtype=F64) if l_new else None
    return q, kc, vc, k, v


# -- the cases -------------------------------------------------------------------------------
MASKS = {
    "none": (None, False, (-1, -1)),
    "causal": (fl.Causal(), True, (-1, -1)),
    "window": (fl.SlidingWindow(3, 1), False, (3, 1)),
    "causal_window": (fl.Causal() & fl.SlidingWindow(4, None), True, (4, -1)),
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("conv", [fl.SEED, fl.FLASH_ATTN_2], ids=lambda c: c.name)
def test_decode_step_with_append_equals_the_reference(mask, conv, gen, assert_close):
    m, causal, window = MASKS[mask]
    q, kc, vc, k, v = make(gen, 3, 4, 2, 1, 17, 8, 6, 1)
    lens = [0, 9, 16]  # an empty cache, a middle one, one filled to capacity by the append
    slopes = torch.rand(3, 4, generator=gen, dtype=F64)
    want = kv_reference(
        q, kc, vc, k, v, seqlens=lens, causal=causal, window=window, alibi=slopes, conv=conv
    )
    got = fl.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens), mask=m, alibi_slopes=slopes,
        conventions=conv, block_k=4,
    )  # fmt: skip
    check(got, want, (kc, vc), assert_close, f"{mask}, {conv.name}")


@pytest.mark.parametrize("interleaved", [True, False], ids=["gpt-j", "neox"])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_prefill_chunk_with_rotary_gqa_and_softcap(interleaved, mask, gen, assert_close):
    m, causal, window = MASKS[mask]
    q, kc, vc, k, v = make(gen, 2, 6, 2, 5, 24, 10, 10, 5)
    cos, sin = tables(gen, 30, 4)  # rotary_dim 8 of d = 10
    lens = [3, 11]
    want = kv_reference(
        q, kc, vc, k, v, seqlens=lens, cos=cos, sin=sin, interleaved=interleaved,
        causal=causal, window=window, softcap=2.0,
    )  # fmt: skip
    got = fl.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens), rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=interleaved, mask=m, softcap=2.0, block_q=2, block_k=3,
    )  # fmt: skip
    check(got, want, (kc, vc), assert_close, f"rotary {mask}")


def test_paged_cache_with_a_shuffled_block_table(gen, assert_close):
    q, kc, vc, k, v = make(gen, 3, 4, 2, 2, 16, 8, 8, 2)
    pk, table = paged_copy(kc, 4, gen)
    pv = torch.randn(pk.shape[0], 2, 4, 8, generator=gen, dtype=F64)
    for i in range(3):
        for s in range(4):
            pv[table[i, s]] = vc[i, :, s * 4 : (s + 1) * 4]
    cos, sin = tables(gen, 16, 4)
    lens = [5, 0, 14]
    slopes = fl.alibi_slopes(4)
    want = kv_reference(
        q, pk, pv, k, v, seqlens=lens, table=table, cos=cos, sin=sin, causal=True, alibi=slopes
    )
    got = fl.attention_with_kvcache(
        q, pk, pv, k, v, cache_seqlens=torch.tensor(lens), block_table=table, rotary_cos=cos,
        rotary_sin=sin, mask=fl.Causal(), alibi_slopes=slopes, block_k=3,
    )  # fmt: skip
    check(got, want, (pk, pv), assert_close, "paged")
    # the same sequences unpaged give the same output
    q2, kc2, vc2 = q.clone(), kc.clone(), vc.clone()
    flat = fl.attention_with_kvcache(
        q2, kc2, vc2, k, v, cache_seqlens=torch.tensor(lens), rotary_cos=cos, rotary_sin=sin,
        mask=fl.Causal(), alibi_slopes=slopes, block_k=3,
    )  # fmt: skip
    assert_close(flat.o, got.o, rtol=TOL, name="paged vs contiguous O")
    led = got.ledger
    assert led.pages_read == sum(-(-n // 4) for n in led.used), led
    assert flat.ledger.pages_read is None


def test_batch_index_and_left_padding(gen, assert_close):
    q, kc, vc, k, v = make(gen, 3, 2, 1, 3, 20, 5, 7, 2, rows=5)
    rows, leftpad, lens = [4, 0, 2], [2, 0, 6], [9, 4, 6]  # the last cache row is all padding
    slopes = torch.rand(3, 2, generator=gen, dtype=F64)
    for mask in ("none", "causal", "window"):
        m, causal, window = MASKS[mask]
        kc_, vc_ = kc.clone(), vc.clone()
        want = kv_reference(
            q, kc_, vc_, k, v, seqlens=lens, rows=rows, leftpad=leftpad, causal=causal,
            window=window, alibi=slopes,
        )  # fmt: skip
        got = fl.attention_with_kvcache(
            q, kc_, vc_, k, v, cache_seqlens=torch.tensor(lens), cache_batch_idx=torch.tensor(rows),
            cache_leftpad=torch.tensor(leftpad), mask=m, alibi_slopes=slopes, block_k=4,
        )  # fmt: skip
        check(got, want, (kc_, vc_), assert_close, f"batch index + left padding, {mask}")
        assert bool((kc_[1] == kc[1]).all() and (kc_[3] == kc[3]).all()), "untouched rows"


def test_flash_attn_2_reads_windows_against_the_cache_capacity(gen, assert_close):
    # 8 queries over 2 cached keys of a 4-key cache: row i's bottom-right diagonal is key i - 6.
    # flash-attn 2 reads a "-1" right side as + capacity: row i sees keys <= i - 2, so rows 0
    # and 1 see none. Read as unbounded (seed) every row sees both keys; bounded by the keys
    # in use (+2) rows 0-3 would see none.
    q, kc, vc, _, _ = make(gen, 1, 2, 2, 8, 4, 4, 4, 0)
    mask = fl.SlidingWindow(1, None)
    fa2 = fl.attention_with_kvcache(
        q, kc, vc, cache_seqlens=2, mask=mask, conventions=fl.FLASH_ATTN_2
    )
    want = kv_reference(q, kc, vc, None, None, seqlens=[2], window=(1, -1), conv=fl.FLASH_ATTN_2)
    assert_close(fa2.o, want[0], rtol=TOL, name="O (flash-attn 2 window)")
    assert_close(fa2.lse, want[1], rtol=TOL, name="LSE (flash-attn 2 window)")
    empty = torch.isinf(fa2.lse[0, 0])  # +inf: flash-attn 2's fully-masked rows
    assert empty.tolist() == [True, True] + [False] * 6, empty
    seed = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=2, mask=mask)
    assert bool(torch.isfinite(seed.lse).all()), "seed: every row sees both keys"


def test_bshd_layout_and_no_new_rows(gen, assert_close):
    q, kc, vc, _, _ = make(gen, 2, 4, 4, 3, 12, 8, 8, 0)
    lens = [12, 5]
    want = kv_reference(q, kc, vc, None, None, seqlens=lens, causal=True)
    got = fl.attention_with_kvcache(
        q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), cache_seqlens=torch.tensor(lens),
        mask=fl.Causal(), layout="bshd",
    )  # fmt: skip
    assert got.o.shape == (2, 3, 4, 8)
    assert_close(got.o.transpose(1, 2), want[0], rtol=TOL, name="O (bshd)")
    assert_close(got.lse, want[1], rtol=TOL, name="LSE (bshd)")
    assert got.ledger.cache_bytes_written == 0 and got.ledger.new_rows == 0


def test_append_in_place_through_bshd_views(gen):
    q, kc, vc, k, v = make(gen, 2, 2, 2, 1, 8, 4, 4, 2)
    kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()  # (B, L, H, d)
    fl.attention_with_kvcache(
        q.transpose(1, 2), kt, vt, k.transpose(1, 2), v.transpose(1, 2),  # type: ignore[union-attr]
        cache_seqlens=3, layout="bshd",
    )  # fmt: skip
    assert torch.equal(kt[:, 3:5].transpose(1, 2), k) and torch.equal(vt[:, 3:5].transpose(1, 2), v)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_kv_decode_equals_one_pass(splits, gen, assert_close):
    q, kc, vc, k, v = make(gen, 2, 8, 2, 1, 40, 16, 16, 1)
    lens = [39, 13]
    opts: dict[str, Any] = dict(cache_seqlens=torch.tensor(lens), mask=fl.Causal(), block_k=8)
    one = fl.attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, **opts)
    many = fl.attention_with_kvcache(q, kc, vc, k, v, num_splits=splits, **opts)
    assert_close(many.o, one.o, rtol=TOL, name=f"O with {splits} splits")
    assert_close(many.lse, one.lse, rtol=TOL, name=f"LSE with {splits} splits")
    assert many.ledger.splits == splits
    c1, cn = one.ledger.forward.counters, many.ledger.forward.counters
    assert cn.qk_dots_visible == c1.qk_dots_visible == (40 + 14) * 8


def test_ledger_books_the_cache_bytes_of_a_step(gen):
    q, kc, vc, k, v = make(gen, 3, 4, 2, 2, 32, 8, 4, 2)
    lens = [30, 7, 0]
    res = fl.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens), mask=fl.SlidingWindow(5, 0)
    )
    led = res.ledger
    per_key = 2 * (8 + 4) * 8  # K/V heads x (d + d_v) x float64
    assert led.used == (32, 9, 2)
    # window (5, 0) bottom-right: the last two rows see keys n-7 .. n-1 (clipped at 0)
    assert led.keys_read == (7, 7, 2)
    assert led.cache_bytes_read == sum(led.keys_read) * per_key
    assert led.cache_bytes_written == 3 * 2 * per_key
    text = str(led)
    assert "cache bytes read" in text and f"{led.cache_bytes_read:,}" in text
    assert led.to_dict()["forward"]["tiles_run"] == led.forward.counters.tiles_run
    assert "<table>" in led._repr_html_()


def test_unused_cache_rows_may_hold_anything(gen, assert_close):
    q, kc, vc, k, v = make(gen, 2, 2, 2, 1, 10, 4, 4, 1)
    kc[0, :, 6:] = math.nan  # never written: an uninitialised cache
    vc[0, :, 6:] = math.inf
    want = kv_reference(q, kc, vc, k, v, seqlens=[5, 9])
    got = fl.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([5, 9]))
    assert not bool(torch.isnan(got.o).any())
    assert_close(got.o, want[0], rtol=TOL, name="O past garbage")
    assert got.ledger.gathered_bytes > 0  # the garbage rows are left out by a copy


def test_a_nan_in_the_keys_in_use_is_named(gen):
    q, kc, vc, k, v = make(gen, 1, 2, 2, 1, 10, 4, 4, 1)
    kc[0, 1, 2, 0] = math.nan
    with pytest.raises(ValueError, match=r"k_cache \(keys in use\) contains NaN"):
        fl.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=5)


def test_apply_rotary_turns_each_pair(gen, assert_close):
    x = torch.randn(2, 3, 5, 12, generator=gen, dtype=F64)
    cos, sin = tables(gen, 9, 5)
    pos = torch.tensor([[1, 4, 0, 8, 2]])
    for inter in (True, False):
        got = fl.apply_rotary(x, cos, sin, pos, interleaved=inter)
        want = x.clone()
        for a in range(2):
            for h in range(3):
                for i in range(5):
                    want[a, h, i] = rotate(x[a, h, i], cos, sin, int(pos[0, i]), inter)
        assert_close(got, want, rtol=1e-15, name=f"rotary (interleaved={inter})")
        # a rotation keeps each pair's length
        norms = got[..., :10].pow(2).sum(-1)
        assert_close(norms, x[..., :10].pow(2).sum(-1), rtol=1e-14, name="norm")


BAD: dict[str, tuple[dict[str, Any], type, str]] = {
    "dropout": ({"dropout_p": 0.1}, ValueError, "dropout"),
    "bias": ({"bias": torch.zeros(1)}, ValueError, "bias"),
    "mask": ({"mask": fl.KeyPadding([3, 3])}, ValueError, "Causal, SlidingWindow"),
    "over capacity": ({"cache_seqlens": 8}, ValueError, "capacity"),
    "negative length": ({"cache_seqlens": torch.tensor([-1, 2])}, ValueError, ">= 0"),
    "lengths shape": ({"cache_seqlens": torch.tensor([1, 2, 3])}, ValueError, "cache_seqlens"),
    "float lengths": ({"cache_seqlens": torch.tensor([1.0, 2.0])}, TypeError, "integers"),
    "leftpad past length": (
        {"cache_seqlens": 2, "cache_leftpad": torch.tensor([3, 0])}, ValueError, "cache_leftpad",
    ),
    "batch index range": ({"cache_batch_idx": torch.tensor([0, 5])}, ValueError, "cache_batch_idx"),
    "repeated batch index": (
        {"cache_batch_idx": torch.tensor([1, 1])}, ValueError, "repeats"
    ),
    "rotary without sin": ({"rotary_cos": torch.ones(9, 2)}, ValueError, "together"),
    "rotary too wide": (
        {"rotary_cos": torch.ones(9, 3, dtype=F64), "rotary_sin": torch.ones(9, 3, dtype=F64)},
        ValueError, "rotary_dim",
    ),
    "rotary too short": (
        {"rotary_cos": torch.ones(3, 2, dtype=F64), "rotary_sin": torch.ones(3, 2, dtype=F64)},
        ValueError, "rows",
    ),
    "splits": ({"num_splits": 0}, ValueError, "num_splits"),
    "layout": ({"layout": "sbhd"}, ValueError, "layout"),
    "batch index with table": (
        {"cache_batch_idx": torch.tensor([0, 1]), "block_table": torch.tensor([[0], [1]])},
        ValueError, "block_table",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments_are_named(case, gen):
    kw, exc, words = BAD[case]
    q, kc, vc, k, v = make(gen, 2, 2, 2, 1, 8, 4, 4, 1)
    kw = {"cache_seqlens": 3, **kw}
    with pytest.raises(exc, match=words):
        fl.attention_with_kvcache(q, kc, vc, k, v, **kw)


def test_dtype_and_shape_mismatches_are_named(gen):
    q, kc, vc, k, v = make(gen, 2, 2, 2, 1, 8, 4, 4, 1)
    with pytest.raises(TypeError, match="share one dtype"):
        fl.attention_with_kvcache(q.float(), kc, vc, cache_seqlens=3)
    with pytest.raises(TypeError, match="cache's dtype"):
        fl.attention_with_kvcache(q, kc, vc, k.float(), v.float(), cache_seqlens=3)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="together"):
        fl.attention_with_kvcache(q, kc, vc, k, None, cache_seqlens=3)
    with pytest.raises(ValueError, match="query heads"):
        fl.attention_with_kvcache(q[:, :1], kc, vc, cache_seqlens=3)
    with pytest.raises(ValueError, match="4-D"):
        fl.attention_with_kvcache(q[0], kc, vc, cache_seqlens=3)


# -- a property ----------------------------------------------------------------------------
@st.composite
def cache_cases(draw: Any) -> dict:
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    cap = draw(st.integers(1, 20))
    l_new = draw(st.integers(0, min(3, cap)))
    lq = draw(st.integers(1, 4))
    lens = [draw(st.integers(0, cap - l_new)) for _ in range(b)]
    paged = draw(st.booleans()) and cap % 4 == 0
    pad = [] if paged else [draw(st.integers(0, n)) for n in lens]
    mask = draw(st.sampled_from(sorted(MASKS)))
    return dict(
        b=b, hkv=hkv, hq=hq, cap=cap, l_new=l_new, lq=lq, lens=lens, paged=paged,
        leftpad=pad if pad and draw(st.booleans()) else None, mask=mask,
        conv=draw(st.sampled_from([fl.SEED, fl.FLASH_ATTN_2, fl.FLASH_ATTN_3])),
        alibi=draw(st.booleans()), rotary=draw(st.booleans()) and l_new > 0,
        splits=draw(st.integers(1, 3)), block_q=draw(st.integers(1, 5)),
        block_k=draw(st.integers(1, 9)), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(case=cache_cases())
def test_any_cache_equals_the_reference(case, assert_close):
    gen = torch.Generator().manual_seed(case["seed"])
    b, hq, hkv, cap = case["b"], case["hq"], case["hkv"], case["cap"]
    q, kc, vc, k, v = make(gen, b, hq, hkv, case["lq"], cap, 6, 5, case["l_new"])
    table = None
    if case["paged"]:
        kc, table = paged_copy(kc, 4, gen)
        vc = torch.randn(kc.shape[0], hkv, 4, 5, generator=gen, dtype=F64)
    m, causal, window = MASKS[case["mask"]]
    slopes = torch.rand(b, hq, generator=gen, dtype=F64) if case["alibi"] else None
    cos = sin = None
    if case["rotary"]:
        cos, sin = tables(gen, cap + case["lq"], 2)
    want = kv_reference(
        q, kc, vc, k, v, seqlens=case["lens"], leftpad=case["leftpad"], table=table, cos=cos,
        sin=sin, causal=causal, window=window, alibi=slopes, conv=case["conv"],
    )  # fmt: skip
    got = fl.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(case["lens"]), block_table=table,
        cache_leftpad=None if case["leftpad"] is None else torch.tensor(case["leftpad"]),
        rotary_cos=cos, rotary_sin=sin, mask=m, alibi_slopes=slopes, conventions=case["conv"],
        num_splits=case["splits"], block_q=case["block_q"], block_k=case["block_k"],
    )  # fmt: skip
    check(
        got, want, (kc, vc), assert_close, str({k_: case[k_] for k_ in ("mask", "lens", "paged")})
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_cache_follows_the_float64_answer(dtype, gen):
    q, kc, vc, k, v = make(gen, 2, 4, 2, 2, 16, 8, 8, 2)
    cos, sin = tables(gen, 20, 4)
    lens = torch.tensor([5, 12])
    opts: dict[str, Any] = dict(cache_seqlens=lens, mask=fl.Causal(), block_k=4)
    exact = fl.attention_with_kvcache(
        *(x.to(dtype).double() for x in (q, kc, vc, k, v)), rotary_cos=cos, rotary_sin=sin, **opts
    )
    kc_, vc_ = kc.to(dtype), vc.to(dtype)
    low = fl.attention_with_kvcache(
        q.to(dtype),
        kc_,
        vc_,
        k.to(dtype),
        v.to(dtype),
        rotary_cos=cos,
        rotary_sin=sin,
        **opts,  # type: ignore[union-attr]
    )
    assert low.o.dtype == dtype and low.lse.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    # inputs rounded once, rotated keys rounded once more when written to the cache
    err = float((low.o.double() - exact.o).abs().max())
    assert err < 64 * eps, f"O off by {err:.3g} (eps {eps:.3g})"
    assert torch.equal(vc_[0, :, 5:7], v[0].to(dtype))  # type: ignore[index]
    assert low.ledger.itemsize == torch.empty((), dtype=dtype).element_size()


# torch's forward mode loads its jvp decompositions through torch.jit.script (deprecated)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_refused_call_leaves_the_cache_as_it_was():
    """Every check runs before the new rows are written: a call that raises has not
    changed the caller's cache (a too-short rotary table, a bad option, a NaN in the new
    keys and an input that requires a gradient all wrote first)."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    kc, vc = (
        torch.zeros(1, 2, 16, 8, dtype=torch.float64),
        torch.zeros(1, 2, 16, 8, dtype=torch.float64),
    )
    k, v = (
        torch.randn(1, 2, 1, 8, dtype=torch.float64),
        torch.randn(1, 2, 1, 8, dtype=torch.float64),
    )
    nan_k = k.clone()
    nan_k[0, 1, 0, 3] = math.nan
    short = dict(
        rotary_cos=torch.ones(6, 2, dtype=torch.float64),
        rotary_sin=torch.zeros(6, 2, dtype=torch.float64),
    )
    calls = {
        "rotary table": (lambda: fl.attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=5, mask=fl.Causal(), **short), "rotary positions"),
        "softcap": (lambda: fl.attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=5, softcap=-1.0), "softcap must be"),
        "NaN key": (lambda: fl.attention_with_kvcache(
            q, kc, vc, nan_k, v, cache_seqlens=5), "k contains NaN"),
        "requires grad": (lambda: fl.attention_with_kvcache(
            q.clone().requires_grad_(), kc, vc, k, v, cache_seqlens=5),
            "attention_with_kvcache is not differentiable"),
    }  # fmt: skip
    for name, (call, words) in calls.items():
        with pytest.raises(ValueError, match=words):
            call()
        assert not kc.any() and not vc.any(), f"{name}: the refused call wrote the cache"
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():  # a dual q's tangent would be dropped (it was: a tangent of None)
        dual = fwad.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match="not differentiable, in forward mode either"):
            fl.attention_with_kvcache(dual, kc, vc, k, v, cache_seqlens=5)
    assert not kc.any() and not vc.any(), "the refused dual call wrote the cache"
    with torch.no_grad():  # the same call without a graph to build decodes
        fl.attention_with_kvcache(q.clone().requires_grad_(), kc, vc, k, v, cache_seqlens=5)
    assert torch.equal(kc[:, :, 5:6], k) and torch.equal(vc[:, :, 5:6], v)


def test_a_paged_append_into_a_cell_some_sequence_reads_is_refused(gen, assert_close):
    """Pages 4 keys long. Sharing a page for reading (a common prompt) decodes as the same
    sequences laid out apart; an append into a cell another sequence reads (the same cell
    for both appends; a shared prompt page), or that the sequence itself reads at another
    position (a page named twice), is refused before anything is written."""
    q, kc, vc, k, v = make(gen, 2, 2, 2, 1, 4, 8, 8, 1)
    pages_k = torch.randn(6, 2, 4, 8, generator=gen, dtype=F64)
    pages_v = torch.randn(6, 2, 4, 8, generator=gen, dtype=F64)
    shared = torch.tensor([[0, 1, 2], [0, 4, 5]])  # page 0: both sequences' positions 0-3
    lens = [9, 6]
    want = kv_reference(q, pages_k.clone(), pages_v.clone(), k, v, seqlens=lens, table=shared)
    pk, pv = pages_k.clone(), pages_v.clone()
    got = fl.attention_with_kvcache(
        q, pk, pv, k, v, cache_seqlens=torch.tensor(lens), block_table=shared
    )
    check(got, want, (pk, pv), assert_close, "a page shared for reading")
    refused = {
        "both append to page 2 offset 1": (
            [[0, 1, 2], [3, 4, 2]], [9, 9], "sequence 0 appends its position 9 to page 2 "
            "offset 1, which sequence 1 reads as its position 9"),
        "an append into the shared prompt page": (
            [[1, 0, 2], [0, 4, 5]], [5, 6], "sequence 0 appends its position 5 to page 0 "
            "offset 1, which sequence 1 reads as its position 1"),
        "a page named twice": (
            [[0, 1, 0], [3, 4, 5]], [9, 6], "which it also reads as its position 1"),
    }  # fmt: skip
    for name, (table, lens, words) in refused.items():
        pk, pv = pages_k.clone(), pages_v.clone()
        with pytest.raises(ValueError, match=re.escape(words)):
            fl.attention_with_kvcache(
                q, pk, pv, k, v, cache_seqlens=torch.tensor(lens), block_table=torch.tensor(table)
            )
        assert torch.equal(pk, pages_k) and torch.equal(pv, pages_v), f"{name}: wrote"


def test_softcap_zero_is_flash_attns_off():
    """flash_attn_with_kvcache's default softcap=0.0 means none: a port keeps working."""
    q = torch.randn(2, 4, 1, 8, dtype=torch.float64)
    kc, vc = (
        torch.randn(2, 2, 9, 8, dtype=torch.float64),
        torch.randn(2, 2, 9, 8, dtype=torch.float64),
    )
    a = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=7, softcap=0.0)
    b = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=7)
    assert torch.equal(a.o, b.o) and torch.equal(a.lse, b.lse)


def test_torch_func_transforms_are_refused_with_the_reason():
    q = torch.randn(3, 1, 2, 1, 8)
    kc, vc = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    step = lambda x: fl.attention_with_kvcache(x, kc, vc, cache_seqlens=7).o  # noqa: E731
    with pytest.raises(RuntimeError, match="writes the cache in place"):
        torch.func.vmap(step)(q)


@pytest.mark.parametrize(
    "case", ["alibi shape", "scale past float32", "NaN in a cached key", "score_mod raises"]
)
def test_a_call_the_loop_refuses_leaves_the_cache_as_it_was(case):
    """Checks only the loop makes (an option's shape or range, a NaN in the keys in use,
    a score_mod's error) raise after the append: the overwritten rows are put back."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 4, generator=gen)
    k, v = torch.randn(2, 2, 1, 4, generator=gen), torch.randn(2, 2, 1, 4, generator=gen)
    kc, vc = torch.randn(2, 2, 8, 4, generator=gen), torch.randn(2, 2, 8, 4, generator=gen)
    opts: dict[str, Any] = {
        "alibi shape": dict(alibi_slopes=torch.ones(3)),
        "scale past float32": dict(scale=1e39),
        "NaN in a cached key": {},
        "score_mod raises": dict(score_mod=lambda s, b, h, i, j: 1 / 0),
    }[case]
    if case == "NaN in a cached key":
        kc[1, 0, 2, 0] = math.nan
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError):
        fl.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([3, 5]), **opts)
    assert torch.equal(kc.nan_to_num(), before[0].nan_to_num()), "k_cache was written"
    assert torch.equal(vc, before[1]), "v_cache was written"


def test_scale_and_softcap_are_taken_by_value_as_flash_attention_takes_them():
    """A 0-d tensor or a NumPy float32 scale/softcap: the same result as the float."""
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 4, dtype=F64, generator=gen)
    kc, vc = (torch.randn(1, 2, 6, 4, dtype=F64, generator=gen) for _ in range(2))
    want = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=6, scale=0.5, softcap=5.0)
    for scale, softcap in (
        (torch.tensor(0.5), torch.tensor(5.0)),
        (np.float32(0.5), np.float32(5)),
    ):
        got = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=6, scale=scale, softcap=softcap)
        assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse)


def test_the_ledger_books_every_row_a_gathered_cache_reads():
    """A paged (or batch-indexed) cache is gathered whole, used row by used row, before the
    loop runs: its reads are every used row and page, not the window's span alone."""
    gen = torch.Generator().manual_seed(0)
    b, h, d, page, per = 2, 2, 4, 4, 10
    kc, vc = (torch.randn(b * per, h, page, d, generator=gen) for _ in range(2))
    table = torch.randperm(b * per, generator=gen).view(b, per)
    q, k, v = (torch.randn(b, h, 1, d, generator=gen) for _ in range(3))
    res = fl.attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor([30, 17]), block_table=table,
        mask=fl.SlidingWindow(3, 0),
    )  # fmt: skip
    led = res.ledger
    assert led.keys_read == led.used == (31, 18)
    assert led.pages_read == 8 + 5
    assert led.cache_bytes_read == (31 + 18) * h * 2 * d * 4


def test_an_append_into_shared_memory_is_refused_before_anything_is_written():
    """The append writes one cell per (sequence, head, position). A prompt's cache
    expand()-ed across beams (stride 0), the same tensor as keys and values, or an
    inference tensor outside inference mode cannot take that: each is refused by name,
    and neither cache is changed (an expanded cache used to be written silently, every
    beam's row into one place, so beam 0 attended to beam 1's new key)."""
    prefix = torch.randn(1, 2, 16, 8, dtype=F64)
    q = torch.randn(2, 2, 1, 8, dtype=F64)
    k, v = torch.randn(2, 2, 1, 8, dtype=F64), torch.randn(2, 2, 1, 8, dtype=F64)
    plain = torch.zeros(2, 2, 16, 8, dtype=F64)
    with torch.inference_mode():
        frozen = torch.zeros(2, 2, 16, 8, dtype=F64)
    cases = {
        "expanded k_cache": (prefix.expand(2, -1, -1, -1), plain.clone(), "k_cache has positions that share memory"),
        "expanded v_cache": (plain.clone(), prefix.expand(2, -1, -1, -1), "v_cache has positions that share memory"),
        "one tensor for both": (plain, plain, "k_cache and v_cache are the same memory"),
        "inference v_cache": (plain.clone(), frozen, "v_cache is an inference tensor"),
    }  # fmt: skip
    for name, (kc, vc, words) in cases.items():
        before = (kc.clone(), vc.clone())
        with pytest.raises(ValueError, match=words):
            fl.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=5)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), f"{name}: written"
    # reading an expanded cache (no append) stays allowed and exact
    kc, vc = prefix.expand(2, -1, -1, -1), (prefix + 1).expand(2, -1, -1, -1)
    res = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=6)
    want = fl.reference_forward(q, kc[:, :, :6], vc[:, :, :6]).o
    assert (res.o - want).abs().max() < TOL
    with torch.inference_mode():  # an inference cache inside inference mode is written
        res = fl.attention_with_kvcache(q, frozen.clone(), frozen.clone(), k, v, cache_seqlens=5)
    assert torch.isfinite(res.o).all()


class _CacheCopies(TorchDispatchMode):
    """Bytes of the copies PyTorch makes of the cache's values while it is active: a copy
    op (``clone``, ``_to_copy``, ``index``, an out-of-place ``copy``/``masked_fill``) whose
    input holds cache values (the cache itself or an earlier such copy, views included)
    and whose result holds at least ``least`` elements (the overwritten rows an append
    keeps for its undo are smaller)."""

    COPIES = ("aten.clone.", "aten._to_copy.", "aten.index.Tensor", "aten.copy.default")

    def __init__(self, caches: tuple[torch.Tensor, ...], least: int) -> None:
        super().__init__()
        self.held = {c.untyped_storage().data_ptr() for c in caches}
        self.least, self.bytes = least, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func)
        copy = name.startswith(self.COPIES) or name == "aten.masked_fill.Scalar"
        ins = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        held = any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.held for a in ins
        )
        if copy and held and isinstance(out, torch.Tensor) and out.numel() >= self.least:
            self.held.add(out.untyped_storage().data_ptr())
            self.bytes += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("native_step", [True, False], ids=["native", "FLASHLEDGER_NATIVE=0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache", ["plain", "strided", "paged"])
def test_gathered_bytes_are_the_copies_the_step_made(cache, dtype, native_step, monkeypatch):
    """``gathered_bytes`` books the copies of the used K/V rows that the step really makes,
    seen as PyTorch makes them (and the native step's Kᵀ, which is laid out in C): a half
    cache read in place costs no float32 copy, the PyTorch step's conversions and Vᵀ are
    booked, and split-KV books each chunk's layout."""
    from flashledger import _native

    kern = _native.kernels()
    if native_step and kern is None:
        pytest.skip(_native.native_status())
    if kern is not None:
        kern.choose()  # every dtype's calibration made (or read back) first: its copies unseen
    if not native_step:
        monkeypatch.setenv("FLASHLEDGER_NATIVE", "0")
    laid: list[int] = []  # the native step's Kᵀ, laid out in C
    kt = _native.Kernels.transposed_k

    def counted(self, k, tile=0, dtype=None):  # type: ignore[no-untyped-def]
        laid.append(k.numel() * (dtype or k.dtype).itemsize)
        return kt(self, k, tile, dtype)

    monkeypatch.setattr(_native.Kernels, "transposed_k", counted)
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, cap, page = 2, 4, 2, 16, 64, 8  # d = 16: no AMX layout either
    for lq, splits in ((1, 1), (1, 2), (40, 1)):  # decode, split-KV decode, a prefill chunk
        q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
        k, v = (torch.randn(b, hkv, 1, d, generator=gen).to(dtype) for _ in range(2))
        table = None
        if cache == "paged":
            kc, vc = (torch.randn(b * cap // page, hkv, page, d, generator=gen) for _ in range(2))
            table = torch.randperm(b * cap // page, generator=gen).view(b, cap // page)
        else:  # "strided": every other head of a larger cache
            heads = hkv * (2 if cache == "strided" else 1)
            kc, vc = (torch.randn(b, heads, cap, d, generator=gen) for _ in range(2))
        kc, vc = kc.to(dtype)[:, :: kc.shape[1] // hkv], vc.to(dtype)[:, :: vc.shape[1] // hkv]
        seen = _CacheCopies((kc, vc), least=b * hkv * 8 * d)
        laid.clear()
        with torch.no_grad(), seen:
            res = fl.attention_with_kvcache(
                q, kc, vc, k, v, cache_seqlens=torch.tensor([50, 30]), block_table=table,
                mask=fl.Causal(), num_splits=splits,
            )  # fmt: skip
        where = f"{cache} {dtype} Lq={lq} splits={splits}"
        assert res.ledger.gathered_bytes == seen.bytes + sum(laid), where
        assert res.ledger.gathered_bytes > 0, where  # a cache of 64 positions, 51 in use
    if native_step and cache == "plain":
        # every position in use: the native decode step reads the cache where it lies, a
        # bfloat16 one too (no float32 copy)
        res = fl.attention_with_kvcache(q[:, :, :1], kc, vc, cache_seqlens=cap)
        assert res.ledger.gathered_bytes == 0


@pytest.mark.parametrize(
    "case",
    ["negative position", "position past the table", "float positions", "head dim too small",
     "positions of another shape"],
)  # fmt: skip
def test_apply_rotary_refuses_what_it_cannot_rotate_by_name(case, gen):
    """A position outside the table (no wrapping from its end), positions that are not
    integers or do not fit x, and a head dim below rotary_dim are refused, named."""
    x = y = torch.randn(2, 3, 8, generator=gen, dtype=F64)  # (H, L, d)
    cos, sin = tables(gen, 10, 2)  # rotary_dim 4, positions 0 .. 9
    pos: Any = torch.tensor([0, 4, 9])
    exc, words = ValueError, r"positions must be table rows 0 \.\. 9"
    if case == "negative position":
        pos = torch.tensor([0, -1, 2])
    elif case == "position past the table":
        pos = torch.tensor(10)
    elif case == "float positions":
        pos, exc, words = torch.tensor([0.0, 1.0, 2.0]), TypeError, "positions must be integers"
    elif case == "head dim too small":
        y, words = x[..., :3], r"head dim must be at least rotary_dim = 2 \* 2"
    else:
        pos, words = torch.tensor([0, 1]), r"positions must broadcast to x's \(\.\.\., L\)"
    with pytest.raises(exc, match=words):
        fl.apply_rotary(y, cos, sin, pos)
    # a Python int or list is a position as well
    assert torch.equal(fl.apply_rotary(x, cos, sin, 9), fl.apply_rotary(x, cos, sin, [9] * 3))


def test_cache_seqlens_none_reads_the_whole_cache_as_flash_attn_does(gen, assert_close):
    """flash-attn's default ``cache_seqlens=None``: every cache position is in use (plain or
    paged); with rows to append it is refused, named, as flash-attn refuses it."""
    q, kc, vc, k, v = make(gen, 2, 4, 2, 1, 12, 4, 4, 1)
    want = fl.attention_with_kvcache(q, kc, vc, cache_seqlens=12)
    got = fl.attention_with_kvcache(q, kc, vc)
    assert_close(got.o, want.o, rtol=0.0, name="O, cache_seqlens None")
    assert got.ledger.used == (12, 12)
    pages, table = paged_copy(kc, 4, gen)
    vpages = torch.zeros_like(pages)
    for i in range(2):
        for s in range(3):
            vpages[table[i, s]] = vc[i, :, 4 * s : 4 * s + 4]
    paged = fl.attention_with_kvcache(q, pages, vpages, block_table=table)
    assert_close(paged.o, want.o, rtol=TOL, name="O, paged, cache_seqlens None")
    before = kc.clone()
    with pytest.raises(ValueError, match="cache_seqlens must be given with k and v"):
        fl.attention_with_kvcache(q, kc, vc, k, v)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_an_empty_batch_is_refused_by_name(layout):
    """B = 0 (or no query head) is refused before anything is read, as flash-attn ("batch
    size must be positive") and flash_attention refuse it."""
    q = torch.zeros(0, 2, 1, 4, dtype=F64)
    kc = vc = torch.zeros(1, 2, 8, 4, dtype=F64)
    if layout == "bshd":
        q, kc, vc = (x.transpose(1, 2) for x in (q, kc, vc))
    seqlens = torch.tensor([], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"at least one sequence and one head .* \(0, 2, 1, 4\)"):
        fl.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, layout=layout)
