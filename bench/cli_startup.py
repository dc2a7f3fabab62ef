"""CLI start-up: CPU of ``synthq`` commands against a bare two-command Typer app, in one run.

Each command runs ``--repeats`` times (default 7) as a fresh process in a
fresh directory; the figure is the median user + system CPU seconds (from
``resource.getrusage(RUSAGE_CHILDREN)``), and the ratio to the bare Typer app
measured in the same run (also shown: the bare app running its command, for
reference). Commands: ``synthq --help``, ``synthq jobs --json``
and ``synthq status JOB --json`` against a SQLite database holding one job
(the embedded default), and ``synthq status JOB --json`` against PostgreSQL
when ``--pg`` is given (e.g. ``postgresql+psycopg://postgres@127.0.0.1/postgres``
with synthq's tables; skipped otherwise). Goal: <= 1.5x the bare app.

``--hog N`` keeps N busy-looping processes running meanwhile (a loaded machine:
``status --json`` on PostgreSQL took 6-14 s there, issue 24), and wall-clock
medians are printed beside the CPU ones.

Run: ``python bench/cli_startup.py [--repeats 7] [--pg URL] [--hog 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BARE_APP = '''
import typer

app = typer.Typer()


@app.command()
def hello(name: str = "world") -> None:
    """Say hello."""
    print(f"hello {name}")


@app.command()
def bye() -> None:
    """Say bye."""
    print("bye")


app()
'''


#: Wall-clock seconds of each command's runs (cpu_of records them).
WALL: dict[str, list[float]] = {}


def cpu_of(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, timeout=120)
    WALL.setdefault(" ".join(cmd), []).append(time.perf_counter() - started)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def pg_job(url: str, env: dict[str, str]) -> str:
    """A job of 1,000 samples in the PostgreSQL database ``url`` (migrated here)."""
    code = ("import sys; from synthq.store.migrate import upgrade; upgrade(sys.argv[1]); "
            "from synthq.testing.chaos import create_job, prompts; "
            "print(create_job(prompts(1000, 'cli'), ['http://127.0.0.1:9/v1'], "
            "name='cli-bench'))")
    done = subprocess.run([sys.executable, "-c", code, url], env={**env,
                          "SYNTHQ_DATABASE_URL": url}, check=True, capture_output=True,
                          text=True, timeout=300)
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pg", help="a PostgreSQL URL: also `status JOB --json` there")
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes meanwhile")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="synthq-cli-bench-"))
    (work / "bare.py").write_text(BARE_APP)
    (work / "data.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env["PYTHONPATH"] = str(REPO)
    synthq = [sys.executable, "-m", "synthq.cli"]
    subprocess.run([*synthq, "enqueue", "-d", "data.jsonl", "-s", "http://127.0.0.1:9/v1",
                    "-m", "m", "--job", "bench"], cwd=work, env=env, check=True,
                   capture_output=True, timeout=120)
    commands = {
        "bare typer app --help": [sys.executable, "bare.py", "--help"],
        # Its command instead of --help: typer imports pydantic (parameter adapters) but
        # not rich (help): the floor of any command, shown for reference.
        "bare typer app hello": [sys.executable, "bare.py", "hello"],
        "synthq --help": [*synthq, "--help"],
        "synthq jobs --json": [*synthq, "jobs", "--json"],
        "synthq status bench --json": [*synthq, "status", "bench", "--json"],
    }
    envs = {name: env for name in commands}
    if args.pg:
        job = pg_job(args.pg, env)
        name = "synthq status JOB --json (PostgreSQL)"
        commands[name] = [*synthq, "status", job, "--json"]
        envs[name] = {**env, "SYNTHQ_DATABASE_URL": args.pg}
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hog)]
    medians: dict[str, float] = {}
    walls: dict[str, float] = {}
    try:
        for name, cmd in commands.items():
            cpu_of(cmd, work, envs[name])  # warm the page cache
            WALL.pop(" ".join(cmd), None)
            medians[name] = statistics.median(cpu_of(cmd, work, envs[name])
                                              for _ in range(args.repeats))
            walls[name] = statistics.median(WALL[" ".join(cmd)])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    bare = medians["bare typer app --help"]
    for name, value in medians.items():
        print(f"{name:<40} {value * 1000:7.0f} ms CPU   {value / bare:5.2f}x the bare app"
              f"   {walls[name]:6.2f} s wall")
    print(json.dumps({"bench": "cli_startup", "hog": args.hog,
                      **{k: round(v, 3) for k, v in medians.items()},
                      "ratios": {k: round(v / bare, 2) for k, v in medians.items()},
                      "wall": {k: round(v, 3) for k, v in walls.items()}}))


if __name__ == "__main__":
    main()
