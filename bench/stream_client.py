"""synthq's inference client alone: CPU per streamed call, no database, no Celery.

The seed scenario's calls (the simulator at ``--latency 0 --tokens-per-second 80
--response-tokens 40``: 43 SSE events a call, 128 in flight) made by
``synthq.serving.inference.InferenceClient`` in one asyncio process, measured with
``time.process_time()`` of that process only (the simulator's CPU is not in it).
This is the per-chunk and per-call path of a worker's answers without anything
else a worker does: a change to the HTTP layer shows here first, undiluted.

``--rev REV`` runs the same client from REV too (checked out into a temporary
``git worktree``, ``PYTHONPATH`` at it), alternating who goes first, and prints
tree ÷ REV per round: median (min-max). ``--profile`` prints cProfile's top
functions for the tree's run (one round). A benchmark, not a test.

Run: ``python bench/stream_client.py [--calls 2000] [--runs 3] [--rev REV]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SIM_ARGS = ["--latency", "0", "--tokens-per-second", "80", "--response-tokens", "40"]


async def _calls(url: str, n: int, inflight: int, profile: bool) -> dict[str, float]:
    from synthq.serving.inference import ChatRequest, InferenceClient

    client = InferenceClient(url, max_connections=inflight)
    room = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        async with room:
            result = await client.chat(
                ChatRequest(model="sim-model", messages=[{"role": "user", "content": f"q {i}"}],
                            max_tokens=256), total_timeout=60, stall_timeout=30)
            assert result.content and result.finish_reason

    try:
        await asyncio.gather(*(one(i) for i in range(inflight)))  # every connection open
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        if prof is not None:
            import pstats

            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    finally:
        await client.close()
    return {"cpu_ms_per_call": 1000 * cpu / n, "calls_per_s": n / wall}


def _side(url: str, n: int, inflight: int, checkout: Path | None) -> dict[str, float]:
    """One measurement in a fresh process, with ``checkout``'s code (None: this tree's)."""
    env = dict(os.environ, PYTHONPATH=str(checkout or REPO))
    out = subprocess.run([sys.executable, __file__, "--child", url, "--calls", str(n),
                          "--inflight", str(inflight)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rev", help="also measure this commit's client, alternating")
    ap.add_argument("--profile", action="store_true", help="cProfile the tree's client once")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import synthq

        print(f"synthq from {Path(synthq.__file__).parent.parent}", file=sys.stderr)
        print(json.dumps(asyncio.run(_calls(args.child, args.calls, args.inflight,
                                            args.profile))))
        return
    if args.calls < 1 or args.runs < 1 or args.inflight < 1:
        ap.error("--calls, --runs and --inflight must be at least 1")
    # The harness puts this tree first on sys.path: only the parent imports it, so that a
    # child runs the synthq that PYTHONPATH names (REV's or, unset, the installed tree's).
    from _harness import Simulator

    with tempfile.TemporaryDirectory(prefix="synthq-stream-client-") as tmp:
        sim = Simulator([*SIM_ARGS, "--capacity", str(args.inflight)], dict(os.environ),
                        Path(tmp))
        try:
            if args.profile:
                asyncio.run(_calls(sim.url, args.calls, args.inflight, True))
            else:
                rounds = _rounds(args, sim.url, Path(tmp))
        finally:
            sim.stop()
    if args.profile:
        return
    _report(args, rounds)


def _rounds(args: argparse.Namespace, url: str, tmp: Path) -> list[dict[str, dict[str, float]]]:
    checkout = None
    if args.rev:
        checkout = tmp / "rev"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                        str(checkout), args.rev], check=True)
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for i in range(args.runs):
            sides = ["tree", "rev"] if checkout is not None else ["tree"]
            if i % 2:
                sides.reverse()
            got = {}
            for side in sides:
                got[side] = _side(url, args.calls, args.inflight,
                                  checkout if side == "rev" else None)
                print(f"[stream_client] round {i + 1}/{args.runs} {side}: "
                      f"{got[side]['cpu_ms_per_call']:.3f} ms CPU a call, "
                      f"{got[side]['calls_per_s']:.1f} calls/s, load "
                      f"{os.getloadavg()[0]:.2f}", file=sys.stderr)
            rounds.append(got)
    finally:
        if checkout is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                            str(checkout)], check=False)
    return rounds


def _report(args: argparse.Namespace, rounds: list[dict[str, dict[str, float]]]) -> None:
    def stats(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    figures: dict[str, object] = {"calls": args.calls, "inflight": args.inflight,
                                  "runs": args.runs, "rev": args.rev}
    for side in rounds[0]:
        cpu = [r[side]["cpu_ms_per_call"] for r in rounds]
        print(f"{side:<5} CPU ms a call {stats(cpu)}   calls/s "
              f"{stats([r[side]['calls_per_s'] for r in rounds])}")
        figures[f"{side}_cpu_ms_per_call"] = round(statistics.median(cpu), 3)
    if args.rev:
        ratio = [r["tree"]["cpu_ms_per_call"] / r["rev"]["cpu_ms_per_call"] for r in rounds]
        print(f"tree / rev: CPU per call {stats(ratio)}x")
        figures["cpu_ratio"] = [round(x, 3) for x in ratio]
    figures["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps({"bench": "stream_client", **figures}))


if __name__ == "__main__":
    main()
