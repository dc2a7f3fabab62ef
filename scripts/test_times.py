"""Where the suite's time goes: the table of a run's test times, by tier and slowest first.

    SYNTHQ_TEST_TIMES=/tmp/times.jsonl bash scripts/test.sh
    python scripts/test_times.py /tmp/times.jsonl [--top 25] [--wall SECONDS]

A tier is the test's folder under tests/ (unit, integration, e2e, api, chaos, training,
engine). Seconds are each test's setup + call + teardown, summed: with two processes the
wall time is about half the total. CPU seconds are those of the test's process and of the
children it reaped (tests/conftest.py; a command the CLI zygote forked is not counted): on
two saturated cores they, not the seconds, say what a test costs the suite.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path, key: str = "seconds") -> dict[str, float]:
    """Each test's seconds (or ``cpu_seconds``), its phases summed."""
    times: dict[str, float] = defaultdict(float)
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            times[row["test"]] += row.get(key) or 0.0
    return dict(times)


def tier(test: str) -> str:
    parts = test.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def table(times: dict[str, float], top: int, wall: float | None,
          cpu: dict[str, float] | None = None) -> str:
    """The tiers and the ``top`` slowest tests; with ``cpu`` (each test's CPU seconds),
    a CPU column beside each."""
    cpu = cpu if cpu and any(cpu.values()) else None
    by_tier: dict[str, list[str]] = defaultdict(list)
    for test in times:
        by_tier[tier(test)].append(test)
    total = sum(times.values())

    def cpu_of(tests: list[str]) -> str:
        return f" {sum(cpu.get(t, 0.0) for t in tests):,.0f} |" if cpu else ""

    extra, rule = (" CPU seconds |", "---:|") if cpu else ("", "")
    lines = [f"| tier | tests | seconds | share |{extra}", f"|---|---:|---:|---:|{rule}"]
    for name, tests in sorted(by_tier.items(), key=lambda kv: -sum(times[t] for t in kv[1])):
        seconds = sum(times[t] for t in tests)
        lines.append(f"| {name} | {len(tests)} | {seconds:,.0f} | {seconds / total:.0%} |"
                     + cpu_of(tests))
    lines.append(f"| all | {len(times)} | {total:,.0f} | |" + cpu_of(list(times)))
    if wall:
        lines.append(f"\nWall time: {wall:,.0f} s ({total / wall:.2f} test-seconds per second).")
    lines += ["", f"The {top} slowest tests:", "", f"| seconds |{extra} test |",
              f"|---:|{rule}---|"]
    for test, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {seconds:,.1f} |{cpu_of([test])} `{test}` |")
    return "\n".join(lines)


def timeline(path: Path) -> str:
    """Each process's busy seconds and when its last test ended, from the run's first
    report (the ``stop`` and ``worker`` each phase records): a process that ends long
    before the last one left its core to the others for that long."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("worker") and r.get("stop")]
    if not rows:
        return ""
    first = min(r["stop"] - r["seconds"] for r in rows)
    busy: dict[str, float] = defaultdict(float)
    last: dict[str, float] = defaultdict(float)
    for r in rows:
        busy[r["worker"]] += r["seconds"]
        last[r["worker"]] = max(last[r["worker"]], r["stop"] - first)
    end = max(last.values())
    lines = ["", "| process | busy seconds | its last test ended at | idle before the end |",
             "|---|---:|---:|---:|"]
    for worker in sorted(busy, key=lambda w: int(w.lstrip("gw") or 0)):
        lines.append(f"| {worker} | {busy[worker]:,.0f} | {last[worker]:,.0f} s | "
                     f"{end - last[worker]:,.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("times", type=Path, help="the SYNTHQ_TEST_TIMES file of a run")
    parser.add_argument("--top", type=int, default=25, help="how many slowest tests to list")
    parser.add_argument("--wall", type=float, help="the run's wall time, printed beside")
    args = parser.parse_args()
    print(table(load(args.times), args.top, args.wall, load(args.times, "cpu_seconds")))
    print(timeline(args.times))


if __name__ == "__main__":
    main()
