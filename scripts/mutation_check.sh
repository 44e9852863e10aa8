#!/usr/bin/env bash
# The mutation check (docs/testing.md): sets up .venv and builds like the
# other scripts, then applies every mutant of scripts/mutants/ to a copy of
# the tree and runs its tests. Arguments go to scripts/mutation_check.py,
# e.g. `bash scripts/mutation_check.sh --fast` (Python mutants only, as CI
# runs it) or `--only NAME` or `--list`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" scripts/mutation_check.py "$@"
