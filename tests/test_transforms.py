"""``flash_attention`` under PyTorch's transforms. ``torch.func``: ``grad``, ``vjp``,
``jacrev``, ``vmap`` and their compositions (per-sample gradients), against
``torch.autograd`` on the same op and against one call per sample, bit for bit where both
run the same passes; what the transforms cannot carry is refused with a message that says
so. ``torch.compile``: the op is opaque to it and runs as it does eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from naive import naive_attention
from test_properties import ALL_PRESETS, problems
from torch.func import grad, jacrev, vjp, vmap
from torch.nn.attention.flex_attention import AuxRequest

import flashledger as fl

F64 = torch.float64


def _qkv(
    seed: int, lead: tuple[int, ...], hk: int, lq: int, lk: int, d: int = 4, dv: int = 3
) -> list[torch.Tensor]:
    """q ``(*lead, lq, d)``; k, v with ``hk`` heads in the last leading dimension."""
    gen = torch.Generator().manual_seed(seed)
    kv_lead = (*lead[:-1], hk) if lead else ()
    return [
        torch.randn(*lead, lq, d, generator=gen, dtype=F64),
        torch.randn(*kv_lead, lk, d, generator=gen, dtype=F64),
        torch.randn(*kv_lead, lk, dv, generator=gen, dtype=F64),
    ]


def _autograd_grads(fn: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    fn(*leaves).backward()
    return tuple(x.grad for x in leaves)  # type: ignore[misc]


CASES = [
    pytest.param({"mask": fl.Causal()}, id="causal"),
    pytest.param({"mask": fl.SlidingWindow(3, 0), "softcap": 2.0}, id="window-softcap"),
    pytest.param(
        {"conventions": fl.FLASH_ATTN_2, "mask": fl.Causal(align="bottom_right")},
        id="fa2-bottom-right",
    ),
    pytest.param({"dropout_p": 0.25, "seed": 7}, id="dropout"),
    pytest.param({"alibi_slopes": torch.tensor([0.5, 0.25], dtype=F64)}, id="alibi"),
]


@pytest.mark.parametrize("opts", CASES)
@pytest.mark.parametrize("shape", [(2, 2, 2, 9, 13), (1, 2, 1, 17, 5)], ids=["mha", "gqa"])
def test_grad_gives_autograds_gradients_bit_for_bit(
    opts: dict[str, Any], shape: tuple[int, ...]
) -> None:
    b, h, hk, lq, lk = shape
    q, k, v = _qkv(0, (b, h), hk, lq, lk)

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (fl.flash_attention(q, k, v, block_q=4, block_k=8, **opts) ** 2).sum()

    got = grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = _autograd_grads(loss, q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g, w), f"{name}: torch.func.grad differs from torch.autograd"


def test_vjp_carries_a_gradient_on_the_lse_where_the_conventions_differentiate_it() -> None:
    q, k, v = _qkv(1, (2,), 2, 6, 11)
    gen = torch.Generator().manual_seed(2)
    do, dlse = (
        torch.randn(2, 6, 3, generator=gen, dtype=F64),
        torch.randn(2, 6, generator=gen, dtype=F64),
    )
    for conv, lse_counts in ((fl.SEED, True), (fl.FLASH_ATTN_2, False)):

        def f(q: torch.Tensor, conv: Any = conv) -> tuple[torch.Tensor, torch.Tensor]:
            out = fl.flash_attention(q, k, v, return_lse=True, conventions=conv)
            assert isinstance(out, tuple)
            return out

        _, pull = vjp(f, q)
        (dq,) = pull((do, dlse))
        (dq_o,) = pull((do, torch.zeros_like(dlse)))
        leaf = q.clone().requires_grad_(True)
        o, lse = f(leaf)
        torch.autograd.backward((o, lse), (do, dlse))
        assert torch.equal(dq, leaf.grad), f"{conv.name}: vjp differs from autograd"
        assert torch.equal(dq, dq_o) != lse_counts, (
            f"{conv.name}: the LSE's gradient should {'' if lse_counts else 'not '}reach dq"
        )


@pytest.mark.parametrize("opts", CASES)
def test_vmap_gives_each_sample_its_own_call(opts: dict[str, Any]) -> None:
    # q (N, H, L, d) mapped on dim 0; k mapped on dim 1; v shared by every sample
    q, k, v = _qkv(3, (3, 2), 2, 7, 10)
    k = k.movedim(0, 1)  # (H, N, L, d)
    v = v[0]

    def f(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return fl.flash_attention(q, k, v, block_q=3, block_k=4, **opts)  # type: ignore[return-value]

    got = vmap(f, in_dims=(0, 1))(q, k)
    want = torch.stack([f(q[i], k[:, i]) for i in range(3)])
    assert torch.equal(got, want)


def test_per_sample_gradients_are_each_samples_own_with_a_mask_mod_and_dropout() -> None:
    # the mask_mod and the dropout depend on the batch index: each sample must see its own
    # (index 0 of its own call), not its position in the mapped batch
    q, k, v = _qkv(4, (4, 2), 2, 12, 12)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> Any:
        return (ki <= qi) | (b == 0) & (h == 1)

    opts = {"mask": fl.MaskMod(mask_mod), "dropout_p": 0.3, "seed": 11}

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # one sample (H, L, d) as a batch of one
        o = fl.flash_attention(q[None], k[None], v[None], block_q=5, block_k=4, **opts)
        return (o**2).sum()

    got = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(4):
        want = _autograd_grads(loss, q[i], k[i], v[i])
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(g[i], w), f"sample {i}: {name} differs from its own call's"


@settings(max_examples=25, deadline=None)
@given(
    pr=problems(max_len=19, max_d=5, max_block=8),
    n=st.integers(1, 3),
    conv=st.sampled_from(ALL_PRESETS),
    seed=st.integers(0, 2**31 - 1),
)
def test_per_sample_gradients_equal_each_samples_own_call(
    pr: dict[str, Any], n: int, conv: fl.Conventions, seed: int
) -> None:
    # any shape, layout, tiles, mask (fully-masked rows included) and preset: vmap(grad)
    # over n samples gives, bit for bit, each sample's gradients through torch.autograd
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (pr[x] + torch.randn(n, *pr[x].shape, generator=gen, dtype=F64) for x in "qkv")
    opts = dict(mask=pr["mask"], scale=pr["scale"], conventions=conv)
    tiles = dict(block_q=pr["block_q"], block_k=pr["block_k"])

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (fl.flash_attention(q, k, v, **tiles, **opts) * pr["do"]).sum()  # type: ignore[operator]

    got = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(n):
        want = _autograd_grads(loss, q[i], k[i], v[i])
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.equal(g[i], w), f"sample {i}: {name} differs from its own call's"


def test_per_sample_bias_gradients_of_a_shared_bias(assert_close: Any) -> None:
    q, k, v = _qkv(5, (3, 2), 2, 6, 9)
    bias = torch.randn(6, 9, generator=torch.Generator().manual_seed(6), dtype=F64)

    def loss(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (fl.flash_attention(q, k[0], v[0], bias=b) ** 2).sum()

    per = vmap(grad(loss), in_dims=(None, 0))(bias, q)
    assert per.shape == (3, 6, 9)
    for i in range(3):
        (want,) = _autograd_grads(lambda b, i=i: loss(b, q[i]), bias)
        assert torch.equal(per[i], want), f"sample {i}: dbias differs"
    # the sum of per-sample gradients is the batch's gradient, within rounding
    (batch,) = _autograd_grads(lambda b: sum(loss(b, q[i]) for i in range(3)), bias)
    assert_close(per.sum(0), batch, rtol=1e-13, name="sum of per-sample dbias")


@pytest.mark.parametrize("lq,lk", [(1, 1), (5, 3), (4, 7)])
def test_jacrev_is_the_jacobian_and_matches_the_naive_formula(
    lq: int, lk: int, assert_close: Any
) -> None:
    q, k, v = _qkv(7, (), 1, lq, lk, d=3, dv=2)

    def f(q: torch.Tensor) -> torch.Tensor:
        return fl.flash_attention(q, k, v, mask=fl.Causal(align="bottom_right"))  # type: ignore[return-value]

    jac = jacrev(f)(q)
    assert jac.shape == (lq, 2, lq, 3)
    assert torch.equal(jac, torch.autograd.functional.jacobian(f, q))

    def naive(q: torch.Tensor) -> torch.Tensor:
        visible = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        return naive_attention(q[None, None], k[None, None], v[None, None], visible=visible)[0][
            0, 0
        ]

    assert_close(jac, torch.autograd.functional.jacobian(naive, q), rtol=1e-12, name="jacobian")


def test_a_flex_score_mod_without_captured_gradients_maps_and_differentiates() -> None:
    q, k, v = _qkv(8, (2, 2, 2), 2, 8, 8)

    def score_mod(s: torch.Tensor, b: Any, h: Any, qi: Any, ki: Any) -> torch.Tensor:
        return s - 0.1 * (qi - ki).abs() + 0.5 * h

    def loss(q: torch.Tensor) -> torch.Tensor:
        return (fl.flex_attention(q, k[0], v[0], score_mod=score_mod) ** 2).sum()  # type: ignore[operator]

    got = vmap(grad(loss))(q)
    for i in range(2):
        (want,) = _autograd_grads(loss, q[i])
        assert torch.equal(got[i], want)


# torch's forward mode loads its jvp decompositions through torch.jit.script (deprecated)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_what_the_transforms_cannot_carry_is_refused_with_the_reason() -> None:
    q, k, v = _qkv(9, (2,), 2, 5, 5)

    def f(q: torch.Tensor) -> torch.Tensor:
        return fl.flash_attention(q, k, v)  # type: ignore[return-value]

    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.jvp(f, (q,), (torch.ones_like(q),))
    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.jacfwd(f)(q)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        grad(lambda q: grad(lambda q: (f(q) ** 2).sum())(q).sum())(q)

    table = torch.zeros(5, dtype=F64, requires_grad=True)

    def with_table(s: torch.Tensor, b: Any, h: Any, qi: Any, ki: Any) -> torch.Tensor:
        return s + table[ki]

    with pytest.raises(ValueError, match="captures 1 tensor"):
        grad(lambda q: fl.flash_attention(q, k, v, score_mod=with_table).sum())(q)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="captures 1 tensor"):  # plain vmap, grad mode on
        vmap(lambda q: fl.flash_attention(q, k, v, score_mod=with_table))(q[None])
    with torch.no_grad():  # where no gradient is wanted, the same call maps
        mapped = vmap(lambda q: fl.flash_attention(q, k, v, score_mod=with_table))(q[None])
        assert torch.equal(mapped[0], fl.flash_attention(q, k, v, score_mod=with_table))

    per_row = torch.randn(3, 5, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    with pytest.raises(ValueError, match="score_mod= option holds a tensor that varies"):
        vmap(lambda t: fl.flash_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + t[i, j]))(
            per_row
        )
    # a per-sample scalar that would broadcast along the keys (Lk = 5) unnoticed
    with pytest.raises(ValueError, match="score_mod= option holds a tensor that varies"):
        vmap(lambda t: fl.flash_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + t))(
            per_row[:, 0]
        )
    with pytest.raises(ValueError, match="mask= option holds a tensor that varies"):
        vmap(
            lambda t: fl.flash_attention(
                q, k, v, mask=fl.Causal() & fl.MaskMod(lambda b, h, i, j: t[i, j] > 0)
            )
        )(per_row)

    q4, k4, v4 = (x[None] for x in (q, k, v))
    with pytest.raises(ValueError, match="return_aux"):
        grad(
            lambda q: fl.flex_attention(  # type: ignore[union-attr]
                q, k4, v4, return_aux=AuxRequest(max_scores=True)
            )[0].sum()
        )(q4)


def test_tensor_options_mapped_by_vmap_are_sliced_per_sample() -> None:
    q, k, v = _qkv(11, (3, 2), 2, 6, 7)
    gen = torch.Generator().manual_seed(12)
    slopes = torch.rand(3, 2, generator=gen, dtype=F64)
    visible = torch.rand(3, 6, 7, generator=gen) > 0.4  # a row may see no key
    bias = torch.randn(2, 6, 7, 3, generator=gen, dtype=F64)  # mapped on its last dim

    def f(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return fl.flash_attention(q, k[0], v[0], alibi_slopes=s, mask=m, bias=b)  # type: ignore[return-value]

    got = vmap(f, in_dims=(0, 0, 0, 3))(q, slopes, visible, bias)
    want = torch.stack([f(q[i], slopes[i], visible[i], bias[..., i]) for i in range(3)])
    assert torch.equal(got, want)


def test_vmap_over_the_backward_of_a_graph_built_outside_torch_func() -> None:
    # torch.func.vmap over torch.autograd.grad: the op's ordinary backward meets mapped
    # gradients and hands them to the backward op, which vmap maps
    q, k, v = _qkv(15, (2,), 1, 6, 8)
    leaf = q.clone().requires_grad_(True)
    o = fl.flash_attention(leaf, k, v, mask=fl.Causal(align="bottom_right"), block_q=4)
    assert isinstance(o, torch.Tensor)
    gs = torch.randn(4, *o.shape, generator=torch.Generator().manual_seed(16), dtype=F64)

    def back(g: torch.Tensor) -> torch.Tensor:
        return torch.autograd.grad(o, leaf, g, retain_graph=True)[0]

    got = vmap(back)(gs)
    assert torch.equal(got, torch.stack([back(g) for g in gs]))
    # torch.autograd's own batched gradients run on the legacy vmap, which cannot map it
    with pytest.raises(ValueError, match="legacy vmap"):
        torch.autograd.grad(o, leaf, gs, is_grads_batched=True)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_dual_tensors_outside_torch_func_are_refused_not_dropped() -> None:
    """torch.autograd.forward_ad's dual tensors (and torch.func.linearize, which makes
    them): the forward alone has no rule for a tangent, and it was dropped (a tangent of
    None, a JVP of zeros) where an input did not require grad; now it is refused, with or
    without requires_grad, through flash_attention and flex_attention alike."""
    import torch.autograd.forward_ad as fwad

    q, k, v = _qkv(21, (1, 1), 1, 6, 6)  # (B, H, L, d), as flex_attention takes them
    t = torch.randn_like(q)
    for leaf in (q, q.clone().requires_grad_(True)):
        for op in (fl.flash_attention, fl.flex_attention):
            with fwad.dual_level(), pytest.raises(RuntimeError, match="no forward-mode"):
                op(fwad.make_dual(leaf, t), k, v)
    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.linearize(lambda q: fl.flash_attention(q, k, v), q)
    with fwad.dual_level():  # a dual level with plain inputs is no forward mode: it runs
        assert torch.equal(fl.flash_attention(q, k, v), fl.flash_attention(q, k, v))


def test_an_option_tensor_changed_before_the_backward_is_refused() -> None:
    """The backward reads the options again: a boolean mask, a DenseMask, alibi_slopes, a
    dropout_mask or a tensor a score_mod reads (through its closure or a global) changed
    in place between the forward and the backward gave the gradients of another problem
    (dQ off by up to 1e4); now the backward refuses, as autograd does for the inputs. A
    0-d tensor scale is read by value at the forward, so changing it later changes
    nothing."""
    q, k, v = _qkv(22, (1,), 1, 6, 6)
    x = q.clone().requires_grad_(True)
    w = torch.tensor(0.5, dtype=F64)

    def shift(s: torch.Tensor, b: Any, h: Any, i: Any, j: Any) -> torch.Tensor:
        return s + w * (i - j)

    drop = torch.rand(1, 1, 6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    cases = {
        "bool mask": (dict(mask=torch.ones(6, 6, dtype=torch.bool).tril()), "mask"),
        "DenseMask": (dict(mask=fl.DenseMask(torch.ones(6, 6, dtype=torch.bool).tril())), None),
        "alibi_slopes": (dict(alibi_slopes=torch.tensor([0.5], dtype=F64)), "alibi_slopes"),
        "dropout_mask": (dict(dropout_p=0.3, dropout_mask=drop.clone()), "dropout_mask"),
        "score_mod closure": (dict(score_mod=shift), None),
    }
    for name, (opts, field) in cases.items():
        for change in (False, True):
            o = fl.flash_attention(x, k, v, **opts)
            held = opts[field] if field else (opts["mask"].mask if name == "DenseMask" else w)
            before = held.clone()
            if change:
                held.logical_not_() if held.dtype == torch.bool else held.add_(1.0)
            if not change:
                o.square().sum().backward()  # unchanged: the gradients flow
                continue
            with pytest.raises(RuntimeError, match="changed in place between the forward"):
                o.square().sum().backward()
            held.copy_(before)
    scale = torch.tensor(0.5, dtype=F64)
    grads = []
    for later in (0.5, 2.0):
        leaf = q.clone().requires_grad_(True)
        o = fl.flash_attention(leaf, k, v, scale=scale)
        scale.fill_(later)  # after the forward: the backward uses the forward's 0.5
        o.square().sum().backward()
        grads.append(leaf.grad)
        scale.fill_(0.5)
    assert torch.equal(grads[0], grads[1])


def test_a_mask_tensor_deep_in_a_composition_changed_before_the_backward_is_refused() -> None:
    """A DenseMask three compositions deep (``((D & Causal) | W) | W``) was past the depth
    the backward's check looked at: changed in place between the forward and the backward,
    it gave the gradients of the new mask silently (dQ off by 5.6); a mask tree is now
    walked to its leaves at any depth."""
    q, k, v = _qkv(22, (1,), 1, 8, 8)
    x = q.clone().requires_grad_(True)
    t = torch.rand(8, 8, generator=torch.Generator().manual_seed(1)) < 0.5
    mask = ((fl.DenseMask(t) & fl.Causal()) | fl.SlidingWindow(0, 0)) | fl.SlidingWindow(0, 0)
    o = fl.flash_attention(x, k, v, mask=mask, block_q=4, block_k=4)
    t.fill_(True)
    with pytest.raises(RuntimeError, match="changed in place between the forward"):
        o.sum().backward()


# dynamo, tracing the create_graph backward's first lines, breaks the graph at a functorch
# check it does not know (and says so in a warning); the op itself runs as eager
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning")
def test_a_gradient_penalty_compiles_around_the_op() -> None:
    """create_graph=True inside torch.compile: the second-order backward runs the op's
    forward again, which dynamo traced into (an internal dynamo error); it now runs as it
    does eagerly, the same penalty as eager."""
    q, k, v = _qkv(23, (1,), 1, 6, 6)

    def penalty(x: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(fl.flash_attention(x, k, v).sum(), x, create_graph=True)
        return g.square().sum()

    want = penalty(q.clone().requires_grad_(True))
    torch._dynamo.reset()
    got = torch.compile(penalty, backend="eager")(q.clone().requires_grad_(True))
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (float(got), float(want))


def test_outside_the_transforms_the_op_is_unchanged() -> None:
    # the torch.func path is taken only while a transform is active
    q, k, v = _qkv(10, (2,), 2, 6, 6)
    leaf = q.clone().requires_grad_(True)
    o = fl.flash_attention(leaf, k, v)
    assert type(o.grad_fn).__name__ == "_FlashAttentionBackward"
    assert torch.equal(vmap(lambda q: fl.flash_attention(q, k, v))(q[None])[0], o.detach())


def test_torch_compile_runs_the_op_as_eager_around_a_graph_break() -> None:
    # the op is opaque to dynamo (torch.compiler.disable on the entry points): the code
    # around it compiles, the op runs as it does eagerly, the same bits forward and backward
    q, k, v = _qkv(13, (2, 2), 1, 11, 9)
    do = torch.randn(2, 2, 11, 3, generator=torch.Generator().manual_seed(14), dtype=F64)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fl.flash_attention(q * 1.0, k, v, mask=fl.Causal(), block_q=4, block_k=4)  # type: ignore[return-value]

    torch._dynamo.reset()  # dynamo skips the op (one break, its reason the op) and goes on
    explained = torch._dynamo.explain(lambda q, k, v: f(q, k, v) * 2)(q, k, v)
    reasons = [b.reason for b in explained.break_reasons]
    assert explained.graph_break_count == 1 and "function `<function flash_attention" in reasons[0]
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="eager")
    got = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_got, o_want = compiled(*got), f(*want)
    assert torch.equal(o_got, o_want)
    o_got.backward(do)
    o_want.backward(do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a.grad, b.grad), f"{name}: compiled differs from eager"


def test_torch_compile_of_flex_and_a_decode_step() -> None:
    q, k, v = _qkv(17, (1, 2), 2, 8, 8)

    def flex(q: torch.Tensor) -> torch.Tensor:
        return fl.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s - (i - j).abs()) * 2  # type: ignore[operator]

    cache_k, cache_v = (torch.cat([x, torch.zeros_like(x)], dim=2) for x in (k, v))

    def decode(q: torch.Tensor) -> torch.Tensor:
        return fl.attention_with_kvcache(q, cache_k, cache_v, cache_seqlens=8).o + 1

    for fn, x in ((flex, q), (decode, q[:, :, -1:])):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(fn, backend="eager")(x), fn(x)), fn.__name__
