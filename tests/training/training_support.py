"""Helpers for the training tests (importable from test modules, unlike conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from synthq.db import session_scope
from synthq.models import Job, TrainingRun

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


def greedy_examples(target: Any, n: int, *, new_tokens: int = 40, seed: int = 0
                    ) -> list[tuple[list[int], list[int]]]:
    """``n`` (input_ids, loss_mask): a counting-language prompt of 4 to 8 tokens, then
    the target's greedy answer (supervised)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        plen = int(torch.randint(4, 9, (1,), generator=gen))
        prompt = counting_batch(gen, 1, plen)
        with torch.no_grad():
            seq = target.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)
        ids = seq[0].tolist()
        out.append((ids, [0] * plen + [1] * (len(ids) - plen)))
    return out


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
