"""How a sequence is cut into shards for ring attention.

A sequence of ``L`` positions is cut into ``n`` chunks with boundaries
``floor(c·L / n)`` for ``c = 0..n`` (chunk sizes differ by at most one, so any
``L >= n`` works). Rank ``r`` of ``W`` holds

- ``"contiguous"``: ``n = W`` chunks, rank ``r`` holds chunk ``r``;
- ``"zigzag"``: ``n = 2W`` chunks, rank ``r`` holds chunk ``r`` followed by
  chunk ``2W - 1 - r``. Under a causal mask every rank then holds one early and
  one late chunk, so every rank runs about the same number of tiles.

A shard is the concatenation of its chunks along the sequence dim, in the order
above; ``Chunk.local`` is where a chunk sits inside its shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "LAYOUTS",
    "Chunk",
    "Layout",
    "check_layout",
    "chunk_bounds",
    "num_chunks",
    "shard_chunks",
    "shard_sequence",
    "unshard_sequence",
]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a shard: global positions ``[start, stop)``, at ``offset`` in the shard."""

    index: int  # chunk number in the whole sequence (0 .. n-1)
    start: int  # first global position
    stop: int  # one past the last global position
    offset: int  # position of the chunk's first row inside the rank's shard

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def local(self) -> slice:
        """The chunk's rows inside the shard."""
        return slice(self.offset, self.offset + self.length)


def check_layout(layout: object) -> Layout:
    """``layout`` must be ``"contiguous"`` or ``"zigzag"``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return layout  # type: ignore[return-value]


def check_world(world_size: object) -> int:
    """``world_size`` must be an integer >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    return world_size


def num_chunks(world_size: int, layout: Layout) -> int:
    """Chunks the sequence is cut into: ``W`` (contiguous) or ``2W`` (zigzag)."""
    return world_size if layout == "contiguous" else 2 * world_size


def chunk_bounds(length: int, world_size: int, layout: Layout, *, what: str = "L") -> list[int]:
    """Chunk boundaries ``[0, ..., length]`` (``n + 1`` ints); every chunk holds >= 1 position."""
    n = num_chunks(world_size, layout)
    if length < n:
        raise ValueError(
            f"sequence length {what} = {length} is too short for the {layout} layout on "
            f"{world_size} rank(s): it is cut into {n} chunks of at least one position, "
            f"so {what} must be >= {n}"
        )
    return [(c * length) // n for c in range(n + 1)]


def rank_chunk_ids(rank: int, world_size: int, layout: Layout) -> tuple[int, ...]:
    """Chunk numbers rank ``rank`` holds, in shard order."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)


def shard_chunks(
    length: int, rank: int, world_size: int, layout: Layout, *, what: str = "L"
) -> tuple[Chunk, ...]:
    """The chunks of rank ``rank``'s shard of a sequence of ``length`` positions."""
    bounds = chunk_bounds(length, world_size, layout, what=what)
    out, offset = [], 0
    for c in rank_chunk_ids(rank, world_size, layout):
        out.append(Chunk(index=c, start=bounds[c], stop=bounds[c + 1], offset=offset))
        offset += bounds[c + 1] - bounds[c]
    return tuple(out)


def _check_rank(rank: object, world_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank


def _check_dim(x: torch.Tensor, dim: object, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim must be an integer in [{-x.ndim}, {x.ndim}) for {what}, got {dim!r}")
    return dim % x.ndim


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, layout: Layout = "contiguous", *, dim: int = -2
) -> torch.Tensor:
    """Rank ``rank``'s shard of ``x`` along ``dim`` (default -2: ``(..., L, d)``).

    Use ``dim=-1`` for row statistics such as an LSE ``(..., L)``. Returns a
    new contiguous tensor (a zigzag shard is two chunks concatenated).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_world(world_size)
    _check_rank(rank, world_size)
    ax = _check_dim(x, dim, f"a tensor of shape {tuple(x.shape)}")
    chunks = shard_chunks(x.shape[ax], rank, world_size, check_layout(layout))
    return torch.cat([x.narrow(ax, c.start, c.length) for c in chunks], dim=ax).contiguous()


def unshard_sequence(
    shards: Sequence[torch.Tensor], layout: Layout = "contiguous", *, dim: int = -2
) -> torch.Tensor:
    """Put the shards of ranks ``0..W-1`` (``W = len(shards)``) back into one sequence.

    The inverse of ``shard_sequence``: the total length is the sum of the
    shard lengths, and each shard must have exactly the length the layout
    gives its rank.
    """
    check_layout(layout)
    if not isinstance(shards, Sequence) or len(shards) < 1:
        raise ValueError("shards must be a non-empty sequence of tensors, one per rank")
    if not all(isinstance(s, torch.Tensor) for s in shards):
        raise TypeError("shards must all be torch.Tensor")
    w = len(shards)
    ax = _check_dim(shards[0], dim, f"shards of shape {tuple(shards[0].shape)}")
    length = sum(s.shape[ax] for s in shards)
    pieces: dict[int, torch.Tensor] = {}
    for r, s in enumerate(shards):
        chunks = shard_chunks(length, r, w, layout)
        want = sum(c.length for c in chunks)
        if s.ndim != shards[0].ndim or s.shape[ax] != want:
            raise ValueError(
                f"shard {r} has shape {tuple(s.shape)}; with the {layout} layout on {w} ranks "
                f"and a total length of {length} it must hold {want} positions along dim {dim}"
            )
        for c in chunks:
            pieces[c.index] = s.narrow(ax, c.offset, c.length)
    return torch.cat([pieces[c] for c in range(len(pieces))], dim=ax)
