"""Adaptive concurrency (``--inflight auto``) against fixed limits, in the embedded mode.

Two simulated servers (``synthq simulate``), each run once per setting with a
fresh ``synthq run`` (SQLite, no broker) and a fresh simulator:

1. **knee**: the total token rate grows with the streams running up to a
   hidden 32 (``--knee N``), then falls (``--knee-falloff F``); room for 1,024 at
   once, so a fixed 256 really runs 256;
2. **slots**: at most 32 requests run at once, the rest wait in the server's
   queue (as in vLLM); ~2 s answers and a short ``--timeout``; a fixed 200
   makes calls wait past it.

Settings: fixed 8, 16, 32, 64, 128, 256 (and 200 on slots) and ``auto`` (cap
256, floor 4). Each run lasts until its samples are done or ``--seconds``
passed (then it is killed). Printed per run: done/s (done samples ÷ seconds
from the first call to the last answer, or to the time box), the share of
calls that timed out, the most requests the server saw at once; then auto ÷
best fixed and auto ÷ worst fixed per server, and the auto limit's trace.

Goals (issue 15): auto ≥ 0.9× the best fixed and ≥ 2× the worst; where a
fixed 200 times out on slots, auto ≤ 1 % of calls timed out; the server never
sees more than the cap.

Faults (issue 24 item 15): ``--chaos slow|dead|503`` makes the server 5×
slower (``POST /sim/slow``), kills it (``kill -9``, restarted on its port), or
answers every call 503 with Retry-After 5 (``POST /sim/overload``), from
``--chaos-at`` s after the first answer for ``--chaos-for`` s; printed: how
long after the cause ended the limit was back to ≥ 0.8× the knee for good.
``--error-rate 0.05``: the server answers 5 % of calls 500 at random (then
compare auto with the best fixed setting).

Run: ``python bench/adaptive.py`` (``--samples``, ``--seconds``, ``--only knee|slots``,
``--settings 8,32,auto``, ``--vllm-metrics``, ``--knee``, ``--chaos``,
``--error-rate``). The machine may be shared: compare ratios from one run, not
absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from synthq.testing.procs import Proc, free_port  # noqa: E402

SCENARIOS: dict[str, dict[str, Any]] = {
    # 16 tokens at 10 tok/s per stream + 0.2 s: ~1.8 s per answer up to the knee.
    "knee": {"sim": ["--knee", "32", "--capacity", "1024", "--latency", "0.2",
                     "--tokens-per-second", "10", "--response-tokens", "16"],
             "timeout": 600.0, "fixed": [8, 16, 32, 64, 128, 256]},
    # 32 slots, ~2 s answers (0.4 s + 16 tokens at 10 tok/s), --timeout 6.
    "slots": {"sim": ["--capacity", "32", "--latency", "0.4", "--tokens-per-second", "10",
                      "--response-tokens", "16"],
              "timeout": 6.0, "fixed": [8, 16, 32, 64, 128, 200, 256]},
}


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SYNTHQ_")
           or k in ("SYNTHQ_GPU_HOUR_PRICE", "SYNTHQ_ADAPTIVE_TRACE")}
    env["SYNTHQ_DATA_DIR"] = str(data_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


class Chaos:
    """One fault, from ``at`` s after the first answer for ``span`` s (see the docstring)."""

    def __init__(self, kind: str | None, at: float, span: float) -> None:
        self.kind, self.at, self.span = kind, at, span
        self.started: float | None = None  # monotonic
        self.ended_unix: float | None = None
        self.restart: Any = None

    def step(self, url: str, sim: Proc, first_answer: float | None) -> Proc:
        """Start or end the fault when due; returns the simulator (a new one after a
        restart)."""
        if self.kind is None or first_answer is None:
            return sim
        now = time.monotonic()
        if self.started is None and now - first_answer >= self.at:
            self.started = now
            if self.kind == "slow":
                httpx.post(f"{url}/sim/slow", json={"seconds": self.span, "factor": 5},
                           timeout=5)
            elif self.kind == "503":
                httpx.post(f"{url}/sim/overload", json={"seconds": self.span, "status": 503,
                                                        "retry_after": 5}, timeout=5)
            else:
                sim.kill9()
        elif self.started is not None and self.ended_unix is None and \
                now - self.started >= self.span:
            self.ended_unix = time.time()
            if self.kind == "dead":
                sim = self.restart()
        return sim


def _wait_up(url: str, sim: Proc) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise RuntimeError(sim.tail()) from None
            time.sleep(0.2)


def _first_answer(url: str) -> float | None:
    try:
        done = httpx.get(f"{url}/sim/stats", timeout=2).json()["completed"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None
    return time.monotonic() if done else None


def run_one(scenario: str, setting: str, *, samples: int, seconds: float, falloff: float,
            vllm_metrics: bool, logs: Path, chaos: Chaos | None = None,
            error_rate: float = 0.0) -> dict[str, Any]:
    spec = SCENARIOS[scenario]
    port = free_port()
    chaos = chaos or Chaos(None, 0.0, 0.0)
    sim_args = [*spec["sim"], "--knee-falloff", str(falloff)] if scenario == "knee" \
        else list(spec["sim"])
    if vllm_metrics:
        sim_args.append("--vllm-metrics")
    if error_rate:
        sim_args += ["--error-rate", str(error_rate)]
    with tempfile.TemporaryDirectory(prefix="synthq-adaptive-") as tmp:
        data = Path(tmp)
        env = _env(data)
        def start_sim(suffix: str = "") -> Proc:
            return Proc([sys.executable, "-m", "synthq.cli", "simulate", "--port", str(port),
                         *sim_args], env, logs / f"{scenario}-{setting}-sim{suffix}.log")

        sim = start_sim()
        chaos.restart = lambda: start_sim("-restarted")
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_up(url, sim)
            dataset = data / "prompts.jsonl"
            with dataset.open("w") as fh:
                for i in range(samples):
                    fh.write(json.dumps({"messages": [
                        {"role": "user", "content": f"question {i} for the {scenario} bench"}]})
                        + "\n")
            inflight = ["--inflight", "auto", "--max-inflight", "256"] if setting == "auto" \
                else ["--inflight", setting]
            run = Proc([sys.executable, "-m", "synthq.cli", "run", "-d", str(dataset), "-s",
                        f"{url}/v1", "-m", "sim-model", "--job", "bench", "--max-tokens", "64",
                        "--timeout", str(spec["timeout"]), "--backoff-base", "0.5",
                        "--backoff-cap", "4", "--json", *inflight], env,
                       logs / f"{scenario}-{setting}-run.log")
            started = time.monotonic()
            killed = False
            first: float | None = None
            while run.proc.poll() is None:
                if time.monotonic() - started > seconds + 15:  # + start-up, enqueue
                    run.kill9()
                    killed = True
                    break
                if chaos.kind is not None:
                    first = first or _first_answer(url)
                    sim = chaos.step(url, sim, first)
                time.sleep(0.25)
            stats = httpx.get(f"{url}/sim/stats", timeout=5).json()
        finally:
            if "run" in locals():
                run.stop()
            sim.stop()
        # The run's database stays beside the logs, for a closer look (samples.finished_at).
        shutil.copy(data / "synthq.db", logs / f"{scenario}-{setting}.db")
        return _measure(data / "synthq.db", samples, seconds, killed, chaos.ended_unix) | {
            "setting": setting, "max_active": stats["max_active"],
            "max_running": stats["max_running"]}


def _measure(db: Path, samples: int, seconds: float, killed: bool,
             cause_ended: float | None = None) -> dict[str, Any]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        first = conn.execute("SELECT min(started_at) FROM attempts").fetchone()[0]
        finished = [_ts(r[0]) for r in conn.execute(
            "SELECT finished_at FROM samples WHERE state='done' AND finished_at IS NOT NULL")]
        outcomes = dict(conn.execute(
            "SELECT outcome, count(*) FROM attempts GROUP BY outcome").fetchall())
        history = conn.execute("SELECT limit_history FROM servers").fetchone()
    finally:
        conn.close()
    if first is None:
        return {"done": 0, "done_per_s": 0.0, "timeouts": 0.0, "calls": 0, "killed": killed,
                "trace": []}
    t0 = _ts(first)
    end = t0 + seconds
    counted = [t for t in finished if t <= end]
    span = (max(counted) - t0) if len(counted) == samples else seconds
    calls = sum(outcomes.values())
    trace = json.loads(history[0]) if history and history[0] else []
    return {"done": len(finished), "done_per_s": len(counted) / max(span, 1e-6),
            "timeouts": (outcomes.get("timeout", 0) + outcomes.get("stalled", 0)) / max(calls, 1),
            "calls": calls, "killed": killed, "outcomes": outcomes,
            "trace": [(round(p[0] - t0, 1), p[1]) for p in trace],
            "cause_ended": None if cause_ended is None else round(cause_ended - t0, 1)}


def back_after(trace: list[tuple[float, int]], end: float, level: float) -> float | None:
    """Seconds from ``end`` until the limit is at ``level`` or above for good (None: it
    was below it at the last point)."""
    after = [(t, lim) for t, lim in trace if t >= end]
    if not after or after[-1][1] < level:
        return None
    below = [t for t, lim in after if lim < level]
    return round(max(below) - end, 1) if below else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=40.0,
                        help="time box per run (from the first call)")
    parser.add_argument("--only", choices=sorted(SCENARIOS))
    parser.add_argument("--settings", help="comma-separated, e.g. 8,32,auto")
    parser.add_argument("--knee-falloff", type=float, default=0.5)
    parser.add_argument("--knee", type=int, default=32,
                        help="where the knee server's rate peaks (streams)")
    parser.add_argument("--vllm-metrics", action="store_true",
                        help="the simulators serve vLLM's gauges")
    parser.add_argument("--chaos", choices=["slow", "dead", "503"],
                        help="a fault on the server mid-run (see the docstring)")
    parser.add_argument("--chaos-at", type=float, default=20.0,
                        help="seconds after the first answer")
    parser.add_argument("--chaos-for", type=float, default=None,
                        help="seconds it lasts (default 30 for slow, 20 otherwise)")
    parser.add_argument("--error-rate", type=float, default=0.0,
                        help="share of calls the server answers 500 at random")
    parser.add_argument("--logs", type=Path, default=None)
    args = parser.parse_args()
    span = args.chaos_for if args.chaos_for is not None else \
        (30.0 if args.chaos == "slow" else 20.0)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="synthq-adaptive-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    SCENARIOS["knee"]["sim"][1] = str(args.knee)
    for scenario in ([args.only] if args.only else list(SCENARIOS)):
        spec = SCENARIOS[scenario]
        settings = args.settings.split(",") if args.settings else \
            [*map(str, spec["fixed"]), "auto"]
        print(f"\n== {scenario}: {' '.join(spec['sim'])}"
              + (f" --knee-falloff {args.knee_falloff}" if scenario == "knee" else "")
              + f", --timeout {spec['timeout']:g}, {args.samples} samples, "
              f"time box {args.seconds:g} s", flush=True)
        print(f"{'setting':>8} {'done/s':>8} {'done':>6} {'timed out':>10} {'max seen':>9}",
              flush=True)
        results = []
        for setting in settings:
            r = run_one(scenario, setting, samples=args.samples, seconds=args.seconds,
                        falloff=args.knee_falloff, vllm_metrics=args.vllm_metrics, logs=logs,
                        chaos=Chaos(args.chaos, args.chaos_at, span) if args.chaos else None,
                        error_rate=args.error_rate)
            results.append(r)
            print(f"{setting:>8} {r['done_per_s']:8.2f} {r['done']:6d} "
                  f"{r['timeouts'] * 100:9.1f}% {r['max_active']:9d}", flush=True)
        fixed = [r for r in results if r["setting"] != "auto"]
        auto = next((r for r in results if r["setting"] == "auto"), None)
        if auto:
            print("auto limit (s from first call, limit): "
                  + " ".join(f"{t}:{lim}" for t, lim in auto["trace"][:: max(1, len(
                      auto["trace"]) // 40)]))
            print(f"auto calls by outcome: {auto['outcomes']}")
        if auto and auto["cause_ended"] is not None and scenario == "knee":
            level = 0.8 * args.knee
            back = back_after(auto["trace"], auto["cause_ended"], level)
            print(f"{args.chaos}: the cause ended at {auto['cause_ended']} s; the limit was "
                  + (f"back to >= {level:g} (0.8x the knee) for good {back} s later"
                     if back is not None else f"still under {level:g} at the end"))
        if auto and fixed:
            best = max(fixed, key=lambda r: r["done_per_s"])
            worst = min(fixed, key=lambda r: r["done_per_s"])
            worst_ratio = (f"{auto['done_per_s'] / worst['done_per_s']:.2f}"
                           if worst["done_per_s"] > 0 else "∞ (the worst finished nothing)")
            print(f"auto ÷ best fixed ({best['setting']}): "
                  f"{auto['done_per_s'] / max(best['done_per_s'], 1e-9):.2f}; "
                  f"auto ÷ worst fixed ({worst['setting']}): {worst_ratio}; "
                  f"auto timed out {auto['timeouts'] * 100:.1f}% of {auto['calls']} calls; "
                  f"server saw at most {auto['max_active']} (cap 256)")
    print(f"\nlogs: {logs}")


if __name__ == "__main__":
    main()
