"""A run's data: the job's examples (through synthq.jobs.export), the draft vocabulary,
batches, and the target's features computed online or cached per sample.

The one-position shift: the target's logits at position j predict token j+1,
so they are supervised where ``loss_mask[j+1]`` is 1 (token j+1 is a token the
model generated). Draft step k at position i learns the target's distribution
at j = i+1+k, so its mask is ``loss_mask[i+2+k]`` (:func:`step_mask`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from synthq.core.errors import UserError
from synthq.training.model import aux_layer_ids

__all__ = ["Example", "load_examples", "draft_vocab", "draft_vocab_of", "count_supervised",
           "batches", "collate", "TargetFeatures",
           "target_features", "draft_head", "FeatureCache", "Prefetcher", "step_mask",
           "supervised",
           "NoSupervisedTokens", "split_eval", "cache_bytes_per_token"]

log = logging.getLogger(__name__)


class NoSupervisedTokens(UserError):
    """The job's examples hold no supervised token the drafter could learn from."""


@dataclass
class Example:
    id: str
    input_ids: np.ndarray  # [L] int64
    loss_mask: np.ndarray  # [L] uint8


def load_examples(export_dir: Path, max_len: int) -> list[Example]:
    """Examples from an export's Parquet shards, cut to ``max_len`` tokens.

    Examples with no supervised token at position 2 or later (nothing the
    drafter's first step could learn) are dropped; none left raises
    :class:`NoSupervisedTokens`.
    """
    import pyarrow.parquet as pq

    manifest = json.loads((export_dir / "manifest.json").read_text())
    out: list[Example] = []
    seen = 0
    for shard in manifest["shards"]:
        table = pq.read_table(export_dir / shard["file"], columns=["id", "input_ids", "loss_mask"])
        for row_id, ids, mask in zip(table.column("id").to_pylist(),
                                     table.column("input_ids").to_numpy(zero_copy_only=False),
                                     table.column("loss_mask").to_numpy(zero_copy_only=False),
                                     strict=True):
            seen += 1
            ids = np.asarray(ids, dtype=np.int64)[:max_len]
            mask = np.asarray(mask, dtype=np.uint8)[:max_len]
            if mask[2:].any():
                out.append(Example(str(row_id), ids, mask))
    if not out:
        raise NoSupervisedTokens(
            f"no supervised token to train on: none of the {seen} exported examples has a "
            f"loss-mask token at position 2 or later within max_len={max_len} (check the "
            "job's tokenizer and mask settings with `synthq sample`)")
    return out


def split_eval(examples: list[Example], fraction: float, seed: int,
               minimum: int = 50) -> tuple[list[Example], list[Example]]:
    """``(train, held_out)``: a validation split never trained on.

    ``max(ceil(fraction * n), minimum)`` examples, but at most a tenth of the job
    (so a small job still trains on 90 %); none when ``fraction`` is 0. The
    choice depends on the seed and the example ids only, so a resumed run holds
    out the same examples.
    """
    n = len(examples)
    if fraction <= 0 or n < 2:
        return examples, []
    k = min(max(int(np.ceil(fraction * n)), minimum), max(1, n // 10))
    order = sorted(range(n), key=lambda i: examples[i].id)
    random.Random(seed * 1_000_033 + 17).shuffle(order)
    held = set(order[:k])
    return ([ex for i, ex in enumerate(examples) if i not in held],
            [ex for i, ex in enumerate(examples) if i in held])


def draft_vocab(examples: list[Example], size: int, vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent supervised target ids (capped to the target vocabulary).

    Returns ``(draft_ids [V] ascending target ids, d2t [V] int64 offsets,
    t2d [T] bool)`` with V = min(size, T). Ids never supervised fill the rest
    in id order, so V is always exactly what the config says.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ex in examples:
        count_supervised(counts, ex.id, ex.input_ids, ex.loss_mask)
    return draft_vocab_of(counts, size)


def count_supervised(counts: np.ndarray, example_id: str, input_ids: np.ndarray,
                     loss_mask: np.ndarray) -> None:
    """Add one example's supervised target ids to ``counts`` [T]."""
    ids = input_ids[loss_mask.astype(bool)]
    if ids.size and int(ids.max()) >= len(counts):
        raise UserError(f"example {example_id} has token id {int(ids.max())}, beyond the "
                        f"target's vocabulary of {len(counts)}: wrong --target?")
    np.add.at(counts, ids, 1)


def draft_vocab_of(counts: np.ndarray, size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`draft_vocab` from the supervised ids' counts [T]."""
    vocab_size = len(counts)
    size = min(size, vocab_size)
    # Most frequent first; ties (and never seen ids) by smaller id: stable and reproducible.
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]
    draft_ids = torch.from_numpy(np.sort(order)).long()
    d2t = draft_ids - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids, d2t, t2d


def batches(examples: list[Example], batch_size: int, seed: int, epoch: int
            ) -> list[list[int]]:
    """One epoch's batches of example indices: shuffled by (seed, epoch), similar lengths
    together (sorted within windows of 32 batches) so padding stays small."""
    order = list(range(len(examples)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    window = batch_size * 32
    chunks = []
    for start in range(0, len(order), window):
        part = sorted(order[start:start + window], key=lambda i: len(examples[i].input_ids))
        chunks += [part[i:i + batch_size] for i in range(0, len(part), batch_size)]
    random.Random(seed * 7 + epoch).shuffle(chunks)
    return chunks


def collate(examples: list[Example], idx: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """Right-padded ``input_ids [B, L]``, ``loss_mask [B, L]`` and ``valid [B, L]``.

    Right padding needs no attention mask: with causal attention a real
    position never sees the padding after it; padded positions are masked out.
    """
    L = max(len(examples[i].input_ids) for i in idx)
    ids = torch.zeros(len(idx), L, dtype=torch.long)
    mask = torch.zeros(len(idx), L, dtype=torch.bool)
    valid = torch.zeros(len(idx), L, dtype=torch.bool)
    for row, i in enumerate(idx):
        n = len(examples[i].input_ids)
        ids[row, :n] = torch.from_numpy(examples[i].input_ids)
        mask[row, :n] = torch.from_numpy(examples[i].loss_mask.astype(bool))
        valid[row, :n] = True
    return ids, mask, valid


def step_mask(loss_mask: torch.Tensor, k: int) -> torch.Tensor:
    """[B, L] where draft step k at position i is supervised: ``loss_mask[i+2+k]``."""
    out = torch.zeros_like(loss_mask)
    shift = 2 + k
    if loss_mask.shape[1] > shift:
        out[:, :-shift] = loss_mask[:, shift:]
    return out


def supervised(loss_mask: torch.Tensor, valid: torch.Tensor, supervise: str) -> torch.Tensor:
    """[B, L] the tokens the loss learns to predict (``TrainConfig.supervise``):
    ``assistant``: the loss mask (the generated tokens); ``all``: every real (non-padding)
    token, prompt and template included. Either way :func:`step_mask` shifts it, so a
    position is supervised only where its next token exists, and position 0 (no context
    before it) never is."""
    if supervise == "assistant":
        return loss_mask
    if supervise == "all":
        return valid.clone()
    raise ValueError(f"supervise must be assistant or all, got {supervise!r}")


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, L, 3H] the three aux hidden states, concatenated
    last: torch.Tensor  # [B, L, H] the target's last hidden state (after its final norm)
    top: torch.Tensor  # [B, L] the target's argmax over its full vocabulary

    def logits(self, head: torch.Tensor) -> torch.Tensor:
        """[B, L, V] the target's logits on the draft vocabulary, recomputed from its
        ``lm_head`` rows of the draft vocabulary ``head`` [V, H] (as SpecForge does:
        the cache never stores them)."""
        return self.last.to(head.device, head.dtype) @ head.T


def draft_head(target: Any, draft_ids: torch.Tensor) -> torch.Tensor:
    """[V, H] the target's ``lm_head`` rows of the draft vocabulary (a frozen copy)."""
    w = target.get_output_embeddings().weight.detach()
    return w[draft_ids.to(w.device)].clone()


@torch.no_grad()
def target_features(target: Any, input_ids: torch.Tensor) -> TargetFeatures:
    """Run the target once: three hidden states (``output_hidden_states`` indices
    ``[2, N//2, N-3]``), its last hidden state and its greedy token."""
    device = target.get_input_embeddings().weight.device
    out = target(input_ids=input_ids.to(device), output_hidden_states=True, use_cache=False)
    n = target.config.num_hidden_layers
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids(n)], dim=-1)
    return TargetFeatures(aux=aux, last=out.hidden_states[-1], top=out.logits.argmax(-1))


def cache_bytes_per_token(hidden_size: int, itemsize: int) -> int:
    """What the offline cache stores per token: 3 aux states + the last hidden state
    (``itemsize`` bytes each value) and the int64 greedy token: ``4H * itemsize + 8``."""
    return 4 * hidden_size * itemsize + 8


class FeatureCache:
    """Offline mode: one safetensors file per example, ``<dir>/<id>.safetensors``.

    Each file holds ``aux`` [L, 3H], ``last`` [L, H] (the target's dtype: bf16 on
    a GPU) and ``top`` [L] int64: ``(3H + H) * 2 + 8`` bytes a token for a bf16
    target. Each file is written to a temporary name in the same directory and
    renamed (atomic): a killed run leaves whole files or none, and a rerun
    computes only the missing ones.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, example_id: str) -> Path:
        return self.directory / f"{example_id}.safetensors"

    def missing(self, examples: list[Example]) -> list[int]:
        return [i for i, ex in enumerate(examples) if not self.path(ex.id).is_file()]

    def estimate(self, target: Any, examples: list[Example]) -> int:
        """Bytes the missing files will take (tensor data; headers are a few hundred bytes)."""
        itemsize = target.get_input_embeddings().weight.element_size()
        per_token = cache_bytes_per_token(target.config.hidden_size, itemsize)
        return sum(len(examples[i].input_ids) * per_token + 512 for i in self.missing(examples))

    def check_space(self, need: int, reserve: int = 1 << 30) -> int:
        """Raise :class:`UserError` unless ``need`` bytes plus ``reserve`` are free here."""
        import shutil

        free = shutil.disk_usage(self.directory).free
        if need + reserve > free:
            raise UserError(
                f"the offline cache needs {need / 1e9:.2f} GB in {self.directory} but only "
                f"{free / 1e9:.2f} GB is free (keeping {reserve / 1e9:.1f} GB spare): free "
                "disk space, use --hidden-states online, or lower --max-len")
        return free

    def fill(self, target: Any, examples: list[Example], heartbeat: Any = None,
             say: Any = None) -> int:
        """Estimate the size, refuse when the disk is short, then compute and store
        what is missing; returns how many files were written."""
        from safetensors.torch import save_file

        todo = self.missing(examples)
        if todo:
            need = self.estimate(target, examples)
            free = self.check_space(need)
            msg = (f"offline cache: {len(todo)} examples, "
                   f"{sum(len(examples[i].input_ids) for i in todo):,} tokens, about "
                   f"{need / 1e9:.3f} GB in {self.directory} ({free / 1e9:.1f} GB free)")
            (say or log.info)(msg)
        for n, i in enumerate(todo):
            ids = torch.from_numpy(examples[i].input_ids)[None]
            f = target_features(target, ids)
            tensors = {"aux": f.aux[0].cpu().contiguous(), "last": f.last[0].cpu().contiguous(),
                       "top": f.top[0].cpu().contiguous()}
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            os.close(fd)
            try:
                save_file(tensors, tmp)
                os.replace(tmp, self.path(examples[i].id))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            if heartbeat is not None and n % 16 == 0:
                heartbeat()
        return len(todo)

    def read(self, example: Example) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.path(example.id)))

    def load(self, examples: list[Example], idx: list[int], L: int,
             parts: list[dict[str, torch.Tensor]] | None = None) -> TargetFeatures:
        """The cached features of a batch, right-padded to L (``parts``: already read)."""
        parts = parts if parts is not None else [self.read(examples[i]) for i in idx]
        aux = torch.zeros(len(idx), L, parts[0]["aux"].shape[-1], dtype=parts[0]["aux"].dtype)
        last = torch.zeros(len(idx), L, parts[0]["last"].shape[-1], dtype=parts[0]["last"].dtype)
        top = torch.zeros(len(idx), L, dtype=torch.long)
        for row, p in enumerate(parts):
            n = p["aux"].shape[0]
            aux[row, :n], last[row, :n], top[row, :n] = p["aux"], p["last"], p["top"]
        return TargetFeatures(aux=aux, last=last, top=top)


class Prefetcher:
    """Reads the next batches' cache files in a background thread while the GPU trains."""

    def __init__(self, cache: FeatureCache, examples: list[Example],
                 order: list[list[int]], depth: int = 2) -> None:
        self.cache, self.examples = cache, examples
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="synthq-prefetch")
        self.futures: dict[int, Future[list[dict[str, torch.Tensor]]]] = {}
        self.order = order
        self.depth = depth
        for j in range(min(depth, len(order))):
            self._submit(j)

    def _submit(self, j: int) -> None:
        idx = self.order[j]
        self.futures[j] = self.pool.submit(lambda: [self.cache.read(self.examples[i])
                                                    for i in idx])

    def get(self, j: int, L: int) -> TargetFeatures:
        if j + self.depth < len(self.order) and j + self.depth not in self.futures:
            self._submit(j + self.depth)
        fut = self.futures.pop(j, None)
        parts = fut.result() if fut is not None else None
        return self.cache.load(self.examples, self.order[j], L, parts)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
