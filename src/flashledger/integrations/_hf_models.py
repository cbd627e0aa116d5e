"""Small random-initialised models from the configurations transformers ships.

No download: each model is built from its configuration class with sizes
given here, weights drawn from a seeded generator. Used by the tests, the
``flashledger model`` command, the benchmark and the examples.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ARCHS", "random_model"]

ARCHS = ("llama", "mistral", "qwen2", "gemma2", "bert", "gpt_oss")
"""Architectures ``random_model`` builds: decoders with causal attention, GQA and
RoPE; mistral (every layer), qwen2 (the upper layers) and gemma2, gpt_oss
(alternate layers) with sliding windows; gemma2 with logit softcaps; gpt_oss with
attention sinks; bert an encoder (bidirectional, with padding)."""


def _check(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def random_model(
    arch: str,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    vocab: int = 128,
    max_positions: int = 512,
    sliding_window: int | None = None,
    dropout: float = 0.0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> Any:
    """A random-initialised ``*ForCausalLM`` (``BertForMaskedLM`` for bert) in eval mode.

    ``hidden`` is split over ``heads`` (head dim ``hidden // heads``);
    ``kv_heads`` defaults to ``heads // 2`` for decoders (GQA) and must equal
    ``heads`` for bert; ``sliding_window`` (default: the architecture's own)
    applies to mistral, qwen2 (layers from the middle up), gemma2 and gpt_oss
    (every other layer); ``dropout`` is the attention dropout used in
    training mode. The same ``seed`` gives the same weights.
    """
    import transformers as tf

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
        _check(name, value)
    _check("vocab", vocab, 2)
    _check("max_positions", max_positions)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if arch == "bert":
        kv_heads = heads if kv_heads is None else kv_heads
        if kv_heads != heads:
            raise ValueError(f"bert has as many key/value heads as heads ({heads}), got {kv_heads}")
    kv = max(heads // 2, 1) if kv_heads is None else _check("kv_heads", kv_heads)
    if heads % kv:
        raise ValueError(f"kv_heads ({kv}) must divide heads ({heads})")
    if sliding_window is not None:
        _check("sliding_window", sliding_window)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            "dtype must be a floating torch.dtype (float64, float32, bfloat16, float16), "
            f"got {dtype!r}"
        )
    head_dim = hidden // heads
    if arch != "bert" and head_dim % 2:
        raise ValueError(
            f"the head dim hidden // heads is {head_dim}: {arch} rotates it in pairs (RoPE), "
            "so it must be even"
        )
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_positions,
        attn_implementation=attn_implementation,
    )
    window: dict[str, Any] = {} if sliding_window is None else {"sliding_window": sliding_window}
    decoder: dict[str, Any] = dict(
        num_key_value_heads=kv, attention_dropout=dropout, pad_token_id=0, head_dim=head_dim
    )
    # architecture: (configuration class, model class, its options)
    spec: dict[str, tuple[str, str, dict[str, Any]]] = {
        "bert": (
            "BertConfig",
            "BertForMaskedLM",
            dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=dropout),
        ),
        "llama": ("LlamaConfig", "LlamaForCausalLM", decoder),
        "mistral": ("MistralConfig", "MistralForCausalLM", {**decoder, **window}),
        "qwen2": (
            "Qwen2Config",
            "Qwen2ForCausalLM",
            {**decoder, "use_sliding_window": True, "max_window_layers": layers // 2, **window},
        ),
        "gemma2": (
            "Gemma2Config",
            "Gemma2ForCausalLM",
            {**decoder, "query_pre_attn_scalar": head_dim, **window},
        ),
        "gpt_oss": (
            "GptOssConfig",
            "GptOssForCausalLM",
            {
                **decoder,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "experts_implementation": "eager",  # the grouped matmul takes no float64
                **window,
            },
        ),
    }
    config_name, model_name, options = spec[arch]
    # gpt_oss's default YaRN parameters assume 131072 positions: transformers warns that a
    # shorter context is inconsistent with them, about a config this function chose
    quiet = tf.utils.logging.get_verbosity()
    tf.utils.logging.set_verbosity_error()
    try:
        config = getattr(tf, config_name)(**common, **options)
    finally:
        tf.utils.logging.set_verbosity(quiet)
    cls = getattr(tf, model_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).eval()
