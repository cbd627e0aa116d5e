"""Shared test helpers: closeness checks that name the worst element, and the presets.

Closeness rule used throughout the engine's tests (normwise, per tensor)::

    |actual - expected| <= atol + rtol * max(1, max |expected|)

for every entry, with the max over the tensor's finite entries: ``rtol`` is
relative to the tensor's scale. An elementwise relative rule would demand more
than float64 can give where sums cancel (an entry of dQ much smaller than its
terms carries the rounding of those terms, not of itself); a different
summation order than the oracle's is all that separates the two. Entries equal
in both (including the same infinity) always pass; a NaN in ``actual`` always
fails. On failure the message names the tensor, how many entries are off, the
worst entry's index and both values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

if os.environ.get("PYTEST_XDIST_WORKER"):
    # test processes share the cores: OpenMP threads that spin at barriers (libgomp's
    # default) would take the core another process's thread is waiting for (read before
    # torch loads the runtime)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

import flashledger as fl
from flashledger import _lane, _native, blocked

ALL_PRESETS = [fl.SEED, fl.FLASH_ATTN_2, fl.FLASH_ATTN_3, fl.FLEX_ATTENTION, fl.SDPA_CPU]


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float,
    atol: float = 0.0,
    name: str = "tensor",
) -> None:
    """``|a - b| <= atol + rtol * max(1, max|b|)`` entrywise; the message names the worst entry."""
    assert isinstance(actual, torch.Tensor), f"{name}: actual is {type(actual).__name__}"
    assert isinstance(expected, torch.Tensor), f"{name}: expected is {type(expected).__name__}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    if actual.numel() == 0:
        return
    a = actual.detach().to(torch.float64).cpu()
    b = expected.detach().to(torch.float64).cpu()
    same = a == b  # equal values, including the same infinity; never NaN
    diff = torch.where(same, 0.0, torch.nan_to_num((a - b).abs(), nan=math.inf, posinf=math.inf))
    finite = b[torch.isfinite(b)]
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    bound = torch.full_like(b, atol + rtol * scale)
    bad = (diff > bound) | (torch.isinf(bound) & ~same)
    if bool(bad.any()):
        ratio = torch.where(torch.isinf(diff), math.inf, diff / bound)
        worst = int(torch.argmax(torch.where(bad, ratio, -1.0)).item())
        idx = _index(worst, a.shape)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.numel()} entries off "
            f"(rule |a-b| <= {atol:g} + {rtol:g}*max(1,max|b|) = {atol + rtol * scale:.3g}); worst at index {idx}: "
            f"actual {a[idx].item()!r}, expected {b[idx].item()!r}, "
            f"|diff| {diff[idx].item():.3g} > allowed {bound[idx].item():.3g}"
        )


def assert_same(actual: torch.Tensor, expected: torch.Tensor, *, name: str) -> None:
    """Exact equality (bool/int tensors); the message names the first mismatch."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    ne = actual.cpu() != expected.cpu()
    if bool(ne.any()):
        idx = tuple(int(i) for i in torch.nonzero(ne)[0].tolist())
        raise AssertionError(
            f"{name}: {int(ne.sum())} of {ne.numel()} entries differ; first at index {idx}: "
            f"actual {actual[idx].item()!r}, expected {expected[idx].item()!r}"
        )


def outputs_close(got: tuple[Any, Any], want: tuple[Any, Any], *, rtol: float, name: str) -> None:
    """O, LSE, dQ, dK, dV of ``got`` = (forward result, backward result) against ``want``'s:
    no NaN, then ``assert_close`` on each, named ``"{what} ({name})"``."""
    (fwd, bwd), (want_f, want_b) = got, want
    for what, actual, expected in (
        ("O", fwd.o, want_f.o),
        ("LSE", fwd.lse, want_f.lse),
        ("dQ", bwd.dq, want_b.dq),
        ("dK", bwd.dk, want_b.dk),
        ("dV", bwd.dv, want_b.dv),
    ):
        assert not bool(torch.isnan(actual).any()), f"NaN in {what} ({name})"
        assert_close(actual, expected, rtol=rtol, name=f"{what} ({name})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long sweeps (``@pytest.mark.slow``) run only when a ``-m`` expression names them.

    ``pytest`` alone runs the fast suite; ``-m slow`` runs only the sweeps and
    ``-m "slow or not slow"`` runs everything.
    """
    if "slow" in (config.getoption("markexpr", default="") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture(scope="session", name="assert_close")
def assert_close_fixture() -> Callable[..., None]:
    """The ``assert_close(actual, expected, *, rtol, atol=0.0, name)`` helper."""
    return assert_close


@pytest.fixture(scope="session", name="outputs_close")
def outputs_close_fixture() -> Callable[..., None]:
    """The ``outputs_close(got, want, *, rtol, name)`` helper."""
    return outputs_close


@pytest.fixture(scope="session", name="assert_same")
def assert_same_fixture() -> Callable[..., None]:
    """The ``assert_same(actual, expected, *, name)`` helper."""
    return assert_same


@pytest.fixture(params=ALL_PRESETS, ids=lambda c: c.name)
def preset(request: pytest.FixtureRequest) -> fl.Conventions:
    """Each conventions preset in turn."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fixed seed (fresh for every test)."""
    return torch.Generator().manual_seed(20240611)


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed output compared in tests is plain text: no forced colour, the default width
    (a CI runner may set ``COLUMNS``)."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def native() -> _native.Kernels:
    """The native tile step (skips where it is not built)."""
    kern = _native.kernels()
    if kern is None:
        pytest.skip(_native.native_status())
    return kern


def _count_calls(
    monkeypatch: pytest.MonkeyPatch, targets: tuple[tuple[Any, str, str], ...]
) -> dict[str, int]:
    """Calls of each ``(module, function, key)`` counted under ``key`` (skips where the
    native tile step is not built)."""
    kern = _native.kernels()
    if kern is None:
        pytest.skip(_native.native_status())
    kern.choose()  # every dtype's calibration made (or read back) first: its passes uncounted
    calls = {"forward": 0, "backward": 0}
    for module, name, key in targets:
        real = getattr(module, name)

        def counted(*a: Any, _real: Any = real, _key: str = key, **kw: Any) -> Any:
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the passes that run with the native tile step (skips where it is not built):
    the loop's, and the planned lane's (``_lane``)."""
    return _count_calls(
        monkeypatch,
        (
            (blocked, "_forward_native", "forward"),
            (blocked, "_backward_native", "backward"),
            (_lane, "_run", "forward"),
        ),
    )


@pytest.fixture
def scored_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the native passes that add a score_mod's term to their scores (skips where
    the native tile step is not built)."""
    return _count_calls(
        monkeypatch,
        (
            (blocked, "_forward_native_scored", "forward"),
            (blocked, "_backward_native_scored", "backward"),
        ),
    )
