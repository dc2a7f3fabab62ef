"""A small model of one server and the embedded loop, to run the adaptive controller
(synthq.serving.controller.decide) in closed loop in milliseconds.

Each call is modelled on its own, as the project's simulator (synthq.testing.simulator)
serves it: **slots** (at most N calls run, the rest wait in a FIFO queue; a call takes
``latency`` then ``tokens`` at ``rate`` tokens/s) or **knee** (every call runs; each
stream gets ``rate`` tokens/s up to ``knee`` streams, past it the total falls as
``knee × rate × (knee / n) ** falloff``). The dispatcher keeps queued + running at the
limit (a lowered limit drains as calls end); once a tick the controller gets the window
that ``synthq.serving.adaptive._window`` would build from the ``attempts`` rows: calls that
ended in the last 2 s, latency figures from those that started after the last change.

Faults, as the chaos runs made them (:class:`Event`): a **slowdown** (every stream and
the time to first token ``factor``× slower), a **death** (the calls in flight break
mid-answer, ``server_error``; new ones are refused, ``connection``), a **503** storm
(every call answered 503 at once); and ``error_rate``, a share of calls answered 500 at
random. The dispatcher's own reactions are modelled too: a server whose last three calls
failed that way is "down" and gets one call every 2 s until one succeeds
(``synthq.queue.dispatch.server_is_down``), and a dead server's failed health probe (every
5 s) stops all sending until a probe passes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from synthq.queue.limits import start_limit
from synthq.serving.adaptive import TICK_SECONDS
from synthq.serving.controller import CallRow, Window, decide, summarize

DT = 0.02


@dataclass
class Call:
    start: float
    slot: float | None = None  # when it got a slot (slots) / started running
    first: float | None = None  # first token
    end: float | None = None
    left: float = 0.0  # tokens still to generate
    outcome: str = "ok"
    tokens: int = 16


@dataclass(frozen=True)
class Event:
    """A fault from ``start`` to ``end`` (s): "slow" (``factor``× slower), "dead" (killed),
    "hung" (stopped: nothing moves, the health probe times out), "503", "shrink" (the
    server's size × ``factor``: another tenant took the rest)."""

    kind: str
    start: float
    end: float
    factor: float = 5.0

    def on(self, t: float) -> bool:
        return self.start <= t < self.end


#: Outcomes that make a server "down" (synthq.queue.dispatch.says_down; the 5xx are HTTP 5xx).
DOWN = ("connection", "server_error", "timeout", "stalled")
PROBE_INTERVAL = 2.0
HEALTH_EVERY = 5.0


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
             tick_every: float = TICK_SECONDS, jitter: float = 0.0, seed: int = 0,
             events: Sequence[Event] = (), error_rate: float = 0.0, spread: float = 0.0
             ) -> Run:
    """Run ``samples`` calls through a ``kind`` ("slots" / "knee") server of ``size``,
    at a fixed limit or (``fixed=None``) the adaptive one, through ``events``; each
    answer is ``tokens`` long, give or take ``spread`` (a share, at random)."""
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
    ended: list[Call] = []  # in the order they ended
    healthy = True
    next_health = 0.0
    was_dead = False
    while len(run.done_at) < samples and t < seconds:
        now = [e for e in events if e.on(t)]
        dead = any(e.kind == "dead" for e in now)
        hung = any(e.kind == "hung" for e in now)
        refusing = any(e.kind == "503" for e in now)
        slow = max([e.factor for e in now if e.kind == "slow"], default=1.0)
        room_of = max(1, round(size * min([e.factor for e in now if e.kind == "shrink"],
                                          default=1.0)))
        if dead and not was_dead:  # the calls in flight break off mid-answer
            for c in active:
                c.end, c.outcome = t, "server_error"
            waiting.clear()
        was_dead = dead
        if t >= next_health:  # the health probe: a dead server's /health fails
            healthy, next_health = not (dead or hung), next_health + HEALTH_EVERY
        # The dispatcher refills up to the limit (a down server: one call every 2 s).
        down = len(ended) >= 3 and all(c.outcome in DOWN for c in ended[-3:])
        room = 0 if not healthy else limit if not down else \
            (1 if not active and t - (ended[-1].end or 0.0) >= PROBE_INTERVAL else 0)
        while len(active) < room and sent < samples:
            size_of = tokens * (1 + spread * rng.uniform(-1, 1)) if spread else tokens
            c = Call(start=t, left=float(size_of), tokens=max(1, round(size_of)))
            calls.append(c)
            sent += 1
            if dead or refusing or (error_rate and rng.random() < error_rate):
                c.end, c.outcome = t + 0.01, "connection" if dead else "server_error"
                sent -= 1  # the sample is retried later
            else:
                waiting.append(c)
            active.append(c)
        run.max_seen = max(run.max_seen, len(active))
        # The server admits calls (a stopped one does nothing at all).
        if hung:
            pass
        elif kind == "slots":
            while waiting and sum(1 for c in active if c.slot is not None and c.end is None) \
                    < room_of:
                waiting.pop(0).slot = t
        else:
            for c in waiting:
                c.slot = t
            waiting.clear()
        running = [] if hung else [c for c in active if c.slot is not None and c.outcome == "ok"]
        n = len(running)
        per = rate
        if kind == "knee" and n > room_of:
            per = room_of * rate * (room_of / n) ** falloff / n
        per /= slow
        for c in running:
            assert c.slot is not None
            if t - c.slot < latency * slow:
                continue
            if c.first is None:
                c.first = t
            c.left -= per * DT
            if c.left <= 0:
                c.end = t
        for c in [c for c in active if c.end is not None and c.end <= t + 1e-9]:
            active.remove(c)
            ended.append(c)
            if c.outcome == "ok":
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
    """What ``synthq.serving.adaptive._window`` reads from these calls' ``attempts`` rows."""
    rows: list[CallRow] = [
        (c.start, c.end, "ok", c.end - c.start, (c.first or c.end) - c.start, c.tokens)
        if c.outcome == "ok" else (c.start, c.end, c.outcome, c.end - c.start, None, None)
        for c in calls if c.end is not None and c.end <= now]
    return summarize(rows, now=now, limit=limit, inflight=inflight, since=since)
