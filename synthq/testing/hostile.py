"""A hostile OpenAI-compatible server: the answers a broken or malicious server gives.

The simulator (:mod:`synthq.testing.simulator`) plays a server that works, with
faults; this one plays a server that attacks the client, over real HTTP from a
thread (tests) or a process (``python -m synthq.testing.hostile``):

* an error answer with a body of any size (``error_bytes``; 3 GB is streamed
  from one 64 KiB buffer, never allocated);
* ``/health``, ``/v1/models`` or ``/metrics`` answers that never end
  (``endless``), fast or trickling (``trickle``);
* stream chunks of any shape (``chunks``: each a JSON value, or raw bytes), or a
  non-streamed answer of any shape (``document``);
* answers carrying a reasoning of any size (``reasoning_bytes``).

It counts the chat calls it gets and the size of each request body (``GET
/hostile/stats`` from another process). :class:`HostileProcess` runs it as a
process of its own and :func:`run_measured` runs a command with its peak RSS:
the e2e tests and ``scripts/check_hostile.py`` share them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from synthq.testing.procs import REPO, Proc, free_port

__all__ = ["Script", "Hostile", "GOOD_CHUNKS", "MALFORMED", "HostileProcess", "run_measured",
           "main"]

#: A well-formed answer: role, two words, the finish, the usage.
GOOD_CHUNKS: list[Any] = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "hello"}}]},
    {"choices": [{"index": 0, "delta": {"content": " hostile"}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
]

#: Stream chunks of the wrong shape (issue 24, item 3), each sent before GOOD_CHUNKS:
#: before the fix each raised in the worker and was retried at once, for ever.
MALFORMED: dict[str, list[Any]] = {
    "delta-str": [{"choices": [{"index": 0, "delta": "str"}]}],
    "choices-items": [{"choices": ["str", 5]}],
    "choices-object": [{"choices": {"index": 0}}],
    "content-number": [{"choices": [{"index": 0, "delta": {"content": 5}}]}],
    "content-list": [{"choices": [{"index": 0, "delta": {"content": ["a"]}}]}],
    "reasoning-object": [{"choices": [{"index": 0, "delta": {"reasoning_content": {"a": 1}}}]}],
    "tool-index-list": [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": [1], "function": {"name": "f"}}]}}]}],
    "tool-function-str": [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": "f"}]}}]}],
    "tool-calls-object": [{"choices": [{"index": 0, "delta": {"tool_calls": {"index": 0}}}]}],
    "tool-arguments-number": [{"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c", "function": {"name": "f", "arguments": 7}}]}}]}],
    "token-ids-str": [{"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": "ab"}]}],
    "token-ids-huge": [{"choices": [{"index": 0, "delta": {"content": "a"},
                                     "token_ids": [1 << 40]}]}],
    "finish-number": [{"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": 7}]}],
    "finish-long": [{"choices": [{"index": 0, "delta": {"content": "a"},
                                  "finish_reason": "s" * 200}]}],
    "prompt-ids-object": [{"prompt_token_ids": {"a": 1}, "choices": []}],
}

_FILLER = b"x" * (64 << 10)


@dataclass
class Script:
    """What the server does. Mutable: a test may change it between calls."""

    #: Chat calls answer this status (0: they answer ``chunks``) with ``error_bytes`` of body.
    error_status: int = 0
    error_bytes: int = 0
    #: The SSE payloads of a chat answer (JSON values, or raw bytes), then ``[DONE]``.
    chunks: list[Any] = field(default_factory=lambda: list(GOOD_CHUNKS))
    #: Instead of ``chunks``: a good answer whose reasoning_content has this many bytes.
    reasoning_bytes: int = 0
    #: Instead of a stream: this JSON body (a non-streamed answer, of any shape).
    document: Any = None
    #: Paths (``/health``, ``/v1/models``, ``/metrics``) whose 200 answer never ends.
    endless: tuple[str, ...] = ()
    #: Endless bodies come 100 bytes every 50 ms (a deadline, not the byte cap, stops them).
    trickle: bool = False
    #: What ``/v1/models`` lists.
    models: list[str] = field(default_factory=lambda: ["hostile"])


class Hostile:
    """The server on a free port of 127.0.0.1, serving from a daemon thread."""

    def __init__(self, script: Script | None = None, port: int = 0) -> None:
        self.script = script or Script()
        self.calls = 0
        self.request_sizes: list[int] = []
        #: Bytes of endless or error bodies written before the client hung up.
        self.sent = 0
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"hostile": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base_url}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name=f"hostile-{self.port}")
        self._thread.start()

    def count(self, size: int) -> None:
        with self._lock:
            self.calls += 1
            self.request_sizes.append(size)

    def wrote(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def close(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Hostile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hostile: Hostile

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # quiet: tests read counts, not an access log

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        script = self.hostile.script
        path = self.path.split("?", 1)[0]
        if path in script.endless:
            self._endless(script.trickle)
        elif path == "/health":
            self._send(200, b"", "text/plain")
        elif path == "/v1/models":
            data = [{"id": m, "object": "model"} for m in script.models]
            self._send(200, json.dumps({"object": "list", "data": data}).encode())
        elif path == "/hostile/stats":  # for a test or check in another process
            self._send(200, json.dumps({"calls": self.hostile.calls,
                                        "request_sizes": self.hostile.request_sizes}).encode())
        elif path == "/metrics":
            self._send(200, b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n",
                       "text/plain")
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        size = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(size)
        if not self.path.endswith("/chat/completions"):
            self._send(404, b'{"error": "not found"}')
            return
        self.hostile.count(len(body))
        script = self.hostile.script
        if script.error_status:
            self._huge(script.error_status, script.error_bytes)
            return
        if script.document is not None:
            self._send(200, json.dumps(script.document).encode())
            return
        chunks = script.chunks
        if script.reasoning_bytes:
            chunks = [{"choices": [{"index": 0, "delta": {
                "reasoning_content": "r" * script.reasoning_bytes}}]}, *GOOD_CHUNKS]
        events = b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode())
                          + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self._send(200, events, "text/event-stream")

    def _send(self, status: int, data: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _huge(self, status: int, size: int) -> None:
        """An error answer of ``size`` bytes, written from one buffer until the client hangs up."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        head = b'{"error": {"message": "a hostile error, and then: '
        left = size
        try:
            self.wfile.write(head[:left])
            left -= min(left, len(head))
            view = memoryview(_FILLER)
            while left > 0 and not self.hostile.stopping.is_set():
                piece = view[:min(left, len(view))]
                self.wfile.write(piece)
                left -= len(piece)
                self.hostile.wrote(len(piece))
        except OSError:  # the client read what it wanted and hung up
            self.close_connection = True

    def _endless(self, trickle: bool) -> None:
        """A 200 whose chunked body never ends (until the client hangs up)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        piece = b"# more\n" * 14 + b"#\n" if trickle else _FILLER
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        try:
            while not self.hostile.stopping.is_set():
                self.wfile.write(frame)
                self.hostile.wrote(len(piece))
                if trickle:
                    time.sleep(0.05)
        except OSError:
            pass
        self.close_connection = True


class HostileProcess(Proc):
    """``python -m synthq.testing.hostile`` on a free port, in its own process group (so a
    3 GB body is not written by the process that measures the client); ``args`` as
    :func:`main` takes them."""

    def __init__(self, log_path: Path, env: dict[str, str], *args: str,
                 timeout: float = 20.0) -> None:

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base_url}/v1"
        super().__init__([sys.executable, "-m", "synthq.testing.hostile", "--port",
                          str(self.port), *args], env, log_path, name="hostile")
        self.wait_healthy(f"{self.base_url}/health", timeout, "the hostile server",
                          request_timeout=1.0)

    def calls(self) -> int:
        """Chat calls the server has had."""
        import httpx

        return int(httpx.get(f"{self.base_url}/hostile/stats", timeout=5).json()["calls"])


#: Runs a command and prints the peak RSS of its process tree (KiB) as the last line.
_PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def run_measured(cmd: list[str], env: dict[str, str],
                 timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``cmd`` (from the repository root) to its end; its result (the peak line taken
    off its stdout) and the peak RSS of its process tree in MB."""
    done = subprocess.run([sys.executable, "-c", _PEAK, *cmd], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.rstrip("\n").split("\n")
    peak_mb = int(lines[-1]) / 1024 if lines and lines[-1].strip().isdigit() else float("nan")
    done.stdout = "\n".join(lines[:-1]) + "\n"
    return done, peak_mb


def main(argv: list[str] | None = None) -> None:
    """``python -m synthq.testing.hostile --port 8123 --error-status 500 --error-bytes 3e9``"""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--error-status", type=int, default=0)
    parser.add_argument("--error-bytes", type=float, default=0)
    parser.add_argument("--endless", action="append", default=[],
                        help="a path whose 200 never ends (repeatable)")
    parser.add_argument("--trickle", action="store_true")
    parser.add_argument("--chunks", help="a JSON list of SSE payloads for chat answers")
    args = parser.parse_args(argv)
    script = Script(error_status=args.error_status, error_bytes=int(args.error_bytes),
                    endless=tuple(args.endless), trickle=args.trickle)
    if args.chunks:
        script.chunks = json.loads(args.chunks)
    server = Hostile(script, port=args.port)
    print(f"hostile server on {server.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
