#!/usr/bin/env bash
# Runs the vLLM integration tests (tests/test_vllm_connector.py): vLLM 0.33.0's
# own OffloadingConnector, worker role, drives torch_kvswap's plug-in on CPU
# caches. Makes .venv-vllm on first use: torch 2.13.0 (CPU), vllm==0.33.0 and
# the packages its offloading path imports, all pinned in requirements-vllm.txt
# and installed with --no-deps (so no CUDA torch is pulled in). The extension
# is built by scripts/env.sh (as for scripts/test.sh) and used from the source
# tree. Extra arguments go to pytest. Exits with pytest's status; a missing or
# broken vLLM fails the run instead of skipping it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # .venv, the built extension; cd "$ROOT"
ensure_venv "$ROOT/.venv-vllm" requirements-vllm.txt --no-deps   # env.sh's; sets PY
VPY="$PY"
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/torch_kvswap_src.pth"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 KVSWAP_REQUIRE_VLLM=1
exec "$VPY" -m pytest -q -p no:cacheprovider tests/test_vllm_connector.py tests/test_vllm_import.py "$@"
