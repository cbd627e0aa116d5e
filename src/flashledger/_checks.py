"""Input validation shared by every entry point: clear errors, never a crash later on."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ._limits import MAX_SIZE

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes flashledger computes in (``is_floating_point()`` also admits the float8 ones)."""

__all__ = [
    "FLOAT_DTYPES",
    "all_finite",
    "autocast_off",
    "broadcasts_to",
    "check_finite",
    "check_float_tensor",
    "check_qkv",
    "check_qkv_finite",
    "check_size",
    "plain",
    "power_of_two",
]


def plain(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its values as stored: a negative view (``x.is_neg()``, which PyTorch
    applies lazily to ops but not to raw pointers) resolved, else ``x`` itself."""
    return x.resolve_neg() if x.is_neg() else x


def check_float_tensor(name: str, x: Any) -> torch.Tensor:
    """``x`` must be a floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:  # (is_floating_point() is True for the float8 dtypes too)
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}"
        )
    return x


def all_finite(x: torch.Tensor, *, allow_neg_inf: bool = False) -> bool:
    """True when ``x`` holds no NaN and no infinity (``allow_neg_inf``: -inf allowed).

    One vectorised reduction in the common case: a sum is finite only if every
    term is (NaN and ±inf propagate; +inf + -inf is NaN), and a maximum is below
    +inf and not NaN only if no entry is NaN or +inf. ``isfinite(x).all()``
    costs several passes and a boolean tensor, over 10x more on CPU. A sum
    that overflows on finite values falls back to the exact elementwise test.
    A contiguous float32/float64 CPU tensor is read by the native step's check
    instead, once that step is loaded: one pass in this thread, exact.
    """
    if x.numel() == 0:
        return True
    x = x.detach()
    if not allow_neg_inf and _native_check(x):
        from . import _native

        kern = _native.loaded()
        if kern is not None:  # one pass in this thread: no parallel region to wait for
            return kern.all_finite(x)
    if allow_neg_inf:
        top = float(x.amax())
        if top < math.inf:  # False for NaN and +inf
            return True
        return not bool((torch.isnan(x) | (x == math.inf)).any())
    if x.dtype in (torch.float16, torch.bfloat16):  # summed in float64, a slab at a time
        if all(math.isfinite(float(p.sum(dtype=torch.float64))) for p in pieces(x)):
            return True
    elif math.isfinite(float(x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def _native_check(x: torch.Tensor) -> bool:
    """Whether the native step's check can read ``x``: contiguous float32/float64 on the
    CPU. A PyTorch reduction is a parallel region, and with another process busy on the
    cores each one can wait a scheduler time slice (about 6 ms measured with 2 threads on a
    2-core Intel Xeon, against 0.02 ms for the one-thread pass), several times per call."""
    return (
        x.dtype in (torch.float32, torch.float64)
        and x.device.type == "cpu"
        and x.is_contiguous()
        and not x.is_conj()
    )


PIECE_ELEMS = 1 << 18
"""Elements of one slab of a half-precision tensor that a check reduces in a wider dtype:
PyTorch converts the whole operand first (a float16 tensor summed in float64 takes four
times its own memory at once), so the checks go a slab of at most this many at a time."""


def pieces(x: torch.Tensor, elems: int = PIECE_ELEMS) -> Iterator[torch.Tensor]:
    """``x`` as views of about ``elems`` elements each (at least one index of its last
    dimension but one, or of its only dimension, per view), split along that dimension;
    ``x`` itself when it is that small. No copy, whatever its strides."""
    n = x.numel()
    if n <= elems or x.dim() == 0:
        yield x
        return
    dim = -2 if x.dim() >= 2 else 0
    size = x.shape[dim]
    step = max(1, size * elems // n)
    yield from x.split(step, dim=dim)


def value_range(x: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of ``x`` in one pass (``aminmax``; NaN when ``x`` holds one); ``(0,
    0)`` when it is empty."""
    if x.numel() == 0:
        return 0.0, 0.0
    lo, hi = torch.aminmax(x.detach())
    return float(lo), float(hi)


def check_finite(name: str, x: torch.Tensor, *, allow_neg_inf: bool = False) -> None:
    """Raise ``ValueError`` naming the first offending element of ``x``."""
    if all_finite(x, allow_neg_inf=allow_neg_inf):
        return
    bad = torch.isnan(x) | (torch.isinf(x) if not allow_neg_inf else (x == math.inf))
    idx = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
    what = "NaN or +inf" if allow_neg_inf else "NaN or inf"
    allowed = "finite values or -inf" if allow_neg_inf else "finite values"
    raise ValueError(
        f"{name} contains {what} at index {idx} (value {x[idx].item()}); allowed: {allowed}"
    )


def check_size(name: str, value: Any, *, low: int = 1) -> int:
    """A length, tile size, head dim, count or seed: an integer in ``low..MAX_SIZE``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {low}, got {value!r}")
    if not low <= value <= MAX_SIZE:
        raise ValueError(f"{name} must be an integer in {low}..{MAX_SIZE} (2**31 - 1), got {value}")
    return value


def check_qkv(q: Any, k: Any, v: Any, *, finite: bool = True) -> None:
    """Shapes ``(L, d)``, ``(H, L, d)`` or ``(B, H, L, d)``; K/V heads divide Q heads; with
    ``finite`` (default) every value finite too (``check_qkv_finite``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, x)
        if x.ndim not in (2, 3, 4):
            raise ValueError(
                f"{name} must have shape (L, d), (H, L, d) or (B, H, L, d), got {tuple(x.shape)}"
            )
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            "q, k and v must have the same number of dimensions, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if q.device.type == "meta":
        raise ValueError("q, k and v are meta tensors (no data); attention needs their values")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            "convert them first (e.g. k.to(q.dtype))"
        )
    if 0 in q.shape[:-2] or 0 in k.shape[:-2]:
        raise ValueError(
            f"batch and head counts must be >= 1: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the head dim d: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            "k and v must agree on every dim but the last (heads and key length): "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must share the batch dim: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q.ndim >= 3:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv < 1 or hq % hkv != 0:
            raise ValueError(
                f"the number of query heads ({hq}) must be a multiple of the number of key/value "
                f"heads ({hkv}) (GQA/MQA)"
            )
    if q.shape[-1] < 1 or v.shape[-1] < 1:
        raise ValueError(f"head dims must be >= 1: q {tuple(q.shape)}, v {tuple(v.shape)}")
    if k.shape[-2] < 1 or q.shape[-2] < 1:
        raise ValueError(f"sequence lengths must be >= 1: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if finite:
        check_qkv_finite(q, k, v)


def check_qkv_finite(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first NaN or infinite element of q, k or v."""
    check_finite("q", q)
    check_finite("k", k)
    check_finite("v", v)


def any_of(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """``x.any(dim)`` for a bool tensor, as the maximum of its bytes: PyTorch's boolean
    reductions on CPU run element by element (over 10x slower than ``amax`` on the same
    bytes, measured with torch 2.13; see docs/internals.md)."""
    return _of_bytes(x, dim, torch.amax, torch.any)


def all_of(x: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """``x.all(dim)`` for a bool tensor, as the minimum of its bytes (see ``any_of``)."""
    return _of_bytes(x, dim, torch.amin, torch.all)


def _of_bytes(x: torch.Tensor, dim: Any, on_bytes: Any, on_bools: Any) -> torch.Tensor:
    if x.numel() == 0:  # (amax/amin refuse an empty reduction)
        return on_bools(x) if dim is None else on_bools(x, dim)  # type: ignore[no-any-return]
    u8 = x.view(torch.uint8)
    return (on_bytes(u8) if dim is None else on_bytes(u8, dim)).view(torch.bool)  # type: ignore[no-any-return]


def power_of_two(x: float) -> bool:
    """Whether ``x`` is a (positive) power of two: a product by it is exact, so a scale that
    rides on a matmul's alpha leaves every score as the reference rounds it."""
    return math.frexp(x)[0] == 0.5


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """True when a tensor of ``shape`` broadcasts to exactly ``target`` (no axis grows it)."""
    try:
        return torch.broadcast_shapes(torch.Size(shape), torch.Size(target)) == torch.Size(target)
    except RuntimeError:
        return False


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def autocast_off(fn: _Fn) -> _Fn:
    """Run ``fn`` with ``torch.autocast`` off on the CPU (and CUDA where it is on): the loops
    and the dense reference compute in their own accumulation dtype, whichever step runs
    them. Under an enabled autocast their PyTorch matmuls would otherwise run in the
    autocast dtype (bfloat16) while the native step's did not, so that a result returned
    as float32 carried bfloat16 errors on some paths only (loop_order="fa1", a
    reference_forward asked for dtype=float32, which even came back in bfloat16)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            if torch.is_autocast_enabled("cuda"):
                with torch.autocast("cuda", enabled=False):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
