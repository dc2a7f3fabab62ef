"""The operations the CLI and the REST API share, beyond what their modules export.

Each function does one thing a person asks for (create a job from a file,
requeue, pause) with the same validation in both front ends; the writes go
through :mod:`synthq.states` and :func:`synthq.enqueue.enqueue`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from synthq import states
from synthq.db import utcnow
from synthq.enqueue import EnqueueReport, JobSpec, enqueue
from synthq.enums import JobState
from synthq.errors import PERMANENT_CLASSES, RETRYABLE_CLASSES, TOKENIZATION_CLASSES, UserError
from synthq.models import Job

__all__ = ["KNOWN_CLASSES", "check_classes", "check_overrides", "requeue", "set_job_state",
           "data_path", "enqueue_file", "bad_rows", "requeue_left_servers"]

#: Failure classes a requeue may name.
KNOWN_CLASSES = frozenset(RETRYABLE_CLASSES | PERMANENT_CLASSES | TOKENIZATION_CLASSES)


def check_classes(classes: Sequence[str]) -> None:
    for c in classes:
        if c not in KNOWN_CLASSES:
            raise UserError(f"unknown class {c!r}; known: {', '.join(sorted(KNOWN_CLASSES))}")


def requeue(session: Session, job: Job, *, classes: Sequence[str] = (),
            sample_ids: Sequence[int] = (), overrides: dict[str, Any] | None = None,
            limits: dict[str, Any] | None = None) -> int:
    """Failed samples (of ``classes``, or ``sample_ids``, or all) back to pending.

    ``overrides`` (see :func:`check_overrides`) become the requeued samples' own
    settings; done samples and the job keep theirs. ``limits`` (the job fields of
    :func:`synthq.enqueue.inflight_settings`) become the job's, in the same transaction.
    """
    check_classes(classes)
    overrides = check_overrides(overrides or {})
    now = utcnow()
    n = states.requeue(session, job.id, classes=list(classes), sample_ids=list(sample_ids),
                       now=now, overrides=overrides or None)
    if limits:
        states.update_job(session, job, limits, now=now)
    return n


#: Request fields an override may not set (synthq sets them itself).
_RESERVED = frozenset({"model", "messages", "stream", "max_tokens", "tools", "tool_choice"})


def check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Per-sample settings for ``requeue``, checked; the ``None`` values dropped.

    Keys: max_tokens, temperature, top_p, total_timeout, stall_timeout,
    max_attempts, extra_body, chat_template_kwargs. Raises :class:`UserError`
    naming the option (``--max-tokens``) for a bad one.
    """
    from synthq.jobview import OVERRIDABLE

    out = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(out) - set(OVERRIDABLE)
    if unknown:
        raise UserError(f"unknown settings {sorted(unknown)}; known: {', '.join(OVERRIDABLE)}")

    def flag(key: str) -> str:
        return "--" + {"total_timeout": "timeout"}.get(key, key).replace("_", "-")

    for key in ("max_tokens", "max_attempts"):
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int)
                           or out[key] < 1):
            raise UserError(f"{flag(key)} must be a positive integer, got {out[key]!r}")
    for key in ("temperature", "top_p", "total_timeout", "stall_timeout"):
        if key not in out:
            continue
        value = out[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise UserError(f"{flag(key)} must be a number, got {value!r}")
        low_ok = value >= 0 if key == "temperature" else value > 0
        if not low_ok or (key == "top_p" and value > 1):
            raise UserError(f"{flag(key)} is out of range: {value!r}")
        out[key] = float(value)
    if "total_timeout" in out:
        from synthq.config import get_settings

        visibility = get_settings().visibility_timeout
        if out["total_timeout"] >= visibility:
            raise UserError(f"--timeout {out['total_timeout']:g} s is not below the broker's "
                            f"visibility timeout ({visibility:g} s)")
    for key in ("extra_body", "chat_template_kwargs"):
        if key in out and not isinstance(out[key], dict):
            raise UserError(f"{flag(key)} must be a JSON object")
    reserved = _RESERVED & set(out.get("extra_body") or {})
    if reserved:
        raise UserError(f"--extra-body may not set {sorted(reserved)}")
    return out


def requeue_left_servers(session: Session, job: Job) -> int:
    """Samples that failed as ``bad_request`` on a server the job no longer has: pending again.

    A wrong server URL (no ``/v1``) fails every sample with a 404; running the
    job again with the right URL should redo them, not leave them failed.
    """
    from sqlalchemy import select

    from synthq.enums import SampleState
    from synthq.models import Sample

    ids = list(session.scalars(select(Sample.id).where(
        Sample.job_id == job.id, Sample.state == SampleState.FAILED,
        Sample.error_class == "bad_request", Sample.server.is_not(None),
        Sample.server.not_in(list(job.servers)))))
    moved = 0
    for start in range(0, len(ids), 10_000):
        moved += states.requeue(session, job.id, sample_ids=ids[start:start + 10_000],
                                now=utcnow())
    return moved


def set_job_state(session: Session, job: Job, target: JobState) -> str:
    """Pause, resume or cancel ``job``; the state it had. UserError if it cannot."""
    before = str(job.state)
    if not states.set_job_state(session, job.id, target, now=utcnow()):
        if job.state == JobState.CANCELLED:
            raise UserError(f"job {job.name} is cancelled; it cannot be resumed or paused")
        raise UserError(f"job {job.name} is {before}; it cannot become {target}")
    session.refresh(job)
    return before


def data_path(data_dir: Path, relative: str) -> Path:
    """``relative`` inside ``data_dir``; UserError for anything that leaves it."""
    root = data_dir.expanduser().resolve()
    if not relative.strip() or "\x00" in relative:
        raise UserError("path is empty")
    path = (root / relative).resolve()
    if not path.is_relative_to(root) or path == root:
        raise UserError(f"path must be inside the data directory ({root.name}/)")
    if not path.exists():
        raise UserError(f"no such file in the data directory: {relative}")
    if path.is_dir():
        # A folder's files are read through their links: none may lead out of the root.
        for inner in path.rglob("*"):
            if inner.is_symlink() and not inner.resolve().is_relative_to(root):
                raise UserError(f"path must be inside the data directory ({root.name}/): "
                                f"{inner.relative_to(root)} links out of it")
    return path


def bad_rows(source: str, *, limit: int = 1000, id_field: str | None = None,
             key_version: int | None = None, regenerate: str = "last") -> list[tuple[int, str]]:
    """The first ``limit`` malformed rows of ``source`` with their reasons."""
    from synthq.dataset import KEY_VERSION, iter_rows

    found: list[tuple[int, str]] = []
    for row in iter_rows(source, id_field=id_field, key_version=key_version or KEY_VERSION,
                         regenerate=regenerate):
        if row.skip_reason is not None:
            found.append((row.index, row.skip_reason))
            if len(found) >= limit:
                break
    return found


def enqueue_file(spec: JobSpec, source: str, *, id_field: str | None = None,
                 limit: int = 1000) -> tuple[EnqueueReport, list[tuple[int, str]]]:
    """Enqueue ``source``; the report and every malformed row (up to ``limit``) with its reason.

    Good rows are inserted whatever the bad ones are (docs/design.md, invariant 8).
    """
    report = enqueue(spec, source, id_field=id_field)
    if not report.skipped:
        return report, []
    return report, bad_rows(source, limit=limit, id_field=id_field,
                            key_version=report.key_version, regenerate=spec.regenerate)
