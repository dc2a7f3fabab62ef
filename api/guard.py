"""What every request passes through before a route: headers, body limit, database slots.

One plain ASGI middleware (no per-request thread), in this order:

* **Security headers** on every answer: the page may not be framed
  (``X-Frame-Options: DENY``, CSP ``frame-ancestors 'none'``), loads nothing
  from another origin (CSP ``default-src 'self'``), no MIME sniffing.
* **Upload body limit**: an upload whose ``Content-Length`` is over the limit
  is answered 413 before a byte of its body is read; one without (chunked) is
  cut with 413 as soon as the bytes received pass it.
* **Database slots**: at most ``slots`` requests that touch the database run
  at once; the others wait on the event loop (no thread, no connection held)
  and get 503 with ``Retry-After`` if no slot frees within ``wait_s``. With
  ``slots`` no larger than the connection pool, a request never blocks a
  worker thread waiting for a connection that only another request, itself
  waiting for a thread, could give back: the deadlock that made 100
  concurrent ``GET /api/jobs`` fail with 500 after 30 s.
* **Writes**: when a request other than a read ends, ``on_write`` is called
  (the app forgets its shared reads, :mod:`api.coalesce`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Guard", "UPLOAD_PATH", "SECURITY_HEADERS", "BodyTooLarge", "RETRY_AFTER_S",
           "Outage", "outage"]

log = logging.getLogger("synthq.api")

UPLOAD_PATH = "/api/jobs/upload"
#: Seconds a client is told to wait after a 503.
RETRY_AFTER_S = 5
#: Multipart framing and the ``spec`` field, on top of the file itself.
FORM_OVERHEAD = 64 << 10

SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy",
     b"default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
     b"frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]

#: Paths that never touch the database (no slot needed). Any other may, if only to
#: look up a session cookie.
_NO_DB = ("/health",)
#: Methods that change nothing; any other request ends by calling ``on_write``.
_READS = ("GET", "HEAD", "OPTIONS")


class BodyTooLarge(HTTPException):
    """The request body passed the upload limit while it was being read (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"file is over {limit:,} bytes", headers={"Connection": "close"})


def _json(status: int, detail: str, *headers: tuple[bytes, bytes]) -> list[Message]:
    body = json.dumps({"detail": detail}).encode()
    return [{"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), *headers]},
            {"type": "http.response.body", "body": body}]


class Guard:
    """The middleware; ``upload_limit`` is read per request (settings may change)."""

    def __init__(self, app: ASGIApp, *, upload_limit: Callable[[], int], slots: int,
                 wait_s: float = 30.0, on_write: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.on_write = on_write
        self.upload_limit = upload_limit
        self.slots = slots
        self.wait_s = wait_s
        self._sem: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                names = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []),
                                      *(h for h in SECURITY_HEADERS if h[0] not in names)]
            await send(message)

        async def answer(messages: list[Message]) -> None:
            for m in messages:
                await send_with_headers(m)

        path: str = scope["path"]
        if path == UPLOAD_PATH and scope["method"] == "POST":
            cap = self.upload_limit() + FORM_OVERHEAD
            length = _content_length(scope)
            if length is not None and length > cap:
                await answer(_json(413, f"file is over {self.upload_limit():,} bytes",
                                   (b"connection", b"close")))
                return
            receive = _capped(receive, cap, self.upload_limit())
        try:
            if path in _NO_DB or path == "/":
                await self.app(scope, receive, send_with_headers)
                return
            await self._with_slot(scope, receive, send_with_headers, answer)
        except BodyTooLarge:
            if not started:
                await answer(_json(413, f"file is over {self.upload_limit():,} bytes",
                                   (b"connection", b"close")))

    async def _with_slot(self, scope: Scope, receive: Receive, send: Send,
                         answer: Callable[[list[Message]], Awaitable[None]]) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)
        try:
            await asyncio.wait_for(self._sem.acquire(), self.wait_s)
        except TimeoutError:
            await answer(_json(503, "the API is busy; retry later",
                               (b"retry-after", str(RETRY_AFTER_S).encode())))
            return
        status = 500
        write = scope["method"] not in _READS

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if write:
                    # Committed (routes commit before answering): a read the client sends
                    # once it has this answer must not get a result shared from before.
                    self.on_write()
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self._sem.release()
            if write:
                self.on_write()  # and once more at the end, whatever happened
        if status < 500:
            outage.ok()


class Outage:
    """Logs a database outage's cause once, when it starts, and once when it ends."""

    def __init__(self) -> None:
        self.down = False
        self._lock = threading.Lock()

    def failed(self, cause: str) -> None:
        with self._lock:
            if self.down:
                return
            self.down = True
        log.error("database unavailable: %s (answering 503 until it is back)", cause)

    def ok(self) -> None:
        if not self.down:
            return
        with self._lock:
            was, self.down = self.down, False
        if was:
            log.warning("database available again")


#: The process's outage state (the API's exception handlers and /ready report to it).
outage = Outage()


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _capped(receive: Receive, cap: int, limit: int) -> Receive:
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message: dict[str, Any] = dict(await receive())
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise BodyTooLarge(limit)
        return message

    return wrapped
