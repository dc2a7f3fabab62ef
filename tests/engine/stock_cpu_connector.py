"""vLLM's stock ``ExampleHiddenStatesConnector`` for the CPU, for the engine tier only.

The stock connector copies the hidden states out of the KV cache on a CUDA stream into
pinned memory, which a CPU build cannot do. This subclass replaces only that copy
(``_submit_async_write``) with a slice of the CPU cache; the stock file naming (the
request id under ``shared_storage_path``), its ``.lock`` files and its layout
(``hidden_states`` [tokens, layers, hidden], ``token_ids``) are the stock's, so synthq
meets the files a stock connector writes on a GPU (issue 30 item 1). vLLM imports it
in its own process (``kv_connector_module_path``); it is no part of synthq.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["StockCpuHiddenStatesConnector"]


class _Done:
    """A finished copy (the CPU slice is synchronous), where the stock code keeps a CUDA
    event."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class StockCpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape((1, self._block_size))
                 + block_ids.reshape((-1, 1)) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        # From here on, the stock method's own steps.
        prior = self._req_futures.get(pending.req_id)
        assert prior is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC,
                              0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename,
                                       lock_fd)
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
