"""The explorer says what it computes: a softcap step that can be followed by hand, the ring's
tile as it runs, a length limit counted in rows, and link values the page cannot show
rewritten to what it shows.

Before, in turn: with a softcap, section 04 showed S = QKᵀ/√d and ∂Q += ∂S K/√d while dQ took
∂S·(1 − t²); the ring said "tile 4" while 2 × 2 tiles ran (a tile never crosses a chunk); 65
rows of Q were refused as "at most 64 entries"; ``mc=2`` measured with no mask (the default is
causal), ``cm=garbage`` was read as "row 0 fully masked", and ``lang=fr`` or ``sec=nonsense``
stayed in the URL of an English page showing section 01.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

import pytest
from playwright.sync_api import expect

from flashledger import examples

pytestmark = pytest.mark.browser
expect.set_options(timeout=20_000)

EPS = sys.float_info.epsilon

# a row of values as shown: each entry's full value, a masked entry as the 0 the loop stores
ROW_VALUES = """cell => [...cell.querySelectorAll('.num, .masked-entry')]
    .map(e => e.classList.contains('num') ? Number(e.dataset.value) : 0)"""


def _query(page: Any) -> dict[str, list[str]]:
    return parse_qs(urlparse(page.url).query, keep_blank_values=True)


@pytest.fixture
def opened(visit_at: Any) -> Iterator[Callable[[str], Any]]:
    """``opened(query)``: a fresh page on the explorer at ``query``; at the end of the test none
    of the pages opened may have thrown anything uncaught."""
    visits: list[Any] = []

    def open_at(query: str) -> Any:
        visits.append(visit_at(1280, 900))
        return visits[-1].open(query)

    yield open_at
    uncaught = [e for v in visits for e in v.console_errors if e.startswith("uncaught")]
    assert not uncaught, uncaught


# ----------------------------------------------------------------------------- 1. softcap


def test_a_softcap_step_can_be_followed_by_hand(opened: Any) -> None:
    """Each row of the tile: the shown ∂S·(1 − t²) times K/√d is the dQ the step added."""
    page = opened("?sec=backward&cap=0.5&bstep=1")
    rows = page.locator("#bw-prows tbody tr")
    expect(rows).to_have_count(2)
    expect(page.locator('#bw-formula math[data-formula="backward_softcap"]')).to_be_visible()
    expect(page.locator('#bw-formula math[data-formula="scores_softcap"]')).to_be_visible()
    expect(page.locator('#bw-formula math[data-formula="backward"]')).to_be_hidden()
    expect(page.locator("#bw-cap-note")).to_contain_text("c = 0.5")
    expect(page.locator("#bw-cap-note")).to_contain_text("∂S·(1 − t²)")
    keys = page.locator("#bw-step table.data td").nth(2).inner_text()
    k0 = int(re.findall(r"k(\d+)", keys)[0])
    k = examples.five_position_example()["k"].tolist()
    d = len(k[0])
    plain_differs = False
    for n in range(rows.count()):
        row = rows.nth(n)
        i = int(row.get_attribute("data-row") or "")
        factor = row.locator('[data-col="ds_qk"]').evaluate(ROW_VALUES)
        ds = row.locator('[data-col="ds"]').evaluate(ROW_VALUES)
        # the step is the first: the accumulated dQ row shown is this step's increment
        acc = page.locator(f'#bw-grads tr[data-grad="dq{i}"] [data-col="acc"]')
        dq = acc.evaluate(ROW_VALUES)
        for c in range(d):
            terms = [f * k[k0 + j][c] / math.sqrt(d) for j, f in enumerate(factor)]
            bound = 64 * EPS * sum(abs(x) for x in terms) + 1e-300
            assert abs(sum(terms) - dq[c]) <= bound, (i, c, factor, dq)
            plain = sum(x * k[k0 + j][c] / math.sqrt(d) for j, x in enumerate(ds))
            plain_differs |= abs(plain - dq[c]) > 1e-6 * max(abs(dq[c]), 1e-3)
    assert plain_differs, "the ∂S column alone should not give dQ under a softcap"
    page.click('#lang-switch button[data-lang="zh"]')
    expect(page.locator("#bw-cap-note")).to_contain_text("截顶")
    expect(page.locator('#bw-formula math[data-formula="backward_softcap"]')).to_be_visible()


def test_without_a_softcap_the_plain_formulas_and_columns_stay(opened: Any) -> None:
    page = opened("?sec=backward&bstep=1")
    expect(page.locator("#bw-prows tbody tr")).to_have_count(2)
    expect(page.locator('#bw-formula math[data-formula="backward"]')).to_be_visible()
    expect(page.locator('#bw-formula math[data-formula="backward_softcap"]')).to_be_hidden()
    expect(page.locator('#bw-prows [data-col="ds_qk"]')).to_have_count(0)
    expect(page.locator("#bw-prows thead th")).to_have_count(3)


# ----------------------------------------------------------------------------- 2. ring tiles


@pytest.mark.parametrize(
    ("query", "en", "zh"),
    [
        ("", "tile 4 → 2 × 2", "块大小 4 → 2 × 2"),  # zigzag, W = 4, L = 16: chunks of 2
        ("&rlay=contiguous&rb=8", "tile 8 → 4 × 4", "块大小 8 → 4 × 4"),  # chunks of 4
        ("&rb=2", "tile 2 ·", "块大小 2 ·"),  # fits a chunk: runs as asked
    ],
    ids=["zigzag-chunks-of-2", "contiguous-chunks-of-4", "tile-fits"],
)
def test_the_ring_says_what_tile_runs(opened: Any, query: str, en: str, zh: str) -> None:
    page = opened(f"?sec=ring{query}")
    config = page.locator("#ring-config")
    expect(config).to_contain_text(en)
    expect(page.locator('[data-i18n="s7.block"]')).to_have_attribute("title", re.compile("chunk"))
    page.click('#lang-switch button[data-lang="zh"]')
    expect(config).to_contain_text(zh)


# ----------------------------------------------------------------------------- 3. rows


def test_a_matrix_with_too_many_rows_is_refused_in_rows(opened: Any) -> None:
    rows = "\n".join(["0.1, 0.2"] * 65)
    query = urlencode({"sec": "backward", "q": rows, "k": rows, "v": rows, "g": rows})
    page = opened(f"?{query}")
    q_error = page.locator('#sec-backward [data-error-for="q"]')
    expect(q_error).to_have_text("at most 64 rows are allowed (one row per position)")
    page.click('#lang-switch button[data-lang="zh"]')
    expect(q_error).to_have_text("至多允许 64 行（每个位置一行）")
    # a row too long is still counted in entries
    page.click('#lang-switch button[data-lang="en"]')
    wide = "\n".join([", ".join(["0.1"] * 17)] * 5)
    page.fill("#f-q", wide)
    page.fill("#f-k", wide)
    expect(q_error).to_have_text("at most 16 entries are allowed")


# ----------------------------------------------------------------------------- 4. link values


def test_a_links_checkbox_value_goes_back_to_its_default(visit_at: Any, opened: Any) -> None:
    v = visit_at(1280, 900)
    bodies: list[dict[str, Any]] = []
    v.page.on(
        "request",
        lambda req: (
            bodies.append(json.loads(req.post_data or "{}"))
            if req.url.endswith("/api/measure")
            else None
        ),
    )
    page = v.open("?sec=gpu&mc=2")
    expect(page.locator("#f-m-causal")).to_be_checked()
    assert "mc" not in _query(page), page.url
    expect(page.locator("#measure-device")).not_to_have_text(re.compile("computing"))
    assert bodies and all(b.get("causal") is True for b in bodies), bodies
    page = opened("?sec=backward&alibi=2")
    expect(page.locator("#f-alibi")).not_to_be_checked()
    assert "alibi" not in _query(page), page.url


def test_an_unreadable_custom_grid_in_a_link_becomes_the_causal_grid(opened: Any) -> None:
    page = opened("?sec=backward&mask=custom&cm=garbage")
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    expect(page.locator("#bw-stats .tag")).to_have_count(0)  # no row is fully masked
    assert _query(page)["cm"] == ["10000;11000;11100;11110;11111"], page.url
    expect(page.locator("#mask-grid button.on")).to_have_count(15)
    page = opened("?sec=backward&cm=garbage")  # no custom mask: the grid is unused
    expect(page.locator("#bw-stats tbody tr")).to_have_count(5)
    assert "cm" not in _query(page), page.url


# ----------------------------------------------------------------------------- 5. lang, sec


@pytest.mark.parametrize(
    ("query", "kept"),
    [
        ("?lang=fr", {}),
        ("?sec=nonsense", {}),
        ("?lang=fr&sec=ledger&bs=3", {"sec": ["ledger"], "bs": ["3"]}),
        ("?lang=zh&sec=nonsense", {"lang": ["zh"]}),
    ],
)
def test_a_links_language_or_section_the_page_lacks_is_rewritten(
    opened: Any, query: str, kept: dict[str, list[str]]
) -> None:
    page = opened(query)
    expect(page.locator("main > section:not([hidden])")).to_have_count(1)
    assert _query(page) == kept, page.url
    shown = page.locator("main > section:not([hidden])").get_attribute("data-section")
    assert shown == kept.get("sec", ["running"])[0]
    assert page.evaluate("document.documentElement.lang") == (
        "zh-CN" if kept.get("lang") == ["zh"] else "en"
    )
    page.go_back()  # rewritten in place: Back leaves the page
    assert page.url == "about:blank", page.url
