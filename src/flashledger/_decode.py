"""The decode lane: an unobserved forward of a few query rows against many keys, planned
once per shape and run as one native call.

A decode step repeats its shapes on every layer and every token, and its arithmetic is
small (a few query rows per head against the cache). The general path decides the same
things on every call: validation, the problem's layout, the tile sizes, the schedule,
the work split, a ledger, the checks of the result; together several times the native
pass of a short cache. Where nobody can observe the call (``_FlashAttention.apply``
with no gradient to flow, no ledger sink, no trace), the lane keeps what the general
path decides for a call's shapes, dtypes, devices, options, thread count and matmul
back end, decided by the general path's own functions (``build_problem``,
``_resolve_tiles``, ``_native_forward_plan``, ``_forward_operands``),
as a ``_native.ForwardPass``, and runs that pass on each call's tensors. Its results
are the general path's bit for bit (``tests/test_decode_lane.py``).

Around the pass a call runs no tensor operation but its two results' allocations
(``ForwardPass.run_rows``): after a pass has streamed a long cache through the CPU's
caches, each small operation costs several times its warm time, and a decode step's
own arithmetic is a few hundred microseconds. With q, K and V in one half dtype the
pass widens q's rows and rounds O itself; with one part it checks the values as it
writes them.

It takes only the calls the general path runs as one native pass with the keys read
in place: no mask but ``Causal`` or ``SlidingWindow`` (values: their partial tiles'
rows come from the geometry alone, as intervals), no bias, score_mod, softcap, ALiBi,
dropout or varlen, one query tile, at most 64 query rows per K/V head, on CPU with the
native step on.
A result that is not finite goes back to the general path, which names the input or
the row at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _native
from ._problem import _frame_key, _FrameCache, build_problem
from .blocked import (
    _Book,
    _check_options,
    _classes,
    _forward_operands,
    _kind_of,
    _native_forward_plan,
    _native_step,
    _new_ledger,
    _plain_scores,
    _resolve_tiles,
)
from .masks import Causal, IntervalBound, SlidingWindow

__all__ = ["forward"]

# options the lane reads (any value) and those it takes only at their defaults
_READ = frozenset(("mask", "scale", "conventions", "seed", "block_q", "block_k", "loop_order"))
_KEYED = ("scale", "seed", "dropout_p", "block_q", "block_k", "loop_order")
_UNSET = frozenset(
    (
        "bias",
        "softcap",
        "alibi_slopes",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "seqused_q",
        "seqused_k",
        "dropout_mask",
        "score_mod",
        "placement",
        "acc_dtype",
    )
)


@dataclass(frozen=True, eq=False)
class _Plan:
    """One call shape's pass, and how the call's q reaches it."""

    run: _native.ForwardPass
    half_rows: bool  # q, K, V and O in one half dtype: q's rows and O as they are; else
    # q, K, V, O and the loop in one float dtype: every tensor as it is


_NOT_TAKEN = object()  # a call shape the lane leaves to the general path
_PLANS: _FrameCache[_Plan | object] = _FrameCache(64)


def forward(
    q: Any, k: Any, v: Any, opts: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(o, lse)`` in the caller's layout (as ``_FlashAttention.apply`` returns them) when
    the lane takes the call, else None (the general path runs it). ``opts`` as the op's."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or q.device.type != "cpu":
        return None
    mask = opts.get("mask")
    if mask is not None and type(mask) not in (Causal, SlidingWindow):
        return None
    for name, value in opts.items():
        if name in _READ:
            continue
        if name == "dropout_p" and value == 0:
            continue
        if name not in _UNSET or value is not None:
            return None
    if opts.get("loop_order", "fa2") != "fa2":
        return None
    kern = _native.kernels()
    if kern is None:
        return None
    if q.dtype not in kern.choices or k.dtype not in kern.choices:
        kern.choose(q.dtype, k.dtype)  # before its settings key the plan
    frame = _frame_key(  # every option read, with its type (True is not taken for 1)
        q,
        k,
        v,
        mask,
        opts.get("conventions"),
        None,
        None,
        *(opts.get(name) for name in _KEYED),
    )
    if frame is None:
        return None
    key = (frame, torch.get_num_threads(), kern.settings())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(q, k, v, opts, kern)
        _PLANS.put(key, plan)
    if plan is _NOT_TAKEN:
        return None
    assert isinstance(plan, _Plan)
    return _run(plan, q, k, v)


def _plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict[str, Any], kern: _native.Kernels
) -> _Plan | object:
    """What the general path decides for this call's shapes, as a plan; ``_NOT_TAKEN``
    when it would not run them as one keys-in-place native pass."""
    problem = {n: x for n, x in opts.items() if n not in ("block_q", "block_k", "loop_order")}
    try:
        _check_options(opts.get("block_q"), opts.get("block_k"), opts.get("loop_order", "fa2"))
        pb = build_problem(q, k, v, **problem)
    except (TypeError, ValueError):
        return _NOT_TAKEN  # the general path raises, naming what was wrong
    if _native_step(pb, "fa2", False) is not kern or not _plain_scores(pb):
        return _NOT_TAKEN  # (a term added to the scores rides on the general path's tiles)
    if pb.mask is not None and not isinstance(pb.mask, IntervalBound):
        return _NOT_TAKEN
    block_q, block_k = _resolve_tiles(
        pb, kern, opts.get("block_q"), opts.get("block_k"), forward=True
    )
    if pb.shape[5] == 0:
        return _NOT_TAKEN
    book = _Book(pb, _new_ledger(pb, "forward", block_q, block_k, "fa2").counters)
    kind_of = _kind_of(_classes(pb, block_q, block_k))
    _, sched, _, args = _native_forward_plan(pb, kern, book, kind_of, block_q, block_k)
    if not args["keys_in_place"]:  # (one query tile, a few rows per K/V head)
        return _NOT_TAKEN
    qn, kn, vn = _forward_operands(pb, kern, True)
    run = _native.ForwardPass(kern, qn, kn, vn, sched, **args, keep_scratch=True)
    half_rows = run.half != 0 and q.dtype == kn.dtype == pb.out_dtype
    if not (half_rows or q.dtype == qn.dtype == kn.dtype == pb.out_dtype):
        return _NOT_TAKEN  # (q, k and v share one dtype: one of the two always holds)
    return _Plan(run=run, half_rows=half_rows)


def _run(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The planned pass on this call's tensors, laid out as ``_forward_operands`` lays
    them; None when the result is not finite (a row that sees no key, an overflow, a NaN
    input: the general path's to report or explain)."""
    qn = q if q.is_contiguous() else q.contiguous()  # (B·Hq, Lq, d) as laid out
    kn = k if k.is_contiguous() else k.contiguous()
    vn = v if v.is_contiguous() else v.contiguous()
    rows = q.shape[:-1]  # the caller's (..., Lq)
    if plan.half_rows:  # q's rows and O in the cache's dtype: no conversion around the pass
        return plan.run.run_rows(None, kn, vn, rows, q16=qn)
    return plan.run.run_rows(qn, kn, vn, rows)  # (..., Lq, d_v), (..., Lq)
