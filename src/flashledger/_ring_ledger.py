"""The ring ledger: every hop of the ring, every chunk pair each rank attended.

Records are made by the rank that did the work (a hop by its sender, a chunk
pair by the rank that ran or skipped it), so one rank's ``RingLedger`` holds
that rank's share; ``RingLedger.combine`` (or ``gather`` across processes)
puts the shares of all ranks together, sorted.

With ``RingLedger(record_states=True)`` each rank also keeps, at the end of
every ring step of every pass, a ``RankState``: CPU copies of the running
state its loop holds then (forward: the merged partial ``(o, lse)`` of its
query rows; backward: its dQ so far and the dK/dV accumulators it passes on).
Off by default: nothing is copied.

Communication has a closed form (``ring_comm_totals``). With ``W`` ranks, a
key sequence of ``Lk`` positions, ``B`` batch, ``Hkv`` key/value heads and head
dims ``d``, ``d_v``, one full K/V sequence weighs
``kv = Lk·B·Hkv·(d + d_v)`` elements. Every step each rank forwards the shard
it holds, so every step moves one whole K/V sequence around the ring:

- forward, K/V: ``W(W-1)`` hops, ``(W-1)·kv`` elements;
- backward, K/V: the same again (the shards travel to be recomputed against);
- backward, dK/dV accumulators: ``W·W`` hops, ``W·kv`` elements (a full circle,
  ending at the shard's owner), in the accumulation dtype.

With ``W = 1`` nothing travels.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import torch

from ._limits import RING_TIMEOUT_S
from .ledger import Counters

__all__ = [
    "CommTotals",
    "Hop",
    "PairStep",
    "RankState",
    "RankWork",
    "RingLedger",
    "RingSetup",
    "ring_comm_totals",
]

PASSES = ("forward", "backward")
PAYLOADS = {"kv": "K/V", "dkv": "dK/dV"}


@dataclass(frozen=True)
class RingSetup:
    """What one ring call ran on (identical on every rank)."""

    world_size: int
    layout: str  # "contiguous" | "zigzag"
    lq: int  # global query length
    lk: int  # global key length
    q_bounds: tuple[int, ...]  # query chunk boundaries (n + 1 ints)
    k_bounds: tuple[int, ...]  # key chunk boundaries
    batch: int  # B (1 for inputs without a batch dim)
    heads_q: int  # Hq (1 for 2-D inputs)
    heads_kv: int  # Hkv
    d: int
    d_v: int
    dtype: str  # dtype of q, k, v (what K/V travel in)
    itemsize: int  # bytes per K/V element on the wire
    grad_itemsize: int  # bytes per dK/dV accumulator element (accumulation dtype)
    block_q: int
    block_k: int

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Chunk numbers rank ``rank`` holds."""
        w = self.world_size
        return (rank,) if self.layout == "contiguous" else (rank, 2 * w - 1 - rank)


@dataclass(frozen=True)
class Hop:
    """One message around the ring."""

    pass_name: str  # "forward" | "backward"
    step: int  # ring step during which it was sent (0-based)
    sender: int
    receiver: int
    payload: str  # "kv" (a K/V shard) | "dkv" (the dK/dV accumulators of a shard)
    shard: int  # the rank that owns the shard carried
    nbytes: int  # bytes sent (all tensors of the message)


@dataclass(frozen=True)
class PairStep:
    """One (query chunk, key chunk) pair a rank attended or skipped during one ring step."""

    pass_name: str
    step: int
    rank: int
    shard: int  # owner of the K/V shard held during this step
    q_chunk: int
    k_chunk: int
    skipped: bool  # entirely masked: never computed (its tiles booked as skipped)
    counters: Counters  # the blocked loop's counters for this pair


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both absent, or equal in dtype, shape and every value (-inf equals -inf)."""
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a, b)


@dataclass(frozen=True, eq=False)
class RankState:
    """One rank's running state at the end of one ring step (recorded on request).

    Tensors are CPU copies in the accumulation dtype, laid out like the rank's
    shards (``(..., L_shard, X)`` with ``...`` = ``()``, ``(H,)`` or ``(B, H)``),
    rows in shard order. Forward records carry ``o``, ``lse``; backward records
    ``dq``, ``dk``, ``dv``; the others are None.

    - ``o`` ``(..., Lq_shard, d_v)``, ``lse`` ``(..., Lq_shard)``: the partial
      result of the rank's query rows merged over the shards held in steps
      ``0..step`` (LSE -inf and O 0 on rows that have seen no key yet; the
      conventions' LSE for fully-masked rows is applied only to the final LSE);
    - ``dq`` ``(..., Lq_shard, d)``: the rank's dQ after steps ``0..step``;
    - ``dk`` ``(..., Lk_shard(shard), d | d_v)``, ``dv``: the dK/dV accumulators of
      K/V shard ``shard`` as the rank passes them on at the end of the step: the
      contributions of ``step + 1`` ranks, the previous ``step`` ranks' and its own.
      After the last step they are complete and travel to their owner (with
      ``W = 1`` they stay).
    """

    pass_name: str  # "forward" | "backward"
    step: int
    rank: int
    shard: int  # owner of the K/V shard held during the step (and of dk, dv)
    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None

    _TENSORS: ClassVar[tuple[str, ...]] = ("o", "lse", "dq", "dk", "dv")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankState):
            return NotImplemented
        return (self.pass_name, self.step, self.rank, self.shard) == (
            other.pass_name,
            other.step,
            other.rank,
            other.shard,
        ) and all(_same(getattr(self, n), getattr(other, n)) for n in self._TENSORS)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this record carries, by name."""
        return {n: t for n in self._TENSORS if (t := getattr(self, n)) is not None}


@dataclass(frozen=True)
class CommTotals:
    """Hops and bytes per pass and payload (observed or closed form)."""

    forward_kv_hops: int = 0
    forward_kv_bytes: int = 0
    backward_kv_hops: int = 0
    backward_kv_bytes: int = 0
    backward_dkv_hops: int = 0
    backward_dkv_bytes: int = 0

    @property
    def hops(self) -> int:
        return self.forward_kv_hops + self.backward_kv_hops + self.backward_dkv_hops

    @property
    def nbytes(self) -> int:
        return self.forward_kv_bytes + self.backward_kv_bytes + self.backward_dkv_bytes

    def rows(self) -> list[tuple[str, str, int, int]]:
        """``(pass, payload, hops, bytes)`` for each kind of message."""
        return [
            ("forward", "kv", self.forward_kv_hops, self.forward_kv_bytes),
            ("backward", "kv", self.backward_kv_hops, self.backward_kv_bytes),
            ("backward", "dkv", self.backward_dkv_hops, self.backward_dkv_bytes),
        ]

    def to_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


def ring_comm_totals(
    *,
    world_size: int,
    lk: int,
    d: int,
    d_v: int | None = None,
    batch: int = 1,
    heads_kv: int = 1,
    itemsize: int = 8,
    grad_itemsize: int | None = None,
    backward: bool = True,
) -> CommTotals:
    """Closed-form communication of one ring call (see the module docstring).

    ``itemsize``: bytes per K/V element (8 for float64); ``grad_itemsize``:
    bytes per dK/dV accumulator element (default: the accumulation dtype's, as
    the ring sends them: 8 for float64 inputs, 4 for float32, float16 and
    bfloat16); ``d_v`` defaults to ``d``. ``backward=False`` counts the forward only.
    """
    for name, val in (
        ("world_size", world_size),
        ("lk", lk),
        ("d", d),
        ("batch", batch),
        ("heads_kv", heads_kv),
        ("itemsize", itemsize),
    ):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"ring_comm_totals: {name} must be an integer >= 1, got {val!r}")
    for name, opt in (("d_v", d_v), ("grad_itemsize", grad_itemsize)):
        if opt is not None and (isinstance(opt, bool) or not isinstance(opt, int) or opt < 1):
            raise ValueError(
                f"ring_comm_totals: {name} must be None or an integer >= 1, got {opt!r}"
            )
    dv = d if d_v is None else d_v
    gsize = (8 if itemsize == 8 else 4) if grad_itemsize is None else grad_itemsize
    w = world_size
    kv = lk * batch * heads_kv * (d + dv)  # elements of one whole K/V sequence
    fwd = CommTotals(forward_kv_hops=w * (w - 1), forward_kv_bytes=(w - 1) * kv * itemsize)
    if not backward:
        return fwd
    full_circle = w if w > 1 else 0
    return CommTotals(
        forward_kv_hops=fwd.forward_kv_hops,
        forward_kv_bytes=fwd.forward_kv_bytes,
        backward_kv_hops=w * (w - 1),
        backward_kv_bytes=(w - 1) * kv * itemsize,
        backward_dkv_hops=w * full_circle,
        backward_dkv_bytes=full_circle * kv * gsize,
    )


@dataclass(frozen=True)
class RankWork:
    """What one rank computed in one pass: chunk pairs and the blocked loop's counters."""

    rank: int
    pass_name: str
    chunks: tuple[int, ...]
    pairs_run: int
    pairs_skipped: int
    counters: Counters


def _sum_counters(items: Iterable[Counters]) -> Counters:
    total = Counters()
    for c in items:
        for f in fields(Counters):
            setattr(total, f.name, getattr(total, f.name) + getattr(c, f.name))
    return total


@dataclass
class RingLedger:
    """Hops and chunk pairs of one ring call (forward and, once run, backward).

    Pass an empty ``RingLedger()`` to ``ring_attention(..., ledger=...)``: it
    fills with this rank's records; ``ledger.gather(group)`` returns every
    rank's records combined. ``simulate_ring`` returns the combined ledger.
    ``RingLedger(record_states=True)`` also keeps a ``RankState`` per rank,
    pass and ring step in ``states`` (default False: none kept, nothing copied).
    """

    setup: RingSetup | None = None
    passes: list[str] = field(default_factory=list)
    hops: list[Hop] = field(default_factory=list)
    pairs: list[PairStep] = field(default_factory=list)
    states: list[RankState] = field(default_factory=list)
    record_states: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.record_states, bool):
            raise ValueError(f"record_states must be True or False, got {self.record_states!r}")

    # -- combining ------------------------------------------------------------------
    def sort(self) -> None:
        """Order hops by (pass, step, payload, sender), pairs by (pass, step, rank, chunks)
        and states by (pass, step, rank)."""
        order = {p: i for i, p in enumerate(PASSES)}
        kinds = {p: i for i, p in enumerate(PAYLOADS)}
        self.hops.sort(key=lambda h: (order[h.pass_name], h.step, kinds[h.payload], h.sender))
        self.pairs.sort(
            key=lambda p: (order[p.pass_name], p.step, p.rank, p.q_chunk, p.k_chunk),
        )
        self.states.sort(key=lambda x: (order[x.pass_name], x.step, x.rank))

    @staticmethod
    def combine(ledgers: Sequence[RingLedger]) -> RingLedger:
        """Every rank's share in one ledger (all must describe the same call)."""
        if not ledgers:
            raise ValueError("combine needs at least one RingLedger")
        setups = {led.setup for led in ledgers}
        passes = {tuple(led.passes) for led in ledgers}
        if len(setups) != 1 or len(passes) != 1:
            raise ValueError("the ledgers describe different ring calls and cannot be combined")
        if len({led.record_states for led in ledgers}) != 1:
            raise ValueError(
                "some ledgers record per-step states and some do not; pass "
                "RingLedger(record_states=...) with the same value on every rank"
            )
        out = RingLedger(
            setup=ledgers[0].setup,
            passes=list(ledgers[0].passes),
            record_states=ledgers[0].record_states,
        )
        for led in ledgers:
            out.hops.extend(led.hops)
            out.pairs.extend(led.pairs)
            out.states.extend(led.states)
        out.sort()
        return out

    def gather(self, group: Any = None, *, timeout: float | None = RING_TIMEOUT_S) -> RingLedger:
        """All ranks' records, combined, on every rank of ``group`` (a collective call);
        waits at most ``timeout`` seconds for the other ranks (``None``: the group's own)."""
        import pickle

        from ._ring_transport import DistTransport

        tp = DistTransport(group, timeout=timeout)
        parts = [pickle.loads(b) for b in tp.all_gather_bytes(pickle.dumps(self))]
        return RingLedger.combine(parts)

    # -- summaries --------------------------------------------------------------------
    def comm_totals(self) -> CommTotals:
        """Hops and bytes observed."""
        acc: dict[str, int] = {}
        for h in self.hops:
            key = f"{h.pass_name}_{h.payload}"
            acc[f"{key}_hops"] = acc.get(f"{key}_hops", 0) + 1
            acc[f"{key}_bytes"] = acc.get(f"{key}_bytes", 0) + h.nbytes
        return CommTotals(**acc)

    def expected_comm(self) -> CommTotals:
        """The closed form for this call's setup and passes."""
        s = self._setup()
        return ring_comm_totals(
            world_size=s.world_size,
            lk=s.lk,
            d=s.d,
            d_v=s.d_v,
            batch=s.batch,
            heads_kv=s.heads_kv,
            itemsize=s.itemsize,
            grad_itemsize=s.grad_itemsize,
            backward="backward" in self.passes,
        )

    def comm_matches(self) -> bool:
        """Observed communication equals the closed form."""
        return self.comm_totals() == self.expected_comm()

    def rank_work(self, pass_name: str = "forward") -> list[RankWork]:
        """Per-rank totals of one pass, from the pairs recorded."""
        s = self._setup()
        out = []
        for r in range(s.world_size):
            mine = [p for p in self.pairs if p.rank == r and p.pass_name == pass_name]
            out.append(
                RankWork(
                    rank=r,
                    pass_name=pass_name,
                    chunks=s.chunks_of(r),
                    pairs_run=sum(not p.skipped for p in mine),
                    pairs_skipped=sum(p.skipped for p in mine),
                    counters=_sum_counters(p.counters for p in mine),
                )
            )
        return out

    def balance(self, pass_name: str = "forward") -> float:
        """Max over ranks of tiles run, divided by the mean (1.0 = perfectly balanced)."""
        runs = [w.counters.tiles_run for w in self.rank_work(pass_name)]
        mean = sum(runs) / len(runs)
        return max(runs) / mean if mean > 0 else 1.0

    def critical_path(self, pass_name: str = "forward") -> int:
        """Sum over steps of the busiest rank's tiles: the tile steps a lock-step ring waits for.

        The ideal is the total divided by ``W``; causal work on the contiguous
        layout sits well above it, zigzag at (or next to) it.
        """
        grid = self.step_grid(pass_name)
        steps = len(grid[0]) if grid else 0
        return sum(max(row[t][1] for row in grid) for t in range(steps))

    def step_grid(self, pass_name: str = "forward") -> list[list[tuple[int, int]]]:
        """``grid[rank][step] = (shard held, tiles run)`` for one pass."""
        s = self._setup()
        grid = [[(-1, 0)] * s.world_size for _ in range(s.world_size)]
        for p in self.pairs:
            if p.pass_name == pass_name:
                shard, run = grid[p.rank][p.step]
                grid[p.rank][p.step] = (p.shard, run + p.counters.tiles_run)
        return grid

    def state(self, pass_name: str, step: int, rank: int) -> RankState:
        """The ``RankState`` rank ``rank`` recorded at the end of ring step ``step`` of a pass."""
        if not self.record_states:
            raise ValueError(
                "this RingLedger records no per-step states; pass RingLedger(record_states=True) "
                "to ring_attention, or record_states=True to simulate_ring"
            )
        for x in self.states:
            if (x.pass_name, x.step, x.rank) == (pass_name, step, rank):
                return x
        s = self._setup()
        raise ValueError(
            f"no state recorded for pass {pass_name!r}, step {step}, rank {rank}; recorded: "
            f"passes {self.passes}, steps 0..{s.world_size - 1}, ranks 0..{s.world_size - 1}"
            + ("" if self.passes == list(PASSES) else " (a forward-only call has no backward)")
        )

    def _setup(self) -> RingSetup:
        if self.setup is None:
            raise ValueError("this RingLedger is empty: it has not recorded a ring call yet")
        return self.setup

    # -- renderers --------------------------------------------------------------------
    def to_dict(self, *, states: bool = False) -> dict[str, Any]:
        """JSON-ready: setup, hops, pairs, per-rank work, observed and closed-form totals.

        ``states=True`` adds every recorded ``RankState`` under ``"states"`` (tensors as
        nested lists of floats, -inf kept as a float: pass the result through
        ``flashledger.ledger.jsonable`` before ``json.dumps`` for strict JSON).
        """
        s = self._setup()
        out: dict[str, Any] = {
            "setup": asdict(s),
            "passes": list(self.passes),
            "comm": {
                "observed": self.comm_totals().to_dict(),
                "closed_form": self.expected_comm().to_dict(),
                "match": self.comm_matches(),
            },
            "ranks": {
                p: [
                    {
                        "rank": w.rank,
                        "chunks": list(w.chunks),
                        "pairs_run": w.pairs_run,
                        "pairs_skipped": w.pairs_skipped,
                        "counters": w.counters.to_dict(),
                    }
                    for w in self.rank_work(p)
                ]
                for p in self.passes
            },
            "balance": {p: self.balance(p) for p in self.passes},
            "critical_path": {p: self.critical_path(p) for p in self.passes},
            "hops": [asdict(h) for h in self.hops],
            "pairs": [
                {**{k: v for k, v in asdict(p).items() if k != "counters"}, **p.counters.to_dict()}
                for p in self.pairs
            ],
        }
        if states:
            if not self.record_states:
                raise ValueError(
                    "to_dict(states=True): this RingLedger records no per-step states; pass "
                    "RingLedger(record_states=True) to ring_attention, or record_states=True "
                    "to simulate_ring"
                )
            out["states"] = [
                {
                    "pass_name": x.pass_name,
                    "step": x.step,
                    "rank": x.rank,
                    "shard": x.shard,
                    **{n: t.tolist() for n, t in x.tensors().items()},
                }
                for x in self.states
            ]
        return out

    def _header(self) -> str:
        s = self._setup()
        lengths = f"Lq = Lk = {s.lq}" if s.lq == s.lk else f"Lq = {s.lq}, Lk = {s.lk}"
        n = len(s.q_bounds) - 1
        return (
            f"ring attention: {s.world_size} rank(s), {s.layout} layout, {lengths} in {n} "
            f"chunks per sequence; B={s.batch} Hq={s.heads_q} Hkv={s.heads_kv} d={s.d} "
            f"d_v={s.d_v} {s.dtype}; tiles {s.block_q}x{s.block_k}"
        )

    def _comm_rows(self) -> list[list[str]]:
        obs, exp = self.comm_totals(), self.expected_comm()
        rows = []
        for (pn, pl, h, b), (_, _, he, be) in zip(obs.rows(), exp.rows()):
            if pn not in self.passes:
                continue
            ok = "ok" if (h, b) == (he, be) else "MISMATCH"
            rows.append([pn, PAYLOADS[pl], str(h), str(b), str(he), str(be), ok])
        return rows

    def _rank_rows(self) -> list[list[str]]:
        rows = []
        for p in self.passes:
            for w in self.rank_work(p):
                c = w.counters
                rows.append(
                    [
                        p,
                        str(w.rank),
                        ",".join(map(str, w.chunks)),
                        f"{w.pairs_run}/{w.pairs_skipped}",
                        f"{c.tiles_run}/{c.tiles_skipped}",
                        str(c.qk_dots_visible),
                        str(c.qk_dots_computed),
                    ]
                )
        return rows

    def _grid_rows(self, pass_name: str) -> list[list[str]]:
        return [
            [str(r)] + [f"{run} [K/V {shard}]" for shard, run in row]
            for r, row in enumerate(self.step_grid(pass_name))
        ]

    def _hop_rows(self) -> list[list[str]]:
        return [
            [
                h.pass_name,
                str(h.step),
                f"{h.sender} -> {h.receiver}",
                PAYLOADS[h.payload],
                str(h.shard),
                str(h.nbytes),
            ]
            for h in self.hops
        ]

    _COMM_COLS = ("pass", "payload", "hops", "bytes", "closed-form hops", "closed-form bytes", "")
    _RANK_COLS = (
        "pass",
        "rank",
        "chunks",
        "pairs run/skipped",
        "tiles run/skipped",
        "QK dots visible",
        "QK dots computed",
    )
    _HOP_COLS = ("pass", "step", "sender -> receiver", "payload", "shard", "bytes")

    def __str__(self) -> str:
        if self.setup is None:
            return "ring attention ledger: empty"
        w = self.setup.world_size
        out = [self._header(), "", "communication (observed vs closed form)"]
        out += _table(self._COMM_COLS, self._comm_rows())
        out += ["", "work per rank (pairs = query chunk x key chunk)"]
        out += _table(self._RANK_COLS, self._rank_rows())
        out += [f"balance (max / mean tiles run): {_balance_line(self)}"]
        if self.record_states:
            out += [_states_line(self)]
        for p in self.passes:
            out += ["", f"{p}: tiles run per rank and step [K/V shard held]"]
            out += _table(("rank", *(f"step {t}" for t in range(w))), self._grid_rows(p))
        if self.hops:
            out += ["", "hops"]
            out += _table(self._HOP_COLS, self._hop_rows())
        return "\n".join(out)

    def _repr_html_(self) -> str:
        if self.setup is None:
            return "<p>ring attention ledger: empty</p>"
        w = self.setup.world_size
        parts = [f"<p><b>{html.escape(self._header())}</b></p>"]
        parts.append(_html_table(self._COMM_COLS, self._comm_rows()))
        parts.append(_html_table(self._RANK_COLS, self._rank_rows()))
        parts.append(f"<p>balance (max / mean tiles run): {html.escape(_balance_line(self))}</p>")
        if self.record_states:
            parts.append(f"<p>{html.escape(_states_line(self))}</p>")
        for p in self.passes:
            parts.append(f"<p>{p}: tiles run per rank and step [K/V shard held]</p>")
            cols = ("rank", *(f"step {t}" for t in range(w)))
            parts.append(_html_table(cols, self._grid_rows(p)))
        if self.hops:
            parts.append(_html_table(self._HOP_COLS, self._hop_rows()))
        return "\n".join(parts)


def _balance_line(led: RingLedger) -> str:
    w = led._setup().world_size
    parts = []
    for p in led.passes:
        total = sum(r.counters.tiles_run for r in led.rank_work(p))
        parts.append(
            f"{p} {led.balance(p):.2f} (critical path {led.critical_path(p)} tile steps, "
            f"ideal {total / w:.4g})"
        )
    return "; ".join(parts)


def _states_line(led: RingLedger) -> str:
    per_pass = ", ".join(f"{p} {sum(x.pass_name == p for x in led.states)}" for p in led.passes)
    return f"per-step states recorded (rank x step): {len(led.states)} ({per_pass})"


def _table(cols: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return lines


def _html_table(cols: Sequence[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"
