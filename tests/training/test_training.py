"""Drafter training on the CPU with a tiny Llama target, against real PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, TrainingRun

torch = pytest.importorskip("torch")

from training_support import get_run, greedy_examples, start_run  # noqa: E402
from vllm_reference import RefDrafter, ref_speculate  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Short but real: 24 greedy examples, 4 a step, 20 epochs = 120 steps.
FAST = dict(draft_vocab_size=64, batch_size=4, epochs=20, lr=1e-2, warmup_ratio=0.05,
            save_every=40, log_every=5, seed=0)


def _run(job_id: int, target: Path, **settings: Any) -> int:
    return start_run(job_id, target, **{**FAST, **settings})


_get = get_run


def _step0_accuracy(target: Any, drafter: Any, examples: list[Any]) -> float:
    """Position-0 accuracy (draft argmax == target argmax) on supervised positions."""
    from synthq.training.data import Example, collate, draft_head, target_features
    from synthq.training.loss import ttt_loss

    exs = [Example(str(i), np.array(a), np.array(m, dtype=np.uint8))
           for i, (a, m) in enumerate(examples)]
    draft_ids = drafter.draft_to_target
    ids, mask, _ = collate(exs, list(range(len(exs))))
    feats = target_features(target, ids)
    with torch.no_grad():
        logits = drafter(ids, feats.aux, 1)
        _, stats = ttt_loss(logits, feats, mask, draft_ids, 0.8, draft_head(target, draft_ids),
                            drafter.t2d)
    return stats[0][0] / stats[0][1]


def test_run_trains_a_drafter_that_vllm_layout_loads_and_speculates_exactly(
        greedy_job: Callable[..., int], tiny_target: Any, tiny_target_dir: Path) -> None:
    from safetensors import safe_open

    from synthq.training.checkpoint import load_drafter
    from synthq.training.data import Example, draft_vocab
    from synthq.training.lifecycle import execute_run
    from synthq.training.model import DraftConfig, Eagle3Drafter
    from synthq.training.speculate import (
        acceptance_length,
        greedy_generate,
        speculative_generate,
    )

    job_id = greedy_job(24)
    run_id = _run(job_id, tiny_target_dir, eval_draft_tokens=4)
    assert execute_run(run_id) == "done", _get(run_id).error
    run = _get(run_id)
    assert (run.state, run.step, run.total_steps, run.resumed_from) == ("done", 120, 120, 0)

    # The loss falls (logged every 5 steps in SQL).
    losses = [m["loss"] for m in run.metrics]
    assert len(run.metrics) == 24 and len(run.metrics[0]["acc"]) == 7
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:2]), losses

    # The checkpoint is vLLM's llama_eagle3 layout.
    final = Path(run.checkpoint or "")
    assert final.name == "final" and (final / "metrics.png").stat().st_size > 1000
    cfg = json.loads((final / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (1, 64, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (96, 64, 64)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM, as-is
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],  # SGLang +1
                                   "use_aux_hidden_state": True}
    assert cfg["rms_norm_eps"] > 0
    H, kv = 64, 2 * 16
    shapes = {"fc.weight": (H, 3 * H), "midlayer.self_attn.q_proj.weight": (H, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, H),
              "midlayer.mlp.gate_proj.weight": (128, H), "midlayer.mlp.up_proj.weight": (128, H),
              "midlayer.mlp.down_proj.weight": (H, 128),
              "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), "norm.weight": (H,),
              "lm_head.weight": (64, H), "d2t": (64,), "t2d": (96,)}
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(shapes)
        for name, shape in shapes.items():
            assert tuple(f.get_slice(name).get_shape()) == shape, name
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 64
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(64) + d2t)

    # Trained vs untrained, position 0, on fresh greedy data of the target.
    drafter = load_drafter(final, tiny_target)
    fresh = greedy_examples(tiny_target, 8, seed=7)
    train_exs = [Example(str(i), np.array(a), np.array(m, dtype=np.uint8))
                 for i, (a, m) in enumerate(greedy_examples(tiny_target, 24, seed=0))]
    ids, d2t0, t2d0 = draft_vocab(train_exs, 64, 96)
    torch.manual_seed(0)
    untrained = Eagle3Drafter(DraftConfig.from_target(tiny_target.config, 64))
    untrained.init_from_target(tiny_target, ids)
    untrained.d2t.copy_(d2t0)
    untrained.t2d.copy_(t2d0)
    before = _step0_accuracy(tiny_target, untrained.eval(), fresh)
    after = _step0_accuracy(tiny_target, drafter, fresh)
    assert after > before + 0.2, (before, after)

    # Served: vLLM's loader (re-implemented in the test) loads every parameter, and its
    # forward, written from vLLM's semantics, drafts exactly synthq's tokens; draft-and-
    # verify with it reproduces the target's greedy output.
    ref = RefDrafter(final, tiny_target)
    assert ref.unloaded() == []
    ref_lengths: list[int] = []
    for prompt, _ in greedy_examples(tiny_target, 6, seed=11, new_tokens=1):
        prompt = prompt[:-1]
        want = greedy_generate(tiny_target, prompt, 32)
        got, rounds = ref_speculate(tiny_target, ref, prompt, 32, k=4)
        mine, my_rounds = speculative_generate(tiny_target, drafter, prompt, 32, k=4)
        assert got == want and mine == want
        assert rounds == my_rounds  # the same drafts, round by round
        ref_lengths += rounds
    served = sum(ref_lengths) / len(ref_lengths)

    # Trained beats untrained by 0.3 tokens a round on held-out prompts, and the run's
    # own eval_acceptance_length (its held-out split) agrees with the reference's figure.
    untrained_accept = acceptance_length(
        tiny_target, untrained, [Example(str(i), np.array(a), np.array(m, dtype=np.uint8))
                                 for i, (a, m) in enumerate(fresh)], 4).mean
    print(f"position-0 accuracy {before:.2f} -> {after:.2f}; acceptance length (k=4) "
          f"untrained {untrained_accept:.2f}, trained {served:.2f} (vLLM reference), run's "
          f"eval {run.eval_acceptance_length}; loss {np.mean(losses[:2]):.2f} -> "
          f"{np.mean(losses[-4:]):.2f}")
    assert served >= untrained_accept + 0.3, (untrained_accept, served)
    assert run.eval_acceptance_length is not None
    assert abs(run.eval_acceptance_length - served) <= 0.4, (run.eval_acceptance_length, served)
    assert run.metrics[-1]["eval_accept"] == run.eval_acceptance_length


def test_offline_cache_is_written_atomically_and_reused(
        greedy_job: Callable[..., int], tiny_target_dir: Path) -> None:
    from synthq.training.lifecycle import execute_run

    job_id = greedy_job(8)
    run_id = _run(job_id, tiny_target_dir, hidden_states="offline", epochs=2)
    assert execute_run(run_id) == "done", _get(run_id).error
    cache = Path(_get(run_id).output_dir) / "cache"
    files = sorted(cache.iterdir())
    # 1 of the 8 is held out for evaluation: never trained on, never cached
    assert len(files) == 7 and all(p.suffix == ".safetensors" for p in files)
    from safetensors.torch import load_file

    t = load_file(str(files[0]))
    assert set(t) == {"aux", "last", "top"}  # no logits: recomputed from lm_head rows
    assert t["aux"].shape[1] == 3 * 64 and t["last"].shape[1] == 64
    assert t["aux"].shape[0] == t["last"].shape[0] == t["top"].shape[0]
    per_token = files[0].stat().st_size / t["aux"].shape[0]
    # (3H + H) values of the target's dtype (fp32 on this CPU: 4 bytes) + the int64 token
    assert per_token <= (3 * 64 + 64) * 4 + 8 + 64, per_token


def test_a_job_without_supervised_tokens_fails_its_run(
        greedy_job: Callable[..., int], tiny_target: Any, tiny_target_dir: Path) -> None:
    from synthq.training.lifecycle import execute_run

    examples = [(ids, [0] * len(ids)) for ids, _ in greedy_examples(tiny_target, 3, new_tokens=4)]
    job_id = greedy_job(examples=examples)
    run_id = _run(job_id, tiny_target_dir)
    assert execute_run(run_id) == "failed"
    run = _get(run_id)
    assert run.state == "failed" and run.finished_at is not None
    assert "no supervised token to train on" in (run.error or ""), run.error


def test_readiness_starts_exactly_one_run(sample_factory: Callable[..., int],
                                          job_factory: Callable[..., Any],
                                          tiny_target_dir: Path) -> None:
    from sqlalchemy import update

    from synthq.store.models import Sample
    from synthq.training.readiness import check_readiness

    job_id = job_factory([]).job_id
    other = job_factory([]).job_id  # never armed: no target
    done = [sample_factory("done", job_id=job_id) for _ in range(49)]
    running = sample_factory("running", job_id=job_id)
    sample_factory("skipped", job_id=job_id)
    sample_factory("done", job_id=other)
    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.train_target, job.train_settings = str(tiny_target_dir), {"epochs": 3}
    sent: list[list[int]] = []
    assert check_readiness(sent.append).started == []  # 49/50 done but one running
    with session_scope() as s:
        s.execute(update(Sample).where(Sample.id == running).values(state="done"))
    first = check_readiness(sent.append)
    assert len(first.started) == 1 and sent == [first.started]
    for _ in range(3):
        assert check_readiness(sent.append).started == []
    with session_scope() as s:
        runs = s.query(TrainingRun).all()
        assert [(r.job_id, r.trigger, r.state, r.settings["epochs"]) for r in runs] == \
            [(job_id, "auto", "pending", 3)]
    assert len(done) == 49


def test_readiness_thresholds() -> None:
    from synthq.core.errors import UserError
    from synthq.training.config import parse_when

    ready = parse_when("ready")
    assert ready.met(done=98, total=101, skipped=1, inflight=0)
    assert not ready.met(done=97, total=100, skipped=0, inflight=0)
    assert not ready.met(done=99, total=100, skipped=0, inflight=1)
    assert parse_when("done:0.9").met(done=90, total=100, skipped=0, inflight=0)
    assert not parse_when("done:0.9").met(done=89, total=100, skipped=0, inflight=0)
    assert parse_when("count:10").met(done=10, total=1000, skipped=0, inflight=50)
    assert not parse_when("never").met(done=10, total=10, skipped=0, inflight=0)
    assert not ready.met(done=0, total=0, skipped=0, inflight=0)
    assert str(parse_when("done:0.9")) == "done:0.9" and str(parse_when("count:5")) == "count:5"
    for bad in ("done:0", "done:1.5", "count:0", "count:2.5", "soon", "done:x"):
        with pytest.raises(UserError):
            parse_when(bad)


def test_stale_running_run_is_sent_again(greedy_job: Callable[..., int],
                                         tiny_target_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    from synthq.queue import run_states as states
    from synthq.spec.config import get_settings
    from synthq.training.readiness import check_readiness

    monkeypatch.setenv("SYNTHQ_TRAIN_LEASE", "5")
    get_settings.cache_clear()
    run_id = _run(greedy_job(2), tiny_target_dir)
    with session_scope() as s:
        assert states.claim(s, run_id, "a" * 16, worker="w1", now=utcnow(), lease=5)
        assert not states.claim(s, run_id, "b" * 16, worker="w2", now=utcnow(), lease=5)
    assert check_readiness().to_send == []
    with session_scope() as s:
        s.get(TrainingRun, run_id).heartbeat_at = utcnow() - timedelta(seconds=10)  # type: ignore
    assert check_readiness().to_send == [run_id]
    with session_scope() as s:
        assert not states.progress(s, run_id, "a" * 16, now=utcnow())  # the old worker lost it
        assert states.claim(s, run_id, "c" * 16, worker="w3", now=utcnow(), lease=5)
