"""Size limits shared by the library and the command line (no torch import here)."""

from __future__ import annotations

__all__ = ["BACKWARD_CLI_MAX_SCORES", "MAX_SIZE", "RING_TIMEOUT_S", "TRACE_MAX_BYTES"]

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
