"""The API under load and hostile uploads: concurrent reads, a gzip bomb, a 300 MB line.

Starts ``synthq api`` (``--python`` picks another checkout's interpreter, to
compare before/after in one run) against a fresh PostgreSQL database, then:

* ``--concurrency`` (default 200) concurrent ``GET /api/jobs`` and as many
  ``GET /metrics``: status codes and p50/p99 latency;
* an upload of a gzip (~1 MB) that inflates to a 1 GB single line, and one of a
  300 MB single line: status code, and the API process's peak RSS (VmHWM).

Run: ``python bench/api_hostile.py [--concurrency 200]``; against another checkout:
``--repo /work/main --python /work/main/.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
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


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def concurrent(url: str, n: int) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120,
                                 limits=httpx.Limits(max_connections=2 * n)) as c:
        async def one(path: str) -> tuple[int, float]:
            t = time.monotonic()
            try:
                r = await c.get(path)
                return r.status_code, time.monotonic() - t
            except httpx.HTTPError:
                return 0, time.monotonic() - t

        results = await asyncio.gather(*(one(p) for _ in range(n)
                                         for p in ("/api/jobs", "/metrics")))
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
    args = ap.parse_args()
    with Bench("api_hostile", redis_db=11) as b:
        port = free_port()
        env = {**b.child_env(), "SYNTHQ_API_TOKEN": TOKEN, "SYNTHQ_API_HIDE_TORCH": "1",
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
            figures["concurrent"] = asyncio.run(concurrent(url, args.concurrency))
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
