"""The explorer teaches by showing: linked hovering, step animations (and none when the
reader asks for reduced motion), the picture of one row with draggable scores, the forward
loop stepped tile by tile, formula lines lit by the step that uses them, keys that step,
one length for Q/K/V/G, storage against L, and the primary sources.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=20_000)

DESKTOP = (1400, 900)
ANIMATIONS = "() => document.getAnimations().filter(a => a.playState !== 'finished').length"


def has_class(cls: str) -> Any:
    return re.compile(rf"(^|\s){cls}(\s|$)")


def quiet_errors(visit: Any) -> list[str]:
    return [e for e in visit.console_errors if "status of 4" not in e]


def numbers(locator: Any) -> list[float]:
    return [float(x) for x in locator.evaluate_all("e => e.map(n => n.dataset.value)")]


def progress(page: Any, readout: str) -> Any:
    return page.locator(f'[data-readout="{readout}"] .readout-value')


# ----------------------------------------------------------------------------- hover links


def test_hovering_links_cells_tiles_and_rows_both_ways(visit_at: Any) -> None:
    v = visit_at(*DESKTOP)
    page = v.open("?sec=backward&bstep=6")
    expect(progress(page, "bw-progress")).to_have_text("6 / 6")
    # a cell: its tile's step, its LSE row, dQ of its query, dK and dV of its key
    page.locator('#bw-heat rect[data-cell="3,1"]').hover()
    for sel in (
        '#bw-steps tr[data-step="2"]',
        '#bw-stats tr[data-row="3"]',
        '#bw-grads tr[data-grad="dq3"]',
        '#bw-grads tr[data-grad="dk1"]',
        '#bw-grads tr[data-grad="dv1"]',
    ):
        expect(page.locator(sel)).to_have_class(has_class("linked"))
    expect(page.locator("#bw-stats tr.linked")).to_have_count(1)
    expect(page.locator("#bw-heat .link")).to_have_attribute("data-link", "2,4,0,2")
    expect(page.locator(".heat-tip")).to_contain_text("P[3,1] = 0.196097")
    # and back: a key's gradient row outlines its column, a step's row its tile
    page.locator('#bw-grads tr[data-grad="dk2"]').hover()
    expect(page.locator("#bw-heat .link")).to_have_attribute("data-link", "0,5,2,3")
    expect(page.locator('#bw-grads tr[data-grad="dv2"]')).to_have_class(has_class("linked"))
    page.locator('#bw-steps tr[data-step="4"]').hover()
    expect(page.locator("#bw-heat .link")).to_have_attribute("data-link", "2,4,2,4")
    expect(page.locator('#bw-stats tr[data-row="2"]')).to_have_class(has_class("linked"))
    expect(page.locator('#bw-grads tr[data-grad="dk3"]')).to_have_class(has_class("linked"))
    page.mouse.move(2, 2)
    expect(page.locator("#bw-heat .link")).to_have_count(0)
    expect(page.locator("#sec-backward .linked")).to_have_count(0)

    page.click('#tabs button[data-sec="ledger"]')
    expect(page.locator("#ledger-table tbody tr")).to_have_count(3)
    page.locator('#ledger-table tr[data-block="1"]').hover()
    expect(page.locator('#ledger-chart [data-band="1"]')).to_have_class(has_class("linked"))
    expect(page.locator("#ledger-row tr.linked")).to_have_count(2)
    page.locator('#ledger-row tr[data-pos="5"]').hover()
    expect(page.locator('#ledger-chart g[data-pos="5"]')).to_have_class(has_class("linked"))
    expect(page.locator('#ledger-table tr[data-block="2"]')).to_have_class(has_class("linked"))
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- motion


@pytest.mark.parametrize("motion", ["no-preference", "reduce"])
def test_steps_animate_unless_reduced_motion_is_asked(visit_at: Any, motion: str) -> None:
    v = visit_at(*DESKTOP, reduced_motion=motion)
    page = v.open("?sec=ledger&step=1")
    expect(page.locator("#ledger-chart .weight")).to_have_count(2)
    page.wait_for_timeout(300)
    moving = []
    for sec, button in (
        ("ledger", "#ledger-stepper"),
        ("backward", "#bw-stepper"),
        ("gpu", "#gpu-stepper .stepper:not([hidden])"),
    ):
        page.click(f'#tabs button[data-sec="{sec}"]')
        page.wait_for_timeout(400)
        page.locator(f'{button} [data-action="forward"]').click()
        moving.append(page.evaluate(ANIMATIONS))
    if motion == "reduce":
        assert moving == [0, 0, 0], f"animations ran under reduced motion: {moving}"
    else:
        assert all(n > 0 for n in moving), f"a step did not animate: {moving}"
    # whatever the motion, the step lands in the same place
    expect(page.locator("#gpu-diagram rect[data-tensor].load")).to_have_count(4)
    page.click('#tabs button[data-sec="ledger"]')
    expect(progress(page, "blocks-read")).to_have_text("2 / 3")
    expect(page.locator("#ledger-chart .m-text")).to_have_text("m = 3")
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- section 02 picture


def test_the_row_picture_draws_the_engines_numbers_and_takes_drags(visit_at: Any) -> None:
    v = visit_at(*DESKTOP)
    page = v.open("?sec=ledger&step=2")
    chart = page.locator("#ledger-chart")
    expect(chart.locator("g.score")).to_have_count(6)
    expect(chart.locator(".m-text")).to_have_text("m = 3")
    weights = numbers(chart.locator(".weight"))
    ell = float(page.locator('[data-readout="ell"] .num').get_attribute("data-value") or "nan")
    assert len(weights) == 4 and abs(sum(weights) - ell) < 1e-12, (weights, ell)
    assert max(weights) == 1.0, "the largest score read has exp(s - m) = 1"
    # drag score 4 (0) up by about two units
    handle = chart.locator('[data-handle="4"]')
    box = handle.bounding_box()
    assert box is not None
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    for dy in range(5, 65, 5):
        page.mouse.move(x, y - dy)
        page.wait_for_timeout(20)
    page.mouse.up()
    expect(page.locator("#f-scores")).not_to_have_value("1, 2, -1, 3, 0, 2.5")
    dragged = float(page.input_value("#f-scores").split(",")[4])
    assert dragged > 0.5, page.input_value("#f-scores")
    expect(
        page.locator('#ledger-row tr[data-pos="4"] td').nth(1).locator(".num")
    ).to_have_attribute("data-value", f"{dragged:g}")
    # the handle takes keys too: score 0 goes up by 0.1
    chart.locator('[data-handle="0"]').focus()
    page.keyboard.press("ArrowUp")
    expect(page.locator("#f-scores")).to_have_value(re.compile(r"^1\.1, 2, "))
    assert "step=2" in page.url, "keys on a handle must not step the ledger"
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- the forward loop


@pytest.mark.parametrize(
    ("size", "lang"), [(DESKTOP, "en"), ((390, 844), "zh")], ids=["1400-en", "390-zh"]
)
def test_the_five_positions_step_through_the_forward_loop(
    visit_at: Any, size: tuple[int, int], lang: str
) -> None:
    v = visit_at(*size, reduced_motion="reduce")
    page = v.open(f"?sec=backward&lang={lang}")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    saved = numbers(page.locator('#bw-stats [data-col="lse"] .num'))
    page.click('#bw-pass button[data-pass="forward"]')
    expect(progress(page, "fw-progress")).to_have_text("0 / 6")
    formula = page.locator("#bw-formula math[data-formula='initial']")
    expect(formula.locator("mtr.lit")).to_have_count(1)
    forward = page.locator('#fw-stepper [data-action="forward"]')
    forward.click()  # tile (0, 0): rows 0 and 1 against keys 0 and 1
    expect(page.locator('#fw-rows tr[data-row="1"] [data-col="m"] .num').nth(1)).to_have_attribute(
        "data-value", re.compile(r"^0\.")
    )
    expect(page.locator("#bw-heat rect.filled")).to_have_count(3)
    # q tile 0 sees only key tile 0: its first tile is also its last, so o′ is written
    lines = page.locator("#bw-formula math[data-formula='running'] mtr.lit")
    expect(lines).to_have_count(4)
    assert lines.evaluate_all("e => e.map(n => n.dataset.line)") == ["0", "2", "3", "4"]
    steps = 1
    while forward.is_enabled():
        forward.click()
        steps += 1
        assert steps <= 10
    assert steps == 6
    expect(progress(page, "fw-rows")).to_have_text("5 / 5")
    diff = float(page.locator('[data-readout="fw-diff"] .num').get_attribute("data-value") or "nan")
    assert diff < 1e-12, diff
    lse = numbers(page.locator('#bw-stats [data-col="lse"] .num'))
    assert max(abs(a - b) for a, b in zip(lse, saved)) < 1e-12, (lse, saved)
    assert "bpass=forward" in page.url and "fstep=6" in page.url
    page.click('#bw-pass button[data-pass="backward"]')
    expect(progress(page, "bw-progress")).to_have_text("0 / 6")
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- formula lines


def test_formula_lines_light_with_the_step_that_uses_them(visit_at: Any) -> None:
    v = visit_at(*DESKTOP, reduced_motion="reduce")
    page = v.open("?sec=ledger")
    running = page.locator("#ledger-formula math[data-formula='running']")
    initial = page.locator("#ledger-formula math[data-formula='initial']")
    expect(initial.locator("mtr.lit")).to_have_count(1)
    expect(running.locator("mtr.lit")).to_have_count(0)
    lit = {1: ["0", "2", "3", "4"], 2: ["0", "1", "2", "3", "4"], 3: ["0", "2", "3", "4"]}
    for step in (1, 2, 3):
        page.keyboard.press("ArrowRight")
        expect(progress(page, "blocks-read")).to_have_text(f"{step} / 3")
        lines = running.locator("mtr.lit").evaluate_all("e => e.map(n => n.dataset.line)")
        assert lines == lit[step], f"block {step}: lines {lines}"
    page.keyboard.press("ArrowLeft")  # block 2: the max moved from 2 to 3, α rescaled
    expect(running.locator('mtr[data-line="1"]')).to_have_class(has_class("lit-strong"))
    expect(page.locator("#ledger-formula-note")).to_contain_text("0.367879")
    # section 01 shows the same step's lines
    page.click('#tabs button[data-sec="running"]')
    expect(page.locator("#sec-running math[data-formula='running'] mtr.lit")).to_have_count(5)

    page.click('#tabs button[data-sec="backward"]')
    backward = page.locator("#bw-formula math[data-formula='backward']")
    expect(backward.locator("mtr.lit")).to_have_count(2)  # λ saved, D computed up front
    page.keyboard.press("ArrowRight")
    lines = backward.locator("mtr.lit").evaluate_all("e => e.map(n => n.dataset.line)")
    assert lines == ["1", "3", "4", "5", "6"], lines
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- keys


def test_arrow_keys_step_and_space_plays(visit_at: Any) -> None:
    v = visit_at(*DESKTOP)
    page = v.open("?sec=ledger")
    expect(page.locator("#ledger-table tbody tr")).to_have_count(3)
    page.locator("#sec-ledger h2").click()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    expect(progress(page, "blocks-read")).to_have_text("2 / 3")
    page.keyboard.press("ArrowLeft")
    expect(progress(page, "blocks-read")).to_have_text("1 / 3")
    page.click("#f-shift")
    page.keyboard.press("ArrowRight")  # inside a field the keys edit the field
    expect(progress(page, "blocks-read")).to_have_text("1 / 3")
    page.locator("#sec-ledger h2").click()
    page.keyboard.press(" ")
    expect(page.locator('#ledger-stepper [data-action="play"]')).to_have_attribute(
        "aria-pressed", "true"
    )
    expect(progress(page, "blocks-read")).to_have_text("3 / 3", timeout=8000)
    expect(page.locator('#ledger-stepper [data-action="play"]')).to_have_attribute(
        "aria-pressed", "false"
    )
    page.keyboard.press("Home")
    expect(progress(page, "blocks-read")).to_have_text("0 / 3")
    page.click('#tabs button[data-sec="ring"]')
    expect(page.locator("#ring-ranks tbody tr")).to_have_count(4)
    page.locator("#sec-ring h2").click()
    page.keyboard.press("ArrowRight")
    expect(page.locator("#ring-stepper .progress-text")).to_contain_text("1 / 4")
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- one length


def test_one_length_resizes_q_k_v_g_together(visit_at: Any) -> None:
    v = visit_at(*DESKTOP)
    page = v.open("?sec=backward")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    seed_q = page.input_value("#f-q").splitlines()
    page.click("#bw-inputs summary")
    expect(page.locator("#f-len")).to_have_value("5")
    page.click("#f-len")
    page.keyboard.press("Control+A")
    page.keyboard.type("8", delay=50)
    page.keyboard.press("Tab")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(8)
    for key in ("q", "k", "v", "g"):
        rows = page.input_value(f"#f-{key}").splitlines()
        assert len(rows) == 8, f"{key} has {len(rows)} rows"
    assert page.input_value("#f-q").splitlines()[:5] == seed_q, "the rows there stay"
    expect(progress(page, "bw-progress")).to_have_text("0 / 10")  # causal, 4 x 4 tiles of 2
    page.fill("#f-bq", "8")
    page.click("#f-len")
    page.keyboard.press("Control+A")
    page.keyboard.type("3", delay=50)
    page.keyboard.press("Enter")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(3)
    expect(page.locator("#f-bq")).to_have_value("3")
    assert page.input_value("#f-q").splitlines() == seed_q[:3]
    page.click("#f-len")
    page.keyboard.press("Control+A")
    page.keyboard.type("65", delay=50)
    page.keyboard.press("Tab")
    expect(page.locator('#sec-backward [data-error-for="length"]')).to_contain_text("1 to 64")
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- storage against L


def test_storage_plot_grows_as_l_squared_and_as_l(visit_at: Any) -> None:
    v = visit_at(*DESKTOP)
    page = v.open("?sec=storage&sd=4")
    plot = page.locator("#storage-plot")
    expect(plot.locator('[data-series="full_p"] circle').first).to_be_attached()
    for series, rule in (
        ("full_p", lambda n: n * n),
        ("lse", lambda n: n),
        ("common", lambda n: 16 * n),
    ):
        points = plot.locator(f'[data-series="{series}"] circle').evaluate_all(
            "e => e.map(c => [+c.dataset.length, +c.dataset.value])"
        )
        assert len(points) >= 10 and points[-1][0] == 65536, points
        bad = [(n, got) for n, got in points if got != rule(n)]
        assert not bad, f"{series}: {bad[:3]}"
    expect(plot.locator(".here-text")).to_have_text("L = 5")
    assert not quiet_errors(v), v.console_errors


# ----------------------------------------------------------------------------- sources


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_sources_section_lists_the_four_primary_sources(visit_at: Any, lang: str) -> None:
    v = visit_at(*DESKTOP)
    page = v.open(f"?sec=sources&lang={lang}")
    items = page.locator("#sources-list > li")
    expect(items).to_have_count(4)
    text = page.inner_text("#sources-list")
    for ident in ("1706.03762", "1805.02867", "2205.14135", "2307.08691"):
        assert f"arXiv:{ident}" in text, ident
    for item in items.all():
        expect(item.locator("p.small")).not_to_be_empty()
    heading = "4" if lang == "en" else "4 项"
    expect(page.locator("#sec-sources h3")).to_contain_text(heading)
    assert page.locator("#sec-sources a[href^='http']").count() == 0
    assert not quiet_errors(v), v.console_errors
