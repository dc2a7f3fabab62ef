"""The adaptive limit's controller (synthq.serving.controller.decide), a pure function, on signal
traces: one recorded from a real embedded run against the knee simulator, and
windows made by a small model of a server (slots or knee) fed back in a loop."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from adaptive_model import simulate

from synthq.serving.controller import Window, decide
from synthq.serving.gauges import parse_vllm_gauges

FLOOR, CAP = 4, 256


def quiet(limit: int, *, now: float, lpt: float = 0.1, ttft: float = 0.4) -> Window:
    """A window at the low-load baseline, with the limit in use."""
    return Window(limit=limit, inflight=limit, ok=limit, tokens=16 * limit, fresh=limit,
                  ttft_s=ttft, tpot_s=lpt, latency_per_token=lpt, now=now)


def run(windows: list[Window]) -> list[tuple[int, str | None]]:
    """Feed windows in order, each with the limit the previous decision set."""
    state: dict[str, Any] | None = None
    limit = windows[0].limit
    out = []
    for w in windows:
        # A used limit stays used, and every call at it ends within the window.
        used = limit if w.inflight == w.limit else w.inflight
        fresh = limit if w.fresh == w.limit else w.fresh
        d = decide(replace(w, limit=limit, inflight=used, fresh=fresh), state, floor=FLOOR,
                   cap=CAP)
        state, limit = d.state, d.limit
        out.append((limit, d.reason))
    return out


def test_rises_on_a_quiet_server_up_to_the_cap_and_no_further() -> None:
    limits = [lim for lim, _ in run([quiet(8, now=float(t)) for t in range(40)])]
    assert limits[0] > 8  # grows from the first window that shows baseline latency
    assert all(b >= a for a, b in zip(limits, limits[1:], strict=False))
    assert limits[-1] == CAP and max(limits) == CAP
    # Slow start: from 8 to the cap in a handful of windows.
    assert limits.index(CAP) <= 10


def test_holds_while_the_limit_is_not_used() -> None:
    windows = [replace(quiet(8, now=float(t)), inflight=2) for t in range(10)]
    assert {lim for lim, _ in run(windows)} == {8}


def test_falls_sharply_on_429_and_5xx_then_cools_down() -> None:
    warm = [quiet(64, now=float(t)) for t in range(3)]
    bad = [replace(quiet(64, now=3.0 + t), overload=3) for t in range(3)]
    out = run([*warm, *bad])
    before = out[2][0]
    cut, reason = out[3]
    assert cut == round(before * 0.7)
    assert reason is not None and reason.startswith(f"{cut} ↓") and "429" in reason
    # Calls that started before the cut still report errors: no second cut at once.
    assert out[4][0] == cut and out[5][0] == cut


def test_falls_on_timeouts_down_to_the_floor_never_below() -> None:
    windows = [replace(quiet(64, now=float(t)), timeouts=5) for t in range(60)]
    limits = [lim for lim, _ in run(windows)]
    assert limits[0] == 32
    assert min(limits) == FLOOR and limits[-1] == FLOOR


def test_falls_on_a_ttft_blow_up_and_says_so() -> None:
    out = run([quiet(48, now=0.0), quiet(48, now=1.0),
               replace(quiet(48, now=2.0), ttft_s=4.1, latency_per_token=0.1 + 3.7 / 16)])
    limit, reason = out[-1]
    assert limit < out[-2][0]
    assert reason is not None and "↓ ttft 4.1 s = 10× baseline" in reason


def test_vllm_gauges_waiting_stops_growth_and_full_kv_cache_shrinks() -> None:
    out = run([replace(quiet(32, now=float(t)), waiting=5.0) for t in range(5)])
    assert max(lim for lim, _ in out) <= 32 + math.isqrt(32)  # no slow start past it
    out = run([quiet(32, now=0.0), replace(quiet(32, now=1.0), kv_usage=0.99)])
    assert out[-1][0] < out[0][0] and "kv cache 99 %" in (out[-1][1] or "")


def replay(name: str) -> list[tuple[int, int, int]]:
    """Feed a recorded trace's windows in order: (limit then, decided now, decided then)."""
    trace = json.loads((Path(__file__).parent / "data" / name).read_text())
    state: dict[str, Any] | None = None
    out = []
    for entry in trace:
        d = decide(Window(**entry["window"]), state, floor=FLOOR, cap=CAP)
        state = d.state
        assert FLOOR <= d.limit <= CAP
        out.append((entry["window"]["limit"], d.limit, entry["decided"]))
    return out


def test_recorded_knee_trace() -> None:
    """Windows recorded by SYNTHQ_ADAPTIVE_TRACE from `synthq run --inflight auto` on
    `synthq simulate --knee 32 --knee-falloff 1` (bench/adaptive.py), by an earlier
    controller: past the knee, where the latency per token rises, it comes back down."""
    steps = replay("adaptive_knee_trace.json")
    past = [(then, now) for then, now, _ in steps if then >= 37]
    assert past and all(now <= then for then, now in past)
    assert any(now < then for then, now in past)
    assert all(32 <= now <= 40 for then, now, _ in steps if then >= 32)


def test_recorded_overshoot_trace_falls_when_latency_rises() -> None:
    """Windows recorded with an earlier, laggier controller that overshot to 40 on the same
    knee server: when the latency per token reaches 1.2× its baseline, the limit falls."""
    steps = replay("adaptive_knee_overshoot_trace.json")
    fell = [i for i, (then, now, _) in enumerate(steps) if now < then]
    assert fell and steps[fell[0]][0] == 40 and steps[fell[0]][1] < 40


def test_slow_start_grows_only_a_limit_judged_on_a_whole_turnover() -> None:
    """Windows recorded from `synthq run --inflight auto` on 32 slots with ~2 s answers
    (bench/adaptive.py --only slots) by the controller that judged a raise on the first
    calls to end (those that found a free slot): it went 36 → 54 on 28 of 36 calls at
    baseline, then had to come back. Judged on all 36, it stays at 36."""
    steps = replay("adaptive_slots_overshoot_trace.json")
    assert max(then for then, _, _ in steps) == 54  # what the recording did
    assert [now for then, now, _ in steps if then == 36][:4] == [36, 36, 36, 36]
    rises = [(then, now) for then, now, _ in steps if now > then]
    assert rises == [(24, 36)]


# -- closed loop: a model of the server and the loop, call by call (adaptive_model) ------------


@pytest.mark.parametrize(("kind", "size", "falloff"), [
    ("knee", 16, 1.0), ("knee", 32, 1.0), ("knee", 32, 0.5), ("knee", 64, 0.5),
    ("slots", 32, 0.0)])
def test_converges_near_the_knee_within_30_s_and_holds(kind: str, size: int,
                                                        falloff: float) -> None:
    run = simulate(kind, size, falloff=falloff, samples=4000, seconds=60.0,
                   latency=0.2 if kind == "knee" else 0.4)
    settled = [lim for t, lim in run.limits if t >= 30]
    assert settled and all(size * 0.85 <= x <= size * 1.25 for x in settled), run.limits
    mid = sorted(settled)[len(settled) // 2]
    assert all(abs(x - mid) <= 0.25 * mid for x in settled), run.limits
    assert run.max_seen <= max(lim for _, lim in run.limits) <= CAP


@pytest.mark.parametrize("knee", [16, 32])
def test_on_a_knee_with_falloff_it_settles_at_the_peak_not_above(knee: int) -> None:
    """Past the peak more calls yield fewer tokens/s: a raise that did not pay is undone
    (the gradient alone settles 2-3 above the knee, where 32 → 34 loses 6 %)."""
    run = simulate("knee", knee, falloff=1.0, samples=4000, seconds=60.0)
    settled = sorted(lim for t, lim in run.limits if t >= 30)
    assert settled[len(settled) // 2] <= knee + 1, run.limits
    assert any("no gain at" in r for r in run.reasons), run.reasons


def test_a_server_with_fewer_slots_than_the_start_settles_near_them() -> None:
    """8 slots, the limit starting at 16: the first calls to end (those that found a slot)
    give the low-load baseline, so it comes down near 8 (it settled at 24 when the
    baseline was taken from calls that had waited)."""
    run = simulate("slots", 8, samples=400, seconds=40.0, latency=0.4)
    settled = [lim for t, lim in run.limits if t >= 20]
    assert settled and all(8 <= x <= 12 for x in settled), run.limits


def test_parse_vllm_gauges() -> None:
    body = ("# HELP vllm:num_requests_waiting x\n"
            'vllm:num_requests_waiting{model_name="m",engine="0"} 3.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="1"} 2.0\n'
            'vllm:num_requests_running{model_name="m"} 30.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.42\n'
            'vllm:generation_tokens_total{model_name="m"} 1e6\n')
    assert parse_vllm_gauges(body) == {"waiting": 5.0, "running": 30.0, "kv_usage": 0.42}
    assert parse_vllm_gauges("nothing here\n") == {}


def test_the_first_wave_reads_as_in_use() -> None:
    """16 calls started together at a limit of 16 and ended 1.39 s later; 1.9 s in, the
    2 s window holds them all. Little's law over the seconds the server had calls reads
    them as 16 × 1.39 / 1.9 ≈ 11.7 in flight, in use (over the whole 2 s window: 11.1,
    "not in use", and the limit did not grow: the two-worker e2e test failed so)."""
    from synthq.serving.controller import summarize

    first = [(0.0, 1.39, "ok", 1.39, 0.4, 10)] * 16
    w = summarize(first, now=1.9, limit=16, inflight=16, since=0.0)
    assert w.concurrency is not None and w.concurrency >= 0.7 * 16
    # With calls before the window, it is over the window, as before.
    older = [(-5.0, -3.6, "ok", 1.4, 0.4, 10)] * 16
    w = summarize([*older, *first], now=1.9, limit=16, inflight=16, since=0.0)
    assert w.concurrency is not None and abs(w.concurrency - 16 * 1.39 / 2.0) < 1e-6
