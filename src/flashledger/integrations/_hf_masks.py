"""transformers' attention masks as flashledger masks, so that the native step runs.

transformers builds each layer's mask once per forward by calling the mask
function registered for the model's attention implementation with the
mask's pattern (``mask_function(b, h, q_idx, kv_idx)``), the 2-D padding
mask and the call's positions (``q_offset``, ``kv_offset``: the global index
of query row 0 and key 0). ``plan_mask`` turns those into a ``PlannedMask``:
a flashledger mask for exactly that call, found in this order:

1. the pattern: ``causal_mask_function`` is read as the diagonal
   ``kv_idx <= q_idx`` without evaluating a pair; ``bidirectional_mask_function``
   as "every key"; any other pattern (sliding windows, chunks, packed
   sequences, a model's own overlay) is evaluated once over the call's grid,
   as transformers' SDPA mask does, and read row by row as an interval
   ``lo[i] <= j <= hi[i]`` when every row is one;
2. the padding: a 2-D mask whose real keys are one run per batch element is
   ``KeyPadding`` (right, left, or both sides);
3. a key tail that no row sees (a static cache's unwritten slots) is cut off
   the call (``PlannedMask.keys``);
4. rows whose intervals follow one diagonal become ``Causal`` or
   ``SlidingWindow`` (bottom-right or top-left aligned), checked against the
   intervals they replace; other interval rows stay row intervals (still the
   native step's interval mask); only a mask with a row that is not one
   interval (a hole in the padding) falls back to ``DenseMask``.

``plan_dense`` does steps 3-4 for a ready-made boolean mask (a model or user
that passes its own 4-D mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..autograd import _is_mapped
from ..masks import (
    Align,
    BoundMask,
    Causal,
    DenseMask,
    Geometry,
    IntervalBound,
    KeyPadding,
    Mask,
    SlidingWindow,
)

__all__ = ["PlannedMask", "RowIntervals", "plan_dense", "plan_mask"]

Kind = Literal["causal", "window", "full", "intervals", "dense"]
"""How a mask was read: ``Causal``, ``SlidingWindow``, no pattern (every key), row
intervals, or the dense fallback."""


class RowIntervals(Mask):
    """Row ``i`` of batch ``b`` sees keys ``lo[b, i] <= j <= hi[b, i]`` (``(Bm, Lq)`` each).

    Made for one call's lengths (``Lq`` rows, ``Lk`` keys); an empty row has
    ``lo > hi``. It binds to the native step's interval mask.
    """

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, lk: int) -> None:
        self.lo, self.hi, self.lk = lo.to(torch.int64), hi.to(torch.int64), lk  # (Bm, Lq)

    def __repr__(self) -> str:
        return f"RowIntervals(batch={self.lo.shape[0]}, Lq={self.lo.shape[1]}, Lk={self.lk})"

    def bind(self, geo: Geometry) -> BoundMask:
        if (geo.lq_total, geo.lk_total) != (self.lo.shape[1], self.lk) or geo.varlen:
            raise ValueError(
                f"{self!r} was made for Lq={self.lo.shape[1]}, Lk={self.lk}; the call has "
                f"Lq={geo.lq_total}, Lk={geo.lk_total}"
            )
        dev = geo.device
        return IntervalBound(geo, self.lo.to(dev), self.hi.to(dev))


def _not_a_tensor(what: str) -> str:
    return (
        f"this model's own code {what}, but its attention mask is flashledger's planned mask, "
        "not a tensor: the model computes on the mask itself (Falcon with ALiBi and Bloom "
        "add their ALiBi to it), which flashledger's attention implementation does not "
        "support; run it with 'sdpa' or 'eager'"
    )


@dataclass(frozen=True, eq=False)
class PlannedMask:
    """A flashledger mask for one attention call of a transformers model.

    ``mask`` (None: every key visible) covers queries ``0..lq-1`` and keys
    ``0..keys-1``; keys ``keys..lk-1`` are seen by no row and are left out of
    the call. ``ndim`` and ``shape`` let transformers' mask preprocessing pass
    a planned mask through as a prepared 4-D mask (static-cache generation
    builds masks ahead of the forward).
    """

    mask: Mask | torch.Tensor | None  # a boolean tensor under vmap (plan_mask)
    batch: int
    lq: int
    lk: int
    keys: int
    kind: Kind
    padded: bool  # a padding mask took part

    ndim = 4

    def __getattr__(self, name: str) -> Any:  # only for attributes it does not have
        if name.startswith("__"):  # copy, pickle and other protocols probe these
            raise AttributeError(name)
        raise AttributeError(_not_a_tensor(f"reads its .{name}"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(_not_a_tensor(f"calls {getattr(func, '__name__', func)} on it"))

    def _arithmetic(self, *_: Any) -> Any:
        raise TypeError(_not_a_tensor("computes with it"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arithmetic
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = __neg__ = _arithmetic

    def __getitem__(self, index: Any) -> PlannedMask:
        """Query rows, as ``mask[:, :, rows, :]`` slices a 4-D mask (Gemma 4 keeps only the
        rows whose logits it returns before its KV-shared layers): the plan of those rows."""

        def whole(part: Any) -> bool:
            return isinstance(part, slice) and part == slice(None)

        if not (
            isinstance(index, tuple)
            and len(index) == 4
            and all(whole(index[i]) for i in (0, 1, 3))
            and isinstance(index[2], slice)
        ):
            raise TypeError(_not_a_tensor(f"indexes it with {index!r}"))
        return plan_dense(self.dense()[:, :, index[2], :])  # (B, 1, Lq', Lk) read again

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, 1, Lq, Lk)``, the shape of the boolean mask it stands for."""
        return (self.batch, 1, self.lq, self.lk)

    @property
    def label(self) -> str:
        """A short description for ledgers: ``causal``, ``window+pad``, ``full+pad``, ..."""
        return self.kind + ("+pad" if self.padded and self.kind != "dense" else "")

    def dense(self) -> torch.Tensor:
        """The boolean mask it stands for, ``(B, 1, Lq, Lk)`` (True = attend); for tests."""
        out = torch.zeros(self.batch, 1, self.lq, self.lk, dtype=torch.bool)
        if self.mask is None:
            out[..., : self.keys] = True
        elif isinstance(self.mask, torch.Tensor):
            out[..., : self.keys] = self.mask[..., : self.keys]
        else:
            vis = self.mask.dense(self.lq, self.keys, batch=self.batch)
            out[..., : self.keys] = vis.reshape(-1, 1, self.lq, self.keys) if vis.ndim == 4 else vis
        return out


def _intervals(vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row ``(lo, hi)`` of a bool ``(Bm, Lq, Lk)`` mask whose rows are each one run of
    True (empty rows: ``lo = 0 > hi = -1``), or None when some row is not."""
    lk = vis.shape[-1]
    count = vis.sum(dim=-1)  # (Bm, Lq)
    first = vis.to(torch.uint8).argmax(dim=-1)  # (Bm, Lq) first True (0 when none)
    last = lk - 1 - vis.flip(-1).to(torch.uint8).argmax(dim=-1)  # (Bm, Lq)
    empty = count == 0
    if not bool(((last - first + 1 == count) | empty).all()):
        return None
    lo = torch.where(empty, 0, first)
    hi = torch.where(empty, -1, last)
    return lo, hi


def _padding_spans(pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(start, stop)`` ``(B,)`` of the real keys of a bool ``(B, Lk)`` padding mask, each
    one run (an all-padding row: ``0, 0``), or None when a row has a hole."""
    iv = _intervals(pad[:, None, :])
    if iv is None:
        return None
    lo, hi = iv[0][:, 0], iv[1][:, 0]  # (B,)
    return lo, hi + 1


def _padding_mask(start: torch.Tensor, stop: torch.Tensor, lk: int) -> Mask | None:
    """``KeyPadding`` for real keys ``[start[b], stop[b])``: right, left or both sides."""
    right = bool((stop < lk).any())
    left = bool((start > 0).any())
    parts: list[Mask] = []
    if right:
        parts.append(KeyPadding(stop))
    if left:
        parts.append(KeyPadding(lk - start, side="left"))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] & parts[1]


def _same_rows(lo: torch.Tensor, hi: torch.Tensor, lo2: torch.Tensor, hi2: torch.Tensor) -> bool:
    """Two interval sets see the same keys: the same empty rows, equal bounds elsewhere."""
    lo, hi, lo2, hi2 = torch.broadcast_tensors(lo, hi, lo2, hi2)
    nonempty = lo <= hi
    if not bool((nonempty == (lo2 <= hi2)).all()):
        return False
    return bool(((lo == lo2) & (hi == hi2) | ~nonempty).all())


def _structured(lo: torch.Tensor, hi: torch.Tensor, lq: int, lk: int) -> Mask | bool | None:
    """``Causal``/``SlidingWindow`` (or None: every key) equal to batch-independent rows
    ``lo``/``hi`` ``(Lq,)`` on ``Lq x Lk``; False when no diagonal fits. ``Causal`` is
    preferred to a window that says the same, bottom-right to top-left."""
    nonempty = lo <= hi
    if bool(nonempty.all()) and bool((lo == 0).all()) and bool((hi == lk - 1).all()):
        return None
    rows = torch.arange(lq)
    geo = Geometry.build(lq=lq, lk=lk)
    found: Mask | None = None
    aligns: tuple[Align, Align] = ("bottom_right", "top_left")
    for align in aligns:
        c = rows + (lk - lq if align == "bottom_right" else 0)  # (Lq,) diagonal key
        cut_right = nonempty & (hi < lk - 1)  # rows whose right end is the window's, not Lk's
        cut_left = nonempty & (lo > 0)
        rights = (hi - c)[cut_right].unique()
        lefts = (c - lo)[cut_left].unique()
        if rights.numel() > 1 or lefts.numel() > 1:
            continue
        right = int(rights[0]) if rights.numel() else None
        left = int(lefts[0]) if lefts.numel() else None
        if (right is not None and right < 0) or (left is not None and left < 0):
            continue
        causal = left is None and right == 0
        cand: Mask = Causal(align) if causal else SlidingWindow(left, right, align)
        bound = cand.bind(geo)
        assert isinstance(bound, IntervalBound)
        if _same_rows(lo, hi, bound.lo[0], bound.hi[0]):
            if causal:
                return cand
            found = found or cand
    return False if found is None else found


def _kind_of(m: Mask | None) -> Kind:
    if m is None:
        return "full"
    return "causal" if isinstance(m, Causal) else "window"


def _finish(
    lo: torch.Tensor,
    hi: torch.Tensor,
    pad: tuple[torch.Tensor, torch.Tensor] | None,
    batch: int,
    lq: int,
    lk: int,
) -> PlannedMask:
    """Rows ``lo``/``hi`` ``(Bm, Lq)`` (pattern) and padding spans -> the planned mask."""
    # -- the key tail no row sees, cut off --
    top = hi.clamp(max=lk - 1)
    if pad is not None:
        top = torch.minimum(top, (pad[1] - 1)[:, None])  # (B, Lq)
        top = torch.where(torch.maximum(lo, pad[0][:, None]) <= top, top, -1)
    else:
        top = torch.where(lo <= top, top, -1)
    keys = max(int(top.max()) + 1, 1)
    hi = hi.clamp(max=keys - 1)
    padm = None
    if pad is not None:
        padm = _padding_mask(pad[0].clamp(max=keys), pad[1].clamp(max=keys), keys)
    # -- one diagonal for every row, or row intervals --
    base: Mask | bool | None = False
    if lo.shape[0] == 1:
        base = _structured(lo[0], hi[0], lq, keys)
    if base is False:
        mask: Mask | None = RowIntervals(lo, hi, keys)
        kind: Kind = "intervals"
    else:
        mask = base if isinstance(base, Mask) else None
        kind = _kind_of(mask)
    if padm is not None:
        mask = padm if mask is None else mask & padm
    return PlannedMask(mask, batch, lq, lk, keys, kind, padded=padm is not None)


def plan_dense(vis: torch.Tensor) -> PlannedMask:
    """A bool mask ``(B, H, Lq, Lk)``, ``(B, Lq, Lk)`` or ``(Lq, Lk)`` (True = attend), as a planned mask:
    structured or row intervals when every row is one interval, else ``DenseMask``."""
    if not 2 <= vis.ndim <= 4:
        raise ValueError(
            "an attention mask tensor must be (B, 1, Lq, Lk), (B, Lq, Lk) or (Lq, Lk), got shape "
            f"{tuple(vis.shape)}"
        )
    while vis.ndim < 4:  # (Lq, Lk) as paged attention passes it, (B, Lq, Lk)
        vis = vis.unsqueeze(1 if vis.ndim == 3 else 0)
    b, h, lq, lk = vis.shape
    if h == 1:
        flat = vis[:, 0]
        if b > 1 and bool((flat == flat[:1]).all()):
            flat = flat[:1]
        iv = _intervals(flat)
        if iv is not None:
            return _finish(iv[0], iv[1], None, b, lq, lk)
    return PlannedMask(DenseMask(vis), b, lq, lk, lk, "dense", padded=False)


def _unpadded(causal: bool, delta: int, batch: int, lq: int, lk: int) -> PlannedMask | None:
    """The plan of an unpadded causal (``kv_idx <= q_idx``, query row ``i`` at key
    ``i + delta``) or bidirectional call when the queries are the last ``Lq`` of the keys
    kept; None otherwise (the general path decides)."""
    if not causal:
        return PlannedMask(None, batch, lq, lk, lk, "full", padded=False)
    keys = lq + delta  # one past the last row's diagonal key
    if delta < 0 or keys > lk:
        return None
    if lq == 1:  # one row that sees every key it keeps
        return PlannedMask(None, batch, lq, lk, keys, "full", padded=False)
    return PlannedMask(Causal("bottom_right"), batch, lq, lk, keys, "causal", padded=False)


def plan_mask(
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
) -> PlannedMask:
    """The planned mask of one call, from the arguments transformers gives a mask function."""
    from transformers import masking_utils as mu

    q_off = int(q_offset)  # a static cache passes a 0-d tensor
    lq, lk = q_length, kv_length

    def dense(fn: Any, padding: torch.Tensor | None) -> torch.Tensor:
        """transformers' own boolean mask of ``fn`` (and ``padding``), ``(B, 1, Lq, Lk)``."""
        vis = mu.sdpa_mask(
            batch_size=batch_size,
            q_length=lq,
            kv_length=lk,
            q_offset=q_off,
            kv_offset=kv_offset,
            mask_function=fn,
            attention_mask=padding,
            allow_is_causal_skip=False,
            use_vmap=use_vmap,
            device=device,
        )
        assert vis is not None
        return vis

    if (
        attention_mask is not None
        and not torch.compiler.is_compiling()  # (dynamo cannot trace the check)
        and _is_mapped(attention_mask)
    ):
        # under vmap each sample has its own padding, which a plan cannot read from the
        # data: transformers' boolean mask, a tensor option the op's vmap rule slices
        vis = dense(mask_function or mu.causal_mask_function, attention_mask)
        return PlannedMask(vis, batch_size, lq, lk, lk, "dense", padded=True)
    # -- padding: the 2-D mask's columns of this call's keys --
    pad = None
    if attention_mask is not None:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        assert padding is not None
        cols = padding[:, kv_offset : kv_offset + kv_length].to(torch.bool)  # (B, Lk)
        if not bool(cols.all()):
            pad = _padding_spans(cols.cpu())
            if pad is None:  # a hole in some row's keys: the dense mask, as SDPA's
                vis = dense(mask_function or mu.causal_mask_function, attention_mask)
                return PlannedMask(DenseMask(vis), batch_size, lq, lk, lk, "dense", padded=True)
    # -- the pattern's rows --
    causal = mask_function is None or mask_function is mu.causal_mask_function
    if pad is None and (causal or mask_function is mu.bidirectional_mask_function):
        fast = _unpadded(causal, q_off - kv_offset, batch_size, lq, lk)
        if fast is not None:  # the common calls, planned without a tensor operation
            return fast
    rows = torch.arange(lq)  # (Lq,)
    if causal:
        lo = torch.zeros(1, lq, dtype=torch.int64)
        hi = (rows + (q_off - kv_offset))[None, :]  # (1, Lq) kv_idx <= q_idx
    elif mask_function is mu.bidirectional_mask_function:
        lo = torch.zeros(1, lq, dtype=torch.int64)
        hi = torch.full((1, lq), lk - 1, dtype=torch.int64)
    else:
        vis = dense(mask_function, None)  # (B, 1, Lq, Lk), expanded when batch-free
        flat = vis[:1, 0] if vis.stride(0) == 0 else vis[:, 0]  # (Bm, Lq, Lk)
        iv = _intervals(flat.cpu())
        if iv is None:
            if pad is not None:
                keep = torch.zeros(batch_size, lk, dtype=torch.bool)
                for b in range(batch_size):
                    keep[b, int(pad[0][b]) : int(pad[1][b])] = True
                vis = vis & keep.to(vis.device)[:, None, None, :]
            return PlannedMask(DenseMask(vis), batch_size, lq, lk, lk, "dense", pad is not None)
        lo, hi = iv
    return _finish(lo, hi, pad, batch_size, lq, lk)
