"""Thin Celery tasks: unpack ids, call synthq, map the outcome."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from celery import signals
from sqlalchemy.exc import DBAPIError

from synthq.app.tick import Effects, run_tick
from synthq.jobs.retokenize import retokenize_batch
from synthq.queue.broker import take_tick
from synthq.queue.dispatch import Dispatched, adopt_stale, dispatch
from synthq.queue.sweep import database_trouble
from synthq.serving.executor import Executor
from synthq.spec.config import get_settings
from synthq.store.db import disk_full, safe_url
from worker.app import CAPTURE_ROUTE, GENERATE_ROUTE, TOKENIZE_ROUTE, TRAIN_ROUTE, app

log = logging.getLogger(__name__)


def publish(batch: Sequence[Dispatched]) -> None:
    """Send one server's queued samples as ``generate`` messages of up to ``batch_size``."""
    size = max(1, get_settings().batch_size)
    with app.producer_or_acquire() as producer:
        for start in range(0, len(batch), size):
            chunk = batch[start:start + size]
            generate.apply_async(([[d.sample_id, d.token, d.job_id] for d in chunk],
                                  chunk[0].server), producer=producer, **GENERATE_ROUTE)


class _Refill:
    """Refills the slots that finished samples free, soon and without one dispatch each.

    Each finished sample pokes it; one thread per worker process runs the
    dispatcher at most every ``refill_interval`` seconds while pokes arrive. (One
    dispatch per sample cost a quarter of a worker's CPU at 50 samples/s.)
    The samples for this process's own free slots are claimed in the dispatch's
    transaction and started here (no broker round trip, no second transaction);
    the rest go to the broker for the other workers.

    With no poke for ``idle`` seconds while this process has free slots, it looks
    in SQL for samples queued that long whose message never came (a half-open
    Redis connection, a lost message) and claims them itself: SQL is the truth.
    """

    def __init__(self, interval: float | None = None, idle: float | None = None) -> None:
        self.interval = interval
        self.idle = idle
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def poke(self) -> None:
        with self._lock:
            if self._stopped:
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="synthq-refill",
                                                 daemon=True)
                self._thread.start()
        self._wake.set()

    def watch(self) -> None:
        """Start the thread without a dispatch (it then looks every ``idle`` s)."""
        with self._lock:
            if self._stopped or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._run, name="synthq-refill",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 0.0) -> None:
        """No refill starts from now on; wait up to ``timeout`` s for the one under way.

        A stopping worker has no slots to refill (the beat tick fills the other
        workers'), and a dispatch cut by the process's exit between its commit
        and its publish would leave samples queued without a message until the
        queued deadline: on a server judged down (one call at a time) they
        block it all that time.
        """
        with self._lock:
            self._stopped = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread() and timeout > 0:
            thread.join(timeout)

    def _idle_seconds(self) -> float:
        if self.idle is not None:
            return self.idle
        settings = get_settings()
        return settings.adopt_after or max(1.0, 2 * settings.heartbeat_interval)

    def _adopt(self) -> None:
        """Idle with free slots: claim what SQL says was queued and never delivered."""
        with _executor_lock:
            mine = _executor
        local = mine.local_claim() if mine is not None else None
        if local is None:
            return
        try:
            adopted = adopt_stale(local, older_than=self._idle_seconds())
        except Exception as exc:  # the next idle round tries again; never stop refilling
            if not _outage(exc):
                log.exception("claiming undelivered samples failed")
            return
        if adopted:
            log.warning("%d samples were queued with this worker's slots free and no "
                        "message came (is the broker reachable?): claimed them from SQL",
                        adopted)

    def _run(self) -> None:
        failures = 0
        while True:
            poked = self._wake.wait(self._idle_seconds())
            self._wake.clear()
            if self._stopped:
                return
            if not poked:
                self._adopt()
                continue
            try:
                with _executor_lock:
                    mine = _executor if get_settings().local_refill else None
                dispatch(publish, local=mine.local_claim() if mine is not None else None)
            except Exception as exc:  # the beat tick will do it; never stop refilling
                if not _outage(exc):
                    log.exception("refill dispatch failed")
                elif not failures:  # one line per outage, not a traceback per fault
                    log.warning("refill dispatch failed (%s: %s); retrying quietly until it "
                                "works", type(exc).__name__, str(exc).splitlines()[0][:200])
                failures += 1
            else:
                if failures:
                    log.warning("refill dispatch works again (after %d failed tries)",
                                failures)
                failures = 0
            time.sleep(self.interval if self.interval is not None
                       else get_settings().refill_interval)


def _outage(exc: BaseException) -> bool:
    """A database or broker that cannot be reached or refuses writes (not a bug)."""
    from kombu.exceptions import OperationalError as BrokerError
    from redis.exceptions import RedisError

    return isinstance(exc, DBAPIError | BrokerError | RedisError | ConnectionError | OSError)


refill = _Refill()

# -- this process's executor (one event loop for every call in flight) -------------------

_executor: Executor | None = None
_executor_lock = threading.Lock()
#: Calls this worker holds at once: SYNTHQ_WORKER_CAPACITY, else the pool's size.
_capacity = 0


def executor() -> Executor:
    global _executor
    with _executor_lock:
        if _executor is None:
            capacity = get_settings().worker_capacity or _capacity or 1
            _executor = Executor(capacity, on_finished=refill.poke)
            log.info("synthq worker %s: capacity %d", _executor.name, capacity)
            refill.watch()  # its slots are free: its refill watches them from now on
        return _executor


@signals.worker_ready.connect
def _start_executor(sender: Any = None, **_: Any) -> None:
    """Register with the dispatcher as soon as the worker consumes ``generate``."""
    global _capacity
    queues = {q.name for q in sender.task_consumer.queues} if sender is not None else set()
    if "generate" not in queues:
        return
    _capacity = int(getattr(sender.controller, "concurrency", 0) or 0)
    executor()


@signals.worker_shutting_down.connect
def _begin_shutdown(**_: Any) -> None:
    """Warm shutdown (SIGTERM): calls get ``shutdown_grace`` seconds, then are cut; this
    process refills no slot any more."""
    refill.stop()
    with _executor_lock:
        if _executor is not None:
            _executor.begin_shutdown(get_settings().shutdown_grace)


@signals.worker_shutdown.connect
def _stop_executor(**_: Any) -> None:
    """Warm shutdown: the batches have finished; the locally refilled calls end too (cut
    at the grace like the others); then forget this worker at once."""
    global _executor
    refill.stop(timeout=30.0)  # a dispatch under way publishes what it queued
    with _executor_lock:
        if _executor is not None:
            if not _executor.drain(get_settings().shutdown_grace + 30.0):
                log.warning("calls still in flight at shutdown: their leases bring them back")
            _executor.close()
            _executor = None


@app.task(name="synthq.generate")
def generate(items: list[list[Any]], server: str | None = None) -> dict[str, Any]:
    """Run a batch of one server's samples to their outcomes.

    Returns the outcome counts and which samples ended how (what Flower shows
    as the task's result), e.g. ``{"server": ..., "samples": 32, "done": 31,
    "retry": 1, "ids": {"done": [...], "retry": [17]}}``.
    """
    outcomes = executor().run_batch(items)
    ids: dict[str, list[int]] = {}
    for sample_id, outcome in sorted(outcomes.items()):
        ids.setdefault(str(outcome), []).append(sample_id)
    return {"server": safe_url(server) if server else server, "samples": len(items),
            **Counter(str(o) for o in outcomes.values()), "ids": ids}


@app.task(name="synthq.dispatch", send_events=False)
def dispatch_tick() -> int:
    """Beat: the scheduler tick (synthq.app.tick: probe, sweep, adapt, dispatch, finish,
    training readiness). Logs only what it did; a tick sent too long ago (its Redis key
    gone: synthq.queue.broker.take_tick) does nothing, the next one does its work."""
    if not take_tick(dispatch_tick.request.id):
        return 0
    try:
        return _tick()
    except DBAPIError as exc:
        database_trouble()  # the sweep waits before judging workers by their heartbeats
        if disk_full(exc):
            log.warning("dispatch tick: the database's disk is full (%s); nothing moves "
                        "until space is freed", str(exc).splitlines()[0][:200])
        else:
            log.warning("dispatch tick: the database is unreachable; the next tick retries")
        return 0


def _tick() -> int:
    """The scheduler tick (synthq.app.tick) with this deployment's effects: the broker."""
    done = run_tick(Effects(publish=publish, start_training=publish_train,
                            start_capture=publish_capture)).did
    for url in done.get("probe") or ():
        log.warning("server %s failed its health probe: nothing is sent to it", url)
    if done.get("sweep"):
        log.info("sweep returned %d samples to pending", done["sweep"])
    if done.get("finish"):
        log.info("jobs finished (every sample done, failed or skipped): %s", done["finish"])
    if done.get("train"):
        log.info("readiness: started training runs %s", done["train"])
    return int(done.get("dispatch") or 0)


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


# --- hidden-state capture (synthq.capture) ---------------------------------------------

#: When beat last sent each job a ``capture`` message (a hint: the stage claims its
#: work in SQL, within each capture server's exact limit; a lost one is sent again).
_capture_sent: dict[int, float] = {}


def publish_capture(job_ids: Sequence[int]) -> None:
    """A ``capture`` message for each job given (once per ``capture_task_seconds / 6``
    at most: a message runs the job's stage for up to ``capture_task_seconds``)."""
    every = get_settings().capture_task_seconds / 6
    now = time.monotonic()
    for job_id in job_ids:
        if now - _capture_sent.get(job_id, float("-inf")) >= every:
            _capture_sent[job_id] = now
            capture.apply_async((job_id,), **CAPTURE_ROUTE)


@app.task(name="synthq.capture")
def capture(job_id: int) -> dict[str, Any]:
    """Run a job's capture stage for up to ``capture_task_seconds``; what is left is
    sent again by beat."""
    from synthq.capture.stage import Stage

    left = Stage(job_id, seconds=get_settings().capture_task_seconds).run()
    return {"job": job_id, "done": left.done, "total": left.total, "failures": left.failures}


# --- drafter training (synthq.training) ------------------------------------------------


def publish_train(run_ids: Sequence[int]) -> None:
    """One ``train`` message per run id."""
    with app.producer_or_acquire() as producer:
        for run_id in run_ids:
            train.apply_async((run_id,), producer=producer, **TRAIN_ROUTE)


# Acknowledged on receipt: a run lasts hours (past Redis' visibility timeout);
# SQL and the readiness check's sweep, not the broker, bring back a lost run.
@app.task(name="synthq.train", acks_late=False)
def train(run_id: int) -> str:
    """Train one drafter run to the end (torch loads only in the training worker)."""
    from synthq.training.lifecycle import execute_run

    return execute_run(run_id)
