"""Span bounds of a mask_mod (``flashledger._spans``): a tile they call empty or full is
empty or full at every position, and a mask_mod they cannot bound is evaluated in full.

The property draws random mask_mods from a grammar of what the spans know (integer
arithmetic, division and remainder by constants, conversions, comparisons, logic,
``where``, a captured tensor indexed by a clamped expression) and holds the bounds to
the mask_mod evaluated at every position, on geometries with offsets and ragged tiles.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import flex_visible, tile_classes_from_dense
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

import flashledger as fl
from flashledger import _maskmod
from flashledger import masks as masks_mod
from flashledger._mods import INDEX_DTYPE, TileCaller
from flashledger._spans import span_classes
from flashledger.masks import EMPTY, FULL, PARTIAL, Geometry

Tensor = torch.Tensor
Expr = Callable[[Any, Any, Any, Any], Any]


def _tiles(n: int, block: int, offset: int) -> tuple[Tensor, Tensor]:
    first = torch.arange(0, n, block)
    return first + offset, torch.clamp(first + block, max=n) - 1 + offset


def _exact(fn: Expr, batch: int, heads: int, rows: Tensor, keys: Tensor) -> Tensor:
    """The mask on every position ``(B, H, r, c)`` (global rows and keys), broadcast, on
    the indices' dtype the library passes (int32)."""
    dt = INDEX_DTYPE
    b = torch.arange(batch, dtype=dt).view(-1, 1, 1, 1)
    h = torch.arange(heads, dtype=dt).view(1, -1, 1, 1)
    out = fn(b, h, rows.to(dt).view(1, 1, -1, 1), keys.to(dt).view(1, 1, 1, -1))
    return torch.as_tensor(out).expand(batch, heads, rows.numel(), keys.numel())


def _check_sound(
    fn: Expr, batch: int, heads: int, lq: int, lk: int, bq: int, bk: int, qo: int, ko: int
) -> tuple[Tensor, Tensor] | None:
    """Assert that ``fn``'s span bounds hold at every position; return them."""
    got = span_classes(
        fn, batch=batch, heads=heads, rows=_tiles(lq, bq, qo), keys=_tiles(lk, bk, ko)
    )
    if got is None:
        return None
    may_true, may_false = got
    vis = _exact(fn, batch, heads, torch.arange(lq) + qo, torch.arange(lk) + ko)
    exact = tile_classes_from_dense(vis, bq, bk)
    wrong = (~may_true & (exact != EMPTY)) | (~may_false & (exact != FULL))
    assert not bool(wrong.any()), (
        f"span bounds call tile {torch.nonzero(wrong)[0].tolist()} "
        f"{'empty' if not bool(may_true[tuple(torch.nonzero(wrong)[0])]) else 'full'}; "
        f"it is {['empty', 'partial', 'full'][int(exact[tuple(torch.nonzero(wrong)[0])])]}"
    )
    return may_true, may_false


# -- a grammar of mask_mods ------------------------------------------------------------------
VALS = torch.tensor([3, 0, 7, 7, 2, 9, 1, 1, 4, 6, 5, 8, 0, 2, 3, 9, 7])  # captured, 17 long
FLAGS = torch.tensor([True, False, True, True, False, False, True, False, True, True, False])


@st.composite
def int_expr(draw: Any, depth: int = 0) -> tuple[str, Expr]:
    leaves: list[tuple[str, Expr]] = [
        ("q", lambda b, h, q, k: q),
        ("k", lambda b, h, q, k: k),
        ("b", lambda b, h, q, k: b),
        ("h", lambda b, h, q, k: h),
    ]
    if depth >= 3 or draw(st.integers(0, 2)) == 0:
        if draw(st.booleans()):
            c = draw(st.integers(-40, 40))
            return (f"{c}", lambda b, h, q, k, c=c: q * 0 + c)
        return draw(st.sampled_from(leaves))
    op = draw(
        st.sampled_from(
            [
                "add",
                "sub",
                "mul",
                "neg",
                "abs",
                "floordiv",
                "mod",
                "min",
                "max",
                "clamp",
                "where",
                "gather",
                "rsub",
                "div_floor",
                "int32",
                "to_long",
            ]
        )
    )
    xs, x = draw(int_expr(depth + 1))
    c = draw(st.integers(1, 9))
    if op in ("add", "sub", "mul", "min", "max"):
        ys, y = draw(int_expr(depth + 1))
        f: Expr = {
            "add": lambda b, h, q, k: x(b, h, q, k) + y(b, h, q, k),
            "sub": lambda b, h, q, k: x(b, h, q, k) - y(b, h, q, k),
            "mul": lambda b, h, q, k: x(b, h, q, k) * y(b, h, q, k),
            "min": lambda b, h, q, k: torch.minimum(x(b, h, q, k), y(b, h, q, k)),
            "max": lambda b, h, q, k: torch.maximum(x(b, h, q, k), y(b, h, q, k)),
        }[op]
        return (f"{op}({xs}, {ys})", f)
    if op == "where":
        cs, cond = draw(bool_expr(depth + 1))
        ys, y = draw(int_expr(depth + 1))
        return (
            f"where({cs}, {xs}, {ys})",
            lambda b, h, q, k: torch.where(cond(b, h, q, k), x(b, h, q, k), y(b, h, q, k)),
        )
    if op == "gather":
        return (
            f"VALS[clamp({xs})]",
            lambda b, h, q, k: VALS[torch.clamp(x(b, h, q, k), 0, VALS.numel() - 1)],
        )
    unary: dict[str, Expr] = {
        "neg": lambda b, h, q, k: -x(b, h, q, k),
        "abs": lambda b, h, q, k: torch.abs(x(b, h, q, k)),
        "floordiv": lambda b, h, q, k: x(b, h, q, k) // c,
        "div_floor": lambda b, h, q, k: torch.div(x(b, h, q, k), -c, rounding_mode="floor"),
        "mod": lambda b, h, q, k: x(b, h, q, k) % c,
        "clamp": lambda b, h, q, k: torch.clamp(x(b, h, q, k), -c, 3 * c),
        "rsub": lambda b, h, q, k: c - x(b, h, q, k),
        "int32": lambda b, h, q, k: x(b, h, q, k).int(),
        "to_long": lambda b, h, q, k: x(b, h, q, k).to(torch.int64),
    }
    return (f"{op}({xs}, {c})", unary[op])


@st.composite
def bool_expr(draw: Any, depth: int = 0) -> tuple[str, Expr]:
    op = draw(
        st.sampled_from(
            ["cmp", "cmp", "cmp", "and", "or", "xor", "not", "flags", "float_cmp", "where"]
            if depth < 3
            else ["cmp", "float_cmp"]
        )
    )
    if op in ("cmp", "float_cmp"):
        (xs, x), (ys, y) = draw(int_expr(depth + 1)), draw(int_expr(depth + 1))
        rel = draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
        cmp: Callable[[Any, Any], Any] = {
            "<": lambda a, c: a < c,
            "<=": lambda a, c: a <= c,
            ">": lambda a, c: a > c,
            ">=": lambda a, c: a >= c,
            "==": lambda a, c: a == c,
            "!=": lambda a, c: a != c,
        }[rel]
        if op == "float_cmp":  # through float32 and a true division
            s = draw(st.sampled_from([0.5, 3.0, -2.5]))
            return (
                f"{xs}.float() / {s} {rel} {ys}",
                lambda b, h, q, k: cmp(x(b, h, q, k).float() / s, y(b, h, q, k)),
            )
        return (f"{xs} {rel} {ys}", lambda b, h, q, k: cmp(x(b, h, q, k), y(b, h, q, k)))
    if op == "flags":
        xs, x = draw(int_expr(depth + 1))
        return (
            f"FLAGS[clamp({xs})]",
            lambda b, h, q, k: FLAGS[torch.clamp(x(b, h, q, k), 0, FLAGS.numel() - 1)],
        )
    if op == "not":
        xs, x = draw(bool_expr(depth + 1))
        return (f"~{xs}", lambda b, h, q, k: ~x(b, h, q, k))
    (xs, x), (ys, y) = draw(bool_expr(depth + 1)), draw(bool_expr(depth + 1))
    if op == "where":
        cs, cond = draw(bool_expr(depth + 1))
        return (
            f"where({cs}, {xs}, {ys})",
            lambda b, h, q, k: torch.where(cond(b, h, q, k), x(b, h, q, k), y(b, h, q, k)),
        )
    f: Expr = {
        "and": lambda b, h, q, k: x(b, h, q, k) & y(b, h, q, k),
        "or": lambda b, h, q, k: x(b, h, q, k) | y(b, h, q, k),
        "xor": lambda b, h, q, k: x(b, h, q, k) ^ y(b, h, q, k),
    }[op]
    return (f"{op}({xs}, {ys})", f)


@settings(max_examples=300, deadline=None)
@given(
    expr=bool_expr(),
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    lq=st.sampled_from([1, 7, 33, 97]),
    lk=st.sampled_from([1, 13, 64, 113]),
    bq=st.sampled_from([1, 4, 16, 32]),
    bk=st.sampled_from([1, 8, 16, 64]),
    qo=st.integers(0, 20),
    ko=st.integers(0, 20),
)
def test_span_bounds_hold_at_every_position(expr, batch, heads, lq, lk, bq, bk, qo, ko):
    name, fn = expr
    try:
        _check_sound(fn, batch, heads, lq, lk, bq, bk, qo, ko)
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from exc


# -- the masks people write ----------------------------------------------------------------
def _doc_ids(lengths: list[int]) -> Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


DOC = _doc_ids([40, 30, 43, 1, 19])
PREFIX = torch.tensor([17, 60])  # per batch entry
WINDOW = torch.tensor([8, 24, 40])  # per head


def causal(b, h, q, k):
    return q >= k


def window(b, h, q, k):
    return (q - k).abs() <= 20


def prefix_lm(b, h, q, k):
    return (k < PREFIX[b]) | (q >= k)


def document(b, h, q, k):
    return (DOC[q] == DOC[k]) & (q >= k)


def chunked(b, h, q, k):
    return q // 32 == k // 32


def per_head_window(b, h, q, k):
    return (q >= k) & (q - k < WINDOW[h])


def neighbourhood(b, h, q, k):
    qx, qy, kx, ky = q % 11, q // 11, k % 11, k // 11
    return ((qx - kx).abs() <= 2) & ((qy - ky).abs() <= 2)


def dilated(b, h, q, k):
    return (q >= k) & ((q - k) % 3 == 0)


def where_mask(b, h, q, k):
    return torch.where(q < 50, q >= k, (q - k).abs() < 10)


def float_alibi_cut(b, h, q, k):
    return (q - k).float() * (h + 1).float() / 8.0 < 12.5


ZOO = [
    causal,
    window,
    prefix_lm,
    document,
    chunked,
    per_head_window,
    neighbourhood,
    dilated,
    where_mask,
    float_alibi_cut,
    and_masks(causal, window),
    or_masks(prefix_lm, chunked),
    noop_mask,
]
TIGHT = {"causal", "window", "prefix_lm", "document", "chunked", "noop_mask", "and_mask"}


@pytest.mark.parametrize("fn", ZOO, ids=lambda f: f.__name__)
@pytest.mark.parametrize("tiles", [(16, 32), (32, 16), (7, 9)])
def test_mask_zoo_classes_are_exact_and_mostly_decided(fn, tiles):
    """attention-gym-style mask_mods: the classes equal a dense evaluation's, the bounds
    decide every tile they can, and for the masks whose bounds are tight, exactly the
    partial tiles are left to evaluate."""
    bq, bk = tiles
    lq, lk = 97, 113
    bounds = _check_sound(fn, 2, 3, lq, lk, bq, bk, 0, 0)
    assert bounds is not None, f"{fn.__name__}: the spans should bound it"
    exact = tile_classes_from_dense(flex_visible(fn, 2, 3, lq, lk), bq, bk)
    got = fl.MaskMod(fn).tile_classes(lq, lk, bq, bk, batch=2, heads=3)
    assert torch.equal(got, exact)
    undecided = bounds[0] & bounds[1]
    if fn.__name__ in TIGHT:
        assert torch.equal(undecided, exact == PARTIAL), fn.__name__


def test_offsets_and_ragged_tiles_use_global_positions():
    """A causal mask on rows 30..96 against keys 5..112 (as a split or ring call sees it)."""
    bounds = _check_sound(causal, 1, 1, 67, 108, 16, 32, 30, 5)
    assert bounds is not None
    may_true, may_false = bounds
    assert bool((~may_false).any()) and bool((~may_true).any())


# -- what the spans leave alone --------------------------------------------------------------
def python_branch(b, h, q, k):
    if q >= 0:  # Python control flow on an index (no mask_mod of a tile can do this)
        return q >= k
    return q < k


def reduction(b, h, q, k):
    return (q >= k) & (q - k < 30) if bool((q >= 0).all()) else q < k


def bit_and(b, h, q, k):
    return (q & 1) == (k & 1)


def shape_read(b, h, q, k):
    return (q >= k) & (q.shape[-2] > 0)


def out_of_range(b, h, q, k):
    return DOC[q + 50] == DOC[k]  # the last rows index past DOC


def wraps_around(b, h, q, k):
    return (q * 2**40) * 2**30 > k  # int64 wraps: not monotone


def narrows(b, h, q, k):
    return (q * 2**40).int() > k  # int32 wraps


def wraps_in_int32(b, h, q, k):
    return q * 2**25 > k * 2**25 + 1  # int64 would not wrap; int32 indices do from q = 64


def two_varying(b, h, q, k):
    dense = torch.rand(120, 120) > 0.5
    return dense[q, k]


def scalar_only(b, h, q, k):
    return torch.where(q >= k, True, False) if q.ndim == 0 else q.item() >= k.item()


def test_python_control_flow_on_a_span_leaves_the_spans():
    assert (
        span_classes(python_branch, batch=1, heads=1, rows=_tiles(9, 4, 0), keys=_tiles(9, 4, 0))
        is None
    )


@pytest.mark.parametrize(
    "fn",
    [reduction, bit_and, shape_read, two_varying, wraps_around, narrows, wraps_in_int32],
    ids=lambda f: f.__name__,
)
def test_a_mask_mod_the_spans_cannot_bound_is_evaluated_in_full(fn):
    torch.manual_seed(0)
    if fn is wraps_in_int32:  # its int32 arithmetic wraps: evaluated, and said so
        with pytest.warns(UserWarning, match="'wraps_in_int32' computes integers that may"):
            assert _check_sound(fn, 1, 2, 97, 113, 16, 32, 0, 0) is None
    else:
        assert _check_sound(fn, 1, 2, 97, 113, 16, 32, 0, 0) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (wraps_in_int32 says it again)
        bound_classes = fl.MaskMod(fn).bind(_geometry(97, 113)).bounded_classes(16, 32)
        assert bool((bound_classes == PARTIAL).all())
        if fn is not two_varying:  # random: evaluated twice it differs
            vis = _exact(fn, 1, 2, torch.arange(97), torch.arange(113))
            exact = tile_classes_from_dense(vis, 16, 32)
            got = fl.MaskMod(fn).tile_classes(97, 113, 16, 32, heads=2)
            assert torch.equal(got, exact)


def test_an_index_past_a_captured_tensor_is_the_mask_mods_own_error():
    """The spans never decide a tile whose index may fall outside a captured tensor: the
    mask_mod is evaluated, and its IndexError is what the call reports."""
    lq = DOC.numel()
    assert (
        span_classes(out_of_range, batch=1, heads=1, rows=_tiles(lq, 16, 0), keys=_tiles(lq, 16, 0))
        is None
    )
    q = k = v = torch.randn(1, 1, lq, 8)
    with pytest.raises(
        ValueError, match=r"out_of_range.*raised IndexError: index 133 is out of bounds"
    ):
        fl.flash_attention(q, k, v, mask=fl.MaskMod(out_of_range))


def test_scalar_mask_mods_still_run_under_vmap():
    """A mask_mod written for scalars leaves the spans at once and runs under vmap."""
    q = k = v = torch.randn(1, 2, 40, 8, dtype=torch.float64)
    got = fl.flash_attention(q, k, v, mask=fl.MaskMod(scalar_only), block_q=16, block_k=16)
    want = fl.flash_attention(q, k, v, mask=fl.Causal(), block_q=16, block_k=16)
    assert torch.equal(got, want)


def test_composites_decide_tiles_from_both_sides(monkeypatch):
    """``MaskMod(f) & Causal()`` and ``MaskMod(f) | MaskMod(g)``: every tile both sides
    decide is left unevaluated, and the classes equal the ones with the bounds off."""
    q = k = v = torch.randn(1, 2, 97, 8, dtype=torch.float64)
    cases = {
        "and": fl.MaskMod(window) & fl.Causal(),
        "or": fl.MaskMod(chunked) | fl.MaskMod(causal),
        "nested": (fl.MaskMod(document) & fl.SlidingWindow(24, 0)) | fl.MaskMod(chunked),
    }
    for name, mask in cases.items():
        with torch.no_grad():
            on = fl.blocked_forward(q, k, v, mask=mask, block_q=16, block_k=16)
            monkeypatch.setattr(_maskmod, "SPAN_BOUNDS", False)
            off = fl.blocked_forward(q, k, v, mask=mask, block_q=16, block_k=16)
            monkeypatch.setattr(_maskmod, "SPAN_BOUNDS", True)
        c_on, c_off = on.ledger.counters, off.ledger.counters
        assert on.ledger.tile_kinds == off.ledger.tile_kinds, name
        assert torch.equal(on.o, off.o), name
        assert c_on.mask_mod_classify_evals < c_off.mask_mod_classify_evals, name


def _geometry(lq: int, lk: int) -> Geometry:
    return Geometry.build(lq=lq, lk=lk, batch=1, heads=2)


def test_the_ledger_books_the_tiles_the_bounds_decided(monkeypatch):
    """A causal MaskMod: every empty and full tile is decided by the bounds, the ledger
    says so (and the closed form predicts it); with the bounds off, none is."""
    q = k = v = torch.randn(1, 2, 97, 8, dtype=torch.float64)
    with torch.no_grad():
        res = fl.blocked_forward(q, k, v, mask=fl.MaskMod(causal), block_q=16, block_k=16)
    exact = tile_classes_from_dense(flex_visible(causal, 1, 2, 97, 97), 16, 16)
    decided = int((exact != PARTIAL).sum())
    c = res.ledger.counters
    assert c.mask_mod_tiles_bounded == decided > 0
    assert f"({decided} tiles decided by bounds)" in str(res.ledger)
    sw = fl.storage_and_work(
        lq=97, lk=97, d=8, heads=2, block_q=16, block_k=16, mask=fl.MaskMod(causal)
    )
    assert sw.mask_mod_tiles_bounded == decided
    assert sw.to_dict()["mask_mod_tiles_bounded"] == decided
    monkeypatch.setattr(_maskmod, "SPAN_BOUNDS", False)
    with torch.no_grad():
        off = fl.blocked_forward(q, k, v, mask=fl.MaskMod(causal), block_q=16, block_k=16)
    assert off.ledger.counters.mask_mod_tiles_bounded == 0
    assert "decided by bounds" not in str(off.ledger)


def test_a_result_that_is_not_a_tensor_is_still_refused():
    """A mask_mod returning a Python bool is not decided by the bounds: the tile call
    refuses it, as it did before the bounds."""
    assert (
        span_classes(
            lambda b, h, q, k: True, batch=1, heads=1, rows=_tiles(9, 4, 0), keys=_tiles(9, 4, 0)
        )
        is None
    )
    q = k = v = torch.randn(1, 1, 9, 4)
    with pytest.raises(ValueError, match="returned bool, not a tensor"):
        fl.flash_attention(q, k, v, mask=fl.MaskMod(lambda b, h, qi, ki: True))


# -- refining the open tiles by sub-blocks ------------------------------------------------------
def _kept_against_dense(bound: Any, dense: Tensor) -> int:
    """Assert every kept tile's visibility equals the dense mask's; return how many."""
    kept = bound._kept()[0]
    for (q0, q1, k0, k1), vis in kept.items():
        want = dense[..., q0:q1, k0:k1]
        got = vis.expand(want.shape)
        wrong = torch.nonzero(got != want)
        assert wrong.numel() == 0, (
            f"kept tile rows {q0}..{q1 - 1} keys {k0}..{k1 - 1}: position "
            f"{wrong[0].tolist()} is {bool(got[tuple(wrong[0])])}, the mask says "
            f"{bool(want[tuple(wrong[0])])}"
        )
    return len(kept)


@pytest.mark.parametrize("fn", ZOO, ids=lambda f: f.__name__)
@pytest.mark.parametrize("tiles", [(32, 64), (64, 32), (48, 16)])
def test_sub_blocks_give_the_exact_classes_and_visibility(fn, tiles, monkeypatch):
    """Tiles the bounds leave open are refined by sub-blocks (the bounds again, then only
    the open sub-blocks evaluated, all in one call): the classes equal a dense
    evaluation's, each kept partial tile's visibility equals the mask's at every
    position (ragged last tiles, per-batch and per-head masks), and a mask the bounds
    follow evaluates fewer positions than whole tiles take."""
    bq, bk = tiles
    lq, lk = 133, 131  # DOC's length, and ragged for every tile size
    dense = flex_visible(fn, 2, 3, lq, lk)  # (B, H, Lq, Lk)
    exact = tile_classes_from_dense(dense, bq, bk)
    evaluated = {}
    for refine in (True, False):
        if not refine:
            monkeypatch.setattr(masks_mod, "SUB_BLOCKS", ())
        bound = fl.MaskMod(fn).bind(Geometry.build(lq=lq, lk=lk, batch=2, heads=3))
        got = bound.classes(bq, bk)
        assert torch.equal(got, exact), f"refine={refine}"
        assert _kept_against_dense(bound, dense) == int((exact == PARTIAL).sum())
        evaluated[refine] = sum(c.positions for c in bound.callers)
    if fn.__name__ in TIGHT and fn is not noop_mask and tiles != (48, 16):
        assert evaluated[True] < evaluated[False], evaluated


def not_five_dims(b, h, q, k):
    """Written for the 4-D tile only: it names the tile's dims."""
    return (q >= k).reshape(q.shape[0], q.shape[1], q.shape[2], k.shape[3])


def test_sub_blocks_are_one_broadcast_call():
    """``TileCaller.blocks``: N sub-blocks in one call of an element-wise mask_mod, equal to
    its values on each; a callable that takes 4-D tiles only answers None (and counts
    nothing), so its tiles are evaluated whole."""
    rows = torch.tensor([[0, 1, 2, 2], [8, 9, 10, 11]])  # (N, s): a repeated last row
    keys = torch.tensor([[4, 5, 6, 7], [0, 1, 2, 3]])
    caller = TileCaller(per_head_window, "mask_mod")
    got = caller.blocks(2, 3, rows, keys, positions=28)
    assert got is not None and got.shape[2:] == (2, 4, 4)
    for n in range(2):
        want = _exact(per_head_window, 2, 3, rows[n], keys[n])
        assert torch.equal(got[:, :, n].expand(2, 3, 4, 4), want)
    assert (caller.calls, caller.positions) == (1, 28)
    tiles_only = TileCaller(not_five_dims, "mask_mod")
    assert tiles_only.blocks(1, 1, rows, keys, positions=28) is None
    assert (tiles_only.calls, tiles_only.positions) == (0, 0)


def test_a_mask_mod_that_takes_tiles_only_is_evaluated_by_tiles(monkeypatch):
    """Where the sub-blocks' call is refused, the tiles the bounds leave open are
    evaluated whole: the same classes and kept visibility."""
    monkeypatch.setattr(TileCaller, "blocks", lambda *a, **k: None)
    dense = flex_visible(document, 1, 1, 133, 133)
    bound = fl.MaskMod(document).bind(Geometry.build(lq=133, lk=133))
    exact = tile_classes_from_dense(dense, 64, 32)
    assert torch.equal(bound.classes(64, 32), exact)
    assert _kept_against_dense(bound, dense) == int((exact == PARTIAL).sum())


def test_sub_blocks_with_varlen_and_composites(monkeypatch):
    """The same forward whether open tiles are refined or evaluated whole: packed
    sequences (``cu_seqlens``), a composite with a closed-form mask and with a second
    mask_mod, ragged tiles; outputs equal bit for bit, tile classes equal."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 133, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 50, 133], dtype=torch.int32)
    cases = {
        "document": lambda: fl.MaskMod(document),
        "window & causal": lambda: fl.MaskMod(window) & fl.Causal(),
        "(document & window) | chunked": lambda: (
            (fl.MaskMod(document) & fl.SlidingWindow(40, 0)) | fl.MaskMod(chunked)
        ),
    }
    for name, mask in cases.items():
        runs = []
        for refine in (True, False):
            monkeypatch.setattr(masks_mod, "SUB_BLOCKS", (16,) if refine else ())
            with torch.no_grad():
                res = fl.blocked_forward(
                    q, k, v, mask=mask(), block_q=64, block_k=64, cu_seqlens_q=cu, cu_seqlens_k=cu
                )
            runs.append((res.o, res.ledger.tile_kinds))
        (o_on, kinds_on), (o_off, kinds_off) = runs
        assert kinds_on == kinds_off, name
        assert torch.equal(o_on, o_off), name


def _assert_documents_bounded(doc: torch.Tensor) -> None:
    """A causal document mask reading ``doc`` (the ids of ``_doc_ids([40, 30, 43, 1, 19])``)
    has tiles the bounds decide, soundly, and the exact classes of its dense mask."""

    def doc_mask(b, h, q, k):
        return (doc[q] == doc[k]) & (q >= k)

    bounds = _check_sound(doc_mask, 1, 1, 133, 133, 32, 32, 0, 0)
    assert bounds is not None and bool((~bounds[0]).any())
    exact = tile_classes_from_dense(flex_visible(document, 1, 1, 133, 133), 32, 32)
    assert torch.equal(fl.MaskMod(doc_mask).tile_classes(133, 133, 32, 32), exact)


def test_a_document_table_made_in_inference_mode_is_still_bounded():
    """A captured tensor without a version counter (made under ``inference_mode``): its
    range tables are built each time, and the classes are still decided by the bounds."""
    with torch.inference_mode():
        doc = _doc_ids([40, 30, 43, 1, 19])

    _assert_documents_bounded(doc)


def test_a_document_table_changed_in_place_is_bounded_anew():
    """The range tables of a captured tensor are kept between calls while it is
    unchanged: changing it in place (its version counter moves) rebuilds them, so the
    classes follow the new documents."""
    doc = _doc_ids([40, 30, 43, 1, 19])

    def doc_mask(b, h, q, k):
        return (doc[q] == doc[k]) & (q >= k)

    for lengths in ([40, 30, 43, 1, 19], [100, 33], [5, 120, 8]):
        doc.copy_(_doc_ids(lengths))
        exact = tile_classes_from_dense(flex_visible(doc_mask, 1, 1, 133, 133), 32, 64)
        got = fl.MaskMod(doc_mask).tile_classes(133, 133, 32, 64)
        assert torch.equal(got, exact), lengths


def test_a_document_table_written_past_its_version_counter_is_bounded_anew():
    """Writes that leave a tensor's version counter as it was (through NumPy's view of it,
    or through ``.data``) still rebuild its kept range tables: a kept table is used only
    where it was built from the values the mask_mod reads now. Kept tables that passed on
    the counter alone classified the new documents' tiles by the old ones."""
    ids = _doc_ids([40, 30, 43, 1, 19]).numpy().copy()
    doc = torch.from_numpy(ids)
    shared = torch.zeros(133, dtype=torch.int64)

    def doc_mask(b, h, q, k):
        return doc[q] == doc[k]

    def shared_mask(b, h, q, k):
        return shared[q] == shared[k]

    def exact(fn):
        return tile_classes_from_dense(flex_visible(fn, 1, 1, 133, 133), 32, 32)

    for lengths in ([40, 30, 43, 1, 19], [64, 69], [5, 120, 8], [133]):
        before = doc._version, shared._version
        ids[:] = _doc_ids(lengths).numpy()  # through NumPy: the counter does not move
        shared.data[:] = _doc_ids(lengths)  # through .data: nor here
        assert (doc._version, shared._version) == before, "the writes moved a counter"
        for fn in (doc_mask, shared_mask):
            got = fl.MaskMod(fn).tile_classes(133, 133, 32, 32)
            assert torch.equal(got, exact(fn)), (lengths, fn.__name__)


def test_mask_mods_and_score_mods_get_int32_indices():
    """Every call of a user callable gets int32 indices (Flex's compiled convention): tile
    by tile, sub-blocks, the score_mod on its tiles and the captured-tensor probe."""
    seen: set[torch.dtype] = set()

    def mask(b, h, q, k):  # (its span bounds run on Spans, int64 inside: not indices)
        seen.update(x.dtype for x in (b, h, q, k) if isinstance(x, torch.Tensor))
        return (DOC[q] == DOC[k]) & (q >= k)

    def bias(s, b, h, q, k):
        seen.update(x.dtype for x in (b, h, q, k) if isinstance(x, torch.Tensor))
        return s + 0.01 * (q - k)

    q = torch.randn(1, 2, 97, 8, dtype=torch.float64)
    with torch.no_grad():
        fl.blocked_forward(q, q, q, mask=fl.MaskMod(mask), score_mod=bias, block_q=16, block_k=32)
    fl.MaskMod(mask).tile_classes(97, 97, 64, 64)  # sub-blocks of 16
    assert seen == {torch.int32}, seen


def test_an_int32_document_table_is_bounded_and_narrow_arithmetic_is_not():
    """A document table of int32 ids (a common dtype for token ids) never had its tiles
    bounded: the wrap check compared the int32 bounds with 2**31, which wraps to -2**31 in
    int32, so every int32 (or int16, uint8) captured tensor left the spans and every
    position was evaluated. int32 values are now bounded as int64 (int32 arithmetic is
    int64's within int32's range, which every computed bound is held to); a narrower
    table, whose own arithmetic wraps, still leaves the spans."""
    doc = _doc_ids([40, 30, 43, 1, 19]).to(torch.int32)

    _assert_documents_bounded(doc)
    big = torch.tensor([2**30, -(2**30), 2**30 - 1] * 11, dtype=torch.int32)

    def wraps(b, h, q, k):  # int32 sums past 2**31 wrap in the evaluation
        return big[q] + big[k] > 0

    with pytest.warns(UserWarning, match="int32's range"):
        assert _check_sound(wraps, 1, 1, 33, 33, 4, 4, 0, 0) is None
    for dt in (torch.int16, torch.uint8):
        small = torch.tensor([0, 1, 0, 1] * 10, dtype=dt)

        def narrow(b, h, q, k, small=small):  # uint8 0 - 1 is 255: not monotone
            return (small[q] - small[k]) == 0

        assert (
            span_classes(narrow, batch=1, heads=1, rows=_tiles(40, 8, 0), keys=_tiles(40, 8, 0))
            is None
        )
