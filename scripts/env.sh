# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything
# the project needs and builds torch_kvswap into it. Safe to rerun: the
# requirements are installed only when requirements-dev.txt changed, and the
# build is incremental (ninja).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON_BIN="${PYTHON:-python3}"

# ensure_venv DIR REQUIREMENTS [PIP_ARGS...]: creates the venv DIR if it is
# missing and installs REQUIREMENTS into it (with PIP_ARGS) whenever that
# file changed since the last install; sets PY to its python.
ensure_venv() {
  local dir="$1" requirements="$2"
  shift 2
  if [ ! -x "$dir/bin/python" ]; then
    echo "[env] creating $dir"
    "$PYTHON_BIN" -m venv "$dir"
  fi
  PY="$dir/bin/python"
  local stamp="$dir/.kvswap-requirements" want
  want="$(sha256sum "$requirements" | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    echo "[env] installing $requirements into $dir"
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet "$@" -r "$requirements"
    echo "$want" > "$stamp"
  fi
}

VENV="$ROOT/.venv"
ensure_venv "$VENV" requirements-dev.txt
if ! "$PY" -m pip show --quiet torch_kvswap >/dev/null 2>&1; then
  echo "[env] installing torch_kvswap (editable)"
  "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
fi
# The tests' fake-runtime extensions (torch_kvswap._fake_cuda, ...).
export KVSWAP_BUILD_FAKES="${KVSWAP_BUILD_FAKES:-1}"
echo "[env] building torch_kvswap"
"$PY" setup.py --quiet build_ext --inplace
export PATH="$VENV/bin:$PATH"
