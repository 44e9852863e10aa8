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
VVENV="$ROOT/.venv-vllm"
if [ ! -x "$VVENV/bin/python" ]; then
  echo "[vllm-env] creating $VVENV"
  "${PYTHON:-python3}" -m venv "$VVENV"
fi
VPY="$VVENV/bin/python"
STAMP="$VVENV/.kvswap-requirements"
WANT="$(sha256sum requirements-vllm.txt | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$WANT" ]; then
  echo "[vllm-env] installing requirements-vllm.txt (--no-deps)"
  "$VPY" -m pip install --quiet --no-deps -r requirements-vllm.txt
  echo "$WANT" > "$STAMP"
fi
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$SITE/torch_kvswap_src.pth"
export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 KVSWAP_REQUIRE_VLLM=1
exec "$VPY" -m pytest -q -p no:cacheprovider tests/test_vllm_connector.py tests/test_vllm_import.py "$@"
