"""Bad input: a ValueError/TypeError whose message names the argument and what is allowed."""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable

import pytest
import torch

import flashledger as fl
from flashledger.online import OnlineSoftmax

f64 = torch.float64


def _qkv(
    lq: int = 5, lk: int = 6, d: int = 4, dv: int = 3, h: int = 2, hkv: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``(h, Lq, d)``, k ``(hkv, Lk, d)``, v ``(hkv, Lk, d_v)`` in float64, from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(h, lq, d, dtype=f64, generator=g),
        torch.randn(hkv, lk, d, dtype=f64, generator=g),
        torch.randn(hkv, lk, dv, dtype=f64, generator=g),
    )


ENTRY = {
    "reference_forward": lambda q, k, v, **kw: fl.reference_forward(q, k, v, **kw),
    "blocked_forward": lambda q, k, v, **kw: fl.blocked_forward(q, k, v, **kw),
    "flash_attention": lambda q, k, v, **kw: fl.flash_attention(q, k, v, **kw),
    # o, lse and do fit the default shapes of _qkv(); the inputs are checked before them
    "blocked_backward": lambda q, k, v, **kw: fl.blocked_backward(
        q,
        k,
        v,
        torch.zeros(2, 5, 3, dtype=f64),
        torch.zeros(2, 5, dtype=f64),
        torch.zeros(2, 5, 3, dtype=f64),
        **kw,
    ),
}


def _raises(fn: Callable[[], object], exc: type[Exception], *fragments: str) -> str:
    """Call ``fn``; it must raise ``exc`` with every fragment in its message."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"message {msg!r} lacks {frag!r}"
    return msg


# -- inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", list(ENTRY))
def test_bad_tensors(entry):
    call = ENTRY[entry]
    q, k, v = _qkv()
    _raises(
        lambda: call(q, torch.randn(2, 6, 3, dtype=f64), v), ValueError, "head dim d", "q (2, 5, 4)"
    )
    _raises(lambda: call(q, k, torch.randn(2, 7, 3, dtype=f64)), ValueError, "k and v must agree")
    _raises(lambda: call(q, k[0], v[0]), ValueError, "same number of dimensions")
    _raises(
        lambda: call(q.expand(3, 2, 5, 4), k.expand(2, 2, 6, 4), v.expand(2, 2, 6, 3)),
        ValueError,
        "batch dim",
    )
    _raises(
        lambda: call(q[None, None], k[None, None], v[None, None]),
        ValueError,
        "(L, d), (H, L, d) or (B, H, L, d)",
    )
    _raises(lambda: call(q[:, :0], k, v), ValueError, "sequence lengths must be >= 1")
    _raises(lambda: call(q, k, v[..., :0]), ValueError, "head dims must be >= 1")
    _raises(
        lambda: call(q.to(torch.int64), k, v), TypeError, "q must have a floating dtype", "int64"
    )
    _raises(lambda: call(q.tolist(), k, v), TypeError, "q must be a torch.Tensor", "list")
    _raises(lambda: call(q, k.float(), v), TypeError, "share one dtype", "k torch.float32", "k.to(")
    _raises(lambda: call(q[None, :0], k[None, :0], v[None, :0]), ValueError, "batch and head")
    _raises(lambda: call(q[:0], k[:0], v[:0]), ValueError, "batch and head counts must be >= 1")
    meta = [x.to("meta") for x in (q, k, v)]
    _raises(lambda: call(*meta), ValueError, "meta tensors")


@pytest.mark.parametrize("entry", list(ENTRY))
def test_gqa_heads_must_divide(entry):
    q, k, v = _qkv(h=3, hkv=2)
    _raises(
        lambda: ENTRY[entry](q, k, v),
        ValueError,
        "number of query heads (3)",
        "multiple of the number of key/value heads (2)",
    )


@pytest.mark.parametrize("entry", list(ENTRY))
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_nan_and_inf_inputs_name_the_index(entry, name):
    t = dict(zip("qkv", _qkv()))
    t[name][1, 2, 0] = math.nan
    msg = _raises(lambda: ENTRY[entry](t["q"], t["k"], t["v"]), ValueError, name, "(1, 2, 0)")
    assert "NaN" in msg and "finite" in msg
    # an infinite q or k entry meeting a positive partner makes a score +inf, and the
    # result NaN (an infinite v entry always reaches O)
    t["q"][1, :, 0], t["k"][1, :, 0] = t["q"][1, :, 0].abs(), t["k"][1, :, 0].abs()
    t[name][1, 2, 0] = math.inf
    _raises(
        lambda: ENTRY[entry](t["q"], t["k"], t["v"]), ValueError, f"{name} contains", "(1, 2, 0)"
    )


@pytest.mark.parametrize("entry", ["reference_forward", "blocked_forward", "flash_attention"])
def test_an_infinite_key_whose_scores_are_all_minus_inf_weighs_nothing(entry):
    """An infinite k entry whose every product with q is -inf is no error: each of its
    scores is -inf, so the key gets weight exactly 0 (IEEE arithmetic, as SDPA), and O is
    that of the same inputs without the key."""
    q, k, v = _qkv()
    q[1, :, 0] = -q[1, :, 0].abs() - 0.1  # every row of head 1: a negative first component
    k[1, 2, 0] = math.inf
    got = ENTRY[entry](q, k, v)
    o = got if isinstance(got, torch.Tensor) else got.o
    seen = torch.ones(2, 5, 6, dtype=torch.bool)
    seen[1, :, 2] = False
    k_fin = k.clone()
    k_fin[1, 2, 0] = 0.0
    want = fl.reference_forward(q, k_fin, v, mask=seen).o
    assert torch.isfinite(o).all()
    assert (o - want).abs().max() <= 1e-13, (o - want).abs().max()


# -- options ------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["blocked_forward", "blocked_backward", "flash_attention"])
@pytest.mark.parametrize(
    ("option", "value", "exc"),
    [
        ("block_q", 0, ValueError),
        ("block_q", -3, ValueError),
        ("block_k", 2**31, ValueError),
        ("block_k", 2.5, TypeError),
        ("block_k", True, TypeError),
        ("block_q", "8", TypeError),
    ],
)
def test_block_sizes(entry, option, value, exc):
    q, k, v = _qkv()
    allowed = "integer >= 1" if exc is TypeError else "integer in 1..2147483647"
    _raises(lambda: ENTRY[entry](q, k, v, **{option: value}), exc, option, allowed)


def test_loop_order():
    q, k, v = _qkv()
    _raises(
        lambda: fl.blocked_forward(q, k, v, loop_order="fa3"),
        ValueError,
        "loop_order",
        "'fa2' or 'fa1'",
    )


@pytest.mark.parametrize("entry", list(ENTRY))
def test_scalar_options(entry):
    call = ENTRY[entry]
    q, k, v = _qkv()
    for p in (-0.1, 1.0, 1.5, math.nan, "0.1"):
        _raises(lambda p=p: call(q, k, v, dropout_p=p), ValueError, "dropout_p", "[0, 1)")
    for c in (0, 0.0, -1.0, math.inf, math.nan):
        _raises(lambda c=c: call(q, k, v, softcap=c), ValueError, "softcap", "> 0")
    for s in (math.nan, math.inf, "1"):
        _raises(lambda s=s: call(q, k, v, scale=s), ValueError, "scale", "finite number")
    for seed in (-1, 1.5):
        _raises(lambda seed=seed: call(q, k, v, seed=seed), ValueError, "seed", "integer >= 0")


@pytest.mark.parametrize("entry", list(ENTRY))
def test_conventions(entry):
    q, k, v = _qkv()
    msg = _raises(
        lambda: ENTRY[entry](q, k, v, conventions="flash_attn_4"),
        ValueError,
        "unknown preset 'flash_attn_4'",
        "allowed:",
    )
    for name in fl.PRESETS:
        assert name in msg
    _raises(lambda: ENTRY[entry](q, k, v, conventions=3), TypeError, "conventions must be")


def test_bad_conventions_values():
    _raises(
        lambda: fl.Conventions(name="x", masked_row_lse=1.0),
        ValueError,
        "masked_row_lse",
        "-inf, +inf or 0.0",
    )
    _raises(
        lambda: fl.Conventions(name="x", causal_align="center"),
        ValueError,
        "causal_align",
        "'top_left' or 'bottom_right'",
    )
    _raises(
        lambda: fl.Conventions(name="x", dropout_keep="philox"),
        ValueError,
        "dropout_keep",
        "'bernoulli' or 'fa2_8bit'",
    )


@pytest.mark.parametrize("entry", list(ENTRY))
def test_alibi_and_bias_shapes(entry):
    call = ENTRY[entry]
    q, k, v = _qkv()
    _raises(
        lambda: call(q, k, v, alibi_slopes=torch.ones(3, dtype=f64)),
        ValueError,
        "alibi_slopes must have shape (H,) = (2,) or (B, H) = (1, 2)",
        "got (3,)",
    )
    _raises(
        lambda: call(q, k, v, alibi_slopes=torch.ones(2, dtype=torch.int64)),
        TypeError,
        "alibi_slopes",
        "floating dtype",
    )
    _raises(
        lambda: call(q, k, v, alibi_slopes=torch.tensor([1.0, math.nan], dtype=f64)),
        ValueError,
        "alibi_slopes",
        "(1,)",
    )
    _raises(
        lambda: call(q, k, v, bias=torch.zeros(5, 7, dtype=f64)),
        ValueError,
        "bias of shape (5, 7)",
        "(B, H, Lq, Lk) = (1, 2, 5, 6)",
    )
    _raises(
        lambda: call(q, k, v, bias=torch.zeros(1, 1, 1, 1, 6, dtype=f64)),
        ValueError,
        "bias of shape",
    )
    bad = torch.zeros(5, 6, dtype=f64)
    bad[3, 4] = math.inf
    _raises(lambda: call(q, k, v, bias=bad), ValueError, "bias contains", "(3, 4)", "-inf")
    ok = torch.zeros(5, 6, dtype=f64)
    ok[3, 4] = -math.inf  # -inf in a bias is allowed: it masks the pair
    call(q, k, v, bias=ok)


def test_alibi_slopes_helper():
    for h in (0, -2, 2.0, True, 2**16 + 1, 2**40):
        _raises(lambda h=h: fl.alibi_slopes(h), ValueError, "heads must be an integer in 1..65536")


# -- masks --------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", list(ENTRY))
def test_mask_shape_and_type(entry):
    call = ENTRY[entry]
    q, k, v = _qkv()
    _raises(
        lambda: call(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool)),
        ValueError,
        "mask of shape (5, 7)",
        "(B, H, Lq, Lk) = (1, 2, 5, 6)",
    )
    _raises(
        lambda: call(q, k, v, mask=torch.ones(3, 5, 6, dtype=torch.bool)),
        ValueError,
        "does not broadcast",
        "each dim must be 1 or equal",
    )
    _raises(lambda: call(q, k, v, mask=torch.ones(5, 6)), TypeError, "bool tensor", "torch.float32")
    meta = torch.ones(5, 6, dtype=torch.bool, device="meta")
    _raises(lambda: call(q, k, v, mask=meta), ValueError, "meta tensor", "give its values")
    _raises(lambda: call(q, k, v, mask=[[True] * 6] * 5), TypeError, "mask must be None", "list")
    _raises(
        lambda: call(q, k, v, mask=fl.KeyPadding([3, 4, 5])),
        ValueError,
        "KeyPadding lengths has 3 entries",
        "(1)",
    )


def test_mask_constructors():
    _raises(
        lambda: fl.Causal(align="diagonal"), ValueError, "align", "'top_left' or 'bottom_right'"
    )
    _raises(lambda: fl.SlidingWindow(-2, 0), ValueError, "SlidingWindow.left", "-1/None")
    _raises(lambda: fl.SlidingWindow(3, 1.5), ValueError, "SlidingWindow.right", "0..2147483647")
    _raises(lambda: fl.SlidingWindow(2**31, 0), ValueError, "SlidingWindow.left", "got 2147483648")
    _raises(lambda: fl.SlidingWindow(1, 1, align="left"), ValueError, "align")
    _raises(
        lambda: fl.KeyPadding([3, -1]), ValueError, "KeyPadding lengths must be >= 0", "[3, -1]"
    )
    _raises(lambda: fl.KeyPadding([[1, 2]]), ValueError, "KeyPadding lengths", "1-D integer")
    _raises(lambda: fl.KeyPadding([1.5]), ValueError, "1-D integer")
    _raises(lambda: fl.KeyPadding([]), ValueError, "(B,)")
    _raises(lambda: fl.DenseMask(torch.ones(3)), TypeError, "bool tensor")
    _raises(lambda: fl.DenseMask(torch.ones(3, dtype=torch.bool)), ValueError, "(Lq, Lk)", "(3,)")
    _raises(lambda: fl.DenseMask([[True]]), TypeError, "DenseMask needs a bool tensor", "list")
    _raises(lambda: fl.Causal() & None, TypeError, "cannot intersect a mask with None")
    _raises(lambda: fl.Causal() & 3, TypeError, "mask must be None, a flashledger Mask")


# -- variable length ----------------------------------------------------------------------
def _cu(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


@pytest.mark.parametrize("entry", list(ENTRY))
def test_cu_seqlens(entry):
    call = ENTRY[entry]
    q, k, v = _qkv(lq=5, lk=6)
    good_k = _cu(0, 2, 6)
    cases = [
        (_cu(1, 3, 5), "cu_seqlens_q must start at 0", "[1, 3, 5]"),
        (_cu(0, 4, 3, 5), "cu_seqlens_q must be non-decreasing", "[0, 4, 3, 5]"),
        (_cu(0, 2, 4), "cu_seqlens_q must end at the packed length 5", "[0, 2, 4]"),
        (
            torch.tensor([0.0, 2.0, 5.0]),
            "cu_seqlens_q must be a 1-D integer tensor",
            "[0, ..., total]",
        ),
        (_cu(5), "cu_seqlens_q must be a 1-D integer tensor", ""),
    ]
    for cq, *frags in cases:
        _raises(
            lambda cq=cq: call(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=good_k), ValueError, *frags
        )
    _raises(
        lambda: call(q, k, v, cu_seqlens_q=_cu(0, 5)),
        ValueError,
        "cu_seqlens_q and cu_seqlens_k must be given together",
    )
    _raises(
        lambda: call(q, k, v, cu_seqlens_q=_cu(0, 5), cu_seqlens_k=good_k),
        ValueError,
        "same number of sequences",
        "got 1 and 2",
    )
    _raises(
        lambda: call(
            q[None].expand(2, 2, 5, 4),
            k[None].expand(2, 2, 6, 4),
            v[None].expand(2, 2, 6, 3),
            cu_seqlens_q=_cu(0, 3, 5),
            cu_seqlens_k=good_k,
        ),
        ValueError,
        "packed along the length axis",
        "(H, total_q, d)",
    )
    _raises(
        lambda: call(
            q, k, v, cu_seqlens_q=_cu(0, 3, 5), cu_seqlens_k=good_k, mask=fl.KeyPadding([2])
        ),
        ValueError,
        "KeyPadding cannot be combined with cu_seqlens",
    )


# -- backward inputs, split-KV, observers, the online state ----------------------------------
def test_backward_inputs():
    q, k, v = _qkv()
    o, lse, do = (
        torch.zeros(2, 5, 3, dtype=f64),
        torch.zeros(2, 5, dtype=f64),
        torch.zeros(2, 5, 3, dtype=f64),
    )
    for fn in (fl.blocked_backward, fl.reference_backward):
        _raises(
            lambda fn=fn: fn(q, k, v, o, lse, do[:, :4]),
            ValueError,
            "do must have shape (2, 5, 3)",
            "(2, 4, 3)",
        )
        _raises(
            lambda fn=fn: fn(q, k, v, o[..., :2], lse, do),
            ValueError,
            "o must have shape (2, 5, 3)",
        )
        _raises(
            lambda fn=fn: fn(q, k, v, o, lse[:, :3], do), ValueError, "lse must have shape (2, 5)"
        )
        _raises(
            lambda fn=fn: fn(q, k, v, o, lse, do, dlse=torch.zeros(5, dtype=f64)),
            ValueError,
            "dlse must have shape (2, 5)",
        )
        _raises(
            lambda fn=fn: fn(q, k, v, o, lse, do.to(torch.int32)),
            TypeError,
            "do must be a floating-point tensor",
        )
        bad = lse.clone()
        bad[1, 1] = math.nan
        _raises(lambda fn=fn, bad=bad: fn(q, k, v, o, bad, do), ValueError, "lse contains NaN")
        bad_do = do.clone()
        bad_do[0, 0, 0] = math.inf
        _raises(
            lambda fn=fn, bad_do=bad_do: fn(q, k, v, o, lse, bad_do),
            ValueError,
            "do contains NaN or inf at index (0, 0, 0)",
        )


def test_split_kv_and_observer():
    q, k, v = _qkv()
    for n in (0, -1):
        _raises(
            lambda n=n: fl.split_kv_forward(q, k, v, num_splits=n),
            ValueError,
            "num_splits must be an integer in 1..2147483647",
        )
    _raises(
        lambda: fl.split_kv_forward(q, k, v, num_splits=7),
        ValueError,
        "num_splits must be between 1 and Lk = 6",
        "got 7",
    )
    _raises(lambda: fl.split_kv_forward(q, k, v, num_splits=2.0), TypeError, "num_splits")
    _raises(
        lambda: fl.blocked_forward(q, k, v, observer=object()),
        TypeError,
        "observer must have forward_tile",
    )


def test_online_softmax_inputs():
    _raises(lambda: OnlineSoftmax(0), ValueError, "d_v must be an integer >= 1", "0")
    osm = OnlineSoftmax(2)
    _raises(
        lambda: osm.update(torch.ones(3), torch.ones(4, 2)),
        ValueError,
        "values must have shape (cols, d_v) = (3, 2)",
        "(4, 2)",
    )
    _raises(
        lambda: osm.update(torch.ones(2, 3), torch.ones(3, 2)),
        ValueError,
        "scores must have shape (*rows, cols)",
        "rows=()",
    )
    _raises(
        lambda: osm.update(torch.tensor([1.0, math.nan]), torch.ones(2, 2)),
        ValueError,
        "NaN or +inf",
    )
    _raises(
        lambda: OnlineSoftmax.run(torch.ones(4), torch.ones(4, 2), block=0),
        ValueError,
        "block must be an integer >= 1",
    )
    assert osm.steps == [], "a rejected update must leave the state untouched"


def test_messages_name_the_argument_not_a_traceback_detail():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=re.escape("dropout_p must be a number in [0, 1), got 2")):
        fl.flash_attention(q, k, v, dropout_p=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_check_is_exact_whatever_the_sum(dtype):
    """The one-reduction check agrees with ``isfinite`` even where the sum overflows."""
    from flashledger._checks import all_finite, check_finite

    big = torch.finfo(dtype).max
    x = torch.full((4, 64), big / 2, dtype=dtype)  # finite, but its sum overflows
    assert all_finite(x) and all_finite(x, allow_neg_inf=True)
    assert all_finite(torch.empty(0, dtype=dtype))
    for bad, neg_ok in ((math.nan, False), (math.inf, False), (-math.inf, True)):
        y = x.clone()
        y[2, 17] = bad
        assert not all_finite(y)
        assert all_finite(y, allow_neg_inf=True) is neg_ok
        with pytest.raises(ValueError, match=re.escape("x contains NaN or inf at index (2, 17)")):
            check_finite("x", y)
    z = torch.randn(3, 5, dtype=dtype, requires_grad=True)
    assert all_finite(z)  # a tensor that requires grad is read without a warning


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_tensor_is_checked_a_slab_at_a_time(dtype, monkeypatch):
    """A half tensor is summed in float64 a slab at a time (PyTorch widens the whole operand
    first: four times the tensor's memory at once): every slab is read, a bad value in the
    last one is found, and the slabs are views of the tensor, whatever its strides."""
    from flashledger import _checks

    monkeypatch.setattr(_checks, "PIECE_ELEMS", 64)
    x = torch.randn(3, 7, 40, dtype=torch.float32).to(dtype).transpose(1, 2)  # (3, 40, 7)
    parts = list(_checks.pieces(x, 64))
    assert len(parts) > 1 and all(p.numel() <= 64 for p in parts)
    assert all(p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(torch.cat(parts, dim=-2), x)
    assert _checks.all_finite(x)
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[2, 39, 6] = bad  # the last slab's last element
        assert not _checks.all_finite(y)
        with pytest.raises(
            ValueError, match=re.escape("y contains NaN or inf at index (2, 39, 6)")
        ):
            _checks.check_finite("y", y)
    assert list(_checks.pieces(torch.ones((), dtype=dtype), 1)) != []


# -- results that cannot be right: a foreign LSE, scores that overflow ------------------------
@pytest.mark.parametrize("bad", [math.inf, -math.inf, 1e300, -1e300])
def test_backward_rejects_an_lse_that_no_forward_gives(bad):
    """A row that sees keys has a finite LSE bounded by its scores; ±inf or 1e300 there would
    rebuild P = 0 and return a zero dQ."""
    q, k, v = _qkv()
    fwd = fl.blocked_forward(q, k, v)
    lse = fwd.lse.clone()
    lse[1, 3] = bad
    do = torch.randn_like(fwd.o)
    for fn in (fl.blocked_backward,):
        _raises(
            lambda fn=fn: fn(q, k, v, fwd.o, lse, do),
            ValueError,
            f"lse[1, 3] = {bad!r} cannot be the log-sum-exp",
            "the forward returned",
        )


def test_the_autograd_backward_checks_do_and_takes_the_forward_s_own_o_and_lse(monkeypatch):
    """Through autograd the backward reads the o and LSE its own forward formed and checked
    (autograd refuses them modified in place): it judges the LSE no second time, where a
    caller's LSE is judged; a dO that is not finite is still named by index."""
    from flashledger._problem import Problem

    judged: list[int] = []
    real = Problem.check_saved_lse

    def spy(self, lse, **kw):
        judged.append(1)
        return real(self, lse, **kw)

    monkeypatch.setattr(Problem, "check_saved_lse", spy)
    q, k, v = (x.detach().requires_grad_() for x in _qkv())
    o = fl.flash_attention(q, k, v, mask=fl.Causal())
    o.backward(torch.randn_like(o))
    assert judged == [] and q.grad is not None and bool(torch.isfinite(q.grad).all())
    qd, kd, vd = (x.detach() for x in (q, k, v))
    fwd = fl.blocked_forward(qd, kd, vd, mask=fl.Causal())
    fl.blocked_backward(qd, kd, vd, fwd.o, fwd.lse, torch.randn_like(fwd.o), mask=fl.Causal())
    assert judged == [1]
    o = fl.flash_attention(q, k, v, mask=fl.Causal())
    bad = torch.randn_like(o)
    bad[0, 1, 2] = math.nan
    _raises(lambda: o.backward(bad), ValueError, "do contains NaN or inf at index (0, 1, 2)")
    q2 = q.detach().clone().requires_grad_()
    o2 = fl.flash_attention(q2, k, v)
    with torch.no_grad():
        q2.add_(1.0)  # a saved input changed in place: autograd refuses the backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o2.sum().backward()


def test_the_score_bound_reads_a_bias_s_finite_values_only():
    """The bound that judges a saved LSE takes a bias's largest finite magnitude, whatever
    the bias holds (-inf as a mask, NaN, all negative, nothing finite), and a backward with
    such a bias accepts the forward's own LSE and refuses one past the bound."""
    from flashledger._problem import _largest_finite_magnitude

    inf, nan = math.inf, math.nan
    cases = [[1.0, -3.0, 2.0], [-inf, 2.0, -5.0], [nan, 1.0], [inf, -inf], [], [-0.0], [-7.0, -2.0]]
    for values in cases:
        x = torch.tensor(values, dtype=torch.float64)
        finite = x[torch.isfinite(x)]
        want = float(finite.abs().amax()) if finite.numel() else 0.0
        got = _largest_finite_magnitude(x)
        assert got == want and math.copysign(1.0, got) == 1.0, f"{values}: {got!r}, want {want!r}"
    q, k, v = _qkv()
    bias = torch.randn(q.shape[-2], k.shape[-2], dtype=q.dtype) * 3
    bias[:, 5] = -math.inf  # a key no row sees
    fwd = fl.blocked_forward(q, k, v, bias=bias)
    do = torch.randn_like(fwd.o)
    fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, bias=bias)
    lse = fwd.lse.clone()
    lse[0, 0] = 1e6
    _raises(
        lambda: fl.blocked_backward(q, k, v, fwd.o, lse, do, bias=bias),
        ValueError,
        "cannot be the log-sum-exp",
    )


@pytest.mark.parametrize("preset", [fl.SEED, fl.FLASH_ATTN_2, fl.SDPA_CPU], ids=lambda c: c.name)
def test_backward_takes_any_lse_convention_on_rows_that_see_no_key(preset):
    q, k, v = _qkv(lq=6, lk=4)
    mask = fl.Causal("bottom_right")  # Lq > Lk: rows 0 and 1 see no key
    bias = torch.zeros(6, 4, dtype=f64)
    bias[4] = -math.inf  # row 4 sees no key either (its bias hides every one)
    opts = dict(mask=mask, bias=bias, conventions=preset)
    fwd = fl.blocked_forward(q, k, v, **opts)
    do = torch.randn_like(fwd.o)
    want = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, **opts)
    for value in (-math.inf, math.inf, 0.0):
        lse = fwd.lse.clone()
        lse[:, [0, 1, 4]] = value
        got = fl.blocked_backward(q, k, v, fwd.o, lse, do, **opts)
        assert torch.equal(got.dq, want.dq) and torch.equal(got.dk, want.dk)
        assert not bool(got.dq[:, [0, 1, 4]].any()), "a row with no key has dQ = 0"
    lse = fwd.lse.clone()
    lse[0, 3] = math.inf  # row 3 does see keys
    _raises(lambda: fl.blocked_backward(q, k, v, fwd.o, lse, do, **opts), ValueError, "lse[0, 3]")


ENTRY_FORWARD = {
    "reference_forward": fl.reference_forward,
    "blocked_forward": fl.blocked_forward,
    "split_kv_forward": lambda q, k, v, **kw: fl.split_kv_forward(q, k, v, num_splits=2, **kw),
    "flash_attention": fl.flash_attention,
}


@pytest.mark.parametrize("entry", list(ENTRY_FORWARD))
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["to_plus_inf", "to_minus_inf"])
def test_scores_that_overflow_blame_the_inputs(entry, sign):
    """Finite inputs whose scores overflow: a clear error, not a NaN LSE or a row silently
    treated as fully masked (every score of row 2 overflows to -inf in the second case)."""
    q, k, v = _qkv()
    u = torch.ones(4, dtype=f64)
    q[1, 2] = 1e300 * u
    k[1] = sign * 1e300 * u
    _raises(
        lambda: ENTRY_FORWARD[entry](q, k, v),
        ValueError,
        "the scores of output row o[1, 2, :] overflow float64",
        "q, k and v are finite",
        "scale q or k down",
    )
    if entry == "reference_forward":
        return
    q32, k32, v32 = (x.clamp(-1e30, 1e30).float() for x in (q, k, v))
    _raises(
        lambda: ENTRY_FORWARD[entry](q32, k32, v32),
        ValueError,
        "overflow float32",
        "or compute in float64",
    )


def test_gradients_that_overflow_blame_the_inputs():
    q, k, v = _qkv()
    fwd = fl.blocked_forward(q, k, v)
    do = torch.full_like(fwd.o, 1e300)
    for fn in (fl.blocked_backward, fl.reference_backward):
        _raises(
            lambda fn=fn: fn(q, k, 1e300 * v, fwd.o, fwd.lse, do),
            ValueError,
            "overflows float64 although every input is finite",
        )


@pytest.mark.parametrize("step", ["native", "pytorch"])
def test_half_gradients_past_their_dtypes_range_are_named(step):
    """float16 inputs whose gradients fit float32's sums but not float16's range (65504):
    the call names the gradient, its first infinite element and the range, rather than
    returning infinities (PyTorch's SDPA returns them), on either step and through autograd;
    bfloat16, float32's range, returns the same gradients finite."""
    from flashledger import _native

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 64, 16, generator=g).half() for _ in range(2))
    v = (300 * torch.randn(1, 2, 64, 16, generator=g)).half()
    do = (6000 * torch.randn(1, 2, 64, 16, generator=g)).half()  # dQ, dK past 2 x 65504
    off = _native.disabled() if step == "pytorch" else contextlib.nullcontext()
    with off:
        fwd = fl.blocked_forward(q, k, v)
        msg = _raises(
            lambda: fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do),
            ValueError,
            "overflows float16 (largest finite value 65504)",
            "although every input is finite",
            "pass float32 inputs",
        )
        name, at = re.search(r"the gradient (d[qkv])(\[[0-9, ]+\])", msg).groups()
        wide = fl.blocked_backward(
            q.float(), k.float(), v.float(), fwd.o.float(), fwd.lse, do.float()
        )
        big = getattr(wide, name)[tuple(json.loads(at))]
        assert math.isfinite(big) and abs(big) > 65504, (name, at, big)
        qg = q.clone().requires_grad_()
        _raises(lambda: fl.flash_attention(qg, k, v).backward(do), ValueError, "overflows float16")
        qb, kb, vb, dob = (x.bfloat16() for x in (q, k, v, do))
        fb = fl.blocked_forward(qb, kb, vb)
        bb = fl.blocked_backward(qb, kb, vb, fb.o, fb.lse, dob)
        assert all(bool(torch.isfinite(x).all()) for x in (bb.dq, bb.dk, bb.dv))


def test_a_half_bias_gradient_past_its_range_is_named():
    """A float16 bias whose gradient (dS summed to the bias's shape) passes 65504 while dQ,
    dK and dV fit: both backwards name dbias and its first infinite element."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 64, 16, generator=g).mul(1e-3).half() for _ in range(2))
    v, do = ((3000 * torch.randn(1, 2, 64, 16, generator=g)).half() for _ in range(2))
    bias = torch.zeros(1, 2, 64, 64, dtype=torch.float16)
    fwd = fl.blocked_forward(q, k, v, bias=bias)
    for fn in (fl.blocked_backward, fl.reference_backward):
        _raises(
            lambda fn=fn: fn(q, k, v, fwd.o, fwd.lse, do, bias=bias),
            ValueError,
            "the gradient dbias[0, ",
            "overflows float16 (largest finite value 65504)",
            "pass the bias in float32",
        )
    wide = fl.blocked_backward(q, k, v, fwd.o, fwd.lse, do, bias=bias.float())
    assert wide.dbias.dtype == torch.float32 and bool(torch.isfinite(wide.dbias).all())
    assert float(wide.dbias.abs().max()) > 65504
    assert all(bool(torch.isfinite(x).all()) for x in (wide.dq, wide.dk, wide.dv))


@pytest.mark.parametrize("option", ["block_q", "block_k"])
@pytest.mark.parametrize("value", [0, True, 2**40, 2.0])
def test_split_kv_checks_its_tile_sizes(option, value):
    q, k, v = _qkv()
    exc = TypeError if isinstance(value, (bool, float)) else ValueError
    _raises(
        lambda: fl.split_kv_forward(q, k, v, num_splits=2, **{option: value}),
        exc,
        option,
    )


def test_seeds_cover_64_bits_and_no_more():
    q, k, v = _qkv()
    keep = {
        s: fl.reference_forward(q, k, v, dropout_p=0.5, seed=s).keep for s in (0, 2**32, 2**64 - 1)
    }
    assert not torch.equal(keep[0], keep[2**32]) and not torch.equal(keep[0], keep[2**64 - 1])
    for fn in ENTRY.values():
        _raises(
            lambda fn=fn: fn(q, k, v, dropout_p=0.5, seed=2**64),
            ValueError,
            "seed must be an integer >= 0 and < 2**64",
            str(2**64),
        )


def test_reference_dtype_must_be_floating():
    q, k, v = _qkv()
    fwd = fl.reference_forward(q, k, v)
    for call in (
        lambda: fl.reference_forward(q, k, v, dtype=torch.int64),
        lambda: fl.reference_backward(q, k, v, fwd.o, fwd.lse, fwd.o, dtype=torch.bool),
    ):
        _raises(call, TypeError, "dtype must be a floating dtype", "float64")


@pytest.mark.parametrize("trace", [False, True])
def test_input_values_are_checked_where_a_score_reads_them(trace):
    """q, k, v values are checked when a result is not finite: a NaN at a key no row sees
    changes nothing (and is not read twice on every call: a decode step reads the cache
    once); one a visible score reads is named, with its index."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 6, 4, dtype=torch.float64, generator=g) for _ in range(3))
    mask = fl.KeyPadding([4, 6])  # batch 0 sees keys 0..3 only
    clean = fl.blocked_forward(q, k, v, mask=mask, block_q=4, block_k=4, trace=trace)
    k_bad = k.clone()
    k_bad[0, 0, 5, 1] = math.nan  # a key batch 0 never sees
    got = fl.blocked_forward(q, k_bad, v, mask=mask, block_q=4, block_k=4, trace=trace)
    assert torch.equal(got.o, clean.o) and torch.equal(got.lse, clean.lse)
    k_bad[0, 0, 2, 1] = math.nan  # a key batch 0 sees
    with pytest.raises(ValueError, match=r"k contains NaN or inf at index \(0, 0, 2, 1\)"):
        fl.blocked_forward(q, k_bad, v, mask=mask, block_q=4, block_k=4, trace=trace)
    v_bad = v.clone()
    v_bad[1, 0, 3, 0] = math.inf
    with pytest.raises(ValueError, match=r"v contains NaN or inf at index \(1, 0, 3, 0\)"):
        fl.reference_forward(q, k, v_bad, mask=mask)


@pytest.mark.parametrize(
    "opts",
    [{}, {"trace": True}, {"loop_order": "fa1"}, {"dropout_p": 0.25, "seed": 3}],
    ids=["plain", "trace", "fa1", "dropout"],
)
def test_a_value_no_row_sees_changes_nothing_on_every_step(opts):
    """NaN and inf values of V (and K) at keys a row of a partial tile runs past but does
    not see, as a padded KV buffer holds: the result is that of zeros there, on the native
    step and on the PyTorch step (trace, dropout, FA1 order), which multiplies P = 0 by
    them."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 4, dtype=torch.float64, generator=g) for _ in range(3))
    for mask in (fl.KeyPadding([6, 13]), fl.KeyPadding([6, 13]) & fl.Causal()):
        want = fl.blocked_forward(q, k, v, mask=mask, block_q=4, block_k=4, **opts)
        k_pad, v_pad = k.clone(), v.clone()
        v_pad[0, :, 6:, 1:] = math.nan  # batch 0's keys 6.. share the partial tile 4..8
        v_pad[0, :, 6:, 0] = math.inf
        k_pad[0, :, 6:, :] = -math.inf
        got = fl.blocked_forward(q, k_pad, v_pad, mask=mask, block_q=4, block_k=4, **opts)
        assert torch.equal(got.o, want.o) and torch.equal(got.lse, want.lse), mask


def test_a_graph_is_built_only_on_finite_inputs():
    """With a gradient to come, every value of q, k and v is checked before the forward:
    the backward reads every key of the tiles it runs, so a NaN past a KeyPadding length
    that the forward's tiles skipped would otherwise stop the backward, on one step and
    at one tile size but not another. Without a gradient such a NaN changes nothing."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=g) for _ in range(3))
    k[..., 7:, :] = math.nan
    v[..., 7:, :] = math.nan
    mask = fl.KeyPadding([7])
    with torch.no_grad():
        o = fl.flash_attention(q, k, v, mask=mask)
    want = fl.reference_forward(q, k[..., :7, :], v[..., :7, :]).o
    torch.testing.assert_close(o, want, rtol=1e-13, atol=1e-13)
    for block in (None, 4):
        with pytest.raises(
            ValueError, match=re.escape("k contains NaN or inf at index (0, 0, 7, 0)")
        ):
            fl.flash_attention(q.requires_grad_(), k, v, mask=mask, block_q=block, block_k=block)


def test_negative_views_are_read_as_their_values():
    """A tensor PyTorch marks negative (``x.is_neg()``: the sign applied lazily, the
    storage holding -x) gives the same result as its resolved values, on the native step
    and the planned decode lane: q, k, v, a bias, ALiBi slopes and the backward's dO."""
    g = torch.Generator().manual_seed(1)
    x, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64, generator=g) for n in (6, 7, 7))
    bias = torch.randn(1, 2, 6, 7, dtype=torch.float64, generator=g)
    slopes = torch.rand(2, dtype=torch.float64, generator=g)
    do = torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=g)
    neg = torch._neg_view
    cases = {
        "q": ((neg(x), k, v), {}, (-x, k, v), {}),
        "k": ((x, neg(k), v), {}, (x, -k, v), {}),
        "v": ((x, k, neg(v)), {}, (x, k, -v), {}),
        "bias": ((x, k, v), {"bias": neg(bias)}, (x, k, v), {"bias": -bias}),
        "slopes": ((x, k, v), {"alibi_slopes": neg(-slopes)}, (x, k, v), {"alibi_slopes": slopes}),
        "q, one row (lane)": ((neg(x[:, :, :1]), k, v), {}, (-x[:, :, :1], k, v), {}),
    }
    for name, (got_in, got_kw, want_in, want_kw) in cases.items():
        got = fl.flash_attention(*got_in, **got_kw)
        want = fl.flash_attention(*want_in, **want_kw)
        assert torch.equal(got, want), name
    q = x.clone().requires_grad_()
    got = torch.autograd.grad(fl.flash_attention(q, k, v), q, neg(do))[0]
    want = torch.autograd.grad(fl.flash_attention(q, k, v), q, -do)[0]
    assert torch.equal(got, want), "dO"


def test_tiny_and_huge_rows_keep_the_lse_check_true():
    """The backward's LSE check bounds every score by max‖q‖·max‖k‖·|scale|: row norms
    whose squares underflow (q near 1e-23 in float32, 1e-170 in float64) must not make
    that bound 0 and refuse the forward's own LSE."""
    g = torch.Generator().manual_seed(2)
    for dtype, small, big, scale in (
        (torch.float32, 1e-23, 1e23, None),
        (torch.float64, 1e-170, 1.0, 1e171),
    ):
        q = (small * torch.randn(1, 1, 6, 4, dtype=dtype, generator=g)).requires_grad_()
        k = (big * torch.randn(1, 1, 7, 4, dtype=dtype, generator=g)).requires_grad_()
        v = torch.randn(1, 1, 7, 4, dtype=dtype, generator=g).requires_grad_()
        o = fl.flash_attention(q, k, v, scale=scale)
        o.sum().backward()  # the forward's own LSE is accepted
        assert q.grad is not None and bool(q.grad.isfinite().all()), dtype


def test_options_past_the_accumulation_dtype_are_named():
    """A softcap, scale or ALiBi slope that is finite but past float32's range turns the
    float32 scores into NaN (s / inf, inf · 0), not into large values: the message names
    the option, not the inputs; NumPy and 0-d tensor scalars are taken by value; an
    integer past float's range is a ValueError naming the option."""
    np = pytest.importorskip("numpy")
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    for kw, words in (
        ({"softcap": 1e39}, "softcap = 1e+39 is past the largest value of float32"),
        ({"scale": -1e39}, "scale = -1e+39 is past the largest value of float32"),
        (
            {"alibi_slopes": torch.tensor([0.5, 1e39], dtype=torch.float64)},
            "alibi_slopes reach 1e+39, past the largest value of float32",
        ),
        (
            {"scale": 10**400},
            "scale must be a finite number (default 1/sqrt(d)), got an integer of 401 digits",
        ),
        ({"softcap": 10**400}, "softcap must be None or a finite number > 0, got an integer"),
        ({"scale": torch.ones(2)}, "a tensor is taken only as a 0-d real value"),
    ):
        _raises(lambda kw=kw: fl.flash_attention(q, k, v, **kw), ValueError, words)
    want = fl.flash_attention(q, k, v, scale=0.5, softcap=2.0)
    for scale, cap in ((np.float32(0.5), np.float64(2.0)), (torch.tensor(0.5), torch.tensor(2.0))):
        assert torch.equal(fl.flash_attention(q, k, v, scale=scale, softcap=cap), want)


def test_dropout_p_and_seed_are_taken_by_value():
    """NumPy and 0-d tensor values of dropout_p and seed, as scale and softcap are taken:
    the same dropout as the Python numbers; a float seed is still refused."""
    np = pytest.importorskip("numpy")
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    want = fl.flash_attention(q, k, v, dropout_p=0.25, seed=3)
    for p, seed in ((np.float64(0.25), np.int64(3)), (torch.tensor(0.25), torch.tensor(3))):
        assert torch.equal(fl.flash_attention(q, k, v, dropout_p=p, seed=seed), want)
    _raises(
        lambda: fl.flash_attention(q, k, v, dropout_p=0.25, seed=torch.tensor(3.0)),
        ValueError,
        "seed must be an integer >= 0 and < 2**64; a tensor is taken only as a 0-d integer",
    )
    _raises(
        lambda: fl.flash_attention(q, k, v, dropout_p=np.float64(1.0)),
        ValueError,
        "dropout_p must be a number in [0, 1), got np.float64(1.0)",
    )


# float8 tensors are floating point to PyTorch (is_floating_point()) but no entry point
# computes in them: each refuses them by name, as it refuses int and complex, rather than
# run a forward in float8 or crash later inside a reduction ("sum_cpu" not implemented).
F8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _qkv_f8(dt: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 4, generator=gen).to(dt) for _ in range(3))


@pytest.mark.parametrize("dt", F8)
@pytest.mark.parametrize(
    "call",
    [
        lambda q, k, v: fl.flash_attention(q, k, v),
        lambda q, k, v: fl.blocked_forward(q, k, v),
        lambda q, k, v: fl.reference_forward(q, k, v),
        lambda q, k, v: fl.flex_attention(q, k, v),
        lambda q, k, v: fl.attention_with_kvcache(q, k, v, cache_seqlens=8),
        lambda q, k, v: fl.blocked_backward(
            q, k, v, torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8, 4)
        ),
    ],
)
def test_float8_inputs_refused_by_name(dt: torch.dtype, call) -> None:
    q, k, v = _qkv_f8(dt)
    with pytest.raises(
        TypeError, match=r"float16, bfloat16, float32, float64\), got torch\.float8"
    ):
        call(q, k, v)


@pytest.mark.parametrize("dt", F8)
def test_float8_options_refused_by_name(dt: torch.dtype) -> None:
    q, k, v = _qkv_f8(torch.float32)
    with pytest.raises(TypeError, match=r"bias must have a floating dtype .*float8"):
        fl.flash_attention(q, k, v, bias=torch.zeros(8, 8).to(dt))
    with pytest.raises(TypeError, match=r"alibi_slopes must have a floating dtype .*float8"):
        fl.flash_attention(q, k, v, alibi_slopes=fl.alibi_slopes(2).to(dt))
    f = fl.blocked_forward(q, k, v)
    with pytest.raises(TypeError, match=r"do must be a floating-point tensor .*float8"):
        fl.blocked_backward(q, k, v, f.o, f.lse, torch.zeros_like(f.o).to(dt))


def test_a_row_sum_past_float16_is_named_as_such():
    """The dense reference asked for float16 over more keys than float16's largest value:
    the scores are small, the row sum overflows; the message says so instead of asking
    for smaller inputs."""
    q = torch.zeros(1, 1, 2, 2, dtype=torch.float16)
    k, v = (torch.ones(1, 1, 70_000, 2, dtype=torch.float16) for _ in range(2))
    _raises(
        lambda: fl.reference_forward(q, k, v, dtype=torch.float16),
        ValueError,
        "the row sums over up to 70000 keys pass its largest value 65504; compute in float32",
    )
