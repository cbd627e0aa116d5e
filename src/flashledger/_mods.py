"""Flex's user callables on whole tiles: ``mask_mod`` and ``score_mod``.

FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says which keys a
query sees and ``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites a
score. Flex calls them per element (under ``torch.vmap`` in eager mode,
inlined in its compiled kernels). flashledger calls them once per tile, with
broadcast index tensors::

    b       (B, 1, 1, 1)   batch index                      int64
    h       (1, H, 1, 1)   query head index                 int64
    q_idx   (1, 1, r, 1)   global positions of the rows     int64
    kv_idx  (1, 1, 1, c)   global positions of the keys     int64
    score   (B, H, r, c)   the scaled score (score_mod only)

and takes the result broadcast to ``(B, H, r, c)``; a mask may leave out the
batch and head dims it does not depend on (``(1, 1, r, c)``), which keeps its
bytes small. To classify tiles, a mask_mod is also called once on many small
square sub-blocks at once, with one more broadcast dim (``TileCaller.blocks``:
``q_idx`` ``(1, 1, N, s, 1)``, ``kv_idx`` ``(1, 1, N, 1, s)``): a mask_mod is
element-wise, as Flex defines it, so the dims only say how the positions are
laid out; one that refuses them (written for 4-D tiles only) is evaluated
tile by tile. A callable written for scalars that does not broadcast (say
``table[b][h]`` instead of ``table[b, h]``) is detected (it raises or returns
a wrong shape) and called under ``torch.vmap`` over the four index dims
instead, as Flex's eager path calls it.

A score_mod may capture tensors that require grad (a learnable bias table, an
ALiBi slope parameter, a tensor computed from one). ``find_captured`` finds
them by running the score_mod once on a 1-element probe under a
``TorchFunctionMode`` that sees every tensor an operation receives: those
that require grad and were not made during the call are the captured ones
(leaf or not, a closure cell, a global or a module attribute alike). A walk
of the probe's autograd graph then checks that nothing was missed (an
operation the mode cannot see, e.g. inside a custom autograd Function); any
leaf it reaches that is not behind a captured tensor is added. Closure
inspection would miss globals, module attributes and tensors reached through
containers; the graph walk alone would find only the leaves behind a
captured intermediate and have to backpropagate through its history on
every tile.

The backward differentiates the score_mod tile by tile: ``UserScore.forward``
evaluates it on a tile with its input as a fresh leaf, and ``vjp`` takes the
vector-Jacobian product with ``torch.autograd.grad``, returning the gradient
of the input scores and adding the captured tensors' gradients to
``UserScore.grads``. Never a dense ``L x L`` graph. While a score_mod runs on a
tile, its integer-array indexing of a table (``table[h, q_idx - kv_idx]``) runs as
a gather whose gradient is a scatter-add (``_gather``): PyTorch's indexing backward
on CPU is a single-threaded ``index_put_``, most of a learnable bias's cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ._gather import fast_indexing

__all__ = [
    "INDEX_DTYPE",
    "MaskModFn",
    "ScoreModFn",
    "TileCaller",
    "UserScore",
    "find_captured",
    "index_grid",
]

MaskModFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = attend)."""
ScoreModFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
"""``score_mod(score, b, h, q_idx, kv_idx) -> score``."""

Kind = Literal["mask_mod", "score_mod"]


INDEX_DTYPE = torch.int32
"""The dtype of the indices a mask_mod or score_mod receives: int32, as FlexAttention's
compiled kernels give them (its eager path gives int64; every length flashledger takes
fits, ``MAX_SIZE``). A callable's index arithmetic (``q_idx - kv_idx + n``) runs two to
four times faster on int32 tensors than on int64 ones on CPU (docs/perf.md)."""


def index_grid(
    batch: int, heads: int, rows: torch.Tensor, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(b, h, q_idx, kv_idx)`` as broadcast ``INDEX_DTYPE`` index tensors for global
    ``rows`` ``(r,)`` and ``keys`` ``(c,)`` (any integer dtype): shapes ``(B,1,1,1)``,
    ``(1,H,1,1)``, ``(1,1,r,1)``, ``(1,1,1,c)``."""
    dev, dt = rows.device, INDEX_DTYPE
    b = torch.arange(batch, device=dev, dtype=dt).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=dev, dtype=dt).view(1, heads, 1, 1)
    return b, h, rows.to(dt).view(1, 1, -1, 1), keys.to(dt).view(1, 1, 1, -1)


def _vmapped(fn: Callable[..., torch.Tensor], kind: Kind) -> Callable[..., torch.Tensor]:
    """``fn`` mapped over the batch, head, query and key dims with ``torch.vmap`` (Flex's
    eager convention): called with 1-D indices ``(B,)``, ``(H,)``, ``(r,)``, ``(c,)``."""
    f = fn
    for dim in (3, 2, 1, 0):  # innermost: keys; outermost: batch
        in_dims: list[int | None] = [None] * 4
        in_dims[dim] = 0
        if kind == "score_mod":
            in_dims.insert(0, 0)  # the score is mapped along with every index
        f = torch.vmap(f, in_dims=tuple(in_dims), out_dims=0)
    return f


def _fit(out: Any, want: tuple[int, int, int, int], kind: Kind) -> torch.Tensor | str:
    """``out`` viewed as 4-D and checked against ``want`` = (B, H, r, c): each dim 1 or equal
    (a mask keeps its broadcast batch and head dims); a string says what is wrong."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if kind == "mask_mod" and out.dtype != torch.bool:
        return f"returned a {out.dtype} tensor; a mask_mod returns bool (True = attend)"
    if kind == "score_mod" and not out.is_floating_point():
        return f"returned a {out.dtype} tensor; a score_mod returns floating-point scores"
    if out.ndim > 4:
        return f"returned shape {tuple(out.shape)}, which does not broadcast to {want}"
    y = out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))
    if any(s not in (1, w) for s, w in zip(y.shape, want)):
        return f"returned shape {tuple(out.shape)}, which does not broadcast to {want}"
    return y


_DROPPED = "returned fewer dims than its indices have (a reshape, squeeze or reduction)"


def _kept_dims(out: Any, ndim: int) -> bool:
    """Whether a callable's broadcast result keeps the ``ndim`` dims of the indices it was
    given (or is a 0-d constant): an element-wise mod's always does. One with fewer dims
    reshaped, squeezed or reduced the index tensors, which under FlexAttention's
    convention are scalars; its values may then fit the tile's shape by coincidence (a
    square tile) while meaning something else, so it is evaluated under ``torch.vmap``."""
    return not isinstance(out, torch.Tensor) or out.ndim in (0, ndim)


class TileCaller:
    """Calls a user ``mask_mod`` or ``score_mod`` on a whole tile (see the module docstring).

    Broadcast first; on an error or a result that does not broadcast, the same call
    under ``torch.vmap``, which is then kept for every later tile. ``calls`` and
    ``positions`` count the tile calls and the (query, key) positions they decided,
    ``gathers`` a score_mod's indexing operations run as gathers (``_gather``).
    """

    def __init__(self, fn: Callable[..., torch.Tensor], kind: Kind) -> None:
        if not callable(fn):
            raise TypeError(
                f"{kind} must be callable as {kind}"
                f"({'score, ' if kind == 'score_mod' else ''}b, h, q_idx, kv_idx), "
                f"got {type(fn).__name__}"
            )
        self.fn = fn
        self.kind = kind
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self._vmap: Callable[..., torch.Tensor] | None = None
        self.calls = 0
        self.positions = 0
        self.gathers = 0

    def _broadcast(self, *args: torch.Tensor) -> Any:
        """``fn(*args)`` on broadcast index tensors; a score_mod's integer-array indexing
        runs as gathers (``_gather.fast_indexing``; ``gathers`` counts them)."""
        if self.kind == "mask_mod":
            return self.fn(*args)
        mode = fast_indexing()
        with mode:
            out = self.fn(*args)
        self.gathers += getattr(mode, "hits", 0)
        return out

    def __call__(
        self,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        score: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The result on the grid ``(B, H, r, c)`` the indices span (a mask: its batch and head
        dims may stay 1); ``score`` ``(B, H, r, c)`` for a score_mod."""
        want = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])
        self.calls += 1
        self.positions += want[2] * want[3]
        head = () if score is None else (score,)
        if self._vmap is None:
            try:
                out = self._broadcast(*head, b, h, q_idx, kv_idx)
                got = _fit(out, want, self.kind) if _kept_dims(out, 4) else _DROPPED
            except Exception as exc:  # scalar-only code, or a plain error: vmap will tell
                got = f"raised {type(exc).__name__}: {' '.join(str(exc).split())}"
            if isinstance(got, torch.Tensor):
                return got
            try:
                self._vmap = _vmapped(self.fn, self.kind)
                flat = (b.view(-1), h.view(-1), q_idx.view(-1), kv_idx.view(-1))
                out = _fit(self._vmap(*head, *flat), want, self.kind)
            except Exception as exc:
                raise ValueError(
                    f"{self.kind} {self.name!r} {got} when called on a tile with broadcast "
                    f"indices b {tuple(b.shape)}, h {tuple(h.shape)}, q_idx "
                    f"{tuple(q_idx.shape)}, kv_idx {tuple(kv_idx.shape)}, and fails under "
                    f"torch.vmap too ({type(exc).__name__}: {exc})"
                ) from exc
            if isinstance(out, str):
                raise ValueError(f"{self.kind} {self.name!r} {out}")
            return out
        flat = (b.view(-1), h.view(-1), q_idx.view(-1), kv_idx.view(-1))
        out = _fit(self._vmap(*head, *flat), want, self.kind)
        if isinstance(out, str):
            raise ValueError(f"{self.kind} {self.name!r} {out}")
        return out

    def blocks(
        self, batch: int, heads: int, rows: torch.Tensor, keys: torch.Tensor, *, positions: int
    ) -> torch.Tensor | None:
        """A mask_mod on ``N`` square blocks at once, bool ``(Bm, Hm, N, s, s)``: block ``n``
        holds global rows ``rows[n]`` ``(s,)`` against global keys ``keys[n]`` ``(s,)``.

        One call with the blocks as one more broadcast dim: ``b`` ``(B, 1, 1, 1, 1)``,
        ``h`` ``(1, H, 1, 1, 1)``, ``q_idx`` ``(1, 1, N, s, 1)``, ``kv_idx`` ``(1, 1, N, 1,
        s)``, which an element-wise mask_mod (Flex's model) broadcasts as it does a
        tile's. None when the callable runs under ``torch.vmap`` or does not take such
        indices (the caller then evaluates tile by tile, which reports any real error).
        ``positions``: the distinct (query, key) positions among them, for the count."""
        if self._vmap is not None or self.kind != "mask_mod":
            return None
        n, s = rows.shape
        dev, dt = rows.device, INDEX_DTYPE
        b = torch.arange(batch, device=dev, dtype=dt).view(batch, 1, 1, 1, 1)
        h = torch.arange(heads, device=dev, dtype=dt).view(1, heads, 1, 1, 1)
        want = (batch, heads, n, s, s)
        qi, ki = rows.to(dt).view(1, 1, n, s, 1), keys.to(dt).view(1, 1, n, 1, s)
        try:
            out = self._broadcast(b, h, qi, ki)
        except Exception:  # the tile by tile evaluation will say what is wrong
            return None
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.bool
            or not _kept_dims(out, 5)
            or any(x not in (1, w) for x, w in zip(out.shape[::-1], want[::-1], strict=False))
        ):
            return None
        out = out.reshape((1,) * (5 - out.ndim) + tuple(out.shape))
        self.calls += 1
        self.positions += positions
        return out.expand(*out.shape[:2], n, s, s)


# ----------------------------------------------------------------------------------------
# captured tensors
# ----------------------------------------------------------------------------------------
class _SeeTensors(TorchFunctionMode):
    """Records every tensor an operation receives that requires grad and was not made
    by an earlier operation of the same call."""

    def __init__(self, made: list[torch.Tensor]) -> None:
        super().__init__()
        self.made = made  # kept alive, so that no id is reused while the probe runs
        self.made_ids = {id(t) for t in made}
        self.seen: list[torch.Tensor] = []
        self._seen_ids: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for x in tree_leaves((args, kwargs)):
            if (
                isinstance(x, torch.Tensor)
                and x.requires_grad
                and id(x) not in self.made_ids
                and id(x) not in self._seen_ids
            ):
                self.seen.append(x)
                self._seen_ids.add(id(x))
        out = func(*args, **kwargs)
        for y in tree_leaves(out):
            if isinstance(y, torch.Tensor) and id(y) not in self._seen_ids:
                self.made.append(y)
                self.made_ids.add(id(y))
        return out


def find_captured(
    score_mod: ScoreModFn, *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The tensors ``score_mod`` captures that require grad, in the order first used.

    One call on a ``(1, 1, 1, 1)`` probe (score 0, every index 0) under
    ``enable_grad`` (see the module docstring). A score_mod that only works on
    scalars is probed under ``torch.vmap`` instead, and its captured tensors are
    the leaves its graph reaches. Raises ``ValueError`` (as a tile call does)
    when the score_mod fails or does not return floating-point scores.
    """
    caller = TileCaller(score_mod, "score_mod")
    score = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device, requires_grad=True)
    idx = [torch.zeros(1, 1, 1, 1, dtype=INDEX_DTYPE, device=device) for _ in range(4)]
    mode = _SeeTensors([score, *idx])
    with torch.enable_grad():
        try:
            with mode:
                fitted = _fit(score_mod(score, *idx), (1, 1, 1, 1), "score_mod")
        except Exception:  # scalar-only code, or an error the tile call will name
            fitted = "failed"
        if isinstance(fitted, torch.Tensor):
            out, captured = fitted, list(mode.seen)
        else:  # the tile call: vmap, or a ValueError naming the score_mod
            out, captured = caller(idx[0], idx[1], idx[2], idx[3], score=score), []
    # -- the graph walk: any leaf reached that is not behind a captured tensor --
    stop = {id(t.grad_fn) for t in captured if t.grad_fn is not None}
    known = {id(t) for t in captured} | {id(score)}
    todo: list[Any] = [out.grad_fn] if out.grad_fn is not None else []
    visited: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in visited or id(node) in stop:
            continue
        visited.add(id(node))
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in known:
                captured.append(leaf)
                known.add(id(leaf))
            continue
        todo.extend(fn for fn, _ in node.next_functions if fn is not None)
    return tuple(captured)


# ----------------------------------------------------------------------------------------
# a score_mod bound to one call
# ----------------------------------------------------------------------------------------
@dataclass
class TileVJP:
    """A tile's score_mod evaluated with its graph: the input leaf and the output."""

    leaf: torch.Tensor  # (B, H, r, c), requires grad
    out: torch.Tensor  # (B, H, r, c)


@dataclass
class UserScore:
    """A ``score_mod`` bound to one call: batch, query heads and global positions.

    ``captured``: the tensors it captures that require grad (``find_captured``,
    run when first needed: a forward never needs them; ``flash_attention``
    hands over the ones it found); ``grads``: their gradients, summed over the
    tiles ``vjp`` has seen (None until one contributes).
    """

    caller: TileCaller
    batch: int
    heads: int
    dtype: torch.dtype
    device: torch.device
    _captured: tuple[torch.Tensor, ...] | None = None
    grads: list[torch.Tensor | None] = field(default_factory=list)
    additive: bool | None = None  # adds a term to the score (``adds_to_score``); None: unknown

    @staticmethod
    def bind(
        score_mod: ScoreModFn, *, batch: int, heads: int, dtype: torch.dtype, device: torch.device
    ) -> UserScore:
        return UserScore(TileCaller(score_mod, "score_mod"), batch, heads, dtype, device)

    @property
    def captured(self) -> tuple[torch.Tensor, ...]:
        if self._captured is None:
            self.use_captured(find_captured(self.caller.fn, dtype=self.dtype, device=self.device))
        assert self._captured is not None
        return self._captured

    def use_captured(self, captured: tuple[torch.Tensor, ...]) -> None:
        """Take ``captured`` as the score_mod's captured tensors (found by the caller)."""
        self._captured = captured
        self.grads = [None] * len(captured)

    def reset_grads(self) -> None:
        """Start a backward pass: no gradient summed yet."""
        self.grads = [None] * len(self.captured)

    def _call(self, s4: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        b, h, qi, ki = index_grid(self.batch, self.heads, rows, keys)
        out = self.caller(b, h, qi, ki, score=s4)  # (B|1, H|1, r, c)
        return out.expand(s4.shape).to(s4.dtype)

    def apply(self, s4: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Scores ``(B, H, r, c)`` of global ``rows`` ``(r,)`` x ``keys`` ``(c,)`` through the
        score_mod (no graph kept)."""
        with torch.no_grad():
            return self._call(s4, rows, keys)

    def forward(
        self, s4: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, TileVJP]:
        """As ``apply``, keeping the graph for ``vjp``: ``(scores, context)``."""
        leaf = s4.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self._call(leaf, rows, keys)
        return out.detach(), TileVJP(leaf, out)

    def vjp(self, ctx: TileVJP, ds: torch.Tensor) -> torch.Tensor:
        """The gradient of the tile's input scores from ``ds`` (that of its output), both
        ``(B, H, r, c)``; the captured tensors' gradients are added to ``grads``."""
        got = self._grads(ctx, ds, (ctx.leaf, *self.captured))
        if got is None:
            return torch.zeros_like(ds)
        self._add(got[1:])  # also when the output does not depend on the input score
        return torch.zeros_like(ds) if got[0] is None else got[0]

    def vjp_captured(self, ctx: TileVJP, ds: torch.Tensor) -> None:
        """As ``vjp``, the captured tensors' gradients only (a score_mod that adds a term
        to the score passes ``ds`` on as the score's own)."""
        got = self._grads(ctx, ds, self.captured)
        if got is not None:
            self._add(got)

    @staticmethod
    def _grads(
        ctx: TileVJP, ds: torch.Tensor, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor | None, ...] | None:
        if not ctx.out.requires_grad or not inputs:  # nothing to differentiate
            return None
        with torch.enable_grad():  # (retain: a captured leaf's own history stays usable)
            return torch.autograd.grad(
                ctx.out, inputs, grad_outputs=ds, allow_unused=True, retain_graph=True
            )

    def _add(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        for n, g in enumerate(grads):
            if g is not None:
                prev = self.grads[n]
                self.grads[n] = g if prev is None else prev + g

    def probe_additive(self, rows: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether the score_mod adds a term to the score (``adds_to_score``), judged on
        the first two global ``rows`` and ``keys`` it will see (the caller's counts and its
        choice of ``torch.vmap`` left as they were; a callable that fails on the probe, as
        one writing into the score in place does, counts as not adding); kept in
        ``additive``.

        Three checks, all needed: the autograd graph has the form ``score + x``
        (``adds_to_score``); nothing computed from the score's value leaves the graph on
        the way (a comparison, ``detach``, ``.item()``: ``_ValueTrace``), nor does a value
        of the indices reach Python (a branch on ``q_idx``, which the first rows alone
        cannot judge); and random scores of several magnitudes give ``score + x``."""
        if self.additive is None:
            caller = self.caller
            state = caller.calls, caller.positions, caller._vmap, caller.fn
            r, c = rows[:2], keys[:2]
            zero = torch.zeros(self.batch, self.heads, len(r), len(c), dtype=self.dtype)
            trace = _ValueTrace()
            caller.fn, caller._vmap = trace.wrap(caller.fn), None  # (vmapped anew, traced)
            try:
                term, ctx = self.forward(zero.to(self.device), r, c)
                self.additive = (
                    not trace.escaped
                    and adds_to_score(ctx)
                    and self._adds_on_values(term, r, c)
                    and not trace.escaped
                )
            except Exception:  # e.g. it writes into the score in place: the PyTorch step
                self.additive = False  # calls it as it always has, and says what fails
            finally:
                caller.calls, caller.positions, caller._vmap, caller.fn = state
        return self.additive

    def _adds_on_values(self, term: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> bool:
        """Whether the score_mod at random scores ``s`` of several magnitudes gives
        ``s + term`` (its value at 0) to rounding: a backstop for what the graph and the
        value trace cannot see."""
        gen = torch.Generator().manual_seed(0)
        eps = torch.finfo(self.dtype).eps
        for scale in (4.0, 64.0, 4096.0):
            s = (scale * torch.randn(term.shape, generator=gen, dtype=self.dtype)).to(self.device)
            out = self.apply(s, rows, keys)
            want = s + term
            both_inf = torch.isinf(out) & (out == want)
            near = (out - want).abs() <= 16 * eps * (s.abs() + term.abs() + 1)
            if not bool((both_inf | near).all()):
                return False
        return True

    def captured_grads(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """``(tensor, gradient)`` per captured tensor (zeros where no tile contributed)."""
        return tuple(
            (t, torch.zeros_like(t) if g is None else g.to(t.dtype))
            for t, g in zip(self.captured, self.grads)
        )


# ----------------------------------------------------------------------------------------
# what a score_mod does with the values it is given
# ----------------------------------------------------------------------------------------
# functions of a tensor's metadata only: their non-tensor results carry no value
_METADATA = frozenset(
    {
        "dim", "ndimension", "size", "shape", "ndim", "numel", "nelement", "stride",
        "dtype", "device", "layout", "is_contiguous", "is_floating_point", "is_complex",
        "is_leaf", "requires_grad", "grad_fn", "element_size", "storage_offset", "__len__",
        "get_device", "is_cuda", "is_cpu", "names", "__hash__",
    }
)  # fmt: skip
# functions whose result has only the metadata of their tensor argument
_LIKE = frozenset(
    {
        "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
        "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
    }
)  # fmt: skip
# functions whose result holds the values of their argument outside the autograd graph
_UNTRACKED = frozenset({"detach", "detach_", "data", "numpy", "tolist", "item"})


def _func_name(func: Any) -> str:
    """``func``'s own name: ``gt`` for ``torch.Tensor.gt``, ``shape`` for the getter of
    ``torch.Tensor.shape``."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    return str(name)


class _ValueTrace(TorchFunctionMode):
    """Follows the values a score_mod is given through the operations it runs on them.

    ``wrap(fn)`` marks the score and the indices each call of ``fn`` receives (under
    ``torch.vmap`` too: the tensors ``fn`` itself sees). Whatever an operation makes
    from a marked tensor is marked in turn. ``escaped`` is set when a value of the
    score leaves the autograd graph (a comparison's or an integer cast's result, a
    ``detach``, an operation under ``no_grad``, a Python number), or a value of the
    indices reaches Python (``.item()``, ``bool()``, ``.tolist()``): a term made that
    way depends on the score in a way its graph does not show, or may differ on rows
    the probe did not see."""

    def __init__(self) -> None:
        super().__init__()
        self.escaped = False
        self._keep: list[torch.Tensor] = []  # alive while traced: no id is reused
        self._score: set[int] = set()
        self._index: set[int] = set()

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def traced(score: torch.Tensor, *idx: torch.Tensor) -> torch.Tensor:
            self._mark(self._score, score)
            for t in idx:
                self._mark(self._index, t)
            before = self.escaped
            try:
                with self:
                    return fn(score, *idx)
            except BaseException:  # a call that fails gives no result: what it did is moot
                self.escaped = before  # (a scalar-only callable's broadcast attempt)
                raise

        traced.__name__ = getattr(fn, "__name__", type(fn).__name__)
        return traced

    def _mark(self, marks: set[int], t: Any) -> None:
        if isinstance(t, torch.Tensor):
            self._keep.append(t)
            marks.add(id(t))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        of_score = [x for x in inputs if id(x) in self._score]
        of_index = any(id(x) in self._index for x in inputs)
        if not of_score and not of_index:
            return out
        name = _func_name(func)
        if name in _LIKE:
            return out
        graph = torch.is_grad_enabled() and any(x.requires_grad for x in of_score)
        for y in tree_leaves(out):
            if not isinstance(y, torch.Tensor):
                if name not in _METADATA:  # a value reached Python
                    self.escaped = True
                continue
            if of_score and (
                name in _UNTRACKED
                or not (y.is_floating_point() or y.is_complex())
                or (graph and not y.requires_grad)
            ):
                self.escaped = True
            self._mark(self._score if of_score else self._index, y)
        return out


# autograd nodes that only re-view the same elements in the same (row-major) order
_SAME_ELEMENTS = frozenset(
    {"ViewBackward0", "ExpandBackward0", "AliasBackward0", "UnsafeViewBackward0"}
)
_MAX_NODES = 10_000


def _through_views(fn: Any, numel: int) -> Any:
    """``fn`` past the nodes that re-view ``numel`` elements as they are (a view of a
    contiguous tensor, an expand to its own size): the node that computed them."""
    while fn is not None and fn.name() in _SAME_ELEMENTS:
        sizes = getattr(fn, "_saved_self_sym_sizes", None)
        if sizes is None or math.prod(int(n) for n in sizes) != numel:
            return _NOT_A_VIEW
        fn = fn.next_functions[0][0]
    return fn


_NOT_A_VIEW = object()


_TOO_LARGE = object()


def _below(fn: Any) -> Iterator[Any]:
    """The autograd nodes at and below ``fn``, each once; past ``_MAX_NODES`` it yields
    ``_TOO_LARGE`` and stops."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if len(seen) >= _MAX_NODES:
            yield _TOO_LARGE
            return
        seen.add(id(node))
        yield node
        todo.extend(f for f, _ in node.next_functions)


def _reaches(fn: Any, target: Any) -> bool:
    """Whether the autograd graph below ``fn`` reaches node ``target`` (True when it is too
    large to tell)."""
    return any(node is target or node is _TOO_LARGE for node in _below(fn))


def adds_to_score(ctx: TileVJP) -> bool:
    """True when the score_mod's output on a tile, as recorded by autograd, is its input
    score plus terms computed without it: a chain of ``+`` and ``-`` whose score side
    reaches the score itself (``score + x``, ``x + score``, ``score - x + y``; each
    ``x`` of the indices and captured tensors only; views that keep the elements in order
    allowed anywhere on the way). Such a score_mod's effect is the additive term
    ``score_mod(0, ...)``, which the native step adds to its scores itself."""
    numel = ctx.leaf.numel()
    # the leaf's own node: the input's AccumulateGrad, found below the output
    leaf_node = next(
        (n for n in _below(ctx.out.grad_fn) if getattr(n, "variable", None) is ctx.leaf), None
    )
    if leaf_node is None:
        return False
    fn = _through_views(ctx.out.grad_fn, numel)
    for _ in range(_MAX_NODES):  # down the score side of the chain
        if fn is None or fn is _NOT_A_VIEW or fn.name() not in ("AddBackward0", "SubBackward0"):
            return False
        (a, _), (b, _) = fn.next_functions
        a, b = _through_views(a, numel), _through_views(b, numel)
        if a is _NOT_A_VIEW or b is _NOT_A_VIEW:
            return False
        alpha = getattr(fn, "_saved_alpha", 1)
        if not _reaches(b, leaf_node):  # score side + alpha·x, score side - alpha·x
            side = a
        elif fn.name() == "AddBackward0" and alpha == 1 and not _reaches(a, leaf_node):
            side = b  # x + score side
        else:
            return False
        if side is leaf_node:
            return True
        fn = side
    return False
