"""vLLM's gauges from a server's ``/metrics`` page (requests waiting and running, KV-cache
usage), for the adaptive limit (:mod:`synthq.serving.adaptive`) and the served
acceptance's counters (:mod:`synthq.training.served`, through :func:`metrics_url`).

A page is read bounded in bytes and time; a server found without the gauges is asked
again after a minute.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

__all__ = ["metrics_url", "parse_vllm_gauges", "scrape", "METRICS_BYTES", "METRICS_SECONDS"]


def metrics_url(base_url: str) -> str:
    """``http://host:8000/v1`` → ``http://host:8000/metrics``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return f"{root}/metrics"


_GAUGES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
           "vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage"}


def parse_vllm_gauges(body: str) -> dict[str, float]:
    """The vLLM gauges in a Prometheus text page, summed over label sets (KV usage: max)."""
    found: dict[str, float] = {}
    for line in body.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = _GAUGES.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if key == "kv_usage":
            found[key] = max(found.get(key, 0.0), value)
        else:
            found[key] = found.get(key, 0.0) + value
    return found


#: Bytes of a ``/metrics`` page read at most (vLLM's is about 100 KB), and seconds in all.
METRICS_BYTES = 4 << 20
METRICS_SECONDS = 0.5
#: Servers found without vLLM gauges, and when (monotonic): asked again after a minute.
_no_gauges: dict[str, float] = {}
_client: httpx.Client | None = None


def scrape(url: str) -> dict[str, float]:
    global _client
    import httpx

    if time.monotonic() - _no_gauges.get(url, -1e9) < 60.0:
        return {}
    from synthq.core.netio import get_bounded

    if _client is None:
        _client = httpx.Client()
    try:
        # Bounded: a page that never ends (or a huge one) costs METRICS_BYTES and the
        # deadline; its complete lines are still read.
        body = get_bounded(_client, metrics_url(url), max_bytes=METRICS_BYTES,
                           seconds=METRICS_SECONDS)
        text = body.text() if body.complete else body.text().rpartition("\n")[0]
        gauges = parse_vllm_gauges(text) if body.status == 200 else {}
    except httpx.HTTPError:
        gauges = {}
    if not gauges:
        _no_gauges[url] = time.monotonic()
    return gauges
