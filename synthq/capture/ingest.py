"""From the engine's file to synthq's store: wait for it whole, check it, store it.

A file counts only once it is in the store and its row says so (the row's
``done`` transition comes after the store's rename). Checks, in order:

* the file is reached only through its folder's descriptor (synthq.capture.confine:
  no symlink, a plain file with one link), and is no larger than the sample's tokens ×
  layers × hidden × 4 B (plus a bounded header) before a byte of it is read;
* its header is the layout (:class:`files.Malformed`: ``capture_mismatch``), with
  ``hidden_states`` [tokens, layers, hidden] and ``token_ids`` [tokens], judged before
  the tensors are read; the tensors fit the file (else ``capture_incomplete``);
* the connector's checksum of ``hidden_states`` matches (when it wrote one);
* the layer ids the connector wrote in the file's metadata (protocol.LAYERS_KEY) are the
  job's, checked from the header before any tensor is read (:class:`OtherLayers`, a
  ``capture_mismatch``: the engine was started with other
  ``eagle_aux_hidden_state_layer_ids``); a file without them (vLLM's stock connector) is
  held to the layer count only;
* ``token_ids`` equal the sample's ``input_ids`` and the layer count is the job's:
  otherwise ``capture_mismatch`` (never data);
* every value of ``hidden_states`` is finite: a NaN or an infinity is
  ``capture_mismatch``, never stored (in float8 one infinity would clip the whole
  tensor's scale).

Every wait (the file whole, the stock connector's ``.lock``) ends at the capture's
deadline; the lock is opened without blocking and looked at first (a FIFO is refused).

A sample of several examples (``--examples per-turn``, synthq.data.examples) is captured
one request per example, each its own prompt: :func:`ingest_parts` checks each
file against its example's ids and stores them end to end as one file, whose rows
align with the sample's concatenated ``input_ids`` and ``loss_mask``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from synthq.capture import confine, files
from synthq.capture.plan import AUTO
from synthq.capture.protocol import LAYERS_KEY
from synthq.capture.store import Store, Stored
from synthq.core.errors import BadRequest, CaptureIncomplete, CaptureMismatch
from synthq.core.retry import exponential

__all__ = ["Ingested", "wait_whole", "ingest", "ingest_parts", "store_parts", "rows", "check",
           "check_layers", "OtherLayers", "discard", "largest_file", "MAX_HIDDEN"]

#: The hidden size a file may have when the target's is not known (the largest served
#: models' are 16,384-25,600).
MAX_HIDDEN = 1 << 16


class OtherLayers(CaptureMismatch):
    """The engine captures other layers than the job's, as its file's metadata says: the
    server's configuration, not the sample's fault, so the capture stage stops at the first
    (synthq.capture.stage) and a probe refuses the server."""


def check_layers(metadata: dict[str, str], layers: list[int]) -> None:
    """Raise :class:`OtherLayers` when the file's metadata names the layers its engine
    captured (protocol.LAYERS_KEY) and they are not ``layers``; nothing when it names none
    (vLLM's stock connector: the layer count is checked with the shape)."""
    raw = metadata.get(LAYERS_KEY)
    if raw is None:
        return
    try:
        captured = [int(part) for part in raw.split(",")]
    except ValueError:
        raise CaptureMismatch(f"the file's {LAYERS_KEY} metadata is not layer ids: "
                              f"{raw[:80]!r}") from None
    if captured != [int(i) for i in layers]:
        raise OtherLayers(
            f"the engine captures layers {captured}, the job's are {list(layers)}: start it "
            f"with eagle_aux_hidden_state_layer_ids {list(layers)}")


@dataclass(frozen=True, slots=True)
class Ingested:
    stored: Stored
    num_tokens: int
    hidden_size: int
    #: The stored dtype (``auto``: the engine file's own).
    dtype: str


@contextlib.contextmanager
def _file(file: confine.EngineFile | Path) -> Iterator[confine.EngineFile]:
    """``file`` as an :class:`confine.EngineFile`; a path synthq names itself (tests,
    tools) opened the same way, its folder closed after."""
    if isinstance(file, confine.EngineFile):
        yield file
        return
    opened = confine.local(Path(file))
    try:
        yield opened
    finally:
        opened.folder.close()


def wait_whole(file: confine.EngineFile | Path, *, timeout: float | None = None,
               deadline: float | None = None) -> None:
    """Until the engine's file is whole: synthq's connector renames it into place; the
    stock one holds an exclusive lock on ``<file>.lock`` while it writes. Ends by
    ``deadline`` (``time.monotonic()``) or after ``timeout`` seconds, whichever is first."""
    ends = [t for t in (deadline, None if timeout is None else time.monotonic() + timeout)
            if t is not None]
    until = min(ends) if ends else time.monotonic()
    polls = 0
    with _file(file) as engine_file:
        while True:
            if engine_file.present() and engine_file.unlocked():
                return
            left = until - time.monotonic()
            if left <= 0:
                raise CaptureIncomplete(f"the engine's file {engine_file} did not appear "
                                        "whole within the capture's deadline")
            polls += 1  # the one backoff curve: 5 ms doubling to 0.1 s
            time.sleep(min(exponential(polls, base=0.005, cap=0.1), left))


def ingest(path: confine.EngineFile | Path, *, input_ids: np.ndarray, layers: list[int],
           dtype: str, store: Store, metadata: dict[str, str],
           hidden: int | None = None) -> Ingested:
    """Check the engine's file against the sample and put it in the store, its hidden
    states as ``dtype`` (``auto``: as the engine wrote them)."""
    return ingest_parts([path], [input_ids], layers=layers, dtype=dtype, store=store,
                        metadata=metadata, hidden=hidden)


def ingest_parts(paths: Sequence[confine.EngineFile | Path], pieces: list[np.ndarray], *,
                 layers: list[int], dtype: str, store: Store, metadata: dict[str, str],
                 hidden: int | None = None) -> Ingested:
    """Check each engine file against its piece of the sample's ids (one per example) and
    store them end to end as one file: ``hidden_states`` [sum of tokens, layers, hidden],
    ``token_ids`` the pieces concatenated (the sample's ``input_ids``)."""
    parts = [check(p, input_ids=ids, layers=layers, hidden=hidden)
             for p, ids in zip(paths, pieces, strict=True)]
    return store_parts(parts, pieces, layers=layers, dtype=dtype, store=store,
                       metadata=metadata)


def store_parts(parts: Sequence[files.Tensor], pieces: Sequence[np.ndarray], *,
                layers: list[int], dtype: str, store: Store,
                metadata: dict[str, str]) -> Ingested:
    """Checked ``hidden_states`` [tokens, layers, hidden], one per piece of ids (each as many
    rows as its piece has ids), stored end to end as one file as ``dtype``."""
    sizes = {t.shape[2] for t in parts}
    if len(sizes) != 1:
        raise CaptureMismatch(f"the examples' files have hidden sizes {sorted(sizes)}")
    if len({t.dtype for t in parts}) > 1:
        parts = [files.convert(t, "float32") for t in parts]
    want = np.concatenate(pieces).astype(np.int64)
    whole = files.Tensor(parts[0].dtype, (len(want), len(layers), parts[0].shape[2]),
                         parts[0].data if len(parts) == 1 else b"".join(t.data for t in parts))
    if dtype == AUTO:  # the engine's own dtype: a bf16 engine's file is not widened
        dtype = files.DTYPE_NAMES[whole.dtype]
    states, scale = files.convert_scaled(whole, dtype)  # float8: one scale for the file
    out = {"hidden_states": states,
           "token_ids": files.Tensor("I64", (len(want),), want.astype("<i8").tobytes())}
    if scale is not None:
        out["hidden_states_scale"] = files.Tensor("F32", (1,),
                                                  np.float32(scale).astype("<f4").tobytes())
    meta_out = dict(metadata, **{LAYERS_KEY: ",".join(str(i) for i in layers)}, dtype=dtype,
                    sha256_hidden_states=hashlib.sha256(states.data).hexdigest())
    if len(pieces) > 1:  # where each example's rows start (synthq.data.examples.split's cuts)
        meta_out["example_tokens"] = ",".join(str(len(p)) for p in pieces)
    stored = store.put(files.dumps(out, meta_out))
    return Ingested(stored, len(want), states.shape[2], dtype)


def rows(tensor: files.Tensor, n: int) -> files.Tensor:
    """The first ``n`` rows (tokens) of ``hidden_states`` [tokens, layers, hidden]: the
    states of a prefix of the tokens (a causal model's states of a token depend on it and
    the ones before it only)."""
    if not 0 <= n <= tensor.shape[0]:
        raise ValueError(f"{n} rows of {tensor.shape[0]}")
    per_row = len(tensor.data) // tensor.shape[0] if tensor.shape[0] else 0
    return files.Tensor(tensor.dtype, (n, *tensor.shape[1:]),
                        memoryview(tensor.data)[:n * per_row].tobytes())


def largest_file(tokens: int, layers: int, hidden: int | None) -> int:
    """The most bytes an engine file of ``tokens`` × ``layers`` may hold: float32 states
    of the target's hidden size (:data:`MAX_HIDDEN` when unknown), int64 token ids, the
    length and a header of at most :data:`files.MAX_HEADER`."""
    return 8 + files.MAX_HEADER + tokens * layers * (hidden or MAX_HIDDEN) * 4 + tokens * 8


def check(path: confine.EngineFile | Path, *, input_ids: np.ndarray, layers: list[int],
          hidden: int | None = None) -> files.Tensor:
    """The engine's file's ``hidden_states``, once it is whole and its token ids and shape
    are ``input_ids``'s; raises ``capture_incomplete`` or ``capture_mismatch``. The file
    is opened in its folder's descriptor and sized before it is read; its header is
    judged before its tensors are read (``hidden``: the target's hidden size, if known,
    the most the file's may be)."""
    want = input_ids.astype(np.int64)
    try:
        with _file(path) as engine_file:
            fd = engine_file.open(most=largest_file(len(want), len(layers), hidden))
    except FileNotFoundError as exc:
        raise CaptureIncomplete(f"the engine's file is not whole: {exc.strerror}") from None
    try:
        return _check_open(fd, want, layers, hidden)
    finally:
        os.close(fd)


def _check_open(fd: int, want: np.ndarray, layers: list[int],
                hidden: int | None) -> files.Tensor:
    try:
        entries, meta, body = files.header(fd, os.fstat(fd).st_size)
    except files.NotWhole as exc:
        raise CaptureIncomplete(f"the engine's file is not whole: {exc}") from None
    except files.Malformed as exc:
        raise CaptureMismatch(f"the engine's file is not a capture file: {exc}") from None
    check_layers(meta, layers)  # the header's word, before a tensor is read
    states, ids_entry = entries.get("hidden_states"), entries.get("token_ids")
    if states is None or ids_entry is None:
        raise CaptureMismatch("the file has no hidden_states or token_ids tensor")
    if states.dtype not in ("F32", "BF16", "F16"):
        raise CaptureMismatch(f"hidden_states is {states.dtype}, not a float")
    try:
        ids = files.tensors_of(fd, entries, body, ["token_ids"])["token_ids"]
    except files.NotWhole as exc:
        raise CaptureIncomplete(f"the engine's file is not whole: {exc}") from None
    got = ids.array().astype(np.int64).ravel()
    if got.shape != want.shape or not np.array_equal(got, want):
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                     min(len(got), len(want)))
        raise CaptureMismatch(
            f"the engine captured {len(got)} tokens, the sample has {len(want)}; they "
            f"differ from position {first}")
    shape = states.shape
    if len(shape) != 3 or shape[0] != len(want) or shape[1] != len(layers):
        raise CaptureMismatch(
            f"hidden_states has shape {list(shape)}, expected [{len(want)}, "
            f"{len(layers)}, hidden]: the engine captures other layers than the job's "
            f"{layers}?")
    if shape[2] > (hidden or MAX_HIDDEN):
        raise CaptureMismatch(f"hidden_states has a hidden size of {shape[2]}, over the "
                              f"{hidden or MAX_HIDDEN} {'of the target' if hidden else 'at most'}")
    try:
        tensor = files.tensors_of(fd, entries, body, ["hidden_states"])["hidden_states"]
    except files.NotWhole as exc:
        raise CaptureIncomplete(f"the engine's file is not whole: {exc}") from None
    expected = meta.get("sha256_hidden_states")
    if expected and hashlib.sha256(tensor.data).hexdigest() != expected:
        raise CaptureIncomplete("hidden_states fails the connector's checksum")
    bad = files.nonfinite(tensor)
    if bad:
        raise CaptureMismatch(f"hidden_states holds {bad} NaN or infinite values (of "
                              f"{int(np.prod(shape))}): not stored")
    return tensor


def discard(path: confine.EngineFile | Path) -> None:
    """Remove the engine's file and its lock once the store holds the capture, by name in
    the folder's descriptor."""
    if isinstance(path, confine.EngineFile):
        path.discard()
        return
    try:
        engine_file = confine.local(path)
    except (OSError, BadRequest):
        return  # its folder is not one (a path through a file): nothing there to delete
    engine_file.discard()
    engine_file.folder.close()
