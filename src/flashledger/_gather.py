"""Integer-array indexing inside a score_mod, as a gather with a scatter-add backward.

A score_mod reads tables with integer index tensors: a relative-position bias
``table[h, q_idx - kv_idx + L - 1]``, a T5 bucket table, an ALiBi slope ``slopes[h]``.
On a tile these are gathers of up to ``B·H·r·c`` elements, and PyTorch's
``Tensor.__getitem__`` with several index tensors goes through its general indexing
kernel, whose backward is an ``index_put_`` with accumulation: on CPU that runs on one
thread, element by element, and is most of a learnable bias's cost (about 4-15x the
scatter-add below on the same elements).

``fast_indexing()`` is a ``TorchFunctionMode`` that ``TileCaller`` holds while a
score_mod runs on a tile (not a mask_mod: without gradients the gain is smaller, and the
mode's dispatch costs a few microseconds per operation on the many small calls that
classify blocks). It rewrites one form of ``__getitem__``, the one where every index is
an integer tensor or a Python int and there is one per dim of the source
(``src[i0, i1, ...]``), which selects ``src[i0[p], i1[p], ...]`` at each position
``p`` of the indices' broadcast shape. It computes the row-major flat index
``sum_k i_k · stride_k`` (negative indices wrapped as Python wraps them) and reads
with ``torch.take``: the same elements, so the forward is bit for bit the indexing
operation's. The gradient of the source is a ``scatter_add_`` of the output's
gradient at the flat indices (the same sums, possibly added in another order).
Everything else (slices, ``None``, ``...``, boolean masks, fewer indices than dims,
fewer than ``MIN_ELEMENTS`` elements selected,
an index out of range, a call under ``torch.vmap``, a tensor on another device than
the CPU, whose indexing backward does not have this cost) runs PyTorch's own indexing,
which also raises its own errors. ``ENABLED`` switches the rewrite off (tests and
benchmarks compare the two).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ENABLED", "fast_indexing"]

ENABLED = True
"""Rewrite integer-array indexing inside score_mods (False: PyTorch's own indexing)."""

MIN_ELEMENTS = 1 << 15
"""Gathers of fewer elements run PyTorch's indexing: the rewrite's own checks cost
~30 microseconds, the time PyTorch's indexing takes for ~32k elements. (Measured on an
Intel Xeon model 167: at 4 x 128² elements the rewrite took 373 µs against 357 without
gradients, 1.6 ms against 4.3 ms with; at 4 x 512², 3.5 ms against 8.0 and 8.5 against
28.)"""

_INDEX_DTYPES = (torch.int64, torch.int32)


class _Take(torch.autograd.Function):
    """``src.take(flat)`` with the gradient of ``src`` as a ``scatter_add_`` at ``flat``."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flat)
        ctx.src_shape = src.shape
        return torch.take(src, flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (flat,) = ctx.saved_tensors
        n = 1
        for s in ctx.src_shape:
            n *= s
        out = grad.new_zeros(n)  # (numel of src,)
        out.scatter_add_(0, flat.reshape(-1), grad.reshape(-1))
        return out.view(ctx.src_shape), None


def _broadcast_shape(shapes: list[torch.Size]) -> tuple[int, ...] | None:
    """The broadcast of ``shapes``, None when they do not broadcast (``torch.broadcast_shapes``
    costs tens of microseconds a call, more than a small gather)."""
    out: list[int] = []
    for shape in shapes:
        pad = len(shape) - len(out)
        if pad > 0:
            out = [1] * pad + out
        for k, n in enumerate(shape, start=len(out) - len(shape)):
            if out[k] == 1:
                out[k] = n
            elif n not in (1, out[k]):
                return None
    return tuple(out)


def _flat_index(src: torch.Tensor, index: tuple[Any, ...]) -> torch.Tensor | None:
    """The row-major flat index of ``src[index]`` (every entry an int or an integer
    tensor, one per dim), expanded to the indices' broadcast shape; None when the
    rewrite does not apply (the caller then runs PyTorch's indexing)."""
    if src.ndim == 0 or len(index) != src.ndim or src.numel() == 0 or src.device.type != "cpu":
        return None
    tensors = [i for i in index if isinstance(i, torch.Tensor)]
    if not tensors:  # all ints: basic indexing, a view
        return None
    for i in index:
        if isinstance(i, torch.Tensor):
            if i.dtype not in _INDEX_DTYPES or i.device != src.device or i.requires_grad:
                return None
        elif isinstance(i, bool) or not isinstance(i, int):
            return None
    shape = _broadcast_shape([t.shape for t in tensors])
    if shape is None or math.prod(shape) < MIN_ELEMENTS:
        return None  # not broadcastable (PyTorch raises its own error), or small
    flat: torch.Tensor | int = 0
    stride = 1
    for dim in range(src.ndim - 1, -1, -1):
        size, i = src.shape[dim], index[dim]
        if isinstance(i, torch.Tensor):
            lo, hi = (int(x) for x in torch.aminmax(i))
            if lo < -size or hi >= size:
                return None  # out of range: PyTorch's indexing says so
            term = i.long()
            if lo < 0:
                term = torch.where(term < 0, term + size, term)
        else:
            if not -size <= i < size:
                return None
            term = i + size if i < 0 else i
        flat = flat + (term * stride if stride != 1 else term)
        stride *= size
    assert isinstance(flat, torch.Tensor)
    return flat.expand(shape)


class _FastIndexing(TorchFunctionMode):
    """See the module docstring; ``hits`` counts the rewritten operations."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.Tensor.__getitem__
            and len(args) == 2
            and not kwargs
            and isinstance(args[0], torch.Tensor)
            and torch._C._functorch.peek_interpreter_stack() is None  # not under vmap
        ):
            src, index = args
            flat = _flat_index(src, index if isinstance(index, tuple) else (index,))
            if flat is not None:
                self.hits += 1
                if src.requires_grad and torch.is_grad_enabled():
                    return _Take.apply(src, flat)
                return torch.take(src, flat)
        return func(*args, **kwargs)


def fast_indexing() -> _FastIndexing | contextlib.nullcontext[None]:
    """The mode to hold while a score_mod runs on a tile (nothing when ``ENABLED`` is False);
    its ``hits`` count the indexing operations it rewrote."""
    return _FastIndexing() if ENABLED else contextlib.nullcontext()
