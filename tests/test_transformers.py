"""flashledger as a transformers attention backend, checked in whole models.

Small random-initialised models built from the configurations transformers
ships (no download). In float64, logits on the real tokens of a padded batch
and the gradients of attention weights equal the same model run with SDPA
(Gemma 2, whose SDPA path refuses softcaps, against its eager formula in
float64; gpt-oss, with sinks, against its eager path); greedy generation
with a KV cache gives the same tokens; training with dropout runs and
learns. The mask mapping is checked on its own: every plan equals the mask
transformers' SDPA path would build, and the models' masks arrive as the
structured masks the native step runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AttentionInterface, AttentionMaskInterface
from transformers import masking_utils as mu

import flashledger as fl
from flashledger.integrations import _hf_attention
from flashledger.integrations.transformers import (
    RowIntervals,
    attention_forward,
    mask_function,
    random_model,
    register,
)

F64 = torch.float64
NAME = register()


def eager64(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 2's eager attention with its softmax in the inputs' dtype (transformers'
    own takes it in float32, and a fully-masked padding row becomes NaN in float64)."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    s = (query @ k.transpose(2, 3)) * scaling  # (B, H, Lq, Lk)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None:
        s = s + attention_mask
    p = torch.softmax(s, dim=-1)
    return (p @ v).transpose(1, 2).contiguous(), p


AttentionInterface.register("eager64", eager64)
AttentionMaskInterface.register("eager64", mu.eager_mask)

# the reference each architecture is compared with
REFERENCE = {
    "llama": "sdpa",
    "mistral": "sdpa",
    "qwen2": "sdpa",
    "gemma2": "eager64",
    "bert": "sdpa",
    "gpt_oss": "eager",
}
DECODERS = [a for a in REFERENCE if a != "bert"]
BUILD: dict[str, Any] = dict(layers=2, hidden=64, heads=4, sliding_window=6, dtype=F64)


@pytest.fixture
def masks_seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], Any]]:
    """(key shape, flashledger mask) of every attention call."""
    seen: list[tuple[tuple[int, ...], Any]] = []
    real = _hf_attention._FlashAttention.apply

    def spy(q: torch.Tensor, k: torch.Tensor, *rest: Any) -> Any:
        seen.append((tuple(k.shape), rest[2]["mask"]))
        return real(q, k, *rest)

    monkeypatch.setattr(_hf_attention._FlashAttention, "apply", spy)
    return seen


def _pair(arch: str, **kw: Any) -> tuple[Any, Any]:
    """(flashledger model, reference model) with the same weights."""
    opts = {**BUILD, **kw}
    return (
        random_model(arch, attn_implementation=NAME, **opts),
        random_model(arch, attn_implementation=REFERENCE[arch], **opts),
    )


def _batch(
    arch: str, gen: torch.Generator, length: int = 19, side: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences, the first padded by 5 tokens on ``side`` (default: on the right for
    bert, on the left, as generation pads, for decoders)."""
    ids = torch.randint(1, 128, (2, length), generator=gen)
    att = torch.ones_like(ids)
    if (side or ("right" if arch == "bert" else "left")) == "right":
        att[0, -5:] = 0
    else:
        att[0, :5] = 0
    return ids, att


# ----------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------
def test_register_names_and_refusals():
    assert register() == "fl_ledger" == NAME
    assert register("my_blocked", block_q=64, block_k=32) == "my_blocked"
    assert "my_blocked" in AttentionInterface._global_mapping
    assert AttentionMaskInterface._global_mapping["my_blocked"] is mask_function
    for bad, part in (("flashledger", "flash"), ("my_sdpa", "sdpa"), ("paged|x", "paged")):
        with pytest.raises(ValueError, match=f"contains '{part}'"):
            register(bad)
    with pytest.raises(ValueError, match="non-empty string"):
        register(" ")
    with pytest.raises(ValueError, match="block_q"):
        register("ok_name", block_q=0)
    for dtype in (torch.int32, "float32"):
        with pytest.raises(ValueError, match=r"dtype must be a floating torch\.dtype"):
            random_model("llama", layers=1, dtype=dtype)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------
# the mask plan equals the mask transformers' SDPA path builds
# ----------------------------------------------------------------------------------------
def _pattern(kind: str, window: int, chunk: int, pos: torch.Tensor) -> Any:
    if kind == "causal":
        return mu.causal_mask_function
    if kind == "bidirectional":
        return mu.bidirectional_mask_function
    if kind == "sliding":
        return mu.sliding_window_causal_mask_function(window)
    if kind == "sliding bidirectional":
        return mu.sliding_window_bidirectional_mask_function(window)
    if kind == "chunked":
        return mu.chunked_causal_mask_function(chunk, torch.zeros(pos.shape[0], dtype=torch.long))
    packed = mu.find_packed_sequence_indices(pos)
    base = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos)
    return base if packed is None else mu.and_masks(base, mu.packed_sequence_mask_function(packed))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 3),
    lq=st.integers(1, 24),
    kind=st.sampled_from(
        ["causal", "bidirectional", "sliding", "sliding bidirectional", "chunked", "packed"]
    ),
    padding=st.sampled_from(["none", "left", "right", "both", "hole"]),
)
def test_mask_plan_equals_the_sdpa_mask(data, batch, lq, kind, padding, assert_same):
    past = 0 if kind == "packed" else data.draw(st.integers(0, 12), label="past")
    tail = 0 if kind == "packed" else data.draw(st.integers(0, 5), label="unwritten tail")
    lk = past + lq + tail  # a static cache holds slots beyond the tokens seen
    window, chunk = data.draw(st.integers(1, 9), label="window"), data.draw(st.integers(1, 7))
    cuts = sorted(data.draw(st.lists(st.integers(1, lq - 1), max_size=2)) if lq > 1 else [])
    pos = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, lq])])[None]
    pattern = _pattern(kind, window, chunk, pos.expand(batch, lq))
    pad = None
    if padding != "none":
        pad = torch.ones(batch, past + lq, dtype=torch.bool)
        n = past + lq
        for b in range(batch):
            a = data.draw(st.integers(0, n), label="pad a")
            z = data.draw(st.integers(a, n), label="pad z")
            if padding == "left":
                pad[b, :a] = False
            elif padding == "right":
                pad[b, z:] = False
            elif padding == "both":
                pad[b, :a] = False
                pad[b, z:] = False
            else:
                pad[b, a:z] = False
    args: dict[str, Any] = dict(
        batch_size=batch, q_length=lq, kv_length=lk, q_offset=past, kv_offset=0,
        mask_function=pattern, attention_mask=pad,
    )  # fmt: skip
    plan = mask_function(**args)
    want = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    assert want is not None
    assert_same(plan.dense(), want.expand(batch, 1, lq, lk), name=f"{kind}, {padding} padding")
    assert plan.keys <= lk and not bool(want[..., plan.keys :].any())
    runs = [] if pad is None else [torch.nonzero(row)[:, 0].tolist() for row in pad]
    holes = any(r and r[-1] - r[0] + 1 != len(r) for r in runs)  # real keys not one run
    if kind in ("causal", "sliding", "bidirectional") and not holes:
        assert plan.kind != "dense", plan  # structured: the native step's interval masks
    if kind == "causal" and padding == "none":
        # one query row sees every key (no mask); an unwritten tail is cut off
        assert plan.kind == ("causal" if lq > 1 else "full"), plan
        assert plan.keys == past + lq, plan


def test_planned_masks_of_prefill_and_decode():
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    plan = mask_function(batch_size=2, q_length=6, kv_length=6, attention_mask=left)
    assert repr(plan.mask) == "(Causal(align='bottom_right') & KeyPadding([4, 6], side='left'))"
    assert plan.label == "causal+pad" and plan.keys == 6
    # one query row after 6 cached tokens: it sees every real key, no causal mask needed
    grown = torch.cat([left, torch.ones(2, 1, dtype=torch.long)], dim=1)
    step = mask_function(batch_size=2, q_length=1, kv_length=7, q_offset=6, attention_mask=grown)
    assert repr(step.mask) == "KeyPadding([5, 7], side='left')"
    # a sliding window of 3 over a DynamicSlidingWindowLayer's 2 + 1 keys
    win = mask_function(
        batch_size=1, q_length=1, kv_length=3, q_offset=9, kv_offset=7,
        mask_function=mu.sliding_window_causal_mask_function(3),
    )  # fmt: skip
    assert win.mask is None and win.kind == "full"
    prefill = mask_function(
        batch_size=1, q_length=9, kv_length=9,
        mask_function=mu.sliding_window_causal_mask_function(3),
    )  # fmt: skip
    assert repr(prefill.mask) == "SlidingWindow(left=2, right=0, align='bottom_right')"
    # a static cache of 16 slots holding 9 tokens: the unwritten keys are left out
    static = mask_function(batch_size=1, q_length=4, kv_length=16, q_offset=5)
    assert static.keys == 9 and repr(static.mask) == "Causal(align='bottom_right')"


# ----------------------------------------------------------------------------------------
# the attention function on its own
# ----------------------------------------------------------------------------------------
class _Module(torch.nn.Module):
    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(gen: torch.Generator, b: int = 2, hq: int = 4, hkv: int = 2, lq: int = 9, lk: int = 9):
    return (
        torch.randn(b, hq, lq, 8, generator=gen, dtype=F64),
        torch.randn(b, hkv, lk, 8, generator=gen, dtype=F64),
        torch.randn(b, hkv, lk, 8, generator=gen, dtype=F64),
    )


def _sdpa(q, k, v, mask=None, causal=False, scale=None):
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return o.transpose(1, 2)


def test_attention_with_each_kind_of_mask(gen, assert_close, masks_seen):
    q, k, v = _qkv(gen)
    m = _Module()
    o, w = attention_forward(m, q, k, v, None, scaling=0.3)
    assert w is None and o.shape == (2, 9, 4, 8)
    assert_close(o, _sdpa(q, k, v, causal=True, scale=0.3), rtol=1e-12, name="no mask: causal")
    o, _ = attention_forward(_Module(is_causal=False), q, k, v, None)
    assert_close(o, _sdpa(q, k, v), rtol=1e-12, name="no mask, not causal")
    # one query row against 9 cached keys: bottom-right, so every key
    o, _ = attention_forward(m, q[:, :, -1:], k, v, None)
    assert_close(o, _sdpa(q[:, :, -1:], k, v), rtol=1e-12, name="decode row")
    # a bool mask with a hole in a row: the dense fallback
    vis = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    vis[1, :, 5:, 2] = False
    o, _ = attention_forward(m, q, k, v, vis)
    assert_close(o, _sdpa(q, k, v, vis), rtol=1e-12, name="bool mask with a hole")
    assert isinstance(masks_seen[-1][1], fl.DenseMask)
    # an additive mask of 0 / most-negative is read as a bool mask; real biases stay biases
    add = torch.zeros(2, 1, 9, 9, dtype=F64).masked_fill(~vis, torch.finfo(F64).min)
    o, _ = attention_forward(m, q, k, v, add)
    assert_close(o, _sdpa(q, k, v, vis), rtol=1e-12, name="additive 0/min mask")
    assert isinstance(masks_seen[-1][1], fl.DenseMask)
    bias = torch.randn(2, 1, 9, 9, generator=gen, dtype=F64)
    o, _ = attention_forward(m, q, k, v, bias)
    assert_close(o, _sdpa(q, k, v, bias), rtol=1e-12, name="additive bias")
    assert masks_seen[-1][1] is None
    tri = torch.ones(9, 9, dtype=torch.bool).tril()
    for shaped in (tri, tri[None], tri.expand(2, 1, 9, 9)):  # (Lq, Lk), (B, Lq, Lk), 4-D
        o, _ = attention_forward(m, q, k, v, shaped)
        assert repr(masks_seen[-1][1]) == "Causal(align='bottom_right')"
        assert_close(o, _sdpa(q, k, v, causal=True), rtol=1e-12, name="bool causal tensor")


def test_attention_softcap_sinks_and_position_bias(gen, assert_close):
    q, k, v = _qkv(gen)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    sinks = torch.randn(4, generator=gen, dtype=F64, requires_grad=True)
    pb = torch.randn(1, 4, 9, 9, generator=gen, dtype=F64, requires_grad=True)
    o, _ = attention_forward(_Module(), q, k, v, None, softcap=2.0, s_aux=sinks, position_bias=pb)
    # the definition: softcapped, biased, causal scores; the sink joins each row's softmax
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = 2.0 * torch.tanh((q @ kk.transpose(2, 3)) / 8**0.5 / 2.0) + pb  # (B, H, Lq, Lk)
    s = s.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), -torch.inf)
    full = torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 9, 1)], dim=-1)
    want = (torch.softmax(full, dim=-1)[..., :-1] @ vv).transpose(1, 2)
    assert_close(o, want, rtol=1e-12, name="softcap + sinks + position bias")
    g = torch.randn(o.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad((o * g).sum(), (q, k, v, sinks, pb))
    wants = torch.autograd.grad((want * g).sum(), (q, k, v, sinks, pb))
    for name, a, b in zip(("dQ", "dK", "dV", "d sinks", "d bias"), grads, wants):
        assert_close(a, b, rtol=1e-12, name=name)


def test_attention_refuses_what_it_cannot_read(gen):
    q, k, v = _qkv(gen)
    with pytest.raises(TypeError, match="attention_mask must be None, a bool or float tensor"):
        attention_forward(_Module(), q, k, v, [[1]])
    with pytest.raises(TypeError, match=r"bool or floating point, got torch\.int64"):
        attention_forward(_Module(), q, k, v, torch.ones(2, 1, 9, 9, dtype=torch.long))
    plan = mask_function(batch_size=2, q_length=5, kv_length=5)
    with pytest.raises(
        ValueError, match="made for batch 2, Lq=5, Lk=5; the call has batch 2, Lq=9"
    ):
        attention_forward(_Module(), q, k, v, plan)
    with pytest.raises(ValueError, match=r"must be \(B, H, L, d\)"):
        attention_forward(_Module(), q[0], k[0], v[0], None)
    with pytest.raises(ValueError, match=r"must be \(B, 1, Lq, Lk\), \(B, Lq, Lk\) or \(Lq, Lk\)"):
        attention_forward(_Module(), q, k, v, torch.ones(9, dtype=torch.bool))


def test_row_intervals_bind_only_to_their_lengths():
    ri = RowIntervals(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 1, 2]]), lk=3)
    assert ri.dense(3, 3).tolist() == fl.Causal("top_left").dense(3, 3).tolist()
    with pytest.raises(ValueError, match="made for Lq=3, Lk=3; the call has Lq=4, Lk=3"):
        ri.dense(4, 3)


# ----------------------------------------------------------------------------------------
# whole models
# ----------------------------------------------------------------------------------------
CASES = [(a, "right" if a == "bert" else "left") for a in REFERENCE]
CASES += [("llama", "right"), ("gemma2", "right")]


@pytest.mark.parametrize(("arch", "side"), CASES, ids=[f"{a}-{s}" for a, s in CASES])
def test_logits_and_gradients_equal_the_reference(arch, side, gen, assert_close, masks_seen):
    ours, ref = _pair(arch)
    ids, att = _batch(arch, gen, side=side)
    real = att.bool()
    w = torch.randn(2, ids.shape[1], 128, generator=gen, dtype=F64)  # a fixed linear loss
    out = {}
    for name, model in (("flashledger", ours), ("reference", ref)):
        logits = model(input_ids=ids, attention_mask=att).logits  # (B, L, V)
        (logits * w)[real].sum().backward()
        out[name] = logits.detach()
    assert not bool(torch.isnan(out["flashledger"]).any())
    assert_close(
        out["flashledger"][real], out["reference"][real], rtol=1e-10, name=f"{arch} logits"
    )
    params = dict(ref.named_parameters())
    checked = 0
    for pname, p in ours.named_parameters():
        if any(part in pname for part in ("q_proj", "v_proj", "query", "value", "sinks")):
            assert p.grad is not None, pname
            assert_close(p.grad, params[pname].grad, rtol=1e-10, name=f"{arch} d {pname}")
            checked += 1
    assert checked >= 4
    # the masks arrived structured: no dense fallback, the padding as KeyPadding
    kinds = {type(m).__name__ if m is not None else "None" for _, m in masks_seen}
    assert "DenseMask" not in kinds and "RowIntervals" not in kinds, kinds
    text = " ".join(repr(m) for _, m in masks_seen)
    if side == "left":
        assert "KeyPadding([14, 19], side='left')" in text, text
    else:  # right padding: keys no query row sees are cut off (causal: the last 5 of row 0)
        assert "KeyPadding([14" in text and "side='left'" not in text, text
    # GQA: K/V keep their own heads, never repeated to the query heads
    assert {keys[1] for keys, _ in masks_seen} == {4 if arch == "bert" else 2}
    if arch in ("mistral", "qwen2", "gemma2", "gpt_oss"):
        assert "SlidingWindow(left=5, right=0, align='bottom_right')" in text, text
    if arch != "bert":
        assert "Causal(align='bottom_right')" in text or arch == "mistral", text


def test_the_native_step_runs_the_model(gen, native_calls, masks_seen):
    ours, _ = _pair("qwen2")
    ids, att = _batch("qwen2", gen)
    ours(input_ids=ids, attention_mask=att).logits.sum().backward()
    assert native_calls == {"forward": 2, "backward": 2}
    assert len(masks_seen) == 2


def test_output_attentions_returns_none_and_says_so(gen):
    """The weights are never formed: ``output_attentions=True`` gives no weights (an empty
    tuple, as SDPA's call does) with a warning that says why; the logits are unchanged."""
    ours, _ = _pair("qwen2")
    ids, att = _batch("qwen2", gen)
    plain = ours(input_ids=ids, attention_mask=att).logits
    with pytest.warns(UserWarning, match="never forms the attention weights"):
        out = ours(input_ids=ids, attention_mask=att, output_attentions=True)
    assert not out.attentions
    assert torch.equal(out.logits, plain)


def test_torch_func_gradients_of_a_model_and_per_sample_ones(gen, assert_close):
    # functional_call + torch.func.grad (meta-learning, per-sample gradients) through the
    # registered attention: the same gradients as backward(), and vmap(grad) gives each
    # sequence's own (padding included: the mask is an option, mapped with the ids)
    ours, _ = _pair("llama")
    ids, att = _batch("llama", gen, side="left")
    params = {n: p.detach() for n, p in ours.named_parameters()}

    def loss(p: dict[str, torch.Tensor], ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(ours, p, (), {"input_ids": ids, "attention_mask": att})
        return logits.logits.square().mean()

    got = torch.func.grad(loss)(params, ids, att)
    ours.zero_grad()
    loss(dict(ours.named_parameters()), ids, att).backward()
    for n, p in ours.named_parameters():
        assert_close(got[n], p.grad, rtol=1e-12, name=f"torch.func d {n}")
    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
        params, ids[:, None], att[:, None]
    )
    for i in range(ids.shape[0]):
        own = torch.func.grad(loss)(params, ids[i : i + 1], att[i : i + 1])
        for n in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
        ):
            assert_close(per[n][i], own[n], rtol=1e-12, name=f"sample {i}: d {n}")


def test_a_compiled_model_runs_the_attention_as_eager(gen):
    # torch.compile of the whole model (dynamo; the eager backend keeps the test short):
    # the attention is opaque to it, the mask function runs where dynamo breaks the graph,
    # and logits and gradients are those of the model run eagerly, bit for bit
    ours, _ = _pair("llama")
    ids, att = _batch("llama", gen, side="left")
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager")
    grads = []
    logits = []
    for model in (compiled, ours):
        ours.zero_grad()
        out = model(input_ids=ids, attention_mask=att).logits
        out.square().mean().backward()
        logits.append(out.detach())
        grads.append(ours.model.layers[1].self_attn.q_proj.weight.grad.clone())
    real = att.bool()
    assert torch.equal(logits[0][real], logits[1][real])
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("arch", DECODERS)
def test_greedy_generation_equals_the_reference(arch, gen, masks_seen):
    ours, ref = _pair(arch)
    ids, att = _batch(arch, gen, length=9)
    kw: dict[str, Any] = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(input_ids=ids, attention_mask=att, **kw)
        want = ref.generate(input_ids=ids, attention_mask=att, **kw)
    assert got.tolist() == want.tolist()
    # decoding: one query row per step against the cache (bottom-right: no causal mask)
    last_keys, last_mask = masks_seen[-1]
    assert last_keys[2] in (6, 14) and not isinstance(last_mask, fl.Causal)


def test_generation_with_a_static_cache(gen, masks_seen):
    ours, ref = _pair("llama")
    ids, att = _batch("llama", gen, length=9)
    kw: dict[str, Any] = dict(max_new_tokens=4, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        got = ours.generate(input_ids=ids, attention_mask=att, **kw)
        want = ref.generate(input_ids=ids, attention_mask=att, **kw)
    assert got.tolist() == want.tolist()
    assert [keys[2] for keys, _ in masks_seen[::2]] == [9, 10, 11, 12]  # unwritten slots cut


def test_packed_sequences_run_as_row_intervals(gen, assert_close, masks_seen):
    ours, ref = _pair("llama")
    ids = torch.randint(1, 128, (1, 20), generator=gen)
    pos = torch.tensor([[*range(7), *range(13)]])
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert_close(got, want, rtol=1e-10, name="packed logits")
    assert isinstance(masks_seen[0][1], RowIntervals)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_training_with_dropout_learns(arch, gen):
    model = random_model(arch, layers=2, hidden=64, heads=4, dropout=0.2, seed=1,
                         attn_implementation=NAME)  # fmt: skip
    model.train()
    ids = torch.randint(1, 128, (4, 24), generator=gen)
    torch.manual_seed(0)
    with fl.ledger_of(model) as book:
        a = model(input_ids=ids).logits
        b = model(input_ids=ids).logits
    assert not torch.equal(a, b), "dropout draws a new mask each call"
    dropped = sum(c.counters.dropped for c in book.calls)
    visible = sum(c.counters.qk_dots_visible for c in book.calls)
    assert 0.1 < dropped / visible < 0.3, (dropped, visible)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05, losses


# ----------------------------------------------------------------------------------------
# the model's ledger
# ----------------------------------------------------------------------------------------
def test_ledger_of_books_every_call_per_layer(gen):
    model = random_model("mistral", layers=3, hidden=64, heads=4, kv_heads=2, sliding_window=8,
                         attn_implementation=register("fl_tiles", block_q=8, block_k=8))  # fmt: skip
    other = random_model("llama", attn_implementation=NAME)
    ids = torch.randint(1, 128, (2, 32), generator=gen)
    with fl.ledger_of(model) as book:
        model(input_ids=ids).logits.sum().backward()
        other(input_ids=ids)  # another model's calls are not booked
    assert [(c.layer, c.pass_name) for c in book.calls] == [
        (0, "forward"), (1, "forward"), (2, "forward"),
        (2, "backward"), (1, "backward"), (0, "backward"),
    ]  # fmt: skip
    call = book.calls[0]
    assert (call.batch, call.heads, call.kv_heads, call.lq, call.lk, call.d) == (
        2,
        4,
        2,
        32,
        32,
        16,
    )
    assert call.mask == "window"
    c = call.counters
    # window of 8 keys (the query's own and 7 before): sum over rows of min(i + 1, 8)
    assert c.qk_dots_visible == 2 * 4 * sum(min(i + 1, 8) for i in range(32))
    assert (c.tiles_run, c.tiles_skipped, c.tiles_full, c.tiles_partial) == (7, 9, 0, 7)
    assert c.qk_dots_computed == 2 * 4 * 7 * 64
    assert call.flops == 2 * (16 + 16) * c.qk_dots_computed
    assert call.p_elements == 2 * 4 * 32 * 32 and call.lse_elements == 2 * 4 * 32
    back = book.calls[-1]
    assert back.flops == 2 * (3 * 16 + 2 * 16) * back.counters.qk_dots_computed
    rows = book.rows()
    assert [(r["layer"], r["pass"]) for r in rows][:2] == [(0, "forward"), (0, "backward")]
    totals = book.totals()
    assert totals["forward"]["qk_dots_visible"] == 3 * c.qk_dots_visible
    text = str(book)
    assert text.startswith("Attention ledger of MistralForCausalLM: 3 attention calls")
    lines = [line.split() for line in text.splitlines()]
    first = ["0", "forward", "1", "window", "32", "x", "32", "7", "9"]
    assert first in [cells[:9] for cells in lines], text
    assert [line[:3] for line in lines[-2:]] == [["all", "forward", "3"], ["all", "backward", "3"]]
    d = book.to_dict()
    assert len(d["calls"]) == 6 and d["totals"]["backward"]["calls"] == 3
    assert "<table>" in book._repr_html_()


def test_ledger_books_a_backward_after_the_block_and_refuses_other_backends(gen):
    model = random_model("llama", attn_implementation=NAME)
    ids = torch.randint(1, 128, (1, 10), generator=gen)
    with fl.ledger_of(model) as book:
        loss = model(input_ids=ids).logits.sum()
    assert [c.pass_name for c in book.calls] == ["forward", "forward"]
    loss.backward()
    assert [c.pass_name for c in book.calls] == ["forward"] * 2 + ["backward"] * 2
    with pytest.raises(ValueError, match="the model's attention is 'sdpa', not flashledger's"):
        fl.ledger_of(random_model("llama"))
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module"):
        fl.ledger_of("model")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------
# the command line and the optional dependency
# ----------------------------------------------------------------------------------------
def test_model_command(capsys):
    from flashledger import cli

    argv = ["model", "--arch", "gemma2", "--layers", "2", "--seq", "48", "--hidden", "32",
            "--heads", "2", "--kv-heads", "1", "--pad", "5", "--batch", "2", "--backward"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Attention ledger: gemma2, 2 layers, hidden 32, heads 2/1, batch 2, seq 48" in out
    assert "window+pad" in out and "causal+pad" in out
    assert "P kept for the backward would take" in out
    assert cli.main([*argv[:-1], "--json", "--generate", "3"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert {r["pass"] for r in data["rows"]} == {"forward"}
    assert data["totals"]["forward"]["calls"] == 2 * 4  # the forward, prefill and 2 steps


@pytest.mark.parametrize(("dtype", "p_bytes"), [("bfloat16", 2), ("float32", 4), ("float64", 8)])
def test_model_command_books_the_lse_in_float32_at_least(capsys, dtype, p_bytes):
    """P in the inputs' dtype, the LSE in float32 at least (the loop keeps it so; a
    bfloat16 run booked it at 2 bytes, half what ``account`` books)."""
    from flashledger import cli

    argv = ["model", "--arch", "llama", "--layers", "1", "--seq", "64", "--hidden", "64",
            "--heads", "4", "--dtype", dtype]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = 1 * 4 * 64  # batch x heads x seq: one LSE entry a row
    p_kib, lse = rows * 64 * p_bytes // 1024, rows * max(4, p_bytes)
    lse_text = f"{lse} B" if lse < 1024 else f"{lse / 1024:.3g} KiB"
    assert f"would take {p_kib} KiB; the LSE takes {lse_text}" in out, out[-300:]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arch", "gpt2"], "--arch must be one of llama, mistral"),
        (["--seq", "0"], "argument --seq: expected an integer >= 1, got 0"),
        (["--pad", "8", "--seq", "8"], "--pad must be smaller than --seq (8), got 8"),
        (["--heads", "4", "--kv-heads", "3"], "kv_heads (3) must divide heads (4)"),
        (["--arch", "bert", "--generate", "2"], "--generate needs a decoder"),
        (["--dtype", "int8"], "--dtype must be one of float32, float64, bfloat16"),
        (["--arch", "llama", "--window", "4"], "llama has no sliding window"),
        (["--arch", "mistral", "--window", "1", "--generate", "2"], "use --window 2 or more"),
        (["--heads", "32"], "the head dim hidden // heads is 1: llama rotates it in pairs"),
        (["--layers", "1000000"], "the weights alone would take about"),
        (["--generate", "100000000"], "FLOPs, over the 2e+13 this command takes on"),
        (["--seq", "2000000"], "lower --seq, --layers, --hidden, --batch or --generate"),
    ],
)
def test_model_command_errors(args, message, capsys):
    from flashledger import cli

    assert cli.main(["model", "--hidden", "32", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_model_command_s_estimate_counts_the_work_it_asks_for():
    """Weights and FLOPs grow as the options say: layers and width, the backward three
    times the forward, each generated token a step against a longer cache."""
    import argparse

    from flashledger import model as fm

    base = dict(arch="llama", layers=2, hidden=64, heads=4, seq=32, batch=1, generate=0)
    base |= dict(backward=False, dtype="float32")

    def est(**kw: Any) -> tuple[float, float]:
        return fm._estimate(argparse.Namespace(**(base | kw)), 2)

    w, f = est()
    assert est(layers=4) == (2 * w, 2 * f)
    assert est(dtype="float64")[0] == 2 * w
    assert est(backward=True)[1] == 3 * f
    assert est(generate=8)[1] > f and est(generate=16)[1] > 2 * (est(generate=8)[1] - f) + f
    assert est(arch="gpt_oss")[0] > 2 * w  # four experts
    assert fm._estimate(argparse.Namespace(**base), 4)[0] > w  # more K/V heads


def test_a_window_of_one_is_refused_when_decoding_and_says_why(capsys):
    """At sliding_window=1 transformers' cache keeps every key while its mask covers the
    newest only (its keys[-window + 1:] is keys[0:]); eager and SDPA broadcast that mask over
    every key. The op refuses the mismatch naming the window; the command's default window
    is at least 2, so a short --seq decodes."""
    from flashledger import cli

    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    model = random_model("mistral", layers=1, sliding_window=1, attn_implementation=register())
    with pytest.raises(ValueError, match=r"sliding_window=1 .* use a sliding window of 2"):
        model.generate(ids, max_new_tokens=2, do_sample=False)
    argv = ["model", "--arch", "mistral", "--seq", "7", "--layers", "1", "--hidden", "32"]
    assert cli.main([*argv, "--generate", "2"]) == 0, capsys.readouterr().err


def test_without_transformers_the_library_works_and_the_integration_says_how(tmp_path):
    script = (
        "import sys; sys.modules['transformers'] = None\n"
        "import flashledger as fl, flashledger.model\n"
        "assert fl.ledger_of and fl.flash_attention\n"
        "try:\n"
        "    import flashledger.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "from flashledger import cli\n"
        "sys.exit(cli.main(['model']))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 2, res.stderr
    assert res.stdout.strip() == (
        "flashledger.integrations.transformers needs transformers: "
        "pip install flashledger[transformers]"
    )
    assert "pip install flashledger[transformers]" in res.stderr
    assert res.stderr.count("\n") == 1, res.stderr


def test_the_training_example_runs(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_lm.py"
    spec = importlib.util.spec_from_file_location("train_tiny_lm", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "loss.png"
    argv = ["--steps", "3", "--batch", "2", "--seq", "16", "--hidden", "32", "--out", str(out)]
    assert example.main(argv) == 0
    text = capsys.readouterr().out
    assert "step    2  loss  flashledger" in text and "largest loss difference over 3 steps" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        example.main(["--dropout", "1.5"])


# ----------------------------------------------------------------------------------------
# models that pass a position bias, autocast, and models that compute on their mask
# ----------------------------------------------------------------------------------------
T5 = dict(
    vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
    pad_token_id=0, decoder_start_token_id=0, eos_token_id=1,
)  # fmt: skip


def _t5(impl: str) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(**T5, attn_implementation=impl)).eval()


def test_a_position_bias_loses_the_key_tail_no_row_sees_with_the_keys() -> None:
    """T5 adds a position bias (B, H, Lq, Lk). A padded tail shared by every row is left
    out of the call with its keys, and now with its bias columns too (the bias stayed Lk
    wide and the call refused it); the logits and a static cache's tokens equal SDPA's."""
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    att = torch.ones(2, 10, dtype=torch.long)
    att[:, 7:] = 0  # the same padded tail in every row
    dec = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    want, got = (
        _t5(impl)(input_ids=ids, attention_mask=att, decoder_input_ids=dec).logits
        for impl in ("sdpa", NAME)
    )
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), float((got - want).abs().max())
    tokens = [
        _t5(impl).generate(
            input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
            cache_implementation="static",
        ).tolist()
        for impl in ("sdpa", NAME)
    ]  # fmt: skip
    assert tokens[0] == tokens[1], tokens


def test_autocast_casts_the_inputs_as_it_casts_sdpa_s() -> None:
    """Under torch.autocast RoPE leaves q and k in float32 while v comes from a bfloat16
    projection; the call takes them in the autocast dtype, as autocast casts SDPA's inputs
    (it refused the mixed dtypes), and a training step matches SDPA's under autocast."""
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for impl in ("sdpa", NAME):
        model = random_model("llama", attn_implementation=impl)  # float32 weights
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad)
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[0]), losses
    rel = float((grads[0] - grads[1]).norm() / grads[0].norm())
    assert rel < 0.05, rel  # bfloat16's rounding, each path its own


@pytest.mark.parametrize("arch", ["falcon_alibi", "bloom"])
def test_a_model_that_computes_on_its_mask_is_refused_clearly(arch: str) -> None:
    """Falcon with ALiBi and Bloom add their ALiBi to the attention mask in their own
    code: the planned mask says so and names the implementations that run them, where an
    AttributeError on 'PlannedMask' or an unsupported '+' was all a person saw."""
    import transformers as tf

    ids = torch.randint(1, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    if arch == "bloom":
        cfg = tf.BloomConfig(vocab_size=97, hidden_size=64, n_layer=1, n_head=4)
        cls = tf.BloomForCausalLM
    else:
        cfg = tf.FalconConfig(
            vocab_size=97, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, alibi=True
        )
        cls = tf.FalconForCausalLM
    cfg._attn_implementation = NAME
    model = cls(cfg).eval()
    with pytest.raises((TypeError, AttributeError), match="computes on the mask itself") as exc:
        model(input_ids=ids)
    assert "'sdpa' or 'eager'" in str(exc.value)
    planned = mask_function(2, 8, 8)
    assert planned.shape == (2, 1, 8, 8) and not hasattr(planned, "dtype")
    import copy

    assert copy.copy(planned).lq == 8  # protocols still work


def test_a_float64_model_under_autocast_keeps_its_attention_in_float64() -> None:
    """autocast leaves float64 tensors as they are (SDPA under a bfloat16 autocast returns
    float64 for float64 inputs); the call cast them to bfloat16 and the model's next
    float64 projection refused the bfloat16 output."""
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :4] = 0
    out = []
    for impl in ("sdpa", NAME):
        model = random_model("llama", dtype=F64, attn_implementation=impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out.append(model(input_ids=ids, attention_mask=att).logits.detach())
    real = att.bool()
    assert out[1].dtype == F64
    err = float((out[1] - out[0])[real].abs().max() / out[0][real].abs().max())
    assert err < 1e3 * torch.finfo(F64).eps, err  # float64 rounding, not bfloat16's (2**-8)


def test_per_row_sinks_join_each_row_s_softmax(gen, assert_close):
    """Inkling 2 passes one sink logit per query row and head as ``sinks`` (B, H, Lq, 1);
    the call dropped it with the other options it does not name, and the model's
    attention silently lost the probability mass its sinks take. Now it is applied as
    s_aux is, row by row, with its gradient, under a padded (planned) mask."""
    q, k, v = _qkv(gen)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    sinks = torch.randn(2, 4, 9, 1, generator=gen, dtype=F64, requires_grad=True)
    att = torch.ones(2, 9, dtype=torch.long)
    att[0, :3] = 0  # left padding
    plan = mask_function(2, 9, 9, attention_mask=att.bool())
    o, _ = attention_forward(_Module(), q, k, v, plan, sinks=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    vis = torch.ones(9, 9, dtype=torch.bool).tril() & att.bool()[:, None, None, :]
    s = ((q @ kk.transpose(2, 3)) / 8**0.5).masked_fill(~vis, -torch.inf)
    p = torch.softmax(torch.cat([s, sinks], dim=-1), dim=-1)[..., :-1]  # (B, H, Lq, Lk)
    want = (p @ vv).transpose(1, 2)
    real = att.bool()  # padded query rows see no key: both give 0 there
    assert_close(o[real], want[real], rtol=1e-12, name="per-row sinks")
    g = torch.randn(o.shape, generator=gen, dtype=F64) * real[:, :, None, None]
    grads = torch.autograd.grad((o * g).sum(), (q, k, v, sinks))
    wants = torch.autograd.grad((want.nan_to_num() * g).sum(), (q, k, v, sinks))
    for name, a, b in zip(("dQ", "dK", "dV", "d sinks"), grads, wants):
        assert_close(a, b, rtol=1e-12, name=name)
    with pytest.raises(ValueError, match=r"sinks must be \(B, Hq, Lq, 1\)"):
        attention_forward(_Module(), q, k, v, None, sinks=torch.zeros(2, 4, 5, 1, dtype=F64))


@pytest.mark.parametrize("option", ["indices", "block_indices"])
def test_key_selections_for_other_kernels_are_refused(gen, option):
    """DeepSeek V3.2's sparse attention (and GLM-DSA, Mistral Large 4, ...) passes its
    top-k keys as ``indices`` and MiniMax M3 its key blocks as ``block_indices``, for a
    kernel that reads them, when the implementation is neither eager nor SDPA; the call
    attended to every key instead, silently."""
    q, k, v = _qkv(gen)
    sel = torch.zeros(2, 9, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=f"'{option}'.*'eager' or 'sdpa'"):
        attention_forward(_Module(), q, k, v, None, **{option: sel})
    o, _ = attention_forward(_Module(), q, k, v, None, **{option: None})  # absent: runs
    assert o.shape == (2, 9, 4, 8)


def test_a_model_with_per_token_sinks_equals_eager() -> None:
    """Inkling 2 (per-token sinks from a projection of the hidden states) against its
    eager attention, in float32 (its router runs in float32)."""
    import transformers as tf

    if not hasattr(tf, "Inkling2TextConfig"):
        pytest.skip("this transformers has no Inkling 2")
    kw = dict(
        vocab_size=97, unpadded_vocab_size=97, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4, d_rel=4, rel_extent=8,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_layers_per_attn_res_block=1, pad_token_id=0, eos_token_id=1,
        layer_types=["hybrid_sliding", "hybrid"],
    )  # fmt: skip
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :3] = 0
    out = []
    for impl in ("eager", NAME):
        cfg = tf.Inkling2TextConfig(**kw)
        cfg._attn_implementation = impl
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tf.Inkling2ForCausalLM(cfg).eval()
        for mod in model.modules():  # sinks that matter (a checkpoint's are not zero)
            if hasattr(mod, "sink_proj"):
                for p in mod.sink_proj.parameters():
                    torch.nn.init.normal_(p, std=1.0, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out.append(model(input_ids=ids, attention_mask=att).logits[att.bool()])
    err = float((out[1] - out[0]).abs().max() / out[0].abs().max())
    assert err < 1e3 * torch.finfo(torch.float32).eps, err  # without the sinks: ~0.6


def test_a_planned_mask_gives_its_query_rows_as_a_4d_mask_does() -> None:
    """Gemma 4 slices every layer's mask to the rows it keeps (``mask[:, :, -k:, :]``)
    before its KV-shared layers; a planned mask was not subscriptable, and generate()
    failed with "'PlannedMask' object is not subscriptable". Its rows are planned again;
    any other index (DeepSeek V3.2's ``mask[:, 0]``) is refused with the clear message."""
    left = torch.ones(3, 12, dtype=torch.bool)
    left[0, :4] = False
    hole = left.clone()
    hole[2, 5] = False  # a hole: the dense plan
    window = mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(4))
    plans = [
        mask_function(3, 12, 12, attention_mask=left),  # causal, left padding
        mask_function(3, 12, 12, attention_mask=hole),  # dense
        mask_function(3, 12, 12, mask_function=window, attention_mask=left),
        mask_function(3, 5, 16, q_offset=7, attention_mask=torch.ones(3, 12, dtype=torch.bool)),
    ]  # fmt: skip
    for plan in plans:
        for rows in (slice(-1, None), slice(-3, None), slice(2, 7), slice(None)):
            got = plan[:, :, rows, :]
            assert isinstance(got, type(plan)) and got.shape[2] == plan.dense()[0, 0, rows].shape[0]
            assert torch.equal(got.dense(), plan.dense()[:, :, rows, :]), (plan, rows)
    with pytest.raises(TypeError, match="computes on the mask itself") as exc:
        plans[0][:, 0, :, :]
    assert "'sdpa' or 'eager'" in str(exc.value)


def test_gemma4_with_kv_shared_layers_generates_as_sdpa() -> None:
    import transformers as tf

    if not hasattr(tf, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    kw = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        vocab_size_per_layer_input=97, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :3] = 0
    tokens = []
    for impl in ("sdpa", NAME):
        cfg = tf.Gemma4TextConfig(**kw)
        cfg._attn_implementation = impl
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = tf.Gemma4ForCausalLM(cfg).to(F64).eval()
        tokens.append(
            model.generate(
                input_ids=ids, attention_mask=att, max_new_tokens=6, min_new_tokens=6,
                do_sample=False,
            ).tolist()
        )  # fmt: skip
    assert tokens[0] == tokens[1], tokens


def test_a_book_that_booked_nothing_says_why_it_may_be_empty():
    """A model whose attention never reaches flashledger's (its modules compute attention
    themselves, or the block did not run it) leaves a warning saying so, not a silent
    "0 attention calls"; a book that booked calls says nothing."""
    model = random_model("llama", attn_implementation=NAME)
    warned = pytest.warns(UserWarning, match="no attention call of LlamaForCausalLM reached")
    with warned, fl.ledger_of(model):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fl.ledger_of(model) as book:
            model(input_ids=torch.randint(1, 128, (1, 6)))
    assert book.calls
