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
"""

from ._problem import Placement
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
from .ledger import BackwardTileStep, Counters, ForwardTileStep, Ledger
from .masks import Causal, DenseMask, KeyPadding, Mask, SlidingWindow
from .online import OnlineSoftmax, OnlineState, merge, merge_partials
from .reference import ReferenceBackward, ReferenceForward, reference_backward, reference_forward
from .scores import alibi_slopes

__version__ = "0.1.0"

__all__ = [
    "FLASH_ATTN_2",
    "FLASH_ATTN_3",
    "FLEX_ATTENTION",
    "PRESETS",
    "SDPA_CPU",
    "SEED",
    "BackwardResult",
    "BackwardTileStep",
    "Causal",
    "Conventions",
    "Counters",
    "DenseMask",
    "ForwardResult",
    "ForwardTileStep",
    "KeyPadding",
    "Ledger",
    "Mask",
    "OnlineSoftmax",
    "OnlineState",
    "Placement",
    "ReferenceBackward",
    "ReferenceForward",
    "SlidingWindow",
    "__version__",
    "alibi_slopes",
    "blocked_backward",
    "blocked_forward",
    "flash_attention",
    "merge",
    "merge_partials",
    "reference_backward",
    "reference_forward",
    "split_kv_forward",
]
