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
``p`` of the indices' broadcast shape: element ``sum_k i_k · stride_k`` of the source
(negative indices wrapped as Python wraps them), the same elements, so the forward is
bit for bit the indexing operation's, and the gradient of the source is a scatter-add of
the output's gradient at those flat indices (the same sums, possibly added in another
order). Two lanes run it:

- the native library's (``_native.Kernels.gather`` / ``scatter_add``; float32 and
  float64 sources, up to 4 broadcast dims, where the native step runs): one loop reads
  each index tensor where it lies (stride 0 along the dims it broadcasts over) and the
  source at the flat index, with no flat index tensor stored, on every thread; the
  scatter-add sums each thread's rows into a private copy of the gradient, added in a
  fixed order. Against the other lane, on a relative-position table read at 4 x 512²
  positions: 1.2 ms instead of 3 ms (the flat index's broadcast add) + 2.2 ms (the
  ``take``), and 1.5 ms instead of 2.1 for the gradient (Intel Xeon model 167, 2 threads);
- PyTorch's operations everywhere else: the flat index built with tensor arithmetic
  (its range checked with ``aminmax``), read with ``torch.take``, the gradient a
  ``scatter_add_``.

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
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from . import _native
from ._native import GATHER_DIMS

__all__ = ["ENABLED", "fast_indexing"]

ENABLED = True
"""Rewrite integer-array indexing inside score_mods (False: PyTorch's own indexing)."""

MIN_ELEMENTS = 1 << 15
"""Gathers of fewer elements run PyTorch's indexing: the rewrite's own checks cost
~30 microseconds, the time PyTorch's indexing takes for ~32k elements. (Measured on an
Intel Xeon model 167: at 4 x 128² elements the rewrite took 373 µs against 357 without
gradients, 1.6 ms against 4.3 ms with; at 4 x 512², 3.5 ms against 8.0 and 8.5 against
28.)"""

NATIVE = True
"""Run the gathers of float32 and float64 tables, and their gradients' scatter-adds, on the
native library's loops where it runs (False: ``torch.take`` and ``scatter_add_``)."""

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


class _Plan(NamedTuple):
    """``src[index]`` with one int or integer tensor per dim of ``src``: the indices'
    broadcast ``shape``, the ints ``(value, dim)`` (wrapped, in range) and the index
    tensors ``(tensor, dim)``."""

    shape: tuple[int, ...]
    ints: list[tuple[int, int]]
    terms: list[tuple[torch.Tensor, int]]

    def base(self, strides: tuple[int, ...]) -> int:
        """The ints' part of the flat index, for a tensor of ``strides``."""
        return sum(value * strides[dim] for value, dim in self.ints)


def _plan(src: torch.Tensor, index: tuple[Any, ...]) -> _Plan | None:
    """The plan of ``src[index]``; None when the rewrite does not apply (the caller then
    runs PyTorch's indexing)."""
    if src.ndim == 0 or len(index) != src.ndim or src.numel() == 0 or src.device.type != "cpu":
        return None
    ints: list[tuple[int, int]] = []
    terms: list[tuple[torch.Tensor, int]] = []
    for dim, i in enumerate(index):
        if isinstance(i, torch.Tensor):
            if i.dtype not in _INDEX_DTYPES or i.device != src.device or i.requires_grad:
                return None
            terms.append((i, dim))
        elif isinstance(i, bool) or not isinstance(i, int):
            return None
        else:
            size = src.shape[dim]
            if not -size <= i < size:
                return None  # out of range: PyTorch's indexing says so
            ints.append((i + size if i < 0 else i, dim))
    if not terms:  # all ints: basic indexing, a view
        return None
    shape = _broadcast_shape([t.shape for t, _ in terms])
    if shape is None or math.prod(shape) < MIN_ELEMENTS:
        return None  # not broadcastable (PyTorch raises its own error), or small
    return _Plan(shape, ints, terms)


def _flat_index(src: torch.Tensor, plan: _Plan) -> torch.Tensor | None:
    """The row-major flat index of ``plan``'s gather from ``src`` (contiguous order),
    expanded to the indices' broadcast shape; None when an index is out of range."""
    strides = _contiguous_strides(src.shape)
    flat: torch.Tensor | int = plan.base(strides)
    for i, dim in plan.terms:
        size, stride = src.shape[dim], strides[dim]
        lo, hi = (int(x) for x in torch.aminmax(i))
        if lo < -size or hi >= size:
            return None  # out of range: PyTorch's indexing says so
        term = i.long()
        if lo < 0:
            term = torch.where(term < 0, term + size, term)
        flat = flat + (term * stride if stride != 1 else term)
    assert isinstance(flat, torch.Tensor)
    return flat.expand(plan.shape)


def _contiguous_strides(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (in elements)."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _library() -> Any:
    """The native library's gather and scatter-add (``_native.Kernels``), or None where
    the native step does not run (``FLASHLEDGER_NATIVE=0``, ``_native.disabled()``, no
    compiler): ``torch.take`` and ``scatter_add_`` then run instead."""
    return _native.kernels() if NATIVE else None


class _NativeTake(torch.autograd.Function):
    """A native gather's result (``plan``, already read from ``src``, handed over in a
    list: a tensor input returned as the output would be a view, which a score_mod could
    not modify in place), with the gradient of ``src`` as the native scatter-add at the
    same indices."""

    @staticmethod
    def forward(
        ctx: Any, src: torch.Tensor, box: list[torch.Tensor], plan: _Plan, kern: Any
    ) -> torch.Tensor:
        ctx.save_for_backward(*(i for i, _ in plan.terms))  # the index tensors, checked
        ctx.dims = [dim for _, dim in plan.terms]
        ctx.shape, ctx.ints, ctx.kern, ctx.src_shape = plan.shape, plan.ints, kern, src.shape
        return box.pop()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        terms = list(zip(ctx.saved_tensors, ctx.dims))
        plan = _Plan(ctx.shape, ctx.ints, terms)
        dst = grad.new_zeros(ctx.src_shape)  # (src's shape), contiguous
        grad = grad.expand(plan.shape).contiguous()  # (the indices' broadcast shape)
        if not ctx.kern.scatter_add(dst, grad, plan.base(dst.stride()), terms):
            raise RuntimeError("an index of a score_mod's gather changed after the forward")
        return dst, None, None, None


def _native_take(src: torch.Tensor, plan: _Plan, kern: Any) -> torch.Tensor | None:
    """``src[index]`` by the native gather, or None when it cannot run it (the dtype, too
    many dims) or an index is out of range."""
    if (
        src.dtype not in (torch.float32, torch.float64)
        or len(plan.shape) > 4
        or len(plan.terms) > GATHER_DIMS
    ):
        return None
    out = kern.gather(src, plan.shape, plan.base(src.stride()), plan.terms)
    if out is None:
        return None
    if src.requires_grad and torch.is_grad_enabled():
        return _NativeTake.apply(src, [out], plan, kern)
    return out


class _FastIndexing(TorchFunctionMode):
    """See the module docstring; ``hits`` counts the rewritten operations, ``native``
    those of them the native library ran."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = 0
        self.native = 0  # of them, those the native library ran
        self.kern: Any = None  # the native library (False: none), looked up at the first gather

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
            plan = _plan(src, index if isinstance(index, tuple) else (index,))
            if plan is not None:
                if self.kern is None:
                    self.kern = _library() or False
                out = _native_take(src, plan, self.kern) if self.kern else None
                if out is not None:
                    self.hits += 1
                    self.native += 1
                    return out
                flat = _flat_index(src, plan)
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
