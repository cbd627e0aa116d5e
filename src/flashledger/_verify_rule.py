"""The closeness rule of ``flashledger.verify`` and the per-case check.

The rule is the one real attention test suites use (flash-attn's tests): run a
plain PyTorch attention in the *same* dtype as the implementation under test,
measure both against a float64 oracle (``reference_forward`` /
``reference_backward`` with the case's conventions), and accept

    error(fn)  <=  factor * error(naive)  +  floor

with ``factor`` 2 for outputs (O, LSE) and 3 for gradients (dQ, dK, dV), and a
floor for the rounding no implementation can avoid, derived from the case's own
numbers (all float64, maxima over the quantity's elements)::

    floor = eps(dtype) * max(1, |oracle|)
          + eps(acc) * sqrt(n + e²) * max(1, |terms|)

The first part is one rounding of the result to the test dtype. The second is
a random walk of roundings in the accumulation dtype (float32 for
float16/bfloat16 inputs, as in every fused kernel; the input dtype otherwise),
each at the magnitude of the *terms* summed, not of their sum: ``|terms|`` is
the quantity computed with every product of absolute values (``Σ P |V|`` for
O, ``Σ P |dO|`` for dV, ``|scale| Σ P (|dO||V| + |dO||O|) |K|`` for dQ and
likewise for dK; the LSE's own value), so an answer that is 0 by cancellation
(a row that sees one key has dQ = 0 exactly) is judged by the size of what
cancelled. ``n`` is the length of the longest chain of sums behind the
quantity: ``Lk`` for O and LSE; ``Lq * Hq / Hkv`` for dV; ``Lk + d_v`` for dQ
and ``Lq * Hq / Hkv + d_v`` for dK, whose ``dS = P ⊙ (dP - D)`` subtracts two
separately rounded dot products of length ``d_v`` (``dP = dO·Vᵀ`` and ``D =
rowsum(dO ⊙ O)``): a FlashAttention backward needs ``D`` before it forms any
``dP`` and no BLAS promises to sum the two in one order.

``e`` is the exponent's part: an error ``δ`` in the argument of ``P = exp(S -
m)`` scales ``P`` by ``1 + δ``. Every score is a dot product of ``d`` terms
summed in an order no BLAS promises to keep, ``sqrt(d)`` roundings at ``σ =
|scale| Σ |q||k|`` (the largest over the visible scores), so ``e² = d σ²`` for
O and the LSE. A FlashAttention backward also rebuilds ``P = exp(S - λ)`` from
the forward's saved ``λ``, where the naive backward keeps the forward's
``P``: its argument adds the roundings of the scale or base change and of ``λ
= m + log ℓ``, two at ``|λ|``, so the gradients take ``e² = d σ² + (2 max(1,
|λ|))²``. Even on a row that sees one key, where the naive softmax's ``P`` is
1 exactly, the kernel's is ``exp(δ)``.

The floor matters where the naive implementation's own error is a poor
yardstick: in float64 the naive and the oracle share a precision, and their
difference measures only summation order. Errors are maximum absolute errors
over all elements. Entries where the oracle is not finite (the LSE of a
fully-masked row: -inf or +inf by convention) must be matched exactly; a NaN
anywhere counts as an infinite error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._verify_cases import Case, dtype_name
from .reference import reference_backward, reference_forward

__all__ = [
    "GRAD_FACTOR",
    "OUTPUT_FACTOR",
    "AttentionFn",
    "Baseline",
    "CaseResult",
    "Comparison",
    "baseline",
    "check_case",
    "naive_attention",
]

OUTPUT_FACTOR = 2.0
"""Allowed multiple of the naive same-dtype error for O and LSE."""
GRAD_FACTOR = 3.0
"""Allowed multiple of the naive same-dtype error for dQ, dK and dV."""

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Case],
    "torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]",
]
"""``fn(q, k, v, case) -> O`` or ``(O, LSE)``; see ``assert_attention_close``."""


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain materialised attention in the inputs' dtype: ``(O, LSE)``.

    q ``(B, Hq, Lq, d)``, k ``(B, Hkv, Lk, d)``, v ``(B, Hkv, Lk, d_v)``; every
    intermediate is rounded to the input dtype, as a same-dtype PyTorch
    implementation would. Fully-masked rows give O = 0 (their LSE is the
    oracle's business and is filled in by :func:`baseline`).
    """
    k, v = _per_query_head(case, k, v)  # (B, Hq, Lk, d), (B, Hq, Lk, d_v)
    s = (q @ k.transpose(-2, -1)) * case.scale  # (B, Hq, Lq, Lk)
    dense = case.dense_mask()
    if dense is not None:
        s = s.masked_fill(~dense, -math.inf)
        empty = ~dense.any(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
        s = s.masked_fill(empty, 0.0)  # keep softmax finite; zeroed below
        p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)  # (B, Hq, Lq, Lk)
    else:
        p = torch.softmax(s, dim=-1)  # (B, Hq, Lq, Lk)
    o = p @ v  # (B, Hq, Lq, d_v)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hq, Lq)
    return o, lse


def _per_query_head(
    case: Case, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``(B, Hkv, Lk, ·)`` repeated to one head per query head ``(B, Hq, Lk, ·)``."""
    group = case.shape.heads_q // case.shape.heads_kv
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


@dataclass(frozen=True)
class Baseline:
    """Inputs of a case, the float64 oracle's answers and the naive same-dtype ones."""

    case: Case
    inputs: tuple[torch.Tensor, ...]  # q, k, v, do in the case dtype (no grad)
    oracle: dict[str, torch.Tensor]  # "O", "LSE", "dQ", "dK", "dV" in float64
    naive: dict[str, torch.Tensor]  # the same names, naive same-dtype values
    terms: dict[str, float] = field(default_factory=dict)
    """Largest magnitude of the terms behind each quantity (``_magnitudes``), and
    ``"e"`` / ``"e_grad"``, the exponent's part of the floor of O and LSE / of the
    gradients."""


def baseline(case: Case, *, grads: bool = True) -> Baseline:
    """Compute the oracle (float64, with the case's conventions) and the naive answers."""
    q, k, v, do = case.inputs()
    q64, k64, v64, do64 = (t.to(torch.float64) for t in (q, k, v, do))
    opts: dict[str, Any] = {"mask": case.mask, "scale": case.scale, "conventions": case.conventions}
    fwd = reference_forward(q64, k64, v64, **opts)
    oracle = {"O": fwd.o, "LSE": fwd.lse}  # (B, Hq, Lq, d_v), (B, Hq, Lq)
    nq, nk, nv = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    n_o, n_lse = naive_attention(nq, nk, nv, case)
    dense = case.dense_mask()
    empty = torch.zeros_like(fwd.lse, dtype=torch.bool) if dense is None else ~dense.any(dim=-1)
    naive = {  # a fully-masked row's LSE is a convention, not a computation: take the oracle's
        "O": n_o.detach(),
        "LSE": torch.where(empty, fwd.lse, n_lse.detach().to(torch.float64)),  # (B, Hq, Lq)
    }
    if grads:
        bwd = reference_backward(q64, k64, v64, fwd.o, fwd.lse, do64, **opts)
        oracle.update(dQ=bwd.dq, dK=bwd.dk, dV=bwd.dv)
        n_dq, n_dk, n_dv = torch.autograd.grad(n_o, (nq, nk, nv), do)
        naive.update(dQ=n_dq, dK=n_dk, dV=n_dv)
    terms = _magnitudes(case, q64, k64, v64, do64 if grads else None, fwd.o, fwd.lse)
    return Baseline(case, (q, k, v, do), oracle, naive, terms)


def _magnitudes(
    case: Case,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
) -> dict[str, float]:
    """The floor's magnitudes (float64, dense: verify's cases are small).

    Each quantity computed with absolute values in every product (the size of
    what its sums add, before any cancellation); ``"e"`` = ``sqrt(d) σ`` over the
    visible scores and ``"e_grad"`` = ``sqrt(d σ² + (2 max(1, |λ|))²)`` (see the
    module docstring).
    """
    s = case.shape
    group = s.heads_q // s.heads_kv
    k, v = _per_query_head(case, k, v)  # (B, Hq, Lk, d), (B, Hq, Lk, d_v)
    scale = abs(case.scale)
    scores = (q @ k.transpose(-2, -1)) * case.scale  # (B, Hq, Lq, Lk)
    sigma = (q.abs() @ k.abs().transpose(-2, -1)) * scale  # (B, Hq, Lq, Lk)
    seen = torch.isfinite(lse)[..., None].expand_as(scores)  # (B, Hq, Lq, Lk)
    dense = case.dense_mask()
    if dense is not None:
        seen = seen & dense
    lam = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # (B, Hq, Lq)
    p = torch.where(seen, torch.exp(scores - lam[..., None]), torch.zeros_like(scores))
    out = {"O": _max(p @ v.abs()), "LSE": _max(lam.abs())}
    sig = _max(torch.where(seen, sigma, torch.zeros_like(sigma)))
    out["e"] = math.sqrt(s.head_dim) * sig
    out["e_grad"] = math.hypot(out["e"], 2.0 * max(1.0, out["LSE"]))
    if do is not None:
        dabs = do.abs()  # (B, Hq, Lq, d_v)
        ds = p * (dabs @ v.abs().transpose(-2, -1) + (dabs * o.abs()).sum(-1, keepdim=True))
        heads = (s.heads_kv, group)  # Hq split as (Hkv, group)
        dv = (p.transpose(-2, -1) @ dabs).unflatten(1, heads).sum(2)  # (B, Hkv, Lk, d_v)
        dk = (ds.transpose(-2, -1) @ q.abs()).unflatten(1, heads).sum(2)  # (B, Hkv, Lk, d)
        out.update(dQ=scale * _max(ds @ k.abs()), dK=scale * _max(dk), dV=_max(dv))
        # D = rowsum(dO ⊙ O) from O as stored (rounded to the input dtype), as every
        # FlashAttention backward forms it: |δD| <= eps(dtype)/2 Σ |dO||O|, carried into dQ
        # and dK by P and scale (the |dO||O| part of their terms)
        dd = p * (dabs * o.abs()).sum(-1, keepdim=True)  # (B, Hq, Lq, Lk)
        dk_d = (dd.transpose(-2, -1) @ q.abs()).unflatten(1, heads).sum(2)  # (B, Hkv, Lk, d)
        out.update(dQ_D=scale * _max(dd @ k.abs()), dK_D=scale * _max(dk_d))
    return out


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def _errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise |got - want| in float64; equal entries (also equal infinities) give 0, NaN
    gives inf, and so does an infinity against a finite value (not float64's largest number)."""
    got = got.detach().to(torch.float64)
    err = (got - want).abs()
    err = torch.where(got == want, torch.zeros_like(err), err)
    return torch.nan_to_num(err, nan=math.inf, posinf=math.inf)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def floor(
    dtype: torch.dtype,
    n_terms: int,
    *,
    result: float = 1.0,
    terms: float = 1.0,
    exponent: float = 0.0,
    stored: float = 0.0,
) -> float:
    """The rule's floor: ``eps(dtype) (max(1, result) + stored / 2) + eps(acc) sqrt(n + e²) max(1, terms)``.

    ``result``: the largest ``|oracle|``; ``terms``: the largest magnitude of the
    summed terms; ``exponent``: ``e``, the exponent's part (module docstring);
    ``stored``: the size of what a rounding of O to the test dtype moves through
    ``D = rowsum(dO ⊙ O)`` (dQ and dK; 0 otherwise), moved by at most half an eps each.
    """
    acc = accumulation_dtype(dtype)
    walk = torch.finfo(acc).eps * math.sqrt(max(1, n_terms) + exponent**2)
    return torch.finfo(dtype).eps * (max(1.0, result) + stored / 2) + walk * max(1.0, terms)


@dataclass(frozen=True)
class Comparison:
    """One quantity of one case measured against the oracle under the rule."""

    quantity: str  # "O", "LSE", "dQ", "dK" or "dV"
    error: float  # max |fn - oracle|
    naive_error: float  # max |naive - oracle|
    factor: float
    floor: float
    index: tuple[int, ...]  # worst element of fn
    got: float
    want: float
    naive_dtype: str

    @property
    def bound(self) -> float:
        """``factor * naive_error + floor``."""
        return self.factor * self.naive_error + self.floor

    @property
    def passed(self) -> bool:
        return self.error <= self.bound

    @property
    def ratio(self) -> float:
        """``error / bound`` (a pass is <= 1)."""
        return self.error / self.bound

    def describe(self) -> str:
        """Worst element, both values and both errors, on two lines."""
        idx = ", ".join(str(i) for i in self.index)
        verdict = ">" if not self.passed else "<="
        head = f"worst element {self.quantity}[{idx}]: got {self.got:.6g}, oracle {self.want:.6g}\n"
        # a row that sees no key: its LSE is a convention (the oracle's is infinite, or 0
        # under sdpa_cpu where the kernel's is infinite), not a number to approach
        empty = math.isinf(self.want) or (self.want == 0 and math.isinf(self.got))
        if self.quantity == "LSE" and not self.passed and empty:
            from .conventions import PRESETS

            by_value: dict[float, list[str]] = {}
            for c in PRESETS.values():
                by_value.setdefault(c.masked_row_lse, []).append(c.name)
            named = "; ".join(f"{v:g}: {', '.join(n)}" for v, n in by_value.items())
            if self.got in by_value:  # another preset's value: a conventions mismatch
                return head + (
                    f"the row sees no key, so its LSE is the conventions' choice ({named}); "
                    f"{self.got:g} is not this case's {self.want:g}: pass the conventions your "
                    "kernel follows"
                )
            if math.isnan(self.got):
                return head + (
                    f"the row sees no key and fn's LSE there is NaN; this case's conventions "
                    f"give {self.want:g} (the presets: {named})"
                )
            return head + (
                f"the row sees no key, but fn's LSE {self.got:g} is finite, which no preset "
                f"gives ({named}): fn attended to keys the mask hides (check the mask and its "
                f"alignment) or writes a sentinel; this case's conventions give {self.want:g}"
            )
        return head + (
            f"error {self.error:.3g} {verdict} bound {self.bound:.3g} = {self.factor:g} x naive "
            f"{self.naive_dtype} error {self.naive_error:.3g} + floor {self.floor:.3g}"
        )


def compare(
    quantity: str,
    got: torch.Tensor,
    want: torch.Tensor,
    naive: torch.Tensor,
    *,
    factor: float,
    dtype: torch.dtype,
    n_terms: int,
    terms: float = 0.0,
    exponent: float = 0.0,
    stored: float = 0.0,
) -> Comparison:
    """Apply the rule to one quantity (all tensors the oracle's shape; sums of ``n_terms``).

    ``terms``: the largest magnitude of the summed terms (at least ``|oracle|``
    is used); ``exponent``: the floor's ``e`` (gradients of a rebuilt ``P``).
    """
    err = _errors(got, want)
    worst = int(torch.argmax(err).item()) if err.numel() else 0
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape))
    finite = want[torch.isfinite(want)]
    result = float(finite.abs().max()) if finite.numel() else 0.0
    naive_error = float(_errors(naive, want).max()) if err.numel() else 0.0
    return Comparison(
        quantity=quantity,
        error=float(err.max()) if err.numel() else 0.0,
        naive_error=naive_error,
        factor=factor,
        floor=floor(
            dtype,
            n_terms,
            result=result,
            terms=max(result, terms),
            exponent=exponent,
            stored=stored,
        ),
        index=index,
        got=float(got.detach().reshape(-1)[worst]) if err.numel() else 0.0,
        want=float(want.reshape(-1)[worst]) if err.numel() else 0.0,
        naive_dtype=dtype_name(dtype),
    )


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one callable on one case."""

    case: Case
    status: str  # "passed", "failed" or "unsupported"
    comparisons: tuple[Comparison, ...] = ()
    notes: tuple[str, ...] = ()
    """What was not checked and why (e.g. no LSE returned)."""
    error: str = ""
    """Why the callable could not be judged (an exception, a wrong shape)."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def worst(self) -> Comparison | None:
        """The comparison closest to (or furthest past) its bound."""
        if not self.comparisons:
            return None
        return max(self.comparisons, key=lambda c: c.ratio)

    @property
    def checked(self) -> str:
        """The quantities compared, e.g. ``"O LSE dQ dK dV"``."""
        return " ".join(c.quantity for c in self.comparisons)

    def message(self) -> str:
        """A readable account: the case, then each failing quantity's worst element (or the error)."""
        head = f"case {self.case.name}"
        if self.error:
            return f"{head}: {self.error}"
        failing = [c for c in self.comparisons if not c.passed]
        shown = failing or ([self.worst] if self.worst else [])
        if not shown:
            return f"{head}: nothing compared"
        lines = [head + ":"]
        for c in shown:
            what = "differs from" if not c.passed else "matches"
            lines.append(f"  {c.quantity} {what} the float64 oracle")
            lines.extend("    " + line for line in c.describe().splitlines())
        return "\n".join(lines)


class ContractError(Exception):
    """The callable broke the ``fn(q, k, v, case) -> O | (O, LSE)`` contract."""


def _split_output(out: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        lse = out[1]
        if lse is None or isinstance(lse, torch.Tensor):
            return out[0], lse
    raise ContractError(f"fn must return O or (O, LSE) as tensors, got {type(out).__name__}")


def _check_shape(what: str, t: torch.Tensor, want: tuple[int, ...], hint: str) -> None:
    if tuple(t.shape) != want:
        raise ContractError(
            f"fn returned {what} of shape {tuple(t.shape)}; expected {hint} = {want}"
        )


def check_case(
    fn: AttentionFn,
    base: Baseline,
    *,
    check_grads: bool = True,
    check_lse: bool = True,
    output_factor: float = OUTPUT_FACTOR,
    grad_factor: float = GRAD_FACTOR,
) -> CaseResult:
    """Run ``fn`` on one case and judge O, LSE and gradients under the rule.

    Gradients are checked when ``check_grads`` and the returned O requires
    grad (``fn`` gets leaf inputs that require grad); the upstream gradient is
    the case's ``do``. ``NotImplementedError`` from ``fn`` gives status
    ``"unsupported"`` with its message; any other exception ``"failed"``.
    """
    case = base.case
    q, k, v, do = (t.detach().clone() for t in base.inputs)
    if check_grads:
        for t in (q, k, v):
            t.requires_grad_(True)
    s = case.shape
    notes: list[str] = []
    try:
        o, lse = _split_output(fn(q, k, v, case))
        _check_shape("O", o, (s.batch, s.heads_q, s.len_q, s.head_dim_v), "(B, Hq, Lq, d_v)")
        rows_k = s.len_k  # terms behind O and LSE
        cols_q = s.len_q * (s.heads_q // s.heads_kv)  # terms behind dV
        dots = s.head_dim_v  # dP - D: two dot products of d_v terms, rounded apart
        comps = [_compare(base, "O", o, output_factor, rows_k)]
        if check_lse and lse is None:
            notes.append("LSE not returned")
        elif check_lse and lse is not None:
            _check_shape("LSE", lse, (s.batch, s.heads_q, s.len_q), "(B, Hq, Lq)")
            comps.append(_compare(base, "LSE", lse, output_factor, rows_k))
        if check_grads and not o.requires_grad:
            notes.append("gradients not checked: O does not require grad")
        elif check_grads:
            grads = torch.autograd.grad(o, (q, k, v), do.to(o.dtype), allow_unused=True)
            for name, g, leaf, n in zip(
                ("dQ", "dK", "dV"), grads, (q, k, v), (rows_k + dots, cols_q + dots, cols_q)
            ):
                g = torch.zeros_like(leaf) if g is None else g
                _check_shape(name, g, tuple(leaf.shape), f"the shape of {name[1].lower()}")
                comps.append(_compare(base, name, g, grad_factor, n))
    except ContractError as exc:
        return CaseResult(case, "failed", notes=tuple(notes), error=str(exc))
    except NotImplementedError as exc:
        reason = f"NotImplementedError: {_one_line(exc)}"
        return CaseResult(case, "unsupported", notes=tuple(notes), error=reason)
    except Exception as exc:  # a broken callable is a failed case, reported with its reason
        return CaseResult(
            case,
            "failed",
            notes=tuple(notes),
            error=f"fn raised {type(exc).__name__}: {_one_line(exc)}",
        )
    status = "passed" if all(c.passed for c in comps) else "failed"
    return CaseResult(case, status, tuple(comps), tuple(notes))


def _compare(
    base: Baseline, name: str, got: torch.Tensor, factor: float, n_terms: int
) -> Comparison:
    want, naive = base.oracle[name], base.naive[name]
    exponent = base.terms.get("e_grad" if name in ("dQ", "dK", "dV") else "e", 0.0)
    return compare(
        name,
        got,
        want,
        naive,
        factor=factor,
        dtype=base.case.dtype,
        n_terms=n_terms,
        terms=base.terms.get(name, 0.0),
        exponent=exponent,
        stored=base.terms.get(f"{name}_D", 0.0),
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
