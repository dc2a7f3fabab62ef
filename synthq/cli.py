"""The ``synthq`` command line.

Every command validates its input and prints a clear error (exit 2) instead of
a traceback. Commands that read or write jobs work on the database in
``SYNTHQ_DATABASE_URL`` (default: a SQLite file under ``./synthq-data/``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from synthq.config import get_settings
from synthq.errors import UserError

app = typer.Typer(
    name="synthq",
    help="Durable generation of EAGLE-3 drafter training data: enqueue prompts, run them "
    "against OpenAI-compatible servers, watch, repair.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database maintenance.", no_args_is_help=True)
app.add_typer(db_app, name="db")

console = Console()
err = Console(stderr=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def _ensure_db() -> None:
    """SQLite is migrated on the fly; PostgreSQL must be at head (``synthq db upgrade``)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from synthq.db import get_engine
    from synthq.migrate import alembic_config, upgrade

    settings = get_settings()
    if settings.is_sqlite:
        upgrade(settings.database_url)
        return
    head = ScriptDirectory.from_config(alembic_config(settings.database_url)).get_current_head()
    try:
        with get_engine().connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    except Exception as exc:  # noqa: BLE001 - any connection problem is the user's to fix
        raise UserError(f"cannot reach the database {settings.database_url!r}: {exc}") from exc
    if current != head:
        raise UserError(f"the database is at revision {current}, not {head}: "
                        "run `synthq db upgrade`")


def _json_option(value: str | None, flag: str) -> dict[str, Any]:
    if not value:
        return {}
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{flag} must be a JSON object, e.g. '{{\"enable_thinking\": true}}'")
    return data


# Options shared by `enqueue` and `run` (one definition each).
DatasetOpt = Annotated[str, typer.Option("--dataset", "-d", help="JSONL/Parquet file or "
                       "directory, or a Hugging Face dataset id (`name[:split]`).")]
ServerOpt = Annotated[list[str], typer.Option("--server", "-s", help="Base URL of an "
                      "OpenAI-compatible server, e.g. http://vllm:8000/v1. Repeat for several.")]
ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model name the server serves.")]
JobOpt = Annotated[str | None, typer.Option("--job", "-j", help="Job name [default: the "
                   "dataset's file name]. Same name and settings again = resume/add.")]
MaxTokensOpt = Annotated[int, typer.Option(help="max_tokens per answer.")]
TemperatureOpt = Annotated[float | None, typer.Option(help="Sampling temperature.")]
TopPOpt = Annotated[float | None, typer.Option(help="Nucleus sampling top_p.")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Total seconds one call may take.")]
StallOpt = Annotated[float, typer.Option(help="Seconds without a streamed chunk before a "
                     "call counts as stalled.")]
AttemptsOpt = Annotated[int, typer.Option(help="Calls per sample before it is failed.")]
BackoffBaseOpt = Annotated[float, typer.Option(help="Backoff base seconds (doubles per attempt, "
                           "full jitter).")]
BackoffCapOpt = Annotated[float, typer.Option(help="Backoff ceiling in seconds.")]
InflightOpt = Annotated[int, typer.Option(help="Most requests in flight per server (set it to "
                        "what the server batches, e.g. vLLM's max_num_seqs).")]
KeepTruncOpt = Annotated[bool, typer.Option("--keep-truncated/--drop-truncated", help="Keep "
                         "answers cut by max_tokens (finish_reason=length) as done.")]
TemplateKwOpt = Annotated[str | None, typer.Option(help="JSON object sent as "
                          "chat_template_kwargs, e.g. '{\"enable_thinking\": true}'.")]
ExtraBodyOpt = Annotated[str | None, typer.Option(help="JSON object of extra request fields.")]
TokenIdsOpt = Annotated[bool, typer.Option(help="Ask vLLM for token ids (return_token_ids).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")]


TokenizerOpt = Annotated[str | None, typer.Option(help="The target model's tokenizer (a local "
                        "path or Hugging Face id). With it, each answer is tokenized with an "
                        "assistant-only loss mask; without it, a sample is done once its answer "
                        "is stored.")]
ChatTemplateOpt = Annotated[Path | None, typer.Option(help="A Jinja chat template file that "
                            "overrides the tokenizer's own.", exists=True, dir_okay=False)]
MaxSeqLenOpt = Annotated[int, typer.Option(help="Truncate training examples to this many "
                         "tokens.")]
ReasoningOpt = Annotated[str, typer.Option(help="keep: reasoning_content is rendered into the "
                         "assistant turn and supervised; drop: left out.")]
MaskOpt = Annotated[str, typer.Option(help="last_turn: supervise the generated answer; "
                    "all_assistant_turns: also the dataset's earlier assistant turns.")]
ThinkOpenOpt = Annotated[str, typer.Option(help="Opens kept reasoning where the template has no "
                         "reasoning_content (escapes like \\n are read).")]
ThinkCloseOpt = Annotated[str, typer.Option(help="Closes kept reasoning where the template has "
                          "no reasoning_content.")]


def _spec(opts: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A JobSpec from the options shared by `enqueue` and `run`."""
    from synthq.enqueue import JobSpec

    sampling: dict[str, Any] = {}
    if opts["temperature"] is not None:
        sampling["temperature"] = opts["temperature"]
    if opts["top_p"] is not None:
        sampling["top_p"] = opts["top_p"]
    body = _json_option(opts["extra_body"], "--extra-body")
    kwargs = _json_option(opts["chat_template_kwargs"], "--chat-template-kwargs")
    if kwargs:  # the server renders with them, and so does our tokenizer
        body["chat_template_kwargs"] = kwargs
    if opts["return_token_ids"]:
        body["return_token_ids"] = True
    template = None
    if opts["chat_template"] is not None:
        template = opts["chat_template"].read_text()
    dataset = opts["dataset"]
    name = opts["job"] or Path(dataset.rstrip("/")).name.split(".")[0] or "job"
    return JobSpec(name=name, model=opts["model"],
                   servers=[s.rstrip("/") for s in opts["server"]],
                   max_tokens=opts["max_tokens"], sampling=sampling, extra_body=body,
                   total_timeout=opts["timeout"], stall_timeout=opts["stall_timeout"],
                   max_attempts=opts["max_attempts"], backoff_base=opts["backoff_base"],
                   backoff_cap=opts["backoff_cap"], inflight_limit=opts["inflight"],
                   keep_truncated=opts["keep_truncated"], tokenizer=opts["tokenizer"],
                   chat_template=template, chat_template_kwargs=kwargs,
                   max_seq_len=opts["max_seq_len"], reasoning=opts["reasoning"],
                   mask=opts["mask"], think_open=_unescape(opts["think_open"]),
                   think_close=_unescape(opts["think_close"]))


def _unescape(text: str) -> str:
    """``\\n`` typed on a command line becomes a newline."""
    return text.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")


def _enqueue(spec, dataset: str, quiet: bool):  # type: ignore[no-untyped-def]
    from synthq.enqueue import enqueue

    _ensure_db()
    if quiet:
        return enqueue(spec, dataset)
    with console.status("reading the dataset…") as st:
        return enqueue(spec, dataset, progress=lambda r: st.update(
            f"read {r.rows:,} rows, {r.inserted:,} new"))


def _print_report(report) -> None:  # type: ignore[no-untyped-def]
    verb = "created" if report.created else "found"
    console.print(f"job [bold]{report.job_name}[/] (id {report.job_id}) {verb}: "
                  f"{report.rows:,} rows read, {report.inserted:,} new samples, "
                  f"{report.duplicates:,} already there, {report.skipped:,} skipped")
    if report.rows and not report.inserted:
        console.print("nothing new to add: this data is already in the job")
    if report.updated_settings:
        console.print(f"updated settings: {', '.join(report.updated_settings)}")
    for index, reason in report.skip_examples[:5]:
        console.print(f"  [yellow]skipped row {index}:[/] {reason}")


@app.command()
def enqueue(
    dataset: DatasetOpt, server: ServerOpt, model: ModelOpt, job: JobOpt = None,
    max_tokens: MaxTokensOpt = 4096, temperature: TemperatureOpt = None, top_p: TopPOpt = None,
    timeout: TimeoutOpt = 1800.0, stall_timeout: StallOpt = 300.0, max_attempts: AttemptsOpt = 5,
    backoff_base: BackoffBaseOpt = 2.0, backoff_cap: BackoffCapOpt = 300.0,
    inflight: InflightOpt = 64, keep_truncated: KeepTruncOpt = False,
    chat_template_kwargs: TemplateKwOpt = None, extra_body: ExtraBodyOpt = None,
    return_token_ids: TokenIdsOpt = False, tokenizer: TokenizerOpt = None,
    chat_template: ChatTemplateOpt = None, max_seq_len: MaxSeqLenOpt = 4096,
    reasoning: ReasoningOpt = "keep", mask: MaskOpt = "last_turn",
    think_open: ThinkOpenOpt = "<think>\\n", think_close: ThinkCloseOpt = "\\n</think>\\n\\n",
    as_json: JsonOpt = False,
) -> None:
    """Add a dataset's prompts to a job (created if new). Prints the job id.

    Example: `synthq enqueue -d p.jsonl -s http://vllm:8000/v1 -m kimi --tokenizer /models/kimi`
    """
    opts = dict(locals())
    try:
        spec = _spec(opts)
        report = _enqueue(spec, dataset, quiet=as_json)
    except UserError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        print(report.to_json())
    else:
        _print_report(report)


@app.command()
def run(
    dataset: DatasetOpt, server: ServerOpt, model: ModelOpt, job: JobOpt = None,
    max_tokens: MaxTokensOpt = 4096, temperature: TemperatureOpt = None, top_p: TopPOpt = None,
    timeout: TimeoutOpt = 1800.0, stall_timeout: StallOpt = 300.0, max_attempts: AttemptsOpt = 5,
    backoff_base: BackoffBaseOpt = 2.0, backoff_cap: BackoffCapOpt = 300.0,
    inflight: InflightOpt = 64, keep_truncated: KeepTruncOpt = False,
    chat_template_kwargs: TemplateKwOpt = None, extra_body: ExtraBodyOpt = None,
    return_token_ids: TokenIdsOpt = False, tokenizer: TokenizerOpt = None,
    chat_template: ChatTemplateOpt = None, max_seq_len: MaxSeqLenOpt = 4096,
    reasoning: ReasoningOpt = "keep", mask: MaskOpt = "last_turn",
    think_open: ThinkOpenOpt = "<think>\\n", think_close: ThinkCloseOpt = "\\n</think>\\n\\n",
    as_json: JsonOpt = False,
) -> None:
    """Enqueue (or resume) a job and process it to the end in this process.

    The embedded default: a SQLite file under ./synthq-data, no Redis. Kill it
    (Ctrl-C, or kill -9) and run the same command again: it resumes, and done
    samples are not generated again.

    Example: `synthq run -d examples/prompts.jsonl -s http://127.0.0.1:8000/v1 -m sim-model`
    """
    opts = dict(locals())
    from synthq.embedded import exclusive, run_job

    settings = get_settings()
    try:
        if not settings.embedded:
            raise UserError("`synthq run` is the embedded mode; unset SYNTHQ_BROKER_URL, or use "
                            "`synthq enqueue` with workers")
        spec = _spec(opts)
        with exclusive(settings.data_dir):
            report = _enqueue(spec, dataset, quiet=as_json)
            if not as_json:
                _print_report(report)
            stop = threading.Event()
            _on_interrupt(stop)
            status = _run_with_progress(run_job, report.job_id, stop, quiet=as_json)
    except UserError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        print(json.dumps(status.to_dict()))
    else:
        _print_status(status)
    if stop.is_set():
        raise typer.Exit(130)


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
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        bar = progress.add_task("generating", total=None, detail="")

        def tick(status) -> None:  # type: ignore[no-untyped-def]
            c = status.counts
            finished = c["done"] + c["failed"] + c["skipped"]
            eta = f" ETA {status.eta_s:,.0f}s" if status.eta_s else ""
            progress.update(bar, total=status.total, completed=finished, detail=(
                f"done {c['done']:,} failed {c['failed']:,} running {c['running']:,} "
                f"{status.done_per_s:.1f}/s{eta}"))

        return run_job(job_id, on_tick=tick, stop=stop)


def _print_status(status) -> None:  # type: ignore[no-untyped-def]
    c = status.counts
    table = Table(title=f"job {status.name} (id {status.id}) — {status.state}, model "
                  f"{status.model}", show_header=True)
    for state in ("pending", "queued", "running", "done", "failed", "skipped"):
        table.add_column(state, justify="right")
    table.add_row(*(f"{c[s]:,}" for s in ("pending", "queued", "running", "done", "failed",
                                          "skipped")))
    console.print(table)
    eta = f", ETA {status.eta_s:,.0f} s" if status.eta_s else ""
    console.print(f"{status.done_per_s:.2f} done/s over the last minutes{eta}")
    if status.failures:
        console.print("failed by class: " + ", ".join(
            f"{k or '?'} {v:,}" for k, v in sorted(status.failures.items(), key=lambda x: -x[1])))
    if status.retrying:
        console.print("waiting to retry: " + ", ".join(
            f"{k} {v:,}" for k, v in status.retrying.items()))
    if status.calls:
        console.print(f"calls to servers: {sum(status.calls.values()):,} (" + ", ".join(
            f"{k} {v:,}" for k, v in sorted(status.calls.items(), key=lambda x: -x[1])) + ")")
    if status.tokenizer:
        stale = (f", [yellow]{status.stale_examples:,} examples still at an older version[/]"
                 if status.stale_examples else "")
        mismatch = (f", {status.token_mismatches:,} differ from the server's token ids"
                    if status.token_mismatches else "")
        console.print(f"examples: {status.num_tokens:,} tokens, {status.num_supervised:,} "
                      f"supervised (tokenizer {status.tokenizer}, version "
                      f"{status.tokenize_version}){stale}{mismatch}")
    if status.inflight:
        console.print("in flight: " + ", ".join(f"{k} {v}" for k, v in status.inflight.items()))
    if status.finished:
        console.print(f"[green]finished[/]: {c['done']:,} done, {c['failed']:,} failed, "
                      f"{c['skipped']:,} skipped")


JobArg = Annotated[str, typer.Argument(help="Job name or id.")]


def _with_job(ref: str, fn):  # type: ignore[no-untyped-def]
    from synthq.db import session_scope
    from synthq.enqueue import find_job

    try:
        _ensure_db()
        with session_scope() as s:
            return fn(s, find_job(s, ref))
    except UserError as exc:
        raise _fail(str(exc)) from None


@app.command()
def jobs(as_json: JsonOpt = False) -> None:
    """List jobs with their progress.

    Example: `synthq jobs --json`
    """
    from sqlalchemy import select

    from synthq.db import session_scope
    from synthq.models import Job
    from synthq.status import state_counts

    try:
        _ensure_db()
    except UserError as exc:
        raise _fail(str(exc)) from None
    rows: list[dict[str, Any]] = []
    with session_scope() as s:
        for job in s.scalars(select(Job).order_by(Job.id)):
            rows.append({"id": job.id, "name": job.name, "state": str(job.state),
                         "model": job.model, "created_at": job.created_at.isoformat(),
                         **state_counts(s, job.id)})
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        console.print("no jobs yet: `synthq enqueue --help`")
        return
    table = Table("id", "name", "state", "model", "done", "failed", "skipped", "open")
    for r in rows:
        table.add_row(str(r["id"]), r["name"], r["state"], r["model"], f"{r['done']:,}",
                      f"{r['failed']:,}", f"{r['skipped']:,}",
                      f"{r['pending'] + r['queued'] + r['running']:,}")
    console.print(table)


@app.command()
def status(
    job: Annotated[str | None, typer.Argument(help="Job name or id [default: the newest].")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw a live progress bar "
                     "until the job finishes (Ctrl-C to leave).")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with --watch.")] = 2.0,
    as_json: JsonOpt = False,
) -> None:
    """Counts per state, done/s, ETA, failures by class and load per server.

    Example: `synthq status my-job --watch`
    """
    from sqlalchemy import select

    from synthq.db import session_scope
    from synthq.models import Job
    from synthq.status import job_status

    ref = job
    if ref is None:
        try:
            _ensure_db()
        except UserError as exc:
            raise _fail(str(exc)) from None
        with session_scope() as s:
            newest = s.scalar(select(Job.id).order_by(Job.id.desc()).limit(1))
        if newest is None:
            raise _fail("no jobs yet: `synthq enqueue --help`")
        ref = str(newest)
    if not watch:
        result = _with_job(ref, job_status)
        if as_json:
            print(json.dumps(result.to_dict()))
        else:
            _print_status(result)
        return
    if interval <= 0:
        raise _fail("--interval must be positive")
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                      TextColumn("{task.fields[detail]}"), console=console) as progress:
            bar = progress.add_task(ref, total=None, detail="")
            while True:
                st = _with_job(ref, job_status)
                c = st.counts
                eta = f" ETA {st.eta_s:,.0f}s" if st.eta_s else ""
                progress.update(bar, total=st.total,
                                completed=c["done"] + c["failed"] + c["skipped"],
                                detail=f"done {c['done']:,} failed {c['failed']:,} running "
                                f"{c['running']:,} {st.done_per_s:.1f}/s{eta}")
                if st.finished:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    _print_status(_with_job(ref, job_status))


@app.command()
def requeue(
    job: JobArg,
    failed: Annotated[bool, typer.Option("--failed", help="Requeue failed samples "
                      "(the default when nothing else is given).")] = False,
    error_class: Annotated[list[str] | None, typer.Option("--class", help="Only failures of "
                           "this class (timeout, stalled, connection, rate_limited, "
                           "server_error, bad_request, context_length, empty_response, "
                           "truncated, ...). Repeatable.")] = None,
    sample: Annotated[list[int] | None, typer.Option("--sample", help="Only this sample id. "
                      "Repeatable.")] = None,
) -> None:
    """Move failed samples back to pending with a fresh attempt budget.

    Example: `synthq requeue my-job --failed --class timeout --class stalled`
    """
    from synthq import states
    from synthq.db import utcnow
    from synthq.errors import PERMANENT_CLASSES, RETRYABLE_CLASSES

    known = RETRYABLE_CLASSES | PERMANENT_CLASSES
    for c in error_class or []:
        if c not in known:
            raise _fail(f"unknown class {c!r}; known: {', '.join(sorted(known))}")

    def go(s, j) -> int:  # type: ignore[no-untyped-def]
        return states.requeue(s, j.id, classes=error_class or [], sample_ids=sample or [],
                              now=utcnow())

    n = _with_job(job, go)
    console.print(f"requeued {n:,} failed samples" + ("" if n else
                  " (nothing matched: see `synthq status`)"))


def _set_job_state(ref: str, target: str) -> None:
    from synthq.db import utcnow
    from synthq.states import JobState

    def go(s, j) -> str:  # type: ignore[no-untyped-def]
        if j.state == JobState.CANCELLED and target != JobState.CANCELLED:
            raise UserError(f"job {j.name} is cancelled; it cannot be resumed or paused")
        before = str(j.state)
        j.state = JobState(target)
        j.updated_at = utcnow()
        return before

    before = _with_job(ref, go)
    console.print(f"job {ref}: {before} → {target}")


@app.command()
def pause(job: JobArg) -> None:
    """Stop dispatching a job's samples; calls in flight finish.

    Example: `synthq pause my-job`
    """
    _set_job_state(job, "paused")


@app.command()
def resume(job: JobArg) -> None:
    """Dispatch a paused job again.

    Example: `synthq resume my-job`
    """
    _set_job_state(job, "active")


@app.command()
def cancel(job: JobArg) -> None:
    """Stop a job for good (its samples and results stay in the database).

    Example: `synthq cancel my-job`
    """
    _set_job_state(job, "cancelled")


@app.command("sample")
def show_sample(
    sample_id: Annotated[int, typer.Argument(help="Sample id (see `synthq status`).")],
    as_json: JsonOpt = False,
) -> None:
    """Show one sample: its prompt, response and every attempt.

    Example: `synthq sample 42`
    """
    from sqlalchemy import select

    from synthq.db import session_scope
    from synthq.models import Attempt, Sample

    try:
        _ensure_db()
    except UserError as exc:
        raise _fail(str(exc)) from None
    with session_scope() as s:
        smp = s.get(Sample, sample_id)
        if smp is None:
            raise _fail(f"no sample {sample_id}")
        attempts = s.scalars(select(Attempt).where(Attempt.sample_id == sample_id)
                             .order_by(Attempt.id)).all()
        data = {c.name: getattr(smp, c.name) for c in Sample.__table__.columns
                if c.name not in ("prompt_token_ids", "completion_token_ids", "input_ids",
                                  "loss_mask")}
        data["attempt_log"] = [{c.name: getattr(a, c.name) for c in Attempt.__table__.columns}
                               for a in attempts]
    if as_json:
        print(json.dumps(data, default=str))
        return
    console.print(f"[bold]sample {sample_id}[/] job {data['job_id']} row {data['dataset_index']}"
                  f" — {data['state']}, {data['attempts']} attempts, server {data['server']}")
    if data["error_class"]:
        console.print(f"[red]{data['error_class']}[/]: {data['error_message']}")
    for m in data["prompt"] or []:
        console.print(f"[cyan]{m['role']}:[/] {m['content']}")
    if data["reasoning_content"]:
        console.print(f"[magenta]reasoning:[/] {data['reasoning_content']}")
    if data["response_content"] is not None:
        console.print(f"[green]assistant:[/] {data['response_content']}")
        console.print(f"finish_reason={data['finish_reason']} tokens: prompt "
                      f"{data['prompt_tokens']}, completion {data['completion_tokens']}")
    if data["num_tokens"] is not None:
        console.print(f"example: {data['num_tokens']} tokens, {data['num_supervised']} "
                      f"supervised (tokenize_version {data['tokenize_version']})")
    table = Table("#", "server", "started", "outcome", "latency s", "ttft s", "tokens", "message")
    for i, a in enumerate(data["attempt_log"], 1):
        table.add_row(str(i), a["server"], str(a["started_at"])[:19], a["outcome"] or "running",
                      f"{a['latency_s']:.2f}" if a["latency_s"] is not None else "",
                      f"{a['ttft_s']:.2f}" if a["ttft_s"] is not None else "",
                      str(a["completion_tokens"] or ""), (a["error_message"] or "")[:80])
    console.print(table)


def _celery(args: list[str]) -> None:
    settings = get_settings()
    if settings.embedded:
        raise _fail("SYNTHQ_BROKER_URL is not set: workers need a Redis broker "
                    "(or use `synthq run`, the embedded mode)")
    cmd = [sys.executable, "-m", "celery", "-A", "worker.app", *args]
    os.execv(sys.executable, cmd)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    concurrency: Annotated[int, typer.Option("-c", "--concurrency", help="Threads: calls in "
                           "flight in this process.")] = 128,
) -> None:
    """Start a generation worker (celery worker, threads pool). Extra args go to celery.

    Example: `SYNTHQ_BROKER_URL=redis://localhost:6379/0 synthq worker -c 128`
    """
    if concurrency < 1:
        raise _fail("--concurrency must be at least 1")
    _celery(["worker", "-Q", "generate,control,tokenize", "-P", "threads", "-c", str(concurrency),
             "-E", "--without-mingle", "--without-gossip", "-l", "INFO", *ctx.args])


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def beat(ctx: typer.Context) -> None:
    """Start the scheduler that runs the dispatcher and lease sweep every second.

    Example: `SYNTHQ_BROKER_URL=redis://localhost:6379/0 synthq beat`
    """
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _celery(["beat", "-l", "INFO", "--schedule", str(settings.data_dir / "celerybeat-schedule"),
             *ctx.args])


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply the Alembic migrations to SYNTHQ_DATABASE_URL.

    Example: `SYNTHQ_DATABASE_URL=postgresql://synthq@db/synthq synthq db upgrade`
    """
    from synthq.migrate import upgrade

    url = get_settings().database_url
    try:
        upgrade(url, revision)
    except Exception as exc:  # noqa: BLE001 - show the cause, not a traceback
        raise _fail(f"migration failed on {url}: {exc}") from None
    console.print(f"database at {revision}")


@app.command()
def simulate(
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    capacity: Annotated[int, typer.Option(help="Requests served at once; more wait "
                        "(like vLLM's max_num_seqs).")] = 64,
    latency: Annotated[float, typer.Option(help="Seconds before the first token.")] = 0.5,
    tokens_per_second: Annotated[float, typer.Option(help="Streaming speed per request "
                                 "(0: all at once).")] = 0.0,
    response_tokens: Annotated[int, typer.Option(help="Words in an answer.")] = 32,
    reasoning: Annotated[bool, typer.Option(help="Stream reasoning_content first.")] = False,
    model: Annotated[str, typer.Option(help="Model name to serve.")] = "sim-model",
    hang_rate: Annotated[float, typer.Option(help="Share of requests never answered.")] = 0.0,
    stall_rate: Annotated[float, typer.Option(help="Share of streams that stop "
                          "mid-way.")] = 0.0,
    rate_limit_rate: Annotated[float, typer.Option(help="Share answered 429 + "
                               "Retry-After.")] = 0.0,
    error_rate: Annotated[float, typer.Option(help="Share answered 500.")] = 0.0,
    context_length_rate: Annotated[float, typer.Option(help="Share answered 400 context "
                                   "length.")] = 0.0,
    reset_rate: Annotated[float, typer.Option(help="Share whose connection is reset "
                          "mid-stream.")] = 0.0,
    empty_rate: Annotated[float, typer.Option(help="Share answered with empty content.")] = 0.0,
    length_rate: Annotated[float, typer.Option(help="Share cut with "
                           "finish_reason=length.")] = 0.0,
    retry_after: Annotated[float, typer.Option(help="Retry-After seconds sent with "
                           "429s.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Random seed for the fault draws.")] = None,
) -> None:
    """Serve a simulated OpenAI-compatible model: a TEST AND DEMO tool, not a model.

    Latency, capacity and fault injection by rate; `GET /sim/stats` reports its
    counters (including the most requests it served at once). A prompt whose
    last user message contains `[[sim:error*2]]` gets that fault on its first 2
    requests.

    Example: `synthq simulate --port 8000 --capacity 16 --latency 0.5 --error-rate 0.05`
    """
    from synthq.simulator import SimConfig, serve

    rates = dict(hang_rate=hang_rate, stall_rate=stall_rate, rate_limit_rate=rate_limit_rate,
                 error_rate=error_rate, context_length_rate=context_length_rate,
                 reset_rate=reset_rate, empty_rate=empty_rate, length_rate=length_rate)
    for name, value in rates.items():
        if not 0.0 <= value <= 1.0:
            raise _fail(f"--{name.replace('_', '-')} must be between 0 and 1")
    if sum(rates.values()) > 1.0:
        raise _fail("the fault rates add up to more than 1")
    if capacity < 1 or latency < 0 or tokens_per_second < 0 or response_tokens < 1 \
            or retry_after < 0:
        raise _fail("--capacity and --response-tokens must be >= 1; --latency and "
                    "--tokens-per-second >= 0")
    if not 0 < port < 65536:
        raise _fail("--port must be 1..65535")
    config = SimConfig(capacity=capacity, latency=latency, tokens_per_second=tokens_per_second,
                       response_tokens=response_tokens, reasoning=reasoning, model=model,
                       retry_after=retry_after, seed=seed, **rates)  # type: ignore[arg-type]
    err.print(f"simulator (test/demo tool) on http://{host}:{port}/v1, model {model!r}")
    serve(config, host=host, port=port)


@app.command()
def export(
    job: JobArg,
    out: Annotated[str, typer.Option("--out", "-o", help="Directory to create (written "
                   "atomically: it appears complete or not at all).")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="`parquet` (id, input_ids, "
                   "loss_mask, conversations) or `jsonl` (SpecForge conversations).")] = "parquet",
    shard_size: Annotated[int, typer.Option(help="Rows per shard file.")] = 10_000,
    include_truncated: Annotated[bool, typer.Option("--include-truncated/--exclude-truncated",
                                 help="Export answers cut by max_tokens (kept as done by "
                                 "--keep-truncated).")] = True,
    allow_stale: Annotated[bool, typer.Option("--allow-stale", help="Parquet: leave out done "
                           "samples not yet retokenized instead of refusing.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export "
                         "in --out.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a job's done samples as Parquet or JSONL shards plus manifest.json.

    Example: `synthq export my-job --format parquet --out exports/my-job --shard-size 50000`
    """
    from pathlib import Path

    from rich.progress import MofNCompleteColumn

    from synthq.export import check_options, export_job

    try:
        check_options(fmt, shard_size)
    except UserError as exc:
        raise _fail(str(exc)) from None
    job_id = _with_job(job, lambda s, j: j.id)
    kwargs: dict[str, Any] = dict(fmt=fmt, shard_size=shard_size, overwrite=overwrite,
                                  include_truncated=include_truncated, allow_stale=allow_stale)
    try:
        if as_json:
            manifest = export_job(job_id, Path(out), **kwargs)
        else:
            with Progress(TextColumn("[bold]exporting"), BarColumn(), TaskProgressColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console) as progress:
                bar = progress.add_task("export", total=None)
                manifest = export_job(job_id, Path(out), progress=lambda n, total:
                                      progress.update(bar, completed=n, total=total), **kwargs)
    except UserError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        print(manifest.to_json())
        return
    tokens = (f", {manifest.num_tokens:,} tokens ({manifest.num_supervised:,} supervised)"
              if manifest.num_tokens is not None else "")
    console.print(f"exported {manifest.exported:,} samples to {out} in "
                  f"{len(manifest.shards)} {fmt} shard(s){tokens}")
    left_out = {k: v for k, v in manifest.excluded.items() if v}
    if left_out:
        console.print("left out: " + ", ".join(f"{v:,} {k}" for k, v in left_out.items()))


@app.command()
def retokenize(
    job: JobArg,
    tokenizer: Annotated[str | None, typer.Option(help="A new tokenizer (path or id).")] = None,
    chat_template: ChatTemplateOpt = None,
    chat_template_kwargs: Annotated[str | None, typer.Option(
        help="JSON object of template variables for tokenizing.")] = None,
    max_seq_len: Annotated[int | None, typer.Option(help="A new maximum length.")] = None,
    reasoning: Annotated[str | None, typer.Option(help="keep or drop.")] = None,
    mask: Annotated[str | None, typer.Option(help="last_turn or all_assistant_turns.")] = None,
    batch_size: Annotated[int, typer.Option(help="Samples per task.")] = 200,
    wait: Annotated[bool, typer.Option(help="Wait and show progress until every example is "
                    "recomputed (with workers).")] = True,
) -> None:
    """Recompute every example from the stored responses, with zero calls to the servers.

    Changes the job's tokenization settings (or keeps them), then re-tokenizes
    done samples and those tokenization failed or skipped. With a broker the
    batches run on the workers' `tokenize` queue; in embedded mode, here.

    Example: `synthq retokenize my-job --max-seq-len 8192 --chat-template fixed.jinja`
    """
    from synthq import retokenize as rt
    from synthq.db import session_scope

    if batch_size < 1:
        raise _fail("--batch-size must be at least 1")
    changes: dict[str, Any] = {}
    try:
        if tokenizer is not None:
            changes["tokenizer"] = tokenizer
        if chat_template is not None:
            changes["chat_template"] = chat_template.read_text()
        if chat_template_kwargs is not None:
            changes["chat_template_kwargs"] = _json_option(chat_template_kwargs,
                                                           "--chat-template-kwargs")
        if max_seq_len is not None:
            changes["max_seq_len"] = max_seq_len
        if reasoning is not None:
            changes["reasoning"] = reasoning
        if mask is not None:
            changes["mask"] = mask
        job_id, version = _with_job(job, lambda s, j: (j.id, rt.configure(s, j, changes)))
    except UserError as exc:
        raise _fail(str(exc)) from None
    console.print(f"job {job}: tokenize_version {version}"
                  + (f" ({', '.join(changes)} changed)" if changes else ""))
    settings = get_settings()
    with Progress(TextColumn("[bold]retokenizing"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("retokenize", total=None)

        def show(stale: int, total: int) -> None:
            progress.update(bar, total=total, completed=total - stale)

        if settings.embedded:
            result = rt.run_in_process(job_id, batch_size=batch_size, progress=show)
            progress.stop()
            console.print(f"{result.done:,} done, {result.failed:,} failed, "
                          f"{result.skipped:,} skipped")
            return
        from worker.tasks import publish_retokenize

        sent = False
        last_stale, moved_at = -1, time.monotonic()
        while True:
            with session_scope() as s:
                stale, total = rt.count_stale(s, job_id, version)
                show(stale, total)
                if stale != last_stale:
                    last_stale, moved_at = stale, time.monotonic()
                # Send what is stale at first, and again when nothing moved for 30 s:
                # a lost message, or samples a worker finished at the old version.
                if stale and (not sent or time.monotonic() - moved_at > 30):
                    ids = rt.stale_ids(s, job_id, version, limit=10**9)
                    publish_retokenize(job_id, [ids[i:i + batch_size]
                                                for i in range(0, len(ids), batch_size)])
                    sent, moved_at = True, time.monotonic()
            if not stale or not wait:
                break
            time.sleep(1.0)
    if wait:
        console.print(f"every example of job {job} is at tokenize_version {version}")
    else:
        console.print("batches sent; `synthq status` shows the progress")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
