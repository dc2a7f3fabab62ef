"""The API under load and hostile uploads: concurrent reads, a gzip bomb, a 300 MB line.

Starts ``synthq api`` (``--python`` picks another checkout's interpreter, to
compare before/after in one run) against a fresh PostgreSQL database, then:

* ``--concurrency`` (default 200) concurrent ``GET /api/jobs`` and as many
  ``GET /metrics``, each on its own connection: status codes, p50/p99 latency,
  and the CPU seconds the API process and this client used meanwhile;
* an upload of a gzip (~1 MB) that inflates to a 1 GB single line, and one of a
  300 MB single line: status code, and the API process's peak RSS (VmHWM).

Run: ``python bench/api_hostile.py [--concurrency 200] [--skip-uploads]``; against another checkout:
``--repo /work/main --python /work/main/.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import httpx
from _harness import Bench, Proc, free_port, summary, wait_until

TOKEN = "bench-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC = json.dumps({"model": "m", "servers": ["http://127.0.0.1:9/v1"]})


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def raw_get(port: int, path: str) -> tuple[int, float]:
    """One GET on its own connection, with asyncio streams: (status, seconds).

    Not httpx: with 400 requests at once, httpx's own CPU (~10 ms a request,
    4+ s in all, in this one process) would be what the latency measured.
    """
    t = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}"
                     f"\r\nConnection: close\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), 120)  # to EOF: the whole answer
        writer.close()
        return int(answer.split(b" ", 2)[1]), time.monotonic() - t
    except (OSError, TimeoutError, ValueError, IndexError):
        return 0, time.monotonic() - t


async def httpx_gets(url: str, paths: list[str]) -> list[tuple[int, float]]:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120,
                                 limits=httpx.Limits(max_connections=len(paths))) as c:
        async def one(path: str) -> tuple[int, float]:
            t = time.monotonic()
            try:
                r = await c.get(path)
                return r.status_code, time.monotonic() - t
            except httpx.HTTPError:
                return 0, time.monotonic() - t

        return await asyncio.gather(*(one(p) for p in paths))


async def concurrent(url: str, n: int, client: str) -> dict[str, object]:
    paths = [p for _ in range(n) for p in ("/api/jobs", "/metrics")]
    if client == "httpx":
        results = await httpx_gets(url, paths)
    else:
        port = int(url.rpartition(":")[2])
        results = await asyncio.gather(*(raw_get(port, p) for p in paths))
    codes: dict[int, int] = {}
    for code, _ in results:
        codes[code] = codes.get(code, 0) + 1
    lat = sorted(t for _, t in results)
    return {"codes": codes, "p50_s": round(statistics.median(lat), 2),
            "p99_s": round(lat[int(len(lat) * 0.99) - 1], 2), "max_s": round(lat[-1], 2)}


def bomb(size: int) -> bytes:
    """A gzip of one JSON line of ``size`` bytes (mostly one repeated character)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = io.BytesIO()
    out.write(comp.compress(b'{"prompt": "'))
    block = b"a" * (1 << 20)
    for _ in range(size >> 20):
        out.write(comp.compress(block))
    out.write(comp.compress(b'"}\n'))
    out.write(comp.flush())
    return out.getvalue()


def upload(url: str, name: str, body: bytes | Path) -> int:
    data = body.open("rb") if isinstance(body, Path) else io.BytesIO(body)
    with data:
        r = httpx.post(f"{url}/api/jobs/upload", headers=AUTH, timeout=600,
                       files={"file": (name, data)}, data={"spec": SPEC})
    return r.status_code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent),
                    help="The checkout whose api/ and synthq/ the API runs.")
    ap.add_argument("--line-mb", type=int, default=300)
    ap.add_argument("--skip-uploads", action="store_true",
                    help="Only the concurrent reads (no gzip bomb, no 300 MB line).")
    ap.add_argument("--redis-db", type=int, default=11)
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="raw: one asyncio connection per request (cheap, the default); "
                         "httpx: an AsyncClient (its own CPU dominates at 400 requests).")
    args = ap.parse_args()
    with Bench("api_hostile", redis_db=args.redis_db) as b:
        port = free_port()
        env = {**b.child_env(), "SYNTHQ_API_TOKEN": TOKEN, "SYNTHQ_API_HIDE_TORCH": "1",
               "SYNTHQ_ALLOWED_SERVERS": "127.0.0.1",
               "PYTHONPATH": args.repo}
        api = Proc([args.python, "-m", "uvicorn", "--app-dir", args.repo, "api.app:app",
                    "--port", str(port),
                    "--log-level", "warning"], env, b.tmp / "api.log", name="api")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _up(url), 60, "the API", procs=[api])
            for i in range(3):
                upload(url, f"seed{i}.jsonl", b'{"prompt": "hi"}\n')
            figures: dict[str, object] = {"repo": args.repo}
            api_cpu, own = cpu_s(api.proc.pid), resource.getrusage(resource.RUSAGE_SELF)
            figures["concurrent"] = asyncio.run(concurrent(url, args.concurrency, args.client))
            after = resource.getrusage(resource.RUSAGE_SELF)
            figures["concurrent_cpu_s"] = {
                "api": round(cpu_s(api.proc.pid) - api_cpu, 2),
                "client": round(after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime, 2)}
            if args.skip_uploads:
                summary("api_hostile", figures)
                return
            base = peak_rss_mb(api.proc.pid)
            figures["rss_before_uploads_mb"] = round(base, 1)
            t = time.monotonic()
            gz = bomb(1 << 30)
            figures["bomb_gzip_mb"] = round(len(gz) / 1e6, 2)
            figures["bomb_status"] = upload(url, "bomb.jsonl.gz", gz)
            figures["bomb_s"] = round(time.monotonic() - t, 1)
            figures["rss_after_bomb_mb"] = round(peak_rss_mb(api.proc.pid), 1)
            with tempfile.TemporaryDirectory() as tmp:
                line = Path(tmp) / "line.jsonl"
                with line.open("wb") as out:
                    out.write(b'{"prompt": "')
                    for _ in range(args.line_mb):
                        out.write(b"b" * (1 << 20))
                    out.write(b'"}\n')
                t = time.monotonic()
                figures["line_status"] = upload(url, "line.jsonl", line)
                figures["line_s"] = round(time.monotonic() - t, 1)
            figures["rss_peak_mb"] = round(peak_rss_mb(api.proc.pid), 1)
            summary("api_hostile", figures)
        finally:
            api.stop()


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
