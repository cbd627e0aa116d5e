"""The native step's two forward products at tile shapes, on one core, as a share of the
register FMA peak.

Compiles a small C harness that includes ``src/flashledger/_native.c`` (the same flags the
step is built with, ``FLASHLEDGER_NATIVE_ARCH``'s target included) and times, on one thread, the forward's ``S = Q Kᵀ`` (``k = d``) and
``acc += P V`` (``k`` = the key tile) through the step's ``mm`` (its own kernel where it is
built) on operands laid out as the step lays them out (padded row strides, Kᵀ of the
whole key length, on 2 MiB-aligned huge-page-advised buffers), against the register-only
FMA loop of the same run. Each round: the fastest of ``--reps`` calls of each product.

    python benchmarks/tile_products.py --rows 256 --keys 1024 --rounds 5

The kernel's blocks, its unrolling and its register shapes were chosen with this (see
docs/perf.md, "The own kernel on AVX2"). Needs gcc and Linux x86-64.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "flashledger" / "_native.c"

HARNESS = r"""
#include "@SOURCE@"
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
static void *buffer(size_t n) { /* 2 MiB-aligned, huge pages advised, as _native.scratch */
    size_t h = (size_t)2 << 20;
    char *p = mmap(0, n + h, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) exit(1);
    p = (char *)(((size_t)p + h - 1) & ~(h - 1));
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 0, n);
    return p;
}
int main(int argc, char **argv) {
#if !FL_OWN
    fprintf(stderr, "the own kernel is not built for this CPU (AVX-512, or AVX2 with FMA)\n");
    return 2;
#endif
    int lk = atoi(argv[1]), d = atoi(argv[2]), nr = atoi(argv[3]), bk = atoi(argv[4]);
    int reps = atoi(argv[5]), rounds = atoi(argv[6]);
    long long lt = padded(lk), ls = padded(bk);
    T *kt = buffer(sizeof(T) * d * lt), *q = buffer(sizeof(T) * nr * d);
    T *s = buffer(sizeof(T) * nr * ls), *v = buffer(sizeof(T) * lk * d);
    T *acc = buffer(sizeof(T) * nr * d);
    for (long long i = 0; i < d * lt; i++) kt[i] = (T)((i % 7) - 3) * (T)0.1;
    for (long long i = 0; i < (long long)nr * d; i++) q[i] = (T)((i % 5) - 2) * (T)0.1;
    for (long long i = 0; i < (long long)lk * d; i++) v[i] = (T)((i % 3) - 1) * (T)0.1;
    for (long long i = 0; i < nr * ls; i++) s[i] = (T)0.001;
    double flop = 2.0 * nr * bk * d;
    for (int round = 0; round < rounds; round++) {
        double t0 = now();
        volatile double sink = SUF(fl_fma_peak)(20000);
        double peak = 20000 * SUF(fl_fma_flops_per_rep)() / (now() - t0) / 1e9;
        (void)sink;
        double qk = 1e9, pv = 1e9;
        for (int r = 0; r < reps; r++) {
            long long k0 = (long long)(r % (lk / bk)) * bk;
            double a = now();
            mm(bk, nr, d, (T)0.18, kt + k0, lt, q, 1, d, 0, s, ls, NULL);
            double b = now();
            mm(d, nr, bk, 1, v + k0 * d, d, s, 1, ls, 1, acc, d, NULL);
            double c = now();
            qk = b - a < qk ? b - a : qk;
            pv = c - b < pv ? c - b : pv;
        }
        printf("%.1f %.1f %.1f\n", peak, flop / qk / 1e9, flop / pv / 1e9);
        fflush(stdout);
    }
    return 0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--rows", type=int, default=256, help="query rows of the tile (default 256)")
    ap.add_argument("--keys", type=int, default=1024, help="keys of the tile (default 1024)")
    ap.add_argument("--length", type=int, default=4096, help="the whole key length (4096)")
    ap.add_argument("--head-dim", type=int, default=64, help="d (default 64)")
    ap.add_argument("--reps", type=int, default=50, help="calls per round (default 50)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    args = ap.parse_args()
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        sys.exit("tile_products: Linux x86-64 only")
    for name in ("rows", "keys", "length", "head_dim", "reps", "rounds"):
        if getattr(args, name) < 1:
            sys.exit(f"tile_products: --{name.replace('_', '-')} must be at least 1")
    if args.keys > args.length:
        sys.exit("tile_products: --keys must be at most --length")
    from flashledger import _native  # the step's own flags

    with tempfile.TemporaryDirectory(prefix="fl-tiles-") as tmp:
        src, exe = Path(tmp) / "harness.c", Path(tmp) / "harness"
        src.write_text(HARNESS.replace("@SOURCE@", str(SOURCE)))
        double = "1" if args.dtype == "float64" else "0"
        cc = os.environ.get("CC", "gcc")
        flags, _ = _native._target(cc)  # the step's flags (FLASHLEDGER_NATIVE_ARCH's target)
        cmd = [cc, *flags, f"-DFL_DOUBLE={double}", "-o", str(exe), str(src), "-lm"]
        build = subprocess.run(cmd, capture_output=True, text=True)
        if build.returncode:
            sys.exit(f"tile_products: the harness did not build:\n{build.stderr[-2000:]}")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        shape = [args.length, args.head_dim, args.rows, args.keys, args.reps, args.rounds]
        run = subprocess.run([str(exe), *map(str, shape)], env=env, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"tile_products: {run.stderr.strip() or f'exit {run.returncode}'}")
    d, nr, bk = args.head_dim, args.rows, args.keys
    print(
        f"{args.dtype}, one thread: S = Q Kᵀ ({nr} x {bk}, k = {d}) and acc += P V "
        f"({nr} x {d}, k = {bk}); GFLOP/s and % of the register FMA peak of the same round"
    )
    print(f"{'round':>5} {'FMA peak':>9} {'QKᵀ':>7} {'%':>4} {'PV':>7} {'%':>4}")
    for i, line in enumerate(run.stdout.split("\n")):
        if not line.strip():
            continue
        peak, qk, pv = map(float, line.split())
        print(
            f"{i + 1:>5} {peak:>9.1f} {qk:>7.1f} {100 * qk / peak:>4.0f} "
            f"{pv:>7.1f} {100 * pv / peak:>4.0f}"
        )


if __name__ == "__main__":
    main()
