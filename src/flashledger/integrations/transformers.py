"""flashledger as an attention backend of Hugging Face transformers models.

    import flashledger as fl
    from flashledger.integrations.transformers import register

    name = register()                      # "fl_ledger"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    # or: model.set_attn_implementation(name)

``register(name)`` registers two functions under one name: the attention
function (``AttentionInterface``) and the mask function
(``AttentionMaskInterface``). Both are needed: without a mask function of its
own, an implementation receives no mask at all and a padded batch would
silently attend to its padding. The mask function reads transformers' mask
(its pattern, the padding, the cache positions) into flashledger's
structured masks, so the native tile step runs with closed-form tile
classes:

- causal, with or without a KV cache: ``Causal("bottom_right")`` (one query
  row in generation sees every cached key);
- sliding windows (Mistral, Qwen2, Gemma 2, gpt-oss):
  ``SlidingWindow(W - 1, 0, "bottom_right")``;
- no pattern (BERT): no mask;
- padding, left or right: ``KeyPadding`` (intersected with the above);
- other patterns whose rows are intervals (packed sequences, chunks): the
  native step's interval mask; anything else: ``DenseMask``.

The attention function keeps K/V heads as they are (GQA without repeating
K/V), honours ``scaling``, ``softcap`` (Gemma 2), ``dropout`` in training
(flashledger's counter-based dropout, seeded from torch's generator), sinks
(``s_aux``, gpt-oss) exactly, and books every call in ``fl.ledger_of(model)``.
Attention weights are never formed: with ``output_attentions=True`` the model
returns none (an empty tuple, as with SDPA) and a warning says so.

``random_model(arch, ...)`` builds a small random-initialised model of the
configurations transformers ships (``ARCHS``), for tests and demos.

Needs transformers >= 5.4 (``pip install flashledger[transformers]``). Run
``python -m flashledger.integrations.transformers`` for a small demo.
"""

from __future__ import annotations

try:
    import transformers as _tf
except ImportError:
    raise ImportError(
        "flashledger.integrations.transformers needs transformers: "
        "pip install flashledger[transformers]"
    ) from None

import functools

from .._checks import check_size
from ..blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from ._hf_attention import attention_forward, mask_function
from ._hf_masks import PlannedMask, RowIntervals
from ._hf_models import ARCHS, random_model

__all__ = [
    "ARCHS",
    "DEFAULT_NAME",
    "PlannedMask",
    "RowIntervals",
    "attention_forward",
    "mask_function",
    "random_model",
    "register",
]

DEFAULT_NAME = "fl_ledger"
# transformers reads meaning into these parts of an implementation's name
_RESERVED = ("flash", "sdpa", "flex", "eager", "paged", "|", "/", ":")


def register(
    name: str = DEFAULT_NAME, *, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K
) -> str:
    """Register flashledger's attention and mask functions; returns ``name``.

    Pass the name as ``attn_implementation=`` when loading a model, or to
    ``model.set_attn_implementation``. ``name`` must not contain ``flash``
    (transformers would look for a Hub kernel), ``sdpa``, ``flex``,
    ``eager`` or ``paged`` (it would apply those backends' checks), nor
    ``|``, ``/`` or ``:``. ``block_q``/``block_k``: the tile sizes (default
    512 x 512). Registering a name again replaces its functions.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    bad = [part for part in _RESERVED if part in name.lower()]
    if bad:
        raise ValueError(
            f"name {name!r} contains {bad[0]!r}, which transformers reads as another backend "
            f"(a name with 'flash' is looked up as a Hub kernel); choose another, e.g. {DEFAULT_NAME!r}"
        )
    check_size("block_q", block_q)
    check_size("block_k", block_k)
    from transformers import AttentionInterface, AttentionMaskInterface

    attend = functools.partial(attention_forward, block_q=block_q, block_k=block_k)
    functools.update_wrapper(attend, attention_forward)
    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, mask_function)
    return name


def _demo() -> None:
    """A tiny Llama on a left-padded batch: logits against SDPA, and the attention ledger."""
    import torch

    from ..model import ledger_of

    name = register()
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :9] = 0  # the first sequence is left-padded by 9 tokens
    sdpa = random_model("llama", dtype=torch.float64)
    ours = random_model("llama", dtype=torch.float64, attn_implementation=name)
    with torch.no_grad(), ledger_of(ours) as book:
        got = ours(input_ids=ids, attention_mask=att).logits
        want = sdpa(input_ids=ids, attention_mask=att).logits
    real = att.bool()
    print(f"transformers {_tf.__version__}, attn_implementation={name!r}")
    print(f"max |logits - SDPA's| on real tokens = {float((got - want)[real].abs().max()):.3g}")
    print(book)


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("integrations.transformers", _demo, command="model")
