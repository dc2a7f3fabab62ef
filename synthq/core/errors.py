"""Every error synthq raises, in one tree.

::

    SynthqError
    ├── UserError                 bad CLI/API input: printed, never a traceback
    │   ├── DiskFull              the database's disk is full: stop, say where
    │   └── HandBack              the run cannot go on here now (a full disk under
    │                             its spool): handed back, the same command resumes it
    └── SampleError               one call for one sample went wrong (has a class)
        ├── RetryableError        back off and try again, up to max_attempts
        │   ├── TimeoutError_         total time budget spent          (timeout)
        │   ├── StalledError          no streamed chunk for too long   (stalled)
        │   ├── ConnectionFailed      refused, reset, DNS, broken stream (connection)
        │   ├── RateLimited           HTTP 429, honours Retry-After    (rate_limited)
        │   ├── ServerError           HTTP >= 500, or 408/409; honours (server_error)
        │   │                         Retry-After when it carries one
        │   ├── WorkerError           an unexpected error of synthq's  (worker_error)
        │   │                         own: retried, then failed
        │   └── Lost                  the holder stopped (kill -9, a   (lost)
        │                             lost lease) before it recorded
        │                             the call: a capture's expiry
        └── PermanentError        retrying cannot help: fail at once
            ├── BadRequest            HTTP 4xx other than below        (bad_request)
            ├── ContextLength         prompt + max_tokens over window  (context_length)
            ├── InvalidInput          the sample itself is unusable    (invalid_input)
            │   └── TokenizerCrashed      the tokenizer or template raised on it
            ├── Unstorable            the database refused the result  (unstorable)
            ├── EmptyResponse         the server answered nothing      (empty_response)
            ├── Truncated             finish_reason=length, not kept   (truncated)
            ├── ResponseTooLarge      answer over max_response_bytes   (response_too_large)
            ├── RequestTooLarge       request over max_request_bytes,  (request_too_large)
            │                         never sent
            ├── BoundaryUnstable      chat template renders unstably   (boundary_unstable)
            ├── MaskMismatch          mask fails its self-check        (mask_mismatch)
            ├── NoSupervisedTokens    nothing left after truncation    (no_supervised_tokens;
            │                         the sample ends skipped, not failed)
            └── CaptureMismatch       a captured file is not the       (capture_mismatch)
                                      sample's (token ids, shape)
        RetryableError also has CaptureIncomplete: the engine's file is missing,
        cut or fails its checksum (capture_incomplete).

``openai``/``httpx`` exceptions are converted at the boundary
(:mod:`synthq.serving.inference`) with ``raise ... from exc``.

Each class's policy (retryable, what it says about the server's load, whether it
says the server is down, which stage's streak it counts toward) is one row of
:data:`POLICY`, read through :class:`FailureClass`: the dispatcher's down rule, the
adaptive controller and the streaks read it there, not from lists of their own.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = [
    "SynthqError",
    "UserError",
    "DiskFull",
    "HandBack",
    "SampleError",
    "RetryableError",
    "PermanentError",
    "TokenizerCrashed",
    "Unstorable",
    "TimeoutError_",
    "StalledError",
    "ConnectionFailed",
    "RateLimited",
    "ServerError",
    "BadRequest",
    "ContextLength",
    "InvalidInput",
    "EmptyResponse",
    "Truncated",
    "ResponseTooLarge",
    "RequestTooLarge",
    "BoundaryUnstable",
    "MaskMismatch",
    "NoSupervisedTokens",
    "CaptureMismatch",
    "CaptureIncomplete",
    "WorkerError",
    "Lost",
    "OVERLOAD_CALLS_PER_ATTEMPT",
    "TOKENIZATION_CLASSES",
    "RETOKENIZABLE",
    "retokenizable",
    "RETRYABLE_CLASSES",
    "ALL_CLASSES",
    "PERMANENT_CLASSES",
    "brief",
    "FailureClass",
    "Load",
    "Down",
    "Stage",
    "Policy",
    "POLICY",
    "answered_status",
    "retry_after",
]


class SynthqError(Exception):
    """Base of every synthq error."""


class UserError(SynthqError):
    """Bad input from a user; the message says what to fix."""


class DiskFull(UserError):
    """The database's disk is full (SQLite "database or disk is full", PostgreSQL 53100).

    Not transient: retrying fills nothing. ``synthq run`` stops with this one line;
    workers stop claiming and hold the answers they have until space returns.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(f"disk full at {where}: free space and run the same command again")


class HandBack(UserError):
    """A training run stopped by where it runs, not by its data or settings (a full disk
    under its spool): its holder hands it back (pending, with this line as its reason)
    instead of failing it, so the same ``synthq train`` resumes it from its last
    checkpoint."""


class SampleError(SynthqError):
    """A call for one sample failed; ``error_class`` is stored on the sample."""

    error_class = "error"
    retryable = False

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or self.error_class).strip())


class RetryableError(SampleError):
    """A transient failure; the sample is retried after a backoff."""

    retryable = True
    #: Seconds the server asked us to wait (Retry-After), if it said.
    retry_after: float | None = None

    @property
    def overload(self) -> bool:
        """The server said "come back later" (429 or 5xx with Retry-After): it is busy,
        not broken, so the call is not charged to the sample's max_attempts (within
        :data:`OVERLOAD_CALLS_PER_ATTEMPT` times the budget)."""
        return self.retry_after is not None


class PermanentError(SampleError):
    """A failure that another attempt cannot fix."""


class TimeoutError_(RetryableError):
    """The call ran past the job's total timeout."""

    error_class = "timeout"


class StalledError(RetryableError):
    """No streamed chunk arrived within the job's stall timeout."""

    error_class = "stalled"


class ConnectionFailed(RetryableError):
    """The connection failed or broke before the response was complete."""

    error_class = "connection"


class RateLimited(RetryableError):
    """The server answered 429 Too Many Requests."""

    error_class = "rate_limited"

    def __init__(self, message: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServerError(RetryableError):
    """The server answered with a 5xx status."""

    error_class = "server_error"

    def __init__(self, message: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ResponseTooLarge(PermanentError):
    """The streamed answer exceeded the job's max_response_bytes."""

    error_class = "response_too_large"


class RequestTooLarge(PermanentError):
    """The request body exceeded SYNTHQ_MAX_REQUEST_BYTES; it was not sent."""

    error_class = "request_too_large"


class BadRequest(PermanentError):
    """The server rejected the request (4xx)."""

    error_class = "bad_request"


class ContextLength(PermanentError):
    """The prompt plus max_tokens does not fit the model's context window."""

    error_class = "context_length"


class InvalidInput(PermanentError):
    """The sample's prompt cannot be sent."""

    error_class = "invalid_input"


class TokenizerCrashed(InvalidInput):
    """The tokenizer or the chat template raised on this conversation (not one of the
    tokenization errors below): the row, as the template sees it, is unusable. The
    response stays stored, so ``synthq retokenize`` may try again with other settings."""


class Unstorable(PermanentError):
    """The database refused to store the result (a value it cannot hold, a constraint):
    retrying would be refused the same way. The message is the driver's, never the SQL."""

    error_class = "unstorable"


class EmptyResponse(PermanentError):
    """The server answered with no content at all."""

    error_class = "empty_response"


class Truncated(PermanentError):
    """The answer hit max_tokens (finish_reason=length) and the job drops truncated answers."""

    error_class = "truncated"


class BoundaryUnstable(PermanentError):
    """The chat template renders the prompt differently once the answer is appended."""

    error_class = "boundary_unstable"


class MaskMismatch(PermanentError):
    """The supervised tokens do not decode to the assistant text."""

    error_class = "mask_mismatch"


class NoSupervisedTokens(PermanentError):
    """Truncation to max_seq_len left no supervised token."""

    error_class = "no_supervised_tokens"


class CaptureMismatch(PermanentError):
    """The captured hidden states are not the sample's: other token ids, or another shape."""

    error_class = "capture_mismatch"


class CaptureIncomplete(RetryableError):
    """The engine's hidden-states file did not appear in time, is cut, or fails its checksum."""

    error_class = "capture_incomplete"


class WorkerError(RetryableError):
    """An unexpected error in the worker (a bug of synthq's, or an answer that sets one
    off): the call is given back after the job's backoff, and fails once its attempts
    are spent."""

    error_class = "worker_error"


class Lost(RetryableError):
    """The process that held it stopped (kill -9, or its lease passed) before it recorded
    the call; the sweep gave it back."""

    error_class = "lost"


#: An overload answer (Retry-After) is not charged to max_attempts, up to this many
#: calls per attempt of the budget in all: a server that says "later" for ever still
#: ends the sample (default 5 attempts: 20 calls, minutes of Retry-After).
OVERLOAD_CALLS_PER_ATTEMPT = 4

#: Failures of the tokenization step: the response is stored, only the
#: example is missing, so `retokenize` (not a new generation) repairs them.
TOKENIZATION_CLASSES = frozenset({"boundary_unstable", "mask_mismatch", "no_supervised_tokens",
                                  "invalid_input"})

#: The samples `retokenize` works on, of those whose response is stored: state → the
#: error classes it needs there (None: any). The one rule: ``synthq.jobs.retokenize``
#: selects by it in SQL, ``synthq.views.report`` counts by it (:func:`retokenizable`).
RETOKENIZABLE: dict[str, frozenset[str] | None] = {
    "done": None, "failed": TOKENIZATION_CLASSES, "skipped": TOKENIZATION_CLASSES}


def retokenizable(state: str, error_class: str | None) -> bool:
    """Whether `retokenize` works on a sample in ``state`` with ``error_class`` whose
    response is stored (:data:`RETOKENIZABLE`)."""
    if state not in RETOKENIZABLE:
        return False
    classes = RETOKENIZABLE[state]
    return classes is None or error_class in classes

def _classes(root: type[SampleError]) -> frozenset[str]:
    """The failure class of ``root`` and of every class below it (in this module)."""
    found, todo = set(), [root]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls is not root:
            found.add(cls.error_class)
    return frozenset(found)


#: A call's failure classes (docs/design.md, invariant 7).
RETRYABLE_CLASSES = frozenset(
    c.error_class for c in (TimeoutError_, StalledError, ConnectionFailed, RateLimited, ServerError)
)
PERMANENT_CLASSES = frozenset(
    c.error_class
    for c in (BadRequest, ContextLength, InvalidInput, EmptyResponse, Truncated, BoundaryUnstable,
              MaskMismatch, NoSupervisedTokens, ResponseTooLarge, RequestTooLarge, Unstorable)
)
#: Every failure class a sample or a capture can end with: each one a class of this
#: module (``worker_error`` and ``lost`` included), what ``requeue --class`` accepts.
ALL_CLASSES = _classes(SampleError)


class FailureClass(enum.StrEnum):
    """The failure classes (each the ``error_class`` of one class above), as stored in
    ``samples.error_class``, ``captures.error_class`` and ``attempts.outcome``. A member's
    properties are its row of :data:`POLICY`."""

    #: :class:`TimeoutError_`
    TIMEOUT = "timeout"
    #: :class:`StalledError`
    STALLED = "stalled"
    #: :class:`ConnectionFailed`
    CONNECTION = "connection"
    #: :class:`RateLimited`
    RATE_LIMITED = "rate_limited"
    #: :class:`ServerError`
    SERVER_ERROR = "server_error"
    #: :class:`WorkerError`
    WORKER_ERROR = "worker_error"
    #: :class:`Lost`
    LOST = "lost"
    #: :class:`CaptureIncomplete`
    CAPTURE_INCOMPLETE = "capture_incomplete"
    #: :class:`BadRequest`
    BAD_REQUEST = "bad_request"
    #: :class:`ContextLength`
    CONTEXT_LENGTH = "context_length"
    #: :class:`InvalidInput` (and :class:`TokenizerCrashed`)
    INVALID_INPUT = "invalid_input"
    #: :class:`Unstorable`
    UNSTORABLE = "unstorable"
    #: :class:`EmptyResponse`
    EMPTY_RESPONSE = "empty_response"
    #: :class:`Truncated`
    TRUNCATED = "truncated"
    #: :class:`ResponseTooLarge`
    RESPONSE_TOO_LARGE = "response_too_large"
    #: :class:`RequestTooLarge`
    REQUEST_TOO_LARGE = "request_too_large"
    #: :class:`BoundaryUnstable`
    BOUNDARY_UNSTABLE = "boundary_unstable"
    #: :class:`MaskMismatch`
    MASK_MISMATCH = "mask_mismatch"
    #: :class:`NoSupervisedTokens`
    NO_SUPERVISED_TOKENS = "no_supervised_tokens"
    #: :class:`CaptureMismatch`
    CAPTURE_MISMATCH = "capture_mismatch"

    @classmethod
    def of(cls, name: str | None) -> FailureClass | None:
        """The member stored as ``name``; None for an attempt that succeeded (``ok``),
        for no outcome, or for a name that is no failure class."""
        if name is None:
            return None
        try:
            return cls(name)
        except ValueError:
            return None

    @property
    def retryable(self) -> bool:
        """Another call may succeed: back off and retry, up to max_attempts."""
        return POLICY[self].retryable

    @property
    def load(self) -> Load:
        """What the failure tells the adaptive controller about the server's load."""
        return POLICY[self].load

    @property
    def down(self) -> Down:
        """Whether the failure counts toward the "server is down" rule."""
        return POLICY[self].down

    def says_down(self, message: str | None) -> bool:
        """Whether a call that failed with this class, and ``message``, says its server is
        not serving (:attr:`down`): always, only when it was answered with an HTTP 5xx
        (:func:`answered_status`), or never."""
        if self.down is Down.UNANSWERED:
            return True
        status = answered_status(message) if self.down is Down.HTTP_5XX else None
        return status is not None and status >= 500

    @property
    def streak(self) -> frozenset[Stage]:
        """The stages in which a run of these failures stops the server's stage
        (:mod:`synthq.queue.streaks`): it says the server is misconfigured."""
        return POLICY[self].streak


class Load(enum.StrEnum):
    """What a failed call says about its server's load (:mod:`synthq.serving.adaptive`)."""

    #: Too much load: the server said so (429) or broke under it (5xx): a sharp cut.
    OVERLOAD = "overload"
    #: The call timed out or stalled: a cut.
    TIMEOUT = "timeout"
    #: Nothing about load: the sample's own fault, synthq's, or a lost holder.
    NONE = "none"


class Down(enum.StrEnum):
    """Whether a failed call counts toward its server's "down" rule
    (:meth:`FailureClass.says_down`, :mod:`synthq.queue.outage`)."""

    #: The server did not serve it (refused, hanging, stalling): always, and a capture
    #: server's outage does not charge the capture.
    UNANSWERED = "unanswered"
    #: Only when the server answered with an HTTP 5xx status (an overloaded queue, a
    #: gateway); a broken stream of the same class does not count.
    HTTP_5XX = "http_5xx"
    #: Never: the server answered.
    NEVER = "never"


class Stage(enum.StrEnum):
    """The stages that call a server: each counts its own streaks."""

    GENERATION = "generation"
    CAPTURE = "capture"


@dataclass(frozen=True, slots=True)
class Policy:
    """One failure class's policy: every field decided, none defaulted."""

    retryable: bool
    load: Load
    down: Down
    streak: frozenset[Stage]


_NONE: frozenset[Stage] = frozenset()
_BOTH = frozenset({Stage.GENERATION, Stage.CAPTURE})
_CAPTURE = frozenset({Stage.CAPTURE})

#: Every failure class's policy, the one table that the callers read.
POLICY: dict[FailureClass, Policy] = {
    #                                  retryable  load           down             streak
    FailureClass.TIMEOUT:              Policy(True, Load.TIMEOUT, Down.UNANSWERED, _NONE),
    FailureClass.STALLED:              Policy(True, Load.TIMEOUT, Down.UNANSWERED, _NONE),
    FailureClass.CONNECTION:           Policy(True, Load.NONE, Down.UNANSWERED, _NONE),
    FailureClass.RATE_LIMITED:         Policy(True, Load.OVERLOAD, Down.NEVER, _NONE),
    FailureClass.SERVER_ERROR:         Policy(True, Load.OVERLOAD, Down.HTTP_5XX, _NONE),
    FailureClass.WORKER_ERROR:         Policy(True, Load.NONE, Down.NEVER, _NONE),
    FailureClass.LOST:                 Policy(True, Load.NONE, Down.NEVER, _NONE),
    FailureClass.CAPTURE_INCOMPLETE:   Policy(True, Load.NONE, Down.NEVER, _NONE),
    FailureClass.BAD_REQUEST:          Policy(False, Load.NONE, Down.NEVER, _BOTH),
    FailureClass.CONTEXT_LENGTH:       Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.INVALID_INPUT:        Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.UNSTORABLE:           Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.EMPTY_RESPONSE:       Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.TRUNCATED:            Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.RESPONSE_TOO_LARGE:   Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.REQUEST_TOO_LARGE:    Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.BOUNDARY_UNSTABLE:    Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.MASK_MISMATCH:        Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.NO_SUPERVISED_TOKENS: Policy(False, Load.NONE, Down.NEVER, _NONE),
    FailureClass.CAPTURE_MISMATCH:     Policy(False, Load.NONE, Down.NEVER, _CAPTURE),
}


#: How a failure answered by the server begins its message (``synthq.serving.inference.
#: status_error`` writes it: ``HTTP 503 (Retry-After 5 s): ...``); the attempt rows keep
#: the message, not the status, so what the policy needs of them is read back here only.
_ANSWERED = re.compile(r"^HTTP (\d+)(?: \(Retry-After ([0-9.]+) s\))?")


def answered_status(message: str | None) -> int | None:
    """The HTTP status a failed call was answered with, from its stored message; None
    when the server gave no HTTP answer (refused, timed out, a broken stream)."""
    found = _ANSWERED.match(message or "")
    return int(found.group(1)) if found else None


def retry_after(message: str | None) -> float | None:
    """The seconds a failed call's answer asked to wait (its Retry-After), from its stored
    message; None when it named none."""
    found = _ANSWERED.match(message or "")
    return float(found.group(2)) if found and found.group(2) else None


def brief(exc: BaseException) -> str:
    """``Class: first line`` of an exception, short enough for a user-visible message.

    A database error is described by the driver's own message (SQLAlchemy's
    ``orig``): never the SQL statement and parameters SQLAlchemy appends, which
    carry claim tokens and whole answers. The full error belongs in the log.
    """
    inner = getattr(exc, "orig", None)
    if isinstance(inner, BaseException):
        exc = inner
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
