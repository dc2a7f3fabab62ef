"""Prometheus metrics read from SQL at scrape time.

Every generation process writes its calls and heartbeats to the database, so
one collector that reads SQL reports the whole fleet, across processes and
machines, without prometheus-client's multiprocess mode. Counters and
histograms are computed from the ``attempts`` table, which only grows.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from synthq.store.db import session_scope
from synthq.views import query

__all__ = ["SqlCollector", "registry"]


def _buckets(bounds: tuple[float, ...], counts: list[int], total: int) -> list[tuple[str, float]]:
    return [*((f"{b:g}", float(n)) for b, n in zip(bounds, counts, strict=True)),
            ("+Inf", float(total))]


class SqlCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        with session_scope() as s:
            snap = query.metrics_snapshot(s)
            costs = query.cost_snapshot(s)
        samples = GaugeMetricFamily("synthq_samples", "Samples by job and state.",
                                    labels=["job", "state"])
        for (job, state), n in sorted(snap.samples.items()):
            samples.add_metric([job, state], n)
        yield samples
        inflight = GaugeMetricFamily("synthq_requests_in_flight",
                                     "Samples queued or running, by server.", labels=["server"])
        for server, n in sorted(snap.inflight.items()):
            inflight.add_metric([server], n)
        yield inflight
        healthy = GaugeMetricFamily("synthq_server_healthy",
                                    "1 if the server passed its last health probe.",
                                    labels=["server"])
        for server, ok in sorted(snap.healthy.items()):
            healthy.add_metric([server], ok)
        yield healthy
        calls = CounterMetricFamily("synthq_requests", "Calls to inference servers by outcome "
                                    "(ok, a failure class, lost, running).",
                                    labels=["server", "outcome"])
        failures = CounterMetricFamily("synthq_request_failures", "Failed calls by class.",
                                       labels=["server", "class"])
        for (server, outcome), n in sorted(snap.calls.items()):
            calls.add_metric([server, outcome], n)
            if outcome not in ("ok", "running"):
                failures.add_metric([server, outcome], n)
        yield calls
        yield failures
        for name, doc, data, bounds in (
                ("synthq_request_duration_seconds", "Latency of finished calls.",
                 snap.latency, query.LATENCY_BUCKETS),
                ("synthq_time_to_first_token_seconds", "Seconds to the first streamed chunk.",
                 snap.ttft, query.TTFT_BUCKETS)):
            hist = HistogramMetricFamily(name, doc, labels=["server"])
            for server, (counts, total, sum_) in sorted(data.items()):
                hist.add_metric([server], _buckets(bounds, counts, total), sum_)
            yield hist
        tokens = CounterMetricFamily("synthq_generated_tokens",
                                     "Completion tokens of successful calls.", labels=["server"])
        for server, n in sorted(snap.generated_tokens.items()):
            tokens.add_metric([server], n)
        yield tokens
        beat = GaugeMetricFamily("synthq_worker_last_heartbeat_timestamp_seconds",
                                 "Unix time of each worker's last heartbeat.", labels=["worker"])
        capacity = GaugeMetricFamily("synthq_worker_capacity", "Calls a worker may hold.",
                                     labels=["worker"])
        held = GaugeMetricFamily("synthq_worker_in_flight", "Calls a worker held at its last "
                                 "heartbeat.", labels=["worker"])
        for worker, (at, cap, n) in sorted(snap.workers.items()):
            beat.add_metric([worker], at)
            capacity.add_metric([worker], cap)
            held.add_metric([worker], n)
        yield beat
        yield capacity
        yield held
        yield from _limits_and_cost(costs)
        yield from _captures()


def _captures() -> Iterator[Metric]:
    """Each capturing job's stage (synthq.capture.progress, what its status shows)."""
    from sqlalchemy import select

    from synthq.capture.progress import capture_progress
    from synthq.spec.config import status_settings
    from synthq.store.models import Capture, Job
    from synthq.store.sqlread import reader_of

    store = status_settings().capture_store or ""
    with session_scope() as s:
        reader = reader_of(s)
        # Only jobs that capture (or once did): a scrape reads nothing of the others.
        had = set(s.scalars(select(Capture.job_id).distinct()))
        found = [(name, capture_progress(reader, job_id, store=store))
                 for job_id, name, servers in s.execute(
                     select(Job.id, Job.name, Job.capture_servers).order_by(Job.name))
                 if servers or job_id in had]
    jobs = [(name, p) for name, p in found if p is not None]
    by_state = GaugeMetricFamily("synthq_captures", "Hidden-state captures by job and state "
                               "(waiting: done samples the stage has not picked up yet).",
                               labels=["job", "state"])
    failures = GaugeMetricFamily("synthq_capture_failures", "Failed captures by job and class.",
                                 labels=["job", "class"])
    disk = {key: GaugeMetricFamily(f"synthq_capture_{key}", doc, labels=["job"]) for key, doc in (
        ("bytes", "Bytes of the job's captured files on disk."),
        ("projected_bytes", "Bytes the job's captures not yet done will take."),
        ("free_bytes", "Free bytes where the capture store lives."))}
    for name, p in jobs:
        for state, n in sorted({**p.counts, "waiting": p.waiting}.items()):
            by_state.add_metric([name, state], n)
        for cls, n in sorted(p.failures.items()):
            failures.add_metric([name, cls], n)
        for key, gauge in disk.items():
            value = getattr(p, key)
            if value is not None:
                gauge.add_metric([name], float(value))
    yield by_state
    yield failures
    yield from disk.values()


def _limits_and_cost(snap: query.CostSnapshot) -> Iterator[Metric]:
    limit = GaugeMetricFamily("synthq_server_limit", "The adaptive in-flight limit of a "
                              "server (--inflight auto).", labels=["server"])
    for server, n in sorted(snap.limits.items()):
        limit.add_metric([server], n)
    yield limit
    families = {
        "busy_s": ("synthq_job_busy_seconds", "Seconds with a call of the job in flight, "
                   "summed over servers."),
        "gpu_hours": ("synthq_job_gpu_hours", "Busy server time × GPUs per server."),
        "tokens": ("synthq_job_generated_tokens", "Completion tokens of the job's ok calls."),
        "tokens_per_s": ("synthq_job_tokens_per_second", "Generated tokens per busy second."),
        "dollars": ("synthq_job_dollars", "GPU-hours × price (with a GPU-hour price)."),
        "dollars_per_mtok": ("synthq_job_dollars_per_million_tokens",
                             "Dollars per 1M generated tokens."),
        "remaining_dollars": ("synthq_job_projected_remaining_dollars",
                              "Projected cost of the remaining samples."),
    }
    for key, (name, doc) in families.items():
        gauge = GaugeMetricFamily(name, doc, labels=["job"])
        for job, cost in sorted(snap.costs.items()):
            if cost.get(key) is not None:
                gauge.add_metric([job], float(cost[key]))
        yield gauge


def registry() -> CollectorRegistry:
    """A registry holding only the SQL collector (one per app)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SqlCollector())
    return reg
