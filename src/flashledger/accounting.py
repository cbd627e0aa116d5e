"""Storage, work and slow-memory traffic of exact blocked attention, in closed form.

Every figure here is computed from the schedule (tile sizes, loop order) and
the mask's tile classification, without running attention; the tests check
each one against the counters the blocked loop keeps while it runs.

``storage_and_work`` books what the seed's section 05 books: the path that
keeps the whole probability matrix ``P`` against the path that keeps one LSE
per row, the tensors both keep, the gradient side, the temporary probability
tile, and the QK dot products, tiles, exponentials and FLOPs of both passes;
with a user's ``MaskMod`` or ``score_mod``, their evaluations too (the loop's
in closed form from the tile classes; the classification's by classifying, as
its cost is the mask_mod's own: see ``_tiling``).

``memory_traffic`` counts slow-memory (HBM) element reads and writes, split by
tensor, for standard attention (``S`` and ``P`` written to and read back from
slow memory) and for the FlashAttention-1 and FlashAttention-2 schedules, with
tiles from an on-chip memory size ``M`` (the paper's rule) or given directly.

=========  ===============  ==========================================
symbol     variable         meaning
=========  ===============  ==========================================
Lq, Lk     ``lq, lk``       query and key lengths
d, d_v     ``d, d_v``       head dims of Q/K and of V
Br, Bc     ``block_q/k``    query / key tile sizes
Tr, Tc     ``tiles_q/k``    ceil(Lq / Br), ceil(Lk / Bc)
M          ``sram``         on-chip memory in elements
r_i, c_j   ``q_sizes[i]``,  rows of query tile i, keys of key tile j
           ``k_sizes[j]``   (the last tile may be ragged)
R          run tiles        tiles (i, j) that are not empty under the mask
=========  ===============  ==========================================
"""

from __future__ import annotations

import html
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from ._checks import check_size
from ._limits import MAX_SIZE
from ._progress import figure_png, numeric_cell, titled_table, write_file
from .conventions import SEED, Conventions, get_conventions
from .ledger import STAT_MIN_BYTES
from .masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Causal,
    IntervalBound,
    Mask,
    SlidingWindow,
    as_mask,
)

if TYPE_CHECKING:
    from rich.console import Group

__all__ = [
    "SCHEDULES",
    "StorageWork",
    "Traffic",
    "TrafficSweep",
    "memory_traffic",
    "paper_tiles",
    "storage_and_work",
    "traffic_sweep",
]

Schedule = Literal["standard", "fa1", "fa2"]
SCHEDULES: tuple[Schedule, ...] = ("standard", "fa1", "fa2")
TENSORS = ("q", "k", "v", "o", "do", "s", "p", "dp", "ds", "m", "ell", "lse", "D", "dq", "dk", "dv")
"""Order in which tensors are listed in traffic tables."""


# ----------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shape:
    """A validated problem size: lengths, head dims, heads and batch."""

    lq: int
    lk: int
    d: int
    d_v: int
    heads: int
    kv_heads: int
    batch: int

    @staticmethod
    def build(lq: Any, lk: Any, d: Any, d_v: Any, heads: Any, kv_heads: Any, batch: Any) -> _Shape:
        lq, lk, d = check_size("lq", lq), check_size("lk", lk), check_size("d", d)
        d_v = d if d_v is None else check_size("d_v", d_v)
        heads = check_size("heads", heads)
        kv_heads = heads if kv_heads is None else check_size("kv_heads", kv_heads)
        if heads % kv_heads != 0:
            raise ValueError(
                f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) (GQA/MQA)"
            )
        return _Shape(lq, lk, d, d_v, heads, kv_heads, check_size("batch", batch))

    @property
    def bh(self) -> int:
        """(batch, query head) pairs."""
        return self.batch * self.heads

    def as_dict(self) -> dict[str, int]:
        return {
            "lq": self.lq,
            "lk": self.lk,
            "d": self.d,
            "d_v": self.d_v,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "batch": self.batch,
        }


def _element_size(dtype: Any) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            "dtype must be a floating torch dtype (float16, bfloat16, float32, float64), "
            f"got {dtype!r}"
        )
    return dtype.itemsize


# the running statistics (m, ℓ, the LSE, D): float32 at least, whatever the inputs' dtype, as
# the blocked loop keeps them (its accumulation dtype) and as flash-attn and PyTorch's SDPA
# return the LSE of half-precision inputs
STATS = frozenset({"m", "ell", "lse", "D"})


def paper_tiles(*, sram_elements: int, d: int) -> tuple[int, int]:
    """FlashAttention's tile rule for on-chip memory of ``M`` elements: ``(Br, Bc)``.

    ``Bc = ceil(M / 4d)``, ``Br = min(ceil(M / 4d), d)`` (FlashAttention paper, Algorithm 1).
    """
    m = check_size("sram_elements", sram_elements)
    d = check_size("d", d)
    bc = -(-m // (4 * d))
    return min(bc, d), bc


# ----------------------------------------------------------------------------------------
# the schedule's tiles, classified by the mask
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tiling:
    """Aggregates of the tile grid that every closed form below is written in.

    Counts are per (batch, head) except ``visible``, which is the total over
    batch and query heads (masks may differ between batch elements).
    """

    block_q: int
    block_k: int
    tiles_q: int  # Tr
    tiles_k: int  # Tc
    run: int  # |R|
    full: int
    partial: int
    area: int  # Σ_R r_i c_j: QK dots computed per (batch, head)
    rows_run: int  # Σ_R r_i
    keys_run: int  # Σ_R c_j
    rows_any: int  # Σ_i r_i [query tile i has a tile run]
    keys_any: int  # Σ_j c_j [key tile j has a tile run]
    visible: int  # visible (query, key) pairs, total over batch and query heads
    mask_mods: int = 0  # user mask_mods the mask evaluates (each per tile call)
    classify_positions: int = 0  # positions per (batch, head) evaluated to classify, all mask_mods
    bounded: int = 0  # tiles classification decided without evaluating a mask_mod
    kept: int = 0  # partial tiles whose visibility the classification kept for the loop
    area_unkept: int = 0  # Σ r_i c_j over the partial tiles not kept

    @property
    def total(self) -> int:
        return self.tiles_q * self.tiles_k

    @property
    def skipped(self) -> int:
        return self.total - self.run


def _sizes(n: int, b: int) -> torch.Tensor:
    """Sizes of the tiles of a length-``n`` axis cut every ``b``, ``(ceil(n/b),)`` int64."""
    starts = torch.arange(0, n, b, dtype=torch.int64)
    return torch.clamp(n - starts, max=b)


def _visible(bound: Any, shape: _Shape) -> int:
    """Visible (query, key) pairs over batch and query heads, from the bound mask."""
    if isinstance(bound, IntervalBound):
        per_b = torch.clamp(bound.hi - bound.lo + 1, min=0).sum(dim=-1)  # (Bm,)
        return int(per_b.sum()) * (shape.batch // per_b.numel()) * shape.heads
    dense = bound.dense()  # (Bm, Hm, Lq, Lk)
    bm, hm = dense.shape[0], dense.shape[1]
    return int(dense.sum()) * (shape.batch // bm) * (shape.heads // hm)


MAX_MASKED_TILES = 2**24
"""Most tiles (``Tq·Tk``) a masked ledger classifies: about 1 GB of working memory."""
MAX_MASKED_LEN = 2**24
"""Longest ``Lq`` or ``Lk`` a masked ledger takes: the mask keeps key bounds per query row."""


def _check_masked_size(shape: _Shape, tq: int, tk: int) -> None:
    """A masked ledger classifies every tile and bounds every row: keep both in memory."""
    if max(shape.lq, shape.lk) > MAX_MASKED_LEN:
        raise ValueError(
            f"with a mask, Lq and Lk must be at most {MAX_MASKED_LEN:,} (the mask keeps key "
            f"bounds per query row); got Lq = {shape.lq:,}, Lk = {shape.lk:,}. Without a mask "
            "the ledger is closed-form and takes any length"
        )
    if tq * tk > MAX_MASKED_TILES:
        raise ValueError(
            f"with a mask, the ledger classifies each of the Tq x Tk tiles: at most "
            f"{MAX_MASKED_TILES:,}, got {tq:,} x {tk:,} = {tq * tk:,}; use larger tiles "
            f"(L = 1,048,576 fits with 256 x 256)"
        )


def _tiling(
    shape: _Shape, block_q: int, block_k: int, mask: Mask | torch.Tensor | None, conv: Conventions
) -> _Tiling:
    """Classify the tiles exactly as the blocked loop does (same geometry, same classes)."""
    block_q = check_size("block_q", block_q)
    block_k = check_size("block_k", block_k)
    tq, tk = -(-shape.lq // block_q), -(-shape.lk // block_k)
    m = as_mask(mask)
    if m is None:
        return _Tiling(
            block_q, block_k, tq, tk,
            run=tq * tk, full=tq * tk, partial=0,
            area=shape.lq * shape.lk,
            rows_run=shape.lq * tk, keys_run=shape.lk * tq,
            rows_any=shape.lq, keys_any=shape.lk,
            visible=shape.lq * shape.lk * shape.bh,
        )  # fmt: skip
    _check_masked_size(shape, tq, tk)
    geo = m.geometry(shape.lq, shape.lk, batch=shape.batch, heads=shape.heads, conventions=conv)
    bound = m.bind(geo)
    kinds = bound.classes(block_q, block_k).to(torch.int64)  # (Tr, Tc)
    classify_positions = sum(caller.positions for caller in bound.callers)
    bounded = bound.tiles_bounded
    ran = kinds != EMPTY  # (Tr, Tc)
    r = _sizes(shape.lq, block_q)  # (Tr,)
    c = _sizes(shape.lk, block_k)  # (Tc,)
    ran_i = ran.to(torch.int64)  # (Tr, Tc)
    per_row = ran_i.sum(dim=1)  # (Tr,) tiles run in each query tile
    per_col = ran_i.sum(dim=0)  # (Tc,) tiles run in each key tile
    # a mask_mod: the classification's evaluations are what classifying costs (counted by
    # the callers); the loop evaluates the partial tiles the classification did not keep
    callers = bound.callers
    kept = torch.zeros_like(ran)  # (Tr, Tc)
    if callers:
        for i, j in torch.nonzero(kinds == PARTIAL).tolist():
            q0, k0 = i * block_q, j * block_k
            kept[i, j] = bound.is_kept(q0, q0 + int(r[i]), k0, k0 + int(c[j]))
    unkept = (kinds == PARTIAL) & ~kept
    return _Tiling(
        block_q, block_k, tq, tk,
        run=int(ran_i.sum()),
        full=int((kinds == FULL).sum()),
        partial=int((kinds == PARTIAL).sum()),
        area=int((r[:, None] * c[None, :] * ran_i).sum()),
        rows_run=int((r * per_row).sum()),
        keys_run=int((c * per_col).sum()),
        rows_any=int((r * (per_row > 0)).sum()),
        keys_any=int((c * (per_col > 0)).sum()),
        visible=_visible(bound, shape),
        mask_mods=len(callers),
        classify_positions=classify_positions,
        bounded=bounded,
        kept=int(kept.sum()),
        area_unkept=int((r[:, None] * c[None, :] * unkept).sum()),
    )  # fmt: skip


def _mask_name(mask: Mask | torch.Tensor | None, conv: Conventions | None = None) -> str:
    """A short label: ``none``, ``causal``, ``causal(bottom_right)``, ``window(128, 0)``, ...;
    a mask that takes its alignment from ``conv`` names it where it is not top-left
    (``causal(bottom_right, from flash_attn_2)``)."""
    if mask is None:
        return "none"
    if isinstance(mask, torch.Tensor):
        return f"bool tensor {tuple(mask.shape)}"
    align: str | None = mask.align if isinstance(mask, Causal | SlidingWindow) else None
    if conv is not None and align is None and conv.causal_align != "top_left":
        align = f"{conv.causal_align}, from {conv.name}"
    if isinstance(mask, Causal):
        return "causal" if align is None else f"causal({align})"
    if isinstance(mask, SlidingWindow):
        name = f"window({mask.left}, {mask.right})"
        return name if align is None else f"{name[:-1]}, {align})"
    return repr(mask)


# ----------------------------------------------------------------------------------------
# rendering shared by both reports
# ----------------------------------------------------------------------------------------
def _num(x: int) -> str:
    return f"{x:,}"


def _bytes(x: int) -> str:
    """``x`` bytes in the largest binary unit that keeps the number under 1000 once it is
    rounded to 3 significant digits (``999 KiB``, then ``0.977 MiB``), up to PiB."""
    units = (
        ("PiB", 1 << 50),
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    )
    for n, (unit, size) in enumerate(units):
        if x >= size or (n + 1 < len(units) and float(f"{x / units[n + 1][1]:.3g}") >= 1000):
            return f"{x / size:.3g} {unit}"
    return f"{x} B"


def _plain_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    right = [i for i in range(len(header)) if all(numeric_cell(r[i]) for r in rows)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(r) for r in rows)])


def _html_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return (
        f"<table><caption>{html.escape(title)}</caption>"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


class _Report(ABC):
    """Mixin: a title, a header and string rows rendered as text, HTML and rich."""

    @abstractmethod
    def _title(self) -> str: ...

    @abstractmethod
    def _header(self) -> list[str]: ...

    @abstractmethod
    def _rows(self) -> list[list[str]]: ...

    def __str__(self) -> str:
        return _plain_table(self._title(), self._header(), self._rows())

    def _repr_html_(self) -> str:
        return _html_table(self._title(), self._header(), self._rows())

    def __rich__(self) -> Group:
        return titled_table(self._title(), self._header(), self._rows())


# ----------------------------------------------------------------------------------------
# storage and work
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StorageWork(_Report):
    """The storage-and-work ledger of one configuration (totals over batch and heads).

    Elements unless named ``*_bytes``. ``qk_dots_*``, ``tiles_*`` and
    ``exps_*`` are what the blocked loop's counters report for the same tiles.
    """

    config: dict[str, Any]
    """Lengths, head dims, heads, batch, tiles, mask, conventions and dtype."""
    bytes_per_element: int
    common_elements: dict[str, int]
    """Q, K, V, O: kept by both paths."""
    full_p_elements: int
    """The path that keeps P: ``Lq·Lk`` per (batch, head)."""
    lse_elements: int
    """The path that keeps one LSE per row: ``Lq`` per (batch, head)."""
    gradient_elements: dict[str, int]
    """Upstream G and dQ, dK, dV, booked apart from the forward's storage."""
    d_elements: int
    """D = rowsum(G ⊙ O), one per row, made by the backward."""
    temp_block_capacity: int
    """Probabilities one tile holds, ``min(Br, Lq)·min(Bc, Lk)`` per (batch, head)."""
    qk_dots_forward: int
    """QK dot products of visible positions in the forward."""
    qk_dots_backward: int
    """The same products again in the backward's rebuild of P."""
    qk_dots_computed: int
    """Dot products computed per pass: the whole area of every tile run."""
    tiles_total: int
    tiles_run: int
    tiles_skipped: int
    tiles_full: int
    tiles_partial: int
    exps_forward: int
    """Exponentials in the forward: every entry of a tile run plus one rescale per row."""
    exps_backward: int
    """Exponentials in the backward's rebuild: every entry of a tile run."""
    flops_forward: int
    """``2·(d + d_v)`` per dot computed: ``S = QKᵀ`` and ``P V``."""
    flops_backward: int
    """``2·(3d + 2d_v)`` per dot computed: ``S``, ``dP``, ``dV``, ``dQ``, ``dK``."""
    mask_mod_classify_evals: int = 0
    """Positions (over batch and query heads) a ``MaskMod``'s mask_mod is evaluated at to
    classify the tiles, in a pass that classifies (``Lq·Lk`` per mask_mod, or the tiles a
    closed-form side of ``&``/``|`` leaves open; none for a BlockMask's blocks)."""
    mask_mod_tiles_bounded: int = 0
    """Tiles the classification decides without evaluating the mask_mod: empty or full by its
    span bounds, or by the closed-form side of ``&``/``|``."""
    mask_mod_tiles_kept: int = 0
    """Partial tiles whose visibility the classification keeps for the loop (up to
    ``masks.KEEP_BYTES``)."""
    mask_mod_tiles: int = 0
    """Tile calls of the mask_mods in each pass: the partial tiles not kept, per mask_mod."""
    mask_mod_evals: int = 0
    """Positions (over batch and query heads) those calls decide."""
    score_mod_tiles: int = 0
    """Tile calls of a score_mod in each pass: one per tile run."""
    score_mod_evals: int = 0
    """Positions (over batch and query heads) those calls cover: the dots computed."""

    @property
    def stat_bytes_per_element(self) -> int:
        """Bytes of one LSE or D entry: float32 at least (``STATS``)."""
        return max(STAT_MIN_BYTES, self.bytes_per_element)

    @property
    def saved_elements(self) -> int:
        """Elements the LSE path saves against the full-P path."""
        return self.full_p_elements - self.lse_elements

    @property
    def saved_bytes(self) -> int:
        """Bytes the LSE path saves: P in the inputs' dtype, the LSE in ``stat_bytes``."""
        return (
            self.full_p_elements * self.bytes_per_element
            - self.lse_elements * self.stat_bytes_per_element
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the key set is stable (the tests pin it)."""
        b, sb = self.bytes_per_element, self.stat_bytes_per_element
        return {
            "config": dict(self.config),
            "bytes_per_element": b,
            "stat_bytes_per_element": sb,
            "common_elements": dict(self.common_elements),
            "full_p_elements": self.full_p_elements,
            "lse_elements": self.lse_elements,
            "saved_elements": self.saved_elements,
            "gradient_elements": dict(self.gradient_elements),
            "d_elements": self.d_elements,
            "temp_block_capacity": self.temp_block_capacity,
            "qk_dots_forward": self.qk_dots_forward,
            "qk_dots_backward": self.qk_dots_backward,
            "qk_dots_computed": self.qk_dots_computed,
            "tiles_total": self.tiles_total,
            "tiles_run": self.tiles_run,
            "tiles_skipped": self.tiles_skipped,
            "tiles_full": self.tiles_full,
            "tiles_partial": self.tiles_partial,
            "exps_forward": self.exps_forward,
            "exps_backward": self.exps_backward,
            "flops_forward": self.flops_forward,
            "flops_backward": self.flops_backward,
            "mask_mod_classify_evals": self.mask_mod_classify_evals,
            "mask_mod_tiles_bounded": self.mask_mod_tiles_bounded,
            "mask_mod_tiles_kept": self.mask_mod_tiles_kept,
            "mask_mod_tiles": self.mask_mod_tiles,
            "mask_mod_evals": self.mask_mod_evals,
            "score_mod_tiles": self.score_mod_tiles,
            "score_mod_evals": self.score_mod_evals,
            "bytes": {
                "common": sum(self.common_elements.values()) * b,
                "full_p": self.full_p_elements * b,
                "lse": self.lse_elements * sb,
                "saved": self.saved_bytes,
                "gradients": sum(self.gradient_elements.values()) * b,
                "d": self.d_elements * sb,
                "temp_block": self.temp_block_capacity * b,
            },
        }

    def _title(self) -> str:
        c = self.config
        return (
            f"Storage and work: Lq={c['lq']} Lk={c['lk']} d={c['d']} d_v={c['d_v']} "
            f"heads={c['heads']} kv_heads={c['kv_heads']} batch={c['batch']} "
            f"tiles {c['block_q']}x{c['block_k']} mask={c['mask']} {c['dtype']}"
        )

    def _header(self) -> list[str]:
        return ["booked as", "item", "count", "bytes", "note"]

    def _rows(self) -> list[list[str]]:
        b, sb = self.bytes_per_element, self.stat_bytes_per_element
        common = sum(self.common_elements.values())
        grads = sum(self.gradient_elements.values())

        def mem(section: str, item: str, n: int, note: str, size: int | None = None) -> list[str]:
            return [section, item, _num(n), _bytes(n * (b if size is None else size)), note]

        stat = "" if sb == b else f", float32 ({sb} B) for {self.config['dtype']} inputs"

        def work(section: str, item: str, n: int, note: str) -> list[str]:
            return [section, item, _num(n), "", note]

        return [
            mem("kept by both paths", "Q, K, V, O", common, "inputs and output"),
            mem("full-P path keeps", "P", self.full_p_elements, "Lq·Lk per (batch, head)"),
            mem("LSE path keeps", "LSE", self.lse_elements, f"one per row{stat}", sb),
            ["LSE path saves", "P - LSE", _num(self.saved_elements), _bytes(self.saved_bytes),
             "elements not stored"],
            mem("gradient side", "G, dQ, dK, dV", grads, "booked apart"),
            mem("backward makes", "D = rowsum(G ⊙ O)", self.d_elements, f"one per row{stat}", sb),
            mem(
                "temporary tile", "P block", self.temp_block_capacity,
                "Br·Bc per (batch, head); scores, dS and matmul workspaces are extra",
            ),
            work("forward", "QK dots (visible)", self.qk_dots_forward, "visible positions"),
            work(
                "backward", "QK dots (rebuild)", self.qk_dots_backward,
                "the same products again: the price of not storing P",
            ),
            work("each pass", "QK dots computed", self.qk_dots_computed, "whole area of tiles run"),
            work("each pass", "tiles run", self.tiles_run, f"of {self.tiles_total}"),
            work("each pass", "tiles skipped", self.tiles_skipped, "empty under the mask"),
            work("each pass", "tiles full", self.tiles_full, "mask never evaluated"),
            work("each pass", "tiles partial", self.tiles_partial, "mask evaluated inside"),
            work("forward", "exponentials", self.exps_forward, "tile entries + one α per row of each tile run"),
            work("backward", "exponentials", self.exps_backward, "tile entries"),
            work("forward", "FLOPs", self.flops_forward, "2(d + d_v) per dot computed"),
            work("backward", "FLOPs", self.flops_backward, "2(3d + 2d_v) per dot computed"),
            *self._mod_rows(work),
        ]  # fmt: skip

    def _mod_rows(self, work: Any) -> list[list[str]]:
        """Rows of a user's mask_mod and score_mod (none without them)."""
        rows = []
        if self.mask_mod_classify_evals or self.mask_mod_tiles or self.mask_mod_tiles_kept:
            rows += [
                work("classification", "mask_mod positions", self.mask_mod_classify_evals,
                     "to classify the tiles"),
                work("classification", "tiles decided by bounds", self.mask_mod_tiles_bounded,
                     "empty or full, nothing evaluated"),
                work("classification", "partial tiles kept", self.mask_mod_tiles_kept,
                     "visibility kept for the loop"),
                work("each pass", "mask_mod tile calls", self.mask_mod_tiles,
                     "partial tiles not kept"),
                work("each pass", "mask_mod positions", self.mask_mod_evals, "in those calls"),
            ]  # fmt: skip
        if self.score_mod_tiles:
            rows += [
                work("each pass", "score_mod tile calls", self.score_mod_tiles, "one per tile run"),
                work("each pass", "score_mod positions", self.score_mod_evals, "whole tiles"),
            ]
        return rows


def storage_and_work(
    *,
    lq: int,
    lk: int,
    d: int,
    d_v: int | None = None,
    heads: int = 1,
    kv_heads: int | None = None,
    batch: int = 1,
    block_q: int,
    block_k: int,
    mask: Mask | torch.Tensor | None = None,
    conventions: Conventions | str = SEED,
    dtype: torch.dtype = torch.float64,
    score_mod: bool | Callable[..., Any] | None = False,
) -> StorageWork:
    """The storage-and-work ledger in closed form (the seed's section 05).

    Sizes: ``lq``, ``lk``, ``d``, ``d_v`` (default ``d``), ``heads`` query heads,
    ``kv_heads`` (default ``heads``; GQA when fewer), ``batch``; tiles
    ``block_q x block_k``; ``mask`` a ``Mask``, a bool tensor or None;
    ``conventions`` sets ``Causal()``'s alignment; ``dtype`` sets the bytes;
    ``score_mod``: whether a score_mod is given (True, or the score_mod itself: its
    evaluations are booked).

    >>> from flashledger import Causal
    >>> sw = storage_and_work(lq=5, lk=5, d=2, block_q=2, block_k=2, mask=Causal())
    >>> sw.full_p_elements, sw.lse_elements, sw.qk_dots_forward, sw.qk_dots_computed
    (25, 5, 15, 17)
    """
    shape = _Shape.build(lq, lk, d, d_v, heads, kv_heads, batch)
    conv = get_conventions(conventions)
    size = _element_size(dtype)
    if not (score_mod is None or isinstance(score_mod, bool) or callable(score_mod)):
        raise TypeError(
            f"score_mod must be True/False or the score_mod callable, got {type(score_mod).__name__}"
        )
    score_mod = bool(score_mod)
    t = _tiling(shape, block_q, block_k, mask, conv)
    bh, bkv = shape.bh, shape.batch * shape.kv_heads
    computed = t.area * bh
    return StorageWork(
        config={
            **shape.as_dict(),
            "block_q": t.block_q,
            "block_k": t.block_k,
            "mask": _mask_name(mask, conv),
            "conventions": conv.name,
            "dtype": str(dtype).removeprefix("torch."),
        },
        bytes_per_element=size,
        common_elements={
            "q": bh * shape.lq * shape.d,
            "k": bkv * shape.lk * shape.d,
            "v": bkv * shape.lk * shape.d_v,
            "o": bh * shape.lq * shape.d_v,
        },
        full_p_elements=bh * shape.lq * shape.lk,
        lse_elements=bh * shape.lq,
        gradient_elements={
            "g": bh * shape.lq * shape.d_v,
            "dq": bh * shape.lq * shape.d,
            "dk": bkv * shape.lk * shape.d,
            "dv": bkv * shape.lk * shape.d_v,
        },
        d_elements=bh * shape.lq,
        temp_block_capacity=min(t.block_q, shape.lq) * min(t.block_k, shape.lk),
        qk_dots_forward=t.visible,
        qk_dots_backward=t.visible,
        qk_dots_computed=computed,
        tiles_total=t.total,
        tiles_run=t.run,
        tiles_skipped=t.skipped,
        tiles_full=t.full,
        tiles_partial=t.partial,
        exps_forward=computed + t.rows_run * bh,
        exps_backward=computed,
        flops_forward=2 * (shape.d + shape.d_v) * computed,
        flops_backward=2 * (3 * shape.d + 2 * shape.d_v) * computed,
        mask_mod_classify_evals=t.classify_positions * bh,
        mask_mod_tiles_bounded=t.bounded,
        mask_mod_tiles_kept=t.kept,
        mask_mod_tiles=(t.partial - t.kept) * t.mask_mods,
        mask_mod_evals=t.area_unkept * t.mask_mods * bh,
        score_mod_tiles=t.run if score_mod else 0,
        score_mod_evals=computed if score_mod else 0,
    )


# ----------------------------------------------------------------------------------------
# memory traffic
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic(_Report):
    """Slow-memory element reads and writes of one schedule, split by tensor.

    Totals over batch and query heads; every query head is booked as reading
    its own K/V, as the blocked loop's counters do.
    """

    schedule: Schedule
    config: dict[str, Any]
    bytes_per_element: int
    forward_reads: dict[str, int]
    forward_writes: dict[str, int]
    backward_reads: dict[str, int]
    backward_writes: dict[str, int]

    @property
    def forward_read(self) -> int:
        """Elements the forward reads (the loop's ``elements_read``)."""
        return sum(self.forward_reads.values())

    @property
    def forward_written(self) -> int:
        return sum(self.forward_writes.values())

    @property
    def backward_read(self) -> int:
        return sum(self.backward_reads.values())

    @property
    def backward_written(self) -> int:
        return sum(self.backward_writes.values())

    @property
    def forward_total(self) -> int:
        return self.forward_read + self.forward_written

    @property
    def backward_total(self) -> int:
        return self.backward_read + self.backward_written

    @property
    def total(self) -> int:
        """Every element moved, both passes."""
        return self.forward_total + self.backward_total

    @property
    def stat_bytes_per_element(self) -> int:
        """Bytes of one entry of m, ℓ, the LSE or D: float32 at least (``STATS``)."""
        return max(STAT_MIN_BYTES, self.bytes_per_element)

    def bytes_of(self, moved: dict[str, int]) -> int:
        """Bytes of ``moved`` (elements per tensor): the statistics at
        ``stat_bytes_per_element``, every other tensor at ``bytes_per_element``."""
        return sum(
            n * (self.stat_bytes_per_element if name in STATS else self.bytes_per_element)
            for name, n in moved.items()
        )

    @property
    def total_bytes(self) -> int:
        """Every byte moved, both passes."""
        return sum(
            self.bytes_of(x)
            for x in (self.forward_reads, self.forward_writes,
                      self.backward_reads, self.backward_writes)
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the key set is stable (the tests pin it)."""

        def side(reads: dict[str, int], writes: dict[str, int]) -> dict[str, Any]:
            return {
                "reads": dict(reads),
                "writes": dict(writes),
                "elements_read": sum(reads.values()),
                "elements_written": sum(writes.values()),
                "bytes_read": self.bytes_of(reads),
                "bytes_written": self.bytes_of(writes),
            }

        return {
            "schedule": self.schedule,
            "config": dict(self.config),
            "bytes_per_element": self.bytes_per_element,
            "stat_bytes_per_element": self.stat_bytes_per_element,
            "forward": side(self.forward_reads, self.forward_writes),
            "backward": side(self.backward_reads, self.backward_writes),
            "total_elements": self.total,
            "total_bytes": self.total_bytes,
        }

    def _title(self) -> str:
        c = self.config
        head = (
            f"Memory traffic ({self.schedule}, elements): Lq={c['lq']} Lk={c['lk']} d={c['d']} "
            f"d_v={c['d_v']} heads={c['heads']} batch={c['batch']}"
        )
        if self.schedule == "standard":
            return f"{head} (S and P whole, whatever the mask)"
        sram = "" if c["sram_elements"] is None else f" M={c['sram_elements']}"
        return f"{head}{sram} tiles {c['block_q']}x{c['block_k']} mask={c['mask']}"

    def _header(self) -> list[str]:
        return ["tensor", "forward reads", "forward writes", "backward reads", "backward writes"]

    def _rows(self) -> list[list[str]]:
        names = [
            n
            for n in TENSORS
            if any(n in x for x in (self.forward_reads, self.forward_writes,
                                    self.backward_reads, self.backward_writes))
        ]  # fmt: skip

        def cell(x: dict[str, int], n: str) -> str:
            return _num(x[n]) if n in x else ""

        rows = [
            [n, cell(self.forward_reads, n), cell(self.forward_writes, n),
             cell(self.backward_reads, n), cell(self.backward_writes, n)]
            for n in names
        ]  # fmt: skip
        rows.append(
            ["total", _num(self.forward_read), _num(self.forward_written),
             _num(self.backward_read), _num(self.backward_written)]
        )  # fmt: skip
        return rows


def _standard(s: _Shape) -> tuple[dict[str, int], ...]:
    """Standard attention: S, P (and dP, dS) go to slow memory and come back."""
    lq, lk, d, dv = s.lq, s.lk, s.d, s.d_v
    sq = lq * lk
    # forward: S = QKᵀ -> HBM; P = softmax(S) -> HBM; O = P V -> HBM
    fr = {"q": lq * d, "k": lk * d, "s": sq, "p": sq, "v": lk * dv}
    fw = {"s": sq, "p": sq, "o": lq * dv}
    # backward: dV = Pᵀ dO; dP = dO Vᵀ; dS = P ⊙ (dP - rowsum(dP ⊙ P));
    # dQ = dS K; dK = dSᵀ Q
    br = {"p": 2 * sq, "do": 2 * lq * dv, "v": lk * dv, "dp": sq, "ds": 2 * sq,
          "k": lk * d, "q": lq * d}  # fmt: skip
    bw = {"dv": lk * dv, "dp": sq, "ds": sq, "dq": lq * d, "dk": lk * d}
    return fr, fw, br, bw


def _blocked(s: _Shape, t: _Tiling, order: str) -> tuple[dict[str, int], ...]:
    """The blocked loop's counting rules (see blocked.py), per (batch, query head)."""
    lq, d, dv = s.lq, s.d, s.d_v
    if order == "fa2":
        # per query tile run: Q_i once; per tile run: K_j, V_j; per query tile: O_i, LSE_i
        fr = {"q": t.rows_any * d, "k": t.keys_run * d, "v": t.keys_run * dv}
        fw = {"o": lq * dv, "lse": lq}
    else:
        # O, ℓ, m initialised in HBM; per key tile run: K_j, V_j; per tile run: Q_i, O_i, ℓ_i,
        # m_i read and O_i, ℓ_i, m_i written back; finally m, ℓ read and the LSE written
        fr = {"q": t.rows_run * d, "k": t.keys_any * d, "v": t.keys_any * dv,
              "o": t.rows_run * dv, "m": t.rows_run + lq, "ell": t.rows_run + lq}  # fmt: skip
        fw = {"o": (lq + t.rows_run) * dv, "m": lq + t.rows_run, "ell": lq + t.rows_run,
              "lse": lq}  # fmt: skip
    # backward (both orders): D = rowsum(dO ⊙ O); dQ initialised; per key tile run: K_j, V_j;
    # per key tile: dK_j, dV_j written; per tile run: Q_i, dO_i, λ_i, D_i, dQ_i read, dQ_i written
    br = {"o": lq * dv, "do": lq * dv + t.rows_run * dv, "k": t.keys_any * d,
          "v": t.keys_any * dv, "q": t.rows_run * d, "lse": t.rows_run, "D": t.rows_run,
          "dq": t.rows_run * d}  # fmt: skip
    bw = {"D": lq, "dq": lq * d + t.rows_run * d, "dk": s.lk * d, "dv": s.lk * dv}
    return fr, fw, br, bw


def _resolve_tiles(
    shape: _Shape, sram_elements: int | None, block_q: int | None, block_k: int | None
) -> tuple[int, int]:
    if sram_elements is not None:
        if block_q is not None or block_k is not None:
            raise ValueError(
                "give either sram_elements (tiles from the paper's rule) or block_q and "
                "block_k, not both"
            )
        return paper_tiles(sram_elements=sram_elements, d=shape.d)
    if block_q is None or block_k is None:
        raise ValueError(
            "memory_traffic needs sram_elements (on-chip memory in elements) or both "
            "block_q and block_k"
        )
    return check_size("block_q", block_q), check_size("block_k", block_k)


def memory_traffic(
    *,
    lq: int,
    lk: int,
    d: int,
    d_v: int | None = None,
    heads: int = 1,
    kv_heads: int | None = None,
    batch: int = 1,
    schedule: Schedule = "fa2",
    sram_elements: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    mask: Mask | torch.Tensor | None = None,
    conventions: Conventions | str = SEED,
    dtype: torch.dtype = torch.float64,
) -> Traffic:
    """Slow-memory reads and writes of one schedule, forward and backward, in closed form.

    ``schedule``: ``"standard"`` (S and P materialised in slow memory, the whole
    ``Lq x Lk`` matrices whatever the mask), ``"fa1"`` or ``"fa2"`` (the blocked
    loop with ``loop_order`` of that name; its ``elements_read`` /
    ``elements_written`` counters equal these figures). Tiles come from
    ``sram_elements`` ``M`` by the paper's rule (``Bc = ceil(M/4d)``,
    ``Br = min(ceil(M/4d), d)``) or from ``block_q`` and ``block_k``; the
    standard schedule needs neither.

    >>> t = memory_traffic(lq=5, lk=5, d=2, schedule="fa2", block_q=2, block_k=2)
    >>> t.forward_read, t.forward_written
    (70, 15)
    """
    shape = _Shape.build(lq, lk, d, d_v, heads, kv_heads, batch)
    conv = get_conventions(conventions)
    size = _element_size(dtype)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    bq: int | None = None
    bk: int | None = None
    if schedule == "standard":
        # S and P are materialised whole: neither tiles nor the mask change the traffic
        if sram_elements is not None or block_q is not None or block_k is not None:
            _resolve_tiles(shape, sram_elements, block_q, block_k)
        parts = _standard(shape)
    else:
        bq, bk = _resolve_tiles(shape, sram_elements, block_q, block_k)
        parts = _blocked(shape, _tiling(shape, bq, bk, mask, conv), schedule)
    fr, fw, br, bw = ({k: v * shape.bh for k, v in p.items()} for p in parts)
    return Traffic(
        schedule=schedule,
        config={
            **shape.as_dict(),
            "sram_elements": sram_elements,
            "block_q": bq,
            "block_k": bk,
            "mask": _mask_name(mask, conv),
            "conventions": conv.name,
            "dtype": str(dtype).removeprefix("torch."),
        },
        bytes_per_element=size,
        forward_reads=fr,
        forward_writes=fw,
        backward_reads=br,
        backward_writes=bw,
    )


# ----------------------------------------------------------------------------------------
# sweeps: traffic against M and against N
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrafficSweep(_Report):
    """Forward+backward traffic of the three schedules against ``M`` and against ``N``.

    ``by_sram[i]`` is ``{"sram_elements": M, "standard": ..., "fa1": ..., "fa2": ...}``
    at length ``n``; ``by_length[i]`` the same keyed by ``"n"`` at ``sram_elements``;
    ``crossover_sram`` the smallest ``M`` (a multiple of ``4d``) at which FA1 moves no
    more elements than standard attention, at each length of ``by_length`` (None: at no
    ``M`` up to one key tile of all ``N`` keys, as at ``N = 1``).
    """

    d: int
    n: int
    sram_elements: int
    by_sram: list[dict[str, int]]
    by_length: list[dict[str, int]]
    crossover_sram: dict[int, int | None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "d": self.d,
            "n": self.n,
            "sram_elements": self.sram_elements,
            "by_sram": [dict(r) for r in self.by_sram],
            "by_length": [dict(r) for r in self.by_length],
            "crossover_sram": {str(k): v for k, v in self.crossover_sram.items()},
        }

    def _title(self) -> str:
        return f"Traffic sweep (elements, forward + backward, d={self.d})"

    def _header(self) -> list[str]:
        return ["sweep", "N", "M", "standard", "fa1", "fa2", "fa1 / fa1(2M)", "fa1 / standard"]

    def _rows(self) -> list[list[str]]:
        rows = []
        for i, r in enumerate(self.by_sram):
            nxt = self.by_sram[i + 1] if i + 1 < len(self.by_sram) else None
            ratio = (
                f"{r['fa1'] / nxt['fa1']:.3f}"
                if nxt is not None and nxt["sram_elements"] == 2 * r["sram_elements"]
                else ""
            )
            rows.append(
                ["M", _num(self.n), _num(r["sram_elements"]), _num(r["standard"]),
                 _num(r["fa1"]), _num(r["fa2"]), ratio, f"{r['fa1'] / r['standard']:.3f}"]
            )  # fmt: skip
        for r in self.by_length:
            rows.append(
                ["N", _num(r["n"]), _num(self.sram_elements), _num(r["standard"]),
                 _num(r["fa1"]), _num(r["fa2"]), "", f"{r['fa1'] / r['standard']:.3f}"]
            )  # fmt: skip
        return rows

    def crossover_lines(self) -> list[str]:
        """One line per length: where FA1 starts moving fewer elements than standard."""
        return [
            f"N={n}: FA1 moves no more elements than standard attention from M = {m:,} "
            f"elements (= {m / self.d**2:.3g}·d²)"
            if m is not None
            else f"N={n}: FA1 moves more elements than standard attention at every M up to "
            f"one key tile of all N = {n:,} keys"
            for n, m in self.crossover_sram.items()
        ]

    def plot(self, path: str) -> None:
        """Save a two-panel PNG: traffic against M, and against N (log-log)."""
        try:
            import matplotlib
        except ImportError as exc:
            raise ImportError("plotting needs matplotlib: pip install 'flashledger[plot]'") from exc
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_m, ax_n) = plt.subplots(1, 2, figsize=(11, 4.2))
        styles = {"standard": "s-", "fa1": "o-", "fa2": "^-"}
        labels = {"standard": "standard (S, P in HBM)", "fa1": "FlashAttention-1",
                  "fa2": "FlashAttention-2"}  # fmt: skip
        ms = [r["sram_elements"] for r in self.by_sram]
        for sch in SCHEDULES:
            ax_m.plot(ms, [r[sch] for r in self.by_sram], styles[sch], label=labels[sch])
        ref = self.by_sram[0]["fa1"] * ms[0]
        ax_m.plot(ms, [ref / m for m in ms], "k:", label="∝ N²d²/M")
        cross = self.crossover_sram.get(self.n)
        if cross is not None:
            ax_m.axvline(cross, color="grey", lw=0.8, ls="--")
            ax_m.text(
                cross, 0.03, f" FA1 = standard at M ≈ {cross:,}",
                transform=ax_m.get_xaxis_transform(), fontsize=8, color="dimgrey",
            )  # fmt: skip
        ax_m.set(xscale="log", yscale="log", xlabel="on-chip memory M (elements)",
                 ylabel="HBM elements moved (fwd + bwd)",
                 title=f"N = {self.n:,}, d = {self.d}")  # fmt: skip
        ns = [r["n"] for r in self.by_length]
        for sch in SCHEDULES:
            ax_n.plot(ns, [r[sch] for r in self.by_length], styles[sch], label=labels[sch])
        ax_n.set(xscale="log", yscale="log", xlabel="sequence length N",
                 ylabel="HBM elements moved (fwd + bwd)",
                 title=f"M = {self.sram_elements:,} elements, d = {self.d}")  # fmt: skip
        for ax in (ax_m, ax_n):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        png = figure_png(fig)
        plt.close(fig)
        write_file(path, png)


def _fwd_bwd(**kw: Any) -> int:
    return memory_traffic(**kw).total


def _crossover(n: int, d: int) -> int | None:
    """Smallest M = 4d·Bc at which FA1 (no mask) moves no more than standard attention;
    None where no M up to one key tile of all N keys (and the size limit) does."""
    standard = _fwd_bwd(lq=n, lk=n, d=d, schedule="standard")
    lo, hi = 1, min(n, MAX_SIZE // (4 * d))  # with Bc = N a single key tile: FA1 is O(Nd)
    if hi < 1 or _fwd_bwd(lq=n, lk=n, d=d, schedule="fa1", sram_elements=4 * d * hi) > standard:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _fwd_bwd(lq=n, lk=n, d=d, schedule="fa1", sram_elements=4 * d * mid) <= standard:
            hi = mid
        else:
            lo = mid + 1
    return 4 * d * lo


def traffic_sweep(
    *,
    d: int = 64,
    n: int = 4096,
    sram_values: Sequence[int] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
    lengths: Sequence[int] = (256, 512, 1024, 2048, 4096, 8192, 16384),
    sram_elements: int = 32768,
) -> TrafficSweep:
    """Traffic of the three schedules (no mask, one head) against M at length ``n``
    and against N at ``sram_elements``; tiles from the paper's rule; crossovers in M."""
    d, n, sram_elements = (
        check_size("d", d),
        check_size("n", n),
        check_size("sram_elements", sram_elements),
    )
    if not sram_values or not lengths:
        raise ValueError("sram_values and lengths must each hold at least one value")
    by_sram = []
    for m in sram_values:
        row = {"sram_elements": check_size("sram_values", m)}
        for sch in SCHEDULES:
            row[sch] = _fwd_bwd(lq=n, lk=n, d=d, schedule=sch, sram_elements=m)
        by_sram.append(row)
    by_length = []
    for length in lengths:
        row = {"n": check_size("lengths", length)}
        for sch in SCHEDULES:
            row[sch] = _fwd_bwd(
                lq=length, lk=length, d=d, schedule=sch, sram_elements=sram_elements
            )
        by_length.append(row)
    cross = {length: _crossover(length, d) for length in sorted({n, *lengths})}
    return TrafficSweep(
        d=d, n=n, sram_elements=sram_elements, by_sram=by_sram, by_length=by_length,
        crossover_sram=cross,
    )  # fmt: skip


def _demo() -> None:
    """The seed's storage-and-work table, then FA2's memory traffic for the same problem."""
    from .masks import Causal

    print(storage_and_work(lq=5, lk=5, d=2, block_q=2, block_k=2, mask=Causal()))
    print()
    print(memory_traffic(lq=5, lk=5, d=2, block_q=2, block_k=2, mask=Causal(), schedule="fa2"))


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("accounting", _demo, command="account")
