"""A bias's gradient and its checks: each tile's dS is written to the gradient where it
lands on a region of its own, and only the regions no tile wrote are zeroed
(``blocked._BiasGrad``); the bias's values are read once per forward + backward (its
``(min, max)`` found by the forward's check serves the backward's checks). Against the
dense float64 oracle, on both tile steps, with a fresh gradient buffer full of NaN (so that
a region left unwritten cannot pass for zeros)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from naive import naive_attention_scores
from torch import Tensor

import flashledger as fl
from flashledger import _memory, _native, _problem, blocked, scores

F64 = torch.float64


@pytest.fixture
def nan_buffers(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """Every fresh gradient buffer ``_BiasGrad`` takes comes full of NaN (kept here)."""
    made: list[Tensor] = []

    def full_of_nan(x: Tensor) -> Tensor:
        out = torch.full_like(x, math.nan)
        made.append(out)
        return out

    monkeypatch.setattr(blocked, "empty_like_huge", full_of_nan)
    return made


def _step(kind: str) -> contextlib.AbstractContextManager[None]:
    if kind == "native":
        if _native.kernels() is None:
            pytest.skip(_native.native_status())
        return contextlib.nullcontext()
    return _native.disabled()


def _oracle_bias_grad(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, do: Tensor, visible: Tensor
) -> Tensor:
    """d(loss)/d(bias) of dense float64 attention, ``loss = <O, do>``."""
    x = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v, bias)]
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, dim=1) for t in x[1:3])
    s = x[0] @ kk.mT * q.shape[-1] ** -0.5 + x[3]
    o, _ = naive_attention_scores(s, vv, visible)
    o.backward(do.to(F64))
    assert x[3].grad is not None
    return x[3].grad


MASKS = {
    "causal": (fl.Causal(), lambda i, j: i >= j),
    "window": (fl.SlidingWindow(20, 5), lambda i, j: (j >= i - 20) & (j <= i + 5)),
}


@pytest.mark.parametrize("step", ["native", "pytorch"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_full_bias_gradient_is_written_tile_by_tile_and_zero_elsewhere(
    step: str, mask: str, dtype: torch.dtype, nan_buffers: list[Tensor], assert_close: Any
) -> None:
    """A ``(B, H, Lq, Lk)`` bias under a mask that skips tiles (GQA, 97 x 113, ragged
    tiles): its gradient equals the oracle's everywhere, exact zeros on the skipped tiles,
    although the buffer it is written into starts as NaN."""
    g = torch.Generator().manual_seed(11)
    b, hq, hk, lq, lk = 2, 4, 2, 97, 113
    q, k, v = (
        torch.randn(b, h, n, 16, generator=g, dtype=F64).to(dtype).requires_grad_(True)
        for h, n in ((hq, lq), (hk, lk), (hk, lk))
    )
    bias = torch.randn(b, hq, lq, lk, generator=g, dtype=F64).to(dtype).requires_grad_(True)
    do = torch.randn(b, hq, lq, 16, generator=g, dtype=F64).to(dtype)
    m, rule = MASKS[mask]
    with _step(step):
        o = fl.flash_attention(q, k, v, mask=m, bias=bias, block_q=32, block_k=24)
        o.backward(do)
    assert len(nan_buffers) == 1, "one gradient buffer, written in place"
    assert bias.grad is not None
    visible = rule(torch.arange(lq).view(lq, 1), torch.arange(lk).view(1, lk))
    want = _oracle_bias_grad(q, k, v, bias, do, visible.view(1, 1, lq, lk))
    tol = 1e-11 if dtype == F64 else 2e-5
    assert_close(bias.grad.to(F64), want, rtol=tol, name=f"dbias ({step}, {mask})")
    hidden = ~visible.expand(b, hq, lq, lk)
    assert bool((bias.grad[hidden] == 0).all()), "dbias is exactly 0 where no key is seen"


@pytest.mark.parametrize("step", ["native", "pytorch"])
@pytest.mark.parametrize("part", ["rows", "keys"])
def test_a_placed_call_s_bias_gradient_is_zero_outside_its_part(
    step: str, part: str, nan_buffers: list[Tensor], assert_close: Any
) -> None:
    """A call placed on rows 40-89, or on keys 20-59, of a global 130 x 75 problem (the
    backward of keys from the whole forward's O and LSE, as a ring's hop takes it): its
    bias gradient (global shape) holds the oracle's values on its part and exact zeros on
    every other row or key."""
    g = torch.Generator().manual_seed(12)
    lq, lk = 130, 75
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=F64) for n in (lq, lk, lk))
    bias = torch.randn(1, 2, lq, lk, generator=g, dtype=F64)
    do = torch.randn(1, 2, lq, 8, generator=g, dtype=F64)
    opts: dict[str, Any] = dict(mask=fl.Causal("bottom_right"), bias=bias, block_q=16, block_k=32)
    whole = fl.blocked_forward(q, k, v, **opts)
    a, z = (40, 90) if part == "rows" else (20, 60)
    if part == "rows":
        place = fl.Placement(q_offset=a, lq_total=lq, lk_total=lk)
        args = (q[:, :, a:z], k, v, whole.o[:, :, a:z], whole.lse[:, :, a:z], do[:, :, a:z])
    else:
        place = fl.Placement(k_offset=a, lq_total=lq, lk_total=lk)
        args = (q, k[:, :, a:z], v[:, :, a:z], whole.o, whole.lse, do)
    with _step(step):
        bwd = fl.blocked_backward(*args, placement=place, **opts)
    assert bwd.dbias is not None and len(nan_buffers) == 1
    i = torch.arange(lq).view(-1, 1)
    visible = (torch.arange(lk).view(1, -1) <= i + lk - lq).view(1, 1, lq, lk)
    want = _oracle_bias_grad(q, k, v, bias, do, visible)
    inside = torch.zeros(lq if part == "rows" else lk, dtype=torch.bool)
    inside[a:z] = True
    got_in, got_out, want_in = (
        (bwd.dbias[:, :, inside], bwd.dbias[:, :, ~inside], want[:, :, inside])
        if part == "rows"
        else (bwd.dbias[..., inside], bwd.dbias[..., ~inside], want[..., inside])
    )
    assert bool((got_out == 0).all()), f"{part} outside the call: zero"
    assert_close(got_in, want_in, rtol=1e-11, name=f"dbias ({step}, {part})")


@pytest.mark.parametrize("step", ["native", "pytorch"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 113), (1, 4, 97, 1), (2, 1, 97, 113)])
def test_a_broadcast_bias_gradient_sums_the_tiles(
    step: str, shape: tuple[int, ...], nan_buffers: list[Tensor], assert_close: Any
) -> None:
    """A bias broadcast over rows, keys, heads or the batch: each region of its gradient
    sums several tiles' dS (into zeros; no NaN buffer is taken unless a region has rows
    and keys of its own)."""
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 97, 8, generator=g, dtype=F64).requires_grad_(True)
    k, v = (torch.randn(2, 2, 113, 8, generator=g, dtype=F64).requires_grad_(True) for _ in "kv")
    bias = torch.randn(*shape, generator=g, dtype=F64).requires_grad_(True)
    do = torch.randn(2, 4, 97, 8, generator=g, dtype=F64)
    with _step(step):
        o = fl.flash_attention(q, k, v, mask=fl.Causal(), bias=bias, block_q=32, block_k=24)
        o.backward(do)
    assert len(nan_buffers) == (1 if shape[-2:] == (97, 113) else 0)
    visible = torch.arange(97).view(-1, 1) >= torch.arange(113).view(1, -1)
    full = bias.detach().expand(2, 4, 97, 113)
    want_full = _oracle_bias_grad(q, k, v, full, do, visible.view(1, 1, 97, 113))
    dims = [n for n, s in enumerate(shape) if s == 1]
    want = want_full.sum(dim=dims, keepdim=True) if dims else want_full
    assert bias.grad is not None
    assert_close(bias.grad, want, rtol=1e-11, name=f"dbias {shape} ({step})")


@contextlib.contextmanager
def _counted_ranges(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """Every pass that finds a tensor's ``(min, max)`` for the checks (shapes listed)."""
    seen: list[tuple[int, ...]] = []
    real = _problem.value_range

    def counted(x: Tensor) -> tuple[float, float]:
        seen.append(tuple(x.shape))
        return real(x)

    for module in (_problem, scores):
        monkeypatch.setattr(module, "value_range", counted)
    yield seen


def test_the_bias_is_read_once_by_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward + backward through autograd check the bias's values in one pass (its
    ``(min, max)``): the backward and its saved-LSE check reuse what the forward found."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g, dtype=F64).requires_grad_(True) for _ in "qkv")
    bias = torch.randn(1, 2, 40, 40, generator=g, dtype=F64).requires_grad_(True)
    with _counted_ranges(monkeypatch) as seen:
        o = fl.flash_attention(q, k, v, bias=bias, mask=fl.Causal())
        assert seen == [(1, 2, 40, 40)], "the forward's check: one pass"
        o.sum().backward()
    assert seen == [(1, 2, 40, 40)], "the backward reads no bias value for its checks"
    assert bias.grad is not None and bool(torch.isfinite(bias.grad).all())


def test_a_bias_changed_in_place_after_the_forward_is_refused() -> None:
    """The backward trusts the forward's ``(min, max)`` only because autograd refuses a
    saved bias changed in place: that refusal stands."""
    q, k, v = (torch.randn(1, 1, 8, 4, dtype=F64).requires_grad_(True) for _ in "qkv")
    bias = torch.randn(1, 1, 8, 8, dtype=F64)
    o = fl.flash_attention(q, k, v, bias=bias)
    bias.fill_(math.nan)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


@pytest.mark.parametrize(
    "value, message",
    [(math.nan, r"bias.*NaN"), (math.inf, r"bias.*inf")],
)
def test_a_bias_with_nan_or_inf_is_refused_by_name(value: float, message: str) -> None:
    bias = torch.zeros(1, 2, 5, 6, dtype=F64)
    bias[0, 1, 3, 4] = value
    q = torch.randn(1, 2, 5, 4, dtype=F64)
    k = v = torch.randn(1, 2, 6, 4, dtype=F64)
    with pytest.raises(ValueError, match=message) as err:
        fl.flash_attention(q, k, v, bias=bias)
    assert "(0, 1, 3, 4)" in str(err.value)


def test_a_bias_rounded_to_inf_in_the_loop_s_dtype_is_seen() -> None:
    """A float64 bias whose values overflow float32 (the loop's dtype for float32 inputs):
    its range is found again after the conversion, so the rows it hides count as hidden."""
    q = k = v = torch.randn(1, 1, 4, 4)
    bias = torch.zeros(1, 1, 4, 4, dtype=F64)
    bias[0, 0, :, 1:] = -1e300  # -inf in float32: row i sees key 0 only
    pb = _problem.build_problem(q, k, v, bias=bias)
    assert pb.smod.bias_range is not None and pb.smod.bias_range[0] == -math.inf
    out = fl.flash_attention(q, k, v, bias=bias)
    torch.testing.assert_close(out, v[:, :, :1].expand(1, 1, 4, 4))


def test_huge_pages_leave_values_and_small_buffers_alone() -> None:
    """``empty_like_huge``: a buffer like its model (shape, dtype, strides), written and
    read as any other; small ones are plain ``empty_like``."""
    for x in (torch.zeros(3, 5), torch.zeros(1, 4, 2048, 1024), torch.zeros(64, 4096).mT):
        out = _memory.empty_like_huge(x)
        assert out.shape == x.shape and out.dtype == x.dtype and out.stride() == x.stride()
        out.fill_(2.5)
        assert bool((out == 2.5).all())


def test_a_tile_off_the_grid_is_refused_not_left_unwritten() -> None:
    """``_BiasGrad.done`` zeroes the grid's tiles that no dS reached; a dS written on a
    tile that is not one of the grid's would leave part of a region unwritten: refused."""
    q = k = v = torch.zeros(1, 1, 8, 4, dtype=F64)
    pb = _problem.build_problem(q, k, v, bias=torch.zeros(1, 1, 8, 8, dtype=F64))
    assert pb.smod.bias is not None
    grad = blocked._BiasGrad(pb.smod.bias, pb)
    grad.add(torch.ones(1, 1, 1, 4, 4, dtype=F64), 0, 4, 0, 4)
    tiles = [(0, 4), (4, 8)]
    out = grad.done(tiles, tiles)
    assert float(out.sum()) == 16.0 and bool((out[..., 4:, :] == 0).all())
    grad.add(torch.ones(1, 1, 1, 2, 4, dtype=F64), 4, 6, 0, 4)  # half a tile of the grid
    with pytest.raises(RuntimeError, match="other than the loop's grid"):
        grad.done(tiles, tiles)


@pytest.mark.parametrize("layout", ["contiguous", "keys strided", "rows broadcast"])
def test_a_bias_alone_is_read_where_it_lies(
    layout: str, monkeypatch: pytest.MonkeyPatch, scored_calls: dict[str, int], assert_close: Any
) -> None:
    """The native passes read a bias that is the whole term (no ALiBi, no score_mod) where
    it lies, with no term laid out per tile (``ScoreMod.tile`` never called), when its keys
    are contiguous, and write its dS into the gradient itself where every head has values
    of its own; a bias strided along its keys, or with ALiBi beside it, is laid out per
    tile. Either way the result is the dense oracle's."""
    g = torch.Generator().manual_seed(15)
    q = torch.randn(2, 4, 97, 8, generator=g, dtype=F64).requires_grad_(True)
    k, v = (torch.randn(2, 2, 113, 8, generator=g, dtype=F64).requires_grad_(True) for _ in "kv")
    shape = (2, 4, 1, 113) if layout == "rows broadcast" else (2, 4, 97, 113)
    raw = torch.randn(*shape, generator=g, dtype=F64)
    bias = (raw.mT.contiguous().mT if layout == "keys strided" else raw).requires_grad_(True)
    do = torch.randn(2, 4, 97, 8, generator=g, dtype=F64)
    laid_out = {"n": 0}
    real = scores.ScoreMod.tile

    def counted(self: Any, *a: Any, **kw: Any) -> Any:
        laid_out["n"] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(scores.ScoreMod, "tile", counted)
    direct = {"n": 0}
    real_direct = blocked._BiasGrad.direct

    def counted_direct(self: Any, *a: Any) -> Any:
        got = real_direct(self, *a)
        direct["n"] += got is not None
        return got

    monkeypatch.setattr(blocked._BiasGrad, "direct", counted_direct)
    o = fl.flash_attention(q, k, v, mask=fl.Causal(), bias=bias, block_q=32, block_k=24)
    o.backward(do)
    assert scored_calls == {"forward": 1, "backward": 1}
    assert (laid_out["n"] == 0) == (layout != "keys strided")
    # dS written by the pass into the gradient itself: a bias with rows, keys and heads of
    # its own, read in place (its gradient laid out like it)
    assert (direct["n"] > 0) == (layout == "contiguous")
    visible = torch.arange(97).view(-1, 1) >= torch.arange(113).view(1, -1)
    want = _oracle_bias_grad(q, k, v, bias.expand(2, 4, 97, 113), do, visible.view(1, 1, 97, 113))
    if layout == "rows broadcast":
        want = want.sum(dim=2, keepdim=True)
    assert bias.grad is not None
    assert_close(bias.grad, want, rtol=1e-11, name=f"dbias ({layout})")
    laid_out["n"] = 0
    with torch.no_grad():
        fl.flash_attention(q, k, v, mask=fl.Causal(), bias=bias, alibi_slopes=fl.alibi_slopes(4))
    assert laid_out["n"] > 0, "ALiBi beside a bias: the term laid out per tile"
