"""--inflight auto with real processes: two Celery workers, beat, PostgreSQL, Redis and
the simulator over HTTP; the adaptive limit moves and the exact limit holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from support import counts, wait_worker_live

from synthq.adaptive import start_limit
from synthq.db import session_scope

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

#: One statement, so one snapshot: samples queued + running on the server, and its bound.
SAMPLE = text("""SELECT (SELECT count(*) FROM samples WHERE server = :u
                         AND state IN ('queued', 'running')),
                        (SELECT "limit" FROM servers WHERE url = :u),
                        (SELECT limit_target FROM servers WHERE url = :u)""")


def test_two_workers_auto_limit_moves_and_the_exact_limit_holds(
        workers: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    # 24 slots, ~1.3 s answers: the limit rises from 16, and comes down on 429s.
    sim = simulator("--capacity", "24", "--latency", "0.3", "--tokens-per-second", "10",
                    "--response-tokens", "10")
    n, cap = 160, 48
    # A few prompts answered 429 once, half-way: the limit must come down sharply.
    texts = [f"auto question {i}" + (" [[sim:rate_limit*1]]" if 100 <= i < 104 else "")
             for i in range(n)]
    report = job_factory(texts, servers=[sim.url],
                         inflight_limit=cap, inflight_auto=True, min_inflight=2)
    workers.worker(concurrency=32)
    workers.worker(concurrency=32)
    wait_worker_live(2)
    workers.beat()
    samples: list[tuple[int, int | None, int | None]] = []
    deadline = time.monotonic() + 120
    while counts(report.job_id)["done"] < n:
        assert time.monotonic() < deadline, f"{counts(report.job_id)}\n{workers.logs()}"
        with session_scope() as s:
            row = s.execute(SAMPLE, {"u": sim.url}).one()
        samples.append((int(row[0]), row[1], row[2]))
        time.sleep(0.03)
    over = [(load, bound) for load, bound, _ in samples
            if load > (bound if bound is not None else start_limit(2, cap))]
    assert not over, f"queued + running above the limit: {over[:10]}"
    targets = [t for _, _, t in samples if t is not None]
    assert max(targets) > start_limit(2, cap), "the limit never rose"
    assert any(b < a for a, b in zip(targets, targets[1:], strict=False)), \
        f"the limit never came down: {sorted(set(targets))}"
    assert len(samples) > 100
    assert sim.stats()["max_active"] <= cap
    assert sim.stats()["faults"]["rate_limit"] == 4
