"""``MaskMod``: a FlexAttention ``mask_mod`` (or a torch ``BlockMask``) as a flashledger mask.

``MaskMod(mask_mod)`` answers the two questions every mask answers:

- which keys a row sees: ``mask_mod(b, h, q_idx, kv_idx)`` evaluated on the
  tile, vectorised over broadcast index tensors (``_mods.TileCaller``), and
- each tile's class: the mask_mod run once on spans of indices (``_spans``:
  per tile, the least and greatest row and key) decides the tiles it cannot
  hold anywhere in (empty) or cannot fail anywhere in (full). It runs on
  sub-blocks of the tiles (``masks._sub_blocks``), so inside a partial tile
  it decides the sub-blocks away from the mask's edges too, and only the
  sub-blocks left open are evaluated (in one call, ``TileCaller.blocks``);
  every tile of a mask_mod the spans cannot follow is evaluated position by
  position (``masks.classify_by_rows``: one row of tiles at a time, memory
  linear in the length). Either way the positions are reduced to empty,
  partial or full, as ``create_block_mask`` does (without its padding: a
  ragged last tile whose real positions are all visible is full). The
  classes are the same either way; the bounds only spare the evaluations.

``MaskMod(block_mask)`` takes a ``torch.nn.attention.flex_attention.BlockMask``
instead: tile classes come from its block structure, without evaluating
anything, and inside a tile a position is visible iff its block is full, or
partial and the block mask's ``mask_mod`` says so: what Flex's compiled
kernels compute (its eager path applies the ``mask_mod`` alone, ignoring the
blocks; they agree whenever the blocks were made from the ``mask_mod``, as
``create_block_mask`` makes them). flashledger's tiles need not match the
block size: a tile is empty when every block it touches is empty (for every
batch and head), full when every one is full, partial otherwise. The partial
tiles' visibility is put together at classification as a mask_mod's is (the
blocks and the span bounds decide sub-blocks, the rest evaluated) and kept for
both passes.

Positions are global (placement, split-KV, ring); with variable length they
are positions in the packed sequence.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ._mods import MaskModFn, TileCaller, index_grid
from ._spans import same_values, span_classes
from .masks import EMPTY, FULL, PARTIAL, BoundMask, Geometry, Mask, _sub_blocks, classify_bounded

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "BlockMaskBound",
    "MaskMod",
    "MaskModBound",
    "block_grid",
    "is_block_mask",
    "padded_as_flex",
]

SPAN_BOUNDS = True
"""Whether a mask_mod's tile classes start from its span bounds (``_spans``); False
evaluates every position (the same classes, at the cost of evaluating them all)."""


def is_block_mask(x: Any) -> bool:
    """True for a ``torch.nn.attention.flex_attention.BlockMask``."""
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(x, BlockMask)


def _fn_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)  # torch wraps some mask_mods (_MaskModWrapper)
    return str(getattr(inner, "__name__", type(inner).__name__))


def block_grid(bm: BlockMask, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``BlockMask``'s blocks, ``(Bb, Hb, Tq, Tk)`` int8 (the blocks covering its
    ``seq_lengths``): ``PARTIAL`` where ``kv_indices`` lists a block, ``FULL`` where
    ``full_kv_indices`` does, ``EMPTY`` elsewhere."""
    lq, lk = (int(x) for x in bm.seq_lengths)
    block_q, block_k = (int(x) for x in bm.BLOCK_SIZE)
    tq, tk = -(-lq // block_q), -(-lk // block_k)
    kv_num, kv_idx = bm.kv_num_blocks, bm.kv_indices  # (Bb, Hb, Tq), (Bb, Hb, Tq, W)
    width = max(tk, kv_idx.shape[-1])
    grid = torch.zeros(*kv_num.shape[:2], tq, width + 1, dtype=torch.int8, device=device)
    pairs = [(kv_num, kv_idx, PARTIAL)]
    if bm.full_kv_num_blocks is not None and bm.full_kv_indices is not None:
        pairs.append((bm.full_kv_num_blocks, bm.full_kv_indices, FULL))
    for num, idx, kind in pairs:
        idx = idx[..., :tq, :].to(device=device, dtype=torch.int64)  # (Bb, Hb, Tq, W)
        num = num[..., :tq].to(device=device, dtype=torch.int64)  # (Bb, Hb, Tq)
        slots = torch.arange(idx.shape[-1], device=device)  # (W,)
        listed = (slots < num[..., None]) & (idx >= 0) & (idx < tk)
        cols = torch.where(listed, idx, width)  # unlisted slots land in a spare column
        grid.scatter_(-1, cols, kind)
    return grid[..., :tk]


_DERIVED: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], dict[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _derived(bm: BlockMask) -> dict[Any, Any]:
    """What was derived from ``bm``'s blocks before (its grid, its tiles' counts), kept
    with the ``BlockMask`` (made once, used every step) while those blocks are as they were:
    the same lengths and block sizes, and each block tensor equal to a copy taken when the
    derivation was kept (a change in place, through ``.data`` or NumPy included, or a new
    tensor set as an attribute, starts afresh)."""
    tensors = (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    shape = (tuple(bm.seq_lengths), tuple(bm.BLOCK_SIZE))
    kept = _DERIVED.get(bm)
    if kept is not None and kept[0][0] == shape and _same_blocks(kept[0][1], tensors):
        return kept[1]
    copies = tuple(None if t is None else t.detach().clone() for t in tensors)
    fresh: dict[Any, Any] = {}
    _DERIVED[bm] = ((shape, copies), fresh)
    return fresh


def _same_blocks(
    copies: tuple[torch.Tensor | None, ...], tensors: tuple[torch.Tensor | None, ...]
) -> bool:
    """Each of ``tensors`` is None where its copy is, else the copy's shape, dtype and
    values."""
    for a, b in zip(copies, tensors, strict=True):
        if a is None or b is None:
            if a is not b:
                return False
            continue
        if a.device != b.device or not same_values(a, b):
            return False
    return True


def padded_as_flex(
    classes: torch.Tensor, len_q: int, len_k: int, block_q: int, block_k: int
) -> torch.Tensor:
    """Tile classes ``(Tq, Tk)`` as FlexAttention's padded mask has them: a full tile on a
    ragged edge (past ``Lq`` or ``Lk``) is partial there. Returns a new tensor."""
    dev = classes.device
    ragged_q = torch.arange(classes.shape[0], device=dev) * block_q + block_q > len_q  # (Tq,)
    ragged_k = torch.arange(classes.shape[1], device=dev) * block_k + block_k > len_k  # (Tk,)
    ragged = ragged_q[:, None] | ragged_k[None, :]
    return torch.where(ragged & (classes == FULL), PARTIAL, classes)


class MaskMod(Mask):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend) as a mask,
    called on broadcast int32 index tensors (as Flex's compiled kernels pass them).

    Or a torch ``BlockMask`` (from ``create_block_mask``): then its block
    structure gives the tile classes and its ``mask_mod`` decides inside
    partial blocks. Composes with the other masks: ``MaskMod(f) & Causal()``,
    ``MaskMod(f) | MaskMod(g)``. See the module docstring for the semantics.
    """

    def __init__(self, mask_mod: MaskModFn | BlockMask) -> None:
        self.block_mask: BlockMask | None = None
        if is_block_mask(mask_mod):
            self.block_mask = mask_mod  # type: ignore[assignment]
            fn = mask_mod.mask_mod  # type: ignore[union-attr]
            if _fn_name(fn) == "_sliced_mask_mod_error":
                raise ValueError(
                    "MaskMod: this BlockMask was sliced (block_mask[...]), which drops its "
                    "mask_mod; slice the inputs instead, or build a BlockMask for them"
                )
            self.mask_mod: MaskModFn = fn
        elif callable(mask_mod):
            self.mask_mod = mask_mod
        else:
            raise TypeError(
                "MaskMod needs a mask_mod callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor, "
                f"or a torch BlockMask; got {type(mask_mod).__name__}"
            )

    def __repr__(self) -> str:
        if self.block_mask is not None:
            bq, bk = self.block_mask.BLOCK_SIZE
            return f"MaskMod(BlockMask {_fn_name(self.mask_mod)} {bq}x{bk})"
        return f"MaskMod({_fn_name(self.mask_mod)})"

    def bind(self, geo: Geometry) -> BoundMask:
        caller = TileCaller(self.mask_mod, "mask_mod")
        if self.block_mask is not None:
            return BlockMaskBound(geo, self.block_mask, caller)
        return MaskModBound(geo, caller)


class MaskModBound(BoundMask):
    """A mask_mod against one call's geometry."""

    def __init__(self, geo: Geometry, caller: TileCaller) -> None:
        self.geo = geo
        self.caller = caller

    @property
    def callers(self) -> tuple[TileCaller, ...]:
        return (self.caller,)

    def _inside(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The mask_mod on the tile's positions, ``(Bm, Hm, r|1, c|1)`` as it broadcasts."""
        g = self.geo
        rows = torch.arange(q0, q1, device=g.device) + g.q_offset  # (r,) global
        keys = torch.arange(k0, k1, device=g.device) + g.k_offset  # (c,) global
        return self.caller(*index_grid(g.batch, g.heads, rows, keys))

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        out = self._inside(q0, q1, k0, k1)  # (Bm, Hm, r|1, c|1)
        return out.expand(out.shape[0], out.shape[1], q1 - q0, k1 - k0)

    @property
    def sub_blockable(self) -> bool:
        return self.caller._vmap is None  # a callable mapped by torch.vmap goes tile by tile

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        g = self.geo
        n, s = rows.shape
        # the distinct positions: a ragged side's last sub-block repeats its last index
        distinct = int(
            ((rows[:, 1:] != rows[:, :-1]).sum(1) + 1)
            .mul((keys[:, 1:] != keys[:, :-1]).sum(1) + 1)
            .sum()
        )
        return self.caller.blocks(
            g.batch, g.heads, rows + g.q_offset, keys + g.k_offset, positions=distinct
        )

    def bounded_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """The classes the mask_mod's span bounds decide (``_spans``): ``EMPTY`` where it
        cannot hold anywhere in the tile, ``FULL`` where it cannot fail, ``PARTIAL`` where
        the bounds do not tell (all of them when the mask_mod leaves the spans' reach)."""
        g = self.geo
        tq, tk = -(-g.lq // block_q), -(-g.lk // block_k)
        out = torch.full((tq, tk), PARTIAL, dtype=torch.int8)
        if not SPAN_BOUNDS:
            return out

        def firsts_lasts(n: int, block: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
            first = torch.arange(0, n, block, device=g.device)  # (T,) local
            return first + offset, torch.clamp(first + block, max=n) - 1 + offset  # global

        bounds = span_classes(
            self.caller.fn,
            batch=g.batch,
            heads=g.heads,
            rows=firsts_lasts(g.lq, block_q, g.q_offset),
            keys=firsts_lasts(g.lk, block_k, g.k_offset),
        )
        if bounds is not None:
            may_true, may_false = (x.cpu() for x in bounds)
            out[~may_false] = FULL
            out[~may_true] = EMPTY
        return out

    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """Exact classes: the span bounds decide what they can, the rest is evaluated."""
        return classify_bounded(self, block_q, block_k)


def _one_or(n: int) -> str:
    """How many entries a BlockMask may have along an axis of ``n``: "1", or "1 or n"."""
    return "1" if n == 1 else f"1 or {n}"


class BlockMaskBound(MaskModBound):
    """A torch ``BlockMask`` against one call's geometry (see the module docstring)."""

    def __init__(self, geo: Geometry, bm: BlockMask, caller: TileCaller) -> None:
        super().__init__(geo, caller)
        lq, lk = (int(x) for x in bm.seq_lengths)
        if (lq, lk) != (geo.lq_total, geo.lk_total):
            raise ValueError(
                f"the BlockMask was made for (Lq, Lk) = ({lq}, {lk}) but the inputs have "
                f"({geo.lq_total}, {geo.lk_total}); make it with create_block_mask for these "
                "lengths"
            )
        self.block_q, self.block_k = (int(x) for x in bm.BLOCK_SIZE)
        bb, hb = bm.kv_num_blocks.shape[:2]
        if bb not in (1, geo.batch) or hb not in (1, geo.heads):
            raise ValueError(
                f"the BlockMask has batch x heads {bb} x {hb}; the inputs need "
                f"{_one_or(geo.batch)} batch entries and {_one_or(geo.heads)} heads"
            )
        self._derived = _derived(bm)  # shared by every call with this BlockMask
        key = ("grid", str(geo.device))
        if key not in self._derived:
            self._derived[key] = block_grid(bm, geo.device)
        self.grid = self._derived[key]  # (Bb, Hb, Tq, Tk), read only

    def _with_blocks(
        self, inside: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Visibility inside the BlockMask: a full block's positions are visible and an
        empty one's are not, whatever the mask_mod says; a partial one's as it says.
        ``inside``: the mask_mod there; ``rows``, ``keys``: the positions' local rows and
        keys, broadcast to them."""
        g = self.geo
        kinds = self.grid[
            :, :, (rows + g.q_offset) // self.block_q, (keys + g.k_offset) // self.block_k
        ]  # (Bb, Hb, ...) each position's block kind
        return (inside | (kinds == FULL)) & (kinds != EMPTY)

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        g = self.geo
        inside = self._inside(q0, q1, k0, k1)  # (Bm, Hm, r|1, c|1)
        rb0, rb1 = (q0 + g.q_offset) // self.block_q, (q1 - 1 + g.q_offset) // self.block_q + 1
        cb0, cb1 = (k0 + g.k_offset) // self.block_k, (k1 - 1 + g.k_offset) // self.block_k + 1
        if bool((self.grid[:, :, rb0:rb1, cb0:cb1] == PARTIAL).all()):  # the mask_mod alone
            return inside.expand(*inside.shape[:2], q1 - q0, k1 - k0)
        rows = torch.arange(q0, q1, device=g.device)[:, None]  # (r, 1)
        keys = torch.arange(k0, k1, device=g.device)[None, :]  # (1, c)
        return self._with_blocks(inside, rows, keys)  # (B', H', r, c)

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        inside = super().sub_blocks(rows, keys)  # (Bm, Hm, N, s, s) the mask_mod
        if inside is None:
            return None
        g = self.geo
        gr = (rows + g.q_offset) // self.block_q  # (N, s) block rows
        gc = (keys + g.k_offset) // self.block_k  # (N, s) block columns
        if bool((gr == gr[:, :1]).all()) and bool((gc == gc[:, :1]).all()):
            # each sub-block inside one block: its first position's kind is every one's;
            # where every one's block is partial (for every batch entry and head, as the
            # sub-blocks the bounds leave open mostly are), the mask_mod alone decides
            if bool((self.grid[:, :, gr[:, 0], gc[:, 0]] == PARTIAL).all()):
                return inside
            return self._with_blocks(inside, rows[:, :1, None], keys[:, None, :1])
        return self._with_blocks(inside, rows[:, :, None], keys[:, None, :])  # (B', H', N, s, s)

    def bounded_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """Classes by position as far as the blocks and the mask_mod's span bounds tell:
        a tile the blocks leave partial is empty where the mask_mod cannot hold in it and
        it touches no full block, full where the mask_mod cannot fail and it touches no
        empty block."""
        counts = self._counts(block_q, block_k)
        out = self._classes(counts)
        part = out == PARTIAL
        if SPAN_BOUNDS and bool(part.any()):
            spans = super().bounded_classes(block_q, block_k)
            n_full_some, n_empty_some = counts[2], counts[3]
            out[part & (spans == EMPTY) & (n_full_some == 0).cpu()] = EMPTY
            out[part & (spans == FULL) & (n_empty_some == 0).cpu()] = FULL
        return out

    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """The classes the blocks give (nothing evaluated); the partial tiles' visibility
        is put together from sub-blocks where the bounds decide most of them
        (``masks._sub_blocks``) and kept for the loop."""
        out = self._classes(self._counts(block_q, block_k))
        part = out == PARTIAL
        if bool(part.any()):
            info = _sub_blocks(self, block_q, block_k)
            if info is not None and not info.whole:
                info.keep(self, block_q, block_k, torch.nonzero(part))
        return out

    @staticmethod
    def _classes(counts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        n_seen, n_open = counts[0], counts[1]
        out = torch.full(n_seen.shape, PARTIAL, dtype=torch.int8)
        out[(n_seen == 0).cpu()] = EMPTY
        out[((n_open == 0) & (n_seen > 0)).cpu()] = FULL
        return out

    def _counts(self, block_q: int, block_k: int) -> tuple[torch.Tensor, ...]:
        """Per tile ``(Tq, Tk)``, the blocks it touches that are: not empty for some batch
        entry and head; not full for some; full for some; empty for some (computed once
        per tile size and geometry for the BlockMask: the bounds and the classes both start
        from them)."""
        g = self.geo
        key = ("counts", str(g.device), g.lq, g.lk, g.q_offset, g.k_offset, block_q, block_k)
        if key not in self._derived:
            self._derived[key] = self._count(block_q, block_k)
        return self._derived[key]  # type: ignore[no-any-return]

    def _count(self, block_q: int, block_k: int) -> tuple[torch.Tensor, ...]:
        g = self.geo

        def spans(n: int, block: int, offset: int, grain: int) -> tuple[torch.Tensor, ...]:
            start = torch.arange(0, n, block, device=g.device)  # local tile starts
            stop = torch.clamp(start + block, max=n)
            return (start + offset) // grain, (stop - 1 + offset) // grain + 1  # block range

        r0, r1 = spans(g.lq, block_q, g.q_offset, self.block_q)  # (Tq,) each
        c0, c1 = spans(g.lk, block_k, g.k_offset, self.block_k)  # (Tk,) each

        grid = self.grid.flatten(0, 1)  # (Bb·Hb, Tq_b, Tk_b)
        per_block = torch.stack(
            [
                (grid != EMPTY).any(dim=0),  # (Tq_b, Tk_b) some (b, h) sees it
                (grid != FULL).any(dim=0),
                (grid == FULL).any(dim=0),
                (grid == EMPTY).any(dim=0),
            ]
        )  # (4, Tq_b, Tk_b)
        p = torch.zeros(4, grid.shape[1] + 1, grid.shape[2] + 1, dtype=torch.int64, device=g.device)
        p[:, 1:, 1:] = per_block.to(torch.int64).cumsum(1).cumsum(2)  # prefix sums
        a, b = r0[:, None], r1[:, None]
        counts = p[:, b, c1] - p[:, a, c1] - p[:, b, c0] + p[:, a, c0]  # (4, Tq, Tk)
        return tuple(counts.unbind(0))
