"""The explorer teaching by showing, and keeping its word: score handles that keep the
focus, text that follows the inputs, section 05 saying whose problem it books, ring steps
and error rows counted from 1, a Chinese page without English, links made of the page's own
options that always load, errors that cover nothing, a row picture whose labels stay apart,
masked entries that read masked, and a Shift that is never silently 0.

Each test drives the page as a person does and failed before the fix it names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser
expect.set_options(timeout=20_000)


@pytest.fixture
def browse(visit_at: Any) -> Iterator[Callable[..., None]]:
    """``browse(check, query, width=1280)``: open the page at ``query`` in a fresh context of
    that width and run ``check(page)``; the page may throw nothing uncaught."""

    def run(check: Callable[[Any], None], query: str = "", width: int = 1280) -> None:
        v = visit_at(width, 900)
        page = v.open(query)
        check(page)
        uncaught = [e for e in v.console_errors if e.startswith("uncaught")]
        assert not uncaught, f"uncaught errors on the page: {uncaught}"

    yield run


def _expect(target: Any) -> Any:
    from playwright.sync_api import expect

    return expect(target)


def _value(page: Any, selector: str) -> str:
    return str(page.locator(selector).first.get_attribute("data-value"))


def _box(page: Any, selector: str) -> dict[str, float]:
    box = page.locator(selector).first.bounding_box()
    assert box is not None, f"{selector} is not shown"
    return box  # type: ignore[no-any-return]


def _apart(a: dict[str, float], b: dict[str, float]) -> bool:
    """True when two boxes do not overlap (touching edges allowed)."""
    return (
        a["x"] + a["width"] <= b["x"] + 0.5
        or b["x"] + b["width"] <= a["x"] + 0.5
        or a["y"] + a["height"] <= b["y"] + 0.5
        or b["y"] + b["height"] <= a["y"] + 0.5
    )


# ----------------------------------------------------------------------------- 1. the score handles


def test_a_score_handle_keeps_the_focus_so_every_arrow_key_moves_the_score(
    browse: Callable[..., None],
) -> None:
    """Before: the redrawn chart dropped the focus to <body> after one press; the next did nothing."""

    def check(page: Any) -> None:
        scores = page.locator("#f-scores")
        page.locator("circle[aria-label^='score 4']").focus()
        for n in (1, 2, 3):
            page.keyboard.press("ArrowUp")
            _expect(scores).to_have_value(f"1, 2, -1, 3, 0.{n}, 2.5")
            # the engine's answer redrew the chart: the same handle still has the focus
            _expect(page.locator('#ledger-table tr[data-block="2"] td').nth(1)).to_have_text(
                f"[0.{n}, 2.5]"
            )
            focused = page.evaluate("document.activeElement.getAttribute('data-handle')")
            assert focused == "4", f"after press {n} the focus is on {focused!r}"
        for _ in range(3):  # quick presses, before the answers come back, all count
            page.keyboard.press("ArrowDown")
        _expect(scores).to_have_value("1, 2, -1, 3, 0, 2.5")
        assert "step=3" in page.url, "keys on a handle must not step the ledger"

    browse(check, "?sec=ledger&step=3")


# ----------------------------------------------------------------------------- 2. section 02's text


def test_the_ledger_card_describes_the_row_it_shows(browse: Callable[..., None]) -> None:
    """Before: "Six scores…" and "Original scores [1, 2, −1, 3, 0, 2.5]" stayed for any row."""

    def check(page: Any) -> None:
        title, note = page.locator("#ledger-card-title"), page.locator("#ledger-note")
        _expect(title).to_have_text("Six scores and 2-D value vectors")
        _expect(note).to_contain_text("Original scores [1, 2, −1, 3, 0, 2.5]")
        _expect(page.locator("#ledger-reset")).to_be_hidden()
        page.fill("#f-scores", "5, 1, 2, 0, 7, 3")
        _expect(note).to_contain_text("Your own 6 scores, not the seed page's example")
        _expect(note).not_to_contain_text("Original scores")
        _expect(title).to_have_text("6 scores and 2-D value vectors")
        page.click('#lang-switch button[data-lang="zh"]')
        _expect(title).to_have_text("6 个分数与 2 维值向量")
        _expect(note).to_contain_text("你输入的 6 个分数")
        page.click('#lang-switch button[data-lang="en"]')
        forty = ", ".join(str(i % 7 - 3) for i in range(40))
        page.fill("#f-values", "\n".join(["1, 0, 2"] * 40))
        page.fill("#f-scores", forty)
        _expect(title).to_have_text("40 scores and 3-D value vectors")
        _expect(note).to_contain_text("Your own 40 scores")
        page.click("#ledger-reset")  # the seed's row back, and its words
        _expect(title).to_have_text("Six scores and 2-D value vectors")
        _expect(note).to_contain_text("Original scores")
        _expect(page.locator("#f-scores")).to_have_value("1, 2, -1, 3, 0, 2.5")

    browse(check, "?sec=ledger")


# ----------------------------------------------------------------------------- 3. section 05 and 04


def test_storage_says_whose_problem_it_books_and_books_section_04s(
    browse: Callable[..., None],
) -> None:
    """Before: after 3 × 3 tiles in section 04, section 05 still booked 2 × 2 without a word."""

    def figure(page: Any, name: str) -> str:
        return _value(page, f'#storage-summary [data-figure="{name}"] .num')

    def check(page: Any) -> None:
        source = page.locator("#storage-source")
        _expect(source).to_contain_text("which are the problem section 04 steps through")
        # the seed's figures: 25 elements of P, 5 of the LSE, 4 per tile, 15 and 15 dot products
        seed = {"full": "25", "lse": "5", "cap": "4", "fwd": "15", "bwd": "15"}
        assert {k: figure(page, k) for k in seed} == seed
        page.click('#tabs button[data-sec="backward"]')
        page.click("#bw-inputs summary")
        page.fill("#f-bq", "3")
        page.fill("#f-bk", "3")
        _expect(page.locator('[data-readout="bw-progress"] .readout-value')).to_have_text("0 / 3")
        page.click('#tabs button[data-sec="storage"]')
        _expect(source).to_contain_text("not the problem section 04 steps through")
        _expect(source).to_contain_text("3 × 3 tiles")
        assert figure(page, "bq") == "2", "the figures are still those of the fields here"
        page.click("#storage-take")
        _expect(page.locator('#storage-summary [data-figure="bq"] .num')).to_have_attribute(
            "data-value", "3"
        )
        assert (figure(page, "bk"), figure(page, "cap")) == ("3", "9")
        _expect(source).to_contain_text("which are the problem section 04 steps through")
        _expect(page.locator("#storage-take")).to_be_hidden()
        # a mask no plain kind gives (a fully-masked row) is booked as section 04's grid
        page.click('#tabs button[data-sec="backward"]')
        page.select_option("#f-mask", "masked_row")
        page.click('#tabs button[data-sec="storage"]')
        _expect(source).to_contain_text("not the problem section 04 steps through")
        page.click("#storage-take")
        _expect(page.locator('#storage-summary [data-figure="fwd"] .num')).to_have_attribute(
            "data-value", "12"
        )
        _expect(page.locator("#f-s-mask")).to_have_value("custom")
        page.click('#lang-switch button[data-lang="zh"]')
        _expect(source).to_contain_text("与第 04 节逐步演示的问题相同")

    browse(check, "?sec=storage")


# ----------------------------------------------------------------------------- 4. ring steps


@pytest.mark.parametrize(
    ("step", "centre", "rows"),
    [
        (0, "before step 1", "before step 1"),
        (1, "after step 1", "after 1 step"),
        (2, "after step 2", "after 2 steps"),
    ],
)
def test_ring_steps_count_from_one_everywhere(
    browse: Callable[..., None], step: int, centre: str, rows: str
) -> None:
    """Before: "2 / 4" done beside "after step 1", "before step 0", a hop ledger from 0."""

    def check(page: Any) -> None:
        _expect(page.locator("#ring-stepper .progress-text")).to_contain_text(f"{step} / 4")
        _expect(page.locator("#ring-diagram .ring-center")).to_have_text(centre)
        _expect(page.locator("#ring-rows-title")).to_have_text(
            f"Rank 0: its rows' running LSE {rows}"
        )
        current = page.locator("#ring-hop-table tbody tr.current td:first-child")
        if step:
            assert set(current.all_inner_texts()) == {str(step)}
            _expect(page.locator("#ring-grid th.current-col")).to_have_text(f"step {step}")
        else:
            _expect(current).to_have_count(0)
        first = page.locator("#ring-hop-table tbody tr td:first-child").first
        _expect(first).to_have_text("1")  # the first hop is sent in step 1, as section 04 counts
        _expect(page.locator("#ring-grid thead th").nth(1)).to_have_text("step 1")
        page.click('#lang-switch button[data-lang="zh"]')
        zh = "第 1 步之前" if step == 0 else f"第 {step} 步之后"
        _expect(page.locator("#ring-diagram .ring-center")).to_have_text(zh)

    browse(check, f"?sec=ring&rstep={step}")


# ----------------------------------------------------------------------------- 5. rows from 1


def test_input_errors_count_rows_from_one_in_both_languages(browse: Callable[..., None]) -> None:
    """Before: "line 1, entry 1" beside "row 4 has 1 entries but row 0 has 2" and "第 0 行"."""

    def check(page: Any) -> None:
        q_error = page.locator('#sec-backward [data-error-for="q"]')
        page.click("#bw-inputs summary")
        page.fill("#f-q", "0.2, -0.3\n0.5, 0.1\n-0.4, 0.7\n0.6, -0.2\n0.1")
        _expect(q_error).to_have_text(
            "row 5 has 1 entry but row 1 has 2; every row needs the same number"
        )
        page.click('#lang-switch button[data-lang="zh"]')
        _expect(q_error).to_have_text("第 5 行有 1 项，第 1 行有 2 项；每行项数必须相同")
        page.fill("#f-q", "a, b\n1, 2\n1, 2\n1, 2\n1, 2")
        _expect(q_error).to_have_text("第 1 行第 1 项：“a” 不是数")
        page.click('#lang-switch button[data-lang="en"]')
        _expect(q_error).to_have_text("row 1, entry 1: “a” is not a number")
        page.click('#tabs button[data-sec="ledger"]')
        page.fill("#f-values", "1, 0\n0, 1\n1, 1\n-1, 0\n0, -1\n0.5")
        _expect(page.locator('#sec-ledger [data-error-for="values"]')).to_have_text(
            "row 6 has 1 entry but row 1 has 2; every row needs the same number"
        )

    browse(check, "?sec=backward")


# ----------------------------------------------------------------------------- 6. Chinese


def test_a_chinese_page_shows_no_english_words_of_the_server_or_the_pictures(
    browse: Callable[..., None],
) -> None:
    """Before: "standard · forward", presets' English descriptions in titles, "K rows 0–1",
    and a mask error "允许的取值：'none', … or 'custom'"."""

    def check(page: Any) -> None:
        page.click('#tabs button[data-sec="storage"]')
        bars = page.locator("#storage-traffic svg text.label")
        _expect(bars).to_have_count(6)  # drawn once the storage answer is in
        labels = bars.all_text_contents()
        assert "标准 · 前向" in labels and "FlashAttention-1 · 反向" in labels, labels
        assert not [x for x in labels if re.search(r"forward|backward|standard", x)], labels
        page.click('#tabs button[data-sec="conventions"]')
        cell = page.locator('#conv-table tr[data-preset="flash_attn_3"] td').first
        _expect(cell).to_have_attribute("title", re.compile("全屏蔽行 LSE 为 −∞"))
        _expect(cell).to_contain_text("因果：右下对齐")
        page.click('#tabs button[data-sec="backward"]')
        options = page.locator("#f-conv option")
        _expect(options.first).to_have_attribute("title", re.compile("全屏蔽行"))
        titles = options.evaluate_all("os => os.map(o => o.title)")
        assert all("全屏蔽行" in x for x in titles), titles
        page.locator('#bw-stepper [data-action="forward"]').click()
        page.click('#tabs button[data-sec="gpu"]')
        tips_at = page.locator("#gpu-diagram rect[data-tensor] title")
        _expect(tips_at.first).to_contain_text("位置")
        tips = tips_at.all_text_contents()
        assert tips and all("位置" in x and "rows" not in x for x in tips), tips[:3]
        # a mask the server does not take (as a link may carry): its choices in Chinese
        page.click('#tabs button[data-sec="backward"]')
        page.click("#bw-inputs summary")
        page.evaluate(
            """() => { const s = document.querySelector('#f-mask');
                       s.append(new Option('diagonal', 'diagonal')); }"""
        )
        page.select_option("#f-mask", "diagonal")
        error = page.locator('#sec-backward [data-error-for="mask"]')
        _expect(error).to_contain_text("“自定义”")
        text = error.inner_text()
        assert " 或 " in text and " or " not in text and "'" not in text, text
        assert "“因果，左上对齐”" in text and "causal" not in text, text

    browse(check, "?lang=zh&sec=storage")


# ----------------------------------------------------------------------------- 7. links


@pytest.mark.parametrize(
    ("query", "ready", "rows"),
    [
        ("?sec=backward&mask=masked_row", "#bw-stats tbody tr", 5),  # the Mask select's option
        ("?sec=ring&rdata=example", "#ring-ranks tbody tr", 2),  # the Inputs select's option
        ("?sec=backward&mask=masked_row&lang=zh&bq=1", "#bw-stats tbody tr", 5),
    ],
)
def test_a_link_made_of_the_pages_own_options_loads(
    browse: Callable[..., None], query: str, ready: str, rows: int
) -> None:
    """Before: both links were refused (422) and left the section blank."""

    def check(page: Any) -> None:
        _expect(page.locator(ready)).to_have_count(rows)
        errors = page.locator("main > section:not([hidden]) .field-error:not(:empty)")
        _expect(errors).to_have_count(0)
        assert "stale" not in (
            page.locator("main > section:not([hidden])").get_attribute("class") or ""
        )
        if "mask=masked_row" in query:
            lse = page.locator('#bw-stats tr[data-row="2"] [data-col="lse"] .num')
            _expect(lse).to_have_attribute("data-value", "-inf")
            _expect(page.locator("#bw-heat rect.cell")).to_have_count(25)
        else:
            _expect(page.locator("#ring-config")).to_contain_text("L = 5 · d = 2")
            assert "rl=5" in page.url and "rd=2" in page.url, page.url

    browse(check, query)


@pytest.mark.parametrize(
    ("query", "field", "ready", "rows"),
    [
        ("?sec=backward&bq=9", "block_q", "#bw-stats tbody tr", 5),
        ("?sec=ring&rw=99", "world_size", "#ring-ranks tbody tr", 4),
        ("?sec=ledger&scores=1,x", "scores", "#ledger-table tbody tr", 3),
        ("?sec=storage&slq=0", "lq", "#storage-table tbody tr", 9),
        ("?sec=conventions&clk=9", "k", "#conv-table tbody tr", 5),
    ],
)
def test_a_link_with_refused_inputs_shows_the_default_example_and_the_error(
    browse: Callable[..., None], query: str, field: str, ready: str, rows: int
) -> None:
    """Before: a refused link left the section's pictures and tables blank."""

    def check(page: Any) -> None:
        _expect(page.locator(ready)).to_have_count(rows)
        section = page.locator("main > section:not([hidden])")
        _expect(section.locator(f'[data-error-for="{field}"]')).not_to_be_empty()
        _expect(section.locator(".stale-note .stale-default").first).to_be_visible()
        _expect(section.locator(".stale-note .stale-default").first).to_have_text(
            "The default example (these inputs were not accepted):"
        )

    browse(check, query)


# ----------------------------------------------------------------------------- 8. error layout


@pytest.mark.parametrize("width", [1280, 375])
def test_an_error_takes_its_own_place_and_covers_nothing(
    browse: Callable[..., None], width: int
) -> None:
    """Before: error bubbles floated over the next label, the fields below and a button."""

    def check(page: Any) -> None:
        page.fill("#f-scores", "1, 2, x")
        scores_error = '#sec-ledger [data-error-for="scores"]'
        _expect(page.locator(scores_error)).to_contain_text("is not a number")
        assert _apart(_box(page, scores_error), _box(page, "#f-values"))
        assert _apart(_box(page, scores_error), _box(page, '#sec-ledger [data-i18n="s2.values"]'))
        page.fill("#f-scores", "1, 2, -1, 3, 0")  # five scores for six value vectors
        values_error = '#sec-ledger [data-error-for="values"]'
        _expect(page.locator(values_error)).to_contain_text("6 rows given; 5 are needed")
        box = _box(page, values_error)
        for other in ("#f-block", "#f-shift", '#sec-ledger [data-i18n="s2.block"]'):
            assert _apart(box, _box(page, other)), f"the Values error covers {other}"
        column = _box(page, ".ledger-inputs")
        assert box["x"] + box["width"] <= column["x"] + column["width"] + 0.5, "it spills out"
        page.fill("#f-scores", "1, 2, -1, 3, 0, 2.5")
        page.fill("#f-block", "9")
        block_error = '#sec-ledger [data-error-for="block_size"]'
        _expect(page.locator(block_error)).to_contain_text("allowed: 1..6")
        for other in ("#f-block", "#f-shift"):
            assert _apart(_box(page, block_error), _box(page, other))
        page.click('#tabs button[data-sec="backward"]')
        page.click("#bw-inputs summary")
        page.evaluate(
            "() => document.querySelector('#f-mask').append(new Option('diagonal', 'diagonal'))"
        )
        page.select_option("#f-mask", "diagonal")
        mask_error = '#sec-backward [data-error-for="mask"]'
        _expect(page.locator(mask_error)).to_contain_text("allowed:")
        for other in ("#bw-reset", "#f-conv", "#f-p", "#f-cap", "#f-slope", "#f-seed"):
            assert _apart(_box(page, mask_error), _box(page, other)), f"it covers {other}"

    browse(check, "?sec=ledger", width)


# ----------------------------------------------------------------------------- 9. the row picture

LABEL_OVERLAPS = """() => {
  const texts = [...document.querySelectorAll('#ledger-chart svg text')]
    .filter(t => t.textContent.trim());
  const boxes = texts.map(t => [t.textContent, t.getBoundingClientRect()]);
  const out = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const [a, A] = boxes[i], [b, B] = boxes[j];
    if (A.left < B.right - 0.5 && B.left < A.right - 0.5
        && A.top < B.bottom - 0.5 && B.top < A.bottom - 0.5) out.push([a, b]);
  }
  return out;
}"""


@pytest.mark.parametrize("width", [1280, 375])
def test_the_row_pictures_labels_stay_apart(browse: Callable[..., None], width: int) -> None:
    """Before: "−1" sat on the index "2"; "m = 3", "2.5", "2.178" and "ℓ" met top right."""

    def check(page: Any) -> None:
        forward = page.locator('#ledger-stepper [data-action="forward"]')
        for step in range(4):
            if step:
                forward.click()
            _expect(page.locator('[data-readout="blocks-read"] .readout-value')).to_have_text(
                f"{step} / 3"
            )
            overlaps = page.evaluate(LABEL_OVERLAPS)
            assert not overlaps, f"step {step}: labels drawn over each other: {overlaps}"
        _expect(page.locator("#ledger-chart .m-text")).to_have_text("m = 3")
        forty = ", ".join(str((i * 7) % 11 - 5) for i in range(40))
        page.fill("#f-values", "\n".join(["1, 0"] * 40))
        page.fill("#f-scores", forty)
        _expect(page.locator("#ledger-chart g.score")).to_have_count(40)
        page.locator('#ledger-stepper [data-action="end"]').click()
        _expect(page.locator("#ledger-chart .m-text")).to_have_text("m = 5")
        assert not page.evaluate(LABEL_OVERLAPS)

    browse(check, "?sec=ledger", width)


def test_a_large_shift_keeps_the_bars_in_their_panel_and_the_labels_distinct(
    browse: Callable[..., None],
) -> None:
    """Before: with Shift 1000 the bars ran into the exp(s − m) panel and read "1.00e+3"."""

    def check(page: Any) -> None:
        labels = page.locator("#ledger-chart .score-text")
        _expect(labels).to_have_count(6)
        assert labels.all_text_contents() == ["1001", "1002", "999", "1003", "1000", "1002.5"]
        _expect(page.locator("#ledger-chart .m-text")).to_have_text("m = 1003")
        weights_top = min(
            b["y"]
            for b in (x.bounding_box() for x in page.locator("#ledger-chart .weight").all())
            if b
        )
        index_top = _box(page, "#ledger-chart .pos-text")["y"]
        for bar in page.locator("#ledger-chart .score-bar").all():
            box = bar.bounding_box()
            assert box is not None and box["y"] + box["height"] <= index_top, box
        assert index_top < weights_top
        assert not page.evaluate(LABEL_OVERLAPS)
        page.fill("#f-shift", "-1000")
        _expect(labels.first).to_have_text("−999")
        assert "e" not in "".join(labels.all_text_contents())

    browse(check, "?sec=ledger&step=3&shift=1000")


# ----------------------------------------------------------------------------- 10. smaller things


def test_a_masked_entry_of_the_current_tile_reads_masked(browse: Callable[..., None]) -> None:
    """Before: the tile table showed q2's masked key as 0 while the heat map said masked."""

    def check(page: Any) -> None:
        row = page.locator('#bw-prows tr[data-row="2"]')
        _expect(row.locator('[data-col="p"] .masked-entry')).to_have_text("masked")
        _expect(row.locator('[data-col="ds"] .masked-entry')).to_have_count(1)
        _expect(row.locator('[data-col="p"] .num')).to_have_count(1)
        p = _value(page, '#bw-prows tr[data-row="2"] [data-col="p"] .num')
        assert p.startswith("0.240436"), p  # q2 sees k2 of this tile, not k3
        _expect(page.locator('#bw-prows tr[data-row="3"] .masked-entry')).to_have_count(0)
        step = page.locator('#bw-steps tr[data-step="4"]')
        _expect(step.locator(".masked-entry")).to_have_count(1)
        page.click('#lang-switch button[data-lang="zh"]')
        _expect(row.locator('[data-col="p"] .masked-entry')).to_have_text("屏蔽")

    browse(check, "?sec=backward&bstep=4")


def test_an_empty_shift_is_refused_with_a_message(browse: Callable[..., None]) -> None:
    """Before: an empty Shift field was silently taken as 0."""

    def check(page: Any) -> None:
        page.fill("#f-shift", "3")
        _expect(page.locator('[data-readout="m"] .num')).to_have_attribute("data-value", "5")
        page.fill("#f-shift", "")
        error = page.locator('#sec-ledger [data-error-for="shift"]')
        _expect(error).to_have_text("enter a number (0 for no shift)")
        _expect(page.locator("#sec-ledger")).to_have_class(re.compile(r"\bstale\b"))
        # the result shown is still the one shifted by 3
        assert _value(page, '[data-readout="m"] .num') == "5"
        page.fill("#f-shift", "0")
        _expect(error).to_have_text("")
        _expect(page.locator('[data-readout="m"] .num')).to_have_attribute("data-value", "2")

    browse(check, "?sec=ledger&step=1")
