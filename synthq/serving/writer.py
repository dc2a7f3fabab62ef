"""The per-process batch writer: every finished outcome committed within one transaction.

Workers used to open three short transactions per sample; at a hundred
samples a second that was most of a worker's CPU. Here the event loop hands
each write (an outcome's compare-and-set plus its attempt row, a lease
renewal, a heartbeat) to one writer thread as a function of ``(session,
now)``. The thread takes whatever has queued up, runs it all in one
transaction, commits, and only then resolves each write's future with the
function's result: nothing is acknowledged before its commit. An idle writer
commits at once and a busy one amortises the transaction over everything that
finished meanwhile.

On PostgreSQL a second thread helps (``threads``): once a commit has run for
``HELP_AFTER`` (5 ms), what queued up meanwhile is committed by the helper instead
of waiting for that commit to end. A commit shorter than that never wakes the
helper, so batches stay whole where the machine is fast (splitting every batch
between two threads cost 12-15 % of ``bench/throughput.py``). A commit is a few
milliseconds of CPU but five or more round trips to the database, and on a loaded
machine each round trip waits for a core (the backend's and this thread's): measured
at 2 CPU hogs on 2 cores, a transaction took ~10 ms of wall time for ~2 ms of CPU,
and the wait behind the previous commit was a third of an answer's whole wait
(``bench/commit_wait.py``; the design's bound is 50 ms, and every answer not
committed is paid for again after a ``kill -9``). Writes of one sample are never in
two batches at once (each awaits its commit before the next), and two batches touch
their rows as any two workers' do: each row is a compare-and-set.
SQLite takes one writer at a time anyway (``BEGIN IMMEDIATE``): one thread there.

A database outage does not drop answers in hand: the batch is retried with
backoff (:func:`synthq.core.retry.exponential`, 0.1 s doubling to 5 s) for up
to ``write_retry_seconds`` (the leases outlive that by default, so the rows are
still ours when PostgreSQL returns). A write that fails on its own (bad data, a
bug) is isolated: the batch is replayed one write per transaction and only that
write's future gets the exception.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from datetime import datetime
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session

from synthq.core.errors import DiskFull
from synthq.core.retry import exponential
from synthq.queue.ledger import Move
from synthq.store.db import database_location, disk_full, session_scope, utcnow

__all__ = ["Writer", "Write"]

log = logging.getLogger(__name__)

#: One write: runs inside the batch's transaction; its return value resolves the future.
Write = Callable[[Session, datetime], Any]


def _sqlite() -> bool:
    from synthq.spec.config import get_settings

    return get_settings().database_url.startswith("sqlite")


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated)


def _run_writes(session: Session, writes: list[Write], now: datetime) -> list[Any]:
    """Run a batch's writes in order; the moves among them of one shape (synthq.queue.ledger.Move:
    the answers' compare-and-sets) as one statement, where the first of them stands."""
    moves: dict[Any, list[tuple[int, Move]]] = {}
    for i, w in enumerate(writes):
        if isinstance(w, Move):
            moves.setdefault(w.shape, []).append((i, w))
    if not any(len(group) > 1 for group in moves.values()):
        return [w(session, now) for w in writes]
    results: dict[int, Any] = {}
    for i, w in enumerate(writes):
        if i in results:
            continue
        if isinstance(w, Move):
            group = moves[w.shape]
            merged = Move.run_merged(session, [m for _, m in group], now)
            results.update(zip([j for j, _ in group], merged, strict=True))
        else:
            results[i] = w(session, now)
    return [results[i] for i in range(len(writes))]


def _resolve(future: Future[Any], result: Any = None, *,
             exc: BaseException | None = None) -> None:
    """Hand a write's result to whoever waits, unless they stopped waiting (a cancelled
    await: the write itself is committed or failed all the same)."""
    if future.cancelled():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled meanwhile
        pass


class Writer:
    """One thread that commits batches of writes (and, on PostgreSQL, a second one that
    helps while a commit runs long); :meth:`submit` from any thread."""

    #: Seconds a commit runs before the helper commits what queued up meanwhile.
    HELP_AFTER = 0.005

    def __init__(self, *, retry_seconds: float = 600.0, max_batch: int = 1000,
                 disk_full_level: int = logging.ERROR, threads: int | None = None) -> None:
        self.retry_seconds = retry_seconds
        #: Level of the one line a full disk logs (the embedded runner says it itself).
        self.disk_full_level = disk_full_level
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[tuple[Write, Future[Any]] | None] = queue.SimpleQueue()
        #: Monotonic time each answer's write was due from (its answer's arrival), by its
        #: future; and the seconds each waited for its commit (the last 100,000). A
        #: kill -9 loses every answer in that window, to be paid for again.
        self._since: dict[Future[Any], float] = {}
        self.commit_waits: deque[float] = deque(maxlen=100_000)
        #: Transactions committed and writes in them (for benchmarks and tests).
        self.commits = 0
        self.writes = 0
        self._count_lock = threading.Lock()
        if threads is None:
            threads = 1 if _sqlite() else 2
        #: Commits under way, a count of those begun, set while one runs (for the helper).
        self._busy = 0
        self._busy_gen = 0
        self._busy_lock = threading.Lock()
        self._busy_event = threading.Event()
        self._stop_help = threading.Event()
        self._threads = [threading.Thread(target=self._run, name="synthq-writer", daemon=True)]
        if threads > 1:
            self._threads.append(threading.Thread(target=self._help, name="synthq-writer-help",
                                                  daemon=True))
        #: While the database's disk is full: the error's first line (writes wait in memory).
        self.disk_full: str | None = None
        self._abandoned = threading.Event()
        for thread in self._threads:
            thread.start()

    def submit(self, write: Write, *, since: float | None = None) -> Future[Any]:
        """Queue ``write``; ``since``: the monotonic time an answer it makes durable arrived
        (its wait for the commit is measured from there, :meth:`wait_figures`)."""
        future: Future[Any] = Future()
        if since is not None:
            self._since[future] = since
        self._queue.put((write, future))
        return future

    async def write(self, write: Write, *, since: float | None = None) -> Any:
        """Submit from the event loop and wait for the commit."""
        return await asyncio.wrap_future(self.submit(write, since=since))

    def wait_figures(self) -> dict[str, float]:
        """How long answers waited for their commit: count, median, p95, p99, max (ms)."""
        waits = sorted(self.commit_waits)
        if not waits:
            return {"answers": 0}

        def at(q: float) -> float:
            return round(1000 * waits[min(len(waits) - 1, int(q * len(waits)))], 1)

        return {"answers": len(waits), "p50_ms": at(0.5), "p95_ms": at(0.95),
                "p99_ms": at(0.99), "max_ms": round(1000 * waits[-1], 1)}

    def abandon(self) -> None:
        """Stop holding writes for a full disk: they fail now (the process is stopping,
        and the samples' leases, or the next run, bring them back)."""
        self._abandoned.set()

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop the threads."""
        self._stop_help.set()
        self._busy_event.set()  # wakes the helper, which then stops
        self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch, stopping = self._drain([first])
            with self._busy_lock:
                self._busy += 1
                self._busy_gen += 1
                self._busy_event.set()
            try:
                self._commit_guarded(batch)
            finally:
                with self._busy_lock:
                    self._busy -= 1
                    if not self._busy:
                        self._busy_event.clear()

    def _help(self) -> None:
        """The second thread: while a commit has run for ``HELP_AFTER`` seconds, commit what
        queued up meanwhile (it would wait for that commit to end). A commit shorter than
        that (an idle or a fast machine) never wakes it: the batches stay whole."""
        while not self._stop_help.is_set():
            self._busy_event.wait()
            if self._stop_help.is_set():
                return
            gen = self._busy_gen
            time.sleep(self.HELP_AFTER)
            with self._busy_lock:
                still = self._busy and self._busy_gen == gen
            if not still:
                continue
            try:
                first = self._queue.get_nowait()
            except queue.Empty:
                time.sleep(self.HELP_AFTER)  # nothing waits: look again a moment later
                continue
            if first is None:  # the main thread's stop: hand it back
                self._queue.put(None)
                continue
            batch, stopping = self._drain([first])
            if stopping:
                self._queue.put(None)
            self._commit_guarded(batch)

    def _drain(self, batch: list[tuple[Write, Future[Any]]]
               ) -> tuple[list[tuple[Write, Future[Any]]], bool]:
        """``batch`` plus whatever is queued (up to ``max_batch``); True when a stop came."""
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _commit_guarded(self, batch: list[tuple[Write, Future[Any]]]) -> None:
        try:
            self._commit(batch)
        except Exception as exc:  # a bug: fail this batch's writes, keep the thread
            log.exception("writer: batch of %d writes failed", len(batch))
            for _, future in batch:
                self._fail(future, exc)

    def _commit(self, batch: list[tuple[Write, Future[Any]]]) -> None:
        deadline = time.monotonic() + self.retry_seconds
        tries = 0
        while True:
            try:
                results = self._transaction([w for w, _ in batch])
            except Exception as exc:  # noqa: BLE001 - classified below
                full = disk_full(exc)
                if full:
                    # Not transient, but the answers in hand are kept until space returns
                    # (or the process stops): one line when it starts, not one per try.
                    if self.disk_full is None:
                        log.log(self.disk_full_level, "writer: the database's disk is full "
                                "(%s); holding %d writes in memory until space returns",
                                str(exc).splitlines()[0][:200], len(batch))
                    self.disk_full = str(exc).splitlines()[0][:500]
                    if self._abandoned.is_set():
                        error = DiskFull(database_location())
                        error.__cause__ = exc
                        for _, future in batch:
                            self._fail(future, error)
                        return
                elif not _transient(exc):
                    self._one_by_one(batch)
                    return
                if time.monotonic() > deadline:
                    log.error("writer: database unreachable for %.0f s; dropping %d writes",
                              self.retry_seconds, len(batch))
                    for _, future in batch:
                        self._fail(future, exc)
                    return
                tries += 1
                # The one backoff curve, without jitter: 0.1 s doubling to 5 s.
                delay = exponential(tries, base=0.1, cap=5.0)
                if not full:
                    log.warning("writer: transient database error (%s); retrying %d writes "
                                "in %.1f s", str(exc).splitlines()[0][:200], len(batch), delay)
                self._abandoned.wait(delay)
                continue
            if self.disk_full is not None:
                log.log(self.disk_full_level, "writer: the database accepts writes again")
                self.disk_full = None
            self._counted(len(batch))
            self._measure(batch)
            for (_, future), result in zip(batch, results, strict=True):
                _resolve(future, result)
            return

    def _counted(self, writes: int) -> None:
        with self._count_lock:
            self.commits += 1
            self.writes += writes

    def _fail(self, future: Future[Any], exc: BaseException) -> None:
        self._since.pop(future, None)
        _resolve(future, exc=exc)

    def _measure(self, batch: list[tuple[Write, Future[Any]]]) -> None:
        """Each answer's wait for its commit, just committed."""
        if not self._since:
            return
        now = time.monotonic()
        for _, future in batch:
            since = self._since.pop(future, None)
            if since is not None:
                self.commit_waits.append(now - since)

    @staticmethod
    def _transaction(writes: list[Write]) -> list[Any]:
        now = utcnow()
        with session_scope() as s:
            return _run_writes(s, writes, now)

    def _one_by_one(self, batch: list[tuple[Write, Future[Any]]]) -> None:
        """Isolate the write that breaks the batch: each in its own transaction."""
        for write, future in batch:
            try:
                result = self._transaction([write])
            except Exception as exc:  # noqa: BLE001 - handed to the write's owner
                if _transient(exc):  # the database went away meanwhile: the normal path
                    self._commit([(write, future)])
                    continue
                self._fail(future, exc)
            else:
                self._counted(1)
                self._measure([(write, future)])
                _resolve(future, result[0])
