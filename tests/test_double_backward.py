"""Second-order gradients of ``flash_attention``: gradient penalties and Hessian-vector products.

With ``create_graph=True`` the backward must itself be differentiable; a constant
gradient would silently drop the attention term of every second-order quantity.
Checked by ``gradgradcheck`` in float64 (masks, fully-masked rows, GQA, softcap,
ALiBi, bias, dropout, variable length, a gradient on the LSE, ragged tiles) and
against PyTorch autograd of attention written out (PyTorch's math backend of SDPA,
and the naive formula of ``naive.py`` for the features SDPA lacks).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from naive import as4d, naive_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashledger as fl

F64 = torch.float64


def _inputs(
    gen: torch.Generator, b: int, hq: int, hkv: int, lq: int, lk: int, d: int = 3, dv: int = 2
) -> list[torch.Tensor]:
    return [
        torch.randn(*shape, generator=gen, dtype=F64, requires_grad=True)
        for shape in ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv))
    ]


CASES: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    # (B, Hq, Hkv, Lq, Lk), options; tiles 2 x 3 (ragged last tiles)
    "causal-gqa": ((1, 2, 1, 5, 5), {"mask": fl.Causal()}),
    "masked-rows-fa2": (
        # bottom-right with Lq > Lk: rows 0, 1 see no key; batch 1 sees no key at all
        (2, 1, 1, 5, 3),
        {"mask": fl.Causal("bottom_right") & fl.KeyPadding([3, 0]), "conventions": "flash_attn_2"},
    ),
    "window-softcap-alibi": (
        (1, 2, 2, 5, 6),
        {"mask": fl.SlidingWindow(2, 1), "softcap": 1.5, "alibi_slopes": fl.alibi_slopes(2)},
    ),
    "dropout": ((1, 2, 1, 4, 5), {"dropout_p": 0.3, "seed": 11}),
    "varlen": (
        (1, 2, 2, 6, 7),
        {
            "cu_seqlens_q": torch.tensor([0, 2, 6], dtype=torch.int32),
            "cu_seqlens_k": torch.tensor([0, 4, 7], dtype=torch.int32),
            "mask": fl.Causal("bottom_right"),
        },
    ),
}


def _squeeze_varlen(xs: list[torch.Tensor], opts: dict[str, Any]) -> list[torch.Tensor]:
    """Variable length packs sequences along the length axis: ``(H, total, d)`` tensors."""
    if "cu_seqlens_q" not in opts:
        return xs
    return [x.detach()[0].clone().requires_grad_(True) for x in xs]


@pytest.mark.parametrize("case", list(CASES))
def test_gradgradcheck(case, gen):
    shape, opts = CASES[case]
    xs = _squeeze_varlen(_inputs(gen, *shape), opts)

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = fl.flash_attention(q, k, v, block_q=2, block_k=3, **opts)
        assert isinstance(o, torch.Tensor)
        return o

    assert torch.autograd.gradgradcheck(attn, xs, fast_mode=True)


def test_gradgradcheck_with_bias_and_lse_gradient(gen):
    """A bias that requires a gradient and a gradient flowing into the returned LSE (SEED:
    differentiable LSE), both second order."""
    q, k, v = _inputs(gen, 1, 2, 1, 4, 5)
    bias = torch.randn(2, 4, 5, generator=gen, dtype=F64, requires_grad=True)

    def attn(q, k, v, bias):  # type: ignore[no-untyped-def]
        return fl.flash_attention(q, k, v, bias=bias, block_q=3, block_k=2, return_lse=True)

    assert torch.autograd.gradgradcheck(attn, (q, k, v, bias), fast_mode=True)


def _penalty_and_hvp(
    attn: Any, xs: list[torch.Tensor], vec: list[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The gradient of a gradient penalty ``‖∂L/∂q‖²`` and the Hessian-vector product ``H·vec``
    of ``L = Σ O²`` with respect to ``(q, k, v)``."""
    loss = (attn(*xs) ** 2).sum()
    grads = torch.autograd.grad(loss, xs, create_graph=True)
    assert all(g.requires_grad for g in grads), "the gradient must carry a graph"
    penalty = torch.autograd.grad((grads[0] ** 2).sum(), xs, retain_graph=True)
    hvp = torch.autograd.grad(grads, xs, grad_outputs=vec)
    return penalty, hvp


def _same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    for name, a, b in zip(("q", "k", "v"), got, want):
        err = float((a - b).abs().max())
        scale = max(1.0, float(b.abs().max()))
        assert err <= 1e-12 * scale, (
            f"{what} w.r.t. {name}: max |diff| {err:.3g} (scale {scale:.3g})"
        )


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_second_order_equals_pytorch_math_backend(causal, gen):
    """The issue's case: a gradient penalty and an HVP, against SDPA's math backend (GQA)."""
    xs = _inputs(gen, 2, 4, 2, 9, 9, d=5, dv=4)
    vec = [torch.randn(x.shape, generator=gen, dtype=F64) for x in xs]

    def ours(q, k, v):  # type: ignore[no-untyped-def]
        return fl.flash_attention(
            q, k, v, mask=fl.Causal() if causal else None, block_q=4, block_k=4
        )

    def sdpa(q, k, v):  # type: ignore[no-untyped-def]
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=True
            )

    got, want = _penalty_and_hvp(ours, xs, vec), _penalty_and_hvp(sdpa, xs, vec)
    _same(got[0], want[0], "gradient penalty")
    _same(got[1], want[1], "Hessian-vector product")


@pytest.mark.parametrize("entry", ["flash_attention", "flex_attention"])
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_second_order_with_the_default_tiles(entry, causal, gen):
    """No block_q / block_k given (the common call, and flex's only one): the graph backward
    takes its default tiles, and agrees with SDPA's math backend; a Hessian too."""
    xs = _inputs(gen, 1, 2, 2, 11, 11, d=4, dv=3)
    vec = [torch.randn(x.shape, generator=gen, dtype=F64) for x in xs]

    def ours(q, k, v):  # type: ignore[no-untyped-def]
        if entry == "flex_attention":
            causal_mod = lambda b, h, qi, ki: qi >= ki  # noqa: E731
            bm = fl.create_block_mask(causal_mod, 1, 1, 11, 11) if causal else None
            return fl.flex_attention(q, k, v, block_mask=bm)
        return fl.flash_attention(q, k, v, mask=fl.Causal() if causal else None)

    def sdpa(q, k, v):  # type: ignore[no-untyped-def]
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    got, want = _penalty_and_hvp(ours, xs, vec), _penalty_and_hvp(sdpa, xs, vec)
    _same(got[0], want[0], "gradient penalty")
    _same(got[1], want[1], "Hessian-vector product")
    q = xs[0].detach()
    h = torch.autograd.functional.hessian(lambda x: ours(x, *xs[1:]).sum(), q)
    h_want = torch.autograd.functional.hessian(lambda x: sdpa(x, *xs[1:]).sum(), q)
    _same((h,), (h_want,), "Hessian")


def test_second_and_third_order_with_every_score_feature(gen):
    """Softcap, ALiBi, a bias, dropout and fully-masked rows against the naive formula."""
    q, k, v = _inputs(gen, 1, 2, 1, 6, 5)
    bias = torch.randn(1, 2, 6, 5, generator=gen, dtype=F64)
    opts: dict[str, Any] = dict(
        softcap=2.0, alibi_slopes=fl.alibi_slopes(2), dropout_p=0.25, seed=3
    )
    keep = fl.reference_forward(q, k, v, mask=fl.Causal("bottom_right"), **opts).keep
    visible = torch.ones(6, 5, dtype=torch.bool).tril(-1)  # bottom-right causal, Lq > Lk
    vec = [torch.randn(x.shape, generator=gen, dtype=F64) for x in (q, k, v)]

    def ours(q, k, v):  # type: ignore[no-untyped-def]
        return fl.flash_attention(
            q, k, v, mask=fl.Causal("bottom_right"), bias=bias, block_q=4, block_k=2, **opts
        )

    def naive(q, k, v):  # type: ignore[no-untyped-def]
        o, _ = naive_attention(
            *(as4d(x) for x in (q, k, v)),
            visible=visible,
            bias=bias,
            keep=keep,
            softcap=opts["softcap"],
            alibi_slopes=opts["alibi_slopes"],
            dropout_p=opts["dropout_p"],
        )
        return o

    got, want = _penalty_and_hvp(ours, [q, k, v], vec), _penalty_and_hvp(naive, [q, k, v], vec)
    _same(got[0], want[0], "gradient penalty")
    _same(got[1], want[1], "Hessian-vector product")

    def third(attn: Any) -> tuple[torch.Tensor, ...]:
        (gq,) = torch.autograd.grad((attn(q, k, v) ** 2).sum(), q, create_graph=True)
        (hq,) = torch.autograd.grad((gq**2).sum(), q, create_graph=True)
        return torch.autograd.grad(hq.sum(), (q, k, v))

    _same(third(ours), third(naive), "third-order gradient")


def test_first_order_backward_is_unchanged_and_builds_no_graph(gen):
    """Without create_graph the fast blocked backward runs: its gradients carry no graph and
    are bit for bit the first-order path's."""
    q, k, v = _inputs(gen, 1, 2, 2, 7, 7)
    o = fl.flash_attention(q, k, v, mask=fl.Causal(), block_q=3, block_k=3)
    g1 = torch.autograd.grad(o.sum(), (q, k, v), retain_graph=True)
    assert not any(g.requires_grad for g in g1)
    g2 = torch.autograd.grad(o.sum(), (q, k, v), create_graph=True)
    for a, b in zip(g1, g2):
        err = float((a - b.detach()).abs().max())
        assert err <= 1e-13, f"graph backward differs from the blocked backward by {err:.3g}"


def test_alibi_slopes_that_require_a_gradient_are_refused(gen):
    """The slopes are options, not inputs of the op: their gradient would silently be None."""
    q, k, v = _inputs(gen, 1, 2, 2, 4, 4)
    slopes = fl.alibi_slopes(2).requires_grad_(True)
    with pytest.raises(ValueError, match=r"gradient for alibi_slopes.*alibi_slopes\.detach\(\)"):
        fl.flash_attention(q, k, v, alibi_slopes=slopes)
    fl.flash_attention(q, k, v, alibi_slopes=slopes.detach())


def test_lse_of_fully_masked_rows_keeps_second_order_finite(gen):
    """Rows with no key rebuild P = 0 in the graph too: no NaN reaches any order."""
    q, k, v = _inputs(gen, 1, 1, 1, 5, 3)
    o, lse = fl.flash_attention(
        q, k, v, mask=fl.Causal("bottom_right"), return_lse=True, block_q=2, block_k=2
    )
    assert bool(torch.isneginf(lse[0, 0, :2]).all())
    (gq,) = torch.autograd.grad((o**2).sum() + lse[..., 2:].sum(), q, create_graph=True)
    grads = torch.autograd.grad((gq**2).sum(), (q, k, v))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert not bool(grads[0][0, 0, :2].any()), "rows with no key get no gradient"
    assert math.isfinite(float(sum(g.sum() for g in grads)))


def test_entry_points_without_a_graph_refuse_inputs_that_require_one(gen):
    """blocked_forward and friends record no graph: an input that requires a gradient would
    silently get none (the native path returned an O without grad_fn)."""
    q, k, v = _inputs(gen, 1, 2, 2, 5, 5)
    fwd = fl.blocked_forward(q.detach(), k.detach(), v.detach())
    calls = {
        "blocked_forward": lambda: fl.blocked_forward(q, k, v),
        "split_kv_forward": lambda: fl.split_kv_forward(q, k, v, num_splits=2),
        "blocked_backward": lambda: fl.blocked_backward(q, k, v, fwd.o, fwd.lse, fwd.o),
    }
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{where} is not differentiable.*q, k, v require"):
            call()
        with torch.no_grad():
            call()  # no graph is asked for: fine


def test_ring_refuses_second_order_gradients(gen):
    """Under create_graph=True the ring's backward would return constant gradients: every
    rank raises before any shard moves."""
    import threading

    from flashledger._ring_core import _rank_run, _RingFunction
    from flashledger._ring_transport import LocalHub, LocalTransport
    from flashledger.ring import shard_sequence

    q, k, v = _inputs(gen, 1, 2, 1, 8, 8)
    hub = LocalHub(2, timeout=10.0)
    errors: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        xs = [shard_sequence(x.detach(), r, 2, "contiguous").requires_grad_() for x in (q, k, v)]
        run = _rank_run(
            LocalTransport(hub, r), layout="contiguous", block_q=4, block_k=4, ledger=None, opts={}
        )
        o, _ = _RingFunction.apply(*xs, run)
        try:
            torch.autograd.grad((o**2).sum(), xs[0], create_graph=True)
        except BaseException as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    for r, e in enumerate(errors):
        assert isinstance(e, ValueError) and "no second-order gradients" in str(e), (r, e)


def test_gradients_with_a_graph_past_their_dtype_are_named():
    """create_graph=True: a float16 gradient past 65504 is named as the first-order backward
    names it, not returned as an infinity inside the graph."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 64, 16, generator=g).half().requires_grad_() for _ in range(2))
    v = (300 * torch.randn(1, 2, 64, 16, generator=g)).half().requires_grad_()
    do = (6000 * torch.randn(1, 2, 64, 16, generator=g)).half()
    o = fl.flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"the gradient dq\[0, 0, 0, 0\] overflows float16"):
        torch.autograd.grad(o, q, do, create_graph=True)
