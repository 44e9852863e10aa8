#!/usr/bin/env bash
# One-shot check on a machine with one NVIDIA GPU, torch (CUDA build) and nvcc
# preinstalled, and no network: builds the package with the CUDA engine, runs
# the CUDA tests, and benchmarks H2D and D2H per path for 2 KiB - 256 KiB
# blocks against one contiguous pinned copy of the same bytes. Everything goes
# to one results file (default: gpu-results.txt; or $1). About 3-4 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-results.txt}"
PY="${PYTHON:-python3}"
exec > >(tee "$OUT") 2>&1
echo "# torch_kvswap GPU check, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
nvcc --version | tail -1

echo "## build"
KVSWAP_BUILD_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps -q -e . || exit 1
"$PY" -c 'import torch_kvswap; print("engines:", torch_kvswap.ENGINES)'

echo "## tests (CUDA)"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_accelerators.py tests/test_handler.py -k "cuda or offloader" 2>&1 | tail -40
TESTS=${PIPESTATUS[0]}

echo "## benchmark"
for dir in h2d d2h; do
  for method in dma kernel; do
    echo "### $dir, copy method $method"
    "$PY" - "$dir" "$method" <<'PYEOF'
import sys, torch, torch_kvswap
from torch_kvswap import bench
torch_kvswap.set_copy_method(sys.argv[2])
bench.main(["--direction", sys.argv[1], "--block-kib", "2", "4", "8", "16", "32", "64", "128", "256",
            "--total-mib", "256", "--layers", "4", "--repeats", "5",
            "--methods", "contiguous", "kvswap_ptr", "kvswap_tensor",
            "--json", f"gpu-bench-{sys.argv[1]}-{sys.argv[2]}.json"])
PYEOF
  done
done
echo "## done: tests exit code $TESTS"
exit "$TESTS"
