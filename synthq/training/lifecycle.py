"""One training run's claim, start to end: :func:`execute_run` (the ``train`` task and
``synthq train``).

It claims the run (CAS), hands it to the loop (:func:`synthq.training.loop.train`), and
ends it: the run's final state, ``failed`` with the reason on an error. A heartbeat
thread renews the run's claim; when it is refused (cancelled, or
another worker took the run over after this one looked dead) training stops
without writing. Ctrl-C hands the claim back at once (the run is pending again),
and a run whose holder was a process of this host that no longer exists (kill
-9) is claimed at once, without waiting for its heartbeat to go stale. With
several GPUs (or ``SYNTHQ_TRAIN_PROCS``, also on the CPU, over gloo) the task
starts ``torchrun`` over :func:`main`; rank 0 writes to SQL and checkpoints.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from synthq.core.errors import HandBack, UserError
from synthq.queue import run_states as states
from synthq.queue import workers
from synthq.spec.config import get_settings
from synthq.store.db import session_scope, utcnow
from synthq.store.models import TrainingRun
from synthq.training.loop import EvalProgress, Lost, RunContext, train

__all__ = ["execute_run", "main"]

log = logging.getLogger(__name__)


def _heartbeat(ctx: RunContext, interval: float, stop: threading.Event) -> None:
    while not stop.wait(interval):
        try:
            with session_scope() as s:
                if not states.progress(s, ctx.run_id, ctx.token, now=utcnow()):
                    ctx.lost.set()
                    return
        except Exception:  # a database hiccup: the next beat tries again
            log.exception("training run %d: heartbeat failed", ctx.run_id)


def execute_run(run_id: int, *, worker: str | None = None,
                on_step: Callable[[int, dict[str, Any]], None] | None = None,
                say: Callable[[str], None] | None = None,
                on_eval: EvalProgress | None = None) -> str:
    """Claim run ``run_id`` and train it to the end. Returns its final state, or
    ``stale`` when another process holds it. Errors end the run ``failed`` with
    the reason; ``on_step(step, record)`` sees each logged step, ``say(line)``
    the run's notices (the cache size estimate, each evaluation), ``on_eval`` each
    held-out prompt of an evaluation. KeyboardInterrupt hands the run back
    (pending, resumable at once) and is raised again."""
    settings = get_settings()
    token = secrets.token_hex(8)
    worker = worker or f"{socket.gethostname()}:{os.getpid()}"
    lease = states.RUNS.lease_seconds()
    with session_scope() as s:
        if not states.claim(s, run_id, token, worker=worker, now=utcnow(),
                            lease=lease,
                            dead_worker=workers.dead_holder_here(s, states.RUNS, run_id)):
            return "stale"
    ctx = RunContext(run_id, token)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(ctx, states.RUNS.renew_every(lease), stop),
                            daemon=True, name="synthq-train-hb")
    beat.start()
    try:
        procs = _processes(settings.train_procs)
        if procs > 1:
            _torchrun(ctx, procs)
            return _state(run_id)
        train(ctx, on_step, say, on_eval)
        return "done"
    except KeyboardInterrupt:
        stop.set()  # no heartbeat after the hand-back
        beat.join()
        with session_scope() as s:
            states.release(s, run_id, token, now=utcnow(),
                           reason="interrupted; resumes from its last checkpoint")
        raise
    except Lost:
        log.warning("training run %d: lost its claim (cancelled or taken over); stopped", run_id)
        return _state(run_id)
    except HandBack as exc:  # nothing wrong with the run: pending, the same command resumes it
        stop.set()
        beat.join()
        with session_scope() as s:
            states.release(s, run_id, token, now=utcnow(), reason=str(exc))
        return _state(run_id)
    except UserError as exc:
        _fail(ctx, str(exc))
        return "failed"
    except Exception as exc:
        log.exception("training run %d failed", run_id)
        _fail(ctx, f"{type(exc).__name__}: {exc}")
        return "failed"
    finally:
        stop.set()
        beat.join()


def _processes(configured: int) -> int:
    """Training processes: SYNTHQ_TRAIN_PROCS, else one per CUDA GPU (SYNTHQ_NO_DDP: one)."""
    if configured > 0:
        return configured
    if os.environ.get("SYNTHQ_NO_DDP"):
        return 1
    return max(1, torch.cuda.device_count())


def _state(run_id: int) -> str:
    with session_scope() as s:
        run = s.get(TrainingRun, run_id)
        return str(run.state) if run else "missing"


def _fail(ctx: RunContext, error: str) -> None:
    with session_scope() as s:
        states.fail(s, ctx.run_id, ctx.token, error=error, now=utcnow())


def _torchrun(ctx: RunContext, procs: int) -> None:
    """DDP over ``procs`` processes (a GPU each with CUDA, else gloo on the CPU); this
    process keeps the claim and heartbeat."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={procs}", "-m", "synthq.training.lifecycle",
           str(ctx.run_id), ctx.token]
    proc = subprocess.Popen(cmd)
    try:
        while proc.poll() is None:
            if ctx.lost.wait(1):
                raise Lost()
    finally:  # lost, Ctrl-C, any error: the ranks stop with this process
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    if proc.returncode != 0 and _state(ctx.run_id) == "running":
        raise RuntimeError(f"torchrun exited with status {proc.returncode}")


def main(argv: list[str] | None = None) -> None:
    """torchrun entry: ``python -m synthq.training.lifecycle RUN_ID TOKEN`` on every rank."""
    import torch.distributed as dist

    run_id, token = (argv or sys.argv[1:])[:2]
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ctx = RunContext(int(run_id), token, rank=rank, world=world)
    try:
        train(ctx, None, None)  # leaves the group with the other ranks after the last step
    except Lost:
        pass
    except HandBack as exc:  # any rank's spool: the run is handed back, resumable
        with session_scope() as s:
            states.release(s, ctx.run_id, ctx.token, now=utcnow(), reason=str(exc))
        raise
    except Exception as exc:
        if rank == 0:
            _fail(ctx, f"{type(exc).__name__}: {exc}")
        # No collective teardown here: the other ranks may be inside a collective, and
        # torchrun stops them once this rank exits non-zero.
        raise


if __name__ == "__main__":
    main()
