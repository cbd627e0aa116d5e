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
full tiles never evaluate the mask, partial tiles do.

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
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import online
from ._checks import check_block
from ._problem import Placement, Problem, build_problem
from .conventions import SEED, Conventions
from .ledger import BackwardTileStep, Counters, ForwardTileStep, Ledger
from .masks import EMPTY, FULL, PARTIAL, TILE_KINDS, Mask
from .reference import _backward_inputs, _conventional_lse

__all__ = [
    "BackwardResult",
    "ForwardResult",
    "blocked_backward",
    "blocked_forward",
    "split_kv_forward",
]

LoopOrder = Literal["fa2", "fa1"]
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


@dataclass(frozen=True)
class ForwardResult:
    """``o`` ``(..., Lq, d_v)`` in the input dtype, ``lse`` ``(..., Lq)`` in the accumulation dtype."""

    o: torch.Tensor
    lse: torch.Tensor
    ledger: Ledger


@dataclass(frozen=True)
class BackwardResult:
    """Gradients like their inputs; ``dbias`` like ``bias`` (or None); ``D`` ``(..., Lq)``."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None
    D: torch.Tensor
    ledger: Ledger


def _tiles(n: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(s + b, n)) for s in range(0, n, b)]


def _observers(ledger: Ledger, trace: bool, observer: Any) -> tuple[list[Any], bool]:
    obs: list[Any] = []
    if trace:
        obs.append(_Recorder(ledger))
    if observer is not None:
        if not (hasattr(observer, "forward_tile") or hasattr(observer, "backward_tile")):
            raise TypeError("observer must have forward_tile(step) and/or backward_tile(step)")
        obs.append(observer)
    wants = any(getattr(o, "wants_tensors", True) for o in obs)
    return obs, wants


class _Recorder:
    """The ``trace=True`` observer: appends every step to the ledger."""

    wants_tensors = True

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def forward_tile(self, step: ForwardTileStep) -> None:
        self.ledger.records.append(step)

    def backward_tile(self, step: BackwardTileStep) -> None:
        self.ledger.records.append(step)


class _Book:
    """Counter bookkeeping shared by both passes."""

    def __init__(self, pb: Problem, counters: Counters) -> None:
        b, hq = pb.shape[:2]
        self.bh = b * hq
        self.c = counters
        self.d, self.dv = pb.shape[6], pb.shape[7]

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
    ) -> None:
        c = self.c
        c.tiles_run += 1
        area = bq * bk * self.bh
        c.qk_dots_computed += area
        if kind == FULL:
            c.tiles_full += 1
            c.qk_dots_visible += area
        else:
            assert vis is not None
            c.tiles_partial += 1
            c.qk_dots_visible += _count(vis, area)
        c.exps += area + (bq * self.bh if forward else 0)
        if keep is not None:
            dropped = ~keep if vis is None else (~keep & vis)
            c.dropped += _count(dropped, area)

    def io(self, read: int = 0, write: int = 0) -> None:
        """Book slow-memory traffic per (batch, query head)."""
        self.c.elements_read += read * self.bh
        self.c.elements_written += write * self.bh


def _count(x: torch.Tensor, area: int) -> int:
    """True entries of a broadcastable bool tile, counted over the full ``area``."""
    return int(x.sum()) * (area // x.numel())


def _tile_scores(
    pb: Problem, qi: torch.Tensor, kj: torch.Tensor, kind: int, q0: int, q1: int, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(s, t, vis, keep)`` of one tile: scores with the mask applied (partial tiles only)."""
    qk = qi @ kj.transpose(-1, -2)  # (B, Hkv, G, bq, bk)
    s, t = pb.smod.tile(qk, q0, q1, k0, k1)
    vis = None
    if kind == PARTIAL:
        vis = pb.mask_tile(q0, q1, k0, k1)  # (Bm, Hkv|1, G|1, bq, bk)
        s = s.masked_fill(~vis, -math.inf)
    keep = pb.keep_tile(q0, q1, k0, k1)
    return s, t, vis, keep


def _check_options(block_q: Any, block_k: Any, loop_order: Any) -> None:
    check_block("block_q", block_q)
    check_block("block_k", block_k)
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
    )
    return led


def _classes(pb: Problem, block_q: int, block_k: int) -> list[list[int]] | None:
    return None if pb.mask is None else pb.mask.tile_classes(block_q, block_k).tolist()


# ----------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------
def _forward(
    pb: Problem,
    *,
    block_q: int,
    block_k: int,
    loop_order: str,
    trace: bool,
    observer: Any,
) -> tuple[torch.Tensor, torch.Tensor, Ledger]:
    """The forward loop. Returns ``o`` ``(B, Hkv, G, Lq, d_v)``, ``lse`` with -inf on empty rows."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    ledger = _new_ledger(pb, "forward", block_q, block_k, loop_order)
    classes = _classes(pb, block_q, block_k)
    ledger.set_tile_classes(None if classes is None else torch.tensor(classes))
    obs, wants = _observers(ledger, trace, observer)
    book = _Book(pb, ledger.counters)
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    kind_of = (lambda i, j: FULL) if classes is None else (lambda i, j: classes[i][j])
    dt, dev = pb.dtype, pb.geo.device
    steps = 0

    def record(**kw: Any) -> None:
        nonlocal steps
        step = ForwardTileStep(index=steps, **kw)
        steps += 1
        for o_ in obs:
            if hasattr(o_, "forward_tile"):
                o_.forward_tile(step)

    if loop_order == "fa2":
        o = torch.empty(b, hkv, g, lq, dv, dtype=dt, device=dev)  # (B, Hkv, G, Lq, d_v)
        lse = torch.empty(b, hkv, g, lq, dtype=dt, device=dev)  # (B, Hkv, G, Lq)
        for i, (q0, q1) in enumerate(qtiles):
            qi = pb.q[..., q0:q1, :]  # (B, Hkv, G, bq, d)
            state = online.OnlineState.empty((b, hkv, g, q1 - q0), dv, dtype=dt, device=dev)
            ran = False
            for j, (k0, k1) in enumerate(ktiles):
                kind = kind_of(i, j)
                if kind == EMPTY:
                    book.skip()
                    continue
                kj, vj = pb.k[..., k0:k1, :], pb.v[..., k0:k1, :]
                s, _, vis, keep = _tile_scores(pb, qi, kj, kind, q0, q1, k0, k1)
                m_before = state.m
                # -- update m, ell, acc (the seed's section 01) --
                state, alpha, p = online.step(state, s, vj, keep=keep, keep_scale=pb.keep_scale)
                book.run(kind, q1 - q0, k1 - k0, vis, keep, forward=True)
                book.io(read=(k1 - k0) * (d + dv))
                ran = True
                if obs:
                    tens = {}
                    if wants:
                        o_now, _ = online.finalize(state)
                        tens = dict(
                            s=pb.user_q(s.clone()),
                            block_max=pb.user_rows(s.amax(dim=-1)),
                            m_before=pb.user_rows(m_before.clone()),
                            m_after=pb.user_rows(state.m.clone()),
                            alpha=pb.user_rows(alpha.clone()),
                            ell=pb.user_rows(state.ell.clone()),
                            acc=pb.user_q(state.acc.clone()),
                            o=pb.user_q(o_now),
                            p=pb.user_q(p.clone()),
                            keep=None if keep is None else pb.user_q(keep.expand_as(p).clone()),
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
            o[..., q0:q1, :], lse[..., q0:q1] = online.finalize(state)
            book.io(write=(q1 - q0) * (dv + 1))
        return o, lse, ledger

    # FlashAttention-1 order: O, m, ell live in slow memory and are updated every step.
    o = torch.zeros(b, hkv, g, lq, dv, dtype=dt, device=dev)  # normalised output
    m = torch.full((b, hkv, g, lq), -math.inf, dtype=dt, device=dev)
    ell = torch.zeros(b, hkv, g, lq, dtype=dt, device=dev)
    book.io(write=lq * (dv + 2))
    for j, (k0, k1) in enumerate(ktiles):
        kj, vj = pb.k[..., k0:k1, :], pb.v[..., k0:k1, :]
        ran = False
        for i, (q0, q1) in enumerate(qtiles):
            kind = kind_of(i, j)
            if kind == EMPTY:
                book.skip()
                continue
            qi = pb.q[..., q0:q1, :]
            s, _, vis, keep = _tile_scores(pb, qi, kj, kind, q0, q1, k0, k1)
            m_before = m[..., q0:q1]
            m_new, ell_new, o_new, alpha, p = online.step_normalized(
                m_before,
                ell[..., q0:q1],
                o[..., q0:q1, :],
                s,
                vj,
                keep=keep,
                keep_scale=pb.keep_scale,
            )
            if obs and wants:
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
            book.io(read=(q1 - q0) * (d + dv + 2), write=(q1 - q0) * (dv + 2))
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
    book.io(read=2 * lq, write=lq)
    return o, lse, ledger


def blocked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    scale: float | None = None,
    conventions: Conventions | str = SEED,
    dropout_p: float = 0.0,
    seed: int = 0,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    placement: Placement | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    loop_order: LoopOrder = "fa2",
    trace: bool = False,
    observer: Any = None,
    raw_lse: bool = False,
) -> ForwardResult:
    """Blocked attention forward.

    q ``(..., Lq, d)``, k ``(..., Lk, d)``, v ``(..., Lk, d_v)`` with ``...`` =
    ``()``, ``(H,)`` or ``(B, H)`` (K/V may have fewer heads: GQA). Tiles of
    ``block_q x block_k`` (default 128 x 128; any sizes >= 1, ragged last
    tiles). ``trace=True`` records every tile step in ``result.ledger.records``.
    ``raw_lse=True`` reports -inf for fully-masked rows whatever the
    conventions (a partial result to merge, as split-KV and ring attention do).
    """
    _check_options(block_q, block_k, loop_order)
    pb = build_problem(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        conventions=conventions,
        dropout_p=dropout_p,
        seed=seed,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        bias=bias,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        placement=placement,
    )
    o, lse, ledger = _forward(
        pb,
        block_q=block_q,
        block_k=block_k,
        loop_order=loop_order,
        trace=trace,
        observer=observer,
    )
    if not raw_lse:
        lse = _conventional_lse(lse, pb.conventions)
    return ForwardResult(o=pb.user_q(o).to(pb.out_dtype), lse=pb.user_rows(lse), ledger=ledger)


# ----------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------
def _backward(
    pb: Problem,
    o5: torch.Tensor,
    lse5: torch.Tensor,
    do5: torch.Tensor,
    dlse5: torch.Tensor | None,
    *,
    block_q: int,
    block_k: int,
    loop_order: str,
    trace: bool,
    observer: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, Ledger]:
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    ledger = _new_ledger(pb, "backward", block_q, block_k, loop_order)
    classes = _classes(pb, block_q, block_k)
    ledger.set_tile_classes(None if classes is None else torch.tensor(classes))
    obs, wants = _observers(ledger, trace, observer)
    book = _Book(pb, ledger.counters)
    qtiles, ktiles = _tiles(lq, block_q), _tiles(lk, block_k)
    kind_of = (lambda i, j: FULL) if classes is None else (lambda i, j: classes[i][j])
    dt, dev = pb.dtype, pb.geo.device

    # -- preprocess: D = rowsum(dO ⊙ O); a gradient on the LSE folds into it --
    D = (do5 * o5).sum(dim=-1)  # (B, Hkv, G, Lq)
    d_eff = D if dlse5 is None else D - dlse5  # dS = P ⊙ (dP - D + dλ)
    book.io(read=lq * 2 * dv, write=lq)
    # a fully-masked row keeps every P = exp(-inf - λ) at 0, whatever LSE convention it carries
    lse_safe = torch.where(torch.isneginf(lse5), math.inf, lse5)  # (B, Hkv, G, Lq)

    dq = torch.zeros(b, hkv, g, lq, d, dtype=dt, device=dev)  # (B, Hkv, G, Lq, d)
    book.io(write=lq * d)
    dk = torch.empty(b, hkv, 1, lk, d, dtype=dt, device=dev)  # (B, Hkv, 1, Lk, d)
    dv_ = torch.empty(b, hkv, 1, lk, dv, dtype=dt, device=dev)  # (B, Hkv, 1, Lk, d_v)
    bias5 = pb.smod.bias
    dbias5 = None if bias5 is None else torch.zeros_like(bias5)
    steps = 0
    for j, (k0, k1) in enumerate(ktiles):
        kj, vj = pb.k[..., k0:k1, :], pb.v[..., k0:k1, :]
        dk_j = torch.zeros(b, hkv, 1, k1 - k0, d, dtype=dt, device=dev)
        dv_j = torch.zeros(b, hkv, 1, k1 - k0, dv, dtype=dt, device=dev)
        ran = False
        for i, (q0, q1) in enumerate(qtiles):
            kind = kind_of(i, j)
            if kind == EMPTY:
                book.skip()
                continue
            qi, do_i = pb.q[..., q0:q1, :], do5[..., q0:q1, :]
            s, t, vis, keep = _tile_scores(pb, qi, kj, kind, q0, q1, k0, k1)
            # -- rebuild the probability block from the whole row's LSE --
            p = torch.exp(s - lse_safe[..., q0:q1, None])  # (B, Hkv, G, bq, bk)
            dp = do_i @ vj.transpose(-1, -2)  # (B, Hkv, G, bq, bk)
            if keep is None:
                pd = p
            else:
                pd = p * keep * pb.keep_scale
                dp = dp * keep * pb.keep_scale
            ds = p * (dp - d_eff[..., q0:q1, None])  # (B, Hkv, G, bq, bk)
            dqk = pb.smod.grad_qk(ds, t)  # gradient of q kᵀ
            dq_c = dqk @ kj  # (B, Hkv, G, bq, d)
            dk_c = (dqk.transpose(-1, -2) @ qi).sum(dim=2, keepdim=True)  # (B, Hkv, 1, bk, d)
            dv_c = (pd.transpose(-1, -2) @ do_i).sum(dim=2, keepdim=True)  # (B, Hkv, 1, bk, d_v)
            dq[..., q0:q1, :] += dq_c
            dk_j += dk_c
            dv_j += dv_c
            if dbias5 is not None:
                _add_bias_grad(dbias5, ds, pb, q0, q1, k0, k1)
            book.run(kind, q1 - q0, k1 - k0, vis, keep, forward=False)
            book.io(read=(q1 - q0) * (2 * d + dv + 2), write=(q1 - q0) * d)
            ran = True
            if obs:
                tens = {}
                if wants:
                    tens = dict(
                        s=pb.user_q(s.clone()),
                        p=pb.user_q(p.clone()),
                        dp=pb.user_q(dp.clone()),
                        ds=pb.user_q(ds.clone()),
                        dq=pb.user_q(dq_c),
                        dk=pb.user_k(dk_c),
                        dv=pb.user_k(dv_c),
                        keep=None if keep is None else pb.user_q(keep.expand_as(p).clone()),
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
        dk[..., k0:k1, :] = dk_j
        dv_[..., k0:k1, :] = dv_j
        book.io(write=(k1 - k0) * (d + dv))
    return dq, dk, dv_, dbias5, D, ledger


def _add_bias_grad(
    dbias5: torch.Tensor, ds: torch.Tensor, pb: Problem, q0: int, q1: int, k0: int, k1: int
) -> None:
    """Add a tile's ``dS`` into the (broadcast-shaped) bias gradient."""
    dims = [ax for ax in range(5) if dbias5.shape[ax] == 1 and ds.shape[ax] != 1]
    contrib = ds.sum(dim=dims, keepdim=True) if dims else ds
    geo = pb.geo
    rq = slice(geo.q_offset + q0, geo.q_offset + q1) if dbias5.shape[-2] != 1 else slice(None)
    rk = slice(geo.k_offset + k0, geo.k_offset + k1) if dbias5.shape[-1] != 1 else slice(None)
    dbias5[..., rq, rk] += contrib


def blocked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    dlse: torch.Tensor | None = None,
    mask: Mask | torch.Tensor | None = None,
    scale: float | None = None,
    conventions: Conventions | str = SEED,
    dropout_p: float = 0.0,
    seed: int = 0,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    placement: Placement | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    loop_order: LoopOrder = "fa2",
    trace: bool = False,
    observer: Any = None,
) -> BackwardResult:
    """Blocked attention backward from the saved ``o`` and ``lse`` (any conventions' LSE).

    ``o``/``do`` ``(..., Lq, d_v)``, ``lse``/``dlse`` ``(..., Lq)``; the other
    arguments as for ``blocked_forward`` (they must match the forward call).
    """
    _check_options(block_q, block_k, loop_order)
    pb = build_problem(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        conventions=conventions,
        dropout_p=dropout_p,
        seed=seed,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        bias=bias,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        placement=placement,
    )
    o5, do5, dlse5 = _backward_inputs(pb, o, lse, do, dlse)
    lse5 = pb.to_internal_rows(lse.to(pb.dtype))
    dq, dk, dv, dbias5, D, ledger = _backward(
        pb,
        o5,
        lse5,
        do5,
        dlse5,
        block_q=block_q,
        block_k=block_k,
        loop_order=loop_order,
        trace=trace,
        observer=observer,
    )
    dbias = None
    if dbias5 is not None and bias is not None:
        dbias = dbias5.reshape(bias.shape).to(bias.dtype)
    return BackwardResult(
        dq=pb.user_q(dq).to(q.dtype),
        dk=pb.user_k(dk).to(k.dtype),
        dv=pb.user_k(dv).to(v.dtype),
        dbias=dbias,
        D=pb.user_rows(D),
        ledger=ledger,
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
    mask: Mask | torch.Tensor | None = None,
    scale: float | None = None,
    conventions: Conventions | str = SEED,
    dropout_p: float = 0.0,
    seed: int = 0,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
) -> ForwardResult:
    """Split the keys into ``num_splits`` chunks, attend each independently, merge.

    Each chunk's partial ``(o, lse)`` comes from ``blocked_forward`` with global
    positions (so masks, ALiBi, bias and dropout see the whole sequence); a
    chunk where a row sees no key has partial LSE -inf and merges to the right
    answer. The ledger's counters are the sum over chunks.
    """
    check_block("num_splits", num_splits)
    pb = build_problem(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        conventions=conventions,
        dropout_p=dropout_p,
        seed=seed,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        bias=bias,
    )
    lq, lk = pb.shape[4], pb.shape[5]
    if num_splits > lk:
        raise ValueError(f"num_splits must be between 1 and Lk = {lk}, got {num_splits}")
    bounds = [(s * lk) // num_splits for s in range(num_splits + 1)]
    o_acc = lse_acc = None
    total = Counters()
    for start, stop in itertools.pairwise(bounds):
        part = build_problem(
            q,
            k[..., start:stop, :],
            v[..., start:stop, :],
            mask=mask,
            scale=scale,
            conventions=conventions,
            dropout_p=dropout_p,
            seed=seed,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            bias=bias,
            placement=Placement(q_offset=0, k_offset=start, lq_total=lq, lk_total=lk),
        )
        po, pl, led = _forward(
            part, block_q=block_q, block_k=block_k, loop_order="fa2", trace=False, observer=None
        )
        for key, val in led.counters.to_dict().items():
            setattr(total, key, getattr(total, key) + val)
        if o_acc is None:
            o_acc, lse_acc = po, pl
        else:
            assert lse_acc is not None
            # -- the one merge: rescale both partial states onto the larger max --
            o_acc, lse_acc = online.merge_partials(o_acc, lse_acc, po, pl)
    assert o_acc is not None and lse_acc is not None
    ledger = Ledger(
        pass_name=f"forward (split-KV, {num_splits} splits)",
        block_q=block_q,
        block_k=block_k,
        loop_order="fa2",
        tiles_q=-(-lq // block_q),
        tiles_k=-(-lk // block_k),
        counters=total,
        lead=pb.ndim - 2,
    )
    lse = _conventional_lse(lse_acc, pb.conventions)
    return ForwardResult(o=pb.user_q(o_acc).to(pb.out_dtype), lse=pb.user_rows(lse), ledger=ledger)
