"""Backoff for retryable failures: exponential with full jitter, capped.

A retry waits in SQL (``next_attempt_at``), never in the broker.
"""

from __future__ import annotations

import random

__all__ = ["exponential", "backoff_delay"]


def exponential(attempt: int, *, base: float, cap: float) -> float:
    """``min(cap, base * 2**(attempt-1))``: the longest wait after ``attempt`` failures
    (>= 1), the one backoff curve of the package."""
    return float(min(cap, base * 2 ** max(0, attempt - 1)))


def backoff_delay(attempt: int, *, base: float, cap: float, retry_after: float | None = None,
                  rng: random.Random | None = None) -> float:
    """Seconds to wait before attempt ``attempt + 1``, after ``attempt`` failures (>= 1).

    Full jitter: uniform in ``[0, min(cap, base * 2**(attempt-1))]``, which
    spreads a burst of failures instead of retrying them in lockstep. A
    server's ``Retry-After`` is a floor: we never come back earlier than asked.
    """
    ceiling = exponential(attempt, base=base, cap=cap)
    delay = (rng or random).uniform(0.0, ceiling)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay
