"""The docs' walkthroughs, run as written.

A walkthrough is a ```` ```bash ```` block in README.md or docs/*.md preceded by the line
``<!-- walkthrough: NAME -->`` (hidden on GitHub and on the docs site). A test takes it
with :func:`walkthrough`, makes it smaller with :func:`reduced` (each replacement must
match the text, so a docs edit that drops a reduced option fails the test instead of
running the full size), and runs it with :func:`run_walkthrough`: one bash script,
``set -euo pipefail``, in a fresh folder that holds the repository's ``scripts/``, the
venv first on ``PATH``. The servers it starts in the background (``... &``) are in the
script's process group and are stopped with it. A wrong path, a missing file or a
command that fails as written fails the test. :func:`start_walkthrough` runs it in the
background, for a test that works beside its later steps (:meth:`Walkthrough.reached`).

``tests/unit/test_walkthroughs.py`` checks that every marked block has a test.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- walkthrough: ([a-z0-9-]+) -->\n```bash\n(.*?)\n```", re.M | re.S)

#: Each walkthrough and the test that runs it (tests/unit/test_walkthroughs.py holds this
#: list against the docs both ways).
RUN_BY = {
    "real-cpu": "tests/engine/test_real.py",
    "tiny-cpu": "tests/training/test_walkthrough_tiny.py",
}


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def marked() -> dict[str, tuple[Path, str]]:
    """Every marked block: its name → (the file, the commands as written)."""
    found: dict[str, tuple[Path, str]] = {}
    for doc in documents():
        for name, body in MARK.findall(doc.read_text()):
            if name in found:
                raise ValueError(f"walkthrough {name!r} is marked twice "
                                 f"({found[name][0].name}, {doc.name})")
            found[name] = (doc, body)
    return found


def walkthrough(name: str) -> str:
    """The commands of walkthrough ``name``, as the docs print them."""
    blocks = marked()
    if name not in blocks:
        raise KeyError(f"no block marked '<!-- walkthrough: {name} -->' in README.md "
                       "or docs/")
    return blocks[name][1]


def reduced(script: str, replacements: list[tuple[str, str]]) -> str:
    """``script`` with each ``(old, new)`` replaced; an ``old`` not found is an error."""
    for old, new in replacements:
        if old not in script:
            raise AssertionError(f"the walkthrough no longer says {old!r}: update the "
                                 f"test's reductions\n{script}")
        script = script.replace(old, new)
    return script


def run_walkthrough(script: str, workdir: Path, env: dict[str, str],
                    timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in ``workdir`` (created, with ``scripts/`` linked from the
    repository, as "from the repository root" means), every command echoed (``bash -x``)
    with the seconds since the start; its background jobs are ended with it. The output
    is also in ``workdir/walkthrough.log``."""
    return start_walkthrough(script, workdir, env).wait(timeout)


class Walkthrough:
    """A walkthrough running in the background (:func:`start_walkthrough`): a test can
    work beside its later steps once :meth:`reached` says an earlier one is done."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc, self.log = proc, log

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def reached(self, command: str, timeout: float) -> None:
        """Return once the script has started the line that begins with ``command``
        (echoed as ``+ [Ns] COMMAND``): under ``set -e`` every command before it
        finished, and succeeded. Raises AssertionError, with the log's end, when the
        script ends first or ``timeout`` seconds pass."""
        import time

        line = re.compile(r"^\+ \[\d+s\] " + re.escape(command), re.M)
        deadline = time.monotonic() + timeout
        while not line.search(self.text()):
            if self.proc.poll() is not None:
                raise AssertionError(f"the walkthrough ended (status {self.proc.returncode}) "
                                     f"before {command!r}:\n{self.text()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the walkthrough did not reach {command!r} within "
                                     f"{timeout:g} s:\n{self.text()[-6000:]}")
            time.sleep(0.5)

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Its end (a status of -1: cut after ``timeout`` seconds); its background jobs
        are ended with it."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            self.stop()
        return subprocess.CompletedProcess(self.proc.args, code, self.text(), "")

    def stop(self) -> None:
        """End the script and its background jobs (nothing once they have ended)."""
        _end_group(self.proc)


def start_walkthrough(script: str, workdir: Path, env: dict[str, str]) -> Walkthrough:
    """:func:`run_walkthrough` in the background: it runs while the caller goes on."""
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "scripts"
    if not link.exists():
        link.symlink_to(REPO / "scripts")
    path = workdir / "walkthrough.sh"
    # Each echoed command carries the seconds since the start: the log is the timing.
    path.write_text("set -euo pipefail\nPS4='+ [${SECONDS}s] '\n" + script + "\n")
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    log = workdir / "walkthrough.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-x", str(path)], cwd=workdir, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Walkthrough(proc, log)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the script's process group (its background servers), SIGKILL after a
    grace period."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            _wait_group(proc, grace)
            return
        except TimeoutError:
            continue


def _wait_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    import time

    if proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    raise TimeoutError
