"""benchmarks/targets.py: the speed and memory targets read from one machine's reports.

Synthetic reports in the shape ``flashledger bench`` writes them (one row per
configuration): a verdict per target with its worst row, exit status 1 when a row
misses one, 2 for reports it cannot judge (two machines, a tile sweep, no report).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "targets.py"


@pytest.fixture(scope="module")
def targets() -> Any:
    spec = importlib.util.spec_from_file_location("bench_targets", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up by name)
    spec.loader.exec_module(module)
    return module


MACHINE = {
    "cpu": "Some CPU",
    "cpu_id": "family 1, model 2",
    "isa": "AVX2 FMA",
    "threads": 2,
}


def row(length: int, dtype: str, causal: bool, **over: Any) -> dict[str, Any]:
    mb = 10.0 * length / 4096
    r = {
        "length": length,
        "dtype": dtype,
        "causal": causal,
        "batch": 1,
        "heads": 4,
        "head_dim": 64,
        "ratio_fwd": 0.8,
        "ratio_fwdbwd": 0.8,
        "pct_fma_peak": 75.0,
        "mem_ratio": 0.9,
        "flashledger": {"peak_extra_mb": mb},
        "sdpa": {"peak_extra_mb": mb / 0.9},
    }
    r.update(over)
    return r


def bench_report(rows: list[dict[str, Any]], **machine: Any) -> dict[str, Any]:
    return {
        "machine": {**MACHINE, **machine},
        "settings": {"tiles": "calibrated"},
        "results": rows,
    }


def all_rows() -> list[dict[str, Any]]:
    return [
        row(n, dt, c)
        for n in (4096, 8192)
        for dt in ("float32", "float64", "bfloat16")
        for c in (False, True)
    ]


def write(path: Path, report: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return path


def run(targets: Any, capsys: Any, *paths: Path) -> tuple[int, str, str]:
    code = targets.main([str(p) for p in paths])
    out = capsys.readouterr()
    return code, out.out, out.err


def verdict_line(out: str, start: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith(f"| {start}")]
    assert len(lines) == 1, out
    return lines[0]


def test_every_target_met_reads_met_with_its_worst_row(targets: Any, capsys: Any, tmp_path: Path):
    rows = all_rows()
    rows[3]["ratio_fwdbwd"] = 0.88  # the worst, still within 0.9
    write(tmp_path / "bench.json", bench_report(rows))
    busy = [{"length": 1024, "head_dim": 128, "tiles": "64x64", "slowdown_ratio": 1.2}]
    write(tmp_path / "contention.json", {"machine": MACHINE, "results": busy})
    dec = [{"lk": 1024, "dtype": "float32", "batch": 1, "ratio": 0.7}]
    write(tmp_path / "decode.json", {"machine": MACHINE, "fixed_cost": [], "results": dec})
    code, out, err = run(targets, capsys, tmp_path)
    assert code == 0, out + err
    assert out.startswith("Some CPU (family 1, model 2; AVX2 FMA), 2 threads")
    line = verdict_line(out, "fwd+bwd <= 0.9 x SDPA, float64")
    assert "| 4 |" in line and "0.88 x (L=4096 float64 causal)" in line
    assert line.endswith("| met |")
    assert "| 1 |" in verdict_line(out, "busy machine") and "decode" in out
    half = verdict_line(out, "fwd+bwd <= 1.0 x SDPA, bfloat16")
    assert "| 4 |" in half and half.endswith("| met |")
    assert "no rows" in verdict_line(out, "fwd+bwd <= 1.0 x SDPA, float16")


def test_a_row_that_misses_a_target_is_named_and_the_status_is_1(
    targets: Any, capsys: Any, tmp_path: Path
):
    rows = all_rows()
    rows[1]["ratio_fwd"] = 0.93  # L=4096 float32 causal
    rows[6]["pct_fma_peak"] = 69.5  # L=8192 float32 no mask
    write(tmp_path / "bench.json", bench_report(rows))
    code, out, _ = run(targets, capsys, tmp_path / "bench.json")
    assert code == 1
    fwd = verdict_line(out, "forward <= 0.9 x SDPA, float32")
    assert "0.93 x (L=4096 float32 causal)" in fwd and "**not met** in 1 of 4" in fwd
    fma = verdict_line(out, "fwd+bwd >= 70 % of the FMA peak, float32")
    assert "69.50 % (L=8192 float32 no mask)" in fma and "not met" in fma
    assert verdict_line(out, "fwd+bwd >= 70 % of the FMA peak, float64").endswith("| met |")
    assert verdict_line(out, "fwd+bwd <= 0.9 x SDPA, float32").endswith("| met |")
    assert "no rows" in verdict_line(out, "busy machine")


def test_memory_that_grows_as_l_squared_is_not_linear(targets: Any, capsys: Any, tmp_path: Path):
    rows = all_rows()
    for r in rows:
        if r["dtype"] == "float64" and not r["causal"]:
            r["flashledger"]["peak_extra_mb"] = 10.0 * (r["length"] / 4096) ** 2
    write(tmp_path / "bench.json", bench_report(rows))
    code, out, _ = run(targets, capsys, tmp_path)
    assert code == 1
    line = verdict_line(out, "memory linear")
    assert "2.00 (float64 no mask, L=4096..8192)" in line and "not met** in 1 of 6" in line


def test_rows_outside_the_targets_shapes_are_left_out(targets: Any, capsys: Any, tmp_path: Path):
    rows = [row(2048, "float32", False, ratio_fwdbwd=2.0), row(4096, "float32", False)]
    rows.append(row(4096, "float32", True, heads=8, ratio_fwd=2.0))  # H = 8: not the target's
    write(tmp_path / "bench.json", bench_report(rows))
    code, out, _ = run(targets, capsys, tmp_path)
    assert code == 0, out
    assert "| 1 |" in verdict_line(out, "fwd+bwd <= 0.9 x SDPA, float32")


def test_reports_of_two_machines_or_settings_are_refused(targets: Any, capsys: Any, tmp_path: Path):
    a = write(tmp_path / "a" / "bench.json", bench_report(all_rows()))
    held = {"environment": {"FLASHLEDGER_NATIVE_ARCH": "x86-64-v3"}}
    b = write(tmp_path / "b" / "bench.json", bench_report(all_rows(), **held))
    code, out, err = run(targets, capsys, a, b)
    assert code == 2 and out == ""
    assert "more than one machine or setting" in err
    assert str(a) in err and "set: FLASHLEDGER_NATIVE_ARCH=x86-64-v3" in err


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda d: d, "no bench*.json, contention*.json, decode*.json in this folder"),
        (lambda d: d / "missing.json", "no such file"),
        (lambda d: write(d / "x.json", {"rows": []}), "not a report of flashledger bench"),
        (lambda d: (d / "bad.json").write_text("{") and d / "bad.json", "not a readable JSON"),
        (
            lambda d: write(
                d / "bench.json", {**bench_report(all_rows()), "settings": {"tiles": "64x64"}}
            ),
            "a tile sweep",
        ),
        (
            lambda d: write(
                d / "bench.json",
                bench_report([{"dtype": "float32", "batch": 1, "heads": 4, "head_dim": 64}]),
            ),
            "lacks a field the targets read (KeyError('length'))",
        ),
        (  # a row without a figure is refused, not left out of the target it would judge
            lambda d: write(
                d / "bench.json",
                bench_report(
                    [{k: v for k, v in r.items() if k != "ratio_fwdbwd"} for r in all_rows()]
                ),
            ),
            "row L=4096 float32 no mask: no ratio_fwdbwd (got None); the target cannot be judged",
        ),
        (
            lambda d: write(
                d / "bench.json",
                bench_report([*all_rows()[:1], row(8192, "float64", True, pct_fma_peak=None)]),
            ),
            "row L=8192 float64 causal: no pct_fma_peak (got None)",
        ),
    ],
    ids=[
        "empty folder",
        "missing file",
        "not a report",
        "not JSON",
        "tile sweep",
        "no length",
        "no ratio",
        "no FMA share",
    ],
)
def test_unusable_input_says_why_and_exits_2(
    targets: Any, capsys: Any, tmp_path: Path, make: Any, reason: str
):
    code, out, err = run(targets, capsys, make(tmp_path))
    assert code == 2 and out == ""
    assert err.startswith("targets: ") and reason in err


def test_a_figure_that_rounds_to_its_bound_is_shown_past_it(
    targets: Any, capsys: Any, tmp_path: Path
):
    """0.9007 misses 0.9 but reads 0.90 with two decimals, beside "not met"; 0.8954 meets
    it and reads 0.90 too: both are shown with four decimals, any other with two."""
    for value, verdict in ((0.9007, "**not met** in 1 of 4"), (0.8954, "met")):
        rows = [row(n, "float32", c) for n in (4096, 8192) for c in (False, True)]
        rows[1]["ratio_fwd"] = value
        path = write(tmp_path / str(value) / "bench.json", bench_report(rows))
        code, out, _ = run(targets, capsys, path)
        line = verdict_line(out, "forward <= 0.9 x SDPA, float32")
        assert f"| {value:.4f} x (L=4096 float32 causal) | {verdict} |" in line, line
        assert code == (1 if verdict != "met" else 0)
    code, out, _ = run(targets, capsys, path)
    assert "| 0.80 x (L=4096 float32 no mask) | met |" in verdict_line(
        out, "fwd+bwd <= 0.9 x SDPA, float32"
    )


def test_a_folder_s_reports_are_read_by_name_and_each_file_once(
    targets: Any, capsys: Any, tmp_path: Path
):
    """A folder gives every bench*.json, contention*.json and decode*.json in it (runs
    repeated as contention-1.json, contention-2.json, ...), not its other JSON; a file
    named twice, or a folder and a file in it, is read once (its rows counted once)."""
    write(tmp_path / "bench.json", bench_report(all_rows()))
    busy = {"machine": MACHINE, "results": [
        {"length": 1024, "head_dim": 128, "tiles": "64x64", "slowdown_ratio": 1.1}]}  # fmt: skip
    write(tmp_path / "contention-1.json", busy | {"results": [busy["results"][0]]})
    write(tmp_path / "contention-2.json", busy | {
        "results": [busy["results"][0] | {"slowdown_ratio": 1.7}]})  # fmt: skip
    write(tmp_path / "model_bench.json", {"machine": {"cpu": "another"}, "results": []})
    code, out, _ = run(targets, capsys, tmp_path, tmp_path / "bench.json", tmp_path / "bench.json")
    assert "model_bench" not in out and out.count("bench.json") == 1, out
    assert verdict_line(out, "fwd+bwd <= 0.9 x SDPA, float32").startswith(
        "| fwd+bwd <= 0.9 x SDPA, float32 | 4 |"
    )
    busy_line = verdict_line(out, "busy machine")
    assert "| 2 | 1.70 x" in busy_line and "**not met** in 1 of 2" in busy_line, busy_line
    assert code == 1
