"""A job's settings as one sample sees them: the job's, with the sample's overrides.

``synthq requeue`` may set a few settings per sample (``samples.overrides``);
the call (:mod:`synthq.process`) and the re-tokenization
(:mod:`synthq.retokenize`) both read a job through :func:`effective`.
"""

from __future__ import annotations

from typing import Any

from synthq import jobspec

__all__ = ["OVERRIDABLE", "Effective", "effective"]


#: Per-sample settings ``synthq requeue`` may set (``samples.overrides``), as declared.
OVERRIDABLE = jobspec.OVERRIDABLE


class Effective:
    """A job's settings with one sample's overrides on top (read-only view)."""

    def __init__(self, job: Any, overrides: dict[str, Any]) -> None:
        self._job = job
        jobspec.apply_overrides(self, job, overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)


def effective(job: Any, overrides: dict[str, Any] | None) -> Any:
    """``job`` itself, or a view of it with the sample's ``overrides`` applied."""
    return Effective(job, overrides) if overrides else job
