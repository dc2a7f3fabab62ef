"""The CLI's options for the job settings, made from their declaration (synthq.spec.jobspec).

:func:`with_settings` adds one Typer option per declared setting to a command
(`enqueue`, `run`, `requeue`): its flags, type, default, choices and help come
from the :class:`synthq.spec.jobspec.Setting`, so a setting added there shows up
here without a line of its own. :func:`job_spec` turns the options' values
into the JobSpec (through :func:`synthq.jobs.enqueue.build_spec`, as the API does).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from synthq.cli import json_option
from synthq.spec import jobspec
from synthq.spec.jobspec import Setting

DatasetOpt = Annotated[str, typer.Option("--dataset", "-d", help="JSONL/Parquet file or "
                       "folder, or a Hugging Face dataset id (`name[:split]`).")]

_TYPES: dict[type, Any] = {int: int, float: float, bool: bool, str: str, list: list[str],
                           dict: str}


def _escaped(text: str) -> str:
    """``text`` as it is typed on a command line (a newline as ``\\n``)."""
    return text.encode("unicode_escape").decode("ascii")


def _unescape(text: str) -> str:
    """``\\n`` typed on a command line becomes a newline."""
    return text.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")


#: The panel of `--help` that lists the options which make and find a job (Typer's first).
OPTIONS = "Options"
#: The other panels of `--help`, by setting; a setting not named here is in OPTIONS.
PANELS: dict[str, str] = {
    **dict.fromkeys(("max_tokens", "temperature", "top_p", "chat_template_kwargs",
                     "extra_body", "regenerate", "history_reasoning"), "Generation"),
    **dict.fromkeys(("timeout", "stall_timeout", "max_attempts", "backoff_base", "backoff_cap",
                     "stream", "max_response_bytes", "keep_truncated", "return_token_ids"),
                    "Calls and retries"),
    **dict.fromkeys(("inflight", "max_inflight", "min_inflight", "gpus", "gpu_hour_price"),
                    "Load and cost"),
    **dict.fromkeys(("tokenizer", "chat_template", "max_seq_len", "reasoning", "mask",
                     "think_open", "think_close", "examples", "capture_servers", "capture_mode"),
                    "Training data"),
}

def _help(s: Setting, mode: str) -> str:
    """The option's --help line: the requeue's own words on a requeue, else the brief
    (the whole explanation is the docs' and the API schema's: ``s.help``)."""
    if mode == "requeue" and s.requeue_help:
        return s.requeue_help
    if s.brief and mode in ("requeue", "retokenize"):  # its default here is the job's
        return re.sub(r" \[default: [^]]*\]", "", s.brief)
    if s.brief:
        return s.brief
    return s.help + (f" [default: {s.omitted}]" if s.omitted else "")


def option(s: Setting, *, mode: str = "create") -> inspect.Parameter:
    """The command parameter of setting ``s``. ``mode``: ``create`` (its declared default),
    ``optional`` (required ones may be left out), ``requeue`` or ``retokenize`` (None: the
    job's stays)."""
    kind = (Path if s.cli == "file" else str if s.cli == "ints" else list[str]
            if s.cli == "pairs" else _TYPES[s.type])
    default: Any = s.default
    if s.cli == "escapes":
        default = _escaped(default)
    required = s.required and mode == "create"
    changes = mode in ("requeue", "retokenize")  # None: the job's stays
    if changes or (s.required and mode != "create"):
        default = None
    help_text = _help(s, mode)
    if default is None and mode in ("requeue", "retokenize") and s.requeue != "job":
        help_text += " [default: the job's]"  # what holds when the option is not given
    if s.type is not bool and (default is None or s.required):
        kind = kind | None
    info: dict[str, Any] = {"help": help_text, "show_default": default is not None,
                            "rich_help_panel": PANELS.get(s.name, OPTIONS)}
    if s.choices or s.metavar:
        info["metavar"] = s.metavar or "<" + "|".join(s.choices) + ">"
    elif s.urls:
        info["metavar"] = "<url>"
    elif s.cli == "json":
        info["metavar"] = "<json>"
    if s.cli == "file":
        info.update(exists=True, dir_okay=False)
    flags = s.flags or ("--" + s.name.replace("_", "-"),)
    if s.type is bool and changes:
        flags = tuple(f for f in flags if f.startswith("--"))
    annotation = Annotated[kind, typer.Option(*flags, **info)]  # type: ignore[valid-type]
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY,
                             default=inspect.Parameter.empty if required else default,
                             annotation=annotation)


def with_settings(names: Iterable[str] | None = None, *, mode: str = "create",
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command an option per declared setting (``names``: these only).

    The options take the place of the command's parameter ``settings`` (in --help
    too), which receives their values as one dict.
    """
    chosen = list(jobspec.SETTINGS) if names is None else [jobspec.BY_NAME[n] for n in names]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        params: list[inspect.Parameter] = []
        for p in inspect.signature(fn, eval_str=True).parameters.values():
            if p.name == "settings":
                params += [option(s, mode=mode) for s in chosen]
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(fn)
        def command(**values: Any) -> Any:
            given = {s.name: values.pop(s.name) for s in chosen}
            return fn(**values, settings=given)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def api_values(values: dict[str, Any]) -> dict[str, Any]:
    """The options' values in the API's form: JSON texts parsed, a template file read,
    escapes read, and the options left at None left out."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        s = jobspec.BY_NAME[name]
        if value is None:
            continue
        if s.cli == "json":
            value = json_option(value, s.flag)
        elif s.cli == "file":
            value = Path(value).read_text()
        elif s.cli == "escapes":
            value = _unescape(value)
        elif s.cli == "ints":
            value = jobspec.ints(value, s)
        elif s.cli == "pairs":
            value = jobspec.pairs(value, s)
        out[name] = value
    return out


def changed(values: dict[str, Any]) -> list[str]:
    """The options among ``values`` given a value other than their default."""
    return [jobspec.BY_NAME[n].flag for n, v in values.items()
            if v is not None and v != option(jobspec.BY_NAME[n]).default]


def job_spec(values: dict[str, Any], dataset: str):  # type: ignore[no-untyped-def]
    """The JobSpec of the settings' options, for ``dataset``."""
    from synthq.jobs.enqueue import build_spec

    return build_spec(api_values(values), source=dataset)
