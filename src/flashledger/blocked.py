"""Blocked attention: the FlashAttention loop, observed.

Forward (FlashAttention-2 order, the default): one pass per query tile
``Q_i`` (``block_q`` rows), an inner loop over key tiles ``K_j, V_j``
(``block_k`` keys); the running state ``(m, ℓ, acc)`` of the tile's rows
stays "on chip" and ``O_i`` and the LSE are written once. FlashAttention-1
order (``loop_order="fa1"``): outer loop over key tiles, inner over query
tiles, with ``O`` (kept normalised), ``m`` and ``ℓ`` read and written back
after every step.

Backward (both orders): one pass per key tile, an inner loop over query tiles;
each step rebuilds its probability block from the saved LSE,
``P = exp(S - λ)``, and adds its contributions; ``dK_j``/``dV_j`` stay on chip
and ``dQ`` is accumulated across key tiles.

=======  ============  =========================  ====================================
symbol   variable      shape                      meaning
=======  ============  =========================  ====================================
Q_i      ``qi``        (B, Hkv, G, bq, d)         query tile (GQA: G query heads per K/V head)
K_j      ``kj``        (B, Hkv, 1, bk, d)         key tile
V_j      ``vj``        (B, Hkv, 1, bk, d_v)       value tile
S_ij     ``s``         (B, Hkv, G, bq, bk)        scores after scale/softcap/bias/mask
m, ℓ     ``m, ell``    (B, Hkv, G, bq)            running max and denominator
acc      ``acc``       (B, Hkv, G, bq, d_v)       running weighted sum of values
α        ``alpha``     (B, Hkv, G, bq)            exp(m_old - m_new)
λ        ``lse``       (B, Hkv, G, Lq)            log-sum-exp per row
D        ``D``         (B, Hkv, G, Lq)            rowsum(dO ⊙ O)
P_ij     ``p``         (B, Hkv, G, bq, bk)        rebuilt probabilities exp(S - λ)
dS_ij    ``ds``        (B, Hkv, G, bq, bk)        P ⊙ (dP - D)
=======  ============  =========================  ====================================

A mask classifies every tile: empty tiles are skipped (booked as skipped),
full tiles never evaluate the mask, partial tiles do. A user's FlexAttention
``mask_mod`` (``MaskMod``) is evaluated on each partial tile at once, and a
``score_mod`` on each tile run at once (in the backward with its graph, for
its vector-Jacobian product on the tile); the ledger books both
(``mask_mod_*`` and ``score_mod_*`` counters). A mask_mod's full tiles run the
native step and its partial tiles hand it their visibility bytes, as a dense
mask's do. A score_mod that adds a term to the score (``_mods.adds_to_score``)
runs on the native step too: each tile that runs evaluates the term
``score_mod(0, ...)`` and the pass adds it (``_ScoreTerms``); any other score_mod
runs the PyTorch step.

Counters (``ledger.counters``, totals over batch and query heads) are always
kept. Slow-memory traffic is counted in elements, per (batch, query head),
as if every query head read its own K/V (MHA):

- forward, fa2: per query tile with at least one tile run, read ``Q_i``
  (``bq·d``); per tile run, read ``K_j, V_j`` (``bk·(d + d_v)``); per query
  tile, write ``O_i`` and its LSE (``bq·(d_v + 1)``).
- forward, fa1: initialise ``O, ℓ, m`` (write ``Lq·(d_v + 2)``); per key tile
  with at least one tile run, read ``K_j, V_j``; per tile run, read ``Q_i,
  O_i, ℓ_i, m_i`` (``bq·(d + d_v + 2)``) and write ``O_i, ℓ_i, m_i``
  (``bq·(d_v + 2)``); finally read ``m, ℓ`` and write the LSE (``3·Lq``).
- backward: read ``O, dO`` and write ``D`` (``Lq·(2·d_v + 1)``); initialise
  ``dQ`` (write ``Lq·d``); per key tile with at least one tile run, read
  ``K_j, V_j``; per key tile, write ``dK_j, dV_j`` (``bk·(d + d_v)``); per tile
  run, read ``Q_i, dO_i, λ_i, D_i`` and ``dQ_i`` (``bq·(2·d + d_v + 2)``)
  and write ``dQ_i`` (``bq·d``).

Exponentials: ``bq·bk`` per tile run, plus ``bq`` rescale factors per forward
tile run.

Tracing off is the same loop with no records and the same counters. On CPU,
for float32/float64 scores without dropout (plain, a softcap, ALiBi, a bias,
an additive score_mod), the pass's schedule (the
tiles that run, in order, with their kinds) then runs as one native call
(``_native``: scores, online update or gradient rebuild, matmuls, work items
handed out to threads, each tile in a per-thread buffer): the same math, its
own rounding (within ~1e-15 relative of the traced step in float64). Elsewhere, or with the native step off (``FLASHLEDGER_NATIVE=0``,
no C compiler), tracing off is the traced arithmetic bit for bit, made fast by:

- every matmul covers all batch and head dims at once, as ``(B·Hkv, G·bq, ·)``
  (GQA stacks a K/V head's query heads), with large tiles (default 512 x 512);
- tile-sized buffers are allocated once per call and reused (``out=`` and
  in-place ops), and ``acc`` and the gradients accumulate inside the matmul
  (``baddbmm_``), stored in the layout whose matmul runs fastest
  (``accᵀ``, ``dQᵀ``, ``dKᵀ``, ``dVᵀ``: float64 GEMMs lose up to 40% otherwise);
- a scale that is a power of two (``1/sqrt(d)`` for d = 16, 64, 256...) rides on
  the matmul as its alpha; others are applied afterwards, as the reference does;
- the backward recomputes each ``S`` with the forward's own call, so ``P =
  exp(S - λ)`` is rebuilt from bit for bit the scores that produced ``λ``;
- exponentials are ``exp2((x - shift)·log2 e)`` (``online.exp_shifted``);
- full tiles are counted in closed form; partial tiles' mask sums stay on the
  device and are read once per pass (no host synchronisation per tile).

Both steps book the FlashAttention counts: a partial tile's ``bq·bk`` dots,
although the native step leaves out of its matmuls the key columns a whole
block of 64 rows cannot see (they would add exact zeros).

dQ accumulates tile by tile in its own buffer and is laid out once at the end,
so the backward holds two copies of dQ at its peak (see docs/perf.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Unpack

import torch

from . import _native, online
from ._checks import all_finite, autocast_off, check_size, pieces, plain, power_of_two
from ._memory import empty_like_huge
from ._mods import adds_to_score, find_captured
from ._options import AttentionOptions, check_options
from ._problem import Placement, Problem, build_problem
from .ledger import BackwardTileStep, Counters, ForwardTileStep, Ledger, Trace, ordinal
from .masks import EMPTY, FULL, PARTIAL, TILE_KINDS, IntervalBound
from .reference import _backward_inputs, _conventional_lse
from .scores import TileGrad

__all__ = [
    "BackwardResult",
    "ForwardResult",
    "blocked_backward",
    "blocked_forward",
    "split_kv_forward",
]

LoopOrder = Literal["fa2", "fa1"]
# The default tiles of the PyTorch step. The native step's default tiles are chosen by
# measurement on the machine it runs on (``_calibrate``: 512 x 512 among the candidates);
# block_q/block_k given explicitly are always used as given.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
_HALF = (torch.bfloat16, torch.float16)  # dtypes the native step reads in place (decode)


@dataclass(frozen=True)
class ForwardResult:
    """``o`` ``(..., Lq, d_v)`` in the input dtype, ``lse`` ``(..., Lq)`` in the accumulation dtype;
    ``row_max`` ``(..., Lq)`` (when asked for): each row's largest score after the score
    transform and the mask, the running max ``m`` the loop ended with (natural units, the
    accumulation dtype, -inf for a row that sees no key)."""

    o: torch.Tensor
    lse: torch.Tensor
    ledger: Ledger
    row_max: torch.Tensor | None = None


@dataclass(frozen=True)
class BackwardResult:
    """Gradients like their inputs; ``dbias`` like ``bias`` (or None); ``D`` ``(..., Lq)``;
    ``captured_grads``: ``(tensor, gradient)`` for each tensor the score_mod captures that
    requires grad (empty without one)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None
    D: torch.Tensor
    ledger: Ledger
    captured_grads: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


def _tiles(n: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(s + b, n)) for s in range(0, n, b)]


def _running(
    book: _Book,
    tiles: Sequence[tuple[int, int]],
    kind_of: Callable[[int, int], int],
    *,
    i: int | None = None,
    j: int | None = None,
) -> Iterator[tuple[int, int, int, int]]:
    """The inner loop's schedule: ``(index, start, stop, kind)`` of each tile that runs.

    Key tiles of query tile ``i``, or query tiles of key tile ``j``; ``kind_of(i, j)``
    classifies a tile. Empty tiles are booked as skipped and left out.
    """
    for n, (t0, t1) in enumerate(tiles):
        kind = kind_of(i, n) if i is not None else kind_of(n, j)  # type: ignore[arg-type]
        if kind == EMPTY:
            book.skip()
            continue
        yield n, t0, t1, kind


def _observers(
    ledger: Ledger, trace: Trace | None, observer: Any
) -> tuple[list[Any], Callable[[int], bool]]:
    """The loop's observers and ``wants(index)``: whether step ``index`` must hand its tensors
    to an observer (the recorder keeps every ``trace.every``-th step)."""
    obs: list[Any] = []
    if trace is not None:
        obs.append(_Recorder(ledger, trace.every))
    if observer is not None:
        if not (hasattr(observer, "forward_tile") or hasattr(observer, "backward_tile")):
            raise TypeError("observer must have forward_tile(step) and/or backward_tile(step)")
        obs.append(observer)
    others = any(getattr(o, "wants_tensors", True) for o in obs if not isinstance(o, _Recorder))
    every = trace.every if trace is not None else 0

    def wants(index: int) -> bool:
        return others or (every > 0 and index % every == 0)

    return obs, wants


class _Recorder:
    """The ``trace=`` observer: appends every ``every``-th step to the ledger."""

    wants_tensors = True

    def __init__(self, ledger: Ledger, every: int) -> None:
        self.ledger, self.every = ledger, every
        ledger.record_every = every

    def forward_tile(self, step: ForwardTileStep) -> None:
        if step.index % self.every == 0:
            self.ledger.records.append(step)

    def backward_tile(self, step: BackwardTileStep) -> None:
        if step.index % self.every == 0:
            self.ledger.records.append(step)


def _record_bytes(
    pb: Problem,
    classes: list[list[int]] | None,
    qtiles: Sequence[tuple[int, int]],
    ktiles: Sequence[tuple[int, int]],
    pass_name: str,
    every: int,
) -> tuple[int, int, int]:
    """``(bytes, steps kept, steps run)`` of the records ``trace`` keeps, in closed form.

    Per tile step of ``bq x bk`` (in the accumulation dtype's bytes, ``B·Hq`` query heads,
    ``B·Hkv`` K/V heads; the dropout keep mask adds one byte per ``B·Hq·bq·bk``):
    forward fa2 ``B·Hq·(2·bq·bk + 5·bq + 2·bq·d_v)`` (s, p; block max, m before/after, α,
    ℓ; acc, o), fa1 the same without acc, backward ``B·Hq·(4·bq·bk + bq·d) + B·Hkv·bk·(d +
    d_v)`` (s, p, dP, dS; the step's dQ, dK, dV). Steps are numbered in loop order
    (query-tile major for the fa2 forward, key-tile major otherwise); step ``n`` is kept
    when ``n % every == 0``.
    """
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    elem = pb.q.element_size()
    bq = torch.tensor([q1 - q0 for q0, q1 in qtiles], dtype=torch.int64)[:, None]  # (Tq, 1)
    bk = torch.tensor([k1 - k0 for k0, k1 in ktiles], dtype=torch.int64)[None, :]  # (1, Tk)
    bh, bkv = b * hq, b * hkv
    if pass_name == "backward":
        per = (bh * (4 * bq * bk + bq * d) + bkv * bk * (d + dv)) * elem
    else:
        rows = 2 * dv if pass_name == "forward fa2" else dv
        per = bh * (2 * bq * bk + 5 * bq + rows * bq) * elem
    if pb.dropout_p > 0.0:
        per = per + bh * bq * bk  # (Tq, Tk) bytes of one step's record
    run = torch.ones(len(qtiles), len(ktiles), dtype=torch.bool)
    if classes is not None:
        run = torch.tensor(classes) != EMPTY  # (Tq, Tk)
    if pass_name != "forward fa2":  # key-tile major
        run, per = run.T, per.T
    run, per = run.reshape(-1), per.expand(run.shape).reshape(-1)
    index = torch.cumsum(run.to(torch.int64), 0) - 1  # loop step number of each tile run
    kept = run & (index % every == 0)
    return int(per[kept].sum()), int(kept.sum()), int(run.sum())


def _check_trace_budget(
    pb: Problem,
    trace: Trace,
    classes: list[list[int]] | None,
    qtiles: Sequence[tuple[int, int]],
    ktiles: Sequence[tuple[int, int]],
    pass_name: str,
) -> None:
    """Raise ``ValueError`` before the loop runs when its records would exceed the budget."""
    budget = trace.max_bytes
    if budget is None:
        return
    need, kept, run = _record_bytes(pb, classes, qtiles, ktiles, pass_name, trace.every)
    if need <= budget:
        return
    every = trace.every
    k = max(every + 1, -(-need * every // max(budget, 1)))
    fits = None
    last = max(run, every + 1)  # every >= run keeps the first step alone
    while True:
        k = min(k, last)  # the doubling may pass ``run``: try the first step alone last
        size = _record_bytes(pb, classes, qtiles, ktiles, pass_name, k)[0]
        if size <= budget:
            fits = (k, size)
            break
        if k >= last:
            break
        k *= 2
    b, hq = pb.shape[:2]
    hint = (
        f"record fewer steps (trace=flashledger.Trace(every={fits[0]}) keeps every "
        f"{ordinal(fits[0])} step: {_size(fits[1])}), "
        if fits is not None
        else "use smaller tiles (even one step's record is over the budget), "
    )
    raise ValueError(
        f"trace: the {pass_name.split()[0]} ledger would record {_size(need)} ({kept:,} of "
        f"{run:,} tile steps, each with its tensors for all B·H = {b * hq} heads: records grow "
        f"as B·H·Lq·Lk), over the trace budget of {_size(budget)}; {hint}raise the budget "
        "(flashledger.Trace(max_bytes=...), None for no limit), or trace a shorter sequence "
        "or fewer heads"
    )


def _size(n: int) -> str:
    """Bytes as ``"1.24 GiB"``-style text."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


class _Book:
    """Counter bookkeeping shared by both passes.

    Full tiles are counted in closed form. Partial tiles and dropout need a
    sum over a boolean tile; those sums stay on the inputs' device and are
    read once, by ``flush`` (no host synchronisation per tile).
    """

    def __init__(self, pb: Problem, counters: Counters) -> None:
        b, hq = pb.shape[:2]
        self.bh = b * hq
        self.c = counters
        self._visible: torch.Tensor | None = None  # pending visible dots (0-d int64)
        self._dropped: torch.Tensor | None = None  # pending dropped entries (0-d int64)
        # user callables count their own tile calls and positions; the loop's share is
        # booked by ``flush`` from the difference
        self._masks = () if pb.mask is None else pb.mask.callers
        self._score = None if pb.smod.user is None else pb.smod.user.caller
        self._seen = self._tally()

    def _tally(self) -> tuple[int, int, int, int]:
        """Tile calls and positions of the mask_mods and of the score_mod so far."""
        sc = self._score
        return (
            sum(m.calls for m in self._masks),
            sum(m.positions for m in self._masks),
            0 if sc is None else sc.calls,
            0 if sc is None else sc.positions,
        )

    def skip(self) -> None:
        self.c.tiles_skipped += 1

    def run(
        self,
        kind: int,
        bq: int,
        bk: int,
        vis: torch.Tensor | None,
        keep: torch.Tensor | None,
        *,
        forward: bool,
        visible: int = 0,
    ) -> None:
        """Book one tile step; a partial tile's visible dots come from ``vis`` or, when
        the step counted them itself (``vis`` None), from ``visible``."""
        c = self.c
        c.tiles_run += 1
        area = bq * bk * self.bh
        c.qk_dots_computed += area
        if kind == FULL:
            c.tiles_full += 1
            c.qk_dots_visible += area
        else:
            c.tiles_partial += 1
            if vis is None:
                c.qk_dots_visible += visible
            else:
                self._visible = _pending(self._visible, vis, area)
        c.exps += area + (bq * self.bh if forward else 0)
        if keep is not None:
            dropped = ~keep if vis is None else (~keep & vis)
            self._dropped = _pending(self._dropped, dropped, area)

    def io(
        self, read: int = 0, write: int = 0, *, stats_read: int = 0, stats_written: int = 0
    ) -> None:
        """Book slow-memory traffic per (batch, query head): ``read`` and ``write``
        elements, of which ``stats_read`` and ``stats_written`` are entries of m, ℓ, the
        LSE or D (kept in float32 at least)."""
        self.c.elements_read += read * self.bh
        self.c.elements_written += write * self.bh
        self.c.stat_elements_read += stats_read * self.bh
        self.c.stat_elements_written += stats_written * self.bh

    def flush(self) -> None:
        """Move the pending on-device counts (and the user callables' calls) into the counters."""
        now, was = self._tally(), self._seen
        self.c.mask_mod_tiles += now[0] - was[0]
        self.c.mask_mod_evals += (now[1] - was[1]) * self.bh
        self.c.score_mod_tiles += now[2] - was[2]
        self.c.score_mod_evals += (now[3] - was[3]) * self.bh
        self._seen = now
        if self._visible is not None:
            self.c.qk_dots_visible += int(self._visible)
            self._visible = None
        if self._dropped is not None:
            self.c.dropped += int(self._dropped)
            self._dropped = None


def _pending(total: torch.Tensor | None, x: torch.Tensor, area: int) -> torch.Tensor:
    """Add the true entries of a broadcastable bool tile, counted over the full ``area``."""
    n = torch.count_nonzero(x) * (area // x.numel())  # 0-d int64 on x's device
    return n if total is None else total + n


class _Workspace:
    """Tile-sized buffers of one call, reused by every tile step.

    A fresh tile-sized tensor per step costs page faults and allocator work;
    the loop instead writes scores, probabilities, ``dP``/``dS`` and the
    on-chip ``dK_j``/``dV_j`` into these buffers with ``out=`` and in-place
    ops. ``get(slot, *shape)`` is a contiguous view of the slot's first
    elements (ragged tiles use a prefix); views are made once per shape.
    """

    def __init__(self, pb: Problem, sizes: Sequence[int]) -> None:
        self._slots = [torch.empty(n, dtype=pb.dtype, device=pb.geo.device) for n in sizes]
        self._views: dict[tuple[int, ...], torch.Tensor] = {}

    def get(self, slot: int, *shape: int) -> torch.Tensor:
        view = self._views.get((slot, *shape))
        if view is None:
            view = self._slots[slot][: math.prod(shape)].view(shape)
            self._views[(slot, *shape)] = view
        return view


# -- layout: the loop works on (B·Hkv, G·rows, ·) so one batched matmul covers every head --
def _rows(x5: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a query-side ``(B, Hkv, G, L, X)`` tensor as ``(B·Hkv, G·(r1-r0), X)``.

    A view when ``G = 1``; a copy for GQA (the query heads of one K/V head
    stacked, so each K/V tile is read once per group).
    """
    b, hkv, g, _, x = x5.shape
    return x5[..., r0:r1, :].reshape(b * hkv, g * (r1 - r0), x)


def _row_stats(r4: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``(B, Hkv, G, L)`` statistics as ``(B·Hkv, G·(r1-r0), 1)``."""
    b, hkv, g, _ = r4.shape
    return r4[..., r0:r1].reshape(b * hkv, g * (r1 - r0), 1)


def _keys(x5: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
    """Keys ``[k0, k1)`` of a key-side ``(B, Hkv, 1, L, X)`` tensor as a ``(B·Hkv, k1-k0, X)`` view."""
    b, hkv, _, _, x = x5.shape
    return x5[..., k0:k1, :].view(b * hkv, k1 - k0, x)


def _unflat(pb: Problem, x: torch.Tensor) -> torch.Tensor:
    """``(B·Hkv, G·rows, *)`` -> ``(B, Hkv, G, rows, *)`` (a view)."""
    b, _, hkv, g = pb.shape[:4]
    return x.view(b, hkv, g, -1, *x.shape[2:])


def _plain_scores(pb: Problem) -> bool:
    """True when the scores are just ``scale · q kᵀ`` (no softcap, ALiBi, bias or score_mod)."""
    sm = pb.smod
    return sm.softcap is None and sm.slopes is None and sm.bias is None and sm.user is None


def _scale_in_matmul(pb: Problem) -> bool:
    """A scale that is a power of two (``1/sqrt(d)`` for d = 4, 16, 64, 256...).

    Then ``scale · (q kᵀ)`` rounds exactly like the reference's ``(q kᵀ) · scale``
    and the scale rides on the matmul (alpha) for free, before any further
    transform of the scores (softcap, ALiBi, bias, score_mod); any other scale is
    applied afterwards, as the reference does, so the scores stay bit for bit
    the reference's.
    """
    return power_of_two(pb.smod.scale)


def _tile_scores(
    pb: Problem,
    ws: _Workspace,
    qi: torch.Tensor,
    kt: torch.Tensor,
    kind: int,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    *,
    grad: bool = False,
) -> tuple[torch.Tensor, TileGrad, torch.Tensor | None, torch.Tensor | None]:
    """``(s, ctx, vis, keep)`` of one tile: scores with the mask applied (partial tiles only).

    ``qi`` ``(B·Hkv, G·bq, d)``, ``kt`` = ``K_jᵀ`` ``(B·Hkv, d, bk)``; ``s``
    ``(B·Hkv, G·bq, bk)`` in workspace slot 0 (a power-of-two scale folded
    into the matmul); ``ctx``: what the backward needs of the score transform
    (``grad=True``: the score_mod's graph on the tile).
    """
    qk = ws.get(0, qi.shape[0], qi.shape[1], kt.shape[2])  # (B·Hkv, G·bq, bk)
    if _scale_in_matmul(pb):
        torch.baddbmm(qk, qi, kt, beta=0.0, alpha=pb.smod.scale, out=qk)
    else:
        torch.bmm(qi, kt, out=qk)
    return _finish_scores(pb, qk, kind, q0, q1, k0, k1, grad=grad)


def _finish_scores(
    pb: Problem,
    qk: torch.Tensor,
    kind: int,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    *,
    grad: bool = False,
) -> tuple[torch.Tensor, TileGrad, torch.Tensor | None, torch.Tensor | None]:
    """Final scores from the tile's ``q kᵀ`` ``(B·Hkv, G·bq, bk)`` (already scaled when the
    scale rides on the matmul).

    Returns ``(s, ctx, vis, keep)``: the transform's backward context
    (``TileGrad``), the visibility (partial tiles) and the dropout keep mask in
    the 5-D layout, or None.
    """
    s, ctx = qk, TileGrad()
    scaled = _scale_in_matmul(pb)
    if not (scaled and _plain_scores(pb)):
        s5, ctx = pb.smod.tile(_unflat(pb, qk), q0, q1, k0, k1, grad=grad, scaled=scaled)
        s = s5.reshape(qk.shape)
    vis = None
    if kind == PARTIAL:
        vis = pb.mask_tile(q0, q1, k0, k1)  # (Bm, Hkv|1, G|1, bq, bk)
        if ctx.user is not None:  # the score_mod's graph may have saved its output (tanh)
            s = _unflat(pb, s).masked_fill(~vis, -math.inf).reshape(qk.shape)
        else:
            _unflat(pb, s).masked_fill_(~vis, -math.inf)
    keep = pb.keep_tile(q0, q1, k0, k1)  # (B, Hkv, G, bq, bk) or None
    return s, ctx, vis, keep


def _seen_values(pb: Problem, vj: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """A partial tile's values with the keys no row of the tile sees set to 0, for a V that
    is not all finite: P is 0 there, and 0 x NaN would carry a value no row reads into
    every row of the tile, where the native step skips those columns. ``vj`` ``(B·Hkv, bk,
    d_v)`` or ``(B, Hkv, 1, bk, d_v)``, ``vis`` ``(Bm, Hkv|1, G|1, bq, bk)``."""
    b, hkv = pb.shape[0], pb.shape[2]
    seen = vis.any(dim=-2).any(dim=2).expand(b, hkv, vis.shape[-1])  # (B, Hkv, bk)
    return vj.masked_fill(~seen.reshape(*vj.shape[:-1], 1), 0)  # a key unseen: 0, not NaN


def _refuse_graph(
    where: str, tensors: dict[str, Any], score_mod: Any = None, q: Any = None
) -> None:
    """The loop fills buffers in place and records no graph: with grad mode on, an input that
    requires a gradient would silently get none from it (a tensor a ``score_mod`` captures
    too). Refuse, and name the op that does."""
    if not torch.is_grad_enabled():
        return
    names = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if callable(score_mod) and isinstance(q, torch.Tensor):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if find_captured(score_mod, dtype=acc, device=q.device):
            names.append("tensors the score_mod captures")
    if names:
        raise ValueError(
            f"{where} is not differentiable (its loop records no graph), but "
            f"{', '.join(names)} require{'s' if len(names) == 1 else ''} a gradient: use "
            "flash_attention(q, k, v, ...) for gradients, or pass detached tensors "
            "(or call it under torch.no_grad())"
        )


def _check_options(block_q: Any, block_k: Any, loop_order: Any) -> None:
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size is not None:
            check_size(name, size)
    if loop_order not in ("fa2", "fa1"):
        raise ValueError(f"loop_order must be 'fa2' or 'fa1', got {loop_order!r}")


def _new_ledger(pb: Problem, name: str, block_q: int, block_k: int, order: str) -> Ledger:
    lq, lk = pb.shape[4], pb.shape[5]
    led = Ledger(
        pass_name=name,
        block_q=block_q,
        block_k=block_k,
        loop_order=order,
        tiles_q=-(-lq // block_q),
        tiles_k=-(-lk // block_k),
        lead=pb.ndim - 2,
        element_bytes=pb.out_dtype.itemsize,
    )
    return led


def _classes(
    pb: Problem, block_q: int, block_k: int, ledger: Ledger | None = None
) -> list[list[int]] | None:
    """The mask's tile classes (None without a mask); with ``ledger``, set in it, and the
    positions a mask_mod was evaluated at to find them and the tiles decided without
    evaluating it booked (none when the bound mask knew them already)."""
    if pb.mask is None:
        if ledger is not None:
            ledger.set_tile_classes(None)
        return None
    callers = pb.mask.callers
    before = sum(m.positions for m in callers)
    bounded = pb.mask.tiles_bounded
    classes = pb.mask.tile_class_rows(block_q, block_k)
    if ledger is not None:
        b, hq = pb.shape[:2]
        ledger.counters.mask_mod_classify_evals += (sum(m.positions for m in callers) - before) * (
            b * hq
        )
        ledger.counters.mask_mod_tiles_bounded += pb.mask.tiles_bounded - bounded
        ledger.set_tile_classes(classes)
    return classes


def _workspace(pb: Problem, block_q: int, block_k: int) -> _Workspace:
    b, _, hkv, g, lq, lk = pb.shape[:6]
    return _Workspace(pb, [b * hkv * g * min(block_q, lq) * min(block_k, lk)])


def _native_step(pb: Problem, loop_order: str, observed: bool) -> _native.Kernels | None:
    """The native step when it applies (nothing observes the steps, FA2 order, CPU,
    float32/float64 accumulation, no dropout, plain scores or ``_additive_scores``) and is
    available; else None (the PyTorch step runs)."""
    if observed or loop_order != "fa2" or pb.geo.device.type != "cpu" or pb.has_dropout:
        return None
    if pb.dtype not in (torch.float32, torch.float64):
        return None
    if _plain_scores(pb):
        return _native.kernels()
    if not _additive_scores(pb):
        return None
    kern = _native.kernels()
    return None if kern is None or _half_step(pb, kern) else kern


def _alibi_args(pb: Problem) -> _native.Alibi | None:
    """ALiBi as the native passes compute it (``_native.Alibi``), or None (no ALiBi, or
    ALiBi laid out per tile with the other terms: ``_scores_in_pass``): each row's slope
    and the local key its distances run from, as ``ScoreMod.tile`` reads them."""
    if pb.smod.slopes is None or not _scores_in_pass(pb):
        return None
    b, hq, hkv, g, lq = pb.shape[:5]
    geo, slopes = pb.geo, pb.smod.slopes
    assert slopes is not None
    slope = slopes.expand(b, hkv, g, lq, 1).reshape(b * hq, lq)  # (B·Hq, Lq)
    if pb.smod.alibi_key_index:  # + slope · (j - first key)
        center, form = geo.k_lo, 2  # (Bg, Lq) global
    else:  # - slope · |i + offset - j|
        center, form = geo.rows()[None, :] + geo.off_br, 1  # (Bg, Lq) global
    center = center - geo.k_offset  # local keys
    center = center.expand(b, lq)[:, None, :].expand(b, hq, lq).reshape(b * hq, lq)
    return _native.Alibi(slope, center, form)


def _scores_in_pass(pb: Problem) -> bool:
    """True when a native pass forms the final scores itself, no term laid out per tile:
    no bias and no score_mod (plain scores; a softcap, which the passes apply first, as
    ``ScoreMod.tile`` does, and ALiBi, ``_alibi_args``, either or both)."""
    return pb.smod.bias is None and pb.smod.user is None


def _additive_scores(pb: Problem) -> bool:
    """True when the scores are ``scale · q kᵀ``, capped or not (a softcap comes first),
    plus terms that do not depend on them: ALiBi, a bias and a score_mod that adds to the
    score (``_mods.adds_to_score``, probed once on the problem's first rows and keys), any
    of them: the native passes cap the scores and add the terms themselves (ALiBi alone
    computed in the pass, any other term laid out per tile: ``_ScoreTerms``)."""
    sm = pb.smod
    if sm.user is None:
        return True
    rows = pb.geo.rows()  # (Lq,) global
    keys = torch.arange(pb.shape[5], device=pb.geo.device) + pb.geo.k_offset  # (Lk,)
    return sm.user.probe_additive(rows, keys)


def _half_inputs(pb: Problem, kern: _native.Kernels | None) -> torch.dtype | None:
    """The half dtype (bfloat16/float16) of q, k and v when the native step runs them with
    float32 sums (on the half step or the float32 step: ``_half_step``, ``_widened``), else
    None."""
    dt = pb.out_dtype  # q's
    if kern is None or dt not in _HALF or pb.dtype != torch.float32:
        return None
    return dt if pb.k_in.dtype == pb.v_in.dtype == dt else None


def _half_step(pb: Problem, kern: _native.Kernels | None) -> bool:
    """True when the native step runs bfloat16/float16 inputs in their dtype (products on
    MKL's half gemm, float32 sums: the path its calibration chose for the dtype), False
    when they run on the float32 step (``_widened``) or are not half."""
    dt = _half_inputs(pb, kern)
    return dt is not None and kern is not None and kern.half_step(dt)


def _widened(pb: Problem, kern: _native.Kernels | None) -> bool:
    """True when bfloat16/float16 inputs run on the float32 step (the path its calibration
    chose for the dtype, not the half step) read in their dtype, each row widened to float32
    as a pass reads it: the float32 step's results on the inputs converted, with no float32
    copy of Q, K, V or dO (``Kernels.forward``'s and ``backward``'s ``widen``)."""
    dt = _half_inputs(pb, kern)
    return dt is not None and kern is not None and not kern.half_step(dt)


def _resolve_tiles(
    pb: Problem,
    kern: _native.Kernels | None,
    block_q: int | None,
    block_k: int | None,
    *,
    forward: bool = False,
) -> tuple[int, int]:
    """``block_q``, ``block_k`` as given, or (None) the default: the tiles the native step
    chose by measurement on this machine for this dtype (the half path's for half inputs
    on it) when it runs, else 512 x 512. A ``forward`` pass takes the forward's own
    measured tiles, unless a mask_mod's evaluations are kept for the backward (they are
    kept per tile: both passes then share the tiles). With a term laid out per tile (a
    bias, an additive score_mod; ``_scores_in_pass``) the native step's tiles are at least
    512 x 512: the term is evaluated once per tile in each pass, and on tiles of 256² the
    calls' own cost outweighs what the smaller tiles gain (docs/perf.md)."""
    if kern is None:
        dq, dk = DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K
    else:
        plain = _scores_in_pass(pb)  # else a term is laid out per tile
        own = forward and (pb.mask is None or not pb.mask.callers) and plain
        dq, dk = kern.tiles(pb.out_dtype if _half_step(pb, kern) else pb.dtype, forward=own)
        if not plain:
            dq, dk = max(dq, DEFAULT_BLOCK_Q), max(dk, DEFAULT_BLOCK_K)
    return (dq if block_q is None else block_q), (dk if block_k is None else block_k)


def _native_vis(
    pb: Problem, intervals: bool, kind: int, q0: int, q1: int, k0: int, k1: int
) -> tuple[torch.Tensor | None, tuple[int, int, int] | None]:
    """A tile's visibility for the native step: ``(tile, (address, stride per K/V head,
    stride per group member))``, ``tile`` the uint8 bytes the step reads (strides 0 where
    the mask broadcasts); both None for a full tile. A pass given an interval mask needs
    no bytes: the step reads its intervals (address 0). Either way the step counts the
    visible dots."""
    if kind != PARTIAL:
        return None, None
    if intervals:
        return None, (0, 0, 0)
    vis = pb.mask_tile(q0, q1, k0, k1)  # (Bm, Hkv|1, G|1, bq, bk)
    area = (q1 - q0) * (k1 - k0)
    if vis.shape[:3] == (1, 1, 1):
        tile = vis.reshape(q1 - q0, k1 - k0).contiguous().view(torch.uint8)  # (bq, bk)
        return tile, (tile.data_ptr(), 0, 0)
    b, _, hkv, g = pb.shape[:4]
    tile = vis.expand(b, hkv, g, q1 - q0, k1 - k0).contiguous().view(torch.uint8)
    return tile, (tile.data_ptr(), g * area, area)


def _row_dots(
    x5: torch.Tensor, y5: torch.Tensor, dt: torch.dtype, kern: _native.Kernels | None = None
) -> torch.Tensor:
    """``rowsum(x ⊙ y)`` in ``dt`` of two ``(..., L, n)`` tensors of one shape (``D =
    rowsum(dO ⊙ O)``): with the native step's ``kern`` and both of one dtype, ``dt`` or a
    half one with ``dt`` float32, its one pass over both (``Kernels.row_dots``); else in
    slabs of rows as the checks go (``_checks.pieces``). No product, and no copy of an
    input in ``dt``, of the whole size. ``(..., L)``."""
    half = dt == torch.float32 and x5.dtype in _HALF
    if kern is not None and x5.dtype == y5.dtype and (x5.dtype == dt or half):
        return kern.row_dots(x5.contiguous(), y5.contiguous())
    parts = zip(pieces(x5), pieces(y5), strict=True)
    return torch.cat([(xs.to(dt) * ys.to(dt)).sum(dim=-1) for xs, ys in parts], dim=-1)


def _native_rows(pb: Problem, x5: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A ``(B, Hkv, G|1, L, X)`` tensor as contiguous ``(B·Hkv·(G|1), L, X)`` in ``dtype``
    (default: the loop's; a view when it is one already)."""
    dt = dtype or pb.dtype
    return _flat(x5 if x5.dtype == dt else x5.to(dt))


def _flat(x5: torch.Tensor) -> torch.Tensor:
    """``(B, Hkv, G|1, L, X)`` as contiguous ``(B·Hkv·(G|1), L, X)``, in its own dtype."""
    x = x5 if x5.is_contiguous() else x5.contiguous()
    return x.view(-1, *x.shape[-2:])


def _native_common(pb: Problem, ran: list[tuple[int, int, int, int, int]]) -> dict[str, Any]:
    """The native pass arguments every pass shares: group size, scale, query heads per
    batch and, when a partial tile of the pass ``ran`` reads it, an interval mask (local
    half-open ``[lo, hi)`` per row; a pass of full tiles, as a decode step's, needs none)."""
    iv = None
    if isinstance(pb.mask, IntervalBound) and any(t[0] == PARTIAL for t in ran):
        iv = pb.mask.local_intervals()  # (Bm, Lq) each
    return dict(
        group=pb.shape[3],
        scale=pb.smod.scale,
        heads_per_batch=pb.shape[1],
        intervals=iv,
        alibi=_alibi_args(pb),
        softcap=pb.smod.softcap,
    )


def _native_schedule(
    pb: Problem,
    book: _Book,
    outer: Sequence[tuple[int, int]],
    inner: Sequence[tuple[int, int]],
    kind_of: Any,
    *,
    forward: bool,
    first: int = 0,
    term_of: Callable[[int, int, int, int, int], tuple[Any, Any]] | None = None,
) -> tuple[_native.Schedule, list[tuple[int, int, int, int, int]]]:
    """The pass's schedule for the native step, built by the loop's own schedule
    (``_running``: empty tiles booked as skipped, left out): rows are the outer tiles
    (forward: query tiles; backward: key tiles), each with the inner tiles that run, in
    order. Also returns each run tile's ``(kind, q0, q1, k0, k1)`` for the booking.
    ``outer`` may be a run of the pass's outer tiles, the first of them tile ``first``;
    ``term_of(kind, q0, q1, k0, k1)`` gives each run tile's ``(term, ds)`` (see
    ``_native.Schedule.add``)."""
    sched = _native.Schedule()
    ran: list[tuple[int, int, int, int, int]] = []
    intervals = isinstance(pb.mask, IntervalBound)
    for n, (a0, a1) in enumerate(outer, start=first):
        tiles = (
            _running(book, inner, kind_of, i=n) if forward else _running(book, inner, kind_of, j=n)
        )
        for _, b0, b1, kind in tiles:
            q0, q1, k0, k1 = (a0, a1, b0, b1) if forward else (b0, b1, a0, a1)
            tile, where = _native_vis(pb, intervals, kind, q0, q1, k0, k1)
            term, ds = (None, None) if term_of is None else term_of(kind, q0, q1, k0, k1)
            sched.add(q0, q1, k0, k1, where, alive=tile, term=term, ds=ds)
            ran.append((kind, q0, q1, k0, k1))
        sched.end_row(a0, a1)
    return sched, ran


def _bf16_rows(pb: Problem, in_place: bool) -> torch.Tensor | None:
    """q's rows ``(B·Hq, Lq, d)`` as the caller gave them, for a bfloat16 q reading a
    bfloat16 cache in place (exactly the float32 q's values: the step's dot products then
    take them as they are); None otherwise."""
    if in_place and pb.q_in.dtype == pb.k_in.dtype == torch.bfloat16:
        return _flat(pb.q_in)
    return None


def _forward_operands(
    pb: Problem, kern: _native.Kernels, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``(B·Hq, Lq, d)``, k ``(B·Hkv, Lk, d)``, v ``(B·Hkv, Lk, d_v)`` as the native
    forward reads them: in the inputs' half dtype on the half path (K then laid out as
    Kᵀ) and on the float32 step widening them (``_widened``), else q in the loop's dtype
    and K/V too, or as they are when read in place (a half-precision cache). A K or V
    converted here is booked in ``pb.kv_bytes_copied``."""
    if (_half_step(pb, kern) or _widened(pb, kern)) and not in_place:
        q, dt = _native_rows(pb, pb.q_in, pb.out_dtype), pb.out_dtype
    else:
        q = _native_rows(pb, pb.q)
        dt = pb.k_in.dtype if in_place and pb.k_in.dtype in _HALF else pb.dtype
    k, v = _native_rows(pb, pb.k_in, dt), _native_rows(pb, pb.v_in, dt)
    for x, given in ((k, pb.k_in), (v, pb.v_in)):
        if x.data_ptr() != given.data_ptr():  # laid out anew: converted to dt
            pb.kv_bytes_copied += x.numel() * x.element_size()
    return q, k, v


def _native_forward_plan(
    pb: Problem,
    kern: _native.Kernels,
    book: _Book,
    kind_of: Any,
    block_q: int,
    block_k: int,
) -> tuple[
    list[tuple[int, int]],
    _native.Schedule,
    list[tuple[int, int, int, int, int]],
    dict[str, Any],
]:
    """What a native forward runs, from the shapes and the mask alone: the query tiles,
    the schedule, the tiles it runs (for the booking) and the pass's arguments besides
    its operands (``Kernels.forward``'s, ``ForwardPass``'s: the interval mask and the
    work split on this thread's thread count). Rows per work item are a whole tile, or
    fewer when the heads alone cannot fill the threads; one query tile (decode) stacks a
    group's query heads as one block of rows, and with a few rows against many keys K is
    read in place (a Kᵀ would cost as much traffic as the attention; a half cache is
    widened as it is read); when the items are still too few to balance, each row's key
    tiles are split into parts (flash-decoding). ``_forward_native`` runs it; the planned
    lane (``_lane``) keeps it for its plans."""
    b, hq, hkv, g, lq, lk = pb.shape[:6]
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    sched, ran = _native_schedule(pb, book, qtiles, ktiles, kind_of, forward=True)
    threads, rows = kern.max_threads(), min(block_q, lq)
    stacked = len(qtiles) == 1  # decode: the group's rows share their K/V tiles
    units = b * hkv if stacked else b * hq
    rows = g * lq if stacked else rows
    chunk = _rows_per_item(units, rows, threads)
    items = units * -(-rows // chunk) * len(qtiles)
    splits = 1
    if items < 4 * threads:  # too few to balance: split each row's key tiles
        splits = max(1, min(sched.longest_row(), -(-4 * threads // items), 16))
    args = dict(
        chunk=chunk,
        splits=splits,
        stacked=stacked,
        keys_in_place=_keys_in_place(pb, block_q),
        **_native_common(pb, ran),
    )
    return qtiles, sched, ran, args


def _keys_in_place(pb: Problem, block_q: int) -> bool:
    """True when a native forward with query tiles of ``block_q`` reads K in place (one
    query tile, a group's rows stacked, at most 64 of them: ``_native_forward_plan``): its
    scores are dot products summed in its own order, which the backward then follows
    (``Kernels.backward``'s ``dot_scores``)."""
    g, lq = pb.shape[3:5]
    return len(_tiles(lq, block_q)) == 1 and g * lq <= 64


def _rows_per_item(units: int, rows: int, threads: int) -> int:
    """Query rows per forward work item: a tile's ``rows``, halved (not below 32) while
    ``units`` tiles of items cannot keep the ``threads`` busy."""
    chunk = rows
    while units * -(-rows // chunk) < threads and chunk > 32:
        chunk = -(-chunk // 2)
    return chunk


def _backward_splits(key_tiles: int, kern: _native.Kernels, kv_heads: int) -> int:
    """Parts of the key tiles a native backward runs apart (each with a dQ of its own):
    enough items for twice the threads across ``kv_heads``, at most 8."""
    return max(1, min(key_tiles, -(-2 * kern.max_threads() // kv_heads), 8))


def _kind_of(classes: list[list[int]] | None) -> Any:
    """``kind_of(i, j)``: tile (i, j)'s class from the mask's classes (every tile full
    without a mask)."""
    return (lambda i, j: FULL) if classes is None else (lambda i, j: classes[i][j])


def _forward_native(
    pb: Problem,
    kern: _native.Kernels,
    ledger: Ledger,
    kind_of: Any,
    book: _Book,
    block_q: int,
    block_k: int,
    o_finite: list[bool] | None = None,
    row_max: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Ledger]:
    """The FA2 forward loop as one native call (see ``_native``).

    The schedule (skipped and partial tiles), the booking and the per-query-tile state
    ``(m, ℓ, acc)``, finalised when the tile's keys are done, are the PyTorch loop's; the
    native pass runs each (query tile, head, row chunk) through its key tiles in order.
    When the query tiles alone cannot keep the threads busy (decode: a few query rows
    against many keys), a group's query heads run as one block of rows and each row's
    key tiles are split into parts attended apart (flash-decoding), merged by the one
    merge's rule (``online.merge_partials``) in the same native call (a dozen small
    tensor operations cost more than a decode step's arithmetic), from each part's
    running max and row sum: a part's rounded LSE would weigh its keys apart from the
    other parts', which the backward's P, rebuilt from one LSE per row, cannot follow. Half
    inputs on the half path stay in their dtype, and with ``o_finite`` so does O (one
    part: the pass rounds it and checks it as it writes it; see ``_forward``).
    """
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    if not _scores_in_pass(pb):
        return _forward_native_scored(pb, kern, ledger, kind_of, book, block_q, block_k, row_max)
    qtiles, sched, ran, args = _native_forward_plan(pb, kern, book, kind_of, block_q, block_k)
    in_place = args["keys_in_place"]
    q, k, v = _forward_operands(pb, kern, in_place)
    half_o = o_finite is not None and q.dtype in _HALF and args["splits"] == 1
    got: list[torch.Tensor] | None = None if row_max is None else []  # (B·Hq, Lq)
    laid: list[int] = []  # bytes of the K/V layout the pass writes (Kᵀ), if it lays one out
    o, lse = kern.forward(
        q,
        k,
        v,
        sched,
        merge=True,  # the one merge's rule, every part at once, in the same native pass
        q16=_bf16_rows(pb, in_place),
        out_dtype=q.dtype if half_o else None,
        o_finite=o_finite,
        row_max=got,
        widen=_widened(pb, kern) and not in_place,
        laid_out=laid,
        **args,
    )  # (B·Hq, Lq, d_v), (B·Hq, Lq)
    pb.kv_bytes_copied += sum(laid)
    if row_max is not None and got:
        row_max.append(got[0].view(b, hkv, g, lq))
    _book_native(book, ran, sched.seen, d, dv, forward=True, outer=qtiles)
    book.flush()
    return o.view(b, hkv, g, lq, dv), lse.view(b, hkv, g, lq), ledger


def _book_native(
    book: _Book,
    ran: list[tuple[int, int, int, int, int]],
    seen: list[int],
    d: int,
    dv: int,
    *,
    forward: bool,
    outer: Sequence[tuple[int, int]],
) -> None:
    """Book the tiles a native pass ran (a partial tile's visible dots as the step counted
    them) and their slow-memory traffic, as the PyTorch loop books them: per tile, then
    per ``outer`` tile (the forward's query tiles: Q_i read where a tile ran, O and λ
    written; the backward's key tiles: K_j, V_j read where a tile ran, dK_j, dV_j
    written)."""
    for t, (kind, q0, q1, k0, k1) in enumerate(ran):
        book.run(kind, q1 - q0, k1 - k0, None, None, forward=forward, visible=seen[t])
        if forward:
            book.io(read=(k1 - k0) * (d + dv))
        else:
            book.io(
                read=(q1 - q0) * (2 * d + dv + 2), write=(q1 - q0) * d, stats_read=2 * (q1 - q0)
            )
    read = {t[1] if forward else t[3] for t in ran}  # outer tiles with a tile run
    for a0, a1 in outer:
        if forward:
            if a0 in read:
                book.io(read=(a1 - a0) * d)
            book.io(write=(a1 - a0) * (dv + 1), stats_written=a1 - a0)
        else:
            if a0 in read:
                book.io(read=(a1 - a0) * (d + dv))
            book.io(write=(a1 - a0) * (d + dv))


def _backward_native(
    pb: Problem,
    kern: _native.Kernels,
    do5: torch.Tensor,
    lse_safe: torch.Tensor,
    d_eff: torch.Tensor,
    ledger: Ledger,
    kind_of: Any,
    book: _Book,
    block_q: int,
    block_k: int,
    half: bool,
    dot_scores: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward loop as one native call: ``(dq, dk, dv, dbias5)``, 5-D (``dbias5``:
    the bias's gradient, None without a bias). ``dot_scores``: its forward read K in place
    (``_keys_in_place``; plain scores only), and the pass forms S as that forward did.

    Work items are (K/V head, part of the key tiles): each key tile's ``dK_j``, ``dV_j``
    accumulate over its query tiles and the group's query heads in the item's scratch;
    with several parts, each keeps a ``dQ`` of its own, added up in order. ``half``: q, k,
    v and dO in the inputs' half dtype (the half path), the gradients float32.
    """
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    dt = pb.dtype
    heads = b * hq
    if not _scores_in_pass(pb):
        return _backward_native_scored(
            pb, kern, do5, lse_safe, d_eff, kind_of, book, block_q, block_k
        )
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    sched, ran = _native_schedule(pb, book, ktiles, qtiles, kind_of, forward=False)
    splits = _backward_splits(len(ktiles), kern, b * hkv)
    widen = _widened(pb, kern) and do5.dtype == pb.out_dtype
    narrow = half or widen  # read in the inputs' half dtype
    xs = (pb.q_in, pb.k_in, pb.v_in, do5) if narrow else (pb.q, pb.k, pb.v, do5)
    q, k, v, do = (_native_rows(pb, x, pb.out_dtype if narrow else dt) for x in xs)
    # half inputs: dK and dV written in their dtype by the pass (dQ, summed over the key
    # tiles, stays float32 until the caller converts it)
    out = pb.out_dtype if pb.out_dtype in _HALF and dt == torch.float32 else None
    dq, dk, dv_ = kern.backward(
        q,
        k,
        v,
        do,
        lse_safe.to(dt).reshape(heads, lq).contiguous(),
        d_eff.to(dt).reshape(heads, lq).contiguous(),
        sched,
        splits=splits,
        out_dtype=out,
        widen=widen,
        dot_scores=dot_scores,
        **_native_common(pb, ran),
    )
    _book_native(book, ran, sched.seen, d, dv, forward=False, outer=ktiles)
    dq5, dk5 = dq.view(b, hkv, g, lq, d), dk.view(b, hkv, 1, lk, d)
    return dq5, dk5, dv_.view(b, hkv, 1, lk, dv), None


SLAB_BYTES = 64 << 20
"""The most memory a native pass with a term laid out per tile (a bias, a score_mod)
holds for the terms of its tiles (and their dS) at once: the pass runs in slabs of whole
tile rows (query tiles in the forward, key tiles in the backward) whose run tiles' terms
fit, at least one row each: memory linear in L."""


ROW_BYTES = 256 << 20
"""The most memory one tile row's terms and their dS may take on the native step; a
longer row (a long sequence, many heads) runs on the PyTorch step, whose memory is a
tile's."""


def _with_terms_that_fit(
    pb: Problem, kern: _native.Kernels | None, block_q: int, block_k: int
) -> _native.Kernels | None:
    """``kern``, or None (the PyTorch step) when the scores' terms would run on it and
    one tile row of them, with their dS, would take more than ``ROW_BYTES``: the forward's
    (``block_q`` x Lk) or the backward's (``block_k`` x Lq), so that both passes decide
    alike (the backward rebuilds P on the step its forward ran on)."""
    if kern is None or _scores_in_pass(pb):
        return kern
    b, hq, _, _, lq, lk = pb.shape[:6]
    row = max(min(block_q, lq) * lk, min(block_k, lk) * lq)
    return kern if 2 * b * hq * row * pb.dtype.itemsize <= ROW_BYTES else None


def _slabs(
    pb: Problem,
    outer: Sequence[tuple[int, int]],
    inner: Sequence[tuple[int, int]],
    kind_of: Any,
    *,
    forward: bool,
    buffers: int,
) -> list[tuple[int, int]]:
    """Runs ``[s0, s1)`` of the outer tiles whose run tiles' terms (``buffers`` per tile,
    ``(B·Hq, r, c)`` each) fit in ``SLAB_BYTES`` together, at least one outer tile each."""
    b, hq = pb.shape[:2]
    unit = buffers * b * hq * pb.dtype.itemsize
    out, s0, used = [], 0, 0
    for n, (a0, a1) in enumerate(outer):
        area = sum(
            (a1 - a0) * (c1 - c0)
            for m, (c0, c1) in enumerate(inner)
            if (kind_of(n, m) if forward else kind_of(m, n)) != EMPTY
        )
        if n > s0 and used + area * unit > SLAB_BYTES:
            out.append((s0, n))
            s0, used = n, 0
        used += area * unit
    out.append((s0, len(outer)))
    return out


class _ScoreTerms:
    """The scores' additive term for each tile a native pass runs (``term_of``, the
    schedule's callback): ALiBi, the bias and a score_mod's ``score_mod(0, ...)`` on a zero
    score, through the PyTorch step's own ``ScoreMod.tile`` (one call of the score_mod per
    tile, as that step calls and books it), ``(B·Hq, r, c)`` in the loop's dtype. With
    ``graphs`` (the backward) a score_mod's call keeps its graph and is checked to add to
    the score (``_mods.adds_to_score``); with ``ds`` each tile gets a buffer for dS of the
    final scores, from which ``vjp`` adds the captured tensors' gradients and the bias's
    (``dbias``, a ``_BiasGrad``). A bias alone (no ALiBi, no score_mod) is its own term: the
    pass reads it where it lies (``_native.TermView``), with no copy per tile."""

    def __init__(self, pb: Problem, *, graphs: bool = False, ds: bool = False) -> None:
        self.pb, self.graphs, self.want_ds = pb, graphs, ds
        self.kept: list[tuple[Any, torch.Tensor, tuple[int, int, int, int]]] = []
        self.zero = torch.zeros((), dtype=pb.dtype, device=pb.geo.device)
        bias = pb.smod.bias
        self.dbias = None if bias is None or not ds else _BiasGrad(bias, pb)
        self.view = self._bias_view(pb)

    @staticmethod
    def _bias_view(pb: Problem) -> tuple[int, torch.Tensor] | None:
        """How a pass reads the bias where it lies, when the term is the bias alone (no
        ALiBi, no score_mod; in the pass's dtype, keys contiguous): its row stride and each
        query head's offset ``(B·Hq,)``, in elements; None otherwise."""
        sm, dt = pb.smod, pb.dtype
        bias = sm.bias  # (B|1, Hkv|1, G|1, Lq|1, Lk)
        if bias is None or sm.slopes is not None or sm.user is not None or bias.dtype != dt:
            return None
        if bias.shape[-1] == 1 or bias.stride(-1) != 1 or bias.device.type != "cpu":
            return None
        return (0 if bias.shape[-2] == 1 else bias.stride(-2)), _head_offsets(bias, pb)

    def term_of(self, kind: int, q0: int, q1: int, k0: int, k1: int) -> tuple[Any, Any]:
        pb = self.pb
        b, hq, hkv, g = pb.shape[:4]
        if self.view is not None:  # the bias alone: read by the pass where it lies
            bias, geo = pb.smod.bias, pb.geo
            assert bias is not None
            row_stride, heads = self.view
            term = _in_place(bias, row_stride, heads, geo.q_offset + q0, geo.k_offset + k0)
            return term, self._ds(kind, None, q0, q1, k0, k1)
        zero = self.zero.expand(b, hkv, g, q1 - q0, k1 - k0)  # (B, Hkv, G, r, c), no memory
        out, ctx = pb.smod.tile(zero, q0, q1, k0, k1, grad=self.graphs, inplace=False, scaled=True)
        if ctx.user is not None and not adds_to_score(ctx.user):
            raise RuntimeError(
                "the score_mod added a term to the score on its first positions but not on "
                f"queries {q0}-{q1 - 1} x keys {k0}-{k1 - 1}: it must compute each position "
                "alike (pointwise, as FlexAttention requires)"
            )
        ds = self._ds(kind, ctx.user, q0, q1, k0, k1)
        return out.reshape(b * hq, q1 - q0, k1 - k0).contiguous(), ds  # (B·Hq, r, c)

    def _ds(self, kind: int, user: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
        """The tile's buffer for dS (None without ``ds``), kept with the score_mod's graph
        for ``vjp``; the pass writes the positions it computes (zeros where masked). With
        the bias alone as the term, the bias's gradient itself where it can take dS as it
        is (``_BiasGrad.direct``): nothing kept, nothing copied."""
        if not self.want_ds:
            return None
        if user is None and self.view is not None and self.dbias is not None:
            direct = self.dbias.direct(kind, q0, q1, k0, k1)
            if direct is not None:
                return direct
        pb = self.pb
        make = torch.zeros if kind == PARTIAL else torch.empty
        ds = make(pb.shape[0] * pb.shape[1], q1 - q0, k1 - k0, dtype=pb.dtype, device=pb.geo.device)
        self.kept.append((user, ds, (q0, q1, k0, k1)))
        return ds  # (B·Hq, r, c)

    def vjp(self) -> None:
        """The captured tensors' gradients and the bias's from each kept tile's dS (the
        score's own is dS: the term does not depend on it); then the graphs go."""
        pb = self.pb
        user = pb.smod.user
        b, hq, hkv, g = pb.shape[:4]
        for ctx, ds, (q0, q1, k0, k1) in self.kept:
            if user is not None and ctx is not None:
                user.vjp_captured(ctx, ds.view(b, hq, *ds.shape[1:]))
            if self.dbias is not None:
                self.dbias.add(ds.view(b, hkv, g, *ds.shape[1:]), q0, q1, k0, k1)
        self.kept.clear()


def _forward_native_scored(
    pb: Problem,
    kern: _native.Kernels,
    ledger: Ledger,
    kind_of: Any,
    book: _Book,
    block_q: int,
    block_k: int,
    row_max: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, Ledger]:
    """The forward on the native step with a term laid out per tile (a bias, an additive
    score_mod, ALiBi with either: ``_additive_scores``): in slabs of query tiles, the term
    of each tile that runs evaluated (``_ScoreTerms``) and added by the pass to its scores."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    heads = b * hq
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    q, k, v = _forward_operands(pb, kern, False)
    widen = _widened(pb, kern)
    o = torch.empty(heads, lq, dv, dtype=pb.dtype)  # (B·Hq, Lq, d_v)
    lse = torch.empty(heads, lq, dtype=pb.dtype)  # (B·Hq, Lq)
    m_all = None if row_max is None else torch.empty(heads, lq, dtype=pb.dtype)
    threads, rows = kern.max_threads(), min(block_q, lq)
    terms = _ScoreTerms(pb)
    slabs = _slabs(pb, qtiles, ktiles, kind_of, forward=True, buffers=1)
    lay = pb.dtype if widen else None  # Kᵀ widened to float32, or in k's dtype
    kt = kern.transposed_k(k, block_k, lay) if len(slabs) > 1 else None  # once, every slab
    laid: list[int] = [] if kt is None else [k.numel() * kt.element_size()]
    for s0, s1 in slabs:
        slab = qtiles[s0:s1]
        sched, ran = _native_schedule(
            pb, book, slab, ktiles, kind_of, forward=True, first=s0, term_of=terms.term_of
        )
        r0, r1 = slab[0][0], slab[-1][1]
        chunk = _rows_per_item(heads * len(slab), rows, threads)
        got: list[torch.Tensor] | None = None if row_max is None else []
        o_s, lse_s = kern.forward(
            q,
            k,
            v,
            sched,
            merge=True,
            row_max=got,
            chunk=chunk,
            kt=kt,
            widen=widen,
            laid_out=laid,
            **_native_common(pb, ran),
        )  # (B·Hq, Lq, d_v), (B·Hq, Lq): the slab's rows written
        o[:, r0:r1], lse[:, r0:r1] = o_s[:, r0:r1], lse_s[:, r0:r1]
        if m_all is not None and got:
            m_all[:, r0:r1] = got[0][:, r0:r1]
        _book_native(book, ran, sched.seen, d, dv, forward=True, outer=slab)
    if kt is not None:
        kern.give_back_kt(kt)
    pb.kv_bytes_copied += sum(laid)
    book.flush()
    if row_max is not None and m_all is not None:
        row_max.append(m_all.view(b, hkv, g, lq))
    return o.view(b, hkv, g, lq, dv), lse.view(b, hkv, g, lq), ledger


def _backward_native_scored(
    pb: Problem,
    kern: _native.Kernels,
    do5: torch.Tensor,
    lse_safe: torch.Tensor,
    d_eff: torch.Tensor,
    kind_of: Any,
    book: _Book,
    block_q: int,
    block_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward on the native step with a term added to the scores (ALiBi, bias, an
    additive score_mod): in slabs of key tiles, each tile's term evaluated (a score_mod's
    with its graph), the pass adding it to its scores and writing dS of the final scores
    back, from which each tile's vector-Jacobian product gives the captured tensors'
    gradients and the bias's. Returns ``(dq, dk, dv, dbias5)`` (``dbias5`` None without a
    bias)."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    dt = pb.dtype
    heads = b * hq
    user = pb.smod.user
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    widen = _widened(pb, kern) and do5.dtype == pb.out_dtype
    xs = (pb.q_in, pb.k_in, pb.v_in, do5) if widen else (pb.q, pb.k, pb.v, do5)
    q, k, v, do = (_native_rows(pb, x, pb.out_dtype if widen else dt) for x in xs)
    lam = lse_safe.to(dt).reshape(heads, lq).contiguous()
    dd = d_eff.to(dt).reshape(heads, lq).contiguous()
    dq = torch.zeros(heads, lq, d, dtype=dt)  # (B·Hq, Lq, d)
    dk = torch.empty(b * hkv, lk, d, dtype=dt)  # (B·Hkv, Lk, d)
    dv_ = torch.empty(b * hkv, lk, dv, dtype=dt)  # (B·Hkv, Lk, d_v)
    grads = (user is not None and bool(user.captured)) or pb.smod.bias is not None
    terms = _ScoreTerms(pb, graphs=True, ds=grads)
    slabs = _slabs(pb, ktiles, qtiles, kind_of, forward=False, buffers=2 if grads else 1)
    for s0, s1 in slabs:
        slab = ktiles[s0:s1]
        sched, ran = _native_schedule(
            pb, book, slab, qtiles, kind_of, forward=False, first=s0, term_of=terms.term_of
        )
        c0, c1 = slab[0][0], slab[-1][1]
        splits = _backward_splits(len(slab), kern, b * hkv)
        dq_s, dk_s, dv_s = kern.backward(
            q,
            k,
            v,
            do,
            lam,
            dd,
            sched,
            splits=splits,
            widen=widen,
            **_native_common(pb, ran),
        )
        dq += dq_s
        dk[:, c0:c1], dv_[:, c0:c1] = dk_s[:, c0:c1], dv_s[:, c0:c1]
        terms.vjp()
        _book_native(book, ran, sched.seen, d, dv, forward=False, outer=slab)
    return (
        dq.view(b, hkv, g, lq, d),
        dk.view(b, hkv, 1, lk, d),
        dv_.view(b, hkv, 1, lk, dv),
        None if terms.dbias is None else terms.dbias.done(qtiles, ktiles),
    )


# ----------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------
@autocast_off
def _forward(
    pb: Problem,
    *,
    block_q: int | None,
    block_k: int | None,
    loop_order: str,
    trace: Trace | None,
    observer: Any,
    o_finite: list[bool] | None = None,
    row_max: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Ledger]:
    """The forward loop. Returns ``o`` ``(B, Hkv, G, Lq, d_v)``, ``lse`` with -inf on empty rows.

    ``o`` in the loop's dtype, except with ``o_finite`` (a list): the native half step may
    then write O in its own dtype, checked as written (``True`` appended to the list; see
    ``_native.ForwardPass.run``). ``row_max`` (a list): the running max ``m`` each row
    ended with is appended, ``(B, Hkv, G, Lq)`` in the loop's dtype: the row's largest
    score after the score transform and the mask, -inf where the row saw no key."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    kern = _native_step(pb, loop_order, trace is not None or observer is not None)
    block_q, block_k = _resolve_tiles(pb, kern, block_q, block_k, forward=True)
    kern = _with_terms_that_fit(pb, kern, block_q, block_k)
    ledger = _new_ledger(pb, "forward", block_q, block_k, loop_order)
    classes = _classes(pb, block_q, block_k, ledger)
    obs, wants = _observers(ledger, trace, observer)
    book = _Book(pb, ledger.counters)
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    if trace is not None:
        _check_trace_budget(pb, trace, classes, qtiles, ktiles, f"forward {loop_order}")
    kind_of = _kind_of(classes)
    dt, dev = pb.dtype, pb.geo.device
    if kern is not None:
        copied = pb.kv_bytes_copied
        out = _forward_native(pb, kern, ledger, kind_of, book, block_q, block_k, o_finite, row_max)
        ledger.kv_bytes_copied = pb.kv_bytes_copied
        if o_finite or all_finite(out[0]) or all_finite(pb.v):
            return out
        # a value no row reads is not finite (a key past seqused_k, a key between two packed
        # sequences that no row sees, a key column a mask hides from every row): the native
        # step multiplies a row block's whole column span [lo, hi) by V, and P = 0 times NaN
        # is NaN; the PyTorch step leaves those values out (``_seen_values``), so it runs
        pb.kv_bytes_copied = copied
        if row_max is not None:
            row_max.clear()
        with _native.disabled():
            return _forward(
                pb,
                block_q=block_q,
                block_k=block_k,
                loop_order=loop_order,
                trace=trace,
                observer=observer,
                o_finite=o_finite,
                row_max=row_max,
            )
    ws = _workspace(pb, block_q, block_k)
    n = b * hkv
    steps = 0

    def record(**kw: Any) -> None:
        nonlocal steps
        book.flush()
        step = ForwardTileStep(index=steps, **kw)
        steps += 1
        for o_ in obs:
            if hasattr(o_, "forward_tile"):
                o_.forward_tile(step)

    def user_q(x: torch.Tensor) -> torch.Tensor:
        return pb.user_q(_unflat(pb, x))

    if loop_order == "fa2":
        o = torch.empty(b, hkv, g, lq, dv, dtype=dt, device=dev)  # (B, Hkv, G, Lq, d_v)
        lse = torch.empty(b, hkv, g, lq, dtype=dt, device=dev)  # (B, Hkv, G, Lq)
        m_all = None if row_max is None else torch.empty_like(lse)  # (B, Hkv, G, Lq)
        # V and acc are stored transposed (d_v rows): acc' = α acc + P̃ V is then formed as
        # accᵀ += Vᵀ P̃ᵀ, the matmul layout that runs fastest on CPU in float64.
        v_t = pb.v.reshape(n, lk, dv).mT  # (B·Hkv, d_v, Lk)
        if not v_t.is_contiguous():  # laid out anew (not when d_v or Lk is 1)
            v_t = v_t.contiguous()
            pb.kv_bytes_copied += v_t.numel() * v_t.element_size()
        v_finite = all_finite(v_t)  # else a partial tile reads only the values its rows see
        # per key tile: K_jᵀ (B·Hkv, d, bk) and V_j (B·Hkv, bk, d_v), views
        kv_t = [(_keys(pb.k, k0, k1).mT, v_t[..., k0:k1].mT) for k0, k1 in ktiles]
        for i, (q0, q1) in enumerate(qtiles):
            qi = _rows(pb.q, q0, q1)  # (B·Hkv, G·bq, d)
            r = qi.shape[1]
            state = online.OnlineState(
                m=torch.full((n, r), -math.inf, dtype=dt, device=dev),  # (B·Hkv, G·bq)
                ell=torch.zeros(n, r, dtype=dt, device=dev),  # (B·Hkv, G·bq)
                acc=torch.zeros(n, dv, r, dtype=dt, device=dev).mT,  # (B·Hkv, G·bq, d_v)
            )
            ran = False
            for j, k0, k1, kind in _running(book, ktiles, kind_of, i=i):
                kt, vj = kv_t[j]
                s, _, vis, keep = _tile_scores(pb, ws, qi, kt, kind, q0, q1, k0, k1)
                if vis is not None and not v_finite:
                    vj = _seen_values(pb, vj, vis)
                want = bool(obs) and wants(steps)
                if want:  # the step overwrites s and the state in place
                    s_seen, m_before = s.clone(), state.m.clone()
                # -- update m, ell, acc (the seed's section 01) --
                alpha, p = online.step_(
                    state,
                    s,
                    vj,
                    keep=None if keep is None else keep.reshape(s.shape),
                    keep_scale=pb.keep_scale,
                )
                book.run(kind, q1 - q0, k1 - k0, vis, keep, forward=True)
                book.io(read=(k1 - k0) * (d + dv))
                ran = True
                if obs:
                    tens = {}
                    if want:
                        o_now, _ = online.finalize(state)
                        tens = dict(
                            s=user_q(s_seen),
                            block_max=user_q(s_seen.amax(dim=-1)),
                            m_before=user_q(m_before),
                            m_after=user_q(state.m.clone()),
                            alpha=user_q(alpha),
                            ell=user_q(state.ell.clone()),
                            acc=user_q(state.acc.clone()),
                            o=user_q(o_now),
                            p=user_q(p.clone()),
                            keep=None if keep is None else pb.user_q(keep),
                        )
                    record(
                        q_tile=i,
                        k_tile=j,
                        q_range=(q0, q1),
                        k_range=(k0, k1),
                        kind=TILE_KINDS[kind],
                        **tens,
                    )
            if ran:
                book.io(read=(q1 - q0) * d)
            o_i, lse_i = online.finalize(state)  # (B·Hkv, G·bq, d_v), (B·Hkv, G·bq)
            o[..., q0:q1, :] = _unflat(pb, o_i)
            lse[..., q0:q1] = _unflat(pb, lse_i)
            if m_all is not None:
                m_all[..., q0:q1] = _unflat(pb, state.m)
            book.io(write=(q1 - q0) * (dv + 1), stats_written=q1 - q0)
        book.flush()
        if row_max is not None and m_all is not None:
            row_max.append(m_all)
        ledger.kv_bytes_copied = pb.kv_bytes_copied
        return o, lse, ledger

    # FlashAttention-1 order: O, m, ell live in slow memory and are updated every step.
    o = torch.zeros(b, hkv, g, lq, dv, dtype=dt, device=dev)  # normalised output
    m = torch.full((b, hkv, g, lq), -math.inf, dtype=dt, device=dev)
    ell = torch.zeros(b, hkv, g, lq, dtype=dt, device=dev)
    book.io(write=lq * (dv + 2), stats_written=2 * lq)
    v_finite = all_finite(pb.v)  # else a partial tile reads only the values its rows see
    for j, (k0, k1) in enumerate(ktiles):
        kj, vj = _keys(pb.k, k0, k1), pb.v[..., k0:k1, :]  # (B·Hkv, bk, d), (B, Hkv, 1, bk, d_v)
        ran = False
        for i, q0, q1, kind in _running(book, qtiles, kind_of, j=j):
            qi = _rows(pb.q, q0, q1)  # (B·Hkv, G·bq, d)
            s3, _, vis, keep = _tile_scores(pb, ws, qi, kj.mT, kind, q0, q1, k0, k1)
            s = _unflat(pb, s3)  # (B, Hkv, G, bq, bk)
            m_before = m[..., q0:q1]
            m_new, ell_new, o_new, alpha, p = online.step_normalized(
                m_before,
                ell[..., q0:q1],
                o[..., q0:q1, :],
                s,
                vj if vis is None or v_finite else _seen_values(pb, vj, vis),
                keep=keep,
                keep_scale=pb.keep_scale,
            )
            if obs and wants(steps):
                tens = dict(
                    s=pb.user_q(s.clone()),
                    block_max=pb.user_rows(s.amax(dim=-1)),
                    m_before=pb.user_rows(m_before.clone()),
                    m_after=pb.user_rows(m_new.clone()),
                    alpha=pb.user_rows(alpha.clone()),
                    ell=pb.user_rows(ell_new.clone()),
                    o=pb.user_q(o_new.clone()),
                    p=pb.user_q(p.clone()),
                    keep=None if keep is None else pb.user_q(keep.expand_as(p).clone()),
                )
            else:
                tens = {}
            m[..., q0:q1], ell[..., q0:q1], o[..., q0:q1, :] = m_new, ell_new, o_new
            book.run(kind, q1 - q0, k1 - k0, vis, keep, forward=True)
            book.io(
                read=(q1 - q0) * (d + dv + 2),
                write=(q1 - q0) * (dv + 2),
                stats_read=2 * (q1 - q0),
                stats_written=2 * (q1 - q0),
            )
            ran = True
            if obs:
                record(
                    q_tile=i,
                    k_tile=j,
                    q_range=(q0, q1),
                    k_range=(k0, k1),
                    kind=TILE_KINDS[kind],
                    **tens,
                )
        if ran:
            book.io(read=(k1 - k0) * (d + dv))
    empty = ell == 0
    lse = torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, ell)))
    book.io(read=2 * lq, write=lq, stats_read=2 * lq, stats_written=lq)
    book.flush()
    if row_max is not None:
        row_max.append(m)
    ledger.kv_bytes_copied = pb.kv_bytes_copied
    return o, lse, ledger


def blocked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    placement: Placement | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    loop_order: LoopOrder = "fa2",
    trace: bool | int | Trace = False,
    observer: Any = None,
    raw_lse: bool = False,
    row_max: bool = False,
    **opts: Unpack[AttentionOptions],
) -> ForwardResult:
    """Blocked attention forward.

    q ``(..., Lq, d)``, k ``(..., Lk, d)``, v ``(..., Lk, d_v)`` with ``...`` =
    ``()``, ``(H,)`` or ``(B, H)`` (K/V may have fewer heads: GQA). Tiles of
    ``block_q x block_k`` (any sizes >= 1, ragged last tiles; None: the tiles the
    native step chose by measurement on this machine, 512 x 512 where it is off). ``trace=True`` records every tile step in ``result.ledger.records``,
    ``trace=k`` every k-th, ``trace=Trace(every=k, max_bytes=n)`` with a budget: the
    records' size is computed before the loop runs and over the budget (1 GiB by
    default) a ``ValueError`` says how large they would be and how to reduce them.
    ``opts``: ``AttentionOptions`` (mask, scale, conventions, dropout, softcap,
    ALiBi, bias, cu_seqlens).
    ``raw_lse=True`` reports -inf for fully-masked rows whatever the
    conventions (a partial result to merge, as split-KV and ring attention do).
    ``row_max=True`` also reports each row's largest score after the score
    transform and the mask (``result.row_max``, the running max the loop ended with).
    """
    _check_options(block_q, block_k, loop_order)
    if not isinstance(row_max, bool):
        raise TypeError(f"row_max must be True or False, got {row_max!r}")
    check_options("blocked_forward", opts)
    _refuse_graph(
        "blocked_forward", dict(q=q, k=k, v=v, bias=opts.get("bias")), opts.get("score_mod"), q
    )
    pb = build_problem(q, k, v, placement=placement, **opts)
    return _forward_problem(
        pb,
        block_q=block_q,
        block_k=block_k,
        loop_order=loop_order,
        trace=trace,
        observer=observer,
        raw_lse=raw_lse,
        row_max=row_max,
    )


def _forward_problem(
    pb: Problem,
    *,
    block_q: int | None,
    block_k: int | None,
    loop_order: str,
    trace: bool | int | Trace = False,
    observer: Any = None,
    raw_lse: bool = False,
    row_max: bool = False,
) -> ForwardResult:
    """``blocked_forward`` on a built problem (``row_max``: report each row's ``m``)."""
    o_finite: list[bool] = []
    m: list[torch.Tensor] | None = [] if row_max else None
    o, lse, ledger = _forward(
        pb,
        block_q=block_q,
        block_k=block_k,
        loop_order=loop_order,
        trace=Trace.of(trace),
        observer=observer,
        o_finite=o_finite,
        row_max=m,
    )
    # a pass that saw every value finite as it wrote it needs no second look
    if not o_finite and pb.check_forward_lse(lse, o) and not raw_lse:  # a row saw no key
        lse = _conventional_lse(lse, pb.conventions)
    o = pb.user_q(o)
    if o.dtype != pb.out_dtype:
        o = o.to(pb.out_dtype)
    return ForwardResult(
        o=o, lse=pb.user_rows(lse), ledger=ledger, row_max=pb.user_rows(m[0]) if m else None
    )


# ----------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------
@autocast_off
def _backward(
    pb: Problem,
    o5: torch.Tensor,
    lse5: torch.Tensor,
    do5: torch.Tensor,
    dlse5: torch.Tensor | None,
    *,
    block_q: int | None,
    block_k: int | None,
    loop_order: str,
    trace: Trace | None,
    observer: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, Ledger]:
    """The backward loop. ``o5`` and ``do5`` in the caller's dtypes (the half path reads a
    dO in the inputs' dtype as it is; every other step converts it to the loop's); the
    gradients in the loop's dtype, or dK and dV in the inputs' half dtype where the native
    step wrote them so."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    # The backward loop is the same in both orders; it runs on the step its forward ran on
    # (the FA1 order's forward is always the PyTorch step), so that P = exp(S - λ) is
    # rebuilt from bit for bit the scores that produced λ: another matmul may round S a
    # unit in the last place apart, and P then misses 1 by that much times |S|.
    kern = _native_step(pb, loop_order, trace is not None or observer is not None)
    # the forward's query tiles: a forward that read K in place formed its scores so
    fwd_block_q = _resolve_tiles(pb, kern, block_q, block_k, forward=True)[0]
    block_q, block_k = _resolve_tiles(pb, kern, block_q, block_k)
    kern = _with_terms_that_fit(pb, kern, block_q, block_k)
    ledger = _new_ledger(pb, "backward", block_q, block_k, loop_order)
    classes = _classes(pb, block_q, block_k, ledger)
    obs, wants = _observers(ledger, trace, observer)
    book = _Book(pb, ledger.counters)
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    if trace is not None:
        _check_trace_budget(pb, trace, classes, qtiles, ktiles, "backward")
    kind_of = _kind_of(classes)
    dt, dev = pb.dtype, pb.geo.device
    n = b * hkv
    # The scores are recomputed by the forward's own call (``_tile_scores``), so the
    # rebuilt P = exp(S - λ) sees bit for bit the S that produced λ. Without a softcap the
    # gradient of q kᵀ is the scale times dS (of the scores after ALiBi, bias and
    # score_mod), and the gradient matmuls carry the scale as their alpha (``a``). The
    # gradients are accumulated transposed, dQᵀ_i (d, G·bq) and dKᵀ_j, dVᵀ_j (d, bk): the
    # matmul layouts that run fastest on CPU.
    fold = pb.smod.softcap is None
    a = pb.smod.scale if fold else 1.0
    # -- preprocess: D = rowsum(dO ⊙ O); a gradient on the LSE folds into it --
    D = _row_dots(do5, o5, dt, kern)  # (B, Hkv, G, Lq)
    d_eff = D if dlse5 is None else D - dlse5  # dS = P ⊙ (dP - D + dλ)
    book.io(read=lq * 2 * dv, write=lq, stats_written=lq)
    # a fully-masked row keeps every P = exp(-inf - λ) at 0, whatever LSE convention it carries
    lse_safe = torch.where(torch.isneginf(lse5), math.inf, lse5)  # (B, Hkv, G, Lq)
    book.io(write=lq * d)  # dQ initialised
    if kern is not None:
        dq5, dk5, dv5, dbias5 = _backward_native(
            pb,
            kern,
            do5,
            lse_safe,
            d_eff,
            ledger,
            kind_of,
            book,
            block_q,
            block_k,
            half=_half_step(pb, kern) and do5.dtype == pb.out_dtype,
            dot_scores=_keys_in_place(pb, fwd_block_q),
        )
        book.flush()
        return dq5, dk5, dv5, dbias5, D, ledger
    do5 = do5.to(dt)
    rows, cols = g * min(block_q, lq), min(block_k, lk)
    ws = _Workspace(
        pb,
        [n * rows * cols] * 4  # S (slot 0, as in the forward), dP, dS, P
        + [n * d * cols, n * dv * cols],  # dKᵀ_j, dVᵀ_j
    )

    q_t = [_rows(pb.q, q0, q1) for q0, q1 in qtiles]  # (B·Hkv, G·bq, d), as in the forward
    do_t = [_rows(do5, q0, q1) for q0, q1 in qtiles]  # (B·Hkv, G·bq, d_v)
    qt_t, dot_t = [x.mT for x in q_t], [x.mT for x in do_t]  # transposed views
    lse_t = [_row_stats(lse_safe, q0, q1) for q0, q1 in qtiles]  # (B·Hkv, G·bq, 1)
    d_t = [_row_stats(d_eff, q0, q1) for q0, q1 in qtiles]  # (B·Hkv, G·bq, 1)

    # dQᵀ is kept tile by tile, each tile contiguous so that the matmul accumulates into it
    # in place (``baddbmm_``); it is laid out as (B, Hkv, G, Lq, d) at the end.
    dq_tiles = torch.zeros(n * g * lq * d, dtype=dt, device=dev)
    dqt_t = [
        dq_tiles[n * g * q0 * d : n * g * q1 * d].view(n, d, g * (q1 - q0)) for q0, q1 in qtiles
    ]
    dk = torch.empty(b, hkv, 1, lk, d, dtype=dt, device=dev)  # (B, Hkv, 1, Lk, d)
    dv_ = torch.empty(b, hkv, 1, lk, dv, dtype=dt, device=dev)  # (B, Hkv, 1, Lk, d_v)
    bias5 = pb.smod.bias
    dbias = None if bias5 is None else _BiasGrad(bias5, pb)
    steps = 0
    for j, (k0, k1) in enumerate(ktiles):
        bk = k1 - k0
        kj, vj = _keys(pb.k, k0, k1), _keys(pb.v, k0, k1)  # (B·Hkv, bk, d), (B·Hkv, bk, d_v)
        kt, vt = kj.mT, vj.mT  # views, (B·Hkv, d, bk), (B·Hkv, d_v, bk)
        kt_c = kt.contiguous()  # Kᵀ_j for dQᵀ += Kᵀ_j dSᵀ
        # dK_j, dV_j stay on chip for the whole key tile (stored transposed)
        dkt_j, dvt_j = ws.get(4, n, d, bk).zero_(), ws.get(5, n, dv, bk).zero_()
        ran = False
        for i, q0, q1, kind in _running(book, qtiles, kind_of, j=j):
            qi, do_i = q_t[i], do_t[i]
            r = qi.shape[1]
            # -- recompute the scores; dP = dO Vᵀ --
            s, ctx, vis, keep = _tile_scores(pb, ws, qi, kt, kind, q0, q1, k0, k1, grad=True)
            dp = torch.bmm(do_i, vt, out=ws.get(1, n, r, bk))  # (B·Hkv, G·bq, bk)
            ds, p = ws.get(2, n, r, bk), ws.get(3, n, r, bk)  # (B·Hkv, G·bq, bk)
            # -- rebuild the probability block from the whole row's LSE --
            online.exp_shifted(s, lse_t[i], out=p)  # P = exp(S - λ)
            want = bool(obs) and wants(steps)
            p_seen = p.clone() if want else None
            if keep is not None:
                keep3 = keep.reshape(p.shape)
                dp.mul_(keep3).mul_(pb.keep_scale)
            torch.sub(dp, d_t[i], out=ds).mul_(p)  # dS = P ⊙ (dP - D)
            ds_seen = ds.clone() if want else None
            if pb.smod.user is not None:  # the score_mod's VJP on the tile: dS of its input
                ds_in = pb.smod.grad_user(_unflat(pb, ds), ctx)
                if ds_in.data_ptr() != ds.data_ptr():  # (an additive score_mod passes ds on)
                    ds.copy_(ds_in.reshape(ds.shape))
            if dbias is not None:
                dbias.add(_unflat(pb, ds), q0, q1, k0, k1)
            if keep is not None:
                p.mul_(keep3).mul_(pb.keep_scale)  # the dropped P that weighted V
            if not fold:  # gradient of q kᵀ through the softcap (else the scale is in alpha)
                ds.copy_(pb.smod.grad_qk(_unflat(pb, ds), ctx).view(ds.shape))
            # -- accumulate: dQᵀ_i += a Kᵀ_j dSᵀ, dKᵀ_j += a Qᵀ_i dS, dVᵀ_j += dOᵀ_i P --
            dqt_t[i].baddbmm_(kt_c, ds.mT, alpha=a)  # (B·Hkv, d, G·bq)
            dkt_j.baddbmm_(qt_t[i], ds, alpha=a)  # (B·Hkv, d, bk), summed over the group
            dvt_j.baddbmm_(dot_t[i], p)  # (B·Hkv, d_v, bk)
            book.run(kind, q1 - q0, bk, vis, keep, forward=False)
            book.io(
                read=(q1 - q0) * (2 * d + dv + 2), write=(q1 - q0) * d, stats_read=2 * (q1 - q0)
            )
            ran = True
            if obs:
                book.flush()
                tens = {}
                if want:
                    assert p_seen is not None and ds_seen is not None

                    def user_q(x: torch.Tensor) -> torch.Tensor:
                        return pb.user_q(_unflat(pb, x))

                    def user_k(x: torch.Tensor) -> torch.Tensor:
                        return pb.user_k(x.reshape(b, hkv, *x.shape[1:]))

                    tens = dict(
                        s=user_q(s.clone()),
                        p=user_q(p_seen),
                        dp=user_q(dp.clone()),
                        ds=user_q(ds_seen),
                        dq=user_q(torch.bmm(ds, kj).mul_(a)),
                        dk=user_k(torch.bmm(ds.mT, qi).mul_(a)),
                        dv=user_k(torch.bmm(p.mT, do_i)),
                        keep=None if keep is None else pb.user_q(keep),
                    )
                step = BackwardTileStep(
                    index=steps,
                    q_tile=i,
                    k_tile=j,
                    q_range=(q0, q1),
                    k_range=(k0, k1),
                    kind=TILE_KINDS[kind],
                    **tens,
                )
                steps += 1
                for o_ in obs:
                    if hasattr(o_, "backward_tile"):
                        o_.backward_tile(step)
        if ran:
            book.io(read=(k1 - k0) * (d + dv))
        _keys(dk, k0, k1).copy_(dkt_j.mT)
        _keys(dv_, k0, k1).copy_(dvt_j.mT)
        book.io(write=(k1 - k0) * (d + dv))
    dq = torch.empty(b, hkv, g, lq, d, dtype=dt, device=dev)  # (B, Hkv, G, Lq, d)
    for (q0, q1), dqt_i in zip(qtiles, dqt_t):
        dq[..., q0:q1, :] = _unflat(pb, dqt_i.mT)
    book.flush()
    return dq, dk, dv_, None if dbias is None else dbias.done(qtiles, ktiles), D, ledger


def _head_offsets(x: torch.Tensor, pb: Problem) -> torch.Tensor:
    """Each query head's element offset ``(B·Hq,)``, as the native passes number the heads,
    in ``x`` ``(B|1, Hkv|1, G|1, ...)`` (a bias or its gradient; 0 along a broadcast axis)."""
    b, hq, _, g = pb.shape[:4]
    h = torch.arange(b * hq)  # (B·Hq,)
    parts = (h // hq, h % hq // g, h % g)  # batch entry, K/V head, member of the group
    return sum(
        (p * x.stride(ax) for ax, p in enumerate(parts) if x.shape[ax] != 1), torch.zeros_like(h)
    )


def _in_place(
    x: torch.Tensor, row_stride: int, heads: torch.Tensor, r0: int, c0: int
) -> _native.TermView:
    """A tile of ``x`` (a bias, its gradient) from global row ``r0``, key ``c0`` as a pass
    reads or writes it where it lies (``_native.TermView``)."""
    first = r0 * row_stride + c0  # elements
    return _native.TermView(x, x.data_ptr() + first * x.element_size(), row_stride, heads)


class _BiasGrad:
    """The bias's gradient ``grad`` (the bias's 5-D shape, ``(B|1, Hkv|1, G|1, Lq|1,
    Lk|1)``) from each tile's dS (``add``), finished by ``done``.

    Where the bias has a row and a key axis, a tile's dS lands on a region of its own: the
    first dS of a region is written there (``copy_``, not added to zeros), and ``done``
    zeroes only the regions no tile reached (the tiles a mask skips, the rows and keys
    outside this call), so that an ``L x L`` gradient is not first filled with zeros and
    then read back for every addition; its pages are huge where the OS lends them
    (``_memory``: a fresh buffer's page faults cost more than writing it). A bias broadcast
    over rows or keys sums the tiles' dS into zeros."""

    def __init__(self, bias5: torch.Tensor, pb: Problem) -> None:
        self.pb = pb
        self.regions = bias5.shape[-2] != 1 and bias5.shape[-1] != 1
        self.grad = empty_like_huge(bias5) if self.regions else torch.zeros_like(bias5)
        self.written: set[tuple[int, int, int, int]] = set()  # local (q0, q1, k0, k1)
        self.heads = self._heads()

    def _heads(self) -> torch.Tensor | None:
        """Each query head's offset in the gradient ``(B·Hq,)``, in elements, where every
        head has values of its own (no axis of B, Hkv, G broadcast) and the keys are
        contiguous, so that a pass may write each tile's dS into it (``direct``); else None."""
        grad, (b, _, hkv, g) = self.grad, self.pb.shape[:4]
        if not self.regions or tuple(grad.shape[:3]) != (b, hkv, g) or grad.stride(-1) != 1:
            return None
        return _head_offsets(grad, self.pb)

    def direct(self, kind: int, q0: int, q1: int, k0: int, k1: int) -> _native.TermView | None:
        """Where a native pass writes the tile's dS straight into the gradient (the tile's
        region, zeroed first when the tile is partial: the pass writes the positions it
        computes), the region then counted as written; None where it cannot (``_heads``) or
        the region has a dS already (a second one adds)."""
        tile = (q0, q1, k0, k1)
        if self.heads is None or tile in self.written:
            return None
        grad, geo = self.grad, self.pb.geo
        r0, c0 = geo.q_offset + q0, geo.k_offset + k0
        if kind == PARTIAL:
            grad[..., r0 : geo.q_offset + q1, c0 : geo.k_offset + k1].zero_()
        self.written.add(tile)
        return _in_place(grad, grad.stride(-2), self.heads, r0, c0)

    def add(self, ds: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
        """Add tile ``[q0, q1) x [k0, k1)``'s ``ds`` ``(B, Hkv, G, r, c)``."""
        grad, geo = self.grad, self.pb.geo
        dims = [ax for ax in range(5) if grad.shape[ax] == 1 and ds.shape[ax] != 1]
        contrib = ds.sum(dim=dims, keepdim=True) if dims else ds
        rq = slice(geo.q_offset + q0, geo.q_offset + q1) if grad.shape[-2] != 1 else slice(None)
        rk = slice(geo.k_offset + k0, geo.k_offset + k1) if grad.shape[-1] != 1 else slice(None)
        region = grad[..., rq, rk]
        tile = (q0, q1, k0, k1)
        if self.regions and tile not in self.written:
            region.copy_(contrib)
            self.written.add(tile)
        else:
            region += contrib

    def done(
        self, qtiles: Sequence[tuple[int, int]], ktiles: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        """The gradient, with zeros where no tile of the grid ``qtiles x ktiles`` (this
        call's, local) wrote. Raises ``RuntimeError`` if a tile written was not one of the
        grid's (its regions would then not tell what is left unwritten)."""
        grad = self.grad
        if not self.regions:
            return grad
        grid = {(q0, q1, k0, k1) for q0, q1 in qtiles for k0, k1 in ktiles}
        if not self.written <= grid:
            raise RuntimeError(
                "the bias gradient was written on tiles other than the loop's grid: "
                f"{sorted(self.written - grid)[:3]}"
            )
        geo = self.pb.geo
        qa, qb = geo.q_offset, geo.q_offset + geo.lq
        ka, kb = geo.k_offset, geo.k_offset + geo.lk
        grad[..., :qa, :].zero_()  # rows and keys outside this call
        grad[..., qb:, :].zero_()
        grad[..., qa:qb, :ka].zero_()
        grad[..., qa:qb, kb:].zero_()
        for q0, q1 in qtiles:  # each row of tiles: its runs of tiles not written, at once
            run: int | None = None
            for k0, k1 in [*ktiles, (geo.lk, geo.lk)]:
                hole = k1 > k0 and (q0, q1, k0, k1) not in self.written
                if hole and run is None:
                    run = k0
                elif not hole and run is not None:
                    grad[..., qa + q0 : qa + q1, ka + run : ka + k0].zero_()
                    run = None
        return grad


def blocked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    dlse: torch.Tensor | None = None,
    placement: Placement | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    loop_order: LoopOrder = "fa2",
    trace: bool | int | Trace = False,
    observer: Any = None,
    **opts: Unpack[AttentionOptions],
) -> BackwardResult:
    """Blocked attention backward from the saved ``o`` and ``lse`` (any conventions' LSE).

    ``o``/``do`` ``(..., Lq, d_v)``, ``lse``/``dlse`` ``(..., Lq)``; the other
    arguments as for ``blocked_forward`` (they must match the forward call).
    """
    _check_options(block_q, block_k, loop_order)
    check_options("blocked_backward", opts)
    _refuse_graph(
        "blocked_backward",
        dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dlse=dlse, bias=opts.get("bias")),
        opts.get("score_mod"),
        q,
    )
    pb = build_problem(q, k, v, placement=placement, **opts)
    return _backward_problem(
        pb,
        o,
        lse,
        do,
        dlse,
        bias=opts.get("bias"),
        block_q=block_q,
        block_k=block_k,
        loop_order=loop_order,
        trace=trace,
        observer=observer,
        whole=placement is None,
    )


def _backward_problem(
    pb: Problem,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    bias: torch.Tensor | None,
    block_q: int | None,
    block_k: int | None,
    loop_order: str,
    trace: bool | int | Trace = False,
    observer: Any = None,
    whole: bool = True,
    saved: bool = False,
) -> BackwardResult:
    """``blocked_backward`` on a built problem (``flash_attention`` gives it the forward's
    bound mask, so that a mask_mod's tile classes and kept tiles serve both passes);
    ``whole``: the call covers the whole sequence (no placement); ``saved``: ``o`` and
    ``lse`` are the forward's own as autograd saved them (checked when the forward formed
    them, and unchanged since: autograd refuses a saved tensor modified in place), so
    their checks are not run again (dO's are)."""
    o, lse, do = plain(o), plain(lse), plain(do)  # the values as stored: read by pointer
    dlse = None if dlse is None else plain(dlse)
    # o and dO in the caller's dtype: converted where they are read (a half dO goes to the
    # half step as it is; D widens their rows as it reads them), never whole in the
    # accumulation dtype
    o5, do5, dlse5 = _backward_inputs(pb, o, lse, do, dlse, convert=False, saved=saved)
    if pb.smod.user is not None:
        pb.smod.user.reset_grads()
    lse5 = pb.to_internal_rows(lse.to(pb.dtype))
    if not saved:
        pb.check_saved_lse(lse5, whole=whole)
    dq, dk, dv, dbias5, D, ledger = _backward(
        pb,
        o5,
        lse5,
        do5,
        dlse5,
        block_q=block_q,
        block_k=block_k,
        loop_order=loop_order,
        trace=Trace.of(trace),
        observer=observer,
    )
    del o5, do5
    out = pb.out_dtype
    dq, dk, dv = pb.user_q(dq).to(out), pb.user_k(dk).to(out), pb.user_k(dv).to(out)
    pb.check_gradients(dq=dq, dk=dk, dv=dv)  # as returned: a half dtype's range counts
    dbias = None
    if dbias5 is not None and bias is not None:
        dbias = dbias5.reshape(bias.shape).to(bias.dtype)
        pb.check_gradients(dbias=dbias)
    user = pb.smod.user
    return BackwardResult(
        dq=dq,
        dk=dk,
        dv=dv,
        dbias=dbias,
        D=pb.user_rows(D),
        ledger=ledger,
        captured_grads=() if user is None else user.captured_grads(),
    )


# ----------------------------------------------------------------------------------------
# split-KV (flash-decoding)
# ----------------------------------------------------------------------------------------
def split_kv_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_splits: int,
    block_q: int | None = None,
    block_k: int | None = None,
    placement: Placement | None = None,
    **opts: Unpack[AttentionOptions],
) -> ForwardResult:
    """Split the keys into ``num_splits`` chunks, attend each independently, merge.

    Each chunk's partial ``(o, lse)`` comes from ``blocked_forward`` with global
    positions (so masks, ALiBi, bias and dropout see the whole sequence); a
    chunk where a row sees no key has partial LSE -inf and merges to the right
    answer. The ledger's counters are the sum over chunks, its ``kv_bytes_copied`` every
    copy of K and V the call made (the whole call's layout, each chunk's). ``placement``: the
    call is part of a longer sequence (its chunks are placed inside it).
    """
    check_size("num_splits", num_splits)
    _check_options(block_q, block_k, "fa2")
    check_options("split_kv_forward", opts, refused=("cu_seqlens_q", "cu_seqlens_k"))
    _refuse_graph(
        "split_kv_forward", dict(q=q, k=k, v=v, bias=opts.get("bias")), opts.get("score_mod"), q
    )
    pb = build_problem(q, k, v, placement=placement, **opts)
    block_q, block_k = _resolve_tiles(
        pb, _native_step(pb, "fa2", False), block_q, block_k, forward=True
    )
    lq, lk = pb.shape[4], pb.shape[5]
    if num_splits > lk:
        raise ValueError(f"num_splits must be between 1 and Lk = {lk}, got {num_splits}")
    geo = pb.geo
    bounds = [(s * lk) // num_splits for s in range(num_splits + 1)]
    o_acc = lse_acc = None
    total = Counters()
    copied = pb.kv_bytes_copied  # the whole problem's layout, then each chunk's copies
    for start, stop in itertools.pairwise(bounds):
        part = build_problem(
            q,
            k[..., start:stop, :],
            v[..., start:stop, :],
            placement=Placement(
                q_offset=geo.q_offset,
                k_offset=geo.k_offset + start,
                lq_total=geo.lq_total,
                lk_total=geo.lk_total,
            ),
            **opts,
        )
        po, pl, led = _forward(
            part, block_q=block_q, block_k=block_k, loop_order="fa2", trace=None, observer=None
        )
        for key, val in led.counters.to_dict().items():
            setattr(total, key, getattr(total, key) + val)
        copied += led.kv_bytes_copied
        if o_acc is None:
            o_acc, lse_acc = po, pl
        else:
            assert lse_acc is not None
            # -- the one merge: rescale both partial states onto the larger max --
            o_acc, lse_acc = online.merge_partials(o_acc, lse_acc, po, pl)
    assert o_acc is not None and lse_acc is not None
    pb.check_forward_lse(lse_acc, o_acc)
    ledger = Ledger(
        pass_name=f"forward (split-KV, {num_splits} splits)",
        block_q=block_q,
        block_k=block_k,
        loop_order="fa2",
        tiles_q=-(-lq // block_q),
        tiles_k=-(-lk // block_k),
        counters=total,
        lead=pb.ndim - 2,
        element_bytes=pb.out_dtype.itemsize,
        kv_bytes_copied=copied,
    )
    lse = _conventional_lse(lse_acc, pb.conventions)
    return ForwardResult(o=pb.user_q(o_acc).to(pb.out_dtype), lse=pb.user_rows(lse), ledger=ledger)


def _demo() -> None:
    """The seed's five positions, causal, 2 x 2 tiles: the forward ledger, step by step."""
    from .examples import FIVE_K, FIVE_Q, FIVE_V
    from .masks import Causal
    from .reference import reference_forward

    fwd = blocked_forward(FIVE_Q, FIVE_K, FIVE_V, mask=Causal(), block_q=2, block_k=2, trace=True)
    print(fwd.ledger)
    ref = reference_forward(FIVE_Q, FIVE_K, FIVE_V, mask=Causal())
    print(f"max |O - dense oracle| = {float((fwd.o - ref.o).abs().max()):.3g}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("blocked", _demo, command="backward")
