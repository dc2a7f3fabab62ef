"""A total deadline for one synchronous HTTP call: headers and body within so many
seconds in all, however slowly a server trickles them.

httpx's sync timeouts bound each socket operation, not a call: a server that sends one
byte every 2 s resets a 120 s read timeout for ever (issue 41: a capture call that never
ended; its lease expired and the same process sent the capture again). So each call's
socket, taken from httpcore's ``trace`` extension as it connects, is watched by one
thread (:class:`Watchdog`) that shuts it down at the deadline: the read that waits ends
at once, and :func:`bounded` raises :class:`httpx.ReadTimeout`, which callers already
class as ``timeout``. Each socket operation waits at most the time left as well.

The client must open a connection per call (``Limits(max_keepalive_connections=0)``,
:func:`client`): a pooled connection makes no ``connect`` event, so its socket could
not be watched before the answer's headers.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

__all__ = ["Watchdog", "bounded", "client", "CONNECT_S"]

#: Seconds a connect may take at most (less when less is left).
CONNECT_S = 10.0


class _Watch:
    """One call's socket and deadline; ``fired`` once the watchdog cut it."""

    __slots__ = ("deadline", "sock", "fired", "done")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.sock: socket.socket | None = None
        self.fired = False
        self.done = False


class Watchdog:
    """One daemon thread that shuts each watched socket down at its deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Watch]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, watch: _Watch, sock: socket.socket) -> None:
        """Cut ``sock`` at ``watch.deadline`` unless the call is over by then."""
        with self._cond:
            watch.sock = sock
            heapq.heappush(self._heap, (watch.deadline, next(self._order), watch))
            if self._thread is None or not self._thread.is_alive():  # first, or forked
                self._thread = threading.Thread(target=self._run, name="synthq-deadline",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        if time.monotonic() >= watch.deadline:
            self._cut(watch)

    def done(self, watch: _Watch) -> None:
        """The call is over: its socket is not cut (the heap drops it in time)."""
        with self._cond:
            watch.done = True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _, _, watch = heapq.heappop(self._heap)
            self._cut(watch)

    def _cut(self, watch: _Watch) -> None:
        with self._cond:
            if watch.done or watch.fired or watch.sock is None:
                return
            watch.fired = True
            sock = watch.sock
        # Wakes a read blocked on it in another thread (EOF there); a socket closed by
        # then raises here, and nothing else is touched (a closed socket has no fd).
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG = Watchdog()


def client(**kwargs: Any) -> httpx.Client:
    """An httpx client whose calls :func:`bounded` can watch: a connection per call."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), **kwargs)


@contextlib.contextmanager
def bounded(http: httpx.Client, method: str, url: str, *, deadline: float,
            **kwargs: Any) -> Iterator[httpx.Response]:
    """``http.stream(method, url, ...)`` that ends by ``deadline`` (``time.monotonic()``)
    in all: past it, :class:`httpx.ReadTimeout` (whatever the cut made the reader see)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise httpx.ReadTimeout("no time left of the call's total deadline")
    watch = _Watch(deadline)
    trace = _tracer(watch, kwargs.pop("extensions", {}).get("trace"))
    timeout = httpx.Timeout(left, connect=min(CONNECT_S, left))
    expired = f"over its total deadline of {left:.3g} s"
    try:
        with http.stream(method, url, timeout=timeout, extensions={"trace": trace},
                         **kwargs) as response:
            if watch.sock is None:  # a pooled connection after all: watch it from here
                stream = response.extensions.get("network_stream")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if sock is not None:
                    _WATCHDOG.watch(watch, sock)
            yield response
    except Exception as exc:
        if watch.fired or time.monotonic() >= deadline:
            raise httpx.ReadTimeout(expired) from exc
        raise
    finally:
        _WATCHDOG.done(watch)
    if watch.fired:  # a body the cut ended early may have looked complete
        raise httpx.ReadTimeout(expired)


def _tracer(watch: _Watch, inner: Callable[[str, dict[str, Any]], None] | None
            ) -> Callable[[str, dict[str, Any]], None]:
    def trace(event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                _WATCHDOG.watch(watch, sock)
        if inner is not None:
            inner(event, info)
    return trace
