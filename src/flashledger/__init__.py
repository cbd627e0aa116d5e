"""flashledger: exact blocked attention (the FlashAttention algorithm), observed.

The forward keeps a running max ``m``, denominator ``ell`` and weighted sum
``acc`` per row and rescales them block by block; the backward rebuilds each
probability block from one saved log-sum-exp per row. Every number the
ledger shows comes from the loop that computed the result.

    >>> import torch, flashledger as fl
    >>> q = k = v = torch.randn(97, 16, dtype=torch.float64)
    >>> res = fl.blocked_forward(q, k, v, mask=fl.Causal(), block_q=32, block_k=32)
    >>> ref = fl.reference_forward(q, k, v, mask=fl.Causal())
    >>> bool((res.o - ref.o).abs().max() < 1e-12)
    True

Names are imported on first use, so ``import flashledger`` (and the
``flashledger`` command's ``--help``) stays quick until torch is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the engine
    "reference_forward": "reference",
    "reference_backward": "reference",
    "ReferenceForward": "reference",
    "ReferenceBackward": "reference",
    "blocked_forward": "blocked",
    "blocked_backward": "blocked",
    "split_kv_forward": "blocked",
    "attention_with_kvcache": "_kvcache",
    "KVCacheResult": "_kvcache",
    "KVCacheLedger": "_kvcache",
    "apply_rotary": "_kvcache",
    "ForwardResult": "blocked",
    "BackwardResult": "blocked",
    "flash_attention": "autograd",
    "flex_attention": "_flex",
    "create_block_mask": "_blockmask",
    "OnlineSoftmax": "online",
    "OnlineState": "online",
    "merge": "online",
    "merge_partials": "online",
    "Placement": "_problem",
    "AttentionOptions": "_options",
    "alibi_slopes": "scores",
    "native_status": "_native",
    # masks and conventions
    "Mask": "masks",
    "Causal": "masks",
    "SlidingWindow": "masks",
    "KeyPadding": "masks",
    "DenseMask": "masks",
    "Padding": "masks",
    "MaskMod": "_maskmod",
    "Conventions": "conventions",
    "PRESETS": "conventions",
    "SEED": "conventions",
    "FLASH_ATTN_2": "conventions",
    "FLASH_ATTN_3": "conventions",
    "FLEX_ATTENTION": "conventions",
    "SDPA_CPU": "conventions",
    # ledgers and accounting
    "Ledger": "ledger",
    "Counters": "ledger",
    "Trace": "ledger",
    "ForwardTileStep": "ledger",
    "BackwardTileStep": "ledger",
    "storage_and_work": "accounting",
    "memory_traffic": "accounting",
    "ledger_of": "model",
    "ModelLedger": "model",
    # verification
    "assert_attention_close": "verify",
    "run_matrix": "verify",
    "lse_to_base2": "verify",
    "lse_from_base2": "verify",
    # context parallelism
    "ring_attention": "ring",
    "simulate_ring": "ring",
    "shard_sequence": "ring",
    "unshard_sequence": "ring",
    "RingLedger": "ring",
    "ring_comm_totals": "ring",
}

__all__ = [
    "FLASH_ATTN_2",
    "FLASH_ATTN_3",
    "FLEX_ATTENTION",
    "PRESETS",
    "SDPA_CPU",
    "SEED",
    "AttentionOptions",
    "BackwardResult",
    "BackwardTileStep",
    "Causal",
    "Conventions",
    "Counters",
    "DenseMask",
    "ForwardResult",
    "ForwardTileStep",
    "KVCacheLedger",
    "KVCacheResult",
    "KeyPadding",
    "Ledger",
    "Mask",
    "MaskMod",
    "ModelLedger",
    "OnlineSoftmax",
    "OnlineState",
    "Padding",
    "Placement",
    "ReferenceBackward",
    "ReferenceForward",
    "RingLedger",
    "SlidingWindow",
    "Trace",
    "__version__",
    "alibi_slopes",
    "apply_rotary",
    "assert_attention_close",
    "attention_with_kvcache",
    "blocked_backward",
    "blocked_forward",
    "create_block_mask",
    "flash_attention",
    "flex_attention",
    "ledger_of",
    "lse_from_base2",
    "lse_to_base2",
    "memory_traffic",
    "merge",
    "merge_partials",
    "native_status",
    "reference_backward",
    "reference_forward",
    "ring_attention",
    "ring_comm_totals",
    "run_matrix",
    "shard_sequence",
    "simulate_ring",
    "split_kv_forward",
    "storage_and_work",
    "unshard_sequence",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flashledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from ._blockmask import create_block_mask
    from ._flex import flex_attention
    from ._kvcache import KVCacheLedger, KVCacheResult, apply_rotary, attention_with_kvcache
    from ._maskmod import MaskMod
    from ._native import native_status
    from ._options import AttentionOptions
    from ._problem import Placement
    from .accounting import memory_traffic, storage_and_work
    from .autograd import flash_attention
    from .blocked import (
        BackwardResult,
        ForwardResult,
        blocked_backward,
        blocked_forward,
        split_kv_forward,
    )
    from .conventions import (
        FLASH_ATTN_2,
        FLASH_ATTN_3,
        FLEX_ATTENTION,
        PRESETS,
        SDPA_CPU,
        SEED,
        Conventions,
    )
    from .ledger import BackwardTileStep, Counters, ForwardTileStep, Ledger, Trace
    from .masks import Causal, DenseMask, KeyPadding, Mask, Padding, SlidingWindow
    from .model import ModelLedger, ledger_of
    from .online import OnlineSoftmax, OnlineState, merge, merge_partials
    from .reference import (
        ReferenceBackward,
        ReferenceForward,
        reference_backward,
        reference_forward,
    )
    from .ring import (
        RingLedger,
        ring_attention,
        ring_comm_totals,
        shard_sequence,
        simulate_ring,
        unshard_sequence,
    )
    from .scores import alibi_slopes
    from .verify import assert_attention_close, lse_from_base2, lse_to_base2, run_matrix
