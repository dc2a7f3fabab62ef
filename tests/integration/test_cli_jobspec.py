"""The CLI's job settings (made from synthq.spec.jobspec): bad values refused in one line with
exit 2 on create and requeue alike, and --help that says what each option takes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, run_cli

pytestmark = pytest.mark.integration


def synthq(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in ``cwd`` with the embedded defaults (a SQLite file there), 200 columns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="200", TERM="dumb", NO_COLOR="1")
    return run_cli(*args, cwd=cwd, env=env, check=False)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
        result.returncode, result.stderr)
    return lines[0]


BAD = [("--max-attempts", "1000000000000"), ("--temperature", "1e308"),
       ("--max-tokens", "1000000000000"), ("--stall-timeout", "1e308"),
       ("--backoff-cap", "1e308"), ("--timeout", "inf"), ("--max-seq-len", "2147483648")]


@pytest.mark.processes
def test_bad_values_are_one_line_and_exit_2_on_create_and_requeue(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    base = ["-d", "d.jsonl", "-s", "http://127.0.0.1:9/v1", "-m", "m"]
    for flag, value in [*BAD, ("--extra-body", '{"n": 100}'),
                        ("--extra-body", '{"max_completion_tokens": 9}')]:
        line = one_error_line(synthq(tmp_path, "enqueue", *base, flag, value))
        assert line.startswith(f"error: {flag} "), line
    assert synthq(tmp_path, "jobs", "--json").stdout.strip() == "[]"  # nothing stored
    assert synthq(tmp_path, "enqueue", *base, "--job", "ok").returncode == 0
    for flag, value in [(f, v) for f, v in BAD if f not in ("--backoff-cap", "--max-seq-len")]:
        line = one_error_line(synthq(tmp_path, "requeue", "ok", flag, value))
        assert line.startswith(f"error: {flag} is out of range"), line
    line = one_error_line(synthq(tmp_path, "requeue", "ok", "--extra-body", '{"n": 2}'))
    assert "--extra-body may not set ['n']" in line


@pytest.mark.processes
def test_kv_transfer_params_is_refused_in_one_line_by_run_enqueue_and_requeue(
        tmp_path: Path) -> None:
    """Issue 41: ``--extra-body '{"kv_transfer_params": {"synthq_name": "x"}}'`` with
    ``--inflight 2`` sent two calls naming one capture file, which wedged vLLM for good."""
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    base = ["-d", "d.jsonl", "-s", "http://127.0.0.1:9/v1", "-m", "m", "--inflight", "2"]
    body = '{"kv_transfer_params": {"synthq_name": "x"}}'
    for command in ("run", "enqueue"):
        line = one_error_line(synthq(tmp_path, command, *base, "--extra-body", body))
        assert line.startswith("error: --extra-body may not set ['kv_transfer_params']"), line
    assert synthq(tmp_path, "jobs", "--json").stdout.strip() == "[]"  # nothing stored
    assert synthq(tmp_path, "enqueue", *base, "--job", "ok").returncode == 0
    line = one_error_line(synthq(tmp_path, "requeue", "ok", "--extra-body", body))
    assert "--extra-body may not set ['kv_transfer_params']" in line


def test_sampling_may_not_carry_kv_transfer_params() -> None:
    from synthq.core.errors import UserError
    from synthq.jobs.enqueue import JobSpec

    spec = JobSpec(name="j", model="m", servers=["http://127.0.0.1:9/v1"],
                   sampling={"kv_transfer_params": {"synthq_name": "x"}})
    with pytest.raises(UserError, match=r"sampling options may not set \['kv_transfer_params'\]"):
        spec.check()


def _rows(help_text: str) -> dict[str, str]:
    """Each option's row of --help, by its long flag (continuation lines joined)."""
    rows: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        cells = line.strip("│ ").strip()
        found = re.match(r"^\*?\s*(--[a-z-]+)", cells)
        if found:
            current = found.group(1)
            rows[current] = cells
        elif current and cells and not line.startswith(("╰", "╭")):
            rows[current] += " " + cells
    return rows


@pytest.mark.processes
def test_help_lists_choices_shows_no_type_for_flags_and_says_the_defaults(
        tmp_path: Path) -> None:
    helps = {c: _rows(synthq(tmp_path, *c.split(), "--help").stdout)
             for c in ("enqueue", "run", "requeue", "retokenize", "export", "train")}
    for command, rows in helps.items():
        assert "--help" in rows and len(rows) > 3, (command, rows)
        for flag, row in rows.items():
            assert "<bool>" not in row, (command, flag, row)
    run = helps["run"]
    for flag, choices in (("--reasoning", "<auto|keep|drop>"), ("--regenerate", "<last|all>"),
                          ("--mask", "<last_turn|all_assistant_turns>"),
                          ("--history-reasoning", "<drop|keep>"), ("--inflight", "<N|auto>")):
        assert choices in run[flag] and choices in helps["enqueue"][flag], run[flag]
    assert "<parquet|jsonl|speculators|specforge>" in helps["export"]["--format"]
    assert "<online|offline|captured|stream>" in helps["train"]["--hidden-states"]
    assert "<now|ready|done:F|count:N|never>" in helps["train"]["--when"]
    for flag in ("--temperature", "--top-p"):
        assert "[default: the server's]" in run[flag], run[flag]
    assert "[default: 4096]" in run["--max-tokens"]
    for flag in ("--tokenizer", "--chat-template", "--chat-template-kwargs", "--max-seq-len",
                 "--reasoning", "--mask"):
        assert "[default: the job's]" in helps["retokenize"][flag], helps["retokenize"][flag]
    assert "<auto|keep|drop>" in helps["retokenize"]["--reasoning"]
    for flag in ("--max-tokens", "--temperature", "--max-attempts", "--extra-body"):
        assert "[default: the job's]" in helps["requeue"][flag], helps["requeue"][flag]


#: Training and DFlash settings out of their declared range (synthq.training.config): issue
#: 41 found them stored on the job and trained (``--epochs 1000000000000``).
BAD_TRAIN = [("--epochs", "1000000000000"), ("--lr", "1e308"), ("--batch-size", "0"),
             ("--draft-vocab-size", "-1"), ("--lr", "nan"), ("--lr", "inf"),
             ("--warmup-ratio", "inf"), ("--eval-fraction", "nan"), ("--max-len", "2"),
             ("--max-steps", "1000000000000"), ("--max-examples", "-1"),
             ("--ttt-steps", "1000000000"), ("--dflash-layers", "1000000"),
             ("--dflash-anchors", "0"), ("--save-every", "0"), ("--log-every", "1000000000000"),
             ("--seed", "100000000"), ("--eval-every", "-1"),
             ("--eval-draft-tokens", "1000"), ("--eval-max-new", "1000000000000"),
             ("--keep-checkpoints", "1000000")]


def test_bad_training_settings_are_one_line_and_exit_2_in_process() -> None:
    """The CLI's command, built once and run in this process (a few ms a value): each bad
    value is refused before the command looks the job up (there is none: the line names
    the option, not the job)."""
    from click.testing import CliRunner
    from typer.main import get_command

    from synthq.cli import app

    runner, cli = CliRunner(), get_command(app)
    for flag, value in BAD_TRAIN:
        result = runner.invoke(cli, ["train", "no-such-job", "--when", "never", flag, value])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1, (flag, value, result.output)
        assert lines[0].startswith(f"error: {flag} "), lines[0]


#: Run in one child process: a job, then every bad value through the CLI's command, with
#: ``--when never`` (stores the settings on the job) and ``--when now`` (makes a run and
#: trains); then what was stored, whether torch was imported, and last the real entry point.
_TRAIN_SCRIPT = """
import json, sys
from click.testing import CliRunner
from typer.main import get_command
from synthq.cli import app, main
runner, cli = CliRunner(), get_command(app)
made = runner.invoke(cli, ["enqueue", "-d", "d.jsonl", "-s", "http://127.0.0.1:9/v1",
                           "-m", "m", "--job", "j"])
assert made.exit_code == 0, made.output
refused = []
for flag, value in json.loads(sys.argv[1]):
    for when in ("never", "now"):
        r = runner.invoke(cli, ["train", "j", "--target", "tgt", "--when", when, flag, value])
        refused.append([flag, r.exit_code, r.stderr.strip().splitlines()])
from sqlalchemy import func, select
from synthq.store.db import session_scope
from synthq.store.models import Job, TrainingRun
with session_scope() as s:
    job = s.scalars(select(Job)).one()
    stored = [job.train_when, job.train_target, job.train_settings,
              s.scalar(select(func.count()).select_from(TrainingRun))]
print(json.dumps({"refused": refused, "stored": stored, "torch": "torch" in sys.modules}))
sys.stdout.flush()
sys.argv = ["synthq", "train", "j", "--target", "tgt", "--epochs", "1000000000000"]
main()
"""


@pytest.mark.processes
def test_bad_training_settings_store_nothing_import_no_torch_and_exit_2(
        tmp_path: Path) -> None:
    """One child for every value (a CLI start costs seconds): nothing stored on the job, no
    run row, torch never imported; the real `synthq train` exits 2 with the one line."""
    import json

    (tmp_path / "d.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "tgt").mkdir()
    (tmp_path / "tgt" / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNTHQ_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="200", TERM="dumb", NO_COLOR="1")
    child = subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, json.dumps(BAD_TRAIN)],
                           cwd=tmp_path, env=env, text=True, capture_output=True, timeout=120)
    found = [line for line in child.stdout.splitlines() if line.startswith('{"refused"')]
    assert found, child.stderr[-3000:]
    out = json.loads(found[0])
    assert len(out["refused"]) == 2 * len(BAD_TRAIN)
    for flag, code, lines in out["refused"]:
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag} "), (
            flag, code, lines)
    assert out["stored"] == ["ready", None, {}, 0]  # the job as enqueued, no run
    assert out["torch"] is False
    line = one_error_line(child)
    assert line == ("error: --epochs is out of range: --epochs must be a positive integer up "
                    "to 10,000, got 1,000,000,000,000")
