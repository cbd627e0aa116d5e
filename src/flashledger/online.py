"""The running state of one output row, its update, and the one merge.

For each new key block ``B`` of a row (the seed's section 01)::

    m'  = max(m, max_j s_j)              running maximum
    α   = exp(m - m')                    rescale factor for the old state
    ℓ'  = α ℓ + Σ_j exp(s_j - m')        running denominator
    a'  = α a + Σ_j exp(s_j - m') v_j    running weighted sum of values
    o'  = a' / ℓ'                        output of the prefix read so far

Start: ``m = -inf``, ``ℓ = 0``, ``a = 0``. An empty state has scale 0:
``exp(-inf - (-inf))`` is never evaluated (where ``m' = -inf`` it is replaced
by 0 before subtracting, so every exponential of a masked score is exp(-inf) = 0).

=========  ==========  ===================  ==============================
symbol     variable    shape                meaning
=========  ==========  ===================  ==============================
m          ``m``       (..., rows)          running max of the scores read
ℓ          ``ell``     (..., rows)          Σ exp(s - m) over keys read
a          ``acc``     (..., rows, d_v)     Σ exp(s - m) v over keys read
α          ``alpha``   (..., rows)          exp(m_old - m_new), 0 if empty
P̃          ``p``       (..., rows, cols)    exp(s - m_new) of this block
λ (LSE)    ``lse``     (..., rows)          m + log ℓ (-inf for an empty row)
=========  ==========  ===================  ==============================

``merge`` combines partial states of the same rows over disjoint key sets (two,
or any number stacked along a first dim, in one pass); it is the only merge rule in
flashledger: split-KV and ring attention call it, the native step's key splits
(flash-decoding) run the same rule in C (``Kernels.merge_splits``, tested against
``merge_partials``), and a partial result ``(o, lse)`` is the state ``(m=lse, ℓ=1, a=o)``.

Run ``python -m flashledger.online`` for the seed's six-score demo.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import FLOAT_DTYPES
from .ledger import HTML_ROWS, _fmt

__all__ = [
    "OnlineSoftmax",
    "OnlineState",
    "OnlineStep",
    "blockwise_softmax_average",
    "exp_shifted",
    "finalize",
    "merge",
    "merge_partials",
    "rescale_factor",
    "state_from_partial",
    "step",
    "step_",
]


@dataclass(frozen=True)
class OnlineState:
    """Running state of some rows: ``m``, ``ell`` ``(..., rows)``, ``acc`` ``(..., rows, d_v)``."""

    m: torch.Tensor
    ell: torch.Tensor
    acc: torch.Tensor

    @staticmethod
    def empty(
        rows: Sequence[int], d_v: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> OnlineState:
        m = torch.full(tuple(rows), -math.inf, dtype=dtype, device=device)  # (..., rows)
        ell = torch.zeros(tuple(rows), dtype=dtype, device=device)  # (..., rows)
        acc = torch.zeros((*rows, d_v), dtype=dtype, device=device)  # (..., rows, d_v)
        return OnlineState(m, ell, acc)


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """``m`` with -inf replaced by 0: the subtrahend of an empty state's exponentials."""
    return torch.nan_to_num(m, nan=math.nan, posinf=math.inf, neginf=0.0)


LOG2E = 1.4426950408889634  # log2(e)


def exp_shifted(
    x: torch.Tensor, shift: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``exp(x - shift)`` (``shift`` broadcast against ``x``), the loops' exponential.

    The difference is formed first (exact when ``x`` is near ``shift``, where
    the large weights are), then ``2^((x - shift) · log2 e)``: PyTorch's
    ``exp2`` is several times faster than ``exp`` on CPU. Masked entries
    (``x = -inf``) and empty rows (``shift = +inf``) give exactly 0; ``shift``
    must not be -inf. ``out=x`` works in place.
    """
    return torch.sub(x, shift, out=out).mul_(LOG2E).exp2_()


def rescale_factor(m_old: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """``α = exp(m_old - m_new)``, exactly 0 where the old state is empty (``m_old = -inf``)."""
    return torch.exp(m_old - _finite_or_zero(m_new))


def step(
    state: OnlineState,
    s: torch.Tensor,
    v: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    keep_scale: float = 1.0,
) -> tuple[OnlineState, torch.Tensor, torch.Tensor]:
    """Read one key block: scores ``s`` ``(..., rows, cols)``, values ``v`` ``(..., cols, d_v)``.

    ``keep`` (bool, broadcastable to ``s``) applies dropout to the weights of
    the values only: ``ℓ`` sums the undropped ``P̃``. Returns
    ``(new_state, alpha, p)``.
    """
    m_new = torch.maximum(state.m, s.amax(dim=-1))  # (..., rows)
    alpha = rescale_factor(state.m, m_new)  # (..., rows)
    p = torch.exp(s - _finite_or_zero(m_new).unsqueeze(-1))  # (..., rows, cols)
    ell = alpha * state.ell + p.sum(dim=-1)  # (..., rows)
    pv = p if keep is None else p * keep * keep_scale  # (..., rows, cols)
    acc = alpha.unsqueeze(-1) * state.acc + pv @ v  # (..., rows, d_v)
    return OnlineState(m_new, ell, acc), alpha, p


def step_(
    state: OnlineState,
    s: torch.Tensor,
    v: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    keep_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``step`` in place, the blocked loop's form: no tile-sized allocation.

    ``state`` is 3-D (``m``, ``ell`` ``(n, rows)``, ``acc`` ``(n, rows, d_v)``)
    and is updated in place; ``s`` ``(n, rows, cols)`` is overwritten with
    ``p = exp(s - m')``; ``v`` is ``(n, cols, d_v)``. The new ``acc`` is
    accumulated by the matmul itself (``baddbmm``), in the transposed form
    ``accᵀ += Vᵀ P̃ᵀ``: with ``acc`` and ``v`` transposed views of contiguous
    ``(n, d_v, ·)`` tensors, as the blocked loop keeps them, that matmul runs
    fastest (any layout is correct). Exponentials go through ``exp_shifted``.
    Returns ``(alpha, p)``.
    """
    m_new = torch.maximum(state.m, s.amax(dim=-1))  # (n, rows)
    m_sub = _finite_or_zero(m_new)  # (n, rows)
    alpha = exp_shifted(state.m, m_sub)  # (n, rows)
    state.m.copy_(m_new)
    p = exp_shifted(s, m_sub.unsqueeze(-1), out=s)  # (n, rows, cols)
    torch.addcmul(p.sum(dim=-1), alpha, state.ell, out=state.ell)  # ℓ' = α ℓ + Σ p
    pv = p if keep is None else p * keep * keep_scale  # (n, rows, cols)
    state.acc.mul_(alpha.unsqueeze(-1))  # (n, rows, d_v)
    state.acc.mT.baddbmm_(v.mT, pv.mT)  # a' = α a + P̃ V, formed as a'ᵀ += Vᵀ P̃ᵀ
    return alpha, p


def step_normalized(
    m: torch.Tensor,
    ell: torch.Tensor,
    o: torch.Tensor,
    s: torch.Tensor,
    v: torch.Tensor,
    *,
    keep: torch.Tensor | None = None,
    keep_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-1's form of ``step``: the stored output ``o`` is kept normalised.

    ``o' = (α ℓ o + P̃ V) / ℓ'`` (0 while ``ℓ' = 0``). Returns ``(m', ℓ', o', alpha, p)``.
    """
    m_new = torch.maximum(m, s.amax(dim=-1))  # (..., rows)
    alpha = rescale_factor(m, m_new)  # (..., rows)
    p = torch.exp(s - _finite_or_zero(m_new).unsqueeze(-1))  # (..., rows, cols)
    ell_new = alpha * ell + p.sum(dim=-1)  # (..., rows)
    pv = p if keep is None else p * keep * keep_scale
    num = (alpha * ell).unsqueeze(-1) * o + pv @ v  # (..., rows, d_v)
    o_new = num / torch.where(ell_new > 0, ell_new, torch.ones_like(ell_new)).unsqueeze(-1)
    return m_new, ell_new, o_new, alpha, p


def finalize(state: OnlineState) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of a state: ``o = acc / ℓ``, ``lse = m + log ℓ``; an empty row gives
    ``o = 0`` and ``lse = -inf`` (conventions replace that LSE later)."""
    empty = state.ell == 0  # (..., rows)
    ell = torch.where(empty, 1.0, state.ell)
    o = state.acc / ell.unsqueeze(-1)  # (..., rows, d_v)
    lse = torch.where(empty, -math.inf, state.m + torch.log(ell))
    return o, lse


def merge(a: OnlineState, b: OnlineState | None = None) -> OnlineState:
    """Combine partial states of the same rows over disjoint key sets: ``a`` and ``b``,
    or (``b`` omitted) the ``S`` parts of ``a`` stacked along its first dim (``m``,
    ``ell`` ``(S, ..., rows)``, ``acc`` ``(S, ..., rows, d_v)``), all in one pass.

    ``m = max`` over the parts; each part is rescaled by ``exp(m_part - m)`` (0 for
    an empty part) and the parts' ``ℓ`` and ``acc`` are summed. Never produces NaN,
    even when every part is empty.
    """
    parts = a if b is None else _stacked(a, b)
    m = parts.m.amax(dim=0)  # (..., rows)
    alpha = rescale_factor(parts.m, m)  # (S, ..., rows)
    ell = (alpha * parts.ell).sum(dim=0)  # (..., rows)
    acc = (alpha.unsqueeze(-1) * parts.acc).sum(dim=0)  # (..., rows, d_v)
    return OnlineState(m, ell, acc)


def _stacked(a: OnlineState, b: OnlineState) -> OnlineState:
    """Two states as one of two parts stacked along a new first dim (broadcast first)."""
    m_a, m_b, ell_a, ell_b = torch.broadcast_tensors(a.m, b.m, a.ell, b.ell)
    acc_a, acc_b = torch.broadcast_tensors(a.acc, b.acc)
    return OnlineState(
        torch.stack((m_a, m_b)), torch.stack((ell_a, ell_b)), torch.stack((acc_a, acc_b))
    )


def state_from_partial(o: torch.Tensor, lse: torch.Tensor) -> OnlineState:
    """A partial result as a state: ``m = lse``, ``ℓ = 1``, ``a = o``.

    A row that saw no key is empty (``m = -inf``, ``ℓ = 0``, ``a = 0``); it may
    carry LSE -inf (flashledger's raw LSE, flash-attn 3, FlexAttention) or +inf
    (flash-attn 2). SDPA's 0 cannot be told from a real LSE of 0: convert such
    results to the raw LSE first (``blocked_forward(..., raw_lse=True)``).
    """
    empty = torch.isinf(lse)
    m = torch.where(empty, -math.inf, lse)
    return OnlineState(m, (~empty).to(o.dtype), torch.where(empty.unsqueeze(-1), 0.0, o))


def merge_partials(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor | None = None,
    lse_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial ``(o, lse)`` results of the same rows over disjoint keys: two parts
    (``o`` ``(..., rows, d_v)``, ``lse`` ``(..., rows)`` each), or (``o_b``, ``lse_b``
    omitted) ``S`` parts stacked along the first dim of ``o_a`` ``(S, ..., rows, d_v)``
    and ``lse_a`` ``(S, ..., rows)``, merged in one pass.

    A row with no key in a part has LSE ±inf there (see ``state_from_partial``);
    the merged LSE is -inf for a row with no key at all. Shapes are taken as given, not
    broadcast: each ``lse`` is its ``o``'s shape without the last dim, and both parts
    have one shape (a ``ValueError`` says which does not).
    """
    if (o_b is None) != (lse_b is None):
        raise ValueError("merge_partials takes o_b and lse_b together (or neither: stacked parts)")
    _check_partial("o_a", o_a, "lse_a", lse_a, stacked=o_b is None)
    if o_b is not None and lse_b is not None:
        _check_partial("o_b", o_b, "lse_b", lse_b, stacked=False)
        if o_b.shape != o_a.shape:
            raise ValueError(
                "merge_partials merges two parts of the same rows: o_b must have o_a's shape "
                f"{tuple(o_a.shape)}, got {tuple(o_b.shape)}"
            )
        o_a, lse_a = torch.stack((o_a, o_b)), torch.stack((lse_a, lse_b))
    return finalize(merge(state_from_partial(o_a, lse_a)))


def _check_partial(o_name: str, o: Any, lse_name: str, lse: Any, *, stacked: bool) -> None:
    """A partial ``(o, lse)`` as ``merge_partials`` takes it: tensors, ``o`` ``(..., d_v)``
    (``(S, ..., d_v)`` when ``stacked``) and ``lse`` exactly ``o``'s shape without ``d_v``."""
    for name, x in ((o_name, o), (lse_name, lse)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"merge_partials: {name} must be a torch.Tensor, got {type(x).__name__}"
            )
    least = 2 if stacked else 1
    if o.ndim < least:
        form = "(S, ..., rows, d_v), the parts stacked" if stacked else "(..., rows, d_v)"
        raise ValueError(f"merge_partials: {o_name} must be {form}, got shape {tuple(o.shape)}")
    if lse.shape != o.shape[:-1]:
        raise ValueError(
            f"merge_partials: {lse_name} must have {o_name}'s shape without its last dim "
            f"(d_v), {tuple(o.shape[:-1])}, got {tuple(lse.shape)} (no broadcasting: one LSE "
            "per row of O, in O's order)"
        )


@dataclass(frozen=True)
class OnlineStep:
    """One block read by ``OnlineSoftmax``: what the seed's ledger table shows."""

    index: int  # 0-based block number
    positions: tuple[int, int]  # key positions [start, stop) of this block
    scores: torch.Tensor  # (..., cols)
    block_max: torch.Tensor  # (...,)
    m_before: torch.Tensor  # (...,)
    m_after: torch.Tensor  # (...,)
    alpha: torch.Tensor  # (...,)
    ell: torch.Tensor  # (...,)
    acc: torch.Tensor  # (..., d_v)
    output: torch.Tensor  # (..., d_v) prefix output acc / ell


class OnlineSoftmax:
    """Step through the online softmax of one row (or many rows), block by block.

    >>> import torch
    >>> osm = OnlineSoftmax(d_v=1)
    >>> _ = osm.update(torch.tensor([1.0, 2.0]), torch.tensor([[1.0], [0.0]]))
    >>> round(float(osm.m), 3)
    2.0

    ``rows`` is the leading shape of the state (``()`` for one row);
    accumulation dtype defaults to float64.
    """

    def __init__(
        self,
        d_v: int,
        *,
        rows: Sequence[int] = (),
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(d_v, bool) or not isinstance(d_v, int) or d_v < 1:
            raise ValueError(f"OnlineSoftmax: d_v must be an integer >= 1, got {d_v!r}")
        if (
            not isinstance(rows, Sequence)
            or isinstance(rows, str)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in rows)
        ):
            raise ValueError(
                "OnlineSoftmax: rows must be a sequence of integers >= 0, the leading shape "
                f"of the state (() for one row, (3,) for three), got {rows!r}"
            )
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                "OnlineSoftmax: dtype must be a floating dtype (float16, bfloat16, float32, "
                f"float64), got {dtype!r}"
            )
        self.d_v = d_v
        self.rows = tuple(rows)
        self.dtype = dtype
        # the loop's layout: a singleton query axis per row, (*rows, 1) and (*rows, 1, d_v)
        self._state = OnlineState.empty((*self.rows, 1), d_v, dtype=dtype, device=device)
        self.steps: list[OnlineStep] = []
        self._read = 0

    @property
    def state(self) -> OnlineState:
        """The running state, ``m``/``ell`` ``(*rows,)`` and ``acc`` ``(*rows, d_v)``."""
        st = self._state
        return OnlineState(st.m.squeeze(-1), st.ell.squeeze(-1), st.acc.squeeze(-2))

    @property
    def m(self) -> torch.Tensor:
        return self.state.m

    @property
    def ell(self) -> torch.Tensor:
        return self.state.ell

    @property
    def acc(self) -> torch.Tensor:
        return self.state.acc

    def output(self) -> torch.Tensor:
        """Output of the prefix read so far, ``(*rows, d_v)`` (0 before any key)."""
        return finalize(self.state)[0]

    def lse(self) -> torch.Tensor:
        """Log-sum-exp of the scores read so far (-inf before any key)."""
        return finalize(self.state)[1]

    def update(self, scores: torch.Tensor, values: torch.Tensor) -> OnlineStep:
        """Read one block: ``scores`` ``(..., cols)``, ``values`` ``(cols, d_v)`` or ``(..., cols, d_v)``."""
        s = torch.as_tensor(scores, dtype=self.dtype)
        v = torch.as_tensor(values, dtype=self.dtype)
        if s.ndim < 1 or tuple(s.shape[:-1]) != self.rows or s.shape[-1] < 1:
            raise ValueError(
                f"scores must have shape (*rows, cols) with rows={self.rows} and cols >= 1, "
                f"got {tuple(s.shape)}"
            )
        lead = tuple(v.shape[:-2])
        shared = len(lead) <= len(self.rows) and all(
            n in (1, r) for n, r in zip(reversed(lead), reversed(self.rows))
        )  # values shared by the rows, or one set per row: the state keeps its shape
        if v.ndim < 2 or v.shape[-1] != self.d_v or v.shape[-2] != s.shape[-1] or not shared:
            raise ValueError(
                f"values must have shape (cols, d_v) = ({s.shape[-1]}, {self.d_v}), or "
                f"(*rows, cols, d_v) with rows={self.rows}, got {tuple(v.shape)}"
            )
        if bool(torch.isnan(s).any()) or bool((s == math.inf).any()):
            raise ValueError("scores must not contain NaN or +inf (-inf marks a masked key)")
        before = self.state.m
        self._state, alpha, _ = step(self._state, s.unsqueeze(-2), v)
        rec = OnlineStep(
            index=len(self.steps),
            positions=(self._read, self._read + s.shape[-1]),
            scores=s,
            block_max=s.amax(dim=-1),
            m_before=before,
            m_after=self.state.m,
            alpha=alpha.squeeze(-1),
            ell=self.state.ell,
            acc=self.state.acc,
            output=self.output(),
        )
        self._read += s.shape[-1]
        self.steps.append(rec)
        return rec

    def __repr__(self) -> str:
        read = f"{len(self.steps)} block{'' if len(self.steps) == 1 else 's'} read"
        if self.rows:
            return f"OnlineSoftmax(d_v={self.d_v}, rows={self.rows}, {read})"
        return (
            f"OnlineSoftmax(d_v={self.d_v}, {read} ({self._read} positions), "
            f"m={_fmt(self.m.item())}, ell={_fmt(self.ell.item())}, "
            f"output={_fmt(self.output().tolist())})"
        )

    def __str__(self) -> str:
        """The block ledger of a single row: one line per block read (``repr`` for many
        rows, whose steps are in ``steps``)."""
        if self.rows or not self.steps:
            return repr(self)
        return self._table(self.steps)

    def _table(self, steps: Sequence[OnlineStep], gap_after: int | None = None) -> str:
        """The block ledger of ``steps``, a line saying how many blocks are left out after
        the first ``gap_after`` of them (None: none left out)."""
        header = ["block", "positions", "scores", "block max", "m", "α", "ℓ", "acc", "output"]
        cells = [
            [
                str(st.index + 1),
                f"{st.positions[0]}..{st.positions[1] - 1}",
                _fmt(st.scores.tolist()),
                *(_fmt(float(x)) for x in (st.block_max, st.m_after, st.alpha, st.ell)),
                _fmt(st.acc.tolist()),
                _fmt(st.output.tolist()),
            ]
            for st in steps
        ]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        right = {0, 3, 4, 5, 6}  # numbers, right-aligned

        def line(row: list[str]) -> str:
            return "  ".join(
                x.rjust(w) if i in right else x.ljust(w)
                for i, (x, w) in enumerate(zip(row, widths))
            ).rstrip()

        lines = [line(c) for c in cells]
        if gap_after is not None:
            left = len(self.steps) - len(steps)
            lines.insert(
                gap_after,
                f"… {left:,} more blocks (all {len(self.steps):,} in .steps; print() prints "
                "every one)",
            )
        return "\n".join([line(header), *lines])

    def _repr_html_(self) -> str:
        """A notebook's view: the block ledger, the first and last ``HTML_ROWS // 2`` blocks
        of a longer one (as the loop's ``Ledger`` shows its steps)."""
        n, half = len(self.steps), HTML_ROWS // 2
        if self.rows or n <= HTML_ROWS:
            return f"<pre>{html.escape(str(self))}</pre>"
        text = self._table([*self.steps[:half], *self.steps[-half:]], gap_after=half)
        return f"<pre>{html.escape(text)}</pre>"

    @classmethod
    def run(cls, scores: torch.Tensor, values: torch.Tensor, *, block: int) -> OnlineSoftmax:
        """Read a whole row ``scores`` ``(..., L)`` with ``values`` ``(L, d_v)`` in blocks of ``block``."""
        s = torch.as_tensor(scores, dtype=torch.float64)
        v = torch.as_tensor(values, dtype=torch.float64)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an integer >= 1, got {block!r}")
        osm = cls(v.shape[-1], rows=tuple(s.shape[:-1]))
        for start in range(0, s.shape[-1], block):
            osm.update(s[..., start : start + block], v[..., start : start + block, :])
        return osm


def softmax_probabilities(scores: torch.Tensor) -> torch.Tensor:
    """``softmax(scores)`` along the last dim, ``(..., L)`` in float64; a row whose every
    score is -inf (fully masked) gets zeros, as the seed defines it, not NaN."""
    s = torch.as_tensor(scores, dtype=torch.float64)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)  # (..., 1)
    return torch.softmax(torch.where(empty, 0.0, s), dim=-1) * ~empty


def softmax_output(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The full-row reference: ``softmax(scores) @ values`` in one go, ``(..., d_v)``; 0 for
    a fully-masked row."""
    v = torch.as_tensor(values, dtype=torch.float64)
    p = softmax_probabilities(scores)  # (..., L)
    return (p.unsqueeze(-2) @ v).squeeze(-2)


def blockwise_softmax_average(
    scores: torch.Tensor, values: torch.Tensor, *, block: int
) -> torch.Tensor:
    """The wrong answer: softmax inside each block, then the mean of the block outputs."""
    s = torch.as_tensor(scores, dtype=torch.float64)
    v = torch.as_tensor(values, dtype=torch.float64)
    outs = [
        softmax_output(s[..., a : a + block], v[..., a : a + block, :])
        for a in range(0, s.shape[-1], block)
    ]
    return torch.stack(outs).mean(dim=0)


def _demo() -> None:
    """The seed page's six scores in blocks of 2: the running state block by block."""
    from .examples import SIX_SCORES, SIX_VALUES

    osm = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    print(osm)
    ref = softmax_output(SIX_SCORES, SIX_VALUES)
    diff = float((osm.output() - ref).abs().max())
    print(f"full-row reference: {_fmt(ref.tolist())}  max |diff| = {diff:.3g}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("online", _demo, command="online")
