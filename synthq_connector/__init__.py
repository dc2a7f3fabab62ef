"""synthq's hidden-states connector for vLLM.

vLLM imports this module in its own process (``kv_connector_module_path``), so
it depends on vLLM, torch and safetensors only, never on the rest of synthq.

It is vLLM's ``ExampleHiddenStatesConnector`` with three changes:

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

A request names its file with ``kv_transfer_params.synthq_name`` (letters,
digits, ``-``, ``_`` and ``.`` only), written under the connector's
``shared_storage_path``; without it the stock name (the request id) is used.

Start vLLM with::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}}'
    --kv-transfer-config '{"kv_connector": "SynthqHiddenStatesConnector",
        "kv_connector_module_path": "synthq_connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/path/to/engine-dir"}}'

with this repository's root on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

# The key is synthq.capture.protocol's (stdlib only: vLLM loads this package from the
# repository, where synthq is too), so the capture stage and this connector share it.
from synthq.capture.protocol import NAME_KEY

__all__ = ["SynthqHiddenStatesConnector", "tensor_sha256", "NAME_KEY"]

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


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
                 lock_fd: int | None) -> None:
    """Thread worker: write ``filename`` whole (tmp, fsync, rename), then release the lock."""
    try:
        event.synchronize()
        hidden = tensors["hidden_states"].contiguous()
        metadata = {
            "sha256_hidden_states": tensor_sha256(hidden),
            "shape": ",".join(str(n) for n in hidden.shape),
            "dtype": str(hidden.dtype).removeprefix("torch."),
            "writer": "synthq_connector",
        }
        tmp = f"{filename}.{os.getpid()}.tmp"
        save_file({"hidden_states": hidden, "token_ids": tensors["token_ids"]}, tmp,
                  metadata=metadata)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, filename)
        dir_fd = os.open(os.path.dirname(filename) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX


class SynthqHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that works on the CPU and writes whole, checked files."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # The stock method names files after the request id; a request that
        # gives a safe synthq_name gets that name instead, in the same folder.
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            params = (
                new_req.sampling_params.extra_args.get("kv_transfer_params")
                if new_req.sampling_params and new_req.sampling_params.extra_args
                else None
            ) or {}
            name = params.get(NAME_KEY)
            if not isinstance(name, str) or not _SAFE_NAME.match(name) or name.startswith("."):
                continue
            filename = os.path.join(self._storage_path, f"{name}.safetensors")
            self._request_filenames[new_req.req_id] = filename
            meta.new_req_filenames[new_req.req_id] = filename
        return meta

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
        import fcntl

        assert pending.req_id not in self._req_futures, "two saves for one request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        future: Future[None] = self._executor.submit(
            _write_whole, tensors, pending.filename, event, lock_fd
        )
        self._req_copy_events[pending.req_id] = event
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
