"""First use and operator safety (issue 7): each wrong step a new user takes.

One test per item of the issue, as a user meets it: the CLI in a subprocess,
in a fresh temporary directory (its own SQLite file), asserting the exit code,
the one-line message, and that no traceback is printed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import REPO, Simulator, free_port, run_cli

SECRET = "SuperSecretPw42"
#: A name with markup brackets, quotes, unicode and spaces.
ODD = 'a[b] [red]oops[x] "q" \'s\' é ü'  # no "/": a job name may not hold one (issue 17)


def synthq(cwd: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``synthq ARGS`` in ``cwd`` with only the given SYNTHQ_ settings (embedded default)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    base.update(PYTHONPATH=str(REPO), COLUMNS="250", **(env or {}))
    result = run_cli(*args, cwd=cwd, env=base, timeout=timeout, check=False)
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    return result


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one ``error:`` line, asserted to be alone on stderr."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def write_rows(path: Path, prompts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def jobs(cwd: Path) -> list[dict[str, object]]:
    result = synthq(cwd, "jobs", "--json")
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))


@pytest.fixture
def sim(simulator: Callable[..., Simulator]) -> Simulator:
    return simulator("--latency", "0")


QUICK = ["--max-tokens", "64", "--backoff-base", "0.05", "--backoff-cap", "0.1"]


# 1 -------------------------------------------------------------------------------------


@pytest.mark.processes
def test_1_every_command_works_in_a_fresh_directory(tmp_path: Path) -> None:
    result = synthq(tmp_path, "jobs")
    assert result.returncode == 0 and "no jobs yet" in result.stdout
    assert (tmp_path / "synthq-data").is_dir()
    for args, message in ((["status"], "no jobs yet"), (["sample", "1"], "no sample 1"),
                          (["status", "nope"], "no job 'nope'")):
        result = synthq(tmp_path, *args)
        assert result.returncode == 2 and message in error_line(result)
    fresh = tmp_path / "other"
    fresh.mkdir()
    result = synthq(fresh, "enqueue", "-d", str(write_rows(fresh / "d.jsonl", ["hi"])),
                    "-s", f"http://127.0.0.1:{free_port()}/v1", "-m", "m")
    assert result.returncode == 0, result.stderr
    assert (fresh / "synthq-data" / "synthq.db").is_file()


# 2 -------------------------------------------------------------------------------------


def test_2_a_model_the_server_does_not_serve_is_refused(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    result = synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "kimi")
    assert result.returncode == 2
    assert error_line(result) == (f"error: server {sim.url} does not serve model 'kimi'; it "
                                  "serves: 'sim-model'")
    assert jobs(tmp_path) == []
    # The simulator answers a request for another model as vLLM does.
    assert sim.http.post("/v1/chat/completions", json={
        "model": "kimi", "messages": [{"role": "user", "content": "x"}]}).json()["message"] \
        == "The model `kimi` does not exist."


@pytest.mark.processes
def test_2_a_dead_server_is_a_warning_then_a_live_line(tmp_path: Path) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    dead = f"http://127.0.0.1:{free_port()}/v1"
    result = synthq(tmp_path, "enqueue", "-d", str(data), "-s", dead, "-m", "m", "--job", "e")
    assert result.returncode == 0
    assert f"warning: server {dead} cannot be reached (ConnectError" in result.stderr
    base = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    proc = subprocess.Popen([sys.executable, "-m", "synthq.cli", "run", "-d", str(data), "-s",
                             dead, "-m", "m", "--job", "e"], cwd=tmp_path,
                            env={**base, "PYTHONPATH": str(REPO), "COLUMNS": "250"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        seen = ""
        while "health probe failing since" not in seen and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert f"server {dead}: health probe failing since" in seen, seen
        assert "ConnectError" in seen
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "Traceback" not in out


# 3 -------------------------------------------------------------------------------------


def test_3_requeue_moves_a_job_to_the_right_model_and_server(
        tmp_path: Path, simulator: Callable[..., Simulator]) -> None:
    first = simulator("--latency", "0", "--model", "old-model")
    second = simulator("--latency", "0", "--model", "new-model")
    data = write_rows(tmp_path / "d.jsonl", ["one", "two", "three [[sim:error*1]]"])
    run = ["run", "-d", str(data), "--job", "j", *QUICK]
    result = synthq(tmp_path, *run, "-s", first.url, "-m", "old-model", "--max-attempts", "1")
    assert result.returncode == 0, result.stderr
    # The right model on the same job name is refused, and says how to move it.
    result = synthq(tmp_path, *run, "-s", second.url, "-m", "new-model")
    assert result.returncode == 2
    assert "synthq requeue j --failed --model new-model" in error_line(result)
    # A model the new server does not serve is refused before anything changes.
    result = synthq(tmp_path, "requeue", "j", "--failed", "--model", "nope", "-s", second.url)
    assert result.returncode == 2 and "does not serve model 'nope'" in error_line(result)
    result = synthq(tmp_path, "requeue", "j", "--failed", "--model", "new-model",
                    "--server", second.url)
    assert result.returncode == 0, result.stderr
    assert "model old-model → new-model" in result.stdout
    assert "2 done samples keep their answers from old-model" in result.stdout
    assert "requeued 1 failed samples" in result.stdout
    [job] = jobs(tmp_path)
    assert job["model"] == "new-model" and job["state"] == "active"
    # The same dataset with the right settings now runs the rest; nothing is added twice.
    result = synthq(tmp_path, *run, "-s", second.url, "-m", "new-model", "--max-attempts", "3",
                    "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["counts"]["done"] == 3 and status["total"] == 3
    assert first.stats()["completed"] == 2 and second.stats()["completed"] == 1


# 4 -------------------------------------------------------------------------------------


def test_4_names_and_paths_are_shown_as_typed(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "in [x]" / "data[bold] é.jsonl", ["hi", "there"])
    result = synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                    "--job", ODD, *QUICK)
    assert result.returncode == 0, result.stderr
    assert f"job {ODD} (id 1) created" in result.stdout
    assert f"job {ODD} (id 1) — finished" in result.stdout
    for args in (["jobs"], ["status", ODD], ["status"], ["sample", "1"], ["requeue", ODD],
                 ["cancel", ODD]):
        result = synthq(tmp_path, *args)
        assert result.returncode == 0, (args, result.stderr)
        if args[0] in ("jobs", "status"):
            assert ODD in result.stdout, (args, result.stdout)
    out = tmp_path / "out [1] é"
    result = synthq(tmp_path, "export", ODD, "--format", "jsonl", "--out", str(out))
    assert result.returncode == 0 and f"to {out} in" in result.stdout.replace("\n", "")
    missing = tmp_path / "data[bold].jsonl"
    result = synthq(tmp_path, "enqueue", "-d", str(missing), "-s", sim.url, "-m", "sim-model")
    assert result.returncode == 2 and error_line(result) == f"error: no such file: {missing}"
    result = synthq(tmp_path, "enqueue", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                    "--job", "123")
    assert result.returncode == 2 and "'123' is all digits" in error_line(result)


# 5 -------------------------------------------------------------------------------------


def test_5_a_finished_job_gets_out_of_the_way(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi", "there"])
    args = ["-s", sim.url, "-m", "sim-model", "--job", "f", *QUICK]
    assert synthq(tmp_path, "run", "-d", str(data), *args).returncode == 0
    [job] = jobs(tmp_path)
    assert job["state"] == "finished"
    status = synthq(tmp_path, "status", "f")
    assert "— finished" in status.stdout
    # A run of a finished job finishes at once; new rows make it active again.
    again = synthq(tmp_path, "run", "-d", str(data), *args, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["state"] == "finished"
    more = write_rows(tmp_path / "more.jsonl", ["hi", "there", "new one"])
    assert synthq(tmp_path, "enqueue", "-d", str(more), *args).returncode == 0
    assert jobs(tmp_path)[0]["state"] == "active"
    assert synthq(tmp_path, "run", "-d", str(more), *args).returncode == 0
    assert jobs(tmp_path)[0]["state"] == "finished"


def test_5_finished_jobs_no_longer_count_toward_a_server(pg: str) -> None:
    from synthq.core.enums import JobState
    from synthq.jobs.enqueue import JobSpec, get_or_create_job
    from synthq.queue import jobs
    from synthq.queue.dispatch import active_servers
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Job

    with session_scope() as s:
        job, _, _ = get_or_create_job(s, JobSpec(name="old", model="m",
                                                 servers=["http://h:1/v1"], inflight_limit=4))
        job_id = job.id
    assert active_servers() == ["http://h:1/v1"]
    with session_scope() as s:
        assert jobs.finish_jobs(s, now=utcnow()) == [job_id]
        assert s.get_one(Job, job_id).state == JobState.FINISHED
    assert active_servers() == []  # its limit of 4 holds no server any more
    with session_scope() as s:
        assert jobs.reactivate(s, job_id, now=utcnow())
        assert s.get_one(Job, job_id).state == JobState.ACTIVE


# 6 -------------------------------------------------------------------------------------


@pytest.mark.processes
def test_6_passwords_never_appear(tmp_path: Path) -> None:
    port = free_port()
    db = f"postgresql://synthq:{SECRET}@127.0.0.1:{port}/synthq"
    broker = f"redis://:{SECRET}@127.0.0.1:{port}/0"
    env = {"SYNTHQ_DATABASE_URL": db}
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    outputs = []
    for args, extra in (
            (["jobs"], {}), (["status", "x"], {}), (["db", "upgrade"], {}),
            (["enqueue", "-d", str(data), "-s", f"http://127.0.0.1:{port}/v1", "-m", "m"], {}),
            (["worker"], {"SYNTHQ_BROKER_URL": broker}),
            (["beat"], {"SYNTHQ_BROKER_URL": broker}),
            (["jobs"], {"SYNTHQ_BROKER_URL": f"amqp://u:{SECRET}@h/"})):
        result = synthq(tmp_path, *args, env={**env, **extra})
        assert result.returncode == 2, (args, result.stderr)
        line = error_line(result)
        assert "***" in line, line
        outputs.append(result.stdout + result.stderr)
    assert SECRET not in "\n".join(outputs)
    # Worker and beat logs go through the same function.
    from worker.logs import RedactFilter

    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "cannot reach %s", (db,), None)
    assert RedactFilter().filter(record) and SECRET not in record.getMessage()


# 7 -------------------------------------------------------------------------------------


@pytest.mark.processes
def test_7_a_failed_enqueue_leaves_no_job(tmp_path: Path) -> None:
    server = ["-s", f"http://127.0.0.1:{free_port()}/v1", "-m", "m"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"prompt": 3}\nnot json\n')
    binary = tmp_path / "model.jsonl"
    binary.write_bytes(bytes(range(256)) * 40)
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"prompt": "hi"}\n')
    cases = [
        (tmp_path / "missing.jsonl", f"no such file: {tmp_path / 'missing.jsonl'}"),
        (empty, f"{empty} has no rows"),
        (junk, f"{junk} has no valid row (line 1: prompt is not a string; line 2: not valid"),
        (binary, f"{binary} is not a JSONL/JSON/Parquet file"),
        (fake, f"{fake} is not a JSONL/JSON/Parquet file"),
    ]
    for path, message in cases:
        result = synthq(tmp_path, "enqueue", "-d", str(path), *server)
        assert result.returncode == 2 and message in error_line(result), result.stderr
    assert jobs(tmp_path) == []
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "hi"}\n\n{"bad\n')
    result = synthq(tmp_path, "enqueue", "-d", str(mixed), *server)
    assert result.returncode == 0 and "skipped line 3: not valid JSON" in result.stdout


# 8 -------------------------------------------------------------------------------------


def test_8_errors_are_one_line_not_tracebacks(tmp_path: Path, sim: Simulator) -> None:
    data = write_rows(tmp_path / "d.jsonl", ["hi"])
    assert synthq(tmp_path, "run", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                  "--job", "x", *QUICK).returncode == 0
    result = synthq(tmp_path, "export", "x", "--format", "jsonl", "--out", "/proc/synthq-export")
    assert result.returncode == 2
    assert error_line(result).startswith("error: cannot write the export to /proc/synthq-export")
    for bad in ("amqp://h/", "redis:/h"):
        result = synthq(tmp_path, "jobs", env={"SYNTHQ_BROKER_URL": bad})
        assert result.returncode == 2
        assert error_line(result).startswith("error: invalid setting SYNTHQ_BROKER_URL: ")
    down = f"redis://127.0.0.1:{free_port()}/0"
    result = synthq(tmp_path, "enqueue", "-d", str(data), "-s", sim.url, "-m", "sim-model",
                    "--job", "y", env={"SYNTHQ_BROKER_URL": down})
    assert result.returncode == 0, result.stderr
    assert "the samples are stored and will run once workers and beat can reach it" \
        in result.stderr


# 9 -------------------------------------------------------------------------------------


@pytest.mark.processes
def test_9_the_demo_gives_up_with_the_simulators_log(tmp_path: Path) -> None:
    with socket.socket() as held:  # a port held by something that is not our simulator
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh")], cwd=tmp_path,
                                env={**os.environ, "SYNTHQ_DEMO_PORT": str(port)},
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"demo: the simulator on port {port} exited; the simulator's log" in result.stderr
    assert "address already in use" in result.stderr.lower()
    assert "SYNTHQ_DEMO_PORT" in (REPO / "README.md").read_text()


# 10 ------------------------------------------------------------------------------------


def test_10_the_idle_dispatch_tick_is_quiet() -> None:
    from worker.logs import QuietTickFilter

    def record(msg: str, args: object) -> logging.LogRecord:
        return logging.LogRecord("celery", logging.INFO, __file__, 1, msg, args, None)  # type: ignore[arg-type]

    quiet = QuietTickFilter()
    assert not quiet.filter(record("Task %(name)s[%(id)s] received",
                                   {"name": "synthq.dispatch", "id": "1"}))
    assert not quiet.filter(record("Task %(name)s[%(id)s] succeeded in %(runtime)ss: "
                                   "%(return_value)s", {"name": "synthq.dispatch", "id": "1",
                                                        "runtime": 0.01, "return_value": "0"}))
    assert not quiet.filter(record("Scheduler: Sending due task %s (%s)",
                                   ("dispatch", "synthq.dispatch")))
    assert quiet.filter(record("Task %(name)s[%(id)s] succeeded in %(runtime)ss: "
                               "%(return_value)s", {"name": "synthq.dispatch", "id": "1",
                                                    "runtime": 0.01, "return_value": "32"}))
    assert quiet.filter(record("Task %(name)s[%(id)s] received",
                               {"name": "synthq.generate", "id": "1"}))
    from worker.tasks import dispatch_tick

    assert dispatch_tick.send_events is False
    from worker.logs import setup

    setup()
    assert logging.getLogger("httpx").getEffectiveLevel() >= logging.WARNING
    from worker.logs import QuietHttpxFilter

    line = logging.LogRecord("httpx", logging.INFO, __file__, 1, "HTTP Request: POST", (), None)
    assert not QuietHttpxFilter().filter(line)


# 11 ------------------------------------------------------------------------------------


def test_11_the_docs_say_how_tests_run_and_what_finished_means() -> None:
    """The README sends a newcomer to the tests' page; that page says what the tests touch,
    the reliability page what `finished` means (both built by `mkdocs build --strict`)."""
    readme = (REPO / "README.md").read_text()
    for fact in ("bash scripts/test.sh", "--fast", "docs/testing.md", "SYNTHQ_DEMO_PORT",
                 "torch"):
        assert fact in readme, fact
    testing = (REPO / "docs" / "testing.md").read_text()
    assert testing.startswith("# Running the tests")
    for fact in ("SYNTHQ_TEST_PG", "SYNTHQ_TEST_REDIS", "synthq_test_<pid>", "database 15",
                 "SYNTHQ_TEST_PG_PREFIX", "SYNTHQ_TEST_REDIS_SHARED", "never flushed"):
        assert fact in testing, fact
    assert "finished ──samples added" in (REPO / "docs" / "reliability.md").read_text()
    # The suite's measured time, with the command that measured it (the figure itself
    # changes with every measurement; that it is stated does not).
    section = testing.split("## The whole suite", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"took\s+[\d,]+ s\b", section), "the suite's measured time"
    assert "`bash scripts/test.sh`" in section


@pytest.mark.processes
def test_11_the_tests_touch_only_their_own_redis_keys(tmp_path: Path) -> None:
    """On a Redis of this test's own (a second database on it, used as given): a
    database holding someone's keys is refused in one line, a shared one keeps them,
    and clearing deletes the tests' keys only, in that database only."""
    import shutil

    from support import RedisForTests

    from synthq.testing.chaos import PrivateRedis

    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    server = PrivateRedis(tmp_path)
    try:
        theirs = server.client()
        theirs.set("someones-key", "1")
        other_db = server.url.rsplit("/", 1)[0] + "/3"
        theirs.set("beside", "1")  # database 0: another database of the same server
        keys = RedisForTests(other_db)
        keys.client.set("someones-key", "1")
        with pytest.raises(pytest.UsageError, match=r"holds 1 key \(someones-key\) that the "
                           r"tests did not make.*SYNTHQ_TEST_REDIS_SHARED=1"):
            keys.check(shared=False)
        keys.check(shared=True)
        keys.client.set("made-by-a-test", "1")
        keys.client.rpush("generate", "a message")
        assert keys.clear() == 2
        assert sorted(keys.client.keys()) == [b"someones-key"]
        assert sorted(theirs.keys()) == [b"beside", b"someones-key"]
        keys.client.rpush("generate", "a deployment's message")
        with pytest.raises(pytest.UsageError, match="holds synthq's queue keys \\(generate\\)"):
            keys.check(shared=True)
        keys.close()
    finally:
        server.kill()


@pytest.mark.processes
def test_11_a_test_session_that_did_not_end_leaves_keys_the_next_one_deletes(
        tmp_path: Path) -> None:
    """A session killed mid-run leaves its claim beside its keys (kombu's bindings, a
    queue): the next session deletes them and runs; while the claiming session still
    runs, the next one is refused; a session's end leaves the database empty."""
    import shutil
    import socket
    import subprocess
    import sys

    from support import CLAIM, RedisForTests

    from synthq.testing.chaos import PrivateRedis

    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    server = PrivateRedis(tmp_path)
    try:
        url = server.url.rsplit("/", 1)[0] + "/4"
        first = RedisForTests(url)
        first.check(shared=False)
        assert first.client.exists(CLAIM)
        first.client.sadd("_kombu.binding.generate", "generate")
        first.client.rpush("generate", "a test's message")
        first.close()  # killed here: no release

        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            first.client.set(CLAIM, f"pid {alive.pid} on {socket.gethostname()} since now")
            with pytest.raises(pytest.UsageError, match=f"in use by another test session "
                               f"\\(pid {alive.pid} on"):
                RedisForTests(url).check(shared=False)
        finally:
            alive.kill()
            alive.wait()
        second = RedisForTests(url)
        second.check(shared=False)  # the dead session's keys are deleted, not refused
        assert sorted(second.client.keys()) == [CLAIM]
        second.client.set("made-by-a-test", "1")
        second.release()
        assert RedisForTests(url).client.keys() == []
    finally:
        server.kill()


def test_11_no_test_flushes_redis() -> None:
    """Flushing empties keys the tests did not make (FLUSHALL: every database)."""
    import re

    flush = re.compile(r"\.flush(db|all)\(|[\"']FLUSH(ALL|DB)[\"']", re.IGNORECASE)
    for path in (REPO / "tests").rglob("*.py"):
        assert not flush.search(path.read_text()), path
