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

Run: ``python bench/cli_startup.py [--repeats 7]``.
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


def cpu_of(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
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
    medians: dict[str, float] = {}
    for name, cmd in commands.items():
        cpu_of(cmd, work, env)  # warm the page cache
        medians[name] = statistics.median(cpu_of(cmd, work, env) for _ in range(args.repeats))
    bare = medians["bare typer app --help"]
    for name, value in medians.items():
        print(f"{name:<30} {value * 1000:7.0f} ms CPU   {value / bare:5.2f}x the bare app")
    print(json.dumps({"bench": "cli_startup", **{k: round(v, 3) for k, v in medians.items()},
                      "ratios": {k: round(v / bare, 2) for k, v in medians.items()}}))


if __name__ == "__main__":
    main()
