#!/usr/bin/env bash
# Line coverage of the Ascend engine's logic (csrc/ascend/ascend_engine.cpp)
# by the CPU suite's fake-ACL cases: builds the test extension with --coverage
# into a temporary directory, runs every case session (as
# tests/test_ascend_fake.py does), then asks gcov. Prints the line and branch
# figures and exits non-zero when lines fall below the floor (default 90 %, or $1).
# The same build runs under AddressSanitizer (the engine and the fake runtime;
# torch and _C are not instrumented), so a use after free in either fails the
# run: an event freed while its record was still queued once crashed a case
# only on some machines. KVSWAP_ASAN=0 builds without it.
# csrc/ascend/acl_real.cpp, the binding to the real ACL, runs only on an NPU.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
FLOOR="${1:-90}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export KVSWAP_FAKE_NPU_BUILD_DIR="$WORK/build"
export KVSWAP_FAKE_NPU_CFLAGS="--coverage -O0"
export KVSWAP_FAKE_NPU_LDFLAGS="--coverage"
if [ "${KVSWAP_ASAN:-1}" = 1 ]; then
  KVSWAP_FAKE_NPU_CFLAGS+=" -fsanitize=address -fno-omit-frame-pointer"
  KVSWAP_FAKE_NPU_LDFLAGS+=" -fsanitize=address"
  # Python is not built with ASan: its runtime goes first, and libstdc++
  # with it, or ASan cannot find the __cxa_throw it intercepts.
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
  # Reports go to files (pytest captures stderr, and a report ends the process).
  export ASAN_OPTIONS="detect_leaks=0:log_path=$WORK/asan"  # leaks: torch's own, at exit
  trap '{ cat "$WORK"/asan.* 2>/dev/null || true; } | head -60; rm -rf "$WORK"' EXIT
fi
CASES=(tests/fake_npu/cases_*.py)
MAIN=()
for f in "${CASES[@]}"; do [ "$f" = tests/fake_npu/cases_load.py ] || MAIN+=("$f"); done
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o "python_files=cases_*.py")
echo "[coverage] fake-ACL cases with --coverage (build in $WORK)"
"${PYTEST[@]}" "${MAIN[@]}"
KVSWAP_FAKE_ACL_ABSENT="$("$PY" -c 'import sys; sys.path.insert(0, "tests"); import test_ascend_fake as t; print(t.LOAD_ABSENT)')" \
  "${PYTEST[@]}" tests/fake_npu/cases_load.py
unset LD_PRELOAD
cd "$WORK/build"
gcov -b -o . "$ROOT/csrc/ascend/ascend_engine.cpp" > gcov.txt 2>&1 || { cat gcov.txt; exit 1; }
FILE_STATS="$(grep -A4 "File '$ROOT/csrc/ascend/ascend_engine.cpp'" gcov.txt)"
LINE="$(echo "$FILE_STATS" | grep 'Lines executed' | head -1)"
echo "[coverage] csrc/ascend/ascend_engine.cpp: $LINE"
echo "[coverage] csrc/ascend/ascend_engine.cpp: $(echo "$FILE_STATS" | grep 'Branches executed' | head -1)"
echo "[coverage] csrc/ascend/ascend_engine.cpp: $(echo "$FILE_STATS" | grep 'Taken at least once' | head -1)"
if [ -n "${KVSWAP_COVERAGE_KEEP:-}" ]; then cp ascend_engine.cpp.gcov "$KVSWAP_COVERAGE_KEEP"; fi
PCT="$(echo "$LINE" | sed -E 's/Lines executed:([0-9.]+)%.*/\1/')"
awk -v p="$PCT" -v f="$FLOOR" 'BEGIN { exit !(p + 0 >= f + 0) }' || {
  echo "[coverage] below the floor of $FLOOR %; uncovered lines:"
  grep -E '^ +#####' ascend_engine.cpp.gcov || true
  exit 1
}
