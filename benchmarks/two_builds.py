"""Two source trees of flashledger timed against each other, round by round.

A change to the native step is measured against the build before it on the same
machine at the same moments: each tree runs in a worker process of its own (its own
compiled library), both hold the same inputs, and the driver asks them in turn for
``--calls`` forward + backward passes per round (the order alternating), keeping each
round's fastest (``--forward``: forwards alone, under ``no_grad``). The back end and the
tiles are forced alike in both (``--gemm``, ``--tiles``; ``--scores own``: a backward's
score products on the own kernel, in a tree that has the setting), so that two
calibrations cannot differ where the trees do not. Prints, per configuration, each
tree's median and the median and range of the rounds' ratios (b over a).

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/two_builds.py --a /tmp/before/src --b src
    .venv/bin/python benchmarks/two_builds.py --a /tmp/before/src --b src \\
        --dtypes float32 --lengths 8192 --causal yes --rounds 9
    .venv/bin/python benchmarks/two_builds.py --a /tmp/before/src --b src --forward \\
        --dtypes float32,float64 --rounds 11 --calls 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from inspect import signature

# the back ends each dtype runs on, forced alike in both trees: (name, the forward's)
GEMMS = {
    "float32": ("blas", "own"),
    "float64": ("blas", "own"),
    "bfloat16": ("amx", None),
    "float16": ("float32", None),
}
TILES = {"float32": "256x512", "float64": "256x256", "bfloat16": "256x256", "float16": "256x512"}


def worker(
    dtype: str,
    length: int,
    causal: bool,
    tiles: str,
    gemm: str | None,
    forward: bool,
    scores: str | None,
) -> None:
    """Hold one configuration's inputs and run ``n`` passes per line read, printing the
    fastest (the tree is the one on ``PYTHONPATH``)."""
    import torch

    import flashledger as fl
    from flashledger import _native

    dt = getattr(torch, dtype)
    kern = _native.kernels()
    if kern is None:
        raise SystemExit("the native step does not run here")
    name, forward_gemm = GEMMS[dtype] if gemm is None else (gemm, None)
    if dt == torch.float16 and name == "float32":  # its float32 step's back ends too
        kern.set_gemm(torch.float32, GEMMS["float32"][0], forward=GEMMS["float32"][1])
    # a backward's score products on the own kernel, where the tree has that setting
    apart = {"scores": scores} if scores and "scores" in signature(kern.set_gemm).parameters else {}
    if dt in (torch.float32, torch.float64):
        kern.set_gemm(dt, name, forward=forward_gemm, **apart)
    else:
        kern.set_gemm(dt, name)
    bq, bk = (int(x) for x in tiles.split("x"))
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, length, 64, generator=gen).to(dt) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    mask = fl.Causal() if causal else None

    def step() -> None:
        if forward:
            with torch.no_grad():
                fl.flash_attention(q, k, v, mask=mask, block_q=bq, block_k=bk)
            return
        o = fl.flash_attention(q, k, v, mask=mask, block_q=bq, block_k=bk)
        o.backward(do)
        q.grad = k.grad = v.grad = None

    step()
    step()
    print("ready", flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        print(min(times), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="the first tree's src folder (the baseline)")
    p.add_argument("--b", help="the second tree's src folder")
    p.add_argument("--dtypes", default="float32,float64,bfloat16,float16")
    p.add_argument("--lengths", default="4096")
    p.add_argument("--causal", default="no", help="no, yes or both")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2, help="passes per round (the fastest kept)")
    p.add_argument("--tiles", default=None, help="e.g. 256x512 (default: per dtype, TILES)")
    p.add_argument("--gemm", default=None, help="force this back end (default: GEMMS)")
    p.add_argument("--forward", action="store_true", help="time forwards alone (no_grad)")
    p.add_argument(
        "--scores",
        default=None,
        help="own: a backward's score products on the own kernel (in a tree that has it)",
    )
    p.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        dtype, length, causal, tiles, gemm, fwd, scores = args.worker
        worker(
            dtype,
            int(length),
            causal == "1",
            tiles,
            None if gemm == "-" else gemm,
            fwd == "1",
            None if scores == "-" else scores,
        )
        return
    if not (args.a and args.b):
        p.error("--a and --b name the two trees' src folders")
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    for dtype in args.dtypes.split(","):
        if dtype not in GEMMS:
            raise SystemExit(f"--dtypes: one of {', '.join(GEMMS)}, got {dtype!r}")
        for length in (int(x) for x in args.lengths.split(",")):
            for c in causal:
                tiles = args.tiles or TILES[dtype]
                cfg = [dtype, str(length), "1" if c else "0", tiles, args.gemm or "-"]
                cfg += ["1" if args.forward else "0", args.scores or "-"]
                procs = []
                for src in (args.a, args.b):
                    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
                    proc = subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--worker", *cfg],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        env=env,
                    )
                    assert proc.stdin is not None and proc.stdout is not None
                    if proc.stdout.readline().strip() != "ready":
                        raise SystemExit(f"the worker on {src} did not start")
                    procs.append(proc)
                got: list[list[float]] = [[], []]
                for r in range(args.rounds):
                    for i in (0, 1) if r % 2 == 0 else (1, 0):
                        stdin, stdout = procs[i].stdin, procs[i].stdout
                        assert stdin is not None and stdout is not None
                        stdin.write(f"{args.calls}\n")
                        stdin.flush()
                        got[i].append(float(stdout.readline()))
                for proc in procs:
                    assert proc.stdin is not None
                    proc.stdin.close()
                    proc.wait()
                ratios = [b / a for a, b in zip(*got, strict=True)]
                print(
                    f"{dtype} L={length} {'causal' if c else 'no mask'} {tiles}"
                    f"{' forward' if args.forward else ''}: "
                    f"a {statistics.median(got[0]) * 1e3:.1f} ms, "
                    f"b {statistics.median(got[1]) * 1e3:.1f} ms, b / a "
                    f"{statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-"
                    f"{max(ratios):.3f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
