"""A language switch restates section 04's legend, table headers and tags (not only the
parts drawn on every step).

Before: after EN -> 中文 in the middle of a step, the heat map's legend, the headers of the
per-row statistics and of the gradients table and the "fully masked" tag stayed in English
(and in Chinese after a switch back), because they were built only with a new result.
"""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=20_000)

PARTS = ["#bw-legend", "#bw-stats thead", "#bw-stats tbody", "#bw-grads thead"]


@pytest.mark.parametrize("bpass", ["backward", "forward"])
@pytest.mark.parametrize(("first", "then"), [("en", "zh"), ("zh", "en")])
def test_a_language_switch_restates_section_04s_legend_headers_and_tags(
    visit_at: Any, bpass: str, first: str, then: str
) -> None:
    query = f"?sec=backward&mask=masked_row&bstep=2&fstep=2&bpass={bpass}"
    switched = visit_at(1280, 900)
    page = switched.open(f"{query}&lang={first}")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    page.click(f'#lang-switch button[data-lang="{then}"]')
    fresh = visit_at(1280, 900).open(f"{query}&lang={then}")
    expect(fresh.locator("#bw-stats tbody tr")).to_have_count(5)
    for part in PARTS:
        if bpass == "forward" and part.startswith("#bw-grads"):
            continue  # the gradients card is hidden in the forward pass
        expect(page.locator(part)).to_have_text(fresh.locator(part).text_content() or "")
    assert not [e for e in switched.console_errors if e.startswith("uncaught")], (
        switched.console_errors
    )
