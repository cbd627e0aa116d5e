"""The options every attention entry point takes, spelled once.

``reference_forward``, ``blocked_forward``, ``flash_attention``,
``split_kv_forward``, ``ring_attention`` (and their backwards) take these as
keyword-only ``**opts: Unpack[AttentionOptions]``: one typed definition instead
of the same keywords written out in every signature. ``build_problem`` checks
their values; ``check_options`` checks their names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

import torch

from ._mods import ScoreModFn
from .conventions import Conventions
from .masks import Mask

__all__ = ["OPTION_NAMES", "AttentionOptions", "check_options"]


class AttentionOptions(TypedDict, total=False):
    """Keyword options of every entry point (all optional; defaults in brackets).

    - ``mask``: a ``Mask`` (``Causal``, ``SlidingWindow``, ``KeyPadding``,
      ``Padding``, ``DenseMask``, ``MaskMod``, their ``&`` and ``|``) or a boolean
      tensor broadcastable to ``(B, H, Lq, Lk)``, True = visible [None: every key
      visible].
    - ``scale``: multiplies ``q kᵀ`` [``1/sqrt(d)``].
    - ``conventions``: a ``Conventions`` preset or its name [``SEED``].
    - ``dropout_p``, ``seed``: dropout probability in ``[0, 1)`` and the seed of
      its counter-based keep mask [0.0, 0].
    - ``dropout_mask``: an outside keep mask, bool broadcastable to
      ``(B, H, Lq, Lk)``, True = kept; replaces the counter-based one (kept
      entries scaled by ``1 / (1 - dropout_p)``) [None].
    - ``softcap``: ``softcap · tanh(s / softcap)`` on the scores [None].
    - ``alibi_slopes``: ``(H,)`` or ``(B, H)`` ALiBi slopes; with ``cu_seqlens``
      ``(H,)`` or one row per sequence ``(n, H)`` [None].
    - ``bias``: additive, broadcastable to ``(B, H, Lq, Lk)`` [None].
    - ``cu_seqlens_q``, ``cu_seqlens_k``: packed variable-length sequences,
      int ``(n + 1,)`` cumulative lengths, given together [None].
    - ``seqused_q``, ``seqused_k``: int ``(B,)`` (with ``cu_seqlens``: ``(n,)``),
      how many queries / keys of each batch element (sequence) are used; the
      causal diagonal, windows and ALiBi are aligned to them, as flash-attn
      aligns them; query rows past ``seqused_q`` see no key [None: all].
    - ``score_mod``: a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)
      -> score``, called once per tile on broadcast index tensors, after the
      scale, softcap, ALiBi and bias; the tensors it captures that require
      grad get gradients [None].
    """

    mask: Mask | torch.Tensor | None
    scale: float | None
    conventions: Conventions | str
    dropout_p: float
    seed: int
    dropout_mask: torch.Tensor | None
    softcap: float | None
    alibi_slopes: torch.Tensor | None
    bias: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    seqused_q: torch.Tensor | None
    seqused_k: torch.Tensor | None
    score_mod: ScoreModFn | None


OPTION_NAMES: frozenset[str] = frozenset(AttentionOptions.__annotations__)


def check_options(where: str, opts: Mapping[str, Any], *, refused: Iterable[str] = ()) -> None:
    """Unknown option names raise ``TypeError`` (naming the allowed ones); an option
    in ``refused`` given a value other than None raises ``ValueError``."""
    unknown = sorted(set(opts) - OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"{where}() got an unexpected keyword argument {unknown[0]!r}; "
            f"its attention options are {', '.join(sorted(OPTION_NAMES))}"
        )
    for name in refused:
        if opts.get(name) is not None:
            raise ValueError(f"{where}() does not take {name}")
