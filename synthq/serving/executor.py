"""A worker process's engine: one asyncio event loop that owns every call in flight.

One OS thread per sample and three ORM transactions each cost nine times the
CPU of a plain asyncio script. So each generation process (a Celery worker
or ``synthq run``) has one :class:`Executor`:

* **a batch in, outcome counts out.** :meth:`Executor.run_batch` claims a
  whole ``generate`` message (up to ``batch_size`` samples of one server) in
  one statement, hands the claimed samples to the loop, and returns when all
  have an outcome. Celery's few carrier threads just wait in it.
* **one event loop** runs every HTTP call of the process (an async client
  per server, its pool sized to the server's current limit), with the raw
  SSE parsing (:mod:`synthq.serving.answer`) and the stall and total clocks of
  :mod:`synthq.serving.inference`.
* **one writer thread** (:mod:`synthq.serving.writer`) commits outcomes in batches.
* **keepalive**: the process's ``workers`` row is refreshed every
  ``heartbeat_interval`` seconds on a connection of its own (:mod:`synthq.queue.heartbeat`:
  a stranded writer no longer silences it), and the leases of its running samples
  are renewed through the writer in one statement when a third of a lease has
  passed (their lease and its renewal are the samples' declaration,
  :data:`synthq.queue.states.SAMPLES`). A sample whose lease turns out lost (the
  sweep gave it away) has its call cancelled. While its heartbeat is late the
  process starts no call.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from synthq.core.errors import DiskFull, WorkerError, brief
from synthq.queue import ledger, states, workers
from synthq.queue.dispatch import LocalClaim
from synthq.queue.heartbeat import Heartbeat
from synthq.queue.jobview import effective, get_job
from synthq.queue.streaks import GENERATION_CLASSES, Streaks
from synthq.serving.call import Call, Outcome, run_claimed
from synthq.serving.inference import InferenceClient
from synthq.serving.writer import Writer
from synthq.spec.config import get_settings
from synthq.store.db import CLAIM_PATH_ATTEMPTS, session_scope, utcnow, with_db_retry

__all__ = ["Executor", "default_executor", "reset_default_executor", "process_sample"]

log = logging.getLogger(__name__)

#: ``(sample_id, token, job_id or None)``: one sample of a ``generate`` message.
Item = tuple[int, str, int | None]


#: How long :meth:`Executor.close` lets the loop's tasks end on their own before it stops
#: the loop.
SETTLE_SECONDS = 1.0


async def _settle(seconds: float) -> None:
    """Let the loop's other tasks end, for ``seconds`` at most: a batch whose calls have all
    ended needs one more turn of the loop to return, the keepalive one to take its
    cancellation. A loop stopped before that leaves them pending, and at the process's exit
    asyncio prints "Task was destroyed but it is pending!" with the task: after a full
    disk's one line, the run's last lines were that. A task still running then (a call in
    flight) is left as before: its lease brings the sample back."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if others:
        await asyncio.wait(others, timeout=seconds)


class Executor:
    """The event loop, writer and keepalive of one generation process."""

    def __init__(self, capacity: int, *, name: str | None = None,
                 on_finished: Callable[[], None] | None = None,
                 tokenize_threads: int = 2) -> None:
        settings = get_settings()
        self.name = name or workers.new_name()
        self.capacity = capacity
        self.on_finished = on_finished
        # Embedded (`synthq run`): a full disk is said once, by the runner; a worker logs it.
        self.writer = Writer(retry_seconds=settings.write_retry_seconds,
                             disk_full_level=logging.DEBUG if settings.embedded
                             else logging.ERROR)
        self._tokenize_pool = ThreadPoolExecutor(tokenize_threads,
                                                 thread_name_prefix="synthq-tokenize")
        self._calls: dict[int, Call] = {}  # loop thread only
        #: Samples claimed by a local refill and not yet in _calls (any thread).
        self._starting = 0
        self._starting_lock = threading.Lock()
        self._clients: dict[str, InferenceClient] = {}  # loop thread only
        self._retired: list[InferenceClient] = []
        #: Unexpected errors already logged with their traceback (type, place).
        self._bugs_seen: set[tuple[str, str]] = set()
        self._closed = False
        #: Set by :meth:`begin_shutdown`: new batches are released, not run.
        self._stopping = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="synthq-loop",
                                        daemon=True)
        self._thread.start()
        #: bad_request in a row per server: the stop_after-th pauses the job (synthq.queue.streaks).
        self.streaks = Streaks(GENERATION_CLASSES, settings.stop_after)
        self.heartbeat = Heartbeat(self.name, capacity=lambda: self.capacity,
                                   inflight=lambda: len(self._calls))
        # Known to the dispatcher before the first message can arrive.
        self._heartbeat_now()
        self.heartbeat.start()
        self._keepalive = asyncio.run_coroutine_threadsafe(self._keep_alive(), self.loop)

    # -- public, any thread -------------------------------------------------------------

    @property
    def inflight(self) -> int:
        return len(self._calls)

    def run_batch(self, items: Sequence[Sequence[Any]]) -> dict[int, Outcome]:
        """Claim ``items`` (``(id, token[, job_id])``) and run them; blocks until all ended.

        Returns each item's outcome; items whose claim lost are ``stale``.
        """
        items = [(int(i[0]), str(i[1]), i[2] if len(i) > 2 else None) for i in items]
        if not items:
            return {}
        if self._stopping or not self.heartbeat.fresh():
            # Shutting down, or silent to the sweep (it may give our samples away):
            # hand the samples back instead of starting them.
            def release() -> int:
                with session_scope() as s:
                    return states.release(s, [(i, t) for i, t, _ in items], now=utcnow())

            with_db_retry(release, attempts=CLAIM_PATH_ATTEMPTS, what="release of a batch")
            return {i: Outcome.STALE for i, _, _ in items}
        job_ids = {j for _, _, j in items if j is not None}
        # The message names the jobs, so the lease is theirs from the start
        # (a generous one otherwise; the first renewal makes it the job's own).
        lease = max((states.SAMPLES.lease_seconds(get_job(j)) for j in job_ids),
                    default=states.SAMPLES.lease_seconds(None))
        token = secrets.token_hex(16)

        def claim() -> list[states.Claimed]:
            now = utcnow()
            with session_scope() as s:
                return states.claim_batch(s, [(i, t) for i, t, _ in items], new_token=token,
                                          lease_until=now + timedelta(seconds=lease),
                                          worker=self.name, now=now)

        # Retried through a database outage for about as long as the queued
        # deadline: past that, the sweep hands these samples out again anyway.
        # A full disk is no outage: stop claiming (and say so) until writes work again.
        if self.writer.disk_full is not None:
            return {i: Outcome.STALE for i, _, _ in items}
        claimed_mono = time.monotonic()  # before the claim statement (Streaks.holds)
        try:
            claimed = with_db_retry(claim, attempts=CLAIM_PATH_ATTEMPTS,
                                    what=f"claim of {len(items)} samples")
        except DiskFull as exc:
            if self.writer.disk_full is None:
                log.log(self.writer.disk_full_level, "the database's disk is full (%s): not "
                        "claiming until it accepts writes again", exc.where)
                self.writer.disk_full = str(exc)
            return {i: Outcome.STALE for i, _, _ in items}
        outcomes = {i: Outcome.STALE for i, _, _ in items}
        if not claimed:
            return outcomes
        jobs = {c.job_id: get_job(c.job_id) for c in claimed}
        future = asyncio.run_coroutine_threadsafe(
            self._run(claimed, jobs, claimed_mono=claimed_mono), self.loop)
        outcomes.update(future.result())
        return outcomes

    def local_claim(self) -> LocalClaim | None:
        """What a refill dispatch may claim for this process itself (``dispatch(local=)``):
        its free slots; None while shutting down, unable to write, or while its heartbeat
        is late."""
        room = self.capacity - self.inflight - self._starting
        if self._stopping or self.writer.disk_full is not None or room <= 0 \
                or not self.heartbeat.fresh():
            return None
        claimed_mono = time.monotonic()  # before the dispatch that claims (Streaks.holds)
        return LocalClaim(self.name, room,
                          lambda session, job_id: states.SAMPLES.lease_seconds(
                              get_job(job_id, session)),
                          lambda claimed: self.start_claimed(claimed, claimed_mono))

    def start_claimed(self, claimed: list[states.Claimed],
                      claimed_mono: float | None = None) -> None:
        """Run samples already claimed for this process (a local refill); returns at once.
        Never raises: samples it cannot start go back to ``pending``."""
        why = ("interrupted", "the worker is stopping")
        if not self._stopping:
            try:
                jobs = {c.job_id: get_job(c.job_id) for c in claimed}
                with self._starting_lock:
                    self._starting += len(claimed)
                asyncio.run_coroutine_threadsafe(
                    self._run(claimed, jobs, started=True, claimed_mono=claimed_mono),
                    self.loop)
                return
            except Exception:  # noqa: BLE001 - the loop is gone: hand them back, never strand
                log.exception("could not start %d claimed samples; handing them back",
                              len(claimed))
                with self._starting_lock:
                    self._starting = 0
                why = (WorkerError.error_class, "the worker could not start the call")

        def give_back() -> None:  # no call was made: the attempt is not charged
            now = utcnow()
            with session_scope() as s:
                for c in claimed:
                    states.retry(s, c.sample_id, c.token, next_attempt_at=now,
                                 error_class=why[0], error_message=why[1], charge=False,
                                 now=now)

        with_db_retry(give_back, attempts=CLAIM_PATH_ATTEMPTS, what="hand back")

    def drain(self, timeout: float) -> bool:
        """Wait until no call is in flight (after :meth:`begin_shutdown`, whose cut ends
        them): samples a local refill started are in no Celery task, so Celery's warm
        shutdown does not wait for them. True when drained."""
        deadline = time.monotonic() + timeout
        while self.inflight or self._starting:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def submit_batch(self, items: Sequence[Sequence[Any]],
                     pool: ThreadPoolExecutor) -> Future[dict[int, Outcome]]:
        """:meth:`run_batch` on a thread of ``pool`` (the embedded runner's carriers)."""
        return pool.submit(self.run_batch, items)

    def begin_shutdown(self, grace: float) -> None:
        """Stop starting batches; cut the calls still running after ``grace`` seconds.

        A cut call's sample goes back to pending, due at once (class
        ``interrupted``), so another worker takes it over without waiting for
        a lease. Batches then end, and Celery's warm shutdown with them.
        """
        self._stopping = True
        # Capacity 0 at once: the dispatcher stops queueing samples for this worker.
        self.capacity = 0
        self.heartbeat.wake()

        def cut() -> None:
            for call in list(self._calls.values()):
                if call.calling and call.task is not None:
                    call.interrupted = True
                    call.task.cancel()

        self.loop.call_soon_threadsafe(self.loop.call_later, grace, cut)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the keepalive, forget this worker, close the clients and the writer."""
        if self._closed:
            return
        self._closed = True
        self._keepalive.cancel()
        self.heartbeat.stop()

        async def close_clients() -> None:
            for client in [*self._clients.values(), *self._retired]:
                await client.close()

        try:
            asyncio.run_coroutine_threadsafe(close_clients(), self.loop).result(timeout)
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("closing clients failed", exc_info=True)
        try:
            self.writer.submit(lambda s, now: workers.unregister(s, self.name)).result(timeout)
        except Exception as exc:  # noqa: BLE001 - the row times out by itself
            if not isinstance(exc, DiskFull):
                log.warning("could not unregister worker %s", self.name)
        self.writer.close(timeout)
        waits = self.writer.wait_figures()
        if waits["answers"]:
            # What a kill -9 would have cost: answers in hand, not yet committed.
            log.info("writer: %d answers waited for their commit: median %.1f ms, p95 %.1f "
                     "ms, p99 %.1f ms, max %.1f ms (%d commits)", waits["answers"],
                     waits["p50_ms"], waits["p95_ms"], waits["p99_ms"], waits["max_ms"],
                     self.writer.commits)
        try:
            asyncio.run_coroutine_threadsafe(_settle(SETTLE_SECONDS), self.loop).result(timeout)
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("settling the loop's tasks failed", exc_info=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self._tokenize_pool.shutdown(wait=False)

    # -- the loop ---------------------------------------------------------------------------

    def _client(self, url: str, limit: int) -> InferenceClient:
        client = self._clients.get(url)
        if client is None or client.max_connections < limit:
            # The pool follows the server's current limit: a raised --inflight
            # gets connections at once instead of waiting on a full pool.
            if client is not None:
                self._retired.append(client)
            # The key goes only to the hosts SYNTHQ_ALLOWED_SERVERS lists (when set):
            # a server named by a user of the API must not receive it.
            settings = get_settings()
            key = settings.api_key if settings.sends_key_to(url) else "EMPTY"
            client = self._clients[url] = InferenceClient(
                url, api_key=key, max_connections=limit)
        return client

    async def _run(self, claimed: list[states.Claimed], jobs: dict[int, Any], *,
                   started: bool = False,
                   claimed_mono: float | None = None) -> dict[int, Outcome]:
        tasks = [asyncio.ensure_future(self._one(c, jobs[c.job_id], claimed_mono))
                 for c in claimed]
        if started:  # start_claimed's count: the calls are in self._calls from here on
            await asyncio.sleep(0)
            with self._starting_lock:
                self._starting -= len(claimed)
        results = await asyncio.gather(*tasks)
        return {c.sample_id: r for c, r in zip(claimed, results, strict=True)}

    async def _one(self, c: states.Claimed, job: Any,
                   claimed_mono: float | None = None) -> Outcome:
        call = Call(c, states.SAMPLES.lease_seconds(job), claimed_mono)
        call.task = asyncio.current_task()
        self._calls[c.sample_id] = call
        try:
            outcome = await run_claimed(call, job, client=self._client, writer=self.writer,
                                        worker=self.name, tokenize_pool=self._tokenize_pool,
                                        streaks=self.streaks)
        except DiskFull:  # nothing can be written: the lease (or the next run) brings it back
            outcome = Outcome.NOT_WRITTEN
        except Exception as exc:  # a bug: hand the sample back, never strand it or the batch
            self._log_unexpected(c.sample_id, exc)
            outcome = await self._give_back(c, brief(exc), call, job)
        finally:
            del self._calls[c.sample_id]
        if self.on_finished is not None:
            self.on_finished()
        return outcome

    def _log_unexpected(self, sample_id: int, exc: Exception) -> None:
        """The traceback the first time a bug is met (by type and place), one line after:
        a bug every call meets would otherwise log a traceback per call."""
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        key = (type(exc).__name__, where)
        if key in self._bugs_seen:
            log.warning("sample %s: unexpected error at %s: %s (traceback logged before)",
                        sample_id, where, brief(exc))
            return
        self._bugs_seen.add(key)
        log.error("sample %s: unexpected error", sample_id, exc_info=exc)

    async def _give_back(self, c: states.Claimed, why: str, call: Call | None = None,
                         job: Any = None) -> Outcome:
        """running → pending after an unexpected error (class ``worker_error``), after the
        job's backoff, so the sample does not wait out its lease; ``NOT_WRITTEN`` if even
        that cannot be written.

        The call counts against ``max_attempts`` (the claim charged it) like any other:
        once they are spent the sample fails as ``worker_error``, so a bug, or a server
        answer that sets one off, every call meets never loops. A sample whose response
        was stored (its claim charges nothing) fails at once: the answer stays, and
        ``requeue`` or ``retokenize`` takes it up again.

        A call that was under way (it may have reached the server, and been paid for)
        gets its attempts row, as every call does, whatever ended it."""
        message = f"unexpected error in the worker: {why}"[:2000]
        attempt = None
        if call is not None and call.calling:
            attempt = states.attempt_row(
                c.sample_id, server=c.server, worker=self.name, started_at=call.started_at,
                ended_at=utcnow(), outcome=WorkerError.error_class, error_message=message,
                latency_s=time.monotonic() - call.started_mono)
        settings = effective(job, c.overrides) if job is not None else None
        delay, retry = 0.0, True
        if settings is not None:
            due = ledger.retry_or_fail(states.SAMPLES, WorkerError(message), c.attempts,
                                       settings)
            retry, delay = due is not None and c.response_content is None, due or 0.0

        def record(s: Any, now: datetime) -> bool:
            if not retry:
                return states.fail(s, c.sample_id, c.token, now=now,
                                   error_class=WorkerError.error_class,
                                   error_message=f"{message} (gave up after {c.attempts} "
                                   "attempts)", attempt=attempt)
            return states.retry(s, c.sample_id, c.token, now=now,
                                next_attempt_at=now + timedelta(seconds=delay),
                                error_class=WorkerError.error_class, error_message=message,
                                attempt=attempt)

        try:
            won = await self.writer.write(record)
        except Exception as exc:  # noqa: BLE001 - the lease is the last line of defence
            if not isinstance(exc, DiskFull):
                log.exception("sample %s: could not hand it back", c.sample_id)
            return Outcome.NOT_WRITTEN
        if not won:
            return Outcome.NOT_WRITTEN
        return Outcome.RETRY if retry else Outcome.FAILED

    def _heartbeat_now(self) -> None:
        """The first heartbeat, before any message can arrive."""
        with_db_retry(self.heartbeat.write, what="worker heartbeat")

    async def _keep_alive(self) -> None:
        interval = get_settings().heartbeat_interval
        while True:
            calls = list(self._calls.values())
            # Renew often enough for the shortest lease (as the samples' kind declares), at
            # most every beat.
            every = states.SAMPLES.renew_every
            step = min([interval, *(every(c.lease_s) for c in calls)])
            await asyncio.sleep(max(0.2, step))
            now_mono = time.monotonic()
            due = [c for c in self._calls.values()
                   if now_mono - c.renewed_at >= every(c.lease_s)]
            if not due:
                continue
            try:
                held = await self.writer.write(self._renewal(due))
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                if not isinstance(exc, DiskFull):  # said once, where it was met
                    log.warning("lease renewal failed: %s", str(exc).splitlines()[0][:200])
                continue
            for call in due:
                call.renewed_at = now_mono
                if call.claimed.sample_id not in held and call.calling:
                    call.lost = True
                    if call.task is not None:
                        call.task.cancel()

    def _renewal(self, due: list[Call]) -> Callable[[Any, datetime], set[int]]:
        by_lease: dict[float, list[tuple[int, str]]] = {}
        for call in due:
            by_lease.setdefault(call.lease_s, []).append(
                (call.claimed.sample_id, call.claimed.token))

        def write(s: Any, now: datetime) -> set[int]:
            held: set[int] = set()
            for lease, items in by_lease.items():
                held |= states.renew_many(s, items, lease_until=now + timedelta(seconds=lease))
            return held

        return write


# -- one per process, for tests and one-off calls --------------------------------------------

_default: Executor | None = None
_default_lock = threading.Lock()


def default_executor() -> Executor:
    """This process's executor for :func:`process_sample` (made once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Executor(capacity=0)
        return _default


def reset_default_executor() -> None:
    """Close the process's default executor (tests do this between tests)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close(timeout=5)
        _default = None


def process_sample(sample_id: int, token: str, *, job_id: int | None = None,
                   worker: str | None = None) -> Outcome:
    """Claim one queued sample and run it to its outcome on this process's executor.

    For tests and one-off use; workers run whole batches (:meth:`Executor.run_batch`).
    """
    del worker  # the executor's own name is the worker's
    return default_executor().run_batch([(sample_id, token, job_id)]).get(
        sample_id, Outcome.STALE)
