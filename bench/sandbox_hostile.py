"""Hostile chat templates against synthq's sandbox: each one's peak RSS, time and outcome.

Each template is compiled and rendered in a child process of its own, in
:class:`synthq.data.sandbox.BoundedSandbox` under ``limits(seconds=...)`` (20 s, the
worker's budget, or ``--seconds``); the parent reads the child's peak RSS from
``os.wait4`` and its wall time. The child's address space is capped (``--cap``
MiB) so that a template the sandbox lets through cannot take the machine down;
a child stopped by the cap reports ``MemoryError``.

Run: ``python bench/sandbox_hostile.py [--seconds 20] [--cap 3072] [NAME ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: name -> template (issue 41's repros first, then what a read of jinja2's filters and
#: globals found).
TEMPLATES = {
    "empty": "{{ messages | length }}",
    "format_nested_width": "{{ '{0:>{1}}'.format('x', 10**9) }}",
    "slice": "{{ [1] | slice(20000000) | list | length }}",
    "lipsum": "{{ lipsum(200000) | length }}",
    "format_precision": "{{ '{0:.{1}f}'.format(1.5, 10**9) }}",
    "format_map_width": "{{ '{a:>{w}}'.format_map({'a': 'x', 'w': 10**9}) }}",
    "percent_star": "{{ '%*s' % (10**9, 'x') }}",
    "format_filter": "{{ '%*s' | format(10**9, 'x') }}",
    "batch_fill": "{{ [1] | batch(20000000, 0) | list | length }}",
    "repeat_list": "{{ ([1] * 30000000) | length }}",
    "round_floor": "{{ 1.5 | round(10**8, 'floor') }}",
    "sum_lists": "{{ ([[0] * 1000] * 3000) | sum(start=[]) | length }}",
    "wordwrap": "{{ ('x' * 2000000) | wordwrap(1) | length }}",
    "urlize": "{{ ('a.com ' * 2000000) | urlize | length }}",
    "urlize_words": "{{ ('a ' * 1000000) | urlize | length }}",
    "translate": "{{ ('x' * 1000).translate({120: 'y' * 1000000}) | length }}",
    "split": "{{ ('ab ' * 10000000).split() | length }}",
    "tojson_indent": "{{ [[[[[[[[1]]]]]]]] | tojson(indent=10000000) | length }}",
    "pprint": "{{ (range(100000) | list * 20) | pprint | length }}",
}


def child(source: str, seconds: float, cap_mib: int) -> None:
    """Compile and render ``source``; print one JSON line (outcome, seconds)."""
    resource.setrlimit(resource.RLIMIT_AS, (cap_mib << 20, cap_mib << 20))
    sys.path.insert(0, str(REPO))
    from synthq.data.sandbox import BoundedSandbox, limits

    started = time.monotonic()
    try:
        template = BoundedSandbox(trim_blocks=True).from_string(source)
        with limits(seconds=seconds):
            out = template.render(messages=[])
        outcome = f"rendered {len(out):,} chars"
    except BaseException as exc:  # noqa: BLE001 - the outcome is what is measured
        outcome = f"{type(exc).__name__}: {' '.join(str(exc).split())[:90]}"
    print(json.dumps({"outcome": outcome, "s": round(time.monotonic() - started, 2)}))


def measure(name: str, seconds: float, cap_mib: int, timeout: float) -> dict[str, object]:
    """One template in a child process: its peak RSS (MiB), wall seconds and outcome."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--seconds",
                             str(seconds), "--cap", str(cap_mib)], stdout=subprocess.PIPE,
                            text=True)
    timer = threading.Timer(timeout, proc.kill)  # a template nothing stops
    timer.start()
    assert proc.stdout is not None
    out = proc.stdout.read()
    # os.wait4, not Popen.wait: the rusage of this child alone.
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    timer.cancel()
    row: dict[str, object] = json.loads(out) if out.strip() else {"outcome": "killed"}
    row["wall_s"] = round(time.monotonic() - started, 2)
    row["rss_mib"] = round(usage.ru_maxrss / 1024)
    return {"name": name, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(TEMPLATES))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--cap", type=int, default=3072)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(TEMPLATES[args.child], args.seconds, args.cap)
        return
    for name in args.names:
        print(json.dumps(measure(name, args.seconds, args.cap, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
