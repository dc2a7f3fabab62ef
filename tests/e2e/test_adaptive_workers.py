"""--inflight auto with real processes: two Celery workers, beat, PostgreSQL, Redis and
the simulator over HTTP; the adaptive limit moves and the exact limit holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from support import counts, wait_worker_live

from synthq.queue.limits import start_limit
from synthq.store.db import session_scope

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: One statement, so one snapshot: samples queued + running on the server, and its bound.
SAMPLE = text("""SELECT (SELECT count(*) FROM samples WHERE server = :u
                         AND state IN ('queued', 'running')),
                        (SELECT "limit" FROM servers WHERE url = :u),
                        (SELECT limit_target FROM servers WHERE url = :u)""")


def test_two_workers_auto_limit_moves_and_the_exact_limit_holds(
        workers: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 slots, ~1.3 s answers: the limit rises from 16, and comes down on 429s.
    sim = simulator("--capacity", "24", "--latency", "0.3", "--tokens-per-second", "10",
                    "--response-tokens", "10")
    cap = 48
    # Each tick's window and decision, for the failure messages: whether the limit rises
    # depends on measured latencies, which a loaded machine makes noisy.
    trace = tmp_path / "adaptive-trace"
    monkeypatch.setenv("SYNTHQ_ADAPTIVE_TRACE", str(trace))

    def decisions() -> str:
        lines = trace.read_text().splitlines() if trace.exists() else []
        return "\n".join(line[:600] for line in lines[-25:])  # the window, then the decision

    # Phase 1, plain prompts: the limit must rise. Phase 2 is enqueued once it has (or
    # once phase 1 ran out): a few prompts answered 429 once, so the limit must come
    # down sharply, wherever it stands.
    rise = job_factory([f"auto question {i}" for i in range(240)], servers=[sim.url],
                       inflight_limit=cap, inflight_auto=True, min_inflight=2)
    workers.worker(concurrency=32)
    workers.worker(concurrency=32)
    wait_worker_live(2)
    workers.beat()
    start = start_limit(2, cap)
    samples: list[tuple[int, int | None, int | None]] = []
    jobs = [rise.job_id]
    deadline = time.monotonic() + 180
    while True:
        left = [j for j in jobs if counts(j)["done"] < (240 if j == rise.job_id else 40)]
        if not left and len(jobs) == 2:
            break
        assert time.monotonic() < deadline, \
            f"{[counts(j) for j in jobs]}\n{decisions()}\n{workers.logs()}"
        with session_scope() as s:
            row = s.execute(SAMPLE, {"u": sim.url}).one()
        samples.append((int(row[0]), row[1], row[2]))
        if len(jobs) == 1 and (row[2] is not None and row[2] > start or not left):
            faults = [f"auto fault {i}" + (" [[sim:rate_limit*1]]" if i < 4 else "")
                      for i in range(40)]
            jobs.append(job_factory(faults, servers=[sim.url], inflight_limit=cap,
                                    inflight_auto=True, min_inflight=2).job_id)
        time.sleep(0.03)
    over = [(load, bound) for load, bound, _ in samples
            if load > (bound if bound is not None else start)]
    assert not over, f"queued + running above the limit: {over[:10]}"
    targets = [t for _, _, t in samples if t is not None]
    assert max(targets) > start, f"the limit never rose:\n{decisions()}"
    assert any(b < a for a, b in zip(targets, targets[1:], strict=False)), \
        f"the limit never came down: {sorted(set(targets))}\n{decisions()}"
    assert len(samples) > 100
    assert sim.stats()["max_active"] <= cap
    assert sim.stats()["faults"]["rate_limit"] == 4
