"""The adaptive in-flight limit's controller (``--inflight auto``): pure functions, no I/O.

:func:`summarize` makes a :class:`Window` of a server's recent calls; :func:`decide` turns
that window and the controller's memory into the new limit and the reason.
:mod:`synthq.serving.adaptive` reads the calls and the gauges and writes the limit, once
a tick.

The algorithm is a latency gradient (Netflix's Gradient / Vegas family) with
a slow start and multiplicative cuts on errors. It judges a limit only by the
calls that started after it was set ("fresh" calls; until the first change, all):
bad news on the first of them to end (half as many as the last raise added),
good news in slow start only on a whole turnover (as many as the limit), since
on a server with slots the first calls to end are those that found a free slot,
the last those that waited for one. The low-load baseline comes from the calls
that did not wait (a time to first token near the lowest):

* **slow start**: from 16 (within floor and cap), ×1.5 per step while the
  latency per generated token stays at its low-load baseline, the time to
  first token does not rise, and the limit is in use;
* **gradient**: ``new = limit × baseline / current + ¼√limit``. Past a
  server's knee, each stream gets slower (or waits in the server's queue) and
  the latency per token rises in proportion: the limit settles a little
  above the knee;
* **hill-climb**: each raise in steady state is judged by what the limit
  yields at full use (Little's law over its own calls: limit ÷ seconds per
  token); a raise that did not pay at least a quarter of its proportional
  gain is undone and barred for 30 s, so on a server whose throughput falls
  past its peak the limit settles at the peak, not above;
* **cuts**: 429 calls and 5xx that are not isolated (×0.7: at least two 5xx and
  a fifth of the window's calls; one 500 among successes is a server's bug, not
  congestion), timeouts and stalls (×0.5), a time to first token of 3× its
  baseline and over a second (×0.75), a KV cache over 97 % (×0.9); then three
  ticks without another cut or growth;
* **recovery**: a limit whose own calls ran well (no error, latency per token
  within 1.25× the baseline) is remembered as the last good one. A decrease to
  under 0.8× it starts a recovery: once the cause has passed (the calls at the
  new limit run at baseline, without congestion), the limit doubles per step
  (judged on half a turnover) back to the last good limit, then steady state
  goes on. A recovery step whose own calls bring the trouble back (a cut, or
  latency off the baseline) shows the limit was the cause: the memory is
  dropped, and the gradient goes on from there. (It climbed back by +1 a step
  after a cut: after a 20 s outage, 14 of a knee of 24 a minute later.)
* **holds**: vLLM reports requests waiting, or the limit is not in use: too
  little work to tell whether more would help, or the calls did not really run
  at that level (Little's law over the window: the ok calls' summed latency ÷
  the window is under 70 % of the limit).

It never goes above the cap (``--max-inflight``) nor below the floor
(``--min-inflight``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from synthq.core.errors import FailureClass, Load

__all__ = ["Window", "Decision", "decide", "CallRow", "summarize", "WINDOW_SECONDS"]

#: Calls that ended this many seconds back make a window.
WINDOW_SECONDS = 2.0
#: Growth per tick in slow start, and the cuts.
SLOW_START = 1.5
CUT_ERRORS = 0.7
CUT_TIMEOUTS = 0.5
CUT_TTFT = 0.75
CUT_KV = 0.9
#: Seconds a raise that did not pay stays barred.
CEILING_SECONDS = 30.0
#: Ticks without growth after a cut (calls started before it still report).
COOLDOWN = 3
#: The gradient's allowance for queueing: QUEUE × √limit calls above the no-queue level.
QUEUE = 0.25
#: Outcomes that mean "too much load" and cut sharply, and those that cut
#: (each class's :attr:`FailureClass.load <synthq.core.errors.FailureClass.load>`).
OVERLOAD = frozenset(c for c in FailureClass if c.load is Load.OVERLOAD)
TIMEOUTS = frozenset(c for c in FailureClass if c.load is Load.TIMEOUT)
#: 5xx answers are congestion only when they are not isolated: at least two, and this
#: share of the calls of the window (those that ended in it, and those still out: an
#: error comes back before the answers started with it). A server that fails one call
#: in twenty at random is not overloaded (429s always are: the server says so).
ERROR_SHARE = 0.2
#: A limit is "good" when its own calls ran without error at a latency per token within
#: this ratio of the baseline; the last good one is remembered this long.
GOOD_RATIO = 1.25
GOOD_MEMORY = 300.0
#: A decrease to under this share of the last good limit starts a recovery: once the
#: cause has passed (calls at baseline, no error), the limit grows ×RECOVER per step
#: (judged on half a turnover) back to the last good limit, then steady state goes on.
RECOVER_BELOW = 0.8
RECOVER = 2.0


@dataclass(frozen=True, slots=True)
class Window:
    """What one server did over the last window, and its state now.

    Latency figures come from the calls that *started* after the limit last
    changed (``fresh``): they measure the current limit, not an older one.
    """

    #: The limit the dispatcher fills up to now, and samples queued + running on the server.
    limit: int
    inflight: int
    #: Calls that ended ok in the window, and their completion tokens (the throughput).
    ok: int = 0
    tokens: int = 0
    #: Of those, the calls that started after the limit last changed.
    fresh: int = 0
    #: Their mean time to first token and time per output token (None: unknown).
    ttft_s: float | None = None
    tpot_s: float | None = None
    #: Their seconds of call per generated token (sum of latencies / sum of tokens);
    #: the mean latency per call when the server reports no token counts.
    latency_per_token: float | None = None
    #: The same over those of them that did not wait in the server's queue (a time to
    #: first token near the lowest): the low-load figure, even while others queue.
    unqueued_lpt: float | None = None
    #: 429 / 5xx calls, and timeouts + stalls, in the window.
    overload: int = 0
    timeouts: int = 0
    #: Of ``overload``, the 5xx answers (the rest are 429s).
    server_errors: int = 0
    #: vLLM's gauges (None: the server does not serve them).
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    seconds: float = WINDOW_SECONDS
    #: Unix time of the tick.
    now: float = 0.0
    #: Calls the server actually held on average over the window (Little's law: the
    #: ok calls' summed latency ÷ the window); None: unknown.
    concurrency: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def done_per_s(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Decision:
    limit: int
    #: Why it changed ("48 ↓ ttft 4.1 s = 3× baseline"); None when it did not.
    reason: str | None
    #: The controller's memory for the next tick (JSON-ready).
    state: dict[str, Any] = field(default_factory=dict)


def _fmt_s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 0.1 else f"{seconds * 1000:.0f} ms"


def _drift(old: Any, new: float) -> float:
    # The lowest seen, drifting up slowly (0.2 % a tick) so that a server that got
    # slower for good (longer prompts, another tenant) is not chased forever.
    return new if old is None else min(float(old) * 1.002, new)


def _congested(w: Window) -> bool:
    """Whether the window's 429/5xx say the server is overloaded (see ERROR_SHARE)."""
    if w.overload > w.server_errors:  # a 429: the server says so
        return True
    calls = w.ok + w.overload + w.timeouts + w.inflight
    return w.server_errors >= 2 and w.server_errors >= ERROR_SHARE * calls


def _good(st: dict[str, Any], now: float) -> int | None:
    """The last good limit remembered (None: none, or too old)."""
    good = st.get("good")
    if not good or now - float(good[1]) > GOOD_MEMORY:
        return None
    return int(good[0])


def decide(w: Window, state: dict[str, Any] | None, *, floor: int, cap: int) -> Decision:
    """The new limit for one server from one window: a pure function.

    ``state`` is what the previous call returned (None the first time); its
    ``changed_at`` (unix time of the last change) tells :func:`synthq.serving.adaptive.tick`
    which calls
    are fresh.
    """
    st: dict[str, Any] = dict(state or {})
    st.setdefault("phase", "start")
    # Until the first change every call counts: the first calls were sent at the start limit.
    st.setdefault("changed_at", 0.0)
    st["ticks"] = int(st.get("ticks", 0)) + 1
    cooldown = int(st.get("cooldown", 0))
    st["cooldown"] = max(0, cooldown - 1)
    limit = max(floor, min(cap, w.limit))

    def out(new: float, why: str) -> Decision:
        value = max(floor, min(cap, int(round(new))))
        if value == w.limit:
            return Decision(value, None, st)
        good = _good(st, w.now)
        if value < w.limit and good is not None and value < RECOVER_BELOW * good:
            # Far under the last good limit: climb back fast once the cause has passed
            # (a raise the hill-climb was judging is not judged against what came after).
            st["phase"] = "recover"
            st.pop("probe", None)
        st["changed_at"] = w.now
        # A raise is judged once as many fresh calls ended as it added (plus one): the
        # first to end are those that found a free slot, not those that waited for one.
        st["added"] = max(0, value - w.limit)
        arrow = "↑" if value > w.limit else "↓"
        return Decision(value, f"{value} {arrow} {why}", st)

    # -- sharp cuts: the server says it is overloaded -----------------------------------------
    congested = _congested(w)
    if (w.timeouts or congested) and not cooldown:
        _cut(st)
        if w.timeouts:
            return out(limit * CUT_TIMEOUTS, f"{w.timeouts} timed out or stalled")
        return out(limit * CUT_ERRORS, f"{w.overload}× 429/5xx")
    if w.kv_usage is not None and w.kv_usage >= 0.97 and not cooldown:
        _cut(st)
        return out(limit * CUT_KV, f"kv cache {w.kv_usage * 100:.0f} %")
    waiting = w.waiting is not None and w.waiting > 0
    if waiting and st["phase"] == "start":
        st["phase"] = "steady"  # the server queues: no more doubling

    # -- wait for calls that started at this limit to tell how it does -------------------------
    # Bad news is judged on the first calls that started after the change (half as many
    # as it added); good news in slow start only on a whole turnover (as many calls as
    # the limit): on a server with slots, the first calls to end are those that found a
    # free one, the last those that waited.
    lpt = w.latency_per_token
    if lpt is None or w.fresh < max(2, int(st.get("added", 0)) // 2):
        return out(limit, "")
    turnover = w.fresh >= limit
    base = st["base_lpt"] = _drift(st.get("base_lpt"), w.unqueued_lpt or lpt)
    if w.ttft_s is not None:
        st["base_ttft"] = _drift(st.get("base_ttft"), w.ttft_s)
    if w.tpot_s is not None:
        st["base_tpot"] = _drift(st.get("base_tpot"), w.tpot_s)
    ratio = lpt / base if base > 0 else 1.0
    gradient = max(0.5, min(1.0, 1.0 / ratio))
    # In use: the dispatcher filled the limit, and the calls really ran at that level
    # (samples queued on our side, not yet calling, do not load the server).
    in_use = w.inflight >= 0.7 * limit and (w.concurrency is None
                                            or w.concurrency >= 0.7 * limit)
    base_ttft = st.get("base_ttft")
    ttft_ratio = w.ttft_s / base_ttft if w.ttft_s is not None and base_ttft else 1.0

    # -- time to first token blow-up: requests wait in the server's queue ------------------
    if (w.ttft_s is not None and base_ttft and ttft_ratio >= 3
            and w.ttft_s - base_ttft >= 1.0 and not cooldown):
        _cut(st)
        return out(limit * CUT_TTFT, f"ttft {_fmt_s(w.ttft_s)} = {ttft_ratio:.0f}× baseline")
    # Requests starting to wait in the server show in the time to first token first.
    queueing = base_ttft is not None and w.ttft_s is not None and \
        ttft_ratio >= 1.3 and w.ttft_s - base_ttft >= 0.15
    at_baseline = gradient >= 0.9 and not queueing
    clean = not congested and not w.timeouts and ratio <= GOOD_RATIO and in_use
    good = _good(st, w.now)
    if clean and st["phase"] != "recover" and (good is None or limit >= good or
                                               limit >= RECOVER_BELOW * good):
        st["good"] = [limit, w.now]  # the last limit that ran well at its own calls

    def why_latency() -> str:
        bp = st.get("base_tpot")
        if w.ttft_s is not None and base_ttft and ttft_ratio > 1.2 and \
                (w.ttft_s - base_ttft) / max(lpt, 1e-9) > 1:
            return f"ttft {_fmt_s(w.ttft_s)} = {ttft_ratio:.1f}× baseline"
        if w.tpot_s is not None and bp and w.tpot_s / bp > 1.2:
            return f"time per token {_fmt_s(w.tpot_s)} = {w.tpot_s / bp:.1f}× baseline"
        return f"latency per token {ratio:.2f}× baseline"

    # -- recovery: back to the last good limit once the cause of a cut has passed -------------
    if st["phase"] == "recover":
        if st.pop("recovering", False) and not at_baseline:
            # The limit the recovery itself raised to did not run well: it was the limit,
            # not a passing cause. Forget the memory; the gradient goes on from here.
            st.pop("good", None)
            st["phase"] = "steady"
        elif good is None or limit >= good:
            st["phase"] = "steady"
        elif at_baseline and not (cooldown or waiting or congested or w.timeouts):
            if not in_use or w.fresh < max(2, limit // 2):
                return out(limit, "")
            st["recovering"] = True
            return out(min(good, max(limit + 1, limit * RECOVER)),
                       f"recovering to {good} (latency at baseline, {ratio:.2f}×)")

    # -- slow start: grow fast while nothing degrades ------------------------------------------
    if st["phase"] == "start":
        if at_baseline:
            if not in_use or not turnover:
                return out(limit, "")
            # Only a limit judged on a whole turnover grows (by SLOW_START at most): calls
            # that had not all run at it yet cannot push it higher.
            return out(max(limit + 1, limit * SLOW_START),
                       f"latency at baseline ({ratio:.2f}×), {w.tokens_per_s:.0f} tok/s")
        st["phase"] = "steady"

    # -- steady: the gradient, and a hill-climb on throughput --------------------------------
    # What the limit yields at full use, by Little's law over its own calls: limit ÷ seconds
    # per token (a mean over a turnover, steadier than the tokens that ended in a window).
    yield_now = limit / lpt
    probe = st.pop("probe", None)
    if probe and limit > probe[0]:
        # The last step was a raise from probe[0]: keep it only if it paid, by at least a
        # quarter of what it would below the knee (past the peak, more calls yield less).
        step = (limit - probe[0]) / probe[0]
        if yield_now < probe[1] * (1 + 0.25 * step):
            st["ceiling"] = [limit, w.now]
            return out(probe[0], f"no gain at {limit} ({yield_now:.0f} vs "
                                 f"{probe[1]:.0f} tok/s at {probe[0]})")
    ceiling = st.get("ceiling")
    if ceiling and w.now - ceiling[1] > CEILING_SECONDS:
        st.pop("ceiling")  # try again now and then: the server or the prompts may have changed
        ceiling = None
    queue = max(1.0, QUEUE * math.sqrt(limit))
    target = limit * gradient + queue
    if target > limit and (waiting or not in_use or cooldown or w.fresh < limit // 2):
        target = limit  # requests wait in the server / the limit is not used / just cut
    if ceiling and target > limit:
        target = max(limit, min(target, ceiling[0] - 1))
    new = math.floor(target) if target > limit else math.ceil(target)
    if new > limit:
        st["probe"] = [limit, yield_now]
        return out(new, f"latency per token {ratio:.2f}× baseline, {w.tokens_per_s:.0f} tok/s")
    if new < limit:
        return out(new, why_latency())
    return out(limit, "")


def _cut(st: dict[str, Any]) -> None:
    """The state of a sharp cut: no growth for COOLDOWN ticks, no slow start any more."""
    if st.pop("recovering", False):
        # The trouble came back at the limit a recovery step raised to, before its calls
        # were judged: that limit is the cause, not a good one to climb back to.
        st.pop("good", None)
        st["phase"] = "steady"
    st["cooldown"] = COOLDOWN
    if st.get("phase") != "recover":
        st["phase"] = "steady"



#: One call as the controller reads it: (started, ended, outcome, latency_s, ttft_s,
#: completion tokens), times in unix seconds.
CallRow = tuple[float, float | None, str | None, float | None, float | None, int | None]


def summarize(rows: Sequence[CallRow], *, now: float, limit: int, inflight: int, since: float,
              seconds: float = WINDOW_SECONDS) -> Window:
    """The :class:`Window` of a server's calls (any order).

    Counts (calls, tokens, errors, the concurrency) cover the calls that ended in the
    last ``seconds``. Latency figures cover the ``limit`` calls that started at or after
    ``since`` (the last change) and ended last, however long ago: one turnover of the
    limit, so a call longer than the window is judged too.
    """
    cutoff = now - seconds
    ok = tokens = overload = timeouts = fresh = server_errors = 0
    busy = 0.0
    judged: list[CallRow] = []
    for row in sorted((r for r in rows if r[1] is not None), key=lambda r: -(r[1] or 0.0)):
        started, ended, outcome, lat, _, ntok = row
        assert ended is not None
        if ended >= cutoff:
            if outcome in OVERLOAD:
                overload += 1
                server_errors += outcome == FailureClass.SERVER_ERROR
            elif outcome in TIMEOUTS:
                timeouts += 1
            elif outcome == "ok":
                ok += 1
                tokens += ntok or 0
                busy += lat or 0.0
        # A call ran at the current limit if three quarters of it came after the change
        # (a slot refilled just before a raise runs alongside the calls the raise adds).
        if outcome == "ok" and lat is not None and started + 0.25 * lat >= since \
                and len(judged) < limit:
            judged.append(row)
    fresh = len(judged)
    ttfts = [r[4] for r in judged if r[4] is not None]
    tpots = [max(0.0, (r[3] or 0.0) - r[4]) / (r[5] - 1)
             for r in judged if r[4] is not None and r[5] and r[5] > 1]

    def per_token(calls: list[CallRow]) -> float | None:
        known = [r for r in calls if r[5]]
        if known:
            return sum(r[3] or 0.0 for r in known) / sum(r[5] or 0 for r in known)
        return sum(r[3] or 0.0 for r in calls) / len(calls) if calls else None

    # The calls that did not wait in the server's queue (a time to first token near the
    # lowest): what the latency per token is at low load, even while others queue.
    prompt = [r for r in judged if r[4] is not None]
    unqueued = None
    if prompt:
        low = min(r[4] or 0.0 for r in prompt)
        unqueued = per_token([r for r in prompt if (r[4] or 0.0) <= low * 1.5 + 0.05])
    return Window(limit=limit, inflight=inflight, ok=ok, tokens=tokens, fresh=fresh,
                  ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
                  tpot_s=sum(tpots) / len(tpots) if tpots else None,
                  latency_per_token=per_token(judged), unqueued_lpt=unqueued,
                  overload=overload, timeouts=timeouts, server_errors=server_errors,
                  seconds=seconds, now=now,
                  concurrency=busy / _span(rows, now, seconds) if ok else None)


def _span(rows: Sequence[CallRow], now: float, seconds: float) -> float:
    """The seconds of the window the server had calls in: the window, or less when its
    first call started inside it (at the start, the first wave's calls ended in a 2 s
    window that they had filled only 1.4 s of: Little's law over 2 s read them as
    11 of 16 calls, "not in use", and the limit did not grow)."""
    first = min((r[0] for r in rows), default=now - seconds)
    return max(1e-3, min(seconds, now - first))
