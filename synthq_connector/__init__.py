"""synthq's hidden-states connector for vLLM.

vLLM imports this module in its own process (``kv_connector_module_path``), so
it depends on vLLM, torch and safetensors only, never on the rest of synthq.

It is vLLM's ``ExampleHiddenStatesConnector`` with these changes:

* **CPU extraction.** The stock connector copies the hidden states out of the
  KV cache with a CUDA stream into pinned memory, which fails on a CPU build
  (``pin_memory=True requires a CUDA or other accelerator backend``). When the
  cache lives on the CPU this one slices it directly; on a GPU it keeps the
  stock asynchronous path.
* **Whole files only.** A file is written under a temporary name, fsynced and
  renamed into place, so a reader (or a kill -9 of the engine) never sees a
  half-written file under its final name.
* **A checksum.** The file's safetensors metadata carries the sha256 of the
  ``hidden_states`` bytes and the tensor's shape and dtype; synthq checks it
  before a capture counts.
* **Its layers named.** The metadata also carries the layer ids the engine captures
  (``layer_ids``: the speculative config's ``eagle_aux_hidden_state_layer_ids``, in the
  order of ``hidden_states``' second axis): the shape only counts them, and synthq
  refuses a file of other layers than its job's with the same count.
* **Names confined, one request per name.** A request names its file with
  ``kv_transfer_params.synthq_name`` (letters, digits, ``-``, ``_`` and ``.``, not
  starting with ``.``), written directly in the connector's ``shared_storage_path``.
  Without such a name the file is ``request-<the request id, made safe>-<hash>``: the
  stock name is the request id, which ``X-Request-Id`` sets (``/../../x`` wrote above
  the folder); a synthq_name beginning ``request-`` is taken for one of these.
  ``hidden_states_path`` in a request is never used (the stock
  ``allow_custom_save_path`` is ignored). A request naming a file that another
  request's save still holds (from its scheduling until its file is written) gets no
  file: it is served, and its answer's ``kv_transfer_params`` says why
  (``synthq_refused``), with no ``hidden_states_path``. vLLM's stock code would make
  the second wait, on the worker's main thread, for the first's lock, which that
  thread must release: no request was ever answered again.
* **Never waits on a lock.** The ``.lock`` beside a file is taken without blocking and
  without following a symlink; if something else holds it, the file is written without
  (it is renamed into place whole anyway) and a warning says so.
* **Unnamed files do not pile up.** Files of requests without a synthq_name are the
  client's to read and delete (vLLM's ``cleanup_hidden_states``); those older than
  ``unnamed_file_ttl_s`` (``kv_connector_extra_config``, default 3600; 0 keeps them)
  are deleted by the writer, with their locks. synthq deletes the files it names.

Start vLLM with::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}}'
    --kv-transfer-config '{"kv_connector": "SynthqHiddenStatesConnector",
        "kv_connector_module_path": "synthq_connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/path/to/engine-dir"}}'

with this repository's root on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import tempfile
import threading
import time
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

# The keys are synthq.capture.protocol's (stdlib only: vLLM loads this package from the
# repository, where synthq is too), so the capture stage and this connector share them.
from synthq.capture.protocol import LAYERS_KEY, NAME_KEY, REFUSED_KEY

__all__ = ["SynthqHiddenStatesConnector", "tensor_sha256", "NAME_KEY", "REFUSED_KEY",
           "LAYERS_KEY", "file_name", "captured_layers"]

logger = init_logger(__name__)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
#: The file name of a request without a synthq_name begins with this.
UNNAMED_PREFIX = "request-"


def file_name(req_id: str, params: Any) -> str:
    """The file name (no folder) of a request: its safe synthq_name, else one made from
    its request id; either has no ``/`` and does not start with ``.``."""
    name = params.get(NAME_KEY) if isinstance(params, dict) else None
    if isinstance(name, str) and _SAFE_NAME.match(name) and not name.startswith("."):
        return f"{name}.safetensors"
    # The id as far as it is safe (for a reader of the folder), and a hash of all of it
    # (ids that differ only in unsafe characters stay apart).
    digest = hashlib.sha256(req_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{UNNAMED_PREFIX}{_UNSAFE_CHARS.sub('_', req_id)[:64]}-{digest}.safetensors"


def captured_layers(vllm_config: Any) -> str | None:
    """The layer ids this engine captures, as a file's ``layer_ids`` metadata says them
    (``2,4,5,8``): the draft model's ``eagle_aux_hidden_state_layer_ids``, which vLLM's
    ``extract_hidden_states`` captures in that order; None where the config has none."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    ids = getattr(getattr(draft, "hf_config", None), "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        return None
    return ",".join(str(int(i)) for i in ids)


def _try_lock(filename: str) -> int | None:
    """An fd holding ``LOCK_EX`` on ``<filename>.lock``, or None: never waits (a lock
    someone else holds would stop the worker's main thread) and never follows a symlink
    (it would truncate a file outside the folder)."""
    try:
        fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW,
                     0o644)
    except OSError as exc:
        logger.warning("synthq_connector: no lock for %s (%s); writing it without",
                       filename, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        logger.warning("synthq_connector: %s.lock is held by another process; writing the "
                       "file without it (it is renamed into place whole)", filename)
        return None
    return fd


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a contiguous CPU tensor's bytes (as safetensors stores them)."""
    data = tensor.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


class _Done:
    """Stands for a finished CUDA event on the CPU path (nothing is in flight)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


def _write_whole(tensors: dict[str, torch.Tensor], filename: str, event: Any,
                 lock_fd: int | None, layer_ids: str | None = None) -> None:
    """Thread worker: write ``filename`` whole (tmp, fsync, rename), then release the lock;
    ``layer_ids``: the captured layers (:func:`captured_layers`), kept in its metadata."""
    try:
        event.synchronize()
        hidden = tensors["hidden_states"].contiguous()
        metadata = {
            "sha256_hidden_states": tensor_sha256(hidden),
            "shape": ",".join(str(n) for n in hidden.shape),
            "dtype": str(hidden.dtype).removeprefix("torch."),
            "writer": "synthq_connector",
        }
        if layer_ids is not None:
            metadata[LAYERS_KEY] = layer_ids
        # A new, unguessable name in the folder, made with O_EXCL: a symlink planted
        # under a predictable one would be written through.
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(filename) + ".", suffix=".tmp",
                                   dir=os.path.dirname(filename) or ".")
        os.close(fd)
        try:
            # (safetensors >= 0.8 writes a file of its own and renames it onto ``tmp``.)
            save_file({"hidden_states": hidden, "token_ids": tensors["token_ids"]}, tmp,
                      metadata=metadata)
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, filename)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(os.path.dirname(filename) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX


class _Written:
    """A CPU save's "copy event": done once its file is written and its lock released, so
    vLLM reports the request finished sending (and the scheduler frees its name) only
    then. (On a GPU the stock event stays: the blocks go back after the copy.)"""

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.exception()  # waits; the error is _on_write_done's to log


class SynthqHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that works on the CPU, writes whole, checked files
    under names confined to its folder, and never lets two requests hold one name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Scheduler side. A file → the request whose save holds it, from its scheduling
        # until vLLM reports it finished sending (written: _Written) or it saves nothing.
        self._holder: dict[str, str] = {}
        self._held: dict[str, str] = {}  # the same, request → file
        self._refused: dict[str, str] = {}  # request → why it got no file
        # Worker side: the sweep of old unnamed files (the writer threads run it).
        self._unnamed_ttl = float(self._kv_transfer_config.get_from_extra_config(
            "unnamed_file_ttl_s", 3600))
        self._sweep_lock = threading.Lock()
        self._swept_at = 0.0
        #: The layers each file holds, named in its metadata (synthq checks them).
        self._layer_ids = captured_layers(self._vllm_config)

    # ---- scheduler side -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # The stock method names files after the request id (or a hidden_states_path the
        # request gives); every name is replaced by one confined to the folder.
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            req_id = new_req.req_id
            params = (
                new_req.sampling_params.extra_args.get("kv_transfer_params")
                if new_req.sampling_params and new_req.sampling_params.extra_args
                else None
            ) or {}
            filename = os.path.join(self._storage_path, file_name(req_id, params))
            holder = self._holder.get(filename)
            if req_id in self._refused or (holder is not None and holder != req_id):
                # Served without a file: no lock, no save, nothing to wait on.
                self._request_filenames.pop(req_id, None)
                meta.new_req_filenames.pop(req_id, None)
                if req_id not in self._refused:
                    self._refused[req_id] = (
                        f"the file {os.path.basename(filename)} is another request's, still "
                        "being saved: this request gets none (send a name of its own)")
                    logger.warning("synthq_connector: request %s names %s, which request %s "
                                   "still holds: served without a file", req_id, filename,
                                   holder)
                continue
            self._holder[filename] = req_id
            self._held[req_id] = filename
            self._request_filenames[req_id] = filename
            meta.new_req_filenames[req_id] = filename
        return meta

    def _release(self, req_id: str) -> None:
        filename = self._held.pop(req_id, None)
        if filename is not None and self._holder.get(filename) == req_id:
            del self._holder[filename]

    def _settle(self, req_id: str, delay: bool,
                params: dict[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
        """A finished request's outcome: a refused one says why; one that saves nothing
        frees its name now (one that saves, once vLLM reports it sent)."""
        if not delay:
            self._release(req_id)
        reason = self._refused.pop(req_id, None)
        if reason is not None:
            return False, {REFUSED_KEY: reason}
        return delay, params

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        return self._settle(request.request_id, delay, params)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # The stock method may return before request_finished (no block table): settle
        # here too (idempotent).
        delay, params = super().request_finished_all_groups(request, block_ids)
        return self._settle(request.request_id, delay, params)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for req_id in connector_output.finished_sending or ():
            self._release(req_id)

    # ---- worker side ----------------------------------------------------------------

    def wait_for_save(self) -> None:
        """The stock pre-lock of new requests' files (before the scheduler answers their
        path), never waiting: see :func:`_try_lock`."""
        if not self._is_tp_rank_zero or not self.use_lock or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            return
        for req_id, filename in metadata.new_req_filenames.items():
            if req_id in self._lock_fds:
                continue
            os.makedirs(os.path.dirname(filename), exist_ok=True)
            lock_fd = _try_lock(filename)
            if lock_fd is not None:
                self._lock_fds[req_id] = lock_fd

    def _submit_async_write(self, pending: PendingSave) -> None:
        assert self._kv_cache is not None
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache.is_cuda:
            # The stock path (a CUDA stream into pinned memory) with our writer.
            return self._submit_cuda(pending)
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        # [tokens, layers, hidden]: a copy, since the blocks are freed after this step.
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        self._submit_write(pending, hidden, _Done())

    def _submit_cuda(self, pending: PendingSave) -> None:
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            slots_gpu = slots.to(device=self._kv_cache.device, non_blocking=True)
            on_gpu = extract_from_kv_cache(self._kv_cache, slots_gpu, num_tokens)
            pinned = torch.empty_like(on_gpu, device="cpu", pin_memory=True)
            pinned.copy_(on_gpu, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        self._submit_write(pending, pinned, done)

    def _submit_write(self, pending: PendingSave, hidden: torch.Tensor, event: Any) -> None:
        assert pending.req_id not in self._req_futures, "two saves for one request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = _try_lock(pending.filename)
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        future: Future[None] = self._executor.submit(
            self._write_and_sweep, tensors, pending.filename, event, lock_fd
        )
        self._req_copy_events[pending.req_id] = (
            _Written(future) if isinstance(event, _Done) else event)
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _write_and_sweep(self, tensors: dict[str, torch.Tensor], filename: str, event: Any,
                         lock_fd: int | None) -> None:
        """Thread worker: the file, whole; then, at most once a minute, the sweep."""
        _write_whole(tensors, filename, event, lock_fd, self._layer_ids)
        self._sweep_unnamed()

    def _sweep_unnamed(self) -> None:
        """Delete files of requests without a synthq_name (and their locks) older than
        ``unnamed_file_ttl_s``: no client named them, and nothing else would."""
        ttl = self._unnamed_ttl
        now = time.time()
        with self._sweep_lock:
            if ttl <= 0 or now - self._swept_at < min(ttl, 60.0):
                return
            self._swept_at = now
        try:
            entries = list(os.scandir(self._storage_path))
        except OSError:
            return
        for entry in entries:
            if not entry.name.startswith(UNNAMED_PREFIX) or not entry.name.endswith(
                    (".safetensors", ".safetensors.lock")):
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > ttl:
                    os.unlink(entry.path)
