#!/usr/bin/env bash
# Sets up .venv, builds torch_kvswap and runs the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k expand`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" -m pytest -q "$@"
