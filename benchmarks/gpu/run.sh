#!/usr/bin/env bash
# The GPU benchmark suite from source (benchmarks/gpu/suite.py): every package's src/ on PYTHONPATH, as the GPU
# machine runs the project (its own torch >= 2.11 and Triton; nothing installed). Arguments go to suite.py:
#   benchmarks/gpu/run.sh --out "$OUT/gpu_suite.json"                     (a GPU: every section, one process)
#   benchmarks/gpu/run.sh --section fp8 --out "$OUT/fp8.json"             (one section)
#   benchmarks/gpu/run.sh --smoke --out /tmp/smoke.json                    (CPU, tiny sizes, the same code paths)
# benchmarks/gpu/gpu_check.sh runs the whole GPU check (probe, gpu tests, each section of this suite through this
# script in a process of its own, one merged JSON) within a time budget: use that on a lent GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:)${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-$(command -v python || command -v python3)}" benchmarks/gpu/suite.py "$@"
