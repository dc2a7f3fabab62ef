"""The job settings are declared once (synthq.spec.jobspec); the CLI's options, the API's
schema, the JobSpec's defaults and the overrides are made from that declaration."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from synthq.core.errors import UserError
from synthq.jobs.enqueue import JobSpec, build_spec
from synthq.spec import jobspec


def test_every_front_end_has_every_setting_with_the_declared_default() -> None:
    from api.schemas import JobSettings, RequeueRequest
    from synthq.cli.generate import enqueue, run
    from synthq.cli.manage import requeue

    names = [s.name for s in jobspec.SETTINGS]
    assert list(JobSettings.model_fields) == names
    for command in (enqueue, run):
        params = inspect.signature(command).parameters
        assert set(names) <= set(params), set(names) - set(params)
    spec_fields = {f.name: f for f in dataclasses.fields(JobSpec)}
    for s in jobspec.SETTINGS:
        api = JobSettings.model_fields[s.name]
        if s.required:
            assert api.is_required(), s.name
        elif s.type is not dict:
            assert api.default == (int(s.default) if s.name == "inflight" else s.default)
        if s.field != "" and s.default is not None and "." not in (s.field or ""):
            f = spec_fields[s.field or s.name]
            made = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            assert made == s.default, s.name
    requeued = {s.name for s in jobspec.SETTINGS if s.requeue}
    assert set(RequeueRequest.model_fields) == {"classes", "sample_ids"} | requeued
    assert requeued <= set(inspect.signature(requeue).parameters)
    assert jobspec.OVERRIDABLE == ("max_tokens", "temperature", "top_p", "total_timeout",
                                   "stall_timeout", "max_attempts", "chat_template_kwargs",
                                   "extra_body")


def test_build_is_the_spec_of_the_defaults() -> None:
    built = build_spec({"model": "m", "servers": ["http://h:8000/v1/"]}, source="d.jsonl")
    assert built == JobSpec(name="d", model="m", servers=["http://h:8000/v1"])


def test_overrides_apply_as_the_job_would() -> None:
    class Job:
        max_tokens, total_timeout, stall_timeout, max_attempts = 10, 100.0, 50.0, 3
        sampling = {"temperature": 0.1}
        extra_body = {"seed": 1, "chat_template_kwargs": {"a": 1}}
        chat_template_kwargs = {"a": 1}

    from synthq.queue.jobview import effective

    view = effective(Job(), {"max_tokens": 20, "top_p": 0.5, "extra_body": {"x": 2},
                             "chat_template_kwargs": {"b": 2}})
    assert (view.max_tokens, view.total_timeout, view.max_attempts) == (20, 100.0, 3)
    assert view.sampling == {"temperature": 0.1, "top_p": 0.5}
    assert view.extra_body == {"seed": 1, "x": 2, "chat_template_kwargs": {"b": 2}}
    assert view.chat_template_kwargs == {"b": 2}
    with pytest.raises(AttributeError, match="a job has no setting 'max_token'"):
        view.max_token  # noqa: B018 - a misspelt setting is an error, not the job's attribute


@pytest.mark.parametrize(("name", "value", "message"), [
    ("max_attempts", 10**12, "--max-attempts is out of range"),
    ("max_attempts", 2.5, "--max-attempts must be a positive integer"),
    ("temperature", float("inf"), "--temperature is out of range"),
    ("backoff_base", -1.0, "--backoff-base is out of range"),
    ("regenerate", "some", "--regenerate must be last or all"),
    ("think_close", "y" * 65, "--think-close may be at most 64 characters"),
    ("servers", "http://h/v1", "--server must be a list of strings"),
])
def test_a_value_out_of_its_declaration_is_one_line(name: str, value: object,
                                                    message: str) -> None:
    with pytest.raises(UserError) as info:
        jobspec.check(jobspec.BY_NAME[name], value)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_apis_enqueue_result_is_the_report_with_every_field() -> None:
    """One outcome record: POST /api/jobs answers each field of EnqueueReport (what
    `synthq enqueue --json` prints), typed as there, plus its malformed rows and message."""
    from typing import get_type_hints

    from api.schemas import EnqueueResult
    from synthq.jobs.enqueue import EnqueueReport

    hints = get_type_hints(EnqueueReport)
    fields = EnqueueResult.model_fields
    assert list(fields) == [*hints, "bad_rows", "message"]
    for name, kind in hints.items():
        assert fields[name].annotation == kind, name
    report = EnqueueReport(job_id=1, job_name="j", created=True, notes=["n"],
                           skip_examples=[("line 2", "bad")])
    body = EnqueueResult(**dataclasses.asdict(report)).model_dump(mode="json")
    assert body == {**json.loads(report.to_json()), "bad_rows": [], "message": ""}
