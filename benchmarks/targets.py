"""The speed and memory targets, read from the reports of one machine's benchmark runs.

Reads the JSON that ``flashledger bench`` writes (``bench.json``; ``contention.json`` with
``--contention``, ``decode.json`` with ``--decode``) and prints, for each target, the rows
it covers, the worst of them and whether every row meets it:

- float32 and float64, L >= 4096, B = 1, H = 4, d = 64, causal and not: forward + backward
  and the forward alone at most 0.9 x SDPA's time; forward + backward at 70 % or more of
  the register FMA peak measured in the same rounds;
- bfloat16 and float16 (the same rows): forward + backward and forward at most 1.0 x SDPA;
- every dtype: peak extra memory at most 1.5 x SDPA's, and linear in L (memory grows as
  L^e with e at most 1.2 between the shortest and the longest length of a configuration;
  a stored L x L matrix would give 2);
- a busy machine (``--contention``): flashledger's slowdown at most 1.5 x SDPA's;
- decode (``--decode``): every row at most 1.0 x SDPA's time.

Every report must come from the same machine (CPU, thread count and the environment that
steers the run); a report of a tile sweep (``--tiles``) is refused, since the targets are
for the tiles the native step chose, and so is a row without a figure a target reads (a
target is judged on every row it covers, or not at all). Arguments are report files or
the folders that hold them (every ``bench*.json``, ``contention*.json`` and
``decode*.json`` there; a file named twice is read once)::

    .venv/bin/python benchmarks/targets.py benchmarks/results
    .venv/bin/python benchmarks/targets.py run/bench.json run/l16384/bench.json run/contention.json

Exit status 0 when every target with rows is met, 1 when one is not, 2 on unusable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPORTS = ("bench.json", "contention.json", "decode.json")
TARGET_SHAPE = {"batch": 1, "heads": 4, "head_dim": 64}
MIN_LENGTH = 4096
TIME_BOUNDS = {"float32": 0.9, "float64": 0.9, "bfloat16": 1.0, "float16": 1.0}  # x SDPA's time
LINEAR_EXPONENT = 1.2


class Unusable(Exception):
    """A report that cannot be read as one machine's benchmark results."""


@dataclass(frozen=True)
class Verdict:
    """One target over the rows it covers: ``worst`` the worst value and its row."""

    target: str
    rows: int
    failed: int
    worst: float | None
    where: str
    unit: str
    bound: float

    @property
    def met(self) -> bool | None:
        return None if self.rows == 0 else self.failed == 0

    def line(self) -> str:
        if self.rows == 0 or self.worst is None:
            return f"| {self.target} | 0 | - | no rows |"
        worst = f"{shown(self.worst, self.bound)}{self.unit} ({self.where})"
        state = "met" if self.failed == 0 else f"**not met** in {self.failed} of {self.rows}"
        return f"| {self.target} | {self.rows} | {worst} | {state} |"


def shown(value: float, bound: float) -> str:
    """``value`` with two decimals, or four where two would print the bound itself (0.9007
    is not met by 0.9, though it reads 0.90)."""
    text = f"{value:.2f}"
    return f"{value:.4f}" if text == f"{bound:.2f}" and value != bound else text


def row_name(r: dict[str, Any]) -> str:
    mask = "causal" if r.get("causal") else "no mask"
    return f"L={r['length']} {r['dtype']} {mask}"


def verdict(
    target: str,
    rows: Iterable[dict[str, Any]],
    value: Callable[[dict[str, Any]], float],
    bound: float,
    name: Callable[[dict[str, Any]], str] = row_name,
    *,
    higher_is_better: bool = False,
    unit: str = "",
) -> Verdict:
    """``target`` over ``rows``: how many miss ``bound`` (at least it where higher is
    better, else at most) and the worst value (the lowest where higher is better, else
    the highest)."""
    seen = [(value(r), r) for r in rows]
    if not seen:
        return Verdict(target, 0, 0, None, "", unit, bound)
    pick = min if higher_is_better else max
    worst, row = pick(seen, key=lambda vr: vr[0])
    failed = sum((v < bound) if higher_is_better else (v > bound) for v, _ in seen)
    return Verdict(target, len(seen), failed, worst, name(row), unit, bound)


def figure(field: str, name: Callable[[dict[str, Any]], str] = row_name) -> Callable[..., float]:
    """A row's ``field`` as a number; a row without it is refused (``Unusable``), never
    left out of the target it would judge."""

    def read(r: dict[str, Any]) -> float:
        v = r.get(field)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise Unusable(f"row {name(r)}: no {field} (got {v!r}); the target cannot be judged")
        return float(v)

    return read


def at_most(
    target: str,
    rows: Iterable[dict[str, Any]],
    field: str,
    bound: float,
    name: Callable[[dict[str, Any]], str] = row_name,
) -> Verdict:
    """``target``: every row's ``field`` (a ratio to SDPA's) at most ``bound``."""
    return verdict(target, rows, figure(field, name), bound, name, unit=" x")


def memory_exponents(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration (dtype, mask) with peak memory at two lengths or more: the exponent
    ``e`` of flashledger's peak extra memory ~ L^e between its shortest and longest length."""
    groups: dict[tuple[str, bool], list[tuple[int, float]]] = {}
    for r in rows:
        mb = (r.get("flashledger") or {}).get("peak_extra_mb")
        if mb:
            groups.setdefault((r["dtype"], bool(r.get("causal"))), []).append((r["length"], mb))
    out = []
    for (dtype, causal), pts in groups.items():
        pts.sort()
        (l0, m0), (l1, m1) = pts[0], pts[-1]
        if l1 > l0:
            e = math.log(m1 / m0) / math.log(l1 / l0)
            out.append({"dtype": dtype, "causal": causal, "lengths": (l0, l1), "exponent": e})
    return out


def load(paths: list[Path]) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """The reports under ``paths`` (files, or folders holding ``bench*.json``,
    ``contention*.json``, ``decode*.json``), by kind; each file once."""
    found: dict[str, list[tuple[Path, dict[str, Any]]]] = {k: [] for k in REPORTS}
    read: set[Path] = set()
    for p in paths:
        stems = tuple(k.removesuffix(".json") for k in REPORTS)
        files = (
            sorted(f for f in p.glob("*.json") if f.name.startswith(stems) and f.is_file())
            if p.is_dir()
            else [p]
        )
        if p.is_dir() and not files:
            raise Unusable(f"{p}: no {', '.join(f'{s}*.json' for s in stems)} in this folder")
        for f in files:
            if not f.is_file():
                raise Unusable(f"{f}: no such file")
            if f.resolve() in read:
                continue
            read.add(f.resolve())
            try:
                report = json.loads(f.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise Unusable(f"{f}: not a readable JSON report ({exc})") from None
            kind = kind_of(report)
            if kind is None:
                raise Unusable(f"{f}: not a report of flashledger bench (no machine and results)")
            found[kind].append((f, report))
    return found


def kind_of(report: Any) -> str | None:
    """Which report ``report`` is (by its fields), or None when it is none of them."""
    if not isinstance(report, dict) or not isinstance(report.get("machine"), dict):
        return None
    if not isinstance(report.get("results"), list) or not all(
        isinstance(r, dict) for r in report["results"]
    ):
        return None
    if "fixed_cost" in report:
        return "decode.json"
    results = report["results"]
    if results and isinstance(results[0], dict) and "slowdown_ratio" in results[0]:
        return "contention.json"
    return "bench.json"


def machine_key(m: dict[str, Any]) -> tuple[Any, ...]:
    env = tuple(sorted((m.get("environment") or {}).items()))
    return (m.get("cpu"), m.get("cpu_id"), m.get("isa"), m.get("threads"), env)


def describe(m: dict[str, Any]) -> str:
    env = " ".join(f"{k}={v}" for k, v in sorted((m.get("environment") or {}).items()))
    text = f"{m.get('cpu')} ({m.get('cpu_id')}; {m.get('isa')}), {m.get('threads')} threads"
    return text + (f"; set: {env}" if env else "")


def verdicts(found: dict[str, list[tuple[Path, dict[str, Any]]]]) -> list[Verdict]:
    """Every target's verdict over the rows of ``found`` (one machine's reports)."""
    rows: list[dict[str, Any]] = []
    for path, report in found["bench.json"]:
        if (report.get("settings") or {}).get("tiles", "calibrated") != "calibrated":
            raise Unusable(f"{path}: a tile sweep (--tiles); the targets are for the chosen tiles")
        rows += [
            r for r in report["results"] if all(r.get(k) == v for k, v in TARGET_SHAPE.items())
        ]
    long = [r for r in rows if r["length"] >= MIN_LENGTH]
    out = []
    for dtype, bound in TIME_BOUNDS.items():
        mine = [r for r in long if r["dtype"] == dtype]
        for what, field in (("fwd+bwd", "ratio_fwdbwd"), ("forward", "ratio_fwd")):
            out.append(at_most(f"{what} <= {bound} x SDPA, {dtype}", mine, field, bound))
        if dtype in ("float32", "float64"):
            out.append(
                verdict(
                    f"fwd+bwd >= 70 % of the FMA peak, {dtype}",
                    mine,
                    figure("pct_fma_peak"),
                    70,
                    higher_is_better=True,
                    unit=" %",
                )
            )
    out += [
        at_most("peak extra memory <= 1.5 x SDPA", rows, "mem_ratio", 1.5),
        verdict(
            f"memory linear in L (L^e, e <= {LINEAR_EXPONENT})",
            memory_exponents(rows),
            lambda g: g["exponent"],
            LINEAR_EXPONENT,
            lambda g: (
                f"{g['dtype']} {'causal' if g['causal'] else 'no mask'}, "
                f"L={g['lengths'][0]}..{g['lengths'][1]}"
            ),
        ),
    ]
    busy = [r for _, rep in found["contention.json"] for r in rep["results"]]
    out.append(
        at_most(
            "busy machine: slowdown <= 1.5 x SDPA's",
            busy,
            "slowdown_ratio",
            1.5,
            lambda r: f"L={r['length']} d={r['head_dim']} tiles {r['tiles']}",
        )
    )
    dec = [r for _, rep in found["decode.json"] for r in rep["results"]]
    out.append(
        at_most(
            "decode <= 1.0 x SDPA",
            dec,
            "ratio",
            1.0,
            lambda r: f"Lk={r['lk']} {r['dtype']} B={r['batch']}",
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="report files or folders holding them")
    args = ap.parse_args(argv)
    try:
        found = load(args.paths)
        reports = [(p, r) for kind in REPORTS for p, r in found[kind]]
        machines = {machine_key(r["machine"]): (p, r["machine"]) for p, r in reports}
        if len(machines) > 1:
            lines = "\n".join(f"  {p}: {describe(m)}" for p, m in machines.values())
            raise Unusable(f"the reports come from more than one machine or setting:\n{lines}")
        try:
            results = verdicts(found)
        except (KeyError, TypeError, ValueError) as exc:
            raise Unusable(f"a report's row lacks a field the targets read ({exc!r})") from None
    except Unusable as exc:
        print(f"targets: {exc}", file=sys.stderr)
        return 2
    ((_, machine),) = machines.values()
    print(describe(machine))
    print(f"reports: {', '.join(str(p) for p, _ in reports)}\n")
    print("| target | rows | worst | verdict |")
    print("|---|---|---|---|")
    for v in results:
        print(v.line())
    return 1 if any(v.met is False for v in results) else 0


if __name__ == "__main__":
    sys.exit(main())
