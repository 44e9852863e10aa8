# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything
# the project needs and builds torch_kvswap into it. Safe to rerun: the
# requirements are installed only when requirements-dev.txt changed, and the
# build is incremental (ninja).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON_BIN="${PYTHON:-python3}"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[env] creating $VENV"
  "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.kvswap-requirements"
WANT="$(sha256sum requirements-dev.txt | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "[env] installing requirements-dev.txt"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -r requirements-dev.txt
  echo "$WANT" > "$STAMP"
fi
if ! "$PY" -m pip show --quiet torch_kvswap >/dev/null 2>&1; then
  echo "[env] installing torch_kvswap (editable)"
  "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
fi
# The tests' fake-runtime extensions (torch_kvswap._fake_cuda, ...).
export KVSWAP_BUILD_FAKES="${KVSWAP_BUILD_FAKES:-1}"
echo "[env] building torch_kvswap"
"$PY" setup.py --quiet build_ext --inplace
export PATH="$VENV/bin:$PATH"
