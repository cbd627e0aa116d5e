"""The explorer under load: trivial-request latency and the server's memory.

Starts the explorer (``python -m flashledger.web --port 0``) in its own process,
warms it up with one request per endpoint at the page's defaults, reads its
idle RSS (``/proc/PID/status``), then sends ``--requests`` parallel worst-case
requests while a prober asks for ``GET /api/examples``, ``GET /`` and a static
file every 100 ms. It prints the answers by status, the prober's latency
(median, 95th percentile, max) and the RSS before, at its peak and over the 10 s
after the load, with the time RSS took to come back within 1.5x of idle.

    .venv/bin/python benchmarks/explorer_load.py                       # 50 mixed worst cases
    .venv/bin/python benchmarks/explorer_load.py --kind measure --requests 45
    .venv/bin/python benchmarks/explorer_load.py --src /path/to/other/src   # another tree
    .venv/bin/python benchmarks/explorer_load.py --calibrate   # seconds per work unit

``--kind``: ``backward`` (about the largest traced backward the work limit
allows: L = 64, causal, 2 x 3 tiles, dropout, softcap, ALiBi), ``conventions``
(L = 64, 4 x 4 tiles, dropout, ALiBi), ``measure`` (L = 1024, d = 128,
block 1024), ``ring`` (8 ranks, L = 64, block 2) or ``mixed`` (all four in turn). ``--json``
prints one JSON object instead of the table. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _matrix(rows: int, cols: int, salt: int) -> list[list[float]]:
    """A deterministic, well-scaled matrix (no torch needed in the client)."""
    return [[((i * 7 + j * 3 + salt) % 11 - 5) / 5 for j in range(cols)] for i in range(rows)]


def _problem(length: int = 64, d: int = 16) -> dict[str, Any]:
    return {"q": _matrix(length, d, 1), "k": _matrix(length, d, 2), "v": _matrix(length, d, 3)}


_ALL = {"dropout_p": 0.3, "softcap": 5.0, "alibi": True}
WORST: dict[str, tuple[str, dict[str, Any]]] = {
    "backward": (
        "/api/backward",
        _problem()
        | {"g": _matrix(64, 16, 4), "block_q": 2, "block_k": 3, "mask": {"kind": "causal"}}
        | _ALL,
    ),
    # flash-attn 2's preset refuses softcap with dropout: dropout and ALiBi here
    "conventions": (
        "/api/conventions",
        _problem() | {"block_q": 4, "block_k": 4, "dropout_p": 0.3, "alibi": True},
    ),
    "measure": ("/api/measure", {"length": 1024, "d": 128, "block": 1024}),
    "ring": ("/api/ring", {"world_size": 8, "length": 64, "block": 2}),
}
"""The most expensive request of each heavy endpoint within the explorer's limits."""

WARM_UP: list[tuple[str, dict[str, Any] | None]] = [
    ("/api/examples", None),
    ("/api/ledger", {"scores": [1, 2, -1, 3, 0, 2.5], "values": _matrix(6, 2, 0)}),
    ("/api/backward", _problem(5, 2) | {"g": _matrix(5, 2, 4), "mask": {"kind": "causal"}}),
    ("/api/storage", {}),
    ("/api/conventions", _problem(5, 2) | {"mask": {"kind": "causal"}}),
    ("/api/measure", {}),
    ("/api/ring", {}),
]
"""One request per endpoint at (about) the page's defaults."""


def rss_mb(pid: int) -> tuple[float, int]:
    """Resident memory (MB) and thread count of process ``pid``."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"Threads:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    return rss / 1024, threads


class Server:
    """``python -m flashledger.web --port 0`` in a child process; ``url`` once it listens."""

    def __init__(self, src: str | None = None) -> None:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        if src:
            env["PYTHONPATH"] = src
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashledger.web", "--port", "0"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.url = ""
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        assert self.proc.stderr is not None
        while not self.url:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"the explorer did not start: {''.join(self.log)[-2000:]}")
            self.log.append(line)
            found = re.search(r"(http://\S+?:\d+)/?", line)
            if found and ("explorer on" in line or "Uvicorn running" in line):
                self.url = found.group(1)
            if time.monotonic() > deadline:
                raise RuntimeError("the explorer did not start within 120 s")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_load(
    *,
    kind: str = "mixed",
    requests: int = 50,
    src: str | None = None,
    settle_s: float = 10.0,
    stop_when_back: bool = False,
) -> dict[str, Any]:
    """Start a server, load it, and return the figures (see the module docstring).

    After the load RSS is sampled for ``settle_s`` seconds, or until it is back
    within 1.5x of idle with ``stop_when_back``.
    """
    server = Server(src)
    pid = server.proc.pid
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for path, body in WARM_UP:
                res = client.get(path) if body is None else client.post(path, json=body)
                if res.status_code != 200:
                    raise RuntimeError(f"warm-up {path}: {res.status_code} {res.text[:300]}")
        time.sleep(2.0)  # let the server give back what the warm-up left
        idle_mb, idle_threads = rss_mb(pid)

        kinds = list(WORST) if kind == "mixed" else [kind]
        statuses: Counter[str] = Counter()
        retry_after: set[str] = set()
        latencies: list[float] = []
        slow: list[tuple[float, str, float]] = []
        peak = [idle_mb, idle_threads]
        stop = threading.Event()

        def heavy(i: int) -> None:
            path, body = WORST[kinds[i % len(kinds)]]
            try:
                with httpx.Client(base_url=server.url, timeout=300) as c:
                    res = c.post(path, json=body)
                statuses[f"{path} {res.status_code}"] += 1
                if res.status_code == 503:
                    retry_after.add(res.headers.get("retry-after", "missing"))
            except httpx.HTTPError as exc:
                statuses[f"{path} {type(exc).__name__}"] += 1

        def probe() -> None:
            with httpx.Client(base_url=server.url, timeout=300) as c:
                n = 0
                while not stop.is_set():
                    path = ("/api/examples", "/", "/static/style.css")[n % 3]
                    start = time.perf_counter()
                    res = c.get(path)
                    latencies.append(time.perf_counter() - start)
                    if latencies[-1] > 0.5:
                        slow.append((round(start - t_load[0], 2), path, round(latencies[-1], 2)))
                    statuses[f"trivial {res.status_code}"] += 1
                    n += 1
                    stop.wait(0.1)

        def sample() -> None:
            while not stop.is_set():
                mb, threads = rss_mb(pid)
                peak[0], peak[1] = max(peak[0], mb), max(peak[1], threads)
                stop.wait(0.1)

        t_load = [time.perf_counter()]
        watchers = [threading.Thread(target=probe), threading.Thread(target=sample)]
        for t in watchers:
            t.start()
        time.sleep(0.3)
        start = t_load[0] = time.perf_counter()
        workers = [threading.Thread(target=heavy, args=(i,)) for i in range(requests)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        load_s = time.perf_counter() - start
        stop.set()
        for t in watchers:
            t.join()

        after: list[tuple[float, float]] = []
        back_s: float | None = None
        t0 = time.perf_counter()
        while (now := time.perf_counter() - t0) <= settle_s:
            mb, _ = rss_mb(pid)
            after.append((round(now, 2), round(mb, 1)))
            if back_s is None and mb <= 1.5 * idle_mb:
                back_s = now
                if stop_when_back:
                    break
            time.sleep(0.25)
        final_mb, final_threads = rss_mb(pid)
    finally:
        server.stop()
    lat = sorted(latencies)
    return {
        "kind": kind,
        "requests": requests,
        "load_s": round(load_s, 2),
        "statuses": dict(sorted(statuses.items())),
        "retry_after": sorted(retry_after),
        "trivial_requests": len(lat),
        "trivial_median_s": round(statistics.median(lat), 4) if lat else None,
        "trivial_p95_s": round(lat[int(0.95 * (len(lat) - 1))], 4) if lat else None,
        "trivial_max_s": round(lat[-1], 4) if lat else None,
        "trivial_over_0_5_s": slow[:20],
        "rss_idle_mb": round(idle_mb, 1),
        "rss_peak_mb": round(peak[0], 1),
        "rss_after_mb": round(final_mb, 1),
        "rss_back_within_1_5x_s": None if back_s is None else round(back_s, 2),
        "rss_after_samples": after[:: max(1, len(after) // 10)],
        "threads_idle": idle_threads,
        "threads_peak": peak[1],
        "threads_after": final_threads,
    }


def calibrate() -> list[dict[str, Any]]:
    """Seconds (CPU of one thread, and wall) per work unit for requests near the limit."""
    import torch

    from flashledger.web import compute
    from flashledger.web import schemas as sc

    torch.set_num_threads(1)
    options: dict[str, dict[str, Any]] = {
        "plain": {},
        "causal": {"mask": {"kind": "causal"}},
        "dropout": {"dropout_p": 0.3},
        "softcap": {"softcap": 5.0},
        "alibi": {"alibi": True},
        "all": {"dropout_p": 0.3, "softcap": 5.0, "alibi": True},
        "causal+all": {"mask": {"kind": "causal"}, "dropout_p": 0.3, "softcap": 5.0, "alibi": True},
    }
    compute.backward_steps(sc.BackwardRequest(**WARM_UP[2][1]))  # type: ignore[arg-type]
    rows = []
    for name, opts in options.items():
        for block in (1, 2, 3, 4, 8):
            for endpoint in ("backward", "conventions"):
                body = _problem() | {"block_q": block, "block_k": block} | opts
                if endpoint == "backward":
                    req: Any = sc.BackwardRequest(**body, g=_matrix(64, 16, 4))
                    fn: Any = compute.backward_steps
                else:
                    req = sc.ConventionsRequest(**body)
                    fn = compute.conventions_table
                units, _ = compute.work_of(req)
                if not 0.2 * compute.MAX_WORK <= units <= compute.MAX_WORK:
                    continue
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    fn(req).model_dump_json()
                except ValueError:  # a pair of options a preset refuses
                    continue
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                rows.append(
                    {
                        "endpoint": endpoint,
                        "options": name,
                        "block": block,
                        "units": round(units),
                        "cpu_s": round(cpu, 3),
                        "wall_s": round(wall, 3),
                        "cpu_s_at_limit": round(cpu / units * compute.MAX_WORK, 2),
                    }
                )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=[*WORST, "mixed"], default="mixed")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--src", help="PYTHONPATH for the server (another source tree)")
    parser.add_argument("--calibrate", action="store_true", help="seconds per work unit")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if args.calibrate:
        rows = calibrate()
        if args.json:
            print(json.dumps(rows))
            return 0
        print(f"{'endpoint':12} {'options':11} {'block':>5} {'units':>7} {'cpu s':>7} "
              f"{'wall s':>7} {'cpu s at limit':>15}")  # fmt: skip
        for r in rows:
            print(f"{r['endpoint']:12} {r['options']:11} {r['block']:>5} {r['units']:>7} "
                  f"{r['cpu_s']:>7} {r['wall_s']:>7} {r['cpu_s_at_limit']:>15}")  # fmt: skip
        worst = max(r["cpu_s_at_limit"] for r in rows)
        print(f"worst: a request at the limit takes {worst} s of one core")
        return 0
    out = run_load(kind=args.kind, requests=args.requests, src=args.src)
    if args.json:
        print(json.dumps(out))
        return 0
    for key, value in out.items():
        print(f"{key:26} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
