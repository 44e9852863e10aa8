#!/usr/bin/env bash
# Builds and runs scripts/measure_aliasing.cpp against .venv's torch: the
# aliasing check's cost per call at 64 cache pairs (docs/performance.md,
# "Aliasing check"). Prints one JSON line per address order.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
TORCH_DIR="$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
OUT_BIN="$ROOT/build/measure_aliasing"
mkdir -p "$ROOT/build"
INCS=()
for d in $("$PY" -c 'import torch.utils.cpp_extension as c; print(" ".join(c.include_paths()))'); do INCS+=(-isystem "$d"); done
g++ -std=c++20 -O2 -DNDEBUG "${INCS[@]}" scripts/measure_aliasing.cpp csrc/core/aliasing.cpp -o "$OUT_BIN" \
  -L "$TORCH_DIR/lib" -lc10 -ltorch_cpu -Wl,-rpath,"$TORCH_DIR/lib"
"$OUT_BIN"
