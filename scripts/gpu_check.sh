#!/usr/bin/env bash
# Check of the CUDA engine on a machine with one NVIDIA GPU (the project's is an
# H200: python3 3.12, torch 2.11.0+cu130, nvcc, ninja, pytest, compute-sanitizer,
# no network), in at most 270 s of wall time, build included, so that two shots
# fit one lease. Usage:
#
#   OUT=/some/writable/dir bash scripts/gpu_check.sh            # on the GPU machine
#   OUT=... bash scripts/gpu_check.sh --only memcheck,bench     # a second shot: those steps again
#   bash scripts/gpu_check.sh --dry-run [--only ...]            # here, on CPU, against the fake runtime
#   bash scripts/gpu_check.sh --budgets                         # the step budgets, as JSON
#
# It builds the package in place (setup.py build_ext --inplace for
# TORCH_CUDA_ARCH_LIST=9.0, ninja on every core, no network, no build
# isolation, build temp in /tmp) and leaves in "$OUT" (what comes back from
# the machine: at most 8 files, none in folders here) at most 6 files:
#   summary.json   every step's status, seconds, budget and result; the goals of
#                  docs/performance.md judged; the check of $OUT itself; the
#                  command of a second shot for the steps that failed
#   probe.json     capture + replay per path x id placement, the pointer op,
#                  torch.compile(mode="reduce-overhead") and whether a graph was recorded
#   bench.json     GB/s per path x direction x block size x descriptor count vs one
#                  contiguous copy, every result byte-checked; the kernel/DMA crossover
#   logs.tar.gz    every step's log, junit XML and sanitizer log, each cut to 1 MiB
# Caches (inductor, triton, CUDA's JIT cache, XDG) live in /tmp/kvswap-gpu-check/cache,
# where a second shot on the same machine finds them; temporary files and logs in
# a folder per run under /tmp/kvswap-gpu-check. Nothing else is written outside
# $OUT and /tmp except the build's outputs in the tree (checked at the end).
#
# Each step runs under `timeout` with its budget, cut to what is left of the
# total less the budgets of the guarded steps still to come (bench, report),
# so an overrunning step cuts the next ones, never the bench or the report. A
# step that fails or times out is recorded and the next one still runs. Exits
# 1 when a step or a check failed, 2 on a usage error or a failed preflight.
#
# --only STEP,...: only those steps (preflight and report always run; build
# too when the tree holds no usable build, else the in-place build is reused).
# --dry-run: the same steps, probe and bench code on a CPU build of torch
# against the fake CUDA runtime (torch_kvswap._fake_cuda, from scripts/test.sh's
# build), with the budgets stretched (KVSWAP_GPU_CHECK_SCALE, 4): the kit's own
# logic, checked in CI. OUT defaults to a new temporary folder there.
set -uo pipefail

# --- budgets (seconds): one table, checked by tests/test_accelerators.py ------------------
TOTAL=${KVSWAP_GPU_CHECK_SECONDS:-270}
STEPS=(preflight build tests probe bench memcheck racecheck report)
declare -A BUDGET=([preflight]=10 [build]=80 [tests]=40 [probe]=30 [bench]=45 [memcheck]=40 [racecheck]=20 [report]=5)
GUARDED=(bench report)  # steps whose slots the steps before them may not use

usage() {
  echo "usage: OUT=dir bash scripts/gpu_check.sh [--dry-run] [--only STEP,...] | --budgets" >&2
  echo "  steps: ${STEPS[*]}" >&2
  exit 2
}
MODE=gpu
ONLY=""
ONLY_SET=0
while [ $# -gt 0 ]; do
  case "$1" in
    --budgets)
      printf '{"total": %s, "guarded": [' "$TOTAL"
      sep=""; for s in "${GUARDED[@]}"; do printf '%s"%s"' "$sep" "$s"; sep=", "; done
      printf '], "steps": {'
      sep=""; for s in "${STEPS[@]}"; do printf '%s"%s": %s' "$sep" "$s" "${BUDGET[$s]}"; sep=", "; done
      printf '}}\n'
      exit 0 ;;
    --dry-run) MODE=dry ;;
    --only) [ $# -ge 2 ] || { echo "gpu_check: --only needs a comma-separated list of steps" >&2; usage; }
      ONLY=$2; ONLY_SET=1; shift ;;
    --only=*) ONLY=${1#--only=}; ONLY_SET=1 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done

# The steps of this run: all of them, or preflight + the --only list + report.
declare -A WANT=()
if (( ONLY_SET )); then
  only_list=(); IFS=, read -r -a only_list <<< "$ONLY"
  [ "${#only_list[@]}" -gt 0 ] || { echo "gpu_check: --only '$ONLY': no step named" >&2; usage; }
  for s in "${only_list[@]}"; do
    [ -n "${BUDGET[$s]+x}" ] || { echo "gpu_check: --only: unknown step '$s' (expected some of: ${STEPS[*]})" >&2; usage; }
    WANT[$s]=1
  done
  WANT[preflight]=1; WANT[report]=1
else
  for s in "${STEPS[@]}"; do WANT[$s]=1; done
fi

# The dry run keeps the arithmetic and stretches time: a shared CI machine
# compiles and runs the fake far slower than the GPU machine runs the real thing.
SCALE=${KVSWAP_GPU_CHECK_SCALE:-$([ "$MODE" = dry ] && echo 4 || echo 1)}
TOTAL=$(( TOTAL * SCALE ))
for s in "${STEPS[@]}"; do BUDGET[$s]=$(( BUDGET[$s] * SCALE )); done

START=$(date +%s)
START_EPOCH=$(date +%s.%N)
die() { echo "gpu_check: $*" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$MODE" = dry ] && [ -z "${OUT:-}" ]; then OUT="$(mktemp -d /tmp/kvswap-gpu-out.XXXXXX)"; fi
[ -n "${OUT:-}" ] || die "OUT is not set; run as OUT=/writable/dir bash scripts/gpu_check.sh"
mkdir -p "$OUT" 2>/dev/null && [ -w "$OUT" ] || die "OUT=$OUT is not a writable directory"
OUT="$(cd "$OUT" && pwd)"
rm -f "$OUT"/summary.json "$OUT"/probe.json "$OUT"/bench.json "$OUT"/logs.tar.gz "$OUT"/logs.tar.gz.part
cd "$ROOT"
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && [ "$MODE" = dry ]; then PYTHON="$ROOT/.venv/bin/python"; fi
PY="${PYTHON:-python3}"

# Everything but $OUT and the in-place build goes under /tmp: a folder per run for
# logs and temporary files; caches where a second shot on this machine finds them
# (a dry run keeps its caches in its own folder and removes it at the end).
BASE=/tmp/kvswap-gpu-check
mkdir -p "$BASE" || die "cannot create $BASE"
RUN="$(mktemp -d "$BASE/run-$(date -u +%Y%m%dT%H%M%S)-XXXXXX")" || die "cannot create a run folder in $BASE"
CACHE=$([ "$MODE" = dry ] && echo "$RUN/cache" || echo "$BASE/cache")
mkdir -p "$RUN/logs" "$RUN/tmp" "$CACHE"
[ "$MODE" = dry ] && [ -z "${KVSWAP_GPU_CHECK_KEEP:-}" ] && trap 'rm -rf "$RUN"' EXIT
export TMPDIR="$RUN/tmp" XDG_CACHE_HOME="$CACHE/xdg" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" TRITON_CACHE_DIR="$CACHE/triton" TRITON_HOME="$CACHE/triton-home"
export CUDA_CACHE_PATH="$CACHE/nv" TORCH_EXTENSIONS_DIR="$CACHE/torch_extensions" HYPOTHESIS_STORAGE_DIRECTORY="$CACHE/hypothesis"
# The toolkit's tools (nvcc, compute-sanitizer) where PATH may lack them.
[ "$MODE" = gpu ] && export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"

# Steps run in a child bash under `timeout`; what the step functions read.
export MODE PY ROOT OUT RUN BASE
LOGS="$RUN/logs"
T="$ROOT/tests"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider --rootdir "$ROOT")
REPORT=("$PY" "$ROOT/scripts/gpu_report.py")

# A build that is already in the tree is reused by a run without `build`.
engine_loads() {
  if [ "$MODE" = dry ]; then "$PY" -c 'import torch_kvswap._fake_cuda' >/dev/null 2>&1
  else "$PY" -c 'import torch_kvswap as k, sys; sys.exit(0 if k.ENGINES.get("cuda") else 1)' >/dev/null 2>&1; fi
}
if [ -z "${WANT[build]+x}" ] && ! engine_loads; then
  echo "gpu_check: no usable build in the tree: build added to this run"
  WANT[build]=1
fi
TO_RUN=(); for s in "${STEPS[@]}"; do [ -n "${WANT[$s]+x}" ] && TO_RUN+=("$s"); done
json_list() { local sep="" s; printf '['; for s in "$@"; do printf '%s"%s"' "$sep" "$s"; sep=", "; done; printf ']'; }
printf '{"mode": "%s", "started": "%s", "started_epoch": %s, "total": %s, "only": %s, "root": "%s", "all_steps": %s, "steps_to_run": %s}\n' \
  "$MODE" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$START_EPOCH" "$TOTAL" "$([ -n "$ONLY" ] && echo "\"$ONLY\"" || echo null)" \
  "$ROOT" "$(json_list "${STEPS[@]}")" "$(json_list "${TO_RUN[@]}")" > "$RUN/meta.json"

FAILED=0
# Runs a step under its budget, cut to the time left less the budgets of the
# guarded steps after it, then records it (summary.json, logs.tar.gz, $OUT check).
step() {  # name command...
  local name=$1; shift
  local budget=${BUDGET[$name]}
  local left=$(( TOTAL - ($(date +%s) - START) ))
  local reserve=0 seen=0 s g
  for s in "${TO_RUN[@]}"; do
    if (( seen )); then for g in "${GUARDED[@]}"; do [ "$s" = "$g" ] && reserve=$(( reserve + BUDGET[$s] )); done; fi
    [ "$s" = "$name" ] && seen=1
  done
  (( budget > left - reserve )) && budget=$(( left - reserve ))
  if (( budget < 5 )); then
    echo "not run: ${budget}s left for it" > "$LOGS/$name.log"
    finish_step "$name" "skipped: out of time" 0 "$budget"; FAILED=1; return
  fi
  local t0=$(date +%s)
  # A shell function of this script runs in a child bash (timeout runs programs),
  # with its arguments and the arrays it reads.
  if declare -F "$1" >/dev/null; then
    set -- bash -c "$(declare -p PYTEST REPORT LOGS T); $(declare -f "$1"); \"\$0\" \"\$@\"" "$@"
  fi
  timeout --kill-after=5 "$budget" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local status=ok
  (( rc == 124 || rc == 137 )) && status="timed out after ${budget}s"
  (( rc != 0 && rc != 124 && rc != 137 )) && status="failed (exit $rc)"
  (( rc != 0 )) && FAILED=1
  finish_step "$name" "$status" $(( $(date +%s) - t0 )) "$budget"
}
finish_step() {  # name status seconds budget: the report's record is the final one
  "${REPORT[@]}" record "$RUN" "$OUT" "$@" $([ "$1" = report ] && echo --final) || FAILED=1
  echo "gpu_check: $1: $2 (${3}s of ${4}s)"
}
want() { [ -n "${WANT[$1]+x}" ]; }

# --- preflight: fail fast and cleanly without a GPU --------------------------------------
preflight() {
  if [ "$MODE" = dry ]; then
    "$PY" -c 'import torch, torch_kvswap._fake_cuda; print("torch", torch.__version__, "(dry run: fake CUDA runtime)")'
    return
  fi
  nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader &&
  "$PY" -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0]); sys.exit(0 if torch.cuda.is_available() else 1)' &&
  { nvcc --version | tail -1 || echo "nvcc not on PATH (the build finds the toolkit through torch)"; } &&
  { command -v compute-sanitizer || echo "compute-sanitizer not on PATH"; } && nproc
}
step preflight preflight
if ! grep -q '"step": "preflight", "status": "ok"' "$RUN/steps.jsonl"; then
  for s in "${TO_RUN[@]:1}"; do
    echo "not run: the preflight failed" > "$LOGS/$s.log"
    finish_step "$s" "skipped: preflight failed" 0 0
  done
  die "preflight failed: no usable GPU or toolchain here (see preflight.log in $OUT/logs.tar.gz)"
fi

# --- build: in place, no network; build temp under /tmp for a second shot ----------------
build() {
  if [ "$MODE" = dry ]; then
    KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=1 "$PY" setup.py --quiet build_ext --inplace &&
      "$PY" -c 'import torch_kvswap._fake_cuda; print("fake CUDA engine built")'
    return
  fi
  # KVSWAP_VERBOSE_BUILD: the compiler's output into this step's log, not a file in TMPDIR.
  KVSWAP_BUILD_CUDA=1 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=0 TORCH_CUDA_ARCH_LIST=9.0 KVSWAP_VERBOSE_BUILD=1 \
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py build_ext --inplace --build-temp "$BASE/build" &&
  "$PY" -c 'import torch_kvswap as k; print("engines:", k.ENGINES, k._loader.ENGINE_ERRORS); assert k.ENGINES["cuda"]'
}
want build && step build build

# --- tests: the CUDA half of the suite -------------------------------------------------------
if want tests; then
  if [ "$MODE" = dry ]; then
    step tests "${PYTEST[@]}" --junitxml="$LOGS/tests.xml" "$T/test_cuda_fake.py" -k "capture_and_replay and 2048"
  else
    step tests "${PYTEST[@]}" --junitxml="$LOGS/tests.xml" "$T/test_accelerators.py" "$T/test_compile.py" -k "cuda"
  fi
fi

# --- probes and benchmark -------------------------------------------------------------------
FAKE=(); [ "$MODE" = dry ] && FAKE=(--fake)
want probe && step probe "$PY" "$ROOT/scripts/gpu_probe.py" "$OUT/probe.json" "${FAKE[@]}"
want bench && step bench "$PY" "$ROOT/scripts/gpu_bench.py" "$OUT/bench.json" "${FAKE[@]}"

# --- memcheck and racecheck: a chosen set under compute-sanitizer -------------------------
# With torch's caching allocator off, every tensor is its own allocation, so an
# access past a block is outside any allocation and memcheck sees it.
A="$T/test_accelerators.py"
MEMCHECK_TESTS=()  # the kernel and the batch path: every direction, small and large blocks
for m in dma kernel; do for bb in 2048 262144; do for d in h2d d2h d2d; do
  MEMCHECK_TESTS+=("$A::test_swap_blocks_matches_the_cpu_reference[$m-dtype0-$bb-$d-cuda]")
done; done; done
MEMCHECK_TESTS+=("$A::test_pointer_op_on_the_current_stream["{0,1,2}"-cuda]"
  "$A::test_cuda_kernel_path_skips_device_ids_out_of_range"
  "$A::test_cuda_kernel_path_with_4096_host_ids["{h2d,d2h}-{1,16}"]"
  "$A::test_cuda_graph_replay_reads_ids_from_device_memory_on_the_kernel_path")
RACECHECK_TESTS=("$A::test_swap_blocks_matches_the_cpu_reference[kernel-dtype0-2048-"{h2d,d2h,d2d}"-cuda]"
  "$A::test_cuda_kernel_path_with_4096_host_ids["{h2d,d2h}"-16]")
sanitized() {  # tool tests...: under compute-sanitizer on a GPU; in a dry run the same tests
  local tool=$1; shift  # (they skip without a GPU: the selection must still exist) and a fake one
  if [ "$MODE" = dry ] && [ "$tool" = racecheck ] && [ -f "$LOGS/memcheck.xml" ]; then
    "${REPORT[@]}" collected "$LOGS/memcheck.xml" "$@"  # a subset of memcheck's: no second pytest
  elif [ "$MODE" = dry ]; then
    "${PYTEST[@]}" --junitxml="$LOGS/$tool.xml" "$@" \
      $([ "$tool" = memcheck ] && echo "$T/test_cuda_fake.py::test_kernel_copies_every_alignment_exactly[2050-sid0-did0]")
  else
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --log-file "$LOGS/$tool-sanitizer.txt" "${PYTEST[@]}" --junitxml="$LOGS/$tool.xml" "$@"
  fi
}
want memcheck && step memcheck sanitized memcheck "${MEMCHECK_TESTS[@]}"
want racecheck && step racecheck sanitized racecheck "${RACECHECK_TESTS[@]}"

# --- report: every result checked, the goals judged, $OUT checked -------------------------
report() { "${REPORT[@]}" judge "$RUN" "$OUT"; }
step report report  # its record is the final one: the kit's own checks (gpu_report.py)

echo "gpu_check: done in $(( $(date +%s) - START ))s ($MODE); results in $OUT"
exit "$FAILED"
