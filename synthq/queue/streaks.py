"""Stop on a systematic failure: the same permanent failure, call after call, on one server.

A misconfigured server fails every call the same way: a capture server without
synthq's connector answers each capture with a file this request did not name
(``bad_request``), and each answer cost the engine a whole prefill; 176 samples,
176 identical failures (issue 30). Such a failure is the server's, not the sample's,
so after :data:`STOP_AFTER` of them in a row on one server (``SYNTHQ_STOP_AFTER``;
0 never stops) the stage stops with one line that names the server and the cause:

* **capture**: classes ``bad_request`` and ``capture_mismatch``; the job's capture
  stage is stopped (``jobs.capture_stopped``, shown by ``synthq status``, the API and
  the job page; the tick starts no stage for it). Resume after the fix:
  ``synthq capture JOB --retry-failed`` (it clears the stop and sends the failed
  captures again).
* **generation**: class ``bad_request``; the job is paused with that line as its
  reason. Resume after the fix: ``synthq resume JOB`` and
  ``synthq requeue JOB --failed --class bad_request``.

"Identical" compares the class and the message's shape: numbers, hex ids and quoted
names are blanked (each capture names its own file). Any success on the server
starts the count again. Each process counts its own calls.

Once a server's stage stops, the process sends it nothing more: a sample claimed
before the stop's write committed is given back uncalled (:meth:`Streaks.stopped`),
so the stop costs at most the calls already in flight. A claim whose statement began
after the stop's write committed saw the job paused, so a sample it returns means the
job was resumed: the stop is over (:meth:`Streaks.holds`).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, replace

from synthq.core.errors import FailureClass, Stage

__all__ = ["STOP_AFTER", "CAPTURE_CLASSES", "GENERATION_CLASSES", "Stop", "Streaks", "shape"]

#: Identical failures in a row on one server after which its stage stops.
STOP_AFTER = 5
#: The classes that say the server is misconfigured, per stage (each class's
#: :attr:`FailureClass.streak <synthq.core.errors.FailureClass.streak>`).
CAPTURE_CLASSES = frozenset(c for c in FailureClass if Stage.CAPTURE in c.streak)
GENERATION_CLASSES = frozenset(c for c in FailureClass if Stage.GENERATION in c.streak)

_VARIABLE = re.compile(r"'[^']*'|\"[^\"]*\"|\b[0-9a-f]{8,}\b|\d+")


def shape(message: str) -> str:
    """``message`` with what varies per call (numbers, hex ids, quoted names) blanked."""
    return _VARIABLE.sub("#", message)


@dataclass(frozen=True, slots=True)
class Stop:
    """A server that failed ``count`` calls in a row the same way."""

    server: str
    error_class: str
    message: str
    count: int
    #: ``time.monotonic()`` when the stop's write (the job paused) committed; None before.
    settled_at: float | None = None

    def line(self, what: str, resume: str) -> str:
        """``capture stopped: server URL failed 5 captures in a row with bad_request:
        MESSAGE; fix it, then RESUME``."""
        failed = f"{self.count} {what}s in a row" if self.count > 1 else f"a {what}"
        return (f"{what} stopped: server {self.server} failed {failed} "
                f"with {self.error_class}: {self.message[:300]}; fix it, then {resume}")


class Streaks:
    """Consecutive identical failures per server (thread-safe)."""

    def __init__(self, classes: frozenset[str], after: int = STOP_AFTER) -> None:
        self.classes = classes
        self.after = after
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[str, int]] = {}
        self._stopped: dict[str, Stop] = {}

    def ok(self, server: str) -> None:
        """A call on ``server`` went through: its count starts again."""
        with self._lock:
            self._runs.pop(server, None)

    def settled(self, server: str, at: float) -> None:
        """The stop on ``server`` is committed (``at``: ``time.monotonic()`` after the
        commit): claims that begin from now on see it."""
        with self._lock:
            stop = self._stopped.get(server)
            if stop is not None and stop.settled_at is None:
                self._stopped[server] = replace(stop, settled_at=at)

    def holds(self, server: str, claimed_at: float) -> Stop | None:
        """The stop that keeps a sample claimed at ``claimed_at`` (``time.monotonic()``
        before its claim statement) from being sent to ``server``: one not committed yet,
        or committed after that claim began. A claim begun after the commit saw the job
        paused, so its sample means the job was resumed: the stop ends."""
        with self._lock:
            stop = self._stopped.get(server)
            if stop is None:
                return None
            if stop.settled_at is None or claimed_at < stop.settled_at:
                return stop
            del self._stopped[server]
            self._runs.pop(server, None)
            return None

    def failed(self, server: str, error_class: str, message: str, *,
               at_once: bool = False) -> Stop | None:
        """Count a failed call; the :class:`Stop` when it is the ``after``-th identical one in
        a row (once: the calls in flight meanwhile do not stop it again with another
        count). Another class or message starts a new run. ``at_once``: this failure alone
        says the server is misconfigured (its file names other layers than the job's,
        synthq.capture.ingest.OtherLayers), so it stops the stage by itself (once)."""
        if self.after <= 0:
            return None
        if error_class not in self.classes:
            # A failure of another kind (a timeout, a sample's own fault) ends the run.
            self.ok(server)
            return None
        key = f"{error_class}\0{shape(message)}"
        with self._lock:
            last, n = self._runs.get(server, ("", 0))
            n = n + 1 if last == key else 1
            self._runs[server] = (key, n)
            if n != self.after and not (at_once and server not in self._stopped):
                return None
            stop = self._stopped[server] = Stop(server, error_class, message, n)
        return stop
