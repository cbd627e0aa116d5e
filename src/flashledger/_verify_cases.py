"""Test cases for ``flashledger.verify``: shapes that break tiling, masks, dtypes.

A :class:`Case` is everything an attention callable needs to run one test: the
tensor shapes, the dtype, the mask (as a flashledger ``Mask`` and as a dense
bool tensor), the softmax scale and the conventions the answer must follow.
Inputs are drawn deterministically from the case's seed, so a failing case can
be rebuilt and rerun on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from .conventions import SEED, Conventions, get_conventions
from .masks import Causal, DenseMask, KeyPadding, Mask, SlidingWindow

__all__ = [
    "ALL_DTYPES",
    "FULL_SHAPES",
    "LARGE_SCORE",
    "LONG_ROW",
    "MASK_KINDS",
    "QUICK_SHAPES",
    "Case",
    "Shape",
    "attention_cases",
    "dtype_name",
    "make_case",
]

ALL_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes swept by default."""

MASK_KINDS: tuple[str, ...] = (
    "none",
    "causal_top_left",
    "causal_bottom_right",
    "window",
    "padding",
    "empty_rows",
)
"""Mask kinds of the sweep (see :func:`make_case`)."""

WINDOW = (16, 4)
"""``(left, right)`` of the sliding-window cases (alignment from the conventions)."""

EMPTY_ROW_KEEP = 0.75
"""Keep probability of the random mask of the ``empty_rows`` cases."""

LARGE_SCORE = 1500.0
"""The sweep's large-score cases scale the scores so that the largest of each row lie near
this (``scale = LARGE_SCORE / (4 sqrt(d))``: a row's largest ``q·k`` of standard normal
entries is a few ``sqrt(d)``), past ``exp``'s overflow in every dtype (float64's at 709.8):
a softmax that does not subtract its row's maximum returns inf or NaN there. At the
default scale the scores stay under 10 and such a kernel passes."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Shape:
    """Tensor sizes of one case: Q ``(B, Hq, Lq, d)``, K ``(B, Hkv, Lk, d)``, V ``(B, Hkv, Lk, d_v)``."""

    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    head_dim_v: int = 0
    """Head dim of V; 0 means the same as ``head_dim``."""

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Shape.{name} must be an integer >= 1, got {value!r}")
        if self.heads_q % self.heads_kv != 0:
            raise ValueError(
                f"Shape.heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})"
            )
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        elif isinstance(self.head_dim_v, bool) or self.head_dim_v < 1:
            raise ValueError(
                f"Shape.head_dim_v must be >= 1 (or 0: same as head_dim), got {self.head_dim_v!r}"
            )

    @property
    def gqa(self) -> bool:
        """True when K/V have fewer heads than Q."""
        return self.heads_kv != self.heads_q

    def __str__(self) -> str:
        heads = f"H{self.heads_q}" if not self.gqa else f"H{self.heads_q}/{self.heads_kv}"
        dims = (
            f"d{self.head_dim}"
            if self.head_dim_v == self.head_dim
            else f"d{self.head_dim}/{self.head_dim_v}"
        )
        return f"B{self.batch} {heads} {self.len_q}x{self.len_k} {dims}"


FULL_SHAPES: tuple[Shape, ...] = (
    Shape(1, 2, 2, 1, 1, 8),  # a single query and key
    Shape(2, 2, 2, 2, 2, 16),
    Shape(1, 2, 2, 97, 113, 5),  # Lq < Lk, odd head dim, ragged tiles
    Shape(2, 2, 2, 113, 97, 7),  # Lq > Lk
    Shape(1, 4, 2, 257, 257, 8),  # GQA, one row past a power of two
    Shape(2, 3, 1, 2, 257, 3),  # MQA, Lq << Lk
    Shape(1, 2, 2, 257, 2, 12),  # Lq >> Lk
    Shape(1, 2, 2, 113, 97, 6, 10),  # d_v != d
)
"""The full sweep's shapes."""

QUICK_SHAPES: tuple[Shape, ...] = (
    Shape(1, 2, 2, 97, 113, 5),
    Shape(2, 4, 2, 113, 97, 7),
    Shape(2, 3, 1, 2, 257, 3),
)
"""The quick sweep's shapes: both ``Lq != Lk`` directions, odd head dims, GQA and MQA."""

LONG_ROW = Shape(1, 2, 2, 3, 4097, 8)
"""The sweep's long-row cases (``long_rows``): rows of 4097 keys, where a row sum kept in
a half dtype and added to key by key rounds each of its additions at that dtype's precision
(an error that grows with the row's length, past the naive same-dtype error, which sums in
float32); the swept shapes' rows hold at most 257 keys, too few to show it."""


@dataclass(frozen=True)
class Case:
    """One test case handed to an attention callable ``fn(q, k, v, case)``.

    Attributes give everything a kernel needs: ``shape``, ``dtype``, ``mask``
    (a flashledger ``Mask`` or ``None``), ``scale`` (always a float; default
    ``1/sqrt(d)``), ``conventions`` (the edge behaviour the answer must follow),
    ``align`` (the resolved causal alignment of a ``Causal``/``SlidingWindow``
    mask, else ``None``) and ``dense_mask()`` (bool ``(B, Hq, Lq, Lk)``,
    True = attend).
    """

    shape: Shape
    dtype: torch.dtype
    mask: Mask | None = None
    mask_name: str = ""
    """Short label of the mask, used in names and messages ("": from the mask, e.g.
    ``causal_bottom_right``; ``none`` without one)."""
    conventions: Conventions = SEED
    scale: float = 0.0
    """Softmax scale; 0 means ``1/sqrt(head_dim)``."""
    seed: int = 0
    """Seed of the inputs (same seed, same tensors)."""

    def __post_init__(self) -> None:
        if self.dtype not in ALL_DTYPES:
            raise ValueError(
                f"Case.dtype must be one of {', '.join(map(dtype_name, ALL_DTYPES))} (the "
                f"oracle's and the rule's dtypes), got {self.dtype!r}"
            )
        if self.mask is not None and not isinstance(self.mask, Mask):
            raise TypeError(
                f"Case.mask must be a flashledger Mask or None, got {type(self.mask).__name__}"
            )
        if not self.mask_name:
            object.__setattr__(self, "mask_name", _mask_label(self.mask))
        if self.scale == 0.0:
            object.__setattr__(self, "scale", 1.0 / math.sqrt(self.shape.head_dim))
        elif not math.isfinite(self.scale):
            raise ValueError(f"Case.scale must be finite, got {self.scale}")

    @property
    def name(self) -> str:
        """E.g. ``"causal_bottom_right B1 H2 97x113 d5 float16 [seed]"``; a scale other
        than ``1/sqrt(d)`` is named: ``"none B1 H2 97x113 d5 float16 scale 168 [seed]"``."""
        scaled = "" if self.default_scale else f" scale {self.scale:.3g}"
        return (
            f"{self.mask_name} {self.shape} {dtype_name(self.dtype)}{scaled} "
            f"[{self.conventions.name}]"
        )

    @property
    def default_scale(self) -> bool:
        """The scale is ``1/sqrt(d)``."""
        return self.scale == 1.0 / math.sqrt(self.shape.head_dim)

    def __str__(self) -> str:
        return self.name

    @property
    def align(self) -> str | None:
        """``"top_left"``/``"bottom_right"`` for a causal or sliding-window mask, else ``None``."""
        if isinstance(self.mask, Causal | SlidingWindow):
            return self.mask.align or self.conventions.causal_align
        return None

    def dense_mask(self) -> torch.Tensor | None:
        """The mask as bool ``(B, Hq, Lq, Lk)`` (an expanded view; True = attend), or ``None``."""
        return self._dense

    @cached_property
    def _dense(self) -> torch.Tensor | None:
        if self.mask is None:
            return None
        s = self.shape
        d = self.mask.dense(
            s.len_q, s.len_k, batch=s.batch, heads=s.heads_q, conventions=self.conventions
        )
        return d.expand(s.batch, s.heads_q, s.len_q, s.len_k)  # (B, Hq, Lq, Lk)

    def inputs(self, *, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, do)`` in ``self.dtype``: standard normal, fixed by ``seed``.

        Shapes: q ``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``, v ``(B, Hkv, Lk, d_v)``,
        do ``(B, Hq, Lq, d_v)``. With ``requires_grad`` q, k and v are leaves that
        require grad.
        """
        s = self.shape
        gen = torch.Generator().manual_seed(self.seed)
        sizes = (
            (s.batch, s.heads_q, s.len_q, s.head_dim),
            (s.batch, s.heads_kv, s.len_k, s.head_dim),
            (s.batch, s.heads_kv, s.len_k, s.head_dim_v),
            (s.batch, s.heads_q, s.len_q, s.head_dim_v),
        )
        out = [
            torch.randn(size, generator=gen, dtype=torch.float64).to(self.dtype) for size in sizes
        ]
        if requires_grad:
            for t in out[:3]:
                t.requires_grad_(True)
        return tuple(out)


def _mask_label(mask: Mask | None) -> str:
    """A case's mask label where none was given: the sweep's kind names where they fit."""
    if mask is None:
        return "none"
    if isinstance(mask, Causal):
        return f"causal_{mask.align}" if mask.align else "causal"
    if isinstance(mask, SlidingWindow):
        return "window"
    if isinstance(mask, KeyPadding):
        return "padding"
    if isinstance(mask, DenseMask):
        return "dense"
    return type(mask).__name__.lower()


def _mask_for(kind: str, shape: Shape, seed: int) -> Mask | None:
    if kind == "none":
        return None
    if kind == "causal_top_left":
        return Causal(align="top_left")
    if kind == "causal_bottom_right":
        return Causal(align="bottom_right")
    if kind == "window":
        return SlidingWindow(*WINDOW)
    if kind == "padding":
        lengths = [max(1, shape.len_k - (shape.len_k * (b + 1)) // 3) for b in range(shape.batch)]
        return KeyPadding(lengths)
    if kind == "empty_rows":
        gen = torch.Generator().manual_seed(seed + 7919)
        lq, lk = shape.len_q, shape.len_k
        keep = torch.rand(shape.batch, 1, lq, lk, generator=gen) < EMPTY_ROW_KEEP
        rows = torch.arange(lq)
        keep[:, :, rows, rows % lk] = True  # every row sees a key, but for:
        keep[:, :, 0] = False  # the first row, which sees none
        if lq >= 3:
            keep[:, :, lq // 2] = False  # nor does the middle one
        # (with 2 rows the second sees keys: a case whose every row is empty would pass
        # any kernel that returns zeros)
        return DenseMask(keep)
    raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_KINDS)}")


def make_case(
    shape: Shape,
    mask_kind: str,
    dtype: torch.dtype,
    *,
    conventions: Conventions | str = SEED,
    scale: float = 0.0,
    seed: int = 0,
) -> Case:
    """A :class:`Case` with one of the sweep's masks.

    ``mask_kind``: ``"none"``; ``"causal_top_left"`` / ``"causal_bottom_right"``
    (``Causal`` with that alignment); ``"window"`` (``SlidingWindow(16, 4)``,
    aligned by the conventions); ``"padding"`` (``KeyPadding``, a different
    length per batch element); ``"empty_rows"`` (a random ``DenseMask`` with
    the first and, from 3 rows on, the middle query row fully masked; every other
    row sees a key).
    """
    conv = get_conventions(conventions)  # a preset or its name
    mask = _mask_for(mask_kind, shape, seed)
    return Case(shape, dtype, mask, mask_kind, conv, scale, seed)


def attention_cases(
    *,
    conventions: Conventions | str = SEED,
    dtypes: Sequence[torch.dtype] = ALL_DTYPES,
    quick: bool = False,
    masks: Sequence[str] = MASK_KINDS,
    gqa: bool = True,
    head_dim_v: bool = True,
    shapes: Sequence[Shape] | None = None,
    seed: int = 0,
    large_scores: bool = True,
    long_rows: bool = True,
) -> list[Case]:
    """The sweep: every shape x mask kind x dtype, for one set of conventions, and (with
    ``large_scores``) one case per mask kind and dtype whose scores reach ``LARGE_SCORE``
    (the shape with the most scores, ``scale = LARGE_SCORE / (4 sqrt(d))``), and (with
    ``long_rows``) one case per dtype on ``LONG_ROW`` (the first mask kind).

    ``quick`` uses ``QUICK_SHAPES`` instead of ``FULL_SHAPES`` (``shapes``
    overrides both); ``gqa=False`` drops shapes with fewer K/V heads than Q
    heads; ``head_dim_v=False`` drops shapes whose V head dim differs from d.
    """
    conventions = get_conventions(conventions)  # a preset or its name
    masks = _names("masks", masks, "'none'")
    for kind in masks:
        if kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_KINDS)}")
    dtypes = _names("dtypes", dtypes, "torch.float32")
    for dt in dtypes:
        if dt not in ALL_DTYPES:
            raise ValueError(
                f"dtypes must be among {', '.join(map(dtype_name, ALL_DTYPES))}, got {dt!r}"
            )
    chosen = list(shapes) if shapes is not None else list(QUICK_SHAPES if quick else FULL_SHAPES)
    chosen = [
        s for s in chosen if (gqa or not s.gqa) and (head_dim_v or s.head_dim_v == s.head_dim)
    ]
    cases = [
        make_case(shape, kind, dt, conventions=conventions, seed=seed + i)
        for i, shape in enumerate(chosen)
        for kind in masks
        for dt in dtypes
    ]
    if large_scores and chosen:  # on the shape with the most scores: rows of many keys
        # every mask kind: a kernel that takes the row maximum over the keys the mask
        # hides (the mask applied after exp) is right at the default scale, and at large
        # scores loses the rows whose visible scores lie far below a hidden one
        shape = max(chosen, key=lambda s: s.len_q * s.len_k)
        scale = LARGE_SCORE / (4 * math.sqrt(shape.head_dim))
        cases += [
            make_case(shape, kind, dt, conventions=conventions, scale=scale, seed=seed)
            for kind in masks
            for dt in dtypes
        ]
    if long_rows:
        cases += [
            make_case(LONG_ROW, masks[0], dt, conventions=conventions, seed=seed) for dt in dtypes
        ]
    return cases


def _names(what: str, given: Any, example: str) -> tuple[Any, ...]:
    """``given`` as a non-empty tuple; a lone string or dtype, or an empty sweep, refused
    (a string would be read letter by letter; an empty sweep checks nothing)."""
    if isinstance(given, str | torch.dtype):
        raise TypeError(f"{what} takes a sequence, got {given!r} alone; write {what}=({given!r},)")
    try:
        out = tuple(given)
    except TypeError:
        raise TypeError(
            f"{what} takes a sequence such as ({example},), got {type(given).__name__}"
        ) from None
    if not out:
        raise ValueError(f"{what} is empty: the sweep would check nothing; name at least one")
    return out
