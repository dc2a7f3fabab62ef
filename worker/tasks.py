"""Thin Celery tasks: unpack ids, call synthq, map the outcome."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from synthq.dispatch import Dispatched, dispatch, sweep
from synthq.process import Outcome, process_sample
from worker.app import GENERATE_ROUTE, app

log = logging.getLogger(__name__)


def publish(batch: Sequence[Dispatched]) -> None:
    """Send one ``generate`` message per queued sample, over one connection."""
    with app.producer_or_acquire() as producer:
        for item in batch:
            generate.apply_async((item.sample_id, item.token), producer=producer,
                                 **GENERATE_ROUTE)


@app.task(name="synthq.generate")
def generate(sample_id: int, token: str) -> str:
    """Run one sample; then refill its server's freed slot right away."""
    outcome = process_sample(sample_id, token)
    if outcome is not Outcome.STALE:
        try:
            dispatch(publish)
        except Exception:  # the beat tick will do it; never fail the sample for this
            log.exception("dispatch after sample %s failed", sample_id)
    return outcome.value


@app.task(name="synthq.dispatch")
def dispatch_tick() -> int:
    """Beat: return expired leases, then queue what is due."""
    swept = sweep()
    if swept:
        log.info("sweep returned %d samples to pending", swept)
    return dispatch(publish)
