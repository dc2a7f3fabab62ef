"""Tests that fail when the drafter is trained or written wrong: layer indices under each
engine's rule, vLLM's loader and forward (re-implemented in vllm_reference.py, sharing
no code with synthq.training), out-of-vocabulary positions, offline == online, resume."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from synthq.store.db import session_scope, utcnow
from synthq.store.models import TrainingRun

torch = pytest.importorskip("torch")

from training_support import get_run, greedy_examples, start_run  # noqa: E402
from vllm_reference import RefDrafter  # noqa: E402


def _layer_inputs(target: Any, ids: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
    """The input of every decoder layer, caught by hooks, and the model's output."""
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.__setitem__(i, (args[0] if args else
                                                            kwargs["hidden_states"]).clone()),
        with_kwargs=True) for i, layer in enumerate(target.model.layers)]
    try:
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(target.model.layers))], out


def _layer_outputs(target: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(
            i, (out[0] if isinstance(out, tuple) else out).clone()))
        for i, layer in enumerate(target.model.layers)]
    try:
        with torch.no_grad():
            target(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(target.model.layers))]


def test_hidden_states_index_i_is_the_input_of_layer_i(tiny_target: Any) -> None:
    from synthq.training.data import target_features
    from synthq.training.model import aux_layer_ids

    n = tiny_target.config.num_hidden_layers
    assert n == 8 and aux_layer_ids(n) == [2, 4, 5]  # distinct on this target
    ids = torch.tensor([[1, 3, 10, 11, 12, 13, 14]])
    inputs, out = _layer_inputs(tiny_target, ids)
    for i in range(n):
        assert torch.equal(out.hidden_states[i], inputs[i]), i
    # ... and the features synthq trains on are those layers' inputs.
    aux = target_features(tiny_target, ids).aux
    assert torch.equal(aux, torch.cat([inputs[i] for i in (2, 4, 5)], dim=-1))


def test_config_resolves_to_the_training_layers_under_each_engine(tiny_target: Any) -> None:
    from synthq.training.data import target_features
    from synthq.training.model import DraftConfig

    cfg = DraftConfig.from_target(tiny_target.config, 64).vllm_config("bfloat16")
    ids = torch.tensor([[1, 4, 20, 22, 24, 26]])
    trained = target_features(tiny_target, ids).aux
    inputs, _ = _layer_inputs(tiny_target, ids)
    outputs = _layer_outputs(tiny_target, ids)
    # vLLM: the top-level key, as output_hidden_states indices (input of layer i).
    vllm = cfg["eagle_aux_hidden_state_layer_ids"]
    assert torch.equal(torch.cat([inputs[i] for i in vllm], -1), trained)
    # SGLang: the nested key; layers_to_capture = [val + 1], captured at the layer's input.
    nested = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    sglang = [val + 1 for val in nested]
    assert torch.equal(torch.cat([inputs[i] for i in sglang], -1), trained)
    # SpecForge: the nested key, hooked at the layer's output.
    assert torch.equal(torch.cat([outputs[i] for i in nested], -1), trained)
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True


def test_out_of_vocabulary_positions_get_no_loss_and_no_gradient() -> None:
    from synthq.training.data import TargetFeatures
    from synthq.training.loss import ttt_loss

    torch.manual_seed(0)
    T, V, H, L = 12, 6, 8, 6
    draft_ids = torch.tensor([0, 2, 4, 6, 8, 10])
    t2d = torch.zeros(T, dtype=torch.bool)
    t2d[draft_ids] = True
    head = torch.randn(T, H)[draft_ids]
    feats = TargetFeatures(aux=torch.randn(1, L, 3 * H), last=torch.randn(1, L, H),
                           top=torch.tensor([[0, 2, 3, 4, 6, 8]]))  # top at 2 is 3: OOV
    # Step 0 at position i learns the target at i+1; supervised where loss_mask[i+2].
    mask = torch.tensor([[0, 0, 0, 1, 0, 0]], dtype=torch.bool)  # position 1 -> target at 2
    logits = torch.randn(1, L, V, requires_grad=True)
    loss, stats = ttt_loss([logits], feats, mask, draft_ids, 0.8, head, t2d)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0
    assert stats == [(0, 1)]  # still counted for accuracy: a miss the drafter can't avoid
    # The same position with an in-vocabulary target is trained.
    feats.top[0, 2] = 4
    logits.grad = None
    loss, _ = ttt_loss([logits], feats, mask, draft_ids, 0.8, head, t2d)
    loss.backward()
    assert float(loss.detach()) > 0 and float(logits.grad[0, 1].abs().sum()) > 0


def _random_drafter(target: Any, seed: int) -> Any:
    """A drafter with every weight random (norms too), so no part can hide."""
    from synthq.training.model import DraftConfig, Eagle3Drafter

    torch.manual_seed(seed)
    d = Eagle3Drafter(DraftConfig.from_target(target.config, 64))
    draft_ids = torch.sort(torch.randperm(96)[:64]).values
    d.init_from_target(target, draft_ids)
    d.d2t.copy_(draft_ids - torch.arange(64))
    d.t2d.zero_()
    d.t2d[draft_ids] = True
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name != "embed_tokens.weight":
                p.add_(0.2 * torch.randn_like(p))
    return d.eval()


def test_vllm_loader_loads_every_parameter_and_the_reference_drafts_synthqs_tokens(
        tiny_target: Any, tmp_path: Path) -> None:
    from synthq.training.checkpoint import save_drafter
    from synthq.training.speculate import _target, propose

    drafter = _random_drafter(tiny_target, 1)
    out = save_drafter(tmp_path / "final", drafter, {})
    ref = RefDrafter(out, tiny_target)
    assert ref.unloaded() == []
    # 6 fused shards + 7 plain tensors + d2t: nothing else was in the file.
    assert len(ref.loaded) == 14
    draws = 0
    for prompt, _ in greedy_examples(tiny_target, 6, seed=3, new_tokens=6):
        for cut in (4, 7, len(prompt)):
            tokens = prompt[:cut]
            _, aux = _target(tiny_target, tokens[:-1])
            mine = propose(drafter, tokens, aux, 4)
            assert ref.propose(tokens, aux[0], 4) == mine, (tokens, mine)
            draws += 1
    assert draws == 18
    # A name vLLM has no parameter for fails the load.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "midlayer.self_attn.rotary.weight": torch.zeros(2)},
              str(out / "model.safetensors"))
    with pytest.raises(KeyError):
        RefDrafter(out, tiny_target)


def test_a_draft_vocabulary_equal_to_the_targets_has_no_d2t_as_vllm_loads_it(
        tiny_target: Any, tmp_path: Path) -> None:
    """vLLM makes no draft_id_to_target_id when the vocabularies are equal: synthq writes
    neither d2t nor t2d then, the reference loader (like vLLM's) refuses a d2t, and
    synthq loads its own checkpoint back with the identity mapping."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from synthq.training.checkpoint import load_drafter, save_drafter
    from synthq.training.model import DraftConfig, Eagle3Drafter
    from synthq.training.speculate import _target, propose

    T = tiny_target.config.vocab_size
    torch.manual_seed(2)
    d = Eagle3Drafter(DraftConfig.from_target(tiny_target.config, T))
    d.init_from_target(tiny_target, torch.arange(T))
    d.t2d.fill_(True)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(0.2 * torch.randn_like(p))
    out = save_drafter(tmp_path / "same", d.eval(), {})
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())  # noqa: SIM118 - safe_open has no __contains__
        assert tuple(f.get_slice("lm_head.weight").get_shape())[0] == T
    ref = RefDrafter(out, tiny_target)
    assert not ref.mapped and ref.unloaded() == [] and len(ref.loaded) == 13
    back = load_drafter(out, tiny_target)
    assert bool(back.t2d.all()) and int(back.d2t.abs().sum()) == 0
    for prompt, _ in greedy_examples(tiny_target, 3, seed=4, new_tokens=4):
        _, aux = _target(tiny_target, prompt[:-1])
        assert ref.propose(prompt, aux[0], 4) == propose(back, prompt, aux, 4) == \
            propose(d, prompt, aux, 4)
    # What synthq wrote before: a d2t beside an equal vocabulary. vLLM 0.32 refused it
    # ("There is no module or parameter named 'draft_id_to_target_id'").
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, "d2t": torch.zeros(T, dtype=torch.long)},
              str(out / "model.safetensors"))
    with pytest.raises(KeyError, match="draft_id_to_target_id"):
        RefDrafter(out, tiny_target)


def test_cache_estimate_matches_the_files_and_short_disk_is_refused(
        tiny_target: Any, tmp_path: Path) -> None:
    from synthq.core.errors import UserError
    from synthq.training.data import Example, FeatureCache, cache_bytes_per_token

    exs = [Example(str(i), np.array(a), np.array(m, dtype=np.uint8))
           for i, (a, m) in enumerate(greedy_examples(tiny_target, 3, new_tokens=10))]
    cache = FeatureCache(tmp_path / "cache")
    estimate = cache.estimate(tiny_target, exs)
    lines: list[str] = []
    assert cache.fill(tiny_target, exs, say=lines.append) == 3
    size = sum(p.stat().st_size for p in (tmp_path / "cache").iterdir())
    assert abs(size - estimate) < 0.1 * estimate, (size, estimate)
    assert len(lines) == 1 and "GB" in lines[0] and "free" in lines[0]
    assert cache_bytes_per_token(4096, 2) == (3 * 4096 + 4096) * 2 + 8  # bf16 8B target
    with pytest.raises(UserError, match="only .* GB is free"):
        cache.check_space(1 << 60)


FAST = dict(draft_vocab_size=64, batch_size=4, lr=1e-2, warmup_ratio=0.05, seed=0,
            eval_fraction=0.0)


def _run(job_id: int, target: Path, **settings: Any) -> int:
    return start_run(job_id, target, **{**FAST, **settings})


_get = get_run


@pytest.mark.integration
def test_offline_loss_equals_online_loss_at_step_1(greedy_job: Callable[..., int],
                                                   tiny_target_dir: Path) -> None:
    from synthq.training.lifecycle import execute_run

    job_id = greedy_job(4)
    losses = []
    for mode in ("online", "offline"):
        run_id = _run(job_id, tiny_target_dir, hidden_states=mode, max_steps=1, log_every=1,
                      batch_size=1)
        assert execute_run(run_id) == "done", _get(run_id).error
        losses.append(_get(run_id).metrics[0]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), losses


class _Kill(BaseException):
    """Stands for a SIGKILL inside the training loop (not caught as an Exception)."""


@pytest.mark.integration
def test_a_resumed_run_reproduces_the_uninterrupted_losses(
        greedy_job: Callable[..., int], tiny_target_dir: Path) -> None:
    from synthq.training.lifecycle import execute_run

    job_id = greedy_job(8)
    settings = dict(max_steps=9, epochs=10, log_every=1, save_every=2, keep_checkpoints=2)
    whole = _run(job_id, tiny_target_dir, **settings)
    assert execute_run(whole) == "done"
    want = [(m["step"], m["loss"]) for m in _get(whole).metrics]
    assert [s for s, _ in want] == list(range(1, 10))

    cut = _run(job_id, tiny_target_dir, **settings)

    def kill_at_7(step: int, record: dict[str, Any]) -> None:
        if step == 7:
            raise _Kill()

    with pytest.raises(_Kill):
        execute_run(cut, on_step=kill_at_7)
    ckpts = Path(_get(cut).output_dir) / "checkpoints"
    # Pruned to the newest 2 (steps 4 and 6), and the run resumes from step 6.
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000006"]
    with session_scope() as s:  # its worker is dead: the heartbeat went stale
        s.get(TrainingRun, cut).heartbeat_at = utcnow() - timedelta(days=1)  # type: ignore
    assert execute_run(cut) == "done", _get(cut).error
    run = _get(cut)
    assert run.resumed_from == 6
    got = [(m["step"], m["loss"]) for m in run.metrics]
    assert [s for s, _ in got] == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (step, a, b)
    assert len([p for p in ckpts.iterdir() if p.name.startswith("step-")]) == 2


def test_chunked_attention_gives_the_same_logits_and_gradients(
        tiny_target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.training import model

    drafter = _random_drafter(tiny_target, 2).train()
    ids = torch.randint(3, 96, (2, 23), generator=torch.Generator().manual_seed(0))
    aux = torch.randn(2, 23, 3 * 64, generator=torch.Generator().manual_seed(1))
    results = []
    for chunk in (1024, 5):  # one SDPA call; 5 checkpointed chunks of 5 queries
        monkeypatch.setattr(model, "ATTN_CHUNK", chunk)
        drafter.zero_grad()
        logits = drafter.unroll(ids, aux, 7)
        weights = [torch.linspace(-1, 1, x.numel()).view_as(x) for x in logits]
        sum((x * w).sum() for x, w in zip(logits, weights, strict=True)).backward()
        results.append(([x.detach() for x in logits],
                        {n: p.grad.clone() for n, p in drafter.named_parameters()
                         if p.grad is not None}))
    (la, ga), (lb, gb) = results
    for x, y in zip(la, lb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and "fc.weight" in ga
    for name in ga:  # float32 sums in another order: equal to 1e-5 of the gradient's scale
        scale = float(ga[name].abs().max())
        assert float((ga[name] - gb[name]).abs().max()) <= 1e-5 * scale + 1e-7, name
