"""A 50-digit oracle for tiny cases, with mpmath.

For ``L <= 12`` the whole forward and backward is computed element by element
in mpmath at 50 significant digits from the exact float64 inputs, then
flashledger's float64 results are measured against it in ulps::

    ulps(x) = max_i |x_i - x*_i| / ulp(max_i |x*_i|)

``ulp(t)`` is the spacing of float64 at ``t`` (``math.ulp``), so the figure is
the worst error in units of the last place of the tensor's largest element,
which stays meaningful for entries that are small through cancellation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ._verify_cases import Case

__all__ = ["MAX_MP_LEN", "MP_DIGITS", "MpResult", "mp_attention", "ulps"]

MP_DIGITS = 50
"""Significant decimal digits of the mpmath oracle."""

MAX_MP_LEN = 12
"""Longest sequence the mpmath oracle accepts (its cost grows as Lq * Lk * d)."""


def _mpmath() -> Any:
    try:
        import mpmath
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 50-digit oracle needs mpmath: pip install 'flashledger[verify]'"
        ) from exc
    return mpmath


@dataclass(frozen=True)
class MpResult:
    """Nested lists of mpmath numbers, laid out like the torch tensors."""

    o: list[Any]  # [B][Hq][Lq][d_v]
    lse: list[Any]  # [B][Hq][Lq]
    dq: list[Any]  # [B][Hq][Lq][d]
    dk: list[Any]  # [B][Hkv][Lk][d]
    dv: list[Any]  # [B][Hkv][Lk][d_v]


def mp_attention(case: Case, *, digits: int = MP_DIGITS) -> MpResult:
    """Forward and backward of ``case`` (its float64-rounded inputs) in mpmath.

    Fully-masked rows follow the case's conventions: O = 0, LSE
    ``conventions.masked_row_lse``, no gradient contribution.
    """
    s = case.shape
    if max(s.len_q, s.len_k) > MAX_MP_LEN:
        raise ValueError(
            f"the mpmath oracle takes sequence lengths <= {MAX_MP_LEN}, got {s.len_q}x{s.len_k}"
        )
    mp = _mpmath()
    q, k, v, do = (t.to(torch.float64).tolist() for t in case.inputs())
    dense = case.dense_mask()
    vis = None if dense is None else dense.tolist()
    group = s.heads_q // s.heads_kv
    zero = mp.mpf(0)
    with mp.workdps(digits):
        scale = mp.mpf(case.scale)
        mpf = mp.mpf
        o = [
            [[[zero] * s.head_dim_v for _ in range(s.len_q)] for _ in range(s.heads_q)]
            for _ in range(s.batch)
        ]
        lse = [[[zero] * s.len_q for _ in range(s.heads_q)] for _ in range(s.batch)]
        dq = [
            [[[zero] * s.head_dim for _ in range(s.len_q)] for _ in range(s.heads_q)]
            for _ in range(s.batch)
        ]
        dk = [
            [[[zero] * s.head_dim for _ in range(s.len_k)] for _ in range(s.heads_kv)]
            for _ in range(s.batch)
        ]
        dv = [
            [[[zero] * s.head_dim_v for _ in range(s.len_k)] for _ in range(s.heads_kv)]
            for _ in range(s.batch)
        ]
        for b in range(s.batch):
            for h in range(s.heads_q):
                hk = h // group
                for i in range(s.len_q):
                    keys = [j for j in range(s.len_k) if vis is None or vis[b][h][i][j]]
                    if not keys:
                        lse[b][h][i] = mpf(case.conventions.masked_row_lse)
                        continue
                    qi = [mpf(x) for x in q[b][h][i]]
                    sc = {
                        j: scale * mp.fsum(a * mpf(c) for a, c in zip(qi, k[b][hk][j]))
                        for j in keys
                    }
                    m = max(sc.values())
                    lam = m + mp.log(mp.fsum(mp.exp(sc[j] - m) for j in keys))
                    p = {j: mp.exp(sc[j] - lam) for j in keys}
                    oi = [
                        mp.fsum(p[j] * mpf(v[b][hk][j][c]) for j in keys)
                        for c in range(s.head_dim_v)
                    ]
                    doi = [mpf(x) for x in do[b][h][i]]
                    D = mp.fsum(a * c for a, c in zip(doi, oi))
                    lse[b][h][i], o[b][h][i] = lam, oi
                    for j in keys:
                        dp = mp.fsum(a * mpf(c) for a, c in zip(doi, v[b][hk][j]))
                        ds = p[j] * (dp - D)
                        for c in range(s.head_dim):
                            dq[b][h][i][c] += scale * ds * mpf(k[b][hk][j][c])
                            dk[b][hk][j][c] += scale * ds * qi[c]
                        for c in range(s.head_dim_v):
                            dv[b][hk][j][c] += p[j] * doi[c]
    return MpResult(o=o, lse=lse, dq=dq, dk=dk, dv=dv)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, list):
        return [y for item in x for y in _flat(item)]
    return [x]


def ulps(got: torch.Tensor, want: list[Any]) -> tuple[float, tuple[int, ...]]:
    """Worst error of float64 ``got`` against mpmath ``want`` in ulps of ``max |want|``, and where.

    Non-finite oracle entries (the LSE of a fully-masked row) must be matched
    exactly; a mismatch there, or a NaN, counts as infinitely many ulps.
    """
    mp = _mpmath()
    flat_want = _flat(want)
    flat_got = got.detach().to(torch.float64).reshape(-1).tolist()
    if len(flat_got) != len(flat_want):
        raise ValueError(f"shape mismatch: {len(flat_got)} values against {len(flat_want)}")
    finite = [abs(float(w)) for w in flat_want if mp.isfinite(w)]
    unit = math.ulp(max(finite, default=1.0) or 1.0)
    worst, where = 0.0, 0
    with mp.workdps(MP_DIGITS):
        for n, (g, w) in enumerate(zip(flat_got, flat_want)):
            if not mp.isfinite(w) or not math.isfinite(g):
                err = 0.0 if g == float(w) else math.inf
            else:
                err = float(abs(mp.mpf(g) - w)) / unit
            if err > worst:
                worst, where = err, n
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(where), got.shape))
    return worst, index
