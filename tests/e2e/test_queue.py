"""The queue with real processes: Celery workers and beat over real Redis,
PostgreSQL, and the simulator over HTTP. Kill tests kill real processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select
from support import counts, redis_for_tests, wait_for, wait_worker_live

from synthq.store.db import session_scope
from synthq.store.models import Attempt, Sample

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def prompts(n: int, tag: str = "p") -> list[str]:
    return [f"{tag} question number {i}: explain something" for i in range(n)]


def assert_all_done_once(job_id: int, n: int, sim: Any) -> None:
    """Every sample done, and no sample's response was written twice."""
    c = counts(job_id)
    assert c["done"] == n, c
    with session_scope() as s:
        ok_writes = s.execute(
            select(Attempt.sample_id, func.count()).join(Sample, Sample.id == Attempt.sample_id)
            .where(Sample.job_id == job_id, Attempt.outcome == "ok")
            .group_by(Attempt.sample_id)).all()
    assert len(ok_writes) == n
    assert all(k == 1 for _, k in ok_writes), "a sample's result was written twice"


def test_three_workers_never_exceed_server_limit(workers: Any, simulator: Callable[..., Any],
                                                 job_factory: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0.2", "--capacity", "256")
    n = 300
    report = job_factory(prompts(n), servers=[sim.url], inflight_limit=16)
    for _ in range(3):
        workers.worker(concurrency=12)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] == n, 90,
             f"not all done: {counts(report.job_id)}\n{workers.logs()}")
    stats = sim.stats()
    assert stats["max_active"] <= 16, stats
    # The limit was the bottleneck (three workers × 12 threads could do 36).
    assert stats["max_active"] >= 12, stats
    assert_all_done_once(report.job_id, n, sim)


def test_duplicate_delivery_writes_once(workers: Any, simulator: Callable[..., Any],
                                        job_factory: Callable[..., Any]) -> None:
    """The same generate message delivered twice: one call, one write; the second is a no-op."""
    from synthq.queue.dispatch import Dispatched, dispatch
    from worker.tasks import publish

    sim = simulator("--latency", "0.3")
    report = job_factory(["only one please"], servers=[sim.url])
    workers.worker(concurrency=4)
    wait_worker_live()  # the dispatcher queues only into live workers' free slots
    batch: list[Dispatched] = []
    dispatch(batch.extend, job_ids=[report.job_id])  # queued in SQL, not yet published
    assert len(batch) == 1
    publish(batch)
    publish(batch)  # two identical messages
    wait_for(lambda: counts(report.job_id)["done"] == 1, 30, workers.logs())
    # The second delivery has run once a task's result says its claim was stale.
    wait_for(lambda: "'stale'" in workers.logs(), 30, workers.logs)
    assert sim.stats()["prompts"]["only one please"] == 1
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Attempt)) == 1
    assert "'stale'" in workers.logs() or "stale" in workers.logs()


def test_kill9_worker_mid_stream_redoes_sample_once(workers: Any, simulator: Callable[..., Any],
                                                    job_factory: Callable[..., Any]) -> None:
    # 40 tokens at 10 tokens/s: a 4 s stream to kill in the middle of.
    sim = simulator("--latency", "0", "--tokens-per-second", "10", "--response-tokens", "40")
    report = job_factory(["a long streamed answer"], servers=[sim.url], stall_timeout=3.0)
    first = workers.worker(concurrency=2, name="victim")
    workers.beat()

    def streaming() -> bool:
        with session_scope() as s:
            smp = s.scalars(select(Sample)).one()
        return smp.state == "running" and sim.stats()["active"] == 1

    wait_for(streaming, 30, workers.logs())
    time.sleep(1.0)  # mid-stream
    first.kill9()
    assert counts(report.job_id)["running"] == 1  # the dead worker still "holds" it
    workers.worker(concurrency=2, name="rescuer")
    # Lease = stall 3 s + margin 2 s; then the sweep requeues it and the rescuer redoes it.
    wait_for(lambda: counts(report.job_id)["done"] == 1, 40, workers.logs())
    with session_scope() as s:
        smp = s.scalars(select(Sample)).one()
        outcomes = list(s.scalars(select(Attempt.outcome).order_by(Attempt.id)))
    assert smp.attempts == 2
    assert outcomes == ["lost", "ok"]
    assert "rescuer" in (smp.worker or "") or smp.worker != "victim"
    assert sim.stats()["prompts"]["a long streamed answer"] == 2


def test_redis_flushall_mid_run_loses_nothing(workers: Any, simulator: Callable[..., Any],
                                              job_factory: Callable[..., Any],
                                              redis_url: str) -> None:
    sim = simulator("--latency", "0.3", "--capacity", "64")
    n = 200
    report = job_factory(prompts(n, "flush"), servers=[sim.url], inflight_limit=16)
    workers.worker(concurrency=16)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] >= 30, 60, workers.logs())
    # Every message lost: the test database's keys deleted (FLUSHALL would also empty
    # every other database of that Redis, and redis-cli's default host is not the URL's).
    assert redis_for_tests().clear() > 0
    assert counts(report.job_id)["done"] < n
    wait_for(lambda: counts(report.job_id)["done"] == n, 120,
             f"{counts(report.job_id)}\n{workers.logs()}")
    assert_all_done_once(report.job_id, n, sim)


def test_flower_shows_generate_tasks_behind_basic_auth(workers: Any, simulator: Callable[..., Any],
                                                       job_factory: Callable[..., Any],
                                                       tmp_path: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sample is in a generate task (a worker's local refill, on by default, runs
    samples without one: off here)."""
    import ast
    import sys

    import httpx
    from support import Proc, child_env, free_port

    sim = simulator("--latency", "0.05")
    port = free_port()
    flower = Proc([sys.executable, "-m", "celery", "-A", "worker.app", "flower",
                   f"--port={port}", "--address=127.0.0.1", "--basic-auth=ops:s3cret-pass"],
                  child_env(), tmp_path / "flower.log")
    workers.procs.append(flower)
    url = f"http://127.0.0.1:{port}"

    def flower_up() -> bool:
        try:
            return httpx.get(f"{url}/healthcheck", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(flower_up, 30, flower.log())
    monkeypatch.setenv("SYNTHQ_LOCAL_REFILL", "0")
    time.sleep(1.0)  # flower subscribes to events before the tasks run
    report = job_factory([f"flower {i}" for i in range(5)], servers=[sim.url])
    workers.worker(concurrency=4)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] == 5, 60, workers.logs())
    assert httpx.get(f"{url}/api/tasks", timeout=5).status_code == 401

    def generate_tasks() -> list[dict[str, Any]]:
        tasks = httpx.get(f"{url}/api/tasks", auth=("ops", "s3cret-pass"), timeout=5).json()
        return [t for t in tasks.values()
                if t.get("name") == "synthq.generate" and t.get("state") == "SUCCESS"]

    # A task is a batch: its args name the sample ids, its result counts their outcomes.
    def ran_all() -> list[dict[str, Any]]:
        tasks = generate_tasks()
        return tasks if sum(ast.literal_eval(t["result"]).get("done", 0)
                            for t in tasks) == 5 else []

    done = wait_for(ran_all, 30, flower.log())
    ids = sorted(i for t in done for i, _tok, _job in ast.literal_eval(t["args"])[0])
    assert ids == [1, 2, 3, 4, 5]


def test_every_turn_regenerated_through_celery_workers(
        workers: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    """--regenerate all on the Celery path: each turn a call within the limit, each on the
    regenerated history; turns of different conversations interleave."""
    import json

    from synthq.data.dataset import Row
    from synthq.data.turns import history
    from synthq.testing.simulator import conversation_tag

    sim = simulator("--latency", "0.1", "--history-answers")
    n = 20
    rows = []
    for i in range(n):
        messages = []
        for t in range(3):
            messages += [{"role": "user", "content": f"conv {i} q{t}"},
                         {"role": "assistant", "content": f"dataset {t}"}]
        rows.append(Row(i, messages))
    report = job_factory(rows=rows, servers=[sim.url], inflight_limit=6, regenerate="all")
    workers.worker(concurrency=4)
    workers.worker(concurrency=4)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] == n, 90,
             f"not all done: {counts(report.job_id)}\n{workers.logs()}")
    assert sim.stats()["max_active"] <= 6
    with session_scope() as s:
        samples = s.execute(select(Sample.id, Sample.prompt, Sample.turns)
                            .where(Sample.job_id == report.job_id)).all()
        calls = dict(s.execute(
            select(Attempt.turn, func.count()).join(Sample, Sample.id == Attempt.sample_id)
            .where(Sample.job_id == report.job_id, Attempt.outcome == "ok")
            .group_by(Attempt.turn)).tuples().all())
    assert calls == {0: n, 1: n, 2: n}
    for _, prompt, answers in samples:
        assert len(answers) == 3, json.dumps(answers)
        for k in range(3):
            assert answers[k]["content"].split()[0] == conversation_tag(
                history(prompt, answers, k))


def test_no_stream_job_on_workers_done_once_with_retries(workers: Any,
                                                         simulator: Callable[..., Any],
                                                         job_factory: Callable[..., Any]) -> None:
    """A ``stream=False`` job through real Celery workers: plain requests only, the
    limit held, a failing first call retried, every sample written once."""
    sim = simulator("--latency", "0.05", "--capacity", "64")
    n = 60
    report = job_factory([*prompts(n - 1, tag="plain"), "flaky [[sim:error*1]]"],
                         servers=[sim.url], inflight_limit=8, stream=False)
    workers.worker(concurrency=8)
    workers.beat()
    wait_for(lambda: counts(report.job_id)["done"] == n, 60,
             f"not all done: {counts(report.job_id)}\n{workers.logs()}")
    stats = sim.stats()
    assert stats["streamed"] == 0 and stats["requests"] == n + 1, stats
    assert stats["max_active"] <= 8, stats
    assert_all_done_once(report.job_id, n, sim)
