"""One declared job (synthq.spec.jobspec): what each setting is to the job (its role, its
column, whether it is exported) makes the "same work" key, the tokenization settings,
the export manifest's settings and the operational columns; the capture stage's settings
are declared there too, and `synthq capture`'s options, checks and the columns' defaults
follow from them."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from synthq.core.errors import UserError
from synthq.spec import jobspec


def test_the_same_work_key_is_the_generation_roles_columns() -> None:
    from synthq.jobs.enqueue import JobSpec

    last = JobSpec(name="j", model="m", servers=["http://h:1/v1"], max_tokens=7,
                   sampling={"temperature": 0.5}, extra_body={"seed": 1})
    assert last.generation_settings() == {"model": "m", "max_tokens": 7,
                                          "sampling": {"temperature": 0.5},
                                          "extra_body": {"seed": 1}}
    every = dataclasses.replace(last, regenerate="all", history_reasoning="keep")
    assert every.generation_settings() == {**last.generation_settings(), "regenerate": "all",
                                           "history_reasoning": "keep"}
    assert jobspec.GENERATION == ("model", "max_tokens", "sampling", "extra_body",
                                  "regenerate", "history_reasoning")


def test_tokenization_settings_are_the_tokenization_roles_columns() -> None:
    from synthq.data.tokenize import TokenizeSettings

    assert {f.name for f in dataclasses.fields(TokenizeSettings)} == set(jobspec.TOKENIZATION)


def test_the_export_manifest_records_the_exported_settings() -> None:
    from synthq.jobs import export
    from synthq.store.models import Job

    assert set(export.SETTINGS) == {*jobspec.EXPORTED, "tokenize_version"}
    columns = set(Job.__table__.c.keys())
    for s in (*jobspec.SETTINGS, *jobspec.CAPTURE):
        assert s.column is None or s.column in columns, s.name


def test_capture_settings_make_the_capture_commands_options_and_the_columns_defaults() -> None:
    from synthq.capture.plan import AUTO, DTYPES
    from synthq.cli.capture import capture
    from synthq.store.models import Job

    params = inspect.signature(capture).parameters
    for s in jobspec.CAPTURE:
        assert s.name in params, s.name
        column = Job.__table__.c[s.column]
        if s.default is not None:
            assert column.default.arg == s.default, s.name
            assert column.server_default.arg == str(s.default), s.name
    assert set(jobspec.BY_NAME["capture_dtype"].choices) == {AUTO, *DTYPES}
    layers = jobspec.BY_NAME["capture_layers"]
    assert jobspec.check(layers, jobspec.ints("2,4,5,8", layers)) == [2, 4, 5, 8]
    for bad in ("2,2", "2,5000", "2,x", ""):
        with pytest.raises(UserError, match="--layers"):
            jobspec.check(layers, jobspec.ints(bad, layers))
    with pytest.raises(UserError, match="--limit"):
        jobspec.check(jobspec.BY_NAME["capture_limit"], 0)


def test_the_mask_default_is_one_rule_by_regenerate() -> None:
    """A job given no mask supervises per its regenerate (jobspec.mask_for), wherever the
    default is read: the JobSpec, the tokenization settings and the column."""
    from types import SimpleNamespace

    from synthq.data.tokenize import TokenizeSettings
    from synthq.jobs.enqueue import JobSpec
    from synthq.store.models import Job

    for regenerate, mask in (("last", "last_turn"), ("all", "all_assistant_turns")):
        spec = JobSpec(name="j", model="m", servers=["http://h:1/v1"], regenerate=regenerate)
        assert spec.mask == jobspec.mask_for(None, regenerate) == mask
        row = SimpleNamespace(**{c: getattr(spec, c) for c in jobspec.TOKENIZATION},
                              regenerate=regenerate)
        row.tokenizer, row.mask = "t", None  # a job read before its mask was stored
        settings = TokenizeSettings.from_job(row)
        assert settings is not None and settings.mask == mask, regenerate
    column = Job.__table__.c["mask"]
    field = {f.name: f for f in dataclasses.fields(TokenizeSettings)}["mask"]
    assert column.default.arg == column.server_default.arg == field.default \
        == jobspec.mask_for(None)


def test_retokenize_changes_the_settings_declared_retokenizable() -> None:
    """`synthq retokenize`'s options and what synthq.jobs.retokenize.configure accepts are the
    settings declared ``retokenize=True``, not lists written again."""
    from synthq.cli.data import retokenize
    from synthq.jobs.retokenize import configure

    declared = {s.name for s in jobspec.SETTINGS if s.retokenize}
    assert set(jobspec.RETOKENIZABLE) == declared == {
        "tokenizer", "chat_template", "chat_template_kwargs", "max_seq_len", "reasoning",
        "mask", "examples"}
    options = set(inspect.signature(retokenize).parameters) & set(jobspec.BY_NAME)
    assert options == declared
    with pytest.raises(UserError, match=r"cannot change \['think_open'\] by retokenizing"):
        configure(None, object(), {"think_open": "<t>"})  # type: ignore[arg-type]


#: Settings whose declared default is resolved before a job is stored (``--reasoning
#: auto`` and ``--examples`` at enqueue, the mask by jobspec.mask_for), and what their
#: column holds where nothing was stored (a job made before the setting existed).
RESOLVED = {"reasoning": "keep", "mask": jobspec.mask_for(None), "examples": "conversation"}


def _own_columns() -> dict[str, jobspec.Setting]:
    """The declared settings that each have a ``jobs`` column of their own, by column."""
    return {s.column: s for s in (*jobspec.SETTINGS, *jobspec.CAPTURE)
            if s.column and s.column != "sampling"}


def test_the_jobspec_is_the_declared_settings_and_what_is_made_from_them() -> None:
    """A setting cannot be declared and not be on the JobSpec, nor the other way round:
    its fields are the declared settings' columns (the sampling keys in ``sampling``),
    the three of --inflight and the dataset, each typed and defaulted as declared."""
    from synthq.jobs.enqueue import JobSpec

    fields = {f.name: f for f in dataclasses.fields(JobSpec)}
    declared = {c: s for c, s in _own_columns().items() if s in jobspec.SETTINGS}
    assert set(fields) == {*declared, "sampling", *jobspec.inflight_settings("auto"),
                           "dataset"}
    for column, s in declared.items():
        f = fields[column]
        # The job's name is made from the dataset's when not given (jobspec.job_name).
        given = s.required or s.name == "name"
        if s.type in (list, dict):
            assert str(f.type).startswith(f"{s.type.__name__}["), column
            assert given or f.default_factory() == s.type(), column  # type: ignore[misc]
            continue
        optional = s.default is None and not given
        assert f.type == s.type.__name__ + (" | None" if optional else ""), column
        if given:
            assert f.default is dataclasses.MISSING, column
        else:
            assert f.default == s.default, column


def test_the_jobs_columns_store_the_declared_settings() -> None:
    """Each declared setting's column holds its type, is nullable where the setting may be
    None once the job is made, fits its longest value, and defaults to the declared
    default (or what an enqueue resolves it to, RESOLVED); every JobSpec field is a
    column (jobs.create_job inserts them)."""
    from sqlalchemy import JSON, Boolean, String

    from synthq.jobs.enqueue import JobSpec
    from synthq.store.models import Job

    columns = Job.__table__.c
    assert {f.name for f in dataclasses.fields(JobSpec)} <= set(columns.keys())
    for name, s in _own_columns().items():
        column = columns[name]
        container = s.type in (list, dict)
        if container:
            assert isinstance(column.type, JSON), name
        else:
            assert column.type.python_type is s.type, name
        # A list or an object not given is stored empty, unless None stands for something
        # (what ``omitted`` says: the drafter's layers for capture_layers).
        may_be_none = s.default is None and not s.required and s.name not in RESOLVED \
            and s.name != "name" and (not container or s.omitted is not None)
        assert column.nullable == may_be_none, name
        if isinstance(column.type, String) and column.type.length is not None:
            assert s.max_len in (None, column.type.length), name
            assert all(len(c) <= column.type.length for c in s.choices), name
        if column.default is not None and not container:
            assert column.default.arg == RESOLVED.get(s.name, s.default), name
            if column.server_default is not None and not isinstance(column.type, Boolean):
                assert column.server_default.arg == str(column.default.arg), name
