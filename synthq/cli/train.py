"""Drafter training: `synthq train` and `synthq runs`.

torch is imported only inside `train` when it runs a run in-process: listing
runs and enqueueing one never load it.
"""

from __future__ import annotations

import json
import signal
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from synthq.cli import (
    JobArg,
    JsonOpt,
    app,
    console,
    ensure_db,
    fail,
    with_job,
)
from synthq.core.errors import UserError

if TYPE_CHECKING:
    from rich.table import Table


def _config(opts: dict[str, Any]) -> Any:
    from synthq.training.config import TrainConfig

    cfg = TrainConfig(**opts)
    cfg.check()
    return cfg


#: The panels of `synthq train --help` besides Options.
_DATA, _STEPS, _DRAFTER, _EVAL = "Data", "Steps", "Drafter", "Evaluation"


@app.command()
def train(
    job: JobArg,
    target: Annotated[str | None, typer.Option("--target", "-t", help="The target model: "
                      "a folder or Hugging Face id [default: the job's].")] = None,
    when: Annotated[str, typer.Option(metavar="<now|ready|done:F|count:N|never>",
                    help="`now`, or arm the job: beat starts the run when it is "
                    "ready.")] = "now",
    out: Annotated[str | None, typer.Option("--out", "-o", help="Run folder [default: "
                   "SYNTHQ_DATA_DIR/runs/JOB-runID].")] = None,
    draft_vocab_size: Annotated[int, typer.Option(help="Most frequent supervised ids "
                                "drafted.", rich_help_panel=_DATA)] = 32_000,
    max_len: Annotated[int, typer.Option(help="Cut examples to this many tokens.",
                                         rich_help_panel=_DATA)] = 2048,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.",
                                            rich_help_panel=_STEPS)] = 1,
    epochs: Annotated[int, typer.Option(help="Passes over the data.",
                                        rich_help_panel=_STEPS)] = 10,
    max_steps: Annotated[int, typer.Option(help="Stop after N steps (0: all epochs).",
                                           rich_help_panel=_STEPS)] = 0,
    max_examples: Annotated[int, typer.Option(help="The first N training examples (0: "
                            "all); the held-out ones stay.", rich_help_panel=_DATA)] = 0,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, cosine).",
                                      rich_help_panel=_STEPS)] = 1e-4,
    warmup_ratio: Annotated[float, typer.Option(help="Warmup share of the steps.",
                                                rich_help_panel=_STEPS)] = 0.02,
    drafter: Annotated[str, typer.Option(metavar="<eagle3|dflash>", help="The drafter "
                       "family (`dflash`: vLLM's block-diffusion method).",
                       rich_help_panel=_DRAFTER)] = "eagle3",
    ttt_steps: Annotated[int, typer.Option(help="Training-time test steps (DFlash: a "
                         "block's draft tokens).", rich_help_panel=_DRAFTER)] = 7,
    supervise: Annotated[str, typer.Option(metavar="<assistant|all>", help="Positions "
                         "learnt: the generated tokens, or every one.",
                         rich_help_panel=_DATA)] = "assistant",
    dflash_layers: Annotated[int, typer.Option(help="DFlash: decoder layers.",
                                               rich_help_panel=_DRAFTER)] = 2,
    dflash_anchors: Annotated[int, typer.Option(help="DFlash: blocks per sequence a step.",
                                                rich_help_panel=_DRAFTER)] = 256,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps.",
                                            rich_help_panel=_STEPS)] = 500,
    log_every: Annotated[int, typer.Option(help="Metrics to SQL every N steps.",
                                           rich_help_panel=_STEPS)] = 10,
    hidden_states: Annotated[str, typer.Option(
        "--hidden-states", "--features", metavar="<online|offline|captured|stream>",
        help="The target's features: run each step, cached, `synthq capture`'s, or "
        "captured ahead of the trainer into a bounded spool.",
        rich_help_panel=_DATA)] = "online",
    spool_size: Annotated[str | None, typer.Option(
        "--spool", metavar="SIZE", help="--features stream: the most bytes of captured features on "
        "disk at once (e.g. 2G).", rich_help_panel=_DATA)] = None,
    capture_server: Annotated[list[str] | None, typer.Option(
        "--capture-server", metavar="URL", help="--features stream: capture through this "
        "server (…/v1; stored on the job, as `synthq capture --server`) [default: the "
        "job's].", rich_help_panel=_DATA)] = None,
    seed: Annotated[int, typer.Option(help="Shuffling and init seed.",
                                      rich_help_panel=_STEPS)] = 0,
    eval_fraction: Annotated[float, typer.Option(help="Share held out to measure "
                             "acceptance (50 to a tenth of the job; 0: none).",
                             rich_help_panel=_EVAL)] = 0.02,
    eval_every: Annotated[int, typer.Option(help="Measure every N steps (0: at the end "
                          "only).", rich_help_panel=_EVAL)] = 1000,
    eval_draft_tokens: Annotated[int, typer.Option(help="Draft tokens a round (vLLM's "
                                 "num_speculative_tokens).", rich_help_panel=_EVAL)] = 4,
    eval_max_new: Annotated[int, typer.Option(help="New tokens per held-out prompt, at "
                            "most.", rich_help_panel=_EVAL)] = 256,
    keep_checkpoints: Annotated[int, typer.Option(help="Step checkpoints kept.",
                                                  rich_help_panel=_STEPS)] = 2,
    restart: Annotated[bool, typer.Option("--restart", help="Cancel the job's unfinished run "
                       "and start a new one with these settings.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Train an EAGLE-3 (or, with --drafter dflash, a DFlash) drafter on a job's data, or
    arm the job to train when ready.

    Without a broker (SYNTHQ_BROKER_URL unset) the run trains in this process to
    the end; with one, it is sent to the `train` queue (`synthq worker --queues
    train`). Rerun after a kill: an unfinished run of the job resumes from its
    last checkpoint.

    Example: `synthq train my-job --target /models/llama-3.1-8b --epochs 2 --lr 1e-4`

    Each option in full: the docs' CLI reference (docs/cli.md).
    """
    from synthq.queue import jobs
    from synthq.spec.config import get_settings
    from synthq.store.db import utcnow
    from synthq.training.config import parse_size, parse_when
    from synthq.training.runs import check_target, check_trainable, check_vocabulary, new_run

    try:
        cfg = _config(dict(draft_vocab_size=draft_vocab_size, max_len=max_len,
                           batch_size=batch_size, epochs=epochs, max_steps=max_steps,
                           max_examples=max_examples, lr=lr,
                           warmup_ratio=warmup_ratio, ttt_steps=ttt_steps,
                           supervise=supervise,
                           drafter=drafter, dflash_layers=dflash_layers,
                           dflash_anchors=dflash_anchors,
                           save_every=save_every, log_every=log_every,
                           hidden_states=hidden_states, seed=seed,
                           spool=parse_size(spool_size) if spool_size is not None else 0,
                           eval_fraction=eval_fraction, eval_every=eval_every,
                           eval_draft_tokens=eval_draft_tokens, eval_max_new=eval_max_new,
                           keep_checkpoints=keep_checkpoints))
        threshold = None if when == "now" else parse_when(when)
        if threshold is None and get_settings().embedded:
            _check_torch()
        if target is not None:
            check_target(target)
    except UserError as exc:
        raise fail(str(exc)) from None

    def go(s, j) -> dict[str, Any]:  # type: ignore[no-untyped-def]
        from sqlalchemy import select

        from synthq.queue.run_states import OPEN
        from synthq.store.models import TrainingRun

        chosen = target or j.train_target
        if capture_server:
            from synthq.app import service

            service.set_capture(s, j, {"capture_servers": capture_server})
        if cfg.hidden_states == "stream" and not j.capture_servers:
            raise UserError(f"job {j.name} has no capture server: --features stream captures "
                            "through one (give --capture-server URL)")
        if threshold is not None:
            if chosen is None and threshold.kind != "never":
                raise UserError("give --target: the job has no stored target model")
            jobs.update_job(s, j, {"train_when": str(threshold), "train_target": chosen,
                                     "train_settings": cfg.to_dict()}, now=utcnow())
            return {"job": j.name, "train_when": str(threshold), "target": chosen}
        if chosen is None:
            raise UserError("give --target: the job has no stored target model")
        unfinished = s.scalar(select(TrainingRun).where(
            TrainingRun.job_id == j.id, TrainingRun.state.in_(OPEN),
            TrainingRun.target == chosen).order_by(TrainingRun.id.desc()).limit(1))
        if unfinished is not None and restart:
            from synthq.queue.run_states import cancel

            cancel(s, unfinished.id, now=utcnow())
        elif unfinished is not None:
            changed = _changed(unfinished.settings or {}, cfg.to_dict())
            if changed:
                raise UserError(
                    f"job {j.name} has an unfinished run {unfinished.id} with other settings "
                    f"({changed}); rerun without them to resume it, or add --restart to "
                    "cancel it and start a new run")
            if cfg.hidden_states == "stream":
                from synthq.training.runs import check_same_examples

                check_same_examples(unfinished.output_dir, j)
            return {"run": unfinished.id, "resumed": True, "job": j.name,
                    "output_dir": unfinished.output_dir}
        check_trainable(j)  # what train takes, before a run row is made
        check_vocabulary(s, j, chosen)
        run = new_run(s, j, target=chosen, config=cfg, trigger="manual", output_dir=out)
        return {"run": run.id, "resumed": False, "job": j.name, "output_dir": run.output_dir}

    info = with_job(job, go)
    if threshold is not None:
        if as_json:
            print(json.dumps(info))
        else:
            console.print(f"job {info['job']}: train_when={info['train_when']}, target "
                          f"{info['target']} (beat starts the run when the job is ready)")
        return
    run_id = info["run"]
    if not get_settings().embedded:
        from synthq.queue.broker import TRAIN_ROUTE, send

        send("synthq.train", [(run_id,)], TRAIN_ROUTE)
        if as_json:
            print(json.dumps({**info, "queued": True}))
        else:
            console.print(f"training run {run_id} of job {info['job']} sent to the train "
                          f"queue; follow it with `synthq runs {info['job']} --watch`")
        return
    _run_here(run_id, info, as_json)


def _changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``batch_size 1 → 4, lr …``: the settings that differ between two runs."""
    return ", ".join(f"{k} {old.get(k)} → {v}" for k, v in sorted(new.items())
                     if k in old and old[k] != v)


def _check_torch() -> None:
    """Training in this process needs torch: one line, before any run row is made."""
    import importlib.util

    try:
        missing = importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        raise UserError("training needs torch, which is not installed: pip install "
                        "'synthq[train]' (or set SYNTHQ_BROKER_URL and train on a worker "
                        "that has it)")


def _run_here(run_id: int, info: dict[str, Any], as_json: bool) -> None:
    from synthq.training.lifecycle import execute_run

    if not as_json:
        verb = "resuming" if info["resumed"] else "starting"
        console.print(f"{verb} training run {run_id} of job {info['job']} in "
                      f"{info['output_dir']}")

    def on_step(step: int, record: dict[str, Any]) -> None:
        if not as_json:
            acc = " ".join(f"{a:.2f}" for a in record["acc"])
            evaluated = (f" eval_accept {record['eval_accept']:.2f}"
                         if record.get("eval_accept") is not None else "")
            console.print(f"step {step}: loss {record['loss']:.4f} acc [{acc}] "
                          f"accept≈{record['accept']:.2f}{evaluated}")

    def say(line: str) -> None:
        if as_json:  # stdout carries the JSON only
            import sys

            print(line, file=sys.stderr)
        else:
            console.print(line)

    evaluation = _EvalBar(enabled=not as_json)
    # Ctrl-C and `kill` hand the run back. SIGINT is set here too, as `synthq run` sets
    # it: a shell's background job starts with SIGINT ignored, and Python keeps that.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        state = execute_run(run_id, on_step=on_step, say=say, on_eval=evaluation.update)
    except KeyboardInterrupt:
        evaluation.close()
        raise fail(f"interrupted: run {run_id} is handed back; rerun `synthq train "
                   f"{info['job']}` to resume it from its last checkpoint", code=130) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    evaluation.close()
    row = _runs(str(run_id), by_run=True)[0]
    if state == "stale":
        raise fail(f"run {run_id} is being trained by {row['worker']}; follow it with "
                   f"`synthq runs {info['job']} --watch`")
    if as_json:
        print(json.dumps(row))
    elif state == "done":
        ev = row.get("eval_acceptance_length")
        served = (f"; eval acceptance length {ev:.2f} on held-out prompts (trust this, not "
                  "accept≈)" if ev is not None else "")
        console.print(f"run {run_id} done: drafter in {row['checkpoint']}{served}")
    if state == "pending":  # handed back (synthq.core.errors.HandBack): its line says why
        raise fail(f"run {run_id} handed back: {row['error']}", code=1)
    if state != "done":
        raise fail(f"run {run_id} {state}: {row['error'] or 'see `synthq runs`'}", code=1)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


class _EvalBar:
    """An evaluation's progress: held-out prompts done and the acceptance length so far,
    as a bar on a terminal, else a line every tenth of the prompts."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.progress: Any = None
        self.task: Any = None

    def update(self, done: int, total: int, mean: float) -> None:
        if not self.enabled:
            return
        if not console.get().is_terminal:
            if done == total or done % max(1, total // 10) == 0:
                console.print(f"evaluating: {done}/{total} held-out prompts, acceptance "
                              f"length {mean:.2f} so far")
            return
        if self.progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(TextColumn("[bold]evaluating"), BarColumn(),
                                     MofNCompleteColumn(), TextColumn("held-out prompts, "
                                     "acceptance length {task.fields[mean]:.2f}"),
                                     TimeElapsedColumn(), console=console.get(), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("eval", total=total, mean=mean)
        self.progress.update(self.task, completed=done, total=total, mean=mean)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _runs(ref: str | None, by_run: bool = False) -> list[dict[str, Any]]:
    from synthq.store.db import session_scope
    from synthq.training.runs import list_runs

    if ref is None or by_run:
        try:
            ensure_db()
        except UserError as exc:
            raise fail(str(exc)) from None
        with session_scope() as s:
            rows = list_runs(s)
        return [r for r in rows if not by_run or str(r["id"]) == ref]
    return with_job(ref, lambda s, j: list_runs(s, j.id))  # type: ignore[no-any-return]


def _table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table("run", "job", "drafter", "state", "step", "loss", "acc@0", "accept≈ (train)",
                  "eval accept", "served accept", "checkpoint / error")
    for r in rows:
        total = f"/{r['total_steps']}" if r["total_steps"] else ""
        acc = f"{r['acc'][0]:.2f}" if r["acc"] else ""
        ev = r.get("eval_acceptance_length")
        sv = r.get("served_acceptance_length")
        served = (f"{sv:.2f} ({r.get('served_engine') or '?'} "
                  f"{r.get('served_engine_version') or ''})".replace(" )", ")")
                  if sv is not None else "")
        table.add_row(str(r["id"]), str(r["job"]), r.get("drafter") or "eagle3", r["state"],
                      f"{r['step']}{total}",
                      f"{r['loss']:.4f}" if r["loss"] is not None else "", acc,
                      f"{r['accept']:.2f}" if r["accept"] is not None else "",
                      f"{ev:.2f}" if ev is not None else "", served,
                      r["error"] if r["state"] == "failed" else (r["checkpoint"] or ""))
    return table


@app.command()
def runs(
    job: Annotated[str | None, typer.Argument(help="Job name or id [default: all "
                   "jobs].")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw until no run is "
                     "pending or running (Ctrl-C to leave).")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with "
                        "--watch.")] = 2.0,
    as_json: JsonOpt = False,
) -> None:
    """List training runs: state, step, loss, accuracy, acceptance, checkpoint.

    Example: `synthq runs my-job --watch`
    """
    if interval <= 0:
        raise fail("--interval must be positive")
    if not watch:
        rows = _runs(job)
        if as_json:
            print(json.dumps(rows))
        elif rows:
            console.print(_table(rows))
        else:
            console.print("no training runs yet: `synthq train --help`")
        return
    from rich.live import Live

    try:
        with Live(_table(_runs(job)), console=console.get(), auto_refresh=False) as live:
            while True:
                rows = _runs(job)
                live.update(_table(rows), refresh=True)
                if not any(r["state"] in ("pending", "running") for r in rows):
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if as_json:
        print(json.dumps(_runs(job)))
