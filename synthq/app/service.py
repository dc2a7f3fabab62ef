"""The operations the CLI and the REST API share, beyond what their modules export.

Each function does one thing a person asks for (create a job from a file,
requeue, pause) with the same validation in both front ends; the writes go
through :mod:`synthq.queue.states` (samples), :mod:`synthq.queue.jobs` (a job's state
and settings) and :func:`synthq.jobs.enqueue.enqueue`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from synthq.core.enums import JobState
from synthq.core.errors import ALL_CLASSES, TOKENIZATION_CLASSES, UserError
from synthq.core.secrets import safe_url
from synthq.jobs.enqueue import EnqueueReport, JobSpec, enqueue
from synthq.queue import jobs, states
from synthq.spec import jobspec
from synthq.store.db import utcnow
from synthq.store.models import Job

__all__ = ["KNOWN_CLASSES", "check_classes", "check_overrides", "requeue", "requeue_with",
           "set_job_state", "data_path", "enqueue_file", "bad_rows", "requeue_left_servers",
           "preflight", "set_capture", "start_now"]

log = logging.getLogger(__name__)

#: Failure classes a requeue may name.
KNOWN_CLASSES = frozenset(ALL_CLASSES | TOKENIZATION_CLASSES)


def check_classes(classes: Sequence[str]) -> None:
    for c in classes:
        if c not in KNOWN_CLASSES:
            raise UserError(f"unknown class {c!r}; known: {', '.join(sorted(KNOWN_CLASSES))}")


def requeue(session: Session, job: Job, *, classes: Sequence[str] = (),
            sample_ids: Sequence[int] = (), overrides: dict[str, Any] | None = None) -> int:
    """Failed samples (of ``classes``, or ``sample_ids``, or all) back to pending.

    ``overrides`` (see :func:`check_overrides`) become the requeued samples' own
    settings; done samples and the job keep theirs.
    """
    check_classes(classes)
    overrides = check_overrides(overrides or {})
    return states.requeue(session, job.id, classes=list(classes), sample_ids=list(sample_ids),
                          now=utcnow(), overrides=overrides or None)


def requeue_with(session: Session, job: Job, *, classes: Sequence[str] = (),
                 sample_ids: Sequence[int] = (), settings: dict[str, Any] | None = None) -> int:
    """:func:`requeue` with a requeue's settings as the CLI and the API take them
    (:func:`synthq.spec.jobspec.requeue_settings`): the requeued samples' own, and the job's
    in-flight limit from now on."""
    overrides, limits = jobspec.requeue_settings(settings or {})
    n = requeue(session, job, classes=classes, sample_ids=sample_ids, overrides=overrides)
    if limits is not None:
        jobs.update_job(session, job, limits, now=utcnow())
    return n


def check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Per-sample settings for ``requeue``, checked; the ``None`` values dropped.

    Keys: :data:`synthq.spec.jobspec.OVERRIDABLE` (max_tokens, temperature, ...,
    total_timeout, ...), checked as a job's are at create. Raises
    :class:`UserError` naming the option (``--max-tokens``) for a bad one.
    """
    return jobspec.check_overrides(overrides)


def preflight(spec: JobSpec) -> list[str]:
    """What the CLI and the API ask the servers before a job is stored: each capture server
    must answer, and no generation server may list its models without ``spec.model``
    (each a :class:`UserError`); warnings to show (a server not up yet), one line each."""
    from synthq.serving.health import check_model

    if spec.capture_servers:
        from synthq.capture.stage import check_answer

        check_answer(spec.capture_servers)
    warnings = check_model(spec.servers, spec.model)
    if spec.capture_mode == "inline":
        # Each generation server must save an answer's states: refused in one line, before
        # the job is stored (synthq.capture.inline.probe).
        from synthq.capture.deadline import client
        from synthq.capture.inline import probe
        from synthq.capture.stage import server_key

        with client(auth=server_key) as http:
            for url in spec.servers:
                probe(http, url, spec.model)
    return warnings


def requeue_left_servers(session: Session, job: Job) -> int:
    """Samples that failed as ``bad_request`` on a server the job no longer has: pending again.

    A wrong server URL (no ``/v1``) fails every sample with a 404; running the
    job again with the right URL should redo them, not leave them failed.
    """
    from sqlalchemy import select

    from synthq.core.enums import SampleState
    from synthq.store.models import Sample

    ids = list(session.scalars(select(Sample.id).where(
        Sample.job_id == job.id, Sample.state == SampleState.FAILED,
        Sample.error_class == "bad_request", Sample.server.is_not(None),
        Sample.server.not_in(list(job.servers)))))
    moved = 0
    for start in range(0, len(ids), 10_000):
        moved += states.requeue(session, job.id, sample_ids=ids[start:start + 10_000],
                                now=utcnow())
    return moved


def set_capture(session: Session, job: Job, values: dict[str, Any]) -> dict[str, Any]:
    """Change ``job``'s capture settings (``jobspec.CAPTURE``, by name), as `synthq capture`
    and ``PUT /api/jobs/{id}/capture`` both do; returns the job's capture settings after.

    Each value is checked as declared. New capture servers must answer before the job
    stores them, as at enqueue; an engine-files folder must be a real folder on this
    machine, and the given ones are merged into the job's (``""`` removes a server's).
    An omitted setting is kept, and so is a null where the column holds none, or an
    empty value of a setting kept when omitted (``capture_servers``).
    """
    from synthq.capture.confine import check_folder
    from synthq.capture.stage import check_answer

    unknown = set(values) - {s.name for s in jobspec.CAPTURE}
    if unknown:
        raise UserError(f"not capture settings: {sorted(unknown)}")
    changes = {k: v for k, v in jobspec.check_values(values).items()
               if (v is not None or Job.__table__.c[k].nullable)
               and (v or not jobspec.BY_NAME[k].kept_when_omitted)}
    if "capture_servers" in changes:
        check_answer(changes["capture_servers"])
    if "capture_files" in changes:
        given = {url: str(check_folder(url, folder)) if folder else ""
                 for url, folder in changes["capture_files"].items()}
        merged = {**(job.capture_files or {}), **given}
        changes["capture_files"] = {url: folder for url, folder in merged.items() if folder}
    if changes:
        jobs.update_job(session, job, changes, now=utcnow())
    return {s.name: getattr(job, s.name) for s in jobspec.CAPTURE}


def set_job_state(session: Session, job: Job, target: JobState) -> str:
    """Pause, resume or cancel ``job``; the state it had. UserError if it cannot."""
    before = str(job.state)
    if not jobs.set_job_state(session, job.id, target, now=utcnow()):
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
    from synthq.data.dataset import KEY_VERSION, iter_rows

    found: list[tuple[int, str]] = []
    for row in iter_rows(source, id_field=id_field, key_version=key_version or KEY_VERSION,
                         regenerate=regenerate):
        if row.skip_reason is not None:
            found.append((row.index, row.skip_reason))
            if len(found) >= limit:
                break
    return found


def start_now() -> None:
    """With a broker: one scheduler tick now, so that new samples start without waiting
    for beat's next one. Best effort: beat's ticks start them anyway (a broker that
    cannot be reached gets one log line, not an error for the caller)."""
    from synthq.spec.config import get_settings

    if get_settings().embedded:
        return
    from synthq.queue.broker import kick_dispatch

    try:
        kick_dispatch()
    except Exception as exc:  # noqa: BLE001 - the samples are stored; beat starts them
        log.warning("could not ask the workers for a tick (%s: %s): beat's next tick "
                    "starts the new samples", type(exc).__name__,
                    safe_url(str(exc).splitlines()[0][:200]) if str(exc) else "")


def enqueue_file(spec: JobSpec, source: str, *, id_field: str | None = None,
                 limit: int = 1000) -> tuple[EnqueueReport, list[tuple[int, str]]]:
    """Enqueue ``source``; the report and every malformed row (up to ``limit``) with its reason.

    Good rows are inserted whatever the bad ones are (docs/design.md, invariant 8).
    """
    report = enqueue(spec, source, id_field=id_field)
    if report.inserted:
        start_now()
    if not report.skipped:
        return report, []
    return report, bad_rows(source, limit=limit, id_field=id_field,
                            key_version=report.key_version, regenerate=spec.regenerate)
