#!/usr/bin/env bash
# Compile-checks the accelerator engines that cannot run here, against their
# real headers: csrc/ascend/ against each pair of torch and torch-npu headers
# in NPU_PAIRS (one configuration each: optional ACL functions are found at run
# time), the core, host engine and Ascend engine for aarch64 (cross compiler,
# torch 2.13.0 and torch-npu 2.13.0), and csrc/cuda/:
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
# Every pair of torch and torch-npu the engine is built for in practice:
# vllm-ascend's pin (2.10.0 with 2.10.0.post4), the development release, and
# vLLM 0.33's torch. Each with the C++ standard its torch's cpp_extension
# passes (torch 2.10: C++17). Headers only: torch/include/ and
# torch_npu/include/ are extracted from the wheels into .ci-cache/ once (the
# wheels are deleted), with the symbols libtorch_npu.so exports; .venv's torch
# serves its own release.
NPU_PAIRS=("2.10.0 2.10.0.post4 c++17" "2.13.0 2.13.0 c++20" "2.14.0 2.14.0 c++20")
# fetch_headers SPEC DEST: extracts SPEC's torch/include/ or torch_npu/include/
# (and libtorch_npu.so's exported symbols) into DEST, unless already there.
fetch_headers() {
  [ -f "$2/.complete" ] && return 0
  echo "[engines] fetching $1 headers"
  rm -rf "$2" "$CACHE/download"
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: "$1" -d "$CACHE/download"
  "$PY" - "$CACHE/download" "$2" <<'PYEOF'
import glob, os, subprocess, sys, zipfile
wheel, dest = glob.glob(f"{sys.argv[1]}/*.whl")[0], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith(("torch/include/", "torch_npu/include/"))])
    if "torch_npu/lib/libtorch_npu.so" in z.namelist():
        lib = z.extract("torch_npu/lib/libtorch_npu.so", sys.argv[1])
        symbols = subprocess.run(["nm", "-D", "--defined-only", "--format=posix", lib], check=True,
                                 capture_output=True, text=True).stdout
        with open(f"{dest}/libtorch_npu.symbols", "w") as f:
            f.writelines(line.split()[0] + "\n" for line in symbols.splitlines())
open(f"{dest}/.complete", "w").close()
PYEOF
  rm -rf "$CACHE/download"
}
CXX="${CXX:-g++}"
OBJ="$(mktemp -d)"
trap 'rm -rf "$OBJ"' EXIT
VENV_TORCH="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
for pair in "${NPU_PAIRS[@]}"; do
  read -r torch_v npu_v std <<<"$pair"
  fetch_headers "torch-npu==$npu_v" "$CACHE/torch_npu-$npu_v"
  npu="$CACHE/torch_npu-$npu_v/torch_npu"
  if [ "$VENV_TORCH" = "$torch_v" ]; then
    incs=("${SYS_INCS[@]}")
  else
    fetch_headers "torch==$torch_v" "$CACHE/torch-$torch_v"
    t="$CACHE/torch-$torch_v/torch/include"
    incs=(-isystem "$t" -isystem "$t/torch/csrc/api/include" -isystem "$PY_INC")
  fi
  # One configuration per pair: the optional ACL functions are looked up at
  # run time (csrc/ascend/acl_real.cpp), so nothing about the CANN version is
  # decided here. The include directories are setup.py's (npu_extension).
  # The sources compile side by side (two cores).
  pids=()
  for src in csrc/ascend/*.cpp; do
    echo "[engines] $CXX $src (torch $torch_v, torch-npu $npu_v, $std)"
    "$CXX" -std="$std" -O2 -fPIC -c "$src" -o "$OBJ/$(basename "$src").o" "${WARN[@]}" "${incs[@]}" \
      -isystem "$npu/include" -isystem "$npu/include/third_party/acl/inc" -DTORCH_EXTENSION_NAME=_C_npu &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  # What the engine takes from libtorch_npu (linked --as-needed, setup.py):
  # nothing from torch-npu 2.13 on, NPUStream's constructor and stream()
  # before it; each must be exported by that release's library.
  refs="$(nm -u --format=posix "$OBJ"/*.o | awk '{print $1}' | grep -E '(7c10_npu|9torch_npu)' | sort -u || true)"
  before_2_13=false
  [ "$(printf '%s\n' "$npu_v" 2.13 | sort -V | head -1)" = 2.13 ] || before_2_13=true
  if $before_2_13 && [ -z "$refs" ]; then
    echo "[engines] torch-npu $npu_v: the engine references nothing of libtorch_npu, but this torch has no stream handle route without it" >&2
    exit 1
  fi
  if ! $before_2_13 && [ -n "$refs" ]; then
    echo "[engines] torch-npu $npu_v: the engine references libtorch_npu, which from 2.13 on it need not: $refs" >&2
    exit 1
  fi
  for sym in $refs; do
    grep -qxF "$sym" "$CACHE/torch_npu-$npu_v/libtorch_npu.symbols" || {
      echo "[engines] the engine references $(echo "$sym" | c++filt), which torch-npu $npu_v's libtorch_npu.so does not export" >&2
      exit 1
    }
  done
  if [ -n "$refs" ]; then
    echo "[engines] torch-npu $npu_v: takes $(echo "$refs" | wc -l) symbols from libtorch_npu, all exported by it"
  else
    echo "[engines] torch-npu $npu_v: references nothing of libtorch_npu"
  fi
done
NPU_INC="$CACHE/torch_npu-2.13.0/torch_npu/include"

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
