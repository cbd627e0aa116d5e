"""The score transform ``s = f(q k^T)`` and its derivative.

Order (flash-attn): ``s = scale * q k^T``; softcap ``s = c * tanh(s / c)``;
then ALiBi ``- slope * |i + Lk - Lq - j|`` (bottom-right aligned, per
sequence with variable length or used lengths; slopes ``(H,)``, ``(B, H)``,
or one row per packed sequence) and an additive ``bias``; then a user's
FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` on the whole tile
(alone, it sees ``scale * q k^T``, as in Flex); masks last (masked entries
become ``-inf``). Under a causal mask flash-attn 2's kernel
adds ``+ slope * j`` instead (``j`` counted from the sequence's first key;
``Conventions.alibi_causal == "key_index"``): on every visible key that is
the same term plus ``slope * (i + Lk - Lq)``, so P and O are unchanged and
the LSE grows by that amount.

Backward: with ``dS`` the gradient of the final scores, the score_mod's
vector-Jacobian product on the tile gives the gradient ``dS'`` of its input
(and adds the gradients of the tensors it captures; ``_mods.UserScore``);
``dBias = dS'`` and the gradient of ``q k^T`` is ``scale * (1 - t^2) * dS'``
with ``t = tanh(scale * q k^T / c)`` (just ``scale * dS'`` without softcap).

Tensors are in the loop's internal 5-D layout ``(B, Hkv, G, rows, cols)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import plain, value_range
from ._mods import ScoreModFn, TileVJP, UserScore
from .masks import Geometry

__all__ = ["ScoreMod", "TileGrad", "alibi_slopes"]


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


@dataclass(frozen=True)
class TileGrad:
    """What the backward keeps of a tile's score transform."""

    t: torch.Tensor | None = None  # softcap's tanh(scale * q k^T / c)
    user: TileVJP | None = None  # the score_mod's input and output, with their graph


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
    user: UserScore | None = None  # a FlexAttention score_mod
    bias_range: tuple[float, float] | None = None  # the bias's (min, max), when known

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
        bias_range: tuple[float, float] | None = None,
        alibi_key_index: bool = False,
        score_mod: ScoreModFn | None = None,
        batch: int = 1,
    ) -> ScoreMod:
        slopes = None
        if alibi_slopes is not None:
            s = plain(alibi_slopes).to(device=geo.device, dtype=dtype)
            if geo.row_seq is not None and s.ndim == 2:  # one row of slopes per packed sequence
                per_row = s[geo.row_seq]  # (Lq, H)
                slopes = to5d(per_row.T[None, :, :, None], hkv, g)  # (1, Hkv, G, Lq, 1)
            else:
                s = s.view(1, -1) if s.ndim == 1 else s  # (B|1, H)
                slopes = to5d(s[:, :, None, None], hkv, g)
        b5 = None
        if bias is not None:
            b = plain(bias).to(device=geo.device, dtype=dtype)
            if b is not bias or bias_range is None:  # converted: rounded values, found again
                bias_range = value_range(b)
            while b.ndim < 4:
                b = b.unsqueeze(0)
            b5 = to5d(b, hkv, g)
        user = None
        if score_mod is not None:
            user = UserScore.bind(
                score_mod, batch=batch, heads=hkv * g, dtype=dtype, device=geo.device
            )
        return ScoreMod(scale, geo, hkv, g, softcap, slopes, b5, alibi_key_index, user, bias_range)

    def tile(
        self,
        qk: torch.Tensor,
        q0: int,
        q1: int,
        k0: int,
        k1: int,
        *,
        grad: bool = False,
        inplace: bool = True,
        scaled: bool = False,
    ) -> tuple[torch.Tensor, TileGrad]:
        """Final scores of a tile from ``qk = q k^T`` (``scaled``: ``scale · q k^T``, the
        scale already applied by the matmul); returns ``(s, ctx)``.

        ``qk`` is modified in place unless ``inplace=False`` (out-of-place ops only, for
        a graph autograd differentiates again). ``ctx`` keeps what the backward needs:
        ``t = tanh(scale * qk / c)`` when softcap is on and, with ``grad=True``, the
        score_mod's graph on the tile.
        """
        s = qk  # (B, Hkv, G, bq, bk)
        if not scaled:
            s = qk.mul_(self.scale) if inplace else qk * self.scale
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
        if self.user is None:
            return s, TileGrad(t)
        # -- the user's score_mod, once on the whole tile, in Flex's (B, H, r, c) layout --
        geo = self.geo
        rows = geo.rows()[q0:q1]  # (r,) global
        keys = torch.arange(k0, k1, device=geo.device) + geo.k_offset  # (c,) global
        s4 = s.reshape(s.shape[0], self.hkv * self.g, q1 - q0, k1 - k0)  # (B, Hq, r, c)
        if not grad:
            out = self.user.apply(s4, rows, keys)  # (B, Hq, r, c)
            return (_owned(out, s4) if inplace else out).reshape(s.shape), TileGrad(t)
        out, vjp = self.user.forward(s4, rows, keys)
        if inplace and not _is_buffer(out, s4):
            out = out.clone()  # s4 is the graph's input: its values stay as they are
        return out.reshape(s.shape), TileGrad(t, vjp)

    def bias_tile(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        assert self.bias is not None
        geo = self.geo
        b = self.bias
        rq = slice(geo.q_offset + q0, geo.q_offset + q1) if b.shape[-2] != 1 else slice(None)
        rk = slice(geo.k_offset + k0, geo.k_offset + k1) if b.shape[-1] != 1 else slice(None)
        return b[..., rq, rk]

    def grad_user(self, ds: torch.Tensor, ctx: TileGrad) -> torch.Tensor:
        """Gradient of the score_mod's input from ``ds``, that of the final scores (5-D);
        ``ds`` itself without a score_mod. The captured tensors' gradients accumulate in
        ``self.user.grads``."""
        if self.user is None or ctx.user is None:
            return ds
        ds4 = ds.reshape(ctx.user.out.shape)  # (B, Hq, r, c)
        return self.user.vjp(ctx.user, ds4).reshape(ds.shape)

    def grad_qk(self, ds: torch.Tensor, ctx: TileGrad) -> torch.Tensor:
        """Gradient with respect to ``q k^T`` from ``ds``, that of the scores after bias
        (``grad_user``'s result)."""
        if ctx.t is None:
            return ds * self.scale
        return ds * (self.scale * (1.0 - ctx.t * ctx.t))


def _is_buffer(out: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``out`` is the tile buffer ``buf`` itself (the same elements, laid out alike)."""
    return (
        out.data_ptr() == buf.data_ptr() and out.shape == buf.shape and out.stride() == buf.stride()
    )


def _owned(out: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """A score_mod's result as scores the loop may overwrite in place: ``out`` when it is
    the tile buffer ``buf`` (the score returned as given, or changed in place), else its
    values copied into ``buf``. ``out`` may be a tensor the score_mod captured, a view of
    one, or a broadcast with one element behind many: the loop's in-place softmax must
    neither write to the caller's tensor nor fail on a broadcast."""
    if _is_buffer(out, buf):
        return out
    if out.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
        out = out.clone()  # a rearranged view of the buffer itself (flipped, transposed)
    return buf.copy_(out)


def _demo() -> None:
    """ALiBi slopes for a few head counts."""
    for heads in (1, 4, 6, 8):
        print(f"{heads} heads: {[round(x, 6) for x in alibi_slopes(heads).tolist()]}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("scores", _demo)
