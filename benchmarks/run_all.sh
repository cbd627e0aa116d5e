#!/usr/bin/env bash
# The measurements behind docs/perf.md. Run from the repository root on an otherwise idle
# machine; each command prints its table and writes bench.json and bench.png.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-.venv/bin}"

# 1. tile sweep at L = 8192 (how DEFAULT_BLOCK_Q / DEFAULT_BLOCK_K were chosen)
"$BIN/flashledger" bench --lengths 8192 --tiles 256x256,256x512,512x512,1024x512 \
    --no-memory --no-naive --out benchmarks/results/tiles

# 2. the comparison: L = 4096, 8192, 16384; float32 and float64; causal and not;
#    peak memory per method in fresh subprocesses; naive attention up to L = 8192
"$BIN/flashledger" bench --out benchmarks/results

cp benchmarks/results/bench.png docs/img/bench.png
