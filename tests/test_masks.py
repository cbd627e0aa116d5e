"""Mask algebra: dense matrices against the formulas of CONVENTIONS.md, and tile classes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import causal_visible, padding_visible, tile_classes_from_dense, window_visible

import flashledger as fl
from flashledger.masks import EMPTY, FULL, PARTIAL, Geometry

ALIGNS = ["top_left", "bottom_right"]
lengths = st.integers(1, 40)
blocks = st.integers(1, 24)
side = st.one_of(st.none(), st.just(-1), st.integers(0, 12))


@st.composite
def mask_and_formula(draw: Any, lq: int, lk: int, batch: int) -> tuple[fl.Mask, torch.Tensor]:
    """A random mask of any kind (or an ``&`` of two) and its formula, ``(B|1, 1|H, Lq, Lk)``."""

    def one() -> tuple[fl.Mask, torch.Tensor]:
        kind = draw(st.sampled_from(["causal", "window", "padding", "dense"]))
        if kind == "causal":
            align = draw(st.sampled_from(ALIGNS))
            return fl.Causal(align), causal_visible(lq, lk, align)[None, None]
        if kind == "window":
            align = draw(st.sampled_from(ALIGNS))
            left, right = draw(side), draw(side)
            m = fl.SlidingWindow(left, right, align=align)
            return m, window_visible(lq, lk, left, right, align)[None, None]
        if kind == "padding":
            lens = draw(st.lists(st.integers(0, lk + 3), min_size=batch, max_size=batch))
            pad_side = draw(st.sampled_from(["right", "left"]))
            m = fl.KeyPadding(lens, side=pad_side)
            return m, padding_visible(lq, lk, lens, pad_side)
        seed = draw(st.integers(0, 2**31 - 1))
        density = draw(st.sampled_from([0.0, 0.2, 0.8, 1.0]))
        gen = torch.Generator().manual_seed(seed)
        t = torch.rand(batch, 1, lq, lk, generator=gen) < density
        return fl.DenseMask(t), t

    m, vis = one()
    if draw(st.booleans()):
        m2, vis2 = one()
        m, vis = m & m2, vis & vis2
    return m, vis


# -- dense() against the formulas -------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(lq=lengths, lk=lengths, align=st.sampled_from(ALIGNS))
def test_causal_dense_is_the_formula(lq, lk, align, assert_same):
    assert_same(fl.Causal(align).dense(lq, lk), causal_visible(lq, lk, align), name="causal")
    # align=None takes the alignment of the conventions (here: of the geometry)
    assert_same(
        fl.Causal().dense(lq, lk, causal_align=align),
        causal_visible(lq, lk, align),
        name="Causal() under the conventions' alignment",
    )


def test_bottom_right_causal_masks_the_first_rows_when_lq_exceeds_lk():
    d = fl.Causal("bottom_right").dense(7, 4)
    assert not bool(d[:3].any()), "rows 0..2 of a 7x4 bottom-right causal mask see no key"
    assert d[3].tolist() == [True, False, False, False]
    assert bool(d[6].all())
    assert fl.Causal("top_left").dense(4, 7)[0].tolist() == [True] + [False] * 6


@settings(max_examples=80, deadline=None)
@given(lq=lengths, lk=lengths, left=side, right=side, align=st.sampled_from(ALIGNS))
def test_sliding_window_dense_is_the_formula(lq, lk, left, right, align, assert_same):
    got = fl.SlidingWindow(left, right, align=align).dense(lq, lk)
    assert_same(got, window_visible(lq, lk, left, right, align), name=f"window({left},{right})")


@pytest.mark.parametrize("align", ALIGNS)
def test_window_with_right_zero_and_unbounded_left_is_causal(align, assert_same):
    for left in (None, -1):
        assert_same(
            fl.SlidingWindow(left, 0, align=align).dense(9, 13),
            fl.Causal(align).dense(9, 13),
            name=f"SlidingWindow({left}, 0)",
        )
    full = fl.SlidingWindow(None, None, align=align).dense(5, 6)
    assert bool(full.all())
    # xformers' single-number window W keeps W keys including the query's own
    w = fl.SlidingWindow(2, 0, align=align).dense(8, 8)
    assert w.sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("lens", [[0], [3], [6], [9], [0, 2, 6]])
def test_key_padding_dense_is_the_formula(lens, side, assert_same):
    got = fl.KeyPadding(lens, side=side).dense(4, 6, batch=len(lens))
    want = padding_visible(4, 6, lens, side)
    if len(lens) == 1:
        want = want[0, 0]
    assert_same(got, want, name=f"KeyPadding({lens}, side={side!r})")


def test_key_padding_side_is_checked_and_shown():
    with pytest.raises(ValueError, match="side must be 'right' or 'left', got 'top'"):
        fl.KeyPadding([3], side="top")  # type: ignore[arg-type]
    assert repr(fl.KeyPadding([3, 5], side="left")) == "KeyPadding([3, 5], side='left')"
    assert repr(fl.KeyPadding([3])) == "KeyPadding([3])"


def test_dense_mask_dense_is_the_tensor(gen, assert_same):
    t = torch.rand(2, 3, 5, 7, generator=gen) < 0.5
    assert_same(fl.DenseMask(t).dense(5, 7, batch=2, heads=3), t, name="DenseMask")
    t2 = torch.rand(5, 7, generator=gen) < 0.5
    assert_same(fl.DenseMask(t2).dense(5, 7), t2, name="DenseMask 2-D")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), lq=lengths, lk=lengths, batch=st.integers(1, 3))
def test_any_mask_and_combination_dense_is_the_formula(data, lq, lk, batch, assert_same):
    m, vis = data.draw(mask_and_formula(lq, lk, batch))
    geo = Geometry.build(lq=lq, lk=lk, batch=batch, heads=2)
    got = m.bind(geo).dense()  # (Bm, Hm, Lq, Lk)
    assert_same(got.expand(batch, 2, lq, lk), vis.expand(batch, 2, lq, lk), name=repr(m))


def test_and_accepts_tensors_on_either_side(gen, assert_same):
    t = torch.rand(6, 6, generator=gen) < 0.5
    causal = fl.Causal("top_left").dense(6, 6)
    assert_same((fl.Causal("top_left") & t).dense(6, 6), causal & t, name="mask & tensor")
    assert_same(
        (fl.DenseMask(t) & fl.Causal("top_left")).dense(6, 6), causal & t, name="dense & mask"
    )
    a = fl.SlidingWindow(1, 1, align="top_left") & fl.Causal("top_left") & fl.KeyPadding([4])
    assert_same(
        a.dense(6, 6), window_visible(6, 6, 1, 0, "top_left") & (torch.arange(6) < 4), name="chain"
    )


# -- tile classes -----------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(data=st.data(), lq=lengths, lk=lengths, bq=blocks, bk=blocks, batch=st.integers(1, 3))
def test_tile_classes_equal_the_dense_reduction(data, lq, lk, bq, bk, batch, assert_same):
    m, vis = data.draw(mask_and_formula(lq, lk, batch))
    geo = Geometry.build(lq=lq, lk=lk, batch=batch, heads=2)
    got = m.bind(geo).tile_classes(bq, bk)
    want = tile_classes_from_dense(vis.expand(batch, 2, lq, lk), bq, bk)
    assert_same(got, want, name=f"tile classes of {m!r} ({lq}x{lk}, tiles {bq}x{bk})")


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    lq_total=st.integers(2, 40),
    lk_total=st.integers(2, 40),
    bq=blocks,
    bk=blocks,
)
def test_tile_classes_of_a_placed_slice(data, lq_total, lk_total, bq, bk, assert_same):
    """A call covering rows [q0, q0+lq) and keys [k0, k0+lk) of a longer sequence."""
    q0 = data.draw(st.integers(0, lq_total - 1))
    lq = data.draw(st.integers(1, lq_total - q0))
    k0 = data.draw(st.integers(0, lk_total - 1))
    lk = data.draw(st.integers(1, lk_total - k0))
    m, vis = data.draw(mask_and_formula(lq_total, lk_total, 1))
    geo = Geometry.build(
        lq=lq, lk=lk, q_offset=q0, k_offset=k0, lq_total=lq_total, lk_total=lk_total
    )
    bound = m.bind(geo)
    part = vis[..., q0 : q0 + lq, k0 : k0 + lk]
    assert_same(bound.dense().expand_as(part), part, name=f"placed dense of {m!r}")
    want = tile_classes_from_dense(part, bq, bk)
    assert_same(bound.tile_classes(bq, bk), want, name=f"placed tile classes of {m!r}")


def test_tile_classes_of_the_seed_and_ragged_edges(assert_same):
    want = torch.tensor([[PARTIAL, EMPTY, EMPTY], [FULL, PARTIAL, EMPTY], [FULL, FULL, FULL]])
    assert_same(fl.Causal().tile_classes(5, 5, 2, 2), want.to(torch.int8), name="seed 5x5 / 2x2")
    # a ragged last key tile (keys 8..9 of 10) that every row sees is full
    c = fl.KeyPadding([10]).tile_classes(3, 10, 3, 4)
    assert c.tolist() == [[FULL, FULL, FULL]]
    # keys 8..9 padded away: the last tile is empty, the middle one partial
    c = fl.KeyPadding([6]).tile_classes(3, 10, 3, 4)
    assert c.tolist() == [[FULL, PARTIAL, EMPTY]]
    # bottom-right causal with Lq > Lk: the first query tile sees nothing
    c = fl.Causal("bottom_right").tile_classes(8, 3, 4, 3)
    assert c.tolist() == [[EMPTY], [PARTIAL]]


def test_dense_mask_tile_is_full_only_if_full_in_every_batch_and_head(assert_same):
    t = torch.ones(2, 2, 4, 4, dtype=torch.bool)
    t[1, 0, 0, 0] = False
    geo = Geometry.build(lq=4, lk=4, batch=2, heads=2)
    got = fl.DenseMask(t).bind(geo).tile_classes(2, 2)
    assert_same(got, torch.tensor([[PARTIAL, FULL], [FULL, FULL]], dtype=torch.int8), name="B,H")
    # a causal mask intersected with it: the diagonal tiles stay partial
    got = (fl.DenseMask(t) & fl.Causal("top_left")).bind(geo).tile_classes(2, 2)
    want = torch.tensor([[PARTIAL, EMPTY], [FULL, PARTIAL]], dtype=torch.int8)
    assert_same(got, want, name="dense & causal")


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3),
    lq=st.integers(1, 40),
    lk=st.integers(1, 60),
    bq=st.integers(1, 17),
    bk=st.integers(1, 17),
    kind=st.sampled_from(["causal", "causal-br", "window", "padding", "causal&padding"]),
    data=st.data(),
)
def test_interval_tiles_in_integers_equal_the_tensor_rule(b, lq, lk, bq, bk, kind, data):
    """A few rows (decode) are classified in plain integers; the classes equal the tensor
    rule's, tile for tile."""
    from flashledger import masks
    from flashledger._problem import build_problem

    pad = fl.KeyPadding(data.draw(st.lists(st.integers(0, lk), min_size=b, max_size=b)))
    mask = {
        "causal": fl.Causal(),
        "causal-br": fl.Causal("bottom_right"),
        "window": fl.SlidingWindow(data.draw(st.integers(0, 10)), data.draw(st.integers(-1, 5))),
        "padding": pad,
        "causal&padding": fl.Causal("bottom_right") & pad,
    }[kind]
    q, k = torch.randn(b, 2, lq, 4), torch.randn(b, 2, lk, 4)
    bound = build_problem(q, k, k, mask=mask).mask
    assert isinstance(bound, masks.IntervalBound)
    few = bound._tile_classes_few(bq, bk, -(-lq // bq), -(-lk // bk))
    masks_few = masks._FEW_ROWS
    try:
        masks._FEW_ROWS = -1  # the tensor rule
        want = bound.tile_classes(bq, bk)
    finally:
        masks._FEW_ROWS = masks_few
    assert torch.equal(few, want), (few, want)


@settings(max_examples=80, deadline=None)
@given(
    lq=st.integers(1, 40),
    lk=st.integers(1, 60),
    extra_q=st.integers(0, 5),
    extra_k=st.integers(0, 9),
    data=st.data(),
)
def test_masks_bound_in_integers_equal_the_tensor_form(lq, lk, extra_q, extra_k, data):
    """On a plain geometry a few rows bind in plain integers (a decode step); their
    intervals equal the tensor form's, row for row, for every alignment, window side and
    placement inside a longer sequence, alone and under ``&``."""
    from flashledger import masks

    def one() -> fl.Mask:
        align = data.draw(st.sampled_from([None, *ALIGNS]))
        if data.draw(st.booleans()):
            return fl.Causal(align)
        return fl.SlidingWindow(data.draw(side), data.draw(side), align=align)

    mask = one() if data.draw(st.booleans()) else one() & one()
    q_off, k_off = data.draw(st.integers(0, extra_q)), data.draw(st.integers(0, extra_k))
    geo = Geometry.build(
        lq=lq,
        lk=lk,
        q_offset=q_off,
        k_offset=k_off,
        lq_total=lq + extra_q,
        lk_total=lk + extra_k,
        causal_align=data.draw(st.sampled_from(ALIGNS)),
        window_rewrite=data.draw(st.booleans()),
    )
    assert geo.plain
    few = mask.bind(geo)
    rows = masks._FEW_ROWS
    try:
        masks._FEW_ROWS = -1  # the tensor form
        want = mask.bind(geo)
    finally:
        masks._FEW_ROWS = rows
    assert isinstance(few, masks.IntervalBound) and isinstance(want, masks.IntervalBound)
    assert few._rows is not None and want._rows is None, "one form each"
    assert torch.equal(few.lo, want.lo), (mask, few.lo, want.lo)
    assert torch.equal(few.hi, want.hi), (mask, few.hi, want.hi)
    assert few.rows() == want.rows()
    for got, ref in zip(few.local_intervals(), want.local_intervals()):
        assert torch.equal(got, ref), (mask, got, ref)
    assert torch.equal(few.dense(), want.dense()), mask


def test_a_plain_geometry_makes_its_row_tensors_when_asked():
    """A plain geometry (no variable or used lengths) holds no tensor until asked; then its
    rows read ``[0, Lk_total)`` with the two diagonals, as a bounded geometry's do."""
    geo = Geometry.build(lq=3, lk=5, q_offset=2, lq_total=6, lk_total=9)
    assert geo.plain and not geo.bounded and "k_lo" not in geo.__dict__
    assert geo.k_lo.tolist() == [[0, 0, 0]] and geo.k_hi.tolist() == [[9, 9, 9]]
    assert geo.diagonal("top_left").tolist() == [[2, 3, 4]]
    assert geo.diagonal("bottom_right").tolist() == [[5, 6, 7]]
    assert geo.diagonal_rows("bottom_right") == [5, 6, 7]
    used = Geometry.build(lq=3, lk=5, batch=2, seqused_k=torch.tensor([5, 2]))
    assert not used.plain and used.k_hi.tolist() == [[5, 5, 5], [2, 2, 2]]


def test_a_value_mask_on_the_same_long_plain_geometry_is_bound_once():
    """``Causal`` and ``SlidingWindow`` on a plain geometry of many rows bind once per
    geometry and keep their tile classes (a training step's layers share them), equal to
    a fresh binding's; another geometry, value or tile size binds or classifies afresh,
    and a mask holding tensors is never kept."""
    from flashledger import masks

    geo = Geometry.build(lq=1500, lk=1700)
    for mask in (fl.Causal("bottom_right"), fl.SlidingWindow(100, 3)):
        first, again = mask.bind(geo), mask.bind(Geometry.build(lq=1500, lk=1700))
        assert first is again
        rows = first.tile_class_rows(256, 128)
        assert first.tile_class_rows(256, 128) is rows
        fresh = mask._bind(geo) if isinstance(mask, fl.SlidingWindow) else None
        want = fresh or masks.IntervalBound(geo, geo.k_lo, geo.diagonal("bottom_right"))
        assert rows == want.tile_classes(256, 128).tolist()
        assert first.tile_class_rows(128, 128) == want.tile_classes(128, 128).tolist()
        assert mask.bind(Geometry.build(lq=1500, lk=1701)) is not first
    assert fl.Causal("top_left").bind(geo) is not fl.Causal("bottom_right").bind(geo)
    few = Geometry.build(lq=8, lk=1700)
    assert fl.Causal().bind(few) is not fl.Causal().bind(few)  # a few rows: plain integers
    lens = torch.tensor([1000, 1700])
    pad = fl.KeyPadding(lens)
    two = Geometry.build(lq=1500, lk=1700, batch=2)
    assert pad.bind(two) is not pad.bind(two)


@pytest.mark.parametrize(
    "shape",
    [(2, 1, 1, 9), (1, 9), (7, 1), (1, 1, 9), (2, 3, 7, 1), (2, 1, 7, 9), (1, 3, 1, 1)],
    ids=str,
)
@pytest.mark.parametrize("length", [9, 300], ids=["short", "native"])
def test_bool_mask_broadcasts_in_every_dim(shape, length, gen, assert_close):
    """A bool ``mask=`` broadcasts as SDPA's ``attn_mask`` does, the query and key dims
    included: ``(B, 1, 1, Lk)`` is the usual key-padding mask. Forward and gradients
    against SDPA (float64), on the small path and on the native step's."""
    lq, lk = (7, 9) if length == 9 else (length - 13, length)
    q = torch.randn(2, 3, lq, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(2, 3, lk, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    sized = tuple(lq if n == 7 else lk if n == 9 else n for n in shape)
    m = torch.rand(sized, generator=gen) < 0.6
    m[..., 0] = True  # every row sees a key (SDPA gives NaN for a row that sees none)
    o = fl.flash_attention(q, k, v, mask=m)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert_close(o, want, rtol=1e-12, name=f"O, mask {sized}")
    got_g = torch.autograd.grad(o.square().sum(), (q, k, v))
    want_g = torch.autograd.grad(want.square().sum(), (q, k, v))
    for name, a, b in zip("qkv", got_g, want_g):
        assert_close(a, b, rtol=1e-12, name=f"d{name}, mask {sized}")


def test_dense_and_tile_classes_check_their_sizes_and_take_preset_names():
    """``Mask.dense`` and ``Mask.tile_classes`` took a preset's name as every entry point
    does only as an AttributeError ('str' object has no attribute 'causal_align'), a tile
    side of 0 as a ZeroDivisionError, and negative sizes as an empty answer."""
    w = fl.SlidingWindow(2, None)
    assert torch.equal(
        w.dense(3, 8, conventions="flash_attn_2"), w.dense(3, 8, conventions=fl.FLASH_ATTN_2)
    )
    assert torch.equal(
        w.tile_classes(3, 8, 2, 2, conventions="flash_attn_2"),
        w.tile_classes(3, 8, 2, 2, conventions=fl.FLASH_ATTN_2),
    )
    with pytest.raises(ValueError, match="block_q"):
        fl.Causal().tile_classes(6, 6, 0, 2)
    with pytest.raises(ValueError, match="block_k"):
        fl.MaskMod(lambda b, h, q, k: q >= k).tile_classes(6, 6, 2, -1)
    with pytest.raises(ValueError, match="lq"):
        fl.Causal().dense(-3, 4)
    with pytest.raises(ValueError, match="batch"):
        fl.Causal().dense(3, 3, batch=0)
