"""``synthq export --format speculators|specforge``: each peer's own reader takes every
captured example, and its targets' argmax equals transformers' logits'.

The readers are the peers' own code, from their packages (scripts/peer-readers.sh
installs them pinned, without their dependencies, outside the clone):

* speculators 0.9.0 ``speculators.train.data.ArrowDataset`` (vllm-project/speculators,
  ``src/speculators/train/data.py``; ``load_from_disk`` of the folder, then
  ``hs_connectors.FileTransfer`` reads ``hidden_states/hs_{i}.safetensors``), and its
  training's ``speculators.train.cli.parse_vocab_mappings`` for the draft vocabulary;
* SpecForge 0.2.0 ``specforge.data.preprocessing.list_local_files`` and
  ``OfflineEagle3Dataset`` (sgl-project/SpecForge, ``specforge/data/preprocessing.py``).

The store's files are made the way the capture stage makes them, without vLLM: a
file in the engine's layout from transformers' own states (tests/engine shows the
engine's equal transformers' to 1e-4), through ``synthq.capture.ingest`` into the
store, its row marked done through ``synthq.queue.capture_states``. The targets (a Llama and
a Gemma) have final norm weights far from ones, so a wrong norm changes the argmax.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from training_support import VOCAB, capture_file

from synthq.capture.plan import drafter_layers
from synthq.core.errors import UserError
from synthq.training.export_features import export_features

SAMPLES = 10


@pytest.fixture(scope="session")
def peer_readers() -> Path:
    """The folder holding the peers' packages, on ``sys.path`` for these tests."""
    from support import peer_readers

    return peer_readers()


def _captured_job(job_factory: Callable[..., Any], sample_factory: Callable[..., int],
                  target_dir: Path, target: Any, tmp_path: Path, *,
                  shorter: bool = False) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
    """A job of SAMPLES done samples on ``target``, every one captured into the store.
    ``shorter``: the first sample's example is a prefix of its capture (as a per-turn
    example read from its conversation's capture), so its file must be cut."""
    from sqlalchemy import update

    from synthq.capture import ingest
    from synthq.capture.stage import store
    from synthq.core.packing import pack_ids, pack_mask
    from synthq.queue import capture_states
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Job, Sample

    job_id = job_factory([], tokenizer=str(target_dir)).job_id
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(train_target=str(target_dir)))
    rng = np.random.default_rng(3)
    examples: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for _ in range(SAMPLES):
        n = int(rng.integers(12, 40))
        ids = np.concatenate([[1], rng.integers(3, VOCAB, n - 1)]).astype(np.int32)
        mask = (np.arange(n) >= n // 3).astype(np.uint8)
        sid = sample_factory("done", job_id=job_id, input_ids=pack_ids(ids),
                             loss_mask=pack_mask(mask), num_tokens=n,
                             num_supervised=int(mask.sum()), tokenize_version=1,
                             response_content="x")
        examples[sid] = (ids, mask)
    layers = drafter_layers(target.config.num_hidden_layers)
    now = utcnow()
    with session_scope() as s:
        capture_states.add_missing(s, job_id, now=now)
        claimed = capture_states.claim(s, job_id, server="http://capture", limit=SAMPLES,
                                       most=SAMPLES, worker="test", token="t" * 32, lease=60,
                                       now=now)
        assert len(claimed) == SAMPLES
        for c in claimed:
            ids = examples[c.sample_id][0]
            engine_file = tmp_path / f"engine-{c.sample_id}.safetensors"
            capture_file(target, ids.astype(np.int64), engine_file)
            got = ingest.ingest(engine_file, input_ids=ids, layers=layers, dtype="auto",
                                store=store(), metadata={"engine": "test"})
            assert capture_states.done(s, c, now=now, path=got.stored.path,
                                       sha256=got.stored.sha256, nbytes=got.stored.bytes,
                                       num_tokens=got.num_tokens, layer_ids=layers,
                                       dtype=got.dtype, engine="test", engine_model="m")
    if shorter:
        first = min(examples)
        ids, mask = examples[first]
        ids, mask = ids[:len(ids) - 5], mask[:len(mask) - 5]
        with session_scope() as s:
            s.execute(update(Sample).where(Sample.id == first).values(
                input_ids=pack_ids(ids), loss_mask=pack_mask(mask), num_tokens=len(ids)))
        examples[first] = (ids, mask)
    return job_id, [examples[k] for k in sorted(examples)]


def _cli(job_id: int, out: Path, fmt: str, *extra: str) -> subprocess.CompletedProcess[str]:
    from support import run_cli

    return run_cli("export", str(job_id), "--format", fmt, "--out", str(out), *extra,
                   check=False, timeout=300)


def _argmax(target: Any, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return target(input_ids=torch.from_numpy(ids.astype(np.int64))[None]).logits[0].argmax(-1)


@pytest.mark.parametrize("style", ["weight", "one_plus_weight"])
def test_speculators_reader_takes_every_example(
        peer_readers: Path, norm_targets: dict[str, tuple[Path, Any]], style: str,
        job_factory: Callable[..., Any], sample_factory: Callable[..., int],
        tmp_path: Path) -> None:
    from speculators.train.cli import parse_vocab_mappings
    from speculators.train.data import ArrowDataset

    from synthq.capture.stage import store
    from synthq.training.captured import load_target_head

    target_dir, target = norm_targets[style]
    job_id, examples = _captured_job(job_factory, sample_factory, target_dir, target, tmp_path,
                                     shorter=True)
    out = tmp_path / "speculators"
    if style == "weight":  # the command, once
        done = _cli(job_id, out, "speculators", "--draft-vocab-size", "40")
        assert done.returncode == 0, done.stderr + done.stdout
        assert f"exported {SAMPLES} captured examples" in done.stdout, done.stdout
        assert f"{SAMPLES - 1} hardlink" in done.stdout and "1 cut" in done.stdout
    else:
        export_features(job_id, out, fmt="speculators", draft_vocab_size=40)
    dataset = ArrowDataset(max_len=4096, datapath=str(out), on_missing="raise")
    assert len(dataset) == SAMPLES
    head = load_target_head(str(target_dir))
    taken = 0
    for i, (ids, mask) in enumerate(examples):
        item = dataset[i]  # its own checks: token_ids equal input_ids, or None and a warning
        assert item is not None
        assert item["input_ids"].tolist() == ids.tolist()  # rows in order
        assert item["loss_mask"].tolist() == mask.tolist()
        assert item["hidden_states"].shape == (len(ids), 3 * head.embed.shape[1])
        # speculators applies the verifier's norm itself: the last slot is before it.
        top = (head.final_norm(item["verifier_last_hidden_states"]) @ head.head.T).argmax(-1)
        assert torch.equal(top, _argmax(target, ids))
        taken += 1
    assert taken == SAMPLES
    links = sorted((out / "hidden_states").iterdir())
    stored = {p.stat().st_ino for p in store().root.glob("*/*.safetensors")}
    linked = [p for p in links if p.stat().st_ino in stored]
    assert len(linked) == SAMPLES - 1  # hard links into the store: no copies
    assert (out / "hidden_states" / "hs_0.safetensors").stat().st_ino not in stored  # cut
    # The draft vocabulary, read by speculators' own loader as its training reads it
    # (--data-path DIR --draft-vocab-size 40): it finds d2t-40.npy/t2d-40.npy in DIR.
    d2t, t2d, size = parse_vocab_mappings(argparse.Namespace(
        d2t_path=None, t2d_path=None, data_path=str(out), draft_vocab_size=40,
        token_freq_path=None, verifier_name_or_path=str(target_dir), trust_remote_code=False))
    assert size == 40 and d2t is not None and t2d is not None, "speculators did not find them"
    assert d2t.shape == (40,) and t2d.shape == (VOCAB,) and int(t2d.sum()) == 40
    assert t2d[torch.arange(40) + d2t].all()


@pytest.mark.parametrize("style", ["weight", "one_plus_weight"])
def test_specforge_reader_takes_every_example(
        peer_readers: Path, norm_targets: dict[str, tuple[Path, Any]], style: str,
        job_factory: Callable[..., Any], sample_factory: Callable[..., int],
        tmp_path: Path) -> None:
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files

    from synthq.training.captured import load_target_head

    target_dir, target = norm_targets[style]
    job_id, examples = _captured_job(job_factory, sample_factory, target_dir, target, tmp_path)
    out = tmp_path / "specforge"
    manifest = export_features(job_id, out, fmt="specforge")
    assert (manifest.exported, manifest.files, manifest.norm_style) == (
        SAMPLES, {"written": SAMPLES}, style)
    files = list_local_files(str(out))
    assert len(files) == SAMPLES
    dataset = OfflineEagle3Dataset(files, max_len=4096)
    head = load_target_head(str(target_dir))
    hidden = head.embed.shape[1]
    taken = 0
    for i, (ids, mask) in enumerate(examples):
        item = dataset[i]
        # Its reader loads file 0 in place of one it cannot read: the ids say which it read.
        assert item["input_ids"][0].tolist() == ids.tolist()  # sorted listing = export order
        assert item["loss_mask"][0, :-1].tolist() == mask[:-1].tolist()  # it zeroes the last
        assert item["hidden_state"].shape == (1, len(ids), 3 * hidden)
        assert item["target"].shape == (1, len(ids), hidden)
        with torch.no_grad():
            want = target(input_ids=torch.from_numpy(ids.astype(np.int64))[None],
                          output_hidden_states=True)
        # After the target's own final norm: transformers' last hidden state, its argmax.
        torch.testing.assert_close(item["target"][0], want.hidden_states[-1][0], atol=1e-5,
                                   rtol=1e-5)
        assert torch.equal((item["target"][0] @ head.head.T).argmax(-1),
                           want.logits[0].argmax(-1))
        taken += 1
    assert taken == SAMPLES


def test_features_export_refuses_uncaptured_examples(
        norm_targets: dict[str, tuple[Path, Any]], job_factory: Callable[..., Any],
        sample_factory: Callable[..., int], tmp_path: Path) -> None:
    from synthq.core.packing import pack_ids, pack_mask

    target_dir, target = norm_targets["weight"]
    job_id, _ = _captured_job(job_factory, sample_factory, target_dir, target, tmp_path)
    ids = np.array([1, 5, 6, 7, 8], dtype=np.int32)
    sample_factory("done", job_id=job_id, input_ids=pack_ids(ids),
                   loss_mask=pack_mask(np.ones(5, np.uint8)), num_tokens=5, num_supervised=5,
                   tokenize_version=1, response_content="x")
    done = _cli(job_id, tmp_path / "out", "specforge")
    assert done.returncode == 2, done.stderr + done.stdout
    assert "no done capture" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(UserError, match="no done capture"):
        export_features(job_id, tmp_path / "out", fmt="speculators")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
