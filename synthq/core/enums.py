"""The states of samples and jobs (kept apart so that models and states import one way)."""

from __future__ import annotations

import enum

__all__ = ["SampleState", "JobState", "RunState", "CaptureState", "SpoolState", "INFLIGHT",
           "FINISHED"]


class SampleState(enum.StrEnum):
    #: Waiting to be sent, possibly until ``next_attempt_at`` (a retry's backoff).
    PENDING = "pending"
    #: A ``generate`` message was published; waiting for a worker to claim it.
    QUEUED = "queued"
    #: A worker holds the lease and is calling the server.
    RUNNING = "running"
    #: The response (and, later, its tokenization) is stored. Final.
    DONE = "done"
    #: Gave up: a permanent error, or retries exhausted. ``requeue`` revives it.
    FAILED = "failed"
    #: The dataset row was malformed, or tokenization left nothing to learn. Final.
    SKIPPED = "skipped"


class JobState(enum.StrEnum):
    #: Samples are dispatched.
    ACTIVE = "active"
    #: Nothing new is dispatched; calls in flight finish.
    PAUSED = "paused"
    #: Like paused, for good (``resume`` refuses).
    CANCELLED = "cancelled"
    #: Every sample is terminal (done, failed or skipped): it holds no server's
    #: limit. Active again when samples are added or requeued.
    FINISHED = "finished"


class RunState(enum.StrEnum):
    #: Waiting for a training worker (a ``train`` message was published).
    PENDING = "pending"
    #: A worker holds the claim and heart-beats.
    RUNNING = "running"
    #: The drafter checkpoint is written. Final.
    DONE = "done"
    #: Stopped by an error; ``error`` says why. Final (``synthq train`` starts a new one).
    FAILED = "failed"
    #: Stopped by a person. Final.
    CANCELLED = "cancelled"


class CaptureState(enum.StrEnum):
    """One sample's hidden-state capture (synthq.capture): a stage after generation."""

    #: Waiting to be sent to a capture server, possibly until ``next_attempt_at``.
    PENDING = "pending"
    #: A capture process holds the lease and is calling the server.
    RUNNING = "running"
    #: The file is in synthq's store, checked (token ids, shape, checksum). Final
    #: while the sample's tokenization stays the one it was captured at.
    DONE = "done"
    #: Gave up: a permanent error (``capture_mismatch``...), or attempts exhausted.
    FAILED = "failed"


class SpoolState(enum.StrEnum):
    """One example of one epoch of a streamed training run (``--features stream``): its
    features captured into the run's spool, trained on, and committed by a checkpoint."""

    #: Its features are not in the spool: the run's capture asks the engine for them.
    PENDING = "pending"
    #: Its capture call is in flight on ``server`` (held under a claim and a lease): it
    #: counts toward that server's capture limit, as a running capture does.
    CAPTURING = "capturing"
    #: Its file is in the spool, ahead of the trainer (the capture's lead).
    SPOOLED = "spooled"
    #: The trainer trained on it (``step``); no checkpoint has committed that step yet.
    TRAINING = "training"
    #: A committed checkpoint consumed it: the ledger's record of the epoch. Final.
    CONSUMED = "consumed"
    #: Its capture failed for good (the run stopped with the line). ``error_message``.
    FAILED = "failed"


#: States that hold a slot of a server's in-flight limit.
INFLIGHT = (SampleState.QUEUED, SampleState.RUNNING)
#: States a sample does not leave by itself.
FINISHED = (SampleState.DONE, SampleState.FAILED, SampleState.SKIPPED)
