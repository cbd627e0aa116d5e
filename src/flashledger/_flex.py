"""``flex_attention``: PyTorch's FlexAttention call, computed by the blocked loop.

Same signature and semantics as ``torch.nn.attention.flex_attention.
flex_attention`` (query ``(B, Hq, L, E)``, key ``(B, Hkv, S, E)``, value
``(B, Hkv, S, Ev)``; ``score_mod``; a ``BlockMask`` from ``create_block_mask``;
``scale``; ``enable_gqa``; ``return_lse``; ``kernel_options``; ``return_aux``),
with the FLEX_ATTENTION conventions: the LSE is natural-log and
differentiable, a fully-masked row gives O = 0 and LSE -inf. What flashledger
adds on CPU: a backward (torch 2.13 has none there), float64 throughout, and
gradients for every tensor the score_mod captures that requires grad.

The block mask is used as Flex's kernels use it (``_maskmod.BlockMaskBound``):
its blocks give the tile classes, its ``mask_mod`` decides inside partial
blocks. flashledger's tiles (``block_q x block_k``, by default those of
``flash_attention``) need not be the block mask's (default 128 x 128): a tile
is classified from the blocks it covers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ._checks import check_float_tensor
from ._eager import opaque_to_compile
from ._maskmod import MaskMod, is_block_mask
from ._mods import ScoreModFn
from .autograd import _attend
from .conventions import FLEX_ATTENTION

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["flex_attention"]


@opaque_to_compile  # as flash_attention
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreModFn | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Mapping[str, Any] | None = None,
    *,
    return_aux: Any = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """FlexAttention, exact and differentiable on CPU (torch's signature).

    query ``(B, Hq, L, E)``, key ``(B|1, Hkv, S, E)``, value ``(B|1, Hkv, S, Ev)``
    (``Hkv < Hq`` needs ``enable_gqa=True``; a key/value batch of 1 is broadcast
    when the block mask has the query's batch); ``score_mod(score, b, h, q_idx,
    kv_idx)`` (int32 indices, as Flex's compiled kernels pass them); ``block_mask`` a
    ``BlockMask`` made for ``(L, S)``; ``scale``
    [``1/sqrt(E)``]. Returns ``o`` ``(B, Hq, L, Ev)`` in the query's dtype, and
    with ``return_lse=True`` also the LSE ``(B, Hq, L)`` (float64 for float64
    inputs, else float32). ``return_aux=AuxRequest(lse=..., max_scores=...)``
    returns ``(o, AuxOutput(lse, max_scores))`` instead, each requested field
    ``(B, Hq, L)`` in that dtype (the other None): ``max_scores`` is each row's
    largest score after the score_mod and the mask (-inf for a row that sees no
    key), the running max the loop ended with, not differentiable, as Flex's.
    ``kernel_options``: the Triton kernels' settings, accepted and without effect
    on CPU (as in torch's CPU path). ``block_q``, ``block_k``: flashledger's
    tiles [None: the native step's, as for ``flash_attention``].
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_float_tensor(name, x)
        if x.ndim != 4:
            raise ValueError(
                f"flex_attention: {name} must be 4-D (B, H, L, E) as in FlexAttention, "
                f"got shape {tuple(x.shape)}"
            )
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be True or False, got {enable_gqa!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    want_lse, want_max = _aux_request(return_aux, return_lse)
    _check_kernel_options(kernel_options)
    hq, hkv = query.shape[1], key.shape[1]
    if value.shape[1] != hkv:  # before the GQA hint, which would not help
        raise ValueError(
            f"flex_attention: key has {hkv} heads and value {value.shape[1]}; they must have "
            "the same number"
        )
    if not enable_gqa and hq != hkv:
        raise ValueError(
            f"flex_attention: query has {hq} heads and key/value {hkv}; pass enable_gqa=True "
            "for grouped-query attention"
        )
    mask = None
    if block_mask is not None:
        if not is_block_mask(block_mask):
            raise TypeError(
                "block_mask must be a torch.nn.attention.flex_attention.BlockMask (from "
                f"create_block_mask) or None, got {type(block_mask).__name__}"
            )
        mask = MaskMod(block_mask)
    if query.shape[0] != key.shape[0]:
        bm_batch = None if block_mask is None else block_mask.kv_num_blocks.shape[0]
        if key.shape[0] != 1 or bm_batch != query.shape[0]:
            raise ValueError(
                f"flex_attention: query batch {query.shape[0]} and key/value batch "
                f"{key.shape[0]} differ; a key/value batch of 1 is broadcast when the block "
                "mask has the query's batch"
            )
        key = key.expand(query.shape[0], *key.shape[1:])
        value = value.expand(query.shape[0], *value.shape[1:])
    opts: dict[str, Any] = {"conventions": FLEX_ATTENTION, "scale": scale}
    if mask is not None:
        opts["mask"] = mask
    if score_mod is not None:
        opts["score_mod"] = score_mod
    row_max: list[torch.Tensor] | None = [] if want_max else None
    o, lse = _attend(query, key, value, block_q, block_k, "fa2", opts, row_max=row_max)
    if return_aux is not None:
        return o, AuxOutput(
            lse=lse if want_lse else None, max_scores=row_max[0] if row_max else None
        )
    return (o, lse) if return_lse else o


try:  # torch's own (2.9 and later), so that code written for Flex reads the same fields
    from torch.nn.attention.flex_attention import AuxOutput
except ImportError:  # pragma: no cover - older torch

    class AuxOutput(NamedTuple):  # type: ignore[no-redef]
        """Flex's auxiliary outputs: the requested fields, None for the others."""

        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None


def _aux_request(return_aux: Any, return_lse: bool) -> tuple[bool, bool]:
    """``(lse, max_scores)`` wanted, from ``return_aux`` (an ``AuxRequest`` or None)."""
    if return_aux is None:
        return return_lse, False
    if return_lse:
        raise ValueError(
            "flex_attention: pass return_lse=True or return_aux, not both (return_lse is "
            "Flex's older spelling of return_aux=AuxRequest(lse=True))"
        )
    lse, top = getattr(return_aux, "lse", None), getattr(return_aux, "max_scores", None)
    if not (isinstance(lse, bool) and isinstance(top, bool)):
        raise TypeError(
            "return_aux must be an AuxRequest(lse=..., max_scores=...) with True/False "
            f"fields (torch.nn.attention.flex_attention.AuxRequest) or None, got {return_aux!r}"
        )
    return lse, top


_OUTPUT_KEYS = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX")


def _check_kernel_options(options: Any) -> None:
    """``kernel_options`` must be a mapping of option names (as Flex's ``FlexKernelOptions``);
    the outputs are asked for through ``return_aux``, as in Flex."""
    if options is None:
        return
    if not isinstance(options, Mapping) or not all(isinstance(n, str) for n in options):
        raise TypeError(
            "kernel_options must be a dict of Flex kernel option names to values "
            f"(FlexKernelOptions) or None, got {options!r}"
        )
    taken = [n for n in _OUTPUT_KEYS if n in options]
    if taken:
        raise ValueError(
            f"kernel_options may not set {', '.join(taken)}: ask for the LSE and the row "
            "maxima with return_aux=AuxRequest(lse=True, max_scores=True)"
        )
