"""Exports started from the REST API: run in the background, tracked on disk.

Each run has a directory ``ROOT/<run id>/`` that :func:`synthq.jobs.export.export_job`
fills atomically, and a status file ``ROOT/<run id>.json`` (``running``,
``done`` with the manifest, or ``failed`` with the reason). Status lives in
files, not in memory, so any API process behind a load balancer can answer
for any run.

A running export touches its status file every :data:`HEARTBEAT_S` seconds;
one whose file has not been touched for :data:`STALE_S` (the API process that
ran it stopped) reads as ``failed``, and its half-written ``.tmp-*`` folder is
removed. At most :data:`MAX_RUNNING` exports run at once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from synthq.core.errors import UserError
from synthq.jobs.export import check_options, export_job
from synthq.store.db import safe_url, utcnow

__all__ = ["ExportRun", "Busy", "MAX_RUNNING", "start", "get", "file_path", "running"]

#: Exports that may run at once (each holds a database connection and a CPU).
MAX_RUNNING = 2
#: Seconds between touches of a running export's status file.
HEARTBEAT_S = 10.0
#: A running export whose status file is older than this is dead.
STALE_S = 60.0


class Busy(UserError):
    """:data:`MAX_RUNNING` exports are running already."""

_RUN_ID = re.compile(r"^[0-9a-f]{16}$")
_start_lock = threading.Lock()


@dataclass
class ExportRun:
    id: str
    job_id: int
    format: str
    state: str = "running"
    error: str | None = None
    started_at: str = field(default_factory=lambda: utcnow().isoformat())
    finished_at: str | None = None
    #: Shard and manifest file names, once done.
    files: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _save(root: Path, run: ExportRun) -> None:
    tmp = root / f".{run.id}.json.tmp"
    tmp.write_text(json.dumps(run.to_dict()), encoding="utf-8")
    tmp.replace(root / f"{run.id}.json")


def start(root: Path, job_id: int, *, fmt: str = "parquet", shard_size: int = 10_000,
          include_truncated: bool = True, allow_stale: bool = False,
          wait: bool = False) -> ExportRun:
    """Start exporting ``job_id`` into ``root/<new id>/`` on a thread; the run as it starts."""
    check_options(fmt, shard_size)
    root.mkdir(parents=True, exist_ok=True)
    with _start_lock:
        if len(running(root)) >= MAX_RUNNING:
            raise Busy(f"{MAX_RUNNING} exports are running already; retry when one is done")
        run = ExportRun(id=secrets.token_hex(8), job_id=job_id, format=fmt)
        _save(root, run)
    finished = threading.Event()

    def beat() -> None:
        while not finished.wait(HEARTBEAT_S):
            try:
                os.utime(root / f"{run.id}.json")
            except OSError:
                return

    def go() -> None:
        try:
            manifest = export_job(job_id, root / run.id, fmt=fmt, shard_size=shard_size,
                                  include_truncated=include_truncated, allow_stale=allow_stale)
        except UserError as exc:
            run.state, run.error = "failed", safe_url(str(exc))
        except Exception as exc:  # noqa: BLE001 - recorded for the caller, never lost
            run.state, run.error = "failed", safe_url(f"{type(exc).__name__}: {exc}")
        else:
            run.state, run.manifest = "done", manifest.to_dict()
            run.files = sorted(p.name for p in (root / run.id).iterdir() if p.is_file())
        run.finished_at = utcnow().isoformat()
        finished.set()
        _save(root, run)

    threading.Thread(target=beat, name=f"synthq-export-beat-{run.id}", daemon=True).start()
    thread = threading.Thread(target=go, name=f"synthq-export-{run.id}", daemon=True)
    thread.start()
    if wait:
        thread.join()
    return run


def get(root: Path, run_id: str) -> ExportRun | None:
    """The run ``run_id``, or None (also for an id that is not one of ours)."""
    if not _RUN_ID.match(run_id):
        return None
    path = root / f"{run_id}.json"
    if not path.is_file():
        return None
    run = ExportRun(**json.loads(path.read_text(encoding="utf-8")))
    if run.state == "running" and time.time() - path.stat().st_mtime > STALE_S:
        # The process running it stopped (an API restart): it will never finish.
        run.state, run.error = "failed", "the API process running this export stopped"
        run.finished_at = utcnow().isoformat()
        for tmp in root.glob(f".{run.id}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        _save(root, run)
    return run


def running(root: Path) -> list[ExportRun]:
    """The exports running now (stale ones are marked failed on the way)."""
    found = []
    for path in root.glob("*.json"):
        run = get(root, path.stem)
        if run is not None and run.state == "running":
            found.append(run)
    return found


def file_path(root: Path, run: ExportRun, name: str) -> Path | None:
    """A file of a finished run, by name; None for anything not in its list."""
    if run.state != "done" or name not in run.files:
        return None
    return root / run.id / name
