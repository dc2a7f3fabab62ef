"""The CLI imports only the module of the command it runs (synthq.cli._Synthq), so its
table of which module defines which command must be exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_default_python


def test_the_command_table_says_where_each_command_is_defined() -> None:
    from synthq.cli import COMMANDS, _command_name, app

    found: dict[str, list[str]] = {}
    for command in app.registered_commands:
        assert command.callback is not None
        module = command.callback.__module__.removeprefix("synthq.cli.")
        found.setdefault(module, []).append(_command_name(command))
    assert found == {module: list(names) for module, names in COMMANDS.items()}


@pytest.mark.processes
def test_one_command_loads_its_module_alone_and_help_lists_every_command(
        tmp_path: Path) -> None:
    code = ("import sys; from synthq.cli import app\n"
            "try:\n"
            "    app(['sample', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            # synthq.cli.helpfmt draws the help this command asks for: no command module.
            "print(sorted(m for m in sys.modules if m.startswith('synthq.cli.')\n"
            "             and m != 'synthq.cli.helpfmt'))\n"
            "from synthq.cli import COMMANDS, _command_name\n"
            "print([_command_name(c) for c in app.registered_commands])\n"
            "print([n for names in COMMANDS.values() for n in names])")
    result = run_default_python(code, tmp_path)
    loaded, listed, expected = result.stdout.splitlines()[-3:]
    assert loaded == "['synthq.cli.watch']", result.stdout + result.stderr
    assert listed == expected  # a later read loads the others, in the order of --help
