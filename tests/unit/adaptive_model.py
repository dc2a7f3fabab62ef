"""A small model of one server and the embedded loop, to run the adaptive controller
(synthq.adaptive.decide) in closed loop in milliseconds.

Each call is modelled on its own, as the project's simulator (synthq.testing.simulator)
serves it: **slots** (at most N calls run, the rest wait in a FIFO queue; a call takes
``latency`` then ``tokens`` at ``rate`` tokens/s) or **knee** (every call runs; each
stream gets ``rate`` tokens/s up to ``knee`` streams, past it the total falls as
``knee × rate × (knee / n) ** falloff``). The dispatcher keeps queued + running at the
limit (a lowered limit drains as calls end); once a tick the controller gets the window
that ``synthq.adaptive._window`` would build from the ``attempts`` rows: calls that
ended in the last 2 s, latency figures from those that started after the last change.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from synthq.adaptive import TICK_SECONDS, CallRow, Window, decide, start_limit, summarize

DT = 0.02


@dataclass
class Call:
    start: float
    slot: float | None = None  # when it got a slot (slots) / started running
    first: float | None = None  # first token
    end: float | None = None
    left: float = 0.0  # tokens still to generate


@dataclass
class Run:
    limits: list[tuple[float, int]] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    max_seen: int = 0
    reasons: list[str] = field(default_factory=list)

    def seconds_for(self, n: int) -> float:
        return self.done_at[n - 1] if len(self.done_at) >= n else float("inf")


def simulate(kind: str, size: int, *, falloff: float = 1.0, samples: int = 400,
             fixed: int | None = None, floor: int = 4, cap: int = 256, latency: float = 0.2,
             rate: float = 10.0, tokens: int = 16, seconds: float = 120.0,
             tick_every: float = TICK_SECONDS, jitter: float = 0.0, seed: int = 0) -> Run:
    """Run ``samples`` calls through a ``kind`` ("slots" / "knee") server of ``size``,
    at a fixed limit or (``fixed=None``) the adaptive one."""
    run = Run()
    limit = fixed if fixed is not None else start_limit(floor, cap)
    state: dict[str, Any] | None = None
    calls: list[Call] = []
    active: list[Call] = []
    waiting: list[Call] = []
    sent = 0
    t = 0.0
    rng = random.Random(seed)
    next_tick = tick_every * 0.5
    while len(run.done_at) < samples and t < seconds:
        # The dispatcher refills up to the limit.
        while len(active) < limit and sent < samples:
            c = Call(start=t, left=float(tokens))
            calls.append(c)
            active.append(c)
            waiting.append(c)
            sent += 1
        run.max_seen = max(run.max_seen, len(active))
        # The server admits calls.
        if kind == "slots":
            while waiting and sum(1 for c in active if c.slot is not None and c.end is None) < size:
                waiting.pop(0).slot = t
        else:
            for c in waiting:
                c.slot = t
            waiting.clear()
        running = [c for c in active if c.slot is not None]
        n = len(running)
        per = rate
        if kind == "knee" and n > size:
            per = size * rate * (size / n) ** falloff / n
        for c in running:
            assert c.slot is not None
            if t - c.slot < latency:
                continue
            if c.first is None:
                c.first = t
            c.left -= per * DT
            if c.left <= 0:
                c.end = t
        for c in [c for c in active if c.end is not None]:
            active.remove(c)
            run.done_at.append(t)
        if fixed is None and t >= next_tick:
            # The loop ticks about once a second, later when the machine is busy.
            next_tick += tick_every + rng.uniform(0.0, jitter)
            since = float((state or {}).get("changed_at", 0.0))
            w = window(calls, t, limit, len(active), since)
            d = decide(w, state, floor=floor, cap=cap)
            state, limit = d.state, d.limit
            if d.reason:
                run.reasons.append(f"{t:.1f}: {d.reason}")
            run.limits.append((round(t, 1), limit))
        t += DT
    return run


def window(calls: list[Call], now: float, limit: int, inflight: int, since: float) -> Window:
    """What ``synthq.adaptive._window`` reads from these calls' ``attempts`` rows."""
    rows: list[CallRow] = [(c.start, c.end, "ok", c.end - c.start,
                            (c.first or c.end) - c.start, 16)
                           for c in calls if c.end is not None]
    return summarize(rows, now=now, limit=limit, inflight=inflight, since=since)
