"""``flash_attention``: the blocked loop as a differentiable PyTorch op.

The forward saves ``q, k, v, o`` and one LSE per row; the backward is
``blocked_backward`` (it rebuilds each probability block from the LSE). A
gradient flowing into the returned LSE is propagated when the conventions say
the LSE is differentiable (``SEED`` and ``FLEX_ATTENTION``) and ignored
otherwise (flash-attn, SDPA). Passes ``torch.autograd.gradcheck`` in float64.

Second order: when autograd asks the backward for a graph (``create_graph=True``:
gradient penalties, Hessian-vector products), the backward recomputes ``(o, lse)``
with this op and runs the blocked backward of ``_backward_graph`` (out-of-place
tile steps), so the gradients are themselves differentiable, exactly, to any
order (``gradgradcheck`` in float64). That graph holds every tile's
intermediates: memory ``O(B·H·Lq·Lk)``, like PyTorch's math backend.

``_FlashAttention.apply(q, k, v, bias, opts, sink, *captured)`` is the op
itself; ``sink`` (or None) is called with each pass's ``Ledger`` as the pass
ends, which is how a model's ledger (``flashledger.model.ledger_of``) books
both passes of every attention call (a backward that builds a graph has no
blocked ledger to book). Where no gradient can flow (grad mode off, or no input
requires one: inference, a decode step) ``apply`` runs that forward alone,
without an autograd node, whose bookkeeping would cost more than a short call's
arithmetic.

With a ``score_mod``, the tensors it captures that require grad (found once
per call, ``_mods.find_captured``) are the op's ``captured`` inputs, so that
its backward returns their gradients (summed over the tiles). The backward
reuses the forward's bound mask and score_mod: a ``MaskMod`` is classified
once per call, and the partial tiles' visibility it kept is not evaluated
again. Second-order gradients with a score_mod are not supported (refused).

Under ``torch.func`` transforms the op runs as ``_FuncAttention`` (``forward`` without
``ctx``, ``setup_context``): ``grad``, ``vjp``, ``jacrev`` and ``vmap``, composed as
``vmap(grad(f))`` for per-sample gradients. Its backward is ``_FuncAttentionBackward``,
an op of its own, so that ``vmap`` maps it too; both ``vmap`` rules run one call per
sample (``vmap(f)(x)[i]`` is ``f(x[i])`` bit for bit, whatever the options). First
order only there, no forward mode; an option that holds a mapped tensor where the rule
cannot slice it (a score_mod's closure, a mask object) is refused.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Unpack

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _lane
from ._backward_graph import graph_backward
from ._checks import check_qkv_finite
from ._eager import opaque_to_compile
from ._mods import find_captured
from ._options import AttentionOptions, check_options
from ._problem import Problem, build_problem
from .blocked import (
    BackwardResult,
    ForwardResult,
    LoopOrder,
    _backward_problem,
    _check_options,
    _forward_problem,
)
from .conventions import SEED, get_conventions
from .ledger import Ledger
from .masks import Mask

__all__ = ["flash_attention"]


class _FlashAttention(torch.autograd.Function):
    @classmethod
    def apply(  # type: ignore[override]
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        opts: dict[str, Any],
        sink: Callable[[Ledger], None] | None = None,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)``; under a ``torch.func`` transform through ``_FuncAttention``; else
        through autograd only when a gradient can flow (grad mode on and an input requires
        one): otherwise the forward alone, as autograd would run it, without a graph node
        (its bookkeeping is a large part of a decode step), and with no ledger sink on the
        planned lane where it applies (``_lane``: a call of at most ``LANE_ROWS`` query
        rows, planned once per shape)."""
        if torch._C._are_functorch_transforms_active():
            return _transformed(q, k, v, bias, opts, sink, captured)
        inputs = (q, k, v, bias, *captured)
        if _forward_ad._current_level >= 0 and any(  # (-1 outside a dual_level)
            isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None
            for t in inputs
        ):  # a dual input's tangent would be dropped: the forward alone has no rule for it
            raise RuntimeError(_NO_FORWARD_MODE)
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in inputs
        ):
            # every value checked before a graph is built: the backward reads every key of
            # the tiles it runs, so a NaN the forward's tiles did not read (keys past a
            # KeyPadding length) would stop the backward, not this call
            check_qkv_finite(q, k, v)
            return super().apply(q, k, v, bias, opts, sink, *captured)  # type: ignore[no-any-return]
        lane = _lane_forward(q, k, v, bias, opts, sink, captured)
        if lane is not None:
            return lane
        _, res = _forward(q, k, v, bias, opts, sink, captured)
        return res.o, res.lse

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        opts: dict[str, Any],
        sink: Callable[[Ledger], None] | None = None,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lane = _lane_forward(q, k, v, bias, opts, sink, captured)
        if lane is not None:
            o, lse = lane
            # a value mask (Causal, SlidingWindow) or none: the backward binds it again
            ctx.bound = ctx.bias_range = None
        else:
            pb, res = _forward(q, k, v, bias, opts, sink, captured)
            o, lse = res.o, res.lse
            # the bound mask (tile classes, kept partial tiles) and score_mod, for the backward
            ctx.bound = (pb.mask, pb.smod.user)
            ctx.bias_range = pb.smod.bias_range  # autograd checks that the bias stays unchanged
        ctx.set_materialize_grads(False)  # an unused LSE output costs no zero tensor and no pass
        ctx.save_for_backward(q, k, v, bias, o, lse, *captured)
        ctx.opts = {n: _by_value(n, x) for n, x in opts.items() if n != _ROW_MAX}
        held = _options_held(ctx.opts, (q, k, v, bias, *captured))
        ctx.held = [(t, t._version) for t in held]
        ctx.sink = sink
        return o, lse

    @staticmethod
    def jvp(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(_NO_FORWARD_MODE)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, do: torch.Tensor, dlse: torch.Tensor | None
    ) -> tuple[Any, ...]:
        q, k, v, bias, o, lse, *captured = ctx.saved_tensors
        for t, version in ctx.held:
            if t._version != version:
                raise RuntimeError(
                    f"{_CHANGED_OPTION} (a {t.dtype} tensor of shape {tuple(t.shape)}, at "
                    f"version {t._version}, read at version {version})"
                )
        opts = ctx.opts
        use_dlse = get_conventions(opts["conventions"]).lse_differentiable and dlse is not None
        none = (None,) * len(captured)
        if do is None and not use_dlse:  # neither output carries a gradient
            return None, None, None, None, None, None, *none
        if any(
            isinstance(g, torch.Tensor) and torch._C._functorch.is_legacy_batchedtensor(g)
            for g in (do, dlse)
        ):
            raise ValueError(
                "flash_attention: torch.autograd's batched gradients (is_grads_batched=True: "
                "jacobian(..., vectorize=True), gradcheck's check_batched_grad) run on "
                "PyTorch's legacy vmap, which cannot map this op; use torch.func "
                "(jacrev, or vmap over vjp), which can"
            )
        do = torch.zeros_like(o) if do is None else do.contiguous()
        if torch._C._are_functorch_transforms_active() and not torch.is_grad_enabled():
            # a graph built outside torch.func, its backward mapped by torch.func.vmap
            # (vmap over torch.autograd.grad): the backward as an op vmap maps
            if captured:
                raise ValueError(
                    "flash_attention: a backward mapped by torch.func.vmap with a score_mod "
                    "that captures tensors requiring grad is not supported"
                )
            dq, dk, dv, dbias = _FuncAttentionBackward.apply(
                q, k, v, bias, o, lse, do, dlse if use_dlse else None, opts, ctx.sink
            )
            return dq, dk, dv, dbias if ctx.needs_input_grad[3] else None, None, None
        if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate
            dq, dk, dv, dbias = _graph_gradients(
                q, k, v, bias, do, dlse if use_dlse else None, opts
            )
            return dq, dk, dv, dbias if ctx.needs_input_grad[3] else None, None, None
        dl, bound, rng = dlse if use_dlse else None, ctx.bound, ctx.bias_range
        res = _backward(q, k, v, bias, o, lse, do, dl, opts, ctx.sink, bias_range=rng, bound=bound)
        dbias = res.dbias if bias is not None and ctx.needs_input_grad[3] else None
        found = _match(captured, res.captured_grads)
        dcaptured = [g if ctx.needs_input_grad[6 + n] else None for n, g in enumerate(found)]
        return res.dq, res.dk, res.dv, dbias, None, None, *dcaptured


@opaque_to_compile  # (a gradient penalty under torch.compile: dynamo traced into apply)
def _graph_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    opts: dict[str, Any],
) -> tuple[torch.Tensor | None, ...]:
    """``(dq, dk, dv, dbias)`` as tensors autograd can differentiate (``create_graph=True``):
    the forward again as a graph of the op, then the backward as differentiable ops."""
    if opts.get("score_mod") is not None:
        raise ValueError(
            "flash_attention: second-order gradients (create_graph=True) are not "
            "supported with a score_mod; take first-order gradients, or express the "
            "modification as softcap=, alibi_slopes= or bias="
        )
    conv = get_conventions(opts["conventions"])
    raw = replace(conv, masked_row_lse=-math.inf, lse_differentiable=True)
    o_g, lse_g = _FlashAttention.apply(q, k, v, bias, {**opts, "conventions": raw})
    return tuple(graph_backward(q, k, v, o_g, lse_g, do, dlse, bias, opts))


def _by_value(name: str, x: Any) -> Any:
    """An option as the backward takes it: a 0-d tensor scale by its value at the forward
    (the forward read that value; a change after it is not the forward's problem)."""
    if name == "scale" and isinstance(x, torch.Tensor) and x.ndim == 0 and not x.requires_grad:
        return float(x)
    return x


def _transformed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    opts: dict[str, Any],
    sink: Callable[[Ledger], None] | None,
    captured: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op under a ``torch.func`` transform (``_FuncAttention``), or a ValueError for
    what it cannot carry there."""
    if captured:
        raise ValueError(
            f"flash_attention under torch.func transforms: the score_mod captures "
            f"{len(captured)} tensor(s) that require grad, and a transform cannot reach a "
            "tensor the op does not take as an input; pass such a term as bias= (a tensor "
            "input, differentiated), take the gradient with torch.autograd outside "
            "torch.func, or, where no gradient is wanted, call it under torch.no_grad()"
        )
    _check_unmapped(opts)
    if _ROW_MAX in opts:
        raise ValueError(
            "flex_attention under torch.func transforms: return_aux (the rows' maxima) is not "
            "supported there; call it without return_aux"
        )
    out: tuple[torch.Tensor, torch.Tensor] = _FuncAttention.apply(q, k, v, bias, opts, sink)
    return out


class _PerSample(torch.autograd.Function):
    """What the two ``torch.func`` ops share: a ``vmap`` rule of one call per sample
    (``_per_sample``) over their first ``tensors`` arguments, and no forward mode."""

    tensors = 0

    @classmethod
    def vmap(  # type: ignore[override]
        cls, info: Any, in_dims: tuple[int | None, ...], *args: Any
    ) -> tuple[tuple[torch.Tensor | None, ...], tuple[int | None, ...]]:
        return _per_sample(cls.apply, info.batch_size, in_dims, args, tensors=cls.tensors)

    @staticmethod
    def jvp(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(_NO_FORWARD_MODE)


class _FuncAttention(_PerSample):
    """The op as ``torch.func`` transforms need it: ``forward`` without ``ctx``,
    ``setup_context``, and a ``vmap`` rule. ``grad``, ``vjp``, ``jacrev`` and ``vmap`` work,
    and compose (``vmap(grad(f))``: per-sample gradients), because the backward is itself
    an op with a ``vmap`` rule (``_FuncAttentionBackward``). Under ``vmap`` each sample runs
    as its own call (``_per_sample``), so ``vmap(f)(x)[i]`` is ``f(x[i])`` bit for bit with
    every option: a mask, a score_mod or dropout sees the sample's own batch and head
    indices, as it would unmapped. Forward mode (``jvp``, ``jacfwd``, ``hessian``) is
    refused."""

    tensors = 4  # q, k, v, bias

    @staticmethod
    def forward(  # type: ignore[override]
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        opts: dict[str, Any],
        sink: Callable[[Ledger], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lane = _lane_forward(q, k, v, bias, opts, sink, ())  # the backward binds its mask
        if lane is not None:
            return lane
        _, res = _forward(q, k, v, bias, opts, sink, ())
        return res.o, res.lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        q, k, v, bias, opts, sink = inputs
        o, lse = output
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, bias, o, lse)
        ctx.opts, ctx.sink = opts, sink

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, do: torch.Tensor | None, dlse: torch.Tensor | None
    ) -> tuple[Any, ...]:
        q, k, v, bias, o, lse = ctx.saved_tensors
        use_dlse = get_conventions(ctx.opts["conventions"]).lse_differentiable and dlse is not None
        if do is None and not use_dlse:
            return None, None, None, None, None, None
        do = torch.zeros_like(o) if do is None else do
        dq, dk, dv, dbias = _FuncAttentionBackward.apply(
            q, k, v, bias, o, lse, do, dlse if use_dlse else None, ctx.opts, ctx.sink
        )
        return dq, dk, dv, dbias if ctx.needs_input_grad[3] else None, None, None


class _FuncAttentionBackward(_PerSample):
    """``_FuncAttention``'s backward pass as an op of its own, so that ``vmap`` can map it
    (per-sample gradients, ``jacrev``): ``(dq, dk, dv, dbias)`` from ``(q, k, v, bias, o,
    lse, do, dlse)``, dbias None without a bias. Not differentiable again under the
    transforms (second order goes through ``torch.autograd``, ``create_graph=True``)."""

    tensors = 8  # q, k, v, bias, o, lse, do, dlse

    @staticmethod
    def forward(  # type: ignore[override]
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        o: torch.Tensor,
        lse: torch.Tensor,
        do: torch.Tensor,
        dlse: torch.Tensor | None,
        opts: dict[str, Any],
        sink: Callable[[Ledger], None] | None,
    ) -> tuple[torch.Tensor | None, ...]:
        res = _backward(q, k, v, bias, o, lse, do, dlse, opts, sink)
        return res.dq, res.dk, res.dv, res.dbias if bias is not None else None

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:  # type: ignore[override]
        raise RuntimeError(
            "flash_attention under torch.func transforms gives first-order gradients (grad, "
            "vjp, jacrev, and vmap over them); a gradient of those gradients is taken with "
            "torch.autograd.grad(..., create_graph=True) outside torch.func"
        )


_NO_FORWARD_MODE = (
    "flash_attention has no forward-mode derivative (torch.func.jvp, jacfwd, hessian, "
    "linearize, torch.autograd.forward_ad's dual tensors); use reverse mode: "
    "torch.func.grad, vjp, jacrev"
)


def _per_sample(
    fn: Callable[..., tuple[torch.Tensor | None, ...]],
    n: int,
    in_dims: tuple[int | None, ...],
    args: tuple[Any, ...],
    *,
    tensors: int,
) -> tuple[tuple[torch.Tensor | None, ...], tuple[int | None, ...]]:
    """A vmap rule: ``fn`` once per sample of the mapped dimension (the first ``tensors``
    arguments, and the tensors of the options dict after them, sliced where mapped; the
    rest passed as they are), the outputs stacked along dimension 0."""
    if n == 0:
        raise ValueError("flash_attention under vmap: the mapped dimension is empty")
    opts, opt_dims = args[tensors], in_dims[tensors]
    if opt_dims is not None and not isinstance(opt_dims, dict):
        raise ValueError("flash_attention under vmap: the options cannot be mapped as a whole")
    dims: dict[str, int | None] = opt_dims or {}
    mapped = {name: d for name, d in dims.items() if d is not None}

    def sample(i: int) -> tuple[torch.Tensor | None, ...]:
        xs = (x if d is None else x.select(d, i) for x, d in zip(args[:tensors], in_dims))
        own = {name: x.select(mapped[name], i) if name in mapped else x for name, x in opts.items()}
        return fn(*xs, own, *args[tensors + 1 :])

    outs = [sample(i) for i in range(n)]
    stacked: list[torch.Tensor | None] = []
    for j in range(len(outs[0])):  # an output is None in every sample or in none
        col = [x for out in outs if (x := out[j]) is not None]
        stacked.append(torch.stack(col) if col else None)
    return tuple(stacked), tuple(None if x is None else 0 for x in stacked)


def _check_unmapped(opts: Mapping[str, Any]) -> None:
    """Under vmap: a ValueError for an option that holds a mapped tensor where the vmap rule
    cannot slice it (a tensor option itself is mapped as an input is)."""
    for name, x in opts.items():
        if not isinstance(x, torch.Tensor) and _holds_mapped(x):
            raise ValueError(
                f"flash_attention under vmap: the {name}= option holds a tensor that varies "
                "along the mapped dimension (captured by a mask_mod or score_mod, or inside a "
                "mask object), which the op cannot slice per sample; pass such a term as a "
                "tensor option (bias=, mask= a boolean tensor, alibi_slopes=), which vmap maps"
            )


def _is_mapped(x: torch.Tensor) -> bool:
    """Whether ``x`` is being mapped by an active ``vmap`` (a batched tensor, possibly under
    other transforms' wrappers, e.g. ``grad``'s inside ``vmap(grad(f))``)."""
    fc = torch._C._functorch
    while True:
        if fc.is_batchedtensor(x):
            return True
        if not fc.is_functorch_wrapped_tensor(x):
            return False
        x = fc.get_unwrapped(x)


def _holds_mapped(x: Any) -> bool:
    """Whether ``x`` holds a tensor being mapped by vmap (``_held_tensors``)."""
    return any(_is_mapped(t) for t in _held_tensors(x))


def _held_tensors(x: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """The tensors ``x`` holds: itself, or in a function's closure, an object's attributes,
    a sequence's or a dict's items (``depth`` levels down)."""
    if isinstance(x, torch.Tensor):
        yield x
        return
    if x is None or isinstance(x, (bool, int, float, str)):
        return
    if isinstance(x, Mask):  # a mask tree (a & b | c ...): its leaves at any depth
        for y in vars(x).values():
            yield from _held_tensors(y, depth if isinstance(y, Mask) else depth - 1)
        return
    if depth == 0:
        return
    inner: list[Any] = []
    if isinstance(x, (tuple, list)):
        inner = list(x)
    elif isinstance(x, dict):
        inner = list(x.values())
    elif isinstance(x, types.FunctionType):  # its closure, and the tensors its globals name
        inner = [c.cell_contents for c in x.__closure__ or () if c.cell_contents is not x]
        names = x.__code__.co_names
        inner += [g for n in names if isinstance(g := x.__globals__.get(n), torch.Tensor)]
    elif isinstance(x, types.MethodType):
        inner = [x.__func__, x.__self__]
    elif isinstance(x, functools.partial):
        inner = [x.func, *x.args, *x.keywords.values()]
    if hasattr(x, "__dict__") and not isinstance(x, (type, types.ModuleType)):
        inner += list(vars(x).values())
    for y in inner:
        yield from _held_tensors(y, depth - 1)


def _options_held(opts: Mapping[str, Any], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors the options hold that the backward reads again (a boolean mask, a mask
    object's or a mask_mod's or score_mod's tensors, alibi_slopes, dropout_mask) and that
    are not inputs of the op: the backward checks their version counters, as autograd
    checks the inputs', so that one changed in place between the forward and the backward
    is an error, not the gradients of another problem. Tensors without a version counter
    (made under inference_mode) are left out."""
    seen = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
    out = []
    for t in _held_tensors(list(opts.values())):
        if id(t) not in seen and not t.is_inference():
            seen.add(id(t))
            out.append(t)
    return out


_CHANGED_OPTION = (
    "flash_attention: a tensor an option holds (mask=, alibi_slopes=, dropout_mask=, or one a "
    "mask_mod or score_mod reads) was changed in place between the forward and the "
    "backward, which would give the gradients of another problem; change a copy, or run "
    "the forward again"
)


def _lane_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    opts: dict[str, Any],
    sink: Callable[[Ledger], None] | None,
    captured: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(o, lse)`` from the planned lane (``_lane``) when nothing observes the forward (no
    ledger sink, no bias or captured tensors, no row maxima asked for) and the lane takes
    the call; else None (``_forward`` runs it)."""
    if sink is not None or bias is not None or captured or _ROW_MAX in opts:
        return None
    return _lane.forward(q, k, v, opts)


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    opts: dict[str, Any],
    sink: Callable[[Ledger], None] | None,
    captured: Sequence[torch.Tensor],
) -> tuple[Problem, ForwardResult]:
    """The op's forward pass: its problem and result; the ledger goes to ``sink``, and with
    ``opts[_ROW_MAX]`` (a list) each row's largest score (``ForwardResult.row_max``) to it."""
    problem, loop = _split(opts)
    _check_options(**loop)  # the op may be called directly (the transformers integration)
    pb = build_problem(q, k, v, bias=bias, **problem)
    if pb.smod.user is not None:
        pb.smod.user.use_captured(tuple(captured))  # found once, by flash_attention
    row_max = opts.get(_ROW_MAX)
    res = _forward_problem(pb, **loop, row_max=row_max is not None)
    if sink is not None:
        sink(res.ledger)
    if row_max is not None:
        row_max.append(res.row_max)
    return pb, res


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    opts: dict[str, Any],
    sink: Callable[[Ledger], None] | None,
    *,
    bias_range: Any = None,
    bound: tuple[Any, Any] | None = None,
) -> BackwardResult:
    """The op's first-order backward pass; its ledger goes to ``sink``. ``bound``: the
    forward's bound mask and score_mod, which serve as they are (the same geometry); else
    both are bound again from ``opts``, a score_mod with no captured tensors (the lane
    takes none; under ``torch.func`` they are refused)."""
    problem, loop = _split(opts)
    pb = build_problem(q, k, v, bias=bias, bias_range=bias_range, **problem)
    if bound is not None:
        pb.mask, pb.smod.user = bound
    elif pb.smod.user is not None:
        pb.smod.user.use_captured(())
    res = _backward_problem(pb, o, lse, do.contiguous(), dlse, bias=bias, saved=True, **loop)
    if sink is not None:
        sink(res.ledger)
    return res


_LOOP = ("block_q", "block_k", "loop_order")
_ROW_MAX = "_row_max"  # a list the forward appends its rows' largest scores to (flex's aux)


def _split(opts: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The op's options as ``(build_problem's, the loop's)``."""
    problem = {n: x for n, x in opts.items() if n not in _LOOP and n != _ROW_MAX}
    return problem, {n: opts[n] for n in _LOOP}


def _match(
    captured: Sequence[torch.Tensor], grads: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor | None]:
    """The gradient of each captured tensor, by identity (by position if the backward's
    search found them as other tensor objects)."""
    by_id = {id(t): g for t, g in grads}
    if all(id(t) in by_id for t in captured):
        return [by_id[id(t)] for t in captured]
    if len(grads) == len(captured):
        return [g for _, g in grads]
    raise RuntimeError(
        f"the score_mod captured {len(captured)} tensor(s) requiring grad in the forward and "
        f"{len(grads)} in the backward; keep the tensors it captures fixed until backward"
    )


# opaque to torch.compile (_eager): dynamo breaks the graph around each call and runs it
# eagerly; so are flex_attention, attention_with_kvcache and the transformers
# integration's attention_forward
@opaque_to_compile
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    loop_order: LoopOrder = "fa2",
    return_lse: bool = False,
    **opts: Unpack[AttentionOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(f(q kᵀ)) v`` computed blockwise, differentiable.

    q ``(..., Lq, d)``, k ``(..., Lk, d)``, v ``(..., Lk, d_v)``; returns ``o``
    ``(..., Lq, d_v)`` (and ``lse`` ``(..., Lq)`` with ``return_lse=True``).
    ``opts``: ``AttentionOptions``, as for ``blocked_forward``; ``bias`` receives
    a gradient when it requires one, and so does every tensor a ``score_mod``
    captures that requires one.
    """
    check_options("flash_attention", opts)
    o, lse = _attend(q, k, v, block_q, block_k, loop_order, opts)
    return (o, lse) if return_lse else o


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_q: int | None,
    block_k: int | None,
    loop_order: LoopOrder,
    opts: Mapping[str, Any],
    row_max: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attention``'s ``(o, lse)`` for checked ``opts``; with ``row_max`` (a list),
    the forward appends each row's largest score ``(..., Lq)`` to it (not differentiable:
    the running max the loop ended with, natural units, -inf for a row that sees no key)."""
    _check_options(block_q, block_k, loop_order)
    slopes = opts.get("alibi_slopes")
    if isinstance(slopes, torch.Tensor) and slopes.requires_grad:
        raise ValueError(
            "flash_attention does not compute a gradient for alibi_slopes (they are an option, "
            "like the scale); pass alibi_slopes.detach()"
        )
    rest: dict[str, Any] = dict(opts)
    bias = rest.pop("bias", None)
    rest.setdefault("conventions", SEED)
    rest.update(block_q=block_q, block_k=block_k, loop_order=loop_order)
    if torch._C._are_functorch_transforms_active():
        _check_unmapped(rest)  # before the score_mod is first called (find_captured)
    captured: tuple[torch.Tensor, ...] = ()
    score_mod = rest.get("score_mod")
    if score_mod is not None and torch.is_grad_enabled() and isinstance(q, torch.Tensor):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        captured = find_captured(score_mod, dtype=acc, device=q.device)
    if row_max is not None:
        rest[_ROW_MAX] = row_max
    out: tuple[torch.Tensor, torch.Tensor] = _FlashAttention.apply(
        q, k, v, bias, rest, None, *captured
    )
    return out


def _demo() -> None:
    """flash_attention as a differentiable op: its gradients against the dense oracle's."""
    from .examples import FIVE_G, FIVE_K, FIVE_Q, FIVE_V
    from .masks import Causal
    from .reference import reference_backward, reference_forward

    q, k, v = (x.clone().requires_grad_(True) for x in (FIVE_Q, FIVE_K, FIVE_V))
    o = flash_attention(q, k, v, mask=Causal(), block_q=2, block_k=2)  # (5, 2)
    assert isinstance(o, torch.Tensor)
    o.backward(FIVE_G)
    ref = reference_forward(FIVE_Q, FIVE_K, FIVE_V, mask=Causal())
    refb = reference_backward(FIVE_Q, FIVE_K, FIVE_V, ref.o, ref.lse, FIVE_G, mask=Causal())
    for name, got, want in (
        ("dQ", q.grad, refb.dq),
        ("dK", k.grad, refb.dk),
        ("dV", v.grad, refb.dv),
    ):
        assert got is not None
        print(f"{name}: max |autograd - oracle| = {float((got - want).abs().max()):.3g}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("autograd", _demo)
