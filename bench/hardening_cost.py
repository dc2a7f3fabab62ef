"""What each check of the hardening round (issue 24) costs, per chunk, per call, per sample.

Each piece is timed in this process with the process's CPU clock, side by side
with the same piece as it was before the round (``--before REV``, default
91e9d3c, the commit before it: its ``synthq/inference.py`` is loaded from git as
a module of its own, its imports of the flat package of then pointed at today's
folders), interleaved over ``--repeats`` rounds; the figure is the
median microseconds per operation, and the difference is what the check adds:

* **chunk**: ``synthq.serving.answer.Accumulator.add`` of one streamed chunk (a
  vLLM-style text chunk) with the shape checks vs without;
* **end of a streamed call**: the usage check (``answer.checked_usage``, ``_ceiling``,
  ``pieces``, ``ids``) vs nothing;
* **request body**: ``_body`` (reserved keys left out, the size cap) vs the plain dump;
* **non-streamed answer**: ``_completion_result`` with its field and usage checks vs without;
* **clock**: ``synthq.core.clock.utcnow`` on the database's time (anchor + monotonic) vs
  ``datetime.now(UTC)``;
* **statement**: one ``SELECT 1`` round trip on a psycopg connection with the
  answer deadline (``synthq.store.db._guarded_connection``) vs a plain one (PostgreSQL;
  skipped with ``--no-pg``);
* **template render**: a Qwen3-style chat template (``tests/chat_tokenizers.py``)
  rendering a ~2,000-token conversation in :class:`synthq.data.sandbox.BoundedSandbox`
  (the budget) vs jinja2's ``ImmutableSandboxedEnvironment`` (what transformers
  uses).

The writer's helper thread is not a piece of code one can time alone (it costs by
splitting batches): its price is measured end to end (bench/README).

Run: ``python bench/hardening_cost.py [--before 91e9d3c] [--repeats 5] [--no-pg]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


#: Where the modules the old inference.py imports live today (the package was flat then).
_MOVED = {"errors": "synthq.core.errors", "netio": "synthq.core.netio"}


def _before_inference(rev: str) -> Any:
    """``synthq/inference.py`` as it was at ``rev``, loaded as a module of its own."""
    import synthq

    source = subprocess.run(["git", "show", f"{rev}:synthq/inference.py"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    for old, new in _MOVED.items():  # ``from synthq import errors`` as it was written then
        setattr(synthq, old, importlib.import_module(new))
    spec = importlib.util.spec_from_loader("synthq_inference_before", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(compile(source, f"{rev}:synthq/inference.py", "exec"), module.__dict__)  # noqa: S102
    return module


def per_op_us(fn: Callable[[], Any], n: int) -> float:
    """CPU microseconds per call of ``fn`` over ``n`` calls."""
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return 1e6 * (time.process_time() - t0) / n


def _chunk(i: int) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": {"content": f"word{i} "}, "logprobs": None,
                         "finish_reason": None}]}


def pieces(before: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """name -> (before, now, calls per timing)."""
    from synthq.serving import answer
    from synthq.serving import inference as now

    chunks = [_chunk(i) for i in range(40)]
    chunks[-1]["choices"][0]["finish_reason"] = "length"

    def add_all(accumulator: Any) -> Callable[[], Any]:
        def run() -> Any:
            acc = accumulator()
            for c in chunks:
                acc.add(c)
            return acc
        return run

    filled = add_all(answer.Accumulator)()
    filled.usage = {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52}
    request = now.ChatRequest(model="m", messages=[{"role": "user", "content": "q " * 20}],
                              max_tokens=256)
    old_request = before.ChatRequest(model="m", messages=request.messages, max_tokens=256)
    client = now.InferenceClient("http://127.0.0.1:9/v1")
    old_client = before.InferenceClient("http://127.0.0.1:9/v1")

    def usage_now() -> Any:
        ids = filled.ids()
        return answer.checked_usage(filled.usage, ceiling=now._ceiling(request), ids=ids,
                                    prompt_ids=filled.prompt_token_ids,
                                    streamed=filled.pieces(), text=bool(filled.content))

    def usage_before() -> Any:
        usage = filled.usage or {}
        return usage.get("prompt_tokens"), usage.get("completion_tokens")

    document = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant",
                                                     "content": "word " * 40},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52}}
    return {
        "chunk": (add_all(before._Accumulator), add_all(answer.Accumulator), 25),
        "end of a streamed call (usage)": (usage_before, usage_now, 1000),
        "request body": (lambda: old_client._body(old_request, stream=True),
                         lambda: client._body(request, stream=True), 1000),
        "non-streamed answer": (
            lambda: before._completion_result(document, {}, 0.0),
            lambda: now._completion_result(document, {}, 0.0, 256), 1000),
    }


def clock_pieces() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    from synthq.core import clock

    clock.calibrate(datetime.now(UTC), time.monotonic(), datetime.now(UTC))
    return {"clock (utcnow)": (lambda: datetime.now(UTC), clock.utcnow, 5000)}


def pg_pieces() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    import psycopg

    from synthq.store.db import _guarded_connection

    dsn = os.environ.get("SYNTHQ_BENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
    plain = psycopg.connect(dsn, autocommit=True)
    guarded = _guarded_connection(60.0).connect(dsn, autocommit=True)

    def select(conn: Any) -> Callable[[], Any]:
        return lambda: conn.execute("SELECT 1").fetchone()

    return {"statement (SELECT 1)": (select(plain), select(guarded), 300)}


def render_pieces() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from synthq.data.sandbox import BoundedSandbox
    from tests.chat_tokenizers import QWEN3_TEMPLATE

    words = " ".join(f"token{i}" for i in range(700))
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": f"Explain {words[:2000]}"},
                {"role": "assistant", "content": words}]
    kwargs = dict(messages=messages, add_generation_prompt=False, tools=None)
    env_kw = dict(trim_blocks=True, lstrip_blocks=True)
    plain = ImmutableSandboxedEnvironment(**env_kw).from_string(QWEN3_TEMPLATE)  # type: ignore[arg-type]
    bounded = BoundedSandbox(**env_kw).from_string(QWEN3_TEMPLATE)  # type: ignore[arg-type]
    assert plain.render(**kwargs) == bounded.render(**kwargs)

    return {"template render (bounded sandbox)": (lambda: plain.render(**kwargs),
                                                  lambda: bounded.render(**kwargs), 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--before", default="91e9d3c",
                    help="the commit before the hardening round (its inference.py)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL statement")
    args = ap.parse_args()
    before = _before_inference(args.before)
    table = {**pieces(before), **clock_pieces(), **render_pieces()}
    if not args.no_pg:
        table.update(pg_pieces())
    results: dict[str, dict[str, float]] = {}
    print(f"{'piece':<36} {'before us':>10} {'now us':>10} {'added us':>10} {'ratio':>7}")
    for name, (old, new, n) in table.items():
        old(), new()  # warm up
        a, b = [], []
        for i in range(args.repeats):
            for fn, out in ((old, a), (new, b)) if i % 2 == 0 else ((new, b), (old, a)):
                out.append(per_op_us(fn, n))
        ma, mb = statistics.median(a), statistics.median(b)
        unit = " (40 chunks)" if name == "chunk" else ""
        print(f"{name + unit:<36} {ma:>10.2f} {mb:>10.2f} {mb - ma:>10.2f} {mb / ma:>6.2f}x")
        results[name] = {"before_us": round(ma, 2), "now_us": round(mb, 2)}
    print(json.dumps({"bench": "hardening_cost", "before": args.before, **results,
                      "loadavg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
