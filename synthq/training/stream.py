"""``--features stream``: the trainer's side of a streamed run (the capture's side is
:mod:`synthq.capture.spool`, the ledger's rows :mod:`synthq.queue.spool_states`).

Each rank's examples, in the order the steps take them (its shard of each batch: the
ranks' shards are disjoint), are captured ahead of the trainer into the rank's spool
(``OUT/spool/rankR``, ``--spool`` bytes shared evenly by the ranks). Before each step,
every rank waits until its batch's files are in its spool, or until its capture waits
for room that only a commit frees (every file in the spool trained on since the last
checkpoint, or ahead of the trainer): then a checkpoint is saved and committed at once
(every rank agrees through one all-reduce per step, so DDP's collectives stay in step),
and the files it consumed may go. The step claims its files (the run's token), and
each checkpoint finishes what it trained on (consumed, per epoch: the ledger's record).

A resumed run (kill -9, Ctrl-C, a worker taking it over) takes the dead holder's rows
over, finishes those its checkpoint covers, and trains again, in the same order, those
trained after it: the steps of a checkpoint's epoch from its step on take exactly the
examples it had not seen.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import select

from synthq.capture.spool import Slot, Spool, StreamCapture, human, probe
from synthq.core.errors import UserError
from synthq.queue import spool_states as spool_rows
from synthq.spec.config import get_settings
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job, TrainingRun
from synthq.training.captured import CapturedFeatures, TargetHead
from synthq.training.data import Example, TargetFeatures, batches

__all__ = ["Stream", "plan_steps"]

log = logging.getLogger(__name__)


def plan_steps(examples: list[Example], batch_size: int, world: int, seed: int,
               total: int) -> list[tuple[int, list[list[int]]]]:
    """Each step's (epoch, every rank's example indices), as :func:`synthq.training.loop.
    _steps` takes them: a batch of ``batch_size`` per rank, rank r's share ``b[r::world]``.
    A batch with fewer examples than ranks would have a rank train on another's example
    (twice in the epoch): refused."""
    per_epoch = math.ceil(len(examples) / (batch_size * world))
    out: list[tuple[int, list[list[int]]]] = []
    order: list[list[int]] = []
    for step in range(total):
        epoch, j = divmod(step, per_epoch)
        if j == 0:
            order = batches(examples, batch_size * world, seed, epoch)
        b = order[j]
        if len(b) < world:
            raise UserError(f"--features stream: a batch of {len(b)} examples cannot give "
                            f"each of {world} ranks its own ({len(examples)} examples, "
                            f"batch size {batch_size}): use a number of examples that "
                            "leaves no batch smaller than the number of ranks")
        out.append((epoch, [b[r::world] for r in range(world)]))
    return out


class Stream(CapturedFeatures):
    """The rank's streamed features: a :class:`CapturedFeatures` over the files of its
    spool that the current step claimed."""

    def __init__(self, *, ctx: Any, run_id: int, job_id: int, out: Path, spool: int,
                 head: TargetHead, examples: list[Example],
                 steps: list[tuple[int, list[list[int]]]],
                 layers: list[int], resumed: int, notice: Callable[[str], None]) -> None:
        super().__init__({}, head)
        self.ctx, self.run_id, self.job_id, self.out = ctx, run_id, job_id, out
        self.examples, self.steps, self.layers = examples, steps, layers
        self.notice = notice
        self.world, self.rank = ctx.world, ctx.rank
        self.size = spool
        self.spool = Spool(out / "spool" / f"rank{self.rank}", spool // self.world)
        #: The step of the latest committed checkpoint (nothing to commit before it).
        self.committed = resumed
        self.order: list[Slot] = []
        self.first: list[int] = []  # index in order of each step's first slot
        for step, (epoch, shares) in enumerate(steps):
            self.first.append(len(self.order))
            for i in shares[self.rank]:
                ex = examples[i]
                self.order.append(Slot(step, epoch, ex.id, ex.input_ids))
        self.capture: StreamCapture | None = None
        self.stats: dict[str, int] = {}
        self.prior_high_water = 0
        self._stats_at = 0.0

    # -- the start ------------------------------------------------------------------------
    def start(self, resumed: int) -> None:
        """The dead holder's rows taken over and committed (rank 0), the spool checked
        against the rows, the servers probed, and the capture started at the trainer's
        step ``resumed``."""
        settings = get_settings()
        with session_scope() as s:
            job = s.get(Job, self.job_id)
            assert job is not None
            s.expunge(job)
            # The run's high-water mark so far (an earlier holder's): it only rises.
            self.prior_high_water = int(s.scalar(select(TrainingRun.spool_high_water).where(
                TrainingRun.id == self.run_id)) or 0)
        if not job.capture_servers:
            raise UserError(f"job {job.name} has no capture server: --features stream "
                            "captures through them (`synthq train JOB --capture-server URL`, "
                            "or `synthq capture JOB --server URL`)")
        if resumed:
            from synthq.training.runs import check_same_examples

            check_same_examples(self.out, job)
        if self.rank == 0:
            with session_scope() as s:
                now = utcnow()
                spool_rows.take_over(s, self.run_id, token=self.ctx.token,
                                     lease=settings.train_lease, now=now)
                spool_rows.commit(s, self.run_id, token=self.ctx.token, step=resumed, now=now)
        self._barrier()
        with session_scope() as s:
            rows = spool_rows.files(s, self.run_id, self.rank)
        missing = self.spool.scan({r.path: int(r.bytes or 0) for r in rows if r.path})
        if missing:
            with session_scope() as s:
                now = utcnow()
                gone = [r for r in rows if r.path in missing]
                spool_rows.forget_file(s, [r.id for r in gone if r.state == "consumed"],
                                       now=now)
                spool_rows.lost_file(s, [r.id for r in gone if r.state != "consumed"], now=now)
        shortest = min(self.examples, key=lambda ex: len(ex.input_ids))
        timeout = job.capture_timeout or settings.capture_timeout
        found = probe(job, list(job.capture_servers), self.layers, shortest.input_ids,
                      hidden=int(self.target.config.hidden_size), timeout=timeout)
        self._check_size(found)
        epochs: dict[int, list[str]] = {}
        for slot in self.order:
            epochs.setdefault(slot.epoch, []).append(slot.example)
        self.capture = StreamCapture(
            run_id=self.run_id, rank=self.rank, job=job, probe=found, layers=self.layers,
            spool=self.spool, order=self.order, epochs=epochs, say=self.notice,
            timeout=timeout)
        self.capture.position = self.first[resumed] if resumed < len(self.first) \
            else len(self.order)
        self.capture.start()
        self.notice(f"features: {len(self.order)} examples of this rank streamed through "
                    f"{', '.join(job.capture_servers)} into a spool of {human(self.size)} "
                    f"({human(self.spool.size)} a rank; {found.dtype}, "
                    f"{human(found.estimate(1) - found.estimate(0))} a token)")

    def _worker(self) -> str:
        import os
        import socket

        return f"{socket.gethostname()}:{os.getpid()}"

    def _check_size(self, found: Any) -> None:
        """Every rank's batch must fit its share of the spool (the same figures on every
        rank: the one line comes from rank 0)."""
        need, what = 0, ""
        for _, shares in self.steps:
            for share in shares:
                total = sum(found.estimate(len(self.examples[i].input_ids)) for i in share)
                if total > need:
                    need = total
                    what = ", ".join(self.examples[i].id for i in share)
        if need > self.spool.size:
            big = max(self.examples, key=lambda ex: len(ex.input_ids))
            raise UserError(
                f"--spool {human(self.size)} is smaller than one step's features: example(s) "
                f"{what} take {human(need)} ({human(self.spool.size)} a rank of "
                f"{self.world}; the largest example, {big.id}, {len(big.input_ids)} tokens, "
                f"takes {human(found.estimate(len(big.input_ids)))}): give --spool at least "
                f"{human(need * self.world)}")

    # -- each step ------------------------------------------------------------------------
    def before(self, step: int, commit: Callable[[], None]) -> None:
        """Until step ``step``'s files are in every rank's spool: a checkpoint committed
        whenever a rank's capture waits for room only a commit frees."""
        assert self.capture is not None
        self.capture.position = self.first[step]
        again = False
        while True:
            stalled = self._wait(step)
            flag = self._agree(stalled)
            if not flag:
                return
            if self.committed >= step:  # committed already: its files go once it is written
                if again:
                    raise UserError(
                        f"--spool {human(self.size)} cannot hold step {step + 1}'s features "
                        "beside those ahead of it: give a larger --spool")
                again = True
            else:
                commit()
                self.committed = step
            self._barrier()
            self.capture.wake()

    def _wait(self, step: int) -> bool:
        """Whether the capture waits for a commit (else the step's files are ready)."""
        assert self.capture is not None
        want = [(s.epoch, s.example) for s in self.order[self.first[step]:self._end(step)]]
        cond = self.spool.cond
        with cond:
            while True:
                if self.capture.error is not None:
                    raise self.capture.error
                if all(w in self.capture.ready for w in want):
                    return False
                if self.capture.stalled:
                    return True
                if not self.capture.is_alive():
                    raise RuntimeError("the spool's capture stopped")
                cond.wait(0.5)
                self.ctx.check()

    def _end(self, step: int) -> int:
        return self.first[step + 1] if step + 1 < len(self.first) else len(self.order)

    def _agree(self, stalled: bool) -> bool:
        """Whether any rank's capture waits for a commit; the ranks' spool figures summed."""
        assert self.capture is not None
        mine = [int(stalled), self.spool.used, len(self.spool.held), self.spool.high_water,
                self.capture.lead()]
        if self.world > 1:
            import torch.distributed as dist

            t = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(t)
            mine = [int(v) for v in t.tolist()]
        self.stats = dict(spool_size=self.size, spool_bytes=mine[1], spool_files=mine[2],
                          spool_high_water=max(mine[3], self.prior_high_water),
                          spool_lead=mine[4])
        return mine[0] > 0

    def take(self, step: int, idx: list[int], L: int) -> TargetFeatures:
        """Step ``step``'s files claimed (the run's token) and read: the batch's features."""
        epoch = self.steps[step][0]
        wanted = {self.examples[i].id for i in idx}
        with session_scope() as s:
            rows = spool_rows.items(s, self.run_id, rank=self.rank, epoch=epoch,
                                    examples=wanted)
            got = spool_rows.take(s, [r.id for r in rows], token=self.ctx.token,
                                  worker=self._worker(), step=step + 1,
                                  lease=get_settings().train_lease, now=utcnow())
        if got != len(wanted) or len(rows) != len(wanted):  # the run is not this holder's
            self.ctx.lost.set()
            self.ctx.check()
        self.paths = {r.example: (self.spool.root / str(r.path), 0) for r in rows}
        parts = [self.read(self.examples[i]) for i in idx]
        return self.load(self.examples, idx, L, parts)

    def commit(self, step: int) -> None:
        """A checkpoint of ``step`` is committed (rank 0 writes the ledger)."""
        self.committed = max(self.committed, step)
        if self.rank == 0:
            with session_scope() as s:
                spool_rows.commit(s, self.run_id, token=self.ctx.token, step=step, now=utcnow())
        if self.capture is not None:
            self.capture.wake()

    def figures(self, *, every: float = 2.0) -> dict[str, int]:
        """The spool's figures for the run's row, at most every ``every`` seconds (0:
        now)."""
        now = time.monotonic()
        if not self.stats or now - self._stats_at < every:
            return {}
        self._stats_at = now
        return dict(self.stats)

    def done(self) -> dict[str, int]:
        """Rank 0, after the run's last commit: every rank's files go (none is needed any
        more); the figures the run ends with."""
        self.close()
        with session_scope() as s:
            spool_rows.forget_file(s, [r.id for r in spool_rows.files(s, self.run_id)],
                                   now=utcnow())
        import shutil

        shutil.rmtree(self.out / "spool", ignore_errors=True)
        return dict(self.stats, spool_bytes=0, spool_files=0, spool_lead=0)

    def close(self) -> None:
        if self.capture is not None:
            self.capture.stop.set()
            with self.spool.cond:
                self.spool.cond.notify_all()
            self.capture.join(timeout=30)

    def fill(self, target: Any, examples: list[Example], heartbeat: Any = None,
             say: Any = None) -> int:
        return 0

    def missing(self, examples: list[Example]) -> list[int]:
        return []

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
