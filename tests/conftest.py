"""Shared fixtures: real PostgreSQL, real Redis, real processes.

* ``pg``: a PostgreSQL database for this test session, migrated with Alembic,
  emptied before each test that uses it; ``SYNTHQ_DATABASE_URL`` points at it.
* ``redis_url``: the Redis database of ``SYNTHQ_TEST_REDIS`` (default 15), used as
  given; the keys the tests made are deleted before and after each test that uses
  it, nothing else (see ``support.RedisForTests``).
* ``simulator``: a factory starting ``synthq simulate`` subprocesses.
* ``workers``: a factory starting real ``celery worker`` / ``celery beat``
  subprocesses against them (no eager mode anywhere).
* ``job_factory`` / ``sample_factory``: rows in the states a test needs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from support import (  # noqa: F401 - the settings, shared with tests that need them
    PG_ADMIN_URL,
    PROCESS_GUARDS,
    REDIS_URL,
    TEST_ENV,
    Proc,
    Simulator,
    _reset_process_state,
    child_env,
    close_cli_host,
    fresh_pg_database,
    pg_database,
    redis_for_tests,
    release_redis_for_tests,
)

# The property tests check results, not speed: no per-example deadline, and no health
# check of how fast inputs are drawn (a run at load 10 failed
# test_content_keys_match_content_key's: 2 inputs drawn in 2.36 s).
hypothesis_settings.register_profile(
    "synthq", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("synthq")

#: Why a test is outside the fast tier (``scripts/test.sh --fast``), read from what it
#: uses, so a new test carries its marker without anyone adding it: a fixture it asks
#: for, its folder, or a marker it already has. A test that starts processes some other
#: way says so itself (``@pytest.mark.processes``).
_FIXTURE_MARKS = {
    "pg": "postgres", "pg_session_url": "postgres", "redis_url": "redis",
    "simulator": "processes", "workers": "processes", "api_server": "processes",
    "start_sim": "processes",
    "cluster": "chaos", "private_pg": "chaos", "private_redis": "chaos",
    "engine": "engine",
}
_FOLDER_MARKS = {"engine": "engine", "chaos": "chaos", "training": "training"}
_FILE_MARKS = {"test_api_browser.py": "browser"}
_MARKER_MARKS = {"e2e": "processes", "gpu": "gpu"}
#: The markers that keep a test out of the fast tier; ``smoke`` brings one back in.
SLOW_TIERS = ("postgres", "redis", "processes", "engine", "chaos", "browser", "training", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        why = {_FIXTURE_MARKS[f] for f in getattr(item, "fixturenames", ()) if f in _FIXTURE_MARKS}
        folder = item.path.parent.name
        if folder in _FOLDER_MARKS:
            why.add(_FOLDER_MARKS[folder])
        if item.path.name in _FILE_MARKS:
            why.add(_FILE_MARKS[item.path.name])
        # A backend chosen by a parameter (``request.getfixturevalue("pg")``): its id says.
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "postgresql" in callspec.id.split("-"):
            why.add("postgres")
        why.update(_MARKER_MARKS[m.name] for m in item.iter_markers() if m.name in _MARKER_MARKS)
        for name in sorted(why - {m.name for m in item.iter_markers()}):
            item.add_marker(name)
    # The engine tier's groups first, each to its own process (scripts/test.sh passes
    # --no-loadscope-reorder, so xdist hands out the groups in this order, one to each
    # process, then the rest one test at a time in pytest-randomly's order). Sorted by
    # size, as xdist would, the real target's single test (three minutes) went where the
    # shuffle put it among the single tests, and a late draw made the run's tail. Then the
    # tiers whose tests take seconds to a minute (chaos, e2e, training) and the other xdist
    # groups, so that the run ends on short tests on every process rather than on one long
    # test while the others have nothing left; then the rest (integration, api, unit) mixed:
    # sorted by tier, the integration tests ran on every process at once, and the cores
    # sat 20-60 % idle while they waited on their timeouts and servers (vmstat, run ci1).
    # The order within each class stays pytest-randomly's.
    items.sort(key=_longest_first)


#: The engine tier's xdist groups, the longest first.
_ENGINE_GROUPS = ("engine-capture", "engine", "engine-real")
#: Then these tiers (tests/FOLDER), whose tests take seconds to a minute (chaos's median
#: 13 s, e2e's 6 s, training's up to a minute; scripts/test_times.py), and the other groups.
_LONG_TIERS = ("chaos", "e2e", "training")


def _longest_first(item: pytest.Item) -> tuple[int, int]:
    group = item.get_closest_marker("xdist_group")
    name = group.args[0] if group is not None and group.args else None
    if name in _ENGINE_GROUPS:
        return 0, _ENGINE_GROUPS.index(name)
    return (1, 0) if name is not None or item.path.parent.name in _LONG_TIERS else (2, 0)


#: The markers of a test that may start a process. The fast tier (``scripts/test.sh
#: --fast`` sets ``SYNTHQ_FAST_TIER``) fails any other test the moment it starts one, so
#: a test that starts processes cannot stay in the fast tier unmarked.
_MAY_START_PROCESSES = {"processes", "smoke", "engine", "chaos", "browser"}
_running: list[pytest.Item] = []
_popen_init = subprocess.Popen.__init__


def _guard(command: Any) -> None:
    item = _running[-1] if _running else None
    if item is not None and not any(m.name in _MAY_START_PROCESSES for m in item.iter_markers()):
        raise RuntimeError(f"{item.nodeid} starts a process ({command!r:.80}) but is in the "
                           "fast tier: mark it @pytest.mark.processes")


def _guarded_popen_init(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
    _guard(args[0] if args else kwargs.get("args"))
    _popen_init(self, *args, **kwargs)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def pytest_configure(config: pytest.Config) -> None:
    import os

    if os.environ.get("SYNTHQ_FAST_TIER"):
        subprocess.Popen.__init__ = _guarded_popen_init  # type: ignore[method-assign]
        PROCESS_GUARDS.append(_guard)  # the CLI's processes forked by support.CliHost


def pytest_collection_finish(session: pytest.Session) -> None:
    """Check the test Redis before the first test runs when any selected test uses it:
    a database that is not the tests' own stops the session in one line, not after
    minutes of other tests."""
    if any("redis_url" in getattr(item, "fixturenames", ()) for item in session.items):
        redis_for_tests()
    pg_database()  # a bad SYNTHQ_TEST_PG_PREFIX stops it the same way


def _cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has reaped (user + system):
    a process a test starts and waits for counts; one forked by another process (the
    CLI zygote's commands, a server's own children it did not reap) does not."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


#: Where the last phase ended, in :func:`_cpu_seconds` (the session's start at first).
_cpu_at: list[float] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Each phase's CPU seconds (:func:`_cpu_seconds`, since the phase before ended) ride
    on its report to the controller, for ``SYNTHQ_TEST_TIMES``: on a saturated machine
    a test's wall time says little of what it costs, its CPU time does."""
    report: pytest.TestReport = yield
    now = _cpu_seconds()
    start = _cpu_at[-1] if _cpu_at else now
    _cpu_at[:] = [now]
    report.user_properties.append(("cpu_seconds", round(now - start, 3)))
    return report


def pytest_sessionstart(session: pytest.Session) -> None:
    _cpu_at[:] = [_cpu_seconds()]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """``SYNTHQ_TEST_TIMES=FILE``: each phase's time, a JSON line each, for
    ``scripts/test_times.py`` (where the suite's time goes, by tier). Written by the
    process that reports (xdist's controller), once per phase."""
    import os

    out = os.environ.get("SYNTHQ_TEST_TIMES")
    if not out or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import json

    with open(out, "a") as fh:
        fh.write(json.dumps({"test": report.nodeid, "when": report.when,
                             "seconds": round(report.duration, 3),
                             "cpu_seconds": dict(report.user_properties).get("cpu_seconds"),
                             "outcome": report.outcome,
                             # when it ended, and on which process: the run's timeline
                             "stop": round(getattr(report, "stop", 0.0), 3),
                             "worker": getattr(getattr(getattr(report, "node", None),
                                                       "gateway", None), "id", None)}) + "\n")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave the test Redis as it was found: the tests' keys and their claim deleted."""
    release_redis_for_tests()
    close_cli_host()


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[str]:
    from synthq.store.migrate import upgrade

    with fresh_pg_database(pg_database()) as url:
        upgrade(url)
        yield url


@pytest.fixture
def pg(pg_session_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """An empty, migrated PostgreSQL database; the settings point at it."""
    from sqlalchemy import create_engine, text

    engine = create_engine(pg_session_url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE training_runs, attempts, samples, jobs, servers, workers "
                          "RESTART IDENTITY CASCADE"))
    engine.dispose()
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", pg_session_url)
    monkeypatch.setenv("SYNTHQ_DATA_DIR", str(tmp_path / "data"))
    for key, value in TEST_ENV.items():
        monkeypatch.setenv(key, value)
    _reset_process_state()
    yield pg_session_url
    _reset_process_state()


@pytest.fixture
def redis_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    keys = redis_for_tests()
    keys.clear()
    monkeypatch.setenv("SYNTHQ_BROKER_URL", REDIS_URL)
    _reset_process_state()
    yield REDIS_URL
    keys.clear()


@pytest.fixture
def simulator(tmp_path: Path) -> Iterator[Callable[..., Simulator]]:
    """``simulator("--latency", "0.1", ...)`` starts one; all stop at teardown."""
    started: list[Simulator] = []

    def start(*args: str) -> Simulator:
        sim = Simulator(list(args), tmp_path)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def workers(pg: str, redis_url: str, tmp_path: Path) -> Iterator[Any]:
    """Factory for real Celery processes: ``workers.worker(concurrency=8)``, ``workers.beat()``."""

    class Factory:
        def __init__(self) -> None:
            self.procs: list[Proc] = []

        def worker(self, concurrency: int = 8, name: str | None = None,
                   queues: str = "generate,control,tokenize") -> Proc:
            name = name or f"w{len(self.procs)}"
            cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "worker",
                   "-Q", queues, "-P", "threads", "-c", str(concurrency),
                   "-n", f"{name}@%h", "--without-mingle", "--without-gossip", "-l", "INFO"]
            proc = Proc(cmd, child_env(), tmp_path / f"{name}.log")
            self.procs.append(proc)
            return proc

        def beat(self) -> Proc:
            cmd = [sys.executable, "-m", "celery", "-A", "worker.app", "beat", "-l", "INFO",
                   "--schedule", str(tmp_path / "beat-schedule")]
            proc = Proc(cmd, child_env(), tmp_path / "beat.log")
            self.procs.append(proc)
            return proc

        def logs(self) -> str:
            return "\n".join(f"--- {p.log_path.name}\n{p.log()[-4000:]}" for p in self.procs)

    factory = Factory()
    yield factory
    # Every process asked to stop first, so their warm shutdowns (seconds each) overlap.
    for proc in factory.procs:
        proc.ask_stop()
    for proc in factory.procs:
        proc.stop()


@pytest.fixture
def job_factory(pg: str) -> Callable[..., Any]:
    """``job_factory(prompts=[...], servers=[url], **JobSpec fields)`` → EnqueueReport."""
    from synthq.data.dataset import Row
    from synthq.jobs.enqueue import EnqueueReport, JobSpec, get_or_create_job
    from synthq.jobs.samplecopy import insert_rows
    from synthq.store.db import session_scope

    counter = iter(range(1, 10**6))

    def make(prompts: list[str] | None = None, *, rows: list[Row] | None = None,
             servers: list[str] | None = None, **fields: Any) -> EnqueueReport:
        fields.setdefault("name", f"job{next(counter)}")
        fields.setdefault("model", "sim-model")
        fields.setdefault("max_tokens", 64)
        fields.setdefault("backoff_base", 0.1)
        fields.setdefault("backoff_cap", 0.5)
        spec = JobSpec(servers=servers or ["http://127.0.0.1:9/v1"], **fields)
        with session_scope() as s:
            job, created, _ = get_or_create_job(s, spec)
            job_id, settings = job.id, job.generation_settings()
        report = EnqueueReport(job_id=job_id, job_name=spec.name, created=created)
        if rows is None:
            rows = [Row(i, [{"role": "user", "content": p}]) for i, p in enumerate(prompts or [])]
        insert_rows(job_id, settings, rows, report, regenerate=spec.regenerate)
        return report

    return make


@pytest.fixture
def sample_factory(job_factory: Callable[..., Any]) -> Callable[..., int]:
    """``sample_factory(state="failed", attempts=3, **columns)`` → a sample id."""
    from sqlalchemy import update

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Sample

    counter = iter(range(10**6))

    def make(state: str = "pending", *, job_id: int | None = None, **columns: Any) -> int:
        if job_id is None:
            job_id = job_factory([]).job_id
        from synthq.data.dataset import content_key

        now = utcnow()
        with session_scope() as s:
            smp = Sample(job_id=job_id, content_key=content_key(
                [{"role": "user", "content": f"s{next(counter)}"}], {}),
                dataset_index=0, prompt=[{"role": "user", "content": "hello"}],
                state=state, attempts=0, next_attempt_at=now, created_at=now, updated_at=now)
            s.add(smp)
            s.flush()
            if columns:
                s.execute(update(Sample).where(Sample.id == smp.id).values(**columns))
            return smp.id

    return make
