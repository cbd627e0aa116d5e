"""A score_mod that adds a term to the score (``score + table[h, q - kv]``, ALiBi, a
-inf mask) runs on the native step: the pass adds ``score_mod(0, ...)``, evaluated tile
by tile, to its scores, and hands dS back for the captured tensors' gradients. Against
the PyTorch step (the same callable on every tile) and the dense float64 oracle; the
detection of what adds a term (``_mods.adds_to_score``) and of what does not."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from naive import naive_attention_scores
from torch import Tensor

import flashledger as fl
from flashledger import _native, blocked
from flashledger._mods import UserScore

F64 = torch.float64
TABLE = torch.randn(4, 64, dtype=F64)


def _rel(table: Tensor, lk: int) -> Callable[..., Tensor]:
    def score(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + table[h, q - kv + lk]

    return score


ADDS: dict[str, tuple[Callable[..., Tensor], bool]] = {
    "score + table[h, q - kv]": (lambda s, b, h, q, k: s + TABLE[h, q - k + 31], True),
    "table[h, q - kv] + score": (lambda s, b, h, q, k: TABLE[h, q - k + 31] + s, True),
    "ALiBi, score - slope * |q - kv|": (
        lambda s, b, h, q, k: s - (h + 1) * 0.1 * (q - k).abs(),
        True,
    ),
    "a constant": (lambda s, b, h, q, k: s + 1.5, True),
    "a -inf mask": (lambda s, b, h, q, k: s + torch.where(q >= k, 0.0, -float("inf")), True),
    "a chain: score + x - y + z": (
        lambda s, b, h, q, k: s + TABLE[h, q - k + 31] - 0.5 * (q - k).abs() + h * 0.25,
        True,
    ),
    "softcap": (lambda s, b, h, q, k: 30 * torch.tanh(s / 30), False),
    "a term of score.detach()": (lambda s, b, h, q, k: s + s.detach().square(), False),
    "(score + x) * 1": (lambda s, b, h, q, k: (s + TABLE[h, q - k + 31]) * 1, False),
    "score times a term": (lambda s, b, h, q, k: s * TABLE[h, q - k + 31], False),
    "a term of the score": (lambda s, b, h, q, k: s + s.square() * 0.1, False),
    "torch.where on the score": (lambda s, b, h, q, k: torch.where(q >= k, s, -1e9), False),
    "the score itself": (lambda s, b, h, q, k: s, False),
    "2 * score + 1": (lambda s, b, h, q, k: 2 * s + 1, False),
    "1 - score": (lambda s, b, h, q, k: 1 - s, False),
    # a term made from the score's value outside its graph: a comparison, a cast, no_grad
    "-inf where score > 20": (
        lambda s, b, h, q, k: s + torch.where(s > 20, -float("inf"), 0.0),
        False,
    ),
    "a gate on the score's sign": (
        lambda s, b, h, q, k: s + ((s > 0) & (q - k >= 3)).to(s.dtype),
        False,
    ),
    "a table behind a gate on the score": (
        lambda s, b, h, q, k: s + (s > 0) * TABLE[h, (q - k) % 64],
        False,
    ),
    "a term of score.long()": (lambda s, b, h, q, k: s + (s.long() % 2), False),
    "a term of score.item()": (lambda s, b, h, q, k: s + float(s.sum().item() > 1e3), False),
    "a term under no_grad": (lambda s, b, h, q, k: s + _no_grad_square(s), False),
    # a value of the indices reaching Python: the first rows cannot judge the rest
    "a branch on q_idx": (
        lambda s, b, h, q, k: s + 1.0 if int(q.max()) < 16 else s * 2.0,
        False,
    ),
    # written for scalars (broadcast indices fail it: called under torch.vmap): a term
    "table[h][q - kv] under vmap": (lambda s, b, h, q, k: s + TABLE[h][q - k + 31], True),
    # the indices compared and cast stay in tensors: still a term
    "a -inf mask from int(q >= k)": (
        lambda s, b, h, q, k: s - 1e9 * (q < k).to(s.dtype) + torch.zeros_like(s),
        True,
    ),
}


def _no_grad_square(s: Tensor) -> Tensor:
    with torch.no_grad():
        return s.square()


@pytest.mark.parametrize("name", list(ADDS))
def test_what_adds_a_term_to_the_score_is_told_apart(name: str) -> None:
    fn, adds = ADDS[name]
    user = UserScore.bind(fn, batch=1, heads=4, dtype=F64, device=torch.device("cpu"))
    assert user.probe_additive(torch.arange(6), torch.arange(5)) is adds
    assert user.caller.calls == 0 and user.caller.positions == 0, "the probe is not booked"


def _run(
    score_mod: Any,
    captured: list[Tensor],
    dtype: torch.dtype,
    *,
    native: bool,
    shape: tuple[int, int, int, int, int] = (2, 4, 2, 97, 113),
    **kw: Any,
) -> tuple[Tensor, ...]:
    b, hq, hk, lq, lk = shape
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, lq, 16, generator=g, dtype=F64).to(dtype).requires_grad_(True)
    k = torch.randn(b, hk, lk, 16, generator=g, dtype=F64).to(dtype).requires_grad_(True)
    v = torch.randn(b, hk, lk, 16, generator=g, dtype=F64).to(dtype).requires_grad_(True)
    do = torch.randn(b, hq, lq, 16, generator=g, dtype=F64).to(dtype)
    for t in captured:
        t.grad = None
    with contextlib.nullcontext() if native else _native.disabled():
        o = fl.flash_attention(q, k, v, score_mod=score_mod, **kw)
        o.backward(do)
    return (o.detach(), q.grad, k.grad, v.grad, *(t.grad for t in captured))  # type: ignore[misc]


CASES: dict[str, dict[str, Any]] = {
    "no mask": {},
    "causal, small tiles": {"mask": fl.Causal(), "block_q": 16, "block_k": 32},
    "causal, ragged tiles": {"mask": fl.Causal(), "block_q": 7, "block_k": 5},
    "document MaskMod": {
        "mask": fl.MaskMod(lambda b, h, q, k: (q // 40 == k // 40) & (q >= k)),
        "block_q": 32,
        "block_k": 32,
    },
    "sliding window": {"mask": fl.SlidingWindow(20, 0), "block_q": 16, "block_k": 16},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_an_additive_score_mod_on_the_native_step_equals_the_pytorch_step(
    case: str, dtype: torch.dtype, scored_calls: dict[str, int], assert_close: Any
) -> None:
    table = torch.nn.Parameter(0.3 * torch.randn(4, 97 + 113 + 1, dtype=dtype))
    sm = _rel(table, 113)
    got = _run(sm, [table], dtype, native=True, **CASES[case])
    assert scored_calls == {"forward": 1, "backward": 1}
    want = _run(sm, [table], dtype, native=False, **CASES[case])
    # float64: rounding apart only; float32: the step's base-2 forward and the PyTorch
    # step's natural exponent differ by a few units in the last place of the scores
    rtol = 1e-12 if dtype == F64 else 2e-5
    for name, a, b in zip(("O", "dQ", "dK", "dV", "d table"), got, want, strict=True):
        assert_close(a, b, rtol=rtol, name=f"{name} ({case}, {dtype})")


def test_an_additive_score_mod_equals_the_dense_oracle(
    scored_calls: dict[str, int], assert_close: Any
) -> None:
    """ALiBi plus a learnable table plus a -inf mask that empties some rows, float64,
    against dense attention with the same final scores."""
    table = torch.nn.Parameter(0.3 * torch.randn(4, 97 + 113 + 1, dtype=F64))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)

    def sm(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        gone = (q % 13 == 5) | (kv > q + 20)  # rows 5, 18, ... see no key
        return (
            s
            + table[h, q - kv + 113]
            - slopes[h] * (q - kv).abs()
            + torch.where(gone, -float("inf"), 0.0)
        )

    got = _run(sm, [table], F64, native=True, shape=(2, 4, 4, 97, 113), block_q=32, block_k=16)
    assert scored_calls == {"forward": 1, "backward": 1}
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 97, 16, generator=g, dtype=F64).requires_grad_(True)
    k = torch.randn(2, 4, 113, 16, generator=g, dtype=F64).requires_grad_(True)
    v = torch.randn(2, 4, 113, 16, generator=g, dtype=F64).requires_grad_(True)
    do = torch.randn(2, 4, 97, 16, generator=g, dtype=F64)
    table.grad = None
    qi = torch.arange(97).view(1, 1, 97, 1)
    ki = torch.arange(113).view(1, 1, 1, 113)
    hh = torch.arange(4).view(1, 4, 1, 1)
    bias = sm(torch.zeros(2, 4, 97, 113, dtype=F64), None, hh, qi, ki)  # type: ignore[arg-type]
    o, _ = naive_attention_scores(q @ k.mT * 16**-0.5 + bias, v, None)
    o.backward(do)
    want = (o.detach(), q.grad, k.grad, v.grad, table.grad)
    empty = (torch.arange(97) % 13 == 5).view(1, 1, 97, 1)
    assert bool((got[0].masked_select(empty) == 0).all()), "a row that sees no key gives 0"
    for name, a, b in zip(("O", "dQ", "dK", "dV", "d table"), got, want, strict=True):
        assert_close(a, b, rtol=1e-11, name=name)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_alibi_and_a_bias_ride_on_the_native_step(
    dtype: torch.dtype, scored_calls: dict[str, int], assert_close: Any
) -> None:
    """ALiBi and a learnable bias (no score_mod) are a term the native step adds: against
    dense attention with the same scores, GQA 97 x 113, ragged causal tiles. The bias
    sends some scores 60-110 below their row's maximum, where the probabilities fall
    through float32's subnormal range (the step's exponential gives 0 below 2^-100)."""
    g = torch.Generator().manual_seed(5)
    b, hq, hk, lq, lk = 2, 4, 2, 97, 113
    q, k, v = (
        torch.randn(b, h, n, 16, generator=g, dtype=F64).to(dtype).requires_grad_(True)
        for h, n in ((hq, lq), (hk, lk), (hk, lk))
    )
    do = torch.randn(b, hq, lq, 16, generator=g, dtype=F64).to(dtype)
    far = -60 - 50 * torch.rand(1, hq, lq, lk, generator=g, dtype=F64)  # (1, Hq, Lq, Lk)
    keep = torch.rand(1, hq, lq, lk, generator=g) < 0.7
    bias = torch.where(keep, torch.randn(1, hq, lq, lk, generator=g, dtype=F64), far)
    bias = bias.to(dtype).requires_grad_(True)
    slopes = fl.alibi_slopes(hq, dtype=dtype)
    o = fl.flash_attention(
        q, k, v, mask=fl.Causal(), alibi_slopes=slopes, bias=bias, block_q=32, block_k=24
    )
    o.backward(do)
    assert scored_calls == {"forward": 1, "backward": 1}
    got = (o.detach(), q.grad, k.grad, v.grad, bias.grad)
    x = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v, bias)]
    qi, ki = torch.arange(lq).view(lq, 1), torch.arange(lk).view(1, lk)
    # ALiBi's distance runs from the bottom-right diagonal, i + Lk - Lq (the causal mask's
    # own alignment is top-left): a shift per row that the LSE sees and O does not
    alibi = -slopes.to(F64).view(1, hq, 1, 1) * (qi + lk - lq - ki).abs()  # (1, Hq, Lq, Lk)
    kk, vv = (t.repeat_interleave(hq // hk, dim=1) for t in x[1:3])
    s = x[0] @ kk.mT * 16**-0.5 + alibi + x[3]
    want_o, want_lse = naive_attention_scores(s, vv, (qi >= ki).view(1, 1, lq, lk))
    want_o.backward(do.to(F64))
    want = (want_o.detach(), *(t.grad for t in x))
    tol = 1e-11 if dtype == F64 else 2e-5
    for name, a, w in zip(("O", "dQ", "dK", "dV", "dbias"), got, want, strict=True):
        assert_close(a.to(F64), w, rtol=tol, name=f"{name} ({dtype})")
    fwd = fl.blocked_forward(
        *(t.detach() for t in (q, k, v)),
        mask=fl.Causal(),
        alibi_slopes=slopes,
        bias=bias.detach(),
        block_q=32,
        block_k=24,
    )
    assert_close(fwd.lse.to(F64), want_lse.detach(), rtol=tol, name=f"LSE ({dtype})")


@pytest.mark.parametrize("form", ["distance", "key index"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_alibi_alone_is_computed_in_the_native_pass(
    form: str,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    native_calls: dict[str, int],
    scored_calls: dict[str, int],
) -> None:
    """ALiBi with nothing else on the scores runs the native step's own passes, its term
    computed in them (no term laid out per tile): bit for bit the result of the laid-out
    term, in both of ALiBi's forms (-slope · |i - j|; flash-attn 2's causal slope · (j -
    first key)), GQA 97 x 113, ragged tiles."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(2, h, n, 16, generator=g, dtype=F64).to(dtype).requires_grad_(True)
        for h, n in ((4, 97), (2, 113), (2, 113))
    )
    do = torch.randn(2, 4, 97, 16, generator=g, dtype=F64).to(dtype)
    opts: dict[str, Any] = dict(alibi_slopes=torch.rand(2, 4, generator=g, dtype=F64))
    if form == "key index":
        opts.update(conventions=fl.FLASH_ATTN_2, mask=fl.Causal())
    else:
        opts.update(mask=fl.SlidingWindow(40, 30))

    def run() -> list[Tensor]:
        for t in (q, k, v):
            t.grad = None
        o = fl.flash_attention(q, k, v, block_q=32, block_k=24, **opts)
        o.backward(do)
        return [o.detach(), *(t.grad for t in (q, k, v))]  # type: ignore[misc]

    in_pass = run()
    assert native_calls["forward"] == native_calls["backward"] == 1
    assert scored_calls == {"forward": 0, "backward": 0}, "ALiBi alone laid out a term"
    monkeypatch.setattr(blocked, "_scores_in_pass", lambda pb: False)  # the laid-out term
    laid_out = run()
    assert scored_calls == {"forward": 1, "backward": 1}
    for name, a, b in zip(("O", "dQ", "dK", "dV"), in_pass, laid_out, strict=True):
        diff = (a - b).abs()
        worst = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        assert torch.equal(a, b), (
            f"{name} ({form}, {dtype}) differs at {worst}: {a[worst]} vs {b[worst]}"
        )


def test_slabs_of_a_few_tiles_give_the_same_result(
    monkeypatch: pytest.MonkeyPatch, scored_calls: dict[str, int]
) -> None:
    """The term and its dS held a tile row (or column) at a time: bit for bit the result
    of one slab (each tile computes the same products; dQ sums its slabs' parts)."""
    table = torch.nn.Parameter(0.3 * torch.randn(4, 97 + 113 + 1, dtype=F64))
    sm = _rel(table, 113)
    opts = dict(mask=fl.Causal(), block_q=16, block_k=16)
    whole = _run(sm, [table], F64, native=True, **opts)
    monkeypatch.setattr(blocked, "SLAB_BYTES", 1)  # one tile per slab
    kern = _native.kernels()
    assert kern is not None
    real = type(kern).transposed
    transposed: list[tuple[tuple[int, ...], int]] = []

    def counted(self: Any, x: Tensor, buf: Tensor, tile: int = 0) -> Tensor:
        transposed.append((tuple(x.shape), tile))
        return real(self, x, buf, tile)

    monkeypatch.setattr(type(kern), "transposed", counted)
    sliced = _run(sm, [table], F64, native=True, **opts)
    # Kᵀ laid out once for the forward's slabs, per key tile (16 keys); the backward's
    # items lay out each key tile's Kᵀ_j and Vᵀ_j themselves, whatever the slabs
    assert len(transposed) == 1 and {t for _, t in transposed} == {16}, transposed
    assert torch.equal(whole[0], sliced[0])
    for name, a, b in zip(("dQ", "dK", "dV", "d table"), whole[1:], sliced[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")


def test_other_score_mods_keep_the_pytorch_step(scored_calls: dict[str, int]) -> None:
    sm = ADDS["softcap"][0]
    _run(sm, [], F64, native=True, mask=fl.Causal())
    assert scored_calls == {"forward": 0, "backward": 0}


@pytest.mark.parametrize(
    "name",
    ["-inf where score > 20", "a gate on the score's sign", "a table behind a gate on the score"],
)
def test_a_term_gated_on_the_score_keeps_the_exact_result(
    name: str, scored_calls: dict[str, int], assert_close: Any
) -> None:
    """A term that depends on the score through a comparison looks like ``score + x`` to
    autograd; added as ``score_mod(0, ...)`` it would be wrong wherever the comparison
    fires. Such a score_mod keeps the PyTorch step, and O and every gradient equal the
    dense float64 oracle's (queries scaled so that scores pass 20)."""
    fn = ADDS[name][0]
    b, hq, lq, lk, d = 1, 4, 97, 113, 16
    g = torch.Generator().manual_seed(5)
    q = (8 * torch.randn(b, hq, lq, d, generator=g, dtype=F64)).requires_grad_(True)
    k = torch.randn(b, hq, lk, d, generator=g, dtype=F64).requires_grad_(True)
    v = torch.randn(b, hq, lk, d, generator=g, dtype=F64).requires_grad_(True)
    do = torch.randn(b, hq, lq, d, generator=g, dtype=F64)
    o = fl.flash_attention(q, k, v, score_mod=fn, block_q=32, block_k=32)
    got = (o, *torch.autograd.grad(o, (q, k, v), do))
    assert scored_calls == {"forward": 0, "backward": 0}, "added as a term"
    s = d**-0.5 * q @ k.transpose(-1, -2)  # (1, H, Lq, Lk)
    assert int((s > 20).sum()) > 0, "no score passes 20: the case tests nothing"
    ref, _ = naive_attention_scores(fn(s, *_grid(hq, lq, lk)), v, None)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), do))
    for a, w, what in zip(got, want, ("O", "dQ", "dK", "dV"), strict=True):
        assert_close(a, w, rtol=1e-11, name=f"{what} ({name})")


def test_a_zero_table_behind_a_gate_on_the_score_gets_its_gradient(
    scored_calls: dict[str, int], assert_close: Any
) -> None:
    """A learnable table at its usual zero start, behind ``score > 0``: at zero the term
    is the same for every score, so only what the score_mod does with the score's value
    tells it apart from a term; the table's gradient then equals the oracle's."""
    table = torch.zeros(4, 64, dtype=F64, requires_grad=True)

    def sm(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + (s > 0) * table[h, (q - kv) % 64]

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, n, 16, generator=g, dtype=F64) for n in (97, 113, 113))
    do = torch.randn(1, 4, 97, 16, generator=g, dtype=F64)
    o = fl.flash_attention(q, k, v, score_mod=sm, block_q=32, block_k=32)
    (got,) = torch.autograd.grad(o, table, do)
    assert scored_calls == {"forward": 0, "backward": 0}, "added as a term"
    ref, _ = naive_attention_scores(
        sm(16**-0.5 * q @ k.transpose(-1, -2), *_grid(4, 97, 113)), v, None
    )
    (want,) = torch.autograd.grad(ref, table, do)
    assert float(want.abs().max()) > 0.1, "the oracle's gradient is too small to test"
    assert_close(got, want, rtol=1e-11, name="d table")


def _grid(hq: int, lq: int, lk: int) -> tuple[Tensor, ...]:
    """Broadcast index tensors of a whole ``(1, hq, lq, lk)`` score matrix."""
    return (
        torch.zeros(1, 1, 1, 1, dtype=torch.long),
        torch.arange(hq).view(1, hq, 1, 1),
        torch.arange(lq).view(1, 1, lq, 1),
        torch.arange(lk).view(1, 1, 1, lk),
    )


def test_a_score_mod_that_adds_only_on_some_positions_is_refused(
    scored_calls: dict[str, int],
) -> None:
    """Not pointwise: it adds a term on its first calls (the probe's few) and scales the
    score on later ones, with nothing the probe can see; the native pass would miss the
    scaling, so it says so when the backward checks each tile's graph."""
    calls = [0]

    def sm(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        calls[0] += 1
        return s + 1.0 if calls[0] <= 8 else s * 2.0

    with pytest.raises(RuntimeError, match="pointwise"):
        _run(sm, [], F64, native=True, block_q=16, block_k=16)


def test_a_branch_on_the_indices_keeps_the_pytorch_step(scored_calls: dict[str, int]) -> None:
    """A value of ``q_idx`` read in Python (``int(q.max())``): the probe's first rows
    cannot judge the others, so the score_mod runs as the callable it is, tile by tile,
    on the PyTorch step, native or not."""

    def sm(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s + 1.0 if int(q.max()) < 16 else s * 2.0

    native = _run(sm, [], F64, native=True, block_q=16, block_k=16)
    assert scored_calls == {"forward": 0, "backward": 0}
    python = _run(sm, [], F64, native=False, block_q=16, block_k=16)
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)


def test_a_score_mod_that_saves_its_output_with_a_partial_tile() -> None:
    """``tanh`` saves its output for its backward; the PyTorch step masks a partial tile
    out of place, so the score_mod's graph stays intact."""
    sm = lambda s, b, h, q, k: torch.tanh(s)  # noqa: E731
    got = _run(sm, [], F64, native=True, mask=fl.Causal(), block_q=16, block_k=16)
    assert all(bool(torch.isfinite(x).all()) for x in got)


def test_rows_whose_terms_do_not_fit_keep_the_pytorch_step(
    monkeypatch: pytest.MonkeyPatch, scored_calls: dict[str, int], assert_close: Any
) -> None:
    """Memory: where one tile row of terms (with their dS) would take more than
    ``ROW_BYTES``, both passes run the PyTorch step, with the same result."""
    table = torch.nn.Parameter(0.3 * torch.randn(4, 97 + 113 + 1, dtype=F64))
    sm = _rel(table, 113)
    want = _run(sm, [table], F64, native=True, mask=fl.Causal(), block_q=16, block_k=32)
    assert scored_calls == {"forward": 1, "backward": 1}
    monkeypatch.setattr(blocked, "ROW_BYTES", 2 * 2 * 4 * 32 * 97 * 8 - 1)  # a row too many
    got = _run(sm, [table], F64, native=True, mask=fl.Causal(), block_q=16, block_k=32)
    assert scored_calls == {"forward": 1, "backward": 1}, "no second scored pass"
    for name, a, b in zip(("O", "dQ", "dK", "dV", "d table"), got, want, strict=True):
        assert_close(a, b, rtol=1e-12, name=name)


def test_a_score_mod_that_writes_into_the_score_keeps_the_pytorch_step(
    scored_calls: dict[str, int], assert_close: Any
) -> None:
    """``score.add_(x)`` cannot run on the probe's graph: it counts as not adding, and the
    PyTorch step runs it without gradients as it always has."""

    def in_place(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s.add_(-0.5 * (q - kv).abs())

    def out_of_place(s: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return s - 0.5 * (q - kv).abs()

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 97, 16, generator=g, dtype=F64) for _ in range(3))
    with torch.no_grad():
        got = fl.flash_attention(q, k, v, mask=fl.Causal(), score_mod=in_place)
        assert scored_calls["forward"] == 0
        want = fl.flash_attention(q, k, v, mask=fl.Causal(), score_mod=out_of_place)
    assert scored_calls["forward"] == 1
    assert_close(got, want, rtol=1e-12, name="O")


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_the_softcap_s_tanh_is_within_a_few_units_in_the_last_place(native, dtype) -> None:
    """The step's tanh (a Taylor series below 1/2, 1 - 2 / (e^2x + 1) above) against
    mpmath: within 2.5 units in the last place, densely around the switch at 1/2, over
    magnitudes 1e-30 to 1e3 and both signs; ±inf give ±1, NaN stays NaN, ±0 stay ±0."""
    mpmath = pytest.importorskip("mpmath")
    g = torch.Generator().manual_seed(11)
    near = torch.linspace(0.45, 0.6, 4001, dtype=F64)  # the switch between the two forms
    wide = torch.randn(4000, generator=g, dtype=F64) * 10.0 ** torch.randint(
        -30, 4, (4000,), generator=g
    )
    x = torch.cat([near, -near, wide]).to(dtype)
    got = native.tanh(x)
    mpmath.mp.dps = 40
    want = torch.tensor([float(mpmath.tanh(mpmath.mpf(float(v)))) for v in x.tolist()], dtype=F64)
    w = want.to(dtype).abs()
    ulp = (w.nextafter(torch.tensor(math.inf, dtype=dtype)) - w).to(F64)
    err = (got.to(F64) - want).abs() / ulp
    worst = int(err.argmax())
    assert float(err.max()) <= 2.5, (
        f"tanh({x[worst].item()!r}) = {got[worst].item()!r}, want {want[worst].item()!r}: "
        f"{err[worst].item():.2f} units in the last place"
    )
    special = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0], dtype=dtype)
    out = native.tanh(special)
    assert out[:2].tolist() == [1.0, -1.0] and math.isnan(out[2].item())
    assert out[3].item() == 0.0 and math.copysign(1.0, out[4].item()) == -1.0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_softcap_alone_runs_in_the_native_passes(
    case: str,
    dtype: torch.dtype,
    native_calls: dict[str, int],
    scored_calls: dict[str, int],
    assert_close: Any,
) -> None:
    """A softcap with nothing else on the scores caps them in the native passes (and its
    gradient's 1 - tanh² in the backward): equal to the PyTorch step (float64 to rounding,
    float32 to 2e-5) on every mask case, GQA 97 x 113, with large scores so that the cap
    bites, and to the dense float64 oracle (O, LSE, gradients) to 1e-11."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (
        (s * torch.randn(2, h, n, 16, generator=g, dtype=F64)).to(dtype).requires_grad_(True)
        for s, h, n in ((3.0, 4, 97), (3.0, 2, 113), (1.0, 2, 113))
    )
    do = torch.randn(2, 4, 97, 16, generator=g, dtype=F64).to(dtype)

    def run(native_step: bool) -> list[Tensor]:
        for t in (q, k, v):
            t.grad = None
        with contextlib.nullcontext() if native_step else _native.disabled():
            o = fl.flash_attention(q, k, v, softcap=5.0, **CASES[case])
            o.backward(do)
        return [o.detach(), *(t.grad for t in (q, k, v))]  # type: ignore[misc]

    got = run(True)
    assert native_calls["forward"] == native_calls["backward"] == 1
    assert scored_calls == {"forward": 0, "backward": 0}
    want = run(False)
    rtol = 1e-12 if dtype == F64 else 2e-5
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):
        assert_close(a, b, rtol=rtol, name=f"{name} ({case}, {dtype}) vs the PyTorch step")
    if dtype != F64 or case != "causal, ragged tiles":
        return
    x = [t.detach().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(2, dim=1) for t in x[1:])
    s = 5.0 * torch.tanh(x[0] @ kk.mT * 16**-0.5 / 5.0)
    qi, ki = torch.arange(97).view(97, 1), torch.arange(113).view(1, 113)
    want_o, want_lse = naive_attention_scores(s, vv, (qi >= ki).view(1, 1, 97, 113))
    want_o.backward(do)
    for name, a, b in zip(
        ("O", "dQ", "dK", "dV"), got, [want_o, *(t.grad for t in x)], strict=True
    ):
        assert_close(a, b.detach(), rtol=1e-11, name=f"{name} vs the dense oracle")
    fwd = fl.blocked_forward(
        *(t.detach() for t in (q, k, v)), softcap=5.0, mask=fl.Causal(), block_q=7, block_k=5
    )
    assert_close(fwd.lse, want_lse.detach(), rtol=1e-11, name="LSE vs the dense oracle")


@pytest.mark.parametrize("terms", ["ALiBi", "ALiBi, bias and a table"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_softcap_with_terms_after_it_runs_natively(
    terms: str,
    dtype: torch.dtype,
    native_calls: dict[str, int],
    scored_calls: dict[str, int],
    assert_close: Any,
) -> None:
    """A softcap, then ALiBi (computed in the pass) or ALiBi, a learnable bias and a
    score_mod's learnable table (laid out per tile), in the PyTorch step's order: the native
    passes cap the scores and add the terms, and hand the terms dS of the final scores
    (before the cap's derivative). Against the PyTorch step (float64 1e-12, float32 2e-5),
    every gradient; against the dense float64 oracle (O, LSE, gradients) to 1e-11."""
    g = torch.Generator().manual_seed(17)
    b, hq, hk, lq, lk = 2, 4, 2, 97, 113
    q, k, v = (
        (s * torch.randn(b, h, n, 16, generator=g, dtype=F64)).to(dtype).requires_grad_(True)
        for s, h, n in ((3.0, hq, lq), (3.0, hk, lk), (1.0, hk, lk))
    )
    do = torch.randn(b, hq, lq, 16, generator=g, dtype=F64).to(dtype)
    slopes = fl.alibi_slopes(hq, dtype=dtype)
    bias = (0.5 * torch.randn(1, hq, lq, lk, generator=g, dtype=F64)).to(dtype).requires_grad_()
    table = torch.nn.Parameter((0.3 * torch.randn(hq, lq + lk + 1, generator=g)).to(dtype))
    opts: dict[str, Any] = dict(softcap=4.0, alibi_slopes=slopes, mask=fl.Causal())
    learn = [q, k, v]
    if terms != "ALiBi":
        opts.update(bias=bias, score_mod=_rel(table, lk))
        learn += [bias, table]

    def run(native_step: bool) -> list[Tensor]:
        for t in learn:
            t.grad = None
        with contextlib.nullcontext() if native_step else _native.disabled():
            o = fl.flash_attention(q, k, v, block_q=32, block_k=24, **opts)
            o.backward(do)
        return [o.detach(), *(t.grad for t in learn)]  # type: ignore[misc]

    got = run(True)
    assert native_calls["forward"] == native_calls["backward"] == 1
    laid_out = 0 if terms == "ALiBi" else 1
    assert scored_calls == {"forward": laid_out, "backward": laid_out}
    want = run(False)
    names = ("O", "dQ", "dK", "dV", "dbias", "d table")
    rtol = 1e-12 if dtype == F64 else 2e-5
    for name, a, w in zip(names, got, want, strict=False):
        assert_close(a, w, rtol=rtol, name=f"{name} ({terms}, {dtype}) vs the PyTorch step")
    if dtype != F64:
        return
    x = [t.detach().requires_grad_(True) for t in learn]
    kk, vv = (t.repeat_interleave(hq // hk, dim=1) for t in x[1:3])
    qi, ki = torch.arange(lq).view(lq, 1), torch.arange(lk).view(1, lk)
    s = 4.0 * torch.tanh(x[0] @ kk.mT * 16**-0.5 / 4.0)
    s = s - slopes.view(1, hq, 1, 1) * (qi + lk - lq - ki).abs()  # bottom-right ALiBi
    if terms != "ALiBi":
        s = s + x[3] + x[4][torch.arange(hq).view(1, hq, 1, 1), qi - ki + lk]
    want_o, want_lse = naive_attention_scores(s, vv, (qi >= ki).view(1, 1, lq, lk))
    want_o.backward(do)
    oracle = [want_o.detach(), *(t.grad for t in x)]
    for name, a, w in zip(names, got, oracle, strict=False):
        assert_close(a, w, rtol=1e-11, name=f"{name} ({terms}) vs the dense oracle")
    with torch.no_grad():  # the score_mod's table requires grad; blocked_forward has no graph
        fwd = fl.blocked_forward(
            *(t.detach() for t in (q, k, v)),
            block_q=32,
            block_k=24,
            **{n: (t.detach() if isinstance(t, Tensor) else t) for n, t in opts.items()},
        )
    assert_close(fwd.lse, want_lse.detach(), rtol=1e-11, name=f"LSE ({terms}) vs the oracle")
