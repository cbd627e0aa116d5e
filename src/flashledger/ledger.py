"""The ledger: what the blocked loop did, step by step, and what it counted.

Counters are always kept (they cost a few integer additions per tile).
Records, one per tile step, are built only when tracing is on; they hold the
tensors the loop actually computed, in the caller's layout (leading
``(B, H)`` dims dropped when the inputs had none).

Renderers: ``str(ledger)`` (plain text table), ``ledger.to_dict()`` (JSON-ready,
infinities as the strings ``"inf"``/``"-inf"``), ``ledger._repr_html_()`` for
notebooks.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ._checks import check_size
from ._limits import TRACE_MAX_BYTES
from .masks import TILE_KINDS

STAT_MIN_BYTES = 4
"""Bytes of one entry of the running statistics (m, ℓ, the LSE, D) at least: float32,
whatever the inputs' dtype, as the blocked loop keeps them (its accumulation dtype) and as
flash-attn and PyTorch's SDPA return the LSE of half-precision inputs."""

__all__ = ["BackwardTileStep", "Counters", "ForwardTileStep", "Ledger", "Trace", "jsonable"]


@dataclass(frozen=True)
class Trace:
    """What ``trace=`` records: every ``every``-th tile step, within ``max_bytes``.

    ``trace=True`` is ``Trace()`` (every step, the default budget of 1 GiB) and
    ``trace=k`` is ``Trace(every=k)``. Records hold the step's tensors (scores,
    probabilities, running state or gradients), so they grow as ``B·H·Lq·Lk``;
    the loop computes their size before it starts and raises ``ValueError``,
    with the size and how to reduce it, when it exceeds ``max_bytes`` (``None``:
    no budget). Kept records keep the loop's step ``index``.
    """

    every: int = 1
    """Keep the records of steps ``0, every, 2·every, ...`` (observers still see every step)."""
    max_bytes: int | None = TRACE_MAX_BYTES
    """Budget for the records' tensor data, in bytes (default 1 GiB; ``None``: unlimited)."""

    def __post_init__(self) -> None:
        check_size("Trace.every", self.every)
        mb = self.max_bytes
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 0):
            raise ValueError(f"Trace.max_bytes must be an integer >= 0 or None, got {mb!r}")

    @staticmethod
    def of(trace: bool | int | Trace | None) -> Trace | None:
        """``trace=`` as a ``Trace`` (None when off): False/None, True, an int ``every`` or a Trace."""
        if trace is None or trace is False:
            return None
        if trace is True:
            return Trace()
        if isinstance(trace, Trace):
            return trace
        if isinstance(trace, int):
            return Trace(every=trace)
        raise TypeError(
            "trace must be True/False, an integer k (record every k-th step) or "
            f"flashledger.Trace(every=..., max_bytes=...), got {type(trace).__name__}"
        )


@dataclass
class Counters:
    """Totals over batch and heads for one pass (forward or backward)."""

    qk_dots_visible: int = 0
    """QK dot products for visible (query, key) pairs in the tiles run."""
    qk_dots_computed: int = 0
    """QK dot products actually computed: the whole area of every tile run (partial tiles
    compute masked entries too)."""
    exps: int = 0
    """Exponentials evaluated (probabilities and rescale factors, masked entries included)."""
    tiles_run: int = 0
    tiles_skipped: int = 0
    """Tiles with no visible pair: never loaded, never computed."""
    tiles_full: int = 0
    """Tiles run without evaluating the mask."""
    tiles_partial: int = 0
    """Tiles run with the mask evaluated inside."""
    dropped: int = 0
    """Visible (query, key) entries zeroed by dropout."""
    elements_read: int = 0
    """Slow-memory (HBM) elements read under the schedule run (see blocked.py)."""
    elements_written: int = 0
    """Slow-memory (HBM) elements written under the schedule run."""
    stat_elements_read: int = 0
    """Of ``elements_read``, entries of m, ℓ, the LSE and D: float32 at least whatever the
    input dtype (``element_bytes``), as ``accounting.STATS`` books them."""
    stat_elements_written: int = 0
    """Of ``elements_written``, likewise."""
    mask_mod_tiles: int = 0
    """Tile calls of a user mask_mod in the loop: one per partial tile run and mask_mod (full
    and empty tiles never evaluate it)."""
    mask_mod_evals: int = 0
    """(batch, query head, query, key) positions those calls decided."""
    mask_mod_classify_evals: int = 0
    """Positions (over batch and query heads) a mask_mod was evaluated at to classify the tiles
    before the loop; 0 when the classes were known (a BlockMask's blocks, or the forward's
    classes reused by the backward of ``flash_attention``)."""
    mask_mod_tiles_bounded: int = 0
    """Tiles that classification decided without evaluating the mask_mod: empty or full by
    its span bounds (``_spans``), or by the closed-form side of ``&``/``|``."""
    score_mod_tiles: int = 0
    """Tile calls of a user score_mod: one per tile run (the backward's keeps its graph for the
    vector-Jacobian product on the tile)."""
    score_mod_evals: int = 0
    """(batch, query head, query, key) positions those calls covered."""

    def to_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class ForwardTileStep:
    """One forward tile step: query tile ``q_tile`` against key tile ``k_tile``.

    Tensor fields are ``None`` unless the loop was traced. Row statistics are
    ``(..., bq)``; ``s``/``p`` ``(..., bq, bk)``; ``acc``/``o`` ``(..., bq, d_v)``.
    """

    index: int
    q_tile: int
    k_tile: int
    q_range: tuple[int, int]
    k_range: tuple[int, int]
    kind: str  # "full" | "partial"
    s: torch.Tensor | None = None  # scores of the tile (masked entries -inf)
    block_max: torch.Tensor | None = None  # rowmax of s
    m_before: torch.Tensor | None = None
    m_after: torch.Tensor | None = None
    alpha: torch.Tensor | None = None  # exp(m_before - m_after), 0 for an empty state
    ell: torch.Tensor | None = None
    acc: torch.Tensor | None = None  # unnormalised accumulator (FA2 order); None in FA1 order
    o: torch.Tensor | None = None  # output of the keys read so far
    p: torch.Tensor | None = None  # exp(s - m_after)
    keep: torch.Tensor | None = None  # dropout keep mask of the tile


@dataclass(frozen=True)
class BackwardTileStep:
    """One backward tile step: key tile ``k_tile`` against query tile ``q_tile``.

    ``p`` is the rebuilt probability block ``exp(s - lse)``; ``ds`` the gradient of
    the tile's final scores ``s``, ``P ⊙ (dP - D)`` (with a softcap ``s`` is the capped
    score, and ``dq``/``dk`` take ``ds`` through the cap's derivative ``1 - tanh²``, so
    ``ds @ K · scale`` is not ``dq`` there); ``dq``/``dk``/``dv`` this step's
    contributions.
    """

    index: int
    q_tile: int
    k_tile: int
    q_range: tuple[int, int]
    k_range: tuple[int, int]
    kind: str
    s: torch.Tensor | None = None
    p: torch.Tensor | None = None
    dp: torch.Tensor | None = None
    ds: torch.Tensor | None = None
    dq: torch.Tensor | None = None  # (..., bq, d)
    dk: torch.Tensor | None = None  # (..., bk, d)
    dv: torch.Tensor | None = None  # (..., bk, d_v)
    keep: torch.Tensor | None = None


HTML_ROWS = 60
"""Records a notebook shows of a longer ledger: the first and last half of this."""
CELL_VALUES = 16
"""Values a table cell shows in full: a longer row vector shows its ends, a larger tile
its shape and range (every value stays in ``records`` and ``to_dict()``)."""


@dataclass
class Ledger:
    """Records of one pass (``"forward"`` or ``"backward"``) and its counters."""

    pass_name: str
    block_q: int
    block_k: int
    loop_order: str
    tiles_q: int
    tiles_k: int
    counters: Counters = field(default_factory=Counters)
    records: list[ForwardTileStep | BackwardTileStep] = field(default_factory=list)
    tile_kinds: list[list[str]] = field(default_factory=list)
    """``tile_kinds[i][j]``: ``"empty"``, ``"partial"`` or ``"full"`` for every tile."""
    lead: int = 0
    """Leading (batch, head) dims of the record tensors: 0, 1 or 2."""
    record_every: int = 1
    """Records were kept for every ``record_every``-th step (``Trace.every``)."""
    element_bytes: int = 0
    """Bytes of one element in slow memory: the inputs' dtype (2 for bfloat16/float16,
    whatever the loop accumulates in); 0 when not known. The statistics (m, ℓ, the LSE, D)
    take ``stat_bytes``."""
    kv_bytes_copied: int = 0
    """Forward: bytes written by the copies of K and V this implementation made for the
    pass, booked where each was made (strided K/V laid out contiguously, K/V converted to
    the accumulation dtype, the PyTorch step's Vᵀ, the native step's Kᵀ); 0 when the pass
    read K and V where they lie. Not part of the schedule's traffic (``counters``)."""

    @property
    def stat_bytes(self) -> int:
        """Bytes of one entry of m, ℓ, the LSE or D: float32 at least (the loop keeps them
        so for half inputs; ``accounting.STATS``); 0 when ``element_bytes`` is not known."""
        return max(STAT_MIN_BYTES, self.element_bytes) if self.element_bytes else 0

    @property
    def bytes_read(self) -> int:
        """Slow-memory bytes read: ``counters.elements_read`` elements, the statistics at
        ``stat_bytes`` and the rest at ``element_bytes``."""
        c = self.counters
        plain = c.elements_read - c.stat_elements_read
        return plain * self.element_bytes + c.stat_elements_read * self.stat_bytes

    @property
    def bytes_written(self) -> int:
        """Slow-memory bytes written, likewise."""
        c = self.counters
        plain = c.elements_written - c.stat_elements_written
        return plain * self.element_bytes + c.stat_elements_written * self.stat_bytes

    # -- plumbing used by the loop --------------------------------------------------
    def set_tile_classes(self, classes: Sequence[Sequence[int]] | torch.Tensor | None) -> None:
        """``(Tq, Tk)`` classes (0 empty, 1 partial, 2 full); ``None``: no mask, all full."""
        if classes is None:
            self.tile_kinds = [["full"] * self.tiles_k for _ in range(self.tiles_q)]
            return
        rows = classes.tolist() if isinstance(classes, torch.Tensor) else classes
        self.tile_kinds = [[TILE_KINDS[int(c)] for c in row] for row in rows]

    # -- renderers --------------------------------------------------------------------
    def rows(
        self, records: Sequence[ForwardTileStep | BackwardTileStep] | None = None
    ) -> list[dict[str, Any]]:
        """One summary dict per record (default: all; first batch and head when there are
        several)."""
        out = []
        for r in self.records if records is None else records:
            row: dict[str, Any] = {
                "step": r.index + 1,
                "tile": f"Q{r.q_tile} x K{r.k_tile}",
                "queries": f"{r.q_range[0]}..{r.q_range[1] - 1}",
                "keys": f"{r.k_range[0]}..{r.k_range[1] - 1}",
                "kind": r.kind,
            }
            if isinstance(r, ForwardTileStep):
                row.update(
                    block_max=_first(r.block_max, self.lead),
                    m=_first(r.m_after, self.lead),
                    alpha=_first(r.alpha, self.lead),
                    ell=_first(r.ell, self.lead),
                )
            else:
                row.update(p=_first(r.p, self.lead))
            out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: configuration, counters, tile kinds and every record's fields."""
        return {
            "pass": self.pass_name,
            "block_q": self.block_q,
            "block_k": self.block_k,
            "loop_order": self.loop_order,
            "tiles_q": self.tiles_q,
            "tiles_k": self.tiles_k,
            "counters": self.counters.to_dict(),
            "element_bytes": self.element_bytes,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "tile_kinds": self.tile_kinds,
            "record_every": self.record_every,
            "records": [jsonable(asdict(r)) for r in self.records],
        }

    def __str__(self) -> str:
        c = self.counters
        head = (
            f"{self.pass_name} ledger: tiles {self.block_q}x{self.block_k}, "
            f"{self.loop_order} order, {c.tiles_run} run ({c.tiles_full} full, "
            f"{c.tiles_partial} partial), {c.tiles_skipped} skipped; QK dots: "
            f"{c.qk_dots_visible} visible, {c.qk_dots_computed} computed; exps {c.exps}; "
            f"HBM elements read {c.elements_read}, written {c.elements_written}"
            + (
                f" ({self.bytes_read} and {self.bytes_written} bytes at {self.element_bytes} "
                "per element)"
                if self.element_bytes
                else ""
            )
        )
        if c.mask_mod_tiles or c.mask_mod_classify_evals:
            head += (
                f"; mask_mod: {c.mask_mod_evals} positions in {c.mask_mod_tiles} tile calls, "
                f"{c.mask_mod_classify_evals} to classify"
            )
            if c.mask_mod_tiles_bounded:
                head += f" ({c.mask_mod_tiles_bounded} tiles decided by bounds)"
        if c.score_mod_tiles:
            head += f"; score_mod: {c.score_mod_evals} positions in {c.score_mod_tiles} tile calls"
        head += self._every_note() + self._shown_note()
        rows = self.rows()
        if not rows:
            return head
        cols = list(rows[0])
        cells = [[_fmt(r[k]) for k in cols] for r in rows]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(cols)]
        lines = [head, "  ".join(k.ljust(w) for k, w in zip(cols, widths)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells]
        return "\n".join(lines)

    def _every_note(self) -> str:
        """Which steps the records keep, when not every one (``trace=k``)."""
        if self.record_every > 1 and self.records:
            return f"; records of every {ordinal(self.record_every)} step"
        return ""

    def _shown_note(self) -> str:
        """Which (batch, head) the rows show, when the records hold several."""
        if not self.lead or not self.records:
            return ""
        r = self.records[0]
        t = r.block_max if isinstance(r, ForwardTileStep) else r.p
        dims = "" if t is None else " of " + " x ".join(str(n) for n in t.shape[: self.lead])
        what = "batch 0, head 0" if self.lead == 2 else "the first of the leading dim"
        return f"; rows show {what}{dims} (the counters count all)"

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"Ledger({self.pass_name}, tiles {self.block_q}x{self.block_k}, {self.loop_order}, "
            f"{c.tiles_run} run, {c.tiles_skipped} skipped, {len(self.records)} records)"
        )

    def _repr_html_(self) -> str:
        c = self.counters
        parts = [
            f"<p><b>{html.escape(self.pass_name)} ledger</b>: tiles {self.block_q}&times;"
            f"{self.block_k}, {html.escape(self.loop_order)} order"
            f"{html.escape(self._every_note() + self._shown_note())}</p>",
            "<table><tr>"
            + "".join(f"<th>{k}</th>" for k in c.to_dict())
            + "</tr><tr>"
            + "".join(f"<td>{v}</td>" for v in c.to_dict().values())
            + "</tr></table>",
        ]
        n, half = len(self.records), HTML_ROWS // 2
        cut = n > HTML_ROWS
        shown = [*self.records[:half], *self.records[-half:]] if cut else self.records
        rows = self.rows(shown)
        if rows:
            cols = list(rows[0])

            def tr(r: dict[str, Any]) -> str:
                return (
                    "<tr>" + "".join(f"<td>{html.escape(_fmt(r[k]))}</td>" for k in cols) + "</tr>"
                )

            body = [tr(r) for r in rows]
            if cut:
                gap = (
                    f"<tr><td colspan='{len(cols)}'>&hellip; {n - 2 * half:,} more records "
                    f"(all {n:,} in <code>ledger.records</code>; <code>print(ledger)</code> "
                    "prints every one)</td></tr>"
                )
                body.insert(half, gap)
            parts.append(
                "<table><tr>"
                + "".join(f"<th>{html.escape(k)}</th>" for k in cols)
                + "</tr>"
                + "".join(body)
                + "</table>"
            )
        return "\n".join(parts)


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ..., ``11th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _first(x: torch.Tensor | None, lead: int) -> list[Any] | None:
    """The first batch element's first head (``lead`` leading dims dropped), as lists."""
    if x is None:
        return None
    y = x
    for _ in range(lead):
        y = y[0]
    return y.tolist()  # type: ignore[no-any-return]


def _fmt(v: Any) -> str:
    """A cell: a number, a row vector (its ends past ``CELL_VALUES`` values), a tile (its
    shape and range past ``CELL_VALUES`` values)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return _fnum(v)
    if isinstance(v, list):
        flat = _flat(v)
        if len(flat) <= CELL_VALUES:
            return "[" + ", ".join(_fmt(x) for x in v) + "]"
        if not any(isinstance(x, list) for x in v):
            ends = [_fmt(x) for x in v[:4]], [_fmt(x) for x in v[-2:]]
            return f"[{', '.join(ends[0])}, …, {', '.join(ends[1])}] ({len(v)} values)"
        shape = "x".join(str(n) for n in _shape(v))
        finite = [x for x in flat if isinstance(x, float | int) and math.isfinite(x)]
        rng = f"{_fnum(min(finite))}..{_fnum(max(finite))}" if finite else "no finite value"
        return f"{shape} tile, {rng}"
    return str(v)


def _flat(v: Any) -> list[Any]:
    return [y for x in v for y in _flat(x)] if isinstance(v, list) else [v]


def _shape(v: Any) -> list[int]:
    return [len(v), *_shape(v[0])] if isinstance(v, list) and v else []


def _fnum(x: float) -> str:
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.6g}"


def jsonable(x: Any) -> Any:
    """Tensors to nested lists; ±inf to ``"inf"``/``"-inf"``; NaN to ``"nan"``."""
    if isinstance(x, torch.Tensor):
        return jsonable(x.detach().cpu().tolist())
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def _demo() -> None:
    """The backward ledger of the seed's five positions: each tile's rebuilt P rows."""
    from .blocked import blocked_backward, blocked_forward
    from .examples import FIVE_G, FIVE_K, FIVE_Q, FIVE_V
    from .masks import Causal

    opts: dict[str, Any] = dict(mask=Causal(), block_q=2, block_k=2)
    fwd = blocked_forward(FIVE_Q, FIVE_K, FIVE_V, **opts)
    print(
        blocked_backward(FIVE_Q, FIVE_K, FIVE_V, fwd.o, fwd.lse, FIVE_G, **opts, trace=True).ledger
    )


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("ledger", _demo, command="backward")
