# Sourced by scripts/env.sh and scripts/lint.sh: the functions that make a
# venv and install a requirements file into it (nothing is built or
# installed by sourcing this file).
ROOT="${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
PYTHON_BIN="${PYTHON_BIN:-${PYTHON:-python3}}"

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
import shlex, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
pairs = {}  # one of each: a setting in pip.conf and in PIP_* is listed twice
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    if flag:
        pairs.update(((flag, v), None) for v in shlex.split(value.strip("\x27\"")))
args = ["--index-strategy", "unsafe-best-match"] + [a for pair in pairs for a in pair]
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
      echo "[env] installing $requirements into $dir with uv (seconds once its wheels are in uv's cache; a CUDA build of torch, a minute or two before) ..."
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
