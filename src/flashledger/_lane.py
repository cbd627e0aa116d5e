"""The planned lane: an unobserved forward, planned once per call shape and run as one
native call.

A decode step repeats its shapes on every layer and every token, and so does a model's
prefill of a prompt or an encoder's forward of a batch. The general path decides the
same things on every call: validation, the problem's layout, the tile sizes, the
schedule, the work split, a ledger, the checks of the result; together several times
the native pass of a short cache, and a few hundred microseconds of a short prompt's.
Where nobody can observe the forward (no ledger sink, no trace: a call with no gradient
to flow, or a training step's forward, whose backward runs the general path), the lane
keeps what the general path decides for a call's shapes, dtypes, devices, options,
thread count and matmul back end, decided by the general path's own functions
(``build_problem``, ``_resolve_tiles``, ``_native_forward_plan``, ``_forward_operands``),
as a ``_native.ForwardPass``, and runs that pass on each call's tensors. Its results
are the general path's bit for bit (``tests/test_lane.py``).

Around the pass a call runs no tensor operation but its two results' allocations and,
where the pass lays Kᵀ out, that layout (``ForwardPass.run_rows``): after a pass has
streamed a long cache through the CPU's caches, each small operation costs several
times its warm time, and a decode step's own arithmetic is a few hundred microseconds.
With q, K and V in one half dtype, read in place, the pass widens q's rows and rounds O
itself; with one part it checks the values as it writes them.

It takes the calls the general path runs as one native pass: no mask but ``Causal`` or
``SlidingWindow`` (values: their partial tiles' rows come from the geometry alone, as
intervals), under which every row sees a key; no bias, score_mod, softcap, ALiBi,
dropout or varlen; at most ``LANE_ROWS`` query rows; q, K and V in the dtype the pass
computes in, or a half cache read in place (decode); on CPU with the native step on.
A result that is not finite goes back to the general path, which names the input or
the row at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _native
from ._checks import plain
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
from .conventions import Conventions
from .masks import Causal, IntervalBound, SlidingWindow

__all__ = ["LANE_ROWS", "forward"]

# query rows of the longest call the lane plans: an unobserved float32 forward (B = 1,
# H = 4, d = 64) took 0.50 x the general path's time at L = 64, 0.78 at 256, 0.91 at
# 1024, 0.985 at 2048 and the same at 4096 (AMD EPYC family 25 model 1, one process
# alternating the two), where a plan only holds memory
LANE_ROWS = 2048

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

# The last call the lane ran, as its caller made it: (signature, plan). A repeat of it (a
# decode step's next layer or token) runs that plan without the plan cache's key (the
# frame key, its hash and lookup: about a fifth of a decode call's fixed cost). Written
# whole, read whole: a thread that reads another's pair reads a consistent one.
_last: tuple[tuple[Any, ...], _Plan] | None = None
# option values a signature compares (values compared by ==, with their types)
_PLAIN = frozenset((type(None), bool, int, float, str, Causal, SlidingWindow, Conventions))


def forward(
    q: Any, k: Any, v: Any, opts: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(o, lse)`` in the caller's layout (as ``_FlashAttention.apply`` returns them) when
    the lane takes the call, else None (the general path runs it). ``opts`` as the op's."""
    global _last
    if not (type(q) is type(k) is type(v) is torch.Tensor) or q.device.type != "cpu":
        return None
    kern = _native.kernels()
    if kern is None:
        return None
    sig = _signature(q, k, v, opts, kern)
    last = _last
    if sig is not None and last is not None and last[0] == sig:
        return _run(last[1], q, k, v)
    for name, value in opts.items():
        if name in _READ:
            continue
        if name == "dropout_p" and value == 0:
            continue
        if name not in _UNSET or value is not None:
            return None
    if opts.get("loop_order", "fa2") != "fa2":
        return None
    if q.dtype not in kern.choices or k.dtype not in kern.choices:
        kern.choose(q.dtype, k.dtype)  # before its settings key the plan
    frame = _frame_key(  # every option read, with its type (True is not taken for 1)
        q,
        k,
        v,
        opts.get("mask"),  # (a mask but Causal or SlidingWindow: None, the general path)
        opts.get("conventions"),
        None,
        None,
        *(opts.get(name) for name in _KEYED),
        max_rows=LANE_ROWS,
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
    if sig is not None:
        _last = (sig, plan)
    return _run(plan, q, k, v)


def _signature(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict[str, Any], kern: _native.Kernels
) -> tuple[Any, ...] | None:
    """What a repeat of a call must share with it to run its plan: shapes, dtypes,
    devices, every option with its type (in the caller's order), the thread count and
    the step with its back ends; None when an option is not a plain value (a tensor, a
    mask that holds one: such calls take the plan cache's key)."""
    items = tuple(opts.items())
    types = tuple(type(value) for _, value in items)
    if not _PLAIN.issuperset(types):
        return None
    return (
        (q.shape, k.shape, v.shape),
        (q.dtype, k.dtype, v.dtype),
        (q.device, k.device, v.device),
        items,
        types,
        torch.get_num_threads(),
        kern,
        kern.settings(),
    )


def _plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict[str, Any], kern: _native.Kernels
) -> _Plan | object:
    """What the general path decides for this call's shapes, as a plan; ``_NOT_TAKEN``
    when it would not run them as one native pass, or a row sees no key (its result is
    the conventions', which the general path gives)."""
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
    rows = pb.rows_with_keys()  # None: every row sees a key
    if pb.shape[5] == 0 or (rows is not None and not bool(rows.all())):
        return _NOT_TAKEN
    book = _Book(pb, _new_ledger(pb, "forward", block_q, block_k, "fa2").counters)
    kind_of = _kind_of(_classes(pb, block_q, block_k))
    _, sched, _, args = _native_forward_plan(pb, kern, book, kind_of, block_q, block_k)
    in_place = args["keys_in_place"]  # (one query tile, a few rows per K/V head)
    if q.dtype in _native._HALF and not in_place:
        return _NOT_TAKEN  # (the half step's O comes rounded from a merged pass: its path's)
    qn, kn, vn = _forward_operands(pb, kern, in_place)
    run = _native.ForwardPass(kern, qn, kn, vn, sched, **args, keep_scratch=True)
    half_rows = run.half != 0 and q.dtype == kn.dtype == pb.out_dtype
    if not (half_rows or q.dtype == qn.dtype == kn.dtype == pb.out_dtype):
        return _NOT_TAKEN  # (q, k and v share one dtype: one of the two always holds)
    return _Plan(run=run, half_rows=half_rows)


def _run(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The planned pass on this call's tensors, laid out as ``_forward_operands`` lays
    them; None when the result is not finite (an overflow, a NaN input: the general
    path's to report or explain)."""
    q, k, v = plain(q), plain(k), plain(v)  # the values as stored: the pass reads pointers
    qn = q if q.is_contiguous() else q.contiguous()  # (B·Hq, Lq, d) as laid out
    kn = (k if k.is_contiguous() else k.contiguous()).view(-1, *k.shape[-2:])  # (B·Hk, Lk, d)
    vn = (v if v.is_contiguous() else v.contiguous()).view(-1, *v.shape[-2:])
    rows = q.shape[:-1]  # the caller's (..., Lq)
    if plan.half_rows:  # q's rows and O in the cache's dtype: no conversion around the pass
        return plan.run.run_rows(None, kn, vn, rows, q16=qn)
    return plan.run.run_rows(qn, kn, vn, rows)  # (..., Lq, d_v), (..., Lq)
