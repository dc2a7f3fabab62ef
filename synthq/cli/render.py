"""How the CLI draws a job: the status summary and the live progress bar."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from synthq.cli import console
from synthq.enums import FINISHED, SampleState

if TYPE_CHECKING:
    from synthq.status import JobStatus


@contextmanager
def job_progress(description: str) -> Iterator[Any]:
    """A live bar; call the yielded function with each new JobStatus."""
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task(description, total=None, detail="")

        def update(status: JobStatus) -> None:
            c = status.counts
            eta = f" ETA {status.eta_s:,.0f}s" if status.eta_s else ""
            progress.update(bar, total=status.total,
                            completed=sum(c[s] for s in FINISHED),
                            detail=f"done {c['done']:,} failed {c['failed']:,} running "
                            f"{c['running']:,} {status.done_per_s:.1f}/s{eta}")

        yield update


def print_status(status: JobStatus) -> None:
    from rich.table import Table

    c = status.counts
    table = Table(title=f"job {status.name} (id {status.id}) — {status.state}, model "
                  f"{status.model}", show_header=True)
    for state in SampleState:
        table.add_column(state.value, justify="right")
    table.add_row(*(f"{c[s]:,}" for s in SampleState))
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
    for url, error in status.unhealthy.items():
        console.print(f"[red]server {url} fails its health probe[/] ({error}): nothing is sent")
    if status.inflight:
        console.print("in flight: " + ", ".join(f"{k} {v}" for k, v in status.inflight.items()))
    if status.workers:
        console.print("workers: " + ", ".join(
            f"{w['name']} {w['inflight']}/{w['capacity']}" for w in status.workers))
    elif status.open and not status.finished:
        console.print("[yellow]no live worker[/]: start `synthq worker` (or use `synthq run`)")
    if status.finished:
        console.print(f"[green]finished[/]: {c['done']:,} done, {c['failed']:,} failed, "
                      f"{c['skipped']:,} skipped")
