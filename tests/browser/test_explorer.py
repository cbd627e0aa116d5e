"""The explorer in a real browser: loading, stepping, errors, masks, language, URL state.

Each test opens a fresh page on the shared server (see conftest.py), which
also fails any test whose page requested something outside 127.0.0.1.
Screenshots of every section land in tests/browser/artifacts/. The README's
pictures (docs/img/explorer.png, docs/img/ring.png) are rewritten only when
FLASHLEDGER_UPDATE_DOCS_IMAGES=1 is set, so a test run leaves the tree clean.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=20_000)

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
IMAGES = DOCS_IMG if os.environ.get("FLASHLEDGER_UPDATE_DOCS_IMAGES") == "1" else ARTIFACTS
README_IMAGE = IMAGES / "explorer.png"
SECTIONS = {
    "running": "#s1-live tbody tr",
    "ledger": "#ledger-table tbody tr",
    "gpu": "#measure-table tbody tr",
    "backward": "#bw-stats tbody tr",
    "storage": "#storage-table tbody tr",
    "conventions": "#conv-table tbody tr",
}


def value(page: Any, readout: str) -> float:
    """The full-precision value shown in a readout card."""
    text = page.locator(f'[data-readout="{readout}"] .readout-value .num').first.get_attribute(
        "data-value"
    )
    assert text is not None, f"readout {readout!r} shows no number"
    return float(text)


def step_to_end(page: Any, stepper: str) -> int:
    """Press the stepper's forward button until it is disabled; returns the presses."""
    forward = page.locator(f'{stepper} [data-action="forward"]')
    presses = 0
    while forward.is_enabled():
        forward.click()
        presses += 1
        assert presses <= 100, f"{stepper} never reached its end"
    return presses


def test_every_section_loads_cleanly(visit: Any) -> None:
    page = visit.open()
    for n, (sec, ready) in enumerate(SECTIONS.items(), start=1):
        page.click(f'#tabs button[data-sec="{sec}"]')
        expect(page.locator(f"#sec-{sec}")).to_be_visible()
        expect(page.locator(ready).first).to_be_visible()
        assert f"sec={sec}" in page.url or sec == "running", f"URL lacks the section: {page.url}"
        visit.shot(f"{n:02d}-{sec}")
    assert not visit.console_errors, f"console errors: {visit.console_errors}"
    body = page.inner_text("body")
    assert "NaN" not in body and "undefined" not in body, "a NaN or undefined is shown"
    assert visit.requests, "no request was recorded"


def test_ledger_steps_to_m_3(visit: Any) -> None:
    page = visit.open("?sec=ledger")
    expect(page.locator("#ledger-table tbody tr")).to_have_count(3)
    assert value(page, "m") == float("-inf"), "before the first block m must be -inf"
    page.locator('#ledger-stepper [data-action="forward"]').click()
    expect(page.locator('[data-readout="blocks-read"] .readout-value')).to_have_text("1 / 3")
    assert value(page, "m") == 2.0
    assert value(page, "diff") > 0.1, "after one block the prefix output is not the full row"
    assert step_to_end(page, "#ledger-stepper") == 2
    expect(page.locator('[data-readout="blocks-read"] .readout-value')).to_have_text("3 / 3")
    assert value(page, "m") == 3.0
    diff = value(page, "diff")
    assert diff < 1e-12, f"final max difference {diff}"
    expect(page.locator('[data-readout="m"] .readout-value')).to_have_text("3")
    assert not visit.console_errors, visit.console_errors


def test_block_size_changes_the_ledger_rows(visit: Any) -> None:
    page = visit.open("?sec=ledger")
    rows = page.locator("#ledger-table tbody tr")
    expect(rows).to_have_count(3)
    page.fill("#f-block", "4")
    expect(rows).to_have_count(2)
    expect(rows.nth(0).locator("td").nth(1)).to_have_text("[1, 2, −1, 3]")
    page.fill("#f-block", "1")
    expect(rows).to_have_count(6)
    assert "bs=1" in page.url, page.url


def test_invalid_input_shows_the_reason_next_to_the_field(visit: Any) -> None:
    page = visit.open("?sec=ledger")
    expect(page.locator("#ledger-table tbody tr")).to_have_count(3)
    page.fill("#f-scores", "1, 2, x, 3")
    error = page.locator('[data-error-for="scores"]')
    expect(error).to_contain_text("“x” is not a number")
    expect(page.locator("#f-scores")).to_have_attribute("aria-invalid", "true")
    page.fill("#f-scores", "1, 2, -1, 3, 0, 2.5")
    expect(error).to_have_text("")
    page.fill("#f-block", "9")  # the server refuses it: 422 with the reason
    block_error = page.locator('[data-error-for="block_size"]')
    expect(block_error).to_contain_text("allowed: 1..6")
    page.fill("#f-block", "2")
    expect(block_error).to_have_text("")
    expect(page.locator("#ledger-table tbody tr")).to_have_count(3)
    # the browser logs the refused request itself; nothing else may appear
    unexpected = [e for e in visit.console_errors if "status of 422" not in e]
    assert not unexpected, unexpected


def test_backward_stepper_reaches_exact_gradients(visit: Any) -> None:
    visit.page.emulate_media(reduced_motion="reduce")
    page = visit.open("?sec=backward")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    forward = page.locator('#bw-stepper [data-action="forward"]')
    for _ in range(3):
        forward.click()
    expect(page.locator('[data-readout="bw-progress"] .readout-value')).to_have_text("3 / 6")
    expect(page.locator("#bw-heat .tile.current")).to_have_count(1)
    # the README's picture: the section with a cell hovered and its rows lit, at rest (no
    # animation half way), in a window tall enough that nothing scrolls under the pointer
    page.set_viewport_size({"width": 1280, "height": 2400})
    page.evaluate("window.scrollTo(0, 0)")
    page.locator('#bw-heat rect[data-cell="3,1"]').hover()
    expect(page.locator('#bw-grads tr[data-grad="dk1"]')).to_have_class(re.compile("linked"))
    expect(page.locator(".heat-tip")).to_be_visible()
    box = page.evaluate(
        """() => [document.querySelector('#sec-backward').getBoundingClientRect().top,
                 document.querySelector('#bw-grads-card').getBoundingClientRect().bottom]"""
    )
    README_IMAGE.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(
        path=str(README_IMAGE),
        clip={"x": 0, "y": box[0], "width": 1280, "height": box[1] - box[0] + 16},
    )
    page.mouse.move(2, 2)
    page.set_viewport_size({"width": 1280, "height": 900})
    assert step_to_end(page, "#bw-stepper") == 3
    expect(page.locator('[data-readout="bw-progress"] .readout-value')).to_have_text("6 / 6")
    grad = value(page, "grad-diff")
    assert grad < 1e-12, f"final gradient max difference {grad}"
    assert value(page, "fwd-diff") < 1e-12
    expect(page.locator('[data-readout="autograd"] .badge')).to_have_class("badge ok")
    # the accumulated gradients shown equal the full reference, row by row
    for row in page.locator("#bw-grads tbody tr").all():
        cells = row.locator("td")
        got = [
            float(x)
            for x in cells.nth(1).locator(".num").evaluate_all("e => e.map(n => n.dataset.value)")
        ]
        ref = [
            float(x)
            for x in cells.nth(2).locator(".num").evaluate_all("e => e.map(n => n.dataset.value)")
        ]
        worst = max(abs(a - b) for a, b in zip(got, ref))
        assert worst < 1e-12, f"{cells.nth(0).inner_text()}: accumulated off by {worst}"
    visit.shot("04-backward-end")
    assert not visit.console_errors, visit.console_errors


def test_fully_masked_row_preset(visit: Any) -> None:
    page = visit.open("?sec=backward")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    page.click("#bw-inputs summary")
    page.select_option("#f-mask", "masked_row")
    lse = page.locator('#bw-stats tr[data-row="2"] [data-col="lse"] .num')
    expect(lse).to_have_attribute("data-value", "-inf")
    expect(lse).to_have_text("−∞")
    o_values = page.locator('#bw-stats tr[data-row="2"] [data-col="o"] .num')
    expect(o_values).to_have_count(2)
    assert o_values.evaluate_all("e => e.map(n => n.dataset.value)") == ["0", "0"]
    expect(page.locator('#mask-grid button[data-cell^="2,"].on')).to_have_count(0)
    step_to_end(page, "#bw-stepper")
    assert value(page, "grad-diff") < 1e-12
    visit.shot("04-backward-masked-row")
    page.click('#tabs button[data-sec="conventions"]')
    page.select_option("#f-c-mask", "masked_row")
    expect(
        page.locator(
            '#conv-table tr[data-preset="flash_attn_2"] td[data-row="2"] [data-col="lse"] .num'
        )
    ).to_have_text("+∞")
    for text in (page.inner_text("body"), page.content()):
        assert "NaN" not in text, "NaN appears on the page"
    assert not visit.console_errors, visit.console_errors


def test_language_switch_changes_the_headings(visit: Any) -> None:
    page = visit.open("?sec=ledger")
    heading = page.locator("#sec-ledger h2")
    expect(heading).to_have_text("Advance block by block, watch the old state rescale")
    page.click('#lang-switch button[data-lang="zh"]')
    expect(heading).to_have_text("按块推进，看旧累计值怎样重新缩放")
    expect(page.locator('#tabs button[data-sec="backward"]')).to_contain_text("重建与求导")
    expect(page.locator('[data-readout="m"] .readout-label')).to_have_text("当前 m")
    expect(page.locator("html")).to_have_attribute("lang", "zh-CN")
    page.click('#lang-switch button[data-lang="en"]')
    expect(page.locator("h1")).to_have_text(
        "Blocked attention: rebuild probabilities, accumulate gradients"
    )


def test_url_state_survives_a_reload(visit: Any) -> None:
    page = visit.open("?sec=ledger")
    rows = page.locator("#ledger-table tbody tr")
    expect(rows).to_have_count(3)
    page.fill("#f-block", "3")
    expect(rows).to_have_count(2)
    page.locator('#ledger-stepper [data-action="forward"]').click()
    page.click('#lang-switch button[data-lang="zh"]')
    for part in ("bs=3", "step=1", "lang=zh", "sec=ledger"):
        assert part in page.url, f"{part} missing from {page.url}"
    page.reload()
    page.wait_for_selector("body[data-ready='1']")
    expect(page.locator("#f-block")).to_have_value("3")
    expect(rows).to_have_count(2)
    expect(page.locator('[data-readout="blocks-read"] .readout-value')).to_have_text("1 / 2")
    expect(page.locator("#sec-ledger h2")).to_have_text("按块推进，看旧累计值怎样重新缩放")
    expect(page.locator('#tabs button[data-sec="ledger"]')).to_have_class("active")
    expect(page.locator("#sec-running")).to_be_hidden()
    assert value(page, "m") == 2.0


RING_IMAGE = IMAGES / "ring.png"


def test_ring_section_steps_to_the_oracle(visit: Any) -> None:
    page = visit.open("?sec=ring")
    ranks = page.locator("#ring-ranks tbody tr")
    expect(ranks).to_have_count(4)
    progress = page.locator("#ring-stepper .progress-text")
    expect(progress).to_contain_text("0 / 4")
    assert value(page, "ring-now") > 0.1, "before step 0 no rank has merged a shard"
    page.locator('#ring-stepper [data-action="forward"]').click()
    expect(page.locator("#ring-diagram .hop.kv")).to_have_count(4)
    expect(page.locator("#ring-hop-table tbody tr.current")).to_have_count(4)
    assert step_to_end(page, "#ring-stepper") == 3
    expect(progress).to_contain_text("4 / 4")
    now = value(page, "ring-now")
    assert now < 1e-12, f"forward after the last step: max |O - oracle| = {now}"
    for name in ("o", "lse", "dq", "dk", "dv"):
        diff = value(page, f"ring-{name}")
        assert diff < 1e-12, f"ring {name} off the dense oracle by {diff}"
    assert value(page, "ring-replay") == 0.0
    expect(page.locator('[data-readout="ring-comm-ok"] .badge')).to_have_class("badge ok")
    # zigzag under the causal mask: every rank runs the same tiles
    bars = page.locator("#ring-bars .bar-value").all_inner_texts()
    assert len(bars) == 4 and len(set(bars)) == 1, f"tiles per rank: {bars}"
    assert value(page, "ring-balance") == 1.0

    page.click('#ring-pass button[data-pass="backward"]')
    expect(progress).to_contain_text("0 / 4")
    forward = page.locator('#ring-stepper [data-action="forward"]')
    forward.click()
    forward.click()
    expect(page.locator("#ring-diagram .acc-token")).to_have_count(4)
    expect(page.locator("#ring-diagram .hop.dkv")).to_have_count(4)
    assert value(page, "ring-now") > 1e-6, "halfway round the gradients are not complete"
    RING_IMAGE.parent.mkdir(parents=True, exist_ok=True)
    card = page.locator("#sec-ring > .card").first.bounding_box()
    assert card is not None
    page.screenshot(
        path=str(RING_IMAGE),
        full_page=True,
        clip={"x": 0, "y": 0, "width": 1280, "height": card["y"] + card["height"] + 16},
    )
    assert step_to_end(page, "#ring-stepper") == 2
    expect(page.locator("#ring-diagram .acc-token.home")).to_have_count(4)
    now = value(page, "ring-now")
    assert now < 1e-12, f"backward after the last step: max |grads - oracle| = {now}"
    for part in ("sec=ring", "rpass=backward", "rstep=4"):
        assert part in page.url, f"{part} missing from {page.url}"
    for text in (page.inner_text("body"), page.content()):
        assert "NaN" not in text, "NaN appears on the page"
    assert "undefined" not in page.inner_text("#sec-ring"), "an undefined is shown"
    visit.shot("ring")
    assert not visit.console_errors, visit.console_errors
