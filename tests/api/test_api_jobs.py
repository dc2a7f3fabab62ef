"""The REST API against real PostgreSQL: create, upload, inspect, requeue, export, metrics."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKEN, settle
from support import counts

pytestmark = pytest.mark.integration


def spec(sim_url: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "servers": [sim_url], "max_tokens": 32, "backoff_base": 0.1,
            "backoff_cap": 0.5, **extra}


def test_malformed_upload_is_201_with_each_bad_row_and_keeps_the_good_ones(client: Any) -> None:
    """Bad rows never stop a job: it is created and its good rows run, so the answer is 201
    (it was 422, for a job that existed and ran), its body naming each skipped row."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})
             for i in range(5)]
    lines.insert(1, "{not json")
    lines.insert(3, json.dumps({"messages": []}))
    lines.append(json.dumps({"conversations": [{"from": "gpt", "value": "no question"}]}))
    body = ("\n".join(lines) + "\n").encode()
    r = client.post("/api/jobs/upload", files={"file": ("prompts.jsonl", io.BytesIO(body))},
                    data={"spec": json.dumps(spec("http://127.0.0.1:9/v1", name="up"))})
    assert r.status_code == 201, r.text
    result = r.json()
    # Bad rows are kept too, as skipped samples with their reason.
    assert result["inserted"] == 8 and result["skipped"] == 3 and result["job_name"] == "up"
    assert result["created"] is True
    assert [e["row"] for e in result["bad_rows"]] == [1, 3, 7]
    assert all(e["reason"] for e in result["bad_rows"])
    assert result["message"] == (
        f"job up (id {result['job_id']}) created: 8 rows read, 5 new samples to run, 0 already "
        "in the job; 3 malformed rows skipped (rows 1, 3, 7, counted from 0; bad_rows gives "
        "each reason)")
    assert client.get(f"/api/jobs/{result['job_id']}").status_code == 200  # it exists
    # No tokenizer: told now that the job makes no training data, and how to add one later.
    assert any("job up has no tokenizer" in w and "`synthq retokenize up --tokenizer TARGET`"
               in w for w in result["warnings"]), result["warnings"]
    assert counts(result["job_id"])["pending"] == 5
    # Clean data: 201. Settings are validated like the CLI's.
    good = client.post("/api/jobs/upload", files={"file": ("ok.jsonl", io.BytesIO(
        lines[0].encode()))}, data={"spec": json.dumps(spec("http://127.0.0.1:9/v1"))})
    assert good.status_code == 201 and good.json()["job_name"] == "ok"
    bad = client.post("/api/jobs/upload", files={"file": ("x.jsonl", io.BytesIO(body))},
                      data={"spec": json.dumps(spec("ftp://nope", max_tokens=0))})
    assert bad.status_code == 422 and "--server" in bad.json()["detail"]


def test_upload_over_the_size_limit_is_413(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from api.config import api_settings

    monkeypatch.setenv("SYNTHQ_API_UPLOAD_MAX_BYTES", "100")
    api_settings.cache_clear()
    r = client.post("/api/jobs/upload", files={"file": ("big.jsonl", io.BytesIO(b"x" * 500))},
                    data={"spec": json.dumps(spec("http://127.0.0.1:9/v1"))})
    assert r.status_code == 413


def test_create_from_a_server_side_path_stays_in_the_data_dir(client: Any, tmp_path: Path
                                                              ) -> None:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (tmp_path / "secret.jsonl").write_text(json.dumps({"prompt": "outside"}) + "\n")
    r = client.post("/api/jobs", json={**spec("http://127.0.0.1:9/v1"), "path": "p.jsonl"})
    assert r.status_code == 201 and r.json()["inserted"] == 1, r.text
    for path in ("../secret.jsonl", str(tmp_path / "secret.jsonl"), "nope.jsonl", ".."):
        r = client.post("/api/jobs", json={**spec("http://127.0.0.1:9/v1"), "path": path})
        assert r.status_code == 422, (path, r.text)
    both = client.post("/api/jobs", json={**spec("x"), "path": "p.jsonl", "hf_dataset": "a/b"})
    assert both.status_code == 422


def test_jobs_samples_pagination_and_steering(client: Any, job_factory: Callable[..., Any],
                                              sample_factory: Callable[..., int]) -> None:
    report = job_factory([f"p{i}" for i in range(7)])
    for _ in range(3):
        sample_factory("failed", job_id=report.job_id, error_class="timeout",
                       server="http://127.0.0.1:9/v1")
    jobs = client.get("/api/jobs").json()
    assert jobs[0]["counts"]["pending"] == 7 and jobs[0]["counts"]["failed"] == 3
    detail = client.get(f"/api/jobs/{report.job_name}").json()
    assert detail["failures"] == {"timeout": 3} and detail["total"] == 10
    # Keyset pages of 4: 4 + 4 + 2, no sample twice.
    seen: list[int] = []
    after = 0
    while True:
        page = client.get(f"/api/jobs/{report.job_id}/samples",
                          params={"limit": 4, "after": after}).json()
        seen += [s["id"] for s in page["items"]]
        if page["next_after"] is None:
            break
        after = page["next_after"]
    assert seen == sorted(set(seen)) and len(seen) == 10
    failed = client.get(f"/api/jobs/{report.job_id}/samples",
                        params={"state": "failed", "error_class": "timeout",
                                "server": "http://127.0.0.1:9/v1"}).json()["items"]
    assert len(failed) == 3
    assert client.get(f"/api/samples/{failed[0]['id']}").json()["error_class"] == "timeout"
    assert client.get("/api/samples/999999").status_code == 404
    assert client.get("/api/jobs/nope").status_code == 404
    assert client.post(f"/api/jobs/{report.job_id}/pause").json()["state"] == "paused"
    assert client.post(f"/api/jobs/{report.job_id}/pause").status_code == 200
    assert client.post(f"/api/jobs/{report.job_id}/resume").json()["state"] == "active"
    assert client.post(f"/api/jobs/{report.job_id}/cancel").json()["state"] == "cancelled"
    assert client.post(f"/api/jobs/{report.job_id}/resume").status_code == 422
    bad = client.post(f"/api/jobs/{report.job_id}/requeue", json={"classes": ["nope"]})
    assert bad.status_code == 422 and "unknown class" in bad.json()["detail"]


def test_requeue_through_the_api_ends_with_the_samples_done(
        client: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0")
    # Each prompt's first request is answered 400 context-length: a permanent failure.
    report = job_factory([f"q{i} [[sim:context_length*1]]" for i in range(4)] + ["fine"],
                         servers=[sim.url], max_attempts=2)
    settle(report.job_id)
    assert counts(report.job_id)["failed"] == 4
    r = client.post(f"/api/jobs/{report.job_id}/requeue", json={"classes": ["context_length"]})
    assert r.json() == {"requeued": 4}
    settle(report.job_id)
    assert counts(report.job_id)["done"] == 5
    status = client.get(f"/api/jobs/{report.job_id}").json()
    assert status["finished"] and status["calls"] == {"ok": 5, "context_length": 4}
    # By id: nothing failed is left to requeue.
    assert client.post(f"/api/jobs/{report.job_id}/requeue",
                       json={"sample_ids": [1]}).json() == {"requeued": 0}


def test_export_runs_as_a_task_and_downloads(client: Any, simulator: Callable[..., Any],
                                             job_factory: Callable[..., Any]) -> None:
    import time

    sim = simulator("--latency", "0")
    report = job_factory([f"q{i}" for i in range(3)], servers=[sim.url])
    settle(report.job_id)
    r = client.post(f"/api/jobs/{report.job_id}/exports", json={"format": "jsonl"})
    assert r.status_code == 202
    run_id = r.json()["id"]
    for _ in range(100):
        run = client.get(f"/api/exports/{run_id}").json()
        if run["state"] != "running":
            break
        time.sleep(0.05)
    assert run["state"] == "done", run
    assert run["manifest"]["exported"] == 3 and "manifest.json" in run["files"]
    shard = next(f for f in run["files"] if f.endswith(".jsonl"))
    rows = client.get(f"/api/exports/{run_id}/files/{shard}").text.splitlines()
    assert len(rows) == 3 and json.loads(rows[0])["conversations"]
    assert client.get(f"/api/exports/{run_id}/files/..%2Fx").status_code == 404
    # Parquet without a tokenizer is refused up front (not 202, then failed), and says why.
    r = client.post(f"/api/jobs/{report.job_id}/exports", json={"format": "parquet"})
    assert r.status_code == 422 and "tokenizer" in r.json()["detail"], r.text


def test_metrics_follow_prometheus_conventions(client: Any, simulator: Callable[..., Any],
                                               job_factory: Callable[..., Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    sim = simulator("--latency", "0")
    report = job_factory(["a", "b", "c [[sim:empty]]"], servers=[sim.url])
    settle(report.job_id)
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"synthq_samples", "synthq_requests_in_flight", "synthq_requests",
            "synthq_request_failures", "synthq_request_duration_seconds",
            "synthq_time_to_first_token_seconds", "synthq_generated_tokens",
            "synthq_worker_last_heartbeat_timestamp_seconds"} <= set(families)
    samples = {(s.labels["job"], s.labels["state"]): s.value
               for s in families["synthq_samples"].samples}
    assert samples[(report.job_name, "done")] == 2 and samples[(report.job_name, "failed")] == 1
    assert 'synthq_request_failures_total{class="empty_response"' in text
    assert "synthq_request_duration_seconds_bucket" in text and "synthq_requests_total" in text
    count = next(s.value for s in families["synthq_request_duration_seconds"].samples
                 if s.name.endswith("_count"))
    assert count == 3


def test_auto_limit_and_cost_in_the_api_metrics_and_job_page(
        client: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from synthq.serving.adaptive import tick

    sim = simulator("--latency", "0.05", "--vllm-metrics")
    report = job_factory([f"q{i}" for i in range(6)], servers=[sim.url], inflight_limit=64,
                         inflight_auto=True, min_inflight=2, gpus=4, gpu_hour_price=2.0)
    settle(report.job_id)
    assert sim.http.get("/metrics").text.count("vllm:num_requests_waiting") == 2
    decided = tick([report.job_id])[sim.url]
    assert 2 <= decided.limit <= 64
    detail = client.get(f"/api/jobs/{report.job_id}").json()
    lim = detail["limits"][sim.url]
    assert lim["auto"] and lim["limit"] == decided.limit and lim["cap"] == 64
    assert lim["reason"] and len(lim["history"]) == 1
    cost = detail["cost"]
    assert cost["tokens"] > 0 and cost["gpus"] == 4 and cost["busy_s"] > 0
    assert cost["dollars"] == pytest.approx(cost["busy_s"] * 4 / 3600 * 2.0)
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.value for s in families["synthq_server_limit"].samples] == [decided.limit]
    assert families["synthq_job_dollars"].samples[0].labels["job"] == report.job_name
    time.sleep(1.0)
    tick([report.job_id])  # a second point: the chart has a line
    client.post("/ui/login", data={"token": TOKEN})
    page = client.get(f"/ui/jobs/{report.job_id}").text
    assert "In-flight limit and throughput" in page and "<polyline" in page and "GPU-hours" in page
    bad = client.post(f"/api/jobs/{report.job_id}/requeue", json={"inflight": 0})
    assert bad.status_code == 422 and "--inflight must be 1 to 100,000" in bad.json()["detail"]
    ok = client.post(f"/api/jobs/{report.job_id}/requeue",
                     json={"inflight": "auto", "max_inflight": 16})
    assert ok.status_code == 200
    assert client.get(f"/api/jobs/{report.job_id}").json()["limits"][sim.url]["cap"] == 16


def test_requeue_with_settings_of_their_own(
        client: Any, simulator: Callable[..., Any], job_factory: Callable[..., Any]) -> None:
    sim = simulator("--latency", "0", "--record-requests", "--response-tokens", "20")
    # Two answers are cut once by the server (finish_reason=length): failed, truncated.
    report = job_factory([f"q{i} [[sim:length*1]]" for i in range(2)] + ["fine"],
                         servers=[sim.url], max_tokens=30)
    settle(report.job_id)
    assert counts(report.job_id)["failed"] == 2
    url = f"/api/jobs/{report.job_id}/requeue"
    bad = client.post(url, json={"classes": ["truncated"], "max_tokens": 0})
    assert bad.status_code == 422 and "--max-tokens must be a positive integer" in bad.json()[
        "detail"]
    assert client.post(url, json={"classes": ["truncated"], "top_p": 2}).status_code == 422
    r = client.post(url, json={"classes": ["truncated"], "max_tokens": 64, "temperature": 0.5})
    assert r.json() == {"requeued": 2}
    settle(report.job_id)
    assert counts(report.job_id)["done"] == 3
    sent = sorted((r["messages"][-1]["content"], r["max_tokens"])
                  for r in sim.http.get("/sim/requests").json())
    assert sent == [("fine", 30), ("q0 [[sim:length*1]]", 30), ("q0 [[sim:length*1]]", 64),
                    ("q1 [[sim:length*1]]", 30), ("q1 [[sim:length*1]]", 64)]
    items = client.get(f"/api/jobs/{report.job_id}/samples").json()["items"]
    own = [client.get(f"/api/samples/{i['id']}").json()["overrides"] for i in items]
    assert sorted(own, key=str) == [None, {"max_tokens": 64, "temperature": 0.5},
                                    {"max_tokens": 64, "temperature": 0.5}]


def test_upload_with_regenerate_all_keeps_tool_conversations_whole(client: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    row = {"tools": tools, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]}
    r = client.post("/api/jobs/upload", files={"file": ("conv.jsonl", io.BytesIO(
        (json.dumps(row) + "\n").encode()))}, data={"spec": json.dumps(spec(
            "http://127.0.0.1:9/v1", regenerate="all", history_reasoning="keep"))})
    assert r.status_code == 201, r.text
    job = client.get(f"/api/jobs/{r.json()['job_id']}").json()
    assert (job["regenerate"], job["turns_done"], job["turns_total"]) == ("all", 0, 3)
    sample = client.get(f"/api/jobs/{job['id']}/samples").json()["items"][0]
    detail = client.get(f"/api/samples/{sample['id']}").json()
    assert detail["turn_count"] == 3 and detail["tools"] == {"tools": tools}
    assert [m["role"] for m in detail["prompt"]] == ["user", "assistant", "tool", "assistant",
                                                     "user"]
    bad = client.post("/api/jobs/upload", files={"file": ("x.jsonl", io.BytesIO(b"{}\n"))},
                      data={"spec": json.dumps(spec("http://127.0.0.1:9/v1",
                                                    regenerate="every"))})
    assert bad.status_code == 422


def test_create_with_stream_false_stores_the_setting(client: Any, tmp_path: Path) -> None:
    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Job

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "s.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    r = client.post("/api/jobs", json={**spec("http://127.0.0.1:9/v1", name="plain",
                                              stream=False), "path": "s.jsonl"})
    assert r.status_code == 201, r.text
    r = client.post("/api/jobs", json={**spec("http://127.0.0.1:9/v1", name="streamed"),
                                       "path": "s.jsonl"})
    assert r.status_code == 201, r.text
    with session_scope() as s:
        assert dict(s.execute(select(Job.name, Job.stream)).tuples().all()) == {
            "plain": False, "streamed": True}
    bad = client.post("/api/jobs", json={**spec("http://127.0.0.1:9/v1", stream="sometimes"),
                                         "path": "s.jsonl"})
    assert bad.status_code == 422


def test_a_new_job_asks_the_workers_for_a_tick_at_once(redis_url: str, client: Any,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Its samples start at once, not at beat's next tick; a broker that cannot be reached
    costs one log line, not the upload (beat's ticks start the samples later)."""
    import redis
    from support import free_port

    from synthq.queue import broker
    from synthq.spec.config import get_settings

    body = json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode()

    def upload(name: str) -> Any:
        return client.post("/api/jobs/upload", files={"file": (f"{name}.jsonl",
                                                               io.BytesIO(body))},
                           data={"spec": json.dumps(spec("http://127.0.0.1:9/v1"))})

    r = redis.Redis.from_url(redis_url)
    try:
        assert upload("first").status_code == 201
        assert [json.loads(m)["headers"]["task"] for m in r.lrange("control", 0, -1)] == \
            ["synthq.dispatch"]
        assert upload("first").json()["inserted"] == 0  # nothing new: no tick
        assert r.llen("control") == 1
    finally:
        r.close()
    monkeypatch.setenv("SYNTHQ_BROKER_URL", f"redis://127.0.0.1:{free_port()}/0")
    get_settings.cache_clear()
    broker._client.cache_clear()
    started = time.monotonic()
    assert upload("second").status_code == 201
    assert time.monotonic() - started < 10
    assert "could not ask the workers for a tick" in caplog.text
    broker._client.cache_clear()
