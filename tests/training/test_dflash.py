"""DFlash drafter training on the CPU with the tiny Llama target, against real PostgreSQL:
the block mask holds (no block sees past its anchor), training and drafting compute the
same thing, and a run writes vLLM's DFlash layout with a drafter that drafts better
than an untrained one. (vLLM itself serves it in tests/engine/test_drafter.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from training_support import get_run, greedy_examples, start_run  # noqa: E402


def _drafter(target: Any, layers: int = 1, block: int = 5) -> Any:
    from synthq.training.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    c = DFlashConfig.dflash_from_target(target.config, target.config.vocab_size, layers=layers,
                                 block_size=block)
    d = DFlashDrafter(c)
    d.init_from_target(target, torch.arange(c.vocab_size))
    d.t2d.fill_(True)
    with torch.no_grad():  # a mask unlike the mean embedding, so that slots differ
        d.mask_embedding.normal_()
    return d.eval()


def test_a_block_sees_its_context_and_its_own_block_only(tiny_target: Any) -> None:
    from synthq.training.data import target_features

    d = _drafter(tiny_target, layers=2)
    ids = torch.tensor([greedy_examples(tiny_target, 1, seed=3)[0][0][:30]])
    aux = target_features(tiny_target, ids).aux
    anchors = torch.tensor([[6, 12, 20]])
    with torch.no_grad():
        base = d.blocks(ids, aux, anchors)  # [1, 3, 4, V]
        # Everything at and after position 12 changes: block 0 (anchor 6) must not notice,
        # block 1 sees its anchor token change.
        ids2, aux2 = ids.clone(), aux.clone()
        ids2[0, 12:] = (ids2[0, 12:] + 1) % tiny_target.config.vocab_size
        aux2[0, 12:] = torch.randn_like(aux2[0, 12:])
        moved = d.blocks(ids2, aux2, anchors)
    assert torch.allclose(base[0, 0], moved[0, 0], atol=1e-5)
    assert not torch.allclose(base[0, 1], moved[0, 1], atol=1e-3)
    # One block alone, with only its context, as vLLM and propose() run it: the same logits.
    with torch.no_grad():
        alone = d.blocks(ids[:, :21], aux[:, :20], torch.tensor([[20]]))
    assert torch.allclose(base[0, 2], alone[0, 0], atol=1e-5)
    assert d.propose(ids[0, :21].tolist(), aux[:, :20], 4) == \
        alone[0, 0].argmax(-1).tolist()


def test_anchors_are_the_supervised_positions_with_context() -> None:
    from synthq.training.dflash_loss import sample_anchors

    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    anchors, keep = sample_anchors(mask, 16, torch.Generator().manual_seed(0))
    got = [sorted(int(a) for a, k in zip(row, ks, strict=True) if k)
           for row, ks in zip(anchors, keep, strict=True)]
    assert got == [[2, 3, 4], [5, 6]]  # a: loss_mask[a+1], a >= 1, a + 1 < L
    few, keep = sample_anchors(mask, 2, torch.Generator().manual_seed(0))
    assert few.shape == (2, 2) and bool(keep.all())
    with pytest.raises(RuntimeError, match="no supervised token"):
        sample_anchors(torch.zeros(2, 8, dtype=torch.bool), 4)


@pytest.mark.integration
@pytest.mark.slow
def test_dflash_run_writes_vllms_layout_and_drafts_better_than_untrained(
        greedy_job: Callable[..., int], tiny_target: Any, tiny_target_dir: Path) -> None:
    from safetensors import safe_open

    from synthq.training.checkpoint import load_drafter
    from synthq.training.data import Example
    from synthq.training.lifecycle import execute_run
    from synthq.training.speculate import acceptance_length

    job_id = greedy_job(24)
    run_id = start_run(job_id, tiny_target_dir, drafter="dflash", dflash_layers=1,
                       ttt_steps=4, draft_vocab_size=64, batch_size=4, epochs=15, lr=1e-2,
                       warmup_ratio=0.05, save_every=40, log_every=5, seed=0,
                       eval_draft_tokens=4)
    assert execute_run(run_id) == "done", get_run(run_id).error
    run = get_run(run_id)
    assert (run.state, run.step, run.total_steps) == ("done", 90, 90)
    losses = [m["loss"] for m in run.metrics]
    assert len(run.metrics[0]["acc"]) == 4  # one accuracy per block slot
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:2]), losses

    final = Path(run.checkpoint or "")
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 4],  # vLLM adds 1: [2, 4, 5]
                                    "mask_token_id": 0, "use_aux_hidden_state": True}
    assert (cfg["block_size"], cfg["num_hidden_layers"], cfg["target_hidden_size"]) == (5, 1, 64)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (96, 64)
    assert cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"]
    H, kv = 64, 2 * 16
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,),
              "layers.0.self_attn.q_proj.weight": (H, H),
              "layers.0.self_attn.k_proj.weight": (kv, H),
              "layers.0.self_attn.v_proj.weight": (kv, H),
              "layers.0.self_attn.o_proj.weight": (H, H),
              "layers.0.self_attn.q_norm.weight": (16,), "layers.0.self_attn.k_norm.weight": (16,),
              "layers.0.mlp.gate_proj.weight": (128, H), "layers.0.mlp.up_proj.weight": (128, H),
              "layers.0.mlp.down_proj.weight": (H, 128),
              "layers.0.input_layernorm.weight": (H,),
              "layers.0.post_attention_layernorm.weight": (H,),
              "lm_head.weight": (64, H), "d2t": (64,), "t2d": (96,)}
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == shapes  # noqa: SIM118
    mask = torch.load(final / "mask_embedding.pt", weights_only=True)
    assert mask["mask_token_id"] == 0 and mask["embedding"].shape == (H,)

    # Loaded back, it drafts better than an untrained one on fresh greedy data.
    drafter = load_drafter(final, tiny_target)
    assert torch.equal(drafter.mask_embedding, mask["embedding"])
    fresh = [Example(str(i), np.array(a), np.array(m, dtype=np.uint8))
             for i, (a, m) in enumerate(greedy_examples(tiny_target, 8, seed=7))]
    untrained = _drafter(tiny_target, layers=1)
    before = acceptance_length(tiny_target, untrained, fresh, 4).mean
    after = acceptance_length(tiny_target, drafter, fresh, 4).mean
    print(f"DFlash acceptance length (k=4): untrained {before:.2f}, trained {after:.2f}, "
          f"run's eval {run.eval_acceptance_length}")
    assert after >= before + 0.5, (before, after)
    assert run.eval_acceptance_length is not None and run.eval_acceptance_length >= 2.0


class _Kill(BaseException):
    """Stands for a SIGKILL inside the training loop (not caught as an Exception)."""


@pytest.mark.integration
def test_a_resumed_dflash_run_reproduces_the_uninterrupted_losses(
        greedy_job: Callable[..., int], tiny_target_dir: Path) -> None:
    from datetime import timedelta

    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import TrainingRun
    from synthq.training.lifecycle import execute_run

    job_id = greedy_job(8)
    settings = dict(drafter="dflash", dflash_layers=1, ttt_steps=3, eval_draft_tokens=3,
                    draft_vocab_size=64, batch_size=4, lr=1e-2, warmup_ratio=0.05, seed=0,
                    eval_fraction=0.0, max_steps=7, epochs=10, log_every=1, save_every=2,
                    dflash_anchors=8)
    whole = start_run(job_id, tiny_target_dir, **settings)
    assert execute_run(whole) == "done", get_run(whole).error
    want = [m["loss"] for m in get_run(whole).metrics]

    cut = start_run(job_id, tiny_target_dir, **settings)

    def kill_at_5(step: int, record: dict[str, Any]) -> None:
        if step == 5:
            raise _Kill()

    with pytest.raises(_Kill):
        execute_run(cut, on_step=kill_at_5)
    with session_scope() as s:  # its worker is dead: the heartbeat went stale
        s.get(TrainingRun, cut).heartbeat_at = utcnow() - timedelta(days=1)  # type: ignore
    assert execute_run(cut) == "done", get_run(cut).error
    run = get_run(cut)
    assert run.resumed_from == 4 and (run.settings or {})["drafter"] == "dflash"
    got = [m["loss"] for m in run.metrics]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)  # the same anchors after resume


def test_dflash_loss_on_captured_features_equals_the_offline_path(
        tiny_target: Any, tiny_target_dir: Path, tmp_path: Path) -> None:
    from training_support import capture_file

    from synthq.training.captured import CapturedFeatures, load_target_head
    from synthq.training.data import Example, FeatureCache, draft_head
    from synthq.training.dflash_loss import block_loss, sample_anchors

    examples = [Example(str(i), np.concatenate([[1, 3], 5 + (np.arange(20) + i) % 91])
                        .astype(np.int64), (np.arange(22) >= 4).astype(np.uint8))
                for i in range(4)]
    offline = FeatureCache(tmp_path / "cache")
    offline.fill(tiny_target, examples)
    paths = {ex.id: tmp_path / f"cap-{ex.id}.safetensors" for ex in examples}
    for ex in examples:
        capture_file(tiny_target, ex.input_ids, paths[ex.id])
    head = load_target_head(str(tiny_target_dir))
    idx = [0, 1, 2, 3]
    a = offline.load(examples, idx, 22)
    b = CapturedFeatures({k: (p, 0) for k, p in paths.items()}, head).load(examples, idx, 22)
    d = _drafter(head, layers=1)  # built from the target's head alone, as a captured run is
    ids = torch.stack([torch.from_numpy(examples[i].input_ids) for i in idx])
    mask = torch.stack([torch.from_numpy(examples[i].loss_mask.astype(bool)) for i in idx])
    anchors, keep = sample_anchors(mask, 6, torch.Generator().manual_seed(0))
    dhead = draft_head(head, d.draft_to_target)
    with torch.no_grad():
        la, _ = block_loss(d(ids, a.aux, anchors), a, mask, anchors, keep, d.draft_to_target,
                           0.8, dhead, d.t2d)
        lb, _ = block_loss(d(ids, b.aux, anchors), b, mask, anchors, keep, d.draft_to_target,
                           0.8, dhead, d.t2d)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_dflash_settings_are_checked_and_checkpoints_name_their_vllm_method(
        tmp_path: Path) -> None:
    from synthq.core.errors import UserError
    from synthq.training.config import TrainConfig
    from synthq.training.drafters import speculative_config, vllm_method

    TrainConfig(drafter="dflash", ttt_steps=4, eval_draft_tokens=4).check()
    with pytest.raises(UserError, match="drafts ttt-steps=2 tokens"):
        TrainConfig(drafter="dflash", ttt_steps=2, eval_draft_tokens=4).check()
    with pytest.raises(UserError, match="drafter must be eagle3 or dflash"):
        TrainConfig(drafter="medusa").check()
    with pytest.raises(UserError, match="--dflash-layers is out of range"):
        TrainConfig(drafter="dflash", dflash_layers=0).check()
    for arch, method in (("DFlashDraftModel", "dflash"), ("LlamaForCausalLMEagle3", "eagle3")):
        (tmp_path / method).mkdir()
        (tmp_path / method / "config.json").write_text(json.dumps({"architectures": [arch]}))
        assert vllm_method(tmp_path / method) == method
        assert speculative_config(tmp_path / method, 3) == {
            "method": method, "model": str(tmp_path / method), "num_speculative_tokens": 3}
    with pytest.raises(UserError, match="not a drafter checkpoint"):
        vllm_method(tmp_path / "missing")
