"""A tiny Llama target for a real vLLM on a CPU: ``synthq testing tiny-target DIR``.

Built from a config in seconds, no download: a byte-level BPE tokenizer trained on
a counting language with a ChatML chat template, and a small Llama (head_dim 64:
vLLM's CPU attention refuses smaller heads) trained for a few seconds on that
language, so that its greedy answers are deterministic and a drafter can learn
them. The language::

    user:      count from 23 to 29
    assistant: 23 24 25 26 27 28 29<|im_end|>

Every prompt has one right answer, so a trained target answers it the same way
every time, and an EAGLE-3 drafter trained on the target's own answers (generated
by vLLM) drafts most of it right. The directory is a normal transformers model
(``save_pretrained``): vLLM serves it with ``--model DIR``, synthq tokenizes with it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TinySpec", "build_tiny_target", "cached_tiny_target", "count_prompt",
           "count_answer", "prompts", "write_prompt_set", "CHAT_TEMPLATE", "END_OF_TURN"]

END_OF_TURN = "<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", END_OF_TURN, "<think>", "</think>"]

#: ChatML; the assistant's turn ends at <|im_end|>, the target's EOS.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Numbers run 0..TOP-1; an answer has 3..MAX_COUNT of them.
TOP = 100
MAX_COUNT = 20


@dataclass(frozen=True)
class TinySpec:
    """The target's shape and its few seconds of training."""

    layers: int = 8
    hidden: int = 64
    heads: int = 1  # head_dim = hidden // heads = 64
    intermediate: int = 192
    max_positions: int = 512
    vocab: int = 400
    steps: int = 300
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0


def count_prompt(n: int, start: int) -> str:
    return f"count from {start} to {start + n - 1}"


def count_answer(n: int, start: int) -> str:
    return " ".join(str(start + i) for i in range(n))


def prompts(k: int, seed: int) -> list[tuple[int, int]]:
    """``k`` (count, start) pairs drawn with ``seed``; every pair stays below TOP."""
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        n = rng.randint(3, MAX_COUNT)
        out.append((n, rng.randint(0, TOP - n)))
    return out


def write_prompt_set(directory: Path, *, train: int = 600, held_out: int = 40,
                     seed: int = 1) -> dict[str, Any]:
    """``DIR/train.jsonl`` and ``DIR/held_out.jsonl``: prompts of the target's language in
    ``messages`` form (what ``synthq run -d`` reads), the held-out ones never among the
    training ones, and ``DIR/manifest.json``. The loop on the tiny target had no prompt
    file that any command wrote (``synthq testing doc-prompts`` is the real target's)."""
    space = sum(TOP - n + 1 for n in range(3, MAX_COUNT + 1))  # 1,611 distinct prompts
    if train + held_out > space:
        from synthq.core.errors import UserError

        raise UserError(f"the language has {space:,} distinct prompts: --train plus "
                        f"--held-out may not exceed it, got {train + held_out:,}")
    rng = random.Random(seed)
    chosen_pairs: dict[tuple[int, int], None] = {}  # distinct, in the order drawn
    while len(chosen_pairs) < train + held_out:
        n = rng.randint(3, MAX_COUNT)
        chosen_pairs.setdefault((n, rng.randint(0, TOP - n)))
    every = list(chosen_pairs)
    pairs, fresh = every[:train], every[train:]
    directory.mkdir(parents=True, exist_ok=True)
    for name, chosen in (("train", pairs), ("held_out", fresh)):
        (directory / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": f"count-{n}-{start}",
                        "messages": [{"role": "user", "content": count_prompt(n, start)}]})
            + "\n" for n, start in chosen))
    manifest = {"directory": str(directory), "train": len(pairs), "held_out": len(fresh),
                "seed": seed, "language": "count from A to B -> A A+1 ... B",
                "files": ["train.jsonl", "held_out.jsonl"]}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _chat(n: int, start: int) -> str:
    return (f"<|im_start|>user\n{count_prompt(n, start)}{END_OF_TURN}\n"
            f"<|im_start|>assistant\n{count_answer(n, start)}{END_OF_TURN}\n")


def _tokenizer(spec: TinySpec) -> Any:
    """Byte-level BPE trained on every prompt and answer of the language."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [_chat(n, s) for n in range(3, MAX_COUNT + 1) for s in range(0, TOP - n + 1)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TURN,
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def _batch(tok: Any, pairs: list[tuple[int, int]]) -> tuple[Any, Any]:
    """Padded ids and labels: the loss is on the answers only (the prompts are random,
    nothing to learn there), so a few hundred steps make the answers exact."""
    import torch

    rows, starts = [], []
    for n, s in pairs:
        text = _chat(n, s)
        head = text[:text.index("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
        rows.append(tok(text, add_special_tokens=False)["input_ids"])
        starts.append(len(tok(head, add_special_tokens=False)["input_ids"]))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, a) in enumerate(zip(rows, starts, strict=True)):
        ids[i, :len(r)] = torch.tensor(r)
        labels[i, a:len(r)] = torch.tensor(r[a:])
    return ids, labels


def build_tiny_target(directory: Path, spec: TinySpec | None = None,
                      say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build, train and ``save_pretrained`` the target into ``directory``; returns a
    summary (vocabulary, parameters, final loss, greedy accuracy on unseen prompts)."""
    import torch

    spec = spec or TinySpec()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    # One thread: a model this small gains nothing from more, and on a busy machine
    # OpenMP threads that wait for each other made a step ten times slower.
    torch.set_num_threads(1)
    try:
        return _build(directory, spec, say, t0)
    finally:
        torch.set_num_threads(threads)


def cached_tiny_target(spec: TinySpec | None = None,
                       say: Callable[[str], None] | None = None) -> Path:
    """The target of ``spec`` in synthq's cache (``~/.cache/synthq/tiny-target-KEY``),
    built first if this version of this file has not built it yet: the build is seeded,
    so a second one would write the same model. KEY is this file's bytes and the spec."""
    import dataclasses
    import hashlib

    from synthq.testing.real import cached_build

    spec = spec or TinySpec()
    key = hashlib.sha256(Path(__file__).read_bytes())
    if spec != TinySpec():  # the default's key is the file's alone, as it always was
        key.update(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode())
    return cached_build(f"tiny-target-{key.hexdigest()[:12]}", "tiny_target.json",
                        lambda partial: build_tiny_target(partial, spec, say))


def _build(directory: Path, spec: TinySpec, say: Callable[[str], None] | None,
           t0: float) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    tok = _tokenizer(spec)
    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=spec.hidden,
                         intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                         num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                         head_dim=spec.hidden // spec.heads,
                         max_position_embeddings=spec.max_positions, rms_norm_eps=1e-6,
                         tie_word_embeddings=False,
                         bos_token_id=tok.pad_token_id, eos_token_id=eot,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / max(1, spec.steps)))
    rng = random.Random(spec.seed)
    loss = float("nan")
    model.train()
    for step in range(spec.steps):
        ids, labels = _batch(tok, prompts(spec.batch, rng.randrange(1 << 30)))
        out = model(input_ids=ids, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss = float(out.loss.detach())
        if say is not None and (step + 1) % 100 == 0:
            say(f"step {step + 1}/{spec.steps}: loss {loss:.3f}")
    model.eval()
    accuracy = _greedy_accuracy(model, tok, prompts(20, spec.seed + 1))
    directory.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = eot
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    summary = {"directory": str(directory), "vocab_size": len(tok),
               "parameters": sum(p.numel() for p in model.parameters()),
               "layers": spec.layers, "head_dim": spec.hidden // spec.heads,
               "loss": round(loss, 4), "greedy_exact": accuracy,
               "seconds": round(time.perf_counter() - t0, 1)}
    (directory / "tiny_target.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _greedy_accuracy(model: Any, tok: Any, pairs: list[tuple[int, int]]) -> float:
    """Share of prompts the target answers exactly (greedy, stopping at <|im_end|>)."""
    import torch

    right = 0
    with torch.no_grad():
        for n, s in pairs:
            text = tok.apply_chat_template([{"role": "user", "content": count_prompt(n, s)}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=3 * MAX_COUNT, do_sample=False,
                                 eos_token_id=tok.convert_tokens_to_ids(END_OF_TURN),
                                 pad_token_id=tok.pad_token_id)
            answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            right += answer.strip() == count_answer(n, s)
    return right / len(pairs)
