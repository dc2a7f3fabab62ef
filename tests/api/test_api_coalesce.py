"""Identical reads at once share one computation (api.coalesce); auth and writes still hold."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from conftest import AUTH


def test_concurrent_gets_share_one_computation_and_errors_are_not_kept() -> None:
    from api.coalesce import Coalescer

    calls = 0
    gate = threading.Event()

    def compute() -> bytes:
        nonlocal calls
        calls += 1
        gate.wait(5)  # every request below arrives while this one runs
        return b"answer"

    async def go(reads: Coalescer) -> list[bytes]:
        tasks = [asyncio.create_task(reads.get("k", compute)) for _ in range(10)]
        await asyncio.sleep(0.1)
        gate.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(go(Coalescer(ttl_s=0))) == [b"answer"] * 10
    assert calls == 1

    def broken() -> bytes:
        nonlocal calls
        calls += 1
        raise RuntimeError("database down")

    async def fail_then_retry(reads: Coalescer) -> tuple[list[object], bytes]:
        failed = await asyncio.gather(*(reads.get("k", broken) for _ in range(5)),
                                      return_exceptions=True)
        return failed, await reads.get("k", lambda: b"back")

    calls = 0
    failed, after = asyncio.run(fail_then_retry(Coalescer(ttl_s=60)))
    assert calls == 1 and all(isinstance(e, RuntimeError) for e in failed)
    assert after == b"back"  # the failure was not kept, even with a long TTL


@pytest.mark.integration
def test_200_identical_reads_cost_one_query_set(api_env: str, job_factory: Any) -> None:
    """N concurrent GET /api/jobs and /metrics run the SQL of one of each; auth per request;
    a cancel through the API is seen by the very next read."""
    import httpx
    from sqlalchemy import event

    from api.app import create_app
    from synthq.store.db import get_engine

    job = job_factory(["a", "b"]).job_id
    app = create_app()
    statements: list[str] = []
    event.listen(get_engine(), "before_cursor_execute",
                 lambda conn, cur, sql, *rest: statements.append(sql))

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", headers=AUTH) as c:
            # Once first: what a process does once (the cost report's first fold, the
            # /metrics rollup's first read) is not a read's own SQL.
            await c.get("/api/jobs")
            await c.get("/metrics")
            app.state.reads.invalidate()
            one = len(statements)
            await c.get("/api/jobs")
            await c.get("/metrics")
            single = len(statements) - one
            app.state.reads.invalidate()
            before = len(statements)
            answers = await asyncio.gather(
                *(c.get(path) for _ in range(100) for path in ("/api/jobs", "/metrics")),
                c.get("/api/jobs", headers={"Authorization": "Bearer wrong-token-xxxxxxxx"}),
                c.get("/metrics", headers={"Authorization": ""}))
            shared = len(statements) - before
            cancelled = await c.post(f"/api/jobs/{job}/cancel")
            listed = await c.get("/api/jobs")
            return {"single": single, "shared": shared, "answers": answers,
                    "cancelled": cancelled, "listed": listed}

    got = asyncio.run(go())
    assert got["single"] > 0
    assert got["shared"] == got["single"], "200 identical reads must run one read's SQL"
    codes = [r.status_code for r in got["answers"]]
    assert codes[:200] == [200] * 200 and codes[200:] == [401, 401]
    assert len({r.content for r in got["answers"][:200:2]}) == 1
    assert got["answers"][0].json()[0]["counts"]["pending"] == 2
    assert got["cancelled"].status_code == 200
    assert got["listed"].json()[0]["state"] == "cancelled"
