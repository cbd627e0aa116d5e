"""A mask_mod's tile classes from bounds: the mask_mod run once on *spans* of indices.

A tile's class (empty, partial, full) is decided by the mask_mod's value at every
position of the tile, and evaluating it there costs a few tensor operations per
(query, key) position: at L = 4096 more than the attention's own arithmetic for a
packed-document mask. Most tiles are decided by far less: a key tile wholly after
a query tile is invisible to a causal mask, whatever the positions inside.

``span_classes`` calls the mask_mod once, with ``Span`` objects in place of the
index tensors: per tile row, ``q_idx`` holds the least and the greatest global
row of that query tile (``(1, 1, Tq, 1)``), ``kv_idx`` the same per key tile
(``(1, 1, 1, Tk)``), ``b`` and ``h`` the whole range of batch entries and heads.
Each operation on spans returns bounds that hold for every position of every tile
(interval arithmetic, computed by the same torch operation on the endpoints, so
that rounding is the real computation's: a correctly rounded operation is
monotone; the endpoints are int64 where the real indices are int32, and every
integer bound is kept within int32's range, where the two agree exactly, see
``_INT_SAFE``), and a comparison returns a ``Tri``: per tile,
whether the mask *may* be true somewhere and whether it *may* be false. A tile
that cannot be true is empty; one that cannot be false is full; the others are
evaluated position by position, as before (they are the partial tiles, whose
visibility the loop needs anyway, and the few the bounds are too loose for).

Known: ``+ - *`` (``alpha`` aside), unary minus, ``abs``, floor and true division
and ``%`` by a constant, ``minimum``/``maximum``/``clamp``, comparisons, ``& | ^ ~``
and ``logical_*`` on truth values, ``where``, conversions (``.to``, ``.long()``,
``.float()``, ``.bool()``...), ``new_ones``/``new_zeros``/``new_full`` (Flex's
``and_masks``/``or_masks``/``noop_mask``), and indexing a captured tensor with
spans (``doc[q_idx]``, ``prefix[b]``, ``table[h, q_idx]``: the least and greatest
element in each span, by a sparse table; at most one index varying per tile).
Anything else (another operation, Python control flow on a span, ``.shape``, an
index that may fall outside the tensor) ends the attempt, and every tile is
evaluated position by position: the bounds can only make classification cheaper,
never change a class.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Span", "Tri", "span_classes"]


class _Unknown(Exception):
    """An operation the spans cannot bound: the caller evaluates every position."""


class _PastInt32(_Unknown):
    """An integer value that may leave int32's range, which the mask_mod's int32 indices
    would wrap around (as in compiled FlexAttention; eager Flex's int64 would not)."""


def _const(x: Any) -> bool:
    """A value the same at every position: a Python number or a one-element tensor."""
    if isinstance(x, bool | int | float):
        return True
    return isinstance(x, torch.Tensor) and x.numel() == 1


def _lohi(x: Any) -> tuple[Any, Any]:
    """``(lo, hi)`` of a span or a constant (a number is its own bounds)."""
    if isinstance(x, Span):
        return x.lo, x.hi
    if isinstance(x, Tri):
        raise _Unknown("arithmetic on truth values")
    if _const(x):
        return x, x
    raise _Unknown(f"an operand that varies by position: {type(x).__name__}")


def _tri(x: Any) -> Tri:
    """A truth value as a ``Tri`` (a bool constant: one that is what it is)."""
    if isinstance(x, Tri):
        return x
    if isinstance(x, bool) or (
        isinstance(x, torch.Tensor) and x.numel() == 1 and x.dtype == torch.bool
    ):
        v = torch.as_tensor(bool(x))
        return Tri(v, ~v)
    raise _Unknown(f"not a truth value: {type(x).__name__}")


def _no_nan(*xs: Any) -> None:
    for x in xs:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and bool(torch.isnan(x).any()):
            raise _Unknown("a bound is NaN")


_INT_SAFE = 1 << 31
"""Integer bounds stay below this in magnitude. The mask_mod runs on int32 indices
(``_mods.INDEX_DTYPE``, Flex's compiled convention) while its spans are int64: while every
integer value at every position lies within int32's range, int32 arithmetic is int64's,
exactly, so the classes the spans decide are those the evaluation would find. Past it the
int32 computation may wrap around (not monotone), and the spans give up."""
_INT_FACTOR = 1 << 31  # a product's operands stay below this (no int64 product wraps)


def _ints_below(limit: int, *xs: Any) -> None:
    """Raise ``_Unknown`` unless every integer bound among ``xs`` (Python or tensor) lies
    below ``limit`` in magnitude: past it an operation may wrap around, which is not
    monotone."""
    for x in xs:
        if isinstance(x, torch.Tensor):
            big = not x.is_floating_point() and x.dtype != torch.bool
            if big:  # compared in int64: a narrower tensor would wrap ``limit`` itself
                y = x.to(torch.int64)
                if bool(((y >= limit) | (y <= -limit)).any()):  # (abs wraps at the min)
                    raise _Unknown("integer bounds that may wrap around")
        elif isinstance(x, int) and abs(x) >= limit:
            raise _Unknown("integer bounds that may wrap around")


def _checked(lo: torch.Tensor, hi: torch.Tensor, *, computed: bool = True) -> Span:
    """A span, after checking that integer bounds are far from wrapping around and that
    floating-point ones are not NaN. ``computed=False``: values read from a captured
    tensor, not arithmetic on the indices: past int32's range they are merely unknown."""
    _no_nan(lo, hi)
    try:
        _ints_below(_INT_SAFE, lo, hi)
    except _Unknown:  # (the common case passes with one check)
        if not computed:
            raise
        _ints_below(1 << 62, lo, hi)  # near int64's own wrap: unknown, nothing to say
        raise _PastInt32("integer bounds past int32's range") from None
    return Span(lo, hi)


# -- arithmetic ------------------------------------------------------------------------
def _add(a: Any, b: Any, alpha: Any = None) -> Span:
    if alpha is not None:
        raise _Unknown("add with alpha")
    (al, ah), (bl, bh) = _lohi(a), _lohi(b)
    return _checked(al + bl, ah + bh)


def _sub(a: Any, b: Any, alpha: Any = None) -> Span:
    if alpha is not None:
        raise _Unknown("sub with alpha")
    (al, ah), (bl, bh) = _lohi(a), _lohi(b)
    return _checked(al - bh, ah - bl)


def _rsub(a: Any, b: Any, alpha: Any = None) -> Span:
    return _sub(b, a, alpha)


def _mul(a: Any, b: Any) -> Span:
    (al, ah), (bl, bh) = _lohi(a), _lohi(b)
    _ints_below(_INT_FACTOR, al, ah, bl, bh)
    corners = [x * y for x in (al, ah) for y in (bl, bh)]
    lo = torch.minimum(torch.minimum(corners[0], corners[1]), torch.minimum(corners[2], corners[3]))
    hi = torch.maximum(torch.maximum(corners[0], corners[1]), torch.maximum(corners[2], corners[3]))
    return _checked(lo, hi)


def _neg(a: Any) -> Span:
    if not isinstance(a, Span):
        raise _Unknown("minus a truth value")
    return Span(-a.hi, -a.lo)


def _abs(a: Any) -> Span:
    if not isinstance(a, Span):
        raise _Unknown("abs of a truth value")
    lo, hi = a.lo, a.hi
    alo, ahi = torch.abs(lo), torch.abs(hi)
    zero = torch.zeros_like(alo)
    low = torch.where((lo <= 0) & (hi >= 0), zero, torch.minimum(alo, ahi))
    return Span(low, torch.maximum(alo, ahi))


def _positive_or_negative(c: Any) -> int:
    """+1 or -1: the sign of a constant divisor (0 or NaN: unknown)."""
    if not _const(c) or isinstance(c, Span | Tri):
        raise _Unknown("division by a value that varies by position")
    v = float(c)
    if v > 0:
        return 1
    if v < 0:
        return -1
    raise _Unknown("division by zero or NaN")


def _div(a: Any, b: Any, *, rounding_mode: str | None = None) -> Span:
    if not isinstance(a, Span):
        raise _Unknown("a constant divided by a span")
    sign = _positive_or_negative(b)
    lo, hi = (torch.div(x, b, rounding_mode=rounding_mode) for x in (a.lo, a.hi))
    return Span(lo, hi) if sign > 0 else Span(hi, lo)


def _floordiv(a: Any, b: Any) -> Span:
    return _div(a, b, rounding_mode="floor")


def _remainder(a: Any, m: Any) -> Span:
    if not isinstance(a, Span) or a.lo.is_floating_point() or not _const(m):
        raise _Unknown("remainder other than integer spans by a constant")
    if isinstance(m, float) or (isinstance(m, torch.Tensor) and m.is_floating_point()):
        raise _Unknown("remainder by a floating-point value")
    if _positive_or_negative(m) < 0:
        raise _Unknown("remainder by a negative value")
    ql, qh = (torch.div(x, m, rounding_mode="floor") for x in (a.lo, a.hi))
    one = ql == qh  # the span lies within one period: the remainder is the shifted span
    rl, rh = torch.remainder(a.lo, m), torch.remainder(a.hi, m)
    top = torch.full_like(rh, int(m) - 1)
    return Span(torch.where(one, rl, torch.zeros_like(rl)), torch.where(one, rh, top))


def _minmax(fn: Callable[..., torch.Tensor]) -> Callable[..., Span]:
    def op(a: Any, b: Any = None, **kw: Any) -> Span:
        if b is None or kw or not all(isinstance(x, Span | torch.Tensor) for x in (a, b)):
            raise _Unknown("a reduction, or a number where torch takes a tensor")
        (al, ah), (bl, bh) = _lohi(a), _lohi(b)
        return Span(fn(al, bl), fn(ah, bh))

    return op


def _clamp(a: Any, min: Any = None, max: Any = None) -> Span:
    if not isinstance(a, Span) or not all(x is None or _const(x) for x in (min, max)):
        raise _Unknown("clamp of a constant, or to bounds that vary by position")
    return _checked(torch.clamp(a.lo, min, max), torch.clamp(a.hi, min, max))


# -- comparisons and truth values --------------------------------------------------------
def _cmp(name: str) -> Callable[[Any, Any], Tri]:
    def op(a: Any, b: Any) -> Tri:
        if isinstance(a, Tri) or isinstance(b, Tri):
            if name not in ("eq", "ne"):
                raise _Unknown("ordering of truth values")
            differ = _xor(a, b)
            return differ if name == "ne" else _not(differ)
        (al, ah), (bl, bh) = _lohi(a), _lohi(b)
        _no_nan(al, ah, bl, bh)
        if name == "lt":
            return Tri(al < bh, ah >= bl)
        if name == "le":
            return Tri(al <= bh, ah > bl)
        if name == "gt":
            return Tri(ah > bl, al <= bh)
        if name == "ge":
            return Tri(ah >= bl, al < bh)
        overlap = (al <= bh) & (bl <= ah)
        single = (al == ah) & (bl == bh) & (al == bl)  # both one and the same value
        return Tri(overlap, ~single) if name == "eq" else Tri(~single, overlap)

    return op


def _and(a: Any, b: Any) -> Tri:
    x, y = _tri(a), _tri(b)
    return Tri(x.t & y.t, x.f | y.f)


def _or(a: Any, b: Any) -> Tri:
    x, y = _tri(a), _tri(b)
    return Tri(x.t | y.t, x.f & y.f)


def _xor(a: Any, b: Any) -> Tri:
    x, y = _tri(a), _tri(b)
    return Tri((x.t & y.f) | (x.f & y.t), (x.t & y.t) | (x.f & y.f))


def _not(a: Any) -> Tri:
    x = _tri(a)
    return Tri(x.f, x.t)


def _where(cond: Any, x: Any = None, y: Any = None) -> Span | Tri:
    if x is None or y is None:
        raise _Unknown("where with one argument")
    c = _tri(cond)
    if isinstance(x, Tri) or isinstance(y, Tri) or (_is_bool(x) and _is_bool(y)):
        tx, ty = _tri(x), _tri(y)
        return Tri((c.t & tx.t) | (c.f & ty.t), (c.t & tx.f) | (c.f & ty.f))
    (xl, xh), (yl, yh) = _lohi(x), _lohi(y)
    # a tile where the condition may go either way takes the wider of the two bounds
    lo = torch.minimum(torch.where(c.t, xl, yl), torch.where(c.f, yl, xl))
    hi = torch.maximum(torch.where(c.t, xh, yh), torch.where(c.f, yh, xh))
    return Span(lo, hi)


def _where_method(x: Any, cond: Any, y: Any) -> Span | Tri:
    return _where(cond, x, y)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)


# -- conversions -------------------------------------------------------------------------
def _convert(a: Any, dtype: torch.dtype) -> Span | Tri:
    if isinstance(a, Tri):
        if dtype == torch.bool:
            return a
        return Span((~a.f).to(dtype), a.t.to(dtype))  # 1 where it cannot be false
    if not isinstance(a, Span):
        raise _Unknown("conversion of a constant")
    if dtype == torch.bool:
        _no_nan(a.lo, a.hi)
        zero_lo, zero_hi = a.lo == 0, a.hi == 0
        return Tri(~(zero_lo & zero_hi), (a.lo <= 0) & (a.hi >= 0))
    if not dtype.is_floating_point:  # the values must fit, or the conversion wraps
        info = torch.iinfo(dtype)
        for x in (a.lo, a.hi):
            if not bool(torch.isfinite(x).all()) or bool(((x < info.min) | (x > info.max)).any()):
                raise _Unknown(f"a conversion to {dtype} that may not fit")
    return Span(a.lo.to(dtype), a.hi.to(dtype))


def _to(a: Any, *args: Any, **kwargs: Any) -> Span | Tri:
    dtype = kwargs.get("dtype")
    for x in args:
        if isinstance(x, torch.dtype):
            dtype = x
        elif isinstance(x, torch.Tensor):
            dtype = x.dtype
    if dtype is None:  # .to(device): the values are the same
        if not isinstance(a, Span | Tri):
            raise _Unknown("to() of a constant")
        return a
    return _convert(a, dtype)


def _as(dtype: torch.dtype) -> Callable[..., Span | Tri]:
    def op(a: Any, *args: Any, **kwargs: Any) -> Span | Tri:
        if args or kwargs.keys() - {"memory_format"}:
            raise _Unknown("a conversion with arguments")
        return _convert(a, dtype)

    return op


# -- indexing a captured tensor ------------------------------------------------------------
def _range_table(x: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Sparse table ``(levels, n)``: row ``j`` holds ``reduce`` over ``x[i : i + 2**j]`` (the
    tail past the end repeats the last full window; queries never read it)."""
    rows = [x]
    width = 1
    while 2 * width <= x.shape[0]:
        prev = rows[-1]
        nxt = reduce(prev[:-width], prev[width:])
        rows.append(torch.cat([nxt, prev[prev.shape[0] - width :]]))
        width *= 2
    return torch.stack(rows)


_TABLES: dict[tuple[int, int, str], tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
TABLE_KEEP_BYTES = 8 << 20
"""Largest range table kept between calls (a longer captured tensor's is built each time)."""


def _table_of(
    t: torch.Tensor, x: torch.Tensor, reduce: Callable[..., torch.Tensor], name: str
) -> torch.Tensor:
    """``_range_table(x, reduce)`` for ``x`` reduced from the captured tensor ``t``, kept
    while ``t`` lives and ``x`` is what the table was built from (a mask_mod's ``doc[q_idx]``
    and ``doc[kv_idx]``, and the classifications of one call at two tile sizes, build it
    once), up to 16 tables of at most ``TABLE_KEEP_BYTES`` each. The table's first row is
    ``x`` itself, and a kept table is used only where it equals the ``x`` of this call: a
    write that leaves ``t``'s version counter as it was (through NumPy's view of it, or
    ``t.data``) cannot make a stale table pass for current."""
    key = (id(t), t.data_ptr(), name)
    got = _TABLES.get(key)
    if got is not None and got[0]() is t and same_values(got[1][0], x):
        return got[1]
    table = _range_table(x, reduce)
    if table.numel() * table.element_size() > TABLE_KEEP_BYTES:
        return table
    if len(_TABLES) >= 16:
        _TABLES.clear()
    _TABLES[key] = (weakref.ref(t), table)
    return table


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same values in the same shape and dtype (NaN counts as
    unequal: a table with one is built again)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _range_query(table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reduce: Any) -> Any:
    """``reduce`` of ``x[lo : hi + 1]`` for index tensors ``lo <= hi`` (any shape)."""
    length = hi - lo + 1
    level = torch.floor(torch.log2(length.to(torch.float64))).to(torch.int64)
    level = level - (2**level > length).to(torch.int64)  # log2 rounded up: step down
    level = level + (2 ** (level + 1) <= length).to(torch.int64)  # or down too far
    level = level.clamp(0, table.shape[0] - 1)
    return reduce(table[level, lo], table[level, hi - 2**level + 1])


def _getitem(t: Any, index: Any) -> Span | Tri:
    if isinstance(t, Span | Tri) or not isinstance(t, torch.Tensor):
        raise _Unknown("indexing a span")
    idx = index if isinstance(index, tuple) else (index,)
    if len(idx) != t.ndim:
        raise _Unknown("indexing that leaves dims")
    fixed: list[slice] = []  # per dim: the constant range of the others
    varying: int | None = None
    for dim, i in enumerate(idx):
        n = t.shape[dim]
        if isinstance(i, bool | Tri):
            raise _Unknown("a boolean index")
        if isinstance(i, int) or (isinstance(i, torch.Tensor) and i.numel() == 1):
            if isinstance(i, torch.Tensor) and (i.is_floating_point() or i.dtype == torch.bool):
                raise _Unknown("a non-integer index")
            v = int(i)
            if not 0 <= v < n:
                raise _Unknown("an index outside the tensor (or negative)")
            fixed.append(slice(v, v + 1))
            continue
        if not isinstance(i, Span):
            raise _Unknown(f"an index of type {type(i).__name__}")
        if i.lo.is_floating_point() or i.lo.dtype == torch.bool:
            raise _Unknown("a non-integer index")
        if bool((i.lo < 0).any()) or bool((i.hi >= n).any()):
            raise _Unknown("an index that may fall outside the tensor (or be negative)")
        if i.lo.numel() == 1:
            fixed.append(slice(int(i.lo), int(i.hi) + 1))
            continue
        if varying is not None:
            raise _Unknown("two indices that vary by tile")
        varying = dim
        fixed.append(slice(None))
    sub = t[tuple(fixed)]
    boolean = t.dtype == torch.bool
    if not boolean and not t.is_floating_point() and t.dtype != torch.int64:
        if t.dtype != torch.int32:  # its own arithmetic wraps within int32's range
            raise _Unknown(f"a {t.dtype} tensor, whose arithmetic may wrap around")
        sub = sub.long()  # int32 arithmetic is int64's while the bounds stay in int32's range
    vals = sub.to(torch.uint8) if boolean else sub
    if varying is None:
        spans = [i.lo.shape for i in idx if isinstance(i, Span)]
        shape = torch.broadcast_shapes(*spans) if spans else torch.Size(())
        lo, hi = vals.amin().expand(shape), vals.amax().expand(shape)
    else:
        others = [d for d in range(t.ndim) if d != varying]
        low = vals.amin(dim=others) if others else vals  # (n,)
        high = vals.amax(dim=others) if others else vals  # (n,)
        i = idx[varying]
        assert isinstance(i, Span)
        name = f"{varying} {[(f.start, f.stop) for f in fixed]} {tuple(t.shape)}"
        low_t = _table_of(t, low, torch.minimum, f"min {name}")
        high_t = _table_of(t, high, torch.maximum, f"max {name}")
        lo = _range_query(low_t, i.lo, i.hi, torch.minimum)
        hi = _range_query(high_t, i.lo, i.hi, torch.maximum)
    if boolean:
        return Tri(hi > 0, lo == 0)
    return _checked(lo, hi, computed=False)  # a captured tensor's own values


# -- new tensors ---------------------------------------------------------------------------
def _new(fill: Any) -> Callable[..., torch.Tensor]:
    def op(a: Any, size: Any = (), *rest: Any, **kw: Any) -> torch.Tensor:
        value = fill if fill is not None else (rest[0] if rest else kw.pop("fill_value"))
        if rest and fill is None:
            rest = rest[1:]
        if rest:
            raise _Unknown("new_* with extra arguments")
        shape = tuple(size) if isinstance(size, list | tuple | torch.Size) else (size,)
        if any(int(s) != 1 for s in shape):
            raise _Unknown("new_* of more than one element")
        dtype = kw.get("dtype") or a.dtype
        return torch.full(shape, value, dtype=dtype, device=kw.get("device") or a.device)

    return op


T = torch.Tensor
_TABLE: dict[Any, Callable[..., Any]] = {}


def _register(fn: Callable[..., Any], *funcs: Any) -> None:
    for f in funcs:
        _TABLE[f] = fn


_register(_add, torch.add, T.add, T.__add__, T.__radd__)
_register(_sub, torch.sub, torch.subtract, T.sub, T.subtract, T.__sub__)
_register(_rsub, torch.rsub, T.__rsub__)
_register(_mul, torch.mul, torch.multiply, T.mul, T.multiply, T.__mul__, T.__rmul__)
_register(_neg, torch.neg, torch.negative, T.neg, T.negative, T.__neg__)
_register(_abs, torch.abs, torch.absolute, T.abs, T.absolute, T.__abs__)
_register(_div, torch.div, torch.divide, torch.true_divide, T.div, T.divide, T.true_divide)
_register(_div, T.__truediv__)
_register(_floordiv, torch.floor_divide, T.floor_divide, T.__floordiv__)
_register(_remainder, torch.remainder, T.remainder, T.__mod__)
_register(_minmax(torch.minimum), torch.minimum, T.minimum, torch.min, T.min, torch.fmin)
_register(_minmax(torch.maximum), torch.maximum, T.maximum, torch.max, T.max, torch.fmax)
_register(_clamp, torch.clamp, torch.clip, T.clamp, T.clip)
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    _op = _cmp(_name)
    _register(_op, getattr(torch, _name), getattr(T, _name), getattr(T, f"__{_name}__"))
_register(_cmp("lt"), torch.less, T.less)
_register(_cmp("le"), torch.less_equal, T.less_equal)
_register(_cmp("gt"), torch.greater, T.greater)
_register(_cmp("ge"), torch.greater_equal, T.greater_equal)
_register(_cmp("ne"), torch.not_equal, T.not_equal)
_register(_and, torch.logical_and, T.logical_and, torch.bitwise_and, T.bitwise_and)
_register(_and, T.__and__, T.__rand__)
_register(_or, torch.logical_or, T.logical_or, torch.bitwise_or, T.bitwise_or, T.__or__, T.__ror__)
_register(_xor, torch.logical_xor, T.logical_xor, torch.bitwise_xor, T.bitwise_xor)
_register(_xor, T.__xor__, T.__rxor__)
_register(_not, torch.logical_not, T.logical_not, torch.bitwise_not, T.bitwise_not, T.__invert__)
_register(_where, torch.where)
_register(_where_method, T.where)
_register(_to, T.to)
for _name, _dt in (
    ("long", torch.int64),
    ("int", torch.int32),
    ("float", torch.float32),
    ("double", torch.float64),
    ("bool", torch.bool),
):
    _register(_as(_dt), getattr(T, _name))
_register(_getitem, T.__getitem__)
_register(_new(1), T.new_ones)
_register(_new(0), T.new_zeros)
_register(_new(None), T.new_full)


def _apply(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    fn = _TABLE.get(func)
    if fn is None:
        raise _Unknown(f"{getattr(func, '__name__', func)} on a span")
    _check_bool_ops(func, args)
    return fn(*args, **kwargs)


def _check_bool_ops(func: Any, args: tuple[Any, ...]) -> None:
    """Bitwise operations are logical ones on truth values only (``q_idx & 1`` is not)."""
    if _TABLE.get(func) in (_and, _or, _xor, _not) and any(isinstance(a, Span) for a in args):
        raise _Unknown("a bitwise operation on integers")


class _Bounded:
    """What spans and truth values share: torch dispatches to ``_apply``, Python's
    operators too, and anything that needs a concrete value raises ``_Unknown``."""

    __slots__ = ()

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return _apply(func, args, kwargs or {})

    def _op(self, func: Any, *args: Any) -> Any:
        return _apply(func, (self, *args), {})

    def __add__(self, o: Any) -> Any:
        return self._op(T.__add__, o)

    def __radd__(self, o: Any) -> Any:
        return self._op(T.__radd__, o)

    def __sub__(self, o: Any) -> Any:
        return self._op(T.__sub__, o)

    def __rsub__(self, o: Any) -> Any:
        return self._op(T.__rsub__, o)

    def __mul__(self, o: Any) -> Any:
        return self._op(T.__mul__, o)

    def __rmul__(self, o: Any) -> Any:
        return self._op(T.__rmul__, o)

    def __truediv__(self, o: Any) -> Any:
        return self._op(T.__truediv__, o)

    def __floordiv__(self, o: Any) -> Any:
        return self._op(T.__floordiv__, o)

    def __mod__(self, o: Any) -> Any:
        return self._op(T.__mod__, o)

    def __rtruediv__(self, o: Any) -> Any:
        raise _Unknown("a constant divided by a span")

    def __rfloordiv__(self, o: Any) -> Any:
        raise _Unknown("a constant divided by a span")

    def __rmod__(self, o: Any) -> Any:
        raise _Unknown("a constant modulo a span")

    def __neg__(self) -> Any:
        return self._op(T.__neg__)

    def __abs__(self) -> Any:
        return self._op(T.__abs__)

    def __lt__(self, o: Any) -> Any:
        return self._op(T.__lt__, o)

    def __le__(self, o: Any) -> Any:
        return self._op(T.__le__, o)

    def __gt__(self, o: Any) -> Any:
        return self._op(T.__gt__, o)

    def __ge__(self, o: Any) -> Any:
        return self._op(T.__ge__, o)

    def __eq__(self, o: Any) -> Any:  # type: ignore[override]
        return self._op(T.__eq__, o)

    def __ne__(self, o: Any) -> Any:  # type: ignore[override]
        return self._op(T.__ne__, o)

    __hash__ = None  # type: ignore[assignment]

    def __and__(self, o: Any) -> Any:
        return self._op(T.__and__, o)

    def __rand__(self, o: Any) -> Any:
        return self._op(T.__rand__, o)

    def __or__(self, o: Any) -> Any:
        return self._op(T.__or__, o)

    def __ror__(self, o: Any) -> Any:
        return self._op(T.__ror__, o)

    def __xor__(self, o: Any) -> Any:
        return self._op(T.__xor__, o)

    def __rxor__(self, o: Any) -> Any:
        return self._op(T.__rxor__, o)

    def __invert__(self) -> Any:
        return self._op(T.__invert__)

    def __bool__(self) -> bool:
        raise _Unknown("Python control flow on a span")

    def __index__(self) -> int:
        raise _Unknown("a span used as a Python integer")

    def __int__(self) -> int:
        raise _Unknown("a span used as a Python integer")

    def __float__(self) -> float:
        raise _Unknown("a span used as a Python float")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        fn = getattr(T, name, None)
        if fn is not None and fn in _TABLE:
            return lambda *args, **kwargs: _apply(fn, (self, *args), kwargs)
        raise _Unknown(f".{name} of a span")


class Span(_Bounded):
    """``lo <= x <= hi`` for every position of each tile: ``lo``, ``hi`` tensors of the
    values' dtype, broadcast over ``(1, 1, Tq, Tk)``."""

    __slots__ = ("hi", "lo")

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.lo, self.hi = lo, hi

    @property
    def dtype(self) -> torch.dtype:
        return self.lo.dtype

    @property
    def device(self) -> torch.device:
        return self.lo.device

    def __repr__(self) -> str:
        return f"Span({self.lo.tolist()}, {self.hi.tolist()})"


class Tri(_Bounded):
    """A truth value per tile: ``t`` where it may be true somewhere in the tile, ``f``
    where it may be false somewhere (bool tensors, broadcast over ``(1, 1, Tq, Tk)``)."""

    __slots__ = ("f", "t")

    def __init__(self, t: torch.Tensor, f: torch.Tensor) -> None:
        self.t, self.f = t, f

    @property
    def dtype(self) -> torch.dtype:
        return torch.bool

    def __repr__(self) -> str:
        return f"Tri(t={self.t.tolist()}, f={self.f.tolist()})"


def span_classes(
    mask_mod: Callable[..., Any],
    *,
    batch: int,
    heads: int,
    rows: tuple[torch.Tensor, torch.Tensor],
    keys: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(may_true, may_false)``, bool ``(Tq, Tk)``: per tile, whether ``mask_mod`` may
    hold at some position of it (for some batch entry and head), and whether it may
    fail at some position. ``rows`` = (first, last) global row of each query tile
    ``(Tq,)``, ``keys`` the same per key tile ``(Tk,)``, int64. None when the mask_mod
    does something the spans do not bound (see the module docstring)."""
    tq, tk = rows[0].shape[0], keys[0].shape[0]
    dev = rows[0].device
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=dev)
    b = Span(zero, zero + (batch - 1))
    h = Span(zero, zero + (heads - 1))
    q = Span(rows[0].view(1, 1, tq, 1), rows[1].view(1, 1, tq, 1))
    k = Span(keys[0].view(1, 1, 1, tk), keys[1].view(1, 1, 1, tk))
    try:
        got = mask_mod(b, h, q, k)
        if not isinstance(got, Tri | torch.Tensor):  # not a mask_mod's result: the tile
            return None  # call names what is wrong with it
        out = _tri(got)
        grid = (1, 1, tq, tk)
        if torch.broadcast_shapes(out.t.shape, out.f.shape, grid) != grid:
            return None
    except _PastInt32:  # evaluated in full; the wrap is worth a word
        name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
        warnings.warn(
            f"mask_mod {name!r} computes integers that may leave int32's range: its indices "
            "are int32 (as compiled FlexAttention passes them), so such values wrap around "
            "where eager Flex's int64 indices would not; convert with .long() before such "
            "arithmetic if it is meant",
            stacklevel=2,
        )
        return None
    except Exception:  # _Unknown, or the mask_mod's own error on a span: evaluate instead
        return None
    return out.t.expand(grid)[0, 0], out.f.expand(grid)[0, 0]
