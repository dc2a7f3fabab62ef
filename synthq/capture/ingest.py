"""From the engine's file to synthq's store: wait for it whole, check it, store it.

A file counts only once it is in the store and its row says so (the row's
``done`` transition comes after the store's rename). Checks, in order:

* the file is whole (a safetensors header and tensors that fit it), with
  ``hidden_states`` [tokens, layers, hidden] and ``token_ids`` [tokens];
* the connector's checksum of ``hidden_states`` matches (when it wrote one);
* ``token_ids`` equal the sample's ``input_ids`` and the layer count is the job's:
  otherwise ``capture_mismatch`` (never data).

A sample of several examples (``--examples per-turn``, synthq.examples) is captured
one request per example, each its own prompt: :func:`ingest_parts` checks each
file against its example's ids and stores them end to end as one file, whose rows
align with the sample's concatenated ``input_ids`` and ``loss_mask``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from synthq.capture import files
from synthq.capture.plan import AUTO
from synthq.capture.store import Store, Stored
from synthq.errors import CaptureIncomplete, CaptureMismatch

__all__ = ["Ingested", "wait_whole", "ingest", "ingest_parts", "check", "discard"]


@dataclass(frozen=True, slots=True)
class Ingested:
    stored: Stored
    num_tokens: int
    hidden_size: int
    #: The stored dtype (``auto``: the engine file's own).
    dtype: str


def wait_whole(path: Path, *, timeout: float) -> None:
    """Until the engine's file is whole: synthq's connector renames it into place; the
    stock one holds an exclusive lock on ``<file>.lock`` while it writes."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        if path.is_file():
            if not lock.exists():
                return
            try:
                with open(lock) as f:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    return
            except BlockingIOError:
                pass  # still being written
            except FileNotFoundError:
                return
        if time.monotonic() >= deadline:
            raise CaptureIncomplete(f"the engine's file {path} did not appear whole within "
                                    f"{timeout:g} s")
        time.sleep(delay)
        delay = min(0.1, delay * 2)


def ingest(path: Path, *, input_ids: np.ndarray, layers: list[int], dtype: str, store: Store,
           metadata: dict[str, str]) -> Ingested:
    """Check the engine's file against the sample and put it in the store, its hidden
    states as ``dtype`` (``auto``: as the engine wrote them)."""
    return ingest_parts([path], [input_ids], layers=layers, dtype=dtype, store=store,
                        metadata=metadata)


def ingest_parts(paths: list[Path], pieces: list[np.ndarray], *, layers: list[int], dtype: str,
                 store: Store, metadata: dict[str, str]) -> Ingested:
    """Check each engine file against its piece of the sample's ids (one per example) and
    store them end to end as one file: ``hidden_states`` [sum of tokens, layers, hidden],
    ``token_ids`` the pieces concatenated (the sample's ``input_ids``)."""
    parts = [check(p, input_ids=ids, layers=layers) for p, ids in zip(paths, pieces, strict=True)]
    sizes = {t.shape[2] for t in parts}
    if len(sizes) != 1:
        raise CaptureMismatch(f"the examples' files have hidden sizes {sorted(sizes)}")
    if len({t.dtype for t in parts}) > 1:
        parts = [files.convert(t, "float32") for t in parts]
    want = np.concatenate(pieces).astype(np.int64)
    whole = files.Tensor(parts[0].dtype, (len(want), len(layers), parts[0].shape[2]),
                         b"".join(t.data for t in parts))
    if dtype == AUTO:  # the engine's own dtype: a bf16 engine's file is not widened
        dtype = files.DTYPE_NAMES[whole.dtype]
    hidden, scale = files.convert_scaled(whole, dtype)  # float8: one scale for the file
    out = {"hidden_states": hidden,
           "token_ids": files.Tensor("I64", (len(want),), want.astype("<i8").tobytes())}
    if scale is not None:
        out["hidden_states_scale"] = files.Tensor("F32", (1,),
                                                  np.float32(scale).astype("<f4").tobytes())
    meta_out = dict(metadata, layer_ids=",".join(str(i) for i in layers), dtype=dtype,
                    sha256_hidden_states=hashlib.sha256(hidden.data).hexdigest())
    if len(pieces) > 1:  # where each example's rows start (synthq.examples.split's cuts)
        meta_out["example_tokens"] = ",".join(str(len(p)) for p in pieces)
    stored = store.put(files.dumps(out, meta_out))
    return Ingested(stored, len(want), hidden.shape[2], dtype)


def check(path: Path, *, input_ids: np.ndarray, layers: list[int]) -> files.Tensor:
    """The engine's file's ``hidden_states``, once it is whole and its token ids and shape
    are ``input_ids``'s; raises ``capture_incomplete`` or ``capture_mismatch``."""
    try:
        tensors, meta = files.read(path)
    except (OSError, ValueError) as exc:
        raise CaptureIncomplete(f"the engine's file is not whole: {exc}") from exc
    hidden, ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if hidden is None or ids is None:
        raise CaptureMismatch("the file has no hidden_states or token_ids tensor")
    expected = meta.get("sha256_hidden_states")
    if expected and hashlib.sha256(hidden.data).hexdigest() != expected:
        raise CaptureIncomplete("hidden_states fails the connector's checksum")
    got = ids.array().astype(np.int64)
    want = input_ids.astype(np.int64)
    if got.shape != want.shape or not np.array_equal(got, want):
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                     min(len(got), len(want)))
        raise CaptureMismatch(
            f"the engine captured {len(got)} tokens, the sample has {len(want)}; they "
            f"differ from position {first}")
    if len(hidden.shape) != 3 or hidden.shape[0] != len(want) or hidden.shape[1] != len(layers):
        raise CaptureMismatch(
            f"hidden_states has shape {list(hidden.shape)}, expected [{len(want)}, "
            f"{len(layers)}, hidden]: the engine captures other layers than the job's "
            f"{layers}?")
    if hidden.dtype not in ("F32", "BF16", "F16"):
        raise CaptureMismatch(f"hidden_states is {hidden.dtype}, not a float")
    return hidden


def discard(path: Path) -> None:
    """Remove the engine's file and its lock once the store holds the capture."""
    for p in (path, Path(f"{path}.lock")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
