"""The score transform ``s = f(q k^T)`` and its derivative.

Order (flash-attn): ``s = scale * q k^T``; softcap ``s = c * tanh(s / c)``;
then ALiBi ``- slope * |i + Lk - Lq - j|`` (bottom-right aligned, per
sequence with variable length or used lengths; slopes ``(H,)``, ``(B, H)``,
or one row per packed sequence) and an additive ``bias``; masks last
(masked entries become ``-inf``). Under a causal mask flash-attn 2's kernel
adds ``+ slope * j`` instead (``j`` counted from the sequence's first key;
``Conventions.alibi_causal == "key_index"``): on every visible key that is
the same term plus ``slope * (i + Lk - Lq)``, so P and O are unchanged and
the LSE grows by that amount.

Backward: with ``dS`` the gradient of the final scores, ``dBias = dS`` and
the gradient of ``q k^T`` is ``scale * (1 - t^2) * dS`` with
``t = tanh(scale * q k^T / c)`` (just ``scale * dS`` without softcap).

Tensors are in the loop's internal 5-D layout ``(B, Hkv, G, rows, cols)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import Geometry

__all__ = ["ScoreMod", "alibi_slopes"]


MAX_ALIBI_HEADS = 2**16
"""Most heads :func:`alibi_slopes` builds a schedule for (models use tens to hundreds)."""


def alibi_slopes(heads: int, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The standard ALiBi slope schedule for ``heads`` heads, ``(H,)``.

    For a power of two ``n``: ``2^(-8 k / n)``, k = 1..n; otherwise the
    schedule of the nearest lower power of two, then every other slope of the
    next power of two (Press et al.).
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or not 1 <= heads <= MAX_ALIBI_HEADS:
        raise ValueError(
            f"alibi_slopes: heads must be an integer in 1..{MAX_ALIBI_HEADS}, got {heads!r}"
        )

    def pow2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    n = 1 << (heads.bit_length() - 1)
    slopes = pow2(n)
    if n < heads:
        slopes += pow2(2 * n)[0::2][: heads - n]
    return torch.tensor(slopes, dtype=dtype)


def to5d(x: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """View ``(B|1, H|1, ...)`` as ``(B|1, Hkv|1, G|1, ...)``; ``H`` must be ``Hkv * G`` or 1."""
    if x.shape[1] == 1:
        return x.unsqueeze(2)
    return x.view(x.shape[0], hkv, g, *x.shape[2:])


@dataclass
class ScoreMod:
    """Score transform bound to one call (all tensors already validated)."""

    scale: float
    geo: Geometry
    hkv: int
    g: int
    softcap: float | None = None
    slopes: torch.Tensor | None = None  # (B|1, Hkv, G, Lq|1, 1): per row with per-sequence slopes
    bias: torch.Tensor | None = None  # (B|1, Hkv|1, G|1, Lq_total|1, Lk_total|1)
    alibi_key_index: bool = False  # flash-attn 2's causal form: + slope · (j - first key)

    @staticmethod
    def build(
        *,
        scale: float,
        geo: Geometry,
        hkv: int,
        g: int,
        softcap: float | None,
        alibi_slopes: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        alibi_key_index: bool = False,
    ) -> ScoreMod:
        slopes = None
        if alibi_slopes is not None:
            s = alibi_slopes.to(device=geo.device, dtype=dtype)
            if geo.row_seq is not None and s.ndim == 2:  # one row of slopes per packed sequence
                per_row = s[geo.row_seq]  # (Lq, H)
                slopes = to5d(per_row.T[None, :, :, None], hkv, g)  # (1, Hkv, G, Lq, 1)
            else:
                s = s.view(1, -1) if s.ndim == 1 else s  # (B|1, H)
                slopes = to5d(s[:, :, None, None], hkv, g)
        b5 = None
        if bias is not None:
            b = bias.to(device=geo.device, dtype=dtype)
            while b.ndim < 4:
                b = b.unsqueeze(0)
            b5 = to5d(b, hkv, g)
        return ScoreMod(scale, geo, hkv, g, softcap, slopes, b5, alibi_key_index)

    def tile(
        self, qk: torch.Tensor, q0: int, q1: int, k0: int, k1: int, *, inplace: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final scores of a tile from ``qk = q k^T``; returns ``(s, t)``.

        ``qk`` is modified in place unless ``inplace=False`` (out-of-place ops only, for
        a graph autograd differentiates again). ``t = tanh(scale * qk / c)`` is kept for
        the backward when softcap is on.
        """
        s = qk.mul_(self.scale) if inplace else qk * self.scale  # (B, Hkv, G, bq, bk)
        t = None
        if self.softcap is not None:
            t = s.div_(self.softcap).tanh_() if inplace else torch.tanh(s / self.softcap)
            s = t * self.softcap
        if self.slopes is not None:
            geo = self.geo
            slopes = self.slopes if self.slopes.shape[-2] == 1 else self.slopes[..., q0:q1, :]
            j = torch.arange(k0, k1, device=geo.device)[None, None, :] + geo.k_offset  # (1, 1, bk)
            if self.alibi_key_index:
                pos = (j - geo.k_lo[:, q0:q1, None]).to(s.dtype)  # (Bg, bq, bk)
                s = s + slopes * pos[:, None, None]
            else:
                c = (geo.rows()[None, q0:q1] + geo.off_br[:, q0:q1])[..., None]  # (Bg, bq, 1)
                dist = (c - j).abs().to(s.dtype)  # (Bg, bq, bk)
                s = s - slopes * dist[:, None, None]
        if self.bias is not None:
            s = s + self.bias_tile(q0, q1, k0, k1)
        return s, t

    def bias_tile(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        assert self.bias is not None
        geo = self.geo
        b = self.bias
        rq = slice(geo.q_offset + q0, geo.q_offset + q1) if b.shape[-2] != 1 else slice(None)
        rk = slice(geo.k_offset + k0, geo.k_offset + k1) if b.shape[-1] != 1 else slice(None)
        return b[..., rq, rk]

    def grad_qk(self, ds: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        """Gradient with respect to ``q k^T`` from the gradient of the final scores."""
        if t is None:
            return ds * self.scale
        return ds * (self.scale * (1.0 - t * t))


def _demo() -> None:
    """ALiBi slopes for a few head counts."""
    for heads in (1, 4, 6, 8):
        print(f"{heads} heads: {[round(x, 6) for x in alibi_slopes(heads).tolist()]}")


if __name__ == "__main__":
    _demo()
