"""The job settings, declared once: name, type, default, bounds, choices, help, requeue.

Everything a person sets on a job is one :class:`Setting` in :data:`SETTINGS`.
The front ends derive from it: the CLI's options of `synthq enqueue`, `synthq
run` and `synthq requeue` (:mod:`synthq.cli.options`), the API's ``JobSettings``
and requeue body (:mod:`api.schemas`), and the checks (:func:`check`) that
both run on create and on requeue, so a value is refused with the same one
line wherever it comes from. :func:`build` turns checked values into the
:class:`synthq.jobs.enqueue.JobSpec`; :func:`check_overrides` and
:func:`apply_overrides` are the per-sample settings of a requeue.

Each setting names its **role** in the job: :data:`GENERATION` (the answers
depend on it: part of the "same work" key, :func:`generation_settings`),
:data:`TOKENIZATION` (how examples are made from the answers: the
``TokenizeSettings``), :data:`OPERATIONAL` (how the job runs: enqueueing it
again changes it, :data:`OPERATIONAL`'s columns), or none; whether it is
**exported** (the export manifest's settings, :data:`EXPORTED`); and its
**column** on ``jobs`` (:attr:`Setting.column`). Those lists are made from the
roles here, not written again where they are used.

:data:`CAPTURE` holds the settings of the hidden-state capture stage (``synthq
capture``, ``PUT /api/jobs/{id}/capture``, both through
:func:`synthq.app.service.set_capture`): declared the same way (type, default, bounds,
choices, help), so the command's options, the API's fields, their checks and the
columns' defaults follow from them. ``capture_servers`` is in both tuples: a job
is created with it, and the capture stage changes it.

The retokenizable settings (:data:`RETOKENIZABLE`), the reserved request keys
(:data:`RESERVED_BODY`, for ``extra_body`` and the sampling options alike) and
the mask default (:func:`mask_for`) are written here once too.

Adding a setting: one ``Setting(...)`` here, plus where it is used (a
``JobSpec`` field and its column, or the code that reads it) and its migration.
tests/unit/test_job_roles.py holds the ``JobSpec``'s fields and the ``jobs``
columns to this declaration (names, types, nullability, defaults, lengths).

Bounds fit the columns that store the values (``INTEGER``: below 2**31) and
the arithmetic done with them (a lease or a backoff added to a timestamp must
stay a timestamp): one value out of them must never stop the sweep or the
dispatch of every job. This module imports the standard library only: the CLI
reads it to build its options, and ``synthq --help`` loads neither pydantic
nor SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from synthq.core.errors import UserError

__all__ = ["Setting", "SETTINGS", "CAPTURE", "BY_NAME", "OVERRIDABLE", "OPERATIONAL",
           "RESERVED_BODY", "GENERATION", "TOKENIZATION", "EXPORTED", "RETOKENIZABLE",
           "generation_settings", "default", "urls", "named_urls", "mask_for", "pairs",
           "check", "check_values", "check_body", "check_overrides", "requeue_settings",
           "apply_overrides",
           "inflight_settings", "job_name", "setting_for_key", "DEFAULT_MAX_INFLIGHT",
           "DEFAULT_MIN_INFLIGHT"]

#: Seconds any timeout or backoff may be: a week. A lease or a retry's due time is
#: ``now`` plus one of them, which must stay a date (1e308 s overflows it).
MAX_SECONDS = 7 * 24 * 3600.0
#: The most tokens one answer or example may have (an ``INTEGER`` column holds them).
MAX_TOKENS = 10_000_000
#: The most requests in flight per server any setting may ask for.
MAX_INFLIGHT = 100_000
DEFAULT_MAX_INFLIGHT = 256
DEFAULT_MIN_INFLIGHT = 4

#: Roles of a setting (:attr:`Setting.role`).
GENERATION_ROLE = "generation"
TOKENIZATION_ROLE = "tokenization"
OPERATIONAL_ROLE = "operational"


@dataclass(frozen=True)
class Setting:
    """One job setting, as a person gives it (CLI option, API field)."""

    #: The API field; the CLI option is ``--`` + name with dashes, unless ``flags``.
    name: str
    #: The value's type in the API: int, float, bool, str, dict (a JSON object), list.
    type: type
    default: Any = None
    #: The whole explanation: the API schema's description and the docs' reference.
    help: str = ""
    #: Bounds of a number, inclusive unless ``low_open`` / ``high_open``.
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    #: What an error says the value must be (default: from the bounds).
    must: str | None = None
    #: The values a string may take (listed in --help and the API schema).
    choices: tuple[str, ...] = ()
    #: The longest string the column holds.
    max_len: int | None = None
    #: ``"sample"``: a requeue may set it for the requeued samples (``samples.overrides``);
    #: ``"job"``: a requeue sets it on the job from then on; None: create only.
    requeue: str | None = None
    requeue_help: str | None = None
    #: Where :func:`build` puts it on the JobSpec: an attribute, ``sampling.KEY``, or ""
    #: for none (the command reads it itself). None: the attribute of the same name.
    field: str | None = None
    #: The CLI's option declarations, e.g. ``("--server", "-s")`` or ``("--stream/--no-stream",)``.
    flags: tuple[str, ...] = ()
    required: bool = False
    #: What is sent or used when the setting is not given (its ``--help`` default).
    omitted: str | None = None
    #: How the CLI takes it, where not as the API: ``json`` (a JSON text), ``file`` (a
    #: path whose text is the value), ``escapes`` (``\\n`` read as a newline), ``list``,
    #: ``ints`` (``2,4,5``), ``pairs`` (repeated ``URL=DIR``, a mapping).
    cli: str = ""
    #: What --help shows for the value (default: its type, or its choices).
    metavar: str | None = None
    #: A further check of a valid value (raises UserError).
    also: Callable[[Any], None] | None = None
    #: A list of servers' base URLs: each an http(s) URL, none twice, its trailing ``/``
    #: dropped; the API takes only hosts of SYNTHQ_ALLOWED_SERVERS (:func:`urls`), and
    #: every output shows them masked.
    urls: bool = False
    #: What it is to the job: ``generation`` (the answers depend on it: part of the "same
    #: work" key), ``tokenization`` (how the examples are made: ``TokenizeSettings``),
    #: ``operational`` (how the job runs, not what it makes: enqueueing the job again
    #: with another value changes it, synthq.jobs.enqueue.get_or_create_job), or None.
    role: str | None = None
    #: Recorded in the export manifest's settings (what produced the data).
    exported: bool = False
    #: ``synthq retokenize`` may change it: the examples are made again from the stored
    #: answers, with no call (synthq.jobs.retokenize, :data:`RETOKENIZABLE`).
    retokenize: bool = False
    #: With role ``generation``: part of the key only while the column ``[0]`` holds
    #: ``[1]`` (jobs made before the setting existed keep their keys).
    key_when: tuple[str, Any] | None = None
    #: The items' type of a list.
    item: Any = str
    #: With ``operational``: enqueueing the job again without the setting (an empty
    #: value) keeps the job's, rather than clearing what ``synthq capture`` set.
    kept_when_omitted: bool = False
    #: The CLI's --help line (``help`` when empty): short enough to read at 80 columns,
    #: with its default where that is no value of its own (``[default: the server's]``).
    brief: str = ""

    @property
    def operational(self) -> bool:
        return self.role == OPERATIONAL_ROLE

    @property
    def column(self) -> str | None:
        """The ``jobs`` column that stores it (``sampling`` for a sampling key); None: no
        column of its own (the command reads it, or it makes other columns)."""
        if self.field == "":
            return None
        if self.field and self.field.startswith("sampling."):
            return "sampling"
        return self.key

    @property
    def flag(self) -> str:
        """The CLI option that errors name (``--max-tokens``)."""
        for decl in self.flags:
            if decl.startswith("--"):
                return decl.split("/")[0]
        return "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        """The name stored on the job and in a sample's overrides (``total_timeout``)."""
        if self.field:
            return self.field.rsplit(".", 1)[-1]
        return self.name

    def must_be(self) -> str:
        if self.must:
            return self.must
        if self.type is int:
            if self.low == 1:
                return f"a positive integer up to {self.high:,.0f}"
            return f"an integer from {self.low:,.0f} to {self.high:,.0f}"
        if self.high_open:
            return f"{'above' if self.low_open else 'at least'} {self.low:g} and below " \
                   f"{self.high:,g}"
        if self.low_open:
            return f"above {self.low:g} and at most {self.high:,g}"
        return f"{self.low:g} to {self.high:,g}"


def _below_visibility(total_timeout: float) -> None:
    """A call must end before Redis hands its message to a second worker."""
    from synthq.spec.config import get_settings

    visibility = get_settings().visibility_timeout
    if total_timeout >= visibility:
        raise UserError(
            f"--timeout {total_timeout:g} s is not below the broker's visibility timeout "
            f"({visibility:g} s, SYNTHQ_VISIBILITY_TIMEOUT): Redis would hand the message to a "
            "second worker while the first still runs")


_POSITIVE_SECONDS = dict(low=0.0, high=MAX_SECONDS, low_open=True)

#: The turns a job given no ``--mask`` supervises, by its ``--regenerate``: the one place
#: this default is written (the JobSpec, TokenizeSettings and the ``jobs.mask`` column
#: read it through :func:`mask_for`).
MASK_BY_REGENERATE = {"last": "last_turn", "all": "all_assistant_turns"}


def mask_for(mask: str | None, regenerate: str | None = "last") -> str:
    """A job's mask: ``mask`` as given, else the default of its ``regenerate``."""
    return mask or MASK_BY_REGENERATE["all" if regenerate == "all" else "last"]


#: Set at create (``--capture-server``) and by `synthq capture`: in SETTINGS and CAPTURE.
_CAPTURE_SERVERS = Setting(
    "capture_servers", list, None, "Base URL of a capture server (…/v1): a vLLM started "
    "with extract_hidden_states and synthq's connector; each done sample's hidden "
    "states are captured there (the stage `synthq capture` runs alone). Repeat for "
    "several. Each must answer before the job stores it.",
    flags=("--capture-server",), cli="list", urls=True, role=OPERATIONAL_ROLE,
    kept_when_omitted=True,
    brief="Capture server URL, e.g. http://cap:8000/v1.")


SETTINGS: tuple[Setting, ...] = (
    Setting("servers", list, required=True, flags=("--server", "-s"), cli="list", urls=True,
            role=OPERATIONAL_ROLE,
            help="Base URL of an OpenAI-compatible server, e.g. http://vllm:8000/v1. Repeat "
                 "for several.",
            brief="Server base URL, e.g. http://vllm:8000/v1 (repeat for several)."),
    Setting("model", str, required=True, flags=("--model", "-m"), max_len=200,
            help="Model name the server serves.", role=GENERATION_ROLE, exported=True,
            brief="Model name the server serves."),
    Setting("name", str, field="name", flags=("--job", "-j"), max_len=200,
            help="Job name [default: the dataset's file name]. Same name and settings again "
                 "= resume/add.",
            brief="Job name [default: the dataset's file name]."),
    Setting("max_tokens", int, 4096, "max_tokens per answer.", low=1, high=MAX_TOKENS,
            requeue="sample", requeue_help="max_tokens for the requeued samples only (stored "
            "per sample).", role=GENERATION_ROLE, exported=True,
            brief="max_tokens per answer."),
    Setting("temperature", float, None, "Sampling temperature.", low=0, high=100,
            field="sampling.temperature", omitted="not sent: the server's own",
            requeue="sample", requeue_help="Sampling temperature for the requeued samples "
            "only.", role=GENERATION_ROLE, exported=True,
            brief="Temperature [default: the server's]."),
    Setting("top_p", float, None, "Nucleus sampling top_p.", low=0, high=1, low_open=True,
            field="sampling.top_p", omitted="not sent: the server's own", requeue="sample",
            requeue_help="top_p for the requeued samples only.",
            role=GENERATION_ROLE, exported=True,
            brief="top_p [default: the server's]."),
    Setting("timeout", float, 1800.0, "Total seconds one call may take.",
            field="total_timeout", also=_below_visibility, requeue="sample", role=OPERATIONAL_ROLE,
            requeue_help="Total seconds one call of the requeued samples may take.",
            brief="Total seconds per call.",
            **_POSITIVE_SECONDS),  # type: ignore[arg-type]
    Setting("stall_timeout", float, 300.0, "Seconds without a streamed chunk before a call "
            "counts as stalled.", requeue="sample", requeue_help="Stall timeout of the "
            "requeued samples' calls.",
            role=OPERATIONAL_ROLE, brief="Seconds with no chunk: stalled.",
            **_POSITIVE_SECONDS),  # type: ignore[arg-type]
    Setting("max_attempts", int, 5, "Calls per sample before it is failed.", low=1,
            high=1000, requeue="sample", role=OPERATIONAL_ROLE,
            requeue_help="Calls per requeued sample before it is failed.",
            brief="Calls per sample before it fails."),
    Setting("backoff_base", float, 2.0, "Backoff base seconds (doubles per attempt, full "
            "jitter).", low=0, high=MAX_SECONDS, role=OPERATIONAL_ROLE,
            brief="First retry's wait in seconds."),
    Setting("backoff_cap", float, 300.0, "Backoff ceiling in seconds.", role=OPERATIONAL_ROLE,
            brief="Longest retry wait, seconds.",
            **_POSITIVE_SECONDS),  # type: ignore[arg-type]
    # inflight is "N" or "auto"; its three settings are read together by
    # synthq.jobs.enqueue.inflight_settings, which words their errors.
    Setting("inflight", str, "64", "Most requests in flight per server (set it to what the "
            "server batches, e.g. vLLM's max_num_seqs), or `auto`: each server's limit follows "
            "its latency and errors (see `synthq status`).", field="", requeue="job",
            metavar="<N|auto>", role=OPERATIONAL_ROLE,
            requeue_help="The servers' in-flight limit from now on: a number, or `auto` "
            "(adaptive per server).",
            brief="Calls in flight per server (what it batches, e.g. vLLM's "
            "max_num_seqs), or `auto`."),
    Setting("max_inflight", int, None, "With --inflight auto: the hard cap per server.",
            low=1, high=MAX_INFLIGHT, field="", omitted="256", requeue="job",
            brief="Cap of --inflight auto [default: 256]."),
    Setting("min_inflight", int, None, "With --inflight auto: the floor per server.",
            low=1, high=MAX_INFLIGHT, field="", omitted="4", requeue="job",
            brief="Floor of --inflight auto [default: 4]."),
    Setting("gpus", int, 1, "GPUs behind each server (cost report).", low=1, high=100_000,
            role=OPERATIONAL_ROLE,
            brief="GPUs behind each server (cost)."),
    Setting("gpu_hour_price", float, None, "Dollars per GPU-hour: status shows dollars "
            "spent, $/1M generated tokens and the projected cost.", low=0, high=999_999,
            must="a price in dollars per GPU-hour", omitted="SYNTHQ_GPU_HOUR_PRICE",
            role=OPERATIONAL_ROLE,
            brief="Dollars per GPU-hour, for the cost report [default: SYNTHQ_GPU_HOUR_PRICE]."),
    Setting("max_response_bytes", int, 4 << 20, "Bytes of answer after which a call fails "
            "as response_too_large.", low=1, high=1 << 30, role=OPERATIONAL_ROLE,
            brief="Longest answer in bytes."),
    Setting("keep_truncated", bool, False, "Keep answers cut by max_tokens "
            "(finish_reason=length) as done.", flags=("--keep-truncated/--drop-truncated",),
            role=OPERATIONAL_ROLE, exported=True,
            brief="Keep answers cut by max_tokens, or drop them."),
    Setting("stream", bool, True, "Stream answers (a stall clock: a silent server is caught "
            "mid-answer). --no-stream: one plain call per sample, less CPU per sample, the "
            "total --timeout only.", flags=("--stream/--no-stream",), role=OPERATIONAL_ROLE,
            brief="Stream answers, or plain calls."),
    Setting("chat_template_kwargs", dict, None, "JSON object sent as chat_template_kwargs "
            "(and used by the tokenizer), e.g. '{\"enable_thinking\": true}'.", cli="json",
            requeue="sample", requeue_help="JSON object sent as chat_template_kwargs for the "
            "requeued samples.", role=TOKENIZATION_ROLE, exported=True, retokenize=True,
            brief="JSON object: chat_template_kwargs."),
    Setting("extra_body", dict, None, "JSON object of extra request fields (not those synthq "
            "sets or that change the answers' count, length or shape: n, max_tokens, "
            "stream_options, ...).", cli="json", requeue="sample", requeue_help="JSON object "
            "of extra request fields for the requeued samples (merged over the job's).",
            role=GENERATION_ROLE, exported=True,
            brief="JSON object of extra request fields."),
    Setting("return_token_ids", bool, False, "Ask vLLM for token ids (return_token_ids).",
            field="", flags=("--return-token-ids/--no-return-token-ids",),
            brief="Ask vLLM for its token ids."),
    Setting("id_field", str, None, "The row field holding each row's own id, kept as the "
            "sample's source_id and exported.", field="", max_len=1000,
            omitted="the first of id, uuid, conversation_id, sample_id",
            brief="The rows' own id field [default: id, uuid, conversation_id or "
            "sample_id]."),
    Setting("tokenizer", str, None, "The target model's tokenizer (a local path or Hugging "
            "Face id). With it, each answer is tokenized with an assistant-only loss mask; "
            "without it, a sample is done once its answer is stored.", max_len=500,
            omitted="none", role=TOKENIZATION_ROLE, exported=True, retokenize=True,
            brief="The target's tokenizer (path or HF id): without one, no "
            "training data [default: none]."),
    Setting("chat_template", str, None, "A Jinja chat template that overrides the "
            "tokenizer's own (the CLI reads it from a file).", cli="file",
            omitted="the tokenizer's", role=TOKENIZATION_ROLE, retokenize=True,
            brief="Jinja file to use as chat template [default: the tokenizer's]."),
    Setting("max_seq_len", int, 4096, "Truncate training examples to this many tokens.",
            low=1, high=MAX_TOKENS, role=TOKENIZATION_ROLE, exported=True, retokenize=True,
            brief="Tokens an example is cut to."),
    Setting("reasoning", str, "auto", "auto: keep where the chat template renders "
            "reasoning, drop where it cannot (said in one line at enqueue; the job stores "
            "the result); keep: reasoning_content is rendered into the assistant turn and "
            "supervised; drop: left out.", choices=("auto", "keep", "drop"),
            role=TOKENIZATION_ROLE, exported=True, retokenize=True,
            brief="reasoning_content in the examples."),
    Setting("mask", str, None, "last_turn: supervise the generated answer; "
            "all_assistant_turns: also the dataset's earlier assistant turns.",
            choices=("last_turn", "all_assistant_turns"),
            omitted=f"{mask_for(None, 'all')} with --regenerate all, else {mask_for(None)}",
            role=TOKENIZATION_ROLE, exported=True, retokenize=True,
            brief="Turns supervised [default: per --regenerate]."),
    Setting("think_open", str, "<think>\n", "Opens kept reasoning where the template has no "
            "reasoning_content (escapes like \\n are read).", cli="escapes", max_len=64,
            role=TOKENIZATION_ROLE, exported=True,
            brief="Text before kept reasoning."),
    Setting("think_close", str, "\n</think>\n\n", "Closes kept reasoning where the template "
            "has no reasoning_content.", cli="escapes", max_len=64,
            role=TOKENIZATION_ROLE, exported=True,
            brief="Text after kept reasoning."),
    Setting("regenerate", str, "last", "last: regenerate the last assistant turn; all: every "
            "assistant turn, each on the regenerated history.", choices=("last", "all"),
            role=GENERATION_ROLE, exported=True, key_when=("regenerate", "all"),
            brief="Assistant turns to regenerate."),
    Setting("history_reasoning", str, "drop", "With --regenerate all: drop: earlier turns are "
            "sent with their content only; keep: with their reasoning_content too.",
            choices=("drop", "keep"),
            role=GENERATION_ROLE, exported=True, key_when=("regenerate", "all"),
            brief="Earlier turns' reasoning (regenerate all)."),
    Setting("examples", str, None, "With --regenerate all: conversation: one training "
            "example per conversation, masked per --mask; per-turn: one per regenerated turn, "
            "its history as sent and its answer supervised.",
            choices=("conversation", "per-turn"),
            omitted="per-turn where the template cannot mask several turns at once (tried at "
            "enqueue), else conversation", exported=True, retokenize=True,
            brief="Regenerate all: one example per conversation or per turn "
            "[default: what the template can mask]."),
    _CAPTURE_SERVERS,
    Setting("capture_mode", str, "stage", "stage: each done sample's hidden states are "
            "captured by the capture stage's own calls (a second prefill); inline: the "
            "final answer's call captures them too (the generation server is also the "
            "capture server: vLLM with extract_hidden_states and synthq's connector), the "
            "example is the engine's prompt and output ids, and the stage calls only where "
            "that file is missing, mismatched or late. A server that cannot capture is "
            "refused before anything is stored.", choices=("stage", "inline"),
            flags=("--capture",), role=OPERATIONAL_ROLE, exported=True,
            brief="Hidden states by the capture stage, or inline with the answers."),
)

#: The most output_hidden_states index a capture may name.
MAX_LAYER = 4096


def _layer_ids(layers: list[int]) -> None:
    if not layers or any(i < 0 or i > MAX_LAYER for i in layers) \
            or len(set(layers)) != len(layers):
        raise UserError(f"--layers {','.join(map(str, layers))}: distinct indices between 0 "
                        f"and {MAX_LAYER}")


#: The capture stage's settings (``synthq capture``; synthq.capture), stored on the job:
#: `synthq capture` and ``PUT /api/jobs/{id}/capture`` change them through one function
#: (synthq.app.service.set_capture). The default of a setting may be a sentinel its reader
#: resolves (e.g. ``auto``).
CAPTURE: tuple[Setting, ...] = (
    _CAPTURE_SERVERS,
    Setting("capture_files", dict, None, "Capture server URL → the folder where its engine "
            "writes its files (its connector's shared_storage_path, as this machine sees it). "
            "With it synthq takes files of vLLM's stock ExampleHiddenStatesConnector (named by "
            "request id) too, from that folder only. Merged into the job's; an empty folder "
            "removes the server's.", flags=("--engine-files",), cli="pairs", urls=True,
            metavar="<url=dir>", role=OPERATIONAL_ROLE, kept_when_omitted=True,
            brief="URL=DIR: the folder where capture server URL's engine writes its files, "
            "for vLLM's stock connector. Repeat per server; URL= removes it."),
    Setting("capture_layers", list, None, "output_hidden_states indices to capture, "
            "comma-separated; must be the server's eagle_aux_hidden_state_layer_ids.",
            item=int, cli="ints", flags=("--layers",), metavar="<i,j,...>",
            omitted="the drafter's three and the last layer's, [2, N//2, N-3, N], from the "
            "target's config.json", also=_layer_ids, role=OPERATIONAL_ROLE,
            brief="Hidden-state layers [default: the drafter's and the last]."),
    Setting("capture_dtype", str, "auto", "Stored dtype: auto (the engine's own), float32, "
            "bfloat16 (half a float32's disk), float16, or float8_e4m3 (a quarter, with a "
            "per-tensor scale).",
            choices=("auto", "float32", "bfloat16", "float16", "float8_e4m3"),
            flags=("--dtype",), role=OPERATIONAL_ROLE,
            brief="Stored dtype."),
    Setting("capture_limit", int, 8, "Capture requests in flight per server.", low=1,
            high=4096, flags=("--limit",), role=OPERATIONAL_ROLE,
            brief="Captures in flight per server."),
    Setting("capture_timeout", float, None, "Seconds one capture call may take, its answer "
            "headers and body in all: the engine's prefill of the job's longest example must "
            "fit (a capture's lease is this, the file timeout and the lease margin).",
            flags=("--timeout",), omitted="the service's SYNTHQ_CAPTURE_TIMEOUT (120 s)",
            role=OPERATIONAL_ROLE, brief="Seconds per capture call [default: the service's].",
            **_POSITIVE_SECONDS),  # type: ignore[arg-type]
    Setting("train_target", str, None, "The target model's folder (its config.json gives the "
            "layer count and width for the default layers and the disk plan). Stored on the "
            "job as its training target.", max_len=1000, flags=("--target", "-t"),
            role=OPERATIONAL_ROLE,
            brief="The target model's folder (stored on the job)."),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in (*SETTINGS, *CAPTURE)}

#: Per-sample settings a requeue may set, by the key ``samples.overrides`` stores.
OVERRIDABLE: tuple[str, ...] = tuple(s.key for s in SETTINGS if s.requeue == "sample")

#: Request fields ``extra_body`` may not set: those synthq sets itself (model, messages,
#: stream, max_tokens, the row's tools) and those that change how many answers come back
#: (n, best_of), how long they may be (max_completion_tokens, ignore_eos), how they are
#: counted (stream_options) or what shape they have (logprobs, echo, a continued message),
#: and ``kv_transfer_params``: it drives the engine's KV connector (a capture's file name;
#: two calls naming one file wedged vLLM for good, issue 41).
RESERVED_BODY = frozenset({
    "model", "messages", "stream", "max_tokens", "tools", "tool_choice",
    "n", "best_of", "max_completion_tokens", "ignore_eos", "logprobs", "top_logprobs",
    "prompt_logprobs", "stream_options", "echo", "continue_final_message",
    "add_generation_prompt", "kv_transfer_params"})


def default(name: str) -> Any:
    """The declared default of setting ``name``."""
    return BY_NAME[name].default


def setting_for_key(key: str) -> Setting | None:
    """The setting stored under ``key`` (``total_timeout`` → ``timeout``)."""
    for s in SETTINGS:
        if s.key == key:
            return s
    return None


def check(s: Setting, value: Any) -> Any:
    """``value`` of setting ``s``, checked (an int given for a float becomes a float);
    a :class:`UserError` naming the option otherwise."""
    if value is None:
        if s.required:
            raise UserError(f"{s.flag} is required")
        return None
    if s.type is bool:
        if not isinstance(value, bool):
            raise UserError(f"{s.flag} must be true or false, got {value!r}")
        return value
    if s.type in (int, float):
        return _number(s, value)
    if s.name == "inflight" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # the API's number; "auto" is the other form
    if s.type is str:
        if not isinstance(value, str):
            raise UserError(f"{s.flag} must be a string, got {value!r}")
        if s.choices and value not in s.choices:
            raise UserError(f"{s.flag} must be {_one_of(s.choices)}, got {value!r}")
        if s.max_len is not None and len(value) > s.max_len:
            raise UserError(f"{s.flag} may be at most {s.max_len} characters, got "
                            f"{len(value):,}")
    elif s.type is dict and not isinstance(value, dict):
        raise UserError(f"{s.flag} must be a JSON object")
    elif s.type is list and not (isinstance(value, list) and all(
            isinstance(v, s.item) and not isinstance(v, bool) for v in value)):
        raise UserError(f"{s.flag} must be a list of "
                        f"{'integers' if s.item is int else 'strings'}")
    if s.urls:
        value = _urls(s, value) if s.type is list else _url_keys(s, value)
    if s.name == "extra_body":
        check_body(value)
    if s.also is not None:
        s.also(value)
    return value


def _urls(s: Setting, given: list[str]) -> list[str]:
    """Base URLs, each http(s), none twice, without a trailing ``/``."""
    from urllib.parse import urlparse

    for url in given:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UserError(f"{s.flag} {url!r} is not an http(s) URL such as "
                            "http://localhost:8000/v1")
    stripped = [u.rstrip("/") for u in given]
    if len(set(stripped)) != len(stripped):
        raise UserError(f"the same {s.flag} is given twice")
    return stripped


def _url_keys(s: Setting, given: dict[str, Any]) -> dict[str, str]:
    """A mapping of base URLs (each checked as :func:`_urls` checks a list) to strings."""
    if not all(isinstance(v, str) for v in given.values()):
        raise UserError(f"{s.flag} must map each server URL to a folder")
    return dict(zip(_urls(s, list(given)), given.values(), strict=True))


def named_urls(values: Mapping[str, Any]) -> list[str]:
    """Every server URL that settings ``values`` (by name) name: the URL lists, and the
    keys of a mapping by URL (``capture_files``)."""
    return [u for name, value in values.items()
            if name in BY_NAME and BY_NAME[name].urls and value for u in value]


def urls(spec: Any) -> list[str]:
    """Every server URL a JobSpec names (its ``servers``, ``capture_servers``, ...): what
    the API checks against SYNTHQ_ALLOWED_SERVERS before it sends anything anywhere."""
    return [u for s in SETTINGS if s.urls for u in getattr(spec, s.key)]


def _number(s: Setting, value: Any) -> Any:
    if s.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{s.flag} must be {s.must_be()}, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise UserError(f"{s.flag} must be a number, got {value!r}")
    low_ok = s.low is None or (value > s.low if s.low_open else value >= s.low)
    high_ok = s.high is None or (value < s.high if s.high_open else value <= s.high)
    if not low_ok or not high_ok:
        shown = f"{value:,}" if isinstance(value, int) else f"{value:g}"
        raise UserError(f"{s.flag} is out of range: {s.flag} must be {s.must_be()}, "
                        f"got {shown}")
    if s.also is not None:
        s.also(value)
    return float(value) if s.type is float else value


def _one_of(choices: tuple[str, ...]) -> str:
    if len(choices) == 2:
        return " or ".join(choices)
    return "one of " + ", ".join(choices)


def ints(text: str, s: Setting) -> list[int]:
    """A comma-separated list of integers as the CLI takes it (``--layers 2,4,5,8``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{s.flag} {text!r}: give comma-separated integers, e.g. 2,4,5,8") \
            from None


def pairs(items: list[str], s: Setting) -> dict[str, str]:
    """``URL=DIR`` items as the CLI takes them (``--engine-files``): URL → DIR ("" for
    ``URL=``)."""
    out: dict[str, str] = {}
    for item in items:
        url, eq, folder = item.rpartition("=")
        if not eq or not url:
            raise UserError(f"{s.flag} {item!r}: expected URL=DIR")
        out[url] = folder
    return out


def check_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Each declared setting in ``values`` checked (:func:`check`); the others as given."""
    return {k: check(BY_NAME[k], v) if k in BY_NAME else v for k, v in values.items()}


def check_body(body: Mapping[str, Any], flag: str = "--extra-body") -> None:
    """Refuse request fields ``extra_body`` (or a job's sampling options, sent in the same
    body) may not set (:data:`RESERVED_BODY`), in one line."""
    reserved = RESERVED_BODY & set(body)
    if reserved:
        raise UserError(f"{flag} may not set {sorted(reserved)}: synthq sets these itself, or "
                        "they change how many answers come back, how long or in what shape, "
                        "how their tokens are counted, or what the engine's KV connector does")


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Per-sample settings of a requeue, by stored key (``total_timeout``), checked; the
    ``None`` values dropped. Raises :class:`UserError` naming the option."""
    out = {k: v for k, v in overrides.items() if v is not None}
    unknown = set(out) - set(OVERRIDABLE)
    if unknown:
        raise UserError(f"unknown settings {sorted(unknown)}; known: {', '.join(OVERRIDABLE)}")
    for key, value in out.items():
        s = setting_for_key(key)
        assert s is not None
        out[key] = check(s, value)
    return out


def requeue_settings(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A requeue's settings (by name: ``timeout``, ``inflight``, ...; None: not given),
    checked: the requeued samples' overrides (by stored key), and the job's new in-flight
    fields (None: unchanged)."""
    unknown = [k for k in values if k not in BY_NAME or not BY_NAME[k].requeue]
    if unknown:
        raise UserError(f"a requeue cannot set {sorted(unknown)}")
    overrides = check_overrides({BY_NAME[k].key: v for k, v in values.items()
                                 if BY_NAME[k].requeue == "sample"})
    inflight = {k: values.get(k) for k in ("inflight", "max_inflight", "min_inflight")}
    if all(v is None for v in inflight.values()):
        return overrides, None
    if inflight["inflight"] is None:
        raise UserError("--max-inflight and --min-inflight go with --inflight auto")
    checked = {k: check(BY_NAME[k], v) for k, v in inflight.items()}
    return overrides, inflight_settings(checked["inflight"], checked["max_inflight"],
                                        checked["min_inflight"])


def apply_overrides(view: Any, job: Any, overrides: Mapping[str, Any]) -> None:
    """Set on ``view`` the job's per-sample settings with ``overrides`` on top.

    Sampling keys go into ``sampling``; ``extra_body`` is merged over the job's;
    ``chat_template_kwargs`` replace the job's and are sent in the body too (as
    :func:`build` sends a job's); any other replaces the job's attribute.
    """
    view.sampling = dict(job.sampling or {})
    view.extra_body = {**(job.extra_body or {}), **(overrides.get("extra_body") or {})}
    view.chat_template_kwargs = job.chat_template_kwargs
    for key in OVERRIDABLE:
        s = setting_for_key(key)
        assert s is not None and s.field != ""
        if key == "extra_body":
            continue
        if s.field and s.field.startswith("sampling."):
            if key in overrides:
                view.sampling[key] = overrides[key]
        elif key == "chat_template_kwargs":
            if key in overrides:
                view.chat_template_kwargs = overrides[key]
                view.extra_body["chat_template_kwargs"] = overrides[key]
        else:
            setattr(view, key, overrides.get(key, getattr(job, key)))


def job_name(given: str | None, source: str) -> str:
    """The job's name: ``given``, else the dataset's file name without its suffixes."""
    return given or source.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].split(".")[0] \
        or "job"


def inflight_settings(inflight: str | int, max_inflight: int | None = None,
                      min_inflight: int | None = None) -> dict[str, Any]:
    """The job fields of ``--inflight N|auto``, ``--max-inflight``, ``--min-inflight``.

    ``N``: a fixed limit. ``auto``: the servers' adaptive limits (synthq.serving.adaptive)
    between the floor and the cap (``inflight_limit`` holds the cap). Raises
    :class:`UserError` with one line for anything else.
    """
    value = str(inflight).strip().lower()
    if value == "auto":
        cap = DEFAULT_MAX_INFLIGHT if max_inflight is None else max_inflight
        floor = DEFAULT_MIN_INFLIGHT if min_inflight is None else min_inflight
        if not (1 <= cap <= MAX_INFLIGHT and 1 <= floor <= MAX_INFLIGHT):
            raise UserError(f"--max-inflight and --min-inflight must be 1 to {MAX_INFLIGHT:,}")
        if floor > cap:
            raise UserError(f"--min-inflight {floor} is above --max-inflight {cap}")
        return {"inflight_limit": cap, "inflight_auto": True, "min_inflight": floor}
    try:
        limit = int(value)
    except ValueError:
        raise UserError(f"--inflight must be a number of requests or 'auto', got "
                        f"{inflight!r}") from None
    if not 1 <= limit <= MAX_INFLIGHT:
        raise UserError(f"--inflight must be 1 to {MAX_INFLIGHT:,}, got {limit}")
    if max_inflight is not None or min_inflight is not None:
        raise UserError("--max-inflight and --min-inflight go with --inflight auto")
    return {"inflight_limit": limit, "inflight_auto": False,
            "min_inflight": DEFAULT_MIN_INFLIGHT}


def kept_when_omitted(key: str) -> bool:
    """Whether an empty value of the stored setting ``key`` keeps the job's on re-enqueue."""
    s = setting_for_key(key)
    return s is not None and s.kept_when_omitted


#: The job columns of the operational settings: what enqueueing a job again may change
#: (``--inflight`` stands for the three columns of :func:`inflight_settings`).
OPERATIONAL: tuple[str, ...] = tuple(
    key for s in SETTINGS if s.operational
    for key in (inflight_settings("auto") if s.name == "inflight" else [s.key]))


def _columns(role: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(s.column for s in SETTINGS if s.role == role and s.column))


#: The job columns whose values the answers depend on: the "same work" key's settings.
GENERATION: tuple[str, ...] = _columns(GENERATION_ROLE)
#: The job columns that make examples from the answers (``synthq.data.tokenize.TokenizeSettings``).
TOKENIZATION: tuple[str, ...] = _columns(TOKENIZATION_ROLE)
#: The settings ``synthq retokenize`` may change (each its own column).
RETOKENIZABLE: tuple[str, ...] = tuple(s.name for s in SETTINGS if s.retokenize)
#: The job columns recorded in the export manifest (what produced the data).
EXPORTED: tuple[str, ...] = tuple(dict.fromkeys(s.column for s in SETTINGS
                                                if s.exported and s.column))


def generation_settings(get: Callable[[str], Any]) -> dict[str, Any]:
    """What makes two generations of one prompt the same work (part of the content key):
    each :data:`GENERATION` column's value (``get(column)``), those with ``key_when`` only
    while it holds (a last-turn job's keys stay as they were before regenerating all)."""
    out: dict[str, Any] = {}
    for s in SETTINGS:
        if s.role != GENERATION_ROLE or not s.column or s.column in out:
            continue
        if s.key_when is not None and get(s.key_when[0]) != s.key_when[1]:
            continue
        out[s.column] = get(s.column)
    return out
