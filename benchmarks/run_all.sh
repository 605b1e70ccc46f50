#!/usr/bin/env bash
# Every figure of BENCHMARKS.md, as `python -m benchmarks all [--quick] [--out DIR]` (kept for old links).
cd "$(dirname "$0")/.." && exec python -m benchmarks all "$@"
