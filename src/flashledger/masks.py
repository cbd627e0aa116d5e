"""Masks that know their tiles.

A mask says which (query, key) pairs may attend (``True`` = attend). Every
mask here can

- give its dense boolean matrix (``mask.dense(Lq, Lk)``), and
- classify each ``block_q x block_k`` tile as ``EMPTY`` (no visible pair: the
  tile is skipped), ``PARTIAL`` (the mask is evaluated inside the tile) or
  ``FULL`` (every pair visible: the mask is never evaluated).

Structured masks (causal, sliding window, key padding, variable-length
sequence bounds) are *interval* masks: query row ``i`` sees exactly the keys
``lo[i] <= j <= hi[i]``. Their tiles are classified in closed form from the
intervals, without evaluating a single pair. Dense masks are classified by
reducing the boolean matrix. ``a & b`` intersects two masks, ``a | b`` unites
them. A user's FlexAttention ``mask_mod`` (``flashledger.MaskMod``) is a mask
like these: its tiles are classified by evaluating it blockwise over index
tensors (``classify_by_rows``), and it composes with the others through ``&``
and ``|``; a composition evaluates the mask_mod only on the tiles its
closed-form side leaves undecided.

Positions are global: a call may cover query rows ``[q_offset, q_offset+Lq)``
and keys ``[k_offset, k_offset+Lk)`` of a longer sequence (split-KV, ring
attention), and causal alignment uses the global lengths.

Conventions (flash-attn semantics):

- ``Causal(align="top_left")``: key j visible to query i iff ``j <= i``;
  ``"bottom_right"``: iff ``j <= i + Lk - Lq``; ``align=None`` takes the
  conventions' ``causal_align``.
- ``SlidingWindow(left, right)``: iff ``c - left <= j <= c + right`` with
  ``c = i`` (top-left) or ``c = i + Lk - Lq`` (bottom-right); ``None`` or -1
  means unbounded on that side; ``SlidingWindow(None, 0)`` is causal.
- ``KeyPadding(lengths)``: batch ``b`` sees keys ``j < lengths[b]`` (right
  padding); ``KeyPadding(lengths, side="left")``: keys ``j >= Lk - lengths[b]``
  (left padding: the real keys are the last ``lengths[b]``). The diagonal
  stays aligned to the padded lengths.
- ``Padding(q_lens, k_lens)``: batch ``b`` uses its first ``q_lens[b]``
  queries and ``k_lens[b]`` keys, and the causal diagonal, windows and ALiBi
  are aligned to those lengths, as flash-attn aligns them to each sequence's
  real length (the same as the ``seqused_q`` / ``seqused_k`` options).
  Query rows past ``q_lens[b]`` see no key. It sets the lengths of the whole
  call, so it is given alone or combined with ``&``.
- ``DenseMask(t)``: any bool tensor broadcastable to ``(B, H, Lq, Lk)``.
- ``a | b``: visible iff visible in either. Tile classes: full if either is
  full, empty if both are empty, else partial (two partial tiles that cover
  each other's gaps are found full).

Windows under ``Conventions.window_rewrite == "flash_attn_2"`` are read as
flash-attn 2 reads them: a side ``>= seqlen_k`` becomes -1 (unbounded), then
a -1 side opposite a bounded side becomes ``seqlen_k`` (``Geometry.window_len``:
``Lk``, the longest sequence with ``cu_seqlens``, the longest ``k_lens`` of a
``Padding``).
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ._checks import all_of, any_of, check_size
from ._limits import MAX_SIZE

if TYPE_CHECKING:
    from ._mods import TileCaller
    from .conventions import Conventions

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Causal",
    "DenseMask",
    "Geometry",
    "KeyPadding",
    "Mask",
    "Padding",
    "SlidingWindow",
    "as_mask",
    "classify_bounded",
    "classify_by_rows",
]

EMPTY, PARTIAL, FULL = 0, 1, 2
TILE_KINDS = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}
Align = Literal["top_left", "bottom_right"]
_BIG = 1 << 60


SeqUsed = tuple[tuple[int, ...] | None, tuple[int, ...] | None]


@dataclass(frozen=True)
class Geometry:
    """Where a call's rows and keys sit, and what each row could see at most.

    All index tensors are int64 on the call's device, ``(Bg, Lq)`` with ``Bg``
    1 or the batch (per-batch lengths: ``seqused_q``/``seqused_k``, a
    ``Padding``). ``k_lo``/``k_hi`` bound row ``i``'s keys to its own sequence
    (``[0, Lk_total)`` without variable length; empty for a query row past its
    sequence's used length); ``off_tl``/``off_br`` are the per-row offsets
    ``c - i`` of the top-left / bottom-right diagonal.

    A *plain* geometry (no variable length, no used lengths: every row may see keys
    ``[0, Lk_total)``, diagonals at offsets 0 and ``Lk_total - Lq_total``) holds no
    tensor: its four are made when first asked, and masks bound to a few of its rows
    work in plain integers (``diagonal_rows``), which for a decode step costs less than
    the tensor operations would.
    """

    lq: int  # rows in this call
    lk: int  # keys in this call
    batch: int
    heads: int  # query heads
    q_offset: int  # global index of row 0
    k_offset: int  # global index of key 0
    lq_total: int
    lk_total: int
    causal_align: Align
    device: torch.device
    # (k_lo, k_hi, off_tl, off_br), (Bg, Lq) each, when rows are bounded to their sequence;
    # None on a plain geometry (see the properties below)
    per_row: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    varlen: bool = False
    row_seq: torch.Tensor | None = None  # (Lq,) sequence of each row (variable length)
    window_len: int | None = None  # seqlen_k of flash-attn 2's window rewriting; None: as given
    seq_used: SeqUsed | None = None  # per-sequence used lengths (q, k), when given

    @staticmethod
    def build(
        *,
        lq: int,
        lk: int,
        batch: int = 1,
        heads: int = 1,
        causal_align: Align = "top_left",
        device: torch.device | str | None = None,
        q_offset: int = 0,
        k_offset: int = 0,
        lq_total: int | None = None,
        lk_total: int | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        seqused_q: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        window_rewrite: bool = False,
        window_len: int | None = None,
        conventions: Conventions | None = None,
    ) -> Geometry:
        """``seqused_q``/``seqused_k``: used lengths per sequence, int ``(n,)`` (``n`` the
        batch, 1, or the number of ``cu_seqlens`` sequences), validated by the caller.
        ``window_rewrite``: read windows as flash-attn 2 does, against ``window_len``
        (default: ``Lk_total``, or the longest ``cu_seqlens_k`` sequence).
        ``conventions``, when given, sets ``causal_align`` and ``window_rewrite``."""
        if conventions is not None:
            causal_align = conventions.causal_align
            window_rewrite = conventions.window_rewrite == "flash_attn_2"
        dev = torch.device(device) if device is not None else torch.device("cpu")
        lq_total = lq if lq_total is None else lq_total
        lk_total = lk if lk_total is None else lk_total
        used: SeqUsed | None = None
        if seqused_q is not None or seqused_k is not None:
            used = (_as_key(seqused_q), _as_key(seqused_k))
        common = dict(
            lq=lq,
            lk=lk,
            batch=batch,
            heads=heads,
            q_offset=q_offset,
            k_offset=k_offset,
            lq_total=lq_total,
            lk_total=lk_total,
            causal_align=causal_align,
            device=dev,
            seq_used=used,
        )
        if cu_seqlens_q is None:
            win = lk_total if window_len is None else window_len
            if used is None:  # plain: no tensor until one is asked for
                return Geometry(**common, window_len=win if window_rewrite else None)  # type: ignore[arg-type]
            rows = torch.arange(q_offset, q_offset + lq, device=dev)  # (Lq,) global rows
            qn = _per_batch(seqused_q, lq_total, batch, dev)  # (B,)
            kn = _per_batch(seqused_k, lk_total, batch, dev)  # (B,)
            live = rows[None, :] < qn[:, None]  # (B, Lq) rows inside the used queries
            zeros = torch.zeros(batch, lq, dtype=torch.int64, device=dev)  # (B, Lq)
            return Geometry(
                **common,  # type: ignore[arg-type]
                per_row=(
                    zeros,
                    torch.where(live, kn[:, None], 0),
                    zeros,
                    zeros + (kn - qn)[:, None],
                ),
                window_len=win if window_rewrite else None,
            )
        assert cu_seqlens_k is not None
        rows = torch.arange(q_offset, q_offset + lq, device=dev)  # (Lq,) global rows
        cq = cu_seqlens_q.to(device=dev, dtype=torch.int64)
        ck = cu_seqlens_k.to(device=dev, dtype=torch.int64)
        qn = cq[1:] - cq[:-1] if seqused_q is None else seqused_q.to(dev, torch.int64)  # (n,)
        kn = ck[1:] - ck[:-1] if seqused_k is None else seqused_k.to(dev, torch.int64)  # (n,)
        seq = torch.searchsorted(cq, rows, right=True) - 1  # (Lq,) sequence of each row
        live = rows - cq[seq] < qn[seq]  # (Lq,)
        win = int((ck[1:] - ck[:-1]).max()) if window_len is None else window_len
        return Geometry(
            **common,  # type: ignore[arg-type]
            per_row=(
                ck[seq][None, :],
                torch.where(live, ck[seq] + kn[seq], ck[seq])[None, :],
                (ck[seq] - cq[seq])[None, :],
                (ck[seq] + kn[seq] - cq[seq] - qn[seq])[None, :],
            ),
            varlen=True,
            row_seq=seq,
            window_len=win if window_rewrite else None,
        )

    @property
    def bounded(self) -> bool:
        """True when rows are bounded to their own sequence (variable length, used lengths)."""
        return self.varlen or self.seq_used is not None

    @property
    def plain(self) -> bool:
        """True when every row may see keys ``[0, Lk_total)`` and the diagonals sit at
        offsets 0 (top-left) and ``Lk_total - Lq_total`` (bottom-right)."""
        return self.per_row is None

    def _row_tensor(self, index: int, value: int) -> torch.Tensor:
        if self.per_row is not None:
            return self.per_row[index]
        return torch.full((1, self.lq), value, dtype=torch.int64, device=self.device)  # (1, Lq)

    @functools.cached_property
    def k_lo(self) -> torch.Tensor:
        """``(Bg, Lq)`` first key of each row's sequence (global)."""
        return self._row_tensor(0, 0)

    @functools.cached_property
    def k_hi(self) -> torch.Tensor:
        """``(Bg, Lq)`` one past each row's last used key (``k_lo`` for a padding row)."""
        return self._row_tensor(1, self.lk_total)

    @functools.cached_property
    def off_tl(self) -> torch.Tensor:
        """``(Bg, Lq)`` top-left diagonal offset ``c - i``."""
        return self._row_tensor(2, 0)

    @functools.cached_property
    def off_br(self) -> torch.Tensor:
        """``(Bg, Lq)`` bottom-right diagonal offset ``c - i``."""
        return self._row_tensor(3, self.lk_total - self.lq_total)

    def rows(self) -> torch.Tensor:
        """Global query indices of this call, ``(Lq,)``."""
        return torch.arange(self.q_offset, self.q_offset + self.lq, device=self.device)

    def diagonal(self, align: Align | None) -> torch.Tensor:
        """Per-row diagonal key position ``c`` for the alignment, ``(Bg, Lq)``."""
        a = align or self.causal_align
        return self.rows()[None, :] + (self.off_tl if a == "top_left" else self.off_br)

    def diagonal_rows(self, align: Align | None) -> list[int]:
        """``diagonal`` of a plain geometry in plain integers, one per row (``Lq``)."""
        assert self.plain
        a = align or self.causal_align
        first = self.q_offset + (0 if a == "top_left" else self.lk_total - self.lq_total)
        return list(range(first, first + self.lq))


def _as_key(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(int(x) for x in t.reshape(-1).tolist())


def _per_batch(t: torch.Tensor | None, full: int, batch: int, dev: torch.device) -> torch.Tensor:
    """Used lengths ``(n,)`` (n = 1 or B) or None -> ``(B,)`` int64 (None: ``full``)."""
    if t is None:
        return torch.full((batch,), full, dtype=torch.int64, device=dev)
    return t.to(device=dev, dtype=torch.int64).reshape(-1).expand(batch)


def fa2_clip(left: int | None, right: int | None, seqlen_k: int) -> tuple[int | None, int | None]:
    """flash-attn 2's first step (``flash_api.cpp``): a side ``>= seqlen_k`` is dropped
    (``None`` = unbounded). Its ``is_causal`` is judged here: no left side, right 0."""
    lo = None if left is None or left >= seqlen_k else left
    hi = None if right is None or right >= seqlen_k else right
    return lo, hi


def fa2_window(left: int | None, right: int | None, seqlen_k: int) -> tuple[int | None, int | None]:
    """A window's sides as flash-attn 2's kernel reads them (``None`` = unbounded).

    ``flash_api.cpp``: a side ``>= seqlen_k`` is dropped; then, when exactly one side is
    unbounded, that side becomes ``seqlen_k``.
    """
    lo, hi = fa2_clip(left, right, seqlen_k)
    if lo is None and hi is not None:
        lo = seqlen_k
    if hi is None and lo is not None:
        hi = seqlen_k
    return lo, hi


KEEP_BYTES = 64 << 20
"""Most bytes of partial-tile visibility a mask with a mask_mod keeps (see ``BoundMask.keep``)."""


class BoundMask(ABC):
    """A mask evaluated against one call's geometry."""

    geo: Geometry

    @property
    def callers(self) -> tuple[TileCaller, ...]:
        """The user mask_mods this mask evaluates (each once per ``block`` call); none for
        the closed-form and dense masks."""
        return ()

    def keep(
        self, q0: int, q1: int, k0: int, k1: int, vis: torch.Tensor, *, shared: bool = False
    ) -> None:
        """Keep a partial tile's visibility (a mask with a mask_mod only), so that no later
        step or pass over the same bound mask evaluates it again. Tiles are kept in the
        order they come until ``KEEP_BYTES`` would be passed; none after that. ``shared``:
        ``vis`` is a contiguous part of a tensor made to hold kept tiles, kept as it is
        (else a view is copied, so as not to hold its base)."""
        if not self.callers:
            return
        kept, used = self._kept()
        if used[0] < 0:  # the budget ran out: keep nothing more
            return
        if used[0] + vis.numel() > KEEP_BYTES:
            used[0] = -1
            return
        whole = vis._base is None or vis._base.numel() == vis.numel()  # holds nothing more
        kept[(q0, q1, k0, k1)] = vis.contiguous() if whole or shared else vis.clone()
        used[0] += vis.numel()

    def is_kept(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """Whether this tile's visibility is kept."""
        return (q0, q1, k0, k1) in self._kept()[0]

    def _kept(self) -> tuple[dict[tuple[int, int, int, int], torch.Tensor], list[int]]:
        store = self.__dict__.get("_kept_tiles")
        if store is None:
            store = self.__dict__["_kept_tiles"] = ({}, [0])
        return store  # type: ignore[no-any-return]

    def classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """``tile_classes``, remembered per tile size by a mask with a mask_mod (a second
        pass over the same bound mask does not evaluate it again)."""
        if not self.callers:
            return self.tile_classes(block_q, block_k)
        memo = self.__dict__.setdefault("_classes_memo", {})
        if (block_q, block_k) not in memo:
            memo[(block_q, block_k)] = self.tile_classes(block_q, block_k)
        return memo[(block_q, block_k)].clone()  # type: ignore[no-any-return]

    def tile_visibility(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """``block`` of a partial tile the loop runs: the kept visibility when there is
        one, else evaluated (and kept, while the budget lasts)."""
        if not self.callers:
            return self.block(q0, q1, k0, k1)
        vis = self._kept()[0].get((q0, q1, k0, k1))
        if vis is None:
            vis = self.block(q0, q1, k0, k1)
            self.keep(q0, q1, k0, k1, vis)
        return vis

    @abstractmethod
    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """Visibility of local rows ``[q0, q1)`` x local keys ``[k0, k1)``: bool ``(Bm, Hm, bq, bk)``."""
        ...

    @abstractmethod
    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """``(Tq, Tk)`` int8 tensor of ``EMPTY``/``PARTIAL``/``FULL``."""
        ...

    @property
    def tiles_bounded(self) -> int:
        """Tiles the classifications of this bound mask decided without evaluating a
        mask_mod although one was inside (by its span bounds, or by the closed-form side of
        ``&``/``|``), summed over the classifications run (a remembered one adds nothing)."""
        return int(self.__dict__.get("_tiles_bounded", 0))

    def _count_bounded(self, n: int) -> None:
        self.__dict__["_tiles_bounded"] = self.tiles_bounded + n

    def bounded_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        """Tile classes as far as they are known without evaluating a mask_mod, ``(Tq, Tk)``
        int8: ``EMPTY``/``FULL`` where decided, ``PARTIAL`` where not (it may still be
        empty or full). A mask without a mask_mod: its ``tile_classes``."""
        if not self.callers:
            return self.tile_classes(block_q, block_k)
        g = self.geo
        return torch.full((-(-g.lq // block_q), -(-g.lk // block_k)), PARTIAL, dtype=torch.int8)

    def tile_class_rows(self, block_q: int, block_k: int) -> list[list[int]]:
        """``classes`` as nested lists ``(Tq, Tk)``, what the loops read (not to be modified:
        a mask may keep them)."""
        rows: list[list[int]] = self.classes(block_q, block_k).tolist()
        return rows

    @property
    def sub_blockable(self) -> bool:
        """Whether ``sub_blocks`` may answer (it still may not: a mask_mod's first
        evaluation tells)."""
        return False

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """Visibility of ``N`` square sub-blocks at once, bool ``(Bm, Hm, N, s, s)``: local
        rows ``rows[n]`` ``(s,)`` against local keys ``keys[n]`` ``(s,)``, int64 ``(N, s)``
        each; None where this mask cannot (its tiles are then evaluated whole)."""
        return None

    def dense(self) -> torch.Tensor:
        """The whole visibility matrix, bool ``(Bm, Hm, Lq, Lk)``."""
        return self.block(0, self.geo.lq, 0, self.geo.lk)

    def rows_with_keys(self) -> torch.Tensor:
        """Rows that see at least one key of the call, bool ``(Bm, Hm, Lq)``."""
        return self.dense().any(dim=-1)


class IntervalBound(BoundMask):
    """Row ``i`` sees global keys ``lo[i] <= j <= hi[i]`` (``lo``, ``hi``: ``(Bm, Lq)``).

    Made from tensors, or (``of_rows``) from plain integers for a few rows of a plain
    geometry, shared by the batch (a decode step): its tensors are then made only when
    a loop asks for them, and ``rows()`` reads the integers as they are.
    """

    def __init__(self, geo: Geometry, lo: torch.Tensor, hi: torch.Tensor) -> None:
        self.geo = geo
        lo, hi = torch.broadcast_tensors(
            torch.maximum(lo, geo.k_lo), torch.minimum(hi, geo.k_hi - 1)
        )
        self._lo: torch.Tensor | None = lo.contiguous()  # (Bm, Lq)
        self._hi: torch.Tensor | None = hi.contiguous()  # (Bm, Lq)
        self._rows: tuple[list[list[int]], list[list[int]]] | None = None
        self._class_rows: dict[tuple[int, int], list[list[int]]] = {}

    @classmethod
    def of_rows(
        cls, geo: Geometry, lo: Sequence[int] | None, hi: Sequence[int] | None
    ) -> IntervalBound:
        """Row ``i`` sees ``lo[i] <= j <= hi[i]`` (global; ``None``: unbounded on that
        side), one interval per row for the whole batch, on a plain geometry; clipped to
        the keys ``[0, Lk_total)`` as the tensor form clips to ``[k_lo, k_hi)``."""
        assert geo.plain
        top = geo.lk_total - 1
        bound = cls.__new__(cls)
        bound.geo = geo
        bound._lo = bound._hi = None
        bound._class_rows = {}
        bound._rows = (
            [[0] * geo.lq if lo is None else [max(x, 0) for x in lo]],
            [[top] * geo.lq if hi is None else [min(x, top) for x in hi]],
        )
        return bound

    @property
    def lo(self) -> torch.Tensor:
        """``(Bm, Lq)`` int64: each row's first visible key (global)."""
        if self._lo is None:
            assert self._rows is not None
            self._lo = torch.tensor(self._rows[0], dtype=torch.int64, device=self.geo.device)
        return self._lo

    @property
    def hi(self) -> torch.Tensor:
        """``(Bm, Lq)`` int64: each row's last visible key (global)."""
        if self._hi is None:
            assert self._rows is not None
            self._hi = torch.tensor(self._rows[1], dtype=torch.int64, device=self.geo.device)
        return self._hi

    def rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """``(lo, hi)`` as plain integers, ``(Bm, Lq)`` nested lists."""
        if self._rows is None:
            self._rows = (self.lo.cpu().tolist(), self.hi.cpu().tolist())
        return self._rows

    def _shared_rows(self) -> tuple[list[int], list[int]] | None:
        """``(lo, hi)`` in plain integers, one per row, when the bound was made from them
        (``of_rows``); else None."""
        if self._rows is None or len(self._rows[0]) != 1 or not _few_plain_rows(self.geo):
            return None
        return self._rows[0][0], self._rows[1][0]

    def local_intervals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys as local half-open ``[lo, hi)`` (``k_offset`` taken off), int64
        ``(Bm, Lq)`` each: what the native step reads."""
        ko = self.geo.k_offset
        if self._lo is None and self._rows is not None:
            lo_rows, hi_rows = self._rows
            dev = self.geo.device
            return (
                torch.tensor([[x - ko for x in r] for r in lo_rows], dtype=torch.int64, device=dev),
                torch.tensor(
                    [[x - ko + 1 for x in r] for r in hi_rows], dtype=torch.int64, device=dev
                ),
            )
        return self.lo - ko, self.hi - ko + 1

    def _size(self) -> int:
        """``Bm · Lq``: how many row intervals there are."""
        if self._rows is not None:
            return len(self._rows[0]) * self.geo.lq
        return self.lo.numel()

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        j = torch.arange(k0, k1, device=self.geo.device) + self.geo.k_offset  # (bk,)
        lo = self.lo[:, q0:q1, None]  # (Bm, bq, 1)
        hi = self.hi[:, q0:q1, None]
        return ((j >= lo) & (j <= hi)).unsqueeze(1)  # (Bm, 1, bq, bk)

    sub_blockable = True

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        j = (keys + self.geo.k_offset)[None, :, None, :]  # (1, N, 1, s) global
        lo, hi = self.lo[:, rows, None], self.hi[:, rows, None]  # (Bm, N, s, 1)
        return ((j >= lo) & (j <= hi)).unsqueeze(1)  # (Bm, 1, N, s, s)

    def rows_with_keys(self) -> torch.Tensor:
        g = self.geo
        lo_l, hi_l = self.lo - g.k_offset, self.hi - g.k_offset  # (Bm, Lq) local
        return ((lo_l <= hi_l) & (hi_l >= 0) & (lo_l <= g.lk - 1)).unsqueeze(1)  # (Bm, 1, Lq)

    def _tiles(self, block_q: int, block_k: int) -> tuple[int, int, bool]:
        """``(Tq, Tk, few)``: the tile grid, and whether it is classified in plain integers."""
        g = self.geo
        tq, tk = -(-g.lq // block_q), -(-g.lk // block_k)
        return tq, tk, self._size() <= _FEW_ROWS and tq * tk <= _FEW_TILES

    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        g = self.geo
        tq, tk, few = self._tiles(block_q, block_k)
        if few:
            return self._tile_classes_few(block_q, block_k, tq, tk)
        pad = tq * block_q - g.lq
        k0 = torch.arange(tk, device=g.device) * block_k + g.k_offset  # (Tk,) global first key
        k1 = torch.clamp(k0 + block_k, max=g.k_offset + g.lk) - 1  # (Tk,) global last key
        # FULL: every row (every batch) covers the whole tile.
        lo_f = torch.nn.functional.pad(self.lo, (0, pad), value=-_BIG)
        hi_f = torch.nn.functional.pad(self.hi, (0, pad), value=_BIG)
        max_lo = lo_f.view(-1, tq, block_q).amax(dim=(0, 2))  # (Tq,)
        min_hi = hi_f.view(-1, tq, block_q).amin(dim=(0, 2))  # (Tq,)
        full = (max_lo[:, None] <= k0[None, :]) & (min_hi[:, None] >= k1[None, :])  # (Tq, Tk)
        # EMPTY: no row's interval meets the tile. Rows mark the tile span they hit.
        lo_l = self.lo - g.k_offset  # (Bm, Lq) local
        hi_l = self.hi - g.k_offset
        hit = (lo_l <= hi_l) & (hi_l >= 0) & (lo_l <= g.lk - 1)  # (Bm, Lq)
        first = torch.clamp(lo_l, min=0) // block_k  # (Bm, Lq)
        last = torch.clamp(hi_l, max=g.lk - 1) // block_k
        qtile = (torch.arange(g.lq, device=g.device) // block_q).expand_as(first)  # (Bm, Lq)
        diff = torch.zeros(tq, tk + 1, dtype=torch.int64, device=g.device)
        flat = diff.view(-1)
        w = hit.to(torch.int64)
        flat.index_add_(0, (qtile * (tk + 1) + first.clamp(0, tk)).reshape(-1), w.reshape(-1))
        flat.index_add_(0, (qtile * (tk + 1) + (last + 1).clamp(0, tk)).reshape(-1), -w.reshape(-1))
        nonempty = diff.cumsum(dim=1)[:, :tk] > 0  # (Tq, Tk)
        out = torch.full((tq, tk), PARTIAL, dtype=torch.int8, device=g.device)
        out[~nonempty] = EMPTY
        out[full & nonempty] = FULL
        return out.cpu()

    def tile_class_rows(self, block_q: int, block_k: int) -> list[list[int]]:
        """``tile_classes`` as nested lists, kept per tile size (a mask bound once serves
        every call that reuses it: a frame's few rows, or a value mask kept by
        ``_kept_bound``; the loops only read them)."""
        rows = self._class_rows.get((block_q, block_k))
        if rows is None:
            tq, tk, few = self._tiles(block_q, block_k)
            if few:
                rows = self._tile_class_rows(block_q, block_k, tq, tk)
            else:
                rows = super().tile_class_rows(block_q, block_k)
            self._class_rows[(block_q, block_k)] = rows
        return rows

    def _tile_classes_few(self, block_q: int, block_k: int, tq: int, tk: int) -> torch.Tensor:
        """``tile_classes`` in plain integers, for a few rows (decode): the same rule
        without the two dozen small tensor operations, which there cost more than the
        attention itself."""
        return torch.tensor(self._tile_class_rows(block_q, block_k, tq, tk), dtype=torch.int8)

    def _tile_class_rows(self, block_q: int, block_k: int, tq: int, tk: int) -> list[list[int]]:
        """``_tile_classes_few`` as nested lists ``(Tq, Tk)``."""
        g = self.geo
        ko, lk = g.k_offset, g.lk
        lo_rows, hi_rows = self.rows()  # (Bm, Lq) global
        out = []
        for qi in range(tq):
            r0, r1 = qi * block_q, min(qi * block_q + block_q, g.lq)
            max_lo = max(lo[r] for lo in lo_rows for r in range(r0, r1))
            min_hi = min(hi[r] for hi in hi_rows for r in range(r0, r1))
            diff = [0] * (tk + 1)  # +1 where a row's run of hit key tiles starts, -1 after it
            for lo, hi in zip(lo_rows, hi_rows):
                for r in range(r0, r1):
                    a, b = lo[r] - ko, hi[r] - ko  # local
                    if a <= b and b >= 0 and a <= lk - 1:
                        diff[max(a, 0) // block_k] += 1
                        diff[min(b, lk - 1) // block_k + 1] -= 1
            row, hits = [], 0
            for kj in range(tk):
                hits += diff[kj]
                k0 = kj * block_k + ko
                k1 = min(k0 + block_k, ko + lk) - 1
                full = max_lo <= k0 and min_hi >= k1
                row.append(EMPTY if hits <= 0 else FULL if full else PARTIAL)
            out.append(row)
        return out


_FEW_ROWS, _FEW_TILES = 512, 4096  # classified in plain integers below these sizes


def _few_plain_rows(geo: Geometry) -> bool:
    """Interval masks bind in plain integers: a plain geometry of at most ``_FEW_ROWS`` rows."""
    return geo.plain and geo.lq <= _FEW_ROWS


_BOUND_KEEP = 32  # bound interval masks kept for their next call (``_kept_bound``)
_bound_cache: OrderedDict[tuple[object, ...], BoundMask] = OrderedDict()
_bound_lock = threading.Lock()


def _kept_bound(mask: Mask, geo: Geometry, bind: Callable[[], BoundMask]) -> BoundMask:
    """``bind()``, kept for the next call of the same value mask (``Causal``,
    ``SlidingWindow``: nothing but their fields and the geometry decides their intervals)
    on the same plain geometry: a training step calls attention with the same shapes in
    every layer, and binding and classifying many rows costs tensor operations per call
    (a bound interval mask remembers its tile classes). Other geometries bind afresh."""
    if not geo.plain or geo.lq <= _FEW_ROWS:
        return bind()
    key = (
        mask,
        geo.lq,
        geo.lk,
        geo.batch,
        geo.heads,
        geo.q_offset,
        geo.k_offset,
        geo.lq_total,
        geo.lk_total,
        geo.causal_align,
        geo.device,
        geo.window_len,
    )
    with _bound_lock:
        bound = _bound_cache.get(key)
        if bound is not None:
            _bound_cache.move_to_end(key)
            return bound
    bound = bind()
    with _bound_lock:
        _bound_cache[key] = bound
        while len(_bound_cache) > _BOUND_KEEP:
            _bound_cache.popitem(last=False)
    return bound


class DenseBound(BoundMask):
    """A bool tensor ``(Bm, Hm, Lq_total, Lk_total)`` sliced to the call."""

    def __init__(self, geo: Geometry, t: torch.Tensor) -> None:
        self.geo = geo
        self.t = t[..., geo.q_offset : geo.q_offset + geo.lq, geo.k_offset : geo.k_offset + geo.lk]

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return self.t[..., q0:q1, k0:k1]

    sub_blockable = True

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        return self.t[:, :, rows[:, :, None], keys[:, None, :]]  # (Bm, Hm, N, s, s)

    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        return _classes_from_dense(self.t, block_q, block_k)


class _PairBound(BoundMask):
    """Two bound masks of one geometry, combined (``AndBound``, ``OrBound``)."""

    def __init__(self, a: BoundMask, b: BoundMask) -> None:
        self.geo = a.geo
        self.a, self.b = a, b

    @property
    def callers(self) -> tuple[TileCaller, ...]:
        return self.a.callers + self.b.callers

    @property
    def sub_blockable(self) -> bool:
        return self.a.sub_blockable and self.b.sub_blockable

    absorbing = EMPTY  # the class one side decides alone (AndBound: empty; OrBound: full)

    def bounded_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        if not self.callers:
            return self.tile_classes(block_q, block_k)
        ca = self.a.bounded_classes(block_q, block_k)
        cb = self.b.bounded_classes(block_q, block_k)
        other = FULL if self.absorbing == EMPTY else EMPTY
        out = torch.full_like(ca, PARTIAL)
        out[(ca == other) & (cb == other)] = other  # both sides decide it alike
        out[(ca == self.absorbing) | (cb == self.absorbing)] = self.absorbing  # one is enough
        return out


class AndBound(_PairBound):
    """Intersection of two bound masks, at least one of them not an interval mask."""

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return self.a.block(q0, q1, k0, k1) & self.b.block(q0, q1, k0, k1)

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        a = self.a.sub_blocks(rows, keys)
        b = None if a is None else self.b.sub_blocks(rows, keys)
        return None if a is None or b is None else a & b

    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        if self.callers:  # a mask_mod inside: evaluated where the other side leaves it open
            return classify_bounded(self, block_q, block_k)
        ca = self.a.tile_classes(block_q, block_k)
        cb = self.b.tile_classes(block_q, block_k)
        out = torch.minimum(ca, cb)  # EMPTY wins; FULL only if both FULL
        # Two partial (or partial and full) tiles may still intersect to empty or full.
        for tq_, tk_ in torch.nonzero(out == PARTIAL).tolist():
            q0, k0 = tq_ * block_q, tk_ * block_k
            vis = self.block(q0, min(q0 + block_q, self.geo.lq), k0, min(k0 + block_k, self.geo.lk))
            if not bool(any_of(vis)):
                out[tq_, tk_] = EMPTY
            elif bool(all_of(vis)) and _covers(vis, self.geo):
                out[tq_, tk_] = FULL
        return out


class OrBound(_PairBound):
    """Union of two bound masks."""

    absorbing = FULL

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        return self.a.block(q0, q1, k0, k1) | self.b.block(q0, q1, k0, k1)

    def sub_blocks(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        a = self.a.sub_blocks(rows, keys)
        b = None if a is None else self.b.sub_blocks(rows, keys)
        return None if a is None or b is None else a | b

    def tile_classes(self, block_q: int, block_k: int) -> torch.Tensor:
        if self.callers:
            return classify_bounded(self, block_q, block_k)
        ca = self.a.tile_classes(block_q, block_k)
        cb = self.b.tile_classes(block_q, block_k)
        out = torch.maximum(ca, cb)  # FULL wins; EMPTY only if both EMPTY
        # two partial tiles may cover each other's gaps: those are looked at
        both = (ca == PARTIAL) & (cb == PARTIAL)
        if bool(both.any()):
            exact = classify_by_rows(self, block_q, block_k, need=both)
            out[both] = exact[both]
        return out


CLASSIFY_CHUNK = 1 << 22
"""Most (query, key) positions one classifying evaluation covers (per batch and head it varies over)."""


def classify_by_rows(
    bound: BoundMask, block_q: int, block_k: int, *, need: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact ``(Tq, Tk)`` tile classes from the mask's values, one row of tiles at a time.

    Each call of ``bound.block`` covers one query tile's rows and at most
    ``CLASSIFY_CHUNK`` positions, so memory stays linear in the length.
    ``need`` ``(Tq, Tk)`` bool: only the needed tiles are evaluated (each run of
    adjacent ones at once); the others are reported ``EMPTY``. The
    partial tiles' visibility is kept (``BoundMask.keep``) for the loop.
    Like ``_classes_from_dense``, a ragged last tile is full when all its real
    positions are visible.
    """
    g = bound.geo
    tq, tk = -(-g.lq // block_q), -(-g.lk // block_k)
    out = torch.full((tq, tk), EMPTY, dtype=torch.int8)
    per_call = max(1, CLASSIFY_CHUNK // (block_q * block_k))  # key tiles per evaluation
    rows_needed = None if need is None else need.cpu()
    for i in range(tq):
        q0, q1 = i * block_q, min((i + 1) * block_q, g.lq)
        for j0, j1 in [(0, tk)] if rows_needed is None else _runs(rows_needed[i]):
            _classify_run(bound, out, i, q0, q1, j0, j1, per_call, block_k)
    return out


def _runs(row: torch.Tensor) -> list[tuple[int, int]]:
    """``[j0, j1)`` of each run of True in a bool row."""
    pad = torch.zeros(1, dtype=torch.int8)
    x = torch.cat([pad, row.to(torch.int8), pad])
    edges = torch.nonzero(torch.diff(x)).view(-1).tolist()
    return list(zip(edges[0::2], edges[1::2], strict=True))


def _classify_run(
    bound: BoundMask,
    out: torch.Tensor,
    i: int,
    q0: int,
    q1: int,
    j0: int,
    j1: int,
    per_call: int,
    block_k: int,
) -> None:
    """``classify_by_rows`` for key tiles ``[j0, j1)`` of query tile ``i`` (rows ``[q0, q1)``)."""
    g = bound.geo
    for ja in range(j0, j1, per_call):
        jb = min(ja + per_call, j1)
        k0, k1 = ja * block_k, min(jb * block_k, g.lk)
        vis = bound.block(q0, q1, k0, k1).contiguous()  # (Bm, Hm, r, c)
        u8 = vis.view(torch.uint8)
        some = u8.amax(dim=2)  # (Bm, Hm, c): a row sees the key
        every = u8.amin(dim=2)  # (Bm, Hm, c): every row sees the key
        pad = (jb - ja) * block_k - (k1 - k0)
        if pad:
            some = torch.nn.functional.pad(some, (0, pad), value=0)
            every = torch.nn.functional.pad(every, (0, pad), value=1)
        some_t = some.reshape(-1, jb - ja, block_k).amax(dim=2).amax(dim=0)  # (n,)
        every_t = every.reshape(-1, jb - ja, block_k).amin(dim=2).amin(dim=0)  # (n,)
        row = torch.where(some_t > 0, PARTIAL, EMPTY).to(torch.int8)
        row[every_t > 0] = FULL
        out[i, ja:jb] = row.cpu()
        for j in torch.nonzero(row == PARTIAL).view(-1).tolist():  # kept for the loop
            c0 = j * block_k
            c1 = min(c0 + block_k, k1 - k0)
            bound.keep(q0, q1, k0 + c0, k0 + c1, vis[..., c0:c1])


def classify_bounded(bound: BoundMask, block_q: int, block_k: int) -> torch.Tensor:
    """Exact tile classes of a mask with a mask_mod inside: what ``bounded_classes`` decides
    without evaluating it (a mask_mod's span bounds; for ``a & b`` / ``a | b`` each side's,
    a closed-form side's or a BlockMask's classes, the tiles one side decides alone or
    both alike), booked as ``tiles_bounded``; the rest evaluated: by sub-blocks where they
    apply (``_classify_by_sub_blocks``), else tile by tile (``classify_by_rows``)."""
    out = _classify_by_sub_blocks(bound, block_q, block_k)
    if out is not None:
        return out
    known = bound.bounded_classes(block_q, block_k)
    need = known == PARTIAL
    bound._count_bounded(int((~need).sum()))
    out = classify_by_rows(bound, block_q, block_k, need=need)
    out[~need] = known[~need]
    return out


SUB_BLOCKS = (16, 32, 64, 128)
"""Sides of the square sub-blocks the tiles a mask_mod's bounds leave open are refined into:
the least that divides both tile sides and whose grid over the call has at most
``SUB_GRID`` sub-blocks (then at most ``SUB_GRID_MAX``); an empty tuple evaluates
those tiles whole."""
SUB_GRID = 1 << 15
"""Sub-blocks a refinement prefers at most: below PyTorch's grain for splitting an
operation between threads, so the bounds' many small operations stay on the calling
thread (waking the others costs more than they do, most of all with
``OMP_WAIT_POLICY=PASSIVE``)."""
SUB_GRID_MAX = 1 << 18
"""Most sub-blocks one refinement bounds: past that, the open tiles are evaluated whole."""


def _sub_side(geo: Geometry, block_q: int, block_k: int) -> int | None:
    fits = [
        (n, s)
        for s in SUB_BLOCKS
        if block_q % s == 0
        and block_k % s == 0
        and (n := -(-geo.lq // s) * -(-geo.lk // s)) <= SUB_GRID_MAX
    ]
    small = [s for n, s in fits if n <= SUB_GRID]
    return small[0] if small else (fits[-1][1] if fits else None)


@dataclass
class _SubBlocks:
    """The open tiles of a mask refined by ``s x s`` sub-blocks (``_sub_blocks``)."""

    s: int
    pq: int  # sub-blocks per tile side
    pk: int
    tiles: torch.Tensor  # (Tq, Tk, pq, pk) int8: the bounds' class of each sub-block
    some: torch.Tensor  # (Tq, Tk, pq, pk) bool: a position visible (some batch entry, head)
    every: torch.Tensor  # (Tq, Tk, pq, pk) bool: every position visible (all of them)
    where: torch.Tensor  # (n, 4) int64: evaluated (tile row, column, sub-row, sub-column)
    vals: torch.Tensor  # (Bm, Hm, n, s, s) bool: their visibility
    whole: bool = False  # the open sub-blocks left unevaluated: evaluate the open tiles whole

    @property
    def open_tiles(self) -> torch.Tensor:
        """``(Tq, Tk)`` bool: the tiles with a sub-block the bounds leave open."""
        return any_of((self.tiles == PARTIAL).flatten(2), dim=2)

    def classes(self) -> torch.Tensor:
        """Exact ``(Tq, Tk)`` tile classes."""
        t_some, t_every = any_of(self.some.flatten(2), dim=2), all_of(self.every.flatten(2), dim=2)
        out = torch.where(t_every, FULL, torch.where(t_some, PARTIAL, EMPTY))
        return out.to(torch.int8).cpu()

    def keep(self, bound: BoundMask, block_q: int, block_k: int, which: torch.Tensor) -> None:
        """Put together the visibility of tiles ``which`` ``(N, 2)`` (tile row, column) and
        keep it (``BoundMask.keep``), a few tiles at a time: each tile's decided
        sub-blocks spread to positions, its evaluated ones written over them."""
        g, s, pq, pk = bound.geo, self.s, self.pq, self.pk
        tq, tk = self.tiles.shape[:2]
        bm, hm = self.vals.shape[:2]
        which = which.to(g.device)
        slot = torch.full((tq, tk), -1, dtype=torch.int64, device=g.device)
        slot[which[:, 0], which[:, 1]] = torch.arange(which.shape[0], device=g.device)
        where = self.where
        of_open = slot[where[:, 0], where[:, 1]]  # (n,) each evaluated sub-block's place
        per_group = max(1, CLASSIFY_CHUNK // (block_q * block_k))
        for g0 in range(0, which.shape[0], per_group):
            group = which[g0 : g0 + per_group]  # (N', 2)
            full = self.tiles[group[:, 0], group[:, 1]] == FULL  # (N', pq, pk)
            words = _spread(full, s, bm * hm)  # (Bm·Hm, N', pq, s, pk, w) words of bytes
            mine = torch.nonzero((of_open >= g0) & (of_open < g0 + group.shape[0])).view(-1)
            if mine.numel():  # the evaluated sub-blocks written over their squares
                got = self.vals[:, :, mine].reshape(bm * hm, -1, s, s)  # (Bm·Hm, m, s, s)
                got = got.view(torch.uint8).view(words.dtype)  # (Bm·Hm, m, s, w)
                w = got.shape[-1]  # words per sub-block row
                n_, i_, j_ = (x[:, None] for x in (of_open[mine] - g0, *where[mine, 2:].T))
                r_ = torch.arange(s, device=g.device)  # (s,)
                at = ((n_ * pq + i_) * s + r_) * pk + j_  # (m, s) each sub-block row's place
                # whole rows of words (index_copy_: a third of an element-wise index_put's time)
                words.view(bm * hm, -1, w).index_copy_(1, at.view(-1), got.view(bm * hm, -1, w))
            vis = words.view(torch.uint8).view(torch.bool).view(bm, hm, -1, block_q, block_k)
            for n, (i, j) in enumerate(group.tolist()):
                q0, q1 = i * block_q, min((i + 1) * block_q, g.lq)
                k0, k1 = j * block_k, min((j + 1) * block_k, g.lk)
                bound.keep(q0, q1, k0, k1, vis[:, :, n, : q1 - q0, : k1 - k0], shared=True)


def _spread(full: torch.Tensor, s: int, copies: int) -> torch.Tensor:
    """Each value of ``full`` ``(N, pq, pk)`` bool over an ``s x s`` square of bytes, in
    ``copies`` copies: ``(copies, N, pq, s, pk, w)``, ``w`` words per square's row (eight
    bytes each when ``s`` is a multiple of 8, else one). A contiguous copy of words whose
    innermost rows are whole (a repeat of bools element by element is 4x slower)."""
    n, pq, pk = full.shape
    dt, w, ones = (torch.int64, s // 8, 0x0101010101010101) if s % 8 == 0 else (torch.uint8, s, 1)
    word = full.to(dt) * ones  # (N, pq, pk): the value in every byte
    row = word.view(n, pq, 1, pk, 1).expand(n, pq, 1, pk, w).reshape(n, pq, 1, pk, w)
    return row.expand(copies, n, pq, s, pk, w).contiguous()


def _sub_blocks(bound: BoundMask, block_q: int, block_k: int) -> _SubBlocks | None:
    """The tiles the bounds leave open, refined by ``s x s`` sub-blocks (``s`` from
    ``SUB_BLOCKS``): the bounds decide the sub-blocks they can (``bounded_classes(s,
    s)``), and only the undecided ones are evaluated (``sub_blocks``: all of them in one
    call, up to ``CLASSIFY_CHUNK`` positions). A packed-document mask's undecided
    sub-blocks lie along the diagonal and the documents' edges: a tenth of its partial
    tiles' positions. Nothing is evaluated (``whole``) where the bounds leave most
    sub-blocks of the open tiles undecided (evaluating those tiles whole is then the
    cheaper way); None where the mask cannot evaluate sub-blocks or no size fits."""
    g = bound.geo
    s = _sub_side(g, block_q, block_k)
    if s is None or not bound.sub_blockable:
        return None
    dev = g.device
    tq, tk = -(-g.lq // block_q), -(-g.lk // block_k)
    pq, pk = block_q // s, block_k // s
    fine = bound.bounded_classes(s, s).to(dev)  # (Fq, Fk)
    fq, fk = fine.shape
    grid = torch.full((tq * pq, tk * pk), EMPTY, dtype=torch.int8, device=dev)
    grid[:fq, :fk] = fine  # (Tq·pq, Tk·pk)
    past = torch.ones(tq * pq, tk * pk, dtype=torch.bool, device=dev)
    past[:fq, :fk] = False  # sub-blocks past the ends: nothing seen, nothing unseen
    tiles = grid.view(tq, pq, tk, pk).permute(0, 2, 1, 3)  # (Tq, Tk, pq, pk)
    open_t = tiles == PARTIAL  # the sub-blocks to evaluate
    some = tiles == FULL
    every = some | past.view(tq, pq, tk, pk).permute(0, 2, 1, 3)
    empty = torch.zeros(1, 1, 0, s, s, dtype=torch.bool, device=dev)
    where = torch.nonzero(open_t)  # (n, 4)
    info = _SubBlocks(s, pq, pk, tiles, some, every, where, empty)
    n_open = where.shape[0]
    if 2 * n_open > int(info.open_tiles.sum()) * pq * pk:
        info.whole = True
        return info
    fr, fc = where[:, 0] * pq + where[:, 2], where[:, 1] * pk + where[:, 3]  # (n,) each
    step = torch.arange(s, device=dev)  # (s,)
    # a ragged side's last sub-block repeats its last position: any and all are unchanged
    # by a repeat, and a tile's slice drops it
    rows = torch.clamp(fr[:, None] * s + step, max=g.lq - 1)  # (n, s) local
    keys = torch.clamp(fc[:, None] * s + step, max=g.lk - 1)  # (n, s) local
    parts = []
    per_call = max(1, CLASSIFY_CHUNK // (s * s))
    for c0 in range(0, n_open, per_call):
        vis = bound.sub_blocks(rows[c0 : c0 + per_call], keys[c0 : c0 + per_call])
        if vis is None:
            return None
        parts.append(vis)  # (Bm, Hm, n', s, s)
    if parts:
        bm = max(p.shape[0] for p in parts)
        hm = max(p.shape[1] for p in parts)
        info.vals = torch.cat([p.expand(bm, hm, *p.shape[2:]) for p in parts], dim=2)
        dims = (0, 1, 3, 4)  # all but the sub-block's
        some[where[:, 0], where[:, 1], where[:, 2], where[:, 3]] = any_of(info.vals, dims)
        every[where[:, 0], where[:, 1], where[:, 2], where[:, 3]] = all_of(info.vals, dims)
    return info


def _classify_by_sub_blocks(bound: BoundMask, block_q: int, block_k: int) -> torch.Tensor | None:
    """Exact tile classes from sub-blocks (``_sub_blocks``), the partial tiles'
    visibility kept for the loop; where the bounds leave most of the open tiles
    undecided, those tiles evaluated whole (``classify_by_rows``). None where sub-blocks
    do not apply."""
    info = _sub_blocks(bound, block_q, block_k)
    if info is None:
        return None
    open_t = info.open_tiles
    bound._count_bounded(int((~open_t).sum()))
    if info.whole:  # the bounds' classes; the open tiles evaluated whole
        known = info.classes()
        # the open tiles, and the partial ones whose sub-blocks the bounds decided (so
        # that their visibility is kept too)
        need = open_t.cpu() | (known == PARTIAL)
        out = classify_by_rows(bound, block_q, block_k, need=need)
        out[~need] = known[~need]
        return out
    out = info.classes()
    info.keep(bound, block_q, block_k, torch.nonzero(out == PARTIAL))
    return out


def _covers(vis: torch.Tensor, geo: Geometry) -> bool:
    """A tile is full only if it is full for every batch and head (broadcast dims count)."""
    return vis.shape[0] in (1, geo.batch) and vis.shape[1] in (1, geo.heads)


def _classes_from_dense(t: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    lq, lk = t.shape[-2], t.shape[-1]
    tq, tk = -(-lq // block_q), -(-lk // block_k)
    x = t.reshape(-1, lq, lk)  # (BH, Lq, Lk)
    pad = (0, tk * block_k - lk, 0, tq * block_q - lq)
    anyv = torch.nn.functional.pad(x, pad, value=False)
    allv = torch.nn.functional.pad(x, pad, value=True)
    anyv = any_of(anyv.view(-1, tq, block_q, tk, block_k), (0, 2, 4))  # (Tq, Tk)
    allv = all_of(allv.view(-1, tq, block_q, tk, block_k), (0, 2, 4))
    out = torch.full((tq, tk), PARTIAL, dtype=torch.int8)
    out[~anyv.cpu()] = EMPTY
    out[(anyv & allv).cpu()] = FULL
    return out


class Mask(ABC):
    """Base class: which (query, key) pairs may attend. Combine with ``&`` and ``|``."""

    @abstractmethod
    def bind(self, geo: Geometry) -> BoundMask:
        """Evaluate against one call's geometry."""
        ...

    def __and__(self, other: Mask | torch.Tensor) -> Mask:
        return And(self, _operand(other))

    def __rand__(self, other: Mask | torch.Tensor) -> Mask:
        return And(_operand(other), self)

    def __or__(self, other: Mask | torch.Tensor) -> Mask:
        return Or(self, _operand(other, "unite"))

    def __ror__(self, other: Mask | torch.Tensor) -> Mask:
        return Or(_operand(other, "unite"), self)

    def dense(
        self,
        lq: int,
        lk: int,
        *,
        batch: int = 1,
        heads: int = 1,
        causal_align: Align = "top_left",
        conventions: Conventions | None = None,
    ) -> torch.Tensor:
        """Bool visibility matrix ``(Lq, Lk)``, or ``(B, H, Lq, Lk)`` when it varies.

        ``conventions`` (when given) sets the causal alignment and how windows are read.
        """
        geo = self.geometry(
            lq, lk, batch=batch, heads=heads, causal_align=causal_align, conventions=conventions
        )
        d = self.bind(geo).dense()
        return d[0, 0] if d.shape[0] == 1 and d.shape[1] == 1 else d

    def tile_classes(
        self,
        lq: int,
        lk: int,
        block_q: int,
        block_k: int,
        *,
        batch: int = 1,
        heads: int = 1,
        causal_align: Align = "top_left",
        conventions: Conventions | None = None,
    ) -> torch.Tensor:
        """``(Tq, Tk)`` int8 tile classes (0 empty, 1 partial, 2 full) over all batches and heads."""
        check_size("block_q", block_q)
        check_size("block_k", block_k)
        geo = self.geometry(
            lq, lk, batch=batch, heads=heads, causal_align=causal_align, conventions=conventions
        )
        return self.bind(geo).tile_classes(block_q, block_k)

    def geometry(self, lq: int, lk: int, **kw: object) -> Geometry:
        """``Geometry.build(lq=lq, lk=lk, **kw)`` with the used lengths of this mask's
        ``Padding`` (if it holds one)."""
        check_size("lq", lq, low=0)
        check_size("lk", lk, low=0)
        for name in ("batch", "heads"):
            if name in kw:
                check_size(name, kw[name])
        if kw.get("conventions") is not None:  # a preset's name, as every entry point takes
            from .conventions import get_conventions

            kw["conventions"] = get_conventions(kw["conventions"])  # type: ignore[arg-type]
        pad = padding_of(self)
        if pad is not None:
            kw.update(pad.geometry_options())
        return Geometry.build(lq=lq, lk=lk, **kw)  # type: ignore[arg-type]


def _check_align(align: str | None) -> None:
    if align not in (None, "top_left", "bottom_right"):
        raise ValueError(f"align must be None, 'top_left' or 'bottom_right', got {align!r}")


@dataclass(frozen=True)
class Causal(Mask):
    """Key j visible to query i iff ``j <= c(i)`` (see the module docstring for ``c``)."""

    align: Align | None = None

    def __post_init__(self) -> None:
        _check_align(self.align)

    def bind(self, geo: Geometry) -> BoundMask:
        if _few_plain_rows(geo):
            return IntervalBound.of_rows(geo, None, geo.diagonal_rows(self.align))
        return _kept_bound(  # (Bg, Lq) each
            self, geo, lambda: IntervalBound(geo, geo.k_lo, geo.diagonal(self.align))
        )


@dataclass(frozen=True)
class SlidingWindow(Mask):
    """Keys ``c - left <= j <= c + right`` (inclusive); ``None`` or -1 = unbounded side."""

    left: int | None
    right: int | None = 0
    align: Align | None = None

    def __post_init__(self) -> None:
        _check_align(self.align)
        for name in ("left", "right"):
            val = getattr(self, name)
            if val is None:
                continue
            if isinstance(val, bool) or not isinstance(val, int) or not -1 <= val <= MAX_SIZE:
                raise ValueError(
                    f"SlidingWindow.{name} must be an integer in 0..{MAX_SIZE}, or -1/None for "
                    f"unbounded; got {val!r}"
                )

    def sides(self, geo: Geometry, *, clip_only: bool = False) -> tuple[int | None, int | None]:
        """``(left, right)`` as this geometry reads them (None = unbounded): as given, or
        rewritten as flash-attn 2 does (``geo.window_len`` set; ``clip_only``: its first
        step only, where its ``is_causal`` is decided)."""
        left = None if self.left in (None, -1) else self.left
        right = None if self.right in (None, -1) else self.right
        if geo.window_len is not None:
            rewrite = fa2_clip if clip_only else fa2_window
            return rewrite(left, right, geo.window_len)
        return left, right

    def bind(self, geo: Geometry) -> BoundMask:
        return _kept_bound(self, geo, lambda: self._bind(geo))

    def _bind(self, geo: Geometry) -> BoundMask:
        left, right = self.sides(geo)
        if _few_plain_rows(geo):
            rows = geo.diagonal_rows(self.align)  # c, one per row
            return IntervalBound.of_rows(
                geo,
                None if left is None else [c - left for c in rows],
                None if right is None else [c + right for c in rows],
            )
        c = geo.diagonal(self.align)  # (Bg, Lq)
        lo = geo.k_lo if left is None else c - left
        hi = geo.k_hi - 1 if right is None else c + right
        return IntervalBound(geo, lo, hi)


class KeyPadding(Mask):
    """Batch element ``b`` sees only its ``lengths[b]`` real keys (``lengths``: ``(B,)`` ints).

    ``side="right"`` (default): the real keys come first, ``j < lengths[b]``;
    ``side="left"``: they come last, ``j >= Lk - lengths[b]`` (left-padded
    batches, as generation pads them; ``Lk`` is the call's whole key length).
    A length of ``Lk`` or more means every key.
    """

    def __init__(
        self,
        lengths: torch.Tensor | list[int] | tuple[int, ...],
        *,
        side: Literal["right", "left"] = "right",
    ) -> None:
        t = torch.as_tensor(lengths)
        if t.ndim != 1 or t.numel() < 1 or t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(
                f"KeyPadding lengths must be a 1-D integer sequence of shape (B,), got {lengths!r}"
            )
        if bool((t < 0).any()):
            raise ValueError(f"KeyPadding lengths must be >= 0, got {t.tolist()}")
        if side not in ("right", "left"):
            raise ValueError(f"KeyPadding side must be 'right' or 'left', got {side!r}")
        self.lengths = t.to(torch.int64)
        self.side = side

    def __repr__(self) -> str:
        side = "" if self.side == "right" else ", side='left'"
        return f"KeyPadding({self.lengths.tolist()}{side})"

    def bind(self, geo: Geometry) -> BoundMask:
        if geo.varlen:
            raise ValueError(
                "KeyPadding cannot be combined with cu_seqlens (variable length already bounds keys)"
            )
        n = self.lengths.numel()
        if n not in (1, geo.batch):
            raise ValueError(
                f"KeyPadding lengths has {n} entries; it needs one per batch element ({geo.batch})"
            )
        lengths = self.lengths.to(geo.device)[:, None].expand(n, geo.lq)  # (B, Lq)
        if self.side == "left":
            lo = geo.lk_total - lengths  # (B, Lq) first real key
            return IntervalBound(geo, lo, geo.k_hi - 1)
        return IntervalBound(geo, geo.k_lo, lengths - 1)


class DenseMask(Mask):
    """An explicit bool mask broadcastable to ``(B, H, Lq, Lk)`` (True = attend)."""

    def __init__(self, mask: torch.Tensor) -> None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"DenseMask needs a bool tensor (True = attend), got {got}")
        if mask.ndim < 2 or mask.ndim > 4:
            raise ValueError(
                "DenseMask must have shape (Lq, Lk), (H, Lq, Lk) or (B, H, Lq, Lk), "
                f"got {tuple(mask.shape)}"
            )
        self.mask = mask

    def __repr__(self) -> str:
        return f"DenseMask(shape={tuple(self.mask.shape)})"

    def bind(self, geo: Geometry) -> BoundMask:
        t = self.mask
        while t.ndim < 4:
            t = t.unsqueeze(0)
        if t.is_meta:
            raise ValueError(
                "mask is a meta tensor (a shape without values); give its values, on the "
                "device of q, k, v or on the CPU"
            )
        want = (geo.batch, geo.heads, geo.lq_total, geo.lk_total)
        if not all(s in (1, w) for s, w in zip(t.shape, want)):
            raise ValueError(
                f"mask of shape {tuple(self.mask.shape)} does not broadcast to "
                f"(B, H, Lq, Lk) = {want}: each dim must be 1 or equal to that size"
            )
        # (B|1, H|1, Lq, Lk): a query or key dim of 1 broadcasts as a view (stride 0)
        return DenseBound(geo, t.to(geo.device).expand(*t.shape[:2], *want[2:]))


class _SequenceBounds(Mask):
    """Variable length: a row sees only the keys of its own sequence."""

    def bind(self, geo: Geometry) -> BoundMask:
        return IntervalBound(geo, geo.k_lo, geo.k_hi - 1)

    def __repr__(self) -> str:
        return "SequenceBounds()"


class Padding(Mask):
    """A padded batch with its real lengths: batch ``b`` uses its first ``q_lens[b]``
    queries and ``k_lens[b]`` keys (``(B,)`` ints each; None: all of them).

    Unlike ``KeyPadding``, the causal diagonal, windows and ALiBi are aligned to
    the real lengths (``c = i + k_lens[b] - q_lens[b]`` bottom-right), as
    flash-attn aligns each sequence of a padded batch; rows past ``q_lens[b]``
    see no key (O = 0, the conventions' LSE). The lengths belong to the whole
    call: give the mask alone or combined with ``&``. Interval mask: the
    native step reads it without mask tiles.
    """

    def __init__(
        self,
        q_lens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
        k_lens: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    ) -> None:
        if q_lens is None and k_lens is None:
            raise ValueError("Padding needs q_lens, k_lens or both (one length per batch element)")
        self.q_lens = None if q_lens is None else _lengths("q_lens", q_lens)
        self.k_lens = None if k_lens is None else _lengths("k_lens", k_lens)

    def __repr__(self) -> str:
        q = None if self.q_lens is None else self.q_lens.tolist()
        k = None if self.k_lens is None else self.k_lens.tolist()
        return f"Padding(q_lens={q}, k_lens={k})"

    def geometry_options(self) -> dict[str, object]:
        """What this padding sets in ``Geometry.build``: the used lengths, and the
        ``seqlen_k`` of flash-attn 2's window rewriting (the longest real key length,
        as ``max_seqlen_k`` of the unpadded call)."""
        opts: dict[str, object] = {"seqused_q": self.q_lens, "seqused_k": self.k_lens}
        if self.k_lens is not None:
            opts["window_len"] = int(self.k_lens.max())
        return opts

    def bind(self, geo: Geometry) -> BoundMask:
        if geo.seq_used != (_as_key(self.q_lens), _as_key(self.k_lens)):
            raise ValueError(
                f"{self!r} sets the sequence lengths of the whole call: give it as the mask "
                "or combined with & (not under | or inside another mask), and not together "
                "with seqused_q/seqused_k"
            )
        return IntervalBound(geo, geo.k_lo, geo.k_hi - 1)


def _lengths(name: str, x: torch.Tensor | list[int] | tuple[int, ...]) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.ndim != 1 or t.numel() < 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"Padding {name} must be a 1-D integer sequence of shape (B,), got {x!r}")
    if bool((t < 0).any()):
        raise ValueError(f"Padding {name} must be >= 0, got {t.tolist()}")
    return t.to(torch.int64).cpu()


def padding_of(mask: Mask | None) -> Padding | None:
    """The ``Padding`` of a mask given alone or in an ``&`` chain (None without one)."""
    if isinstance(mask, Padding):
        return mask
    if isinstance(mask, And):
        a, b = padding_of(mask.a), padding_of(mask.b)
        if a is not None and b is not None:
            raise ValueError(f"a mask can hold one Padding, got {a!r} and {b!r}")
        return a if a is not None else b
    return None


class And(Mask):
    """``a & b``: visible iff visible in both."""

    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"

    def bind(self, geo: Geometry) -> BoundMask:
        ba, bb = self.a.bind(geo), self.b.bind(geo)
        if isinstance(ba, IntervalBound) and isinstance(bb, IntervalBound):
            shared_a, shared_b = ba._shared_rows(), bb._shared_rows()
            if shared_a is not None and shared_b is not None:  # plain integers
                (lo_a, hi_a), (lo_b, hi_b) = shared_a, shared_b
                return IntervalBound.of_rows(
                    geo, list(map(max, lo_a, lo_b)), list(map(min, hi_a, hi_b))
                )
            lo = torch.maximum(ba.lo, bb.lo)
            hi = torch.minimum(ba.hi, bb.hi)
            return IntervalBound(geo, lo, hi)
        return AndBound(ba, bb)


class Or(Mask):
    """``a | b``: visible iff visible in either."""

    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"

    def bind(self, geo: Geometry) -> BoundMask:
        return OrBound(self.a.bind(geo), self.b.bind(geo))


def _operand(other: Mask | torch.Tensor, verb: str = "intersect") -> Mask:
    """The other side of ``mask & other`` (or ``|``): a ``Mask`` or a bool tensor, never None."""
    m = as_mask(other)
    if m is None:
        raise TypeError(f"cannot {verb} a mask with None; allowed: a Mask or a bool tensor")
    return m


def as_mask(mask: Mask | torch.Tensor | None) -> Mask | None:
    """Accept a ``Mask``, a bool tensor (True = attend) or ``None``."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        return DenseMask(mask)
    raise TypeError(
        "mask must be None, a flashledger Mask (Causal, SlidingWindow, KeyPadding, Padding, "
        f"DenseMask, MaskMod) or a bool tensor, got {type(mask).__name__}"
    )


def _demo() -> None:
    """Tile classes of a few masks, Lq = 12, Lk = 16 in 4 x 4 tiles (. empty, p partial, F full)."""
    from . import masks as m  # the package's module (run as a script, this one is __main__)
    from ._maskmod import MaskMod

    def two_documents(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):  # type: ignore[no-untyped-def]
        return (q < 8) == (kv < 8)  # a FlexAttention mask_mod: tokens 0..7, then 8..

    shown: tuple[m.Mask, ...] = (
        m.Causal(),
        m.Causal("bottom_right"),
        m.SlidingWindow(4, 0),
        m.KeyPadding([7]),
        m.Causal("bottom_right") & m.Padding([9], [7]),
        MaskMod(two_documents) | m.SlidingWindow(1, 1),
    )
    print("Tile classes, Lq = 12 queries by Lk = 16 keys in 4 x 4 tiles (rows: query tiles, "
          "columns: key tiles): F full (every pair visible), p partial, . empty (skipped)")  # fmt: skip
    for mask in shown:
        print(repr(mask))
        for row in mask.tile_classes(12, 16, 4, 4).tolist():
            print("  " + " ".join(".pF"[c] for c in row))


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("masks", _demo, command="account")
