"""Integer-array indexing inside mods runs as a gather with a scatter-add backward
(``_gather``): the same values as PyTorch's indexing, bit for bit, the same gradients,
PyTorch's own path (and errors) wherever the rewrite does not apply."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashledger as fl
from flashledger import _gather, _native
from flashledger._mods import TileCaller, index_grid

F64 = torch.float64


@pytest.fixture(autouse=True, params=["native", "torch"])
def lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test in both lanes (the native library's gather where it runs, PyTorch's
    ``take``), rewriting gathers of any size (the default leaves small ones to PyTorch)."""
    monkeypatch.setattr(_gather, "MIN_ELEMENTS", 0)
    if request.param == "native" and _native.kernels() is None:
        pytest.skip("the native library does not run here")
    monkeypatch.setattr(_gather, "NATIVE", request.param == "native")
    return str(request.param)


def _both(src: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``src[index]`` through the mode and through PyTorch, and how many it rewrote."""
    mode = _gather.fast_indexing()
    with mode:
        fast = src[index]
    return fast, src[index], mode.hits


def _grads(src: torch.Tensor, index: Any, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The gradient of ``(src[index] * weight).sum()`` through the mode and through PyTorch."""
    out = []
    for use in (True, False):
        leaf = src.detach().clone().requires_grad_(True)
        with _gather.fast_indexing() if use else contextlib.nullcontext():
            picked = leaf[index]
        (picked * weight).sum().backward()
        assert leaf.grad is not None
        out.append(leaf.grad)
    return tuple(out)


def _ar(*shape: int, hi: int, lo: int = 0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=gen)


REWRITTEN: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], Any]]] = {
    # name: (source, index); every index an int or an integer tensor, one per dim
    "relative bias": (
        lambda: torch.randn(4, 15, dtype=F64),
        lambda: (torch.arange(4).view(1, 4, 1, 1), _ar(1, 1, 5, 6, hi=15)),
    ),
    "1-d table": (lambda: torch.randn(9, dtype=F64), lambda: _ar(3, 4, hi=9)),
    "1-d, bare tensor": (lambda: torch.randn(9, dtype=F64), lambda: _ar(7, hi=9)),
    "negative indices": (
        lambda: torch.randn(5, 7, dtype=F64),
        lambda: (_ar(3, 1, lo=-5, hi=5), _ar(1, 4, lo=-7, hi=7, seed=1)),
    ),
    "an int among tensors": (
        lambda: torch.randn(3, 5, 6, dtype=F64),
        lambda: (2, _ar(4, 1, hi=5), _ar(1, 3, hi=6, seed=1)),
    ),
    "a negative int": (
        lambda: torch.randn(3, 5, dtype=F64),
        lambda: (-1, _ar(2, 2, hi=5)),
    ),
    "int32 indices": (
        lambda: torch.randn(6, 8),
        lambda: (_ar(2, 1, hi=6).int(), _ar(1, 3, hi=8).int()),
    ),
    "non-contiguous source": (
        lambda: torch.randn(8, 6, dtype=F64).t(),
        lambda: (_ar(5, 1, hi=6), _ar(1, 4, hi=8)),
    ),
    "expanded source": (
        lambda: torch.randn(1, 6, dtype=F64).expand(4, 6),
        lambda: (_ar(3, hi=4), _ar(3, hi=6)),
    ),
    "five broadcast dims": (
        lambda: torch.randn(3, 4, dtype=F64),
        lambda: (_ar(2, 1, 1, 1, 1, hi=3), _ar(1, 2, 1, 1, 3, hi=4, seed=1)),
    ),
    "float32 table, int64 indices": (
        lambda: torch.randn(4, 31),
        lambda: (torch.arange(4).view(1, 4, 1, 1), _ar(1, 1, 9, 11, lo=-31, hi=31)),
    ),
    "integer table": (
        lambda: torch.tensor([0, 0, 1, 1, 1, 2]),
        lambda: _ar(1, 1, 4, 1, hi=6),
    ),
}


@pytest.mark.parametrize("name", list(REWRITTEN))
def test_rewritten_indexing_reads_the_same_elements(name: str, lane: str) -> None:
    make_src, make_index = REWRITTEN[name]
    src, index = make_src(), make_index()
    mode = _gather.fast_indexing()
    with mode:
        fast = src[index]
    slow, hits = src[index], mode.hits
    assert hits == 1, f"{name}: the rewrite did not apply"
    # the native lane takes float tables of up to 4 broadcast dims
    native = lane == "native" and src.is_floating_point() and slow.ndim <= 4
    assert mode.native == int(native), f"{name}: native {mode.native}, expected {int(native)}"
    assert fast.shape == slow.shape and fast.dtype == slow.dtype
    assert torch.equal(fast, slow), f"{name}: {(fast - slow).abs().max()}"


@pytest.mark.parametrize("name", [n for n in REWRITTEN if n != "integer table"])
def test_rewritten_indexing_has_the_same_gradient(name: str) -> None:
    make_src, make_index = REWRITTEN[name]
    src, index = make_src(), make_index()
    if not src.is_contiguous():
        src = src.contiguous()  # a leaf of the same values (grad of a view is its base's)
    shape = _both(src, index)[1].shape
    # integer weights: every partial sum is exact, so the order of the adds cannot show
    weight = _ar(*shape, lo=-4, hi=5, seed=3).to(src.dtype)
    fast, slow = _grads(src, index, weight)
    assert torch.equal(fast, slow), f"{name}: {(fast - slow).abs().max()}"


FALLBACKS: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], Any]]] = {
    "a slice": (lambda: torch.randn(4, 6), lambda: (slice(None), _ar(3, hi=6))),
    "None": (lambda: torch.randn(4, 6), lambda: (None, _ar(3, hi=4), _ar(3, hi=6))),
    "Ellipsis": (lambda: torch.randn(4, 6), lambda: (..., _ar(3, hi=6))),
    "a boolean mask": (lambda: torch.randn(4, 6), lambda: torch.rand(4, 6) > 0.5),
    "fewer indices than dims": (lambda: torch.randn(4, 6), lambda: _ar(3, hi=4)),
    "all ints": (lambda: torch.randn(4, 6), lambda: (1, 2)),
    "a list": (lambda: torch.randn(4, 6), lambda: [0, 2]),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_other_indexing_runs_pytorchs_own(name: str) -> None:
    make_src, make_index = FALLBACKS[name]
    src, index = make_src(), make_index()
    fast, slow, hits = _both(src, index)
    assert hits == 0, f"{name}: rewritten, but should run PyTorch's indexing"
    assert torch.equal(fast, slow)


@pytest.mark.parametrize(
    "index",
    [(0, torch.tensor([6])), (torch.tensor([[-5]]), torch.tensor([0])), (9, torch.tensor([0]))],
    ids=["too large", "too negative", "int out of range"],
)
def test_an_index_out_of_range_raises_pytorchs_error(index: Any) -> None:
    src = torch.randn(4, 6)
    with pytest.raises(IndexError) as want:
        src[index]
    mode = _gather.fast_indexing()
    with pytest.raises(IndexError) as got, mode:
        src[index]
    assert str(got.value) == str(want.value)
    assert mode.hits == 0


def test_under_vmap_it_runs_pytorchs_own() -> None:
    src = torch.randn(4, 6)
    rows, cols = _ar(5, hi=4), _ar(5, hi=6, seed=1)
    mode = _gather.fast_indexing()
    with mode:
        got = torch.vmap(lambda i, j: src[i, j])(rows, cols)
    assert mode.hits == 0
    assert torch.equal(got, src[rows, cols])


def test_small_gathers_run_pytorchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gather, "MIN_ELEMENTS", 12)
    src = torch.randn(4, 6)
    assert _both(src, (_ar(3, 1, hi=4), _ar(1, 4, hi=6)))[2] == 1  # 12 elements
    assert _both(src, (_ar(11, hi=4), _ar(11, hi=6)))[2] == 0


def test_switched_off_it_rewrites_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gather, "ENABLED", False)
    caller = TileCaller(lambda s, b, h, q, k: s + TABLE[h, q - k + 7], "score_mod")
    b, h, q, k = index_grid(1, 2, torch.arange(4), torch.arange(3))
    caller(b, h, q, k, score=torch.zeros(1, 2, 4, 3, dtype=F64))
    assert caller.gathers == 0


@settings(max_examples=40, deadline=None)
@given(
    dims=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    data=st.data(),
)
def test_random_integer_indexing_matches_pytorch(dims: list[int], data: st.DataObject) -> None:
    """Random source shapes, index tensors of random broadcast shapes, negative
    indices and ints among them: the same values and the same gradients."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    src = torch.randn(*dims, generator=gen, dtype=F64)
    out_rank = data.draw(st.integers(1, 3))
    index: list[Any] = []
    for size in dims:
        if data.draw(st.booleans()) and len(index) < len(dims) - 1:
            index.append(data.draw(st.integers(-size, size - 1)))
            continue
        shape = [data.draw(st.sampled_from([1, 3])) for _ in range(out_rank)]
        index.append(torch.randint(-size, size, shape, generator=gen))
    if not any(isinstance(i, torch.Tensor) for i in index):
        index[-1] = torch.randint(-dims[-1], dims[-1], (2,), generator=gen)
    fast, slow, hits = _both(src, tuple(index))
    assert hits == 1
    assert torch.equal(fast, slow)
    weight = torch.randint(-4, 5, slow.shape, generator=gen).to(F64)
    got, want = _grads(src, tuple(index), weight)
    assert torch.equal(got, want), f"worst {(got - want).abs().max()}"


TABLE = torch.randn(2, 15, dtype=F64)


def test_a_relative_bias_score_mod_runs_as_gathers_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A learnable bias through ``flash_attention``: the rewrite applies on every tile
    (counted), the output is bit for bit the one with PyTorch's indexing, the gradients
    of q, k, v and the table agree to rounding."""
    gen = torch.Generator().manual_seed(0)
    n = 8
    q, k, v = (torch.randn(1, 2, n, 4, generator=gen, dtype=F64) for _ in range(3))
    table0 = torch.randn(2, 2 * n - 1, generator=gen, dtype=F64)

    def run(enabled: bool) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(_gather, "ENABLED", enabled)
        table = table0.clone().requires_grad_(True)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

        def rel_bias(s: Any, b: Any, h: Any, qi: Any, ki: Any) -> torch.Tensor:
            return s + table[h, qi - ki + n - 1]

        o = fl.flash_attention(*leaves, mask=fl.Causal(), score_mod=rel_bias, block_q=3, block_k=5)
        o.backward(torch.ones_like(o))
        return (o.detach(), *(x.grad for x in leaves), table.grad)  # type: ignore[misc]

    fast, slow = run(True), run(False)
    assert torch.equal(fast[0], slow[0])
    for name, a, b in zip(("dq", "dk", "dv", "dtable"), fast[1:], slow[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")

    monkeypatch.setattr(_gather, "ENABLED", True)
    caller = TileCaller(lambda s, b, h, qi, ki: s + TABLE[h, qi - ki + 7], "score_mod")
    bb, hh, qq, kk = index_grid(1, 2, torch.arange(4), torch.arange(5))
    caller(bb, hh, qq, kk, score=torch.zeros(1, 2, 4, 5, dtype=F64))
    assert caller.gathers == 1


@pytest.mark.parametrize(
    ("table", "shape"),
    [((4, 100), (1, 4, 64, 300)), ((150_000,), (1, 1, 250, 280))],
    ids=["threads sum private copies", "a large table: one thread"],
)
def test_native_scatter_add_equals_pytorchs_gradient(
    lane: str, table: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    """Gathers large enough to run on every thread: with integer weights every partial
    sum is exact, so the gradient equals PyTorch's bit for bit; with random weights it
    is the same on every call (a fixed order of sums) and PyTorch's to rounding."""
    if lane != "native":
        pytest.skip("the native scatter-add")
    gen = torch.Generator().manual_seed(5)
    src = torch.randn(*table, generator=gen, dtype=F64)
    if len(table) == 2:
        index: Any = (torch.arange(4).view(1, 4, 1, 1), _ar(1, 1, shape[2], shape[3], hi=100))
    else:
        index = _ar(*shape, lo=-table[0], hi=table[0])
    weight = _ar(*shape, lo=-4, hi=5, seed=3).to(F64)
    fast, slow = _grads(src, index, weight)
    assert torch.equal(fast, slow), f"worst {(fast - slow).abs().max()}"
    weight = torch.randn(shape, generator=gen, dtype=F64)
    fast, slow = _grads(src, index, weight)
    again, _ = _grads(src, index, weight)
    assert torch.equal(fast, again)
    torch.testing.assert_close(fast, slow, rtol=1e-13, atol=1e-13)


def test_native_gather_refuses_what_it_does_not_take(lane: str) -> None:
    """Out-of-range indices: ``Kernels.gather`` answers None (the mode then lets PyTorch
    raise its error) and ``scatter_add`` False, without touching memory out of range."""
    if lane != "native":
        pytest.skip("the native library's own calls")
    kern = _native.kernels()
    assert kern is not None
    src = torch.randn(4, 6)
    rows = torch.arange(4).view(4, 1)
    for bad in (torch.tensor([[0, 6]]), torch.tensor([[-7, 0]])):
        assert kern.gather(src, (4, 2), 0, [(rows, 0), (bad, 1)]) is None
        dst = torch.zeros(4, 6)
        assert not kern.scatter_add(dst, torch.ones(4, 2), 0, [(rows, 0), (bad, 1)])
    got = kern.gather(src, (4, 2), 0, [(rows, 0), (torch.tensor([[-6, 5]]), 1)])
    assert got is not None and torch.equal(got, src[rows, torch.tensor([[0, 5]])])


def test_a_gathered_table_can_be_modified_in_place() -> None:
    """A score_mod may modify what it read in place (``bias.mul_(2)``): the gather's
    output is a tensor of its own, not a view, and the gradient flows through it."""
    index = (torch.arange(2).view(2, 1), _ar(1, 5, hi=15))
    weight = _ar(2, 5, lo=-4, hi=5, seed=3).to(F64)
    grads = []
    fast = _gather.fast_indexing()
    for mode in (fast, contextlib.nullcontext()):
        leaf = TABLE.clone().requires_grad_(True)
        with mode:
            picked = leaf[index]
        picked.mul_(2)
        (picked * weight).sum().backward()
        grads.append(leaf.grad)
    assert getattr(fast, "hits", 0) == 1
    assert torch.equal(grads[0], grads[1])
