#!/usr/bin/env bash
# Installs torch_kvswap the ways a user does, outside the project's own
# scripts, and checks what they get:
#   1. `pip install .` with build isolation stops within a minute and prints
#      the right command (it must never build against another torch);
#   2. an sdist is built, then a wheel from that sdist (as pip builds from
#      PyPI); the wheel must hold no test-only extension (_fake*), no test
#      code and none of the build helpers (setup_helpers/);
#   3. the wheel goes into a clean venv (.venv-wheel: torch, numpy) and a
#      smoke test runs from outside the source tree (scripts/smoke_test.py):
#      import, one swap_blocks against a plain reference, one offloader round
#      trip, `python -m torch_kvswap`.
#   4. a wheel built from the working tree itself, where the suite ran and
#      built its test-only extensions in place, with an extension of an
#      earlier build left in build/ on purpose (as one for another torch
#      would be); installed into the same clean venv, it must hold only what
#      its own build compiled for this torch (no _fake* module, no leftover),
#      and its _build_info.json must list exactly the extension files installed.
# Uses .venv's torch (2.13.0) for the build. Exits non-zero on any failure.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # .venv; cd "$ROOT"
BUILD_PY="$PY"
OUT="$ROOT/build/dist"
rm -rf "$OUT"
mkdir -p "$OUT"

echo "[install] 1. pip install . with build isolation must refuse within 60 s"
start=$(date +%s)
set +e
ISOLATED="$(timeout 300 "$BUILD_PY" -m pip install --dry-run --no-deps . 2>&1)"
status=$?
set -e
took=$(( $(date +%s) - start ))
if [ $status -eq 0 ] || ! grep -q -- "pip install --no-build-isolation ." <<<"$ISOLATED"; then
  echo "$ISOLATED" | tail -20
  echo "[install] the isolated build did not stop with the install command (exit $status)"; exit 1
fi
[ "$took" -le 60 ] || { echo "[install] the isolated build took ${took} s to refuse (limit 60 s)"; exit 1; }
echo "[install] refused in ${took} s with the install command"

echo "[install] 2. sdist, then a wheel built from it"
"$BUILD_PY" setup.py --quiet sdist --dist-dir "$OUT" >"$OUT/sdist.log" 2>&1 || { cat "$OUT/sdist.log"; exit 1; }
SDIST="$(ls "$OUT"/torch_kvswap-*.tar.gz)"
# KVSWAP_BUILD_FAKES=1 on purpose: even when asked for, no fake goes in a wheel.
KVSWAP_BUILD_FAKES=1 "$BUILD_PY" -m pip wheel --quiet --no-build-isolation --no-deps -w "$OUT" "$SDIST"
WHEEL="$(ls "$OUT"/torch_kvswap-*.whl)"
"$BUILD_PY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if n.split("/")[-1].startswith("_fake") or n.startswith(("tests/", "setup_helpers/"))
       or "/tests/" in n]
assert not bad, f"test or build-only files in the wheel: {bad}"
assert any(n.startswith("torch_kvswap/_C.") and n.endswith(".so") for n in names), names
assert "torch_kvswap/_build_info.json" in names, names
print(f"[install] wheel: {len(names)} files, no _fake* module and no test code")
EOF

echo "[install] 3. the wheel in a clean venv, smoke test from outside the tree"
printf 'torch==2.13.0\nnumpy\n' > "$ROOT/build/wheel-requirements.txt"
ensure_venv "$ROOT/.venv-wheel" "$ROOT/build/wheel-requirements.txt"   # sets PY
"$PY" -m pip install --quiet --no-deps --force-reinstall "$WHEEL"
SMOKE="$(mktemp -d)"
cp "$ROOT/scripts/smoke_test.py" "$SMOKE/"
(cd "$SMOKE" && "$PY" smoke_test.py)
rm -rf "$SMOKE"

echo "[install] 4. a wheel from the working tree where the tests ran in place"
echo "[install] in-place extensions in the tree: $(cd "$ROOT/torch_kvswap" && echo *.so)"
# What an earlier build for another torch leaves in build/: an engine this
# build does not build, where setuptools would pick it up for the wheel.
LEFTOVER="$("$BUILD_PY" - <<'EOF'
import sysconfig
from setuptools.dist import Distribution
cmd = Distribution().get_command_obj("build")
cmd.finalize_options()
print(f"{cmd.build_platlib}/torch_kvswap/_C_npu{sysconfig.get_config_var('EXT_SUFFIX')}")
EOF
)"
mkdir -p "$(dirname "$LEFTOVER")"
cp "$(ls "$ROOT"/torch_kvswap/_C.*.so)" "$LEFTOVER"
rm -rf "$OUT/tree" && mkdir -p "$OUT/tree"
# With the PATH that built the tree in place (env.sh prepends .venv/bin only
# after its build): another ninja on the path (.venv's 1.13 against the
# system's 1.11) reads the other's log as foreign and recompiles everything.
PATH="${PATH#"$VENV/bin:"}" "$BUILD_PY" -m pip wheel --quiet --no-build-isolation --no-deps -w "$OUT/tree" "$ROOT"
[ ! -e "$LEFTOVER" ] || { echo "[install] the build left $LEFTOVER in place"; exit 1; }
"$PY" -m pip install --quiet --no-deps --force-reinstall "$OUT"/tree/torch_kvswap-*.whl
(cd /tmp && "$PY" - <<'EOF'
import json, pathlib, torch, torch_kvswap
pkg = pathlib.Path(torch_kvswap.__file__).parent
assert "site-packages" in str(pkg), pkg
files = sorted(p.name for p in pkg.iterdir() if p.suffix == ".so")
info = json.loads((pkg / "_build_info.json").read_text())
recorded = sorted(e["file"] for e in info["engines"].values() if e["built"])
assert not [f for f in files if f.startswith("_fake")], f"test-only extension installed: {files}"
assert files == recorded, f"installed {files}, but the build record lists {recorded}"
assert info["torch"] == torch.__version__, (info["torch"], torch.__version__)
assert torch_kvswap._loader.unrecorded_extensions(info) == []
print(f"[install] from the tree: {', '.join(files)}, as recorded, for torch {info['torch']}; no _fake*, no leftover")
EOF
)
release "$ROOT/.venv-wheel"   # env.sh's: only under KVSWAP_PRUNE=1
