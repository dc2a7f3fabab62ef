"""`synthq enqueue` and `synthq run`: create or resume a job, and run it embedded."""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Annotated, Any

import typer

from synthq.cli import (
    JsonOpt,
    app,
    console,
    ensure_db,
    err,
    escape,
    fail,
    warn,
)
from synthq.cli.options import DatasetOpt, changed, job_spec, with_settings
from synthq.cli.render import job_progress, print_status
from synthq.core.errors import DiskFull, UserError


def _enqueue(spec, dataset: str, quiet: bool, id_field: str | None):  # type: ignore[no-untyped-def]
    from synthq.app.service import preflight
    from synthq.jobs.enqueue import enqueue

    spec.check()
    ensure_db()
    # A model the servers do not serve, or a capture server that does not answer, is
    # refused here, not failed sample by sample.
    for line in preflight(spec):
        warn(line)
    if not quiet and _hub_only(dataset):
        warn(f"no local file or folder {dataset!r}: loading it as a Hugging Face dataset id")
    if quiet:
        report = enqueue(spec, dataset, id_field=id_field)
    else:
        with console.status("reading the dataset…") as st:
            report = enqueue(spec, dataset, id_field=id_field, progress=lambda r: st.update(
                f"read {r.rows:,} rows, {r.inserted:,} new"))
    if any(c.startswith("servers ") for c in report.updated_settings):
        from synthq.app import service
        from synthq.jobs.enqueue import find_job
        from synthq.store.db import session_scope

        with session_scope() as s:
            moved = service.requeue_left_servers(s, find_job(s, report.job_id))
        if moved:
            report.warnings.append(f"requeued {moved:,} samples that failed as bad_request "
                                   "on a server the job no longer has")
    return report


def _hub_only(dataset: str) -> bool:
    """True when ``dataset`` is no local path, so only the Hub can answer (slowly)."""
    from pathlib import Path

    from synthq.data.dataset.read import looks_like_path

    return not Path(dataset).expanduser().exists() and not looks_like_path(dataset)


def _check_broker(start: bool) -> None:
    """Warn when the broker cannot be reached: the samples are stored all the same, and
    beat's ticks start them once workers and beat can reach it. ``start``: new samples
    were stored; ask for one scheduler tick now, so they start without waiting for
    beat's next one."""
    import redis
    from kombu.exceptions import KombuError

    from synthq.core.secrets import safe_url
    from synthq.queue.broker import kick_dispatch, ping
    from synthq.spec.config import get_settings

    url = get_settings().broker_url
    try:
        ping(url)
        if start:
            kick_dispatch()
    except (redis.RedisError, KombuError, OSError, ValueError) as exc:
        warn(f"cannot reach the broker {safe_url(url)} ({safe_url(str(exc))}): the samples "
             "are stored and will run once workers and beat can reach it")


def _print_report(report) -> None:  # type: ignore[no-untyped-def]
    verb = "created" if report.created else "found"
    console.print(f"job [bold]{escape(report.job_name)}[/] (id {report.job_id}) {verb}: "
                  f"{report.rows:,} rows read, {report.inserted:,} new samples, "
                  f"{report.duplicates:,} already there, {report.skipped:,} skipped")
    if report.rows and not report.inserted:
        console.print("nothing new to add: this data is already in the job")
    for where, reason in report.skip_examples[:5]:
        console.print(f"  [yellow]skipped {escape(where)}:[/] {escape(reason)}",
                      highlight=False)
    for line in report.notes:
        console.print(escape(line), highlight=False)
    for line in report.warnings:
        warn(line)


@app.command()
@with_settings()
def enqueue(dataset: DatasetOpt, settings: dict[str, Any], as_json: JsonOpt = False) -> None:
    """Add a dataset's prompts to a job (created if new). Prints the job id.

    Example: `synthq enqueue -d p.jsonl -s http://vllm:8000/v1 -m kimi --tokenizer /models/kimi`

    Each option in full: the docs' CLI reference (docs/cli.md).
    """
    try:
        spec = job_spec(settings, dataset)
        report = _enqueue(spec, dataset, quiet=as_json, id_field=settings["id_field"])
    except UserError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print(report.to_json())
    else:
        _print_report(report)
    from synthq.spec.config import get_settings

    if not get_settings().embedded:
        _check_broker(start=report.inserted > 0)


@app.command()
@with_settings(mode="optional")
def run(
    dataset: Annotated[str | None, typer.Option("--dataset", "-d", help="JSONL/Parquet file "
                       "or folder, or a Hugging Face dataset id (`name[:split]`).")] = None,
    *, settings: dict[str, Any], as_json: JsonOpt = False,
) -> None:
    """Enqueue (or resume) a job and process it to the end in this process.

    A SQLite file under ./synthq-data, no Redis. Kill it and run the same command
    again: it resumes, and no done sample is generated again. `synthq run --job NAME`
    alone resumes a stored job with its stored settings.

    Example: `synthq run -d examples/prompts.jsonl -s http://127.0.0.1:8000/v1 -m sim-model`

    Each option in full: the docs' CLI reference (docs/cli.md).
    """
    from synthq.app.embedded import exclusive, run_job
    from synthq.spec.config import get_settings

    config = get_settings()
    job, server, model = settings["name"], settings["servers"], settings["model"]
    try:
        if not config.embedded:
            raise UserError("`synthq run` is the embedded mode; unset SYNTHQ_BROKER_URL, or use "
                            "`synthq enqueue` with workers")
        given = [flag for flag, value in (("-d", dataset), ("-s", server), ("-m", model))
                 if value]
        resume = not given
        if resume and not job:
            raise UserError("give -d/--dataset, -s/--server and -m/--model, or --job NAME to "
                            "resume a stored job")
        if not resume and len(given) < 3:
            missing = [f for f in ("-d", "-s", "-m") if f not in given]
            raise UserError(f"missing {', '.join(missing)}: give all of -d, -s and -m, or "
                            "none of them with --job NAME to resume a stored job")
        if resume:
            _check_resume_flags(settings)
        spec = None if resume else job_spec(settings, str(dataset))
        with exclusive(config.data_dir):
            if spec is None:
                job_id = _stored_job(str(job), quiet=as_json)
            else:
                report = _enqueue(spec, str(dataset), quiet=as_json,
                                  id_field=settings["id_field"])
                if not as_json:
                    _print_report(report)
                job_id = report.job_id
            stop = threading.Event()
            _on_interrupt(stop)
            status = _run_with_progress(run_job, job_id, stop, quiet=as_json)
    except UserError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:
        from synthq.store.db import database_location, disk_full

        if not disk_full(exc):  # a full disk while enqueueing: the same one line
            raise
        raise fail(str(DiskFull(database_location()))) from None
    if as_json:
        print(json.dumps(status.to_dict()))
    else:
        print_status(status, stopped=stop.is_set())
    if stop.is_set():
        raise typer.Exit(130)
    if status.state == "paused" and status.pause_reason:
        # process.wrong_base_url: the first 404 from a URL without /v1 paused the job.
        raise fail(f"job {status.name} paused: {status.pause_reason} Fix it with `synthq "
                   f"resume {status.name}`, then run again with the right --server", code=1)
    failed = status.counts.get("failed", 0)
    if status.finished and failed and not status.counts.get("done", 0):
        hint = ""
        if status.failures.get("bad_request") and any(
                not u.rstrip("/").endswith("/v1") for u in status.servers):
            hint = "; bad_request: is --server the OpenAI base URL, ending in /v1?"
        raise fail(f"every sample failed ({failed:,}): see `synthq status {report.job_name}`; "
                   f"`synthq requeue {report.job_name} --failed` once fixed{hint}", code=1)


def _check_resume_flags(settings: dict[str, Any]) -> None:
    """`synthq run --job NAME` runs the stored settings: refuse other settings given with it
    rather than ignore them."""
    given = changed({k: v for k, v in settings.items() if k != "name"})
    if given:
        raise UserError(f"`synthq run --job NAME` resumes the job with its stored settings; "
                        f"{', '.join(given)} would be ignored. To change the settings of "
                        "samples to redo, use `synthq requeue NAME --max-tokens ...`")


def _stored_job(ref: str, *, quiet: bool) -> int:
    """The id of stored job ``ref`` (`synthq run --job NAME`), resumable or a UserError."""
    from synthq.core.enums import JobState
    from synthq.jobs.enqueue import find_job
    from synthq.store.db import session_scope

    ensure_db()
    with session_scope() as s:
        found = find_job(s, ref)
        if found.state == JobState.CANCELLED:
            raise UserError(f"job {found.name} is cancelled; it cannot be resumed")
        if found.state == JobState.PAUSED:
            why = f" ({found.pause_reason})" if found.pause_reason else ""
            raise UserError(f"job {found.name} is paused{why}; `synthq resume {found.name}` "
                            "first")
        job_id, name, model = found.id, found.name, found.model
    if not quiet:
        console.print(f"job [bold]{escape(name)}[/] (id {job_id}): resuming with its stored "
                      f"settings (model {escape(model)})")
    return job_id


def _on_interrupt(stop: threading.Event) -> None:
    def handler(signum, frame):  # type: ignore[no-untyped-def]
        if stop.is_set():  # second Ctrl-C: leave now; the next run reclaims the rest
            err.print("\nstopped; in-flight samples will be redone on the next run")
            os._exit(130)
        stop.set()
        err.print("\nstopping: no new requests; waiting for calls in flight "
                  "(Ctrl-C again to leave now)")

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _run_with_progress(run_job, job_id: int, stop: threading.Event, quiet: bool):  # type: ignore[no-untyped-def]
    if quiet:
        return run_job(job_id, stop=stop)
    with job_progress("generating") as update:
        return run_job(job_id, on_tick=update, stop=stop)
