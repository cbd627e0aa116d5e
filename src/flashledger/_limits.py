"""Size limits shared by the library and the command line (no torch import here)."""

from __future__ import annotations

import math
import os

__all__ = [
    "BACKWARD_CLI_MAX_SCORES",
    "MAX_SIZE",
    "RING_TIMEOUT_S",
    "TRACE_MAX_BYTES",
    "check_fits",
    "memory_bytes",
]

MAX_SIZE = 2**31 - 1
"""Largest length, tile size, head dim or count accepted: the int32 index range kernels use."""

TRACE_MAX_BYTES = 2**30
"""Default budget of ``trace=True``: 1 GiB of ledger records (they grow as ``B·H·Lq·Lk``)."""

BACKWARD_CLI_MAX_SCORES = 2**22
"""Most scores (``B·H·Lq·Lk``) ``flashledger backward --input`` takes: it prints every tile's
P and checks against the dense reference, both of that size."""

RING_TIMEOUT_S = 300.0
"""Default seconds a ring rank waits on another (its shard, an all-gather) before it raises:
far above a healthy ring step's skew, far below gloo's 30-minute default."""


def memory_bytes() -> float:
    """This machine's physical memory in bytes (infinity where it cannot be read)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def check_fits(what: str, nbytes: float, lower: str) -> None:
    """Raise ``ValueError`` where ``nbytes`` is over half this machine's memory: ``what``
    would take about so many GiB; ``lower`` says which options bring it down."""
    have = memory_bytes()
    if nbytes > have / 2:
        raise ValueError(
            f"{what} would take about {nbytes / 2**30:,.1f} GiB, over half of this machine's "
            f"{have / 2**30:,.0f} GiB; {lower}"
        )
