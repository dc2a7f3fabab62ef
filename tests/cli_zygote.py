"""The CLI's processes for the tests, forked from one that has imported synthq already.

``python tests/cli_zygote.py``, started by ``support.CliHost``: it imports the
libraries every ``synthq`` command pays for (SQLAlchemy and the models, pydantic's
settings, httpx, rich, Typer: about a second of CPU a start) and those a command with a
tokenizer or a target pays for (torch, transformers: 2-3 more), then reads one request
a line on stdin (JSON: ``id``, ``args``, ``env``, ``cwd``, ``out``, ``err``) and forks
a child for each at once (children run side by side). The child is ``python -m
synthq.cli ARGS`` as a shell starts it: its own process, its working directory and
environment replaced by the request's, stdin from /dev/null, stdout and stderr to the
request's files, ``synthq.cli``'s ``__main__`` run as ``-m`` runs it, and the
interpreter's exit (threads joined, atexit, the streams flushed, the exit code; an
uncaught exception printed, exit 1), without the teardown of every module (see
``_exit``). What it does not repeat is the start-up: the interpreter and the imports
below, made once, with no ``SYNTHQ_`` setting in the environment (none of them reads
one when imported: the zygote checks that no settings were read; support.CliHost runs
a command whose variables read at a start differ from the zygote's as a plain
subprocess). It answers ``{"pid": N, "id": ID}`` when a child starts and ``{"pid": N,
"rc": CODE}`` when it ends (a negative code: killed by that signal, as subprocess
says); ``{"signal": S, "pid": N}`` sends a child of its own a signal (never a pid it
has reaped, which another process may have by then).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

#: What a command imports before it does anything: loaded once here.
PRELOAD = ("typer", "click", "rich.console", "rich.markup", "httpx", "pydantic",
           "pydantic_settings", "sqlalchemy", "sqlalchemy.orm", "psycopg", "alembic",
           "synthq.cli", "synthq.spec.config", "synthq.store.db", "synthq.store.models",
           "synthq.jobs.enqueue", "synthq.views.report",
           # What a command with a tokenizer or a target imports (``run``, ``enqueue
           # --tokenizer``, ``capture``, ``export --target``, ``train``): torch and
           # transformers, 2-3 CPU seconds a start. No thread is started by these imports
           # (checked below: a fork copies only the thread that forks).
           "torch", "torch.distributed", "safetensors.torch", "tokenizers", "transformers",
           "synthq.data.tokenize", "synthq.capture.stage", "synthq.training.loop",
           "synthq.training.stream", "synthq.training.dflash", "synthq.training.captured",
           "synthq.training.served", "synthq.training.export_features")
#: transformers' lazy names a command resolves (each imports its modules).
LAZY = ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM", "PreTrainedTokenizerFast")


def _preload() -> None:
    from importlib import import_module

    for name in PRELOAD:
        import_module(name)
    import transformers

    for name in LAZY:
        getattr(transformers, name)
    from synthq.cli import app

    app.registered_commands  # noqa: B018 - imports every command's module
    from synthq.spec.config import get_settings

    # Nothing imported here may have read a setting: each child reads its own.
    assert get_settings.cache_info().currsize == 0, "a preloaded module read the settings"
    assert not any(k.startswith("SYNTHQ_") for k in os.environ)
    # One thread, this one: a thread started by an import would be missing in each child
    # (holding whatever lock it held at the fork).
    assert len(os.listdir("/proc/self/task")) == 1, "a preloaded module started a thread"


def _child(request: dict[str, object], mine: tuple[int, ...]) -> None:
    """Become ``python -m synthq.cli ARGS`` and exit as it does; never returns."""
    import runpy

    for fd in mine:  # the zygote's pipes
        os.close(fd)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        if fd == 2 and path == request["out"]:  # 2>&1
            os.dup2(1, 2)
            continue
        target = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    from synthq.testing.procs import dies_with_parent

    with_parent = dies_with_parent()  # the zygote's end ends it, as a test's child ends
    if with_parent is not None:
        with_parent()
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update(request["env"])  # type: ignore[arg-type]
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = ["-m", *(str(a) for a in request["args"])]  # type: ignore[attr-defined]
    try:  # runpy puts the module's path first in sys.argv, as -m does
        runpy.run_module("synthq.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -1
    except BaseException:  # noqa: BLE001 - printed and exit 1, as the interpreter does
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit_code(code: object) -> int:
    """What the interpreter makes of ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """The interpreter's exit without its teardown of every module (half a second of
    CPU in a process forked from this one, and nothing a command shows): threads that
    are not daemons joined, atexit functions run (logging's flush among them), the
    standard streams flushed; -1: an uncaught Ctrl-C, which ends the process by SIGINT."""
    import atexit
    import signal
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code == -1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def main() -> None:
    import select
    import signal

    # The protocol on file descriptors of its own: fds 0 and 1 belong to the children.
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sys.path[0] = ""
    _preload()
    import gc

    gc.freeze()  # the preloaded objects stay out of the children's collections (and pages)
    # Children run side by side (a test may race two): each one's end wakes the loop.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    mine = (proto_in, proto_out, wake_r, wake_w)

    def answer(reply: dict[str, int]) -> None:
        os.write(proto_out, json.dumps(reply).encode() + b"\n")

    running: set[int] = set()
    pending, reading = b"", True
    while reading or running:
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            running.discard(pid)
            answer({"pid": pid, "rc": os.waitstatus_to_exitcode(status)})
        ready, _, _ = select.select([proto_in, wake_r] if reading else [wake_r], [], [],
                                    None if reading or not running else 1.0)
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        if proto_in in ready:
            chunk = os.read(proto_in, 1 << 16)
            reading = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "signal" in request:  # sent here, where a pid is known to be ours
                    if request["pid"] in running:
                        os.kill(request["pid"], request["signal"])
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _child(request, mine)
                running.add(pid)
                answer({"pid": pid, "id": request["id"]})


if __name__ == "__main__":
    main()
