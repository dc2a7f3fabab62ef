"""``--capture inline``: the final answer's call captured its own hidden states.

A ``--capture inline`` job's generation server is also its capture server: a vLLM with
``extract_hidden_states`` and synthq's connector. The call of each sample's final answer
(synthq.serving.call) names a file (``kv_transfer_params.synthq_name``) and asks for the
output's states too (``include_output_tokens``, vLLM 0.32), and for the engine's token
ids (``return_token_ids``); the sample's final example is those ids, prompt then output,
the output supervised (synthq.data.examples.engine_example), and the file's name is kept
on the sample (``samples.inline_capture``).

The engine saves the states of every token it computed: the prompt's and the output's
but the last output token (never an input to a forward pass). The capture stage then
takes that file instead of calling the engine (:func:`take`), with no second prefill:

* the file is reached only in the server's folder (synthq.capture.confine: the declared
  engine-files folder, else the folder the start's :func:`probe` found), under the name
  the call sent;
* it is whole by the capture's file deadline, and its ``token_ids`` are the engine's own
  ids of that call (stored with the answer), its shape and checksum the connector's;
* each of the sample's pieces (its examples, synthq.data.examples.split) whose ids begin
  the file's takes its rows from it (a causal model's state of a token depends on it and
  the tokens before it only); the final example lacks the state of its last token, the
  one the engine never computed (its state would only predict past the example's end,
  which no loss supervises: synthq.training.captured reads it as zeros).

A file that is missing, mismatched or late is no failure: the stage captures the pieces
it did not cover with calls of its own, as for any other job. Either way the engine's
file is deleted once read.

A server that cannot capture (no ``hidden_states_path`` in its answer, or a file of the
prompt only: a vLLM without ``include_output_tokens``) is refused in one line before
anything is stored (:func:`probe`, from synthq.app.service.preflight) and at the start of
the capture stage.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from synthq.capture import confine, files, ingest
from synthq.capture.deadline import bounded
from synthq.capture.protocol import NAME_KEY, OUTPUT_KEY, PATH_KEY
from synthq.core.errors import CaptureMismatch, SampleError, UserError

__all__ = ["probe", "take", "orphans", "discard", "Piece", "PROBE_SECONDS"]

#: Seconds the probe of one server may take in all (its call and its file).
PROBE_SECONDS = 30.0

#: A piece's rows taken from the engine's file, with the ids they are the states of
#: (the piece's, or all but its last for the final example); None: not covered.
Piece = tuple[files.Tensor, np.ndarray] | None


def probe(client: httpx.Client, url: str, model: str, *, folder: str | None = None,
          pins: confine.Pins | None = None, seconds: float = PROBE_SECONDS,
          layers: list[int] | None = None) -> Path:
    """The folder where server ``url`` writes the hidden states of a generation call, or
    a :class:`UserError` in one line: a two-token completion asks it, as the final
    answer's call will, for the states of its prompt and output; the file must hold one
    state per token but the last (its output's included), and, given the job's
    ``layers``, the states of those layers (the ids the connector names in the file, else
    their count). The file is deleted."""
    deadline = time.monotonic() + seconds
    name = f"synthq-probe-{secrets.token_hex(8)}"
    body = {"model": model, "prompt": "synthq probe", "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "kv_transfer_params": {NAME_KEY: name, OUTPUT_KEY: True}}
    refused = f"--capture inline: server {url} cannot capture"
    try:
        with bounded(client, "POST", f"{url.rstrip('/')}/completions", deadline=deadline,
                     json=body) as response:
            text = response.read()
            if response.status_code >= 400:
                raise UserError(f"{refused}: its probe got HTTP {response.status_code}: "
                                f"{text[:300].decode('utf-8', 'replace')}")
        answer = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise UserError(f"{refused}: its probe failed: {type(exc).__name__}: {exc}") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    path = params.get(PATH_KEY) if isinstance(params, dict) else None
    if not isinstance(path, str):
        raise UserError(f"{refused}: its answer names no hidden-states file "
                        "(kv_transfer_params.hidden_states_path); start it with "
                        "extract_hidden_states and synthq's connector (docs/capture.md)")
    try:
        engine_file = confine.accept(Path(path), name=name, folder=folder, server=url,
                                     pins=pins)
    except SampleError as exc:
        raise UserError(f"{refused} here: {exc}") from None
    try:
        usage = answer.get("usage") or {}
        tokens = int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
        ingest.wait_whole(engine_file, deadline=deadline)
        fd = engine_file.open(most=ingest.largest_file(tokens, 64, None))
        try:
            entries, meta, body_at = files.header(fd, os.fstat(fd).st_size)
            ids = files.tensors_of(fd, entries, body_at, ["token_ids"])["token_ids"]
        finally:
            os.close(fd)
        saved = int(np.prod(ids.shape))
        states = entries["hidden_states"].shape
    except (KeyError, TypeError, ValueError, SampleError, OSError) as exc:
        raise UserError(f"{refused}: its probe's file {path} cannot be read here: "
                        f"{type(exc).__name__}: {exc}") from None
    finally:
        engine_file.discard()
        engine_file.folder.close()
    if layers is not None:
        try:
            ingest.check_layers(meta, layers)
        except SampleError as exc:
            raise UserError(f"{refused} the job's layers: {exc}") from None
        if len(states) != 3 or states[1] != len(layers):
            raise UserError(f"{refused} the job's layers: its probe's file has hidden_states "
                            f"of shape {list(states)}, not [tokens, {len(layers)}, hidden] for "
                            f"the job's layers {layers}")
    if saved != tokens - 1:
        raise UserError(f"{refused} its answers' states: its probe's file holds {saved} "
                        f"tokens' states, not the {tokens - 1} of its prompt and output (a "
                        f"vLLM without {OUTPUT_KEY}? vLLM 0.32 has it)")
    return engine_file.folder.path


def take(engine_file: confine.EngineFile, engine_ids: np.ndarray,
         pieces: Sequence[np.ndarray], *, layers: list[int], hidden: int | None,
         deadline: float) -> list[Piece]:
    """Each piece's rows from the final call's file, once it is whole by ``deadline`` and
    its token ids are ``engine_ids`` (the call's prompt and output) but the last; None for
    a piece whose ids do not begin the file's. Raises ``capture_incomplete`` (missing,
    late, cut) or ``capture_mismatch`` (another file's ids, shape or checksum)."""
    ingest.wait_whole(engine_file, deadline=deadline)
    seen = np.asarray(engine_ids, dtype=np.int64)[:-1]
    states = ingest.check(engine_file, input_ids=seen, layers=layers, hidden=hidden)
    out: list[Piece] = []
    for k, piece in enumerate(pieces):
        ids = np.asarray(piece, dtype=np.int64)
        n = min(len(ids), len(seen))
        short = len(ids) - n  # the final example's last token: no state
        if n and np.array_equal(ids[:n], seen[:n]) and (
                short == 0 or (short == 1 and k == len(pieces) - 1)):
            out.append((ingest.rows(states, n), np.asarray(piece)[:n]))
        else:
            out.append(None)
    if all(p is None for p in out):
        raise CaptureMismatch("the engine's file of the final call begins none of the "
                              "sample's examples")
    return out



def orphans(folder: Path, job_id: int, *, older_than: float) -> list[str]:
    """The names (no suffix) of job ``job_id``'s inline files in ``folder`` written more
    than ``older_than`` seconds ago: candidates for :func:`discard` once no sample names
    them (a call whose answer was not kept, truncated or retried, still left its file)."""
    prefix, suffix = f"synthq-{job_id}-", "-inline.safetensors"
    now = time.time()
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(prefix) and entry.name.endswith(suffix):
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime > older_than:
                    out.append(entry.name.removesuffix(".safetensors"))
            except OSError:
                continue
    return out


def discard(folder: Path, names: Sequence[str]) -> None:
    """Delete these inline files (and their locks) in ``folder``, through its descriptor."""
    if not names:
        return
    opened = confine.Folder(folder)
    try:
        for name in names:
            confine.EngineFile(opened, f"{name}.safetensors").discard()
    finally:
        opened.close()
