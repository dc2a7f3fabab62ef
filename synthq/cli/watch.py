"""Looking at jobs: `synthq jobs`, `synthq status`, `synthq sample`."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from synthq.cli import (
    JsonOpt,
    app,
    console,
    ensure_db,
    fail,
    with_job,
)
from synthq.core.errors import UserError


@app.command()
def jobs(as_json: JsonOpt = False) -> None:
    """List jobs with their progress.

    Example: `synthq jobs --json`
    """
    from synthq.cli.fast import job_rows

    rows = job_rows()
    if rows is None:
        rows = _job_rows()
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        console.print("no jobs yet: `synthq enqueue --help`")
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table("id", "name", "state", "model", "done", "failed", "skipped", "open")
    for r in rows:
        table.add_row(str(r["id"]), escape(r["name"]), r["state"], escape(r["model"]),
                      f"{r['done']:,}",
                      f"{r['failed']:,}", f"{r['skipped']:,}",
                      f"{r['pending'] + r['queued'] + r['running']:,}")
    console.print(table)


def _job_rows() -> list[dict[str, Any]]:
    from synthq.store.counts import job_list
    from synthq.store.db import session_scope

    try:
        ensure_db()
    except UserError as exc:
        raise fail(str(exc)) from None
    with session_scope() as s:
        return job_list(s)


@app.command()
def status(
    job: Annotated[str | None, typer.Argument(help="Job name or id [default: the newest].")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Live progress bars until "
                     "the job finishes; without JOB, one per active job, waiting for the "
                     "first (Ctrl-C to leave).")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with --watch.")] = 2.0,
    as_json: JsonOpt = False,
) -> None:
    """Counts per state, done/s, ETA, failures by class and load per server.

    Example: `synthq status my-job --watch`
    """
    from synthq.cli.render import job_progress, print_status  # not for --json
    from synthq.views.report import job_status

    if not watch:
        from synthq.cli import fast

        result = fast.job_status(job)  # the embedded default, read with sqlite3
        if result is None:
            result = with_job(_job_ref(job), job_status)
        if as_json:
            print(json.dumps(result.to_dict()))
        else:
            print_status(result)
        return
    if interval <= 0:
        raise fail("--interval must be positive")
    if job is None:
        _watch_every_job(interval)
        return
    try:
        with job_progress(job) as update:
            while True:
                st = with_job(job, job_status)
                update(st)
                if st.finished:
                    break
                _wait(interval)
    except KeyboardInterrupt:
        pass
    print_status(with_job(job, job_status))


def _wait(seconds: float) -> None:
    """The pause between two redraws of --watch (a test's hook)."""
    time.sleep(seconds)


def _watch_every_job(interval: float) -> None:
    """`synthq status --watch` without JOB: wait for a job if there is none yet, then a bar
    per job with samples open (new jobs get theirs as they come) until none has; then
    each watched job's summary (or the newest job's, when none was open)."""
    from synthq.cli.render import jobs_progress, print_status
    from synthq.views.report import job_status

    watched: dict[int, str] = {}
    newest: str | None = None
    try:
        ensure_db()
    except UserError as exc:
        raise fail(str(exc)) from None
    try:
        with jobs_progress() as update:
            said_waiting = False
            while True:
                rows = _job_rows()
                if not rows and not said_waiting:
                    console.print("no job yet: waiting for one (`synthq enqueue` or `synthq "
                                  "run`; Ctrl-C to leave)")
                    said_waiting = True
                open_ = [r for r in rows if r["pending"] + r["queued"] + r["running"]
                         and r["state"] not in ("cancelled", "paused")]
                watched.update((r["id"], r["name"]) for r in open_)
                newest = str(rows[-1]["id"]) if rows else None
                if watched:
                    update([with_job(str(i), job_status) for i in watched])
                if rows and not open_:
                    break
                _wait(interval)
    except KeyboardInterrupt:
        pass
    for ref in [str(i) for i in watched] or ([newest] if newest else []):
        print_status(with_job(ref, job_status))


def _job_ref(job: str | None) -> str:
    """``job``, or (None) the newest job's id."""
    if job is not None:
        return job
    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import Job

    try:
        ensure_db()
    except UserError as exc:
        raise fail(str(exc)) from None
    with session_scope() as s:
        newest = s.scalar(select(Job.id).order_by(Job.id.desc()).limit(1))
    if newest is None:
        raise fail("no jobs yet: `synthq enqueue --help`")
    return str(newest)


@app.command("sample")
def show_sample(
    sample_id: Annotated[int, typer.Argument(help="Sample id (see `synthq status`).")],
    as_json: JsonOpt = False,
) -> None:
    """Show one sample: its prompt, response and every attempt.

    Example: `synthq sample 42`
    """
    from dataclasses import asdict

    from rich.table import Table

    from synthq.store.db import session_scope
    from synthq.views.query import sample_detail

    try:
        ensure_db()
    except UserError as exc:
        raise fail(str(exc)) from None
    with session_scope() as s:
        detail = sample_detail(s, sample_id)
    if detail is None:
        raise fail(f"no sample {sample_id}")
    # The record GET /api/samples/{id} answers (synthq.views.query.SampleDetail), URLs masked.
    data = asdict(detail)
    if as_json:
        print(json.dumps(data, default=_iso))
        return
    from rich.markup import escape

    source = f" (id {escape(data['source_id'])})" if data["source_id"] is not None else ""
    console.print(f"[bold]sample {sample_id}[/] job {data['job_id']} row "
                  f"{data['dataset_index'] + 1}{source} — {data['state']}, {_calls(data)}, "
                  f"server {escape(str(data['server']))}")
    if data["error_class"]:
        console.print(f"[red]{data['error_class']}[/]: {escape(str(data['error_message']))}")
    if data["overrides"]:
        console.print("own settings (requeue): " + escape(", ".join(
            f"{k}={json.dumps(v)}" for k, v in data["overrides"].items())))
    if data["tools"]:
        names = [t.get("function", {}).get("name") for t in data["tools"].get("tools", [])]
        console.print(f"tools: {escape(', '.join(str(n) for n in names))}")
    if data["turn_count"]:
        _print_turns(data)
    else:
        for m in data["prompt"] or []:
            _print_message(m)
        if data["reasoning_content"]:
            console.print(f"[magenta]reasoning:[/] {escape(data['reasoning_content'])}")
        if data["response_content"] is not None:
            _print_message({"role": "assistant", "content": data["response_content"],
                            "tool_calls": data["tool_calls"]}, "[green]assistant:[/]")
    if data["response_content"] is not None:
        console.print(f"finish_reason={data['finish_reason']} tokens: prompt "
                      f"{data['prompt_tokens']}, completion {data['completion_tokens']}")
    if data["num_tokens"] is not None and data["examples"]:
        # Per-turn examples (synthq.data.examples): their ids lie one after another.
        console.print(f"examples: {len(data['examples'])}, one per regenerated turn, "
                      f"{data['num_tokens']} tokens and {data['num_supervised']} supervised "
                      f"in all (tokenize_version {data['tokenize_version']})")
        for e in data["examples"]:
            console.print(f"  turn {e['turn'] + 1}: {e['tokens']} tokens, {e['supervised']} "
                          "supervised")
    elif data["num_tokens"] is not None:
        console.print(f"example: {data['num_tokens']} tokens, {data['num_supervised']} "
                      f"supervised (tokenize_version {data['tokenize_version']})")
    table = Table("#", "turn", "server", "started", "outcome", "latency s", "ttft s", "tokens",
                  "message")
    for i, a in enumerate(data["attempt_log"], 1):
        table.add_row(str(i), "" if a["turn"] is None else str(a["turn"] + 1),
                      escape(str(a["server"])), str(a["started_at"])[:19],
                      a["outcome"] or "running",
                      f"{a['latency_s']:.2f}" if a["latency_s"] is not None else "",
                      f"{a['ttft_s']:.2f}" if a["ttft_s"] is not None else "",
                      str(a["completion_tokens"] or ""), escape((a["error_message"] or "")[:80]))
    console.print(table)


def _iso(value: Any) -> str:
    """A datetime as the API writes it (ISO 8601); anything else as its text."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _print_message(m: dict, label: str | None = None) -> None:  # type: ignore[type-arg]
    from rich.markup import escape

    label = label or f"[cyan]{escape(str(m.get('role')))}:[/]"
    text = escape(str(m.get("content") or ""))
    for call in m.get("tool_calls") or []:
        function = call.get("function") or {}
        text += escape(f" → {function.get('name')}({function.get('arguments')})")
    if m.get("role") == "tool" and m.get("tool_call_id"):
        label += escape(f" [{m['tool_call_id']}]")
    console.print(f"{label} {text}")


def _calls(data: dict) -> str:  # type: ignore[type-arg]
    """``3 attempts``; a sample regenerated turn by turn counts its calls over its turns
    (``attempts`` restarts at each turn, the table below lists every call)."""
    def n(count: int, word: str) -> str:
        return f"{count} {word}{'' if count == 1 else 's'}"

    if not data["turn_count"]:
        return n(data["attempts"], "attempt")
    turns = {a["turn"] for a in data["attempt_log"]}
    return f"{n(len(data['attempt_log']), 'call')} over {n(len(turns), 'turn')}"


def _print_turns(data: dict) -> None:  # type: ignore[type-arg]
    """A conversation regenerated turn by turn: each turn's regenerated answer in place
    of the dataset's (``synthq.data.turns``), turns not generated yet marked so."""
    from rich.markup import escape

    from synthq.data.turns import turn_positions

    prompt, answers = data["prompt"] or [], data["turns"] or []
    positions = turn_positions(prompt)
    console.print(f"turns: {len(answers)} of {len(positions)} generated"
                  + (f"; cut after turn {data['cut_at_turn'] + 1}: "
                     f"{escape(str(data['cut_reason']))}" if data["cut_at_turn"] is not None
                     else ""))
    for i, m in enumerate([*prompt, None]):
        if i in positions:
            k = positions.index(i)
            if k < len(answers):
                answer = answers[k]
                if answer.get("reasoning_content"):
                    console.print(f"[magenta]turn {k + 1} reasoning:[/] "
                                  f"{escape(answer['reasoning_content'])}")
                _print_message({"role": "assistant", **answer},
                               f"[green]turn {k + 1} (regenerated, "
                               f"{answer.get('finish_reason')}):[/]")
            elif m is not None:
                _print_message(m, f"[dim]turn {k + 1} (dataset, not generated):[/]")
            else:
                console.print(f"[dim]turn {k + 1}: not generated yet[/]")
        elif m is not None:
            if data["cut_at_turn"] is not None and i > positions[data["cut_at_turn"]]:
                console.print("[yellow]… cut here[/]")
                break
            _print_message(m)
