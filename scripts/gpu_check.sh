#!/usr/bin/env bash
# One-shot check of the CUDA engine on a machine with one NVIDIA GPU, a CUDA
# build of torch, nvcc, ninja, pytest and compute-sanitizer, and no network.
# Usage:
#
#   OUT=/some/writable/dir bash scripts/gpu_check.sh
#
# Everything it writes goes under "$OUT" (set by the caller, never here):
# the build (sm_90 only), logs, pytest reports, and JSON results
#   $OUT/summary.json     one line per step: status, seconds
#   $OUT/probe.json       capture+replay per path x id placement, pointer op,
#                         torch.compile(mode="reduce-overhead")
#   $OUT/bench.json       H2D/D2H GB/s at 2, 16, 256 KiB per path vs one
#                         contiguous pinned copy, each result checked
# Each step has its own timeout inside an 8-minute total; a step that fails
# or times out is recorded and the next one still runs, so partial results
# survive. Exits non-zero when a step failed.
set -uo pipefail
START=$(date +%s)
TOTAL=${KVSWAP_GPU_CHECK_SECONDS:-470}

die() { echo "gpu_check: $*" >&2; exit 2; }
[ -n "${OUT:-}" ] || die "OUT is not set; run as OUT=/writable/dir bash scripts/gpu_check.sh"
mkdir -p "$OUT" 2>/dev/null && [ -w "$OUT" ] || die "OUT=$OUT is not a writable directory"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.json"
: > "$SUMMARY"
record() {  # step status seconds
  printf '{"step": "%s", "status": "%s", "seconds": %s}\n' "$1" "$2" "$3" >> "$SUMMARY"
  echo "gpu_check: $1: $2 (${3}s)"
}

# Nothing outside $OUT: caches, bytecode, temporary files, the build.
export TMPDIR="$OUT/tmp" XDG_CACHE_HOME="$OUT/cache" PYTHONDONTWRITEBYTECODE=1
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor" TRITON_CACHE_DIR="$OUT/triton"
export CUDA_CACHE_PATH="$OUT/nv-cache"
mkdir -p "$TMPDIR" "$XDG_CACHE_HOME"

# --- preflight: fail fast and cleanly without a GPU ---------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L > "$OUT/gpu.txt" 2>&1; then
  record preflight "no NVIDIA GPU (nvidia-smi missing or failing)" 0
  die "no NVIDIA GPU on this machine (nvidia-smi: $(head -1 "$OUT/gpu.txt" 2>/dev/null || echo missing))"
fi
if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    > "$OUT/preflight.log" 2>&1; then
  record preflight "torch sees no CUDA device" 0
  die "torch cannot use a CUDA device here (see $OUT/preflight.log)"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -1; } >> "$OUT/gpu.txt" 2>&1
record preflight ok $(( $(date +%s) - START ))

FAILED=0
step() {  # name budget_seconds command...
  local name=$1 budget=$2; shift 2
  local left=$(( TOTAL - ($(date +%s) - START) ))
  (( budget > left )) && budget=$left
  if (( budget < 5 )); then record "$name" "skipped: out of time" 0; FAILED=1; return; fi
  local t0=$(date +%s)
  timeout --kill-after=5 "$budget" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status=ok
  (( rc == 124 || rc == 137 )) && status="timed out after ${budget}s"
  (( rc != 0 && rc != 124 && rc != 137 )) && status="failed (exit $rc)"
  (( rc != 0 )) && FAILED=1
  record "$name" "$status" $(( $(date +%s) - t0 ))
}

# --- build: _C and _C_cuda for sm_90, into $OUT/lib ----------------------------------------
LIB="$OUT/lib"
build() {
  mkdir -p "$LIB/torch_kvswap" && cp torch_kvswap/*.py "$LIB/torch_kvswap/" &&
  KVSWAP_BUILD_CUDA=1 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=0 TORCH_CUDA_ARCH_LIST=9.0 \
    MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --build-lib "$LIB" --build-temp "$OUT/build" &&
  (cd "$OUT" && PYTHONPATH="$LIB" "$PY" -c 'import torch_kvswap as k; print("engines:", k.ENGINES, k._loader.ENGINE_ERRORS); assert k.ENGINES["cuda"]')
}
step build 240 build
# From here on the package is the one in $LIB: run from $OUT, so that the
# source tree's torch_kvswap/ (no compiled engines) is not on sys.path first.
export PYTHONPATH="$LIB"
cd "$OUT"
T="$ROOT/tests"
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider --rootdir "$ROOT")

# --- tests: the CUDA half of the suite -------------------------------------------------------
step tests 100 "${PYTEST[@]}" --junitxml="$OUT/tests.xml" "$T/test_accelerators.py" "$T/test_compile.py" -k "cuda"

# --- memcheck: a short set under compute-sanitizer ----------------------------------------
step memcheck 70 compute-sanitizer --tool memcheck --error-exitcode 9 --log-file "$OUT/memcheck.txt" \
  "${PYTEST[@]}" "$T/test_accelerators.py" \
  -k "cuda and (matches_the_cpu_reference and 2048 and bfloat16 or pointer_op or kernel_path or capture_on_every_path and 2048)"

# --- probes and benchmark -------------------------------------------------------------------
step probe 45 "$PY" "$ROOT/scripts/gpu_probe.py" probe "$OUT/probe.json"
step bench 60 "$PY" "$ROOT/scripts/gpu_probe.py" bench "$OUT/bench.json"

echo "gpu_check: done in $(( $(date +%s) - START ))s; results in $OUT"
exit "$FAILED"
