"""A tiny Llama target (8 layers: distinct aux layer ids [2, 4, 5]; built from a config,
saved, loaded back) and jobs of its greedy output."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

# Tiny models on a shared 2-core machine: one thread is several times faster than
# two fighting the other processes (and training subprocesses inherit it).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from training_support import VOCAB, counting_batch, greedy_examples  # noqa: E402


def _train_tiny_target(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(120):
        x = counting_batch(gen, 32, 24)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """An 8-layer Llama trained (about 10 s) on a counting language: BOS, a marker
    (3: count by 1, 4: count by 2), then numbers 5..95 counting modulo 91. Its
    greedy output is learnable, so a drafter that trains right drafts it well and
    one that trains wrong (a shifted target, wrong layers) does not.

    Trained once per machine and kept while this file, the language's code and the
    torch and transformers versions are unchanged (``support.built_once``)."""
    import transformers
    from support import built_once

    here = Path(__file__).parent
    return built_once("tiny-llama", [here / "conftest.py", here / "training_support.py",
                                     torch.__version__, transformers.__version__],
                      _train_tiny_target)


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path) -> Any:
    from synthq.training.loop import load_target

    return load_target(str(tiny_target_dir))


@pytest.fixture
def greedy_job(sample_factory: Callable[..., int], job_factory: Callable[..., Any],
               tiny_target: Any) -> Callable[..., int]:
    """``greedy_job(n=24)`` → the id of a job whose n done samples are the target's greedy text."""
    from synthq.core.packing import pack_ids, pack_mask

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


@pytest.fixture(scope="session")
def norm_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """``{style: (folder, model)}``: a Llama (``weight``) and a Gemma (``one_plus_weight``)
    target whose final norm weights are not ones, saved and loaded back."""
    from training_support import norm_target

    from synthq.training.loop import load_target

    out = {}
    for style in ("weight", "one_plus_weight"):
        path = norm_target(tmp_path_factory.mktemp(f"norm-{style}"), style)
        out[style] = (path, load_target(str(path)))
    return out
