"""Capture servers that misbehave on purpose (issue 41), on real sockets: one that
trickles its answer a byte at a time, one that answers 500 to every capture, one that
answers a path of its choosing and plants a symlink there as it answers.

Each connection runs in its own thread; :meth:`HostileServer.close` ends them all (a
trickle stops at once), so a client that never gives up is released at the test's end.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["HostileServer", "Request"]


class Request:
    """What a connection asked: method, path, JSON body (or None)."""

    def __init__(self, method: str, path: str, body: Any) -> None:
        self.method, self.path, self.body = method, path, body


def _read_request(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == "content-length":
            length = int(value)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return Request(method, path, json.loads(rest) if rest else None)


def answer(conn: socket.socket, obj: Any, status: str = "200 OK") -> None:
    body = json.dumps(obj).encode()
    conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


def describe_or(handle: Callable[[HostileServer, socket.socket, Request], None]
                ) -> Callable[[HostileServer, socket.socket, Request], None]:
    """``handle`` for the capture calls; /models and /version answered as vLLM does."""
    def run(server: HostileServer, conn: socket.socket, req: Request) -> None:
        if req.method == "GET" and req.path.endswith("/models"):
            answer(conn, {"data": [{"id": "hostile"}]})
        elif req.method == "GET":
            answer(conn, {"version": "hostile"})
        else:
            handle(server, conn, req)
    return run


class HostileServer:
    """A TCP server that hands each request to ``handle(server, conn, request)``."""

    def __init__(self, handle: Callable[[HostileServer, socket.socket, Request], None]) -> None:
        self.handle = handle
        self.stop = threading.Event()
        self.lock = threading.Lock()
        #: Requests by method ("GET", "POST").
        self.requests: dict[str, int] = {}
        self._conns: list[socket.socket] = []
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self.lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            req = _read_request(conn)
            if req is None:
                return
            with self.lock:
                self.requests[req.method] = self.requests.get(req.method, 0) + 1
            self.handle(self, conn, req)
        except OSError:
            pass
        finally:
            conn.close()

    def trickle(self, conn: socket.socket, data: bytes, every: float) -> None:
        """``data`` a byte at a time, one every ``every`` seconds, until closed."""
        for i in range(len(data)):
            if self.stop.wait(every):
                return
            conn.sendall(data[i:i + 1])

    def close(self) -> None:
        self.stop.set()
        self._sock.close()
        with self.lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
