#!/usr/bin/env bash
# The torch releases torch_kvswap declares (README.md, "Install"), each as a
# user meets it, then under the test suite. For every VERSION (default: the
# oldest declared release and the newest on the registry; .venv's 2.13.0 is
# covered by scripts/test.sh and vLLM 0.33's 2.14.0 by scripts/test_vllm.sh):
#   1. a venv .venv-torch-VERSION holding only torch==VERSION, numpy and ninja;
#   2. the README's install line, read from README.md, from a clean copy of
#      the tree (kept in build/matrix-VERSION/ so a rerun recompiles only what
#      changed; its second half with --force-reinstall --no-deps, for a
#      rerun), then `pip check`: the line must leave no broken requirement
#      (torch 2.11 and 2.12 require setuptools < 82);
#   3. `python -m torch_kvswap` from outside the tree: must exit 0 and report
#      the host engine loaded;
#   4. the version guard: the in-place build of .venv (torch 2.13.0), imported
#      under VERSION, must raise the ImportError that names both releases;
#   5. pytest, hypothesis and expecttest are added, the copy is built in place
#      with the test fakes (incremental: the objects of step 2 are reused) and
#      the suite runs there.
# Usage: bash scripts/test_torch_matrix.sh [VERSION ...]. Exits non-zero on
# the first failing step. CUDA builds of torch bring their CUDA libraries (a
# few GB per release, downloaded once per venv).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # .venv with the in-place build (step 4); cd "$ROOT"
MAIN_PY="$PY"
VERSIONS=("$@")
LINE="$(grep -m1 '^pip install "setuptools' README.md)"   # the README's install line
[[ "$LINE" == *" && pip install --no-build-isolation ." ]] || { echo "[matrix] no install line in README.md"; exit 2; }
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.10.0 2.15.0)

for VERSION in "${VERSIONS[@]}"; do
  echo "[matrix] torch $VERSION"
  VENV="$ROOT/.venv-torch-$VERSION"
  REQ="$ROOT/requirements/torch-$VERSION.txt"   # torch==VERSION, numpy, ninja
  [ -f "$REQ" ] || { echo "[matrix] no $REQ: add one to test torch $VERSION"; exit 2; }
  ensure_venv "$VENV" "$REQ"   # env.sh's; sets PY
  VPY="$PY"

  copy_tree "matrix-$VERSION"   # env.sh's; sets TREE
  COPY="$TREE"
  echo "[matrix] $VERSION: the README's install line: $LINE"
  (cd "$COPY" && PATH="$VENV/bin:$PATH" && eval "${LINE%% && *} --quiet" \
     && eval "${LINE#* && } --quiet --force-reinstall --no-deps")
  "$VPY" -m pip check || { echo "[matrix] $VERSION: the install line left broken requirements"; exit 1; }
  REPORT="$(cd /tmp && "$VPY" -m torch_kvswap)"
  echo "$REPORT"
  grep -Eq '^  engine host +loaded$' <<<"$REPORT" || { echo "[matrix] $VERSION: host engine not reported loaded"; exit 1; }
  grep -Eq "^  built against +torch $VERSION" <<<"$REPORT" || { echo "[matrix] $VERSION: built against another torch"; exit 1; }

  echo "[matrix] $VERSION: the .venv build (torch 2.13.0) imported under torch $VERSION"
  GUARD="$(cd /tmp && PYTHONPATH="$ROOT" "$VPY" -c 'import torch_kvswap' 2>&1 || true)"
  if ! grep -q "built against torch 2.13.0" <<<"$GUARD" || ! grep -q "torch $VERSION" <<<"$GUARD"; then
    echo "$GUARD" | tail -5
    echo "[matrix] $VERSION: no version message"; exit 1
  fi
  echo "[matrix] $VERSION: $(grep -m1 -o 'torch_kvswap was built against.*installed' <<<"$GUARD")"

  "$VPY" -m pip uninstall --quiet --yes torch_kvswap
  "$VPY" -m pip install --quiet pytest hypothesis expecttest 2>&1 | grep -v 'is ignored: it is neither' || true
  echo "[matrix] $VERSION: building in place with the test fakes, then the suite"
  KVSWAP_BUILD_FAKES=1 build_in_place "$VPY" "$COPY"
  (cd "$COPY" && "$VPY" -m pytest -q -p no:cacheprovider tests ${KVSWAP_MATRIX_PYTEST_ARGS:-})
  release "$VENV" "$COPY"   # env.sh's: only under KVSWAP_PRUNE=1
done
