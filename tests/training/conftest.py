"""A tiny Llama target (built from a config, saved, loaded back) and jobs of its greedy output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from training_support import VOCAB, greedy_examples  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharp next-token distributions, like a trained model's
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path) -> Any:
    from synthq.training.loop import load_target

    return load_target(str(tiny_target_dir))


@pytest.fixture
def greedy_job(sample_factory: Callable[..., int], job_factory: Callable[..., Any],
               tiny_target: Any) -> Callable[..., int]:
    """``greedy_job(n=24)`` → the id of a job whose n done samples are the target's greedy text."""
    from synthq.packing import pack_ids, pack_mask

    def make(n: int = 24, *, seed: int = 0, examples: list[Any] | None = None,
             **job_fields: Any) -> int:
        job_id = job_factory([], tokenizer="tiny", **job_fields).job_id
        for ids, mask in examples if examples is not None else greedy_examples(
                tiny_target, n, seed=seed):
            sample_factory("done", job_id=job_id, input_ids=pack_ids(ids),
                           loss_mask=pack_mask(mask), num_tokens=len(ids),
                           num_supervised=sum(mask), tokenize_version=1,
                           response_content="x")
        return job_id

    return make
