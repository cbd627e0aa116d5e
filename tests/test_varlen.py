"""Packed (varlen) sequences at their edges: a NaN or inf in a value no row reads changes
nothing in a forward without a gradient (README): keys past ``seqused_k``, keys of a
sequence no query row has, a key column a mask hides from every row (the native step
computes a row block's whole column span, so such a column sits inside the span of the
rows around it); and flash-attn's packed layout (total, H, d), where flashledger packs as
(H, total, d), is refused naming the layout, not the heads or the cu_seqlens end."""

from __future__ import annotations

import contextlib

import pytest
import torch

import flashledger as fl
from flashledger import _native

f64 = torch.float64


def _packed() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 11, 8, generator=gen, dtype=f64) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(
    "opts, unread",
    [
        # sequence 0 uses keys 0..4 of its slot 0..6: keys 5 and 6 are read by no row
        (dict(seqused_k=torch.tensor([5, 4])), slice(5, 7)),
        # sequence 1 has no query row: its keys 3..6 are read by no row
        (
            dict(
                cu_seqlens_q=torch.tensor([0, 6, 6, 11]), cu_seqlens_k=torch.tensor([0, 3, 7, 11])
            ),
            slice(3, 7),
        ),
    ],
)
def test_varlen_unread_value_changes_nothing(native: bool, opts: dict, unread: slice) -> None:
    q, k, v = _packed()
    o = dict(cu_seqlens_q=torch.tensor([0, 6, 11]), cu_seqlens_k=torch.tensor([0, 7, 11]))
    o.update(opts)
    o["mask"] = fl.Causal("bottom_right")
    ctx = contextlib.nullcontext() if native else _native.disabled()
    with ctx:
        clean = fl.blocked_forward(q, k, v, **o)
        bad = v.clone()
        bad[:, unread] = float("nan")
        got = fl.blocked_forward(q, k, bad, **o)
        with torch.no_grad():
            got_fa = fl.flash_attention(q, k, bad, **o)
    # each O entry is a convex combination of at most Lk values of v: two summation orders
    # differ by at most Lk rounding steps of max|v|
    atol = 2 * k.shape[-2] * torch.finfo(f64).eps * float(v.abs().max())
    torch.testing.assert_close(got.o, clean.o, rtol=0, atol=atol)
    torch.testing.assert_close(got_fa, clean.o, rtol=0, atol=atol)
    torch.testing.assert_close(got.lse, clean.lse, rtol=0, atol=atol)


def test_hidden_column_inside_a_span_changes_nothing() -> None:
    q, k, v = (x[None] for x in _packed())
    seen = torch.ones(11, 11, dtype=torch.bool)
    seen[:, 5] = False  # key 5 hidden from every row, keys on both sides seen
    clean = fl.blocked_forward(q, k, v, mask=fl.DenseMask(seen))
    bad = v.clone()
    bad[..., 5, :] = float("inf")
    got = fl.blocked_forward(q, k, bad, mask=fl.DenseMask(seen))
    atol = 2 * k.shape[-2] * torch.finfo(f64).eps * float(v.abs().max())
    torch.testing.assert_close(got.o, clean.o, rtol=0, atol=atol)


def test_a_value_a_row_reads_is_still_named() -> None:
    q, k, v = _packed()
    bad = v.clone()
    bad[:, 2] = float("nan")
    with pytest.raises(ValueError, match=r"v contains NaN or inf at index \(0, 2, 0\)"):
        fl.blocked_forward(
            q,
            k,
            bad,
            cu_seqlens_q=torch.tensor([0, 6, 11]),
            cu_seqlens_k=torch.tensor([0, 7, 11]),
            seqused_k=torch.tensor([5, 4]),
        )


@pytest.mark.parametrize("total_k, hkv", [(10, 2), (10, 8), (12, 2)])
def test_flash_attn_packed_layout_is_named(total_k: int, hkv: int) -> None:
    cq = torch.tensor([0, 4, 10], dtype=torch.int32)
    ck = torch.tensor([0, total_k - 6, total_k], dtype=torch.int32)
    q = torch.randn(10, 8, 16)
    k = v = torch.randn(total_k, hkv, 16)
    with pytest.raises(ValueError, match=r"flash-attn's \(total, H, d\) layout; pass q.transpose"):
        fl.flash_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, mask=fl.Causal())
    # the same tensors in flashledger's layout run
    o = fl.flash_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        mask=fl.Causal(),
    )
    assert o.shape == (8, 10, 16)


def test_a_wrong_end_is_still_named() -> None:
    q = torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 10"):
        fl.blocked_forward(
            q, q, q, cu_seqlens_q=torch.tensor([0, 4, 9]), cu_seqlens_k=torch.tensor([0, 4, 10])
        )
