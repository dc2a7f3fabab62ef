"""A streamed run's capture: the next examples the trainer will take, captured ahead of it
into a spool whose bytes never exceed its bound (``synthq train JOB --features stream
--spool SIZE``; the trainer's side is :mod:`synthq.training.stream`).

One :class:`Spool` per rank: a folder of whole, content-addressed files
(:class:`synthq.capture.store.Store`: written to a temporary name and renamed), and the
bytes it holds plus those reserved for the captures in flight, never over its bound. A
capture reserves its file's size (estimated from the probe's file: tokens × layers ×
hidden × the engine's dtype, and the header) before the engine is called, and the file
is admitted against the bound before a byte is written.

One :class:`StreamCapture` thread per rank walks the rank's examples in the order the
trainer takes them (epoch after epoch), from the trainer's position: an example whose
file the spool still keeps from an earlier epoch is offered again, uncaptured; another
is captured through the job's capture servers (the capture stage's own request and
checks: :func:`synthq.capture.stage._call`, :mod:`synthq.capture.ingest`) and offered.
Each call holds a slot of its server's one capture limit (``capture_limit``, shared with
``synthq capture`` and the other ranks: the row is ``capturing`` there,
:func:`synthq.queue.spool_states.start_capture`); while every server is at its limit the
capture waits (saying so once), and never skips the example. The thread heart-beats as a
worker, so a killed trainer's calls are freed by the sweep's one dead-holder rule.
A file is shared by the rows of its example that name it (one per epoch), and leaves the
spool only once none of them needs it.
Room comes from files that are no longer needed (every row of theirs consumed: a
committed checkpoint trained on them), the one needed last evicted first; when none is,
the capture waits, :attr:`StreamCapture.stalled`, and the trainer commits a checkpoint
(synthq.training.stream). A server that does not answer is retried (a restart takes
minutes) and nothing is skipped; one that answers wrong stops the run with one line.
The rows and their transitions are :mod:`synthq.queue.spool_states`'.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from synthq.capture import confine, ingest
from synthq.capture.deadline import client as watched_client
from synthq.capture.plan import DTYPES
from synthq.capture.stage import Engine, _call, describe, server_key
from synthq.capture.store import Store, Stored
from synthq.core.errors import HandBack, SampleError, UserError
from synthq.core.retry import exponential
from synthq.queue import capture_states, workers
from synthq.queue import spool_states as spool_rows
from synthq.spec.config import get_settings
from synthq.store.db import session_scope, utcnow

__all__ = ["Slot", "Spool", "StreamCapture", "probe", "Probe", "human"]

log = logging.getLogger(__name__)

#: Bytes a file's header may differ by from the probe's (its metadata's digits).
HEADER_SLACK = 1024


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True, slots=True)
class Slot:
    """One example in the rank's order: the trainer takes it at ``step`` (0-based)."""

    step: int
    epoch: int
    example: str
    input_ids: np.ndarray


class _Full(Exception):
    """The spool has no room for a file now (its bytes would pass the bound)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


def disk_bytes(root: Path) -> int:
    """The bytes on disk under every ``spool`` folder below ``root`` (a data directory's
    ``runs``; files and temporaries alike), as an observer outside the run counts them:
    the tests and ``bench/stream.py`` hold a run's spool to its bound by it."""
    total = 0
    for folder, _, names in os.walk(root):
        if "spool" not in Path(folder).parts:
            continue
        for name in names:
            with contextlib.suppress(OSError):  # renamed or removed meanwhile
                total += os.stat(os.path.join(folder, name)).st_size
    return total


class Spool:
    """A rank's spool folder and its byte count, bound by ``size``."""

    def __init__(self, root: Path, size: int) -> None:
        self.root = Path(root)
        self.size = size
        self.store = _SpoolStore(self)
        self.cond = threading.Condition()
        #: Bytes of the files in the folder, and of the captures in flight (reserved).
        self.used = 0
        self.reserved = 0
        #: The files in the folder, path → bytes.
        self.held: dict[str, int] = {}
        #: The most bytes held and reserved at once.
        self.high_water = 0

    def scan(self, referenced: dict[str, int]) -> list[str]:
        """Keep the files the ledger's rows name, remove any other (a capture killed
        between its file and its row, a temporary file); returns the named ones missing."""
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.store.leftovers():
            tmp.unlink(missing_ok=True)
        for path in sorted(self.root.glob("*/*.safetensors")):
            if str(path.relative_to(self.root)) not in referenced:
                path.unlink(missing_ok=True)
        missing = [p for p in referenced if not (self.root / p).is_file()]
        with self.cond:
            self.held = {p: n for p, n in referenced.items() if p not in missing}
            self.used = sum(self.held.values())
            self.high_water = max(self.high_water, self.used)
        return missing

    def reserve(self, nbytes: int) -> bool:
        """Room for a file of ``nbytes`` (a capture about to be sent); False: none now."""
        with self.cond:
            if self.used + self.reserved + nbytes > self.size:
                return False
            self.reserved += nbytes
            self.high_water = max(self.high_water, self.used + self.reserved)
            return True

    def unreserve(self, nbytes: int) -> None:
        with self.cond:
            self.reserved -= nbytes
            self.cond.notify_all()

    def admit(self, relative: str, nbytes: int, reserved: int) -> bool:
        """A file of ``nbytes`` to be written in place of a reservation of ``reserved``:
        whether it is new (False: the same content is there already); raises
        :class:`_Full` (nothing written) when it would pass the bound."""
        with self.cond:
            if relative in self.held:
                self.reserved -= reserved
                self.cond.notify_all()
                return False
            if self.used + self.reserved - reserved + nbytes > self.size:
                raise _Full(nbytes)
            self.used += nbytes
            self.reserved -= reserved
            self.held[relative] = nbytes
            self.high_water = max(self.high_water, self.used + self.reserved)
            return True

    def remove(self, relative: str) -> int:
        """Delete a file; the bytes freed."""
        (self.root / relative).unlink(missing_ok=True)
        with self.cond:
            freed = self.held.pop(relative, 0)
            self.used -= freed
            self.cond.notify_all()
        return freed


class _SpoolStore(Store):
    """The capture's store, bound by its spool: a file is admitted (its bytes counted
    against the bound) before it is written; a full disk is one line."""

    def __init__(self, spool: Spool) -> None:
        super().__init__(spool.root)
        self.spool = spool
        self.local = threading.local()

    def put(self, data: bytes) -> Stored:
        import hashlib

        digest = hashlib.sha256(data).hexdigest()
        relative = f"{digest[:2]}/{digest}.safetensors"
        new = self.spool.admit(relative, len(data), getattr(self.local, "reserved", 0))
        self.local.reserved = 0
        if not new:  # written whole already (a second copy would pass the bound a moment)
            return Stored(relative, digest, len(data))
        try:
            return super().put(data)
        except OSError as exc:
            self.spool.remove(relative)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HandBack(f"the disk under the spool {self.spool.root} is full "
                               f"({exc.strerror}): an example's features needed "
                               f"{len(data):,} bytes ({human(len(data))}) there; free space "
                               "there (or lower --spool) and rerun the same `synthq train`: "
                               "the run resumes from its last checkpoint") from None
            raise


class _Measure(Store):
    """A store that keeps nothing: the probe's file, measured."""

    def __init__(self) -> None:
        super().__init__(Path("/nonexistent"))
        self.nbytes = 0

    def put(self, data: bytes) -> Stored:
        self.nbytes = len(data)
        return Stored("", "", len(data))


@dataclass(frozen=True, slots=True)
class Probe:
    """What one capture of a short example showed: each server, and a file's size."""

    engines: dict[str, Engine]
    tokens: int
    nbytes: int
    hidden: int
    dtype: str
    layers: int

    def estimate(self, tokens: int) -> int:
        """Bytes of the spool file of an example of ``tokens`` tokens (at most)."""
        per_token = self.layers * self.hidden * DTYPES.get(self.dtype, 4) + 8
        return self.nbytes + (tokens - self.tokens) * per_token + HEADER_SLACK


def _capture(client: Any, engine: Engine, ids: np.ndarray, name: str, *, job: Any,
             layers: list[int], store: Store, metadata: dict[str, str], hidden: int | None,
             timeout: float, pins: confine.Pins) -> ingest.Ingested:
    """One example's capture: the capture stage's request and checks, into ``store``."""
    settings = get_settings()
    deadline = time.monotonic() + timeout + settings.capture_file_timeout
    engine_file = _call(client, engine, ids.tolist(), name,
                        (job.capture_files or {}).get(engine.url), deadline=min(
                            deadline, time.monotonic() + timeout), pins=pins)
    try:
        ingest.wait_whole(engine_file, timeout=settings.capture_file_timeout,
                          deadline=deadline)
        return ingest.ingest_parts([engine_file], [ids], layers=layers, dtype=job.capture_dtype,
                                   store=store, metadata=metadata, hidden=hidden)
    finally:
        ingest.discard(engine_file)
        engine_file.folder.close()


def probe(job: Any, servers: Sequence[str], layers: list[int], ids: np.ndarray, *,
          hidden: int | None, timeout: float) -> Probe:
    """At the run's start: each capture server describes itself and captures ``ids`` (a
    short example) once; a server without ``extract_hidden_states`` or the connector, or
    that captures other layers than the run's, is refused with one line."""
    engines: dict[str, Engine] = {}
    measured = None
    with watched_client(auth=server_key) as client:
        pins = confine.Pins()
        for url in servers:
            engine = describe(client, url, deadline=time.monotonic() + timeout)
            store = _Measure()
            try:
                got = _capture(client, engine, ids, f"synthq-probe-{job.id}-{os.getpid()}",
                               job=job, layers=layers, store=store,
                               metadata={"job": job.name, "example": "probe"},
                               hidden=hidden, timeout=timeout, pins=pins)
            except ingest.OtherLayers as exc:  # the one line names both lists
                raise UserError(f"capture server {url} cannot stream this run's features: "
                                f"{exc}") from None
            except SampleError as exc:
                raise UserError(f"capture server {url} cannot stream this run's features "
                                f"(layers {layers}): {exc.error_class}: {exc}") from None
            engines[url] = engine
            measured = Probe({}, len(ids), store.nbytes, got.hidden_size, got.dtype,
                             len(layers))
    assert measured is not None
    return Probe(engines, measured.tokens, measured.nbytes, measured.hidden, measured.dtype,
                 measured.layers)


class StreamCapture(threading.Thread):
    """The rank's capture, ahead of its trainer (see the module's docstring)."""

    def __init__(self, *, run_id: int, rank: int, job: Any, probe: Probe, layers: list[int],
                 spool: Spool, order: list[Slot], epochs: dict[int, list[str]],
                 say: Callable[[str], None], timeout: float) -> None:
        super().__init__(daemon=True, name=f"synthq-spool-{rank}")
        self.run_id, self.rank, self.job, self.probe = run_id, rank, job, probe
        self.layers, self.spool, self.order, self.epochs = layers, spool, order, epochs
        self.say, self.timeout = say, timeout
        self.stop = threading.Event()
        #: The index in :attr:`order` of the trainer's next example (the trainer sets it).
        self.position = 0
        #: The index of the next example this capture looks at.
        self.ahead = 0
        #: (epoch, example) whose file is in the spool for the trainer.
        self.ready: set[tuple[int, str]] = set()
        #: Waiting for room that only a committed checkpoint can free.
        self.stalled = False
        self.error: BaseException | None = None
        #: Captures this thread sent, and files it offered again uncaptured.
        self.captured = 0
        self.kept = 0
        self._next_use = self._uses()
        self._added: set[int] = set()
        self._servers = list(probe.engines.values())
        self._turn = 0
        self._down: set[str] = set()
        self.pins = confine.Pins()
        #: This thread as a worker (its heartbeat is the lease of the calls it holds).
        self.worker = workers.new_name()
        #: Whether it said that its servers are at their capture limit (once).
        self.said_full = False
        #: Times it found every server at its capture limit.
        self.full_waits = 0

    def _uses(self) -> dict[str, list[int]]:
        uses: dict[str, list[int]] = {}
        for i, slot in enumerate(self.order):
            uses.setdefault(slot.example, []).append(i)
        return uses

    # -- the trainer's side -------------------------------------------------------------
    def lead(self) -> int:
        """Examples in the spool ahead of the trainer."""
        with self.spool.cond:
            return sum(1 for s in self.order[self.position:self.ahead]
                       if (s.epoch, s.example) in self.ready)

    def wake(self) -> None:
        with self.spool.cond:
            self.stalled = False
            self.spool.cond.notify_all()

    # -- the thread ---------------------------------------------------------------------
    def run(self) -> None:
        beating = threading.Event()
        beats = threading.Thread(target=self._beat, args=(beating,), daemon=True,
                                 name=f"synthq-spool-beat-{self.rank}")
        try:
            self._beat_once()
            beats.start()
            self._walk()
        except BaseException as exc:  # the trainer raises it (UserError: its one line)
            self.error = exc
        finally:
            beating.set()
            if beats.is_alive():
                beats.join(timeout=10)
            try:
                with session_scope() as s:
                    workers.unregister(s, self.worker)
            except Exception:  # its row is pruned in time; the run's own error comes first
                log.warning("stream: could not unregister worker %s", self.worker,
                            exc_info=True)
            with self.spool.cond:
                self.spool.cond.notify_all()

    def _beat_once(self) -> None:
        with session_scope() as s:
            workers.heartbeat(s, self.worker, capacity=0, inflight=0)

    def _beat(self, done: threading.Event) -> None:
        """The worker row's heartbeat while the thread runs (a call may take minutes)."""
        every = get_settings().heartbeat_interval
        while not done.wait(every):
            try:
                self._beat_once()
            except Exception:  # a database blip: the next beat tries again
                log.warning("stream: heartbeat of %s failed", self.worker, exc_info=True)

    def _walk(self) -> None:
        self.ahead = self.position
        with session_scope() as s:  # an earlier holder's calls in flight are nobody's now
            spool_rows.take_back_captures(s, self.run_id, self.rank, now=utcnow())
        rows: dict[tuple[int, str], spool_rows.Item] = {}
        while self.ahead < len(self.order) and not self.stop.is_set():
            slot = self.order[self.ahead]
            if slot.epoch not in self._added:
                rows.update(self._epoch(slot.epoch))
            row = rows[(slot.epoch, slot.example)]
            if row.state != spool_rows.SPOOL.waiting:
                if row.state in (spool_rows.SPOOL.offered, spool_rows.SPOOL.held):
                    self._ready(slot)
                self.ahead += 1
                continue
            self._fill(slot, row)
            rows.pop((slot.epoch, slot.example))
            self.ahead += 1

    def _epoch(self, epoch: int) -> dict[tuple[int, str], spool_rows.Item]:
        with session_scope() as s:
            spool_rows.add_epoch(s, self.run_id, self.rank, epoch, self.epochs[epoch],
                                 now=utcnow())
            got = spool_rows.items(s, self.run_id, rank=self.rank, epoch=epoch)
        self._added.add(epoch)
        return {(epoch, r.example): r for r in got}

    def _ready(self, slot: Slot) -> None:
        with self.spool.cond:
            self.ready.add((slot.epoch, slot.example))
            self.spool.cond.notify_all()

    def _fill(self, slot: Slot, row: spool_rows.Item) -> None:
        """The slot's file into the spool (kept from an earlier epoch, or captured), and its
        row offered."""
        kept = self._kept(slot.example)
        if kept is not None:
            path, nbytes = kept
            with session_scope() as s:
                spool_rows.offer(s, row.id, path=path, nbytes=nbytes, captured=False,
                                 now=utcnow())
            self.kept += 1
            self._ready(slot)
            return
        need = self.probe.estimate(len(slot.input_ids))
        if need > self.spool.size:
            raise UserError(f"--spool is too small: example {slot.example}'s features take "
                            f"{human(need)}, over this rank's spool of "
                            f"{human(self.spool.size)}")
        self._room(need)
        self._capture(slot, row, need)
        self.captured += 1
        self._ready(slot)

    def _kept(self, example: str) -> tuple[str, int] | None:
        """A file of ``example`` the spool still holds (for an earlier epoch's row, trained
        on or not: a row only names it, and it stays while any row needs it)."""
        with session_scope() as s:
            mine = spool_rows.files(s, self.run_id, self.rank, example)
        for r in mine:
            if r.path is not None and r.path in self.spool.held:
                return r.path, self.spool.held[r.path]
        return None

    def _room(self, need: int) -> None:
        """Reserve ``need`` bytes: evict files no longer needed, else wait for a commit."""
        while not self.spool.reserve(need):
            if self.stop.is_set():
                raise _Stopped()
            if self._evict():
                continue
            with self.spool.cond:
                self.stalled = True
                self.spool.cond.notify_all()
                self.spool.cond.wait(0.5)
        with self.spool.cond:
            self.stalled = False

    def _evict(self) -> bool:
        """Remove the file no longer needed whose next use is the farthest (never: first);
        whether one was."""
        with session_scope() as s:
            rows = spool_rows.files(s, self.run_id, self.rank)
        by_path: dict[str, list[spool_rows.Item]] = {}
        for r in rows:
            assert r.path is not None
            by_path.setdefault(r.path, []).append(r)
        free = [p for p, rs in by_path.items()
                if all(r.state == spool_rows.SPOOL.done for r in rs)]
        if not free:
            return False

        def next_use(path: str) -> float:
            later = [i for i in self._next_use.get(by_path[path][0].example, [])
                     if i >= self.ahead]
            return later[0] if later else float("inf")

        victim = max(free, key=next_use)
        self.spool.remove(victim)
        with session_scope() as s:
            spool_rows.forget_file(s, [r.id for r in by_path[victim]], now=utcnow())
        return True

    def _capture(self, slot: Slot, row: spool_rows.Item, reserved: int) -> Stored:
        """The slot's capture, each call within its server's capture limit, retried while
        its servers do not answer (nothing is skipped), its file offered; a wrong answer
        stops the run with one line. ``reserved``: the bytes :meth:`_room` reserved for it
        (released here when no file took them)."""
        polls = 0
        store = self.spool.store
        try:
            while True:
                if self.stop.is_set():
                    raise _Stopped()
                engine, token = self._slot(row)
                store.local.reserved = reserved
                try:
                    got = self._call(engine, slot, store)
                except _Full as full:  # over the estimate: room for its real size, again
                    self._release(row, token)
                    self.spool.unreserve(reserved)
                    reserved = store.local.reserved = 0
                    self._room(full.nbytes)
                    reserved = full.nbytes
                    continue
                except SampleError as exc:
                    if not exc.retryable:
                        with session_scope() as s:
                            spool_rows.fail_capture(s, row.id, token=token,
                                                    error_class=exc.error_class,
                                                    error_message=str(exc), now=utcnow())
                        raise UserError(f"capture server {engine.url} failed example "
                                        f"{slot.example}: {exc.error_class}: {exc}") from None
                    self._release(row, token)
                    if engine.url not in self._down:
                        self._down.add(engine.url)
                        self.say(f"stream: capture server {engine.url} does not answer "
                                 f"({exc.error_class}: {str(exc)[:200]}); retrying, nothing "
                                 "is skipped")
                    polls += 1
                    self.stop.wait(exponential(polls, base=0.5, cap=5.0))
                    continue
                except BaseException:  # a full disk's line, a stop: the slot is free again
                    self._release(row, token)
                    raise
                with session_scope() as s:
                    spool_rows.captured(s, row.id, token=token, path=got.stored.path,
                                        nbytes=got.stored.bytes, now=utcnow())
                if engine.url in self._down:
                    self._down.discard(engine.url)
                    self.say(f"stream: capture server {engine.url} answers again")
                return got.stored
        finally:
            if store.local.reserved:  # no file took the reservation
                store.local.reserved = 0
                self.spool.unreserve(reserved)

    def _call(self, engine: Engine, slot: Slot, store: Store) -> ingest.Ingested:
        with watched_client(auth=server_key) as client:
            return _capture(client, engine, slot.input_ids,
                            f"synthq-spool-{self.run_id}-{self.rank}-{slot.epoch}-"
                            f"{slot.example.replace(':', '_')}-{os.getpid()}",
                            job=self.job, layers=self.layers, store=store,
                            metadata={"job": self.job.name, "run": str(self.run_id),
                                      "example": slot.example},
                            hidden=self.probe.hidden, timeout=self.timeout,
                            pins=self.pins)

    def _slot(self, row: spool_rows.Item) -> tuple[Engine, str]:
        """A slot of a capture server's limit for ``row``'s call (the servers in turn): its
        engine and the call's claim token. While every server is at its limit, it waits
        (saying so once) and frees what dead holders left there (no tick may run beside
        a streamed run)."""
        limit = int(self.job.capture_limit)
        lease = spool_rows.CAPTURE.lease_seconds(self.timeout)
        polls = 0
        while True:
            for _ in self._servers:
                engine = self._servers[self._turn % len(self._servers)]
                self._turn += 1
                token = secrets.token_hex(8)
                with session_scope() as s:
                    if spool_rows.start_capture(s, row.id, server=engine.url, limit=limit,
                                                token=token, worker=self.worker, lease=lease,
                                                now=utcnow()):
                        return engine, token
            if self.stop.is_set():
                raise _Stopped()
            self.full_waits += 1
            if not self.said_full:
                self.said_full = True
                self.say(f"stream: capture server(s) {', '.join(e.url for e in self._servers)} "
                         f"at their capture limit ({limit} calls each, shared with `synthq "
                         "capture` and every rank); waiting for a slot, nothing is skipped")
            timeout = get_settings().worker_timeout
            with session_scope() as s:  # as the tick's sweep would: dead holders' calls
                now = utcnow()
                spool_rows.expire_captures(s, now=now, worker_timeout=timeout)
                capture_states.expire(s, now=now, worker_timeout=timeout)
            polls += 1
            self.stop.wait(exponential(polls, base=0.1, cap=1.0))

    def _release(self, row: spool_rows.Item, token: str) -> None:
        with session_scope() as s:
            spool_rows.release_capture(s, row.id, token=token, now=utcnow())


class _Stopped(Exception):
    """The trainer stopped the capture."""
