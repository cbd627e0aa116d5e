"""Counter-based dropout: the keep decision is a pure function of its coordinates.

``keep(seed, b, h, i, j)`` hashes the seed, batch index, query head, global
query index and global key index into 32 random bits (a chain of the
murmur3 32-bit finaliser, computed vectorised in int64 torch ops). So the
dense reference, a blocked forward with any tiling, its backward, split-KV and
every rank of ring attention all see the same keep mask.

Two keep tests (``Conventions.dropout_keep``):

- ``"bernoulli"``: keep iff ``u32 < round((1 - p) * 2**32)`` (rate ``1 - p``);
- ``"fa2_8bit"``: flash-attn 2's test on the low byte, keep iff
  ``byte <= floor((1 - p) * 255)`` (rate ``(floor((1-p)*255) + 1) / 256``).

Kept entries are scaled by ``1 / (1 - p)`` in both; the LSE is computed
before dropout and never sees it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dropout_keep", "keep_rate", "random_bits"]

_M32 = 0xFFFFFFFF
_GOLD = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def random_bits(
    seed: int, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor
) -> torch.Tensor:
    """32 random bits per coordinate (int64 in ``[0, 2**32)``), broadcasting b, h, i, j."""
    s = torch.tensor(seed & ((1 << 64) - 1), dtype=torch.uint64).to(torch.int64)
    x = _mix32((s & _M32) ^ _GOLD[0])
    x = _mix32(x ^ ((s >> 32) & _M32) ^ _GOLD[1])
    x = _mix32(x ^ ((b.to(torch.int64) * _GOLD[2]) & _M32))
    x = _mix32(x ^ ((h.to(torch.int64) * _GOLD[3]) & _M32))
    x = _mix32(x ^ ((i.to(torch.int64) * _GOLD[4]) & _M32))
    return _mix32(x ^ (j.to(torch.int64) & _M32))


def dropout_keep(
    seed: int,
    p: float,
    mode: str,
    b: torch.Tensor,
    h: torch.Tensor,
    i: torch.Tensor,
    j: torch.Tensor,
) -> torch.Tensor:
    """Bool keep mask for broadcast coordinates (True = kept)."""
    u = random_bits(seed, b.to(i.device), h.to(i.device), i, j)
    if mode == "fa2_8bit":
        return (u & 0xFF) <= math.floor((1.0 - p) * 255)
    return u < round((1.0 - p) * 2**32)


def keep_rate(p: float, mode: str) -> float:
    """Expected fraction of kept entries under a keep test."""
    if mode == "fa2_8bit":
        return (math.floor((1.0 - p) * 255) + 1) / 256
    return 1.0 - p


def _demo() -> None:
    """The counter-based keep mask: one 4 x 8 tile at p = 0.25, both keep tests."""
    i, j = torch.arange(4)[:, None], torch.arange(8)[None, :]
    zero = torch.zeros((), dtype=torch.int64)
    for mode in ("bernoulli", "fa2_8bit"):
        keep = dropout_keep(0, 0.25, mode, zero, zero, i, j)
        print(f"{mode}: expected keep rate {keep_rate(0.25, mode):.6f}")
        for row in keep.tolist():
            print("  " + "".join("1" if x else "." for x in row))


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("dropout", _demo)
