#!/usr/bin/env bash
# One-shot check of the CUDA engine on a machine with one NVIDIA GPU, a CUDA
# build of torch, nvcc, ninja, pytest and compute-sanitizer, and no network.
# Usage:
#
#   OUT=/some/writable/dir bash scripts/gpu_check.sh     # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run                   # here, on CPU, against the fake runtime
#   bash scripts/gpu_check.sh --budgets                   # the step budgets, as JSON
#
# It builds the package in place (setup.py build_ext --inplace, no network,
# no build isolation; _C and _C_cuda for TORCH_CUDA_ARCH_LIST=9.0) and
# writes its results under "$OUT" (only $OUT comes back from the machine):
#   $OUT/summary.json     one line per step: status, seconds, budget
#   $OUT/probe.json       capture+replay per path x id placement, pointer op,
#                         torch.compile(mode="reduce-overhead") with whether a
#                         CUDA graph was recorded and why not
#   $OUT/bench.json       H2D/D2H GB/s at 2, 16, 256 KiB per path vs one
#                         contiguous pinned copy, each result checked
#   $OUT/<step>.log       each step's output
# Each step has its own timeout; the budgets below sum to no more than the
# total, and every step before the bench is cut short rather than eat into
# the bench's slot. A step that fails or times out is recorded and the next
# one still runs, so partial results survive. Exits non-zero when a step
# failed.
#
# --dry-run runs the same steps and the same probe and bench code on a CPU
# build of torch against the fake CUDA runtime (torch_kvswap._fake_cuda, from
# scripts/test.sh's build): the kit's own logic, checked in CI before its one
# shot on hardware. OUT defaults to a temporary directory there.
set -uo pipefail

# --- budgets (seconds): one table, checked by tests/test_accelerators.py ------------
TOTAL=${KVSWAP_GPU_CHECK_SECONDS:-480}
STEPS=(preflight build tests memcheck probe bench report)
declare -A BUDGET=([preflight]=20 [build]=160 [tests]=80 [memcheck]=45 [probe]=90 [bench]=75 [report]=5)
GUARDED=bench  # the step whose slot earlier steps may not use

MODE=gpu
case "${1:-}" in
  --budgets)
    printf '{"total": %s, "guarded": "%s", "steps": {' "$TOTAL" "$GUARDED"
    sep=""
    for s in "${STEPS[@]}"; do printf '%s"%s": %s' "$sep" "$s" "${BUDGET[$s]}"; sep=", "; done
    printf '}}\n'
    exit 0 ;;
  --dry-run) MODE=dry ;;
  "") ;;
  *) echo "usage: OUT=dir bash scripts/gpu_check.sh [--dry-run | --budgets]" >&2; exit 2 ;;
esac

# The dry run keeps the arithmetic and stretches time: a shared CI machine
# compiles and runs the fake far slower than the GPU machine runs the real
# thing.
SCALE=${KVSWAP_GPU_CHECK_SCALE:-$([ "$MODE" = dry ] && echo 4 || echo 1)}
TOTAL=$(( TOTAL * SCALE ))
for s in "${STEPS[@]}"; do BUDGET[$s]=$(( BUDGET[$s] * SCALE )); done

START=$(date +%s)
die() { echo "gpu_check: $*" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$MODE" = dry ] && [ -z "${OUT:-}" ]; then OUT="$(mktemp -d)"; fi
[ -n "${OUT:-}" ] || die "OUT is not set; run as OUT=/writable/dir bash scripts/gpu_check.sh"
mkdir -p "$OUT" 2>/dev/null && [ -w "$OUT" ] || die "OUT=$OUT is not a writable directory"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/.venv/bin/python" ] && [ "$MODE" = dry ]; then PYTHON="$ROOT/.venv/bin/python"; fi
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.json"
: > "$SUMMARY"
record() {  # step status seconds budget
  printf '{"step": "%s", "status": "%s", "seconds": %s, "budget": %s}\n' "$1" "$2" "$3" "${4:-0}" >> "$SUMMARY"
  echo "gpu_check: $1: $2 (${3}s of ${4:-0}s)"
}

# The toolkit's tools (nvcc, compute-sanitizer) where PATH may lack them.
[ "$MODE" = gpu ] && export PATH="$PATH:${CUDA_HOME:-/usr/local/cuda}/bin"

# Nothing outside $OUT and the tree: caches, bytecode, temporary files.
export TMPDIR="$OUT/tmp" XDG_CACHE_HOME="$OUT/cache" PYTHONDONTWRITEBYTECODE=1
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor" TRITON_CACHE_DIR="$OUT/triton"
export CUDA_CACHE_PATH="$OUT/nv-cache"
mkdir -p "$TMPDIR" "$XDG_CACHE_HOME"

# Steps run in a child bash under `timeout`; what the step functions read.
export MODE PY ROOT OUT STEP_NAMES="${STEPS[*]}"

FAILED=0
# Runs a step under its budget, less whatever time it would take from the
# guarded step's slot (for steps before it), less the time already gone.
step() {  # name command...
  local name=$1; shift
  local budget=${BUDGET[$name]}
  local now=$(( $(date +%s) - START ))
  local left=$(( TOTAL - now ))
  local reserve=0 seen=0 s
  for s in "${STEPS[@]}"; do
    [ "$s" = "$name" ] && seen=1
    if (( seen )) && [ "$s" = "$GUARDED" ] && [ "$name" != "$GUARDED" ]; then reserve=${BUDGET[$GUARDED]}; fi
  done
  (( budget > left - reserve )) && budget=$(( left - reserve ))
  if (( budget < 5 )); then record "$name" "skipped: out of time" 0 "$budget"; FAILED=1; return; fi
  local t0=$(date +%s)
  # A shell function of this script runs in a child bash (timeout runs programs).
  if declare -F "$1" >/dev/null; then set -- bash -c "$(declare -f "$1"); $1"; fi
  timeout --kill-after=5 "$budget" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local status=ok
  (( rc == 124 || rc == 137 )) && status="timed out after ${budget}s"
  (( rc != 0 && rc != 124 && rc != 137 )) && status="failed (exit $rc)"
  (( rc != 0 )) && FAILED=1
  record "$name" "$status" $(( $(date +%s) - t0 )) "$budget"
}

# --- preflight: fail fast and cleanly without a GPU ---------------------------------
preflight() {
  if [ "$MODE" = dry ]; then
    "$PY" -c 'import torch, torch_kvswap._fake_cuda; print("torch", torch.__version__, "(dry run: fake CUDA runtime)")'
    return
  fi
  nvidia-smi -L && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader &&
  "$PY" -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)' &&
  { nvcc --version | tail -1 || echo "nvcc not on PATH (the build finds the toolkit through torch)"; }
}
step preflight preflight
if grep -q '"step": "preflight", "status": "ok"' "$SUMMARY"; then :; else
  die "preflight failed: no usable GPU or toolchain here (see $OUT/preflight.log)"
fi
cp "$OUT/preflight.log" "$OUT/gpu.txt"

# --- build: in place, no network -------------------------------------------------------------
build() {
  if [ "$MODE" = dry ]; then
    KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=1 "$PY" setup.py --quiet build_ext --inplace &&
      "$PY" -c 'import torch_kvswap._fake_cuda; print("fake CUDA engine built")'
    return
  fi
  KVSWAP_BUILD_CUDA=1 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=0 TORCH_CUDA_ARCH_LIST=9.0 \
    MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace --build-temp "$ROOT/build/gpu-check" &&
  "$PY" -c 'import torch_kvswap as k; print("engines:", k.ENGINES, k._loader.ENGINE_ERRORS); assert k.ENGINES["cuda"]'
}
step build build
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
T="$ROOT/tests"
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider --rootdir "$ROOT")

# --- tests: the CUDA half of the suite -------------------------------------------------------
if [ "$MODE" = dry ]; then
  step tests "${PYTEST[@]}" --junitxml="$OUT/tests.xml" "$T/test_cuda_fake.py" -k "capture_and_replay and 2048"
else
  step tests "${PYTEST[@]}" --junitxml="$OUT/tests.xml" "$T/test_accelerators.py" "$T/test_compile.py" -k "cuda"
fi

# --- memcheck: a short set under compute-sanitizer ----------------------------------------
if [ "$MODE" = dry ]; then  # no sanitizer without a GPU: the same step machinery, plain pytest
  step memcheck "${PYTEST[@]}" "$T/test_cuda_fake.py" -k "kernel_copies_every_alignment and 2050"
else
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 --log-file "$OUT/memcheck.txt" \
    "${PYTEST[@]}" "$T/test_accelerators.py" \
    -k "cuda and (matches_the_cpu_reference and 2048 and bfloat16 or pointer_op or kernel_path or capture_on_every_path and 2048)"
fi

# --- probes and benchmark -------------------------------------------------------------------
FAKE=(); [ "$MODE" = dry ] && FAKE=(--fake)
step probe "$PY" "$ROOT/scripts/gpu_probe.py" probe "$OUT/probe.json" "${FAKE[@]}"
step bench "$PY" "$ROOT/scripts/gpu_probe.py" bench "$OUT/bench.json" "${FAKE[@]}"

# --- report: every step ran, every probe and bench result is checked -----------------------
report() {
  # shellcheck disable=SC2086 # STEP_NAMES: one word per step
  "$PY" - "$OUT" $STEP_NAMES <<'PYEOF'
import json, sys
out, steps = sys.argv[1], sys.argv[2:]
summary = [json.loads(line) for line in open(f"{out}/summary.json")]
done = {s["step"]: s["status"] for s in summary}
bad = [f"{s}: {done.get(s, 'missing')}" for s in steps if s != "report" and done.get(s) != "ok"]
for name in ("probe", "bench"):
    try:
        results = json.load(open(f"{out}/{name}.json"))["results"]
    except (OSError, ValueError, KeyError) as exc:
        bad.append(f"{name}.json: {exc}")
        continue
    bad += [f"{name}: {r}" for r in results if not r.get("ok")]
    if not results:
        bad.append(f"{name}.json: no results")
probes = json.load(open(f"{out}/probe.json"))["results"] if "probe" in done else []
for r in probes:
    if r["case"][0] == "reduce_overhead":
        print("reduce-overhead", r["case"][1:], "graph recorded:", r.get("graph_recorded"), "why not:", r.get("why_not"))
        if "graph_recorded" not in r:
            bad.append(f"probe {r['case']}: no graph_recorded report")
print("\n".join(bad) if bad else "every step ok, every result checked")
sys.exit(1 if bad else 0)
PYEOF
}
step report report

echo "gpu_check: done in $(( $(date +%s) - START ))s ($MODE); results in $OUT"
exit "$FAILED"
