"""The regression guard: the seed-scenario benchmark for REV and for the working tree, alternating.

``REV`` (any commit name git knows) is checked out into a temporary ``git
worktree``; each round runs ``bench/seed_scenario.py --runs 1 --skip-scripts``
once from that checkout (``PYTHONPATH`` set to it, so REV's code and REV's
benchmark run) and once from this working tree, the order alternating between
rounds so that a change in the machine's load hits both sides. It prints, per
side, done/s and CPU ms per sample (every process but the server's), and the
ratios working tree ÷ REV taken within each round: median (min-max) over the
rounds, with the 1-minute load average before each run.

A benchmark, not a test: nothing here asserts on speed. Read a ratio as a
change only when its whole min-max range is off 1.0 and the load was alike.

Run: ``python bench/compare.py main [--runs 3] [--no-stream] [--mode embedded]
[--samples 2000]`` (each run starts its own PostgreSQL database, Redis db 12,
simulator, worker and beat: about 30-60 s a run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent


class Run(NamedTuple):
    """One seed-scenario run of one side: its figures and the load it ran under."""

    done_per_s: float
    cpu_ms_per_sample: float
    load_1m: float


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("rev", help="the commit to compare with (a branch, tag or hash)")
    ap.add_argument("--runs", type=int, default=3, help="rounds (each runs both sides once)")
    ap.add_argument("--no-stream", action="store_true", help="synthq's job does not stream")
    ap.add_argument("--mode", choices=("distributed", "embedded"), default="distributed")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--redis-db", type=int, default=12)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.samples < 10:
        ap.error("--samples must be at least 10")
    return args


def order(round_index: int) -> tuple[str, str]:
    """Who runs first in a round: REV in even rounds, the working tree in odd ones."""
    return ("rev", "tree") if round_index % 2 == 0 else ("tree", "rev")


def stats(values: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


def ratios(rev: Sequence[Run], tree: Sequence[Run]) -> dict[str, list[float]]:
    """Working tree ÷ REV per round, for done/s and for CPU per sample."""
    if len(rev) != len(tree) or not rev:
        raise ValueError("one run of each side per round")
    return {"done_per_s": [t.done_per_s / r.done_per_s for r, t in zip(rev, tree, strict=True)],
            "cpu_per_sample": [t.cpu_ms_per_sample / r.cpu_ms_per_sample
                               for r, t in zip(rev, tree, strict=True)]}


def fmt(values: Sequence[float], digits: int = 2) -> str:
    med, lo, hi = stats(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def figures_of(output: str, mode: str) -> tuple[float, float]:
    """done/s and CPU ms per sample from seed_scenario's last (JSON) line."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            fig = data[f"synthq_{mode}"]
            return float(fig["done_per_s"]), float(fig["cpu_ms_per_sample"])
    raise ValueError("seed_scenario printed no summary line")


def run_side(tree: Path, args: argparse.Namespace) -> Run:
    cmd = [sys.executable, str(tree / "bench" / "seed_scenario.py"), "--runs", "1",
           "--skip-scripts", "--mode", args.mode, "--samples", str(args.samples),
           "--redis-db", str(args.redis_db)]
    if args.no_stream:
        cmd.append("--no-stream")
    env = dict(os.environ, PYTHONPATH=str(tree))
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"seed_scenario in {tree} exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    done, cpu = figures_of(proc.stdout, args.mode)
    return Run(done, cpu, load)


def resolve(rev: str) -> str:
    proc = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compare: {rev!r} is not a commit of this repository")
    return proc.stdout.strip()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    commit = resolve(args.rev)
    with tempfile.TemporaryDirectory(prefix="synthq-compare-") as tmp:
        checkout = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(checkout), commit],
                       cwd=REPO, check=True)
        try:
            sides = {"rev": checkout, "tree": REPO}
            runs: dict[str, list[Run]] = {"rev": [], "tree": []}
            for i in range(args.runs):
                for side in order(i):
                    r = run_side(sides[side], args)
                    runs[side].append(r)
                    print(f"[compare] round {i + 1}/{args.runs} {side}: {r.done_per_s:.1f} "
                          f"done/s, {r.cpu_ms_per_sample:.2f} ms CPU/sample, load "
                          f"{r.load_1m:.2f}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=REPO,
                           check=False)
    stream = "no-stream" if args.no_stream else "stream"
    print(f"seed scenario, {args.mode}, {stream}, {args.samples} samples, {args.runs} "
          f"round(s), median (min-max); REV = {args.rev} ({commit[:10]})")
    for side, label in (("rev", "REV"), ("tree", "working tree")):
        rs = runs[side]
        print(f"  {label:<13} done/s {fmt([r.done_per_s for r in rs], 1):>20}   CPU ms/sample "
              f"{fmt([r.cpu_ms_per_sample for r in rs]):>18}   load "
              f"{fmt([r.load_1m for r in rs])}")
    q = ratios(runs["rev"], runs["tree"])
    print(f"  tree / REV    done/s {fmt(q['done_per_s']):>18}x  CPU per sample "
          f"{fmt(q['cpu_per_sample']):>17}x")
    print(json.dumps({"bench": "compare", "rev": commit, "mode": args.mode, "stream": stream,
                      "runs": args.runs,
                      "done_per_s_ratio": [round(x, 3) for x in q["done_per_s"]],
                      "cpu_per_sample_ratio": [round(x, 3) for x in q["cpu_per_sample"]],
                      "load_1m": [round(r.load_1m, 2) for s in runs.values() for r in s]}))


if __name__ == "__main__":
    main()
