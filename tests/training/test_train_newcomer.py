"""`synthq train` for a newcomer on the CPU (issue 25, item 6): a real `synthq train`
process killed (SIGKILL) and interrupted (SIGINT, during the final evaluation) resumes
at once, without redoing steps, and shows the evaluation's progress; DDP runs on the
CPU under torchrun with gloo, two ranks giving the model one process gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import REPO, child_env, wait_for
from training_support import get_run, greedy_examples, start_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: A run long enough to be killed mid-way, short enough for a test: 40 steps over 90
#: training examples in batches of 2, 10 held out (a tenth), each evaluated one draft
#: token a round (many verify rounds: an evaluation long enough to interrupt).
TRAIN = ["--draft-vocab-size", "64", "--batch-size", "2", "--epochs", "50", "--max-steps",
         "40", "--lr", "1e-2", "--save-every", "10", "--log-every", "1", "--eval-fraction",
         "0.1", "--eval-every", "0", "--eval-draft-tokens", "1", "--eval-max-new", "40"]


def start_train(job_id: int, target: Path, out: Path, *,
                sigint_ignored: bool = False) -> subprocess.Popen[str]:
    """`synthq train` in embedded mode; stdout to ``out``, stderr to ``out`` + ``.err``.
    ``sigint_ignored``: started as a shell's background job is (SIGINT ignored)."""
    env = child_env(SYNTHQ_BROKER_URL="", PYTHONUNBUFFERED="1", COLUMNS="200")

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen([sys.executable, "-m", "synthq.cli", "train", str(job_id),
                             "--target", str(target), *TRAIN], cwd=REPO, env=env, text=True,
                            stdout=open(out, "w"),  # noqa: SIM115 - the child holds it
                            stderr=open(f"{out}.err", "w"),  # noqa: SIM115
                            preexec_fn=ignore_sigint if sigint_ignored else None)


@pytest.mark.timeout(900)  # three `synthq train` starts: minutes on a loaded 2-core machine
def test_killed_and_interrupted_synthq_train_resumes_at_once(
        pg: str, greedy_job: Callable[..., int], tiny_target: Any, tiny_target_dir: Path,
        tmp_path: Path) -> None:
    job_id = greedy_job(examples=greedy_examples(tiny_target, 25) * 4)
    # kill -9 mid-training: the next `synthq train` on this host takes the run over at
    # once (its holder's pid is gone), not after the 120 s lease.
    first = start_train(job_id, tiny_target_dir, tmp_path / "first.out")
    try:
        wait_for(lambda: (r := _run(job_id)) is not None and r.step >= 12, 400,
                 (tmp_path / "first.out.err").read_text())
    finally:
        first.kill()
        first.wait(30)
    killed = _run(job_id)
    assert killed is not None and killed.state == "running"  # its claim, left behind
    out_path = tmp_path / "second.out"
    # Started the way a shell starts a background job (`synthq train ... &`: SIGINT
    # ignored, and Python keeps that): Ctrl-C, or `kill -INT`, still hands the run back.
    second = start_train(job_id, tiny_target_dir, out_path, sigint_ignored=True)
    try:
        def evaluating() -> bool:
            if second.poll() is not None:
                pytest.fail(f"exited {second.returncode}: {out_path.read_text()}"
                            f"{Path(f'{out_path}.err').read_text()}")
            return "\nevaluating: " in out_path.read_text()

        wait_for(evaluating, 400, "no evaluation", interval=0.02)
        # Ctrl-C during the final evaluation: the run is handed back at once.
        second.send_signal(signal.SIGINT)
        second.wait(60)
    finally:
        if second.poll() is None:
            second.kill()
    out, log = out_path.read_text(), Path(f"{out_path}.err").read_text()
    assert "resuming training run" in out and "being trained by" not in out + log, out + log
    shown = [line for line in out.splitlines() if line.startswith("evaluating: ")]
    assert shown[0].startswith("evaluating: 1/10 held-out prompts, acceptance length "), out
    assert not shown[-1].startswith("evaluating: 10/10"), out  # stopped during it
    assert second.returncode == 130, out + log
    assert "handed back" in log and "Traceback" not in log, log
    interrupted = _run(job_id)
    assert interrupted is not None
    assert (interrupted.state, interrupted.claim, interrupted.step) == ("pending", None, 40)
    # The last step was saved before the evaluation: resuming redoes no step.
    assert Path(interrupted.checkpoint or "").name == "step-00000040"
    third = subprocess.run([sys.executable, "-m", "synthq.cli", "train", str(job_id),
                            "--target", str(tiny_target_dir), *TRAIN], cwd=REPO,
                           env=child_env(SYNTHQ_BROKER_URL="", COLUMNS="200"), text=True,
                           capture_output=True, timeout=300)
    assert third.returncode == 0, third.stdout + third.stderr
    done = _run(job_id)
    assert done is not None and done.state == "done" and done.resumed_from == 40
    # No step trained again: the only step line is the last one, shown with its evaluation.
    shown = [line for line in third.stdout.splitlines() if line.startswith("step ")]
    assert shown and all(line.startswith("step 40: ") and "eval" in line
                         for line in shown), third.stdout
    assert done.eval_acceptance_length is not None
    assert [line for line in third.stdout.splitlines() if line.startswith("evaluating: ")][-1] \
        .startswith("evaluating: 10/10 held-out prompts")
    assert Path(done.output_dir, "metrics.png").is_file()
    assert Path(done.output_dir, "final", "metrics.png").is_file()


def _run(job_id: int) -> Any:
    from sqlalchemy import select

    from synthq.store.db import session_scope
    from synthq.store.models import TrainingRun

    with session_scope() as s:
        run = s.scalar(select(TrainingRun).where(TrainingRun.job_id == job_id)
                       .order_by(TrainingRun.id.desc()).limit(1))
        if run is not None:
            s.expunge(run)
        return run


def test_a_dead_holder_on_this_host_is_taken_over_and_a_live_one_is_not(
        pg: str, greedy_job: Callable[..., int], tiny_target_dir: Path) -> None:
    import socket

    from synthq.queue import run_states as states
    from synthq.queue import workers
    from synthq.store.db import session_scope, utcnow

    def _dead_local_holder(s: Any, run_id: int) -> str | None:
        """What the training lifecycle asks before its claim: the ledger's dead-holder rule."""
        return workers.dead_holder_here(s, states.RUNS, run_id)

    run_id = start_run(greedy_job(2), tiny_target_dir)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    for holder, takeover in ((f"{host}:{gone.pid}", True), (f"{host}:{os.getppid()}", False),
                             (f"elsewhere:{gone.pid}", False), ("celery@w1", False)):
        with session_scope() as s:
            assert states.cancel(s, run_id, now=utcnow()) or True
        with session_scope() as s:
            run_id = start_run(greedy_job(2), tiny_target_dir)
            assert states.claim(s, run_id, "t1", worker=holder, now=utcnow(), lease=120)
        with session_scope() as s:
            dead = _dead_local_holder(s, run_id)
            assert (dead == holder) is takeover, holder
            assert states.claim(s, run_id, "t2", worker="me", now=utcnow(), lease=120,
                                dead_worker=dead) is takeover, holder


def test_two_cpu_ranks_train_the_model_one_process_trains(
        pg: str, greedy_job: Callable[..., int], tiny_target: Any, tiny_target_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun with 2 gloo ranks (global batch 2 = 1 per rank) against one process
    with batches of 2: DDP averages the ranks' gradients, equal to the one batch's when
    every example has as many supervised tokens (40 each; the whole vocabulary drafted,
    so no position is out of it)."""
    import torch
    from safetensors.torch import load_file

    from synthq.spec.config import get_settings
    from synthq.training.lifecycle import execute_run

    examples = greedy_examples(tiny_target, 8)
    settings: dict[str, Any] = dict(draft_vocab_size=96, epochs=1, max_steps=4, lr=1e-2,
                                    save_every=100, log_every=1, eval_fraction=0.0)
    one = start_run(greedy_job(examples=examples), tiny_target_dir, batch_size=2, **settings)
    t0 = time.perf_counter()
    assert execute_run(one) == "done", get_run(one).error
    monkeypatch.setenv("SYNTHQ_TRAIN_PROCS", "2")
    get_settings.cache_clear()
    two = start_run(greedy_job(examples=examples), tiny_target_dir, batch_size=1, **settings)
    assert execute_run(two) == "done", get_run(two).error
    # The control: one process, batches of 1 (the same 4 steps on other batches).
    monkeypatch.setenv("SYNTHQ_TRAIN_PROCS", "1")
    get_settings.cache_clear()
    other = start_run(greedy_job(examples=examples), tiny_target_dir, batch_size=1, **settings)
    assert execute_run(other) == "done", get_run(other).error
    a, b, c = (load_file(str(Path(get_run(r).output_dir, "final", "model.safetensors")))
               for r in (one, two, other))
    assert get_run(one).step == get_run(two).step == 4
    assert set(a) == set(b) == set(c)
    # d2t/t2d only where the draft vocabulary is smaller than the target's (vLLM's rule).
    for key in ("d2t", "t2d"):
        if key in a:
            assert torch.equal(a[key], b[key])
    for name in a:
        if not a[name].is_floating_point():
            continue
        ranks = float((a[name] - b[name]).abs().mean())
        batches = float((a[name] - c[name]).abs().mean())
        # Float noise only (Adam turns a near-zero gradient's rounding into a step of
        # lr), far below what other batches make of the same 4 steps.
        assert ranks < 2e-4 and ranks < 0.05 * batches, (name, ranks, batches)
    print(f"3 runs, one of them 2 ranks: {time.perf_counter() - t0:.1f} s")
