"""flash-attn's edges, emulated from its source and compared with the presets.

flash-attn needs CUDA, so ``verify`` cannot run it. Instead this module
follows, step by step, what its source does to the arguments and the scores
(flash-attn 2: ``csrc/flash_attn/flash_api.cpp`` for the argument rewriting,
``csrc/flash_attn/src/mask.h`` for masking and ALiBi, ``flash_fwd_kernel.h``
for fully-masked rows; flash-attn 3: ``hopper/flash_api.cpp`` and
``hopper/mask.h``; see docs/conventions.md), in plain dense float64 PyTorch
that shares nothing with flashledger's masks or score transform. Each edge is
one row of the report: flashledger's ``FLASH_ATTN_2`` / ``FLASH_ATTN_3``
preset against the emulation, and, in the case label, how far the seed's
documented mathematics (bottom-right aligned) reads the same call. The shapes
are B = 1, H = 2, d = 8, float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from ._verify_report import VerifyRow
from .blocked import blocked_forward
from .conventions import FLASH_ATTN_2, FLASH_ATTN_3, SEED, Conventions
from .masks import Causal, Mask, SlidingWindow

__all__ = ["emulate_flash_attn", "flash_attn_edge_rows"]

F64 = torch.float64
EDGE_TOL = 1e-12
"""Relative bound (to ``max(1, |value|)``) for flashledger against the emulation, float64."""


def _rewrite_fa2(
    lq: int, lk: int, causal: bool, left: int, right: int, has_alibi: bool
) -> tuple[bool, bool, int, int]:
    """flash-attn 2's argument handling: ``(is_causal, is_local, left, right)``."""
    if left >= lk:
        left = -1
    if right >= lk:
        right = -1
    if lq == 1 and not has_alibi:
        causal = False  # the same mask for a single query
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    if left < 0 and right >= 0:
        left = lk
    if left >= 0 and right < 0:
        right = lk
    is_local = (left >= 0 or right >= 0) and not is_causal
    return is_causal, is_local, left, right


def _rewrite_fa3(
    lq: int, lk: int, causal: bool, left: int, right: int
) -> tuple[bool, bool, int, int]:
    """flash-attn 3's argument handling: ``(is_causal, is_local, left, right)``."""
    if left >= lk - 1:
        left = -1
    if right >= lq - 1:
        right = -1
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    if left < 0:
        left = lk - 1
    if right < 0:
        right = lq - 1
    return is_causal, is_local, left, right


def emulate_flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    version: int = 2,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of one flash-attn call as its source computes them, float64.

    q ``(B, H, Lq, d)``, k and v ``(B, H, Lk, ·)`` (no GQA here), flash-attn's
    arguments. Raises ``ValueError`` where flash-attn refuses the call.
    """
    if softcap > 0 and dropout_p > 0:
        raise ValueError("flash-attn refuses softcap together with dropout")
    b, h, lq, d = q.shape
    lk = k.shape[2]
    left, right = window
    if version == 2:
        is_causal, is_local, left, right = _rewrite_fa2(
            lq, lk, causal, left, right, alibi_slopes is not None
        )
    else:
        is_causal, is_local, left, right = _rewrite_fa3(lq, lk, causal, left, right)
    scale = 1.0 / math.sqrt(d)
    s = torch.einsum("bhid,bhjd->bhij", q.to(F64), k.to(F64))  # (B, H, Lq, Lk)
    if softcap > 0:
        s = softcap * torch.tanh(s * (scale / softcap))
    else:
        s = s * scale
    row = torch.arange(lq).view(-1, 1)  # (Lq, 1)
    col = torch.arange(lk).view(1, -1)  # (1, Lk)
    if alibi_slopes is not None:
        slope = alibi_slopes.to(F64).view(-1 if alibi_slopes.ndim == 2 else 1, h, 1, 1)
        if is_causal:
            s = s + slope * col  # the kernel adds slope · col when causal
        else:
            s = s - slope * (row + lk - lq - col).abs()
    hidden = torch.zeros(lq, lk, dtype=torch.bool)
    if is_causal:
        hidden = col >= torch.clamp(row + 1 + lk - lq, max=lk)
    elif is_local:
        limit_right = torch.clamp(row + 1 + lk - lq + right, max=lk)
        limit_left = torch.clamp(row + lk - lq - left, min=0)
        hidden = (col >= limit_right) | (col < limit_left)
    s = s.masked_fill(hidden, -math.inf)
    empty = hidden.all(dim=-1)  # (Lq,)
    lse = torch.logsumexp(torch.where(empty[:, None], 0.0, s), dim=-1)  # (B, H, Lq)
    p = torch.exp(s - lse[..., None]).masked_fill(empty[:, None], 0.0)
    masked_lse = math.inf if version == 2 else -math.inf
    return p @ v.to(F64), torch.where(empty, masked_lse, lse)


def _mask_of(causal: bool, window: tuple[int, int]) -> Mask | None:
    w = None if window == (-1, -1) else SlidingWindow(window[0], window[1])
    c = Causal() if causal else None
    if w is None:
        return c
    return w if c is None else (c & w)


def _apart(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> str:
    """How far the seed's reading ``a`` is from flash-attn's ``b``: O and finite-LSE gaps."""
    do = float((a[0] - b[0]).abs().max())
    both = torch.isfinite(a[1]) & torch.isfinite(b[1])
    dl = float((a[1] - b[1])[both].abs().max()) if bool(both.any()) else 0.0
    if max(do, dl) < 1e-12 and torch.equal(torch.isfinite(a[1]), torch.isfinite(b[1])):
        return "seed: same"
    return f"seed: O {do:.2g} LSE {dl:.2g}"


def _row(
    system: str,
    conv: Conventions,
    case: str,
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
) -> VerifyRow:
    o, lse = got
    wo, wl = want
    same_inf = torch.equal(torch.isinf(lse), torch.isinf(wl)) and torch.equal(
        lse[torch.isinf(lse)], wl[torch.isinf(wl)]
    )
    fin = torch.isfinite(wl)
    err_o = float(((o.to(F64) - wo).abs() / wo.abs().clamp(min=1.0)).max())
    err_l = (
        float(((lse - wl)[fin].abs() / wl[fin].abs().clamp(min=1.0)).max())
        if bool(fin.any())
        else 0.0
    )
    worst, err = ("O", err_o) if err_o >= err_l else ("LSE", err_l)
    ok = same_inf and err <= EDGE_TOL
    detail = (
        ""
        if ok
        else (
            f"{case}: {worst} {err:.3g} from the emulated kernel"
            + ("" if same_inf else "; fully-masked rows (infinite LSE) differ")
        )
    )
    return VerifyRow(
        system=system, convention=conv.name, case=case, dtype="float64", checked="O LSE",
        worst=worst, error=err, bound=EDGE_TOL, status="passed" if ok else "failed", detail=detail,
    )  # fmt: skip


def _refusal_row(system: str, conv: Conventions, case: str, call: Callable[[], Any]) -> VerifyRow:
    try:
        call()
    except ValueError as exc:
        return VerifyRow(
            system=system, convention=conv.name, case=case, dtype="-", checked="refusal",
            worst="refused", error=0.0, bound=0.0, status="passed", detail=str(exc),
        )  # fmt: skip
    return VerifyRow(
        system=system, convention=conv.name, case=case, dtype="-", checked="refusal",
        worst="accepted", error=1.0, bound=0.0, status="failed",
        detail=f"{case}: flash-attn refuses the call, {conv.name} accepted it",
    )  # fmt: skip


def flash_attn_edge_rows(quick: bool = False) -> list[VerifyRow]:
    """One row per flash-attn edge the presets reproduce (small float64 shapes)."""
    gen = torch.Generator().manual_seed(2)
    rows: list[VerifyRow] = []
    seed_br = dataclasses.replace(SEED, name="seed_bottom_right", causal_align="bottom_right")
    edges: list[tuple[str, Conventions, int, dict[str, Any], tuple[int, int]]] = [
        ("flash-attn 2 window -1", FLASH_ATTN_2, 2, {"window": (7, -1)}, (24, 12)),
        ("flash-attn 2 side ≥ Lk", FLASH_ATTN_2, 2, {"window": (-1, 20)}, (40, 12)),
        ("flash-attn 2 ALiBi LSE", FLASH_ATTN_2, 2, {"causal": True, "alibi": True}, (9, 13)),
        ("flash-attn 3 windows", FLASH_ATTN_3, 3, {"window": (40, 2)}, (24, 12)),
    ]  # fmt: skip
    if not quick:
        edges += [
            ("flash-attn 2 window -1", FLASH_ATTN_2, 2, {"window": (3, -1)}, (33, 9)),
            ("flash-attn 2 ALiBi LSE", FLASH_ATTN_2, 2, {"causal": True, "alibi": True, "softcap": 3.0}, (17, 5)),
            ("flash-attn 2 ALiBi LSE", FLASH_ATTN_2, 2, {"window": (-1, 0), "alibi": True}, (6, 6)),
        ]  # fmt: skip
    for system, conv, version, kw, (lq, lk) in edges:
        q = torch.randn(1, 2, lq, 8, generator=gen, dtype=F64)
        k = torch.randn(1, 2, lk, 8, generator=gen, dtype=F64)
        v = torch.randn(1, 2, lk, 8, generator=gen, dtype=F64)
        slopes = torch.rand(1, 2, generator=gen, dtype=F64) if kw.get("alibi") else None
        causal, window = bool(kw.get("causal")), kw.get("window", (-1, -1))
        softcap = float(kw.get("softcap", 0.0))
        want = emulate_flash_attn(
            q, k, v, version=version, causal=causal, window=window, alibi_slopes=slopes,
            softcap=softcap,
        )  # fmt: skip
        opts: dict[str, Any] = dict(
            mask=_mask_of(causal, window), alibi_slopes=slopes, softcap=softcap or None
        )
        res = blocked_forward(q, k, v, conventions=conv, block_q=4, block_k=5, **opts)
        seed = blocked_forward(q, k, v, conventions=seed_br, block_q=4, block_k=5, **opts)
        label = " causal" if causal else ""
        label += f" w{window[0]},{window[1]}" if window != (-1, -1) else ""
        label += " alibi" if slopes is not None else ""
        label += f" cap{softcap:g}" if softcap else ""
        case = f"{lq}x{lk}{label}; {_apart((seed.o, seed.lse), want)}"
        rows.append(_row(system, conv, case, (res.o, res.lse), want))
    x = torch.randn(1, 2, 6, 8, generator=gen, dtype=F64)
    for conv, name in ((FLASH_ATTN_2, "flash-attn 2"), (FLASH_ATTN_3, "flash-attn 3")):
        rows.append(
            _refusal_row(
                f"{name} cap+drop",
                conv,
                "softcap 2 with dropout 0.1",
                lambda conv=conv: blocked_forward(
                    x, x, x, softcap=2.0, dropout_p=0.1, conventions=conv
                ),  # type: ignore[misc]
            )
        )
    return rows
