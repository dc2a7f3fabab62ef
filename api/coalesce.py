"""Identical reads at once share one computation: ``GET /api/jobs`` and ``/metrics``.

A dashboard of 200 browsers, or Prometheus and Grafana polling together, send
the same read many times at once. Each one costs SQL and serialization
(``/metrics`` runs a dozen grouped queries), so 200 of them in one API process
queued for many seconds. Here the first request of a key computes the answer
(in a worker thread) and every identical request arriving while it runs, or
within ``ttl_s`` seconds of its start, gets the same bytes: 200 requests, one
query set and one serialization.

What it does not change:

* **Auth runs per request**: the routes' dependencies (token or session
  cookie) run before a request reaches :meth:`Coalescer.get`. There is one
  token, so every caller let in may read the same thing: the key is the route
  and its query string. A per-caller scope, if one is ever added, belongs in
  the key.
* **A write through this API is seen by the next read**: the app calls
  :meth:`Coalescer.invalidate` when any request other than a read ends, so a
  read after a cancel computes afresh. Changes made elsewhere (workers, the
  CLI) show within ``ttl_s``.
* **Errors are not kept**: a failed computation (database down, pool
  exhausted) is raised to every request that waited for it, each then answered
  by the app's handlers (503), and the next request tries again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Hashable

from starlette.concurrency import run_in_threadpool

__all__ = ["Coalescer", "READ_TTL_S"]

#: Seconds a computed read is shared with later identical requests.
READ_TTL_S = 1.0


class Coalescer:
    def __init__(self, ttl_s: float = READ_TTL_S) -> None:
        self.ttl_s = ttl_s
        #: key -> (monotonic time the computation started, its task)
        self._entries: dict[Hashable, tuple[float, asyncio.Task[bytes]]] = {}

    async def get(self, key: Hashable, compute: Callable[[], bytes]) -> bytes:
        """``compute()``'s result, shared with identical requests (see the module doc)."""
        now = time.monotonic()
        entry = self._entries.get(key)
        if entry is None or (entry[1].done() and now - entry[0] > self.ttl_s):
            self._prune(now)
            task = asyncio.ensure_future(run_in_threadpool(compute))
            entry = self._entries[key] = (now, task)
            task.add_done_callback(functools.partial(self._forget_failed, key))
        # shield: a client that hangs up cancels its own wait, not the shared computation.
        return await asyncio.shield(entry[1])

    def _forget_failed(self, key: Hashable, task: asyncio.Task[bytes]) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[1] is task and (task.cancelled() or task.exception()):
            del self._entries[key]

    def _prune(self, now: float) -> None:
        # Keys carry the query string, which a client may vary: keep only live entries.
        for key, (started, task) in list(self._entries.items()):
            if task.done() and now - started > self.ttl_s:
                del self._entries[key]

    def invalidate(self) -> None:
        """Forget every result: the next read of any key computes afresh."""
        self._entries.clear()
