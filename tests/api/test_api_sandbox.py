"""A tokenizer folder whose chat template is hostile, over real HTTP and PostgreSQL: the
job is refused with synthq's limit, and the API neither grows nor waits for it (issue
41 item 7: created after 28.9 s, against a 2 s probe limit, with the API at 1.6 GB)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import AUTH

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

#: Constant, so jinja2 folds it while it compiles, outside any render.
SLICE = "{{ [1] | slice(20000000) | list | length }}"


def _status_mb(pid: int, field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (peak) of process ``pid``, MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def test_a_tokenizer_folder_with_a_hostile_template_is_refused_without_growing_the_api(
        api_server: Callable[..., Any], tmp_path: Path) -> None:
    import chat_tokenizers as ct

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    good = Path(ct.qwen3(data)).relative_to(data)
    hostile = Path(ct._chatml(data, "slice", SLICE)).relative_to(data)
    server = api_server()
    spec = {"model": "sim-model", "servers": ["http://127.0.0.1:9/v1"], "max_tokens": 16,
            "path": "p.jsonl"}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        # A good tokenizer first: transformers and a tokenizer loaded, the API at its size.
        r = c.post("/api/jobs", json={**spec, "name": "good", "tokenizer": str(good)})
        assert r.status_code == 201, r.text
        before = _status_mb(server.proc.pid, "VmRSS")
        started = time.monotonic()
        r = c.post("/api/jobs", json={**spec, "name": "slice", "tokenizer": str(hostile)})
        took = time.monotonic() - started
        grown = _status_mb(server.proc.pid, "VmHWM") - before
        assert r.status_code == 422, (r.status_code, r.text, grown, took)
        detail = r.json()["detail"]
        assert "\n" not in detail and "synthq's limit" in detail, detail
        # Today's code: 201 and +1.4 GB. Here a tokenizer's load and the refused probe.
        assert grown < 200, (grown, took)
        assert "slice" not in [j["name"] for j in c.get("/api/jobs").json()]
