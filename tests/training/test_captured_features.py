"""``--hidden-states captured``: features read from capture files equal the offline
path's, and the loss on them is the same, with only the target's embeddings, norm and
lm_head loaded.

The capture files here are written from transformers' own hidden states in the
layout the engine writes (tests/engine/test_capture.py shows the engine's equal
transformers' to 1e-4): ``hidden_states`` [T, 4, H] at ``[2, N//2, N-3, N]``, the
last one before the final norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from training_support import capture_file

from synthq.training.captured import CapturedFeatures, load_target_head
from synthq.training.data import Example, FeatureCache, draft_head
from synthq.training.loss import ttt_loss
from synthq.training.model import DraftConfig, Eagle3Drafter


def test_captured_features_and_loss_equal_the_offline_path(
        tiny_target: Any, tiny_target_dir: Path, tmp_path: Path) -> None:
    _same_features_and_loss(tiny_target, tiny_target_dir, tmp_path)


def test_a_one_plus_weight_norm_target_trains_from_captures_as_online(
        norm_targets: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """A Gemma-style target ((1+w)·x̂, weights far from 0): the captured path's
    recomputed norm and the losses equal transformers' online features'."""
    path, target = norm_targets["one_plus_weight"]
    assert load_target_head(str(path)).norm_style == "one_plus_weight"
    _same_features_and_loss(target, path, tmp_path)


def _same_features_and_loss(tiny_target: Any, tiny_target_dir: Path, tmp_path: Path) -> None:
    examples = [Example(str(i), np.concatenate([[1, 3], 5 + (np.arange(20) + i) % 91])
                        .astype(np.int64), (np.arange(22) >= 4).astype(np.uint8))
                for i in range(4)]
    offline = FeatureCache(tmp_path / "cache")
    offline.fill(tiny_target, examples)
    paths = {}
    for ex in examples:
        paths[ex.id] = (tmp_path / f"cap-{ex.id}.safetensors", 0)
        capture_file(tiny_target, ex.input_ids, paths[ex.id][0])
    head = load_target_head(str(tiny_target_dir))
    # Nothing but the embeddings, the final norm and the head came from the target.
    assert torch.equal(head.embed, tiny_target.get_input_embeddings().weight)
    assert torch.equal(head.head, tiny_target.get_output_embeddings().weight)
    captured = CapturedFeatures(paths, head)
    idx = [0, 1, 2, 3]
    a = offline.load(examples, idx, 22)
    b = captured.load(examples, idx, 22)
    assert torch.equal(a.aux, b.aux)  # the same layers, the same values
    torch.testing.assert_close(b.last, a.last, atol=1e-5, rtol=0)  # the norm, recomputed
    assert torch.equal(a.top, b.top)

    draft_ids = torch.arange(40)
    drafter = Eagle3Drafter(DraftConfig.from_target(tiny_target.config, len(draft_ids)))
    drafter.init_from_target(head, draft_ids)
    ids = torch.stack([torch.from_numpy(examples[i].input_ids) for i in idx])
    mask = torch.stack([torch.from_numpy(examples[i].loss_mask.astype(bool)) for i in idx])
    dhead = draft_head(head, draft_ids)
    d2t = drafter.draft_to_target
    t2d = torch.zeros(tiny_target.config.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    with torch.no_grad():
        la, _ = ttt_loss(drafter(ids, a.aux, 3), a, mask, d2t, 0.8, dhead, t2d)
        lb, _ = ttt_loss(drafter(ids, b.aux, 3), b, mask, d2t, 0.8, dhead, t2d)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_captured_features_refuse_other_token_ids(tiny_target: Any, tiny_target_dir: Path,
                                                  tmp_path: Path) -> None:
    ex = Example("7", np.array([1, 3, 5, 6, 7, 8], dtype=np.int64), np.ones(6, np.uint8))
    capture_file(tiny_target, np.array([1, 3, 5, 6, 7, 9], dtype=np.int64),
                  tmp_path / "c.safetensors")
    captured = CapturedFeatures({"7": (tmp_path / "c.safetensors", 0)},
                                load_target_head(str(tiny_target_dir)))
    from synthq.core.errors import UserError

    with pytest.raises(UserError, match="differ from its input_ids"):
        captured.read(ex)
    with pytest.raises(UserError, match="no captured features"):
        captured.fill(None, [Example("8", ex.input_ids, ex.loss_mask)])


def test_per_turn_examples_read_their_own_rows_of_their_samples_file(
        tiny_target: Any, tiny_target_dir: Path, tmp_path: Path) -> None:
    """Issue 30 item 3: a per-turn sample's examples are captured one prompt each and
    stored end to end in the sample's one file (synthq.capture.ingest.ingest_parts);
    each example ``SAMPLE:TURN`` reads its own rows from its offset and gets exactly
    the features of its own prompt (the offline path computes each alone)."""
    from safetensors.torch import load_file, save_file

    turns = [Example(f"5:{t}", np.concatenate([[1, 3], 5 + (np.arange(8 + 4 * t) * 7) % 91])
                     .astype(np.int64), np.ones(10 + 4 * t, np.uint8)) for t in range(3)]
    offline = FeatureCache(tmp_path / "cache")
    offline.fill(tiny_target, turns)
    parts = []
    for t, ex in enumerate(turns):
        capture_file(tiny_target, ex.input_ids, tmp_path / f"turn{t}.safetensors")
        parts.append(load_file(str(tmp_path / f"turn{t}.safetensors")))
    whole = tmp_path / "sample.safetensors"
    save_file({k: torch.cat([p[k] for p in parts]) for k in ("hidden_states", "token_ids")},
              str(whole))
    offsets = np.cumsum([0, *(len(ex.input_ids) for ex in turns[:-1])])
    captured = CapturedFeatures({ex.id: (whole, int(o)) for ex, o in
                                 zip(turns, offsets, strict=True)},
                                load_target_head(str(tiny_target_dir)))
    for i, ex in enumerate(turns):
        a = offline.load(turns, [i], len(ex.input_ids))
        b = captured.load(turns, [i], len(ex.input_ids))
        assert torch.equal(a.aux, b.aux)
        assert torch.equal(a.top, b.top)
