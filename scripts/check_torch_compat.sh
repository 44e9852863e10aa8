#!/usr/bin/env bash
# Builds torch_kvswap against another torch release and runs the test suite
# with it, in a copy of the working tree (the in-place build of .venv stays
# as it is). Usage: bash scripts/check_torch_compat.sh [VERSION]  (default
# 2.6.0, the oldest release setup.py accepts). Accelerator engines are not
# built: this checks the core, the host engine and the Python package, and
# compiles the CUDA engine against that release's headers when nvcc exists.
# Downloads torch and, for CUDA builds of torch, its CUDA libraries (a few GB)
# into .venv-torch-VERSION/ on first use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-2.6.0}"
VENV="$ROOT/.venv-torch-$VERSION"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "[compat] creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
  echo "[compat] installing torch==$VERSION"
  "$PY" -m pip install --quiet "torch==$VERSION" numpy ninja setuptools wheel pytest hypothesis expecttest
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$WORK")
cd "$WORK"
echo "[compat] building against torch $("$PY" -c 'import torch; print(torch.__version__)')"
KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_NPU=0 KVSWAP_BUILD_FAKES=1 "$PY" setup.py --quiet build_ext --inplace
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -n "$NVCC" ]; then
  echo "[compat] csrc/cuda/ host logic against torch $VERSION's headers (compile only)"
  INCS=()
  for d in $("$PY" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))') \
           "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
           "${CUDA_HOME:-/usr/local/cuda}/include"; do
    INCS+=("-isystem" "$d")
  done
  for src in csrc/cuda/cuda_engine.cpp csrc/cuda/cuda_api_real.cpp; do
    "${CXX:-g++}" -std=c++17 -O2 -fPIC -c "$src" -o /dev/null -Wall -Wextra -Werror -Wno-unused-parameter \
      "${INCS[@]}" -DTORCH_EXTENSION_NAME=_C_cuda
  done
fi
"$PY" -m pytest -q -p no:cacheprovider tests "${@:2}"
