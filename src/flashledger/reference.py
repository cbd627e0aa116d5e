"""The dense reference: the oracle every other path is checked against.

Written to be read. It materialises the whole score matrix (``Lq x Lk`` per
head), computes in float64 by default, and its backward is the closed form,
not autograd::

    S  = f(scale · Q Kᵀ)  with masked entries -inf      (B, H, Lq, Lk)
    λ  = log Σ_j exp(S_ij)                               (B, H, Lq)   the LSE
    P  = exp(S - λ)                                      (B, H, Lq, Lk)
    O  = (P ⊙ M / (1 - p)) V                             (B, H, Lq, d_v)
    D  = rowsum(dO ⊙ O)                                  (B, H, Lq)
    dP = dO Vᵀ                                           (B, H, Lq, Lk)
    dS = P ⊙ (M ⊙ dP / (1 - p) - D + dλ)                 (B, H, Lq, Lk)
    dQ = f'(dS) K,   dK = f'(dS)ᵀ Q,   dV = (P ⊙ M / (1 - p))ᵀ dO

``f`` is the score transform (scale, softcap, ALiBi, bias, a user's
``score_mod``; see scores.py: the score_mod's part of ``f'`` is its
vector-Jacobian product, from autograd, which also gives the gradients of the
tensors it captures), ``M``
the dropout keep mask and ``dλ`` an optional gradient on the LSE. A query row
with no visible key has ``O = 0``, zero gradients and the LSE of the chosen
conventions (-inf by default): it is handled separately, so ``-inf - (-inf)``
is never evaluated.

Tensors are laid out as ``(B, Hkv, G, L, *)`` internally (GQA without copies);
results come back in the caller's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Unpack

import torch

from ._checks import FLOAT_DTYPES, autocast_off, check_finite
from ._options import AttentionOptions, check_options
from ._problem import Placement, Problem, build_problem
from .conventions import Conventions
from .scores import TileGrad

__all__ = ["ReferenceBackward", "ReferenceForward", "reference_backward", "reference_forward"]


@dataclass(frozen=True)
class ReferenceForward:
    """Dense forward: ``o`` ``(..., Lq, d_v)``, ``lse`` ``(..., Lq)``, ``p`` and ``s`` ``(..., Lq, Lk)``."""

    o: torch.Tensor
    lse: torch.Tensor
    p: torch.Tensor  # probabilities before dropout (masked entries 0)
    s: torch.Tensor  # final scores (masked entries -inf)
    keep: torch.Tensor | None  # dropout keep mask (True = kept), or None without dropout
    attn_probs: torch.Tensor | None = None
    """With ``return_attn_probs=True``: the probabilities as flash-attn's test reference
    (``attention_ref``) returns them, ``(..., Lq, Lk)`` in the inputs' dtype: the softmax
    before dropout (dropped entries keep their value, nothing rescaled by ``1/(1-p)``),
    masked entries and fully-masked rows 0. The keep mask is ``keep``."""


@dataclass(frozen=True)
class ReferenceBackward:
    """Dense backward: ``dq``, ``dk``, ``dv`` like q, k, v; ``dbias`` like bias; ``D`` ``(..., Lq)``;
    ``captured_grads``: ``(tensor, gradient)`` for each tensor the score_mod captures that
    requires grad (empty without one)."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None
    D: torch.Tensor
    captured_grads: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


def _dense_scores(pb: Problem, *, grad: bool = False) -> tuple[torch.Tensor, TileGrad]:
    """All scores at once: ``S`` ``(B, Hkv, G, Lq, Lk)`` with masked entries -inf, and what
    the backward needs of the transform (``grad=True``: the score_mod's graph too)."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    qk = pb.q @ pb.k.transpose(-1, -2)  # (B, Hkv, G, Lq, Lk)
    s, ctx = pb.smod.tile(qk, 0, lq, 0, lk, grad=grad)
    if pb.mask is not None:
        s = s.masked_fill(~pb.mask_tile(0, lq, 0, lk, kept=False), -math.inf)
    return s, ctx


def _softmax_rows(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax with fully-masked rows handled apart: ``(P, lse)``, lse -inf on empty rows."""
    m = s.amax(dim=-1, keepdim=True)  # (..., Lq, 1)
    empty = torch.isneginf(m)  # rows with no visible key
    e = torch.exp(s - torch.where(empty, 0.0, m))  # (..., Lq, Lk), 0 on masked entries
    ell = e.sum(dim=-1, keepdim=True)  # (..., Lq, 1)
    p = e / torch.where(empty, 1.0, ell)
    lse = torch.where(empty, -math.inf, m + torch.log(ell)).squeeze(-1)  # (..., Lq)
    return p, lse


def _conventional_lse(lse: torch.Tensor, conventions: Conventions) -> torch.Tensor:
    """Replace the -inf LSE of fully-masked rows with the conventions' value."""
    if conventions.masked_row_lse == -math.inf:
        return lse
    return torch.where(torch.isneginf(lse), conventions.masked_row_lse, lse)


@autocast_off
def reference_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    placement: Placement | None = None,
    dtype: torch.dtype = torch.float64,
    return_attn_probs: bool = False,
    **opts: Unpack[AttentionOptions],
) -> ReferenceForward:
    """Dense attention forward in ``dtype`` (default float64).

    q ``(..., Lq, d)``, k ``(..., Lk, d)``, v ``(..., Lk, d_v)`` with ``...`` =
    ``()``, ``(H,)`` or ``(B, H)``; ``opts``: ``AttentionOptions`` (mask, scale
    [``1/sqrt(d)``], conventions, dropout or an outside ``dropout_mask``,
    softcap, ALiBi, bias, cu_seqlens, seqused). ``return_attn_probs=True`` also
    fills ``attn_probs`` (flash-attn's test-reference probabilities, in q's dtype).
    """
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be True or False, got {return_attn_probs!r}")
    check_options("reference_forward", opts)
    pb = build_problem(q, k, v, placement=placement, acc_dtype=dtype, **opts)
    lq, lk = pb.shape[4], pb.shape[5]
    s, _ = _dense_scores(pb)  # (B, Hkv, G, Lq, Lk)
    p, lse = _softmax_rows(s)
    keep = pb.keep_tile(0, lq, 0, lk)
    pd = p if keep is None else p * keep * pb.keep_scale  # (B, Hkv, G, Lq, Lk)
    o = pd @ pb.v  # (B, Hkv, G, Lq, d_v)
    pb.check_forward_lse(lse, o)
    return ReferenceForward(
        o=pb.user_q(o),
        lse=pb.user_rows(_conventional_lse(lse, pb.conventions)),
        p=pb.user_q(p),
        s=pb.user_q(s),
        keep=None if keep is None else pb.user_q(keep.expand_as(p)),
        attn_probs=pb.user_q(p).to(q.dtype) if return_attn_probs else None,
    )


@autocast_off
def reference_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    dlse: torch.Tensor | None = None,
    placement: Placement | None = None,
    dtype: torch.dtype = torch.float64,
    **opts: Unpack[AttentionOptions],
) -> ReferenceBackward:
    """Closed-form dense backward in ``dtype`` (default float64).

    ``o`` and ``do`` ``(..., Lq, d_v)``; ``lse`` ``(..., Lq)`` is checked for
    shape only (the reference recomputes ``P`` from the scores); ``dlse``
    ``(..., Lq)`` is an optional gradient on the LSE.
    """
    check_options("reference_backward", opts)
    pb = build_problem(q, k, v, placement=placement, acc_dtype=dtype, **opts)
    o5, do5, dlse5 = _backward_inputs(pb, o, lse, do, dlse)
    lq, lk = pb.shape[4], pb.shape[5]
    s, ctx = _dense_scores(pb, grad=True)  # (B, Hkv, G, Lq, Lk)
    p, lse_raw = _softmax_rows(s)
    pb.check_forward_lse(lse_raw)
    keep = pb.keep_tile(0, lq, 0, lk)
    D = (do5 * o5).sum(dim=-1)  # (B, Hkv, G, Lq)
    dp = do5 @ pb.v.transpose(-1, -2)  # (B, Hkv, G, Lq, Lk)
    if keep is None:
        pd = p
    else:
        pd = p * keep * pb.keep_scale
        dp = dp * keep * pb.keep_scale
    inner = dp - D.unsqueeze(-1)
    if dlse5 is not None:
        inner = inner + dlse5.unsqueeze(-1)
    ds = p * inner  # (B, Hkv, G, Lq, Lk)
    ds = pb.smod.grad_user(ds, ctx)  # through the score_mod: the scores before it
    dqk = pb.smod.grad_qk(ds, ctx)  # (B, Hkv, G, Lq, Lk)
    dq = dqk @ pb.k  # (B, Hkv, G, Lq, d)
    dk = (dqk.transpose(-1, -2) @ pb.q).sum(dim=2, keepdim=True)  # (B, Hkv, 1, Lk, d)
    dv = (pd.transpose(-1, -2) @ do5).sum(dim=2, keepdim=True)  # (B, Hkv, 1, Lk, d_v)
    dq, dk, dv = pb.user_q(dq), pb.user_k(dk), pb.user_k(dv)
    pb.check_gradients(dq=dq, dk=dk, dv=dv)
    dbias, bias = None, opts.get("bias")
    if bias is not None:
        dbias = reduce_to_bias(pb.user_q(ds), bias)
        pb.check_gradients(dbias=dbias)
    return ReferenceBackward(
        dq=dq,
        dk=dk,
        dv=dv,
        dbias=dbias,
        D=pb.user_rows(D),
        captured_grads=() if pb.smod.user is None else pb.smod.user.captured_grads(),
    )


def _floating(name: str, x: object) -> None:
    """A tensor handed to a backward (o, do, lse, dlse) in a dtype flashledger computes in."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), "
            f"got {got}"
        )


def _backward_inputs(
    pb: Problem,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    *,
    convert: bool = True,
    saved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check ``o``, ``lse``, ``do``, ``dlse`` against the problem and lay them out internally,
    in the accumulation dtype (``convert=False``: ``o`` and ``do`` in their own, for a caller
    that converts them where it reads them; ``saved``: ``o`` and ``lse`` are the forward's
    own, their values checked when it formed them, so only their shapes are)."""
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    want_o = (*_lead(pb), lq, dv)
    for name, x in (("o", o), ("do", do)):
        _floating(name, x)
        if tuple(x.shape) != want_o:
            raise ValueError(f"{name} must have shape {want_o}, got {tuple(x.shape)}")
    want_l = (*_lead(pb), lq)
    for name, r in (("lse", lse), ("dlse", dlse)):
        if r is None:
            continue
        _floating(name, r)
        if tuple(r.shape) != want_l:
            raise ValueError(f"{name} must have shape {want_l}, got {tuple(r.shape)}")
    if not saved and bool(torch.isnan(lse).any()):
        raise ValueError("lse contains NaN; allowed: finite values or ±inf on fully-masked rows")
    for name, t in (("o", None if saved else o), ("do", do), ("dlse", dlse)):
        if t is not None:
            check_finite(name, t)  # names the first NaN or inf by index
    dt = pb.dtype
    o5 = pb.to_internal_q(o.to(dt) if convert else o)
    do5 = pb.to_internal_q(do.to(dt) if convert else do)
    dlse5 = None if dlse is None else pb.to_internal_rows(dlse.to(dt))
    return o5, do5, dlse5


def _lead(pb: Problem) -> tuple[int, ...]:
    b, hq = pb.shape[0], pb.shape[1]
    return {2: (), 3: (hq,), 4: (b, hq)}[pb.ndim]


def reduce_to_bias(ds: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Sum a full ``(..., Lq, Lk)`` gradient down to ``bias``'s broadcast shape."""
    g = ds
    while g.ndim < bias.ndim:
        g = g.unsqueeze(0)
    while g.ndim > bias.ndim:
        g = g.sum(dim=0)
    dims = [i for i, (gs, bs) in enumerate(zip(g.shape, bias.shape)) if bs == 1 and gs != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.to(bias.dtype)


def _demo() -> None:
    """The dense float64 oracle on the seed's five positions: O, LSE and the gradients."""
    from .examples import FIVE_G, FIVE_K, FIVE_Q, FIVE_V
    from .masks import Causal

    fwd = reference_forward(FIVE_Q, FIVE_K, FIVE_V, mask=Causal())
    bwd = reference_backward(FIVE_Q, FIVE_K, FIVE_V, fwd.o, fwd.lse, FIVE_G, mask=Causal())
    for name, t in (("O", fwd.o), ("LSE", fwd.lse), ("dQ", bwd.dq), ("dK", bwd.dk), ("dV", bwd.dv)):
        print(f"{name:<4}{torch.round(t, decimals=6).tolist()}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("reference", _demo)
