"""Helpers for the training tests (importable from test modules, unlike conftest)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 96


def greedy_examples(target: Any, n: int, *, new_tokens: int = 40, seed: int = 0
                    ) -> list[tuple[list[int], list[int]]]:
    """``n`` (input_ids, loss_mask): a random prompt, then the target's greedy answer
    (supervised)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        plen = int(torch.randint(4, 9, (1,), generator=gen))
        prompt = torch.randint(3, VOCAB, (1, plen), generator=gen)
        with torch.no_grad():
            seq = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        ids = seq[0].tolist()
        out.append((ids, [0] * plen + [1] * (len(ids) - plen)))
    return out
