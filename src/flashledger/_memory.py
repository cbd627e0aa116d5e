"""Large buffers on transparent huge pages, where the operating system lends them.

The first write to a fresh buffer faults in each of its pages: at 4 KiB a page, the
gradient of a ``(1, 4, 4096, 4096)`` float32 bias (256 MiB) takes 65536 faults, and
writing it the first time costs three to four times what writing it again does.
``empty_like_huge`` asks Linux to back such a buffer with 2 MiB pages
(``madvise(MADV_HUGEPAGE)``, which the kernel's default ``madvise`` mode of transparent
huge pages honours); elsewhere, for small buffers, or where the advice is refused, it is
``torch.empty_like``. The advice changes no value, only how the pages are mapped.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20
"""Bytes of a transparent huge page on x86-64 and arm64 (4 KiB base pages)."""
MIN_BYTES = 32 << 20
"""Buffers smaller than this are left as they are (few faults; glibc serves them from its
heap, which the advice would reach beyond the buffer)."""


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` on Linux with ``MADV_HUGEPAGE`` known to Python; else None."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_MADVISE = _madvise()


def empty_like_huge(x: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(x)``, its whole 2 MiB pages advised huge when it is a large CPU
    buffer on Linux (see the module docstring)."""
    out = torch.empty_like(x)
    size = out.numel() * out.element_size()
    if _MADVISE is None or size < MIN_BYTES or out.device.type != "cpu":
        return out
    start = out.data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = (start + size) // HUGE_PAGE * HUGE_PAGE
    if hi > lo:
        _MADVISE(lo, hi - lo, mmap.MADV_HUGEPAGE)  # advice: a refusal changes nothing
    return out
