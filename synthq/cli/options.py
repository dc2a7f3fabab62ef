"""Options shared by `synthq enqueue` and `synthq run`, and the JobSpec they make."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from synthq.cli import (
    json_option,
)

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
InflightOpt = Annotated[str, typer.Option(help="Most requests in flight per server (set it to "
                        "what the server batches, e.g. vLLM's max_num_seqs), or `auto`: each "
                        "server's limit follows its latency and errors (see `synthq status`).")]
MaxInflightOpt = Annotated[int | None, typer.Option(help="With --inflight auto: the hard cap "
                           "per server [default: 256].")]
MinInflightOpt = Annotated[int | None, typer.Option(help="With --inflight auto: the floor per "
                           "server [default: 4].")]
GpusOpt = Annotated[int, typer.Option(help="GPUs behind each server (cost report).")]
GpuPriceOpt = Annotated[float | None, typer.Option(help="Dollars per GPU-hour: status shows "
                        "dollars spent, $/1M generated tokens and the projected cost "
                        "[default: SYNTHQ_GPU_HOUR_PRICE].")]
KeepTruncOpt = Annotated[bool, typer.Option("--keep-truncated/--drop-truncated", help="Keep "
                         "answers cut by max_tokens (finish_reason=length) as done.")]
StreamOpt = Annotated[bool, typer.Option("--stream/--no-stream", help="Stream answers (a "
                      "stall clock: a silent server is caught mid-answer). --no-stream: one "
                      "plain call per sample, less CPU per sample, the total --timeout only.")]
TemplateKwOpt = Annotated[str | None, typer.Option(help="JSON object sent as "
                          "chat_template_kwargs, e.g. '{\"enable_thinking\": true}'.")]
ExtraBodyOpt = Annotated[str | None, typer.Option(help="JSON object of extra request fields.")]
TokenIdsOpt = Annotated[bool, typer.Option(help="Ask vLLM for token ids (return_token_ids).")]
IdFieldOpt = Annotated[str | None, typer.Option(help="The row field holding each row's own "
                      "id, kept as the sample's source_id and exported [default: the first of "
                      "id, uuid, conversation_id, sample_id].")]


TokenizerOpt = Annotated[str | None, typer.Option(help="The target model's tokenizer (a local "
                        "path or Hugging Face id). With it, each answer is tokenized with an "
                        "assistant-only loss mask; without it, a sample is done once its answer "
                        "is stored.")]
ChatTemplateOpt = Annotated[Path | None, typer.Option(help="A Jinja chat template file that "
                            "overrides the tokenizer's own.", exists=True, dir_okay=False)]
MaxSeqLenOpt = Annotated[int, typer.Option(help="Truncate training examples to this many "
                         "tokens.")]
ReasoningOpt = Annotated[str, typer.Option(help="keep: reasoning_content is rendered into the "
                         "assistant turn and supervised; drop: left out; auto: keep where the "
                         "template renders reasoning, drop where it removes it.")]
MaskOpt = Annotated[str | None, typer.Option(help="last_turn: supervise the generated answer; "
                    "all_assistant_turns: also the dataset's earlier assistant turns "
                    "[default: all_assistant_turns with --regenerate all, else last_turn].")]
RegenerateOpt = Annotated[str, typer.Option(help="last: regenerate the last assistant turn; "
                          "all: every assistant turn, each on the regenerated history.")]
HistoryReasoningOpt = Annotated[str, typer.Option(help="With --regenerate all: drop: earlier "
                                "turns are sent with their content only; keep: with their "
                                "reasoning_content too.")]
ExamplesOpt = Annotated[str | None, typer.Option(help="With --regenerate all: conversation: "
                        "one training example per conversation, masked per --mask; per-turn: "
                        "one per regenerated turn, its history as sent and its answer "
                        "supervised [default: per-turn where the template cannot mask several "
                        "turns at once (tried at enqueue), else conversation].")]
ThinkOpenOpt = Annotated[str, typer.Option(help="Opens kept reasoning where the template has no "
                         "reasoning_content (escapes like \\n are read).")]
ThinkCloseOpt = Annotated[str, typer.Option(help="Closes kept reasoning where the template has "
                          "no reasoning_content.")]


def job_spec(opts: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A JobSpec from the options shared by `enqueue` and `run`."""
    from synthq.enqueue import JobSpec, inflight_settings

    sampling: dict[str, Any] = {}
    if opts["temperature"] is not None:
        sampling["temperature"] = opts["temperature"]
    if opts["top_p"] is not None:
        sampling["top_p"] = opts["top_p"]
    body = json_option(opts["extra_body"], "--extra-body")
    kwargs = json_option(opts["chat_template_kwargs"], "--chat-template-kwargs")
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
                   backoff_cap=opts["backoff_cap"],
                   **inflight_settings(opts["inflight"], opts.get("max_inflight"),
                                       opts.get("min_inflight")),
                   gpus=opts.get("gpus", 1), gpu_hour_price=opts.get("gpu_hour_price"),
                   keep_truncated=opts["keep_truncated"], stream=opts["stream"],
                   tokenizer=opts["tokenizer"],
                   chat_template=template, chat_template_kwargs=kwargs,
                   max_seq_len=opts["max_seq_len"], reasoning=opts["reasoning"],
                   mask=opts["mask"], think_open=_unescape(opts["think_open"]),
                   think_close=_unescape(opts["think_close"]),
                   regenerate=opts.get("regenerate") or "last",
                   history_reasoning=opts.get("history_reasoning") or "drop",
                   examples=opts.get("examples"))


def _unescape(text: str) -> str:
    """``\\n`` typed on a command line becomes a newline."""
    return text.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")
