"""Verify attention implementations: an oracle for kernel authors, and live cross-checks.

``assert_attention_close(fn)`` runs an attention callable over a sweep of
cases that break tiling (lengths 1, 2, 97, 113, 257; ``Lq != Lk`` both ways;
odd head dims; GQA/MQA; ``d_v != d``; no mask, causal in both alignments,
sliding window, key padding, fully-masked rows; float16, bfloat16, float32,
float64) and judges O, LSE and gradients against the float64 oracle
(``reference_forward`` / ``reference_backward`` with the chosen conventions).

The rule (flash-attn's): ``error(fn) <= factor * error(naive) + floor``, where
``naive`` is plain PyTorch attention in the same dtype, ``factor`` is 2 for O
and LSE and 3 for gradients, and ``floor = (eps(dtype) + eps(acc) * sqrt(n)) *
max(1, max |oracle|)`` covers the rounding no implementation can avoid
(``acc``: float32 for half inputs, else the input dtype; ``n``: the length of
the longest chain of sums behind the quantity, ``d_v`` more for dQ and dK,
whose ``dP - D`` subtracts two dot products rounded apart).

The callable's contract::

    fn(q, k, v, case) -> O  or  (O, LSE)

    q (B, Hq, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, d_v) in case.dtype;
    with check_grads they are leaves that require grad.
    case.mask            a flashledger Mask (Causal, SlidingWindow, KeyPadding,
                         DenseMask) or None
    case.dense_mask()    the same as bool (B, Hq, Lq, Lk), True = attend, or None
    case.align           "top_left"/"bottom_right" for causal/window masks, else None
    case.scale           the softmax scale (a float)
    case.conventions     the edge behaviour expected (fully-masked rows, LSE)
    O (B, Hq, Lq, d_v); LSE (B, Hq, Lq), natural log (optional).

Gradients are checked through autograd when the returned O requires grad.

>>> import torch.nn.functional as F
>>> from flashledger import SDPA_CPU
>>> def sdpa(q, k, v, case):
...     return F.scaled_dot_product_attention(
...         q, k, v, attn_mask=case.dense_mask(), scale=case.scale, enable_gqa=case.shape.gqa)
>>> report = assert_attention_close(sdpa, conventions=SDPA_CPU, quick=True,
...                                 dtypes=(torch.float32,), masks=("causal_top_left",))
>>> report.passed
True

``run_matrix()`` runs every live system of the installed PyTorch (SDPA math,
the CPU flash kernel and its LSE, the causal bias objects, FlexAttention and
its BlockMask) and flashledger's own blocked loop under each preset, the
flash-attn edges its presets reproduce (against an emulation of flash-attn's
source, one row per edge), flashledger's FlexAttention path
(``flex_attention``, ``MaskMod``, ``score_mod``) against torch's
FlexAttention forward and a dense float64 autograd oracle on
attention-gym-style cases (``_verify_flex``), a 50-digit mpmath oracle on
tiny cases, and reports the facts it observed.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import _verify_systems as systems
from ._verify_cases import (
    ALL_DTYPES,
    LARGE_SCORE,
    MASK_KINDS,
    QUICK_SHAPES,
    Case,
    Shape,
    attention_cases,
    dtype_name,
    make_case,
)
from ._verify_flash_attn import flash_attn_edge_rows
from ._verify_flex import flex_rows
from ._verify_mp import MP_DIGITS, MpResult, mp_attention, ulps
from ._verify_report import Fact, VerifyReport, VerifyRow, count_row
from ._verify_rule import (
    GRAD_FACTOR,
    OUTPUT_FACTOR,
    AttentionFn,
    CaseResult,
    baseline,
    check_case,
    naive_attention,
)
from .autograd import flash_attention
from .blocked import blocked_backward, blocked_forward
from .conventions import FLEX_ATTENTION, PRESETS, SDPA_CPU, SEED, Conventions, get_conventions
from .masks import EMPTY, FULL, PARTIAL, DenseMask
from .reference import reference_backward, reference_forward

__all__ = [
    "ALL_DTYPES",
    "LARGE_SCORE",
    "MASK_KINDS",
    "MP_ULP_BOUND",
    "AttentionFn",
    "Case",
    "CaseResult",
    "Fact",
    "Shape",
    "VerifyReport",
    "VerifyRow",
    "add_cli_arguments",
    "assert_attention_close",
    "attention_cases",
    "lse_from_base2",
    "lse_to_base2",
    "make_case",
    "naive_attention",
    "observe_facts",
    "run_cli",
    "run_matrix",
]

LOG2E = 1.4426950408889634  # log2(e) = 1 / ln 2
LN2 = 0.6931471805599453  # ln 2

MP_ULP_BOUND = 16.0
"""flashledger's float64 O, LSE and gradients must be within this many ulps of the 50-digit answer.

Measured over 360 tiny cases (5 shapes x 6 masks x 12 seeds): median 2.5-3 ulps,
99th percentile about 7, worst 8.6 (the dense reference's dQ); summation order
alone moves the figure by a few ulps, hence the margin.
"""

MAX_FAILURES_SHOWN = 5


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run with one intra-op thread, restoring the caller's setting afterwards.

    The cases are small: a thread pool costs more than it gives there, and on
    a busy machine its spinning threads make a run several times slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE -> base 2 (``m + log2(ℓ)``, the Triton tutorial's ``M``): ``lse * log2(e)``.

    Same shape and dtype; ``±inf`` and 0 are kept as they are.
    """
    return lse * LOG2E


def lse_from_base2(lse2: torch.Tensor) -> torch.Tensor:
    """Base-2 LSE (``m + log2(ℓ)``) -> natural log: ``lse2 * ln 2``. Same shape and dtype."""
    return lse2 * LN2


# ----------------------------------------------------------------------------------------
# assert_attention_close
# ----------------------------------------------------------------------------------------
def assert_attention_close(
    fn: AttentionFn,
    *,
    conventions: Conventions | str = SEED,
    dtypes: Sequence[torch.dtype] = ALL_DTYPES,
    cases: Sequence[Case] | None = None,
    check_grads: bool = True,
    check_lse: bool = True,
    quick: bool = False,
    masks: Sequence[str] = MASK_KINDS,
    gqa: bool = True,
    head_dim_v: bool = True,
    large_scores: bool = True,
    long_rows: bool = True,
    output_factor: float = OUTPUT_FACTOR,
    grad_factor: float = GRAD_FACTOR,
) -> VerifyReport:
    """Assert that ``fn`` computes attention as the float64 oracle does, under the rule.

    ``fn(q, k, v, case) -> O | (O, LSE)`` (see the module docstring for the
    contract). The sweep is ``attention_cases(conventions=..., dtypes=...,
    quick=..., masks=..., gqa=..., head_dim_v=..., large_scores=..., long_rows=...)`` unless
    ``cases`` is given (then exactly those run, each with its own dtype and
    conventions); ``large_scores`` adds a case per dtype whose scores reach
    ``LARGE_SCORE`` (1500), where a softmax that does not subtract its row's
    maximum overflows; ``long_rows`` one per dtype with rows of 4097 keys, where a
    row sum kept in float16 stops taking its additions.
    ``check_lse`` compares a returned LSE (natural log; use
    ``lse_from_base2`` for base-2 kernels); ``check_grads`` compares dQ, dK, dV
    when the returned O requires grad.

    Cases run with one intra-op thread (``torch.set_num_threads(1)``,
    restored afterwards): they are small, and a thread pool only slows them.

    Raises ``AssertionError`` naming, for each failing case (the first
    five), the quantity, the worst element's index, both values and both
    errors (fn's and the naive same-dtype implementation's). Returns the
    ``VerifyReport`` of all cases otherwise.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(q, k, v, case), got {type(fn).__name__}")
    conv = get_conventions(conventions)
    for name, factor in (("output_factor", output_factor), ("grad_factor", grad_factor)):
        if not (isinstance(factor, int | float) and math.isfinite(factor) and factor >= 1):
            raise ValueError(f"{name} must be a finite number >= 1, got {factor!r}")
    if cases is None:
        run = attention_cases(
            conventions=conv,
            dtypes=dtypes,
            quick=quick,
            masks=masks,
            gqa=gqa,
            head_dim_v=head_dim_v,
            large_scores=large_scores,
            long_rows=long_rows,
        )
    else:
        run = list(cases)
        bad = [c for c in run if not isinstance(c, Case)]
        if bad or not run:
            raise TypeError("cases must be a non-empty sequence of flashledger.verify.Case")
    start = time.perf_counter()
    name = getattr(fn, "__name__", type(fn).__name__)
    with _one_thread():
        results = [
            check_case(
                fn,
                baseline(c, grads=check_grads),
                check_grads=check_grads,
                check_lse=check_lse,
                output_factor=output_factor,
                grad_factor=grad_factor,
            )
            for c in run
        ]
    report = VerifyReport(
        rows=[_row(name, r) for r in results],
        seconds=time.perf_counter() - start,
        quick=quick,
    )
    bad_results = [r for r in results if not r.passed]
    if bad_results:
        shown = "\n".join(r.message() for r in bad_results[:MAX_FAILURES_SHOWN])
        more = len(bad_results) - MAX_FAILURES_SHOWN
        tail = f"\n... and {more} more failing cases" if more > 0 else ""
        if any(r.status == "unsupported" for r in bad_results):
            tail += (
                "\n(cases fn does not support can be left out with masks=, gqa=, head_dim_v= "
                "or an explicit cases= list)"
            )
        judged = [r for r in bad_results if not r.error]
        could_not = len(bad_results) - len(judged)
        parts = []
        if judged:
            parts.append(f"{len(judged)} differ from the float64 oracle")
        if could_not:
            parts.append(f"{could_not} could not be judged (fn raised or returned a wrong shape)")
        raise AssertionError(
            f"{name}: {len(bad_results)} of {len(results)} cases fail: {'; '.join(parts)} "
            f"(rule: error <= {output_factor:g}x (O, LSE) / {grad_factor:g}x (grads) the naive "
            f"same-dtype error + floor)\n{shown}{tail}"
        )
    return report


def _row(system: str, r: CaseResult) -> VerifyRow:
    worst = r.worst
    detail = r.error or (r.message() if r.status == "failed" else "; ".join(r.notes))
    return VerifyRow(
        system=system,
        convention=r.case.conventions.name,
        case=r.case.name,
        dtype=dtype_name(r.case.dtype),
        checked=r.checked or "-",
        worst=worst.quantity if worst else "-",
        error=worst.error if worst else 0.0,
        bound=worst.bound if worst else 0.0,
        status=r.status,
        detail=detail,
    )


# ----------------------------------------------------------------------------------------
# observed facts
# ----------------------------------------------------------------------------------------
def _describe(x: torch.Tensor) -> str:
    vals = sorted({float(v) for v in x.reshape(-1).tolist()}, key=str)
    if any(math.isnan(v) for v in vals):
        return "NaN"
    return ", ".join(f"{v:g}" for v in vals)


def _attempt(probe: Callable[[], str]) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return probe()
    except Exception as exc:
        return f"raises {type(exc).__name__}: {' '.join(str(exc).split())}"


def observe_facts() -> list[Fact]:
    """Run the installed PyTorch on the edge cases where systems disagree, and say what it does."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[1] = False  # row 1 sees no key
    row = Case(Shape(1, 2, 2, 4, 4, 8), torch.float32)
    masked_case = Case(row.shape, torch.float16, DenseMask(keep), "empty_rows")
    facts: list[Fact] = []

    def add(system: str, question: str, probe: Callable[[], str]) -> None:
        facts.append(Fact(system, question, _attempt(probe)))

    def math_row() -> str:
        qg = q.clone().requires_grad_(True)
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=keep)
        o.sum().backward()
        assert qg.grad is not None
        return f"O {_describe(o[0, :, 1])}, dQ {_describe(qg.grad[0, :, 1])}"

    def math_half() -> str:
        q16, k16, v16 = (t.half() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.MATH):
            o16 = F.scaled_dot_product_attention(q16, k16, v16)
            o32 = F.scaled_dot_product_attention(q16.float(), k16.float(), v16.float())
        same = torch.equal(o16, o32.half())
        return "computes in float32, rounds once" if same else "differs from float32 rounded once"

    def flash_row() -> str:
        o, lse = systems.cpu_flash_op(q.half(), k.half(), v.half(), masked_case)
        return f"O {_describe(o[0, :, 1])}, LSE {_describe(lse[0, :, 1])} (LSE dtype {dtype_name(lse.dtype)})"

    def flash_causal() -> str:
        lq, lk = 3, 2
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(
                q[:, :, :lq], k[:, :, :lk], v[:, :, :lk], is_causal=True
            )
        row0 = o[0, 0, 0]
        return "top-left (row 0 sees key 0)" if torch.allclose(row0, v[0, 0, 0]) else "bottom-right"

    def flash_dv() -> str:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v[..., :5])
        return "runs"

    def lower_right() -> str:
        lq, lk = 4, 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            o = F.scaled_dot_product_attention(
                q, k[:, :, :lk], v[:, :, :lk], attn_mask=causal_lower_right(lq, lk)
            )
        said = [str(w.message) for w in caught if "NaN" in str(w.message)]
        warn = f" (it warns: {said[0]!r})" if said else ""
        return f"rows 0-{lq - lk - 1} give O {_describe(o[0, :, : lq - lk])}{warn}"

    def flex_row() -> str:
        o, lse = systems.flex_forward(q.half(), k.half(), v.half(), masked_case)
        return f"O {_describe(o[0, :, 1])}, LSE {_describe(lse[0, :, 1])} (LSE dtype {dtype_name(lse.dtype)})"

    def flex_bwd() -> str:
        qg = q.clone().requires_grad_(True)
        o, _ = systems.flex_backward(qg, k, v, row)
        o.sum().backward()
        return "runs"

    def flex_ragged() -> str:
        everything = DenseMask(torch.ones(130, 130, dtype=torch.bool))
        full_case = Case(Shape(1, 1, 1, 130, 130, 8), torch.float32, everything, "all")
        classes = systems.flex_tile_classes(full_case, 128, 128)
        names = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}
        return (
            f"an all-True 130x130 mask in 128x128 tiles: tile (0,0) {names[int(classes[0, 0])]}, "
            f"ragged tiles {sorted({names[int(c)] for c in classes.reshape(-1)[1:].tolist()})}"
        )

    def naive_row() -> str:
        s = torch.full((4,), -math.inf)
        return f"softmax of an all -inf row gives {_describe(torch.softmax(s, dim=-1))}"

    add("SDPA math", "fully-masked row (bool mask)", math_row)
    add("SDPA math", "float16 inputs", math_half)
    add("SDPA flash (CPU kernel)", "fully-masked row (float16)", flash_row)
    add("SDPA flash (CPU kernel)", "is_causal=True with Lq=3 > Lk=2", flash_causal)
    add("SDPA flash (CPU kernel)", "V head dim 5 != Q/K head dim 8", flash_dv)
    add("SDPA causal_lower_right", "Lq=4 > Lk=2: the first rows see no key", lower_right)
    add("FlexAttention eager", "fully-masked row (float16)", flex_row)
    add("FlexAttention eager", "backward on CPU", flex_bwd)
    add("Flex BlockMask", "tiles on a ragged edge", flex_ragged)
    add("plain torch.softmax", "fully-masked row", naive_row)
    return facts


# ----------------------------------------------------------------------------------------
# the matrix
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _System:
    name: str
    fn: AttentionFn
    conventions: Conventions
    masks: tuple[str, ...] = MASK_KINDS
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    grads: bool = True
    lse: bool = True


def _flashledger(loop_order: str, block_q: int, block_k: int) -> AttentionFn:
    def fn(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = flash_attention(
            q,
            k,
            v,
            mask=case.mask,
            scale=case.scale,
            conventions=case.conventions,
            block_q=block_q,
            block_k=block_k,
            loop_order=loop_order,  # type: ignore[arg-type]
            return_lse=True,
        )
        return o, lse

    fn.__name__ = f"flashledger {loop_order} {block_q}x{block_k}"
    return fn


def _systems(quick: bool) -> list[_System]:
    """The systems of the matrix.

    ``quick`` runs flashledger's non-seed presets in float64 only (they differ
    from the seed only at the edges, which no dtype changes), its fa1 order in
    float32/float64, and FlexAttention in bfloat16/float32.
    """
    flex_dtypes = (torch.bfloat16, torch.float32) if quick else ALL_DTYPES
    fa2, fa1 = _flashledger("fa2", 64, 32), _flashledger("fa1", 32, 64)
    out: list[_System] = []
    for conv in PRESETS.values():
        dtypes = ALL_DTYPES if conv is SEED or not quick else (torch.float64,)
        out.append(_System("flashledger fa2 64x32", fa2, conv, dtypes=dtypes))
        if not quick or conv is SEED:
            fa1_dtypes = (torch.float32, torch.float64) if quick else dtypes
            out.append(_System("flashledger fa1 32x64", fa1, conv, dtypes=fa1_dtypes))
    causal_tl, causal_br = ("causal_top_left",), ("causal_bottom_right",)
    out += [
        _System("SDPA math", systems.sdpa_math, SDPA_CPU, lse=False),
        _System("SDPA flash (CPU kernel)", systems.sdpa_flash, SDPA_CPU, lse=False),
        _System("aten CPU flash op", systems.cpu_flash_op, SDPA_CPU),
        _System(
            "SDPA is_causal=True", systems.sdpa_is_causal, SDPA_CPU, masks=causal_tl, lse=False
        ),
        _System(
            "SDPA causal_upper_left",
            systems.sdpa_causal_upper_left,
            SDPA_CPU,
            masks=causal_tl,
            lse=False,
        ),
        _System(
            "SDPA causal_lower_right",
            systems.sdpa_causal_lower_right,
            SDPA_CPU,
            masks=causal_br,
            lse=False,
        ),
        _System(
            "FlexAttention eager",
            systems.flex_forward,
            FLEX_ATTENTION,
            dtypes=flex_dtypes,
            grads=False,
        ),
    ]
    return out


MP_SHAPES: tuple[Shape, ...] = (
    Shape(1, 2, 1, 12, 12, 4),
    Shape(1, 2, 2, 5, 12, 3),
    Shape(2, 2, 1, 12, 7, 5),
    Shape(1, 2, 2, 9, 11, 8, 3),
)
"""Tiny shapes for the 50-digit oracle (every length <= 12)."""


def _mp_rows(quick: bool) -> list[VerifyRow]:
    shapes = MP_SHAPES[:2] if quick else MP_SHAPES
    masks = ("causal_bottom_right", "empty_rows") if quick else MASK_KINDS
    rows = []
    for i, shape in enumerate(shapes):
        for kind in masks:
            case = make_case(shape, kind, torch.float64, seed=100 + i)
            want = mp_attention(case)
            q, k, v, do = case.inputs()
            opts: dict[str, Any] = {
                "mask": case.mask,
                "scale": case.scale,
                "conventions": case.conventions,
            }
            ref = reference_forward(q, k, v, **opts)
            ref_b = reference_backward(q, k, v, ref.o, ref.lse, do, **opts)
            fwd = blocked_forward(q, k, v, **opts, block_q=4, block_k=4)
            bwd = blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, block_q=4, block_k=4)
            blocked = (fwd.o, fwd.lse, bwd.dq, bwd.dk, bwd.dv)
            rows.append(
                _mp_row(
                    "mpmath vs reference",
                    case,
                    (ref.o, ref.lse, ref_b.dq, ref_b.dk, ref_b.dv),
                    want,
                )
            )
            rows.append(_mp_row("mpmath vs blocked 4x4", case, blocked, want))
    return rows


def _mp_row(system: str, case: Case, got: tuple[torch.Tensor, ...], want: MpResult) -> VerifyRow:
    names = ("O", "LSE", "dQ", "dK", "dV")
    parts = (want.o, want.lse, want.dq, want.dk, want.dv)
    measured = [(name, *ulps(g, w)) for name, g, w in zip(names, got, parts)]
    name, err, index = max(measured, key=lambda m: m[1])
    passed = err <= MP_ULP_BOUND
    where = ", ".join(str(i) for i in index)
    return VerifyRow(
        system=system,
        convention=case.conventions.name,
        case=case.name,
        dtype="float64",
        checked=" ".join(names),
        worst=name,
        error=err,
        bound=MP_ULP_BOUND,
        status="passed" if passed else "failed",
        unit="ulp",
        detail=""
        if passed
        else f"case {case.name}: {name}[{where}] is {err:.3g} ulps from the {MP_DIGITS}-digit answer",
    )


def _tile_rows(quick: bool) -> list[VerifyRow]:
    shapes = (
        QUICK_SHAPES
        if quick
        else (*QUICK_SHAPES, Shape(1, 2, 2, 257, 257, 8), Shape(1, 2, 2, 300, 200, 8))
    )
    blocks = ((128, 128), (16, 32))
    rows = []
    for shape in shapes:
        for kind in MASK_KINDS[1:]:
            case = make_case(shape, kind, torch.float32, conventions=FLEX_ATTENTION)
            for bq, bk in blocks:
                theirs = systems.flex_tile_classes(case, bq, bk)
                ours = systems.ledger_tile_classes_for_flex(case, bq, bk)
                diff = int((theirs != ours).sum())
                where = f"{case.mask_name} B{shape.batch} {shape.len_q}x{shape.len_k} @{bq}x{bk}"
                detail = (
                    f"{diff} of {theirs.numel()} tiles differ: flex {theirs.tolist()} vs "
                    f"flashledger {ours.tolist()}"
                    if diff
                    else ""
                )
                conv = case.conventions.name
                rows.append(
                    count_row("Flex BlockMask tiles", conv, where, "tile classes", diff, detail)
                )
    return rows


def _flex_backward_rows(quick: bool) -> list[VerifyRow]:
    dtypes = (torch.float32,) if quick else ALL_DTYPES
    rows = []
    for dt in dtypes:
        case = make_case(QUICK_SHAPES[0], "causal_top_left", dt, conventions=FLEX_ATTENTION)
        result = check_case(systems.flex_backward, baseline(case), check_grads=True, check_lse=True)
        rows.append(_row("FlexAttention backward", result))
    return rows


DECODE_SHAPES: tuple[Shape, ...] = (Shape(2, 8, 2, 1, 300, 64), Shape(1, 4, 1, 3, 257, 24))
"""Decode shapes: a few query rows (GQA, MQA) against many keys, for the native step's
decode form (a group's heads as one block of rows, the key tiles split, K read in place)."""


def _decode_system() -> _System:
    """flashledger on decode shapes, with key tiles of 64 so that each row's keys split."""
    fn = _flashledger("fa2", 64, 64)
    fn.__name__ = "flashledger decode"
    masks = ("none", "causal_bottom_right", "padding")
    return _System("flashledger decode (split keys)", fn, SEED, masks=masks)


def _plan(quick: bool) -> list[tuple[Case, list[_System]]]:
    """Each case of the sweep with the systems that run it (the oracle is computed once per case)."""
    sys_list = _systems(quick)
    shapes = QUICK_SHAPES if quick else None
    plan: list[tuple[Case, list[_System]]] = []
    for conv in {s.conventions.name: s.conventions for s in sys_list}.values():
        for case in attention_cases(conventions=conv, shapes=shapes, quick=quick):
            users = [
                s
                for s in sys_list
                if s.conventions is conv and case.mask_name in s.masks and case.dtype in s.dtypes
            ]
            if users:
                plan.append((case, users))
    dec = _decode_system()
    shapes = DECODE_SHAPES[:1] if quick else DECODE_SHAPES
    for case in attention_cases(conventions=SEED, shapes=shapes, masks=dec.masks, gqa=True):
        plan.append((case, [dec]))
    return plan


EXTRA_STEPS = (
    6  # observed facts, FlexAttention backward and tiles, flash-attn edges, Flex model, mpmath
)


def matrix_steps(*, quick: bool = False) -> int:
    """How many times ``run_matrix`` calls ``progress``."""
    return len(_plan(quick)) + EXTRA_STEPS


def run_matrix(
    *, quick: bool = False, progress: Callable[[int, int, str], None] | None = None
) -> VerifyReport:
    """Run every system x preset x mask x dtype x shape; return the report.

    ``progress(done, total, label)`` is called after each step. ``quick`` uses
    three shapes, fewer dtypes for flashledger's non-seed presets, its fa1
    order and FlexAttention, and a smaller mpmath and tile set.
    """
    start = time.perf_counter()
    report = VerifyReport(quick=quick)
    plan = _plan(quick)
    total = len(plan) + EXTRA_STEPS
    done = 0

    def step(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    with warnings.catch_warnings(), _one_thread():
        warnings.simplefilter("ignore", UserWarning)
        report.facts = observe_facts()
        step("observed facts")
        for case, users in plan:
            base = baseline(case)
            for s in users:
                result = check_case(s.fn, base, check_grads=s.grads, check_lse=s.lse)
                report.rows.append(_row(s.name, result))
            step(case.name)
        report.rows += _flex_backward_rows(quick)
        step("FlexAttention backward")
        report.rows += _tile_rows(quick)
        step("FlexAttention tiles")
        report.rows += flash_attn_edge_rows(quick)
        step("flash-attn edges")
        report.rows += flex_rows(quick=quick)
        step("Flex programming model")
        report.rows += _mp_rows(quick)
        step("mpmath")
    report.seconds = time.perf_counter() - start
    return report


# ----------------------------------------------------------------------------------------
# command line hooks
# ----------------------------------------------------------------------------------------
def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--quick``, ``--json`` and ``--html PATH`` to the ``verify`` sub-command."""
    parser.add_argument(
        "--quick", action="store_true", help="a smaller sweep (well under a minute)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print every row as JSON instead of the table"
    )
    parser.add_argument(
        "--html", metavar="PATH", help="also write a standalone HTML report to PATH"
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run the matrix with a progress bar, print the table (or JSON), write HTML if asked.

    Returns 1 when any row failed, 0 otherwise; 2 (with a one-line message on
    standard error) when the ``--html`` path cannot be written.
    """
    import sys

    from ._progress import make_console, output_problem, progress, write_file

    html_path = getattr(args, "html", None)
    if html_path is not None:
        problem = output_problem(html_path)
        if problem:
            print(
                f"flashledger verify: error: cannot write --html {html_path}: {problem}",
                file=sys.stderr,
            )
            return 2
    quick = bool(getattr(args, "quick", False))
    with progress("verify", total=matrix_steps(quick=quick)) as advance:
        report = run_matrix(quick=quick, progress=lambda done, total, label: advance(1))
    if getattr(args, "json", False):
        print(report.to_json())
    else:
        report.print_to(make_console())
    if html_path:
        try:
            write_file(html_path, report.to_html().encode("utf-8"))
        except OSError as exc:
            print(f"flashledger verify: {exc.strerror}", file=sys.stderr)
            return 2
    return 0 if report.passed else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m flashledger.verify", description="run the verification matrix"
    )
    add_cli_arguments(_parser)
    raise SystemExit(run_cli(_parser.parse_args()))
