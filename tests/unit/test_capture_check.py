"""Issue 41 item 6: the check of a new job's capture servers (synthq.capture.stage.
check_answer, what ``POST /api/jobs`` asks) against a server that trickles ``/models`` a
byte at a time: 40 checks at once end within the check's total deadline, the server
sees one of them, and the next ones are answered from its result at once."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hostile_capture import HostileServer, Request

from synthq.capture import stage
from synthq.core.errors import UserError


def _trickle_models(server: HostileServer, conn: socket.socket, req: Request) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n")
    server.trickle(conn, b" " * 100_000, 0.2)


def _check_all(url: str, n: int, within: float, server: HostileServer) -> list[object]:
    out: list[object] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            got: object = stage.check_answer([url])
        except Exception as exc:  # noqa: BLE001 - collected for the test thread
            got = exc
        with lock:
            out.append(got)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    ends = time.monotonic() + within
    for t in threads:
        t.join(max(0.0, ends - time.monotonic()))
    if any(t.is_alive() for t in threads):
        server.close()  # releases the checks that never give up
        pytest.fail(f"{sum(t.is_alive() for t in threads)} of {n} checks still ran after "
                    f"{within:g} s")
    return out


def test_forty_checks_of_a_trickling_server_end_within_the_deadline() -> None:
    server = HostileServer(_trickle_models)
    try:
        started = time.monotonic()
        out = _check_all(server.url, 40, 15, server)
        took = time.monotonic() - started
        again = time.monotonic()
        more = _check_all(server.url, 40, 2, server)  # within CHECK_KEEP_S: its result
        took_again = time.monotonic() - again
    finally:
        server.close()
    print(f"\n40 checks of a trickling capture server: {took:.1f} s, "
          f"{server.requests.get('GET')} GETs; 40 more: {took_again:.2f} s")
    assert all(isinstance(e, UserError) for e in out + more), out + more
    assert all("does not list a model" in str(e) or "did not answer" in str(e)
               for e in out), out
    assert took < 8, took  # stage.CHECK_SECONDS (5 s) in all, and some slack
    assert server.requests.get("GET") == 1  # one check at a time, its result shared
    assert took_again < 1, took_again
