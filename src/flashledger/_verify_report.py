"""The verification report: rows, a grouped summary, text, rich, JSON and HTML."""

from __future__ import annotations

import html
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["Fact", "VerifyReport", "VerifyRow"]

STATUSES = ("passed", "failed", "unsupported")
DTYPE_ORDER = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
SHORT_DTYPE = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


@dataclass(frozen=True)
class VerifyRow:
    """One system, under one convention, on one case."""

    system: str  # e.g. "SDPA flash (CPU kernel)"
    convention: str  # preset name, e.g. "sdpa_cpu"
    case: str  # case name, e.g. "causal_bottom_right B1 H2 97x113 d5 float16 [sdpa_cpu]"
    dtype: str  # "float16", ...; "-" where dtypes do not apply
    checked: str  # quantities compared, e.g. "O LSE dQ dK dV"
    worst: str  # the quantity closest to (or past) its bound
    error: float  # its error (unit below)
    bound: float  # its bound
    status: str  # "passed", "failed" or "unsupported"
    unit: str = "abs"  # "abs" (max absolute error), "ulp" or "tiles" (mismatching tiles)
    detail: str = ""  # the failure message, the reason it is unsupported, or what was not checked

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"VerifyRow.status must be one of {STATUSES}, got {self.status!r}")


def count_row(
    system: str, convention: str, case: str, checked: str, differ: int, detail: str
) -> VerifyRow:
    """A row that counts mismatches (tiles, blocks): passed when ``differ`` is 0 and no
    ``detail`` says what else differs; the detail is kept only for a failure."""
    ok = differ == 0 and not detail
    return VerifyRow(
        system=system,
        convention=convention,
        case=case,
        dtype="-",
        checked=checked,
        worst="tiles" if checked == "tile classes" else "blocks",
        error=float(differ),
        bound=0.0,
        status="passed" if ok else "failed",
        unit="tiles",
        detail="" if ok else detail,
    )


@dataclass(frozen=True)
class Fact:
    """A behaviour of the installed PyTorch, observed by running it."""

    system: str
    question: str
    observed: str


@dataclass(frozen=True)
class _Group:
    system: str
    convention: str
    rows: tuple[VerifyRow, ...]

    @property
    def status(self) -> str:
        counts = {s: sum(r.status == s for r in self.rows) for s in STATUSES}
        if counts["failed"]:
            return f"FAILED {counts['failed']}/{len(self.rows)}"
        if counts["unsupported"] == len(self.rows):
            return "unsupported"
        if counts["unsupported"]:
            return f"passed ({counts['unsupported']} unsup.)"
        return "passed"

    @property
    def dtypes(self) -> str:
        found = {r.dtype for r in self.rows}
        if found == set(DTYPE_ORDER):
            return "all"
        ordered = sorted(found, key=lambda d: DTYPE_ORDER.get(d, 9))
        return " ".join(SHORT_DTYPE.get(d, d) for d in ordered)

    @property
    def worst(self) -> VerifyRow:
        judged = [r for r in self.rows if r.status != "unsupported"] or list(self.rows)
        return max(judged, key=_ratio)


def _ratio(row: VerifyRow) -> float:
    if row.status == "unsupported":
        return -1.0
    if row.bound == 0:
        return 0.0 if row.error == 0 else math.inf
    return row.error / row.bound


def _num(x: float, unit: str) -> str:
    if unit == "tiles":
        return f"{x:.0f}"
    if unit == "ulp":
        return f"{x:.2f} ulp"
    return f"{x:.2e}"


@dataclass
class VerifyReport:
    """Rows of a verification run, with the facts observed on the way.

    ``passed`` is True when no row failed (unsupported rows are reported, not
    failures). ``str(report)`` is the grouped summary table as plain text;
    ``rich_table()`` the same for a terminal; ``to_json()`` / ``to_html()``
    hold every row.
    """

    rows: list[VerifyRow] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)
    seconds: float = 0.0
    quick: bool = False
    torch_version: str = field(default_factory=lambda: torch.__version__)

    @property
    def passed(self) -> bool:
        return not any(r.status == "failed" for r in self.rows)

    @property
    def failures(self) -> list[VerifyRow]:
        return [r for r in self.rows if r.status == "failed"]

    def counts(self) -> dict[str, int]:
        """Rows by status."""
        return {s: sum(r.status == s for r in self.rows) for s in STATUSES}

    def summary(self) -> str:
        """One line: counts, time, verdict."""
        c = self.counts()
        verdict = "PASSED" if self.passed else "FAILED"
        mode = "quick" if self.quick else "full"
        return (
            f"verify ({mode}, torch {self.torch_version}): {verdict}: {c['passed']} passed, "
            f"{c['failed']} failed, {c['unsupported']} unsupported in {self.seconds:.1f} s"
        )

    def groups(self) -> list[_Group]:
        """Rows grouped by (system, convention), each in first-seen order."""
        found: dict[tuple[str, str], list[VerifyRow]] = {}
        systems: dict[str, int] = {}
        conventions: dict[str, int] = {}
        for r in self.rows:
            found.setdefault((r.system, r.convention), []).append(r)
            systems.setdefault(r.system, len(systems))
            conventions.setdefault(r.convention, len(conventions))
        keys = sorted(found, key=lambda k: (systems[k[0]], conventions[k[1]]))
        return [_Group(s, c, tuple(found[(s, c)])) for s, c in keys]

    def _table_rows(self) -> list[list[str]]:
        out = []
        for g in self.groups():
            w = g.worst
            n = str(len(g.rows))
            if w.status == "unsupported":
                out.append(
                    [g.system, g.convention, n, g.dtypes, "-", "-", "-", "(see below)", g.status]
                )
                continue
            case = w.case.removesuffix(f" [{g.convention}]")
            for long, short in SHORT_DTYPE.items():
                case = case.replace(f" {long}", f" {short}")
            err, bound = _num(w.error, w.unit), _num(w.bound, w.unit)
            checked: list[str] = []  # every quantity any case of the row compared
            for r in g.rows:
                if r.status != "unsupported":
                    checked += [x for x in r.checked.split() if x not in checked]
            row = [
                g.system,
                g.convention,
                n,
                g.dtypes,
                " ".join(checked),
                err,
                bound,
                f"{w.worst} @ {case}",
                g.status,
            ]
            out.append(row)
        return out

    def unsupported(self) -> list[tuple[str, str, int, str]]:
        """``(system, convention, cases, reason)`` for each distinct reason a system gave."""
        found: dict[tuple[str, str, str], int] = {}
        for r in self.rows:
            if r.status == "unsupported":
                key = (r.system, r.convention, r.detail)
                found[key] = found.get(key, 0) + 1
        return [(s, c, n, reason) for (s, c, reason), n in found.items()]

    HEADERS = (
        "system", "convention", "n", "dtypes", "checked", "error", "bound",
        "worst (quantity @ case)", "status",
    )  # fmt: skip

    def rich_table(self) -> Any:
        """A ``rich.table.Table`` of the grouped summary."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(
            title=self.summary(), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False
        )
        rows = self._table_rows()
        for i, h in enumerate(self.HEADERS):
            numeric = h in ("n", "error", "bound")
            # a number stays on one line, a word too (text wraps at its spaces)
            cells = [r[i] for r in rows] if numeric else [w for r in rows for w in r[i].split()]
            table.add_column(
                h,
                overflow="fold",
                no_wrap=h.startswith("worst"),
                justify="right" if numeric else "left",
                min_width=max([len(c) for c in cells] + [len(w) for w in h.split()]),
            )
        for row in rows:
            style = (
                "red"
                if row[8].startswith("FAILED")
                else ("yellow" if row[8] == "unsupported" else None)
            )
            table.add_row(*(Text(cell) for cell in row), style=style)
        return table

    def __rich__(self) -> Any:
        return self.rich_table()

    def render_text(self, *, width: int = 200) -> str:
        """The summary table, the failures and the observed facts as plain text."""
        from rich.console import Console

        buf = io.StringIO()
        self.print_to(Console(file=buf, width=width, no_color=True, highlight=False, emoji=False))
        return buf.getvalue()

    def print_to(self, console: Any) -> None:
        """Print the summary table, every failure and the observed facts on a rich console."""
        console.print(self.rich_table())
        for r in self.failures:
            console.print(
                f"FAILED {r.system} [{r.convention}] {r.detail}", soft_wrap=True, markup=False
            )
        gaps = self.unsupported()
        if gaps:
            console.print("Unsupported on CPU (reported, not failed):")
            for system, conv, n, reason in gaps:
                line = f"  {system} [{conv}], {n} case{'s' if n > 1 else ''}: {reason}"
                console.print(line, soft_wrap=True, markup=False)
        if self.facts:
            console.print("Observed in this PyTorch:")
            for f in self.facts:
                line = f"  {f.system}: {f.question} -> {f.observed}"
                console.print(line, soft_wrap=True, markup=False)

    def __str__(self) -> str:
        return self.render_text()

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "quick": self.quick,
            "torch": self.torch_version,
            "seconds": round(self.seconds, 3),
            "counts": self.counts(),
            "facts": [asdict(f) for f in self.facts],
            "rows": [_json_row(r) for r in self.rows],
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """Every row and fact as JSON (infinite errors as the string ``"inf"``)."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_html(self) -> str:
        """A standalone HTML page (inline CSS, no external resources)."""
        return _PAGE.format(fragment=self._html_fragment())

    def _repr_html_(self) -> str:
        """The report in a notebook: a fragment whose style applies to it alone."""
        return self._html_fragment()

    def _html_fragment(self) -> str:
        e = html.escape

        def row(cells: Sequence[str], css: str) -> str:
            tds = "".join(
                f"<td class='num'>{e(c)}</td>" if _NUMERIC.match(c) else f"<td>{e(c)}</td>"
                for c in cells
            )
            return f"<tr class='{css}'>{tds}</tr>"

        summary = []
        for cells in self._table_rows():
            if cells[8] == "unsupported":
                reasons = {
                    r.detail for r in self.rows if (r.system, r.convention) == (cells[0], cells[1])
                }
                cells = [*cells[:7], "; ".join(sorted(reasons)), cells[8]]
            summary.append(row(cells, _css(cells[8])))
        cols = (
            "system",
            "convention",
            "case",
            "checked",
            "worst",
            "error",
            "bound",
            "status",
            "detail",
        )
        judged = {"passed", "failed"}
        detail = [
            row(
                (
                    r.system, r.convention, r.case, r.checked, r.worst,
                    _num(r.error, r.unit) if r.status in judged else "-",
                    _num(r.bound, r.unit) if r.status in judged else "-",
                    r.status, r.detail,
                ),
                _css(r.status),
            )
            for r in self.rows
        ]  # fmt: skip
        facts = [row((f.system, f.question, f.observed), "") for f in self.facts]
        return _FRAGMENT.format(
            title=e(self.summary()),
            head="".join(f"<th>{e(h)}</th>" for h in self.HEADERS),
            summary="".join(summary),
            detail_head="".join(f"<th>{e(c)}</th>" for c in cols),
            detail="".join(detail),
            facts_block=_FACTS.format(facts="".join(facts)) if facts else "",
            rule=e(RULE_TEXT),
        )


RULE_TEXT = (
    "A row passes when error <= factor x (error of a naive PyTorch attention in the same dtype) + floor, "
    "all against the float64 oracle with the row's conventions; factor 2 for O and LSE, 3 for dQ, dK, dV; "
    "floor = (eps(dtype) + eps(acc) sqrt(n)) max(1, max|oracle|), acc = float32 for half inputs, "
    "n = length of the longest chain of sums (Lk for O, LSE; + d_v for dQ, dK: dP - D). mpmath rows: ulps of the largest element against 50 digits. "
    "Tile rows: number of tiles classified differently."
)


_NUMERIC = re.compile(r"^-?[0-9.]+(e[+-][0-9]+)?( ulp)?$")


def _json_row(r: VerifyRow) -> dict[str, Any]:
    d = asdict(r)
    for key in ("error", "bound"):
        if not math.isfinite(d[key]):
            d[key] = str(d[key])
    return d


def _css(status: str) -> str:
    if status.lower().startswith("failed"):
        return "failed"
    return "unsupported" if status == "unsupported" else "passed"


_STYLE = """<style>
.fl-verify {{ font-family: system-ui, sans-serif; color: #222; }}
.fl-verify table {{ border-collapse: collapse; margin: 1em 0; font-size: 13px; }}
.fl-verify th, .fl-verify td {{ border: 1px solid #ccc; padding: 3px 6px; text-align: left;
  vertical-align: top; }}
.fl-verify th {{ background: #f0f0f0; }}
.fl-verify tr.failed td {{ background: #fde2e2; }}
.fl-verify tr.unsupported td {{ background: #fff6d6; }}
.fl-verify p.rule {{ max-width: 60em; }}
.fl-verify td.num {{ white-space: nowrap; text-align: right; }}
</style>"""
_FACTS = """<h2>Observed in this PyTorch</h2>
<table><thead><tr><th>system</th><th>question</th><th>observed</th></tr></thead><tbody>{facts}</tbody></table>
"""
# the report as a fragment: its style scoped to the .fl-verify block (a notebook shows it
# among other outputs), and as a page around it
_FRAGMENT = (
    _STYLE
    + """
<div class="fl-verify">
<h1>flashledger verify</h1>
<p><b>{title}</b></p>
<p class="rule">{rule}</p>
<h2>Summary</h2>
<table><thead><tr>{head}</tr></thead><tbody>{summary}</tbody></table>
{facts_block}<h2>Every row</h2>
<table><thead><tr>{detail_head}</tr></thead><tbody>{detail}</tbody></table>
</div>
"""
)
_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>flashledger verify</title>
<style>body {{ margin: 2em; }}</style></head><body>
{fragment}</body></html>
"""
