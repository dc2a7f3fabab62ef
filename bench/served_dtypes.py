"""The served acceptance of drafters trained on hidden states stored in each dtype, against
float32 (issue 30 item 4: the goal is within 0.05), on the tiny target, measured by vLLM.

    .venv/bin/python bench/served_dtypes.py [--prompts 400] [--epochs 3] [--draft-tokens 4]
                                            [--dtypes float32,bfloat16,float16,float8_e4m3]
                                            [--target DIR] [--work DIR]

1. The tiny target (``synthq testing tiny-target``; ``--target`` reuses one) served by a
   plain vLLM answers ``--prompts`` counting prompts (``synthq run``, greedy, token ids
   returned): one job. The server is stopped.
2. One vLLM capture server (``extract_hidden_states`` and synthq's connector, at the
   drafter's layers) captures the job once per dtype, each into its own copy of the data
   directory (``synthq capture --dtype D``): the engine's float32 states, stored as D.
3. Per dtype, ``synthq train --hidden-states captured`` with the same seed and settings,
   so that the stored dtype is the only difference; each checkpoint served by vLLM's
   EAGLE-3 (``num_speculative_tokens`` = ``--draft-tokens``) and measured by
   ``synthq serve-check`` on the run's held-out prompts (one split for all: the same job).

Rows (JSON; after the generation's line, one per dtype): bytes per token stored, synthq's
own ``eval`` and vLLM's ``served`` acceptance length (1 + accepted / drafts), drafts, and
``delta`` (served minus float32's). Nothing is asserted. About 10-15 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from synthq.testing.vllm import VllmServer, start_capture_server  # noqa: E402

NAME = "tiny"


def _synthq(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"synthq {' '.join(args[:2])} failed:\n{out.stderr[-3000:]}{out.stdout[-2000:]}")
    text = out.stdout.strip()
    try:
        return json.loads(text.splitlines()[-1])
    except ValueError:  # capture prints its plan's line, then indented JSON
        return json.loads(text[text.index("{"):])


def _env(data: Path) -> dict[str, str]:
    import os

    return dict(os.environ, SYNTHQ_DATA_DIR=str(data), SYNTHQ_DATABASE_URL="",
                SYNTHQ_BROKER_URL="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _generate(target: Path, work: Path, n: int) -> Path:
    """The job ``gen``: dflash.py's generation (the same prompts, seed and settings), in its
    own data directory."""
    from dflash import _generate as generate_job

    data = work / "generated"
    generate_job(target, work, _env(data), n)
    return data


def _bytes_per_token(data: Path) -> float:
    import sqlite3

    con = sqlite3.connect(data / "synthq.db")
    try:
        nbytes, tokens = con.execute("SELECT sum(bytes), sum(num_tokens) FROM captures "
                                     "WHERE state = 'done'").fetchone()
    finally:
        con.close()
    return round(nbytes / tokens, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16,float8_e4m3")
    ap.add_argument("--target", type=Path, help="a tiny target built before")
    ap.add_argument("--work", type=Path, help="keep the work here (default: a temp dir)")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    work = args.work or Path(tempfile.mkdtemp(prefix="synthq-dtypes-"))
    work.mkdir(parents=True, exist_ok=True)
    target = args.target
    if target is None:
        target = work / "target"
        subprocess.run([sys.executable, "-m", "synthq.cli", "testing", "tiny-target",
                        str(target)], check=True, cwd=REPO, capture_output=True)
    from synthq.capture.plan import drafter_layers

    layers = drafter_layers(json.loads((target / "config.json").read_text())["num_hidden_layers"])
    generated = _generate(target, work, args.prompts)

    server = start_capture_server(target, NAME, layers=layers, engine_dir=work / "engine",
                                  log_path=work / "vllm-capture.log")
    try:
        server.wait_ready(timeout=1500)
        for dtype in dtypes:
            data = work / f"data-{dtype}"
            shutil.copytree(generated, data)
            out = _synthq(_env(data), "capture", "gen", "--server", server.base_url,
                          "--layers", ",".join(map(str, layers)), "--dtype", dtype,
                          "--target", str(target), "--json")
            _say(f"captured {dtype}: {out}")
    finally:
        server.stop()

    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        data = work / f"data-{dtype}"
        row = _synthq(_env(data), "train", "gen", "--target", str(target), "--hidden-states",
                      "captured", "--draft-vocab-size", "100000", "--epochs", str(args.epochs),
                      "--batch-size", "8", "--lr", "2e-3", "--eval-draft-tokens",
                      str(args.draft_tokens), "--out", str(work / f"run-{dtype}"), "--json")
        if row["state"] != "done":
            sys.exit(f"training on {dtype}: {row['state']} {row.get('error')}")
        spec = {"method": "eagle3", "model": row["checkpoint"],
                "num_speculative_tokens": args.draft_tokens}
        served = VllmServer.start(target, NAME, log_path=work / f"vllm-{dtype}.log",
                                  speculative=spec)
        try:
            served.wait_ready(timeout=1500)
            check = _synthq(_env(data), "serve-check", str(row["id"]), "-s", served.base_url,
                            "-m", NAME, "--json")
        finally:
            served.stop()
        rows.append({"dtype": dtype, "bytes_per_token": _bytes_per_token(data),
                     "eval": row["eval_acceptance_length"],
                     "served": check["served_acceptance_length"], "drafts": check["drafts"]})
        _say(f"{dtype}: {rows[-1]}")
    base = next((r["served"] for r in rows if r["dtype"] == "float32"), None)
    for r in rows:
        r["delta"] = None if base is None else round(r["served"] - base, 3)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
