"""One attention problem, validated and laid out for the loops.

Both the dense reference and the blocked loop start here, so every option is
checked once, with the same messages. Tensors are viewed in the internal 5-D
layout ``(B, Hkv, G, L, d)`` (``G = Hq // Hkv``; K and V have ``G = 1``).
"""

from __future__ import annotations

import math
import numbers
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ._checks import (
    FLOAT_DTYPES,
    all_finite,
    any_of,
    check_finite,
    check_float_tensor,
    check_qkv,
    check_qkv_finite,
    pieces,
    plain,
    value_range,
)
from ._mods import ScoreModFn
from .conventions import Conventions, get_conventions
from .dropout import dropout_keep
from .masks import (
    And,
    BoundMask,
    Causal,
    Geometry,
    Mask,
    SlidingWindow,
    _SequenceBounds,
    as_mask,
    padding_of,
)
from .scores import ScoreMod, to5d

__all__ = [
    "FLOAT_DTYPES",
    "SEED_LIMIT",
    "Placement",
    "Problem",
    "build_problem",
    "check_option_values",
]


@dataclass(frozen=True)
class Placement:
    """Where this call's rows and keys sit in a longer sequence (split-KV, ring attention).

    Query row ``r`` of the call is global row ``q_offset + r``; key ``c`` is
    global key ``k_offset + c``; masks, ALiBi, bias and dropout use global
    positions and the global lengths ``lq_total`` / ``lk_total``.
    """

    q_offset: int = 0
    k_offset: int = 0
    lq_total: int | None = None
    lk_total: int | None = None


@dataclass
class Problem:
    """Everything a loop needs, validated. Shapes in the comments."""

    q_in: torch.Tensor  # (B, Hkv, G, Lq, d) in the input dtype (``q``: in the accumulation dtype)
    k_in: torch.Tensor  # (B, Hkv, 1, Lk, d) likewise (``k``)
    v_in: torch.Tensor  # (B, Hkv, 1, Lk, d_v) likewise (``v``)
    ndim: int  # caller's rank: 2, 3 or 4
    out_dtype: torch.dtype
    acc_dtype: torch.dtype  # the loop's: float32 for half inputs, float64 for float64
    conventions: Conventions
    geo: Geometry
    mask: BoundMask | None
    smod: ScoreMod
    dropout_p: float
    seed: int
    # an outside keep mask, (B|1, Hkv|1, G|1, Lq_total|1, Lk_total|1), or None
    keep_mask: torch.Tensor | None = None
    # the caller's q, k, v: their values are checked only when a result is not finite
    # (``_blame_inputs``), so that a decode step does not read the whole cache once more
    inputs: tuple[torch.Tensor, ...] = ()
    # bytes of the copies of K and V made for this call so far, booked where each is made:
    # laid out contiguously here, converted to the accumulation dtype (``k``, ``v``), laid
    # out anew by a forward pass (the PyTorch step's Vᵀ, the native step's Kᵀ)
    kv_bytes_copied: int = 0

    @property
    def has_dropout(self) -> bool:
        """True when entries are dropped: ``dropout_p > 0`` or an outside keep mask."""
        return self.dropout_p != 0.0 or self.keep_mask is not None

    @property
    def dtype(self) -> torch.dtype:
        """The accumulation dtype."""
        return self.acc_dtype

    @property
    def q(self) -> torch.Tensor:
        """Q ``(B, Hkv, G, Lq, d)`` in the accumulation dtype (converted once, when first
        asked: the native step's half path reads ``q_in`` as it is)."""
        if "_q" not in self.__dict__:
            self.__dict__["_q"] = self.q_in.to(self.dtype)
        return self.__dict__["_q"]  # type: ignore[no-any-return]

    @property
    def k(self) -> torch.Tensor:
        """K ``(B, Hkv, 1, Lk, d)`` in the accumulation dtype (converted once, when first
        asked: a decode step reading a half-precision cache in place, or the half path,
        never asks)."""
        if "_k" not in self.__dict__:
            self.__dict__["_k"] = self._converted(self.k_in)
        return self.__dict__["_k"]  # type: ignore[no-any-return]

    @property
    def v(self) -> torch.Tensor:
        """V ``(B, Hkv, 1, Lk, d_v)`` in the accumulation dtype (converted once)."""
        if "_v" not in self.__dict__:
            self.__dict__["_v"] = self._converted(self.v_in)
        return self.__dict__["_v"]  # type: ignore[no-any-return]

    def _converted(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (K or V) in the accumulation dtype, the copy booked (``kv_bytes_copied``)."""
        if x.dtype == self.dtype:
            return x
        self.kv_bytes_copied += x.numel() * self.dtype.itemsize
        return x.to(self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int, int, int]:
        """``(B, Hq, Hkv, G, Lq, Lk, d, d_v)``."""
        b, hkv, g, lq, d = self.q_in.shape
        return b, hkv * g, hkv, g, lq, self.k_in.shape[-2], d, self.v_in.shape[-1]

    # -- layout -----------------------------------------------------------------------
    def user_q(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Hkv, G, L, *)`` -> the caller's layout of a query-side tensor."""
        b, hkv, g = x.shape[:3]
        y = x.reshape(b, hkv * g, *x.shape[3:])
        return _drop_leading(y, self.ndim, rows_only=x.ndim == 4)

    def user_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Hkv, G, L)`` row statistics -> ``(..., L)`` in the caller's layout."""
        return self.user_q(x)

    def user_k(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, Hkv, 1, L, *)`` or ``(B, Hkv, L, *)`` -> the caller's layout of a key-side tensor."""
        y = x.squeeze(2) if x.ndim == 5 else x
        return _drop_leading(y, self.ndim, rows_only=False)

    def to_internal_q(self, x: torch.Tensor) -> torch.Tensor:
        """A caller-layout query-side tensor ``(..., L, X)`` -> ``(B, Hkv, G, L, X)``."""
        b, hq, hkv, g = self.shape[:4]
        y = _add_leading(x, 4)
        return y.reshape(b, hkv, g, *y.shape[2:])

    def to_internal_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Caller-layout rows ``(..., L)`` -> ``(B, Hkv, G, L)``."""
        b, hq, hkv, g = self.shape[:4]
        y = _add_leading(x, 3)
        return y.reshape(b, hkv, g, y.shape[-1])

    # -- per-tile ingredients ---------------------------------------------------------
    def keep_tile(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Dropout keep mask of a tile, bool ``(B, Hkv, G, bq, bk)``, or None without dropout."""
        b, hq, hkv, g = self.shape[:4]
        if self.keep_mask is not None:
            t, geo = self.keep_mask, self.geo
            rq = slice(geo.q_offset + q0, geo.q_offset + q1) if t.shape[-2] != 1 else slice(None)
            rk = slice(geo.k_offset + k0, geo.k_offset + k1) if t.shape[-1] != 1 else slice(None)
            return t[..., rq, rk].expand(b, hkv, g, q1 - q0, k1 - k0)
        if self.dropout_p == 0.0:
            return None
        dev = self.geo.device
        bi = torch.arange(b, device=dev).view(b, 1, 1, 1, 1)
        hi = torch.arange(hq, device=dev).view(1, hkv, g, 1, 1)
        i = torch.arange(q0, q1, device=dev).view(-1, 1) + self.geo.q_offset
        j = torch.arange(k0, k1, device=dev).view(1, -1) + self.geo.k_offset
        return dropout_keep(self.seed, self.dropout_p, self.conventions.dropout_keep, bi, hi, i, j)

    def mask_tile(self, q0: int, q1: int, k0: int, k1: int, *, kept: bool = True) -> torch.Tensor:
        """Visibility of a tile, bool broadcastable to ``(B, Hkv, G, bq, bk)``; ``kept``: a
        partial tile of the loop (a mask_mod's visibility is kept between passes)."""
        assert self.mask is not None
        if kept:
            vis = self.mask.tile_visibility(q0, q1, k0, k1)  # (Bm, Hm, bq, bk)
        else:
            vis = self.mask.block(q0, q1, k0, k1)
        b, hq, hkv, g = self.shape[:4]
        if vis.shape[1] == 1:
            return vis.unsqueeze(2)
        return vis.reshape(vis.shape[0], hkv, g, *vis.shape[2:])

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.dropout_p)

    # -- what a result may hold -------------------------------------------------------
    def rows_with_keys(self) -> torch.Tensor | None:
        """Bool ``(B|1, Hkv|1, G|1, Lq)``: rows that see at least one key of this call (after
        the mask and any -inf entries of ``bias``); None when every row does."""
        vis = None
        if self.mask is not None:
            rows = self.mask.rows_with_keys()  # (Bm, Hm, Lq)
            vis = rows.unsqueeze(2) if rows.shape[1] == 1 else self._split_heads(rows)
        bias = self.smod.bias
        if bias is not None and not self._bias_finite():  # -inf entries hide keys too
            lq, lk = self.shape[4], self.shape[5]
            seen = torch.isfinite(
                self.smod.bias_tile(0, lq, 0, lk)
            )  # (B|1, Hkv|1, G|1, Lq|1, Lk|1)
            if self.mask is not None:
                seen = seen & self.mask_tile(0, lq, 0, lk)
            vis = any_of(seen.expand(*seen.shape[:3], lq, lk), -1)  # (B|1, Hkv|1, G|1, Lq)
        return vis

    def _bias_finite(self) -> bool:
        """Whether every value of the bias is finite (from its ``(min, max)``, found when it
        was checked: no pass over it here)."""
        lo, hi = self.smod.bias_range or value_range(self.smod.bias)  # type: ignore[arg-type]
        return -math.inf < lo and hi < math.inf

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(Bm, Hq, ...)`` -> ``(Bm, Hkv, G, ...)``."""
        hkv, g = self.shape[2], self.shape[3]
        return x.reshape(x.shape[0], hkv, g, *x.shape[2:])

    def score_bound(self) -> float:
        """An upper bound on ``|s|`` over the visible scores, from the inputs (float64).

        ``|scale · q·k| <= |scale| · max‖q‖ · max‖k‖`` (softcap bounds it by ``c``), plus
        the largest ALiBi distance times the largest slope and the largest finite ``|bias|``.
        Infinite when the norms themselves overflow float64, or with a score_mod (a user
        function: no bound).
        """
        sm = self.smod
        if sm.user is not None:
            return math.inf
        if sm.softcap is not None:
            bound = sm.softcap
        else:
            bound = abs(sm.scale) * _max_norm(self.q_in) * _max_norm(self.k_in)
        if sm.slopes is not None:
            bound += float(sm.slopes.detach().abs().amax()) * (
                self.geo.lq_total + self.geo.lk_total
            )
        if sm.bias is not None:
            bound += _largest_finite_magnitude(sm.bias, sm.bias_range)
        return bound

    def _user_index(self, bad: torch.Tensor) -> tuple[int, ...]:
        """Index, in the caller's layout of a ``(..., Lq)`` row tensor, of the first True of
        the internal ``(B, Hkv, G, Lq)`` bool ``bad``."""
        b, hq, hkv, g, lq = self.shape[:5]
        full = self.user_rows(bad.expand(b, hkv, g, lq))
        return tuple(int(i) for i in torch.nonzero(full)[0].tolist())

    def check_forward_lse(self, lse: torch.Tensor, o: torch.Tensor | None = None) -> bool:
        """Raise ``ValueError`` when a result is not finite where it must be: the scores or
        the output overflowed the accumulation dtype (the inputs are finite, so they are too
        large). ``lse`` ``(B, Hkv, G, Lq)`` is the raw LSE (-inf on rows that see no key);
        ``o`` ``(B, Hkv, G, Lq, d_v)`` optional. Returns True when some row's LSE is -inf
        (a row that sees no key: the conventions may report another value there)."""
        bad = None
        lse = lse.detach()
        lo = hi = 0.0
        if lse.numel():
            lo, hi = (float(x) for x in torch.aminmax(lse))  # one pass; NaN propagates
        if not hi < math.inf and bool((torch.isnan(lse) | (lse == math.inf)).any()):
            bad = torch.isnan(lse) | (lse == math.inf)  # NaN or +inf: a score reached +inf
        elif self.smod.user is None and lo == -math.inf:
            # -inf on a row that sees keys (a score_mod may send a whole row to -inf: Flex
            # gives that row O = 0 and LSE -inf, as a masked one)
            rows = self.rows_with_keys()
            neg = torch.isneginf(lse)
            bad = neg if rows is None else neg & rows
            if not bool(bad.any()):
                bad = None
        if bad is not None:
            self._blame_inputs()
            idx = ", ".join(map(str, self._user_index(bad)))
            raise ValueError(self._overflow_message(f"the scores of output row o[{idx}, :]"))
        if o is not None and not all_finite(o):
            self._blame_inputs()
            bad = ~torch.isfinite(o).all(dim=-1)  # (B, Hkv, G, Lq)
            idx = ", ".join(map(str, self._user_index(bad)))
            raise ValueError(self._overflow_message(f"output row o[{idx}, :]"))
        return lo == -math.inf

    def check_gradients(self, **grads: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the first value that is not finite of a gradient as it
        is returned (``gradient_overflow``), or the input that is not finite."""
        for name, x in grads.items():
            err = gradient_overflow(name, x, self.dtype)
            if err is not None:
                self._blame_inputs()
                raise err

    def check_saved_lse(self, lse: torch.Tensor, *, whole: bool) -> None:
        """The LSE handed to a backward must be the forward's: on every row that sees keys it
        is finite and within ``[-bound, bound + log Lk]`` of the score bound (``whole``: this
        call covers every key of the rows, so the upper limit applies). Rows that see no key
        may carry any convention's value (-inf, +inf, 0). ``lse`` ``(B, Hkv, G, Lq)``."""
        lse = lse.detach()
        bound = self.score_bound()
        slack = 1e-3 * bound + 1.0  # rounding of the scores in the accumulation dtype
        lo = -(bound + slack)
        hi = bound + slack + math.log(self.geo.lk_total) if whole else math.inf
        ok = torch.isfinite(lse) & (lse >= lo) & (lse <= hi)
        if self.smod.user is not None:  # a score_mod may send a whole row to -inf
            ok |= torch.isneginf(lse)
        if bool(ok.all()):
            return
        rows = self.rows_with_keys()  # only when needed: a dense mask makes it O(Lq·Lk)
        bad = ~ok if rows is None else ~ok & rows
        if not bool(bad.any()):
            return
        self._blame_inputs()  # a NaN input makes the bound NaN: name the input instead
        idx = self._user_index(bad)
        value = float(self.user_rows(lse)[idx])
        raise ValueError(
            f"lse{list(idx)} = {value!r} cannot be the log-sum-exp of that row's scores: the "
            f"row sees keys, so its LSE is finite and within [{lo:.4g}, {hi:.4g}] for these "
            "inputs; pass the lse the forward returned for the same q, k, v and options (a row "
            "that sees no key may carry -inf, +inf or 0)"
        )

    def _blame_inputs(self) -> None:
        """A result is not finite: raise ``ValueError`` naming the first NaN or infinite
        element of q, k or v if there is one (else the caller explains the overflow)."""
        if self.inputs:
            check_qkv_finite(*self.inputs)

    def _overflow_message(self, where: str) -> str:
        if self.smod.user is not None:
            return (
                f"{where} overflow {_dtype_name(self.dtype)} (or the score_mod gave +inf or "
                "NaN) although q, k and v are finite: check what the score_mod returns"
                + _wider_hint(self.dtype)
            )
        bound = self.score_bound()
        big = torch.finfo(self.dtype).max
        if bound < big / 4:  # scores and their differences within range: a sum passed it
            what = (
                f"the row sums over up to {self.geo.lk_total} keys"
                if self.geo.lk_total >= big
                else "the weighted sums of v"
            )
            return (
                f"{where} overflow {_dtype_name(self.dtype)} although q, k and v are finite "
                f"and the scores (|scale·q·k| at most {bound:.3g}) are within its range: "
                f"{what} pass its largest value {big:.6g}"
                + ("; compute in float32 or float64" if self.dtype.itemsize < 4 else "")
            )
        reach = f"may reach {bound:.3g}" if math.isfinite(bound) else "exceeds float64's range"
        return (
            f"{where} overflow {_dtype_name(self.dtype)} although q, k and v are finite: the "
            f"inputs are too large (|scale·q·k| {reach}); scale q or k down"
            + _wider_hint(self.dtype)
        )


def _wider_hint(acc: torch.dtype) -> str:
    """What a message adds for results that overflow ``acc``: float64, where it is not."""
    return "" if acc == torch.float64 else ", or compute in float64"


def gradient_overflow(name: str, x: torch.Tensor, acc: torch.dtype) -> ValueError | None:
    """The error for gradient ``name`` as it is returned (the caller's layout and dtype),
    computed with finite inputs in ``acc``, when one of its values is not finite: its sums
    overflowed ``acc``, or it lies past the largest value of the narrower dtype it is
    returned in (float16's 65504). None when every value is finite."""
    if all_finite(x):
        return None
    at = [int(i) for i in torch.nonzero(~torch.isfinite(x.detach()))[0].tolist()]
    if x.dtype.itemsize < acc.itemsize:  # returned in a narrower dtype
        big = torch.finfo(x.dtype).max
        wider = "the bias in float32" if name == "dbias" else "float32 inputs"
        return ValueError(
            f"the gradient {name}{at} overflows {_dtype_name(x.dtype)} (largest finite value "
            f"{big:g}) although every input is finite: the inputs (q, k, v, o, do) are too "
            f"large for it; scale them down, or pass {wider} (the gradient then comes in "
            "float32)"
        )
    return ValueError(
        f"the gradient {name}{at} overflows {_dtype_name(acc)} although every input is finite: "
        "the inputs (q, k, v, o, do) are too large for it; scale them down" + _wider_hint(acc)
    )


def _largest_finite_magnitude(x: torch.Tensor, known: tuple[float, float] | None = None) -> float:
    """The largest ``|x|`` over the finite values of ``x`` (0 when there are none): from
    its ``(min, max)`` (``known``, or one ``aminmax`` pass) when every value is finite, as
    a dense bias usually is; else a copy with NaN and infinities as 0 (a boolean index of
    a (1, H, L, L) bias costs seconds at L = 4096)."""
    lo, hi = known or value_range(x)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = value_range(x.detach().nan_to_num(0.0, 0.0, 0.0))
    return max(abs(lo), abs(hi))


def _max_norm(x: torch.Tensor) -> float:
    """Largest row norm of ``(..., L, d)``, in the tensor's dtype, at least float32. Where
    the squares overflow or fall near the subnormals (entries past about 1e19 or under
    1e-19 in float32: a norm of 0 would make every score bound 0), once more in float64 on
    ``x / max|x|``, whose squares do neither."""
    wide = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else None
    # (a half x in slabs: PyTorch widens the whole operand before the norm otherwise)
    parts = pieces(x.detach()) if wide else [x.detach()]
    n = float(
        torch.stack([torch.linalg.vector_norm(p, dim=-1, dtype=wide).amax() for p in parts]).amax()
    )
    used = wide or x.dtype
    if math.isfinite(n) and n >= _SQUARES_SAFE[used]:
        return n
    top = float(x.detach().abs().amax())
    if top == 0.0 or not math.isfinite(top):
        return top
    scaled = x.detach().to(torch.float64) / top
    return top * float(torch.linalg.vector_norm(scaled, dim=-1).amax())


# row norms at or above these were summed from squares clear of the subnormals
_SQUARES_SAFE = {
    dt: math.sqrt(torch.finfo(dt).tiny) * 2.0**26 for dt in (torch.float32, torch.float64)
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _drop_leading(y: torch.Tensor, ndim: int, *, rows_only: bool) -> torch.Tensor:
    # y is (B, H, L, *) or (B, H, L) for rows
    target = ndim - 1 if rows_only else ndim
    while y.ndim > target:
        y = y.squeeze(0)
    return y


def _add_leading(x: torch.Tensor, ndim: int) -> torch.Tensor:
    while x.ndim < ndim:
        x = x.unsqueeze(0)
    return x


def _check_packed_layout(name: str, cu: Any, x: Any) -> None:
    """flash-attn packs varlen tensors as ``(total, H, d)``; flashledger packs along the length
    axis, ``(H, total, d)``: name the layout when the packed length sits in the head axis."""
    if cu is None or not isinstance(x, torch.Tensor) or x.ndim != 3:
        return
    try:
        last = int(torch.as_tensor(cu).reshape(-1)[-1])
    except (TypeError, ValueError, RuntimeError, IndexError):
        return  # _check_cu names what is wrong with cu itself
    if last != x.shape[1] and last == x.shape[0]:
        raise ValueError(
            f"with cu_seqlens, {name} is packed along the length axis as (H, total, d) "
            f"(or (total, d)); got {name} of shape {tuple(x.shape)}, whose first axis is the "
            f"packed length {last}: flash-attn's (total, H, d) layout; pass "
            f"{name}.transpose(0, 1)"
        )


def _check_cu(name: str, cu: Any, total: int) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        cu = torch.as_tensor(cu)
    if cu.ndim != 1 or cu.numel() < 2 or cu.is_floating_point() or cu.dtype == torch.bool:
        raise ValueError(
            f"{name} must be a 1-D integer tensor of cumulative lengths [0, ..., total], got {cu!r}"
        )
    c = cu.to(torch.int64).cpu()
    if int(c[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {c.tolist()}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {c.tolist()}")
    if int(c[-1]) != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {c.tolist()}")
    return c


SEED_LIMIT = 2**64
"""Seeds are integers in ``0..2**64 - 1``: the dropout hash keys on all 64 bits of the seed."""


def check_option_values(
    *,
    scale: Any,
    dropout_p: Any,
    seed: Any,
    softcap: Any,
    alibi_slopes: Any,
    bias: Any,
    bias_range: tuple[float, float] | None = None,
) -> tuple[float, float] | None:
    """The options that do not depend on the shapes: raise naming the option and what is allowed.

    ``scale`` is the value after its default (``None`` is not allowed here). Returns the
    bias's ``(min, max)`` (None without one; ``bias_range``: already known, as the
    autograd backward knows the forward's, autograd having checked that the bias is
    unchanged), found in the one pass that checks its values.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(
            f"scale must be a finite number (default 1/sqrt(d)), got {type(scale).__name__} "
            f"{scale!r}"
        )
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (default 1/sqrt(d)), got {scale!r}")
    if (
        isinstance(dropout_p, bool)
        or not isinstance(dropout_p, (int, float))
        or not (0.0 <= dropout_p < 1.0)
    ):
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(
            "seed must be an integer >= 0 and < 2**64 (the dropout hash keys on 64 bits, so "
            f"larger seeds would repeat smaller ones), got {seed!r}"
        )
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if alibi_slopes is not None:
        check_float_tensor("alibi_slopes", alibi_slopes)
        check_finite("alibi_slopes", alibi_slopes)
    if bias is None:
        return None
    check_float_tensor("bias", bias)
    if bias_range is None:
        bias_range = value_range(bias)
    if not bias_range[1] < math.inf:  # NaN or +inf somewhere: name the first
        check_finite("bias", bias, allow_neg_inf=True)
    return bias_range


def _as_real(name: str, x: Any, allowed: str) -> Any:
    """A number option as a Python float: a NumPy scalar or a 0-d tensor (no gradient) taken
    by value; None and other types left for ``check_option_values`` to name; a number past
    float's range refused here, naming the option."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, torch.Tensor):
        if x.ndim != 0 or x.requires_grad or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(
                f"{name} must be {allowed}; a tensor is taken only as a 0-d real value "
                f"without a gradient, got shape {tuple(x.shape)} {x.dtype}"
                + (" requiring grad" if x.requires_grad else "")
            )
        return float(x)
    if isinstance(x, numbers.Real) and not isinstance(x, float | int):
        return float(x)  # a NumPy or other real scalar
    if isinstance(x, int):
        try:
            float(x)
        except OverflowError:
            raise ValueError(
                f"{name} must be {allowed}, got an integer of {len(str(x))} digits, "
                "past float's range"
            ) from None
    return x


def _as_whole(name: str, x: Any, allowed: str) -> Any:
    """An integer option as a Python int: a NumPy integer or a 0-d integer tensor (no
    gradient) taken by value; anything else left for ``check_option_values`` to name."""
    if isinstance(x, bool | int) or x is None:
        return x
    if isinstance(x, torch.Tensor):
        if x.ndim != 0 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(
                f"{name} must be {allowed}; a tensor is taken only as a 0-d integer value, "
                f"got shape {tuple(x.shape)} {x.dtype}"
            )
        return int(x)
    if isinstance(x, numbers.Integral):
        return int(x)  # a NumPy or other integer scalar
    return x


def _check_representable(
    acc: torch.dtype, dtype: torch.dtype, scale: Any, softcap: Any, slopes: Any
) -> None:
    """A finite option that rounds to infinity in the accumulation dtype ``acc`` (float32
    for float32 and half inputs) would make the scores NaN, not large: refused by name.
    Options of the wrong type are left for ``check_option_values``."""
    big = torch.finfo(acc).max
    where = f"{_dtype_name(acc)}, the accumulation dtype of {_dtype_name(dtype)} inputs"
    for name, x in (("scale", scale), ("softcap", softcap)):
        real = isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x)
        if real and abs(x) > big:
            raise ValueError(
                f"{name} = {x:.4g} is past the largest value of {where} ({big:.4g}); "
                "pass float64 inputs for it"
            )
    if isinstance(slopes, torch.Tensor) and slopes.dtype in FLOAT_DTYPES and slopes.numel():
        top = float(slopes.detach().abs().amax())
        if math.isfinite(top) and top > big:
            raise ValueError(
                f"alibi_slopes reach {top:.4g}, past the largest value of {where} ({big:.4g}); "
                "pass float64 inputs for them"
            )


def build_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    scale: float | None = None,
    conventions: Conventions | str | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    score_mod: ScoreModFn | None = None,
    placement: Placement | None = None,
    acc_dtype: torch.dtype | None = None,
    bias_range: tuple[float, float] | None = None,
) -> Problem:
    """Validate every input and option and lay the problem out for a loop. The values of
    q, k, v are checked when a result is not finite (a NaN or inf no visible score reads
    changes nothing), not here: that check reads every input once more. ``bias_range``: the
    bias's ``(min, max)`` when the caller already found it for this bias, unchanged since
    (the autograd backward: the forward's), so that its values are not read again.

    A call of a few rows whose options hold no tensor (a decode step: every layer of a
    model repeats its shapes) reuses the frame of an earlier call with the same shapes,
    dtypes, devices and options (``_FRAMES``): what validation found and built depends on
    nothing else."""
    scale = _as_real("scale", scale, "a finite number (default 1/sqrt(d))")
    softcap = _as_real("softcap", softcap, "None or a finite number > 0")
    dropout_p = _as_real("dropout_p", dropout_p, "a number in [0, 1)")
    seed = _as_whole("seed", seed, "an integer >= 0 and < 2**64")
    tensors = (alibi_slopes, bias, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    key = None  # a score_mod is a user function (it may read tensors): never kept
    if dropout_mask is None and score_mod is None and all(t is None for t in tensors):
        key = _frame_key(
            q, k, v, mask, conventions, placement, acc_dtype, scale, dropout_p, seed, softcap
        )
    frame = _FRAMES.get(key) if key is not None else None
    if frame is None:
        frame = _frame_of(
            q,
            k,
            v,
            mask=mask,
            scale=scale,
            conventions=conventions,
            dropout_p=dropout_p,
            seed=seed,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            bias=bias,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            dropout_mask=dropout_mask,
            score_mod=score_mod,
            placement=placement,
            acc_dtype=acc_dtype,
            bias_range=bias_range,
        )
        if key is not None:
            _FRAMES.put(key, frame)
    return frame.problem(q, k, v)


@dataclass(frozen=True)
class _Frame:
    """What a call's shapes and options make of it, before any value is read: validated,
    with its conventions, geometry, bound mask and score transform (shared by the calls
    that reuse it: never modified)."""

    dims: tuple[int, int, int, int, int]  # (B, Hkv, G, Lq, d)
    acc_dtype: torch.dtype
    conventions: Conventions
    geo: Geometry
    mask: BoundMask | None
    smod: ScoreMod
    dropout_p: float
    seed: int
    keep_mask: torch.Tensor | None

    def problem(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Problem:
        """The call's ``Problem``: q, k, v laid out in the internal 5-D layout."""
        b, hkv, g, lq, d = self.dims
        q4, k4, v4 = (_add_leading(plain(x), 4) for x in (q, k, v))
        # contiguous once here (a copy only for strided inputs, e.g. heads sliced out of a
        # larger tensor, or a cache's used rows), so that every tile of the loop is a view
        k_in, v_in = k4.contiguous().unsqueeze(2), v4.contiguous().unsqueeze(2)
        copied = sum(  # the copies just made: a negative view resolved, a strided one laid out
            x.numel() * x.element_size() * (int(x.is_neg()) + int(not x4.is_contiguous()))
            for x, x4 in ((k, k4), (v, v4))
        )
        return Problem(
            q_in=q4.contiguous().view(b, hkv, g, lq, d),
            k_in=k_in,
            v_in=v_in,
            ndim=q.ndim,
            out_dtype=q.dtype,
            acc_dtype=self.acc_dtype,
            conventions=self.conventions,
            geo=self.geo,
            mask=self.mask,
            smod=self.smod,
            dropout_p=self.dropout_p,
            seed=self.seed,
            keep_mask=self.keep_mask,
            inputs=(q, k, v),
            kv_bytes_copied=copied,
        )


_FRAME_ROWS = 512  # frames are kept for calls of at most this many query rows


def _frame_key(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    conventions: Any,
    placement: Any,
    acc_dtype: Any,
    *scalars: Any,
    max_rows: int = _FRAME_ROWS,
) -> tuple[Any, ...] | None:
    """The frame cache's key of a call: shapes, dtypes and devices of q, k, v and the
    options (scalars with their types, so that ``True`` is not taken for ``1``); None
    when the frame may not be kept: inputs that are not tensors, more than ``max_rows``
    query rows, a mask other than ``Causal``/``SlidingWindow`` (those are values; others
    may hold tensors), an option given as a tensor, or an unhashable option."""
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        return None
    if q.ndim < 2 or q.shape[-2] > max_rows:
        return None
    if mask is not None and type(mask) not in (Causal, SlidingWindow):
        return None
    if any(isinstance(x, torch.Tensor) for x in scalars):  # a 0-d tensor scale: by value later
        return None
    key = (
        (q.shape, k.shape, v.shape),
        (q.dtype, k.dtype, v.dtype),
        (q.device, k.device, v.device),
        mask,
        conventions,
        placement,
        acc_dtype,
        tuple((type(x), x) for x in scalars),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


F = TypeVar("F")


class _FrameCache(Generic[F]):
    """The most recent frames (``size`` of them), by key; safe to share between threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._frames: OrderedDict[tuple[Any, ...], F] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> F | None:
        with self._lock:
            frame = self._frames.get(key)
            if frame is not None:
                self._frames.move_to_end(key)
            return frame

    def put(self, key: tuple[Any, ...], frame: F) -> None:
        with self._lock:
            self._frames[key] = frame
            while len(self._frames) > self.size:
                self._frames.popitem(last=False)


_FRAMES: _FrameCache[_Frame] = _FrameCache(64)


def _frame_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None = None,
    scale: float | None = None,
    conventions: Conventions | str | None = None,
    dropout_p: float = 0.0,
    seed: int = 0,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    score_mod: ScoreModFn | None = None,
    placement: Placement | None = None,
    acc_dtype: torch.dtype | None = None,
    bias_range: tuple[float, float] | None = None,
) -> _Frame:
    """Validate every input and option (not the values of q, k, v) and build the call's
    frame: conventions, geometry, bound mask, score transform."""
    for name, cu, x in (("q", cu_seqlens_q, q), ("k", cu_seqlens_k, k)):
        _check_packed_layout(name, cu, x)
    check_qkv(q, k, v, finite=False)
    conv = get_conventions(conventions)
    q4 = _add_leading(q, 4)
    k4 = _add_leading(k, 4)
    b, hq, lq, d = q4.shape
    hkv, lk = k4.shape[1], k4.shape[2]
    g = hq // hkv
    if acc_dtype is None:
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    elif acc_dtype not in FLOAT_DTYPES:
        raise TypeError(
            "dtype must be a floating dtype (float16, bfloat16, float32, float64), "
            f"got {acc_dtype!r}"
        )
    # -- options --
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    _check_representable(acc_dtype, q.dtype, scale, softcap, alibi_slopes)
    bias_range = check_option_values(
        scale=scale,
        dropout_p=dropout_p,
        seed=seed,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        bias=bias,
        bias_range=bias_range,
    )
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            "score_mod must be None or callable as score_mod(score, b, h, q_idx, kv_idx) -> "
            f"score, got {type(score_mod).__name__}"
        )
    place = placement or Placement()
    lq_total = place.lq_total if place.lq_total is not None else lq
    lk_total = place.lk_total if place.lk_total is not None else lk
    if not (
        place.q_offset >= 0
        and place.q_offset + lq <= lq_total
        and place.k_offset >= 0
        and place.k_offset + lk <= lk_total
    ):
        raise ValueError(f"placement {place} does not fit the call's lengths Lq={lq}, Lk={lk}")
    if bias is not None:
        bb = _add_leading(bias, 4)
        want = (b, hq, lq_total, lk_total)
        if bias.ndim > 4 or any(s not in (1, w) for s, w in zip(bb.shape, want)):
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} is not broadcastable to (B, H, Lq, Lk) = {want}"
            )
    # -- variable length --
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    cq = ck = None
    if cu_seqlens_q is not None:
        if b != 1:
            raise ValueError(
                "with cu_seqlens, sequences are packed along the length axis: q must be "
                f"(total_q, d) or (H, total_q, d), got {tuple(q.shape)}"
            )
        if placement is not None:
            raise ValueError("cu_seqlens cannot be combined with a placement")
        cq = _check_cu("cu_seqlens_q", cu_seqlens_q, lq)
        ck = _check_cu("cu_seqlens_k", cu_seqlens_k, lk)
        if cq.numel() != ck.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                f"got {cq.numel() - 1} and {ck.numel() - 1}"
            )
    n_seq = b if cq is None else cq.numel() - 1
    if alibi_slopes is not None:  # dtype and values checked above
        rows = b if cq is None else n_seq
        if alibi_slopes.shape not in ((hq,), (rows, hq)):
            per = "(B, H)" if cq is None else "(n, H), one row per sequence"
            raise ValueError(
                f"alibi_slopes must have shape (H,) = ({hq},) or {per} = ({rows}, {hq}), "
                f"got {tuple(alibi_slopes.shape)}"
            )
    if dropout_mask is not None:
        _check_dropout_mask(dropout_mask, (b, hq, lq_total, lk_total))
    dropping = dropout_p > 0 or dropout_mask is not None
    if softcap is not None and dropping and not conv.softcap_with_dropout:
        raise ValueError(
            f"conventions {conv.name!r} refuse softcap together with dropout (the real "
            "kernel has no softcapped dropout path); pass one of them, or conventions "
            "that accept the pair (e.g. 'seed')"
        )
    # -- used lengths: seqused_q / seqused_k, or a Padding mask --
    m = as_mask(mask)
    pad = padding_of(m)
    used: dict[str, Any] = {}
    if pad is not None:
        if cq is not None:
            raise ValueError(
                "a Padding mask cannot be combined with cu_seqlens; packed sequences take "
                "seqused_q / seqused_k"
            )
        if seqused_q is not None or seqused_k is not None:
            raise ValueError(
                "a Padding mask and seqused_q/seqused_k both set the used lengths; give one"
            )
        for name, lens, total in (
            ("q_lens", pad.q_lens, lq_total),
            ("k_lens", pad.k_lens, lk_total),
        ):
            if lens is not None:
                _check_used(f"Padding {name}", lens, b, total, per_batch=True)
        used = pad.geometry_options()
    else:
        if seqused_q is not None:
            alloc_q = lq_total if cq is None else cq[1:] - cq[:-1]
            used["seqused_q"] = _check_used(
                "seqused_q", seqused_q, n_seq, alloc_q, per_batch=cq is None
            )
        if seqused_k is not None:
            alloc_k = lk_total if ck is None else ck[1:] - ck[:-1]
            used["seqused_k"] = _check_used(
                "seqused_k", seqused_k, n_seq, alloc_k, per_batch=cq is None
            )
    geo = Geometry.build(
        lq=lq,
        lk=lk,
        batch=b,
        heads=hq,
        causal_align=conv.causal_align,
        window_rewrite=conv.window_rewrite == "flash_attn_2",
        device=q.device,
        q_offset=place.q_offset,
        k_offset=place.k_offset,
        lq_total=lq_total,
        lk_total=lk_total,
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        **used,
    )
    if geo.bounded:
        m = _SequenceBounds() if m is None else (_SequenceBounds() & m)
    bound = m.bind(geo) if m is not None else None
    smod = ScoreMod.build(
        scale=float(scale),
        geo=geo,
        hkv=hkv,
        g=g,
        softcap=None if softcap is None else float(softcap),
        alibi_slopes=alibi_slopes,
        bias=bias,
        bias_range=bias_range,
        dtype=acc_dtype,
        alibi_key_index=conv.alibi_causal == "key_index" and causal_in_fa_terms(m, geo),
        score_mod=score_mod,
        batch=b,
    )
    keep_mask = None
    if dropout_mask is not None:
        km = _add_leading(dropout_mask, 4).to(q.device)
        keep_mask = to5d(km, hkv, g)
    return _Frame(
        dims=(b, hkv, g, lq, d),
        acc_dtype=acc_dtype,
        conventions=conv,
        geo=geo,
        mask=bound,
        smod=smod,
        dropout_p=float(dropout_p),
        seed=seed,
        keep_mask=keep_mask,
    )


def _check_dropout_mask(t: Any, want: tuple[int, int, int, int]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"dropout_mask must be a bool tensor (True = kept), got {got}")
    tt = _add_leading(t, 4)
    if t.ndim > 4 or any(s not in (1, w) for s, w in zip(tt.shape, want)):
        raise ValueError(
            f"dropout_mask of shape {tuple(t.shape)} is not broadcastable to "
            f"(B, H, Lq, Lk) = {want}"
        )


def _check_used(
    name: str, x: Any, n: int, alloc: int | torch.Tensor, *, per_batch: bool
) -> torch.Tensor:
    """Used lengths: 1-D integers, one per batch element (or 1) / per sequence, each within
    its allocated length ``alloc`` (an int, or ``(n,)`` per sequence). Returns int64 ``(n|1,)``."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.ndim != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor of used lengths, got {x!r}")
    sizes = (1, n) if per_batch else (n,)
    what = "batch element" if per_batch else "sequence"
    if t.numel() not in sizes:
        raise ValueError(f"{name} has {t.numel()} entries; it needs one per {what} ({n})")
    c = t.to(torch.int64).cpu()
    limit = torch.as_tensor(alloc, dtype=torch.int64).cpu()
    bad = (c < 0) | (c > limit)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        top = int(limit if limit.ndim == 0 else limit[i])
        raise ValueError(
            f"{name}[{i}] = {int(c[i])} is outside 0..{top} (the {what}'s allocated length)"
        )
    return c


def causal_in_fa_terms(mask: Mask | None, geo: Geometry) -> bool:
    """flash-attn's ``is_causal`` for a mask: the windows of its ``&`` chain
    (``Causal`` = no left bound, right 0), all bottom-right aligned, with sides dropped
    where flash-attn 2 drops them (``>= seqlen_k``), intersect to no left bound and a
    right bound of 0 (``flash_api.cpp`` decides ``is_causal`` before it turns a
    remaining -1 side into ``seqlen_k``)."""
    left: int | None = None
    right: int | None = None
    found = False
    for leaf in _and_leaves(mask):
        if isinstance(leaf, Causal):
            sides: tuple[int | None, int | None] = (None, 0)
        elif isinstance(leaf, SlidingWindow):
            sides = leaf.sides(geo, clip_only=True)
        else:
            continue
        if (leaf.align or geo.causal_align) != "bottom_right":
            return False
        found = True
        l_, r_ = sides
        left = l_ if left is None else (left if l_ is None else min(left, l_))
        right = r_ if right is None else (right if r_ is None else min(right, r_))
    return found and left is None and right == 0


def _and_leaves(mask: Mask | None) -> list[Mask]:
    if mask is None:
        return []
    if isinstance(mask, And):
        return _and_leaves(mask.a) + _and_leaves(mask.b)
    return [mask]
