"""One vLLM engine (``LLM``) in a process of its own, driven by a test.

Several engines on one machine (vLLM's p2p tier between two of them) need
processes of their own: vLLM keeps its connector, its parallel state and its
NIXL agent per process. :class:`Instance` starts this file as a script;
the script builds the engine from the JSON of its first argument, then
answers one JSON command per line of its standard input with one JSON line
(prefixed with :data:`REPLY`, since vLLM logs to the same stream):

- ``{"op": "generate", "prompt": [...], "kv_transfer_params": {...}}``:
  ``{"tokens": [...], "cached": n, "finish_reason": "length"}``;
- ``{"op": "rpc", "method": "kvswap_track", "args": [...]}``: every rank's
  result of that method of :class:`vllm_worker_extension.KVSwapRecorder`;
- ``{"op": "metrics", "prefix": "vllm:"}``: vLLM's counters with that prefix;
- ``{"op": "shutdown"}``: the engine shut down, then the process exits.

The engine's arguments are tests/test_vllm_engine.py's (the 4-layer model,
32-token blocks), with the test's overrides.

:class:`ServerInstance` is the same engine as vLLM's OpenAI server, started
from a command line, with the parts of :class:`Instance`'s interface a
server can offer over HTTP (``VLLM_SERVER_DEV_MODE=1`` for
``/collective_rpc``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPLY = "KVSWAP-REPLY "
TESTS = Path(__file__).resolve().parent
ENGINE_MODEL = str(TESTS / "data" / "llama-4layer")
#: the test model's engine: ``LLM``'s arguments, and as the server's flags (SERVER_FLAGS)
ENGINE = dict(
    load_format="dummy",
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float16",
    max_model_len=512,
    block_size=32,
    max_num_seqs=2,
    num_gpu_blocks_override=64,
    seed=0,
    enable_prefix_caching=True,
)
SERVER_FLAGS = [
    part
    for name, value in ENGINE.items()
    for part in (["--" + name.replace("_", "-")] + ([] if value is True else [str(value)]))
]


def random_weight_model(root: Path, seed: int = 0) -> Path:
    """The 4-layer test model (tests/data/llama-4layer's config) with random
    weights in ``root`` (a safetensors file), made once per ``root``: vLLM's
    dummy weights are the same on every tensor-parallel rank, so the ranks'
    KV caches would hold the same bytes and a rank mix-up would go unseen."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((TESTS / "data" / "llama-4layer" / "config.json").read_text())
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if (root / "model.safetensors").exists():
        return root
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.float16)

    weights = {
        "model.embed_tokens.weight": rand(vocab, h),
        "model.norm.weight": torch.ones(h, dtype=torch.float16),
    }
    weights["lm_head.weight"] = rand(vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.float16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16),
        }
    save_file(weights, str(root / "model.safetensors"))
    return root


class InstanceError(RuntimeError):
    """The instance process exited or answered with an error."""


class Instance:
    """A vLLM engine in a child process (this file run as a script)."""

    def __init__(
        self,
        name: str,
        engine_args: dict,
        env: dict | None = None,
        log_dir: Path | None = None,
        cores: set[int] | None = None,
    ):
        """Starts the engine; ``cores``: the CPUs it and every process it
        starts may run on (all when None)."""
        self.name = name
        self.log = (log_dir or Path("/tmp")) / f"vllm-instance-{name}-{os.getpid()}.log"
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self._lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), json.dumps(engine_args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                # the engine core in a process of its own, stepping by itself
                # (an in-process engine steps only inside generate)
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                **(env or {}),
            },
            start_new_session=True,  # the engine's own processes are killed with it
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
        atexit.register(self.kill)  # a failed test leaves no engine behind
        self._replies: list[dict] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log_file.write(line)
            self._log_file.flush()
            if line.startswith(REPLY):
                with self._cond:
                    self._replies.append(json.loads(line[len(REPLY) :]))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def ready(self, timeout: float = 300) -> dict:
        """Waits for the engine to be built; returns its first reply."""
        return self._wait(timeout)

    def _wait(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._replies:
                left = deadline - time.monotonic()
                if self.proc.poll() is not None and not self._replies:
                    self._reader.join(5)
                    if self._replies:
                        break
                    raise InstanceError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
                if left <= 0:
                    raise InstanceError(f"{self.name}: no answer in {timeout} s:\n{self.tail()}")
                self._cond.wait(min(left, 1.0))
            reply = self._replies.pop(0)
        if "error" in reply:
            raise InstanceError(f"{self.name}: {reply['error']}\n{self.tail()}")
        return reply

    def send(self, timeout: float = 300, **command) -> dict:
        """Sends one command; returns its reply."""
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._wait(timeout)

    def generate(self, prompt: list[int], timeout: float = 300, **kw) -> dict:
        return self.send(timeout=timeout, op="generate", prompt=prompt, **kw)

    def rpc(self, method: str, *args, timeout: float = 120) -> list:
        return self.send(timeout=timeout, op="rpc", method=method, args=list(args))["result"]

    def metrics(self, prefix: str = "vllm:") -> dict[str, float]:
        """vLLM's counters with `prefix`, summed over labels but the tier's
        (``name[label]``)."""
        return self.send(op="metrics", prefix=prefix)["metrics"]

    def tail(self, lines: int = 60) -> str:
        self._log_file.flush()
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the instance and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def close(self, timeout: float = 60) -> int | None:
        """Shuts the engine down (a SIGKILL of its process group after
        `timeout`); returns the exit status."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "shutdown"}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait(30)
        # The engine's other processes end after it (vLLM's engine core
        # releases the /dev/shm region as it exits); whatever is still alive
        # after `timeout` is killed.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._group_alive():
            time.sleep(0.2)
        self.kill()
        self._reader.join(5)
        self._log_file.close()
        return self.proc.returncode


def http(url: str, body: dict | None = None, timeout: float = 120) -> bytes:
    """GET `url` (POST `body` as JSON when given); the response's body."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="GET" if body is None else "POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` samples by name and labels (without engine and model labels)."""
    out: dict[str, float] = {}
    for line in http(base + "/metrics").decode().splitlines():
        m = re.fullmatch(r"([\w:]+)(?:\{(.*)\})? (\S+)", line)
        if not m or line.startswith("#"):
            continue
        labels = [
            kv
            for kv in re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")
            if kv[0] not in ("engine", "model_name")
        ]
        out[m.group(1) + "".join(f"[{v}]" for _, v in sorted(labels))] = float(m.group(3))
    return out


class ServerInstance:
    """vLLM's OpenAI server in a process group of its own, started from
    `argv` (``python -m vllm.entrypoints.openai.api_server ...``) with the
    test model's flags (SERVER_FLAGS), the workers' recorder and dev mode."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path, cores: set[int]):
        assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.http_port = s.getsockname()[1]
        self.name = name
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.log = log_dir / f"vllm-server-{name}-{os.getpid()}.log"
        environ = {
            **os.environ,
            "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            **env,
        }
        environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own engine process
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    *argv[1:],
                    *SERVER_FLAGS,
                    "--worker-extension-cls",
                    "vllm_worker_extension.KVSwapRecorder",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.http_port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cores),
            )
        atexit.register(self.kill)

    def ready(self, timeout: float = 300) -> None:
        """Waits until the server answers ``/health``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise InstanceError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                http(self.base + "/health", timeout=5)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise InstanceError(f"{self.name}: no /health in {timeout} s:\n{self.tail()}") from None
                time.sleep(1)

    def generate(
        self, prompt: list[int], timeout: float = 300, kv_transfer_params: dict | None = None
    ) -> dict:
        """A greedy completion of 3 tokens: ``{"tokens": [...]}``."""
        body = {
            "model": ENGINE_MODEL,
            "prompt": prompt,
            "max_tokens": 3,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        if kv_transfer_params:
            body["kv_transfer_params"] = kv_transfer_params
        (choice,) = json.loads(http(self.base + "/v1/completions", body, timeout))["choices"]
        return {"tokens": choice["token_ids"], "finish_reason": choice["finish_reason"]}

    def rpc(self, method: str, *args: str, timeout: float = 120) -> list:
        """Every rank's result of the recorder's `method`, through
        ``/collective_rpc``: vLLM sends string arguments only, and returns a
        result that is not a dict or a list as its ``str``."""
        body = {"method": method, "args": list(args), "timeout": timeout}
        return json.loads(http(self.base + "/collective_rpc", body, timeout + 10))["results"]

    def metrics(self, prefix: str = "vllm:") -> dict[str, float]:
        """vLLM's counters with `prefix`, named as :meth:`Instance.metrics`
        names them (Prometheus's ``_total`` suffix removed)."""
        return {
            name.replace("_total", "", 1): value
            for name, value in metrics(self.base).items()
            if name.startswith(prefix)
        }

    def tail(self, lines: int = 60) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the server and every process it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def close(self, timeout: float = 60) -> int | None:
        """SIGTERM to the server's PID, as an operator stops it (a SIGKILL
        of its process group after `timeout`); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self.proc.wait(30)
        self.kill()
        return self.proc.returncode


# -- the script -----------------------------------------------------------------------


def _reply(**kw) -> None:
    sys.stdout.write(REPLY + json.dumps(kw) + "\n")
    sys.stdout.flush()


def main(engine_args: dict) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm_helpers import counters

    args = dict(
        model=ENGINE_MODEL,
        **ENGINE,
        disable_log_stats=False,
        worker_extension_cls="vllm_worker_extension.KVSwapRecorder",
        # as the server's --shutdown-timeout 30 (docs/vllm.md): with vLLM's 0,
        # shutdown kills the engine's processes before the region is released
        shutdown_timeout=30,
    )
    args.update(engine_args)
    if isinstance(args.get("kv_transfer_config"), dict):
        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    try:
        llm = LLM(**args)
    except Exception as exc:
        _reply(error=f"engine start failed: {type(exc).__name__}: {exc}")
        raise
    _reply(ready=True, pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            if op == "generate":
                params = SamplingParams(
                    max_tokens=command.get("max_tokens", 3),
                    temperature=0.0,
                    detokenize=False,
                    extra_args={"kv_transfer_params": command["kv_transfer_params"]}
                    if command.get("kv_transfer_params")
                    else None,
                )
                (o,) = llm.generate([{"prompt_token_ids": command["prompt"]}], params, use_tqdm=False)
                _reply(
                    tokens=list(o.outputs[0].token_ids),
                    cached=o.num_cached_tokens,
                    finish_reason=o.outputs[0].finish_reason,
                )
            elif op == "rpc":
                _reply(result=llm.collective_rpc(command["method"], args=tuple(command.get("args", ()))))
            elif op == "metrics":
                _reply(metrics=counters(llm, command.get("prefix", "vllm:")))
            elif op == "reset_prefix_cache":
                _reply(ok=llm.reset_prefix_cache(reset_connector=command.get("reset_connector", False)))
            elif op == "shutdown":
                break
            else:
                _reply(error=f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 - the test reads it as this command's error
            _reply(error=f"{op}: {type(exc).__name__}: {exc}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
