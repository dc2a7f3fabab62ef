"""A run's data: the job's examples (through synthq.export), the draft vocabulary,
batches, and the target's features computed online or cached per sample.

The one-position shift: the target's logits at position j predict token j+1,
so they are supervised where ``loss_mask[j+1]`` is 1 (token j+1 is a token the
model generated). Draft step k at position i learns the target's distribution
at j = i+1+k, so its mask is ``loss_mask[i+2+k]`` (:func:`step_mask`).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from synthq.errors import UserError
from synthq.training.model import aux_layer_ids

__all__ = ["Example", "load_examples", "draft_vocab", "batches", "collate", "TargetFeatures",
           "target_features", "FeatureCache", "step_mask", "NoSupervisedTokens"]


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


def draft_vocab(examples: list[Example], size: int, vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent supervised target ids (capped to the target vocabulary).

    Returns ``(draft_ids [V] ascending target ids, d2t [V] int64 offsets,
    t2d [T] bool)`` with V = min(size, T). Ids never supervised fill the rest
    in id order, so V is always exactly what the config says.
    """
    size = min(size, vocab_size)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ex in examples:
        ids = ex.input_ids[ex.loss_mask.astype(bool)]
        if ids.size and int(ids.max()) >= vocab_size:
            raise UserError(f"example {ex.id} has token id {int(ids.max())}, beyond the "
                            f"target's vocabulary of {vocab_size}: wrong --target?")
        np.add.at(counts, ids, 1)
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


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, L, 3H] the three aux hidden states, concatenated
    logits: torch.Tensor  # [B, L, V] the target's logits on the draft vocabulary
    top: torch.Tensor  # [B, L] the target's argmax over its full vocabulary (for accuracy)


@torch.no_grad()
def target_features(target: Any, input_ids: torch.Tensor, draft_ids: torch.Tensor
                    ) -> TargetFeatures:
    """Run the target once: three hidden states (``output_hidden_states`` indices
    ``[2, N//2, N-3]``) and its logits, restricted to the draft vocabulary."""
    device = target.get_input_embeddings().weight.device
    out = target(input_ids=input_ids.to(device), output_hidden_states=True, use_cache=False)
    n = target.config.num_hidden_layers
    aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids(n)], dim=-1)
    logits = out.logits
    return TargetFeatures(aux=aux, logits=logits[..., draft_ids.to(logits.device)],
                          top=logits.argmax(-1))


class FeatureCache:
    """Offline mode: one safetensors file per example, ``<dir>/<id>.safetensors``.

    Each file is written to a temporary name in the same directory and renamed
    (atomic): a killed run leaves whole files or none, and a rerun computes
    only the missing ones. The cache belongs to one run (its draft vocabulary).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, example_id: str) -> Path:
        return self.directory / f"{example_id}.safetensors"

    def missing(self, examples: list[Example]) -> list[int]:
        return [i for i, ex in enumerate(examples) if not self.path(ex.id).is_file()]

    def fill(self, target: Any, examples: list[Example], draft_ids: torch.Tensor,
             heartbeat: Any = None) -> int:
        """Compute and store what is missing; returns how many files were written."""
        from safetensors.torch import save_file

        todo = self.missing(examples)
        for n, i in enumerate(todo):
            ids = torch.from_numpy(examples[i].input_ids)[None]
            f = target_features(target, ids, draft_ids)
            tensors = {"aux": f.aux[0].cpu().contiguous(), "logits": f.logits[0].cpu().contiguous(),
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

    def load(self, examples: list[Example], idx: list[int], L: int) -> TargetFeatures:
        """The cached features of a batch, right-padded to L."""
        from safetensors.torch import load_file

        parts = [load_file(str(self.path(examples[i].id))) for i in idx]
        aux = torch.zeros(len(idx), L, parts[0]["aux"].shape[-1], dtype=parts[0]["aux"].dtype)
        logits = torch.zeros(len(idx), L, parts[0]["logits"].shape[-1],
                             dtype=parts[0]["logits"].dtype)
        top = torch.zeros(len(idx), L, dtype=torch.long)
        for row, p in enumerate(parts):
            n = p["aux"].shape[0]
            aux[row, :n], logits[row, :n], top[row, :n] = p["aux"], p["logits"], p["top"]
        return TargetFeatures(aux=aux, logits=logits, top=top)

