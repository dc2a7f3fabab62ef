"""An asyncio-protocol network backend for the HTTP client (``httpcore2``).

A streamed generation arrives one small chunk per token, and every chunk is a
socket read. The default backend goes through anyio, which pauses and resumes
the socket's reader on every read (two selector system calls) and builds a
cancel scope per read: about 70 µs of CPU per chunk here, most of a worker's
time at 30,000 chunks a second. This backend keeps the socket readable and
buffers what arrives in an :class:`asyncio.Protocol`; a read takes what is
buffered or waits for the next ``data_received``. The HTTP parsing, pooling,
timeouts-as-exceptions and TLS stay httpcore's and asyncio's.

Every body read from a server that synthq does not keep (an error answer, a
health probe, ``/v1/models``, ``/metrics``) goes through :func:`read_bounded`
or :func:`get_bounded`: at most so many bytes, within so many seconds in all.
A server answering a 500 with a 3 GB body, or a ``/metrics`` page that never
ends, costs a few hundred kilobytes and a few seconds, never the process's memory.

A streamed answer's chunked body is read by :func:`chunked_body`: the data chunks
are unframed here, a socket read at a time, instead of one h11 event (and one
trip through httpcore's layers) per chunk; the last chunk and its trailers are
handed back to h11, so the connection ends its response in h11's own state.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
import httpcore2
from httpcore2._backends.base import AsyncNetworkBackend, AsyncNetworkStream

if TYPE_CHECKING:
    import httpx

__all__ = ["AsyncioBackend", "install", "chunked_body", "Body", "read_bounded", "get_bounded"]

#: Stop reading from the socket while this much is buffered and unread.
_HIGH_WATER = 1 << 20


class _Protocol(asyncio.Protocol):
    __slots__ = ("transport", "buffer", "waiter", "eof", "error", "paused", "deadline", "timer")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.eof = False
        self.error: BaseException | None = None
        self.paused = False
        #: When the waiting read times out (the loop's clock), or None: no timeout.
        self.deadline: float | None = None
        #: The one timer that checks ``deadline``; a read that waits moves the deadline,
        #: not the timer (one timer a timeout period, not one per read).
        self.timer: asyncio.TimerHandle | None = None

    def check_deadline(self) -> None:
        self.timer = None
        waiter, deadline = self.waiter, self.deadline
        if waiter is None or waiter.done() or deadline is None:
            return  # no read waits now: the next one that does sets a timer
        loop = waiter.get_loop()
        if loop.time() >= deadline:
            waiter.set_exception(TimeoutError())
        else:  # a later read moved the deadline
            self.timer = loop.call_at(deadline, self.check_deadline)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()


class _Stream(AsyncNetworkStream):
    def __init__(self, protocol: _Protocol) -> None:
        self._p = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._p
        if not p.buffer and not p.eof:
            # A bare future and a deadline: asyncio.timeout(), or a timer per read, costs
            # more (a stream reads every few milliseconds; its timeout is seconds).
            loop = asyncio.get_running_loop()
            waiter = p.waiter = loop.create_future()
            if timeout is None:
                p.deadline = None
            else:
                p.deadline = deadline = loop.time() + timeout
                timer = p.timer
                if timer is None or timer.when() > deadline:
                    if timer is not None:
                        timer.cancel()
                    p.timer = loop.call_at(deadline, p.check_deadline)
            try:
                await waiter
            except TimeoutError as exc:
                raise httpcore2.ReadTimeout(f"no data for {timeout} s") from exc
            finally:
                p.waiter = None
        if p.buffer:
            data = bytes(p.buffer[:max_bytes])
            del p.buffer[:max_bytes]
            if p.paused and len(p.buffer) < _HIGH_WATER // 2 and p.transport is not None:
                p.transport.resume_reading()
                p.paused = False
            return data
        if p.error is not None:
            raise httpcore2.ReadError(str(p.error) or type(p.error).__name__)
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        transport = self._p.transport
        if transport is None or transport.is_closing():
            raise httpcore2.WriteError("the connection is closed")
        # Requests are small: the transport buffers them without flow control.
        transport.write(buffer)

    async def aclose(self) -> None:
        if self._p.timer is not None:
            self._p.timer.cancel()
            self._p.timer = None
        if self._p.transport is not None:
            self._p.transport.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        assert self._p.transport is not None
        try:
            async with asyncio.timeout(timeout):
                transport = await loop.start_tls(self._p.transport, self._p, ssl_context,
                                                 server_hostname=server_hostname)
        except TimeoutError as exc:
            raise httpcore2.ConnectTimeout("TLS handshake timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            raise httpcore2.ConnectError(str(exc)) from exc
        self._p.transport = transport  # type: ignore[assignment]
        return self

    def get_extra_info(self, info: str) -> Any:
        p, transport = self._p, self._p.transport
        if info == "is_readable":  # an idle keep-alive connection the server closed
            return p.eof or bool(p.buffer)
        if transport is None:
            return None
        name = {"ssl_object": "ssl_object", "client_addr": "sockname",
                "server_addr": "peername", "socket": "socket"}.get(info)
        return transport.get_extra_info(name) if name else None


class AsyncioBackend(AsyncNetworkBackend):
    """Plain asyncio TCP (and TLS) connections for httpcore2's async pool."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    _Protocol, host, port,
                    local_addr=(local_address, 0) if local_address else None)
        except TimeoutError as exc:
            raise httpcore2.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise httpcore2.ConnectError(str(exc)) from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return _Stream(protocol)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, protocol = await loop.create_unix_connection(_Protocol, path)
        except TimeoutError as exc:
            raise httpcore2.ConnectTimeout(f"connecting to {path} timed out") from exc
        except OSError as exc:
            raise httpcore2.ConnectError(str(exc)) from exc
        return _Stream(protocol)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def install(transport: Any) -> bool:
    """Use :class:`AsyncioBackend` in an ``httpx2.AsyncHTTPTransport``'s pool.

    Returns False (and leaves the default backend) if the pool is not the
    plain connection pool this was written against (a proxy, another version).
    """
    pool = getattr(transport, "_pool", None)
    if not isinstance(pool, httpcore2.AsyncConnectionPool) or \
            not hasattr(pool, "_network_backend"):
        return False
    pool._network_backend = AsyncioBackend()
    return True


# -- a chunked body, unframed a read at a time -----------------------------------------------

#: A chunk's size line, as h11 takes it (``chunk_header`` in ``h11._abnf``): up to 20 hex
#: digits, extensions ignored, trailing blanks allowed.
_CHUNK_HEADER = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
#: A size line longer than this (without its CRLF) is not one.
_MAX_HEADER_LINE = 4096
#: Bytes taken from the socket per read.
_READ = 1 << 20


def chunked_body(stream: Any) -> AsyncIterator[bytes] | None:
    """The body of an HTTP/1.1 response in ``Transfer-Encoding: chunked``, unframed here.

    ``stream`` is httpcore2's ``HTTP11ConnectionByteStream`` of a response whose body
    nothing has read yet, on a connection of :class:`AsyncioBackend`. Each item is
    everything the socket had (the data of one or many chunks); the read timeout is
    the request's. The zero-size last chunk and the trailers go to the connection's
    h11 state, which parses them and ends the response as it would have, so a
    keep-alive connection is reused and a malformed end fails as before.

    Returns None when the response is not such a one (another transfer coding, another
    backend, other versions' internals): the caller reads the body the usual way.
    Errors are httpcore2's (``ReadTimeout``, ``ReadError``, ``RemoteProtocolError``).
    """
    connection = getattr(stream, "_connection", None)
    state = getattr(connection, "_h11_state", None)
    network = getattr(connection, "_network_stream", None)
    request = getattr(stream, "_request", None)
    if type(network) is not _Stream or type(state) is not h11.Connection or request is None:
        return None
    reader = getattr(state, "_reader", None)
    buffer = getattr(state, "_receive_buffer", None)
    if state.their_state is not h11.SEND_BODY or type(reader).__name__ != "ChunkedReader" \
            or getattr(reader, "_bytes_in_chunk", 1) != 0 \
            or getattr(reader, "_bytes_to_discard", b"x") != b"" \
            or getattr(reader, "_reading_trailer", True) is not False \
            or buffer is None or getattr(state, "_receive_buffer_closed", True):
        return None
    timeout = (request.extensions.get("timeout") or {}).get("read")
    # What h11 read past the headers is the body's start: it is taken from h11 here.
    start = bytes(buffer)
    state._receive_buffer = type(buffer)()
    return _unchunk(state, network, start, timeout)


async def _unchunk(state: h11.Connection, network: _Stream, data: bytes,
                   timeout: float | None) -> AsyncIterator[bytes]:
    buf = data
    pos = 0
    left = 0  # bytes of the current chunk's data still to come
    crlf = False  # the CRLF after a chunk's data is due
    while True:
        out: list[bytes] = []
        end = len(buf)
        while True:
            if left:
                take = min(left, end - pos)
                if take:
                    out.append(buf[pos:pos + take])
                    pos += take
                    left -= take
                if left:
                    break
                crlf = True
            if crlf:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise httpcore2.RemoteProtocolError(
                        f"malformed chunk footer: {buf[pos:pos + 2]!r} (expected b'\\r\\n')")
                pos += 2
                crlf = False
            line_end = buf.find(b"\r\n", pos, pos + _MAX_HEADER_LINE + 2)
            if line_end < 0:
                if end - pos > _MAX_HEADER_LINE:
                    raise httpcore2.RemoteProtocolError(
                        f"illegal chunk header: {buf[pos:pos + 40]!r}...")
                break
            match = _CHUNK_HEADER.fullmatch(buf, pos, line_end + 2)
            if match is None:
                raise httpcore2.RemoteProtocolError(
                    f"illegal chunk header: {buf[pos:line_end + 2][:80]!r}")
            size = int(match.group(1), 16)
            if size == 0:
                # The last chunk: h11 reads the trailers and ends the response.
                if out:
                    yield b"".join(out)
                await _finish(state, network, buf[pos:], timeout)
                return
            pos = line_end + 2
            left = size
        if out:
            yield out[0] if len(out) == 1 else b"".join(out)
        more = await network.read(_READ, timeout)
        if not more:
            raise httpcore2.RemoteProtocolError(
                "peer closed connection without sending complete message body "
                "(incomplete chunked read)")
        buf = buf[pos:] + more if pos < len(buf) else more
        pos = 0


async def _finish(state: h11.Connection, network: _Stream, rest: bytes,
                  timeout: float | None) -> None:
    """Hand the last chunk (and what follows it) to h11, and read on until it ends."""
    state.receive_data(rest)
    while True:
        try:
            event = state.next_event()
        except h11.RemoteProtocolError as exc:
            raise httpcore2.RemoteProtocolError(str(exc)) from exc
        if event is h11.NEED_DATA:
            state.receive_data(await network.read(_READ, timeout))
            continue
        if type(event) is h11.EndOfMessage or event is h11.PAUSED:
            return
        raise httpcore2.RemoteProtocolError(f"unexpected {type(event).__name__} after the "
                                            "last chunk")


# -- bounded reads ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Body:
    """What a bounded read got: the status, the bytes, and whether that was all of it."""

    status: int
    data: bytes
    #: False when the byte cap or the deadline cut the body short.
    complete: bool

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


class _Parts:
    """Bytes gathered up to a cap (what passes it is dropped, not kept)."""

    __slots__ = ("parts", "seen", "cap")

    def __init__(self, cap: int) -> None:
        self.parts: list[bytes] = []
        self.seen = 0
        self.cap = cap

    def add(self, data: bytes) -> bool:
        """Keep ``data`` (up to the cap); False once the cap is reached."""
        room = self.cap - self.seen
        if len(data) > room:
            self.parts.append(data[:room])
            self.seen = self.cap
            return False
        self.parts.append(data)
        self.seen += len(data)
        return True

    def data(self) -> bytes:
        return b"".join(self.parts)


async def read_bounded(chunks: AsyncIterator[bytes], *, max_bytes: int,
                       seconds: float) -> tuple[bytes, bool]:
    """At most ``max_bytes`` of ``chunks``, read for at most ``seconds`` in all.

    Returns the bytes and whether the body ended within both bounds. The caller
    closes the response: an unread rest closes its connection (nothing drains it).
    A read timeout of the transport still ends a read that waits too long.
    """
    got = _Parts(max_bytes)
    complete = False
    try:
        async with asyncio.timeout(seconds):
            async for data in chunks:
                if not got.add(data):
                    break
            else:
                complete = True
    except TimeoutError:
        pass
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # an async generator left mid-body: end it now, not at GC
            await close()
    return got.data(), complete


def get_bounded(client: httpx.Client, url: str, *, max_bytes: int, seconds: float) -> Body:
    """``GET url`` with a body of at most ``max_bytes``, read for at most ``seconds``
    in all (each socket read waits at most ``seconds`` too); raises
    :class:`httpx.HTTPError` as ``client.get`` does when the server cannot be reached.

    A sync client has no total timeout of its own: the deadline is checked between
    chunks, so a body that never ends, or trickles, stops within about ``seconds``
    plus one read timeout.
    """
    deadline = time.monotonic() + seconds
    got = _Parts(max_bytes)
    complete = False
    # identity: a compressed body would be capped only after decoding, chunk by chunk.
    with client.stream("GET", url, timeout=seconds,
                       headers={"Accept-Encoding": "identity"}) as response:
        for data in response.iter_bytes():
            if not got.add(data) or time.monotonic() > deadline:
                break
        else:
            complete = True
    return Body(response.status_code, got.data(), complete)
