"""``run_matrix`` (what ``flashledger verify --quick`` runs), its report and the CLI hooks."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

import flashledger.verify as verify
from flashledger import cli
from flashledger.verify import VerifyReport, VerifyRow, run_matrix


@pytest.fixture(scope="module")
def quick_report() -> tuple[VerifyReport, list[tuple[int, int, str]]]:
    calls: list[tuple[int, int, str]] = []
    report = run_matrix(
        quick=True, progress=lambda done, total, label: calls.append((done, total, label))
    )
    return report, calls


def test_quick_matrix_passes(quick_report: tuple[VerifyReport, list[tuple[int, int, str]]]) -> None:
    report, _ = quick_report
    failed = report.failures
    assert report.passed, "\n".join(f"{r.system} [{r.convention}] {r.detail}" for r in failed[:5])
    counts = report.counts()
    assert counts["failed"] == 0 and counts["passed"] > 500, counts
    systems = {r.system for r in report.rows}
    for name in (
        "flashledger fa2 64x32", "flashledger fa1 32x64", "SDPA math", "SDPA flash (CPU kernel)",
        "aten CPU flash op", "SDPA is_causal=True", "SDPA causal_upper_left",
        "SDPA causal_lower_right", "FlexAttention eager", "FlexAttention backward",
        "Flex BlockMask tiles", "mpmath vs reference", "mpmath vs blocked 4x4",
        "flash-attn 2 window -1", "flash-attn 2 ALiBi LSE", "flash-attn 2 cap+drop",
        "flashledger Flex fwd", "flashledger Flex max", "flashledger MaskMod",
        "flashledger Flex grads", "MaskMod tiles", "fl.create_block_mask",
    ):  # fmt: skip
        assert name in systems, f"{name} missing from the matrix"
    fl_presets = {r.convention for r in report.rows if r.system == "flashledger fa2 64x32"}
    assert fl_presets == {"seed", "flash_attn_2", "flash_attn_3", "flex_attention", "sdpa_cpu"}
    unsupported = [r for r in report.rows if r.status == "unsupported"]
    assert unsupported and all(r.system == "FlexAttention backward" for r in unsupported)
    assert all("backward on CPU" in r.detail for r in unsupported)
    mp_rows = [r for r in report.rows if r.unit == "ulp"]
    assert mp_rows and all(r.error <= r.bound == verify.MP_ULP_BOUND for r in mp_rows)
    lse_checked = {r.system for r in report.rows if "LSE" in r.checked}
    assert {"aten CPU flash op", "FlexAttention eager", "flashledger fa2 64x32"} <= lse_checked
    assert len(report.facts) == 10


def test_progress_counts_every_step(
    quick_report: tuple[VerifyReport, list[tuple[int, int, str]]],
) -> None:
    _, calls = quick_report
    total = calls[0][1]
    assert [c[0] for c in calls] == list(range(1, total + 1))
    assert total == verify.matrix_steps(quick=True)
    assert calls[-1][2] == "mpmath"


def test_report_renderings(quick_report: tuple[VerifyReport, list[tuple[int, int, str]]]) -> None:
    report, _ = quick_report
    data = json.loads(report.to_json())
    assert (
        data["passed"] is True and data["quick"] is True and len(data["rows"]) == len(report.rows)
    )
    assert set(data["rows"][0]) >= {"system", "convention", "case", "error", "bound", "status"}
    text = str(report)
    assert text.startswith("verify (quick, torch") or "verify (quick, torch" in text.splitlines()[0]
    assert (
        "PASSED" in text
        and "Observed in this PyTorch:" in text
        and "FlexAttention backward" in text
    )
    page = report.to_html()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert page.count("<tr") > len(report.rows)
    table = report.rich_table()
    assert table.row_count == len(report.groups()) and table.row_count < 40


def test_report_with_a_failure_and_infinite_error() -> None:
    row = VerifyRow(
        system="mine", convention="seed", case="empty_rows B1 H2 4x4 d2 float32 [seed]", dtype="float32",
        checked="O", worst="O", error=math.inf, bound=1e-6, status="failed", detail="got nan",
    )  # fmt: skip
    report = VerifyReport(rows=[row])
    assert not report.passed and report.failures == [row]
    assert json.loads(report.to_json())["rows"][0]["error"] == "inf"
    assert "FAILED 1/1" in str(report) and "FAILED mine [seed] got nan" in str(report)
    assert "class='failed'" in report.to_html()
    # in a notebook: a fragment whose every style rule is scoped to it, no page around it
    frag = report._repr_html_()
    assert "<html" not in frag and "<body" not in frag and "class='failed'" in frag
    rules = re.findall(r"^([^{}\n]+)\{", frag.split("</style>")[0], re.M)
    assert rules and all(
        sel.strip().startswith(".fl-verify") for r in rules for sel in r.split(",")
    )
    assert "Observed in this PyTorch" not in frag  # no facts: no empty table
    with pytest.raises(ValueError, match="status must be one of"):
        VerifyRow("s", "c", "x", "-", "O", "O", 0.0, 0.0, "skipped")


# -- CLI hooks ----------------------------------------------------------------------------
def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flashledger verify")
    verify.add_cli_arguments(parser)
    return parser.parse_args(argv)


def test_cli_arguments() -> None:
    args = _args("--quick", "--json", "--html", "out.html")
    assert args.quick and args.json and args.html == "out.html"
    assert not _args().quick and _args().html is None


def test_run_cli_prints_writes_and_returns_status(
    quick_report: tuple[VerifyReport, list[tuple[int, int, str]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path,
) -> None:
    report, _ = quick_report
    seen: list[bool] = []

    def fake_matrix(*, quick: bool = False, progress=None) -> VerifyReport:
        seen.append(quick)
        return report

    monkeypatch.setattr(verify, "run_matrix", fake_matrix)
    monkeypatch.setattr(verify, "matrix_steps", lambda *, quick=False: 1)
    html = tmp_path / "verify.html"
    assert verify.run_cli(_args("--quick", "--html", str(html))) == 0 and seen == [True]
    out = capsys.readouterr().out
    assert "PASSED" in out and "SDPA math" in out and "Observed in this PyTorch:" in out
    assert html.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert verify.run_cli(_args("--json")) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True
    # through the real command line
    assert cli.main(["verify", "--quick", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["failed"] == 0

    broken = VerifyReport(
        rows=[
            *report.rows[:3],
            VerifyRow(
                "mine", "seed", "c", "float32", "O", "O", 1.0, 0.1, "failed", detail="detail"
            ),
        ]
    )
    monkeypatch.setattr(verify, "run_matrix", lambda *, quick=False, progress=None: broken)
    assert verify.run_cli(_args()) == 1
    assert "FAILED mine [seed] detail" in capsys.readouterr().out


def test_run_cli_rejects_an_unwritable_html_path(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    code = verify.run_cli(_args("--html", str(tmp_path / "missing" / "v.html")))
    err = capsys.readouterr().err
    assert code == 2 and "cannot write --html" in err and "directory does not exist" in err
    assert len(err.strip().splitlines()) == 1
    assert verify.run_cli(_args("--html", str(tmp_path))) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_full_matrix_passes() -> None:
    report = run_matrix()
    assert report.passed, "\n".join(
        f"{r.system} [{r.convention}] {r.detail}" for r in report.failures[:5]
    )
    assert report.counts()["passed"] > 2500


def test_the_create_block_mask_row_fails_on_other_blocks_or_another_layout(monkeypatch) -> None:
    """The row compares the blocks' kinds first, then every index tensor: a block mask of
    another mask_mod fails on the kinds, one laid out in another order on the layout."""
    import torch

    from flashledger import _blockmask, _verify_flex

    case = next(c for c in _verify_flex.flex_cases(quick=True) if c.mask_mod is not None)
    assert _verify_flex._block_mask_row(case).status == "passed"

    real = _blockmask.create_block_mask

    def everything(*args, **kwargs):  # every block visible, whatever the mask_mod
        return real(lambda b, h, q, kv: q >= 0, *args[1:], **kwargs)

    monkeypatch.setattr(_blockmask, "create_block_mask", everything)
    row = _verify_flex._block_mask_row(case)
    assert row.status == "failed" and row.error > 0 and "differ in kind" in row.detail

    monkeypatch.setattr(_blockmask, "create_block_mask", real)
    ordered = _blockmask._ordered

    def flipped(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unlisted blocks after the listed ones in descending order (torch: ascending)."""
        num, idx = ordered(dense)
        j = torch.arange(idx.shape[-1])
        n = num[..., None].long()
        slots = torch.where(j < n, j, idx.shape[-1] - 1 - j + n)
        return num, idx.gather(-1, slots).contiguous()

    monkeypatch.setattr(_blockmask, "_ordered", flipped)
    row = _verify_flex._block_mask_row(case)
    assert row.status == "failed" and row.error == 0
    assert "laid out differently in kv_indices" in row.detail
