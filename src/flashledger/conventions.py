"""How real attention systems differ at the edges, as one selectable value.

Every forward and backward takes ``conventions=``. The mathematics never
changes; only the edges do (see CONVENTIONS.md of the project):

- ``masked_row_lse``: the LSE reported for a query row with no visible key.
  Its output and gradients are always 0 and it contributes nothing to dK/dV.
- ``causal_align``: what ``Causal()`` (and ``SlidingWindow`` without ``align``)
  means when ``Lq != Lk``: ``"top_left"`` (key j visible iff ``j <= i``) or
  ``"bottom_right"`` (iff ``j <= i + Lk - Lq``).
- ``dropout_keep``: the keep test for dropout: ``"bernoulli"`` (keep with
  probability exactly ``1 - p``) or ``"fa2_8bit"`` (flash-attn 2: keep iff a
  random byte ``<= floor((1 - p) * 255)``); kept entries are scaled by
  ``1 / (1 - p)`` in both.
- ``lse_differentiable``: whether a gradient flowing into the returned LSE is
  propagated (FlexAttention) or ignored (flash-attn).
- ``window_rewrite``: how ``SlidingWindow`` sides are read. ``"none"``: as
  given (-1/None unbounded, any size a bound). ``"flash_attn_2"``: as
  flash-attn 2's ``flash_api.cpp`` rewrites them before the kernel runs: a
  side ``>= seqlen_k`` becomes -1, then a -1 side opposite a bounded one
  becomes ``seqlen_k``; so with ``Lq > Lk + 1`` a "-1" right side still hides
  keys from the first rows.
- ``alibi_causal``: the ALiBi term under a causal mask. ``"distance"``:
  ``-slope·|c - j|`` everywhere. ``"key_index"``: flash-attn 2's kernel adds
  ``+slope·j`` when causal (j counted from the sequence's first key): the same
  probabilities and O, an LSE larger by ``slope·c``.
- ``softcap_with_dropout``: False refuses ``softcap`` together with dropout,
  as flash-attn 2 does.

>>> from flashledger.conventions import FLASH_ATTN_2
>>> FLASH_ATTN_2.masked_row_lse
inf
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FLASH_ATTN_2",
    "FLASH_ATTN_3",
    "FLEX_ATTENTION",
    "PRESETS",
    "SDPA_CPU",
    "SEED",
    "Conventions",
    "get_conventions",
]

CausalAlign = Literal["top_left", "bottom_right"]
DropoutKeep = Literal["bernoulli", "fa2_8bit"]
WindowRewrite = Literal["none", "flash_attn_2"]
AlibiCausal = Literal["distance", "key_index"]


@dataclass(frozen=True)
class Conventions:
    """The edge behaviour of one attention system (frozen, validated)."""

    name: str
    """Short name, e.g. ``"seed"`` or ``"flash_attn_2"``."""
    masked_row_lse: float = -math.inf
    """LSE reported for a fully-masked query row: ``-inf``, ``+inf`` or ``0.0``."""
    causal_align: CausalAlign = "top_left"
    """Alignment of ``Causal()`` / ``SlidingWindow`` when ``Lq != Lk``."""
    dropout_keep: DropoutKeep = "bernoulli"
    """Dropout keep test: exact Bernoulli(1 - p) or flash-attn 2's 8-bit threshold."""
    lse_differentiable: bool = False
    """Propagate a gradient flowing into the returned LSE (``dS += P * dLSE``)."""
    window_rewrite: WindowRewrite = "none"
    """``SlidingWindow`` sides as given, or rewritten against ``seqlen_k`` as flash-attn 2 does."""
    alibi_causal: AlibiCausal = "distance"
    """ALiBi under a causal mask: ``-slope·|c - j|``, or flash-attn 2's ``+slope·j`` (LSE shifted)."""
    softcap_with_dropout: bool = True
    """Accept ``softcap`` together with dropout (flash-attn 2 refuses the pair)."""
    description: str = ""
    """One line on where this convention comes from."""

    def __post_init__(self) -> None:
        if not (math.isinf(self.masked_row_lse) or self.masked_row_lse == 0.0):
            raise ValueError(
                f"Conventions.masked_row_lse must be -inf, +inf or 0.0, got {self.masked_row_lse!r}"
            )
        if self.causal_align not in ("top_left", "bottom_right"):
            raise ValueError(
                "Conventions.causal_align must be 'top_left' or 'bottom_right', "
                f"got {self.causal_align!r}"
            )
        if self.dropout_keep not in ("bernoulli", "fa2_8bit"):
            raise ValueError(
                "Conventions.dropout_keep must be 'bernoulli' or 'fa2_8bit', "
                f"got {self.dropout_keep!r}"
            )
        if self.window_rewrite not in ("none", "flash_attn_2"):
            raise ValueError(
                "Conventions.window_rewrite must be 'none' or 'flash_attn_2', "
                f"got {self.window_rewrite!r}"
            )
        if self.alibi_causal not in ("distance", "key_index"):
            raise ValueError(
                "Conventions.alibi_causal must be 'distance' or 'key_index', "
                f"got {self.alibi_causal!r}"
            )
        if not isinstance(self.softcap_with_dropout, bool):
            raise ValueError(
                "Conventions.softcap_with_dropout must be True or False, "
                f"got {self.softcap_with_dropout!r}"
            )


SEED = Conventions(
    name="seed",
    masked_row_lse=-math.inf,
    causal_align="top_left",
    lse_differentiable=True,
    description="the seed page: fully-masked row -> O = 0, grads 0, LSE -inf (handled separately)",
)
FLASH_ATTN_2 = Conventions(
    name="flash_attn_2",
    masked_row_lse=math.inf,
    causal_align="bottom_right",
    dropout_keep="fa2_8bit",
    window_rewrite="flash_attn_2",
    alibi_causal="key_index",
    softcap_with_dropout=False,
    description="flash-attn 2.1+: LSE +inf on fully-masked rows, bottom-right causal, 8-bit "
    "dropout, window sides rewritten against seqlen_k, +slope·j ALiBi when causal, "
    "no softcap with dropout",
)
FLASH_ATTN_3 = Conventions(
    name="flash_attn_3",
    masked_row_lse=-math.inf,
    causal_align="bottom_right",
    softcap_with_dropout=False,
    description="flash-attn 3 (Hopper): LSE -inf on fully-masked rows, bottom-right causal, "
    "no softcap with dropout (its interface has no dropout)",
)
FLEX_ATTENTION = Conventions(
    name="flex_attention",
    masked_row_lse=-math.inf,
    causal_align="top_left",
    lse_differentiable=True,
    description="FlexAttention: LSE -inf on fully-masked rows, differentiable LSE",
)
SDPA_CPU = Conventions(
    name="sdpa_cpu",
    masked_row_lse=0.0,
    causal_align="top_left",
    description="PyTorch SDPA CPU flash kernel: LSE 0 on fully-masked rows, is_causal top-left",
)

PRESETS: dict[str, Conventions] = {
    c.name: c for c in (SEED, FLASH_ATTN_2, FLASH_ATTN_3, FLEX_ATTENTION, SDPA_CPU)
}


def get_conventions(value: Conventions | str | None) -> Conventions:
    """Resolve a preset name (``"seed"``, ``"flash_attn_2"``, ...) or pass a value through."""
    if value is None:
        return SEED
    if isinstance(value, Conventions):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_")
        if key in PRESETS:
            return PRESETS[key]
        raise ValueError(
            f"conventions: unknown preset {value!r}; allowed: {', '.join(sorted(PRESETS))}"
        )
    raise TypeError(
        f"conventions must be a Conventions value or a preset name, got {type(value).__name__}"
    )


def preset_arg(text: str) -> str:
    """An argparse ``type``: a preset's name as ``get_conventions`` reads it (``FLASH_ATTN_2``,
    ``flash-attn-2``), returned as its canonical name."""
    import argparse

    try:
        return get_conventions(text).name
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown preset {text!r}; allowed: {', '.join(sorted(PRESETS))}"
        ) from None


def _demo() -> None:
    """Every preset's edge conventions, one line each."""
    for c in PRESETS.values():
        print(
            f"{c.name:<15} causal {c.causal_align:<12} masked-row LSE {c.masked_row_lse:<5g} "
            f"dropout {c.dropout_keep:<9} LSE grad {'yes' if c.lse_differentiable else 'no':<4} "
            f"windows {c.window_rewrite:<13} causal ALiBi {c.alibi_causal:<9} "
            f"softcap+dropout {'yes' if c.softcap_with_dropout else 'no'}"
        )
        print(f"{'':<15} {c.description}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("conventions", _demo)
