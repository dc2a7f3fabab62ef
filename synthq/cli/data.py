"""Training data: `synthq retokenize` and `synthq export`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from synthq.cli import (
    JobArg,
    JsonOpt,
    app,
    console,
    escape,
    fail,
    with_job,
)
from synthq.cli.options import api_values, with_settings
from synthq.core.errors import UserError
from synthq.spec import jobspec


@app.command()
def export(
    job: JobArg,
    out: Annotated[str, typer.Option("--out", "-o", help="Directory to create (written "
                   "atomically: it appears complete or not at all).")],
    fmt: Annotated[str, typer.Option("--format", "-f",
                   metavar="<parquet|jsonl|speculators|specforge>",
                   help="`parquet` (id, source_id, "
                   "input_ids, loss_mask, conversations), `jsonl` (SpecForge conversations, "
                   "with id and source_id), or the captured features (`synthq capture`) in "
                   "a peer's offline layout: `speculators` (its datasets folder with "
                   "hidden_states/hs_{i} linked into synthq's store) or `specforge` (its "
                   ".ckpt files, hidden_state after the target's final norm).")] = "parquet",
    shard_size: Annotated[int, typer.Option(help="Rows per shard file.")] = 10_000,
    include_truncated: Annotated[bool, typer.Option("--include-truncated/--exclude-truncated",
                                 help="Export answers cut by max_tokens (kept as done by "
                                 "--keep-truncated).")] = True,
    allow_stale: Annotated[bool, typer.Option("--allow-stale", help="Parquet: leave out done "
                           "samples not yet retokenized instead of refusing.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export "
                         "in --out.")] = False,
    target: Annotated[str | None, typer.Option("--target", "-t", help="speculators/specforge: "
                      "the target's folder (config.json; SpecForge reads its final norm and "
                      "lm_head) [default: the job's --train-target, else its tokenizer "
                      "folder].")] = None,
    draft_vocab_size: Annotated[int, typer.Option(min=1, help="speculators: the draft "
                                "vocabulary written as d2t-N.npy/t2d-N.npy (as `synthq train` "
                                "picks it; none when it is the target's whole vocabulary); "
                                "speculators reads them given --draft-vocab-size N."
                                )] = 32_000,
    as_json: JsonOpt = False,
) -> None:
    """Write a job's done samples as Parquet or JSONL shards plus manifest.json.

    Example: `synthq export my-job --format parquet --out exports/my-job --shard-size 50000`
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from synthq.jobs.export import FEATURE_FORMATS, check_options, export_job

    try:
        check_options(fmt, shard_size, features=True)
    except UserError as exc:
        raise fail(str(exc)) from None
    job_id = with_job(job, lambda s, j: j.id)
    if fmt in FEATURE_FORMATS:
        _export_features(job_id, out, fmt, target=target, draft_vocab_size=draft_vocab_size,
                         overwrite=overwrite, as_json=as_json)
        return
    kwargs: dict[str, Any] = dict(fmt=fmt, shard_size=shard_size, overwrite=overwrite,
                                  include_truncated=include_truncated, allow_stale=allow_stale)
    with _export_errors(out):
        if as_json:
            manifest = export_job(job_id, Path(out), **kwargs)
        else:
            with Progress(TextColumn("[bold]exporting"), BarColumn(), TaskProgressColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console.get()) as progress:
                bar = progress.add_task("export", total=None)
                manifest = export_job(job_id, Path(out), progress=lambda n, total:
                                      progress.update(bar, completed=n, total=total), **kwargs)
    if as_json:
        print(manifest.to_json())
        return
    tokens = (f", {manifest.num_tokens:,} tokens ({manifest.num_supervised:,} supervised)"
              if manifest.num_tokens is not None else "")
    what = (f"{manifest.exported:,} examples (one per regenerated turn) of "
            f"{manifest.samples:,} samples" if manifest.examples == "per-turn"
            else f"{manifest.exported:,} samples")
    console.print(f"exported {what} to {escape(out)} in "
                  f"{len(manifest.shards)} {fmt} shard(s){tokens}")
    left_out = {k: v for k, v in manifest.excluded.items() if v}
    if left_out:
        console.print("left out: " + ", ".join(f"{v:,} {k}" for k, v in left_out.items()))


@contextmanager
def _export_errors(out: str) -> Iterator[None]:
    """An export's errors as one line each (exit 2): what the user can fix, or the disk's."""
    try:
        yield
    except UserError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise fail(f"cannot write the export to {out}: {exc.strerror or exc}{where}") from None


def _export_features(job_id: int, out: str, fmt: str, *, target: str | None,
                     draft_vocab_size: int, overwrite: bool, as_json: bool) -> None:
    """`synthq export --format speculators|specforge`: synthq.training.export_features."""
    from synthq.training.export_features import export_features

    with _export_errors(out):
        manifest = export_features(job_id, Path(out), fmt=fmt, target=target,
                                   draft_vocab_size=draft_vocab_size, overwrite=overwrite)
    if as_json:
        print(manifest.to_json())
        return
    how = ", ".join(f"{n:,} {k}" for k, n in sorted(manifest.files.items()))
    console.print(f"exported {manifest.exported:,} captured examples of {manifest.samples:,} "
                  f"samples to {escape(out)} for {fmt} ({how}; {manifest.bytes_written:,} B "
                  "written)")


@app.command()
@with_settings(jobspec.RETOKENIZABLE, mode="retokenize")
def retokenize(
    job: JobArg,
    settings: dict[str, Any],
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
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    from synthq.jobs import retokenize as rt
    from synthq.spec.config import get_settings
    from synthq.store.db import session_scope

    if batch_size < 1:
        raise fail("--batch-size must be at least 1")
    try:
        changes = jobspec.check_values(api_values(settings))
        job_id, version = with_job(job, lambda s, j: (j.id, rt.configure(s, j, changes)))
    except UserError as exc:
        raise fail(str(exc)) from None
    console.print(f"job {escape(job)}: tokenize_version {version}"
                  + (f" ({', '.join(changes)} changed)" if changes else ""))
    config = get_settings()
    with Progress(TextColumn("[bold]retokenizing"), BarColumn(), TaskProgressColumn(),
                  TimeElapsedColumn(), console=console.get()) as progress:
        bar = progress.add_task("retokenize", total=None)

        def show(stale: int, total: int) -> None:
            progress.update(bar, total=total, completed=total - stale)

        if config.embedded:
            result = rt.run_in_process(job_id, batch_size=batch_size, progress=show)
            progress.stop()
            console.print(f"{result.done:,} done, {result.failed:,} failed, "
                          f"{result.skipped:,} skipped")
            return
        from synthq.queue.broker import TOKENIZE_ROUTE, send

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
                    send("synthq.retokenize", [(job_id, ids[i:i + batch_size])
                                               for i in range(0, len(ids), batch_size)],
                         TOKENIZE_ROUTE)
                    sent, moved_at = True, time.monotonic()
            if not stale or not wait:
                break
            time.sleep(1.0)
    if wait:
        console.print(f"every example of job {escape(job)} is at tokenize_version {version}")
    else:
        console.print("batches sent; `synthq status` shows the progress")
