"""What the explorer shows, computed by flashledger's own loops.

Every figure comes from the engine: ``OnlineSoftmax`` for the one-row ledger,
``blocked_forward``/``blocked_backward`` (traced) for the tile stepper,
``reference_*`` for the oracle, ``accounting`` for storage and traffic,
``simulate_ring`` (the in-process twin of ring attention) for section 07. The
only computation written here is the independent PyTorch autograd check of
section 04: naive attention in float64, differentiated by autograd.

All inputs arrive validated and size-capped (see ``schemas.py``); tensors are
float64 unless a measurement asks for float32. Before a request is queued its
work is estimated from the request alone (``check_work``): the tile steps the
loops will run, weighted by what each step costs, at most ``MAX_WORK``
(about a second of one core). The long computations take ``check``, a callable
that raises when the client has gone away; they call it between tile steps
(traced runs) or between phases, so abandoned work stops.
"""

from __future__ import annotations

import math
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from flashledger import _native, accounting, examples
from flashledger.blocked import blocked_backward, blocked_forward
from flashledger.conventions import PRESETS, get_conventions
from flashledger.ledger import BackwardTileStep, ForwardTileStep
from flashledger.masks import Causal, DenseMask, Mask, SlidingWindow
from flashledger.online import OnlineSoftmax, blockwise_softmax_average, softmax_output
from flashledger.reference import reference_backward, reference_forward
from flashledger.ring import RankState, RingLedger, RingSetup, simulate_ring

from . import schemas as sc

__all__ = [
    "MAX_WORK",
    "backward_steps",
    "check_work",
    "conventions_table",
    "examples_payload",
    "ledger_steps",
    "measure",
    "ring",
    "storage",
    "work_of",
]

F64 = torch.float64
AUTOGRAD_RTOL = 1e-10
"""The autograd check passes when max |blocked - autograd| <= rtol * max(1, max |grad|), or
within what the rounding of large scores allows (``_grad_tolerance``)."""


def _grad_tolerance(
    req: sc.AttentionProblem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
) -> float:
    """The gradients' absolute tolerance: ``AUTOGRAD_RTOL · max(1, max|grad|)``, or where
    the scores are large ``4 d eps (1 + S)`` times the largest term a gradient sums
    (``_grad_terms``; a gradient can cancel to 0 where its terms are large), ``S = scale · d
    · max|q| · max|k|`` (+ ALiBi's largest term) bounding every ``|s|``. Each path forms
    ``s`` with its own rounding (``d · eps · S`` each, at most), and ``P = exp(s - lse)``
    carries the difference as a relative one: with entries near the 1e6 limit the scores
    reach 1e12, which float64 keeps to 1e-4."""
    d = q.shape[1]
    bound = d * float(q.abs().max()) * float(k.abs().max()) / math.sqrt(d)
    if req.softcap is not None:
        bound = min(bound, req.softcap)
    if req.alibi:
        bound += req.alibi_slope * max(q.shape[0], k.shape[0])
    rounding = 4 * d * torch.finfo(torch.float64).eps * (1 + bound)
    largest = max(1.0, *(float(x.abs().max()) for x in grads))
    return max(AUTOGRAD_RTOL * largest, rounding * max(largest, _grad_terms(req, q, k, v, g)))


def _grad_terms(req: sc.AttentionProblem, *xs: torch.Tensor) -> float:
    """The largest term any gradient sums, which its rounding error scales with. With q,
    k, v, g: ``|dS| <= 2 d_v max|g| max|v| / (1 - p)`` summed against P (a row of P sums
    to 1, a column to at most Lq): dQ's terms ``scale · |dS| · max|k|``, dK's ``scale · Lq
    · |dS| · max|q|``, dV's ``Lq · max|g| / (1 - p)``."""
    q, k, v, g = xs  # (Lq, d) (Lk, d) (Lk, d_v) (Lq, d_v)
    lq, d, dv = q.shape[0], q.shape[1], v.shape[1]
    mq, mk, mv, mg = (float(x.abs().max()) if x.numel() else 0.0 for x in xs)
    drop = 1.0 / (1.0 - req.dropout_p)
    ds = 2 * dv * mg * mv * drop
    scale = 1.0 / math.sqrt(d)
    return max(scale * ds * mk, scale * lq * ds * mq, lq * mg * drop)


_MEASURE_LOCK = threading.Lock()
"""One measurement at a time, so that two timings never share the cores."""


Check = Callable[[], None]
"""Raises when the request's client has gone away; called between units of work."""


def _no_check() -> None:
    """The default ``check``: never stops."""


class _Checkpoint:
    """An observer that calls ``check`` at every tile step, so a traced run can be stopped."""

    wants_tensors = False

    def __init__(self, check: Check) -> None:
        self.check = check

    def forward_tile(self, _step: ForwardTileStep) -> None:
        self.check()

    def backward_tile(self, _step: BackwardTileStep) -> None:
        self.check()


def _t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, with equal infinities counted as equal (0 for empty tensors)."""
    same = a == b  # also True for matching infinities
    diff = torch.where(same, torch.zeros((), dtype=a.dtype), (a - b).abs())
    return float(diff.max()) if diff.numel() else 0.0


def _tiles(n: int, b: int) -> list[list[int]]:
    return [[s, min(s + b, n)] for s in range(0, n, b)]


# ----------------------------------------------------------------------------- examples


def examples_payload() -> sc.ExamplesResponse:
    """The seed's data sets, the presets and the input limits, for the page's defaults."""
    five = examples.five_position_example()
    return sc.ExamplesResponse(
        ledger={
            "scores": examples.SIX_SCORES.tolist(),
            "values": examples.SIX_VALUES.tolist(),
            "block_size": examples.SIX_BLOCK,
        },
        backward={
            "q": examples.FIVE_Q.tolist(),
            "k": examples.FIVE_K.tolist(),
            "v": examples.FIVE_V.tolist(),
            "g": examples.FIVE_G.tolist(),
            "block_q": int(five["block_q"]),
            "block_k": int(five["block_k"]),
            "mask": "causal_top_left",
            "conventions": "seed",
        },
        presets=[
            {
                "name": c.name,
                "description": c.description,
                "masked_row_lse": c.masked_row_lse,
                "causal_align": c.causal_align,
                "dropout_keep": c.dropout_keep,
                "lse_differentiable": c.lse_differentiable,
            }
            for c in PRESETS.values()
        ],
        limits=sc.LIMITS,
    )


# ----------------------------------------------------------------------------- section 02


def ledger_steps(req: sc.LedgerRequest) -> sc.LedgerResponse:
    """Read one row block by block with ``OnlineSoftmax``; every step against the full row."""
    scores = _t(req.scores) + req.shift  # (n,)
    values = _t(req.values)  # (n, d_v)
    bs = req.block_size
    osm = OnlineSoftmax.run(scores, values, block=bs)
    p = torch.softmax(scores, dim=-1)  # (n,)
    o = softmax_output(scores, values)  # (d_v,)
    steps = [
        sc.LedgerStep(
            index=st.index,
            start=st.positions[0],
            stop=st.positions[1],
            scores=st.scores.tolist(),
            block_max=float(st.block_max),
            m_before=float(st.m_before),
            m=float(st.m_after),
            alpha=float(st.alpha),
            ell=float(st.ell),
            acc=st.acc.tolist(),
            o=st.output.tolist(),
            max_diff=_max_diff(st.output, o),
            weights=torch.exp(scores[: st.positions[1]] - st.m_after).tolist(),
        )
        for st in osm.steps
    ]
    blocks = _tiles(len(req.scores), bs)
    softmaxes = [torch.softmax(scores[a:b], dim=-1) for a, b in blocks]  # each (b - a,)
    outputs = [softmax_output(scores[a:b], values[a:b]) for a, b in blocks]  # each (d_v,)
    average = blockwise_softmax_average(scores, values, block=bs)  # (d_v,)
    return sc.LedgerResponse(
        n=len(req.scores),
        d_v=values.shape[1],
        block_size=bs,
        shift=req.shift,
        scores=scores.tolist(),
        values=values.tolist(),
        blocks=blocks,
        p=p.tolist(),
        o=o.tolist(),
        lse=float(torch.logsumexp(scores, dim=-1)),
        steps=steps,
        per_block=sc.PerBlockAverage(
            softmax=[x.tolist() for x in softmaxes],
            outputs=[x.tolist() for x in outputs],
            average=average.tolist(),
            max_diff=_max_diff(average, o),
        ),
    )


# ----------------------------------------------------------------------------- masks


def build_mask(spec: sc.MaskSpec) -> Mask | None:
    """The engine's mask for a request's mask spec (``None`` = no mask)."""
    if spec.kind == "none":
        return None
    if spec.kind == "causal":
        return Causal()
    if spec.kind == "causal_top_left":
        return Causal(align="top_left")
    if spec.kind == "causal_bottom_right":
        return Causal(align="bottom_right")
    if spec.kind == "sliding_window":
        return SlidingWindow(spec.left, spec.right, align=spec.align)
    assert spec.dense is not None  # kind == "custom", checked by the request model
    return DenseMask(torch.tensor(spec.dense, dtype=torch.bool))


def _dense(mask: Mask | None, lq: int, lk: int, align: Any) -> torch.Tensor:
    """Visibility ``(Lq, Lk)`` (True = attend) as the loop sees it under ``align``."""
    if mask is None:
        return torch.ones(lq, lk, dtype=torch.bool)
    return mask.dense(lq, lk, causal_align=align)


def _options(req: sc.AttentionProblem, mask: Mask | None) -> dict[str, Any]:
    """Keyword options shared by every engine call of one request."""
    return {
        "mask": mask,
        "conventions": req.conventions,
        "dropout_p": req.dropout_p,
        "seed": req.seed,
        "softcap": req.softcap,
        "alibi_slopes": _t([req.alibi_slope]) if req.alibi else None,
    }


# ----------------------------------------------------------------------------- work limits

MAX_WORK = 12_000
"""Most work one request may ask for, in units of one plain tile step of the PyTorch step
(about 0.1 ms of one core): about a second. The seed's examples need at most 2 % of it;
the page's largest traced problem (64 x 64, causal, 1 x 1 tiles) about 97 %."""
_NATIVE_STEP = 0.1
"""Cost of an untraced forward tile step on the native step (plain scores, no dropout)."""
_FORWARD_STEP = {"base": 1.0, "dropout": 5.0, "softcap": 0.5, "alibi": 1.5}
"""Cost of an untraced forward tile step of the PyTorch step: base plus each option used."""
_TRACED_FORWARD_STEP = {"base": 3.5, "dropout": 6.0, "softcap": 1.5, "alibi": 2.5}
"""Cost of a traced forward tile step (its record and response included)."""
_TRACED_BACKWARD_STEP = {"base": 2.0, "dropout": 6.0, "softcap": 1.0, "alibi": 1.5}
"""Cost of a traced backward tile step (its record and response included)."""
_PARTIAL = 0.5
"""Extra cost of a partial tile (the mask is evaluated inside it), per pass."""


def _used(req: sc.AttentionProblem) -> dict[str, bool]:
    return {"dropout": req.dropout_p > 0.0, "softcap": req.softcap is not None, "alibi": req.alibi}


def _step_cost(req: sc.AttentionProblem, table: dict[str, float], native: bool) -> float:
    used = _used(req)
    if native and not any(used.values()):
        return _NATIVE_STEP
    return table["base"] + sum(table[name] for name, on in used.items() if on)


def _tiles_run(
    req: sc.BackwardRequest | sc.ConventionsRequest, conventions: str
) -> tuple[int, int]:
    """Tiles of the ``(Lq / block_q) x (Lk / block_k)`` grid the loop runs (not empty), and
    how many of them are partial."""
    lq, lk = len(req.q), len(req.k)
    mask = build_mask(req.mask)
    if mask is None:
        return -(-lq // req.block_q) * -(-lk // req.block_k), 0
    align = get_conventions(conventions).causal_align
    classes = mask.tile_classes(lq, lk, req.block_q, req.block_k, causal_align=align)
    return int((classes != 0).sum()), int((classes == 1).sum())


def _options_named(req: sc.AttentionProblem) -> str:
    names = {"dropout": "dropout", "softcap": "softcap", "alibi": "ALiBi"}
    used = [names[name] for name, on in _used(req).items() if on]
    return f" with {', '.join(used)}" if used else ""


def work_of(req: sc.BackwardRequest | sc.ConventionsRequest) -> tuple[float, str]:
    """The work a request asks for (units of ``MAX_WORK``) and what it is, in words.

    ``/api/backward`` runs an untraced forward, a traced forward and a traced backward
    over the tiles the mask does not skip; ``/api/conventions`` one untraced forward per
    preset. Measured with ``benchmarks/explorer_load.py --calibrate``.
    """
    native = _native.kernels() is not None
    forward = _step_cost(req, _FORWARD_STEP, native)
    if isinstance(req, sc.BackwardRequest):
        tiles, partial = _tiles_run(req, req.conventions)
        traced = _step_cost(req, _TRACED_FORWARD_STEP, native=False)
        backward = _step_cost(req, _TRACED_BACKWARD_STEP, native=False)
        units = tiles * (forward + traced + backward) + 3 * partial * _PARTIAL
        what = f"{tiles:,} tiles run forward, traced forward and traced backward" + _options_named(
            req
        )
        return units, what
    tiles = partial = 0
    for name in PRESETS:
        run, part = _tiles_run(req, name)
        tiles, partial = tiles + run, partial + part
    what = f"{tiles:,} tiles run over the {len(PRESETS)} presets{_options_named(req)}"
    return tiles * forward + partial * _PARTIAL, what


def check_work(req: sc.BackwardRequest | sc.ConventionsRequest, *, limit: float = MAX_WORK) -> None:
    """Raise :class:`InputError` (naming the tiles) when a request asks for more than ``limit``."""
    units, what = work_of(req)
    if units > limit:
        raise sc.InputError(
            "block_q",
            f"block_q, block_k: too much work for one request: {what} count "
            f"{units:,.0f} work units; the limit is {limit:,.0f} (about a second): use larger "
            "tiles, a shorter sequence or fewer options",
            "work",
            units=round(units),
            max=round(limit),
        )


# ----------------------------------------------------------------------------- section 04


def _naive_autograd(
    req: sc.BackwardRequest,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    visible: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of ``L = Σ O ⊙ G`` for naive float64 attention, by PyTorch autograd.

    Written from the definitions, independently of flashledger's score code:
    ``S = scale·QKᵀ``, softcap ``c·tanh(S/c)``, ALiBi ``-slope·|i + Lk - Lq - j|``,
    masked entries ``-inf``; a row with no visible key is given the constant
    scores 0 before the softmax and its probabilities are multiplied by 0.
    """
    qa, ka, va = (x.clone().requires_grad_(True) for x in (q, k, v))
    lq, lk = q.shape[0], k.shape[0]
    s = (qa @ ka.T) / math.sqrt(q.shape[1])  # (Lq, Lk)
    if req.softcap is not None:
        s = req.softcap * torch.tanh(s / req.softcap)
    if req.alibi:
        i = torch.arange(lq, dtype=F64)[:, None]  # (Lq, 1)
        j = torch.arange(lk, dtype=F64)[None, :]  # (1, Lk)
        s = s - req.alibi_slope * (i + lk - lq - j).abs()
    has_key = visible.any(dim=-1, keepdim=True)  # (Lq, 1)
    s = s.masked_fill(~visible, -math.inf)
    s = torch.where(has_key, s, torch.zeros((), dtype=F64))  # (Lq, Lk)
    p = torch.softmax(s, dim=-1) * has_key  # (Lq, Lk)
    if keep is not None:
        p = p * keep / (1.0 - req.dropout_p)
    o = p @ va  # (Lq, d_v)
    (o * g).sum().backward()
    assert qa.grad is not None and ka.grad is not None and va.grad is not None
    return qa.grad, ka.grad, va.grad


def _rows(x: torch.Tensor | None) -> list[Any]:
    """A traced tensor as nested lists (every traced record carries its tensors)."""
    if x is None:
        raise RuntimeError("a traced ledger record is missing a tensor")
    return x.tolist()  # type: ignore[no-any-return]


def _forward_steps(records: list[Any], lq: int) -> list[sc.ForwardStep]:
    """The traced forward's tiles, each with its rows' denominator before the tile."""
    ell_now = [0.0] * lq  # running ell of every query row, in loop order
    out = []
    for r in records:
        if not isinstance(r, ForwardTileStep):
            raise RuntimeError(f"the forward ledger holds a {type(r).__name__}")
        a, b = r.q_range
        ell_after = _rows(r.ell)
        out.append(
            sc.ForwardStep(
                **_tile_fields(r),
                s=_rows(r.s),
                p=_rows(r.p),
                block_max=_rows(r.block_max),
                m_before=_rows(r.m_before),
                m=_rows(r.m_after),
                alpha=_rows(r.alpha),
                ell_before=ell_now[a:b],
                ell=ell_after,
                o=_rows(r.o),
            )
        )
        ell_now[a:b] = ell_after
    return out


def _tile_fields(r: ForwardTileStep | BackwardTileStep) -> dict[str, Any]:
    """The fields every traced tile step shows (``schemas._TileStep``)."""
    return dict(
        index=r.index,
        q_tile=r.q_tile,
        k_tile=r.k_tile,
        q_range=list(r.q_range),
        k_range=list(r.k_range),
        kind=r.kind,
    )


def _ds_through_cap(
    r: BackwardTileStep, q: torch.Tensor, k: torch.Tensor, softcap: float | None
) -> list[Any] | None:
    """With a softcap, ``dS·(1 - t²)`` of the tile, ``t = tanh(scale·QKᵀ/c)``: the gradient of
    the uncapped scores, which is what dq and dk take (``dq = it @ K · scale``); the ``ds``
    of the trace is the gradient of the capped scores. None without a softcap."""
    if softcap is None or r.ds is None:
        return None
    (a, b), (c, e) = r.q_range, r.k_range
    t = torch.tanh((q[a:b] @ k[c:e].T) / math.sqrt(q.shape[1]) / softcap)  # (rows, cols)
    return _rows(r.ds * (1.0 - t * t))


def _backward_step(
    r: ForwardTileStep | BackwardTileStep, q: torch.Tensor, k: torch.Tensor, softcap: float | None
) -> sc.BackwardStep:
    if not isinstance(r, BackwardTileStep):
        raise RuntimeError(f"the backward ledger holds a {type(r).__name__}")
    return sc.BackwardStep(
        **_tile_fields(r),
        p=_rows(r.p),
        ds=_rows(r.ds),
        ds_qk=_ds_through_cap(r, q, k, softcap),
        dq=_rows(r.dq),
        dk=_rows(r.dk),
        dv=_rows(r.dv),
    )


def backward_steps(req: sc.BackwardRequest, *, check: Check = _no_check) -> sc.BackwardResponse:
    """Blocked forward, then the traced blocked backward, against the reference and autograd.

    ``check`` is called before each phase and at every traced tile step.
    """
    q, k, v, g = _t(req.q), _t(req.k), _t(req.v), _t(req.g)  # (Lq, d) (Lk, d) (Lk, d_v) (Lq, d_v)
    lq, lk, d, dv = q.shape[0], k.shape[0], q.shape[1], v.shape[1]
    mask = build_mask(req.mask)
    opts = _options(req, mask)
    tiles: dict[str, Any] = {"block_q": req.block_q, "block_k": req.block_k}
    check()
    fwd = blocked_forward(q, k, v, **opts, **tiles)
    stop = _Checkpoint(check)
    # the same loop, observed (and stopped at a tile step when the client has gone)
    traced = blocked_forward(q, k, v, **opts, **tiles, trace=True, observer=stop)
    ref = reference_forward(q, k, v, **opts)
    bwd = blocked_backward(q, k, v, fwd.o, fwd.lse, g, **opts, **tiles, trace=True, observer=stop)
    refb = reference_backward(q, k, v, ref.o, ref.lse, g, **opts)
    check()
    visible = _dense(mask, lq, lk, get_conventions(req.conventions).causal_align)  # (Lq, Lk)
    auto = _naive_autograd(req, q, k, v, g, visible, ref.keep)

    grads = (bwd.dq, bwd.dk, bwd.dv)
    ref_grads = (refb.dq, refb.dk, refb.dv)
    grad_diff = max(_max_diff(a, b) for a, b in zip(grads, ref_grads))
    auto_diff = max(_max_diff(a, b) for a, b in zip(grads, auto))
    tol = _grad_tolerance(req, q, k, v, g, auto)
    steps = [_backward_step(r, q, k, req.softcap) for r in bwd.ledger.records]
    return sc.BackwardResponse(
        lq=lq,
        lk=lk,
        d=d,
        d_v=dv,
        scale=1.0 / math.sqrt(d),
        conventions=req.conventions,
        o=fwd.o.tolist(),
        lse=fwd.lse.tolist(),
        D=bwd.D.tolist(),
        ref_o=ref.o.tolist(),
        ref_lse=ref.lse.tolist(),
        forward_max_diff=_max_diff(fwd.o, ref.o),
        p=ref.p.tolist(),
        mask=visible.tolist(),
        keep=None if ref.keep is None else ref.keep.tolist(),
        fully_masked_rows=[i for i in range(lq) if not bool(visible[i].any())],
        q_tiles=_tiles(lq, req.block_q),
        k_tiles=_tiles(lk, req.block_k),
        tile_kinds=bwd.ledger.tile_kinds,  # type: ignore[arg-type]
        steps=steps,
        grads=sc.Gradients(dq=bwd.dq.tolist(), dk=bwd.dk.tolist(), dv=bwd.dv.tolist()),
        reference=sc.Gradients(dq=refb.dq.tolist(), dk=refb.dk.tolist(), dv=refb.dv.tolist()),
        grad_max_diff=grad_diff,
        tolerance=tol,
        autograd=sc.AutogradCheck(max_diff=auto_diff, tolerance=tol, ok=auto_diff <= tol),
        counters=bwd.ledger.counters.to_dict(),
        forward_counters=fwd.ledger.counters.to_dict(),
        forward_steps=_forward_steps(list(traced.ledger.records), lq),
        forward_o=traced.o.tolist(),
        forward_steps_max_diff=_max_diff(traced.o, ref.o),
    )


# ----------------------------------------------------------------------------- section 06


def conventions_table(
    req: sc.ConventionsRequest, *, check: Check = _no_check
) -> sc.ConventionsResponse:
    """The same problem under every preset: each row's O and LSE, blocked vs reference.

    ``check`` is called before each preset.
    """
    q, k, v = _t(req.q), _t(req.k), _t(req.v)
    lq, lk = q.shape[0], k.shape[0]
    mask = build_mask(req.mask)
    results = []
    for conv in PRESETS.values():
        check()
        about: dict[str, Any] = dict(
            name=conv.name,
            description=conv.description,
            masked_row_lse=conv.masked_row_lse,
            causal_align=conv.causal_align,
            dropout_keep=conv.dropout_keep,
            lse_differentiable=conv.lse_differentiable,
        )
        try:
            req.model_copy(update={"conventions": conv.name}).check_pair()
        except sc.InputError as refused:  # as the real kernel refuses it
            results.append(sc.ConventionResult(**about, rows=[], refused=str(refused)))
            continue
        opts = _options(req, mask) | {"conventions": conv}
        fwd = blocked_forward(q, k, v, **opts, block_q=req.block_q, block_k=req.block_k)
        ref = reference_forward(q, k, v, **opts)
        visible = _dense(mask, lq, lk, conv.causal_align)  # (Lq, Lk)
        rows = [
            sc.ConventionRow(
                row=i,
                fully_masked=not bool(visible[i].any()),
                o=fwd.o[i].tolist(),
                lse=float(fwd.lse[i]),
                ref_lse=float(ref.lse[i]),
                max_diff=_max_diff(fwd.o[i], ref.o[i]),
            )
            for i in range(lq)
        ]
        results.append(sc.ConventionResult(**about, rows=rows))
    return sc.ConventionsResponse(presets=results)


# ----------------------------------------------------------------------------- section 05

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def storage(req: sc.StorageRequest) -> sc.StorageResponse:
    """The storage and work ledger and the memory-traffic model of ``flashledger.accounting``."""
    mask = build_mask(req.mask)
    sizes: dict[str, Any] = {
        "lq": req.lq,
        "lk": req.lk,
        "d": req.d,
        "d_v": req.d_v,
        "block_q": req.block_q,
        "block_k": req.block_k,
        "mask": mask,
        "dtype": _DTYPES[req.dtype],
    }
    ledger = accounting.storage_and_work(**sizes).to_dict()
    traffic: dict[str, dict[str, Any]] = {
        schedule: accounting.memory_traffic(**sizes, schedule=schedule).to_dict()
        for schedule in accounting.SCHEDULES
    }
    tq, tk = -(-req.lq // req.block_q), -(-req.lk // req.block_k)
    kinds: list[list[sc.TileKind]] | None = None
    if tq <= 32 and tk <= 32:
        names: dict[int, sc.TileKind] = {0: "empty", 1: "partial", 2: "full"}
        if mask is None:
            kinds = [["full"] * tk for _ in range(tq)]
        else:
            classes = mask.tile_classes(req.lq, req.lk, req.block_q, req.block_k)
            kinds = [[names[int(c)] for c in row] for row in classes.tolist()]
    return sc.StorageResponse(
        ledger=ledger, sweep=_storage_sweep(req), traffic=traffic, tile_kinds=kinds
    )


def _storage_sweep(req: sc.StorageRequest) -> list[sc.StoragePoint]:
    """Both paths' storage for Lq = Lk = L over powers of two up to the limit (and this L)."""
    lengths = {2**n for n in range(sc.MAX_STORAGE_LEN.bit_length())} | {req.lq}
    points = []
    for n in sorted(lengths):
        sw = accounting.storage_and_work(
            lq=n, lk=n, d=req.d, d_v=req.d_v, block_q=n, block_k=n, dtype=_DTYPES[req.dtype]
        )
        points.append(
            sc.StoragePoint(
                length=n,
                full_p=sw.full_p_elements,
                lse=sw.lse_elements,
                common=sum(sw.common_elements.values()),
            )
        )
    return points


# ----------------------------------------------------------------------------- section 03


MEASURE_BUDGET_S = 1.0
"""Time after which the timed runs of one request stop (warm-ups not counted), shared
by its four functions; past it each still gets ``MEASURE_MIN_RUNS``."""
MEASURE_MIN_RUNS = 3
"""Runs timed even past the budget (fewer only when fewer are asked for)."""


def _timed_runs(
    fn: Callable[[], Any], repeats: int, budget_s: float, check: Check = _no_check
) -> list[float]:
    """Run times (ms) of ``fn``: one warm-up run not timed (caches, the native step's first
    build, allocator), then up to ``repeats`` timed runs, stopping once ``budget_s`` is
    spent and at least ``MEASURE_MIN_RUNS`` are done. ``check`` is called before each run."""
    check()
    fn()  # warm-up
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats:
        check()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        spent += times[-1] / 1e3
        if spent > budget_s and len(times) >= min(repeats, MEASURE_MIN_RUNS):
            break
    return times


def measure(req: sc.MeasureRequest, *, check: Check = _no_check) -> sc.MeasureResponse:
    """Time the untraced blocked loop and the dense reference on this machine (CPU).

    ``check`` is called before each timed run (each is bounded by the request's limits).
    """
    dt = torch.float64 if req.dtype == "float64" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shape = (1, req.length, req.d)  # (H, L, d)
    q, k, v, g = (torch.randn(shape, generator=gen, dtype=dt) for _ in range(4))
    mask = Causal() if req.causal else None
    tiles: dict[str, Any] = {"block_q": req.block, "block_k": req.block}
    with _MEASURE_LOCK:
        check()
        fwd = blocked_forward(q, k, v, mask=mask, **tiles)  # the results compared
        check()
        ref = reference_forward(q, k, v, mask=mask, dtype=dt)
        check()
        bwd = blocked_backward(q, k, v, fwd.o, fwd.lse, g, mask=mask, **tiles)
        check()
        refb = reference_backward(q, k, v, ref.o, ref.lse, g, mask=mask, dtype=dt)
        runs: dict[str, Callable[[], Any]] = {
            "blocked_forward": lambda: blocked_forward(q, k, v, mask=mask, **tiles),
            "blocked_backward": lambda: blocked_backward(
                q, k, v, fwd.o, fwd.lse, g, mask=mask, **tiles
            ),
            "reference_forward": lambda: reference_forward(q, k, v, mask=mask, dtype=dt),
            "reference_backward": lambda: reference_backward(
                q, k, v, ref.o, ref.lse, g, mask=mask, dtype=dt
            ),
        }
        budget = MEASURE_BUDGET_S / len(runs)
        times = {name: _timed_runs(fn, req.repeats, budget, check) for name, fn in runs.items()}
    itemsize = torch.finfo(dt).bits // 8
    return sc.MeasureResponse(
        device=f"CPU ({platform.machine() or 'unknown'})",
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        length=req.length,
        d=req.d,
        block=req.block,
        causal=req.causal,
        dtype=req.dtype,
        repeats=req.repeats,
        times_ms={name: statistics.median(ts) for name, ts in times.items()},
        runs={name: len(ts) for name, ts in times.items()},
        min_ms={name: min(ts) for name, ts in times.items()},
        max_ms={name: max(ts) for name, ts in times.items()},
        forward_max_diff=_max_diff(fwd.o.to(F64), ref.o.to(F64)),
        grad_max_diff=max(
            _max_diff(a.to(F64), b.to(F64))
            for a, b in ((bwd.dq, refb.dq), (bwd.dk, refb.dk), (bwd.dv, refb.dv))
        ),
        full_p_bytes=req.length * req.length * itemsize,
        lse_bytes=req.length * itemsize,
        counters=fwd.ledger.counters.to_dict(),
    )


# ----------------------------------------------------------------------------- section 07

RING_TOLERANCE = 1e-12
"""The ring's O, LSE, dQ, dK, dV must equal the float64 dense oracle to this (max |difference|)."""


def _ring_inputs(req: sc.RingRequest) -> tuple[torch.Tensor, ...]:
    """Q, K, V, G ``(L, d)`` float64: the seed page's five positions, or normal draws."""
    if req.data == "example":
        ex = examples.five_position_example()
        return ex["q"], ex["k"], ex["v"], ex["g"]  # type: ignore[return-value]
    gen = torch.Generator().manual_seed(req.seed)
    return tuple(torch.randn(req.length, req.d, generator=gen, dtype=F64) for _ in range(4))


def _worst(a: torch.Tensor, b: torch.Tensor) -> tuple[float, list[int]]:
    """max |a - b| (equal infinities count as equal) and the index of the worst element."""
    same = a == b
    diff = torch.where(same, torch.zeros((), dtype=a.dtype), (a - b).abs())
    flat = int(diff.argmax())
    return float(diff.max()), [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]


def _chunk_rows(setup: RingSetup, chunks: tuple[int, ...]) -> list[int]:
    """Global positions of ``chunks`` in shard order."""
    b = setup.q_bounds
    return [i for c in chunks for i in range(b[c], b[c + 1])]


def _forward_state(
    led: RingLedger, n: int, r: int, rows: int, d_v: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Rank ``r``'s ``(shard held, o, lse)`` after ``n`` forward ring steps: the state it
    recorded at the end of step ``n - 1``; before any step (``n = 0``) its own shard, O = 0
    and LSE -inf on its ``rows`` rows."""
    if n == 0:
        o = torch.zeros(rows, d_v, dtype=F64)  # (rows_r, d_v)
        return r, o, torch.full((rows,), -math.inf, dtype=F64)  # (rows_r,)
    st = led.state("forward", n - 1, r)
    assert st.o is not None and st.lse is not None  # a forward record carries both
    return st.shard, st.o, st.lse


def _held_accumulators(led: RingLedger, n: int, r: int, w: int) -> RankState | None:
    """The dK/dV accumulators rank ``r`` holds after ``n`` backward ring steps: those rank
    ``r - 1`` recorded as passing on at the end of step ``n - 1`` (``n`` ranks' contributions);
    a hop copies them unchanged. None before the first step."""
    return led.state("backward", n - 1, (r - 1) % w) if n > 0 else None


def _ring_pass(led: RingLedger, pass_name: str) -> sc.RingPassSummary:
    """Per-rank work, the (rank, step) grid, balance and critical path of one pass."""
    setup = led.setup
    assert setup is not None
    w = setup.world_size
    grid = [[[-1, 0, 0] for _ in range(w)] for _ in range(w)]
    for p in led.pairs:
        if p.pass_name == pass_name:
            cell = grid[p.rank][p.step]
            cell[0] = p.shard
            cell[1] += p.counters.tiles_run
            cell[2] += p.counters.tiles_skipped
    work = led.rank_work(pass_name)
    total = sum(x.counters.tiles_run for x in work)
    return sc.RingPassSummary(
        work=[
            sc.RingWork(
                rank=x.rank,
                pairs_run=x.pairs_run,
                pairs_skipped=x.pairs_skipped,
                tiles_run=x.counters.tiles_run,
                tiles_skipped=x.counters.tiles_skipped,
                qk_dots_visible=x.counters.qk_dots_visible,
                qk_dots_computed=x.counters.qk_dots_computed,
            )
            for x in work
        ],
        grid=[
            [sc.RingGridCell(shard=c[0], tiles_run=c[1], tiles_skipped=c[2]) for c in row]
            for row in grid
        ],
        balance=led.balance(pass_name),
        critical_path=led.critical_path(pass_name),
        ideal=total / w,
    )


def _tiles_so_far(led: RingLedger, pass_name: str, rank: int, steps: int) -> tuple[int, int]:
    """Tiles ``rank`` ran and skipped in the first ``steps`` ring steps of a pass."""
    mine = [p for p in led.pairs if p.pass_name == pass_name and p.rank == rank and p.step < steps]
    return sum(p.counters.tiles_run for p in mine), sum(p.counters.tiles_skipped for p in mine)


def ring(req: sc.RingRequest, *, check: Check = _no_check) -> sc.RingResponse:
    """Ring attention on ``W`` simulated ranks, every hop and every rank's state per step.

    The per-step states are the ring's own: ``simulate_ring(..., record_states=True)``
    keeps each rank's ``RankState`` at the end of every ring step of both passes.
    ``check`` is called before the ring runs and before the oracle.
    """
    check()
    q, k, v, g = _ring_inputs(req)  # (L, d) (L, d) (L, d_v) (L, d_v)
    mask = build_mask(req.mask)
    w, b = req.world_size, req.block
    res = simulate_ring(
        q,
        k,
        v,
        world_size=w,
        layout=req.layout,
        do=g,
        mask=mask,
        block_q=b,
        block_k=b,
        record_states=True,
    )
    assert res.dq is not None and res.dk is not None and res.dv is not None  # do was given
    led = res.ledger
    setup = led.setup
    assert setup is not None
    check()
    ref = reference_forward(q, k, v, mask=mask)
    refb = reference_backward(q, k, v, ref.o, ref.lse, g, mask=mask)
    rows = [_chunk_rows(setup, setup.chunks_of(r)) for r in range(w)]

    ring_out = {"o": res.o, "lse": res.lse, "dq": res.dq, "dk": res.dk, "dv": res.dv}
    oracle = {"o": ref.o, "lse": ref.lse, "dq": refb.dq, "dk": refb.dk, "dv": refb.dv}
    checks = []
    for name, got in ring_out.items():
        worst, index = _worst(got, oracle[name])
        checks.append(
            sc.RingCheck(name=name, max_diff=worst, index=index, ok=worst <= RING_TOLERANCE)  # type: ignore[arg-type]
        )

    forward = []
    for n in range(w + 1):
        o_now = torch.zeros_like(res.o)  # (L, d_v)
        ranks = []
        for r in range(w):
            shard, o_r, lse_r = _forward_state(led, n, r, len(rows[r]), v.shape[-1])
            o_now[rows[r]] = o_r  # (rows_r, d_v)
            run, skipped = _tiles_so_far(led, "forward", r, n)
            ranks.append(
                sc.RingForwardRank(
                    rank=r,
                    shard=shard,
                    tiles_run=run,
                    tiles_skipped=skipped,
                    lse=lse_r.tolist(),
                    o_max_diff=_max_diff(o_r, res.o[rows[r]]),
                )
            )
        forward.append(sc.RingForwardStep(step=n, ranks=ranks, max_diff=_max_diff(o_now, ref.o)))

    backward = []
    for n in range(w + 1):
        dq_now, dk_now, dv_now = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        ranks_b = []
        for r in range(w):
            own = led.state("backward", n - 1, r) if n > 0 else None
            if own is not None:
                assert own.dq is not None  # a backward record
                dq_now[rows[r]] = own.dq
            held = _held_accumulators(led, n, r, w)
            acc_diff = 0.0
            if held is not None:
                assert held.dk is not None and held.dv is not None  # a backward record
                at = rows[held.shard]
                dk_now[at], dv_now[at] = held.dk, held.dv
                acc_diff = max(_max_diff(held.dk, res.dk[at]), _max_diff(held.dv, res.dv[at]))
            run, skipped = _tiles_so_far(led, "backward", r, n)
            ranks_b.append(
                sc.RingBackwardRank(
                    rank=r,
                    shard=r if own is None else own.shard,
                    tiles_run=run,
                    tiles_skipped=skipped,
                    dq_max_diff=_max_diff(dq_now[rows[r]], res.dq[rows[r]]),
                    acc_shard=None if held is None else held.shard,
                    acc_count=n,
                    acc_max_diff=acc_diff,
                )
            )
        now_diff = max(
            _max_diff(dq_now, refb.dq), _max_diff(dk_now, refb.dk), _max_diff(dv_now, refb.dv)
        )
        backward.append(sc.RingBackwardStep(step=n, ranks=ranks_b, max_diff=now_diff))

    # the last states recorded against what the ring returned (an exact link: 0)
    final_diffs = []
    for r in range(w):
        fwd, bwd = led.state("forward", w - 1, r), led.state("backward", w - 1, r)
        assert fwd.o is not None and fwd.lse is not None and bwd.dq is not None
        assert bwd.dk is not None and bwd.dv is not None
        mine, theirs = rows[r], rows[bwd.shard]  # the accumulators go on to their owner
        final_diffs += [
            _max_diff(fwd.o, res.o[mine]),
            _max_diff(fwd.lse, res.lse[mine]),
            _max_diff(bwd.dq, res.dq[mine]),
            _max_diff(bwd.dk, res.dk[theirs]),
            _max_diff(bwd.dv, res.dv[theirs]),
        ]

    observed, closed = led.comm_totals(), led.expected_comm()
    comm = [
        sc.RingComm(
            pass_name=pn,  # type: ignore[arg-type]
            payload=pl,  # type: ignore[arg-type]
            hops=hops,
            nbytes=nbytes,
            closed_form_hops=c_hops,
            closed_form_nbytes=c_bytes,
            ok=(hops, nbytes) == (c_hops, c_bytes),
        )
        for (pn, pl, hops, nbytes), (_, _, c_hops, c_bytes) in zip(observed.rows(), closed.rows())
    ]
    chunks = setup.chunks_of
    owners = [next(r for r in range(w) if c in chunks(r)) for c in range(len(setup.q_bounds) - 1)]
    return sc.RingResponse(
        world_size=w,
        layout=req.layout,
        length=setup.lq,
        d=setup.d,
        block=b,
        bounds=list(setup.q_bounds),
        owners=owners,
        ranks=[sc.RingRank(rank=r, chunks=list(chunks(r)), rows=rows[r]) for r in range(w)],
        forward=forward,
        backward=backward,
        lse=res.lse.tolist(),
        hops=[
            sc.RingHop(
                pass_name=h.pass_name,  # type: ignore[arg-type]
                step=h.step,
                sender=h.sender,
                receiver=h.receiver,
                payload=h.payload,  # type: ignore[arg-type]
                shard=h.shard,
                nbytes=h.nbytes,
            )
            for h in led.hops
        ],
        comm=comm,
        comm_match=led.comm_matches(),
        passes={p: _ring_pass(led, p) for p in led.passes},
        checks=checks,
        tolerance=RING_TOLERANCE,
        final_state_max_diff=max(final_diffs),
    )
