"""The attention function transformers calls, and the mask function that feeds it.

transformers calls ``attention(module, query, key, value, attention_mask,
**options)`` with query ``(B, Hq, Lq, d)``, key/value ``(B, Hkv, Lk, d)``
(fewer K/V heads under GQA, the KV cache's keys in generation) and wants
``(B, Lq, Hq, d_v)`` back with the attention weights (always None here: a
blocked kernel never forms them). Options it passes:

=================  ===========================================================
``scaling``        the score scale (default ``1/sqrt(d)``)
``dropout``        dropout on the probabilities (models pass 0 in eval mode)
``softcap``        ``s = c·tanh(s/c)`` (Gemma 2)
``s_aux``          one sink logit per query head (gpt-oss): it joins every
                   row's softmax denominator and carries no value, so
                   ``O = O_attn · sigmoid(LSE - sink)``, exact, with gradients
``sinks``          one sink logit per query row and head (Inkling 2's per-token
                   sinks, ``(B, Hq, Lq, 1)``): as ``s_aux``, row by row
``position_bias``  an additive score bias (its gradient included)
``is_causal``      used only when no mask came (default ``module.is_causal``)
``sliding_window`` likewise: the mask function already put the window in
=================  ===========================================================

Options that select keys for a kernel of another library (``indices``: the
top-k keys of DeepSeek's sparse attention; ``block_indices``: MiniMax's key
blocks) are refused: attending to every key instead would be silently wrong.

Masks arrive as the ``PlannedMask`` the registered mask function made (see
``_hf_masks``), or as a model's own 4-D boolean or additive float tensor
(read into a planned mask or an additive bias), or None: causal,
bottom-right aligned, when the module is causal (one query row against the
KV cache then sees every key), every key otherwise.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .._checks import broadcasts_to
from .._eager import opaque_to_compile
from ..autograd import _FlashAttention
from ..blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from ..conventions import SEED
from ..masks import Causal, Mask, SlidingWindow
from ..model import _sink_for
from ._hf_masks import PlannedMask, plan_dense, plan_mask

__all__ = ["attention_forward", "mask_function"]

_SEEDS = 1 << 62  # dropout seeds are drawn from torch's generator in [0, 2**62)


# options that pick keys for another library's kernel: ignoring them changes the result
_REFUSED = {
    "indices": "the top-k keys of each query row, DeepSeek sparse attention",
    "block_indices": "the key blocks of each query row, block-sparse attention",
}


def _sink_logits(
    s_aux: torch.Tensor | None, sinks: torch.Tensor | None, shape: tuple[int, ...]
) -> torch.Tensor:
    """The sink logit of every row, broadcastable to the LSE's ``(B, Hq, Lq)``: ``s_aux``
    ``(Hq,)`` per head, or ``sinks`` ``(B, Hq, Lq, 1)`` (or ``(B, Hq, Lq)``) per row."""
    if s_aux is not None:
        return s_aux.reshape(1, -1, 1)  # (1, Hq, 1)
    assert sinks is not None
    s = sinks[..., 0] if sinks.ndim == 4 and sinks.shape[-1] == 1 else sinks
    if not broadcasts_to(s.shape, shape):
        raise ValueError(
            "sinks must be (B, Hq, Lq, 1) or (B, Hq, Lq), one logit per query row and head, "
            f"got shape {tuple(sinks.shape)} for (B, Hq, Lq) = {shape}"
        )
    return s


def _additive_as_bool(mask: torch.Tensor) -> torch.Tensor | None:
    """An additive float mask that only says attend (0) or not (-inf or the dtype's most
    negative values) as a bool mask; None when it carries real biases."""
    low = torch.finfo(mask.dtype).min / 2
    blocked = mask <= low
    if bool(((mask == 0) | blocked).all()):
        return ~blocked
    return None


def _planned(
    attention_mask: Any,
    module: Any,
    is_causal: bool | None,
    sliding_window: int | None,
    b: int,
    lq: int,
    lk: int,
) -> tuple[PlannedMask | None, torch.Tensor | None]:
    """``(planned mask, additive bias)`` of one call."""
    if isinstance(attention_mask, PlannedMask):
        return attention_mask, None
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if lq == 1 and (not sliding_window or lk <= sliding_window):
            causal = False  # one query row (bottom-right) sees every key: no mask to classify
        if causal and sliding_window:
            window = SlidingWindow(int(sliding_window) - 1, 0, "bottom_right")
            return PlannedMask(window, b, lq, lk, lk, "window", padded=False), None
        if causal:
            return PlannedMask(Causal("bottom_right"), b, lq, lk, lk, "causal", padded=False), None
        return PlannedMask(None, b, lq, lk, lk, "full", padded=False), None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            "attention_mask must be None, a bool or float tensor (B, 1, Lq, Lk) or the mask "
            f"flashledger's mask function made, got {type(attention_mask).__name__}"
        )
    if attention_mask.dtype == torch.bool:
        return plan_dense(attention_mask), None
    if not attention_mask.is_floating_point():
        raise TypeError(
            f"attention_mask must be bool or floating point, got {attention_mask.dtype}"
        )
    vis = _additive_as_bool(attention_mask)
    if vis is not None:
        return plan_dense(vis), None
    return None, attention_mask


@opaque_to_compile  # as flash_attention
def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a transformers model: ``(O (B, Lq, Hq, d_v), None)``.

    query ``(B, Hq, Lq, d)``, key ``(B, Hkv, Lk, d)``, value ``(B, Hkv, Lk, d_v)``;
    options as transformers names them (module docstring). Runs
    ``flashledger``'s blocked forward and backward (the native step where it
    applies) and books both passes in any open ``ledger_of`` that holds
    ``module``.
    """
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            "query, key and value must be (B, H, L, d) tensors, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    for name, what in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"this model passes its attention {name!r} ({what}), which flashledger's "
                "attention does not read: it would attend to every key the mask allows instead; "
                "run the model with attn_implementation='eager' or 'sdpa'"
            )
    sinks_per_row = kwargs.get("sinks")
    if sinks_per_row is not None and s_aux is not None:
        raise ValueError("pass sink logits as s_aux (per head) or sinks (per row), not both")
    if kwargs.get("output_attentions", False):
        warnings.warn(
            "flashledger's attention never forms the attention weights: output_attentions=True "
            "returns none (set attn_implementation='eager' to get them)",
            stacklevel=2,
        )
    dev = query.device.type
    if torch.is_autocast_enabled(dev):  # as autocast casts SDPA's inputs (its lower-precision
        low = torch.get_autocast_dtype(dev)  # list): RoPE may have left q, k in float32 and v
        query, key, value = (  # in the autocast dtype; float64 it leaves as it is, as autocast
            x if x.dtype == torch.float64 else x.to(low) for x in (query, key, value)
        )
    b, _, lq, _ = query.shape
    lk = key.shape[2]
    planned, bias = _planned(attention_mask, module, is_causal, sliding_window, b, lq, lk)
    mask: Mask | torch.Tensor | None = None
    if planned is not None:
        if (planned.lq, planned.lk) != (lq, lk) or planned.batch not in (1, b):
            why = ""
            if sliding_window == 1 and planned.lk < lk:
                # transformers' sliding-window cache keeps its last `window - 1` keys as
                # keys[-window + 1:], which at a window of 1 is every key
                why = (
                    ": at sliding_window=1 transformers' sliding-window cache keeps every key "
                    "while its mask covers only the newest (eager and SDPA then broadcast "
                    "that mask over all of them); use a sliding window of 2 or more"
                )
            raise ValueError(
                f"the attention mask was made for batch {planned.batch}, Lq={planned.lq}, "
                f"Lk={planned.lk}; the call has batch {b}, Lq={lq}, Lk={lk}{why}"
            )
        mask = planned.mask
        if planned.keys < lk:  # a key tail that no row sees, left out with its bias columns
            key, value = key[:, :, : planned.keys], value[:, :, : planned.keys]
            if position_bias is not None and position_bias.shape[-1] == lk:
                position_bias = position_bias[..., : planned.keys]
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    seed = 0
    if dropout:
        seed = int(torch.randint(0, _SEEDS, (), dtype=torch.int64))
    opts: dict[str, Any] = dict(
        mask=mask,
        scale=scaling,
        conventions=SEED,  # differentiable LSE (the sink needs it); explicit alignments
        dropout_p=float(dropout),
        seed=seed,
        softcap=softcap,
        alibi_slopes=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        block_q=block_q,
        block_k=block_k,
        loop_order="fa2",
    )
    label = planned.label if planned is not None else "additive bias"
    sink = _sink_for(module, query, key, value, label)
    o, lse = _FlashAttention.apply(
        query, key, value, bias, opts, sink
    )  # (B, Hq, Lq, d_v), (B, Hq, Lq)
    if s_aux is not None or sinks_per_row is not None:
        sinks = _sink_logits(s_aux, sinks_per_row, tuple(lse.shape)).to(lse.dtype)
        o = o * torch.sigmoid(lse - sinks).unsqueeze(-1).to(o.dtype)  # (B, Hq, Lq, d_v)
    return o.transpose(1, 2), None  # (B, Lq, Hq, d_v)


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Any = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> PlannedMask:
    """The mask function transformers calls once per forward and mask pattern.

    Takes the arguments of transformers' ``sdpa_mask`` and returns the
    ``PlannedMask`` that ``attention_forward`` receives as ``attention_mask``.
    """
    if isinstance(attention_mask, PlannedMask):  # planned ahead (static-cache generation)
        return attention_mask
    return plan_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        use_vmap=use_vmap,
        device=device,
    )
