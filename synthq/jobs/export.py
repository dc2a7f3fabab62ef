"""Export a job's done samples as training data: Parquet or JSONL shards plus a manifest.

Layout of an export directory::

    OUT/
      data-00000-of-00003.parquet   (or .jsonl), ``shard_size`` rows each, id order
      data-00001-of-00003.parquet
      data-00002-of-00003.parquet
      manifest.json                 counts, shards, token totals, tokenizer, settings

Parquet columns (``datasets.load_dataset("parquet", data_files="OUT/*.parquet")``):
one row per training example (:mod:`synthq.data.examples`): a sample's, or with
``--examples per-turn`` one per regenerated turn. ``id`` (string: synthq's
sample id; ``ID:TURN`` for a per-turn example), ``source_id`` (string or null:
the dataset row's own id), ``input_ids`` (list<int32>), ``loss_mask``
(list<int8>, 0/1, as long as ``input_ids``), ``conversations``
(list<struct<role, content, reasoning_content, tool_calls, tool_call_id,
finish_reason>>: the messages the example was tokenized from, each generated
answer with its ``finish_reason``), ``tools`` (the row's tool definitions, JSON
text of the OpenAI list), ``tool_choice`` (JSON text), ``finish_reason`` (the
supervised turn's), ``turn`` (per-turn examples: which turn, else null).
JSONL is SpecForge's and speculators' layout: ``{"id", "source_id",
"conversations": [{"role", "content"}, ...], "finish_reason"}``, plus ``"tools":
[...]`` (a list, as both read it) and ``"tool_choice"`` when the row has tools,
``"turn"`` for a per-turn example, and ``"finish_reasons"`` (one per generated
turn) for a whole conversation of several; the answers' reasoning under
``reasoning_content`` when the job keeps reasoning. SpecForge reads
``conversations`` (and ``tools``) and ignores the rest.

Rows are streamed with keyset pagination (``id > last ORDER BY id LIMIT BATCH``),
one Parquet row group per page, so memory does not grow with the job. On
PostgreSQL every query runs in one read-only REPEATABLE READ transaction: the
counts in the manifest and the rows in the shards are the same snapshot even
while workers keep finishing samples.

The export is atomic: everything is written into a temporary directory next
to ``OUT`` and renamed into place at the end; on any error it is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine, func, or_, select
from sqlalchemy.orm import Session

import synthq
from synthq.core.errors import UserError
from synthq.core.packing import unpack_ids, unpack_mask
from synthq.core.secrets import safe_keys
from synthq.data.examples import Example, build, exported, split
from synthq.queue.states import SampleState
from synthq.spec.jobspec import EXPORTED
from synthq.store.db import get_engine, session_scope, utcnow
from synthq.store.models import Job, Sample

__all__ = ["FORMATS", "FEATURE_FORMATS", "Manifest", "export_job", "check_options",
           "tokenizer_fingerprint", "parquet_schema"]

#: Output formats.
FORMATS = ("parquet", "jsonl")
#: Formats of captured features (synthq.training.export_features writes them).
FEATURE_FORMATS = ("speculators", "specforge")
#: Rows per database query (and per Parquet row group).
BATCH = 1000
MANIFEST = "manifest.json"
#: Files whose bytes identify a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
#: Job columns recorded in the manifest: what produced the data.
#: (The declared settings that say so, synthq.spec.jobspec.EXPORTED, and the tokenize version.)
SETTINGS = (*EXPORTED, "tokenize_version")


def parquet_schema() -> Any:
    import pyarrow as pa

    # tool_calls: the OpenAI list as JSON text (arguments may be any JSON). finish_reason:
    # a generated answer's (null for the dataset's messages).
    message = pa.struct([("role", pa.string()), ("content", pa.string()),
                         ("reasoning_content", pa.string()), ("tool_calls", pa.string()),
                         ("tool_call_id", pa.string()), ("finish_reason", pa.string())])
    return pa.schema([("id", pa.string()), ("source_id", pa.string()),
                      ("input_ids", pa.list_(pa.int32())),
                      ("loss_mask", pa.list_(pa.int8())),
                      ("conversations", pa.list_(message)),
                      # The row's tool definitions (the OpenAI list) as JSON text, or null.
                      ("tools", pa.string()),
                      # The row's tool_choice as JSON text ("auto", {...}), or null.
                      ("tool_choice", pa.string()),
                      # The supervised turn's finish_reason ("length": cut at max_tokens,
                      # supervised without an end marker); the last turn's for a whole
                      # conversation.
                      ("finish_reason", pa.string()),
                      # The regenerated turn of a per-turn example (0-based), else null.
                      ("turn", pa.int32())])


@dataclass
class Manifest:
    """What an export holds; written as ``manifest.json`` and returned by :func:`export_job`."""

    format: str
    job: dict[str, Any]
    #: The job's generation and tokenization settings.
    settings: dict[str, Any]
    #: Samples of the job per state (all of them, not only the exported ones).
    counts: dict[str, int]
    #: Rows written: training examples (one per sample, or per regenerated turn).
    exported: int
    #: Done samples left out, by reason (``stale``: not tokenized at the job's current
    #: tokenize_version, with --allow-stale; ``truncated``: with --exclude-truncated).
    excluded: dict[str, int]
    #: ``[{"file": "data-00000-of-00002.parquet", "rows": 10000}, ...]`` in id order.
    shards: list[dict[str, Any]]
    #: Sums over the exported rows tokenized at the current version (None: no tokenizer).
    num_tokens: int | None
    num_supervised: int | None
    tokenizer: str | None
    #: sha256 of the tokenizer's tokenizer.json + tokenizer_config.json (None: not found here).
    tokenizer_hash: str | None
    #: sha256 of the chat template text: the job's own, else the tokenizer's.
    chat_template_hash: str | None
    #: ``job``, ``tokenizer`` or None.
    chat_template_source: str | None
    #: The job's cost report when exported (synthq.store.cost: busy GPU time, tokens, dollars).
    cost: dict[str, Any] | None = None
    #: Conversations regenerated turn by turn that were cut after a turn whose tool
    #: calls did not fit the dataset's results: ``{"samples": n, "reasons": {reason: n}}``
    #: over the exported rows.
    cut: dict[str, Any] = field(default_factory=lambda: {"samples": 0, "reasons": {}})
    #: Exported rows per distinct settings of their own (``synthq requeue --max-tokens``
    #: ...): ``[{"overrides": {...}, "samples": n}]``; rows on the job's settings are
    #: not listed.
    overrides: list[dict[str, Any]] = field(default_factory=list)
    #: Samples the rows come from (``exported`` is larger with per-turn examples).
    samples: int = 0
    #: The job's ``--examples``: ``conversation`` or ``per-turn`` (synthq.data.examples).
    examples: str = "conversation"
    synthq_version: str = synthq.__version__
    created_at: str = field(default_factory=lambda: utcnow().isoformat())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)


def check_options(fmt: str, shard_size: int, *, features: bool = False) -> None:
    """Raise :class:`UserError` for an unknown format or a shard size below 1;
    ``features``: the captured features' formats (synthq.training.export_features) count too."""
    known = FORMATS + (FEATURE_FORMATS if features else ())
    if fmt not in known:
        raise UserError(f"--format must be one of {', '.join(known)}, got {fmt!r}")
    if shard_size < 1:
        raise UserError(f"--shard-size must be at least 1, got {shard_size}")


# --- tokenizer fingerprint --------------------------------------------------------------


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _cached_file(repo_id: str, filename: str) -> Path | None:
    """``filename`` of a Hugging Face repo from the local cache only (never the network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename)
    except Exception:  # noqa: BLE001 - not a valid repo id, or no hub library: not cached
        return None
    return Path(found) if isinstance(found, str) else None


def _tokenizer_files(path: str) -> dict[str, Path]:
    local = Path(path).expanduser()
    if local.is_dir():
        return {name: local / name for name in TOKENIZER_FILES if (local / name).is_file()}
    files = {name: _cached_file(path, name) for name in TOKENIZER_FILES}
    return {name: p for name, p in files.items() if p is not None}


def _tokenizer_template(path: str, local_dir: bool) -> str | None:
    """The tokenizer's own chat template, loaded from local files only; None if unavailable."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=not local_dir)
    except Exception:  # noqa: BLE001 - any failure to load means "unknown", not an error
        return None
    template = getattr(tok, "chat_template", None)
    if template is None or isinstance(template, str):
        return template
    # Several named templates: hash them all, in a stable order.
    return json.dumps(template, sort_keys=True)


def tokenizer_fingerprint(path: str | None, chat_template: str | None = None) -> dict[str, Any]:
    """Hashes that identify the tokenizer and chat template behind an export.

    ``tokenizer_hash``: sha256 over the names and bytes of ``tokenizer.json`` and
    ``tokenizer_config.json`` found in ``path`` (a local directory) or in the
    Hugging Face cache (a hub id); None when neither holds them.
    ``chat_template_hash``: sha256 of ``chat_template`` when given (the job's
    override), else of the tokenizer's own template. Nothing is downloaded: an
    export never waits on the network, so a tokenizer this machine has not
    seen gives None rather than a guess.
    """
    result: dict[str, Any] = {"tokenizer": path, "tokenizer_hash": None,
                              "chat_template_hash": None, "chat_template_source": None}
    files = _tokenizer_files(path) if path else {}
    if files:
        digest = hashlib.sha256()
        for name in sorted(files):
            digest.update(name.encode() + b"\0")
            digest.update(files[name].read_bytes())
            digest.update(b"\0")
        result["tokenizer_hash"] = digest.hexdigest()
    if chat_template is not None:
        result.update(chat_template_hash=_sha256_text(chat_template),
                      chat_template_source="job")
    elif path and files:  # only try to load what is here (importing transformers is slow)
        template = _tokenizer_template(path, Path(path).expanduser().is_dir())
        if template is not None:
            result.update(chat_template_hash=_sha256_text(template),
                          chat_template_source="tokenizer")
    return result


# --- reading ----------------------------------------------------------------------------


@contextmanager
def _snapshot(engine: Engine) -> Iterator[Callable[[], AbstractContextManager[Session]]]:
    """Yields a factory of sessions that all read one consistent state where possible.

    PostgreSQL: one read-only REPEATABLE READ transaction for the whole export.
    SQLite: a short transaction per query (a long one would hold its write lock
    and stall the embedded runner).
    """
    if engine.dialect.name != "postgresql":
        yield lambda: session_scope(engine)
        return
    with engine.connect() as raw:
        conn = raw.execution_options(isolation_level="REPEATABLE READ",
                                     postgresql_readonly=True)
        with conn.begin(), Session(bind=conn) as session:
            yield lambda: nullcontext(session)


@dataclass
class _Plan:
    job_id: int
    job_name: str
    version: int
    tokenized: bool  # parquet: rows carry input_ids / loss_mask
    reasoning: bool  # put reasoning_content into the answer
    include_truncated: bool
    regenerate_all: bool = False  # conversations regenerated turn by turn
    per_turn: bool = False  # one example per regenerated turn
    history_reasoning: str = "drop"

    def filters(self) -> list[Any]:
        conds: list[Any] = [Sample.job_id == self.job_id, Sample.state == SampleState.DONE]
        if not self.include_truncated:
            conds.append(or_(Sample.finish_reason.is_(None), Sample.finish_reason != "length"))
        if self.tokenized:
            conds += [Sample.input_ids.is_not(None), Sample.tokenize_version == self.version]
        return conds


def _columns(plan: _Plan) -> list[Any]:
    cols: list[Any] = [Sample.id, Sample.source_id, Sample.prompt, Sample.response_content,
                       Sample.num_tokens, Sample.num_supervised, Sample.tools, Sample.tool_calls,
                       Sample.turns, Sample.cut_at_turn, Sample.cut_reason, Sample.overrides,
                       Sample.finish_reason, Sample.examples,
                       (Sample.input_ids.is_not(None)
                        & (Sample.tokenize_version == plan.version)).label("current")]
    if plan.reasoning:
        cols.append(Sample.reasoning_content)
    if plan.tokenized:
        cols += [Sample.input_ids, Sample.loss_mask]
    return cols


def _pages(sessions: Callable[[], AbstractContextManager[Session]],
           plan: _Plan) -> Iterator[list[Any]]:
    """Pages of at most BATCH rows in id order: ``WHERE id > last ORDER BY id LIMIT BATCH``."""
    last = 0
    cols, conds = _columns(plan), plan.filters()
    while True:
        batch = BATCH
        with sessions() as s:
            rows = list(s.execute(select(*cols).where(*conds, Sample.id > last)
                                  .order_by(Sample.id).limit(batch)))
        if rows:
            yield rows
        if len(rows) < batch:
            return
        last = rows[-1].id


def _examples(row: Any, plan: _Plan) -> list[Example]:
    """The row's examples (:func:`synthq.data.examples.build`), those it was tokenized into."""
    built = build(row.prompt or [], content=row.response_content or "",
                  reasoning=row.reasoning_content if plan.reasoning else None,
                  tool_calls=row.tool_calls, finish_reason=row.finish_reason,
                  answers=row.turns if plan.regenerate_all and row.turns else None,
                  tools=row.tools, per_turn=plan.per_turn,
                  history_reasoning=plan.history_reasoning)
    if row.examples:  # tokenized per turn: the turns that kept a supervised token
        by_turn = {e.turn: e for e in built}
        return [by_turn[int(e["turn"])] for e in row.examples]
    return built


def _example_id(row: Any, example: Example) -> str:
    return str(row.id) if example.turn is None else f"{row.id}:{example.turn}"


def _tool_fields(tools: dict[str, Any] | None) -> tuple[list[Any] | None, Any]:
    """The row's tool definitions (a list, as SpecForge and speculators read them) and
    its tool_choice, from ``samples.tools``."""
    if not tools:
        return None, None
    return tools.get("tools"), tools.get("tool_choice")


def _record(row: Any, example: Example, plan: _Plan) -> dict[str, Any]:
    """One JSONL line."""
    # Messages keep the keys they had (a JSON reader infers one struct for them); the
    # finish reasons are row fields: the supervised turn's, and with several generated
    # turns in one example, each one's.
    out: dict[str, Any] = {"id": _example_id(row, example), "source_id": row.source_id,
                           "conversations": exported(example, reasoning=plan.reasoning,
                                                     finish=False),
                           "finish_reason": example.finish_reason}
    if example.turn is None and len(example.generated) > 1:
        out["finish_reasons"] = example.finish_reasons
    definitions, choice = _tool_fields(row.tools)
    if definitions:
        out["tools"] = definitions
    if choice is not None:
        out["tool_choice"] = choice
    if example.turn is not None:
        out["turn"] = example.turn
    return out


def _parquet_message(m: dict[str, Any]) -> dict[str, Any]:
    out = {"reasoning_content": None, "tool_call_id": None, "finish_reason": None, **m}
    out["tool_calls"] = json.dumps(m["tool_calls"], ensure_ascii=False) if m.get(
        "tool_calls") else None
    return out


def _tokens(row: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """The row's examples' ids and masks (several: ``samples.examples``)."""
    ids = unpack_ids(row.input_ids)
    assert ids is not None  # the query selects tokenized rows only
    n = len(ids)
    if len(row.loss_mask or b"") != (n + 7) // 8 or (row.num_tokens not in (None, n)):
        raise UserError(f"sample {row.id}: its loss mask or num_tokens does not match its "
                        f"{n} input_ids; run `synthq retokenize` on the job")
    try:
        return split(ids, unpack_mask(row.loss_mask, n), row.examples)
    except ValueError as exc:
        raise UserError(f"sample {row.id}: {exc}; run `synthq retokenize` on the job") from exc


# --- writing ----------------------------------------------------------------------------


class _Shards:
    """Rows into ``part-NNNNN`` files of ``shard_size`` rows; renamed by :meth:`finish`."""

    def __init__(self, directory: Path, fmt: str, shard_size: int) -> None:
        self.directory, self.fmt, self.shard_size = directory, fmt, shard_size
        self.rows: list[int] = []  # rows per shard written so far
        self._writer: Any = None

    def _room(self) -> int:
        """Rows the current shard still takes, opening a new shard if it is full."""
        if not self.rows or self.rows[-1] >= self.shard_size:
            self._close()
            path = self.directory / f"part-{len(self.rows):05d}.{self.fmt}"
            self.rows.append(0)
            if self.fmt == "parquet":
                import pyarrow.parquet as pq

                self._writer = pq.ParquetWriter(path, parquet_schema(), compression="zstd")
            else:
                self._writer = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in _close
        return self.shard_size - self.rows[-1]

    def write(self, records: Any) -> None:
        """``records``: a list of dicts (jsonl) or a pyarrow Table (parquet)."""
        start = 0
        while start < len(records):
            n = min(self._room(), len(records) - start)
            if self.fmt == "parquet":
                self._writer.write_table(records.slice(start, n))
            else:
                self._writer.write("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                           for r in records[start:start + n]))
            self.rows[-1] += n
            start += n

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def finish(self) -> list[dict[str, Any]]:
        self._close()
        total = len(self.rows)
        shards = []
        for i, rows in enumerate(self.rows):
            name = f"data-{i:05d}-of-{total:05d}.{self.fmt}"
            os.rename(self.directory / f"part-{i:05d}.{self.fmt}", self.directory / name)
            shards.append({"file": name, "rows": rows})
        return shards

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._close()


def _table(rows: list[Any], plan: _Plan) -> Any:
    """One page as a pyarrow Table (list columns built from flat numpy buffers)."""
    import pyarrow as pa

    pairs: list[tuple[Any, Example]] = []
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for r in rows:
        tokens = _tokens(r)
        examples = _examples(r, plan)
        if len(tokens) != len(examples):
            raise UserError(f"sample {r.id}: {len(tokens)} tokenized examples for "
                            f"{len(examples)} built; run `synthq retokenize` on the job")
        pairs += [(r, e) for e in examples]
        ids += [t[0] for t in tokens]
        masks += [t[1] for t in tokens]
    offsets = np.zeros(len(pairs) + 1, dtype=np.int32)
    np.cumsum([len(i) for i in ids], out=offsets[1:])
    schema = parquet_schema()
    conversations = [[_parquet_message(m) for m in exported(e, reasoning=plan.reasoning)]
                     for _, e in pairs]
    tools = [_tool_fields(r.tools) for r, _ in pairs]

    def text(value: Any) -> str | None:
        return None if value is None else json.dumps(value, ensure_ascii=False)

    return pa.Table.from_arrays([
        pa.array([_example_id(r, e) for r, e in pairs], pa.string()),
        pa.array([r.source_id for r, _ in pairs], pa.string()),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(ids), pa.int32())),
        pa.ListArray.from_arrays(pa.array(offsets),
                                 pa.array(np.concatenate(masks).astype(np.int8), pa.int8())),
        pa.array(conversations, schema.field("conversations").type),
        pa.array([text(d) if d else None for d, _ in tools], pa.string()),
        pa.array([text(c) for _, c in tools], pa.string()),
        pa.array([e.finish_reason for _, e in pairs], pa.string()),
        pa.array([e.turn for _, e in pairs], pa.int32()),
    ], schema=schema)


# --- the export -------------------------------------------------------------------------


def _is_export(path: Path) -> bool:
    try:
        return "synthq_version" in json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; choose a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(f"--out {out} exists; choose a new directory or pass --overwrite")
    if not _is_export(out):
        raise UserError(f"--out {out} holds files that are not a synthq export (no "
                        f"{MANIFEST}); refusing to replace it even with --overwrite")


def _install(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out``; with ``overwrite`` the old export goes only once the new is in."""
    _check_out(out, overwrite)
    if not (out.is_dir() and any(out.iterdir())):
        try:
            os.rename(tmp, out)  # replaces an empty directory
        except OSError as exc:
            raise UserError(f"cannot create --out {out}: {exc}") from exc
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rename(out, old / "export")
    try:
        os.rename(tmp, out)
    except OSError as exc:
        os.rename(old / "export", out)
        shutil.rmtree(old, ignore_errors=True)
        raise UserError(f"cannot replace --out {out}: {exc}") from exc
    shutil.rmtree(old, ignore_errors=True)


def export_job(job_id: int, out_dir: Path, *, fmt: str = "parquet", shard_size: int = 10_000,
               include_truncated: bool = True, allow_stale: bool = False,
               overwrite: bool = False,
               progress: Callable[[int, int], None] | None = None) -> Manifest:
    """Write the job's done samples to ``out_dir`` as ``fmt`` shards plus ``manifest.json``.

    Parquet needs the job's tokenization: it holds the samples tokenized at the
    job's current ``tokenize_version``, and refuses while others are stale
    (``synthq retokenize`` still running) unless ``allow_stale`` leaves them out.
    JSONL holds the conversations of every done sample. ``progress(written,
    total)`` is called after each page. Raises :class:`UserError` for anything
    the user can fix; ``out_dir`` then does not appear.
    """
    check_options(fmt, shard_size)
    out = Path(out_dir).expanduser().absolute()
    _check_out(out, overwrite)
    engine = get_engine()
    with _snapshot(engine) as sessions:
        with sessions() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise UserError(f"no job {job_id}")
            if fmt == "parquet" and not job.tokenizer:
                raise UserError("job has no tokenizer: parquet needs input_ids; use --format "
                                "jsonl or set one with synthq retokenize")
            plan = _Plan(job_id=job.id, job_name=job.name, version=job.tokenize_version,
                         tokenized=fmt == "parquet", reasoning=job.reasoning != "drop",
                         include_truncated=include_truncated,
                         regenerate_all=job.regenerate == "all",
                         per_turn=job.regenerate == "all" and job.examples == "per-turn",
                         history_reasoning=job.history_reasoning)
            info = {"id": job.id, "name": job.name, "dataset": job.dataset}
            has_tokenizer = bool(job.tokenizer)
            settings = {k: getattr(job, k) for k in SETTINGS}
            fingerprint = tokenizer_fingerprint(job.tokenizer, job.chat_template)
            from synthq.store.counts import state_counts

            counts = state_counts(s, job.id)
            from synthq.store.cost import job_cost

            open_ = sum(counts.get(x, 0) for x in ("pending", "queued", "running"))
            cost = job_cost(s, job, remaining=open_, store=False).to_dict()  # read-only
            cost["servers"] = safe_keys(cost["servers"])  # a server URL may hold a password
            done = [Sample.job_id == job.id, Sample.state == SampleState.DONE]
            truncated = 0 if include_truncated else s.scalar(
                select(func.count()).where(*done, Sample.finish_reason == "length")) or 0
            total = s.scalar(select(func.count()).where(*plan.filters())) or 0
        stale = counts[SampleState.DONE] - truncated - total if plan.tokenized else 0
        if stale and not allow_stale:
            raise UserError(
                f"{stale:,} of {counts[SampleState.DONE]:,} done samples are not tokenized at "
                f"the job's current tokenize_version {plan.version}: wait for `synthq "
                f"retokenize` to finish (see `synthq status`), or pass --allow-stale to "
                f"export only the {total:,} current ones")
        if not total:
            raise UserError(f"job {plan.job_name} has no done samples to export yet "
                            "(see `synthq status`)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        # mkdtemp makes 0700; the export's files are 0644, so its folder follows the umask.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        shards = _Shards(tmp, fmt, shard_size)
        try:
            written = samples = tokens = supervised = 0
            cut: dict[str, Any] = {"samples": 0, "reasons": {}}
            overridden: dict[str, int] = {}
            for rows in _pages(sessions, plan):
                for r in rows:
                    if r.cut_at_turn is not None:
                        cut["samples"] += 1
                        reason = str(r.cut_reason or "")
                        cut["reasons"][reason] = cut["reasons"].get(reason, 0) + 1
                    if r.overrides:
                        key = json.dumps(r.overrides, sort_keys=True)
                        overridden[key] = overridden.get(key, 0) + 1
                current = [r for r in rows if r.current]
                tokens += sum(r.num_tokens or 0 for r in current)
                supervised += sum(r.num_supervised or 0 for r in current)
                if plan.tokenized:
                    table = _table(rows, plan)
                    shards.write(table)
                    written += table.num_rows
                else:
                    records = [_record(r, e, plan) for r in rows for e in _examples(r, plan)]
                    shards.write(records)
                    written += len(records)
                samples += len(rows)
                if progress:
                    progress(samples, total)
            manifest = Manifest(
                format=fmt, job=info, settings=settings, counts=counts, exported=written,
                samples=samples, examples=settings["examples"],
                excluded={"stale": stale, "truncated": truncated}, shards=shards.finish(),
                num_tokens=tokens if has_tokenizer else None,
                num_supervised=supervised if has_tokenizer else None, cost=cost, cut=cut,
                overrides=[{"overrides": json.loads(k), "samples": n}
                           for k, n in sorted(overridden.items(), key=lambda x: -x[1])],
                **fingerprint)
            (tmp / MANIFEST).write_text(manifest.to_json(indent=2) + "\n", encoding="utf-8")
            _install(tmp, out, overwrite)
        except BaseException:
            shards.abort()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return manifest
