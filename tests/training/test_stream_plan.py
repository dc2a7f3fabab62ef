"""``--features stream``'s order (synthq.training.stream.plan_steps): each step's batch is the
one the loop trains, the ranks' shares of it are disjoint and cover it, every example is in
each epoch once, and a batch that cannot give every rank its own example is refused."""

from __future__ import annotations

import numpy as np
import pytest

from synthq.core.errors import UserError
from synthq.training.data import Example, batches
from synthq.training.stream import plan_steps


def _examples(n: int) -> list[Example]:
    return [Example(str(i), np.arange(3 + i % 5, dtype=np.int64), np.ones(3 + i % 5, np.uint8))
            for i in range(n)]


def test_ranks_take_disjoint_shares_of_each_batch_and_each_example_once_an_epoch() -> None:
    examples = _examples(12)
    steps = plan_steps(examples, 2, 2, seed=3, total=9)  # 3 steps an epoch, 3 epochs
    assert [epoch for epoch, _ in steps] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for epoch in range(3):
        order = batches(examples, 4, 3, epoch)
        shares = [s for e, s in steps if e == epoch]
        seen: list[int] = []
        for b, (zero, one) in zip(order, shares, strict=True):
            assert zero == b[0::2] and one == b[1::2]  # the loop's b[rank::world]
            assert not set(zero) & set(one)
            seen += zero + one
        assert sorted(seen) == list(range(12))


def test_a_batch_smaller_than_the_ranks_is_refused() -> None:
    with pytest.raises(UserError, match="cannot give each of 2 ranks its own"):
        plan_steps(_examples(5), 1, 2, seed=0, total=3)
