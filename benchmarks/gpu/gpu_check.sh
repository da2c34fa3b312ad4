#!/usr/bin/env bash
# The whole GPU check in one command, within a time budget (default 420 s: 7 minutes on one H200), from source:
#   benchmarks/gpu/gpu_check.sh OUTDIR [--smoke] [--deps DIR] [--budget SECONDS]
# Steps, in order, each guarded (its exit status, time and last lines are recorded, and the next step still runs) and
# each under `timeout` (its own budget, cut to what is left of the whole):
#   probe     benchmarks/gpu/probe.py: versions, the card, every torch/Triton API our code uses (present or missing)
#   tests     pytest -m gpu over packages/*/tests and integration/ (junit XML in OUTDIR)
#   suite:*   benchmarks/gpu/suite.py, one process per section (step experts permutation fp8 offload sync graphs)
#   merge     benchmarks/gpu/merge_check.py: OUTDIR/gpu_check.json, the one JSON to read
# --smoke: the same on the CPU at tiny sizes (suite --smoke, all sections in one process to pay the imports once;
# the tests step runs only GPU_CHECK_TESTS, by default one gpu-marked module, which skips without CUDA).
# --deps DIR (default benchmarks/gpu/.deps, if there): the folder build_test_deps.py makes (pytest, hypothesis...),
# put on PYTHONPATH after the packages' src/. GPU_CHECK_TESTS="paths..." overrides the test paths; PYTHON the
# interpreter (default python). See benchmarks/gpu/README.md.
set -uo pipefail

usage() { echo "usage: $0 OUTDIR [--smoke] [--deps DIR] [--budget SECONDS]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
SMOKE=0; DEPS=benchmarks/gpu/.deps; BUDGET=420
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --deps) DEPS=${2:?--deps needs a folder}; shift ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    *) usage ;;
  esac
  shift
done
# OUTDIR and --deps are taken from where this was called; then everything runs from the repository root
mkdir -p "$OUT/logs" "$OUT/suite" || exit 2
OUT=$(cd "$OUT" && pwd)
[ -d "$DEPS" ] && [ "$DEPS" != benchmarks/gpu/.deps ] && DEPS=$(cd "$DEPS" && pwd)
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-$(command -v python || command -v python3)}

SRC=$(ls -d "$REPO"/packages/*/src | paste -sd:)
# a deps folder built for another Python (hypothesis is compiled for one minor version) is left out, with a warning
if [ -f "$DEPS/MANIFEST.json" ] && ! "$PY" -c 'import json, sys; m = json.load(open(sys.argv[1]))
sys.exit(m["python"] != "%d.%d" % sys.version_info[:2])' "$DEPS/MANIFEST.json"; then
  echo "warning: $DEPS is not built for this $($PY --version 2>&1) (its MANIFEST.json); going on without it" >&2
  DEPS=none
fi
if [ -d "$DEPS" ]; then
  DEPS=$(cd "$DEPS" && pwd)
  export PYTHONPATH="$SRC:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
else
  case $DEPS in benchmarks/gpu/.deps|none) ;; *) echo "warning: --deps $DEPS is not a folder; going on without it" >&2 ;; esac
  DEPS=""
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONDONTWRITEBYTECODE=1

SECTIONS=(step experts permutation fp8 offload sync graphs)
# each step's own budget in seconds (expected on an H200 in brackets): the whole is cut to --budget
declare -A OWN=(
  [probe]=60        # [~20: imports every module of ours; one small inductor compile]
  [tests]=120       # [~40: collecting every test module; a handful of gpu tests]
  [step]=150        # [~80: two full-width 4-layer models, regional compile, 9 + 9 steps of 4,096 tokens]
  [experts]=45      # [~10]
  [permutation]=45  # [~10: Triton compiles]
  [fp8]=45          # [~10]
  [offload]=75      # [~30: 3 variants x 8 x 2 steps of 4 x 4,096 tokens]
  [sync]=60         # [~15: 3 eager steps of a 2-layer proxy under the sync debug mode]
  [graphs]=60       # [~20 (not yet run): the capture check, 2 layers captured, 9 + 9 steps of 1,024 tokens]
  [suite]=240       # --smoke: every section in one process
)
MERGE_RESERVE=20  # kept back for the merge
START=$(date +%s.%N)
STEPS="$OUT/steps.tsv"
printf 'name\trc\tseconds\tbudget_s\tlog\n' >"$STEPS"

elapsed() { awk -v s="$START" -v n="$(date +%s.%N)" 'BEGIN { printf "%.1f", n - s }'; }

# run_step NAME COMMAND...: under `timeout` (own budget, cut to what is left); output to OUT/logs/NAME.log
run_step() {
  local name=$1; shift
  local own=${OWN[${name#suite:}]} left limit t0 rc seconds log="$OUT/logs/${name/:/_}.log"
  left=$(awk -v b="$BUDGET" -v e="$(elapsed)" -v r="$MERGE_RESERVE" 'BEGIN { printf "%d", b - e - r }')
  limit=$(( own < left ? own : left ))
  if [ "$limit" -lt 5 ]; then
    echo "== $name: skipped, the budget is spent (+$(elapsed) s)"
    printf '%s\t%s\t0\t%s\t%s\n' "$name" "skipped" "$limit" "$log" >>"$STEPS"
    return
  fi
  echo "== $name (limit ${limit} s, at +$(elapsed) s)"
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  seconds=$(awk -v s="$t0" -v n="$(date +%s.%N)" 'BEGIN { printf "%.1f", n - s }')
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$seconds" "$limit" "$log" >>"$STEPS"
  if [ "$rc" -eq 0 ]; then
    echo "== $name: ok in ${seconds} s"
    tail -n 3 "$log" | sed 's/^/   /'
  else
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      echo "== $name: TIMED OUT after ${seconds} s (limit ${limit} s)"
    else
      echo "== $name: FAILED (exit $rc) in ${seconds} s"
    fi
    tail -n 15 "$log" | sed 's/^/   /'
  fi
}

echo "gpu_check: out $OUT, budget ${BUDGET} s, smoke $SMOKE, deps ${DEPS:-none}, $($PY --version 2>&1)"

run_step probe "$PY" benchmarks/gpu/probe.py --out "$OUT/probe.json"

if [ "$SMOKE" = 1 ]; then
  read -r -a TESTS <<<"${GPU_CHECK_TESTS:-packages/moe-precision/tests/test_native_gpu.py}"
else
  read -r -a TESTS <<<"${GPU_CHECK_TESTS:-$(ls -d packages/*/tests | paste -sd' ') integration}"
fi
# --continue-on-collection-errors: a test module importing what this machine lacks (pyarrow, tensorboard...) must
# not stop the gpu tests of the others; -p no:cacheprovider: nothing written into the repository
run_step tests "$PY" -m pytest -m gpu "${TESTS[@]}" -q -rfEs -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$OUT/gpu_tests.xml"

if [ "$SMOKE" = 1 ]; then
  run_step suite:suite bash benchmarks/gpu/run.sh --smoke --out "$OUT/suite/all.json"
else
  for section in "${SECTIONS[@]}"; do
    run_step "suite:$section" bash benchmarks/gpu/run.sh --section "$section" --out "$OUT/suite/$section.json"
  done
fi

echo "== merge (at +$(elapsed) s)"
timeout 60 "$PY" benchmarks/gpu/merge_check.py "$OUT" --budget "$BUDGET" --elapsed "$(elapsed)" --smoke "$SMOKE" \
  --deps "${DEPS:-}"
rc=$?
echo "gpu_check: done in $(elapsed) s; $OUT/gpu_check.json"
exit $rc
