#!/usr/bin/env bash
# About a minute: L = 1024 and 2048, float32, causal and not (no file in docs/ is touched).
set -euo pipefail
cd "$(dirname "$0")/.."
"${BIN:-.venv/bin}/flashledger" bench --quick --out benchmarks/results/quick
