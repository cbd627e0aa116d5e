"""Request and response models of the explorer's JSON API.

Every request model forbids unknown fields and non-finite numbers, and caps
every size, so that no request can make the server compute for long or
return an error other than a readable 422. Responses carry float64 values;
``-inf``/``+inf`` travel as the JSON strings ``"-Infinity"``/``"Infinity"``
(pydantic's ``ser_json_inf_nan="strings"``).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from flashledger.conventions import PRESETS
from flashledger.ring import chunk_bounds

__all__ = [
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

LIMITS: dict[str, float] = {
    "max_body_bytes": MAX_BODY_BYTES,
    "max_trace_len": MAX_TRACE_LEN,
    "max_head_dim": MAX_HEAD_DIM,
    "max_abs_input": MAX_ABS_INPUT,
    "max_storage_len": MAX_STORAGE_LEN,
    "max_storage_tiles": MAX_STORAGE_TILES,
    "max_measure_len": MAX_MEASURE_LEN,
    "max_measure_dim": MAX_MEASURE_DIM,
    "max_measure_tiles": MAX_MEASURE_TILES,
    "max_ring_world": MAX_RING_WORLD,
    "max_ring_tiles": MAX_RING_TILES,
}


Finite = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_ABS_INPUT, le=MAX_ABS_INPUT)]
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
    """A request that is well-formed JSON but inconsistent; ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Request(BaseModel):
    # strict: a number is a JSON number (not "1", not true), an integer has no fraction
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")


def _check_rectangular(name: str, rows: list[list[float]]) -> int:
    width = len(rows[0])
    for i, row in enumerate(rows):
        if len(row) != width:
            raise InputError(
                name,
                f"{name}: row {i} has {len(row)} entries but row 0 has {width}; "
                "every row must have the same length",
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
    """

    kind: MaskKind = "none"
    left: int = Field(default=-1, ge=-1, le=MAX_STORAGE_LEN)
    right: int = Field(default=0, ge=-1, le=MAX_STORAGE_LEN)
    align: Literal["top_left", "bottom_right"] | None = None
    dense: list[list[bool]] | None = Field(
        default=None,
        max_length=MAX_TRACE_LEN,
        description="kind 'custom' only: the Lq x Lk grid, true = attend; "
        "null or [] with any other kind",
    )

    @model_validator(mode="after")
    def _dense_only_for_custom(self) -> MaskSpec:
        if self.kind == "custom" and self.dense is None:
            raise InputError(
                "mask", "mask: kind 'custom' needs 'dense', an Lq x Lk grid of true/false"
            )
        if self.kind != "custom" and self.dense:
            raise InputError(
                "mask",
                f"mask: 'dense' is only used with kind 'custom', not {self.kind!r} "
                "(leave it out, null or [])",
            )
        if self.kind != "custom":
            self.dense = None  # an empty grid is no grid
        return self

    def check_shape(self, lq: int, lk: int) -> None:
        """Raise :class:`InputError` unless a custom grid is ``(lq, lk)``."""
        if self.dense is None:
            return
        if len(self.dense) != lq or any(len(row) != lk for row in self.dense):
            got = f"{len(self.dense)} x {len(self.dense[0]) if self.dense else 0}"
            raise InputError(
                "mask", f"mask: the custom grid is {got}; it must be {lq} x {lk} (Lq x Lk)"
            )


# ----------------------------------------------------------------------------- section 2


class LedgerRequest(_Request):
    """One query row: scores ``s_j`` (n,), values ``v_j`` (n, d_v), key block size, shift."""

    scores: list[Finite] = Field(min_length=1, max_length=MAX_TRACE_LEN)
    values: Matrix
    block_size: int = Field(default=2, ge=1, le=MAX_TRACE_LEN)
    shift: Finite = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> LedgerRequest:
        n = len(self.scores)
        if self.block_size > n:
            raise InputError(
                "block_size",
                f"block_size: {self.block_size} is larger than the row ({n} scores); "
                f"allowed: 1..{n}",
            )
        if len(self.values) != n:
            raise InputError(
                "values",
                f"values: {len(self.values)} value vectors for {n} scores; "
                "give one value vector per score",
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
    mask: MaskSpec = Field(default_factory=MaskSpec)
    conventions: str = Field(default="seed", json_schema_extra={"enum": list(PRESETS)})
    dropout_p: float = Field(default=0.0, ge=0.0, le=0.9, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    softcap: float | None = Field(default=None, gt=0.0, le=1e4, allow_inf_nan=False)
    alibi: bool = False
    alibi_slope: float = Field(default=0.5, gt=0.0, le=16.0, allow_inf_nan=False)

    @field_validator("conventions")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        if value not in PRESETS:
            raise InputError(
                "conventions",
                f"conventions: unknown preset {value!r}; allowed: {', '.join(PRESETS)}",
            )
        return value

    def check_problem(self) -> None:
        """Raise :class:`InputError` on inconsistent shapes."""
        d = _check_rectangular("q", self.q)
        dk = _check_rectangular("k", self.k)
        _check_rectangular("v", self.v)
        if dk != d:
            raise InputError("k", f"k: rows have {dk} entries but q's have {d}; q and k share d")
        if len(self.v) != len(self.k):
            raise InputError(
                "v", f"v: {len(self.v)} rows but k has {len(self.k)}; one value row per key"
            )
        self.mask.check_shape(len(self.q), len(self.k))


class BackwardRequest(AttentionProblem):
    """An attention problem plus the upstream gradient G (Lq, d_v) and the tile sizes."""

    g: Matrix
    block_q: int = Field(default=2, ge=1, le=MAX_TRACE_LEN)
    block_k: int = Field(default=2, ge=1, le=MAX_TRACE_LEN)

    @model_validator(mode="after")
    def _consistent(self) -> BackwardRequest:
        self.check_problem()
        dv = len(self.v[0])
        if len(self.g) != len(self.q) or _check_rectangular("g", self.g) != dv:
            raise InputError(
                "g",
                f"g: shape {len(self.g)} x {len(self.g[0])}; it must be Lq x d_v = "
                f"{len(self.q)} x {dv} (one gradient row per query, like O)",
            )
        if self.block_q > len(self.q):
            raise InputError(
                "block_q", f"block_q: {self.block_q} is larger than Lq; allowed: 1..{len(self.q)}"
            )
        if self.block_k > len(self.k):
            raise InputError(
                "block_k", f"block_k: {self.block_k} is larger than Lk; allowed: 1..{len(self.k)}"
            )
        return self


class BackwardStep(_Response):
    index: int
    q_tile: int
    k_tile: int
    q_range: list[int] = Field(description="[start, stop) of the query rows")
    k_range: list[int] = Field(description="[start, stop) of the key rows")
    kind: Literal["partial", "full"]
    p: Mat = Field(description="rebuilt probabilities exp(S - lse), (rows, cols)")
    ds: Mat = Field(description="dS of the tile, (rows, cols)")
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
    tolerance: Num = Field(description="1e-10 * max(1, max |grad|): the bound the page checks")
    autograd: AutogradCheck
    counters: dict[str, int] = Field(description="backward ledger counters")
    forward_counters: dict[str, int]


# ----------------------------------------------------------------------------- section 5

StorageDtype = Literal["float64", "float32", "float16", "bfloat16"]


class StorageRequest(_Request):
    """Sizes of one attention problem for the storage and work ledger."""

    lq: int = Field(default=5, ge=1, le=MAX_STORAGE_LEN)
    lk: int = Field(default=5, ge=1, le=MAX_STORAGE_LEN)
    d: int = Field(default=2, ge=1, le=1024)
    block_q: int = Field(default=2, ge=1, le=MAX_STORAGE_LEN)
    block_k: int = Field(default=2, ge=1, le=MAX_STORAGE_LEN)
    mask: MaskSpec = Field(default_factory=lambda: MaskSpec(kind="causal_top_left"))
    dtype: StorageDtype = "float64"

    @model_validator(mode="after")
    def _consistent(self) -> StorageRequest:
        if self.block_q > self.lq:
            raise InputError(
                "block_q", f"block_q: {self.block_q} is larger than Lq; allowed: 1..{self.lq}"
            )
        if self.block_k > self.lk:
            raise InputError(
                "block_k", f"block_k: {self.block_k} is larger than Lk; allowed: 1..{self.lk}"
            )
        tiles = -(-self.lq // self.block_q) * -(-self.lk // self.block_k)
        if tiles > MAX_STORAGE_TILES:
            raise InputError(
                "block_q",
                f"block_q, block_k: {tiles} tiles; at most {MAX_STORAGE_TILES} allowed "
                "(use larger blocks)",
            )
        if self.mask.kind == "custom":
            raise InputError(
                "mask", "mask: the storage ledger takes none, causal or sliding_window"
            )
        return self


class StorageResponse(_Response):
    ledger: dict[str, Any] = Field(description="flashledger.accounting.storage_and_work(...)")
    traffic: dict[str, dict[str, Any]] = Field(
        description="memory_traffic(...) of each schedule: standard, fa1, fa2"
    )
    tile_kinds: list[list[TileKind]] | None = Field(
        description="tile classes when the grid is at most 32 x 32, else null"
    )


# ----------------------------------------------------------------------------- section 6


class ConventionsRequest(AttentionProblem):
    """An attention problem evaluated under every conventions preset, in tiles."""

    block_q: int = Field(default=2, ge=1, le=MAX_TRACE_LEN)
    block_k: int = Field(default=2, ge=1, le=MAX_TRACE_LEN)

    @model_validator(mode="after")
    def _consistent(self) -> ConventionsRequest:
        self.check_problem()
        if self.block_q > len(self.q):
            raise InputError(
                "block_q", f"block_q: {self.block_q} is larger than Lq; allowed: 1..{len(self.q)}"
            )
        if self.block_k > len(self.k):
            raise InputError(
                "block_k", f"block_k: {self.block_k} is larger than Lk; allowed: 1..{len(self.k)}"
            )
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
    rows: list[ConventionRow]


class ConventionsResponse(_Response):
    presets: list[ConventionResult]


# ----------------------------------------------------------------------------- section 3


class MeasureRequest(_Request):
    """Shape of a timed run of the blocked loop against the dense reference."""

    length: int = Field(default=128, ge=1, le=MAX_MEASURE_LEN)
    d: int = Field(default=16, ge=1, le=MAX_MEASURE_DIM)
    block: int = Field(default=32, ge=1, le=MAX_MEASURE_LEN)
    causal: bool = True
    dtype: Literal["float64", "float32"] = "float64"
    repeats: int = Field(default=3, ge=1, le=3)

    @model_validator(mode="after")
    def _consistent(self) -> MeasureRequest:
        if self.block > self.length:
            raise InputError(
                "block", f"block: {self.block} is larger than length; allowed: 1..{self.length}"
            )
        tiles = (-(-self.length // self.block)) ** 2
        if tiles > MAX_MEASURE_TILES:
            raise InputError(
                "block",
                f"block: {tiles} tiles; at most {MAX_MEASURE_TILES} are timed (use a block of "
                f"at least {-(-self.length // 16)})",
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
    repeats: int
    times_ms: dict[str, Num]
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
    limits: dict[str, float]


# ----------------------------------------------------------------------------- section 7

RingLayout = Literal["contiguous", "zigzag"]
RingPass = Literal["forward", "backward"]


class RingRequest(_Request):
    """One ring-attention problem for the in-process twin: ranks, layout, sizes, mask, inputs.

    Q, K, V and G are ``(length, d)`` float64: random normal draws from ``seed``, or, with
    ``data = "example"``, the seed page's five positions (``length = 5``, ``d = 2``).
    Tiles inside each (query chunk, key chunk) pair are ``block x block``.
    """

    world_size: int = Field(default=4, ge=1, le=MAX_RING_WORLD)
    layout: RingLayout = "zigzag"
    length: int = Field(default=16, ge=1, le=MAX_TRACE_LEN)
    d: int = Field(default=4, ge=1, le=MAX_HEAD_DIM)
    block: int = Field(default=4, ge=1, le=MAX_TRACE_LEN)
    mask: MaskSpec = Field(default_factory=lambda: MaskSpec(kind="causal"))
    data: Literal["random", "example"] = "random"
    seed: int = Field(default=0, ge=0, le=2**31 - 1)

    def chunks(self) -> int:
        """Chunks the sequence is cut into: ``W`` (contiguous) or ``2W`` (zigzag)."""
        return self.world_size if self.layout == "contiguous" else 2 * self.world_size

    def tiles_per_pass(self) -> int:
        """Tiles of every (query chunk, key chunk) pair of one pass, over all ranks."""
        bounds = chunk_bounds(self.length, self.world_size, self.layout)
        along = sum(-(-(b - a) // self.block) for a, b in pairwise(bounds))
        return along * along  # query chunks x key chunks, Lq = Lk

    @model_validator(mode="after")
    def _consistent(self) -> RingRequest:
        if self.data == "example" and (self.length, self.d) != (5, 2):
            raise InputError(
                "data",
                f"data: the seed page's example has length 5 and d 2, not length "
                f"{self.length} and d {self.d}; set both, or use random data",
            )
        n = self.chunks()
        if self.length < n:
            raise InputError(
                "length",
                f"length: {self.length} is too short for the {self.layout} layout on "
                f"{self.world_size} rank(s): the sequence is cut into {n} chunks of at least "
                f"one position; allowed: {n}..{MAX_TRACE_LEN}",
            )
        if self.block > self.length:
            raise InputError(
                "block", f"block: {self.block} is larger than length; allowed: 1..{self.length}"
            )
        tiles = self.tiles_per_pass()
        if tiles > MAX_RING_TILES:
            raise InputError(
                "block",
                f"block: {tiles} tiles per pass; at most {MAX_RING_TILES} allowed "
                "(use a larger block or a shorter length)",
            )
        if self.mask.kind == "custom":
            raise InputError(
                "mask", "mask: the ring section takes none, causal or sliding_window, not custom"
            )
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
    """One problem with a request (more keys may follow these three)."""

    model_config = ConfigDict(extra="allow")

    field: str = Field(description="the top-level request field to blame, '' when none")
    path: str = Field(description="where in the body, e.g. 'q[3][1]'; '' when none")
    message: str = Field(
        description="one line naming the field, what was wrong and what is allowed"
    )


class ErrorResponse(BaseModel):
    """The body of every error answer (400, 408, 413, 422, 503)."""

    detail: str = Field(description="every message of ``errors``, on one line")
    errors: list[ErrorItem]
