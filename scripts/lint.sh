#!/usr/bin/env bash
# Lint and format check of the whole tree, CI's first step: ruff (rules and
# format: pyproject.toml, [tool.ruff]) over the Python files, clang-format
# (.clang-format) over the C++ and CUDA files git tracks or would add. The pinned tools live
# in .venv-lint (requirements/lint.txt), without torch and without building
# the extension, so the check takes seconds.
#   bash scripts/lint.sh          check, fail on any finding or unformatted file
#   bash scripts/lint.sh --fix    format everything in place, apply ruff's safe fixes
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/venv.sh
ensure_venv "$ROOT/.venv-lint" requirements/lint.txt   # sets PY
BIN="$ROOT/.venv-lint/bin"
# Tracked and new (not ignored) files, as ruff walks the tree: a C++ file not
# yet added to git is checked here before CI's clean clone meets it.
mapfile -t CPP < <(git ls-files --cached --others --exclude-standard '*.cpp' '*.cc' '*.h' '*.hpp' '*.cu' '*.cuh')
status=0
if [ "${1:-}" = --fix ]; then
  "$BIN/ruff" check --fix . || status=1
  "$BIN/ruff" format .
  "$BIN/clang-format" -i "${CPP[@]}"
  exit "$status"
fi
echo "[lint] ruff check"
"$BIN/ruff" check . || status=1
echo "[lint] ruff format --check"
"$BIN/ruff" format --check . || status=1
echo "[lint] clang-format --dry-run --Werror (${#CPP[@]} files)"
"$BIN/clang-format" --dry-run --Werror "${CPP[@]}" || status=1
[ "$status" = 0 ] && echo "[lint] clean" || echo "[lint] FAILED: \`bash scripts/lint.sh --fix\` formats the tree and applies ruff's safe fixes"
exit "$status"
