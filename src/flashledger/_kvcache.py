"""Attention over a KV cache, in flash-attn's terms (``flash_attn_with_kvcache``).

One call of incremental decoding: new keys and values (optional) are written
into the cache *in place* at each sequence's current length, rotary
embeddings (optional) are applied to the new keys and to the queries, and the
queries attend to every key of their sequence's cache, new rows included.

=================  ==========================================  =======================================
argument           shape                                       meaning
=================  ==========================================  =======================================
``q``              (B, Hq, Lq, d)                              queries (the last Lq positions)
``k_cache``        (B_cache, Hkv, L_cache, d)                  keys; paged: (pages, Hkv, page_size, d)
``v_cache``        (B_cache, Hkv, L_cache, d_v)                values; paged likewise
``k``, ``v``       (B, Hkv, L_new, d) / (B, Hkv, L_new, d_v)   rows appended at ``cache_seqlens``
``cache_seqlens``  int or (B,)                                 keys in the cache before the append
``cache_batch_idx``  (B,)                                      cache row of each batch element
``cache_leftpad``  (B,)                                        first used key of each cache row
``block_table``    (B, max_pages)                              paged cache: page of each page slot
``rotary_cos/sin``  (L_ro, rotary_dim / 2)                     rotary tables, by absolute position
=================  ==========================================  =======================================

With ``layout="bshd"`` every tensor is in flash-attn's ``(batch, seqlen, heads,
dim)`` order instead (paged caches ``(pages, page_size, Hkv, d)``).

Sequence ``b`` uses cache positions ``[leftpad_b, n_b)`` with ``n_b =
cache_seqlens_b + L_new``; positions inside it count from ``leftpad_b``. Its
queries are the last ``Lq`` positions: ``Causal()`` and ``SlidingWindow``
without ``align`` are bottom-right aligned to ``n_b - leftpad_b`` whatever the
conventions, and ALiBi distances follow the same diagonal. Windows are read as
the conventions say (flash-attn 2 rewrites their sides against the cache's
capacity). Rotary (flash-attn's kernel, ``flash_fwd_kernel.h``): new key ``t``
is rotated at position ``cache_seqlens_b + t``; queries at ``cache_seqlens_b +
t`` under a causal or windowed mask, otherwise all at ``cache_seqlens_b``.

The attention itself is the blocked loop (``blocked_forward``) or, with
``num_splits > 1``, split-KV (``split_kv_forward``) on the used keys; a paged,
batch-indexed or left-padded cache is first gathered into one contiguous copy
of its used rows, a plain cache is sliced (the loop lays the slice out
contiguously when it is strided). The ledger books the cache bytes the step
reads: per sequence, the span of keys at least one of its queries can see; and
the bytes of every copy of the used rows, as the code that made it reports it.
``cache_seqlens=None`` (flash-attn's default) puts every cache position in use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Unpack

import torch
import torch.autograd.forward_ad as _forward_ad

from ._checks import all_finite, broadcasts_to, check_finite, check_float_tensor, check_size
from ._eager import opaque_to_compile
from ._options import AttentionOptions, check_options
from ._problem import Placement, _as_real, check_option_values
from .blocked import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    blocked_forward,
    split_kv_forward,
)
from .conventions import get_conventions
from .ledger import Ledger
from .masks import (
    And,
    Causal,
    Geometry,
    IntervalBound,
    Mask,
    SlidingWindow,
    _SequenceBounds,
    as_mask,
    fa2_window,
)

__all__ = ["KVCacheLedger", "KVCacheResult", "apply_rotary", "attention_with_kvcache"]

Layout = Literal["bhsd", "bshd"]


# ----------------------------------------------------------------------------------------
# rotary embedding
# ----------------------------------------------------------------------------------------
def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotary embedding of the first ``rotary_dim = 2 · cos.shape[-1]`` dims of ``x``.

    ``x`` ``(..., L, d)``; ``cos``, ``sin`` ``(L_ro, rotary_dim / 2)``; ``positions``
    integer, broadcastable to ``(..., L)``: the table row of each vector. Pairs
    ``(x_i, x_{i + r/2})`` (GPT-NeoX, ``interleaved=False``) or ``(x_{2i}, x_{2i+1})``
    (GPT-J, ``interleaved=True``) turn by the angle whose cosine and sine the tables
    hold: ``(a, b) -> (a cos - b sin, a sin + b cos)``. Computed in float64 for
    float64 inputs (float32 otherwise) and returned in ``x``'s dtype; dims past
    ``rotary_dim`` are copied. A position outside ``0 .. L_ro - 1`` (no wrapping from
    the end), ``positions`` that do not broadcast to ``(..., L)`` and a head dim below
    ``rotary_dim`` raise ``ValueError``; positions that are not integers, ``TypeError``.
    """
    _check_rotary(x, cos, sin, positions)
    half = cos.shape[-1]
    r = 2 * half
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(work)[positions]  # (..., L, r/2)
    s = sin.to(work)[positions]
    xr = x[..., :r].to(work)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)  # (..., L, r)
    else:
        a, b = xr[..., :half], xr[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)  # (..., L, r)
    return torch.cat((rot.to(x.dtype), x[..., r:]), dim=-1)


def _check_rotary(x: Any, cos: Any, sin: Any, positions: Any) -> None:
    """``apply_rotary``'s arguments, named when they are not what it takes."""
    check_float_tensor("x", x)
    check_float_tensor("cos", cos)
    check_float_tensor("sin", sin)
    if cos.ndim != 2 or sin.shape != cos.shape or cos.shape[1] < 1:
        raise ValueError(
            "cos and sin must be (L_ro, rotary_dim / 2), one shape, rotary_dim >= 2, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if x.ndim < 1 or x.shape[-1] < 2 * cos.shape[1]:
        raise ValueError(
            f"x's head dim must be at least rotary_dim = 2 * {cos.shape[1]} (cos.shape[-1] "
            f"pairs), got x of shape {tuple(x.shape)}"
        )
    pos = positions if isinstance(positions, torch.Tensor) else torch.as_tensor(positions)
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise TypeError(
            f"positions must be integers (table rows 0 .. {cos.shape[0] - 1}), got {pos.dtype}"
        )
    if not broadcasts_to(pos.shape, x.shape[:-1]):
        raise ValueError(
            f"positions must broadcast to x's (..., L) = {tuple(x.shape[:-1])}, got shape "
            f"{tuple(pos.shape)}"
        )
    if pos.numel():
        lo, hi = (int(t) for t in torch.aminmax(pos))
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(
                f"positions must be table rows 0 .. {cos.shape[0] - 1} (cos has "
                f"{cos.shape[0]} rows), got values from {lo} to {hi}"
            )


# ----------------------------------------------------------------------------------------
# the ledger
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCacheLedger:
    """What one cached attention step moved, in bytes of the cache's dtype.

    ``keys_read[b]``: keys of sequence ``b`` the step reads (the span its queries
    can see, or every used row where the cache is gathered; all ``K`` and ``V`` heads
    of each); ``cache_bytes_read`` their bytes,
    ``K`` and ``V`` together; ``cache_bytes_written`` the appended rows;
    ``gathered_bytes`` the bytes written by the copies of the used K/V rows the step
    made, each booked where it was made and in its own dtype: the gather of a paged,
    batch-indexed or left-padded cache (one copy, in the cache's dtype) and the loop's
    (``forward.kv_bytes_copied``: a strided view of a plain cache's used rows laid out
    contiguously, K/V converted to the accumulation dtype, Kᵀ or Vᵀ laid out); 0 when
    the loop reads the cache where it lies. ``pages_read`` the page slots the read
    spans touch (paged caches only). ``forward`` is the blocked loop's own ledger
    (counters summed over splits).
    """

    batch: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    itemsize: int
    new_rows: int
    used: tuple[int, ...]  # keys in use per sequence after the append
    keys_read: tuple[int, ...]
    cache_bytes_read: int
    cache_bytes_written: int
    gathered_bytes: int
    pages_read: int | None
    splits: int
    forward: Ledger = field(repr=False)

    def rows(self) -> list[tuple[str, str, str]]:
        """``(item, value, note)`` rows of the summary table."""
        per_key = self.heads_kv * (self.head_dim + self.head_dim_v) * self.itemsize
        out = [
            ("sequences", f"{self.batch}", f"{self.heads_kv} K/V heads, {per_key} B per key"),
            ("keys in use", f"{sum(self.used):,}", f"per sequence {list(self.used)}"),
            ("keys read", f"{sum(self.keys_read):,}", f"per sequence {list(self.keys_read)}"),
            ("cache bytes read", f"{self.cache_bytes_read:,}", "K and V of the keys read"),
            (
                "cache bytes written",
                f"{self.cache_bytes_written:,}",
                f"{self.new_rows} new row{'' if self.new_rows == 1 else 's'} per sequence, "
                "in place",
            ),
            (
                "bytes gathered",
                f"{self.gathered_bytes:,}",
                "copies of the used rows: the gather, the loop's layouts",
            ),
        ]
        if self.pages_read is not None:
            out.append(("pages read", f"{self.pages_read:,}", "page slots the reads touch"))
        c = self.forward.counters
        out += [
            ("splits", f"{self.splits}", "key chunks merged by the one merge"),
            ("tiles run", f"{c.tiles_run:,}", f"{c.tiles_skipped:,} skipped"),
            ("QK dots", f"{c.qk_dots_visible:,}", f"visible; {c.qk_dots_computed:,} computed"),
        ]
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready figures (the loop's counters under ``forward``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "forward"}
        d["used"], d["keys_read"] = list(self.used), list(self.keys_read)
        d["forward"] = self.forward.counters.to_dict()
        return d

    def __str__(self) -> str:
        rows = self.rows()
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines = ["KV-cache step ledger"]
        lines += [f"  {a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        body = "".join(
            f"<tr><td>{html.escape(a)}</td><td style='text-align:right'>{html.escape(b)}</td>"
            f"<td>{html.escape(c)}</td></tr>"
            for a, b, c in self.rows()
        )
        return f"<p><b>KV-cache step ledger</b></p><table>{body}</table>"


@dataclass(frozen=True)
class KVCacheResult:
    """``o`` like ``q`` with ``d_v`` (``(B, Hq, Lq, d_v)``, or bshd), ``lse`` ``(B, Hq, Lq)``."""

    o: torch.Tensor
    lse: torch.Tensor
    ledger: KVCacheLedger


# ----------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------
def _int_vector(name: str, x: Any, n: int) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.ndim != 1 or t.numel() != n:
        raise ValueError(f"{name} must have shape (B,) = ({n},), got {tuple(t.shape)}")
    return t.to(torch.int64).cpu()


def _mask_leaves(mask: Mask | None) -> list[Mask]:
    if mask is None:
        return []
    if isinstance(mask, And):
        return _mask_leaves(mask.a) + _mask_leaves(mask.b)
    return [mask]


def _check_layout(name: str, x: Any, ndim: int = 4) -> torch.Tensor:
    check_float_tensor(name, x)
    if x.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor, got shape {tuple(x.shape)}")
    return x  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------------
# the entry point
# ----------------------------------------------------------------------------------------
def _check_paged_writes(
    table: torch.Tensor,
    used_slots: torch.Tensor,
    seqlens: torch.Tensor,
    start: torch.Tensor,
    total: torch.Tensor,
    page: int,
    l_new: int,
) -> None:
    """Refuses a paged append that writes a cache cell some sequence reads: another
    sequence's (a page shared for reading, as a common prompt's), or one it reads itself
    at another position (a page named twice). ``table`` ``(B, max_pages)``,
    ``used_slots`` the page slots each sequence reads, ``seqlens``/``start``/``total``
    ``(B,)``. Only the pages that more than one slot in use names are looked at closely."""
    pos = seqlens[:, None] + torch.arange(l_new)  # (B, L_new) positions appended
    wslot = pos // page  # (B, L_new)
    wpage = table.gather(1, wslot)  # (B, L_new)
    counts = torch.bincount(table[used_slots], minlength=int(table.max()) + 1)
    shared = counts[wpage] > 1  # (B, L_new)
    if not bool(shared.any()):
        return
    for b, i in torch.nonzero(shared).tolist():
        p, off = int(wpage[b, i]), int(pos[b, i]) % page
        for b2, j in torch.nonzero((table == p) & used_slots).tolist():
            at = j * page + off  # where sequence b2 sees that cell
            if (b2, j) == (b, int(wslot[b, i])) or not int(start[b2]) <= at < int(total[b2]):
                continue
            who = "it also reads" if b2 == b else f"sequence {b2} reads"
            raise ValueError(
                f"block_table: sequence {b} appends its position {int(pos[b, i])} to page {p} "
                f"offset {off}, which {who} as its position {at}; appending would change "
                "what that position holds. Pages several sequences share can only be read: "
                "give each sequence pages of its own for the rows it appends"
            )


@opaque_to_compile  # as flash_attention
def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    num_splits: int = 1,
    layout: Layout = "bhsd",
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    **opts: Unpack[AttentionOptions],
) -> KVCacheResult:
    """One attention step over a KV cache (flash-attn's ``flash_attn_with_kvcache``).

    Shapes and meaning in the module docstring (``B >= 1``, as flash-attn's).
    ``cache_seqlens`` None (flash-attn's default): every cache position is in use, and
    no rows can be appended. ``k``/``v`` (both or neither) are
    written into ``k_cache``/``v_cache`` in place, at positions ``cache_seqlens[b]``
    onwards of cache row ``cache_batch_idx[b]`` (default ``b``), or through
    ``block_table`` for a paged cache (``cache_batch_idx`` cannot be combined with
    it). ``rotary_cos``/``rotary_sin`` (with ``k``) rotate the new keys and the
    queries (``rotary_interleaved``: GPT-J pairs; False: GPT-NeoX halves).
    ``num_splits > 1`` runs split-KV. ``opts``: ``mask`` (``Causal``,
    ``SlidingWindow`` or their ``&``, aligned to each sequence's cache length),
    ``scale``, ``conventions``, ``softcap`` (0.0, flash-attn's default, is none),
    ``alibi_slopes`` (``(H,)`` or ``(B, H)``); dropout, bias, ``cu_seqlens`` and
    ``seqused`` are not taken (``cache_seqlens`` is the used length). The cache must
    share q's dtype. Every check runs before the cache is written: a call that raises
    leaves it as it was. Not differentiable, and not under ``torch.func`` transforms.
    """
    check_options(
        "attention_with_kvcache",
        opts,
        refused=(
            "bias",
            "dropout_mask",
            "cu_seqlens_q",
            "cu_seqlens_k",
            "seqused_q",
            "seqused_k",
        ),
    )
    if opts.get("dropout_p", 0.0) not in (0, 0.0, None):
        raise ValueError(
            "attention_with_kvcache does not take dropout (flash-attn's cached path has none); "
            f"got dropout_p={opts['dropout_p']!r}"
        )
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be True or False, got {rotary_interleaved!r}")
    check_size("num_splits", num_splits)
    check_size("block_q", block_q)
    check_size("block_k", block_k)
    for name, allowed in (
        ("scale", "a finite number (default 1/sqrt(d))"),
        ("softcap", "None or a finite number > 0"),
    ):  # a NumPy scalar or a 0-d tensor by value, as every other entry point takes them
        if name in opts:
            opts = {**opts, name: _as_real(name, opts[name], allowed)}  # type: ignore[misc]
    if opts.get("softcap") == 0:  # flash-attn's default, 0.0, means no softcap
        opts = {**opts, "softcap": None}  # type: ignore[typeddict-item]
    # everything that can fail is checked before the cache is written: a call that raises
    # leaves the caller's cache as it was
    check_option_values(
        scale=1.0 if opts.get("scale") is None else opts["scale"],
        dropout_p=0.0,
        seed=opts.get("seed", 0),
        softcap=opts.get("softcap"),
        alibi_slopes=opts.get("alibi_slopes"),
        bias=None,
    )
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "attention_with_kvcache under torch.func transforms (vmap, grad) is not supported: "
            "it writes the cache in place; call it once per sample, or use flash_attention on "
            "the keys in use"
        )
    given = [x for x in (q, k_cache, v_cache, k, v) if isinstance(x, torch.Tensor)]
    if _forward_ad._current_level >= 0 and any(  # (-1 outside a dual_level)
        _forward_ad.unpack_dual(x).tangent is not None for x in given
    ):
        raise RuntimeError(
            "attention_with_kvcache is not differentiable, in forward mode either: an input "
            "is a dual tensor (torch.autograd.forward_ad), whose tangent would be dropped; "
            "use flash_attention on the keys in use for a reverse-mode gradient"
        )
    if torch.is_grad_enabled() and any(x.requires_grad for x in given):
        raise ValueError(
            "attention_with_kvcache is not differentiable (it writes the cache in place and "
            "records no graph), and an input requires a gradient: call it under "
            "torch.no_grad() to decode, or use flash_attention on the keys in use for a "
            "gradient"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            check_float_tensor(name, x)  # (a float8 dtype: named here, before a sum reads it)
            check_finite(name, x)  # names the first NaN or inf by index

    def bhsd(name: str, x: torch.Tensor) -> torch.Tensor:
        x = _check_layout(name, x)
        return x.transpose(1, 2) if layout == "bshd" else x

    q = bhsd("q", q)
    k_cache, v_cache = bhsd("k_cache", k_cache), bhsd("v_cache", v_cache)
    b, hq, lq, d = q.shape
    if b < 1 or hq < 1:  # as flash-attn ("batch size must be positive") and flash_attention
        raise ValueError(
            f"q must hold at least one sequence and one head (batch and head counts >= 1), "
            f"got shape {tuple(q.shape)} in layout {layout}"
        )
    hkv, dv = k_cache.shape[1], v_cache.shape[-1]
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            "k_cache and v_cache must agree on every dim but the head dim: "
            f"{tuple(k_cache.shape)} vs {tuple(v_cache.shape)} (layout {layout})"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    if k_cache.shape[-1] != d:
        raise ValueError(f"k_cache's head dim {k_cache.shape[-1]} must equal q's ({d})")
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(
            f"the query heads ({hq}) must be a multiple of the cache's K/V heads ({hkv})"
        )
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError("q, k_cache and v_cache must be on one device")
    dev = q.device
    # -- where each sequence lives --
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx cannot be combined with block_table (the block table already "
                "says where each sequence's pages are)"
            )
        bt = block_table if isinstance(block_table, torch.Tensor) else torch.as_tensor(block_table)
        if bt.is_floating_point() or bt.dtype == torch.bool or bt.ndim != 2 or bt.shape[0] != b:
            raise ValueError(
                f"block_table must be an integer tensor of shape (B, max_pages) = ({b}, ...), "
                f"got {tuple(bt.shape)} {bt.dtype}"
            )
        page = k_cache.shape[2]
        capacity = bt.shape[1] * page
        table = bt.to(device=dev, dtype=torch.int64)
    else:
        page, capacity, table = 0, k_cache.shape[2], None
    if cache_seqlens is None:  # flash-attn's default: the whole cache is in use
        if k is not None:
            raise ValueError(
                "cache_seqlens must be given with k and v (the rows are appended at each "
                "sequence's cache_seqlens); None means every cache position is in use, as "
                "flash-attn reads it, and leaves no room to append"
            )
        seqlens = torch.full((b,), capacity, dtype=torch.int64)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((b,), cache_seqlens, dtype=torch.int64)
    else:
        seqlens = _int_vector("cache_seqlens", cache_seqlens, b)
    rows_idx = torch.arange(b, dtype=torch.int64)
    if cache_batch_idx is not None:
        rows_idx = _int_vector("cache_batch_idx", cache_batch_idx, b)
        bad = (rows_idx < 0) | (rows_idx >= k_cache.shape[0])
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"cache_batch_idx[{i}] = {int(rows_idx[i])} is outside 0..{k_cache.shape[0] - 1}"
            )
    elif not paged and k_cache.shape[0] < b:
        raise ValueError(
            f"the cache has {k_cache.shape[0]} rows for {b} sequences; give cache_batch_idx or "
            "a larger cache"
        )
    start = torch.zeros(b, dtype=torch.int64)
    if cache_leftpad is not None:
        start = _int_vector("cache_leftpad", cache_leftpad, b)
    # -- the new rows --
    if (k is None) != (v is None):
        raise ValueError("k and v (the rows to append) must be given together")
    l_new = 0
    if k is not None and v is not None:
        k, v = bhsd("k", k), bhsd("v", v)
        if k.shape != (b, hkv, k.shape[2], d) or v.shape != (b, hkv, k.shape[2], dv):
            raise ValueError(
                f"k and v must be (B, Hkv, L_new, d) = ({b}, {hkv}, L_new, {d}) and "
                f"(..., {dv}) in layout bhsd, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
            raise TypeError(
                f"k and v must have the cache's dtype {k_cache.dtype}, got {k.dtype}, {v.dtype}"
            )
        l_new = k.shape[2]
    total = seqlens + l_new  # (B,) one past each sequence's last key
    for name, t in (("cache_seqlens", seqlens), ("cache_leftpad", start)):
        if bool((t < 0).any()):
            raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    if bool((total > capacity).any()):
        i = int(torch.nonzero(total > capacity)[0, 0])
        raise ValueError(
            f"sequence {i}: cache_seqlens {int(seqlens[i])} + {l_new} new rows = {int(total[i])} "
            f"exceeds the cache's capacity of {capacity} positions"
        )
    if bool((start > seqlens).any()):
        i = int(torch.nonzero(start > seqlens)[0, 0])
        raise ValueError(
            f"cache_leftpad[{i}] = {int(start[i])} is past cache_seqlens[{i}] = {int(seqlens[i])}"
        )
    if paged:
        assert table is not None
        need = (total + page - 1) // page  # page slots in use per sequence
        slot = torch.arange(table.shape[1])[None, :]
        used_slots = (slot < need[:, None]) & (slot >= (start // page)[:, None])  # (B, max_pages)
        vals = table.cpu()[used_slots]
        if vals.numel() and bool(((vals < 0) | (vals >= k_cache.shape[0])).any()):
            raise ValueError(
                f"block_table names pages outside 0..{k_cache.shape[0] - 1} for positions in use"
            )
        if l_new:
            _check_paged_writes(table.cpu(), used_slots, seqlens, start, total, page, l_new)
    if l_new and cache_batch_idx is not None and rows_idx.unique().numel() != b:
        raise ValueError(
            "cache_batch_idx repeats a cache row; appending would write that row twice"
        )
    if l_new:
        _check_writable(k_cache, v_cache)
    # -- mask, conventions --
    mask = as_mask(opts.get("mask"))
    for leaf in _mask_leaves(mask):
        if not isinstance(leaf, Causal | SlidingWindow):
            raise ValueError(
                "attention_with_kvcache takes Causal, SlidingWindow or their & as mask "
                f"(aligned to each sequence's cache length), got {leaf!r}"
            )
    conv = get_conventions(opts.get("conventions"))
    conv_cache = dataclasses.replace(conv, causal_align="bottom_right")
    # -- rotary --
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if k is None:
            raise ValueError(
                "rotary_cos/rotary_sin rotate the appended keys and the queries: give k and v"
            )
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_float_tensor(name, t)
            if t.ndim != 2 or t.shape != rotary_cos.shape:
                raise ValueError(
                    f"{name} must be (L_ro, rotary_dim / 2), both the same shape, got "
                    f"{tuple(t.shape)}"
                )
        if 2 * rotary_cos.shape[1] > d or rotary_cos.shape[1] < 1:
            raise ValueError(
                f"rotary_dim = 2 * {rotary_cos.shape[1]} must be between 2 and the head dim {d}"
            )
    # -- write the new rows, rotated --
    window_len = capacity if conv.window_rewrite == "flash_attn_2" else None
    windowed = _windowed(mask, window_len)
    if rotary:  # the queries' positions too, before anything is written
        assert rotary_cos is not None
        t_q = torch.arange(lq)[None, :] if windowed else torch.zeros(1, lq, dtype=torch.int64)
        pos_q = seqlens[:, None] + t_q  # (B, Lq)
        _check_rows("rotary_cos", rotary_cos, int(pos_q.max()))
        _check_rows("rotary_cos", rotary_cos, int(seqlens.max()) + l_new - 1)
    undo: list[tuple[torch.Tensor, torch.Tensor]] = []  # (cache, its rows before the append)

    def put_back() -> None:
        """The rows the append overwrote, written back: a call that raises leaves the cache
        as it was."""
        for cache, before in reversed(undo):
            with contextlib.suppress(Exception):
                _write(cache, before, pos_new, rows_idx, table, page)

    if k is not None and v is not None:
        pos_new = seqlens[:, None] + torch.arange(l_new)[None, :]  # (B, L_new) absolute positions
        if rotary:
            assert rotary_cos is not None and rotary_sin is not None
            k = apply_rotary(
                k,
                rotary_cos.to(dev),
                rotary_sin.to(dev),
                pos_new[:, None].to(dev),
                interleaved=rotary_interleaved,
            )
        try:
            for cache, rows_new in ((k_cache, k), (v_cache, v)):
                # the rows the append overwrites, put back if anything below raises
                undo.append((cache, _read(cache, pos_new, rows_idx, table, page)))
                _write(cache, rows_new, pos_new, rows_idx, table, page)
        except BaseException:  # v_cache's write failed after k_cache's: k_cache as it was
            put_back()
            raise
    if rotary:
        assert rotary_cos is not None and rotary_sin is not None
        q = apply_rotary(
            q,
            rotary_cos.to(dev),
            rotary_sin.to(dev),
            pos_q[:, None].to(dev),
            interleaved=rotary_interleaved,
        )
    # -- the keys in use, as one (B, Hkv, L, d) view or copy --
    used = total - start  # (B,)
    lview = max(1, int(used.max()))
    plain = not paged and cache_batch_idx is None and bool((start == 0).all())
    if plain:
        kk, vv = k_cache[:b, :, :lview], v_cache[:b, :, :lview]
        plain = _tails_finite(kk, vv, used)
    gathered = 0  # bytes of the copies of K and V made here; the loop books its own
    if not plain:
        kk = _gather(k_cache, start, used, lview, rows_idx, table, page)
        vv = _gather(v_cache, start, used, lview, rows_idx, table, page)
        gathered = (kk.numel() + vv.numel()) * kk.element_size()
    # -- attend --
    run_opts: dict[str, Any] = {n: x for n, x in opts.items() if n != "conventions"}
    run_opts.update(conventions=conv_cache, seqused_k=used)
    place = Placement(lk_total=capacity)
    try:
        if num_splits > 1:
            res = split_kv_forward(
                q,
                kk,
                vv,
                num_splits=min(num_splits, lview),
                block_q=block_q,
                block_k=block_k,
                placement=place,
                **run_opts,
            )
        else:
            res = blocked_forward(
                q, kk, vv, block_q=block_q, block_k=block_k, placement=place, **run_opts
            )
    except BaseException as exc:
        # a check only the loop can make (the shape or range of an option, a NaN in the
        # keys in use, a score_mod's error) failed after the append
        put_back()
        if isinstance(exc, ValueError):  # name the caller's arguments, not the loop's
            msg = str(exc)
            for inner, outer in (
                ("k ", "k_cache (keys in use) "),
                ("v ", "v_cache (values in use) "),
            ):
                if msg.startswith(inner + "contains"):
                    raise ValueError(outer + msg[len(inner) :]) from None
        raise
    # -- the ledger: the span of keys each sequence's queries see --
    geo = Geometry.build(
        lq=lq,
        lk=lview,
        batch=b,
        heads=hq,
        conventions=conv_cache,
        lk_total=capacity,
        seqused_k=used,
    )
    bound = (_SequenceBounds() if mask is None else (_SequenceBounds() & mask)).bind(geo)
    assert isinstance(bound, IntervalBound)
    lo, hi = bound.lo.expand(b, lq), bound.hi.expand(b, lq)  # (B, Lq) first / last key seen
    seen = lo <= hi
    first = torch.where(seen, lo, lview).amin(dim=1).cpu()  # (B,)
    last = torch.where(seen, hi, -1).amax(dim=1).cpu()  # (B,)
    if not plain:  # the gather read every used row of the cache, seen or not
        first = torch.where(used > 0, 0, lview)
        last = used - 1
    keys_read = torch.clamp(last - first + 1, min=0)  # (B,)
    item = k_cache.element_size()
    per_key = hkv * (d + dv) * item
    pages_read = None
    if paged:
        a = (start + first) // page
        z = (start + last) // page
        pages_read = int(torch.where(keys_read > 0, z - a + 1, 0).sum())
    ledger = KVCacheLedger(
        batch=b,
        heads_kv=hkv,
        head_dim=d,
        head_dim_v=dv,
        itemsize=item,
        new_rows=l_new,
        used=tuple(int(x) for x in used.tolist()),
        keys_read=tuple(int(x) for x in keys_read.tolist()),
        cache_bytes_read=int(keys_read.sum()) * per_key,
        cache_bytes_written=b * l_new * per_key,
        gathered_bytes=gathered + res.ledger.kv_bytes_copied,
        pages_read=pages_read,
        splits=min(num_splits, lview),
        forward=res.ledger,
    )
    o = res.o.transpose(1, 2) if layout == "bshd" else res.o
    return KVCacheResult(o=o, lse=res.lse, ledger=ledger)


def _windowed(mask: Mask | None, window_len: int | None) -> bool:
    """flash-attn's "causal or local": the mask bounds keys by position (sides as read)."""
    for leaf in _mask_leaves(mask):
        if isinstance(leaf, Causal):
            return True
        if isinstance(leaf, SlidingWindow):
            left = None if leaf.left in (None, -1) else leaf.left
            right = None if leaf.right in (None, -1) else leaf.right
            if window_len is not None:
                left, right = fa2_window(left, right, window_len)
            if left is not None or right is not None:
                return True
    return False


def _check_rows(name: str, table: torch.Tensor, top: int) -> None:
    if top >= table.shape[0]:
        raise ValueError(
            f"{name} has {table.shape[0]} rows; the rotary positions in use reach {top}"
        )


def _slots(
    pos: torch.Tensor, rows: torch.Tensor, table: torch.Tensor | None, page: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache ``(row, position)`` index pairs of absolute positions ``pos`` ``(B, L)``."""
    if table is None:
        return rows[:, None].expand_as(pos), pos
    p = pos.to(table.device)
    return table.gather(1, p // page).cpu(), (p % page).cpu()


def _write(
    cache: torch.Tensor,
    new: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor | None,
    page: int,
) -> None:
    """``cache[row, :, position] = new[b, :, t]`` for every ``(b, t)``, in place."""
    r, p = _slots(pos, rows, table, page)  # (B, L_new) each
    dev = cache.device
    cache[r.to(dev), :, p.to(dev)] = new.transpose(1, 2)  # (B, L_new, Hkv, d)


def _check_writable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Refuse, before anything is written, caches the append cannot write one cell per
    position into: an expanded view (stride 0 along a dimension of more than one element,
    e.g. a prompt's cache ``expand``-ed across beams, whose rows are one memory), the same
    tensor as keys and values, or an inference tensor outside ``torch.inference_mode()``
    (PyTorch writes it and then raises)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        shared = [
            i for i, (n, st) in enumerate(zip(cache.shape, cache.stride())) if n > 1 and st == 0
        ]
        if shared or torch._debug_has_internal_overlap(cache) == 1:
            where = f" (dim {shared[0]} has stride 0)" if shared else ""
            raise ValueError(
                f"{name} has positions that share memory{where}, as an expand()-ed cache does: "
                "the append would write several sequences' or heads' rows into one place; "
                f"give each its own memory ({name}.contiguous() or .clone())"
            )
        if cache.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(
                f"{name} is an inference tensor (made under torch.inference_mode()), which the "
                "append cannot write outside inference mode; call attention_with_kvcache under "
                "torch.inference_mode() too, or pass a cache made outside it"
            )
    if k_cache.data_ptr() == v_cache.data_ptr() and k_cache.stride() == v_cache.stride():
        raise ValueError(
            "k_cache and v_cache are the same memory: the values' append would overwrite the "
            "keys'; pass two caches"
        )


def _read(
    cache: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor | None,
    page: int,
) -> torch.Tensor:
    """A copy of ``cache[row, :, position]`` for every ``(b, t)``, laid out as ``_write``
    takes its rows: ``(B, Hkv, L, X)``."""
    r, p = _slots(pos, rows, table, page)
    dev = cache.device
    return cache[r.to(dev), :, p.to(dev)].transpose(1, 2)  # (B, Hkv, L, X)


def _gather(
    cache: torch.Tensor,
    start: torch.Tensor,
    used: torch.Tensor,
    lview: int,
    rows: torch.Tensor,
    table: torch.Tensor | None,
    page: int,
) -> torch.Tensor:
    """The used keys of every sequence, left-aligned: ``(B, Hkv, lview, X)`` (zeros past
    use), contiguous, in one copy of the cache's rows."""
    j = torch.arange(lview)[None, :]  # (1, lview)
    live = j < used[:, None]  # (B, lview)
    # a valid position everywhere: a sequence using nothing may start past the cache's end
    pos = torch.where(live, start[:, None] + j, 0)  # (B, lview)
    r, p = _slots(pos, rows, table, page)
    dev = cache.device
    heads = torch.arange(cache.shape[1], device=dev)[None, :, None]  # (1, Hkv, 1)
    # the index tensors broadcast to (B, Hkv, lview): the copy comes in the loop's layout
    out = cache[r.to(dev)[:, None, :], heads, p.to(dev)[:, None, :]]  # (B, Hkv, lview, X)
    return out.masked_fill_(~live.to(dev)[:, None, :, None], 0.0)


def _tails_finite(kk: torch.Tensor, vv: torch.Tensor, used: torch.Tensor) -> bool:
    """True when the rows past each sequence's use, inside the view, hold finite values
    (they are read by partial tiles and multiplied by exact zeros)."""
    for i, n in enumerate(used.tolist()):
        if n < kk.shape[2] and not (all_finite(kk[i, :, n:]) and all_finite(vv[i, :, n:])):
            return False
    return True


def _demo() -> None:
    """Decode three steps into a paged cache and print the last step's ledger."""
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, d, page = 2, 4, 2, 8, 4
    pages = torch.randn(6, hkv, page, d, generator=gen, dtype=torch.float64)
    k_cache, v_cache = pages.clone(), pages.clone()
    table = torch.tensor([[4, 1, 5], [0, 2, 3]])
    lens = torch.tensor([3, 7])
    for step in range(3):
        q = torch.randn(b, hq, 1, d, generator=gen, dtype=torch.float64)
        kn = torch.randn(b, hkv, 1, d, generator=gen, dtype=torch.float64)
        vn = torch.randn(b, hkv, 1, d, generator=gen, dtype=torch.float64)
        res = attention_with_kvcache(
            q, k_cache, v_cache, kn, vn, cache_seqlens=lens, block_table=table, mask=Causal()
        )
        lens = lens + 1
        print(f"step {step}: o[0, 0, 0, :3] = {[round(x, 4) for x in res.o[0, 0, 0, :3].tolist()]}")
    print(res.ledger)
    assert math.isfinite(float(res.lse.sum()))


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("_kvcache", _demo)
