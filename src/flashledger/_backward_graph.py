"""The blocked backward as a graph autograd can differentiate: exact second-order gradients.

``flash_attention``'s first-order backward is ``blocked_backward``: tile buffers
reused in place, ``out=`` matmuls, the native step. None of that records a
graph, so a gradient taken with ``create_graph=True`` would come back
constant and a gradient penalty or a Hessian-vector product would silently
lose the attention term. When autograd asks for a graph, the backward runs
here instead: the same FA2 schedule (an outer loop over key tiles, an inner
one over query tiles, empty tiles skipped), each step written with
out-of-place PyTorch ops, so autograd differentiates it like any other code::

    P_ij  = exp(S_ij - λ_i)                     rebuilt from the LSE
    dP_ij = dO_i V_jᵀ        (⊙ M / (1 - p) with dropout)
    dS_ij = P_ij ⊙ (dP_ij - D_i + dλ_i)          D = rowsum(dO ⊙ O)
    dQ_i += f'(dS_ij) K_j,  dK_j += f'(dS_ij)ᵀ Q_i,  dV_j += (P_ij ⊙ M / (1 - p))ᵀ dO_i

``O`` and ``λ`` must be functions of ``q, k, v`` in the graph (they carry
second-order terms), so the caller passes a recomputed, differentiable
``(o, lse)``. Dropout's keep mask is a pure function of the coordinates
(``dropout.py``), a constant of the graph: the second derivative is exact with
dropout too.

Memory: autograd keeps every tile's intermediates (scores, ``P``, ``dP``,
``dS``, softcap's ``t``) for the next differentiation, about six
``B·Hq·Lq·Lk`` tensors in the accumulation dtype: what PyTorch's math backend
keeps for its double backward, not the ``O(L)`` of the first-order backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._problem import build_problem
from .blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q
from .masks import EMPTY, PARTIAL
from .reference import _backward_inputs, reduce_to_bias

__all__ = ["graph_backward"]


def graph_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    bias: torch.Tensor | None,
    opts: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dq, dk, dv, dbias)`` as differentiable functions of every input.

    ``o`` ``(..., Lq, d_v)`` and ``lse`` ``(..., Lq)`` (-inf on rows with no key) must
    be differentiable functions of ``q, k, v, bias``; ``do``/``dlse`` the upstream
    gradients; ``opts`` the options of ``flash_attention`` (``block_q``/``block_k``
    set the tiles, default 512 x 512 where absent or None; ``loop_order`` is ignored: the
    backward has one order).
    """
    block_q = opts.get("block_q") or DEFAULT_BLOCK_Q
    block_k = opts.get("block_k") or DEFAULT_BLOCK_K
    kw = {n: x for n, x in opts.items() if n not in ("block_q", "block_k", "loop_order")}
    pb = build_problem(q, k, v, bias=bias, **kw)
    b, hq, hkv, g, lq, lk, d, dv = pb.shape
    o5, do5, dlse5 = _backward_inputs(pb, o, lse, do, dlse)
    lse5 = pb.to_internal_rows(lse.to(pb.dtype))  # (B, Hkv, G, Lq)
    D = (do5 * o5).sum(dim=-1)  # (B, Hkv, G, Lq)
    if dlse5 is not None:
        D = D - dlse5  # dS = P ⊙ (dP - D + dλ)
    # a row that sees no key rebuilds P = exp(-inf - (+inf)) = 0, never exp(-inf - (-inf))
    lse_safe = torch.where(torch.isneginf(lse5), math.inf, lse5)  # (B, Hkv, G, Lq)
    classes = None if pb.mask is None else pb.mask.tile_classes(block_q, block_k).tolist()
    qtiles = [(s, min(s + block_q, lq)) for s in range(0, lq, block_q)]
    ktiles = [(s, min(s + block_k, lk)) for s in range(0, lk, block_k)]
    want_dbias = bias is not None and bias.requires_grad
    dq_parts: list[list[torch.Tensor]] = [[] for _ in qtiles]
    ds_tiles: dict[tuple[int, int], torch.Tensor] = {}
    dk_tiles, dv_tiles = [], []
    for j, (k0, k1) in enumerate(ktiles):
        kj, vj = pb.k[..., k0:k1, :], pb.v[..., k0:k1, :]  # (B, Hkv, 1, bk, d | d_v)
        dk_j = kj.new_zeros(b, hkv, 1, k1 - k0, d)  # (B, Hkv, 1, bk, d)
        dv_j = vj.new_zeros(b, hkv, 1, k1 - k0, dv)  # (B, Hkv, 1, bk, d_v)
        for i, (q0, q1) in enumerate(qtiles):
            kind = classes[i][j] if classes is not None else None
            if kind == EMPTY:
                continue
            qi, do_i = pb.q[..., q0:q1, :], do5[..., q0:q1, :]  # (B, Hkv, G, bq, d | d_v)
            # -- the scores, then P rebuilt from the row's LSE --
            s, t = pb.smod.tile(qi @ kj.mT, q0, q1, k0, k1, inplace=False)  # (B, Hkv, G, bq, bk)
            if kind == PARTIAL:
                s = s.masked_fill(~pb.mask_tile(q0, q1, k0, k1), -math.inf)
            p = torch.exp(s - lse_safe[..., q0:q1, None])  # (B, Hkv, G, bq, bk)
            dp = do_i @ vj.mT  # (B, Hkv, G, bq, bk)
            keep = pb.keep_tile(q0, q1, k0, k1)
            p_kept = p
            if keep is not None:
                dp = dp * keep * pb.keep_scale
                p_kept = p * keep * pb.keep_scale  # the dropped P that weighted V
            ds = p * (dp - D[..., q0:q1, None])  # (B, Hkv, G, bq, bk)
            dqk = pb.smod.grad_qk(ds, t)  # gradient of q kᵀ
            # -- accumulate: dQ_i += f'(dS) K_j, dK_j += f'(dS)ᵀ Q_i, dV_j += P̃ᵀ dO_i --
            dq_parts[i].append(dqk @ kj)  # (B, Hkv, G, bq, d)
            dk_j = dk_j + (dqk.mT @ qi).sum(dim=2, keepdim=True)  # summed over the group
            dv_j = dv_j + (p_kept.mT @ do_i).sum(dim=2, keepdim=True)
            if want_dbias:
                ds_tiles[i, j] = ds
        dk_tiles.append(dk_j)
        dv_tiles.append(dv_j)
    dq_rows = [
        sum(parts[1:], parts[0]) if parts else pb.q.new_zeros(b, hkv, g, q1 - q0, d)
        for parts, (q0, q1) in zip(dq_parts, qtiles)
    ]
    dq5 = torch.cat(dq_rows, dim=-2)  # (B, Hkv, G, Lq, d)
    dk5, dv5 = torch.cat(dk_tiles, dim=-2), torch.cat(dv_tiles, dim=-2)  # (B, Hkv, 1, Lk, ·)
    dbias = None
    if want_dbias:
        assert bias is not None

        def tile(i: int, j: int) -> torch.Tensor:
            (q0, q1), (k0, k1) = qtiles[i], ktiles[j]
            return ds_tiles.get((i, j), pb.q.new_zeros(b, hkv, g, q1 - q0, k1 - k0))

        ds_full = torch.cat(  # (B, Hkv, G, Lq, Lk)
            [
                torch.cat([tile(i, j) for j in range(len(ktiles))], dim=-1)
                for i in range(len(qtiles))
            ],
            dim=-2,
        )
        dbias = reduce_to_bias(pb.user_q(ds_full), bias)
    gq, gk, gv = pb.user_q(dq5).to(q.dtype), pb.user_k(dk5).to(k.dtype), pb.user_k(dv5).to(v.dtype)
    pb.check_gradients(dq=gq, dk=gk, dv=gv)  # as returned, as the first-order backward checks
    if dbias is not None:
        pb.check_gradients(dbias=dbias)
    return gq, gk, gv, dbias
