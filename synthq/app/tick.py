"""One scheduler tick: every periodic stage of the service, in one order.

Celery beat's ``synthq.dispatch`` task (``worker/tasks.py``) and the embedded
``synthq run`` loop (:mod:`synthq.app.embedded`) both call :func:`run_tick`; only
their effects differ (:class:`Effects`: how queued samples reach a caller,
how a training run is started), so this module imports nothing of ``worker/``.

The order, and why (docs/design.md, "The tick", points here):

1. **probe**: servers due a health probe; one found down is sent at most one
   call by this tick's dispatch, not a batch.
2. **sweep**: every kind of leased work a dead holder leaves (synthq.queue.sweep):
   expired leases, dead workers' samples and captures, and unclaimed queued
   samples go back to ``pending``, so the dispatch below frees their slots and
   sends them again in the same tick (and the capture step finds its servers' true
   room); where the tick starts training, orphaned training runs too, each sent its
   message.
3. **adapt**: the adaptive limits (``--inflight auto``) *before* the dispatch,
   so that what the controller decided on the calls that just ended is what
   this dispatch fills: a raise is filled at once, a cut queues nothing above
   the new target that would then have to drain. The controller's "is the
   limit in use" reading does not wait for this tick's dispatch: the slots
   freed by ended calls are refilled as they end (a worker's refill, the
   embedded loop's wake), and it allows 30 % of slack. (The beat ran it after
   the dispatch and the embedded loop before; the embedded order is the one
   whose figures are in bench/HISTORY.md, "Adaptive concurrency".)
4. **dispatch**: queue what is due, within each server's limit.
5. **finish**: jobs whose samples are all terminal are marked finished.
6. **train**: the readiness check starts a training run for each job whose
   data is ready, and sends again the runs whose holder died. Nothing above
   depends on it, and after the dispatch a slow or failing check cannot hold
   back the queueing of due samples. Only a consumer of ``control`` runs this
   tick, so each training worker also runs the same check itself
   (synthq.training.readiness.Watch): with only training workers and beat, an
   orphaned run was never sent again (issue 41).
7. **capture**: jobs with capture servers get a pending capture for each newly
   done sample, and those with captures due are handed to the capture stage
   (synthq.capture): after generation's stages, whose done samples it follows.

A stage is one line of :data:`STAGES`: a name, a function of the :class:`Tick`
and whether it runs on every wake of the embedded loop or only once per
interval. Its function returns what it did (``Tick.did[name]``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError

from synthq.queue import jobs
from synthq.queue.dispatch import LocalClaim, Publisher, active_servers, dispatch
from synthq.queue.sweep import sweep
from synthq.serving import adaptive
from synthq.serving.controller import Decision
from synthq.serving.health import probe_due
from synthq.store.db import session_scope, utcnow

__all__ = ["Effects", "Tick", "Stage", "STAGES", "run_tick"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Effects:
    """What a tick does beyond the database; each scheduler passes its own."""

    #: Hands each server's newly queued samples to the callers (None: queue nothing
    #: this tick, e.g. while the embedded loop stops).
    publish: Publisher | None
    #: This process's own share of what the dispatch queues (the embedded loop's
    #: free slots), asked for at each dispatch; None: all goes to ``publish``.
    local: Callable[[], LocalClaim | None] | None = None
    #: Sends one ``train`` message per run id; None: no training stage (embedded).
    start_training: Callable[[list[int]], None] | None = None
    #: Runs (or sends) the capture stage of each job id given; None: no capture stage
    #: in the tick (the embedded run captures once generation ends).
    start_capture: Callable[[list[int]], None] | None = None


@dataclass(slots=True)
class Tick:
    """One tick's inputs and, by stage name, what each stage did."""

    effects: Effects
    #: The jobs it looks at (None: every active job).
    job_ids: Sequence[int] | None = None
    #: A full tick runs every stage; a wake (the embedded loop, between two full ticks)
    #: only those marked ``every_wake``.
    full: bool = True
    did: dict[str, Any] = field(default_factory=dict)

    @property
    def queued(self) -> int:
        return int(self.did.get("dispatch") or 0)


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    run: Callable[[Tick], Any]
    #: Runs on every wake of the embedded loop, not only on full ticks.
    every_wake: bool = False
    #: A failure other than the database's is logged and the tick goes on (the stage
    #: must never stop the dispatcher).
    guarded: bool = False
    #: A database error stops the tick (and is raised: the scheduler tells an outage from
    #: a full disk); False: it is logged like any other (a guarded stage's own trouble).
    database_stops: bool = True


def _probe(t: Tick) -> list[str]:
    """The servers found down by this tick's probes."""
    return [url for url, healthy in probe_due(active_servers(t.job_ids)).items()
            if not healthy]


def _sweep(t: Tick) -> int:
    """Rows given back (and training runs sent again, when this tick starts training)."""
    return sweep(job_ids=t.job_ids, send_runs=t.effects.start_training)


def _adapt(t: Tick) -> dict[str, Decision]:
    return adaptive.tick(job_ids=t.job_ids)


def _dispatch(t: Tick) -> int:
    publish = t.effects.publish
    if publish is None:
        return 0
    local = t.effects.local() if t.effects.local is not None else None
    return dispatch(publish, job_ids=t.job_ids, local=local)


def _finish(t: Tick) -> list[int]:
    with session_scope() as s:
        return jobs.finish_jobs(s, now=utcnow(), job_ids=t.job_ids)


def _train(t: Tick) -> list[int]:
    """The training runs started (readiness, synthq.training; no torch)."""
    if t.effects.start_training is None:
        return []
    from synthq.training.readiness import check_readiness

    return check_readiness(t.effects.start_training).started


def _capture(t: Tick) -> list[int]:
    """The jobs whose captures are due, handed to the capture stage (synthq.capture)."""
    if t.effects.start_capture is None:
        return []
    from synthq.capture.due import due_jobs

    with session_scope() as s:
        due = due_jobs(s, now=utcnow())
    if t.job_ids is not None:
        due = [j for j in due if j in t.job_ids]
    if due:
        t.effects.start_capture(due)
    return due


#: The stages, in the order of the module's docstring.
STAGES: tuple[Stage, ...] = (
    Stage("probe", _probe),
    Stage("sweep", _sweep),
    Stage("adapt", _adapt, every_wake=True, guarded=True),
    Stage("dispatch", _dispatch, every_wake=True),
    Stage("finish", _finish),
    Stage("train", _train, guarded=True, database_stops=False),
    Stage("capture", _capture, guarded=True, database_stops=False),
)


def run_tick(effects: Effects, *, job_ids: Sequence[int] | None = None,
             full: bool = True) -> Tick:
    """Run the stages due (all of them on a ``full`` tick) in order; returns what they did.

    A database error stops the tick and is raised (the caller knows whether it is an
    outage or a full disk), but in a stage that says otherwise; the next tick starts over.
    """
    tick = Tick(effects, job_ids, full)
    for stage in STAGES:
        if not (full or stage.every_wake):
            continue
        try:
            tick.did[stage.name] = stage.run(tick)
        except Exception as exc:
            if not stage.guarded or (stage.database_stops and isinstance(exc, DBAPIError)):
                raise
            log.exception("scheduler tick: the %s stage failed; the others go on", stage.name)
    return tick
