"""Ring attention: the blocked loop with the key index running over ranks.

Each of ``W`` ranks holds a shard of Q, K and V along the sequence (see
``_ring_layout``). One rank's forward, step ``t = 0 .. W-1``:

1. post the K/V shard it holds to the next rank and a receive from the
   previous one (step ``t < W-1``), then compute while it travels;
2. attend its query chunks to the shard it holds (owner ``(rank - t) mod W``),
   one ``blocked_forward(..., placement=..., raw_lse=True)`` per (query chunk,
   key chunk) pair, global positions for masks, ALiBi, bias and dropout; a pair
   the mask hides entirely is skipped and booked;
3. merge each pair's partial ``(o, lse)`` into the running result of its query
   chunk with ``online.merge_partials`` (the one merge);
4. wait for the next shard;
5. with ``RingLedger(record_states=True)``, record a ``RankState``: copies of the
   merged partial ``(o, lse)`` of all its query rows so far.

The conventions' LSE for fully-masked rows is applied only to the final LSE.

Backward, same ring: the K/V shards travel again and each pair is recomputed
with ``blocked_backward`` against this rank's final ``o`` and ``lse``.
``dQ`` stays local; the ``dK``/``dV`` of the shard held accumulate as they
travel (accumulation dtype) and reach their owner after a full circle. A
recorded backward ``RankState`` holds ``dq`` after the step and the
accumulators ``dk_s``, ``dv_s`` the rank has just passed on:

=========  ===============  ===============================  =========================
symbol     variable         shape                            where it lives
=========  ===============  ===============================  =========================
Q, O, dO   ``qa, oa, doa``  (..., Lq_shard, d | d_v)         this rank, all steps
λ (LSE)    ``lse``          (..., Lq_shard)                  this rank (-inf: no key)
K, V       ``k_cur, v_cur`` (..., Lk_shard(src), d | d_v)    travels: src = rank - t
dQ         ``dq``           (..., Lq_shard, d)               this rank
dK, dV     ``dk_s, dv_s``   (..., Lk_shard(src), d | d_v)    travels with the shard
=========  ===============  ===============================  =========================
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Unpack, cast

import torch

from . import online
from ._checks import check_finite, check_qkv, check_size
from ._limits import RING_TIMEOUT_S
from ._mods import find_captured
from ._options import AttentionOptions, check_options
from ._problem import Placement, build_problem, check_option_values, gradient_overflow
from ._ring_agree import (
    FIELDS,
    describe_options,
    digest,
    gather_texts,
    mismatch_message,
    raise_together,
)
from ._ring_layout import (
    Chunk,
    Layout,
    check_layout,
    check_world,
    chunk_bounds,
    shard_chunks,
    shard_sequence,
    unshard_sequence,
)
from ._ring_ledger import Hop, PairStep, RankState, RingLedger, RingSetup
from ._ring_transport import (
    DistTransport,
    LocalHub,
    LocalTransport,
    Pending,
    RingAborted,
    Transport,
)
from .blocked import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, blocked_backward, blocked_forward
from .conventions import SEED, Conventions, get_conventions
from .ledger import Counters
from .masks import EMPTY, Mask, as_mask
from .reference import _conventional_lse

__all__ = ["RingResult", "ring_attention", "simulate_ring"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_META = ("ndim", "batch", "heads_q", "heads_kv", "d", "d_v", "Lq", "Lk", "dtype", "layout")


@dataclass(frozen=True)
class _Options:
    """Everything a pair's blocked call takes besides tensors and placement."""

    mask: Mask | None
    conventions: Conventions
    rest: dict[str, Any]  # the other attention options, as given (values checked per call)
    block_q: int
    block_k: int

    @staticmethod
    def build(where: str, opts: Mapping[str, Any], *, block_q: int, block_k: int) -> _Options:
        check_options(
            where, opts, refused=("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
        )
        check_size("block_q", block_q)
        check_size("block_k", block_k)
        bias = opts.get("bias")
        if bias is not None and isinstance(bias, torch.Tensor) and bias.requires_grad:
            raise ValueError(
                "ring attention does not compute a gradient for bias; pass bias.detach() "
                "(bias is allowed as a constant of global shape (B, H, Lq, Lk))"
            )
        rest = {n: x for n, x in opts.items() if n not in ("mask", "conventions")}
        return _Options(
            mask=as_mask(opts.get("mask")),
            conventions=get_conventions(opts.get("conventions", SEED)),
            rest=rest,
            block_q=block_q,
            block_k=block_k,
        )

    def blocked_kwargs(self) -> dict[str, Any]:
        return dict(
            mask=self.mask,
            conventions=self.conventions,
            **self.rest,
            block_q=self.block_q,
            block_k=self.block_k,
        )


@dataclass(frozen=True)
class _Plan:
    """The ring as every rank agreed on it, seen from one rank."""

    setup: RingSetup
    rank: int
    q_chunks: tuple[Chunk, ...]  # this rank's query chunks
    kv_chunks: tuple[tuple[Chunk, ...], ...]  # every rank's key chunks
    empty: frozenset[tuple[int, int]]  # (query chunk, key chunk) pairs the mask hides entirely
    acc_dtype: torch.dtype

    def kv_len(self, owner: int) -> int:
        return sum(c.length for c in self.kv_chunks[owner])

    def placement(self, qc: Chunk, kc: Chunk) -> Placement:
        s = self.setup
        return Placement(q_offset=qc.start, k_offset=kc.start, lq_total=s.lq, lk_total=s.lk)


def _lead(x: torch.Tensor) -> tuple[int, int]:
    """``(B, H)`` of a ``(L, d)``, ``(H, L, d)`` or ``(B, H, L, d)`` tensor."""
    return (1, 1) if x.ndim == 2 else (1, x.shape[0]) if x.ndim == 3 else (x.shape[0], x.shape[1])


def _meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> list[int]:
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            "ring attention needs q, k and v of one dtype among float16, bfloat16, float32, "
            f"float64; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    b, hq = _lead(q)
    hkv = _lead(k)[1]
    return [
        q.ndim,
        b,
        hq,
        hkv,
        q.shape[-1],
        v.shape[-1],
        q.shape[-2],
        k.shape[-2],
        _DTYPES.index(q.dtype),
        ("contiguous", "zigzag").index(layout),
    ]


def _make_plan(
    tp: Transport,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    opts: _Options | None,
    *,
    error: BaseException | None = None,
    record_states: bool = False,
) -> _Plan:
    """Agree on shapes and options with every rank, then lay out the ring (``_ring_agree``).

    Every rank validates its own inputs and options first (``error``: what already failed
    on this rank), then takes part in one all-gather of a failure flag, its shapes and a
    digest of its options, so every rank raises together instead of waiting on one that
    failed, and a rank given other options is named instead of computing another
    attention. The checks that need the global lengths follow, and a second all-gather of
    a flag makes those fail everywhere at once too.
    """
    err = error
    meta, hashes = [0] * len(_META), [0] * len(FIELDS)
    texts: dict[str, str] = {}
    if err is None:
        assert opts is not None
        try:
            check_qkv(q, k, v)
            meta = _meta(q, k, v, layout)
            rest = opts.rest
            check_option_values(
                scale=1.0 if rest.get("scale") is None else rest["scale"],
                dropout_p=rest.get("dropout_p", 0.0),
                seed=rest.get("seed", 0),
                softcap=rest.get("softcap"),
                alibi_slopes=rest.get("alibi_slopes"),
                bias=rest.get("bias"),
            )
            texts = describe_options(
                opts.mask,
                opts.conventions,
                rest,
                block_q=opts.block_q,
                block_k=opts.block_k,
                record_states=record_states,
            )
            hashes = digest(texts)
        except (TypeError, ValueError) as e:
            err = e
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    every = tp.all_gather_ints([int(err is not None), *meta, *hashes], device=device)
    raise_together(tp, err, [m[0] for m in every], "inputs or options", device=device)
    assert opts is not None
    rows = [m[1 : 1 + len(_META)] for m in every]
    digests = [m[1 + len(_META) :] for m in every]
    differ = [f for i, f in enumerate(FIELDS) if len({d[i] for d in digests}) > 1]
    if differ:  # every rank sees the same table: all gather the texts and raise the same error
        mine = "\x1f".join(texts[f] for f in differ)
        raise ValueError(mismatch_message(differ, gather_texts(tp, mine, device=device)))
    named = {"layout": ("contiguous", "zigzag"), "dtype": [str(t) for t in _DTYPES]}
    for r, row in enumerate(rows):
        diff = [
            f"{n}: rank 0 has {named[n][a] if n in named else a}, "
            f"rank {r} has {named[n][b] if n in named else b}"
            for n, a, b in zip(_META, rows[0], row)
            if n not in ("Lq", "Lk") and a != b
        ]
        if diff:
            raise ValueError(
                "ring attention: every rank must hold shards of one problem (same dims, "
                "heads, dtype and layout; only the sequence shard differs); " + "; ".join(diff)
            )
    plan: _Plan | None = None
    try:
        plan = _lay_out(tp, q, k, v, layout, opts, rows)
    except (TypeError, ValueError) as e:
        err = e
    flags = tp.all_gather_ints([int(err is not None)], device=device)
    raise_together(tp, err, [f[0] for f in flags], "options for the global shapes", device=device)
    assert plan is not None
    return plan


def _lay_out(
    tp: Transport,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    opts: _Options,
    rows: list[list[int]],
) -> _Plan:
    """The chunks, the setup and the pairs the mask hides, from every rank's shapes; checks
    every option against the global shapes (the same outcome on every rank)."""
    w, r = tp.world_size, tp.rank
    lq, lk = sum(row[6] for row in rows), sum(row[7] for row in rows)
    q_bounds = chunk_bounds(lq, w, layout, what="Lq")
    k_bounds = chunk_bounds(lk, w, layout, what="Lk")
    q_chunks = [shard_chunks(lq, o, w, layout, what="Lq") for o in range(w)]
    kv_chunks = tuple(shard_chunks(lk, o, w, layout, what="Lk") for o in range(w))
    for what, col, total, chunks in (
        ("query rows", 6, lq, q_chunks),
        ("keys", 7, lk, kv_chunks),
    ):
        held = [row[col] for row in rows]
        want = [sum(c.length for c in cs) for cs in chunks]
        if held != want:
            # the global length is the sum of the shards: which rank is off is not known
            raise ValueError(
                f"ring attention: the ranks hold {held} {what} ({total} in all), but the "
                f"{layout} layout on {w} rank(s) cuts {total} {what} as {want}: a rank holds "
                f"a shard of another length; cut the sequence with "
                f"shard_sequence(x, rank, {w}, {layout!r})"
            )
    b, hq, hkv = rows[0][1], rows[0][2], rows[0][3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    setup = RingSetup(
        world_size=w,
        layout=layout,
        lq=lq,
        lk=lk,
        q_bounds=tuple(q_bounds),
        k_bounds=tuple(k_bounds),
        batch=b,
        heads_q=hq,
        heads_kv=hkv,
        d=q.shape[-1],
        d_v=v.shape[-1],
        dtype=str(q.dtype).removeprefix("torch."),
        itemsize=q.element_size(),
        grad_itemsize=torch.empty((), dtype=acc).element_size(),
        block_q=opts.block_q,
        block_k=opts.block_k,
    )
    mine_q = q_chunks[r]
    # every option checked against the global shapes before anything travels
    qc0, kc0 = mine_q[0], kv_chunks[r][0]
    build_problem(
        q[..., qc0.local, :],
        k[..., kc0.local, :],
        v[..., kc0.local, :],
        **{n: x for n, x in opts.blocked_kwargs().items() if n not in ("block_q", "block_k")},
        placement=Placement(q_offset=qc0.start, k_offset=kc0.start, lq_total=lq, lk_total=lk),
    )
    empty = set()
    if opts.mask is not None:
        for qc in mine_q:
            for kc in (c for chunks in kv_chunks for c in chunks):
                geo = opts.mask.geometry(
                    qc.length,
                    kc.length,
                    batch=b,
                    heads=hq,
                    conventions=opts.conventions,
                    device=q.device,
                    q_offset=qc.start,
                    k_offset=kc.start,
                    lq_total=lq,
                    lk_total=lk,
                )
                kind = int(opts.mask.bind(geo).tile_classes(qc.length, kc.length)[0, 0])
                if kind == EMPTY:
                    empty.add((qc.index, kc.index))
    return _Plan(setup, r, mine_q, kv_chunks, frozenset(empty), acc)


def _rows(x: torch.Tensor, c: Chunk) -> torch.Tensor:
    """Rows of chunk ``c`` of a ``(..., L_shard, X)`` tensor."""
    return x[..., c.local, :]


class _RankRun:
    """One rank's part of one ring call: forward, then (optionally) backward."""

    def __init__(
        self,
        tp: Transport,
        layout: Layout,
        opts: _Options | None,
        ledger: RingLedger | None,
        *,
        error: BaseException | None = None,
    ) -> None:
        """``error``: what this rank's arguments already failed with; it is raised at the
        ranks' first agreement, together with every other rank (``opts`` may then be None)."""
        self.tp, self.layout = tp, layout
        self._opts, self.error = opts, error
        self.ledger = ledger if isinstance(ledger, RingLedger) else None
        self.recording = self.ledger is not None and self.ledger.record_states  # RankStates
        self.plan: _Plan | None = None
        # gradients of the tensors a score_mod captures, summed over this rank's pairs
        self.captured_grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def opts(self) -> _Options:
        assert self._opts is not None, "the options failed their checks"
        return self._opts

    # -- bookkeeping ------------------------------------------------------------------
    def _pass_on(
        self, pass_name: str, step: int, payload: str, shard: int, send: list[torch.Tensor]
    ) -> Pending:
        """Post ``send`` (shard ``shard``'s tensors) to the next rank; receive the previous
        rank's shard ``shard - 1`` into fresh buffers."""
        assert self.plan is not None
        n = self.plan.kv_len((shard - 1) % self.tp.world_size)
        recv = [
            torch.empty((*t.shape[:-2], n, t.shape[-1]), dtype=t.dtype, device=t.device)
            for t in send
        ]
        pending = self.tp.exchange(send, recv)
        if self.ledger is not None:
            nbytes = sum(t.numel() * t.element_size() for t in send)
            hop = Hop(pass_name, step, self.tp.rank, self.tp.next, payload, shard, nbytes)
            self.ledger.hops.append(hop)
        return pending

    def _book_pair(
        self,
        pass_name: str,
        step: int,
        shard: int,
        qc: Chunk,
        kc: Chunk,
        counters: Counters | None,
    ) -> None:
        if self.ledger is None:
            return
        skipped = counters is None
        if counters is None:
            bq, bk = self.opts.block_q, self.opts.block_k
            counters = Counters(tiles_skipped=-(-qc.length // bq) * -(-kc.length // bk))
        self.ledger.pairs.append(
            PairStep(pass_name, step, self.tp.rank, shard, qc.index, kc.index, skipped, counters)
        )

    def _keep(self, pass_name: str, step: int, shard: int, **tensors: torch.Tensor) -> None:
        """Record CPU copies of this rank's running state at the end of ``step`` (if asked)."""
        if self.ledger is None or not self.recording:
            return
        copies = {n: t.detach().to(device="cpu", copy=True) for n, t in tensors.items()}
        self.ledger.states.append(RankState(pass_name, step, self.tp.rank, shard, **copies))

    def _start(self, pass_name: str) -> None:
        if self.ledger is not None:
            assert self.plan is not None
            self.ledger.setup = self.plan.setup
            self.ledger.passes.append(pass_name)

    # -- forward ----------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)`` of this rank's query rows, accumulation dtype, LSE -inf on empty rows."""
        self.plan = plan = _make_plan(
            self.tp,
            q,
            k,
            v,
            self.layout,
            self._opts,
            error=self.error,
            record_states=self.recording,
        )
        self._start("forward")
        w, r, acc = self.tp.world_size, self.tp.rank, plan.acc_dtype
        kw = self.opts.blocked_kwargs()
        qa = q.to(acc)  # (..., Lq_shard, d)
        parts: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(plan.q_chunks)
        k_cur, v_cur = k.contiguous(), v.contiguous()  # (..., Lk_shard(src), d | d_v)
        for step in range(w):
            src = (r - step) % w  # owner of the shard held
            pending = None
            if step < w - 1:  # -- send on what we hold, compute while it travels --
                pending = self._pass_on("forward", step, "kv", src, [k_cur, v_cur])
            ka, va = k_cur.to(acc), v_cur.to(acc)
            for i, qc in enumerate(plan.q_chunks):
                for kc in plan.kv_chunks[src]:
                    if (qc.index, kc.index) in plan.empty:
                        self._book_pair("forward", step, src, qc, kc, None)
                        continue
                    res = blocked_forward(
                        _rows(qa, qc),
                        _rows(ka, kc),
                        _rows(va, kc),
                        placement=plan.placement(qc, kc),
                        raw_lse=True,
                        **kw,
                    )
                    self._book_pair("forward", step, src, qc, kc, res.ledger.counters)
                    part = parts[i]
                    # -- the one merge: both partial states onto the larger max --
                    parts[i] = (
                        (res.o, res.lse)
                        if part is None
                        else online.merge_partials(part[0], part[1], res.o, res.lse)
                    )
            if pending is not None:
                k_cur, v_cur = pending.wait()
            if self.recording:
                o_now, lse_now = self._joined(parts, qa, v.shape[-1])
                self._keep("forward", step, src, o=o_now, lse=lse_now)
        return self._joined(parts, qa, v.shape[-1])

    def _joined(
        self, parts: list[tuple[torch.Tensor, torch.Tensor] | None], qa: torch.Tensor, d_v: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query chunks' partial ``(o, lse)`` in shard order: ``(..., Lq_shard, d_v)``,
        ``(..., Lq_shard)``; a chunk with no key yet gets O = 0 and LSE -inf."""
        assert self.plan is not None
        os, lses = [], []
        for qc, part in zip(self.plan.q_chunks, parts):
            if part is None:  # every key hidden from this chunk: O = 0, LSE -inf
                lead = qa.shape[:-2]
                os.append(qa.new_zeros((*lead, qc.length, d_v)))  # (..., Lq_chunk, d_v)
                lses.append(qa.new_full((*lead, qc.length), -math.inf))  # (..., Lq_chunk)
            else:
                os.append(part[0])
                lses.append(part[1])
        return torch.cat(os, dim=-2), torch.cat(lses, dim=-1)

    def finish(
        self, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the caller sees: ``o`` in the input dtype, the conventions' LSE."""
        return o.to(q.dtype), _conventional_lse(lse, self.opts.conventions)

    # -- backward ---------------------------------------------------------------------
    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        do: torch.Tensor,
        dlse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this rank's shards from the forward's ``o`` and raw ``lse``."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("ring attention backward called before its forward")
        # the upstream gradients are this rank's own: agree before anything travels
        err: Exception | None = None
        try:
            if torch.is_grad_enabled():
                raise ValueError(
                    "ring attention has no second-order gradients: its backward records no "
                    "graph, so create_graph=True would silently give gradients of gradients "
                    "without the attention term; take them with flash_attention on one process"
                )
            check_finite("do (the gradient of o)", do)
            if dlse is not None:
                check_finite("dlse (the gradient of the LSE)", dlse)
        except ValueError as e:
            err = e
        flags = self.tp.all_gather_ints([int(err is not None)], device=q.device)
        raise_together(
            self.tp, err, [f[0] for f in flags], "gradients in the backward", device=q.device
        )
        self._start("backward")
        # this backward's shares only: a second backward of the same graph
        # (retain_graph=True) must not add the first one's again
        self.captured_grads = {}
        w, r, acc = self.tp.world_size, self.tp.rank, plan.acc_dtype
        kw = self.opts.blocked_kwargs()
        qa, oa, doa = q.to(acc), o.to(acc), do.to(acc)  # (..., Lq_shard, d | d_v)
        dlsea = None if dlse is None else dlse.to(acc)  # (..., Lq_shard)
        dq = torch.zeros_like(qa)  # (..., Lq_shard, d)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        dkv_pending: Pending | None = None
        dk_s: torch.Tensor
        dv_s: torch.Tensor
        for step in range(w):
            src = (r - step) % w
            kv_pending = None
            if step < w - 1:
                kv_pending = self._pass_on("backward", step, "kv", src, [k_cur, v_cur])
            ka, va = k_cur.to(acc), v_cur.to(acc)
            n = plan.kv_len(src)
            dk_s = ka.new_zeros((*ka.shape[:-2], n, ka.shape[-1]))  # (..., Lk_shard(src), d)
            dv_s = va.new_zeros((*va.shape[:-2], n, va.shape[-1]))  # (..., Lk_shard(src), d_v)
            for qc in plan.q_chunks:
                for kc in plan.kv_chunks[src]:
                    if (qc.index, kc.index) in plan.empty:
                        self._book_pair("backward", step, src, qc, kc, None)
                        continue
                    # -- rebuild P from this rank's final LSE; add this pair's gradients --
                    res = blocked_backward(
                        _rows(qa, qc),
                        _rows(ka, kc),
                        _rows(va, kc),
                        _rows(oa, qc),
                        lse[..., qc.local],
                        _rows(doa, qc),
                        dlse=None if dlsea is None else dlsea[..., qc.local],
                        placement=plan.placement(qc, kc),
                        **kw,
                    )
                    self._book_pair("backward", step, src, qc, kc, res.ledger.counters)
                    for t, g in res.captured_grads:
                        prev = self.captured_grads.get(id(t))
                        self.captured_grads[id(t)] = (t, g if prev is None else prev[1] + g)
                    dq[..., qc.local, :] += res.dq
                    dk_s[..., kc.local, :] += res.dk
                    dv_s[..., kc.local, :] += res.dv
            if dkv_pending is not None:  # -- the accumulators of this shard, from upstream --
                dk_in, dv_in = dkv_pending.wait()
                dk_s += dk_in
                dv_s += dv_in
            if w > 1:
                dkv_pending = self._pass_on("backward", step, "dkv", src, [dk_s, dv_s])
            if kv_pending is not None:
                k_cur, v_cur = kv_pending.wait()
            self._keep("backward", step, src, dq=dq, dk=dk_s, dv=dv_s)
        if dkv_pending is not None:  # our own shard's dK, dV after a full circle
            dk_s, dv_s = dkv_pending.wait()
        grads = dq.to(q.dtype), dk_s.to(k.dtype), dv_s.to(v.dtype)
        if q.dtype != acc:  # (every rank alike) a gradient past its half dtype's range
            errs = (gradient_overflow(n, g, acc) for n, g in zip(("dq", "dk", "dv"), grads))
            err = next((e for e in errs if e is not None), None)
            flags = self.tp.all_gather_ints([int(err is not None)], device=q.device)
            raise_together(self.tp, err, [f[0] for f in flags], "gradients", device=q.device)
        return grads


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        run: _RankRun,
        *captured: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = run.forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse, *captured)
        ctx.run = run
        return run.finish(q, o, lse)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, do: torch.Tensor, dlse: torch.Tensor | None
    ) -> tuple[Any, ...]:
        q, k, v, o, lse, *captured = ctx.saved_tensors
        run: _RankRun = ctx.run
        use_dlse = run.opts.conventions.lse_differentiable and dlse is not None
        dq, dk, dv = run.backward(q, k, v, o, lse, do, dlse if use_dlse else None)
        # this rank's share of each captured tensor's gradient (its query rows' pairs); a
        # data-parallel all-reduce of the parameters sums the ranks' shares
        got = run.captured_grads
        dcap = [got[id(t)][1] if id(t) in got else torch.zeros_like(t) for t in captured]
        return dq, dk, dv, None, *dcap


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    layout: Layout = "contiguous",
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    return_lse: bool = False,
    ledger: RingLedger | None = None,
    timeout: float | None = RING_TIMEOUT_S,
    **opts: Unpack[AttentionOptions],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``, differentiable.

    Every rank calls it with its shard (``shard_sequence(x, rank, W, layout)``):
    q ``(..., Lq_shard, d)``, k ``(..., Lk_shard, d)``, v ``(..., Lk_shard, d_v)``
    with ``...`` = ``()``, ``(H,)`` or ``(B, H)`` (GQA allowed). Returns this
    rank's ``o`` ``(..., Lq_shard, d_v)`` (and ``lse`` ``(..., Lq_shard)`` in the
    accumulation dtype with ``return_lse=True``). Masks (a ``MaskMod`` too), ALiBi,
    ``bias`` (global ``(B, H, Lq, Lk)``, no gradient), a ``score_mod`` and dropout
    use global positions; every rank must pass the same options. A tensor the
    score_mod captures gets this rank's share of its gradient (the pairs of its
    query rows: sum the ranks', as data parallelism does). Backward is a collective too: every
    rank must run it. ``ledger=RingLedger()`` records this rank's hops and
    chunk pairs (``ledger.gather(group)`` combines the ranks);
    ``RingLedger(record_states=True)`` also keeps this rank's running state at the
    end of every ring step (``RankState``; pass the same value on every rank).
    Runs on gloo (CPU) and nccl (GPU); the device follows the tensors.

    Before anything travels the ranks agree (one all-gather of small integers): a rank
    whose inputs or options are invalid, or whose options differ from the others'
    (mask, scale, conventions, dropout, seed, softcap, ALiBi, bias, tiles), makes every
    rank raise at once, naming the ranks and what differs. Every wait on another rank
    gives up after ``timeout`` seconds (default 300) with a ``TimeoutError`` (``None``:
    the process group's own timeout, 30 minutes for gloo); the group is unusable after one.
    """
    err: Exception | None = None
    wait: float | None = None
    try:  # a bad argument fails at the ranks' first agreement, on every rank at once
        wait = _check_timeout(timeout, none_ok=True)
    except ValueError as e:
        err = e
    tp = DistTransport(group, timeout=wait)  # no process group: nothing to agree with
    run = _rank_run(
        tp, layout=layout, block_q=block_q, block_k=block_k, ledger=ledger, opts=opts, error=err
    )
    captured: tuple[torch.Tensor, ...] = ()
    score_mod = opts.get("score_mod")
    wanted = err is None and callable(score_mod) and torch.is_grad_enabled()
    if wanted and score_mod is not None and isinstance(q, torch.Tensor):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        try:  # a score_mod that fails its probe fails at the agreement, on every rank at once
            captured = find_captured(score_mod, dtype=acc, device=q.device)
        except (TypeError, ValueError) as e:
            run.error = run.error or e
    o, lse = _RingFunction.apply(q, k, v, run, *captured)
    return (o, lse) if return_lse else o


def _rank_run(
    tp: Transport,
    *,
    layout: Any,
    block_q: Any,
    block_k: Any,
    ledger: Any,
    opts: Mapping[str, Any],
    error: Exception | None = None,
) -> _RankRun:
    """One rank's run from ``ring_attention``'s arguments. An invalid argument does not
    raise here: it is kept and raised at the ranks' first agreement, on every rank."""
    run_opts, lay = None, cast(Layout, "contiguous")
    try:
        run_opts = _Options.build("ring_attention", opts, block_q=block_q, block_k=block_k)
        lay = check_layout(layout)
        _check_ledger(ledger)
    except (TypeError, ValueError) as e:
        error = error or e
    return _RankRun(tp, lay, run_opts, ledger, error=error)


def _check_timeout(timeout: Any, *, none_ok: bool = False) -> float | None:
    if timeout is None and none_ok:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        allowed = "a number of seconds > 0" + (" or None" if none_ok else "")
        raise ValueError(f"timeout must be {allowed}, got {timeout!r}")
    return float(timeout)


def _check_ledger(ledger: Any) -> None:
    if ledger is not None and not isinstance(ledger, RingLedger):
        raise TypeError(f"ledger must be a RingLedger or None, got {type(ledger).__name__}")
    if ledger is not None and ledger.passes:
        raise ValueError(
            "this RingLedger already holds a ring call; pass a fresh RingLedger() per call"
        )


# ----------------------------------------------------------------------------------------
# the in-process twin
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RingResult:
    """What ``simulate_ring`` returns, on full (unsharded) tensors.

    ``o`` ``(..., Lq, d_v)``; ``lse`` ``(..., Lq)`` (conventions' value on
    fully-masked rows); ``dq``/``dk``/``dv`` like q/k/v, or None without ``do``;
    ``ledger`` every rank's hops and chunk pairs (and, with ``record_states=True``,
    every rank's ``RankState`` per pass and ring step).
    """

    o: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    ledger: RingLedger
    captured_grads: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    """``(tensor, gradient)`` for each tensor a score_mod captures that requires grad,
    summed over the ranks (empty without ``do`` or a score_mod)."""


def simulate_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    world_size: int,
    layout: Layout = "contiguous",
    do: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    timeout: float = 60.0,
    record_states: bool = False,
    **opts: Unpack[AttentionOptions],
) -> RingResult:
    """Run ring attention with ``world_size`` simulated ranks in this process.

    Takes full tensors, shards them, runs every rank's forward (and backward
    when the upstream gradient ``do`` ``(..., Lq, d_v)`` is given; ``dlse``
    ``(..., Lq)`` is used when the conventions' LSE is differentiable, as in
    ``ring_attention``) in its own thread, with the same code as
    ``ring_attention``: only the transport differs (in-memory queues instead of
    torch.distributed). Each rank gives up after ``timeout`` seconds of waiting.
    ``record_states=True`` keeps every rank's running state at the end of every
    ring step in ``ledger.states`` (``RankState``: CPU copies; default False).
    """
    w = check_world(world_size)
    lay = check_layout(layout)
    run_opts = _Options.build("simulate_ring", opts, block_q=block_q, block_k=block_k)
    check_qkv(q, k, v)
    chunk_bounds(q.shape[-2], w, lay, what="Lq")
    chunk_bounds(k.shape[-2], w, lay, what="Lk")
    want_o = (*q.shape[:-1], v.shape[-1])
    if do is not None and (not isinstance(do, torch.Tensor) or tuple(do.shape) != want_o):
        got = tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__
        raise ValueError(f"do must be a tensor shaped like the output {want_o}, got {got}")
    if dlse is not None and (
        not isinstance(dlse, torch.Tensor) or tuple(dlse.shape) != tuple(q.shape[:-1])
    ):
        got = tuple(dlse.shape) if isinstance(dlse, torch.Tensor) else type(dlse).__name__
        raise ValueError(
            f"dlse must be a tensor shaped like the LSE {tuple(q.shape[:-1])}, got {got}"
        )
    if dlse is not None and do is None:
        raise ValueError("dlse needs do: give the upstream gradient of the output too")
    _check_timeout(timeout)
    if not isinstance(record_states, bool):
        raise ValueError(f"record_states must be True or False, got {record_states!r}")

    def shards(x: torch.Tensor, dim: int = -2) -> list[torch.Tensor]:
        return [shard_sequence(x, r, w, lay, dim=dim) for r in range(w)]

    qs, ks, vs = shards(q), shards(k), shards(v)
    dos = None if do is None else shards(do)
    dlses = None if dlse is None else shards(dlse, -1)
    use_dlse = run_opts.conventions.lse_differentiable
    hub = LocalHub(w, timeout=float(timeout))
    out: list[tuple[Any, ...] | None] = [None] * w
    errors: list[BaseException | None] = [None] * w

    def rank_job(r: int) -> None:
        try:
            with torch.no_grad():
                led = RingLedger(record_states=record_states)
                run = _RankRun(LocalTransport(hub, r), lay, run_opts, led)
                o, lse = run.forward(qs[r], ks[r], vs[r])
                grads: tuple[torch.Tensor, ...] | tuple[None, None, None] = (None, None, None)
                if dos is not None:
                    dl = dlses[r] if dlses is not None and use_dlse else None
                    grads = run.backward(qs[r], ks[r], vs[r], o, lse, dos[r], dl)
                out[r] = (*run.finish(qs[r], o, lse), *grads, led, run.captured_grads)
        except BaseException as e:  # handed to the caller below
            errors[r] = e
            hub.abort()

    threads = [
        threading.Thread(target=rank_job, args=(r,), name=f"flashledger-ring-rank-{r}")
        for r in range(w)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout * 4)
    if any(t.is_alive() for t in threads):
        hub.abort()
        for t in threads:
            t.join(timeout=timeout)
        raise TimeoutError(
            f"simulate_ring: the simulated ranks did not finish in {timeout * 4:g} s"
        )
    first = next((e for e in errors if e is not None and not isinstance(e, RingAborted)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    res = [x for x in out if x is not None]
    o = unshard_sequence([x[0] for x in res], lay)
    lse = unshard_sequence([x[1] for x in res], lay, dim=-1)
    grads_full: list[torch.Tensor | None] = [None, None, None]
    if do is not None:
        grads_full = [unshard_sequence([x[i] for x in res], lay) for i in (2, 3, 4)]
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for x in res:  # each rank's share, summed
        for key, (t, g) in x[6].items():
            prev = captured.get(key)
            captured[key] = (t, g if prev is None else prev[1] + g)
    return RingResult(
        o=o,
        lse=lse,
        dq=grads_full[0],
        dk=grads_full[1],
        dv=grads_full[2],
        ledger=RingLedger.combine([x[5] for x in res]),
        captured_grads=tuple(captured.values()),
    )
