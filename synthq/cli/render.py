"""How the CLI draws a job: the status summary and the live progress bar."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from synthq.cli import console, escape
from synthq.core.enums import FINISHED, SampleState

if TYPE_CHECKING:
    from synthq.views.report import JobStatus


def _progress() -> Any:
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                    TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                    console=console.get())


@contextmanager
def job_progress(description: str) -> Iterator[Any]:
    """A live bar; call the yielded function with each new JobStatus."""
    with _progress() as progress:
        bar = progress.add_task(escape(description), total=None, detail="")
        failing: dict[str, str | None] = {}
        yield lambda status: _show(progress, bar, status, failing)


@contextmanager
def jobs_progress() -> Iterator[Any]:
    """A live bar per job; call the yielded function with the JobStatus of each job to
    show (a job seen first gets a new bar; a bar stays once its job is finished)."""
    with _progress() as progress:
        bars: dict[int, Any] = {}
        failing: dict[str, str | None] = {}

        def update(statuses: list[JobStatus]) -> None:
            unhealthy: dict[str, str | None] = {}
            for status in statuses:
                if status.id not in bars:
                    bars[status.id] = progress.add_task(escape(status.name), total=None,
                                                        detail="")
                unhealthy.update(status.unhealthy)
                _show(progress, bars[status.id], status, failing, servers=False)
            _servers(progress, unhealthy, failing)

        yield update


def _servers(progress: Any, unhealthy: dict[str, str | None],
             failing: dict[str, str | None]) -> None:
    """A server failing its probe gets a line above the bars, and one when it is back."""
    for url, error in unhealthy.items():
        if url not in failing:
            progress.console.print(f"[red]server {escape(url)}:[/] health probe "
                                   f"{escape(error or 'failing')}", highlight=False)
    for url in set(failing) - set(unhealthy):
        progress.console.print(f"[green]server {escape(url)}:[/] answers again")
    failing.clear()
    failing.update(unhealthy)


def _show(progress: Any, bar: Any, status: JobStatus, failing: dict[str, str | None],
          servers: bool = True) -> None:
    """Bar ``bar`` at ``status``: samples finished of all, and the detail line."""
    if servers:
        _servers(progress, status.unhealthy, failing)
    c = status.counts
    eta = f" ETA {status.eta_s:,.0f}s" if status.eta_s else ""
    auto = [str(v["limit"]) for v in status.limits.values() if v.get("auto")]
    limit = f" limit {'/'.join(auto)}" if auto else ""
    progress.update(bar, total=status.total,
                    completed=sum(c[s] for s in FINISHED),
                    detail=f"done {c['done']:,} failed {c['failed']:,} running "
                    f"{c['running']:,} {status.done_per_s:.1f}/s{eta}{limit}")


def print_status(status: JobStatus, *, stopped: bool = False) -> None:
    """The job's summary. ``stopped``: this `synthq run` was interrupted (Ctrl-C), so the
    hint is to run it again, not to start a worker."""
    from rich.table import Table

    c = status.counts
    # Every sample is terminal: the job is finished, though the tick that marks its row
    # may not have run yet (the footer below says "finished" from the same counts).
    state = "finished" if status.finished and status.state == "active" else status.state
    table = Table(title=f"job {escape(status.name)} (id {status.id}) — {state}, model "
                  f"{escape(status.model)}", show_header=True)
    for state in SampleState:
        table.add_column(state.value, justify="right")
    table.add_row(*(f"{c[s]:,}" for s in SampleState))
    console.print(table)
    if status.pause_reason:
        console.print(f"[yellow]paused by synthq:[/] {escape(status.pause_reason)}")
    # One ETA: the cost report's projection (calls left × tokens per call ÷ tokens/s,
    # turns counted) where there is one, else open samples ÷ done/s.
    remaining = (status.cost or {}).get("remaining_s") or status.eta_s
    eta = f", ETA {_duration(remaining)}" if remaining else ""
    console.print(f"{status.done_per_s:.2f} done/s over the last minutes{eta}")
    if status.regenerate == "all":
        cut = (f", {status.cut:,} conversations cut where a regenerated tool call did not "
               "match the dataset's" if status.cut else "")
        console.print(f"turns: {status.turns_done:,} / {status.turns_total:,} done "
                      f"(every assistant turn regenerated){cut}")
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
                      f"supervised (tokenizer {escape(status.tokenizer)}, version "
                      f"{status.tokenize_version}){stale}{mismatch}")
    for url, error in status.unhealthy.items():
        console.print(f"[red]server {escape(url)} fails its health probe[/] "
                      f"({escape(error or '')}): nothing is sent")
    if status.inflight:
        console.print("in flight: " + ", ".join(f"{escape(k)} {v}"
                                                for k, v in status.inflight.items()))
    for url, lim in status.limits.items():
        if lim.get("auto"):
            console.print(f"limit {escape(url)}: {lim['limit']} (auto {lim['floor']}–"
                          f"{lim['cap']}; last change: {escape(str(lim.get('reason') or '-'))})",
                          highlight=False)
    if status.cost:
        console.print(cost_line(status.cost), highlight=False)
    for line in status.capture.lines() if status.capture else ():
        console.print(escape(line), highlight=False)
    for sp in status.spool:
        console.print(f"spool of run {sp['run']} ({sp['state']}): {sp['bytes']:,} of "
                      f"{sp['size']:,} bytes, {sp['files']:,} files, high-water "
                      f"{sp['high_water']:,} bytes, capture lead {sp['lead']:,} examples",
                      highlight=False)
    if status.workers and not status.finished:  # a finished job holds no worker's load
        console.print("workers: " + ", ".join(
            f"{escape(w['name'])} {w['inflight']}/{w['capacity']}" for w in status.workers))
    elif status.open and not status.finished:
        _no_worker_hint(status, stopped)
    for warning in status.warnings:
        console.print(f"[yellow]warning[/]: {escape(warning)}", highlight=False)
    if status.finished:
        console.print(f"[green]finished[/]: {c['done']:,} done, {c['failed']:,} failed, "
                      f"{c['skipped']:,} skipped")


def _no_worker_hint(status: JobStatus, stopped: bool) -> None:
    """Why nothing runs, and the command that runs it: embedded jobs have no worker."""
    from synthq.spec.config import get_settings

    left = f"{status.open:,} samples left"
    if stopped:
        console.print(f"[yellow]stopped[/]: {left}; run the same command again (or `synthq "
                      f"run --job {escape(status.name)}`) to resume")
    elif get_settings().embedded:
        console.print(f"[yellow]not running[/]: {left}; `synthq run --job "
                      f"{escape(status.name)}` resumes it")
    else:
        console.print(f"[yellow]no live worker[/]: {left}; start `synthq worker`")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def cost_line(cost: dict[str, Any]) -> str:
    """One line of the cost report (synthq.store.cost): busy GPU time, tokens, dollars."""
    parts = [f"cost: {_duration(cost['busy_s'])} busy × {cost['gpus']} GPU "
             f"= {cost['gpu_hours']:.3f} GPU-h, {cost['tokens']:,} tokens generated, "
             f"{cost['tokens_per_s']:,.0f} tok/s while busy"]
    if cost.get("dollars") is not None:
        parts.append(f"${cost['dollars']:,.2f} so far at ${cost['gpu_hour_price']:g}/GPU-h")
    if cost.get("dollars_per_mtok") is not None:
        parts.append(f"${cost['dollars_per_mtok']:,.2f} per 1M tokens")
    # The time left is the summary's ETA (print_status): said once, not here again.
    if cost.get("remaining_s") and cost.get("remaining_dollars") is not None:
        parts.append(f"≈ ${cost['remaining_dollars']:,.2f} more to finish")
    return "; ".join(parts)
