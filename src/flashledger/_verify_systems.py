"""Live adapters for the attention systems of the installed PyTorch (CPU).

Each adapter follows the ``fn(q, k, v, case) -> O | (O, LSE)`` contract of
``assert_attention_close``, so the real systems are judged by exactly the rule
a user's kernel is judged by. An adapter raises ``NotImplementedError`` with
the system's own message when the system cannot do a case on CPU; the report
then marks the case "unsupported" instead of skipping it.

| adapter | PyTorch entry point | returns |
|---|---|---|
| ``sdpa_math`` | ``scaled_dot_product_attention`` under ``SDPBackend.MATH`` | O |
| ``sdpa_flash`` | the same under ``SDPBackend.FLASH_ATTENTION`` | O |
| ``cpu_flash_op`` | ``aten._scaled_dot_product_flash_attention_for_cpu`` | O, LSE |
| ``sdpa_is_causal`` | ``scaled_dot_product_attention(is_causal=True)`` | O |
| ``sdpa_causal_upper_left`` / ``_lower_right`` | ``torch.nn.attention.bias`` | O |
| ``flex_forward`` | ``flex_attention`` (eager) + ``create_block_mask`` | O, LSE |
| ``flex_backward`` | the same with inputs that require grad | O |
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ._maskmod import block_grid, padded_as_flex
from ._verify_cases import Case
from .masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Causal,
    DenseMask,
    KeyPadding,
    Mask,
    SlidingWindow,
)

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "cpu_flash_op",
    "flex_backward",
    "flex_block_mask",
    "flex_forward",
    "flex_tile_classes",
    "ledger_tile_classes_for_flex",
    "sdpa_causal_lower_right",
    "sdpa_causal_upper_left",
    "sdpa_flash",
    "sdpa_is_causal",
    "sdpa_math",
]

Tensor = torch.Tensor


def _sdpa(q: Tensor, k: Tensor, v: Tensor, case: Case, backend: object, **kw: object) -> Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):  # type: ignore[arg-type]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            scale=case.scale,
            enable_gqa=case.shape.gqa,
            **kw,  # type: ignore[arg-type]
        )


def _unequal_head_dims(case: Case, exc: RuntimeError) -> NotImplementedError:
    s = case.shape
    return NotImplementedError(
        f"the CPU flash kernel needs one head dim for Q, K and V (here d={s.head_dim}, "
        f"d_v={s.head_dim_v}); torch says: {' '.join(str(exc).split())}"
    )


def sdpa_math(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    """SDPA's math backend with the case's dense bool mask."""
    from torch.nn.attention import SDPBackend

    return _sdpa(q, k, v, case, SDPBackend.MATH, attn_mask=case.dense_mask())


def sdpa_flash(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    """SDPA restricted to the CPU flash kernel, with the case's dense bool mask."""
    from torch.nn.attention import SDPBackend

    try:
        return _sdpa(q, k, v, case, SDPBackend.FLASH_ATTENTION, attn_mask=case.dense_mask())
    except RuntimeError as exc:
        if case.shape.head_dim_v != case.shape.head_dim:
            raise _unequal_head_dims(case, exc) from exc
        raise


def _additive_mask(case: Case, dtype: torch.dtype) -> Tensor | None:
    dense = case.dense_mask()  # (B, Hq, Lq, Lk)
    if dense is None:
        return None
    zeros = torch.zeros(dense.shape, dtype=dtype)
    return zeros.masked_fill(~dense, -math.inf)  # (B, Hq, Lq, Lk)


def cpu_flash_op(q: Tensor, k: Tensor, v: Tensor, case: Case) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: O and its LSE.

    A top-left causal mask goes in as ``is_causal=True``; every other mask as
    an additive float mask (0 / -inf) in the inputs' dtype, the only mask
    type this op takes.
    """
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    is_causal = isinstance(case.mask, Causal) and case.align == "top_left"
    mask = None if is_causal else _additive_mask(case, q.dtype)
    try:
        o, lse = op(q, k, v, 0.0, is_causal, attn_mask=mask, scale=case.scale)
    except RuntimeError as exc:
        if case.shape.head_dim_v != case.shape.head_dim:
            raise _unequal_head_dims(case, exc) from exc
        raise
    return o, lse


def sdpa_is_causal(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
    """SDPA with ``is_causal=True`` (only for top-left causal cases)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=case.scale, enable_gqa=case.shape.gqa
    )


def _bias_adapter(which: str) -> Callable[[Tensor, Tensor, Tensor, Case], Tensor]:
    def fn(q: Tensor, k: Tensor, v: Tensor, case: Case) -> Tensor:
        from torch.nn.attention import bias

        make = bias.causal_upper_left if which == "upper_left" else bias.causal_lower_right
        attn_bias = make(case.shape.len_q, case.shape.len_k)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_bias, scale=case.scale, enable_gqa=case.shape.gqa
        )

    fn.__name__ = f"sdpa_causal_{which}"
    fn.__doc__ = f"SDPA with ``torch.nn.attention.bias.causal_{which}(Lq, Lk)``."
    return fn


sdpa_causal_upper_left = _bias_adapter("upper_left")
sdpa_causal_lower_right = _bias_adapter("lower_right")


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _mask_mod(mask: Mask, case: Case) -> MaskMod:
    """A FlexAttention ``mask_mod`` written in Flex's own terms for flashledger's masks."""
    lq, lk = case.shape.len_q, case.shape.len_k
    if isinstance(mask, Causal | SlidingWindow):
        shift = lk - lq if case.align == "bottom_right" else 0
        if isinstance(mask, Causal):

            def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return kv_idx <= q_idx + shift

            return causal
        left = math.inf if mask.left in (None, -1) else mask.left
        right = math.inf if mask.right in (None, -1) else mask.right

        def window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            c = q_idx + shift
            return (kv_idx >= c - left) & (kv_idx <= c + right)

        return window
    if isinstance(mask, KeyPadding):
        lengths = mask.lengths.expand(case.shape.batch)  # (B,)

        def padding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx < lengths[b]

        return padding
    dense = case.dense_mask()
    assert dense is not None

    def lookup(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return dense[b, h, q_idx, kv_idx]

    return lookup


def flex_block_mask(case: Case, *, block_size: int | tuple[int, int] = 128) -> BlockMask | None:
    """``create_block_mask`` for the case's mask (``None`` without a mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if case.mask is None:
        return None
    s = case.shape
    heads = s.heads_q if isinstance(case.mask, DenseMask) else None
    return create_block_mask(
        _mask_mod(case.mask, case),
        s.batch,
        heads,
        s.len_q,
        s.len_k,
        device="cpu",
        BLOCK_SIZE=block_size,
    )


def _flex(q: Tensor, k: Tensor, v: Tensor, case: Case) -> tuple[Tensor, Tensor]:
    from torch.nn.attention import flex_attention as flex

    opts: dict[str, Any] = {
        "block_mask": flex_block_mask(case),
        "scale": case.scale,
        "enable_gqa": case.shape.gqa,
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        if hasattr(flex, "AuxRequest"):
            o, aux = flex.flex_attention(q, k, v, **opts, return_aux=flex.AuxRequest(lse=True))
            return o, aux.lse
        return flex.flex_attention(q, k, v, **opts, return_lse=True)  # torch < 2.9


def flex_forward(q: Tensor, k: Tensor, v: Tensor, case: Case) -> tuple[Tensor, Tensor]:
    """FlexAttention's eager forward (inputs detached: forward only): O and LSE."""
    return _flex(q.detach(), k.detach(), v.detach(), case)


def flex_backward(q: Tensor, k: Tensor, v: Tensor, case: Case) -> tuple[Tensor, Tensor]:
    """FlexAttention with inputs that require grad (its backward, where it has one)."""
    return _flex(q, k, v, case)


def flex_tile_classes(case: Case, block_q: int, block_k: int) -> Tensor:
    """The tiles of the case's ``BlockMask``, reduced over batch and heads: ``(Tq, Tk)`` int8.

    ``EMPTY`` where the tile is skipped for every (batch, head), ``FULL`` where
    it is full for every one, ``PARTIAL`` otherwise.
    """
    bm = flex_block_mask(case, block_size=(block_q, block_k))
    if bm is None:
        raise ValueError(f"case {case.name} has no mask, so no BlockMask to classify")
    return block_mask_classes(bm)


def block_mask_classes(bm: Any) -> Tensor:
    """A ``BlockMask``'s tiles reduced over batch and heads: ``(Tq, Tk)`` int8, ``EMPTY``
    where every (batch, head) skips the tile, ``FULL`` where every one has it full."""
    grid = block_grid(bm)  # (B, H, Tq, Tk)
    out = torch.full(grid.shape[2:], PARTIAL, dtype=torch.int8)
    out[(grid == EMPTY).all(dim=1).all(dim=0)] = EMPTY
    out[(grid == FULL).all(dim=1).all(dim=0)] = FULL
    return out


def ledger_tile_classes_for_flex(case: Case, block_q: int, block_k: int) -> Tensor:
    """flashledger's tile classes of the case's mask, in FlexAttention's terms: ``(Tq, Tk)`` int8.

    FlexAttention pads the mask with False to whole tiles, so a tile on a
    ragged edge (past ``Lq`` or ``Lk``) is never full; flashledger classifies
    only the real positions and may call such a tile full. This demotes those
    tiles to partial; everything else must agree as is.
    """
    s = case.shape
    if case.mask is None:
        raise ValueError(f"case {case.name} has no mask, so no tiles to classify")
    classes = case.mask.tile_classes(
        s.len_q,
        s.len_k,
        block_q,
        block_k,
        batch=s.batch,
        heads=s.heads_q,
        conventions=case.conventions,
    )  # (Tq, Tk)
    return padded_as_flex(classes, s.len_q, s.len_k, block_q, block_k)
