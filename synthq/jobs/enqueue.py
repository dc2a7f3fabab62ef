"""Create a job (or find it again) and insert its samples from a dataset.

Samples are keyed by content (docs/design.md, invariant 9): enqueueing the same data
into a job again inserts nothing. Malformed rows become ``skipped`` samples
with their reason (invariant 8). The rows are written in batches by
:mod:`synthq.jobs.samplecopy` (a binary ``COPY`` on PostgreSQL).

A job keeps the prompt rule it was created under (``jobs.key_version``, see
:data:`synthq.data.dataset.KEY_VERSION`): rows enqueued into a job made before the
current rule are read under its old rule, so they match its samples instead
of doubling them, and the report says so. Each sample keeps its row's own id
as ``source_id``; ids that several samples of the job share are reported.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from synthq.core.errors import UserError
from synthq.core.secrets import safe_url
from synthq.data.dataset import (
    KEY_VERSION,
    MAX_ROW_CHARS,
    Row,
    iter_rows,
)
from synthq.jobs.samplecopy import insert_rows
from synthq.queue import jobs
from synthq.spec import jobspec
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, Sample

__all__ = ["JobSpec", "EnqueueReport", "enqueue", "get_or_create_job",
           "find_job", "inflight_settings", "DEFAULT_MAX_INFLIGHT", "DEFAULT_MIN_INFLIGHT"]

#: ``--inflight auto``: the default hard cap and floor of the adaptive limit.
#: The most requests in flight per server any setting may ask for.
MAX_INFLIGHT = jobspec.MAX_INFLIGHT
DEFAULT_MAX_INFLIGHT = jobspec.DEFAULT_MAX_INFLIGHT
DEFAULT_MIN_INFLIGHT = jobspec.DEFAULT_MIN_INFLIGHT
inflight_settings = jobspec.inflight_settings


#: Characters a job name may not hold: ``/`` and ``\\`` (paths and URLs), control
#: characters (newlines forge log lines) and bidirectional overrides (U+202E shows
#: text reversed).
_BAD_NAME_CHARS = re.compile(r"[/\\\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                             r"\u2066-\u2069]")


def _check_tokenizer_path(tokenizer: str) -> None:
    """A tokenizer typed as a path (``/``, ``./``, ``~``) must exist: no Hub lookup of a typo."""
    import os

    if tokenizer.startswith(("/", "./", "../", "~", "\\")) and \
            not os.path.exists(os.path.expanduser(tokenizer)):
        raise UserError(f"--tokenizer {tokenizer}: no such directory (a local tokenizer is "
                        "a folder holding tokenizer.json or tokenizer_config.json)")


def _char_name(char: str) -> str:
    import unicodedata

    if char in "/\\":
        return repr(char)
    return f"U+{ord(char):04X} ({unicodedata.name(char, 'a control character')})"


@dataclass
class JobSpec:
    """Everything a job is created with; validated by :meth:`check`.

    A field per declared setting with a column of its own (synthq.spec.jobspec.SETTINGS: its
    key, type and default), plus what is made from several (``sampling``, from the
    sampling keys; ``inflight_limit``, ``inflight_auto`` and ``min_inflight``, from
    --inflight) and the ``dataset``. Written out so that mypy knows each field; a test
    (tests/unit/test_job_roles.py) fails when they and the declaration differ.
    """

    name: str
    model: str
    servers: list[str]
    # The defaults are the declared ones (synthq.spec.jobspec).
    max_tokens: int = jobspec.default("max_tokens")
    sampling: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    total_timeout: float = jobspec.default("timeout")
    stall_timeout: float = jobspec.default("stall_timeout")
    max_attempts: int = jobspec.default("max_attempts")
    backoff_base: float = jobspec.default("backoff_base")
    backoff_cap: float = jobspec.default("backoff_cap")
    inflight_limit: int = int(jobspec.default("inflight"))
    #: ``--inflight auto``: inflight_limit is then the hard cap (``--max-inflight``).
    inflight_auto: bool = False
    min_inflight: int = DEFAULT_MIN_INFLIGHT
    #: GPUs behind each server, and the price of a GPU-hour (cost report).
    gpus: int = jobspec.default("gpus")
    gpu_hour_price: float | None = None
    keep_truncated: bool = jobspec.default("keep_truncated")
    #: False: one non-streamed call per sample (no stall clock, no partial progress).
    stream: bool = jobspec.default("stream")
    #: A streamed answer longer than this fails as ``response_too_large``.
    max_response_bytes: int = jobspec.default("max_response_bytes")
    dataset: str = ""
    # Tokenization (synthq.data.tokenize); no tokenizer means none.
    tokenizer: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_seq_len: int = jobspec.default("max_seq_len")
    reasoning: str = jobspec.default("reasoning")
    #: None: the default of its ``regenerate`` (synthq.spec.jobspec.mask_for).
    mask: str | None = None
    think_open: str = jobspec.default("think_open")
    think_close: str = jobspec.default("think_close")
    #: ``last`` or ``all`` (every assistant turn, each on the regenerated history).
    regenerate: str = jobspec.default("regenerate")
    #: ``drop`` or ``keep``: earlier regenerated turns sent with their reasoning_content.
    history_reasoning: str = jobspec.default("history_reasoning")
    #: ``conversation`` or ``per-turn`` (synthq.data.examples); None: chosen at enqueue.
    examples: str | None = None
    #: Hidden-state capture servers (synthq.capture); empty: no capture stage.
    capture_servers: list[str] = field(default_factory=list)
    #: ``stage`` or ``inline`` (the final answer's call captures its hidden states too).
    capture_mode: str = jobspec.default("capture_mode")

    def __post_init__(self) -> None:
        self.mask = jobspec.mask_for(self.mask, self.regenerate)
        if self.capture_mode == "inline":  # the generation servers capture too
            self.capture_servers = list(dict.fromkeys([*self.capture_servers, *self.servers]))

    def check(self) -> None:
        """Raise :class:`UserError` naming the first bad setting."""
        if not self.name.strip() or len(self.name) > 200:
            raise UserError("job name must be 1 to 200 characters")
        bad = _BAD_NAME_CHARS.search(self.name)
        if bad:
            raise UserError(f"job name may not hold {_char_name(bad.group())}: it is shown in "
                            "URLs, logs and terminals; use letters, digits, - _ . and spaces")
        if self.name.strip().isdigit():
            raise UserError(f"job name {self.name!r} is all digits, which `synthq status` "
                            "would read as a job id; pick a name with a letter in it")
        if not self.model.strip():
            raise UserError("--model must name the served model")
        if not self.servers:
            raise UserError("give at least one --server URL, e.g. http://localhost:8000/v1")
        # Each declared setting's type, bounds and choices (synthq.spec.jobspec), as a front
        # end checks them (the servers' URLs too); then what relates settings to each other.
        for s in jobspec.SETTINGS:
            if s.field == "" or s.name == "name":
                continue
            path = s.field or s.name
            value = (self.sampling.get(s.key) if path.startswith("sampling.")
                     else getattr(self, path))
            jobspec.check(s, value)
        # The stored forms of --inflight N|auto (inflight_settings).
        for flag, value, high in (("--inflight", self.inflight_limit, MAX_INFLIGHT),
                                  ("--min-inflight", self.min_inflight, MAX_INFLIGHT)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= high:
                raise UserError(f"{flag} must be 1 to {high:,}, got {value!r}")
        if self.inflight_auto and self.min_inflight > self.inflight_limit:
            raise UserError(f"--min-inflight {self.min_inflight} is above --max-inflight "
                            f"{self.inflight_limit}")
        if self.backoff_cap < self.backoff_base:
            raise UserError("--backoff-cap must be at least --backoff-base")
        if self.tokenizer is not None:
            _check_tokenizer_path(self.tokenizer)
        if self.capture_mode == "inline":
            self._check_inline()
        # Sampling keys are sent in the body as extra_body's are: one list refuses both.
        jobspec.check_body(self.sampling, flag="sampling options")

    def _check_inline(self) -> None:
        """``--capture inline``: the final example is the engine's prompt and output ids,
        the output supervised (synthq.data.examples.engine_example), so the job must make
        examples and supervise only the final answer in the example that holds it."""
        if self.tokenizer is None:
            raise UserError("--capture inline needs --tokenizer: the captured states are "
                            "those of the training examples it makes")
        if self.regenerate == "all" and self.mask != "last_turn" \
                and self.examples != "per-turn":
            raise UserError("--capture inline with --regenerate all: give --examples per-turn "
                            "(or --mask last_turn): the final call's file holds the states of "
                            "the last turn's example; earlier turns are captured by the stage")
        if self.regenerate != "all" and self.mask != "last_turn":
            raise UserError("--capture inline supervises the answer the engine wrote: "
                            "--mask last_turn (its default)")

    def tokenize_settings(self) -> Any:
        """The tokenization settings, or None without a tokenizer."""
        from synthq.data.tokenize import TokenizeSettings

        return TokenizeSettings.from_job(self)

    def generation_settings(self) -> dict[str, Any]:
        """As :meth:`synthq.store.models.Job.generation_settings` (both synthq.spec.jobspec's)."""
        return jobspec.generation_settings(lambda column: getattr(self, column))


@dataclass
class EnqueueReport:
    job_id: int
    job_name: str
    created: bool
    rows: int = 0
    inserted: int = 0
    skipped: int = 0
    duplicates: int = 0
    updated_settings: list[str] = field(default_factory=list)
    #: A few skip reasons with where the row is (``line 3``, ``row 3``), for the summary.
    skip_examples: list[tuple[str, str]] = field(default_factory=list)
    #: The job's prompt rule (synthq.data.dataset.KEY_VERSION for jobs made now).
    key_version: int = KEY_VERSION
    #: Rows read that carry their own id (kept as the sample's source_id).
    source_ids: int = 0
    #: Source ids that more than one sample of the job holds, and the first few of them.
    duplicate_source_ids: int = 0
    duplicate_source_id_examples: list[str] = field(default_factory=list)
    #: Things the user should know, one line each (the CLI prints them as warnings).
    warnings: list[str] = field(default_factory=list)
    #: What a setting resolved to (``--reasoning auto: drop: ...``), one line each.
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def find_job(session: Session, ref: str | int) -> Job:
    """A job by id or name, or a :class:`UserError` that lists what exists."""
    job = None
    if isinstance(ref, int) or str(ref).isdigit():
        job = session.get(Job, int(ref))
    if job is None:
        job = session.scalar(select(Job).where(Job.name == str(ref)))
    if job is None:
        names = session.scalars(select(Job.name).order_by(Job.id.desc()).limit(10)).all()
        hint = f" Jobs: {', '.join(names)}." if names else " There are no jobs yet."
        raise UserError(f"no job {ref!r}.{hint}")
    return job


def get_or_create_job(session: Session, spec: JobSpec) -> tuple[Job, bool, list[str]]:
    """The job named ``spec.name``: created, or found with the same generation settings.

    Operational settings (servers, timeouts, limits) of an existing job are
    updated to the spec's; a different model or sampling is an error, since
    its samples would no longer be the same work.
    """
    spec.check()
    job = session.scalar(select(Job).where(Job.name == spec.name))
    now = utcnow()
    if job is None:
        values = asdict(spec)
        values["examples"] = spec.examples or "conversation"
        job = jobs.create_job(session, values, key_version=KEY_VERSION, now=now)
        if job is not None:
            return job, True, []
        # Another enqueue created it a moment ago: treat it as found.
        job = session.scalars(select(Job).where(Job.name == spec.name)
                              .execution_options(populate_existing=True)).one()
    if job.generation_settings() != spec.generation_settings():
        hint = (f"; to send its remaining work to model {spec.model!r}: `synthq requeue "
                f"{spec.name} --failed --model {spec.model}`"
                if {**job.generation_settings(), "model": spec.model}
                == spec.generation_settings() else "")
        raise UserError(
            f"job {spec.name!r} exists with other generation settings "
            f"({json.dumps(job.generation_settings())}); pick another --job name{hint}")
    from synthq.data.tokenize import TokenizeSettings

    theirs, ours = TokenizeSettings.from_job(job), spec.tokenize_settings()
    if theirs != ours or (spec.examples or "conversation") != job.examples:
        raise UserError(
            f"job {spec.name!r} exists with other tokenization settings; change them with "
            f"`synthq retokenize {spec.name} ...` (no new generation), or pick another --job")
    if job.key_version > KEY_VERSION:
        raise UserError(
            f"job {spec.name!r} was created by a newer synthq (key version {job.key_version}; "
            f"this one knows up to {KEY_VERSION}): upgrade synthq to add rows to it")
    # The settings that may change on an existing job: how to run it, not what it makes.
    changed = [k for k in jobspec.OPERATIONAL if getattr(job, k) != getattr(spec, k)
               and not (jobspec.kept_when_omitted(k) and not getattr(spec, k))]
    described = [safe_url(f"{k} {getattr(job, k)!r} -> {getattr(spec, k)!r}") for k in changed]
    jobs.update_job(session, job, {k: getattr(spec, k) for k in changed}, now=now)
    return job, False, described


#: Duplicate source ids named in the report.
DUPLICATE_EXAMPLES = 5


def duplicate_source_ids(session: Session, job_id: int,
                         limit: int = DUPLICATE_EXAMPLES) -> tuple[int, list[str]]:
    """How many source ids more than one sample of the job holds, and the first few."""
    shared = (select(Sample.source_id, func.min(Sample.id).label("first"))
              .where(Sample.job_id == job_id, Sample.source_id.is_not(None))
              .group_by(Sample.source_id).having(func.count() > 1).subquery())
    count = session.scalar(select(func.count()).select_from(shared)) or 0
    examples = session.scalars(select(shared.c.source_id).order_by(shared.c.first)
                               .limit(limit)).all() if count else []
    return int(count), [str(e) for e in examples]


def _warn_unread(source: str, report: EnqueueReport) -> None:
    """A dataset folder's files that are not read (``.csv``, ``.md``): named, not silent."""
    import os
    from pathlib import Path

    from synthq.data.dataset import unread_files

    folder = Path(os.path.expanduser(source))
    if not folder.is_dir():
        return
    unread = unread_files(folder)
    if unread:
        shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5:,} more" if len(unread) > 5
                                         else "")
        report.warnings.append(f"skipped {len(unread):,} files in {source} that are not "
                               f".jsonl, .json, .jsonl.gz or .parquet: {shown}")


def old_rule_warning(job_name: str, key_version: int) -> str:
    """The line that says a job keeps its old prompt rule."""
    return (f"job {job_name!r} was created under prompt rule {key_version} (the prompt stopped "
            "before the last assistant turn, dropping a final user question); its rows are "
            "read under that rule so they match its samples instead of being added twice. "
            f"Enqueue into a new --job to use the current rule ({KEY_VERSION}: the prompt ends "
            "with the last user turn)")


def enqueue(spec: JobSpec, source: str, *, max_chars: int = MAX_ROW_CHARS,
            id_field: str | None = None,
            progress: Callable[[EnqueueReport], None] | None = None) -> EnqueueReport:
    """Create or find the job and add the dataset's rows. Safe to repeat.

    ``id_field`` names the field holding each row's own id (default: the first
    of ``id``, ``uuid``, ``conversation_id``, ``sample_id`` a row has).
    """
    if not source.strip():
        raise UserError("--dataset is empty")
    if id_field is not None and not id_field.strip():
        raise UserError("--id-field is empty")
    spec.dataset = source
    spec.check()  # bad settings in one line before the tokenizer's seconds of loading
    notes, chat = _resolve_tokenization(spec)
    with session_scope() as s:
        known, examples = s.execute(select(Job.key_version, Job.examples)
                                    .where(Job.name == spec.name)).one_or_none() or (None, None)
    from synthq.data.examples import choose

    # An existing job keeps its own; a new one is chosen now, before any call.
    note = None
    if spec.examples is None and examples is not None:
        spec.examples = examples
    else:
        spec.examples, note = choose(spec.examples, regenerate=spec.regenerate,
                                     mask=spec.mask, tokenizer=chat)
    spec.check()  # the timeout below the broker's visibility timeout too (synthq.spec.jobspec)
    from synthq.data.dataset import DatasetError

    # The rows are read under the job's prompt rule: an existing job's own.
    try:
        rows = iter_rows(source, max_chars=max_chars, id_field=id_field,
                         key_version=known or KEY_VERSION, regenerate=spec.regenerate)
        # Read up to the first valid row before making the job: a source that
        # is unreadable or holds no valid row leaves nothing behind.
        head = _read_to_first_valid(rows)
    except DatasetError as exc:
        raise UserError(str(exc)) from exc
    if not any(not r.skipped for r in head) and len(head) < PEEK_ROWS:
        raise UserError(_no_valid_row(source, head))
    with session_scope() as s:
        job, created, changed = get_or_create_job(s, spec)
        job_id, settings, key_version = job.id, job.key_generation_settings(), job.key_version
        tokenized = bool(job.tokenizer)
    report = EnqueueReport(job_id=job_id, job_name=spec.name, created=created,
                           updated_settings=changed, key_version=key_version,
                           notes=notes if created else [])
    if key_version != KEY_VERSION:
        report.warnings.append(old_rule_warning(spec.name, key_version))
    if note is not None and created:
        report.warnings.append(note)
    _warn_unread(source, report)
    if changed:
        report.warnings.append(f"job {spec.name}: its live settings changed: "
                               f"{', '.join(changed)}")
    try:
        insert_rows(job_id, settings, itertools.chain(head, rows), report, progress,
                    key_version=key_version, regenerate=spec.regenerate)
    except DatasetError as exc:
        raise UserError(str(exc)) from exc
    if report.rows == report.skipped:
        raise UserError(_no_valid_row(source, [], report.skip_examples) +
                        f" (its {report.skipped:,} rows are in job {spec.name!r} as skipped)")
    _check_source_ids(report, id_field)
    if not tokenized:
        report.warnings.append(no_tokenizer_warning(spec.name))
    return report


def no_tokenizer_warning(name: str) -> str:
    """What a job without a tokenizer is told when its prompts are enqueued (CLI and API):
    it was told nothing, and learnt it at `synthq train` or a Parquet export."""
    return (f"job {name} has no tokenizer: its answers are stored, but they make no training "
            "data (no input_ids or loss mask for `synthq train` or a Parquet export); add "
            f"one later, with no new calls: `synthq retokenize {name} --tokenizer TARGET` "
            "(the target model's folder or Hugging Face id)")


def _resolve_tokenization(spec: JobSpec) -> tuple[list[str], Any]:
    """Check the tokenization settings before anything is stored or sent, and resolve
    ``--reasoning auto`` on ``spec``: an existing job keeps its own mode, a new one
    takes what its template allows. Returns the line that says what auto became, and
    the loaded tokenizer (None without one)."""
    tokenize = spec.tokenize_settings()
    if tokenize is None:
        return [], None
    from synthq.data.tokenize import get_chat_tokenizer, precheck_reasoning

    # From the template alone first (well under a second): an impossible --reasoning
    # keep is refused before the tokenizer's load, which takes 20 s to a minute.
    precheck_reasoning(tokenize)
    # Then load it: a tokenizer or template that cannot work (one that loses
    # characters in a round trip, too) is an error here, not a failure of every sample.
    tok = get_chat_tokenizer(tokenize)
    if spec.reasoning != "auto":
        return [], tok
    with session_scope() as s:
        theirs = s.scalar(select(Job.reasoning).where(Job.name == spec.name,
                                                      Job.tokenizer.is_not(None)))
    if theirs in ("keep", "drop"):  # the job's own, whatever auto would pick today
        spec.reasoning = theirs
        return [], tok
    spec.reasoning = tok.reasoning
    return [tok.reasoning_line], tok


#: Rows read before the job is made, looking for a valid one.
PEEK_ROWS = 10_000


def _read_to_first_valid(rows: Iterator[Row]) -> list[Row]:
    """The rows up to and including the first valid one (or PEEK_ROWS of them)."""
    head: list[Row] = []
    for row in rows:
        head.append(row)
        if not row.skipped or len(head) >= PEEK_ROWS:
            break
    return head


def _no_valid_row(source: str, head: list[Row],
                  examples: list[tuple[str, str]] | None = None) -> str:
    if examples is None:
        examples = [(r.where or f"row {r.index + 1}", r.skip_reason or "malformed row")
                    for r in head]
    if not examples:
        return f"{source} has no rows"
    reasons = "; ".join(f"{where}: {reason}" for where, reason in examples[:3])
    return f"{source} has no valid row ({reasons})"


def _check_source_ids(report: EnqueueReport, id_field: str | None) -> None:
    """Warn about rows without their own id (when one was asked for) and shared ids."""
    if id_field is not None and report.source_ids < report.rows:
        missing = report.rows - report.source_ids
        report.warnings.append(
            f"{missing:,} of {report.rows:,} rows have no field {id_field!r}: their samples "
            "have no source_id")
    if not report.source_ids:
        return
    with session_scope() as s:
        count, examples = duplicate_source_ids(s, report.job_id)
    report.duplicate_source_ids, report.duplicate_source_id_examples = count, examples
    if count:
        more = ", …" if count > len(examples) else ""
        report.warnings.append(
            f"{count:,} source ids are held by more than one sample of job "
            f"{report.job_name!r} (different rows with the same id): "
            f"{', '.join(examples)}{more}")


def build_spec(values: Mapping[str, Any], *, source: str = "") -> JobSpec:
    """The :class:`synthq.jobs.enqueue.JobSpec` of ``values`` (API form: objects as dicts, the
    chat template as text), checked (:meth:`JobSpec.check`: each setting as declared).
    ``source``: the dataset, whose file name names a job given no name."""
    given = {k: v for k, v in values.items() if k in jobspec.BY_NAME}
    v = {s.name: given.get(s.name, s.default) for s in jobspec.SETTINGS}
    # What the JobSpec is made from is checked here; the rest by JobSpec.check, in its order
    # (the name, the model and the servers first), once the spec is made.
    for s in jobspec.SETTINGS:
        if s.field == "" or s.type in (list, dict):
            v[s.name] = jobspec.check(s, v[s.name])
    sampling: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for s in jobspec.SETTINGS:
        if s.field == "" or v[s.name] is None:  # not given: the JobSpec's own default
            continue
        target = s.field or s.name
        if target.startswith("sampling."):
            sampling[s.key] = v[s.name]
        else:
            fields[target] = v[s.name]
    body = dict(v["extra_body"] or {})
    kwargs = dict(v["chat_template_kwargs"] or {})
    if kwargs:  # the server renders with them, and so does our tokenizer
        body["chat_template_kwargs"] = kwargs
    if v["return_token_ids"]:
        body["return_token_ids"] = True
    fields.update(
        name=jobspec.job_name(v["name"], source), sampling=sampling, extra_body=body,
        chat_template_kwargs=kwargs,
        **jobspec.inflight_settings(v["inflight"], v["max_inflight"], v["min_inflight"]))
    spec = JobSpec(**fields)
    spec.check()
    return spec
