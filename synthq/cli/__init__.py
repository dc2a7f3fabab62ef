"""The ``synthq`` command line.

Every command validates its input and prints a clear error (exit 2) instead of
a traceback. Commands that read or write jobs work on the database in
``SYNTHQ_DATABASE_URL`` (default: a SQLite file under ``./synthq-data/``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from synthq.core.errors import UserError

if TYPE_CHECKING:
    from rich.console import Console
    from typer.models import CommandInfo

#: The modules that define the commands, in the order of `synthq --help`, and the
#: commands each registers on `app` when it is imported (a test keeps this exact).
COMMANDS: dict[str, tuple[str, ...]] = {
    "generate": ("enqueue", "run"),
    "watch": ("jobs", "status", "sample"),
    "manage": ("requeue", "pause", "resume", "cancel"),
    "data": ("export", "retokenize"),
    "capture": ("capture",),
    "train": ("train", "runs"),
    "engine": ("serve-check",),
    "services": ("worker", "beat", "simulate"),  # and `db upgrade`
    "api": ("api", "flower"),
}


def _command_name(command: CommandInfo) -> str:
    from typer.main import get_command_name

    return command.name or get_command_name(command.callback.__name__ if command.callback
                                            else "")


class _Synthq(typer.Typer):
    """The app, whose commands are loaded as needed.

    Run for one command (``synthq jobs --json``), it imports only the module that
    defines it and builds that command alone. Otherwise Typer would import every
    command module and read every command's signature at each start: ~25 ms of
    CPU, a sixth of what `synthq jobs` costs. Anything else that reads
    ``registered_commands`` (``synthq --help``, an unknown command, tests) gets
    every command: the modules are imported on that first read.
    """

    #: False until every command module is imported (or while __call__ imports one).
    _loaded = False

    @property  # type: ignore[override]
    def registered_commands(self) -> list[CommandInfo]:
        if not self._loaded:
            from importlib import import_module

            self._loaded = True  # the modules' @app.command() read this list as they load
            for module in COMMANDS:
                import_module(f"synthq.cli.{module}")
            # In the order of COMMANDS, whichever module __call__ imported first.
            order = list(COMMANDS)
            self._commands.sort(key=lambda c: order.index(c.callback.__module__.rsplit(
                ".", 1)[-1]) if c.callback else 0)
        return self._commands

    @registered_commands.setter
    def registered_commands(self, commands: list[CommandInfo]) -> None:
        self._commands = commands

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import copy
        import os
        import sys
        from importlib import import_module

        words = kwargs.get("args", args[0] if args else sys.argv[1:])
        name = words[0] if words else None
        module = next((m for m, names in COMMANDS.items() if name in names), None)
        # Shell completion (_SYNTHQ_COMPLETE=...) completes against every command.
        if module is None or any(k.startswith("_") and k.endswith("_COMPLETE")
                                 for k in os.environ):
            self.registered_commands  # noqa: B018 - loads every command, `db upgrade` too
            return super().__call__(*args, **kwargs)
        loaded, self._loaded = self._loaded, True
        try:
            import_module(f"synthq.cli.{module}")
            only = [c for c in self._commands if _command_name(c) == name]
        finally:
            self._loaded = loaded  # a later read still loads the others
        alone = copy.copy(self)
        alone._loaded, alone.registered_commands, alone.registered_groups = True, only, []
        return typer.Typer.__call__(alone, *args, **kwargs)


def _no_type_for_flags() -> None:
    """A flag (``--json``, ``--stream/--no-stream``, ``--help``) takes no value, so --help
    shows no ``<bool>`` beside it, as if it took one (Typer 0.29 shows every option's type)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_no_type_for_flags()


def _compact_help() -> None:
    """Options as two columns, names and help, so --help reads at 80 columns
    (synthq.cli.helpfmt, imported only when help is drawn)."""
    from typer.core import TyperCommand, TyperGroup

    for cls in (TyperCommand, TyperGroup):
        def format_help(self: Any, ctx: Any, formatter: Any,
                        _original: Any = cls.format_help) -> None:
            from synthq.cli.helpfmt import install

            install()
            return _original(self, ctx, formatter)  # type: ignore[no-any-return]

        cls.format_help = format_help  # type: ignore[method-assign]


_compact_help()

app = _Synthq(
    name="synthq",
    help="Durable generation of EAGLE-3 drafter training data: enqueue prompts, run them "
    "against OpenAI-compatible servers, watch, repair.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database maintenance.\n\nExample: `synthq db upgrade` (PostgreSQL: "
                     "after installing or upgrading synthq, before starting workers)",
                     no_args_is_help=True)
app.add_typer(db_app, name="db")
testing_app = typer.Typer(help="Helpers for trying synthq without a GPU.\n\nExample: "
                          "`synthq testing tiny-target synthq-data/tiny` (a tiny Llama a CPU vLLM "
                          "serves)", no_args_is_help=True)
app.add_typer(testing_app, name="testing")

def _console(stderr: bool = False) -> Console:
    """A console; piped (not a terminal, no COLUMNS), lines are not wrapped at 80 columns."""
    import os
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty() or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=1000, soft_wrap=True)


class _LazyConsole:
    """The rich Console, made on first use: importing rich costs ~40 ms of CPU that
    `synthq jobs --json` and `status --json` (typed all day) never need. ``get()`` is the
    Console itself, for rich objects that take one (Progress, Live)."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def get(self) -> Console:
        if self._console is None:
            self._console = _console(self._stderr)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


console = _LazyConsole(stderr=False)
err = _LazyConsole(stderr=True)


def escape(text: str) -> str:
    """rich's markup escape, imported when first needed (see _LazyConsole)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``message`` as one unwrapped line (no markup read in it, passwords in URLs
    masked); the exit to raise."""
    from synthq.store.db import safe_url

    err.print(f"[bold red]error:[/] {escape(safe_url(message))}", soft_wrap=True)
    return typer.Exit(code)


def warn(message: str) -> None:
    """Print ``message`` as one warning line on stderr (no markup read in it)."""
    from synthq.store.db import safe_url

    err.print(f"[yellow]warning:[/] {escape(safe_url(message))}", soft_wrap=True,
              highlight=False)


@app.callback()
def _check_settings(ctx: typer.Context) -> None:
    """Every command but the simulator needs valid settings: a bad one is one line, exit 2."""
    if ctx.invoked_subcommand == "simulate":
        return
    if ctx.invoked_subcommand in ("jobs", "status"):
        from synthq.cli import fast

        if fast.eligible():  # default settings: nothing to validate (see synthq/cli/fast.py)
            return
    from pydantic import ValidationError

    from synthq.spec.config import get_settings

    try:
        get_settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        name = "SYNTHQ_" + "_".join(str(p) for p in first["loc"]).upper()
        reason = str(first["msg"]).removeprefix("Value error, ")
        raise fail(f"invalid setting {name}: {reason}") from None


def ensure_db() -> None:
    """SQLite is migrated on the fly; PostgreSQL must be at head (``synthq db upgrade``)."""
    from synthq.spec.config import get_settings
    from synthq.store.db import get_engine, safe_url
    from synthq.store.migrate import HEAD, current_revision, upgrade

    settings = get_settings()
    try:
        with get_engine().connect() as conn:
            current = current_revision(conn)
    except Exception as exc:  # noqa: BLE001 - any connection problem is the user's to fix
        raise UserError(f"cannot reach the database {safe_url(settings.database_url)}: "
                        f"{safe_url(str(exc).splitlines()[0])}") from exc
    if current == HEAD:
        return
    if settings.is_sqlite:
        upgrade(settings.database_url)
        return
    raise UserError(f"the database is at revision {current}, not {HEAD}: "
                    "run `synthq db upgrade`")


def json_option(value: str | None, flag: str) -> dict[str, Any]:
    if not value:
        return {}
    try:
        data = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{flag} must be a JSON object, e.g. '{{\"enable_thinking\": true}}'")
    return data


JobArg = Annotated[str, typer.Argument(help="Job name or id.")]


def with_job(ref: str, fn):  # type: ignore[no-untyped-def]
    from synthq.jobs.enqueue import find_job
    from synthq.store.db import session_scope

    try:
        ensure_db()
        with session_scope() as s:
            return fn(s, find_job(s, ref))
    except UserError as exc:
        raise fail(str(exc)) from None


JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")]


def main() -> None:  # pragma: no cover
    app()
