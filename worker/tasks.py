"""Thin Celery tasks: unpack ids, call synthq, map the outcome."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from synthq.dispatch import Dispatched, active_servers, dispatch, sweep
from synthq.health import probe_due
from synthq.process import Outcome, process_sample
from synthq.retokenize import retokenize_batch
from worker.app import GENERATE_ROUTE, TOKENIZE_ROUTE, TRAIN_ROUTE, app

log = logging.getLogger(__name__)


def publish(batch: Sequence[Dispatched]) -> None:
    """Send one ``generate`` message per queued sample, over one connection."""
    with app.producer_or_acquire() as producer:
        for item in batch:
            generate.apply_async((item.sample_id, item.token, item.job_id), producer=producer,
                                 **GENERATE_ROUTE)


class _Refill:
    """Refills the slots that finished samples free, soon and without one dispatch each.

    Each finished sample pokes it; one thread per worker process runs the
    dispatcher at most every ``interval`` seconds while pokes arrive. (One
    dispatch per sample cost a quarter of a worker's CPU at 50 samples/s.)
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="synthq-refill",
                                                 daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                dispatch(publish)
            except Exception:  # the beat tick will do it; never stop refilling
                log.exception("refill dispatch failed")
            time.sleep(self.interval)


refill = _Refill()


@app.task(name="synthq.generate")
def generate(sample_id: int, token: str, job_id: int | None = None) -> str:
    """Run one sample; then have its server's freed slot refilled."""
    outcome = process_sample(sample_id, token, job_id=job_id)
    if outcome is not Outcome.STALE:
        refill.poke()
    return outcome.value


@app.task(name="synthq.dispatch")
def dispatch_tick() -> int:
    """Beat: probe servers' health, return expired leases, then queue what is due."""
    for url, healthy in probe_due(active_servers()).items():
        if not healthy:
            log.warning("server %s failed its health probe: nothing is sent to it", url)
    swept = sweep()
    if swept:
        log.info("sweep returned %d samples to pending", swept)
    _train_tick()
    return dispatch(publish)


def publish_retokenize(job_id: int, batches: Sequence[Sequence[int]]) -> None:
    """One ``retokenize`` message per batch of sample ids."""
    with app.producer_or_acquire() as producer:
        for ids in batches:
            retokenize.apply_async((job_id, list(ids)), producer=producer, **TOKENIZE_ROUTE)


@app.task(name="synthq.retokenize")
def retokenize(job_id: int, sample_ids: list[int]) -> dict[str, int]:
    """Recompute a batch of examples from stored responses (no server call)."""
    result = retokenize_batch(job_id, sample_ids)
    return {"done": result.done, "failed": result.failed, "skipped": result.skipped}


# --- drafter training (synthq.training) ------------------------------------------------


def publish_train(run_ids: Sequence[int]) -> None:
    """One ``train`` message per run id."""
    with app.producer_or_acquire() as producer:
        for run_id in run_ids:
            train.apply_async((run_id,), producer=producer, **TRAIN_ROUTE)


def _train_tick() -> None:
    """Beat: start runs for jobs whose data is ready; re-send orphaned runs."""
    from synthq.training.readiness import check_readiness  # no torch: cheap

    try:
        ready = check_readiness(publish_train)
    except Exception:  # training must never stop the dispatcher
        log.exception("training readiness check failed")
        return
    if ready.started:
        log.info("readiness: started training runs %s", ready.started)


# Acknowledged on receipt: a run lasts hours (past Redis' visibility timeout);
# SQL and the readiness check's sweep, not the broker, bring back a lost run.
@app.task(name="synthq.train", acks_late=False)
def train(run_id: int) -> str:
    """Train one drafter run to the end (torch loads only in the training worker)."""
    from synthq.training.loop import execute_run

    return execute_run(run_id)
