"""`synthq serve-check`: the run's drafter served by a real engine, measured by the engine."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from synthq.cli import JsonOpt, app, console, ensure_db, err, fail
from synthq.core.errors import UserError


@app.command("serve-check")
def serve_check(
    run_id: Annotated[int, typer.Argument(help="Training run id (`synthq runs`).")],
    server: Annotated[str, typer.Option("--server", "-s", help="OpenAI base URL of a vLLM "
                      "serving the run's target with its drafter (`method` eagle3 or dflash, as "
                      "`synthq runs` names the run's drafter).")],
    model: Annotated[str, typer.Option("--model", "-m", help="The served model name.")],
    concurrency: Annotated[int, typer.Option(help="Requests at once.")] = 4,
    wait: Annotated[float, typer.Option(help="Seconds to wait for the server to serve "
                                        "the model (it may still be loading).")] = 900.0,
    as_json: JsonOpt = False,
) -> None:
    """Send the run's held-out prompts to vLLM serving its drafter and store the
    acceptance length vLLM measured (its spec-decode counters) on the run, beside
    synthq's own `eval_acceptance_length`. Nothing else may use the server meanwhile.

    Example: `vllm serve TARGET --speculative-config '{"method": "eagle3", "model":
    "RUN/final", "num_speculative_tokens": 4}'` (a `--drafter dflash` run: `"method":
    "dflash"`), then `synthq serve-check 3 -s http://127.0.0.1:8000/v1 -m TARGET`
    """
    from synthq.core.clock import utcnow
    from synthq.queue import run_states
    from synthq.store.db import session_scope
    from synthq.store.models import TrainingRun
    from synthq.training.served import describe, held_out_prompts, measure, wait_serving

    if concurrency < 1:
        raise fail("--concurrency must be at least 1")
    if not 0 <= wait <= 86_400:  # NaN fails too
        raise fail("--wait must be between 0 and 86400 seconds")
    try:
        ensure_db()
        with session_scope() as s:
            run = s.get(TrainingRun, run_id)
            if run is None:
                raise UserError(f"no training run {run_id} (see `synthq runs`)")
            if str(run.state) != "done":
                raise UserError(f"run {run_id} is {run.state}: serve-check needs a done run")
            output_dir, settings = run.output_dir, dict(run.settings)
            drafter = settings.get("drafter", "eagle3")
            evaluated = run.eval_acceptance_length
        prompts = held_out_prompts(output_dir, settings)
        wait_serving(server, model, wait, notice=err.print)
        result = measure(server, model, prompts, concurrency=concurrency)
    except UserError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a network error is one line, not a traceback
        raise fail(f"{server}: {type(exc).__name__}: {exc}") from None
    if result.drafts == 0:
        raise fail(f"{server} made no drafts for {len(prompts)} prompts: is the drafter "
                   "loaded (--speculative-config)?")
    with session_scope() as s:
        if not run_states.record_served(s, run_id, acceptance=result.mean,
                                        engine=result.engine, version=result.version,
                                        now=utcnow()):
            raise fail(f"run {run_id} is no longer done: vLLM's figure was not stored")
    out = {"run": run_id, "drafter": drafter, **describe(result),
           "eval_acceptance_length": evaluated}
    if as_json:
        print(json.dumps(out))
        return
    gap = (f"; synthq's eval_acceptance_length {evaluated:.2f} ({result.mean - evaluated:+.2f})"
           if evaluated is not None else "")
    console.print(f"run {run_id} ({drafter}): {result.engine} {result.version or '?'} served "
                  f"acceptance length {result.mean:.2f} ({result.accepted} accepted of "
                  f"{result.drafts} drafts, {len(prompts)} held-out prompts){gap}")
