#!/usr/bin/env bash
# Compile-checks the accelerator engines that cannot run here, against their
# real headers: csrc/ascend/ against torch-npu 2.13.0's shipped ACL headers
# (one configuration: optional ACL functions are found at run time), the core,
# host engine and Ascend engine for aarch64 (cross compiler), and csrc/cuda/:
# the host logic with the host compiler against the CUDA runtime and torch
# headers, the kernel with nvcc. Also runs the Ascend engine on the fake ACL
# runtime with the batch API and the capture query missing from the start.
# Warnings in our code are errors. Exits non-zero on the first failure.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
CACHE="$ROOT/.ci-cache"
mkdir -p "$CACHE"
TORCH_INC="$("$PY" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))')"
PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
SYS_INCS=()
for d in $TORCH_INC "$PY_INC"; do SYS_INCS+=("-isystem" "$d"); done
WARN=(-Wall -Wextra -Werror -Wno-unused-parameter)

# --- Ascend -------------------------------------------------------------------
NPU_VERSION=2.13.0
NPU_INC="$CACHE/torch_npu-$NPU_VERSION/torch_npu/include"
if [ ! -f "$NPU_INC/acl/acl_rt.h" ]; then
  echo "[engines] fetching torch-npu $NPU_VERSION headers"
  "$PY" -m pip download --quiet --no-deps "torch-npu==$NPU_VERSION" -d "$CACHE/wheels"
  "$PY" - "$CACHE/wheels" "$CACHE/torch_npu-$NPU_VERSION" <<'PYEOF'
import glob, sys, zipfile
wheel = sorted(glob.glob(f"{sys.argv[1]}/torch_npu-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("torch_npu/include/")])
PYEOF
fi
CXX="${CXX:-g++}"
# One configuration: the optional ACL functions are looked up at run time
# (csrc/ascend/acl_real.cpp), so nothing about the CANN version is decided here.
for src in csrc/ascend/*.cpp; do
  echo "[engines] $CXX $src"
  "$CXX" -std=c++20 -O2 -fPIC -c "$src" -o /dev/null "${WARN[@]}" "${SYS_INCS[@]}" \
    -isystem "$NPU_INC" -DTORCH_EXTENSION_NAME=_C_npu
done

# The engine's logic loads and answers through the fake ACL runtime when the
# batch API and the capture query are both absent (CANN 8.0-like), the table
# built that way from the start (tests/fake_npu/cases_load.py).
echo "[engines] Ascend engine on the fake ACL runtime, no batch API and no capture query"
KVSWAP_FAKE_ACL_ABSENT=aclrtMemcpyBatchAsync,aclmdlRICaptureGetInfo,aclmdlRICaptureBegin \
  "$PY" -m pytest -q -p no:cacheprovider -o "python_files=cases_*.py" tests/fake_npu/cases_load.py

# --- aarch64 (Ascend servers are often Arm hosts) ------------------------------
# The core, the host engine and the Ascend engine must build without the
# x86-only fast paths. Cross-compiled for syntax and codegen, not linked;
# -fopenmp as setup.py passes it (torch's parallel backend is OpenMP).
XCXX="${AARCH64_CXX:-aarch64-linux-gnu-g++}"
if ! command -v "$XCXX" >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[engines] installing $XCXX"
  apt-get install -y -q g++-aarch64-linux-gnu >/dev/null 2>&1 || \
    (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q g++-aarch64-linux-gnu >/dev/null 2>&1) || true
fi
if command -v "$XCXX" >/dev/null 2>&1; then
  for src in csrc/registration.cpp csrc/core/*.cpp csrc/host/host_engine.cpp csrc/ascend/*.cpp; do
    echo "[engines] $XCXX $src"
    "$XCXX" -std=c++20 -O2 -fPIC -fopenmp -c "$src" -o /dev/null "${WARN[@]}" "${SYS_INCS[@]}" \
      -isystem "$NPU_INC" -DTORCH_EXTENSION_NAME=_C
  done
else
  echo "[engines] WARNING: no aarch64 cross compiler ($XCXX); the aarch64 build is not checked" >&2
fi

# --- CUDA ---------------------------------------------------------------------
# The engine is split (docs/cuda.md): host logic and its libcudart binding are
# host-compiler C++ against the CUDA runtime headers and torch; only the
# kernel goes through nvcc. Each half is checked with the compiler that
# builds it in `_C_cuda`.
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
if [ ! -x "$NVCC" ]; then
  echo "[engines] nvcc not found; the CUDA engine cannot be checked" >&2
  exit 1
fi
# The toolkit's headers (nvcc may be a wrapper script elsewhere): CUDA_HOME,
# else torch's guess, else /usr/local/cuda.
CUDA_INC=""
for home in "${CUDA_HOME:-}" "$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")')" /usr/local/cuda; do
  if [ -n "$home" ] && [ -f "$home/include/cuda_runtime_api.h" ]; then CUDA_INC="$home/include"; break; fi
done
[ -n "$CUDA_INC" ] || { echo "[engines] CUDA runtime headers not found" >&2; exit 1; }
for src in csrc/cuda/cuda_engine.cpp csrc/cuda/cuda_api_real.cpp; do
  echo "[engines] $CXX $src (CUDA runtime headers)"
  "$CXX" -std=c++20 -O2 -fPIC -c "$src" -o /dev/null "${WARN[@]}" "${SYS_INCS[@]}" \
    -isystem "$CUDA_INC" -DTORCH_EXTENSION_NAME=_C_cuda
done
for src in csrc/cuda/*.cu; do
  echo "[engines] nvcc $src"
  "$NVCC" -std=c++20 -O2 -c "$src" -o /dev/null -arch=sm_90 \
    -Xcompiler -fPIC -Xcompiler "$(IFS=,; echo "${WARN[*]}")" -Werror all-warnings
done
echo "[engines] all engine sources compile"
