"""The API checks job settings as the CLI does (synthq.spec.jobspec), on create and on requeue
alike: a value out of its bounds is a 422 with the option named, and nothing is stored."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select

from synthq.store.db import session_scope
from synthq.store.models import Job, Sample

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("max_attempts", 10**12, "--max-attempts"),
    ("temperature", 1e308, "--temperature"),
    ("max_tokens", 10**12, "--max-tokens"),
    ("stall_timeout", 1e308, "--stall-timeout"),
    ("timeout", 1e308, "--timeout"),
    ("top_p", 0, "--top-p"),
])
def test_requeue_refuses_a_value_out_of_bounds(
        client: Any, job_factory: Callable[..., Any], sample_factory: Callable[..., int],
        field: str, value: Any, flag: str) -> None:
    report = job_factory([])
    sid = sample_factory("failed", job_id=report.job_id, error_class="timeout")
    r = client.post(f"/api/jobs/{report.job_id}/requeue", json={field: value})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(f"{flag} is out of range"), r.text
    with session_scope() as s:
        smp = s.get_one(Sample, sid)
        assert (smp.state, smp.overrides) == ("failed", None)


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("stall_timeout", 1e308, "--stall-timeout"),
    ("backoff_cap", 1e308, "--backoff-cap"),
    ("max_attempts", 10**12, "--max-attempts"),
    ("max_seq_len", 2**31, "--max-seq-len"),
    ("think_open", "x" * 65, "--think-open"),
    ("extra_body", {"n": 100}, "--extra-body"),
    ("extra_body", {"stream_options": {"include_usage": False}}, "--extra-body"),
    ("extra_body", {"kv_transfer_params": {"synthq_name": "dup"}}, "--extra-body"),
    ("reasoning", "maybe", "--reasoning"),
])
def test_create_refuses_what_requeue_refuses(
        client: Any, api_env: str, tmp_path: Any, field: str, value: Any, flag: str) -> None:
    from synthq.spec.config import get_settings

    data = get_settings().data_dir
    data.mkdir(parents=True, exist_ok=True)
    (data / "p.jsonl").write_text('{"prompt": "hi"}\n')
    body = {"model": "m", "servers": ["http://127.0.0.1:9/v1"], "path": "p.jsonl",
            "name": "bounded", field: value}
    r = client.post("/api/jobs", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith(flag), r.text
    with session_scope() as s:
        assert s.scalar(select(Job.id).where(Job.name == "bounded")) is None
