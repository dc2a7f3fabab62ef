"""A job's settings as one sample sees them: the job's, with the sample's overrides.

``synthq requeue`` may set a few settings per sample (``samples.overrides``);
the call (:mod:`synthq.process`) and the re-tokenization
(:mod:`synthq.retokenize`) both read a job through :func:`effective`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OVERRIDABLE", "Effective", "effective"]


#: Per-sample settings ``synthq requeue`` may set (``samples.overrides``).
OVERRIDABLE = ("max_tokens", "temperature", "top_p", "total_timeout", "stall_timeout",
               "max_attempts", "extra_body", "chat_template_kwargs")


class Effective:
    """A job's settings with one sample's overrides on top (read-only view)."""

    def __init__(self, job: Any, overrides: dict[str, Any]) -> None:
        self._job = job
        o = overrides
        self.max_tokens = o.get("max_tokens", job.max_tokens)
        self.total_timeout = o.get("total_timeout", job.total_timeout)
        self.stall_timeout = o.get("stall_timeout", job.stall_timeout)
        self.max_attempts = o.get("max_attempts", job.max_attempts)
        self.sampling = {**(job.sampling or {}),
                         **{k: o[k] for k in ("temperature", "top_p") if k in o}}
        self.extra_body = {**(job.extra_body or {}), **(o.get("extra_body") or {})}
        self.chat_template_kwargs = job.chat_template_kwargs
        if "chat_template_kwargs" in o:
            self.chat_template_kwargs = o["chat_template_kwargs"]
            self.extra_body["chat_template_kwargs"] = o["chat_template_kwargs"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)


def effective(job: Any, overrides: dict[str, Any] | None) -> Any:
    """``job`` itself, or a view of it with the sample's ``overrides`` applied."""
    return Effective(job, overrides) if overrides else job
