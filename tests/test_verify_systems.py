"""Live cross-checks: each PyTorch system on CPU is reproduced by its flashledger preset.

Every check runs the installed PyTorch (2.13 CPU) and compares its observable
O, LSE and gradients with the float64 oracle under the matching preset; the
edge behaviour (fully-masked rows, causal alignment) is asserted explicitly.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashledger as fl
from flashledger import _verify_systems as systems
from flashledger._verify_mp import mp_attention, ulps
from flashledger._verify_rule import baseline, check_case
from flashledger.masks import EMPTY, FULL, PARTIAL
from flashledger.verify import (
    MASK_KINDS,
    MP_ULP_BOUND,
    Case,
    Shape,
    assert_attention_close,
    make_case,
    observe_facts,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SMALL = (Shape(1, 2, 2, 37, 45, 5), Shape(2, 4, 2, 45, 37, 8))
"""Both ``Lq != Lk`` directions, an odd head dim and GQA; small enough to be quick."""


def _cases(
    kinds: tuple[str, ...], conventions: fl.Conventions, dtypes=(torch.float32,)
) -> list[Case]:
    return [
        make_case(shape, kind, dt, conventions=conventions)
        for shape in SMALL
        for kind in kinds
        for dt in dtypes
    ]


# -- SDPA ---------------------------------------------------------------------------------
def test_sdpa_math_matches_sdpa_cpu_preset() -> None:
    cases = _cases(MASK_KINDS, fl.SDPA_CPU, dtypes=(torch.float16, torch.float64))
    report = assert_attention_close(systems.sdpa_math, cases=cases, check_lse=False)
    assert report.passed and len(report.rows) == 24
    assert {r.checked for r in report.rows} == {"O dQ dK dV"}


def test_sdpa_flash_kernel_and_its_lse_match_sdpa_cpu_preset() -> None:
    cases = _cases(MASK_KINDS, fl.SDPA_CPU)
    assert assert_attention_close(systems.sdpa_flash, cases=cases).passed
    report = assert_attention_close(systems.cpu_flash_op, cases=cases)
    assert {r.checked for r in report.rows} == {"O LSE dQ dK dV"}


def test_cpu_flash_kernel_fully_masked_rows_give_zero_output_and_zero_lse() -> None:
    case = make_case(SMALL[0], "empty_rows", torch.float32, conventions=fl.SDPA_CPU)
    q, k, v, _ = case.inputs()
    o, lse = systems.cpu_flash_op(q, k, v, case)
    empty = ~case.dense_mask().any(dim=-1)  # (B, Hq, Lq)
    assert bool(empty.any())
    assert bool((o[empty] == 0).all()), "O of a fully-masked row must be exactly 0"
    assert bool((lse[empty] == 0).all()), (
        f"LSE of fully-masked rows: {lse[empty].unique().tolist()}"
    )
    # the same kernel is *not* the seed convention: LSE 0 is not -inf
    wrong = Case(case.shape, case.dtype, case.mask, case.mask_name, fl.SEED)
    result = check_case(systems.cpu_flash_op, baseline(wrong), check_grads=False)
    assert result.status == "failed" and result.worst is not None and result.worst.quantity == "LSE"
    assert "got 0, oracle -inf" in result.message()


def test_a_wrong_finite_lse_on_fully_masked_rows_fails() -> None:
    def lse_half(q, k, v, case):  # right everywhere but on fully-masked rows: 0.5 instead of 0
        o, lse = systems.cpu_flash_op(q, k, v, case)
        empty = ~case.dense_mask().any(dim=-1)  # (B, Hq, Lq)
        return o, lse.masked_fill(empty, 0.5)

    case = make_case(SMALL[0], "empty_rows", torch.float32, conventions=fl.SDPA_CPU)
    result = check_case(lse_half, baseline(case), check_grads=False)
    assert result.status == "failed" and "got 0.5, oracle 0" in result.message()


def test_flash_kernel_needs_equal_head_dims_and_says_so() -> None:
    case = make_case(Shape(1, 2, 2, 9, 7, 6, 10), "none", torch.float32, conventions=fl.SDPA_CPU)
    for fn in (systems.sdpa_flash, systems.cpu_flash_op):
        result = check_case(fn, baseline(case))
        assert result.status == "unsupported", result.message()
        assert "needs one head dim for Q, K and V (here d=6, d_v=10)" in result.error
    assert check_case(systems.sdpa_math, baseline(case)).passed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_causal_alignments_of_sdpa(dtype: torch.dtype) -> None:
    top_left = _cases(("causal_top_left",), fl.SDPA_CPU, dtypes=(dtype,))
    bottom_right = _cases(("causal_bottom_right",), fl.SDPA_CPU, dtypes=(dtype,))
    for fn in (systems.sdpa_is_causal, systems.sdpa_causal_upper_left):
        assert assert_attention_close(fn, cases=top_left).passed
        with pytest.raises(AssertionError, match="causal_bottom_right"):
            assert_attention_close(fn, cases=bottom_right, check_grads=False)
    assert assert_attention_close(systems.sdpa_causal_lower_right, cases=bottom_right).passed
    with pytest.raises(AssertionError, match="causal_top_left"):
        assert_attention_close(systems.sdpa_causal_lower_right, cases=top_left, check_grads=False)


def test_causal_lower_right_with_more_queries_than_keys_gives_zero_rows() -> None:
    case = make_case(SMALL[1], "causal_bottom_right", torch.float32, conventions=fl.SDPA_CPU)
    q, k, v, _ = case.inputs()
    o = systems.sdpa_causal_lower_right(q, k, v, case)
    first = 45 - 37  # rows 0..7 see no key under bottom-right alignment
    assert bool((o[:, :, :first] == 0).all()) and not bool(torch.isnan(o).any())
    assert bool((o[:, :, first:].abs().sum(dim=-1) > 0).all())


# -- FlexAttention ------------------------------------------------------------------------
def test_flex_forward_matches_flex_preset_with_lse() -> None:
    cases = _cases(MASK_KINDS, fl.FLEX_ATTENTION, dtypes=(torch.bfloat16,))
    report = assert_attention_close(systems.flex_forward, cases=cases, check_grads=False)
    assert report.passed and {r.checked for r in report.rows} == {"O LSE"}


def test_flex_fully_masked_rows_have_lse_minus_inf() -> None:
    case = make_case(SMALL[1], "causal_bottom_right", torch.float32, conventions=fl.FLEX_ATTENTION)
    q, k, v, _ = case.inputs()
    o, lse = systems.flex_forward(q, k, v, case)
    assert bool(torch.isneginf(lse[:, :, :8]).all()) and bool(torch.isfinite(lse[:, :, 8:]).all())
    assert bool((o[:, :, :8] == 0).all())
    wrong = Case(case.shape, case.dtype, case.mask, case.mask_name, fl.SDPA_CPU)
    result = check_case(systems.flex_forward, baseline(wrong, grads=False), check_grads=False)
    assert result.status == "failed" and "got -inf, oracle 0" in result.message()


def test_flex_backward_is_reported_unsupported_on_cpu() -> None:
    case = make_case(SMALL[0], "none", torch.float32, conventions=fl.FLEX_ATTENTION)
    result = check_case(systems.flex_backward, baseline(case))
    assert result.status == "unsupported"
    assert "NotImplementedError" in result.error and "backward on CPU" in result.error


@pytest.mark.parametrize("kind", MASK_KINDS[1:])
def test_flex_block_mask_tiles_match_flashledger(kind: str) -> None:
    for shape in (Shape(2, 2, 2, 130, 200, 8), Shape(1, 2, 2, 200, 130, 8)):
        case = make_case(shape, kind, torch.float32, conventions=fl.FLEX_ATTENTION)
        for bq, bk in ((128, 128), (16, 32)):
            theirs = systems.flex_tile_classes(case, bq, bk)
            ours = systems.ledger_tile_classes_for_flex(case, bq, bk)
            assert torch.equal(theirs, ours), (
                f"{case.name} {bq}x{bk}: {theirs.tolist()} vs {ours.tolist()}"
            )
            assert set(theirs.unique().tolist()) <= {EMPTY, PARTIAL, FULL}


def test_flex_never_calls_a_ragged_tile_full() -> None:
    case = make_case(Shape(1, 1, 1, 130, 130, 8), "none", torch.float32)
    full_mask = Case(
        case.shape, case.dtype, fl.DenseMask(torch.ones(130, 130, dtype=torch.bool)), "all"
    )
    theirs = systems.flex_tile_classes(full_mask, 128, 128)
    assert theirs.tolist() == [[FULL, PARTIAL], [PARTIAL, PARTIAL]]
    raw = full_mask.mask.tile_classes(130, 130, 128, 128)  # flashledger: only real positions count
    assert raw.tolist() == [[FULL, FULL], [FULL, FULL]]
    assert torch.equal(systems.ledger_tile_classes_for_flex(full_mask, 128, 128), theirs)


# -- facts observed in this PyTorch -------------------------------------------------------
def test_observed_facts() -> None:
    facts = {(f.system, f.question): f.observed for f in observe_facts()}
    assert facts[("SDPA math", "fully-masked row (bool mask)")] == "O 0, dQ 0"
    assert facts[("SDPA math", "float16 inputs")] == "computes in float32, rounds once"
    assert facts[("SDPA flash (CPU kernel)", "fully-masked row (float16)")] == (
        "O 0, LSE 0 (LSE dtype float32)"
    )
    assert facts[("SDPA flash (CPU kernel)", "is_causal=True with Lq=3 > Lk=2")].startswith(
        "top-left"
    )
    assert facts[("FlexAttention eager", "fully-masked row (float16)")] == (
        "O 0, LSE -inf (LSE dtype float32)"
    )
    assert "NotImplementedError" in facts[("FlexAttention eager", "backward on CPU")]
    assert facts[("plain torch.softmax", "fully-masked row")].endswith("NaN")
    assert "ragged tiles ['partial']" in facts[("Flex BlockMask", "tiles on a ragged edge")]
    lower_right = facts[("SDPA causal_lower_right", "Lq=4 > Lk=2: the first rows see no key")]
    assert lower_right.startswith("rows 0-1 give O 0")


# -- 50 digits ----------------------------------------------------------------------------
TINY = (Shape(1, 2, 1, 12, 12, 4), Shape(2, 2, 2, 5, 11, 3), Shape(1, 2, 2, 9, 7, 8, 3))


@pytest.mark.parametrize("kind", ["none", "causal_bottom_right", "window", "empty_rows"])
def test_float64_blocked_is_within_16_ulps_of_50_digits(kind: str) -> None:
    for i, shape in enumerate(TINY):
        case = make_case(shape, kind, torch.float64, seed=i)
        want = mp_attention(case)
        q, k, v, do = case.inputs()
        opts = {"mask": case.mask, "scale": case.scale, "conventions": case.conventions}
        fwd = fl.blocked_forward(q, k, v, **opts, block_q=4, block_k=3)
        bwd = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts, block_q=4, block_k=3)
        for name, got, exact in (
            ("O", fwd.o, want.o), ("LSE", fwd.lse, want.lse),
            ("dQ", bwd.dq, want.dq), ("dK", bwd.dk, want.dk), ("dV", bwd.dv, want.dv),
        ):  # fmt: skip
            err, index = ulps(got, exact)
            assert err <= MP_ULP_BOUND, (
                f"{case.name}: {name}[{index}] is {err:.2f} ulps from the 50-digit answer"
            )


def test_ulps_detects_float32_precision_and_wrong_special_values() -> None:
    case = make_case(TINY[0], "empty_rows", torch.float64)
    want = mp_attention(case)
    q, k, v, _ = case.inputs()
    ref = fl.reference_forward(q, k, v, mask=case.mask, scale=case.scale)
    err32, _ = ulps(ref.o.float().double(), want.o)
    assert err32 > 1e4, f"a float32-rounded O should be far more than a few ulps off, got {err32}"
    lse = ref.lse.clone()
    lse[0, 0, 0] = 0.0  # the row is fully masked: the seed says -inf
    err, index = ulps(lse, want.lse)
    assert math.isinf(err) and index == (0, 0, 0)


def test_mpmath_oracle_rejects_long_sequences() -> None:
    with pytest.raises(ValueError, match="sequence lengths <= 12"):
        mp_attention(make_case(Shape(1, 1, 1, 13, 4, 2), "none", torch.float64))
