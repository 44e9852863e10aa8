#!/usr/bin/env bash
# Line coverage of the CUDA engine's host logic (csrc/cuda/cuda_engine.cpp),
# the kernel body (csrc/cuda/copy_kernel.h) and the fake runtime
# (tests/fake_cuda/fake_cuda_runtime.cpp) by the CPU suite's fake-runtime
# tests. The fake extension is test-only and setup.py builds it only in
# place, so a copy of the tree (build/coverage/tree/, env.sh's copy_tree) is
# built in place with --coverage, its objects in build/coverage/temp/ (the
# repository's own in-place build stays as it is); tests/test_cuda_fake.py
# runs in that copy and gcov's figures are printed. Fails below the goals
# (engine 99 %, fake runtime 98 %) and when the tests left no coverage data.
# Usage: bash scripts/coverage_cuda.sh [extra pytest args]
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
COV="$ROOT/build/coverage"
OBJ="$COV/temp/tests/fake_cuda"
copy_tree coverage/tree   # env.sh's; sets TREE
find "$COV/temp" -name '*.gcda' -delete 2>/dev/null || true
# The host engine (_C) takes the same flags here as in the tree: the tree's
# build of it is copied with its build fingerprint (modification time kept),
# so the copy's build compiles only the fake, not _C again (build_command.py,
# BuildWithSummary.stale). A changed source still makes the copy stale.
mkdir -p "$COV/temp"
# With the tree's build record: an in-place build whose record names another
# torch (or none) compiles everything (build_command.py, BuildWithSummary.stale).
for so in "$ROOT"/torch_kvswap/_C.*.so "$ROOT"/torch_kvswap/_build_info.json; do
  cp --preserve=timestamps "$so" "$TREE/torch_kvswap/"
done
TORCH_RELEASE="$("$PY" -c 'import torch; print(torch.__version__)')"
for stamp in "$ROOT"/build/temp.*/"torch-$TORCH_RELEASE"/torch_kvswap._C.fingerprint; do cp "$stamp" "$COV/temp/"; done
echo "[coverage] building torch_kvswap._fake_cuda with --coverage in $TREE"
(cd "$TREE" && KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=1 KVSWAP_FAKE_COVERAGE=1 \
  "$PY" setup.py --quiet build_ext --inplace --build-temp "$COV/temp" 2>&1 | grep -F -e '_fake_cuda' -e '(_C)')
echo "[coverage] running tests/test_cuda_fake.py"
# In the copy, so that its torch_kvswap (with the instrumented extension) is imported.
(cd "$TREE" && PYTHONPATH="$TREE" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_fake.py "$@" | tail -3)
ls "$OBJ"/*.gcda >/dev/null 2>&1 \
  || { echo "[coverage] no coverage data in $OBJ: the tests did not run the instrumented build"; exit 1; }
cd "$OBJ"
report() {  # object-file stem, source path as gcov names it
  gcov -n -o "$OBJ" "$1.cpp" 2>/dev/null | grep -A1 "^File '.*$2'" | sed -n 2p || true
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
