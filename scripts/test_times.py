"""Where the suite's time goes: the table of a run's test times, by tier and slowest first.

    SYNTHQ_TEST_TIMES=/tmp/times.jsonl bash scripts/test.sh
    python scripts/test_times.py /tmp/times.jsonl [--top 25] [--wall SECONDS]

A tier is the test's folder under tests/ (unit, integration, e2e, api, chaos, training,
engine). Seconds are each test's setup + call + teardown, summed: with two processes the
wall time is about half the total (the engine tier runs on one of them).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> dict[str, float]:
    """Each test's seconds, its phases summed."""
    times: dict[str, float] = defaultdict(float)
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            times[row["test"]] += row["seconds"]
    return dict(times)


def tier(test: str) -> str:
    parts = test.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def table(times: dict[str, float], top: int, wall: float | None) -> str:
    by_tier: dict[str, list[float]] = defaultdict(list)
    for test, seconds in times.items():
        by_tier[tier(test)].append(seconds)
    total = sum(times.values())
    lines = ["| tier | tests | seconds | share |", "|---|---:|---:|---:|"]
    for name, values in sorted(by_tier.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {len(values)} | {sum(values):,.0f} | "
                     f"{sum(values) / total:.0%} |")
    lines.append(f"| all | {len(times)} | {total:,.0f} | |")
    if wall:
        lines.append(f"\nWall time: {wall:,.0f} s ({total / wall:.2f} test-seconds per second).")
    lines += ["", f"The {top} slowest tests:", "", "| seconds | test |", "|---:|---|"]
    for test, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {seconds:,.1f} | `{test}` |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("times", type=Path, help="the SYNTHQ_TEST_TIMES file of a run")
    parser.add_argument("--top", type=int, default=25, help="how many slowest tests to list")
    parser.add_argument("--wall", type=float, help="the run's wall time, printed beside")
    args = parser.parse_args()
    print(table(load(args.times), args.top, args.wall))


if __name__ == "__main__":
    main()
