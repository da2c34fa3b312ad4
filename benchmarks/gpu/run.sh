#!/usr/bin/env bash
# The GPU benchmark suite from source (benchmarks/gpu/suite.py): every package's src/ on PYTHONPATH, as the GPU
# machine runs the project (its own torch >= 2.11 and Triton; nothing installed). Arguments go to suite.py:
#   benchmarks/gpu/run.sh --out "$OUT/gpu_suite.json"      (a GPU)
#   benchmarks/gpu/run.sh --smoke --out /tmp/smoke.json     (CPU, tiny sizes, the same code paths)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHONPATH="$(ls -d packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}" exec python benchmarks/gpu/suite.py "$@"
