#!/usr/bin/env bash
# mutmut, a maintained mutation tool, over the Python modules pyproject.toml
# names ([tool.mutmut]: torch_kvswap/offloader/planning.py, by
# tests/test_offloader.py). It runs in a copy of the tree (build/mutmut/,
# with the tree's build of the extensions), since it writes its mutants/
# folder where it runs. Fails unless every mutant it made was killed, and
# lists the others (`mutmut show NAME` in build/mutmut/ prints one).
# docs/architecture.md says which modules it serves and why the curated
# mutants (scripts/mutation_check.sh) cover the rest.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # .venv (mutmut from requirements/dev.txt), the build
copy_tree mutmut   # env.sh's; sets TREE
cp --preserve=timestamps torch_kvswap/_*.so torch_kvswap/_build_info.json "$TREE/torch_kvswap/"
cd "$TREE"
rm -rf mutants
echo "[mutmut] $("$VENV/bin/mutmut" --version 2>&1 | tail -1) in $TREE"
# mutmut forks each mutant's test run from a process that has already run
# tests; torch's OpenMP threads do not survive fork() (docs/ops.md), so a
# child's first parallel torch op would wait for ever (a "timeout" verdict,
# or a crash). One intra-op thread starts no OpenMP pool at all.
export OMP_NUM_THREADS=1
"$VENV/bin/mutmut" run > mutmut-run.log 2>&1 || { tail -c 3000 mutmut-run.log; exit 1; }
tail -c 300 mutmut-run.log | tr '\r' '\n' | grep -E '[0-9]+/[0-9]+' | tail -1
"$VENV/bin/mutmut" results > mutmut-results.log 2>&1
if grep -qE ': (survived|timeout|suspicious|no tests|skipped|segfault|caught by type check|check was interrupted)' mutmut-results.log \
  || ! grep -q . <(ls mutants/torch_kvswap 2>/dev/null); then
  echo "[mutmut] not every mutant was killed:"; cat mutmut-results.log; exit 1
fi
echo "[mutmut] every mutant killed"
