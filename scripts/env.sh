# Sourced by scripts/demo.sh and scripts/test.sh: makes .venv with everything
# the project needs and builds torch_kvswap into it. Safe to rerun: the
# requirements are installed only when requirements/dev.txt changed, and the
# build is incremental (ninja).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON_BIN="${PYTHON:-python3}"

# took START: the time since START (a $SECONDS reading), as "42 s" or
# "3 min 05 s", so each setup step ends with how long it took.
took() {
  local s=$((SECONDS - $1))
  if [ "$s" -ge 60 ]; then printf '%d min %02d s' $((s / 60)) $((s % 60)); else printf '%d s' "$s"; fi
}

# pip_index_args: pip's own index settings (`pip config list` and the
# PIP_* variables it reads) as uv arguments, so uv resolves from the same
# registry and local wheel folders as pip. pip takes the best match across
# all indexes; uv is told to do the same.
pip_index_args() {
  "$PYTHON_BIN" -m pip config list 2>/dev/null | "$PYTHON_BIN" -c '
import os, shlex, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
args = ["--index-strategy", "unsafe-best-match"]
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    if flag:
        args += [a for v in shlex.split(value.strip("\x27\"")) for a in (flag, v)]
print(" ".join(shlex.quote(a) for a in args))'
}

# uv_bin: the uv that installs every venv's packages (`uv pip install`: it
# unpacks a wheel once into its cache, ~/.cache/uv, and links it into each
# venv, where pip unpacks each CUDA build of torch again, minutes apiece).
# It lives in .venv, installed there with pip the first time; KVSWAP_PIP=1
# installs with pip instead.
uv_bin() {
  local uv="$ROOT/.venv/bin/uv"
  if [ ! -x "$uv" ] && [ -x "$ROOT/.venv/bin/python" ]; then
    "$ROOT/.venv/bin/python" -m pip install --quiet uv 2>&1 | grep -v 'is ignored: it is neither' || true
  fi
  [ -x "$uv" ] && echo "$uv"
}

# ensure_venv DIR REQUIREMENTS [PIP_ARGS...]: creates the venv DIR if it is
# missing and installs REQUIREMENTS into it (with PIP_ARGS) whenever that
# file changed since the last install (one stamp per requirements file, so
# one venv can take several); sets PY to its python.
ensure_venv() {
  local dir="$1" requirements="$2"
  shift 2
  local start=$SECONDS
  if [ ! -x "$dir/bin/python" ]; then
    echo "[env] creating the virtual environment $dir ..."
    "$PYTHON_BIN" -m venv "$dir"
    echo "[env] created $dir in $(took $start)"
  fi
  PY="$dir/bin/python"
  local stamp="$dir/.kvswap-$(basename "$requirements")" want uv
  want="$(sha256sum "$requirements" | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    start=$SECONDS
    uv="$([ "${KVSWAP_PIP:-0}" = 1 ] || uv_bin || true)"
    if [ -n "$uv" ]; then
      echo "[env] installing $requirements into $dir with uv (a CUDA build of torch: a minute the first time, seconds after) ..."
      local index
      eval "index=($(pip_index_args))"
      "$uv" pip install --quiet --python "$PY" "${index[@]}" --upgrade pip
      "$uv" pip install --quiet --python "$PY" "${index[@]}" "$@" -r "$requirements"
    else
      echo "[env] installing $requirements into $dir with pip (torch among them: minutes the first time) ..."
      "$PY" -m pip install --quiet --upgrade pip
      "$PY" -m pip install --quiet "$@" -r "$requirements"
    fi
    echo "$want" > "$stamp"
    echo "[env] installed $requirements in $(took $start)"
  fi
}

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
