#!/usr/bin/env bash
# `make gpucheck`: the one-shot GPU check (issue 47), about 9 minutes at most on one GPU, in three
# time-boxed stages, each ending with one line that gives its seconds:
#   0. smoke (60 s): Python, torch, CUDA and the GPU; kvlib's cached decode against recompute on it,
#      and a bf16 matmul. No CUDA device (exit 2) or a failure stops the check here.
#   1. the unit suite on CUDA (240 s): pytest --device cuda, its JUnit XML counted into the record;
#      a failing or stopped suite does not stop the bench, the record says what it did.
#   2. the bench (240 s): python -m kvbench --device cuda (kvbench.gpu), random weights at
#      SmolLM2-135M's and Llama-3.1-8B's shapes in bf16, written to kvbench/data/bench_gpu.json.
# It uses only what the GPU machine has: the repository on PYTHONPATH (kvlib is not installed
# there), no package registry, no SmolLM2 file. Settings, for trying it elsewhere (the tests run it
# on a CPU): PY (default python3), GPUCHECK_DEVICE (cuda), GPUCHECK_QUICK (1: toy sizes),
# GPUCHECK_TESTS (the suite's paths), GPUCHECK_RECORD (where the record goes), GPUCHECK_WORK (logs),
# GPUCHECK_SMOKE_S, GPUCHECK_SUITE_S, GPUCHECK_BENCH_S (the time boxes).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PY:-python3}"
DEVICE="${GPUCHECK_DEVICE:-cuda}"
TESTS="${GPUCHECK_TESTS:-tests}"
RECORD="${GPUCHECK_RECORD:-kvbench/data/bench_gpu.json}"
WORK="${GPUCHECK_WORK:-_build/gpucheck}"
SMOKE_S="${GPUCHECK_SMOKE_S:-60}"
SUITE_S="${GPUCHECK_SUITE_S:-240}"
BENCH_S="${GPUCHECK_BENCH_S:-240}"
QUICK=()
if [ "${GPUCHECK_QUICK:-0}" = 1 ]; then QUICK=(--quick); fi
mkdir -p "$WORK"
begin=$SECONDS

stage() {  # stage NUMBER WHAT START: the stage's one line, with its seconds
  echo "gpucheck stage $1: $2 in $((SECONDS - $3)) s"
}

# -- 0: smoke --------------------------------------------------------------------------------------------
t=$SECONDS
rc=0
timeout -k 10 "$SMOKE_S" "$PY" -m kvbench --device "$DEVICE" --smoke || rc=$?
if [ "$rc" -ne 0 ]; then
  case "$rc" in
    2) why="no CUDA device (see the line above)" ;;
    124) why="timed out after $SMOKE_S s" ;;
    *) why="failed with exit status $rc (see above)" ;;
  esac
  stage 0 "smoke $why; the check stops here, no record written" "$t"
  exit "$rc"
fi
stage 0 "smoke ok" "$t"

# -- 1: the unit suite on the device ---------------------------------------------------------------------
t=$SECONDS
rm -f "$WORK/junit.xml"
suite=("$PY" -m pytest --device "$DEVICE" -q -p no:cacheprovider $TESTS)
src=0
# SIGINT at the time box: pytest stops and still writes its JUnit XML with what ran
timeout -s INT -k 30 "$SUITE_S" "${suite[@]}" --junitxml="$WORK/junit.xml" > "$WORK/suite.log" 2>&1 || src=$?
tail -n 5 "$WORK/suite.log"
suite_s=$((SECONDS - t))
if [ "$src" -eq 124 ]; then
  stage 1 "unit suite on $DEVICE stopped at its $SUITE_S s time box (log: $WORK/suite.log)" "$t"
else
  stage 1 "unit suite on $DEVICE exited $src (log: $WORK/suite.log)" "$t"
fi

# -- 2: the bench, and the record ------------------------------------------------------------------------
# Written beside the logs first, and copied to $RECORD only when the bench wrote it whole (checked
# by kvbench.gpurecord.check_gpu_record): a bench that dies leaves the stored record as it was.
t=$SECONDS
rm -f "$WORK/bench_gpu.json"
brc=0
timeout -s INT -k 15 "$BENCH_S" "$PY" -m kvbench --device "$DEVICE" ${QUICK[@]+"${QUICK[@]}"} \
  --json "$WORK/bench_gpu.json" --suite-xml "$WORK/junit.xml" --suite-seconds "$suite_s" \
  --suite-status "$src" --suite-command "${suite[*]}" || brc=$?
if [ -f "$WORK/bench_gpu.json" ]; then
  mkdir -p "$(dirname "$RECORD")"
  cp "$WORK/bench_gpu.json" "$RECORD"
  stage 2 "bench exited $brc; record written to $RECORD" "$t"
elif [ "$brc" -eq 124 ]; then
  stage 2 "bench stopped at its $BENCH_S s time box; no record written" "$t"
else
  stage 2 "bench exited $brc; no record written" "$t"
fi
echo "gpucheck: $((SECONDS - begin)) s in all"
exit "$brc"
