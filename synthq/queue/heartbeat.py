"""A generation process's heartbeat: its own thread, its own connection, a short deadline.

The beat's sweep counts a worker dead when its ``workers`` row has not been written
for ``worker_timeout`` seconds, and hands its running samples to others. The
heartbeat used to be one more write of the batch writer: when the writer's
connection was stranded (a proxy stopped forwarding, nothing closed), the heartbeat
waited behind it for the writer's whole answer deadline (25 s by default, past the
15 s timeout) while the worker kept calling and answering. The sweep then gave away
every sample of a working worker, and each was paid twice (issue 30: 160 of 300).

So the heartbeat writes on a connection of its own (:func:`synthq.store.db.heartbeat_engine`)
whose every answer is awaited at most :func:`heartbeat_timeout` seconds; a stranded
one is dropped and the next beat, a moment later, connects again. And a worker whose
heartbeat has not been written for :func:`stale_after` seconds (half the timeout: the
sweep may give its samples away soon) starts no call (:meth:`Heartbeat.fresh`); the
calls already under way go on, and their answers are kept if no later attempt has
finished (:func:`synthq.queue.states.keep_late`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from synthq.queue import workers
from synthq.spec.config import Settings, get_settings
from synthq.store.db import heartbeat_engine, session_scope

__all__ = ["Heartbeat", "heartbeat_timeout", "stale_after"]

log = logging.getLogger(__name__)


def heartbeat_timeout(settings: Settings) -> float:
    """Seconds one heartbeat may wait for the database: ``heartbeat_timeout``, or (0) a
    fifth of ``worker_timeout`` (3 s by default), at least 0.5 s."""
    if settings.heartbeat_timeout > 0:
        return settings.heartbeat_timeout
    return max(0.5, settings.worker_timeout / 5)


def stale_after(settings: Settings) -> float:
    """Seconds since its last written heartbeat after which a worker starts no call: half
    of ``worker_timeout`` (7.5 s by default), never less than two beats."""
    return max(settings.worker_timeout / 2, 2 * settings.heartbeat_interval)


class Heartbeat:
    """Writes the process's ``workers`` row every ``heartbeat_interval`` seconds from a
    thread of its own; :meth:`fresh` says whether the last one is recent enough."""

    def __init__(self, name: str, *, capacity: Callable[[], int],
                 inflight: Callable[[], int]) -> None:
        settings = get_settings()
        self.name = name
        self.interval = settings.heartbeat_interval
        self.timeout = heartbeat_timeout(settings)
        self.limit = stale_after(settings)
        self._capacity = capacity
        self._inflight = inflight
        #: Monotonic time of the last heartbeat committed (0: none yet).
        self.written_at = 0.0
        #: Beats that failed since the last one written (the first is logged).
        self.failures = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="synthq-heartbeat",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Beat now (the capacity changed)."""
        self._wake.set()

    def age(self) -> float:
        """Seconds since the last heartbeat was written."""
        return time.monotonic() - self.written_at

    def fresh(self) -> bool:
        """Whether the last heartbeat is recent enough for this worker to start a call."""
        return self.age() <= self.limit

    def write(self) -> None:
        """Write the row once (raises what the database raised)."""
        with session_scope(heartbeat_engine(self.timeout)) as s:
            # The database's time once connected: the first beat may be the first
            # connection, which is what sets synthq's clock (workers.heartbeat).
            workers.heartbeat(s, self.name, capacity=self._capacity(),
                              inflight=self._inflight())
        self.written_at = time.monotonic()

    def beat(self) -> bool:
        """Write the row once; True when committed. Never raises."""
        try:
            self.write()
        except Exception as exc:  # noqa: BLE001 - the next beat, on a fresh connection
            self.failures += 1
            if self.failures == 1:
                log.warning("worker heartbeat failed (%s); trying again on a fresh connection",
                            str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            return False
        if self.failures:
            log.warning("worker heartbeat written again after %d failed tries (%.1f s)",
                        self.failures, self.age())
        self.failures = 0
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            # After a failure, try again soon (the strand is over once we reconnect).
            self._wake.wait(self.interval if not self.failures else min(self.interval, 0.2))
            self._wake.clear()
            if self._stop.is_set():
                return
            self.beat()
