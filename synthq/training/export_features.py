"""Export a job's captured features in the peers' offline layouts: speculators, SpecForge.

``synthq export JOB --format speculators --out DIR`` writes what speculators'
``ArrowDataset`` (``speculators.train.data``; ``scripts/train.py --data-path DIR``)
reads::

    DIR/
      data-00000-of-00001.arrow, dataset_info.json, state.json
            a datasets folder (``save_to_disk``, torch format): ``input_ids`` (int64),
            ``loss_mask`` (int64, 0/1), ``seq_len``; row i is the export's i-th
            example, in synthq's id order
      hidden_states/hs_{i}.safetensors
            row i's capture: a hard link to the file in synthq's store (no copy, and
            the export stays whole if the store's file is later removed), a symbolic
            link where the export is on another filesystem; an example shorter than
            its file (a per-turn example read from a longer capture) gets a file cut
            to its own length, written here
      d2t-{N}.npy, t2d-{N}.npy
            the draft vocabulary of N ids (synthq.training.data.draft_vocab: the most
            frequent supervised ids, as ``synthq train`` picks them) when it is smaller
            than the target's vocabulary: the names speculators' ``parse_vocab_mappings``
            looks for in DIR when its training is given ``--draft-vocab-size N`` (without
            it, speculators trains on the whole vocabulary)
      manifest.json

The store's files are already speculators' own layout (``hidden_states`` [T, L, H]
with the last layer's output, before the final norm, last: speculators applies the
verifier's norm itself; ``token_ids`` [T], which it compares with ``input_ids``).

``--format specforge`` writes what SpecForge's offline dataset
(``specforge.data.preprocessing``: ``list_local_files`` then ``OfflineEagle3Dataset``)
reads: one ``torch.save`` dict per example,
``DIR/rows_{first:09d}-{end:09d}/data_{i:09d}.ckpt`` (zero-padded, so its sorted
listing is the export's order), with ``input_ids`` [T] int64, ``loss_mask`` [T]
int64, ``aux_hidden_state`` [1, T, 3H] (the three drafter layers side by side) and
``hidden_state`` [1, T, H]: the last layer's output *after the target's own final
norm* (synthq.training.norm: ``w·x̂`` or ``(1+w)·x̂`` as the target's model type
computes it), in the store's dtype. These are new files (about the store's size).

Both exports are atomic like synthq.jobs.export's (a temporary folder renamed into place)
and refuse while an example has no done capture of the job's layers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import synthq
from synthq.core.errors import UserError
from synthq.jobs.export import FEATURE_FORMATS
from synthq.store.db import get_engine, utcnow

__all__ = ["FEATURE_FORMATS", "FeaturesManifest", "export_features", "vocab_file"]

#: SpecForge's files per folder (its own ``prepare_hidden_states.py`` groups by 2,000).
GROUP = 2000


@dataclass
class FeaturesManifest:
    """What a features export holds; written as ``manifest.json``."""

    format: str
    job: dict[str, Any]
    #: Examples written (rows / files), in synthq's id order.
    exported: int
    #: Samples they come from.
    samples: int
    #: ``output_hidden_states`` indices of the captured files (the last one before the
    #: final norm).
    layers: list[int]
    #: The store's dtype of the features (SpecForge's files keep it).
    dtype: str | None
    hidden_size: int | None
    #: How each example's features got there: ``hardlink`` / ``symlink`` into the store
    #: (speculators), ``cut`` (a shorter copy of a longer capture), ``written`` (SpecForge).
    files: dict[str, int] = field(default_factory=dict)
    #: Bytes of the files written here (links count nothing).
    bytes_written: int = 0
    #: The target folder read (norm and lm_head for SpecForge, vocabulary for d2t).
    target: str | None = None
    #: SpecForge: the final norm applied (synthq.training.norm's style).
    norm_style: str | None = None
    #: speculators: the draft vocabulary's size N, written as d2t-N.npy/t2d-N.npy (None:
    #: none); speculators' training reads them with ``--draft-vocab-size N``.
    draft_vocab_size: int | None = None
    synthq_version: str = synthq.__version__
    created_at: str = field(default_factory=lambda: utcnow().isoformat())

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(asdict(self), indent=indent, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class _Row:
    """One example to export: its id, tokens and the store file of its capture."""

    id: str
    sample_id: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    path: Path
    #: The row the example's tokens start at in that file (a per-turn sample's file
    #: holds its examples end to end, synthq.capture.ingest.ingest_parts).
    start: int = 0


def _examples(job_id: int, layers: list[int]) -> Iterator[list[_Row]]:
    """The job's examples page by page in id order, each with its captured file:
    the example's own capture, else its sample's (the example must be a prefix)."""
    from synthq.jobs import export as ex
    from synthq.training.captured import captured_paths

    paths = captured_paths(job_id, layers)  # UserError when nothing is captured
    with ex._snapshot(get_engine()) as sessions:
        with sessions() as s:
            from synthq.store.models import Job

            job = s.get(Job, job_id)
            assert job is not None
            plan = ex._Plan(job_id=job.id, job_name=job.name, version=job.tokenize_version,
                            tokenized=True, reasoning=False, include_truncated=True)
        missing: list[str] = []
        for page in ex._pages(sessions, plan):
            out: list[_Row] = []
            for r in page:
                turns = [int(e["turn"]) for e in r.examples] if r.examples else [None]
                for turn, (ids, mask) in zip(turns, ex._tokens(r), strict=True):
                    eid = str(r.id) if turn is None else f"{r.id}:{turn}"
                    found = paths.get(eid) or paths.get(str(r.id))
                    if found is None:
                        missing.append(eid)
                        continue
                    out.append(_Row(eid, r.id, ids.astype(np.int64), mask.astype(np.int64),
                                    *found))
            if missing:
                break
            yield out
    if missing:
        raise UserError(f"example(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                        " have no done capture of layers "
                        f"{layers}: run `synthq capture JOB` (it resumes) and export again")


def _read(row: _Row) -> dict[str, Any]:
    """The capture's tensors (safetensors, torch) checked against the example: its
    token ids must begin with the example's."""
    from safetensors.torch import load_file

    data = load_file(str(row.path))
    if row.start:  # the example's own rows of its sample's file
        total = data["token_ids"].shape[0]
        data = {k: v[row.start:] if v.dim() and v.shape[0] == total else v
                for k, v in data.items()}
    ids = data["token_ids"].numpy()
    n = len(row.input_ids)
    if len(ids) < n or not np.array_equal(ids[:n], row.input_ids):
        raise UserError(f"example {row.id}: its captured token ids are not its input_ids "
                        "(retokenized since the capture?): run `synthq capture JOB` again")
    return data


def _token_ids(path: Path) -> np.ndarray:
    """A capture's ``token_ids`` alone (the hidden states are not read)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return np.asarray(f.get_tensor("token_ids"))


def _link(source: Path, dest: Path) -> str:
    """``dest`` names ``source``'s bytes: a hard link, else (another filesystem) a
    symbolic link to its absolute path."""
    try:
        os.link(source, dest)
        return "hardlink"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    os.symlink(source.resolve(), dest)
    return "symlink"


def _cut(row: _Row, dest: Path) -> int:
    """A capture cut to the example's own length, written at ``dest``; its bytes."""
    from synthq.capture import files

    tensors, meta = files.read(row.path)
    n = len(row.input_ids)
    cut = {}
    for name, t in tensors.items():
        per_row = len(t.data) // max(1, t.shape[0])
        cut[name] = files.Tensor(t.dtype, (n, *t.shape[1:]),
                                 t.data[row.start * per_row:(row.start + n) * per_row])
    meta = dict(meta, cut_from=row.path.stem)
    meta.pop("sha256_hidden_states", None)
    blob = files.dumps(cut, meta)
    dest.write_bytes(blob)
    return len(blob)


def _speculators(rows: Iterator[list[_Row]], tmp: Path, manifest: FeaturesManifest,
                 vocab_size: int | None, draft_vocab_size: int,
                 progress: Callable[[int], None] | None) -> None:
    import pyarrow as pa

    try:
        from datasets import Dataset
    except ImportError as exc:
        raise UserError("--format speculators writes a datasets folder: install the "
                        "`datasets` package (synthq[hf])") from exc
    from synthq.training.data import count_supervised, draft_vocab_of

    hs = tmp / "hidden_states"
    hs.mkdir()
    schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                        ("seq_len", pa.int64())])
    counts = np.zeros(vocab_size, dtype=np.int64) if vocab_size else None
    scratch = Path(tempfile.mkdtemp(dir=tmp.parent, prefix=f".{tmp.name}.arrow-"))
    try:
        stream = scratch / "rows.arrow"
        samples: set[int] = set()
        with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for page in rows:
                for row in page:
                    i = manifest.exported
                    ids = _token_ids(row.path)[row.start:]
                    n = len(row.input_ids)
                    if len(ids) < n or not np.array_equal(ids[:n], row.input_ids):
                        raise UserError(f"example {row.id}: its captured token ids are not "
                                        "its input_ids (retokenized since the capture?): run "
                                        "`synthq capture JOB` again")
                    dest = hs / f"hs_{i}.safetensors"
                    if len(ids) == n and not row.start:
                        how = _link(row.path, dest)
                    else:
                        how = "cut"
                        manifest.bytes_written += _cut(row, dest)
                    manifest.files[how] = manifest.files.get(how, 0) + 1
                    if counts is not None:
                        count_supervised(counts, row.id, row.input_ids, row.loss_mask)
                    samples.add(row.sample_id)
                    manifest.exported += 1
                if page:
                    writer.write_table(pa.table({
                        "input_ids": [r.input_ids for r in page],
                        "loss_mask": [r.loss_mask for r in page],
                        "seq_len": [len(r.input_ids) for r in page]}, schema=schema))
                if progress:
                    progress(manifest.exported)
        manifest.samples = len(samples)
        import datasets

        quiet = datasets.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # the command shows its own line
        try:
            dataset = Dataset.from_file(str(stream))
            dataset.set_format("torch")  # as speculators' own preprocessing saves it
            dataset.save_to_disk(str(tmp))
            del dataset
        finally:
            if not quiet:
                datasets.enable_progress_bars()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if counts is not None and draft_vocab_size < len(counts):
        _, d2t, t2d = draft_vocab_of(counts, draft_vocab_size)
        n = int(d2t.numel())
        np.save(tmp / vocab_file("d2t", n), d2t.numpy())
        np.save(tmp / vocab_file("t2d", n), t2d.numpy())
        manifest.draft_vocab_size = n


def vocab_file(kind: str, size: int) -> str:
    """The name speculators 0.9 reads a vocabulary mapping by (``d2t-{N}.npy``,
    ``t2d-{N}.npy``: ``speculators.train.cli.parse_vocab_mappings``); a plain ``d2t.npy``
    is never looked for."""
    return f"{kind}-{size}.npy"


def _specforge(rows: Iterator[list[_Row]], tmp: Path, manifest: FeaturesManifest,
               target: str, progress: Callable[[int], None] | None) -> None:
    import torch

    from synthq.training.captured import load_target_head

    head = load_target_head(target)
    manifest.norm_style = head.norm_style
    n_layers = int(head.config.num_hidden_layers)
    if manifest.layers[-1] != n_layers:
        raise UserError(f"SpecForge's hidden_state is the last layer's output after the final "
                        f"norm: the captures' last layer is {manifest.layers[-1]}, the "
                        f"target's last is {n_layers} (capture with the default layers)")
    samples: set[int] = set()
    for page in rows:
        for row in page:
            i = manifest.exported
            data = _read(row)
            n = len(row.input_ids)
            hidden = data["hidden_states"][:n]  # [T, L, H], the store's dtype
            aux = hidden[:, :-1].reshape(n, -1)  # [T, (L-1)·H]
            last = head.final_norm(hidden[:, -1]).to(hidden.dtype)  # [T, H], after the norm
            first = i // GROUP * GROUP
            folder = tmp / f"rows_{first:09d}-{first + GROUP:09d}"
            folder.mkdir(exist_ok=True)
            dest = folder / f"data_{i:09d}.ckpt"
            torch.save({"input_ids": torch.from_numpy(row.input_ids),
                        "loss_mask": torch.from_numpy(row.loss_mask),
                        "aux_hidden_state": aux[None].contiguous(),
                        "hidden_state": last[None].contiguous()}, dest)
            manifest.bytes_written += dest.stat().st_size
            manifest.files["written"] = manifest.files.get("written", 0) + 1
            samples.add(row.sample_id)
            manifest.exported += 1
        if progress:
            progress(manifest.exported)
    manifest.samples = len(samples)


def export_features(job_id: int, out_dir: Path, *, fmt: str, target: str | None = None,
                    draft_vocab_size: int = 32_000, overwrite: bool = False,
                    progress: Callable[[int], None] | None = None) -> FeaturesManifest:
    """Write the job's captured examples to ``out_dir`` in ``fmt``'s offline layout (see
    the module's docstring). ``target``: the target's folder (default: the job's
    ``--train-target``, else its tokenizer folder). Raises :class:`UserError` for what
    the user can fix; ``out_dir`` then does not appear."""
    from sqlalchemy import func, or_, select

    from synthq.capture.plan import layers_for, target_config
    from synthq.core.enums import CaptureState
    from synthq.jobs import export as ex
    from synthq.queue.states import SampleState
    from synthq.store.db import session_scope
    from synthq.store.models import Capture, Job, Sample

    if fmt not in FEATURE_FORMATS:
        raise UserError(f"--format must be one of {', '.join(FEATURE_FORMATS)}, got {fmt!r}")
    out = Path(out_dir).expanduser().absolute()
    ex._check_out(out, overwrite)
    with session_scope() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise UserError(f"no job {job_id}")
        if not job.tokenizer:
            raise UserError("the job has no tokenizer: its examples have no input_ids")
        where = target or job.train_target or job.tokenizer
        config = target_config(where)
        layers = layers_for(job)
        info = {"id": job.id, "name": job.name, "dataset": job.dataset}
        stored = s.scalar(select(Capture.dtype).where(
            Capture.job_id == job_id, Capture.state == CaptureState.DONE).limit(1))
        stale = s.scalar(select(func.count()).where(
            Sample.job_id == job_id, Sample.state == SampleState.DONE,
            or_(Sample.input_ids.is_(None), Sample.tokenize_version != job.tokenize_version)))
    if stored == "float8_e4m3":
        raise UserError("the captures are stored as float8_e4m3 (with a scale of synthq's "
                        "own, which the peers' readers do not apply): capture again with "
                        "--dtype bfloat16 to export them")
    if stale:
        raise UserError(f"{stale:,} done samples are not tokenized at the job's current "
                        "tokenize_version: wait for `synthq retokenize` (then `synthq capture "
                        "JOB`) before exporting features")
    if fmt == "specforge" and config is None:
        raise UserError(f"--format specforge applies the target's final norm: {where!r} has "
                        "no config.json and weights; pass --target DIR")
    hidden = int(config["hidden_size"]) if config and "hidden_size" in config else None
    manifest = FeaturesManifest(format=fmt, job=info, exported=0, samples=0, layers=layers,
                                dtype=stored, hidden_size=hidden,
                                target=where if config else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        rows = _examples(job_id, layers)
        if fmt == "speculators":
            vocab = int(config["vocab_size"]) if config and "vocab_size" in config else None
            _speculators(rows, tmp, manifest, vocab, draft_vocab_size, progress)
        else:
            assert where is not None
            _specforge(rows, tmp, manifest, where, progress)
        if not manifest.exported:
            raise UserError(f"job {info['name']} has no done, tokenized samples to export yet "
                            "(see `synthq status`)")
        (tmp / ex.MANIFEST).write_text(manifest.to_json(indent=2) + "\n", encoding="utf-8")
        ex._install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
