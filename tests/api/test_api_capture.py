"""``capture_servers`` through the REST API (the declared setting, as `synthq enqueue
--capture-server` takes it): accepted when it answers, 422 when malformed or silent, 403
outside SYNTHQ_ALLOWED_SERVERS; and the capture stage in GET /api/jobs/{id} (the record
`synthq status --json` prints), the job page and /metrics, from real rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import TOKEN
from sqlalchemy import func, select
from support import capture_rows, run_cli

pytestmark = pytest.mark.integration


def _body(sim_url: str, capture: list[str], **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "servers": [sim_url], "path": "p.jsonl",
            "capture_servers": capture, **extra}


def test_the_api_takes_capture_servers_checked_as_the_cli_does(
        client: Any, simulator: Any, tmp_path: Path) -> None:
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    sim = simulator("--latency", "0")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n"
                                          for i in range(8)))
    for capture, code, said in (
            (["ftp://nope"], 422, "--capture-server 'ftp://nope' is not an http(s) URL"),
            (["http://127.0.0.1:9/v1"], 422, "capture server http://127.0.0.1:9/v1 does not "
                                             "list a model"),
            (["http://10.9.8.7:8000/v1"], 403, "not in SYNTHQ_ALLOWED_SERVERS"),
            ("http://127.0.0.1:9/v1", 422, "")):
        r = client.post("/api/jobs", json=_body(sim.url, capture, name="bad"))  # type: ignore[arg-type]
        assert r.status_code == code, (capture, r.text)
        assert said in json.dumps(r.json()), r.text
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0  # nothing stored

    r = client.post("/api/jobs", json=_body(sim.url, [sim.url], name="cap",
                                            capture_layers=None))
    assert r.status_code == 422  # no such setting: the schema is the declared list
    r = client.post("/api/jobs", json=_body(sim.url, [sim.url + "/"], name="cap"))
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]
    with session_scope() as s:
        assert s.get_one(Job, job_id).capture_servers == [sim.url]
        s.get_one(Job, job_id).capture_layers = [2, 4, 5, 8]
    capture_rows(job_id, sim.url)

    api = client.get(f"/api/jobs/{job_id}").json()["capture"]
    cli = json.loads(run_cli("status", str(job_id), "--json").stdout)["capture"]
    assert api.pop("free_bytes") > 0 and cli.pop("free_bytes") > 0  # the disk moves
    assert api == cli  # one record
    assert api["counts"] == {"pending": 2, "running": 0, "done": 1, "failed": 1}
    assert api["failures"] == {"capture_mismatch": 1} and api["bytes"] == 4096
    assert api["servers"] == [sim.url] and api["projected_bytes"] == 512 * 32

    metrics = client.get("/metrics").text
    for line in ('synthq_captures{job="cap",state="done"} 1.0',
                 'synthq_captures{job="cap",state="pending"} 2.0',
                 'synthq_captures{job="cap",state="waiting"} 2.0',
                 'synthq_capture_failures{class="capture_mismatch",job="cap"} 1.0',
                 'synthq_capture_bytes{job="cap"} 4096.0',
                 'synthq_capture_projected_bytes{job="cap"} 16384.0'):
        assert line in metrics, (line, [m for m in metrics.splitlines() if "capture" in m])

    login = client.post("/ui/login", data={"token": TOKEN}, headers={"Authorization": ""},
                        follow_redirects=False)
    assert login.status_code == 303, login.text
    page = client.get(f"/ui/jobs/{job_id}", headers={"Authorization": ""}).text
    assert 'id="capture"' in page and "Hidden-state capture" in page
    assert 'data-class="capture_mismatch"' in page and "4.1 kB" in page
    assert "the engine&#39;s token ids are not the sample&#39;s" in page
    # A stage synthq stopped (issue 30 item 2) says why in the record and on the page.
    from synthq.queue import jobs as job_states
    from synthq.store.db import utcnow

    line = f"capture stopped: server {sim.url} failed 5 captures in a row with bad_request: x"
    with session_scope() as s:
        assert job_states.set_capture_stopped(s, job_id, line, now=utcnow())
    assert client.get(f"/api/jobs/{job_id}").json()["capture"]["stopped"] == line
    page = client.get(f"/ui/jobs/{job_id}", headers={"Authorization": ""}).text
    assert 'id="capture-stopped"' in page and "failed 5 captures in a row" in page


def test_the_api_sets_the_declared_capture_settings_checked_as_the_cli_does(
        client: Any, simulator: Any, tmp_path: Path) -> None:
    """PUT /api/jobs/{id}/capture takes every setting jobspec.CAPTURE declares, with the
    same checks and messages as `synthq capture`; an omitted one is kept; train_target is
    confined to the data directory like the tokenizer."""
    from synthq.spec import jobspec
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    sim = simulator("--latency", "0")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "q"}) + "\n")
    (data / "target").mkdir()
    r = client.post("/api/jobs", json=_body(sim.url, [sim.url], name="cap"))
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]

    schema = client.get("/openapi.json").json()["components"]["schemas"]["CaptureSettings"]
    assert set(schema["properties"]) == {s.name for s in jobspec.CAPTURE}

    for body, said in (({"capture_layers": [2, 2]}, "--layers 2,2: distinct indices"),
                       ({"capture_limit": 0}, "--limit"),
                       ({"capture_dtype": "int4"}, "--dtype"),
                       ({"capture_timeout": 0}, "--timeout"),
                       ({"train_target": "/etc"}, "inside the data directory"),
                       ({"capture_limits": 3}, "capture_limits")):
        r = client.put(f"/api/jobs/{job_id}/capture", json=body)
        assert r.status_code == 422, (body, r.text)
        assert said in json.dumps(r.json()), (body, r.text)

    r = client.put(f"/api/jobs/{job_id}/capture",
                   json={"capture_layers": [2, 4, 5, 8], "capture_dtype": "bfloat16",
                         "train_target": "target"})
    assert r.status_code == 200, r.text
    r = client.put(f"/api/jobs/{job_id}/capture", json={"capture_limit": 3})
    assert r.status_code == 200, r.text
    assert r.json() == {"capture_layers": [2, 4, 5, 8], "capture_dtype": "bfloat16",
                        "capture_limit": 3, "capture_timeout": None,
                        "train_target": str(data / "target")}
    with session_scope() as s:
        job = s.get_one(Job, job_id)
        assert (job.capture_layers, job.capture_dtype, job.capture_limit) == \
            ([2, 4, 5, 8], "bfloat16", 3)
    assert client.put("/api/jobs/999999/capture", json={}).status_code == 404


def test_the_api_sets_capture_servers_and_engine_files_as_synthq_capture_does(
        client: Any, simulator: Any, tmp_path: Path) -> None:
    """capture_servers and capture_files are declared capture settings: PUT
    /api/jobs/{id}/capture changes them through the function `synthq capture` uses (a
    server must answer, 403 outside SYNTHQ_ALLOWED_SERVERS, folders merged and "" removes
    one); an engine-files folder is confined to the data directory; URLs are not echoed."""
    from synthq.store.db import session_scope
    from synthq.store.models import Job

    sim = simulator("--latency", "0")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "q"}) + "\n")
    (data / "engine").mkdir()
    r = client.post("/api/jobs", json=_body(sim.url, [], name="files"))
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]
    for body, code, said in (
            ({"capture_servers": ["ftp://nope"]}, 422, "is not an http(s) URL"),
            ({"capture_servers": ["http://10.9.8.7:8000/v1"]}, 403, "SYNTHQ_ALLOWED_SERVERS"),
            ({"capture_servers": ["http://127.0.0.1:9/v1"]}, 422, "does not list a model"),
            ({"capture_files": {sim.url: "/etc"}}, 422, "inside the data directory"),
            ({"capture_files": {"http://10.9.8.7:8000/v1": "engine"}}, 403, "ALLOWED")):
        r = client.put(f"/api/jobs/{job_id}/capture", json=body)
        assert r.status_code == code, (body, r.text)
        assert said in r.text, (body, r.text)
    r = client.put(f"/api/jobs/{job_id}/capture", json={
        "capture_servers": [sim.url + "/"], "capture_files": {sim.url: "engine"}})
    assert r.status_code == 200, r.text
    assert "capture_servers" not in r.json() and "capture_files" not in r.json()
    with session_scope() as s:
        job = s.get_one(Job, job_id)
        assert job.capture_servers == [sim.url]
        assert job.capture_files == {sim.url: str(data / "engine")}
    r = client.put(f"/api/jobs/{job_id}/capture", json={"capture_files": {sim.url: ""}})
    assert r.status_code == 200, r.text
    with session_scope() as s:
        job = s.get_one(Job, job_id)
        assert (job.capture_servers, job.capture_files) == ([sim.url], {})
