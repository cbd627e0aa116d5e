"""``create_block_mask``: torch's ``BlockMask`` from a ``mask_mod``, without the dense pass.

torch's ``create_block_mask`` (eager) evaluates the mask_mod under ``torch.vmap`` at
every (batch, head, query, key) position and reduces the ``(B, H, Lq, Lk)`` boolean
matrix to blocks: on CPU about 0.1 s at L = 4096 (its first call in a process 1.6 s
more), 2.2 s at L = 8192 with B = 2 and H = 4, and packed-document training makes a new
block mask every step. The same
``BlockMask`` comes from far less work, with the machinery ``MaskMod`` classifies
tiles by:

1. the mask_mod's span bounds (``MaskModBound.bounded_classes``, ``_spans``), once over
   all blocks: a block where it cannot hold for any batch entry and head is empty, one
   where it cannot fail is full (a ragged last block is then partial: Flex pads the
   lengths with False, ``padded_as_flex``);
2. the blocks the bounds leave open, evaluated with broadcast index tensors
   (``_mods.TileCaller``, ``torch.vmap`` for scalar-only code), one call per row of
   blocks (chunked to bound memory), their visible positions counted per batch
   entry and head: 0 empty, ``bq·bk`` full, partial otherwise.

The block grids are laid out exactly as torch lays out its own (the same ordering
of block indices, ``BlockMask.from_kv_blocks``), so the result is the ``BlockMask``
torch would have built, usable by ``fl.flex_attention`` and by torch's
``flex_attention`` alike.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch

from ._maskmod import MaskModBound, padded_as_flex
from ._mods import MaskModFn, TileCaller, index_grid
from .masks import FULL, PARTIAL, Geometry

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["create_block_mask"]

_CHUNK = 1 << 24
"""Positions (batch x heads x rows x keys) evaluated per mask_mod call, at most."""


def _positive_int(name: str, x: Any) -> int:
    """``x`` as a Python int >= 1: any integer type (a NumPy or 0-d integer tensor
    included, through ``__index__``, as torch's own create_block_mask takes them)."""
    try:
        n = operator.index(x) if not isinstance(x, bool) else None
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"create_block_mask: {name} must be an integer >= 1, got {x!r}")
    return n


def _default_device() -> torch.device:
    acc = getattr(torch, "accelerator", None)  # torch's own default (2.6 and later)
    dev = acc.current_accelerator() if acc is not None else None
    return torch.device(dev if dev is not None else "cpu")


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_blocks (B, H, T), indices (B, H, T, T'))`` int32 of a 0/1 block grid: the
    listed blocks first, in ascending order, then the others (torch's layout)."""
    dense = dense.to(torch.int32)
    num = dense.sum(dim=-1)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return num.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()


def _block_counts(
    caller: TileCaller,
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    block_q: int,
    block_k: int,
    open_: torch.Tensor,
) -> torch.Tensor:
    """Visible positions per block ``(B, H, Tq, Tk)`` int64 where ``open_`` ``(Tq, Tk)``
    is True (0 elsewhere): the mask_mod evaluated on those blocks' real positions (padding
    rows and keys past the lengths count as not visible, as Flex pads them)."""
    dev = open_.device
    tq, tk = open_.shape
    counts = torch.zeros(batch, heads, tq, tk, dtype=torch.int64, device=dev)
    kk = torch.arange(block_k, device=dev)  # (bk,)
    # batch entries x heads the mask_mod's result spans (all of them until a call shows
    # that it broadcasts over them)
    spread = 0
    for i in range(tq):
        cols = torch.nonzero(open_[i]).view(-1)  # (n,) open blocks of this block row
        r0, r1 = i * block_q, min((i + 1) * block_q, lq)
        rows = torch.arange(r0, r1, device=dev)  # (r,) the real rows
        c = 0
        while c < cols.numel():
            per_block = (spread or batch * heads) * block_q * block_k
            step = max(1, _CHUNK // per_block)  # blocks in this call
            js = cols[c : c + step]  # (n,)
            c += js.numel()
            keys = js[:, None] * block_k + kk  # (n, bk) positions, some past lk
            real = keys < lk  # (n, bk)
            flat = torch.where(real, keys, lk - 1).view(-1)  # (n·bk,) in range for the mod
            seen = caller(*index_grid(batch, heads, rows, flat))  # (Bm, Hm, r, n·bk)
            spread = max(spread, seen.shape[0] * seen.shape[1])  # (Bm, Hm)
            # every row and key counted, also where the result broadcasts over one of them
            seen = seen.expand(*seen.shape[:2], rows.numel(), flat.numel()) & real.view(1, 1, 1, -1)
            got = seen.sum(dim=2, dtype=torch.int64).view(*seen.shape[:2], -1, block_k).sum(-1)
            counts[:, :, i, js] = got.expand(batch, heads, -1)  # (B, H, n)
    return counts


def create_block_mask(
    mask_mod: MaskModFn,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """torch's ``create_block_mask`` (same arguments in the same order, same
    ``BlockMask``), built from the mask_mod's span bounds and an evaluation of the blocks
    they leave open only.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool``; ``B``, ``H`` the batch and heads it is
    made for (None: 1, the mask_mod called with b = h = 0); ``Q_LEN``, ``KV_LEN``;
    ``device`` [torch's default: the current accelerator, else CPU]; ``BLOCK_SIZE``
    an int or ``(q, kv)`` [128]; ``_compile`` [False] taken and ignored (there is
    nothing to compile: the mask is the same); ``separate_full_blocks`` [True] lists
    full blocks apart (False: every non-empty block is partial);
    ``compute_dq_write_order`` [False] must stay False (the write order of torch's GPU
    backward is not built), ``dq_kv_order`` [True] is then unused. A mask_mod that only
    runs on scalars is evaluated under ``torch.vmap``, as torch evaluates every one.
    """
    from torch.nn.attention.flex_attention import BlockMask

    for name, flag in (
        ("_compile", _compile),
        ("separate_full_blocks", separate_full_blocks),
        ("compute_dq_write_order", compute_dq_write_order),
        ("dq_kv_order", dq_kv_order),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"create_block_mask: {name} must be True or False, got {flag!r}")
    if compute_dq_write_order:
        raise ValueError(
            "create_block_mask: compute_dq_write_order=True is not built (it orders the "
            "dQ writes of torch's GPU backward); leave it False"
        )
    caller = TileCaller(mask_mod, "mask_mod")  # a TypeError names a non-callable
    batch = 1 if B is None else _positive_int("B", B)
    heads = 1 if H is None else _positive_int("H", H)
    lq, lk = _positive_int("Q_LEN", Q_LEN), _positive_int("KV_LEN", KV_LEN)
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2:
        raise ValueError(
            f"create_block_mask: BLOCK_SIZE must be an int or (q, kv), got {BLOCK_SIZE!r}"
        )
    block_q = _positive_int("BLOCK_SIZE (q)", sizes[0])
    block_k = _positive_int("BLOCK_SIZE (kv)", sizes[1])
    dev = _default_device() if device is None else torch.device(device)

    # 1. the span bounds, for every batch entry and head at once (MaskMod's classifier):
    #    the blocks they decide, a full one demoted where padding cuts it (Flex's rule)
    geo = Geometry.build(lq=lq, lk=lk, batch=batch, heads=heads, device=dev)
    bounded = MaskModBound(geo, caller).bounded_classes(block_q, block_k).to(dev)  # (Tq, Tk)
    open_ = bounded == PARTIAL
    decided = padded_as_flex(bounded, lq, lk, block_q, block_k)
    # 2. the open blocks, evaluated
    counts = _block_counts(caller, batch, heads, lq, lk, block_q, block_k, open_)
    area = block_q * block_k
    full = ((counts == area) & open_) | ((decided == FULL) & ~open_)  # (B, H, Tq, Tk)
    partial = ((counts > 0) & (counts < area) & open_) | ((decided == PARTIAL) & ~open_)
    full_num: torch.Tensor | None = None
    full_idx: torch.Tensor | None = None
    if separate_full_blocks:
        full_num, full_idx = _ordered(full)
    else:  # every non-empty block listed as partial
        partial |= full
    kv_num, kv_idx = _ordered(partial)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(block_q, block_k),
        mask_mod=mask_mod,
        seq_lengths=(lq, lk),
    )
