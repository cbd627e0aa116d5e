"""Request and response models of the explorer's JSON API.

Every request model forbids unknown fields and non-finite numbers, and caps
every size, so that no request can make the server compute for long or
return an error other than a readable 422. Responses carry float64 values;
``-inf``/``+inf`` travel as the JSON strings ``"-Infinity"``/``"Infinity"``
(pydantic's ``ser_json_inf_nan="strings"``).

Limits live here once: the ``MAX_*`` constants, served to the page as
``LIMITS``. A bound that depends on another field (a block is at most the
length) is checked in the request's model validator, and only there, so that
every value out of range gets the same ``allowed: lo..hi``. Every error names
its ``kind`` and the numbers of the rule broken (``limits``, see
``ERROR_KINDS``), so that a page can state it in its own language.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from flashledger._text import cut
from flashledger.conventions import PRESETS
from flashledger.ring import chunk_bounds

__all__ = [
    "ERROR_KINDS",
    "LIMITS",
    "BackwardRequest",
    "BackwardResponse",
    "ConventionsRequest",
    "ConventionsResponse",
    "ErrorItem",
    "ErrorResponse",
    "ExamplesResponse",
    "InputError",
    "LedgerRequest",
    "LedgerResponse",
    "MaskSpec",
    "MeasureRequest",
    "MeasureResponse",
    "RingRequest",
    "RingResponse",
    "StorageRequest",
    "StorageResponse",
    "error_details",
]

MAX_BODY_BYTES = 192 * 1024
"""Largest request body accepted (bytes): room for the largest valid problem, four 64 x 16
matrices of full-precision float64 (about 25 characters each) and a 64 x 64 custom mask."""
MAX_TRACE_LEN = 64
"""Largest sequence length for traced, step-by-step runs (sections 2, 4, 6)."""
MAX_HEAD_DIM = 16
"""Largest head dimension (and value dimension) for traced runs."""
MAX_ABS_INPUT = 1e6
"""Largest magnitude of any score, matrix entry or shift."""
MAX_STORAGE_LEN = 65536
"""Largest sequence length for the closed-form storage and work ledger."""
MAX_STORAGE_TILES = 16384
"""Largest number of (query block, key block) tiles the storage ledger classifies."""
MAX_MEASURE_LEN = 1024
"""Largest sequence length timed by the measurement endpoint."""
MAX_MEASURE_DIM = 128
"""Largest head dimension timed by the measurement endpoint."""
MAX_MEASURE_TILES = 256
"""Largest number of tiles timed by the measurement endpoint."""
MAX_RING_WORLD = 8
"""Largest number of simulated ranks in the ring section."""
MAX_RING_TILES = 1024
"""Largest number of tiles per pass the ring section runs (summed over every rank)."""
MAX_MEASURE_RUNS = 25
"""Most timed runs of each function in one measurement (after one warm-up run)."""
MAX_SEED = 2**31 - 1
"""Largest dropout or data seed."""
MAX_STORAGE_DIM = 1024
"""Largest head dimension of the storage and work ledger."""

LIMITS: dict[str, int | float] = {
    "max_body_bytes": MAX_BODY_BYTES,
    "max_trace_len": MAX_TRACE_LEN,
    "max_head_dim": MAX_HEAD_DIM,
    "max_abs_input": int(MAX_ABS_INPUT),
    "max_storage_len": MAX_STORAGE_LEN,
    "max_storage_tiles": MAX_STORAGE_TILES,
    "max_measure_len": MAX_MEASURE_LEN,
    "max_measure_dim": MAX_MEASURE_DIM,
    "max_measure_tiles": MAX_MEASURE_TILES,
    "max_ring_world": MAX_RING_WORLD,
    "max_ring_tiles": MAX_RING_TILES,
    "max_measure_runs": MAX_MEASURE_RUNS,
    "max_seed": MAX_SEED,
    "max_storage_dim": MAX_STORAGE_DIM,
}

ERROR_KINDS: dict[str, str] = {
    "range": "a number outside min..max (limits: min, max, got)",
    "range_open": "a number outside (min, max], min excluded (limits: min, max, got)",
    "too_short": "a list with fewer than min entries (limits: min)",
    "too_long": "a list with more than max entries (limits: max)",
    "count": "a list whose length must equal another's (limits: expected, got)",
    "ragged": "a matrix whose rows differ in length; row counts from 1 (limits: row, got, expected)",
    "columns": "rows of the wrong length (limits: expected, got)",
    "shape": "a matrix of the wrong shape (limits: rows, cols, expected_rows, expected_cols)",
    "tiles": "too many tiles for the blocks asked (limits: tiles, max)",
    "example": "the seed page's example has a fixed shape (limits: length, d)",
    "not_integer": "not a whole number",
    "not_number": "not a number",
    "not_finite": "an infinite or NaN number",
    "not_list": "not a list",
    "not_object": "not a JSON object {...}",
    "not_bool": "not true or false",
    "not_allowed": "a value outside a fixed set (limits: allowed)",
    "pair": "softcap with dropout, which the conventions refuse (limits: conventions, allowed)",
    "mask_dense": "a custom mask without its grid, or a grid without a custom mask",
    "unknown_field": "a field the request does not have",
    "unused": "a field the other fields leave without effect (limits: needs)",
    "missing": "a required field left out",
    "invalid_json": "a body that is not JSON",
    "work": "more work than one request may ask for (limits: units, max)",
    "too_large": "a request body over the size limit (limits: max, got)",
    "timeout": "a request not sent in time (limits: seconds)",
    "host": "a Host header the explorer does not answer to (limits: allowed)",
    "busy": "the explorer's queue is full; try again (limits: retry_after)",
    "more_errors": "errors of one request past the first 20, not listed (limits: count, listed)",
    "media_type": "a body not sent as JSON (limits: got)",
    "invalid": "anything else (the message says what)",
}
"""Kinds of input error; each error item carries ``kind`` and ``limits`` (numbers or text)."""

_PYDANTIC_KINDS: dict[str, str] = {
    "int_parsing": "not_integer",
    "int_from_float": "not_integer",
    "int_type": "not_integer",
    "float_parsing": "not_number",
    "float_type": "not_number",
    "finite_number": "not_finite",
    "too_short": "too_short",
    "too_long": "too_long",
    "list_type": "not_list",
    "model_type": "not_object",
    "model_attributes_type": "not_object",
    "dict_type": "not_object",
    "bool_parsing": "not_bool",
    "bool_type": "not_bool",
    "literal_error": "not_allowed",
    "extra_forbidden": "unknown_field",
    "missing": "missing",
    "json_invalid": "invalid_json",
    "range": "range",
    "range_open": "range_open",
}


def _plain(x: Any) -> int | float | str:
    """A limit as JSON can carry it: whole floats as ints, other objects as text."""
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    if isinstance(x, int | float):
        return x
    return str(x)


def error_details(err: Mapping[str, Any]) -> dict[str, Any]:
    """``kind`` and ``limits`` of one pydantic error (an item of ``ValidationError.errors()``)."""
    kind = _PYDANTIC_KINDS.get(str(err.get("type", "")), "invalid")
    ctx = err.get("ctx") or {}
    limits: dict[str, int | float | str] = {}
    if kind in ("range", "range_open"):
        limits = {k: _plain(ctx[k]) for k in ("min", "max", "got") if k in ctx}
    elif kind == "too_short":
        limits = {"min": _plain(ctx.get("min_length", 0))}
    elif kind == "too_long":
        limits = {"max": _plain(ctx.get("max_length", 0))}
    elif kind == "not_allowed":
        limits = {"allowed": str(ctx.get("expected", ""))}
    return {"kind": kind, "limits": limits}


def _short(x: float) -> float | str:
    """A number as an error may echo it: an integer too long for a float64 (JSON readers
    take it for Infinity) as its first digits and its length."""
    if isinstance(x, int) and abs(x) > 2**53:
        digits = str(abs(x))
        sign = "-" if x < 0 else ""
        return f"{sign}{digits[:6]}... ({len(digits)} digits)"
    return x


def shown(value: Any) -> str:
    """A rejected input as the client wrote it (JSON), cut to 40 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return cut(text)


def _fmt(x: float | str) -> str:
    """A bound as people write it: ``64``, ``0.9``, ``1000000``."""
    return str(_plain(x))


@dataclass(frozen=True)
class Range:
    """``Annotated`` marker: the number must lie in ``lo..hi`` (``lo`` excluded when ``open_lo``).

    Out of range is an error of kind ``range`` (``range_open``) with ``min``, ``max``
    and ``got``; the bounds also go into the JSON schema.
    """

    lo: float
    hi: float
    open_lo: bool = False

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler.resolve_ref_schema(handler(schema))
        out["exclusiveMinimum" if self.open_lo else "minimum"] = _plain(self.lo)
        out["maximum"] = _plain(self.hi)
        return out

    def _check(self, value: Any) -> Any:
        low_ok = value > self.lo if self.open_lo else value >= self.lo
        if low_ok and value <= self.hi:
            return value
        span = f"({_fmt(self.lo)}, {_fmt(self.hi)}]" if self.open_lo else self.span
        got = _short(value)
        raise PydanticCustomError(
            "range_open" if self.open_lo else "range",
            f"{_fmt(got)} is out of range; allowed: {span}",
            {"min": self.lo, "max": self.hi, "got": got},
        )

    @property
    def span(self) -> str:
        """``lo..hi`` as the messages write it."""
        return f"{_fmt(self.lo)}..{_fmt(self.hi)}"


def check_range(field: str, value: int, lo: int, hi: int, why: str = "") -> None:
    """Raise :class:`InputError` (kind ``range``) unless ``lo <= value <= hi``; ``why``
    says where a bound comes from (``"the row has 6 scores"``)."""
    if lo <= value <= hi:
        return
    reason = f" ({why})" if why else ""
    got = _short(value)
    raise InputError(
        field,
        f"{field}: {got} is out of range{reason}; allowed: {lo}..{hi}",
        "range",
        min=lo,
        max=hi,
        got=got,
    )


def _bounds(lo: int, hi: int) -> Any:
    """JSON-schema bounds of a field whose range also depends on other fields."""
    return {"minimum": lo, "maximum": hi}


Finite = Annotated[float, Field(allow_inf_nan=False), Range(-MAX_ABS_INPUT, MAX_ABS_INPUT)]
Row = Annotated[list[Finite], Field(min_length=1, max_length=MAX_HEAD_DIM)]
Matrix = Annotated[list[Row], Field(min_length=1, max_length=MAX_TRACE_LEN)]
Num = Annotated[
    float,
    WithJsonSchema(
        {"anyOf": [{"type": "number"}, {"type": "string", "enum": ["Infinity", "-Infinity"]}]}
    ),
]
"""A float64 in a response; non-finite values serialise as ``"Infinity"``/``"-Infinity"``."""
Vec = list[Num]
Mat = list[list[Num]]


TileKind = Literal["empty", "partial", "full"]


class InputError(ValueError):
    """A request that is well-formed JSON but inconsistent; ``field`` names the culprit.

    ``kind`` is one of ``ERROR_KINDS`` and ``limits`` the numbers of the rule broken.
    """

    def __init__(
        self, field: str, message: str, kind: str = "invalid", **limits: int | float | str
    ) -> None:
        super().__init__(message)
        self.field = field
        self.kind = kind
        self.limits = {k: _plain(v) for k, v in limits.items()}

    def as_error(self) -> dict[str, Any]:
        """The error item of the API's 422 body."""
        return {
            "field": self.field,
            "path": self.field,
            "message": str(self),
            "kind": self.kind,
            "limits": self.limits,
        }


class _Request(BaseModel):
    # strict: a number is a JSON number (not "1", not true), an integer has no fraction
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _check_rectangular(name: str, rows: Sequence[Sequence[Any]]) -> int:
    """The common row length of ``rows``; a ragged row is an error that counts rows from 1,
    as a person reads the lines of a matrix (``limits.row`` too)."""
    width = len(rows[0])
    for i, row in enumerate(rows):
        if len(row) != width:
            raise InputError(
                name,
                f"{name}: row {i + 1} has {_entries(len(row))} but row 1 has {width}; "
                "every row must have the same length",
                "ragged",
                row=i + 1,
                got=len(row),
                expected=width,
            )
    return width


# ----------------------------------------------------------------------------- masks

MaskKind = Literal[
    "none", "causal", "causal_top_left", "causal_bottom_right", "sliding_window", "custom"
]


class MaskSpec(_Request):
    """Which keys each query may see.

    ``causal`` follows the conventions preset's alignment, ``causal_top_left`` and
    ``causal_bottom_right`` fix it; ``sliding_window`` keeps keys
    ``c - left <= j <= c + right`` (-1 = unbounded) around the diagonal ``c`` of
    ``align`` (None: the preset's alignment); ``custom`` takes ``dense``, an
    ``(Lq, Lk)`` grid of booleans (True = attend). With any other kind ``dense`` is
    absent, null or empty (``[]``: no grid); a grid there would be ignored, so it is refused.
    A kind alone may be given as a string: ``"causal"`` is ``{"kind": "causal"}``.
    """

    kind: MaskKind = "none"
    left: Annotated[int, Range(-1, MAX_STORAGE_LEN)] = -1
    right: Annotated[int, Range(-1, MAX_STORAGE_LEN)] = 0
    align: Literal["top_left", "bottom_right"] | None = None
    dense: list[Annotated[list[bool], Field(max_length=MAX_TRACE_LEN)]] | None = Field(
        default=None,
        max_length=MAX_TRACE_LEN,
        description="kind 'custom' only: the Lq x Lk grid, true = attend; "
        "null or [] with any other kind",
    )

    @model_validator(mode="before")
    @classmethod
    def _kind_alone(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _dense_only_for_custom(self) -> MaskSpec:
        if self.kind == "custom" and self.dense is None:
            raise InputError(
                "mask",
                "mask: kind 'custom' needs 'dense', an Lq x Lk grid of true/false",
                "mask_dense",
            )
        if self.kind == "custom" and self.dense:
            _check_rectangular("mask", self.dense)  # before any shape: the rows disagree
        if self.kind != "custom" and self.dense:
            raise InputError(
                "mask",
                f"mask: 'dense' is only used with kind 'custom', not {self.kind!r} "
                "(leave it out, null or [])",
                "mask_dense",
            )
        if self.kind != "custom":
            self.dense = None  # an empty grid is no grid
        unused = [
            name
            for name in ("left", "right", "align")
            if name in self.model_fields_set and getattr(self, name) is not None
        ]
        if self.kind != "sliding_window" and unused:
            hint = (
                "; a causal mask aligned bottom-right is kind 'causal_bottom_right' (top-left: "
                "'causal_top_left', the preset's: 'causal')"
                if "align" in unused and self.kind.startswith("causal")
                else ""
            )
            one = len(unused) == 1
            raise InputError(
                "mask",
                f"mask: {' and '.join(repr(n) for n in unused)} "
                f"{'applies' if one else 'apply'} only to kind 'sliding_window', not "
                f"{self.kind!r}; leave {'it' if one else 'them'} out{hint}",
                "unused",
                needs="kind 'sliding_window'",
            )
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The object, or its kind alone as a string (``"causal"``), as the API reads it."""
        obj = handler(schema)
        kinds = {"type": "string", "enum": list(get_args(MaskKind)), "title": "MaskKind"}
        return {"anyOf": [obj, kinds], "description": obj.get("description", "")}

    def check_shape(self, lq: int, lk: int) -> None:
        """Raise :class:`InputError` unless a custom grid is ``(lq, lk)`` (its rows of one
        length: checked when it was read)."""
        if self.dense is None:
            return
        if len(self.dense) != lq or any(len(row) != lk for row in self.dense):
            rows, cols = len(self.dense), len(self.dense[0]) if self.dense else 0
            raise InputError(
                "mask",
                f"mask: the custom grid is {rows} x {cols}; it must be {lq} x {lk} (Lq x Lk)",
                "shape",
                rows=rows,
                cols=cols,
                expected_rows=lq,
                expected_cols=lk,
            )


# ----------------------------------------------------------------------------- section 2


class LedgerRequest(_Request):
    """One query row: scores ``s_j`` (n,), values ``v_j`` (n, d_v), key block size, shift."""

    scores: list[Finite] = Field(min_length=1, max_length=MAX_TRACE_LEN)
    values: Matrix
    block_size: int = Field(default=2, json_schema_extra=_bounds(1, MAX_TRACE_LEN))
    shift: Finite = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> LedgerRequest:
        n = len(self.scores)
        if "block_size" not in self.model_fields_set:
            self.block_size = min(self.block_size, n)  # the default 2, or 1 for one score
        check_range("block_size", self.block_size, 1, n, f"the row has {n} scores")
        if len(self.values) != n:
            raise InputError(
                "values",
                f"values: {len(self.values)} value vectors for {n} scores; "
                "give one value vector per score",
                "count",
                expected=n,
                got=len(self.values),
            )
        _check_rectangular("values", self.values)
        return self


class LedgerStep(_Response):
    index: int = Field(description="block number, 0-based")
    start: int = Field(description="first position of the block")
    stop: int = Field(description="one past the last position of the block")
    scores: Vec
    block_max: Num
    m_before: Num
    m: Num = Field(description="running max after the block")
    alpha: Num = Field(
        description="scale of the old state, exp(m_before - m); 0 for the first block"
    )
    ell: Num
    acc: Vec
    o: Vec = Field(description="prefix output acc / ell")
    max_diff: Num = Field(description="max |o - full-row output|")
    weights: Vec = Field(
        description="exp(s_j - m) of every position read so far: the terms ell sums (stop,)"
    )


class PerBlockAverage(_Response):
    softmax: list[Vec] = Field(description="softmax taken inside each block")
    outputs: list[Vec] = Field(description="each block's own weighted average of values")
    average: Vec = Field(description="mean of the block outputs")
    max_diff: Num = Field(description="max |average - full-row output|")


class LedgerResponse(_Response):
    n: int
    d_v: int
    block_size: int
    shift: Num
    scores: Vec = Field(description="scores after the shift")
    values: Mat
    blocks: list[list[int]] = Field(description="[start, stop) of each block")
    p: Vec = Field(description="full-row probabilities")
    o: Vec = Field(description="full-row reference output")
    lse: Num
    steps: list[LedgerStep]
    per_block: PerBlockAverage


# ----------------------------------------------------------------------------- section 4


class AttentionProblem(_Request):
    """Q (Lq, d), K (Lk, d), V (Lk, d_v) and the options of the score and mask."""

    q: Matrix
    k: Matrix
    v: Matrix
    mask: MaskSpec = Field(default_factory=MaskSpec, json_schema_extra={"default": "none"})
    conventions: str = Field(default="seed", json_schema_extra={"enum": list(PRESETS)})
    dropout_p: Annotated[float, Field(allow_inf_nan=False), Range(0.0, 0.9)] = 0.0
    seed: Annotated[int, Range(0, MAX_SEED)] = 0
    softcap: Annotated[float, Field(allow_inf_nan=False), Range(0.0, 1e4, open_lo=True)] | None = (
        None
    )
    alibi: bool = False
    alibi_slope: Annotated[float, Field(allow_inf_nan=False), Range(0.0, 16.0, open_lo=True)] = 0.5

    @field_validator("conventions", mode="before")
    @classmethod
    def _known_preset(cls, value: Any) -> Any:
        if not isinstance(value, str) or value not in PRESETS:
            got = repr(cut(value)) if isinstance(value, str) else f"{shown(value)} (not a string)"
            raise InputError(
                "conventions",
                f"conventions: unknown preset {got}; allowed: {', '.join(PRESETS)}",
                "not_allowed",
                allowed=", ".join(PRESETS),
            )
        return value

    @model_validator(mode="after")
    def _no_unused(self) -> AttentionProblem:
        """``seed`` picks dropout's keep mask and ``alibi_slope`` is ALiBi's: each given
        without what it serves would be ignored, so it is refused."""
        if "seed" in self.model_fields_set and self.dropout_p == 0:
            raise InputError(
                "seed",
                "seed: it picks dropout's keep mask, and dropout_p is 0; leave seed out, or set "
                "dropout_p above 0",
                "unused",
                needs="dropout_p > 0",
            )
        if "alibi_slope" in self.model_fields_set and not self.alibi:
            raise InputError(
                "alibi_slope",
                "alibi_slope: it is ALiBi's slope, and alibi is off; leave alibi_slope out, or "
                "set alibi to true",
                "unused",
                needs="alibi: true",
            )
        return self

    def check_pair(self) -> None:
        """Raise :class:`InputError` (kind ``pair``, on ``softcap``) when the conventions
        refuse softcap together with dropout, as their real kernel does."""
        conv = PRESETS[self.conventions]
        if self.softcap is None or self.dropout_p == 0 or conv.softcap_with_dropout:
            return
        takes = ", ".join(n for n, c in PRESETS.items() if c.softcap_with_dropout)
        raise InputError(
            "softcap",
            f"softcap: conventions {conv.name!r} take no softcap together with dropout (the "
            f"real kernel has no softcapped dropout path); turn one of them off, or choose "
            f"conventions that take both: {takes}",
            "pair",
            conventions=conv.name,
            allowed=takes,
        )

    def check_problem(self) -> None:
        """Raise :class:`InputError` on inconsistent shapes."""
        d = _check_rectangular("q", self.q)
        dk = _check_rectangular("k", self.k)
        _check_rectangular("v", self.v)
        if dk != d:
            raise InputError(
                "k",
                f"k: rows have {dk} entries but q's have {d}; q and k share d",
                "columns",
                expected=d,
                got=dk,
            )
        if len(self.v) != len(self.k):
            raise InputError(
                "v",
                f"v: {len(self.v)} rows but k has {len(self.k)}; one value row per key",
                "count",
                expected=len(self.k),
                got=len(self.v),
            )
        self.mask.check_shape(len(self.q), len(self.k))


class BackwardRequest(AttentionProblem):
    """An attention problem plus the upstream gradient G (Lq, d_v) and the tile sizes."""

    g: Matrix
    block_q: int = Field(default=2, json_schema_extra=_bounds(1, MAX_TRACE_LEN))
    block_k: int = Field(default=2, json_schema_extra=_bounds(1, MAX_TRACE_LEN))

    @model_validator(mode="after")
    def _consistent(self) -> BackwardRequest:
        self.check_problem()
        self.check_pair()
        dv = len(self.v[0])
        if len(self.g) != len(self.q) or _check_rectangular("g", self.g) != dv:
            raise InputError(
                "g",
                f"g: shape {len(self.g)} x {len(self.g[0])}; it must be Lq x d_v = "
                f"{len(self.q)} x {dv} (one gradient row per query, like O)",
                "shape",
                rows=len(self.g),
                cols=len(self.g[0]),
                expected_rows=len(self.q),
                expected_cols=dv,
            )
        _check_blocks(self, len(self.q), len(self.k))
        return self


def _check_blocks(req: Any, lq: int, lk: int) -> None:
    """The request's tiles of ``block_q x block_k`` fit ``Lq x Lk``: each block is ``1..L``.
    A block left out takes its default, 2, or the length where that is 1."""
    if "block_q" not in req.model_fields_set:
        req.block_q = min(req.block_q, lq)
    if "block_k" not in req.model_fields_set:
        req.block_k = min(req.block_k, lk)
    check_range("block_q", req.block_q, 1, lq, f"Lq is {lq}")
    check_range("block_k", req.block_k, 1, lk, f"Lk is {lk}")


class _TileStep(_Response):
    """Where a traced tile step stands: its tiles, their rows, partial or full."""

    index: int
    q_tile: int
    k_tile: int
    q_range: list[int] = Field(description="[start, stop) of the query rows")
    k_range: list[int] = Field(description="[start, stop) of the key rows")
    kind: Literal["partial", "full"]


class BackwardStep(_TileStep):
    p: Mat = Field(description="rebuilt probabilities exp(S - lse), (rows, cols)")
    ds: Mat = Field(description="dS of the tile, the gradient of its final scores, (rows, cols)")
    ds_qk: Mat | None = Field(
        description="with a softcap c: dS·(1 - t²), t = tanh(scale·QKᵀ/c), the gradient of the "
        "uncapped scores scale·QKᵀ (dq = ds_qk @ K · scale), (rows, cols); null without softcap"
    )
    dq: Mat = Field(description="contribution to dQ rows, (rows, d)")
    dk: Mat = Field(description="contribution to dK rows, (cols, d)")
    dv: Mat = Field(description="contribution to dV rows, (cols, d_v)")


class Gradients(_Response):
    dq: Mat
    dk: Mat
    dv: Mat


class AutogradCheck(_Response):
    max_diff: Num = Field(description="max |blocked - autograd| over dQ, dK, dV")
    tolerance: Num
    ok: bool


class ForwardStep(_TileStep):
    """One traced forward tile: the rows of the query tile before and after it."""

    s: Mat = Field(description="scores of the tile, masked entries -inf, (rows, cols)")
    p: Mat = Field(description="exp(s - m) of the tile against the running max after it")
    block_max: Vec = Field(description="row max of s, (rows,)")
    m_before: Vec = Field(description="running max before the tile, (rows,)")
    m: Vec = Field(description="running max after the tile, (rows,)")
    alpha: Vec = Field(description="exp(m_before - m), 0 for an empty state, (rows,)")
    ell_before: Vec = Field(description="running denominator before the tile, (rows,)")
    ell: Vec = Field(description="running denominator after the tile, (rows,)")
    o: Mat = Field(description="output of the keys read so far, acc / ell, (rows, d_v)")


class BackwardResponse(_Response):
    lq: int
    lk: int
    d: int
    d_v: int
    scale: Num
    conventions: str
    o: Mat = Field(description="blocked forward output")
    lse: Vec = Field(description="saved log-sum-exp per row")
    D: Vec = Field(description="rowsum(G * O)")
    ref_o: Mat
    ref_lse: Vec
    forward_max_diff: Num
    p: Mat = Field(description="reference probabilities (masked = 0, before dropout)")
    mask: list[list[bool]] = Field(description="dense mask, True = attend")
    keep: list[list[bool]] | None = Field(description="dropout keep mask, or null without dropout")
    fully_masked_rows: list[int]
    q_tiles: list[list[int]]
    k_tiles: list[list[int]]
    tile_kinds: list[list[TileKind]]
    steps: list[BackwardStep]
    grads: Gradients = Field(description="blocked backward result")
    reference: Gradients = Field(description="closed-form dense backward")
    grad_max_diff: Num
    tolerance: Num = Field(
        description="rtol * max(1, max |grad|), rtol 1e-10 or, with large scores, what "
        "their float64 rounding allows: the bound the page checks"
    )
    autograd: AutogradCheck
    counters: dict[str, int] = Field(description="backward ledger counters")
    forward_counters: dict[str, int]
    forward_steps: list[ForwardStep] = Field(
        description="the forward pass traced tile by tile (the same loop, with records)"
    )
    forward_o: Mat = Field(description="output of the traced forward pass")
    forward_steps_max_diff: Num = Field(
        description="max |traced forward O - reference O| (the stepped forward's final check)"
    )


# ----------------------------------------------------------------------------- section 5

StorageDtype = Literal["float64", "float32", "float16", "bfloat16"]


class StorageRequest(_Request):
    """Sizes of one attention problem for the storage and work ledger.

    ``d_v`` is the width of V (null: ``d``). A ``custom`` mask (its ``dense`` grid
    ``Lq x Lk``, so at most the traced problems' size) books exactly the grid of a
    problem stepped in section 04.
    """

    lq: Annotated[int, Range(1, MAX_STORAGE_LEN)] = 5
    lk: Annotated[int, Range(1, MAX_STORAGE_LEN)] = 5
    d: Annotated[int, Range(1, MAX_STORAGE_DIM)] = 2
    d_v: Annotated[int, Range(1, MAX_STORAGE_DIM)] | None = None
    block_q: int = Field(default=2, json_schema_extra=_bounds(1, MAX_STORAGE_LEN))
    block_k: int = Field(default=2, json_schema_extra=_bounds(1, MAX_STORAGE_LEN))
    mask: MaskSpec = Field(
        default_factory=lambda: MaskSpec(kind="causal_top_left"),
        json_schema_extra={"default": "causal_top_left"},
    )
    dtype: StorageDtype = "float64"

    @model_validator(mode="after")
    def _consistent(self) -> StorageRequest:
        _check_blocks(self, self.lq, self.lk)
        tiles = -(-self.lq // self.block_q) * -(-self.lk // self.block_k)
        if tiles > MAX_STORAGE_TILES:
            raise InputError(
                "block_q",
                f"block_q, block_k: {tiles} tiles; at most {MAX_STORAGE_TILES} allowed "
                "(use larger blocks)",
                "tiles",
                tiles=tiles,
                max=MAX_STORAGE_TILES,
            )
        self.mask.check_shape(self.lq, self.lk)
        return self


class StoragePoint(_Response):
    length: int = Field(description="Lq = Lk = length")
    full_p: int = Field(description="elements of P kept by the full-P path (length^2)")
    lse: int = Field(description="elements of the LSE kept instead (length)")
    common: int = Field(description="elements of Q, K, V, O kept by both paths")


class StorageResponse(_Response):
    ledger: dict[str, Any] = Field(description="flashledger.accounting.storage_and_work(...)")
    sweep: list[StoragePoint] = Field(
        description="storage of both paths against the length, at this d and d_v, one head, no mask"
    )
    traffic: dict[str, dict[str, Any]] = Field(
        description="memory_traffic(...) of each schedule: standard, fa1, fa2"
    )
    tile_kinds: list[list[TileKind]] | None = Field(
        description="tile classes when the grid is at most 32 x 32, else null"
    )


# ----------------------------------------------------------------------------- section 6


def _without_conventions(schema: dict[str, Any]) -> None:
    """The schema of a request that runs every preset: no ``conventions`` field to give."""
    schema.get("properties", {}).pop("conventions", None)


class ConventionsRequest(AttentionProblem):
    """An attention problem evaluated under every conventions preset, in tiles."""

    model_config = ConfigDict(json_schema_extra=_without_conventions)

    block_q: int = Field(default=2, json_schema_extra=_bounds(1, MAX_TRACE_LEN))
    block_k: int = Field(default=2, json_schema_extra=_bounds(1, MAX_TRACE_LEN))

    @model_validator(mode="after")
    def _consistent(self) -> ConventionsRequest:
        if "conventions" in self.model_fields_set:
            raise InputError(
                "conventions",
                "conventions: this request runs every preset; leave the field out",
                "unknown_field",
            )
        self.check_problem()
        _check_blocks(self, len(self.q), len(self.k))
        return self


class ConventionRow(_Response):
    row: int
    fully_masked: bool
    o: Vec
    lse: Num
    ref_lse: Num
    max_diff: Num = Field(description="max |blocked O - reference O| over the row")


class ConventionResult(_Response):
    name: str
    description: str
    masked_row_lse: Num
    causal_align: str
    dropout_keep: str
    lse_differentiable: bool
    rows: list[ConventionRow] = Field(description="one per query row; none where refused")
    refused: str | None = Field(
        default=None,
        description="why the preset refuses the problem (softcap with dropout), or null",
    )


class ConventionsResponse(_Response):
    presets: list[ConventionResult]


# ----------------------------------------------------------------------------- section 3


class MeasureRequest(_Request):
    """Shape of a timed run of the blocked loop against the dense reference."""

    length: Annotated[int, Range(1, MAX_MEASURE_LEN)] = 128
    d: Annotated[int, Range(1, MAX_MEASURE_DIM)] = 16
    block: int = Field(default=32, json_schema_extra=_bounds(1, MAX_MEASURE_LEN))
    causal: bool = True
    dtype: Literal["float64", "float32"] = "float64"
    repeats: Annotated[int, Range(1, MAX_MEASURE_RUNS)] = Field(
        default=9,
        description="timed runs of each function after one warm-up run (fewer when each run "
        "is long: the runs of one function stop after about a second, never below 3)",
    )

    def smallest_block(self) -> int:
        """The smallest block whose ``(L / block)^2`` tiles are at most ``MAX_MEASURE_TILES``."""
        per_side = math.isqrt(MAX_MEASURE_TILES)
        return -(-self.length // per_side)

    @model_validator(mode="after")
    def _consistent(self) -> MeasureRequest:
        lo = self.smallest_block()
        check_range(
            "block",
            self.block,
            lo,
            self.length,
            f"at most {MAX_MEASURE_TILES} tiles are timed and a block is at most the length",
        )
        return self


class MeasureResponse(_Response):
    device: str
    threads: int
    torch_version: str
    length: int
    d: int
    block: int
    causal: bool
    dtype: str
    repeats: int = Field(description="timed runs asked for, after one warm-up run")
    times_ms: dict[str, Num] = Field(description="median run time of each function (ms)")
    runs: dict[str, int] = Field(description="timed runs of each function (after its warm-up)")
    min_ms: dict[str, Num] = Field(description="fastest timed run of each function (ms)")
    max_ms: dict[str, Num] = Field(description="slowest timed run of each function (ms)")
    forward_max_diff: Num
    grad_max_diff: Num
    full_p_bytes: int
    lse_bytes: int
    counters: dict[str, int]


# ----------------------------------------------------------------------------- examples


class ExamplesResponse(_Response):
    ledger: dict[str, list[float] | list[list[float]] | int | float]
    backward: dict[str, list[list[float]] | int | str]
    presets: list[dict[str, str | float | bool]]
    limits: dict[str, int | float]


# ----------------------------------------------------------------------------- section 7

RingLayout = Literal["contiguous", "zigzag"]
RingPass = Literal["forward", "backward"]


class RingRequest(_Request):
    """One ring-attention problem for the in-process twin: ranks, layout, sizes, mask, inputs.

    Q, K, V and G are ``(length, d)`` float64: random normal draws from ``seed``, or, with
    ``data = "example"``, the seed page's five positions (``length = 5``, ``d = 2``).
    Tiles inside each (query chunk, key chunk) pair are ``block x block``.
    """

    world_size: Annotated[int, Range(1, MAX_RING_WORLD)] = 4
    layout: RingLayout = "zigzag"
    length: int = Field(default=16, json_schema_extra=_bounds(1, MAX_TRACE_LEN))
    d: Annotated[int, Range(1, MAX_HEAD_DIM)] = 4
    block: int = Field(default=4, json_schema_extra=_bounds(1, MAX_TRACE_LEN))
    mask: MaskSpec = Field(
        default_factory=lambda: MaskSpec(kind="causal"), json_schema_extra={"default": "causal"}
    )
    data: Literal["random", "example"] = "random"
    seed: Annotated[int, Range(0, MAX_SEED)] = 0

    def chunks(self) -> int:
        """Chunks the sequence is cut into: ``W`` (contiguous) or ``2W`` (zigzag)."""
        return self.world_size if self.layout == "contiguous" else 2 * self.world_size

    def tiles_per_pass(self, block: int | None = None) -> int:
        """Tiles of every (query chunk, key chunk) pair of one pass, over all ranks."""
        b = self.block if block is None else block
        bounds = chunk_bounds(self.length, self.world_size, self.layout)
        along = sum(-(-(hi - lo) // b) for lo, hi in pairwise(bounds))
        return along * along  # query chunks x key chunks, Lq = Lk

    @model_validator(mode="after")
    def _consistent(self) -> RingRequest:
        if self.data == "example" and "seed" in self.model_fields_set:
            raise InputError(
                "seed",
                "seed: it draws the random data, and data is 'example' (the seed page's fixed "
                "positions); leave seed out, or use random data",
                "unused",
                needs="data: 'random'",
            )
        if self.data == "example" and (self.length, self.d) != (5, 2):
            raise InputError(
                "data",
                f"data: the seed page's example has length 5 and d 2, not length "
                f"{self.length} and d {self.d}; set both, or use random data",
                "example",
                length=5,
                d=2,
            )
        n = self.chunks()
        check_range(
            "length",
            self.length,
            n,
            MAX_TRACE_LEN,
            f"the {self.layout} layout on {self.world_size} rank(s) cuts the sequence into "
            f"{n} chunks of at least one position",
        )
        if self.mask.kind == "custom":
            raise InputError(
                "mask",
                "mask: the ring section takes none, causal or sliding_window, not custom",
                "not_allowed",
                allowed="none, causal, sliding_window",
            )
        lo = next(b for b in range(1, self.length + 1) if self.tiles_per_pass(b) <= MAX_RING_TILES)
        if self.block >= 1 and self.tiles_per_pass(max(self.block, 1)) > MAX_RING_TILES:
            tiles = self.tiles_per_pass()
            raise InputError(
                "block",
                f"block: {tiles} tiles per pass; at most {MAX_RING_TILES} allowed "
                f"(use a larger block or a shorter length); allowed: {lo}..{self.length}",
                "range",
                min=lo,
                max=self.length,
                got=self.block,
            )
        check_range("block", self.block, lo, self.length, "a block is at most the length")
        return self


class RingRank(_Response):
    rank: int
    chunks: list[int] = Field(description="chunk numbers held, in shard order")
    rows: list[int] = Field(description="global query (and key) positions held, in shard order")


class RingHop(_Response):
    pass_name: RingPass
    step: int = Field(description="ring step during which it was sent, 0-based")
    sender: int
    receiver: int
    payload: Literal["kv", "dkv"] = Field(description="a K/V shard or dK/dV accumulators")
    shard: int = Field(description="the rank that owns the shard carried")
    nbytes: int


class RingComm(_Response):
    pass_name: RingPass
    payload: Literal["kv", "dkv"]
    hops: int
    nbytes: int
    closed_form_hops: int
    closed_form_nbytes: int
    ok: bool


class RingWork(_Response):
    rank: int
    pairs_run: int
    pairs_skipped: int
    tiles_run: int
    tiles_skipped: int
    qk_dots_visible: int
    qk_dots_computed: int


class RingGridCell(_Response):
    shard: int = Field(description="K/V shard held during the step")
    tiles_run: int
    tiles_skipped: int


class RingPassSummary(_Response):
    work: list[RingWork] = Field(description="per rank, whole pass")
    grid: list[list[RingGridCell]] = Field(description="grid[rank][step]")
    balance: Num = Field(description="max / mean tiles run over ranks (1 = balanced)")
    critical_path: int = Field(description="sum over steps of the busiest rank's tiles")
    ideal: Num = Field(description="tiles run / world size")


class RingForwardRank(_Response):
    rank: int
    shard: int = Field(description="K/V shard held during the step")
    tiles_run: int = Field(description="so far")
    tiles_skipped: int = Field(description="so far")
    lse: Vec = Field(description="running LSE of the rank's rows after the step (-inf: no key)")
    o_max_diff: Num = Field(description="max |O so far - final O| over the rank's rows")


class RingForwardStep(_Response):
    step: int = Field(description="ring steps done (0 = before the first)")
    ranks: list[RingForwardRank]
    max_diff: Num = Field(description="max |O so far - dense oracle O| over every row")


class RingBackwardRank(_Response):
    rank: int
    shard: int = Field(description="K/V shard held during the step")
    tiles_run: int = Field(description="so far")
    tiles_skipped: int = Field(description="so far")
    dq_max_diff: Num = Field(description="max |dQ so far - final dQ| over the rank's rows")
    acc_shard: int | None = Field(
        description="shard whose dK/dV accumulators the rank holds after the step's hops "
        "(as the previous rank recorded passing them on); None before step 0"
    )
    acc_count: int = Field(description="ranks whose contributions the accumulators hold")
    acc_max_diff: Num = Field(description="max |accumulated dK, dV - final| of that shard")


class RingBackwardStep(_Response):
    step: int
    ranks: list[RingBackwardRank]
    max_diff: Num = Field(description="max |dQ, dK, dV so far - dense oracle| over every row")


class RingCheck(_Response):
    name: Literal["o", "lse", "dq", "dk", "dv"]
    max_diff: Num
    index: list[int] = Field(description="where the largest difference is")
    ok: bool


class RingResponse(_Response):
    world_size: int
    layout: RingLayout
    length: int
    d: int
    block: int
    bounds: list[int] = Field(description="chunk boundaries, n + 1 positions")
    owners: list[int] = Field(description="owner rank of each chunk")
    ranks: list[RingRank]
    forward: list[RingForwardStep] = Field(
        description="state after 0..W ring steps, as each rank recorded it (RankState)"
    )
    backward: list[RingBackwardStep]
    lse: Vec = Field(description="final LSE of every row (global order)")
    hops: list[RingHop]
    comm: list[RingComm]
    comm_match: bool
    passes: dict[str, RingPassSummary]
    checks: list[RingCheck] = Field(description="ring result against the float64 dense oracle")
    tolerance: Num
    final_state_max_diff: Num = Field(
        description="max |each rank's state recorded at the end of its last ring step - the "
        "ring's result| over O, LSE, dQ and the dK/dV it passes on to their owner (0: the "
        "per-step states are the loop's own)"
    )


# ----------------------------------------------------------------------------- errors


class ErrorItem(BaseModel):
    """One problem with a request."""

    model_config = ConfigDict(extra="allow")

    field: str = Field(description="the top-level request field to blame, '' when none")
    path: str = Field(description="where in the body, e.g. 'q[3][1]'; '' when none")
    message: str = Field(
        description="one line naming the field, what was wrong and what is allowed"
    )
    kind: str = Field(
        description="the rule broken, one of: " + ", ".join(ERROR_KINDS),
        json_schema_extra={"enum": list(ERROR_KINDS)},
    )
    limits: dict[str, int | float | str] = Field(description="the numbers of that rule")


class ErrorResponse(BaseModel):
    """The body of every error answer (400, 408, 413, 422, 503)."""

    detail: str = Field(description="every message of ``errors``, on one line")
    errors: list[ErrorItem]
