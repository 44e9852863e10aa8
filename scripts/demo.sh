#!/usr/bin/env bash
# Sets up .venv, builds torch_kvswap and runs the demo: offload a model-shaped
# paged KV cache to host memory and back, checking every byte.
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --help`.
export KVSWAP_BUILD_FAKES=0   # the demo needs no test-only extension
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" -m torch_kvswap.bench.demo "$@"
