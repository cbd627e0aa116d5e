"""``assert_attention_close``: it passes correct kernels and names what is wrong in broken ones."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
import torch.nn.functional as F

import flashledger as fl
from flashledger._verify_rule import baseline
from flashledger.verify import (
    ALL_DTYPES,
    MASK_KINDS,
    Case,
    Shape,
    assert_attention_close,
    attention_cases,
    lse_from_base2,
    lse_to_base2,
    make_case,
    naive_attention,
)

LQ_LT_LK = Shape(1, 2, 2, 97, 113, 5)
LQ_GT_LK = Shape(2, 4, 2, 113, 97, 7)


def flashledger_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case):
    """flashledger's blocked loop through autograd, with ragged 32 x 16 tiles."""
    return fl.flash_attention(
        q, k, v, mask=case.mask, scale=case.scale, conventions=case.conventions,
        block_q=32, block_k=16, return_lse=True,
    )  # fmt: skip


def sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=case.dense_mask(), scale=case.scale, enable_gqa=case.shape.gqa
    )


def _repeat_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


# -- correct implementations pass ---------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_flash_attention_passes_in_every_dtype(dtype: torch.dtype) -> None:
    report = assert_attention_close(flashledger_fn, dtypes=(dtype,), quick=True)
    assert report.passed
    assert len(report.rows) == 25  # 3 shapes x 6 masks, a large-score case per mask, a long row
    assert all(r.checked == "O LSE dQ dK dV" for r in report.rows), {r.checked for r in report.rows}


@pytest.mark.parametrize("preset", [fl.FLASH_ATTN_2, fl.FLEX_ATTENTION], ids=lambda c: c.name)
def test_blocked_forward_passes_under_other_presets(preset: fl.Conventions) -> None:
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case):
        res = fl.blocked_forward(
            q.detach(),  # forward only: no gradients to judge
            k.detach(),
            v.detach(),
            mask=case.mask,
            scale=case.scale,
            conventions=case.conventions,
            block_q=16,
            block_k=32,
        )
        return res.o, res.lse

    report = assert_attention_close(
        forward, conventions=preset, dtypes=(torch.float32,), quick=True
    )
    assert (
        report.passed and len(report.rows) == 18 + 6 + 1
    )  # a large-score case per mask, a long row
    assert all("gradients not checked" in r.detail for r in report.rows), report.rows[0].detail


def test_sdpa_passes_under_sdpa_cpu() -> None:
    report = assert_attention_close(
        sdpa_fn, conventions=fl.SDPA_CPU, dtypes=(torch.bfloat16, torch.float32), quick=True
    )
    assert (
        report.passed and len(report.rows) == 36 + 12 + 2
    )  # large scores per mask and dtype, long rows
    assert all("LSE not returned" in r.detail for r in report.rows)


def test_full_sweep_covers_the_shapes_that_break_tiling() -> None:
    cases = attention_cases()
    lengths = {c.shape.len_q for c in cases} | {c.shape.len_k for c in cases}
    assert {1, 2, 97, 113, 257} <= lengths
    assert any(c.shape.len_q > c.shape.len_k for c in cases)
    assert any(c.shape.len_q < c.shape.len_k for c in cases)
    assert any(c.shape.head_dim % 2 for c in cases) and any(c.shape.gqa for c in cases)
    assert any(c.shape.head_dim_v != c.shape.head_dim for c in cases)
    assert {c.dtype for c in cases} == set(ALL_DTYPES)
    assert (
        len(cases) == 8 * 6 * 4 + 6 * 4 + 4
    )  # a large-score case per mask and dtype, a long row per dtype
    long = [c for c in cases if c.shape.len_k == 4097]
    assert [c.dtype for c in long] == list(ALL_DTYPES), [c.name for c in long]
    large = [c for c in cases if not c.default_scale]
    assert [c.dtype for c in large] == list(ALL_DTYPES) * 6, [c.name for c in large]
    assert [c.mask_name for c in large[::4]] == list(MASK_KINDS), [c.name for c in large]
    assert all(" B1 H4/2 257x257 d8 " in c.name for c in large), large
    assert all(" scale 133 " in c.name for c in large), [c.name for c in large]
    assert len(attention_cases(large_scores=False, long_rows=False)) == 8 * 6 * 4
    assert not any(c.shape.gqa for c in attention_cases(gqa=False))


# -- broken implementations fail, and the message says where --------------------------------
def _failure(fn, cases: list[Case], **kw) -> str:
    with pytest.raises(AssertionError) as info:
        assert_attention_close(fn, cases=cases, **kw)
    return str(info.value)


def _worst_index(message: str, quantity: str) -> tuple[int, ...]:
    found = re.search(rf"worst element {quantity}\[([0-9, ]+)\]", message)
    assert found, f"no worst element of {quantity} in:\n{message}"
    return tuple(int(i) for i in found.group(1).split(","))


def test_wrong_causal_alignment_fails() -> None:
    def top_left_always(q, k, v, case):
        k, v = _repeat_kv(q, k, v)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=case.align is not None, scale=case.scale
        )

    case = make_case(LQ_LT_LK, "causal_bottom_right", torch.float32)
    msg = _failure(top_left_always, [case], check_grads=False)
    assert "1 of 1 cases" in msg and case.name in msg
    assert "O differs from the float64 oracle" in msg
    assert re.search(r"got -?[0-9.e+-]+, oracle -?[0-9.e+-]+", msg), msg
    assert re.search(r"error \S+ > bound \S+ = 2 x naive float32 error \S+ \+ floor \S+", msg), msg
    # the same callable is right for the top-left case
    assert assert_attention_close(
        top_left_always,
        cases=[make_case(LQ_LT_LK, "causal_top_left", torch.float32)],
        check_grads=False,
    ).passed


def test_nan_on_fully_masked_rows_fails() -> None:
    def naive_softmax(q, k, v, case):
        k, v = _repeat_kv(q, k, v)
        s = (q @ k.transpose(-2, -1)) * case.scale
        s = s.masked_fill(~case.dense_mask(), -math.inf)
        return torch.softmax(s, dim=-1) @ v  # an all -inf row gives NaN

    case = make_case(LQ_GT_LK, "empty_rows", torch.float32)
    msg = _failure(naive_softmax, [case], check_grads=False)
    assert "empty_rows" in msg and "got nan, oracle 0" in msg and "error inf" in msg
    b, h, i, _ = _worst_index(msg, "O")
    assert not bool(case.dense_mask()[b, h, i].any()), (
        f"row {(b, h, i)} of the message is not fully masked"
    )


def test_finite_mask_value_fails_on_fully_masked_rows() -> None:
    def minus_1e6(q, k, v, case):  # the Triton tutorial's masking: a finite -1e6
        k, v = _repeat_kv(q, k, v)
        s = (q @ k.transpose(-2, -1)) * case.scale
        s = s.masked_fill(~case.dense_mask(), -1.0e6)
        return torch.softmax(s, dim=-1) @ v

    partial = make_case(LQ_LT_LK, "padding", torch.float32)
    assert assert_attention_close(minus_1e6, cases=[partial], check_grads=False).passed
    case = make_case(LQ_LT_LK, "empty_rows", torch.float32)
    msg = _failure(minus_1e6, [case], check_grads=False)
    b, h, i, c = _worst_index(msg, "O")
    assert not bool(case.dense_mask()[b, h, i].any()), (
        "the worst element must sit in a fully-masked row"
    )
    assert "oracle 0\n" in msg


def test_base2_lse_fails_and_converted_passes() -> None:
    def base2(q, k, v, case):
        o, lse = flashledger_fn(q, k, v, case)
        return o, lse_to_base2(lse)

    case = make_case(LQ_LT_LK, "causal_top_left", torch.float32)
    msg = _failure(base2, [case], check_grads=False)
    assert "LSE differs from the float64 oracle" in msg
    idx = _worst_index(msg, "LSE")
    assert len(idx) == 3  # (B, Hq, Lq)

    def converted(q, k, v, case):
        o, lse2 = base2(q, k, v, case)
        return o, lse_from_base2(lse2)

    assert assert_attention_close(converted, cases=[case], check_grads=False).passed


def test_dropped_scale_fails_and_names_the_worst_element() -> None:
    def unscaled(q, k, v, case):
        k, v = _repeat_kv(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=case.dense_mask(), scale=1.0)

    case = make_case(LQ_GT_LK, "none", torch.float64)
    msg = _failure(unscaled, [case])
    idx = _worst_index(msg, "O")
    q, k, v, _ = case.inputs()
    got = unscaled(q, k, v, case)
    want = fl.reference_forward(q, k, v, scale=case.scale).o
    err = (got - want).abs()
    assert idx == tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    assert f"got {got[idx].item():.6g}, oracle {want[idx].item():.6g}" in msg
    assert f"error {err.max().item():.3g} >" in msg


def test_a_softmax_without_its_row_maximum_fails_the_default_sweep() -> None:
    """exp(s) / sum exp(s) without subtracting the row's maximum is right at the default
    scale (scores under 10) and overflows at large ones: the sweep's large-score case of
    each dtype catches it, as inf or NaN in O, in every dtype, while the same softmax with
    the maximum subtracted passes them all."""

    def softmax_of(q, k, v, case, subtract):
        k, v = _repeat_kv(q, k, v)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # exp in float32
        s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * case.scale
        if case.dense_mask() is not None:
            s = s.masked_fill(~case.dense_mask(), -math.inf)
        if subtract:
            top = s.amax(-1, keepdim=True)
            s = s - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = s.exp()
        den = p.sum(-1, keepdim=True)
        o = torch.where(den > 0, p / torch.where(den > 0, den, 1), 0) @ v.to(acc)
        return o.to(q.dtype)

    def unsafe(q, k, v, case):
        return softmax_of(q, k, v, case, subtract=False)

    def safe(q, k, v, case):
        return softmax_of(q, k, v, case, subtract=True)

    plain = attention_cases(quick=True, masks=("none",), large_scores=False)
    assert assert_attention_close(unsafe, cases=plain, check_grads=False).passed, (
        "the default scale already overflows: the large-score cases add nothing"
    )
    assert assert_attention_close(safe, quick=True, check_grads=False).passed
    msg = _failure(unsafe, attention_cases(quick=True, masks=("none",)), check_grads=False)
    failed = re.findall(r"case (\S+ B\S+ \S+ \S+ \S+ \S+ scale 168) ", msg)
    assert "4 of 20 cases fail" in msg.splitlines()[0], msg.splitlines()[0]
    assert [name.split()[5] for name in failed] == ["float16", "bfloat16", "float32", "float64"]
    assert "got nan" in msg or "got inf" in msg, msg


def test_a_sweep_that_would_check_nothing_or_read_a_name_letter_by_letter_is_refused() -> None:
    with pytest.raises(ValueError, match="masks is empty: the sweep would check nothing"):
        assert_attention_close(sdpa_fn, masks=(), quick=True)
    with pytest.raises(ValueError, match="dtypes is empty"):
        assert_attention_close(sdpa_fn, dtypes=(), quick=True)
    with pytest.raises(TypeError, match=re.escape("got 'window' alone; write masks=('window',)")):
        assert_attention_close(sdpa_fn, masks="window", quick=True)
    with pytest.raises(TypeError, match=re.escape("write dtypes=(torch.float32,)")):
        assert_attention_close(sdpa_fn, dtypes=torch.float32, quick=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"float16, bfloat16, float32, float64, got torch\.float8"):
        assert_attention_close(sdpa_fn, dtypes=(torch.float8_e4m3fn,), quick=True)
    with pytest.raises(ValueError, match="the oracle's and the rule's dtypes"):
        Case(LQ_LT_LK, torch.float8_e4m3fn)


def test_a_case_built_by_hand_is_named_by_its_mask() -> None:
    """Without a mask_name, a case is named from its mask, not "none"."""
    assert Case(LQ_LT_LK, torch.float32, fl.Causal("bottom_right")).name.startswith(
        "causal_bottom_right B1"
    )
    assert Case(LQ_LT_LK, torch.float32, fl.Causal()).mask_name == "causal"
    assert Case(LQ_LT_LK, torch.float32).mask_name == "none"
    assert Case(LQ_LT_LK, torch.float32, fl.SlidingWindow(2, 0), "mine").mask_name == "mine"


def test_wrong_gradient_fails_on_the_gradient() -> None:
    class DetachV(torch.autograd.Function):  # forward right, dV forgotten
        @staticmethod
        def forward(ctx, v):  # type: ignore[override]
            return v.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return torch.zeros_like(grad)

    def no_dv(q, k, v, case):
        o, lse = flashledger_fn(q, k, DetachV.apply(v), case)
        return o, lse

    msg = _failure(no_dv, [make_case(LQ_LT_LK, "window", torch.float32)])
    assert "dV differs from the float64 oracle" in msg and "got 0," in msg
    assert "3 x naive float32 error" in msg


def test_contract_violations_are_named() -> None:
    case = make_case(LQ_LT_LK, "none", torch.float32)
    msg = _failure(lambda q, k, v, c: q[..., :2], [case])
    assert "fn returned O of shape (1, 2, 97, 2); expected (B, Hq, Lq, d_v) = (1, 2, 97, 5)" in msg
    msg = _failure(lambda q, k, v, c: "O", [case])
    assert "fn must return O or (O, LSE) as tensors, got str" in msg

    def raises(q, k, v, c):
        raise NotImplementedError("no GQA here")

    msg = _failure(raises, [case])
    assert "NotImplementedError: no GQA here" in msg and "masks=, gqa=, head_dim_v=" in msg


def test_bad_arguments_are_rejected_with_what_is_allowed() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        assert_attention_close("sdpa")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="unknown mask kind 'diagonal'; allowed: none, causal_top_left"
    ):
        assert_attention_close(sdpa_fn, masks=("diagonal",))
    with pytest.raises(ValueError, match="unknown preset 'flash'"):
        assert_attention_close(sdpa_fn, conventions="flash")
    with pytest.raises(ValueError, match="grad_factor must be a finite number >= 1"):
        assert_attention_close(sdpa_fn, grad_factor=0.5)
    with pytest.raises(TypeError, match="non-empty sequence"):
        assert_attention_close(sdpa_fn, cases=[])
    with pytest.raises(
        ValueError, match=r"Shape.heads_q \(3\) must be a multiple of heads_kv \(2\)"
    ):
        Shape(1, 3, 2, 4, 4, 8)


# -- the floor ----------------------------------------------------------------------------
TINY = (Shape(1, 2, 2, 1, 1, 8), Shape(2, 2, 2, 2, 2, 16), Shape(1, 2, 2, 257, 2, 12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rounding_of_any_back_end_passes_on_every_seed(dtype: torch.dtype) -> None:
    # rows that see one or two keys: the exact dS is 0 and the naive softmax's P is 1,
    # so the naive error is no yardstick and only the floor judges a kernel's roundings
    # (the rebuilt P = exp(S - λ), D against dP); a floor at the result's magnitude
    # failed some of these seeds on every back end, PyTorch's own flash kernel included
    cases = [
        make_case(shape, kind, dtype, conventions="flash_attn_2", seed=seed)
        for seed in range(0, 20_000, 1000)
        for shape in TINY
        for kind in ("none", "causal_bottom_right", "padding")
    ]
    for fn in (flashledger_fn, sdpa_fn):
        report = assert_attention_close(fn, cases=cases)
        assert max(r.error / r.bound for r in report.rows) < 0.6


def test_floor_is_derived_from_the_terms_and_the_exponent() -> None:
    case = make_case(Shape(1, 2, 2, 1, 1, 8), "none", torch.float64, conventions=fl.FLASH_ATTN_2)
    base = baseline(case)
    q, k, v, do = (t.to(torch.float64) for t in base.inputs)
    eps = torch.finfo(torch.float64).eps
    sigma = float(((q.abs() * k.abs()).sum(-1) * case.scale).max())  # one key per row
    lam = float(base.oracle["LSE"].abs().max())
    assert math.isclose(base.terms["e"], math.sqrt(8) * sigma, rel_tol=1e-12)
    assert math.isclose(base.terms["e_grad"], math.hypot(math.sqrt(8) * sigma, 2 * max(1, lam)))
    assert base.terms["dV"] == float(do.abs().max())  # dV = P dO with P = 1
    dq_terms = case.scale * float(
        ((do.abs() * (v.abs() + v.abs())).sum(-1, keepdim=True) * k.abs()).max()
    )
    assert math.isclose(base.terms["dQ"], dq_terms, rel_tol=1e-12)
    # one key: the exact dS is 0; the oracle's own float64 dQ keeps D's rounding
    assert float(base.oracle["dQ"].abs().max()) < 4 * eps * base.terms["dQ"]

    def kernel(shift: float, what: str):
        # a FlashAttention kernel whose rebuilt P is exp(shift) (dV off by shift)
        # or whose dS keeps a rounding of D (dQ off by shift at the terms' size)
        def fn(q, k, v, case):
            ref = fl.reference_forward(q, k, v, scale=case.scale, conventions=case.conventions)
            return _Shifted.apply(ref.o, q, v, what, shift), ref.lse

        return fn

    for what, terms in (("dV", base.terms["dV"]), ("dQ", base.terms["dQ"])):
        ok = assert_attention_close(kernel(4 * eps, what), cases=[case])
        assert ok.passed, what
        with pytest.raises(AssertionError, match=f"{what} differs"):
            assert_attention_close(kernel(1e-12, what), cases=[case])
        assert terms > 0


class _Shifted(torch.autograd.Function):
    """O passes through; dV = (1 + shift) dO, or dQ = shift (a rounding's worth) per entry."""

    @staticmethod
    def forward(ctx, o, q, v, what, shift):  # type: ignore[override]
        ctx.what, ctx.shift = what, shift
        ctx.save_for_backward(q, v)
        return o.clone()

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, v = ctx.saved_tensors
        if ctx.what == "dV":  # one key per row: dV = P dO with P = exp(shift)
            return None, None, do * (1 + ctx.shift), None, None
        return None, torch.full_like(q, ctx.shift), do, None, None


def test_cases_take_a_preset_by_name() -> None:
    named = attention_cases(conventions="flash_attn_2", dtypes=(torch.float32,), quick=True)
    assert named[0].conventions is fl.FLASH_ATTN_2 and "[flash_attn_2]" in named[0].name
    with pytest.raises(ValueError, match="unknown preset 'flash'"):
        attention_cases(conventions="flash")
    with pytest.raises(ValueError, match="unknown preset 'flash'"):
        make_case(LQ_LT_LK, "none", torch.float32, conventions="flash")


# -- the case object ----------------------------------------------------------------------
def test_case_hands_over_mask_both_ways_and_fixed_inputs() -> None:
    case = make_case(LQ_GT_LK, "causal_bottom_right", torch.bfloat16, conventions=fl.FLASH_ATTN_2)
    dense = case.dense_mask()
    assert dense is not None and dense.shape == (2, 4, 113, 97) and dense.dtype == torch.bool
    i = torch.arange(113)[:, None]
    j = torch.arange(97)[None, :]
    assert torch.equal(dense[1, 3], j <= i + 97 - 113)
    assert case.align == "bottom_right" and math.isclose(case.scale, 1 / math.sqrt(7))
    q, k, v, do = case.inputs()
    assert (q.shape, k.shape, v.shape, do.shape) == (
        (2, 4, 113, 7),
        (2, 2, 97, 7),
        (2, 2, 97, 7),
        (2, 4, 113, 7),
    )
    assert q.dtype == torch.bfloat16 and torch.equal(q, case.inputs()[0])
    assert case.name == "causal_bottom_right B2 H4/2 113x97 d7 bfloat16 [flash_attn_2]"
    window = make_case(LQ_GT_LK, "window", torch.float32, conventions=fl.SEED)
    assert (
        window.align == "top_left"
        and make_case(LQ_GT_LK, "none", torch.float32).dense_mask() is None
    )


def test_empty_rows_case_has_fully_masked_rows() -> None:
    case = make_case(LQ_LT_LK, "empty_rows", torch.float32)
    visible = case.dense_mask().any(dim=-1)  # (B, Hq, Lq)
    assert not bool(visible[..., 0].any()) and not bool(visible[..., 97 // 2].any())
    assert bool(visible.sum() > 90)


def test_naive_attention_rounds_in_its_dtype() -> None:
    case = make_case(LQ_LT_LK, "causal_top_left", torch.float16)
    q, k, v, _ = case.inputs()
    o16, _ = naive_attention(q, k, v, case)
    o64, _ = naive_attention(*(t.double() for t in (q, k, v)), case)
    err = (o16.double() - o64).abs().max().item()
    assert o16.dtype == torch.float16 and 1e-4 < err < 1e-2, err


# -- base-2 LSE ---------------------------------------------------------------------------
def test_lse_base2_round_trip_keeps_special_values() -> None:
    lse = torch.tensor([0.0, 1.5, -2.25, math.inf, -math.inf], dtype=torch.float64)
    lse2 = lse_to_base2(lse)
    assert torch.allclose(lse2[:3], lse[:3] / math.log(2), rtol=1e-15, atol=0)
    assert lse2[3] == math.inf and lse2[4] == -math.inf and lse2[0] == 0
    assert torch.allclose(lse_from_base2(lse2), lse, rtol=1e-15, atol=0)
    assert lse_to_base2(lse.float()).dtype == torch.float32


def triton_style_base2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case, *, block: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny blocked forward in the Triton tutorial's style: exp2, and LSE stored as m + log2(ℓ)."""
    k, v = _repeat_kv(q, k, v)
    qk_scale = case.scale * 1.4426950408889634  # scale * log2(e)
    dense = case.dense_mask()
    b, h, lq, _ = q.shape
    m = torch.full((b, h, lq), -math.inf)  # (B, H, Lq) running max, base 2
    ell = torch.zeros(b, h, lq)  # (B, H, Lq)
    acc = torch.zeros(b, h, lq, v.shape[-1])  # (B, H, Lq, d_v)
    for k0 in range(0, k.shape[2], block):
        s = (
            q.float() @ k[:, :, k0 : k0 + block].float().transpose(-2, -1)
        ) * qk_scale  # (B, H, Lq, bk)
        if dense is not None:
            s = s.masked_fill(~dense[..., k0 : k0 + block], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))  # (B, H, Lq)
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        alpha = torch.exp2(
            torch.where(torch.isinf(m), -math.inf, m - m_safe)
        )  # 0 for an empty state
        p = torch.exp2(s - m_safe[..., None])  # (B, H, Lq, bk)
        ell = alpha * ell + p.sum(dim=-1)
        acc = alpha[..., None] * acc + p @ v[:, :, k0 : k0 + block].float()
        m = m_new
    empty = ell == 0
    o = torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, ell)[..., None])
    lse2 = torch.where(empty, -math.inf, m + torch.log2(torch.where(empty, 1.0, ell)))
    return o.to(q.dtype), lse2


def test_tiny_base2_kernel_matches_after_conversion() -> None:
    cases = [make_case(LQ_LT_LK, kind, torch.float32) for kind in ("none", "empty_rows", "window")]
    for case in cases:
        q, k, v, _ = case.inputs()
        _, lse2 = triton_style_base2(q, k, v, case)
        want = fl.reference_forward(q, k, v, mask=case.mask, scale=case.scale).lse
        assert torch.equal(torch.isinf(lse2), torch.isinf(want)), case.name
        finite = torch.isfinite(want)
        assert torch.allclose(lse_to_base2(want)[finite], lse2[finite].double(), atol=1e-5), (
            case.name
        )

    def natural(q, k, v, case):
        o, lse2 = triton_style_base2(q, k, v, case)
        return o, lse_from_base2(lse2)

    assert assert_attention_close(natural, cases=cases, check_grads=False).passed
    msg = _failure(triton_style_base2, cases, check_grads=False)
    assert "3 of 3 cases" in msg and "LSE differs" in msg


def test_empty_rows_cases_keep_rows_that_see_keys() -> None:
    """A case whose every row sees no key passes any kernel that returns zeros: from two
    rows on, the ``empty_rows`` mask leaves every row but the first (and, from three rows,
    the middle one) seeing a key. (In the 2 x 257 shape of the quick sweep both rows were
    empty, and that case passed kernels without the scale, with a base-2 LSE or no dV.)"""
    from flashledger._verify_cases import attention_cases

    cases = attention_cases(masks=("empty_rows",), dtypes=(torch.float64,))
    assert cases, "no empty_rows cases: the test is void"
    for case in cases:
        seen = case.dense_mask().any(dim=-1)  # (B, Hq, Lq)
        lq = case.shape.len_q
        assert not bool(seen[:, :, 0].any()), f"{case}: row 0 sees a key"
        empty = {0, lq // 2} if lq >= 3 else {0}
        for r in range(lq):
            assert bool(seen[:, :, r].all()) == (r not in empty), f"{case}: row {r}"


def test_a_wrong_empty_row_lse_is_named_as_a_convention() -> None:
    """A fully-masked row's LSE is the conventions' choice: the failure says which preset
    gives which value instead of an error of 1.8e308 against a naive bound."""

    def sdpa_style(q, k, v, case):  # type: ignore[no-untyped-def]
        return fl.flash_attention(
            q, k, v, mask=case.mask, scale=case.scale, return_lse=True, conventions="sdpa_cpu"
        )

    with pytest.raises(AssertionError) as info:
        fl.assert_attention_close(
            sdpa_style, quick=True, masks=("empty_rows",), dtypes=(torch.float64,)
        )
    text = str(info.value)
    assert "got 0, oracle -inf" in text and "the row sees no key" in text, text
    assert "0: sdpa_cpu" in text and "-inf: seed" in text and "1.8e+308" not in text, text


def test_the_failure_header_tells_a_raising_fn_from_a_wrong_one() -> None:
    def raising(q, k, v, case):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel for this shape")

    with pytest.raises(AssertionError) as info:
        fl.assert_attention_close(raising, quick=True, masks=("none",), dtypes=(torch.float64,))
    head = str(info.value).splitlines()[0]
    assert "5 of 5 cases fail: 5 could not be judged (fn raised" in head, head
    assert "differ from the float64 oracle" not in head, head


def test_a_row_maximum_taken_over_hidden_keys_fails_the_large_score_cases() -> None:
    """The row maximum over every key with the mask applied after exp is right at the
    default scale; at large scores a row whose visible scores lie far below a hidden one
    underflows to an empty row. The large-score cases run with every mask kind to catch it."""

    def max_then_mask(q, k, v, case):  # type: ignore[no-untyped-def]
        k, v = _repeat_kv(q, k, v)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * case.scale
        p = (s - s.amax(-1, keepdim=True)).exp()
        if case.dense_mask() is not None:
            p = p * case.dense_mask()
        den = p.sum(-1, keepdim=True)
        o = torch.where(den > 0, p / torch.where(den > 0, den, 1), 0) @ v.to(acc)
        return o.to(q.dtype)

    plain = attention_cases(quick=True, large_scores=False)
    assert assert_attention_close(max_then_mask, cases=plain, check_grads=False).passed
    msg = _failure(max_then_mask, attention_cases(quick=True), check_grads=False)
    assert " scale 168 " in msg and "got 0, oracle" in msg, msg


def test_an_infinite_error_is_printed_as_inf_and_an_attended_empty_row_is_not_a_convention() -> (
    None
):
    """A -inf LSE where the oracle's is finite is an infinite error, not 1.8e+308; a finite LSE
    on a row that sees no key (fn attended to masked keys) is not blamed on the conventions."""

    def strict_causal(q, k, v, case):  # type: ignore[no-untyped-def]
        o, lse = fl.flash_attention(
            q,
            k,
            v,
            mask=case.mask,
            scale=case.scale,
            conventions=case.conventions,
            return_lse=True,
        )
        lse = lse.clone()
        lse[..., 0] = -math.inf  # row 0 treated as seeing no key
        return o, lse

    with pytest.raises(AssertionError) as info:
        fl.assert_attention_close(
            strict_causal,
            quick=True,
            masks=("causal_top_left",),
            dtypes=(torch.float64,),
            check_grads=False,
        )
    text = str(info.value)
    assert "got -inf, oracle" in text and "error inf >" in text, text
    assert "1.8e+308" not in text, text

    def top_left_always(q, k, v, case):  # type: ignore[no-untyped-def]
        return fl.flash_attention(
            q,
            k,
            v,
            mask=fl.Causal(align="top_left"),
            scale=case.scale,
            conventions=case.conventions,
            return_lse=True,
        )

    shape = Shape(2, 4, 2, 113, 97, 7)  # Lq > Lk: bottom-right rows 0-15 see no key
    case = make_case(shape, "causal_bottom_right", torch.float64)
    with pytest.raises(AssertionError) as info:
        fl.assert_attention_close(top_left_always, cases=[case], check_grads=False)
    text = str(info.value)
    assert "oracle -inf" in text and "fn attended to keys the mask hides" in text, text
    assert "pass the conventions your kernel follows" not in text, text


class _StoredOBackward(torch.autograd.Function):
    """A FlashAttention backward in float32 whose D = rowsum(dO ⊙ O) uses O as stored (in the
    input dtype), as flash-attn's and PyTorch's CPU flash kernel's backward do."""

    @staticmethod
    def forward(ctx, q, k, v, case):  # type: ignore[override]
        kk, vv = _repeat_kv(q, k, v)
        s = (q.float() @ kk.float().transpose(-1, -2)) * case.scale
        if case.dense_mask() is not None:
            s = s.masked_fill(~case.dense_mask(), -math.inf)
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = torch.where(torch.isfinite(lse), (s - lse).exp(), 0)
        o = (p @ vv.float()).to(q.dtype)  # stored in the input dtype
        ctx.save_for_backward(q, kk, vv, p, o)
        ctx.group, ctx.scale = q.shape[1] // k.shape[1], case.scale
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        q, kk, vv, p, o = ctx.saved_tensors
        do32 = do.float()
        d = (do32 * o.float()).sum(-1, keepdim=True)  # D from the stored O
        ds = p * (do32 @ vv.float().transpose(-1, -2) - d)
        scale = ctx.scale
        dq = scale * ds @ kk.float()
        dk = (scale * ds.transpose(-1, -2) @ q.float()).unflatten(1, (-1, ctx.group)).sum(2)
        dv = (p.transpose(-1, -2) @ do32).unflatten(1, (-1, ctx.group)).sum(2)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None


def test_a_backward_whose_d_uses_the_stored_output_passes() -> None:
    """D = rowsum(dO ⊙ O) from O rounded to float16 moves dQ by up to eps/2 Σ|dO||O| carried
    by P and scale|K|; the floor covers it (PyTorch's own CPU flash kernel failed this case
    of the seed-77 sweep at 1.27x its bound before)."""

    def stored_o(q, k, v, case):  # type: ignore[no-untyped-def]
        return _StoredOBackward.apply(q, k, v, case)

    (case,) = [
        c
        for c in attention_cases(conventions=fl.SDPA_CPU, dtypes=(torch.float16,), seed=77)
        if c.name == "causal_top_left B2 H3/1 2x257 d3 float16 [sdpa_cpu]"
    ]
    assert assert_attention_close(stored_o, cases=[case]).passed
    assert assert_attention_close(stored_o, quick=True, dtypes=(torch.float16,)).passed


def test_a_row_sum_kept_in_float16_fails_the_long_row_case() -> None:
    """A kernel that adds each key's P to a float16 row sum, one key at a time, stays within
    the rule on rows of up to 257 keys; the long-row case (4097 keys) catches it, and the
    same kernel summing in float32 passes it."""

    def kernel(q, k, v, case, half_sum):
        k, v = _repeat_kv(q, k, v)
        s = (q.float() @ k.float().transpose(-1, -2)) * case.scale
        if case.dense_mask() is not None:
            s = s.masked_fill(~case.dense_mask(), -math.inf)
        top = s.amax(-1, keepdim=True)
        p = (s - torch.where(torch.isfinite(top), top, torch.zeros_like(top))).exp()
        ell = torch.zeros(p.shape[:-1], dtype=torch.float16 if half_sum else torch.float32)
        for j in range(p.shape[-1]):  # key by key, in the sum's dtype
            ell = ell + p[..., j].to(ell.dtype)
        ell = ell.float().unsqueeze(-1)
        return (torch.where(ell > 0, p / torch.where(ell > 0, ell, 1), 0) @ v.float()).to(q.dtype)

    sweep = dict(dtypes=(torch.float16,), masks=("none",), quick=True, check_grads=False)
    half = functools.partial(kernel, half_sum=True)
    assert assert_attention_close(half, long_rows=False, **sweep).passed
    assert assert_attention_close(functools.partial(kernel, half_sum=False), **sweep).passed
    msg = _failure(
        half,
        attention_cases(dtypes=(torch.float16,), masks=("none",), quick=True),
        check_grads=False,
    )
    assert "1 of 5 cases fail" in msg.splitlines()[0], msg.splitlines()[0]
    assert "case none B1 H2 3x4097 d8 float16" in msg, msg
