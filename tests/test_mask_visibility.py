"""The visibility a mask_mod's classification keeps for the loop, against the mask_mod.

Classification refines the tiles its span bounds leave open into square sub-blocks,
evaluates only the undecided ones and spreads the decided ones' classes over their
positions (``masks._SubBlocks.keep``); the loop then reads those kept tiles instead of
evaluating the mask_mod again. Every kept tile must equal the mask_mod evaluated on it,
position by position, for every batch entry and head it varies over, on ragged tiles too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from naive import flex_visible, tile_classes_from_dense

import flashledger as fl
from flashledger import masks
from flashledger._checks import all_of, any_of

Tensor = torch.Tensor
flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")


def _document(lengths: list[int]) -> Callable[..., Tensor]:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def mask(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


def _window_per_head(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (q - kv).abs() <= 9 + 17 * h  # each head its own width


def _prefix_per_batch(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (kv < 20 + 41 * b) | (q >= kv)  # each batch entry its own prefix


MASK_MODS = {
    "document": _document([61, 9, 130, 40, 60]),
    "window per head": _window_per_head,
    "prefix per batch": _prefix_per_batch,
}


@pytest.mark.parametrize("sub", [16, 32])
@pytest.mark.parametrize("tiles", [(64, 64), (128, 64), (32, 96)])
@pytest.mark.parametrize("name", list(MASK_MODS))
def test_kept_tiles_equal_the_mask_mod(name: str, tiles: tuple[int, int], sub: int) -> None:
    mm = MASK_MODS[name]
    b, h, lq, lk = 2, 3, 300, 263  # ragged against every tile and sub-block size
    block_q, block_k = tiles
    old = masks.SUB_BLOCKS
    masks.SUB_BLOCKS = (sub,)
    try:
        mask = fl.MaskMod(mm)
        bound = mask.bind(mask.geometry(lq, lk, batch=b, heads=h))
        classes = bound.tile_classes(block_q, block_k)
    finally:
        masks.SUB_BLOCKS = old
    dense = flex_visible(mm, b, h, lq, lk)  # (B, H, Lq, Lk)
    assert torch.equal(classes, tile_classes_from_dense(dense, block_q, block_k))
    kept = bound._kept()[0]
    partial = torch.nonzero(classes == masks.PARTIAL).tolist()
    assert partial and len(kept) == len(partial), (len(kept), len(partial))
    for i, j in partial:
        q0, q1 = i * block_q, min((i + 1) * block_q, lq)
        k0, k1 = j * block_k, min((j + 1) * block_k, lk)
        got = kept[(q0, q1, k0, k1)].expand(b, h, q1 - q0, k1 - k0)
        want = dense[:, :, q0:q1, k0:k1]
        wrong = torch.nonzero(got != want)
        assert wrong.numel() == 0, (
            f"tile ({i}, {j}): kept visibility differs at {wrong.shape[0]} positions, "
            f"first (b, h, row, key) = {tuple((wrong[0] + torch.tensor([0, 0, q0, k0])).tolist())}"
        )
    # the kept tiles were put together from sub-blocks, not evaluated whole
    assert bound.callers[0].positions < b * h * lq * lk


def test_spread_fills_each_square_with_its_value() -> None:
    gen = torch.Generator().manual_seed(0)
    for s in (8, 12, 16, 32):  # words of eight bytes, and of one where s is no multiple of 8
        full = torch.rand(3, 2, 5, generator=gen) > 0.5  # (N, pq, pk)
        words = masks._spread(full, s, 2)  # (2, N, pq, s, pk, w)
        got = words.view(torch.uint8).view(torch.bool).view(2, 3, 2 * s, 5 * s)
        want = full.repeat_interleave(s, dim=1).repeat_interleave(s, dim=2)
        assert torch.equal(got[0], want) and torch.equal(got[1], want), s


@pytest.mark.parametrize("shape", [(0, 4), (5, 0, 3), (7,), (3, 129, 65)])
def test_bool_reductions_match_torch(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in (0.0, 0.5, 1.0):
        x = torch.rand(shape, generator=gen) < p
        assert bool(any_of(x)) == bool(x.any()) and bool(all_of(x)) == bool(x.all())
        for dim in range(len(shape)):
            assert torch.equal(any_of(x, dim), x.any(dim)), (shape, dim)
            assert torch.equal(all_of(x, dim), x.all(dim)), (shape, dim)
        if len(shape) == 3:
            strided = x.transpose(0, 2)[::2]  # not contiguous
            assert torch.equal(any_of(strided, (0, 2)), strided.any(2).any(0))
            assert torch.equal(all_of(strided, (0, 2)), strided.all(2).all(0))


def test_a_mask_mod_that_drops_dims_is_read_per_position() -> None:
    """A mask_mod written for scalar indices (Flex's convention) that squeezes them,
    ``q_idx.squeeze() >= kv_idx.squeeze()``, returned a 1-D broadcast result; on a square
    tile its shape fit the tile's by coincidence and was read as the same row for every
    query (all 64 positions visible where causal sees 36, O off by 0.64). A broadcast
    result with fewer dims than the indices now goes to ``torch.vmap``, as in Flex."""

    def squeezed(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return q.squeeze() >= kv.squeeze()

    n = 8
    q, k, v = (torch.randn(1, 1, n, 4, dtype=torch.float64) for _ in range(3))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(fl.MaskMod(squeezed).dense(n, n), causal)
    for tiles in ((8, 8), (4, 4), (16, 16)):
        res = fl.blocked_forward(
            q, k, v, mask=fl.MaskMod(squeezed), block_q=tiles[0], block_k=tiles[1]
        )
        assert res.ledger.counters.qk_dots_visible == 36
        ref = fl.reference_forward(q, k, v, mask=causal)
        assert torch.allclose(res.o, ref.o, rtol=0, atol=1e-12)
