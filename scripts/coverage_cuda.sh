#!/usr/bin/env bash
# Line coverage of the CUDA engine's host logic (csrc/cuda/cuda_engine.cpp),
# the kernel body (csrc/cuda/copy_kernel.h) and the fake runtime
# (tests/fake_cuda/fake_cuda_runtime.cpp) by the CPU suite's fake-runtime
# tests. Builds torch_kvswap._fake_cuda with --coverage into build/coverage/
# (the in-place build stays as it is), runs tests/test_cuda_fake.py against
# it and prints gcov's figures. Fails below the goals: engine 99 %, fake
# runtime 98 %.
# Usage: bash scripts/coverage_cuda.sh [extra pytest args]
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
COV="$ROOT/build/coverage"
LIB="$COV/lib"
mkdir -p "$LIB/torch_kvswap"
find "$COV" -name '*.gcda' -delete 2>/dev/null || true
echo "[coverage] building torch_kvswap._fake_cuda with --coverage"
KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=1 KVSWAP_FAKE_COVERAGE=1 \
  "$PY" setup.py --quiet build_ext --build-temp "$COV/temp" --build-lib "$LIB" >/dev/null
cp torch_kvswap/*.py "$LIB/torch_kvswap/"
echo "[coverage] running tests/test_cuda_fake.py"
# From $LIB, so that its torch_kvswap (with the instrumented extension) is imported.
(cd "$LIB" && PYTHONPATH="$LIB" "$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" \
  "$ROOT/tests/test_cuda_fake.py" "$@" | tail -3)
OBJ="$COV/temp/tests/fake_cuda"
cd "$OBJ"
report() {  # object-file stem, source path as gcov names it
  gcov -n -o "$OBJ" "$1.cpp" 2>/dev/null | grep -A1 "^File '.*$2'" | sed -n 2p
}
ENGINE="$(report engine_under_test csrc/cuda/cuda_engine.cpp)"
KERNEL="$(report fake_cuda_runtime csrc/cuda/copy_kernel.h)"
FAKE="$(report fake_cuda_runtime tests/fake_cuda/fake_cuda_runtime.cpp)"
echo "[coverage] csrc/cuda/cuda_engine.cpp (host logic): $ENGINE"
echo "[coverage] csrc/cuda/copy_kernel.h (kernel body, run on the host): $KERNEL"
echo "[coverage] tests/fake_cuda/fake_cuda_runtime.cpp (fake runtime): $FAKE"
pct() { echo "$1" | sed -E 's/.*executed:([0-9.]+)%.*/\1/'; }
awk -v e="$(pct "$ENGINE")" -v f="$(pct "$FAKE")" 'BEGIN {
  bad = 0
  if (e + 0 < 99) { print "[coverage] engine below the 99 % goal"; bad = 1 }
  if (f + 0 < 98) { print "[coverage] fake runtime below the 98 % goal"; bad = 1 }
  exit bad }'
