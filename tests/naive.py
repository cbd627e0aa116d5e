"""Naive attention and mask formulas written straight from the definitions.

Nothing here imports flashledger: it is the independent second check. The
attention is plain differentiable PyTorch on ``(B, H, L, d)`` tensors, so
``torch.autograd`` gives its gradients; the mask helpers are the formulas of
CONVENTIONS.md, evaluated pair by pair in Python.

A fully-masked query row (every score -inf after masks and bias) has output 0,
zero gradients and the LSE ``masked_row_lse`` of the conventions under test;
softmax is taken over a row of zeros there and multiplied by 0, so no NaN
reaches autograd.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def as4d(x: torch.Tensor) -> torch.Tensor:
    """``(L, d)`` / ``(H, L, d)`` / ``(B, H, L, d)`` -> ``(B, H, L, d)``."""
    while x.ndim < 4:
        x = x.unsqueeze(0)
    return x


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    visible: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    masked_row_lse: float = -math.inf,
    alibi_key_index: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of attention, differentiable in q, k, v and bias.

    q ``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``, v ``(B, Hkv, Lk, d_v)`` (query
    head h uses key head ``h // (Hq // Hkv)``); ``visible`` bool broadcastable
    to ``(B, Hq, Lq, Lk)`` (True = attend); ``alibi_slopes`` ``(Hq,)`` or
    ``(B, Hq)`` with bias ``-slope * |i + Lk - Lq - j|``; ``bias`` broadcastable
    to ``(B, Hq, Lq, Lk)``; ``keep`` the dropout keep mask ``(B, Hq, Lq, Lk)``
    (kept weights scaled by ``1 / (1 - dropout_p)``). ``alibi_key_index``: the
    ALiBi term is ``+slope * j`` instead (flash-attn 2's kernel under a causal
    mask). Returns o ``(B, Hq, Lq, d_v)`` and lse ``(B, Hq, Lq)``.
    """
    hq, hkv = q.shape[1], k.shape[1]
    lq, lk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=1)  # (B, Hq, Lk, d)
    v = v.repeat_interleave(hq // hkv, dim=1)  # (B, Hq, Lk, d_v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = scale * (q @ k.transpose(-1, -2))  # (B, Hq, Lq, Lk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(lq, dtype=s.dtype).view(-1, 1)
        j = torch.arange(lk, dtype=s.dtype).view(1, -1)
        dist = (i + lk - lq - j).abs()  # (Lq, Lk)
        slopes = alibi_slopes.to(s.dtype)
        slopes = slopes.view(1, -1, 1, 1) if slopes.ndim == 1 else slopes[:, :, None, None]
        s = s + slopes * j if alibi_key_index else s - slopes * dist
    if bias is not None:
        s = s + bias.to(s.dtype)
    if visible is not None:
        s = torch.where(visible, s, -math.inf)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    s_safe = torch.where(empty, 0.0, s)
    p = torch.softmax(s_safe, dim=-1) * (~empty)  # (B, Hq, Lq, Lk)
    lse = torch.where(empty.squeeze(-1), masked_row_lse, torch.logsumexp(s_safe, dim=-1))
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v, lse


def naive_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    **kw: Any,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
]:
    """``(o, lse, (dq, dk, dv, dbias))`` of ``naive_attention`` by autograd.

    The loss is ``Σ O ⊙ dO`` plus ``Σ LSE ⊙ dLSE`` over rows with a finite LSE
    when ``dlse`` ``(..., Lq)`` is given. q, k, v and do may be 2-, 3- or 4-D;
    gradients come back in their shapes (``dbias`` in bias's, or None); o and
    lse are ``(B, H, Lq, d_v)`` and ``(B, H, Lq)``. ``kw`` goes to ``naive_attention``.
    """
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    o, lse = naive_attention(*(as4d(x) for x in leaves), bias=b, **kw)
    loss = (o * as4d(do)).sum()
    if dlse is not None:
        dl = as4d(dlse.unsqueeze(-1)).squeeze(-1)  # (B, H, Lq)
        loss = loss + torch.where(torch.isinf(lse), 0.0, lse * dl).sum()
    grads = torch.autograd.grad(loss, [*leaves, *([b] if b is not None else [])])
    dbias = grads[3] if b is not None else None
    return o.detach(), lse.detach(), (grads[0], grads[1], grads[2], dbias)


# -- mask formulas (CONVENTIONS.md §2, §3), pair by pair ------------------------------------
def causal_visible(lq: int, lk: int, align: str) -> torch.Tensor:
    """``j <= i`` (top-left) or ``j <= i + Lk - Lq`` (bottom-right), bool ``(Lq, Lk)``."""
    shift = 0 if align == "top_left" else lk - lq
    return torch.tensor([[j <= i + shift for j in range(lk)] for i in range(lq)], dtype=torch.bool)


def window_visible(
    lq: int, lk: int, left: int | None, right: int | None, align: str
) -> torch.Tensor:
    """``c - left <= j <= c + right`` with ``c = i`` or ``i + Lk - Lq``; -1/None unbounded."""
    shift = 0 if align == "top_left" else lk - lq
    rows = []
    for i in range(lq):
        c = i + shift
        row = []
        for j in range(lk):
            ok_left = left in (None, -1) or j >= c - left
            ok_right = right in (None, -1) or j <= c + right
            row.append(ok_left and ok_right)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(lq, lk)


def fa2_sides(left: int | None, right: int | None, seqlen_k: int) -> tuple[int, int]:
    """A window as flash-attn 2's ``flash_api.cpp`` hands it to the kernel (-1 = unbounded).

    A side at or past ``seqlen_k`` is dropped (-1); afterwards a dropped side facing a
    kept one is set to ``seqlen_k``.
    """
    sides = [-1 if x is None else x for x in (left, right)]
    sides = [-1 if x >= seqlen_k else x for x in sides]
    if sides[0] < 0 <= sides[1]:
        sides[0] = seqlen_k
    if sides[1] < 0 <= sides[0]:
        sides[1] = seqlen_k
    return sides[0], sides[1]


def padding_visible(lq: int, lk: int, lengths: list[int], side: str = "right") -> torch.Tensor:
    """Batch b sees keys ``j < lengths[b]`` (right padding) or ``j >= Lk - lengths[b]``
    (left padding): bool ``(B, 1, Lq, Lk)``."""

    def sees(j: int, n: int) -> bool:
        return j < n if side == "right" else j >= lk - n

    return torch.tensor(
        [[[[sees(j, n) for j in range(lk)] for _ in range(lq)]] for n in lengths], dtype=torch.bool
    ).view(len(lengths), 1, lq, lk)


def tile_classes_from_dense(visible: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """0 empty / 1 partial / 2 full for every tile, looping over tiles of a dense mask.

    ``visible`` is ``(..., Lq, Lk)``; a tile is full only if every pair of every
    leading index is visible, empty if none is.
    """
    lq, lk = visible.shape[-2], visible.shape[-1]
    tq, tk = -(-lq // block_q), -(-lk // block_k)
    out = torch.empty(tq, tk, dtype=torch.int8)
    for a in range(tq):
        for b in range(tk):
            tile = visible[..., a * block_q : (a + 1) * block_q, b * block_k : (b + 1) * block_k]
            out[a, b] = 0 if not bool(tile.any()) else (2 if bool(tile.all()) else 1)
    return out


# -- FlexAttention's mods, called as Flex's eager path calls them ------------------------------
def _bhqkv_vmap(fn: Any, *, score: bool) -> Any:
    """``fn`` under ``torch.vmap`` over batch, head, query and key (one scalar per call)."""
    f = fn
    for dim in (3, 2, 1, 0):
        in_dims: list[int | None] = [None] * 4
        in_dims[dim] = 0
        f = torch.vmap(f, in_dims=tuple([0, *in_dims] if score else in_dims))
    return f


def flex_visible(mask_mod: Any, b: int, h: int, lq: int, lk: int) -> torch.Tensor:
    """A mask_mod's dense visibility ``(B, H, Lq, Lk)``, evaluated per element under vmap."""
    idx = (torch.arange(b), torch.arange(h), torch.arange(lq), torch.arange(lk))
    return _bhqkv_vmap(mask_mod, score=False)(*idx)  # type: ignore[no-any-return]


def naive_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask_mod: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's definition, dense: ``(o, lse)``, differentiable in q, k, v and every
    tensor the mods capture. ``(B, H, L, d)`` tensors, K/V heads repeated for GQA; the mods
    are called per element (``torch.vmap``); a fully-masked row has O = 0 and LSE -inf."""
    s, visible = naive_flex_scores(q, k, mask_mod=mask_mod, score_mod=score_mod, scale=scale)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return naive_attention_scores(s, v, visible)


def naive_flex_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    mask_mod: Any = None,
    score_mod: Any = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flex's final scores, dense: ``(s, visible)``, ``s`` ``(B, H, Lq, Lk)`` through the
    score_mod (per element, ``torch.vmap``), ``visible`` the mask_mod's (None without one)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    if score_mod is not None:
        idx = [torch.arange(n) for n in s.shape]
        s = _bhqkv_vmap(score_mod, score=True)(s, *idx)
    visible = None if mask_mod is None else flex_visible(mask_mod, *s.shape)
    return s, visible


def naive_attention_scores(
    s: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of final scores ``s`` ``(B, H, Lq, Lk)`` (masked where ``visible`` is False)
    times ``v``: ``(o, lse)`` with O = 0 and LSE -inf on fully-masked rows."""
    if visible is not None:
        s = torch.where(visible, s, -math.inf)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    s_safe = torch.where(empty, 0.0, s)
    p = torch.softmax(s_safe, dim=-1) * (~empty)
    lse = torch.where(empty.squeeze(-1), -math.inf, torch.logsumexp(s_safe, dim=-1))
    return p @ v, lse
