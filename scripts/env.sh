# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything
# the project needs and builds torch_kvswap into it. Safe to rerun: the
# requirements are installed only when requirements/dev.txt changed, and the
# build is incremental (ninja).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON_BIN="${PYTHON:-python3}"
# took, pip_index_args, uv_bin, ensure_venv
source "$ROOT/scripts/venv.sh"

# The source tree is the package: a .pth file puts it on the venv's path and
# the extensions are built in place (one compile, incremental with ninja).
# The tests' fake-runtime extension (torch_kvswap._fake_cuda) is built when
# KVSWAP_BUILD_FAKES=1.
# put_on_path VENV_PYTHON [TREE]: that venv imports torch_kvswap from TREE
# (default: the repository).
put_on_path() {
  local site
  site="$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "${2:-$ROOT}" > "$site/torch_kvswap_src.pth"
}

# build_in_place VENV_PYTHON [TREE]: builds TREE (default: the repository)
# in place against that venv's torch and puts it on the venv's path.
build_in_place() {
  local tree="${2:-$ROOT}"
  put_on_path "$1" "$tree"
  local start=$SECONDS
  echo "[env] building torch_kvswap in $tree (setup.py build_ext --inplace) ..."
  (cd "$tree" && "$1" setup.py --quiet build_ext --inplace)
  echo "[env] build step done in $(took $start)"
}

# copy_tree NAME: a copy of the tree's tracked and new files in build/NAME,
# for venvs whose torch is not .venv's (an extension is built for one torch).
# Its earlier build outputs are kept, so a rebuild recompiles only what
# changed (the copies keep their modification times). Sets TREE to the copy.
copy_tree() {
  TREE="$ROOT/build/$1"
  mkdir -p "$TREE"
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents --preserve=timestamps -t "$TREE")
}

# release DIR...: removes those venvs or build copies once a script is done
# with them, when KVSWAP_PRUNE=1. .ci/run sets it: its clone is thrown away,
# and each extra venv holds a CUDA build of torch (3-7 GB), so keeping them
# all would need about 25 GB of free disk where one at a time needs about 10.
# Otherwise they are kept, so a rerun installs and compiles nothing again.
release() {
  [ "${KVSWAP_PRUNE:-0}" = 1 ] || return 0
  local dir
  for dir in "$@"; do
    echo "[env] KVSWAP_PRUNE=1: removing $dir"
    rm -rf "$dir"
  done
}

VENV="$ROOT/.venv"
ensure_venv "$VENV" requirements/dev.txt
export KVSWAP_BUILD_FAKES="${KVSWAP_BUILD_FAKES:-1}"
# KVSWAP_TREE_BUILT=1: .ci/run built the tree before starting its two lanes
# of steps, so no step rebuilds it while the other lane uses it.
if [ "${KVSWAP_TREE_BUILT:-0}" = 1 ]; then put_on_path "$PY"; else build_in_place "$PY"; fi
export PATH="$VENV/bin:$PATH"
