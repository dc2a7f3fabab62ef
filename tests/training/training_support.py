"""Helpers for the training tests (importable from test modules, unlike conftest)."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch

from synthq.store.db import session_scope
from synthq.store.models import Job, TrainingRun

VOCAB = 96


#: Numbers of the counting language are ids FIRST..VOCAB-1, counted modulo NUMBERS.
FIRST = 5
NUMBERS = VOCAB - FIRST


def counting_batch(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """[batch, length] counting-language sequences: BOS, marker (3: +1, 4: +2), numbers."""
    step = torch.randint(0, 2, (batch,), generator=gen)
    start = torch.randint(0, NUMBERS, (batch,), generator=gen)
    pos = torch.arange(length - 2)
    nums = (start[:, None] + (step[:, None] + 1) * pos[None]) % NUMBERS + FIRST
    return torch.cat([torch.ones(batch, 1, dtype=torch.long), (step + 3)[:, None], nums], 1)


#: target -> (seed, new_tokens) -> (the generator, the examples drawn from it so far).
_GREEDY: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], tuple[torch.Generator, list[
    tuple[list[int], list[int]]]]]] = weakref.WeakKeyDictionary()


def greedy_examples(target: Any, n: int, *, new_tokens: int = 40, seed: int = 0
                    ) -> list[tuple[list[int], list[int]]]:
    """``n`` (input_ids, loss_mask): a counting-language prompt of 4 to 8 tokens, then
    the target's greedy answer (supervised).

    The k-th example depends on the seed and the k-1 before it only, so the first n of
    a seed are the same for every n: each is generated once per target and process
    (about 0.12 s of CPU an example; the training tier asks for about 200, most of
    them the same ones) and handed out as fresh lists."""
    gen, out = _GREEDY.setdefault(target, {}).setdefault(
        (seed, new_tokens), (torch.Generator().manual_seed(seed), []))
    while len(out) < n:
        plen = int(torch.randint(4, 9, (1,), generator=gen))
        prompt = counting_batch(gen, 1, plen)
        with torch.no_grad():
            seq = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        ids = seq[0].tolist()
        out.append((ids, [0] * plen + [1] * (len(ids) - plen)))
    return [(list(ids), list(mask)) for ids, mask in out[:n]]


def capture_file(target: Any, ids: Any, path: Path) -> None:
    """A capture file as the engine writes it, from transformers' own states:
    ``hidden_states`` [T, 4, H] at ``[2, N//2, N-3, N]`` (the last one the final decoder
    layer's output, before the final norm) and ``token_ids`` [T]."""
    import numpy as np
    from safetensors.torch import save_file

    from synthq.capture.plan import drafter_layers

    kept: dict[str, torch.Tensor] = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, i, o: kept.__setitem__("pre", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = target(input_ids=torch.from_numpy(np.asarray(ids))[None],
                         output_hidden_states=True)
    finally:
        hook.remove()
    n = target.config.num_hidden_layers
    parts = [kept["pre"][0] if i == n else out.hidden_states[i][0] for i in drafter_layers(n)]
    save_file({"hidden_states": torch.stack(parts, 1).contiguous(),
               "token_ids": torch.from_numpy(np.asarray(ids, dtype=np.int64))}, str(path))


def norm_target(path: Path, style: str, *, vocab: int = VOCAB, layers: int = 8) -> Path:
    """A small random target saved with ``save_pretrained`` whose final norm weights are
    far from ones (the weight style: around 1; the (1+w) style: around 0), so a wrong
    norm changes its argmax. ``style``: ``weight`` (a Llama) or ``one_plus_weight`` (a
    Gemma)."""
    from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    shape = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                 tie_word_embeddings=False)
    if style == "weight":
        model: Any = LlamaForCausalLM(LlamaConfig(**shape))
        centre = 1.0
    else:
        model = GemmaForCausalLM(GemmaConfig(head_dim=16, **shape))
        centre = 0.0
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.copy_(centre + 2.0 * torch.randn(norm.shape))
    model.save_pretrained(path)
    return path


def start_run(job_id: int, target: Path, **settings: Any) -> int:
    """A manual training run of ``job_id`` on ``target``; ``settings`` are its TrainConfig."""
    from synthq.training.config import TrainConfig
    from synthq.training.runs import new_run

    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return new_run(s, job, target=str(target), config=TrainConfig(**settings),
                       trigger="manual").id


def get_run(run_id: int) -> TrainingRun:
    """The run's row, detached from its session."""
    with session_scope() as s:
        run = s.get(TrainingRun, run_id)
        assert run is not None
        s.expunge(run)
        return run
