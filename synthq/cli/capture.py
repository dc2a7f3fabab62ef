"""`synthq capture`: run or resume a job's hidden-state capture stage."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from synthq.cli import JobArg, JsonOpt, app, console, ensure_db, fail, warn
from synthq.cli.options import api_values, with_settings
from synthq.core.errors import UserError
from synthq.spec import jobspec


@app.command()
@with_settings([s.name for s in jobspec.CAPTURE if s.name != "capture_servers"],
               mode="retokenize")
def capture(
    job: JobArg,
    # The declared capture_servers, with this command's own short flags.
    capture_servers: Annotated[list[str] | None, typer.Option(
        "--server", "-s", "--capture-server", help="A capture server's base URL (…/v1): a "
        "vLLM started with extract_hidden_states and synthq's connector (see "
        "`scripts/vllm-cpu.sh --capture`). Repeat for several. It must answer; it is stored "
        "on the job [default: the job's].")] = None,
    *, settings: dict[str, Any],
    retry_failed: Annotated[bool, typer.Option(
        "--retry-failed", help="Send failed captures again (their attempts reset), and run "
        "a stage that synthq stopped (a server failed several captures in a row the same "
        "way) again, after the fix.")] = False,
    plan_only: Annotated[bool, typer.Option(
        "--plan", help="Print the disk plan and the stage's counts; capture nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Capture the hidden states of a job's done samples through the serving engine.

    Each sample's own input_ids are sent as the prompt (max_tokens 1); the
    engine's file is checked (token ids, shape, checksum) and moved into
    synthq's store (SYNTHQ_CAPTURE_STORE, default DATA_DIR/hidden-states).
    Rerun to resume: what is done stays done. The disk plan is printed first,
    and the stage refuses to start when the store's free space is short.

    Example: `synthq capture my-job --server http://capture:8000/v1 --target /models/target`
    """
    from synthq.app import service
    from synthq.capture import stage as capture_stage
    from synthq.jobs.enqueue import find_job
    from synthq.queue import capture_states
    from synthq.spec.config import get_settings
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Job

    try:
        ensure_db()
        given = {**api_values(settings), "capture_servers": capture_servers}
        with session_scope() as s:
            row = find_job(s, job)
            job_id = row.id
            # Checked, probed and stored as the API's PUT /api/jobs/{id}/capture does.
            service.set_capture(s, row, given)
            if retry_failed:
                from synthq.queue import jobs

                jobs.set_capture_stopped(s, job_id, None, now=utcnow())
                capture_states.requeue_failed(s, job_id, now=utcnow())
        if plan_only:
            with session_scope() as s:
                capture_states.add_missing(s, job_id, now=utcnow())
                p = capture_stage.plan(s, s.get_one(Job, job_id))
                left = capture_stage.summary(s, job_id)
            _print(p.line(), left, as_json, job_id)
            return
        config = get_settings()
        run = capture_stage.Stage(job_id, say=lambda line: console.print(line, highlight=False),
                                  reclaim_all=config.is_sqlite)
        if config.is_sqlite:
            from synthq.app.embedded import exclusive

            with exclusive(config.data_dir):
                left = run.run()
        else:
            left = run.run()
    except KeyboardInterrupt:
        warn("capture stopped: rerun the same command to resume (what is done stays done)")
        raise typer.Exit(130) from None
    except UserError as exc:
        raise fail(str(exc)) from None
    _print(None, left, as_json, job_id)
    if left.failures:
        raise typer.Exit(1)


def _print(plan_line: str | None, left: Any, as_json: bool, job_id: int) -> None:
    if as_json:  # the stage's record, as `synthq status --json` and the API show it
        from dataclasses import asdict

        from synthq.capture.progress import capture_progress
        from synthq.core.defaults import store_root
        from synthq.spec.config import get_settings
        from synthq.store.db import session_scope
        from synthq.store.sqlread import reader_of

        settings = get_settings()
        with session_scope() as s:
            record = capture_progress(reader_of(s), job_id, store=store_root(
                settings.capture_store, settings.data_dir))
        console.print_json(json.dumps({"plan": plan_line,
                                       **(asdict(record) if record else {})}))
        return
    if plan_line:
        console.print(plan_line, highlight=False)
    failures = ", ".join(f"{k} {v}" for k, v in sorted(left.failures.items())) or "none"
    console.print(f"capture: {left.done}/{left.total} done, {left.bytes / 1e6:.1f} MB, "
                  f"{left.tokens:,} tokens, {left.calls} calls; failed: {failures}",
                  highlight=False)
