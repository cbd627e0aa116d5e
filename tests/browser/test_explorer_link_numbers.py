"""A number from a link that a number field cannot hold as written is shown as the number
the section computes with.

Before: ``?bs=+3`` (a "+" in a query string is a space) or ``?shift=%2B5`` left the field
blank, while the ledger computed with 3 and 5: the inputs on screen did not say what was
computed, and a blank field elsewhere on the page means "enter a number".
"""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=20_000)


@pytest.mark.parametrize(
    ("query", "field", "shown", "rows", "m"),
    [
        ("bs=%2B3&step=1", "#f-block", "3", 2, "2"),  # "+3": block max of [1, 2, -1] is 2
        ("bs=+3&step=1", "#f-block", "3", 2, "2"),  # " 3"
        ("shift=%2B5&step=1", "#f-shift", "5", 3, "7"),  # m = 2 + 5
        ("shift=%E2%88%921&step=1", "#f-shift", "-1", 3, "1"),  # "−1": m = 2 - 1
    ],
)
def test_a_links_number_is_shown_in_its_field(
    visit_at: Any, query: str, field: str, shown: str, rows: int, m: str
) -> None:
    page = visit_at(1280, 900).open(f"?sec=ledger&{query}")
    expect(page.locator("#ledger-table tbody tr")).to_have_count(rows)
    expect(page.locator('[data-readout="m"] .readout-value')).to_have_text(m)
    expect(page.locator(field)).to_have_value(shown)
    expect(page.locator("#sec-ledger .field-error:not(:empty)")).to_have_count(0)
