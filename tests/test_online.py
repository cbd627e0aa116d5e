"""The running state (m, ell, acc), its update and the one merge: the seed's six-score row."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashledger import OnlineSoftmax, OnlineState, merge, merge_partials
from flashledger.examples import SIX_SCORES, SIX_VALUES, six_score_example
from flashledger.online import blockwise_softmax_average, finalize, rescale_factor, step

TOL = 1e-12


def full_row(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``softmax(scores) @ values`` written out: ``Σ_j exp(s_j) v_j / Σ_j exp(s_j)``."""
    w = torch.exp(scores - scores.max())  # (L,)
    return (w[:, None] * values).sum(0) / w.sum()


def state_of(scores: torch.Tensor, values: torch.Tensor) -> OnlineState:
    """The state after reading ``scores`` (one row) in a single block."""
    empty = OnlineState.empty((1,), values.shape[-1], dtype=torch.float64, device=None)
    new, _, _ = step(empty, scores[None, :], values)
    return new


# -- the seed's six-score row -------------------------------------------------------------
def test_six_score_data_is_the_seed_row():
    ex = six_score_example()
    assert ex["scores"].tolist() == [1.0, 2.0, -1.0, 3.0, 0.0, 2.5]
    assert ex["values"].shape == (6, 2) and ex["block"] == 2
    assert ex["scores"].dtype == torch.float64


@pytest.mark.parametrize("block", [1, 2, 3, 4, 5, 6, 7])
def test_six_scores_last_block_equals_full_row(block, assert_close):
    osm = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=block)
    assert len(osm.steps) == -(-6 // block)
    assert_close(osm.output(), full_row(SIX_SCORES, SIX_VALUES), rtol=TOL, name="final output")
    assert_close(osm.lse(), torch.logsumexp(SIX_SCORES, 0), rtol=TOL, name="final log-sum-exp")


def test_six_scores_ledger_table_matches_prefix_formulas(assert_close):
    osm = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    m_prev = -math.inf
    for n, st_ in enumerate(osm.steps):
        a, b = 2 * n, 2 * n + 2
        prefix = SIX_SCORES[:b]
        m = float(prefix.max())
        assert st_.positions == (a, b)
        assert st_.scores.tolist() == SIX_SCORES[a:b].tolist()
        assert float(st_.block_max) == float(SIX_SCORES[a:b].max())
        assert float(st_.m_before) == m_prev and float(st_.m_after) == m
        alpha = 0.0 if m_prev == -math.inf else math.exp(m_prev - m)
        assert math.isclose(float(st_.alpha), alpha, rel_tol=TOL, abs_tol=0.0), (n, st_.alpha)
        ell = float(torch.exp(prefix - m).sum())
        assert math.isclose(float(st_.ell), ell, rel_tol=TOL), (n, float(st_.ell), ell)
        acc = (torch.exp(prefix - m)[:, None] * SIX_VALUES[:b]).sum(0)
        assert_close(st_.acc, acc, rtol=TOL, name=f"acc after block {n}")
        assert_close(st_.output, full_row(prefix, SIX_VALUES[:b]), rtol=TOL, name=f"o{n}")
        m_prev = m
    # the row's values: block maxes 2, 3, 2.5; running max 2, 3, 3
    assert [float(s.block_max) for s in osm.steps] == [2.0, 3.0, 2.5]
    assert [float(s.m_after) for s in osm.steps] == [2.0, 3.0, 3.0]


def test_six_scores_first_alpha_is_zero_and_larger_score_rescales():
    osm = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    assert float(osm.steps[0].alpha) == 0.0
    # block 2 brings 3 > 2: the old state is multiplied by exp(2 - 3)
    assert math.isclose(float(osm.steps[1].alpha), math.exp(-1.0), rel_tol=TOL)
    # block 3 brings nothing larger: scale 1
    assert float(osm.steps[2].alpha) == 1.0


def test_six_scores_intermediate_outputs_cover_only_the_keys_read():
    osm = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    full = full_row(SIX_SCORES, SIX_VALUES)
    for st_ in osm.steps[:-1]:
        gap = float((st_.output - full).abs().max())
        assert gap > 1e-3, f"prefix output of block {st_.index} already equals the full row"


@pytest.mark.parametrize("shift", [-7.5, -1.0, 0.0, 3.25, 100.0])
def test_shift_changes_m_not_the_output(shift, assert_close):
    base = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    moved = OnlineSoftmax.run(SIX_SCORES + shift, SIX_VALUES, block=2)
    for a, b in zip(base.steps, moved.steps):
        assert math.isclose(float(b.m_after), float(a.m_after) + shift, rel_tol=TOL, abs_tol=TOL)
        assert math.isclose(float(b.ell), float(a.ell), rel_tol=1e-12)
        assert_close(b.output, a.output, rtol=TOL, name=f"output after block {a.index}")


def test_blockwise_softmax_average_is_the_counterexample(assert_close):
    wrong = blockwise_softmax_average(SIX_SCORES, SIX_VALUES, block=2)
    full = full_row(SIX_SCORES, SIX_VALUES)
    blocks = [full_row(SIX_SCORES[a : a + 2], SIX_VALUES[a : a + 2]) for a in (0, 2, 4)]
    assert_close(wrong, torch.stack(blocks).mean(0), rtol=TOL, name="average of block softmaxes")
    assert float((wrong - full).abs().max()) > 0.05, (wrong, full)
    # one block covering the row is the full softmax
    one = blockwise_softmax_average(SIX_SCORES, SIX_VALUES, block=6)
    assert_close(one, full, rtol=TOL, name="one block")


def test_online_module_demo_runs():
    run = subprocess.run(
        [sys.executable, "-m", "flashledger.online"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "full-row reference" in out
    diff = float(out.rsplit("max |diff| =", 1)[1].strip())
    assert diff < 1e-12
    # the seed's numbers as the CLI prints them (6 significant digits), one line per block
    assert "full-row reference: [-0.249367, 0.0152181]" in out
    lines = out.splitlines()
    assert lines[0].split() == ["block", "positions", "scores", "block", "max", "m", "α", "ℓ",
                                "acc", "output"]  # fmt: skip
    assert lines[3].split()[:8] == ["3", "4..5", "[0,", "2.5]", "2.5", "3", "1", "2.17785"]


def test_an_online_softmax_shows_its_state():
    """``repr`` states the running state in one line; ``str`` and a notebook show the block
    ledger; many rows show their shape."""
    osm = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    assert repr(osm) == (
        "OnlineSoftmax(d_v=2, 3 blocks read (6 positions), m=3, ell=2.17785, "
        "output=[-0.249367, 0.0152181])"
    )
    assert str(osm).count("\n") == 3 and "<pre>" in osm._repr_html_()
    assert repr(OnlineSoftmax(d_v=1)) == (
        "OnlineSoftmax(d_v=1, 0 blocks read (0 positions), m=-inf, ell=0, output=[0])"
    )
    many = OnlineSoftmax.run(torch.zeros(3, 4), torch.zeros(4, 1), block=2)
    assert str(many) == repr(many) == "OnlineSoftmax(d_v=1, rows=(3,), 2 blocks read)"


# -- the update and the merge -------------------------------------------------------------
def test_rescale_factor_never_evaluates_inf_minus_inf():
    ninf = torch.tensor([-math.inf, -math.inf, 1.0, 2.0], dtype=torch.float64)
    new = torch.tensor([-math.inf, 3.0, 3.0, 2.0], dtype=torch.float64)
    got = rescale_factor(ninf, new)
    assert got.tolist() == [0.0, 0.0, math.exp(-2.0), 1.0]


def test_step_on_a_fully_masked_block_keeps_an_empty_state():
    st0 = OnlineState.empty((2,), 3, dtype=torch.float64, device=None)
    s = torch.full((2, 4), -math.inf, dtype=torch.float64)
    new, alpha, p = step(st0, s, torch.ones(4, 3, dtype=torch.float64))
    assert bool(torch.isneginf(new.m).all())
    assert new.ell.tolist() == [0.0, 0.0] and bool((new.acc == 0).all())
    assert alpha.tolist() == [0.0, 0.0] and bool((p == 0).all())
    o, lse = finalize(new)
    assert bool((o == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("split", [[0, 1, 2, 3], [4, 5], [0, 2, 4], [3], [1, 2, 3, 4, 5]])
def test_merge_of_two_partial_states_is_the_state_of_the_union(split, assert_close):
    mine = torch.tensor(split)
    rest = torch.tensor([j for j in range(6) if j not in split])
    a = state_of(SIX_SCORES[mine], SIX_VALUES[mine])
    b = state_of(SIX_SCORES[rest], SIX_VALUES[rest])
    whole = state_of(SIX_SCORES, SIX_VALUES)
    for name, merged in (("a+b", merge(a, b)), ("b+a", merge(b, a))):
        assert_close(merged.m, whole.m, rtol=0.0, name=f"m of {name}")
        assert_close(merged.ell, whole.ell, rtol=TOL, name=f"ell of {name}")
        assert_close(merged.acc, whole.acc, rtol=TOL, name=f"acc of {name}")
    o_a, lse_a = finalize(a)
    o_b, lse_b = finalize(b)
    o, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    assert_close(o[0], full_row(SIX_SCORES, SIX_VALUES), rtol=TOL, name="merged partial output")
    assert_close(lse, torch.logsumexp(SIX_SCORES, 0)[None], rtol=TOL, name="merged LSE")


def test_merge_with_an_empty_state_gives_no_nan(assert_close):
    full = state_of(SIX_SCORES, SIX_VALUES)
    empty = OnlineState.empty((1,), 2, dtype=torch.float64, device=None)
    for name, merged in (("x+empty", merge(full, empty)), ("empty+x", merge(empty, full))):
        assert_close(merged.m, full.m, rtol=0.0, name=f"m of {name}")
        assert_close(merged.ell, full.ell, rtol=0.0, name=f"ell of {name}")
        assert_close(merged.acc, full.acc, rtol=0.0, name=f"acc of {name}")
    both = merge(empty, empty)
    assert bool(torch.isneginf(both.m).all()) and float(both.ell) == 0.0
    assert not bool(torch.isnan(both.acc).any())
    o, lse = merge_partials(
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([-math.inf], dtype=torch.float64),
        torch.zeros(1, 2, dtype=torch.float64),
        torch.tensor([-math.inf], dtype=torch.float64),
    )
    assert o.tolist() == [[0.0, 0.0]] and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("empty_lse", [-math.inf, math.inf], ids=["-inf", "+inf"])
def test_a_part_with_no_key_merges_away_whichever_infinity_it_carries(empty_lse, assert_close):
    """flash-attn 2 reports +inf for a row with no key; the merge treats it as empty."""
    o_b, lse_b = full_row(SIX_SCORES, SIX_VALUES)[None], torch.logsumexp(SIX_SCORES, 0)[None]
    o_a = torch.full((1, 2), 7.0, dtype=torch.float64)  # garbage O of an empty part is ignored
    lse_a = torch.tensor([empty_lse], dtype=torch.float64)
    for o, lse in (merge_partials(o_a, lse_a, o_b, lse_b), merge_partials(o_b, lse_b, o_a, lse_a)):
        assert_close(o, o_b, rtol=TOL, name=f"O merged with an empty part ({empty_lse})")
        assert_close(lse, lse_b, rtol=TOL, name=f"LSE merged with an empty part ({empty_lse})")


@settings(max_examples=40, deadline=None)
@given(
    parts=st.integers(1, 7),
    rows=st.integers(1, 5),
    d_v=st.integers(1, 4),
    empty=st.lists(st.sampled_from([-math.inf, math.inf, None]), min_size=35, max_size=35),
    seed=st.integers(0, 2**31 - 1),
)
def test_parts_stacked_merge_in_one_pass_to_the_whole(parts, rows, d_v, empty, seed, assert_close):
    """S partial results stacked along a first dim merge at once to the attention of the
    union of their keys (rows that see no key in a part carry -inf or +inf there; a row with
    no key at all merges to O = 0, LSE -inf); two parts give bit for bit what the two-part
    form gives."""
    gen = torch.Generator().manual_seed(seed)
    n_keys = 3
    s = torch.randn(parts, rows, n_keys, generator=gen, dtype=torch.float64) * 3  # (S, R, n)
    v = torch.randn(parts, n_keys, d_v, generator=gen, dtype=torch.float64)  # (S, n, d_v)
    seen = torch.ones(parts, rows, dtype=torch.bool)  # (S, R)
    lse_s = torch.logsumexp(s, -1)  # (S, R)
    o_s = torch.softmax(s, -1) @ v  # (S, R, d_v)
    for i, e in enumerate(empty[: parts * rows]):
        if e is not None:
            p, r = divmod(i, rows)
            seen[p, r] = False
            lse_s[p, r], o_s[p, r] = e, 7.0  # the O of a part with no key is ignored
    o, lse = merge_partials(o_s, lse_s)
    for r in range(rows):
        keep = seen[:, r]
        if not bool(keep.any()):
            assert o[r].tolist() == [0.0] * d_v and lse[r].item() == -math.inf
            continue
        scores = s[keep, r].reshape(-1)  # (S'·n,)
        values = v[keep].reshape(-1, d_v)  # (S'·n, d_v)
        assert_close(o[r], full_row(scores, values), rtol=TOL, name=f"O of row {r}")
        assert_close(lse[r], torch.logsumexp(scores, 0), rtol=TOL, name=f"LSE of row {r}")
    if parts == 2:
        o2, lse2 = merge_partials(o_s[0], lse_s[0], o_s[1], lse_s[1])
        assert torch.equal(o2, o) and torch.equal(lse2, lse), "two parts: one merge, one answer"


def test_merge_partials_takes_both_halves_of_the_second_part():
    o = torch.zeros(1, 2, dtype=torch.float64)
    lse = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="o_b and lse_b together"):
        merge_partials(o, lse, o)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    d_v=st.integers(1, 5),
    block=st.integers(1, 45),
    seed=st.integers(0, 2**31 - 1),
    masked=st.floats(0.0, 1.0),
    spread=st.sampled_from([0.1, 1.0, 30.0, 700.0]),
)
def test_online_rows_equal_softmax_for_any_blocking(n, d_v, block, seed, masked, spread):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(3, n, dtype=torch.float64, generator=gen) * spread  # (rows, L)
    s[torch.rand(3, n, generator=gen) < masked] = -math.inf
    s[0, : n // 2] = -math.inf  # a row whose first blocks are all masked
    v = torch.randn(n, d_v, dtype=torch.float64, generator=gen)
    osm = OnlineSoftmax.run(s, v, block=block)
    for r in range(3):
        got = osm.output()[r]
        visible = ~torch.isneginf(s[r])
        if not bool(visible.any()):
            assert bool((got == 0).all()) and bool(torch.isneginf(osm.lse()[r]))
            continue
        want = full_row(s[r][visible], v[visible])
        err = float((got - want).abs().max())
        assert err <= TOL * max(1.0, float(want.abs().max())), (r, got, want)
    assert not bool(torch.isnan(osm.output()).any())


def test_merge_partials_refuses_an_lse_that_does_not_match_its_o():
    """Each part's LSE is its O's shape without d_v, and both parts have one shape: an LSE
    that would broadcast (one value for every row, a transposed flash-attn varlen LSE)
    or a second part of other rows is refused, named, not merged into a wrong answer."""
    o = torch.zeros(3, 4, dtype=torch.float64)  # (rows, d_v)
    lse = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"lse_a must have o_a's shape without its last dim"):
        merge_partials(o, lse[:1], o, lse)
    with pytest.raises(ValueError, match=r"lse_b must have o_b's shape .* \(3,\), got \(3, 1\)"):
        merge_partials(o, lse, o, lse[:, None])
    varlen = torch.zeros(5, 2, 4, dtype=torch.float64)  # (total, H, d_v), its LSE (H, total)
    with pytest.raises(ValueError, match=r"\(5, 2\), got \(2, 5\)"):
        merge_partials(varlen, torch.zeros(2, 5), varlen, torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"o_b must have o_a's shape \(3, 4\), got \(1, 4\)"):
        merge_partials(o, lse, o[:1], lse[:1])
    with pytest.raises(ValueError, match=r"lse_a must have o_a's shape .* \(2, 3\), got \(2,\)"):
        merge_partials(torch.stack((o, o)), torch.zeros(2))  # stacked parts
    with pytest.raises(ValueError, match=r"\(S, \.\.\., rows, d_v\)"):
        merge_partials(torch.zeros(4), torch.zeros(()))


def test_a_long_row_shows_its_ends_in_a_notebook():
    """A row read in thousands of blocks: the notebook view keeps the first and last
    HTML_ROWS // 2 blocks and says how many it left out, as the loop's Ledger does; print()
    still shows every block."""
    from flashledger.ledger import HTML_ROWS

    n = 5000
    osm = OnlineSoftmax.run(torch.linspace(-1, 1, n), torch.ones(n, 2), block=1)
    page = osm._repr_html_()
    assert page.count("\n") < HTML_ROWS + 5, page.count("\n")
    assert f"{n - HTML_ROWS:,} more blocks" in page
    assert f"\n{n:>5}  " in page, "the last block is shown"
    assert len(str(osm).splitlines()) == n + 1
    short = OnlineSoftmax.run(SIX_SCORES, SIX_VALUES, block=2)
    assert short._repr_html_() == f"<pre>{short!s}</pre>"


def test_values_for_other_rows_are_refused_not_broadcast_into_the_state():
    """One row read with values of three rows would silently become three outputs (m stays
    one number); values for 3 rows in a 2-row state failed inside torch. Both are refused by
    name, as are rows and dtype that cannot make a state."""
    osm = OnlineSoftmax(d_v=2)
    with pytest.raises(ValueError, match=r"\(\*rows, cols, d_v\) with rows=\(\)"):
        osm.update(torch.tensor([1.0, 2.0]), torch.ones(3, 2, 2))
    assert osm.steps == [] and osm.acc.shape == (2,)
    two = OnlineSoftmax(d_v=2, rows=(2,))
    with pytest.raises(ValueError, match=r"rows=\(2,\)"):
        two.update(torch.ones(2, 4), torch.ones(3, 4, 2))
    two.update(torch.ones(2, 4), torch.ones(2, 4, 2))  # one set of values per row
    two.update(torch.ones(2, 4), torch.ones(1, 4, 2))  # shared by the rows
    assert two.acc.shape == (2, 2)
    for bad in (3, None, (2.5,), (-1,)):
        with pytest.raises(ValueError, match="rows must be a sequence of integers"):
            OnlineSoftmax(d_v=2, rows=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        OnlineSoftmax(d_v=2, dtype=torch.int64)
