"""A TCP proxy the tests own, that can strand its connections (issue 24, items 12-13).

``strand()`` makes every connection open at that moment stop forwarding, in both
directions, without closing either side: each end's kernel still acknowledges
every packet (the proxy's sockets are alive), so the client's TCP keepalives see a
healthy connection while no answer will ever come. That is a half-open path as a
NAT, a load balancer or a proxy that lost its upstream leaves it. Connections made
after the strand pass normally ("old connections silently dead, new ones pass").
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Collection
from typing import Any

__all__ = ["StrandingProxy"]


class _Conn:
    def __init__(self) -> None:
        self.stranded = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        #: The local port of the proxy's connection to the target (what the target's
        #: server sees as the client's port: PostgreSQL's ``pg_stat_activity.client_port``).
        self.upstream_port = 0


class StrandingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; runs its own event loop thread."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.loop = asyncio.new_event_loop()
        self._conns: list[_Conn] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name="halfopen-proxy",
                                        daemon=True)
        self._thread.start()
        self._server: asyncio.Server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop).result(10)
        sock: socket.socket = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])
        #: Connections accepted in all, and stranded by :meth:`strand`.
        self.accepted = 0
        self.stranded = 0

    def url_for(self, url: str) -> str:
        """``url`` (``scheme://user@host:port/...``) with its host and port replaced by
        this proxy's."""
        head, _, rest = url.partition("://")
        auth, _, hostpath = rest.rpartition("@")
        _, _, path = hostpath.partition("/")
        return f"{head}://{auth + '@' if auth else ''}127.0.0.1:{self.port}/{path}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn()
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        conn.writers = [writer, up_writer]
        conn.upstream_port = int(up_writer.get_extra_info("sockname")[1])
        self._conns.append(conn)
        # Cancelled at close(): ended quietly (asyncio would log the cancelled handler).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._pump(reader, up_writer, conn),
                                 self._pump(up_reader, writer, conn), return_exceptions=True)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, conn: _Conn) -> None:
        read = asyncio.ensure_future(src.read(65536))
        strand = asyncio.ensure_future(conn.stranded.wait())
        try:
            while True:
                await asyncio.wait({read, strand}, return_when=asyncio.FIRST_COMPLETED)
                if strand.done():
                    # Stop reading and forwarding; keep both sockets open, for good.
                    await asyncio.Event().wait()
                data = read.result()
                if not data:  # a clean close is forwarded (only before the strand)
                    with contextlib.suppress(OSError):
                        dst.close()
                    return
                dst.write(data)
                await dst.drain()
                read = asyncio.ensure_future(src.read(65536))
        except (OSError, asyncio.CancelledError):
            with contextlib.suppress(OSError):
                dst.close()
        finally:
            read.cancel()
            strand.cancel()

    def strand(self, upstream_ports: Collection[int] | None = None) -> int:
        """Strand every connection open now (or only those whose connection to the target
        leaves from one of ``upstream_ports``); returns how many."""
        def go() -> int:
            live = [c for c in self._conns if not c.stranded.is_set()
                    and (upstream_ports is None or c.upstream_port in upstream_ports)]
            for c in live:
                c.stranded.set()
            return len(live)

        n = asyncio.run_coroutine_threadsafe(_call(go), self.loop).result(10)
        self.stranded += n
        return n

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            for c in self._conns:
                for w in c.writers:
                    with contextlib.suppress(Exception):
                        w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> StrandingProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _call(fn: Any) -> Any:
    return fn()
