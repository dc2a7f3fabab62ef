"""The capture stage: claim due captures, ask the engine, check and store the files.

One :class:`Stage` runs in one process (``synthq capture JOB``, the embedded
``synthq run`` once generation ends, or a Celery ``capture`` task). Several may
run at once against the same job and servers: each claim is taken under the
server's lock (synthq.queue.capture_states), so the running captures on a server
never exceed the job's ``capture_limit``. The process heart-beats as a worker
with no generation capacity; when it dies its running captures go back to
pending at the next sweep (or at once, for the embedded SQLite file, whose
lock the next run holds).

Each capture sends the sample's own ``input_ids`` as the prompt (token ids,
``max_tokens: 1``) so the captured rows align one to one with its loss mask. A
sample of several examples (``--examples per-turn``) holds their ids end to end:
each example is sent as its own prompt (one request each, as it was served), and
their files are stored end to end as the sample's one file (synthq.capture.ingest).

A server that fails ``stop_after`` captures in a row the same way (``bad_request``,
``capture_mismatch``: it is misconfigured, and each call costs it a prefill) stops
the stage (synthq.queue.streaks): one line naming the server and the cause, kept in
``jobs.capture_stopped`` until ``synthq capture JOB --retry-failed``.

A server that stops serving (a restart: its cold start takes minutes) is seen by the
rule generation's dispatch uses (synthq.queue.outage), over its calls in SQL
(``capture_calls``, so every capture process agrees): after ``TRIP_AFTER`` calls in a row
refused, timed out or answered 5xx, the claim gives it one capture at a time, a probe
every ``PROBE_INTERVAL`` seconds, and a capture whose call it never answered (refused,
timed out: its server computed nothing) is not charged, so a restart fails no capture; an
HTTP 5xx answer is charged, as generation charges it, so a server that answers 500 to
everything fails its captures after ``max_attempts`` rather than being probed for ever.
The first probe that goes through gives the server its whole limit back.

Every capture has one deadline, the capture timeout plus the file timeout from its
start, so it ends within its lease: each call's answer, headers and body in all
(synthq.capture.deadline: a server trickling its answer is cut there, ``timeout``),
and each wait for the engine's file. The check of a new job's capture servers
(:func:`check_answer`) is bounded the same way, in :data:`CHECK_SECONDS` in all.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from sqlalchemy import func, select

from synthq.capture import confine, ingest, inline
from synthq.capture.deadline import bounded
from synthq.capture.deadline import client as watched_client
from synthq.capture.plan import Plan, check_space, layers_for, target_config
from synthq.capture.progress import CaptureCounts, counts
from synthq.capture.progress import plan as progress_plan
from synthq.capture.protocol import NAME_KEY
from synthq.capture.store import Store
from synthq.core.defaults import store_root
from synthq.core.enums import CaptureState, JobState
from synthq.core.errors import (
    BadRequest,
    CaptureIncomplete,
    ConnectionFailed,
    InvalidInput,
    SampleError,
    ServerError,
    TimeoutError_,
    UserError,
)
from synthq.core.packing import unpack_ids
from synthq.data.examples import split
from synthq.queue import capture_states as states
from synthq.queue import jobs, ledger, outage, workers
from synthq.queue.outage import DOWN_OUTCOMES
from synthq.queue.streaks import CAPTURE_CLASSES, Streaks
from synthq.queue.sweep import sweep
from synthq.serving.inference import status_error
from synthq.spec.config import get_settings
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Capture, Job, Sample
from synthq.store.sqlread import reader_of

__all__ = ["Engine", "Stage", "Summary", "check_answer", "describe", "plan", "store",
           "summary"]

log = logging.getLogger(__name__)

#: Bytes of a capture response read at most (the answer is one token and a path).
MAX_BODY = 1 << 20


def store() -> Store:
    settings = get_settings()
    return Store(store_root(settings.capture_store, settings.data_dir))


@dataclass(frozen=True, slots=True)
class Engine:
    """A capture server as it describes itself."""

    url: str
    model: str
    #: ``vllm 0.32.0`` (``/version``), or ``unknown``.
    version: str


def _bounded_json(response: httpx.Response) -> Any:
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > MAX_BODY:
            raise ServerError(f"the server's answer is over {MAX_BODY} bytes")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise ServerError(f"the server's answer is not JSON: {bytes(body[:200])!r}") from exc


def server_key(request: httpx.Request) -> httpx.Request:
    """httpx auth: ``SYNTHQ_API_KEY`` on a request to a host ``SYNTHQ_ALLOWED_SERVERS``
    allows (any host when it is empty), as the generation calls send it; none elsewhere."""
    settings = get_settings()
    if settings.sends_key_to(str(request.url)):
        request.headers["Authorization"] = f"Bearer {settings.api_key}"
    return request


def _get(client: httpx.Client, url: str, deadline: float) -> Any:
    with bounded(client, "GET", url, deadline=deadline) as response:
        if response.status_code >= 400:
            raise ServerError(f"GET {url}: HTTP {response.status_code}")
        return _bounded_json(response)


def describe(client: httpx.Client, url: str, *, deadline: float | None = None) -> Engine:
    """The served model (``/v1/models``) and the engine's version (``/version``), both
    answered by ``deadline`` (``time.monotonic()``; default :data:`CHECK_SECONDS` from now)."""
    if deadline is None:
        deadline = time.monotonic() + CHECK_SECONDS
    try:
        models = _get(client, f"{url.rstrip('/')}/models", deadline)
        model = str(models["data"][0]["id"])
    except (httpx.HTTPError, SampleError, KeyError, IndexError, TypeError) as exc:
        hint = "" if url.rstrip("/").endswith("/v1") else " (is it the base URL, ending in /v1?)"
        raise UserError(f"capture server {url} does not list a model at /models{hint}: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from exc
    root = url.rstrip("/").removesuffix("/v1")
    try:
        version = f"vllm {_get(client, f'{root}/version', deadline)['version']}"
    except (httpx.HTTPError, SampleError, KeyError, TypeError):
        version = "unknown"
    return Engine(url, model, version)


def check_answer(urls: list[str]) -> list[Engine]:
    """Each capture server as it describes itself; a :class:`UserError` for the first that
    does not answer. Every way a job gets capture servers asks this before the job stores
    them (`synthq capture --server`, `--capture-server` of `synthq enqueue` and `synthq
    run`, ``POST /api/jobs``): a dead URL is refused, not kept as the job's.

    Bounded, so that it never holds an API worker for long (issue 41: 40 job creations
    naming a server that trickles its answer held every worker, and ``/ready`` went
    silent): all of ``urls`` within :data:`CHECK_SECONDS` in all, one check of a URL
    at a time in this process, its result shared by the calls that wait on it and
    kept :data:`CHECK_KEEP_S` for the calls that follow (:class:`_Checks`)."""
    deadline = time.monotonic() + CHECK_SECONDS
    return [_CHECKS.describe(url, deadline) for url in urls]


#: Seconds in all that the check of a new job's capture servers may take.
CHECK_SECONDS = 5.0
#: Seconds a check's result stands for the checks of the same URL that follow.
CHECK_KEEP_S = 5.0


class _Checks:
    """One check of a capture server at a time per URL (thread-safe): a caller waits for
    the check in flight, up to its own deadline, rather than send its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: URL → (when its last check ended, its Engine or its UserError).
        self._done: dict[str, tuple[float, Engine | UserError]] = {}
        self._running: dict[str, threading.Event] = {}

    def describe(self, url: str, deadline: float) -> Engine:
        while True:
            with self._lock:
                kept = self._done.get(url)
                if kept is not None and time.monotonic() - kept[0] < CHECK_KEEP_S:
                    return _result(kept[1])
                running = self._running.get(url)
                if running is None:
                    running = self._running[url] = threading.Event()
                    break
            if not running.wait(max(0.0, deadline - time.monotonic())):
                raise UserError(f"capture server {url} did not answer /models within "
                                f"{CHECK_SECONDS:g} s")
        result: Engine | UserError | None = None
        try:
            with watched_client(auth=server_key) as client:
                result = describe(client, url, deadline=deadline)
        except UserError as exc:
            result = exc
        finally:
            with self._lock:
                now = time.monotonic()
                for old in [u for u, (at, _) in self._done.items() if now - at >= CHECK_KEEP_S]:
                    del self._done[old]
                if result is not None:
                    self._done[url] = (now, result)
                self._running.pop(url).set()
        assert result is not None
        return _result(result)


def _result(kept: Engine | UserError) -> Engine:
    if isinstance(kept, UserError):
        raise UserError(str(kept))
    return kept


_CHECKS = _Checks()


def _call(client: httpx.Client, engine: Engine, input_ids: list[int], name: str,
          folder: str | None = None, *, deadline: float,
          pins: confine.Pins | None = None) -> confine.EngineFile:
    """One capture request, answered by ``deadline`` (``time.monotonic()``, headers and
    body in all); the engine's file, one this request may read and delete, its folder
    open (synthq.capture.confine: named by ``name`` in the one folder the server writes
    to, or inside ``folder``, the server's declared engine-files folder). Errors carry
    their class."""
    body = {"model": engine.model, "prompt": input_ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {NAME_KEY: name}}
    try:
        with bounded(client, "POST", f"{engine.url.rstrip('/')}/completions",
                     deadline=deadline, json=body) as response:
            if response.status_code >= 400:
                text = b"".join(_take(response.iter_bytes(), 4096)).decode("utf-8", "replace")
                raise status_error(response.status_code, text[:500], response.headers,
                                   body=text)
            answer = _bounded_json(response)
    except httpx.TimeoutException as exc:
        raise TimeoutError_(f"the capture request timed out: {exc}") from None
    except httpx.HTTPError as exc:
        raise ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
    try:
        path = Path(str(answer["kv_transfer_params"]["hidden_states_path"]))
    except (KeyError, TypeError) as exc:
        raise BadRequest("the server's answer has no kv_transfer_params.hidden_states_path: "
                         "start it with extract_hidden_states and a hidden-states connector") \
            from exc
    # The file is read and then deleted: only this request's is ever touched, whatever
    # path a server answers.
    return confine.accept(path, name=name, folder=folder, server=engine.url, pins=pins)


def _take(chunks: Any, limit: int) -> list[bytes]:
    out, n = [], 0
    for chunk in chunks:
        out.append(chunk[: limit - n])
        n += len(out[-1])
        if n >= limit:
            break
    return out


@dataclass(frozen=True, slots=True)
class Inline:
    """A sample whose final answer's call saved its states (``--capture inline``)."""

    #: The file's name (``samples.inline_capture``) and the server that wrote it.
    name: str
    server: str
    #: The call's prompt and output ids, as the engine returned them.
    engine_ids: np.ndarray
    #: When the sample was done (the file is late past the file timeout from then).
    answered_at: Any


def _inline_of(name: str | None, server: str | None, prompt_ids: bytes | None,
               output_ids: bytes | None, finished_at: Any) -> Inline | None:
    prompt, output = unpack_ids(prompt_ids), unpack_ids(output_ids)
    if not name or not server or prompt is None or output is None:
        return None
    return Inline(name, server, np.concatenate([prompt, output]), finished_at)


#: A job's captures summed (synthq.capture.progress.counts, what a status shows too).
Summary = CaptureCounts


def summary(session: Any, job_id: int) -> Summary:
    return counts(reader_of(session), job_id)


def plan(session: Any, job: Job, *, at: Store | None = None) -> Plan:
    """What the job's captures not yet done will take on disk."""
    return progress_plan(reader_of(session), job.id, job, free=(at or store()).free_bytes())


class Stage:
    """Runs a job's capture stage in this process until nothing is left to capture."""

    def __init__(self, job_id: int, *, stop: threading.Event | None = None,
                 say: Callable[[str], None] | None = None, reclaim_all: bool = False,
                 seconds: float | None = None) -> None:
        self.job_id = job_id
        self.stop = stop or threading.Event()
        self.say = say or log.info
        self.reclaim_all = reclaim_all
        #: Claim nothing new after this many seconds (a Celery task's share of the
        #: stage); None: run until nothing is left to capture.
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.name = workers.new_name()
        self.store = store()
        settings = get_settings()
        self.timeout = settings.capture_timeout
        # A connection per call: each call's socket is watched to its total deadline.
        self.client = watched_client(auth=server_key)
        #: Each server's folder when none is declared (synthq.capture.confine.Pins).
        self.pins = confine.Pins()
        #: The target's hidden size, when its config.json says (else the first stored
        #: file's): bounds each file's size (synthq.capture.ingest.largest_file).
        self.hidden: int | None = None
        #: Captures this process is running, and on which server.
        self.inflight: dict[Future[None], tuple[states.Claimed, str]] = {}
        self.pool: ThreadPoolExecutor | None = None
        #: Identical failures in a row per server; the line that stopped the stage.
        self.streaks = Streaks(CAPTURE_CLASSES, settings.stop_after)
        self.stopped: str | None = None
        #: The servers this process has said are down (the rule reads SQL: synthq.queue.
        #: outage), so that it says so once, and once when each answers again.
        self.down: set[str] = set()
        self._down_lock = threading.Lock()
        #: ``--capture inline``: each generation server's folder, found by the start's
        #: probe (synthq.capture.inline); empty for any other job.
        self.inline_folders: dict[str, Path] = {}
        #: Inline files that were missing, mismatched or late (their samples captured by
        #: calls), and the inline captures taken whole with no call.
        self.inline_fallbacks = 0
        self.inline_taken = 0

    # -- setup -------------------------------------------------------------
    def prepare(self) -> tuple[Job, list[int], dict[str, Engine]]:
        with session_scope() as s:
            job = s.get(Job, self.job_id)
            if job is None:
                raise UserError(f"no job {self.job_id}")
            if job.state == JobState.CANCELLED:
                raise UserError(f"job {job.name} is cancelled: its captures do not run")
            if not job.capture_servers:
                raise UserError(f"job {job.name} has no capture server: pass --server URL")
            s.expunge(job)
        if job.capture_timeout is not None:  # the job's own (synthq capture --timeout)
            self.timeout = job.capture_timeout
        layers = layers_for(job)
        # Bounded like a capture call (a server that trickles /models stops no stage for
        # good), and as long: an engine busy with prefills may be slow to list its model.
        engines = {url: describe(self.client, url, deadline=time.monotonic() + self.timeout)
                   for url in job.capture_servers}
        for url, folder in (job.capture_files or {}).items():  # the probe checks each
            if url in engines:
                confine.check_folder(url, folder)
        if job.capture_mode == "inline":  # each generation server captures: checked now
            self.inline_folders = {
                url: inline.probe(self.client, url, engines[url].model,
                                  folder=(job.capture_files or {}).get(url), pins=self.pins,
                                  seconds=self.timeout, layers=layers)
                for url in job.servers if url in engines}
            self._sweep_inline()
        with session_scope() as s:
            states.add_missing(s, self.job_id, now=utcnow())
            p = plan(s, job, at=self.store)
        config = target_config(job.train_target, job.tokenizer)
        if config is not None and isinstance(config.get("hidden_size"), int):
            self.hidden = int(config["hidden_size"])
        self.say(p.line())
        check_space(p, reserve=get_settings().capture_reserve_bytes)
        return job, layers, engines

    # -- the loop ----------------------------------------------------------
    def run(self) -> Summary:
        with session_scope() as s:
            stopped = s.scalar(select(Job.capture_stopped).where(Job.id == self.job_id))
            if stopped:  # a misconfigured server stopped it: nothing runs until the fix
                self.say(stopped)
                return summary(s, self.job_id)
        job, _, engines = self.prepare()
        settings = get_settings()
        lease = states.CAPTURES.lease_seconds(self.timeout)
        slots = job.capture_limit * len(engines)
        self.pool = pool = ThreadPoolExecutor(max_workers=slots,
                                              thread_name_prefix="synthq-capture")
        last_beat = 0.0
        try:
            with session_scope() as s:
                workers.heartbeat(s, self.name, capacity=0, inflight=0)
            if self.reclaim_all:  # this process holds the data directory: nothing else runs
                sweep(reclaim_all=True, job_ids=[self.job_id])
            while True:
                now_m = time.monotonic()
                if now_m - last_beat >= settings.heartbeat_interval:
                    last_beat = now_m
                    self._beat(len(self.inflight))
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.stop.set()
                if not self.stop.is_set() and self.stopped is None:
                    self._fill(job, engines, lease)
                if not self.inflight:
                    with session_scope() as s:
                        left = summary(s, self.job_id)
                        due_later = s.scalar(select(func.min(Capture.next_attempt_at)).where(
                            Capture.job_id == self.job_id,
                            Capture.state == CaptureState.PENDING))
                        cancelled = s.scalar(select(Job.state).where(
                            Job.id == self.job_id)) == JobState.CANCELLED
                    if cancelled and left.open:  # its claims are refused from now on
                        self.say(f"job {job.name} was cancelled: capture stopped with "
                                 f"{left.open} captures not run")
                    if self.stop.is_set() or self.stopped is not None or not left.open \
                            or cancelled:
                        return left
                    # Pending but not due (backing off), or running in another process.
                    pause = 0.5
                    if due_later is not None:
                        pause = min(2.0, max(0.05, (due_later - utcnow()).total_seconds()))
                    with session_scope() as s:
                        probe = states.next_probe_s(s, list(engines), now=utcnow())
                    if probe is not None:  # due, but their servers are down: the probe
                        pause = max(pause, min(2.0, probe))
                    self.stop.wait(pause)
                    continue
                finished, _ = wait(list(self.inflight), timeout=1.0,
                                   return_when=FIRST_COMPLETED)
                for fut in finished:
                    self.inflight.pop(fut)
                    fut.result()  # _one records every outcome itself; this surfaces bugs
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if self.inline_taken or self.inline_fallbacks:
                self.say(f"capture inline: {self.inline_taken} taken from their answers' own "
                         f"calls, {self.inline_fallbacks} captured by calls (their files "
                         "missing, mismatched or late)")
            with session_scope() as s:
                workers.unregister(s, self.name)
            self.client.close()

    def _beat(self, inflight: int) -> None:
        """Heartbeat, then the sweep (stopped processes' captures are due again: a
        ``synthq capture`` may run where no tick does), then new done samples' captures."""
        with session_scope() as s:
            workers.heartbeat(s, self.name, capacity=0, inflight=inflight)
        expired = sweep(job_ids=[self.job_id])
        with session_scope() as s:
            states.add_missing(s, self.job_id, now=utcnow())
        self._sweep_inline()
        if expired:
            self.say(f"capture: {expired} held by stopped processes are due again")

    def _fill(self, job: Job, engines: dict[str, Engine], lease: float) -> None:
        for url, engine in engines.items():
            if self.streaks.holds(url, time.monotonic()) is not None:
                continue  # it stopped the stage (its line may not be written yet)
            mine = sum(1 for _, on in self.inflight.values() if on == url)
            room = job.capture_limit - mine  # the claim holds the server's (and a probe's)
            if room <= 0:
                continue
            token = secrets.token_hex(8)
            with session_scope() as s:
                claimed = states.claim(s, self.job_id, server=url, limit=job.capture_limit,
                                       most=room, worker=self.name, token=token, lease=lease,
                                       now=utcnow())
                rows = s.execute(select(
                    Sample.id, Sample.input_ids, Sample.examples, Sample.inline_capture,
                    Sample.server, Sample.prompt_token_ids, Sample.completion_token_ids,
                    Sample.finished_at).where(
                    Sample.id.in_([c.sample_id for c in claimed]))).all() if claimed else []
                ids = {r[0]: (bytes(r[1]) if r[1] is not None else None, r[2],
                              _inline_of(*r[3:])) for r in rows}
            assert self.pool is not None
            for c in claimed:
                raw, examples, made = ids.get(c.sample_id, (None, None, None))
                fut = self.pool.submit(self._one, job, engine, c, raw, examples, made)
                self.inflight[fut] = (c, url)

    def _one(self, job: Job, engine: Engine, claimed: states.Claimed,
             raw_ids: bytes | None, examples: list[dict[str, Any]] | None = None,
             made: Inline | None = None) -> None:
        """One capture, start to recorded outcome. Never raises for a capture's own fault.

        ``examples`` (``samples.examples``): the sample holds several examples end to
        end; each is sent as its own prompt. ``made``: the final answer's call saved
        the states itself (``--capture inline``): the examples it covers are taken from
        its file, and only the others (or all, where the file is missing, mismatched or
        late) are sent."""
        layers = layers_for(job)
        engine_files: list[confine.EngineFile] = []
        called: dict[int, confine.EngineFile] = {}
        settings = get_settings()
        # The whole capture ends by this (every call's answer, every file's wait), so
        # within its lease: it is never sent again while this process still runs it.
        deadline = time.monotonic() + self.timeout + settings.capture_file_timeout
        try:
            if raw_ids is None:
                raise CaptureIncomplete("the sample has no input_ids (retokenized?)")
            input_ids = np.frombuffer(raw_ids, dtype="<i4")
            try:
                pieces = [ids for ids, _ in split(input_ids, input_ids, examples)]
            except ValueError as exc:
                raise InvalidInput(f"the sample's examples do not fit its ids: {exc}") \
                    from exc
            taken: list[inline.Piece] = [None] * len(pieces)
            if made is not None:
                taken = self._take_inline(job, claimed, made, pieces, layers, deadline)
            name = f"synthq-{job.id}-{claimed.sample_id}-{claimed.token}"
            for k, piece in enumerate(pieces):
                if taken[k] is not None:
                    continue
                called[k] = _call(self.client, engine, piece.tolist(),
                                  name if len(pieces) == 1 else f"{name}-{k}",
                                  (job.capture_files or {}).get(engine.url),
                                  deadline=min(deadline, time.monotonic() + self.timeout),
                                  pins=self.pins)
                engine_files.append(called[k])
            for engine_file in engine_files:
                ingest.wait_whole(engine_file, timeout=settings.capture_file_timeout,
                                  deadline=deadline)
            parts: list[tuple[Any, np.ndarray]] = []
            for k, piece in enumerate(pieces):
                from_file = taken[k]
                parts.append(from_file if from_file is not None else (ingest.check(
                    called[k], input_ids=piece, layers=layers, hidden=self.hidden), piece))
            metadata = {"engine": engine.version, "model": engine.model, "job": job.name,
                        "sample_id": str(claimed.sample_id)}
            if made is not None:
                metadata["inline_examples"] = str(sum(t is not None for t in taken))
            got = ingest.store_parts([t for t, _ in parts], [ids for _, ids in parts],
                                     layers=layers, dtype=job.capture_dtype,
                                     store=self.store, metadata=metadata)
        except SampleError as exc:
            self._record_failure(job, claimed, engine.url, exc)
            return
        except Exception as exc:  # a bug of ours: counted, classed, backed off, never a loop
            log.exception("capture of sample %d failed", claimed.sample_id)
            self._record_failure(job, claimed, engine.url,
                                 ServerError(f"{type(exc).__name__}: {exc}"))
            return
        finally:
            for engine_file in engine_files:
                ingest.discard(engine_file)
                engine_file.folder.close()
        with session_scope() as s:
            now = utcnow()
            if called:  # an inline capture taken whole made no call: none is recorded
                states.record_call(s, claimed.capture_id, server=engine.url, outcome="ok",
                                   error_message=None, now=now)
            won = states.done(s, claimed, now=now, path=got.stored.path,
                              sha256=got.stored.sha256, nbytes=got.stored.bytes,
                              num_tokens=got.num_tokens, layer_ids=layers,
                              dtype=got.dtype, engine=engine.version,
                              engine_model=engine.model)
        self.streaks.ok(engine.url)
        self._seen(engine.url, down=False)
        if self.hidden is None:  # the engine's own, checked: bounds the next files' size
            self.hidden = got.hidden_size
        if not won:
            log.warning("capture of sample %d: its claim was lost (lease expired) before "
                        "it was recorded", claimed.sample_id)

    def _take_inline(self, job: Job, claimed: states.Claimed, made: Inline,
                     pieces: list[np.ndarray], layers: list[int],
                     deadline: float) -> list[inline.Piece]:
        """The pieces the final answer's own file covers (synthq.capture.inline.take); all
        None where the file is missing, mismatched or late (said in the log; the stage's
        calls capture them). The engine's file is deleted either way."""
        none: list[inline.Piece] = [None] * len(pieces)
        folder = self.inline_folders.get(made.server)
        if folder is None:
            self._fell_back(claimed, f"its server {made.server} is no capture server")
            return none
        # Late: not whole within the file timeout of the answer (the engine writes it as
        # the call ends), whatever is left of this capture's own deadline.
        since = (utcnow() - made.answered_at).total_seconds() if made.answered_at else 0.0
        by = min(deadline, time.monotonic() + max(
            0.0, get_settings().capture_file_timeout - since))
        try:
            engine_file = confine.accept(folder / f"{made.name}.safetensors", name=made.name,
                                         folder=(job.capture_files or {}).get(made.server),
                                         server=made.server, pins=self.pins)
        except SampleError as exc:
            self._fell_back(claimed, str(exc))
            return none
        try:
            taken = inline.take(engine_file, made.engine_ids, pieces, layers=layers,
                                hidden=self.hidden, deadline=by)
        except SampleError as exc:
            self._fell_back(claimed, f"{exc.error_class}: {exc}")
            return none
        finally:
            ingest.discard(engine_file)
            engine_file.folder.close()
        if all(t is not None for t in taken):
            with self._down_lock:
                self.inline_taken += 1
        return taken

    def _sweep_inline(self) -> None:
        """Delete the job's inline files that no sample names (their calls' answers were
        not kept), once older than the file timeout (synthq.capture.inline.orphans)."""
        older = get_settings().capture_file_timeout
        for folder in set(self.inline_folders.values()):
            names = inline.orphans(folder, self.job_id, older_than=older)
            if not names:
                continue
            with session_scope() as s:
                named = set(s.scalars(select(Sample.inline_capture).where(
                    Sample.job_id == self.job_id, Sample.inline_capture.in_(names))))
            gone = [n for n in names if n not in named]
            try:
                inline.discard(folder, gone)
            except (OSError, SampleError) as exc:
                log.warning("capture inline: the unused files in %s were not deleted: %s",
                            folder, exc)
                continue
            if gone:
                log.info("capture inline: deleted %d files of answers not kept", len(gone))

    def _fell_back(self, claimed: states.Claimed, why: str) -> None:
        with self._down_lock:
            self.inline_fallbacks += 1
        log.info("capture of sample %d: its inline file is not taken (%s): captured by a "
                 "call", claimed.sample_id, why[:300])

    def _record_failure(self, job: Job, claimed: states.Claimed, server: str,
                        exc: SampleError) -> None:
        now = utcnow()
        message = str(exc)[:2000]
        # A file naming other layers than the job's: the engine's settings, not the
        # sample's; one is enough to stop (the calls after it would cost a prefill each).
        stop = self.streaks.failed(server, exc.error_class, message,
                                   at_once=isinstance(exc, ingest.OtherLayers))
        line = stop.line("capture", f"`synthq capture {job.name} --retry-failed`") \
            if stop is not None else None
        with session_scope() as s:
            # The call, then the rule over the server's latest calls (this one included).
            states.record_call(s, claimed.capture_id, server=server,
                               outcome=exc.error_class, error_message=message, now=now)
            down = states.server_down(s, server)
            # A down server is probed one capture at a time (the claim's room). A call it
            # never answered (refused, timed out: a restart computes nothing) is not
            # charged; one it answered (HTTP 5xx) is, as generation charges its probes: a
            # server that answers 500 to every capture fails them after max_attempts, not
            # probed for ever.
            free = down and exc.error_class in DOWN_OUTCOMES
            if line is not None:  # already stopped by another process: kept as it is
                jobs.set_capture_stopped(s, job.id, line, now=now)
            delay = ledger.retry_or_fail(states.CAPTURES, exc, claimed.attempts, job)
            if free:  # the server's outage: due at once, paced by the probes, not charged
                states.retry(s, claimed, now=now, error_class=exc.error_class,
                             error_message=message, next_attempt_at=now, charge=False)
            elif delay is not None:  # the server's Retry-After a floor
                states.retry(s, claimed, now=now, error_class=exc.error_class,
                             error_message=message,
                             next_attempt_at=now + timedelta(seconds=delay))
            else:
                states.fail(s, claimed, now=now, error_class=exc.error_class,
                            error_message=message)
        self._seen(server, down=down, message=message)
        # While its server is down, one line said so: each probe's failure is only debug
        # detail.
        log.log(logging.DEBUG if down else logging.WARNING, "capture of sample %d: %s: %s",
                claimed.sample_id, exc.error_class, message)
        if line is not None and self.stopped is None:
            # Claim nothing more; the calls in flight end and are recorded.
            self.stopped = line
            self.say(line)

    def _seen(self, server: str, *, down: bool, message: str = "") -> None:
        """Say once that a server is down (the rule's reading after a call), and once that
        it answers again."""
        with self._down_lock:
            new = down and server not in self.down
            back = not down and server in self.down
            if new:
                self.down.add(server)
            elif back:
                self.down.discard(server)
        if new:
            self.say(f"capture: server {server} is down ({message[:200]}); one capture at a "
                     f"time every {outage.PROBE_INTERVAL:g} s until it answers, not charged "
                     "while it does not answer at all")
        elif back:
            self.say(f"capture: server {server} answers again; its whole limit is back")
