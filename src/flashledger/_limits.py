"""Size limits shared by the library and the command line (no torch import here)."""

from __future__ import annotations

__all__ = ["MAX_SIZE"]

MAX_SIZE = 2**31 - 1
"""Largest length, tile size, head dim or count accepted: the int32 index range kernels use."""
