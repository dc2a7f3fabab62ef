"""The capture stage's file checks, store and safetensors codec, without an engine.

The engine tier (tests/engine/test_capture.py) runs the real path; these make the
engine's misbehaviour happen on purpose: other token ids, a cut file, a bad checksum.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from synthq.capture import files, ingest
from synthq.capture.store import Store
from synthq.core.errors import CaptureIncomplete, CaptureMismatch

IDS = np.array([0, 5, 17, 99, 128000], dtype="<i4")


def _engine_file(path: Path, ids: np.ndarray, layers: int = 3, *, sha: str | None = "auto",
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
    hidden = hidden if hidden is not None else torch.randn(len(ids), layers, 8)
    meta = {}
    if sha == "auto":
        meta["sha256_hidden_states"] = hashlib.sha256(
            hidden.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    elif sha is not None:
        meta["sha256_hidden_states"] = sha
    save_file({"hidden_states": hidden, "token_ids": torch.from_numpy(ids.astype(np.int64))},
              str(path), metadata=meta)
    return hidden


def test_codec_reads_what_safetensors_writes_and_back(tmp_path: Path) -> None:
    hidden = _engine_file(tmp_path / "a.safetensors", IDS)
    tensors, meta = files.read(tmp_path / "a.safetensors")
    np.testing.assert_array_equal(tensors["hidden_states"].array(), hidden.numpy())
    (tmp_path / "b.safetensors").write_bytes(files.dumps(tensors, {"k": "v"}))
    back = load_file(str(tmp_path / "b.safetensors"))
    assert torch.equal(back["hidden_states"], hidden)
    assert back["token_ids"].tolist() == IDS.tolist()


def test_bfloat16_conversion_rounds_like_torch() -> None:
    values = torch.randn(1000) * 100
    values[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, 65504.0])  # ties, zero
    t = files.Tensor("F32", (1000,), values.numpy().astype("<f4").tobytes())
    got = files.convert(t, "bfloat16")
    want = values.to(torch.bfloat16).view(torch.uint16).numpy().astype("<u2").tobytes()
    assert got.dtype == "BF16" and got.data == want
    f16 = files.convert(t, "float16")
    assert f16.data == values.to(torch.float16).numpy().astype("<f2").tobytes()


def test_ingest_refuses_other_token_ids(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    _engine_file(path, np.array([0, 5, 17, 98, 128000], dtype="<i4"))
    with pytest.raises(CaptureMismatch, match="differ from position 3"):
        ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32",
                      store=Store(tmp_path / "store"), metadata={})
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").rglob("*.*"))


def test_ingest_refuses_another_layer_count(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    _engine_file(path, IDS, layers=4)
    with pytest.raises(CaptureMismatch, match="other layers"):
        ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32",
                      store=Store(tmp_path / "store"), metadata={})


def test_ingest_refuses_other_layer_ids_of_the_same_count(tmp_path: Path) -> None:
    """Issue 43 item 5: the connector names the layers it captured; a file of [1, 3, 4]
    for a job of [2, 3, 4] has the job's layer count, and is refused by its ids in one
    line naming both lists. A stock file (no ids) keeps the count check; the job's own ids
    pass."""
    from synthq.capture.protocol import LAYERS_KEY

    path, store = tmp_path / "e.safetensors", Store(tmp_path / "store")
    hidden = torch.randn(len(IDS), 3, 8)

    def write(layer_ids: str | None) -> None:
        meta = {"sha256_hidden_states": hashlib.sha256(
            hidden.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}
        if layer_ids is not None:
            meta[LAYERS_KEY] = layer_ids
        save_file({"hidden_states": hidden,
                   "token_ids": torch.from_numpy(IDS.astype(np.int64))}, str(path),
                  metadata=meta)

    write("1,3,4")
    with pytest.raises(ingest.OtherLayers) as caught:
        ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32", store=store,
                      metadata={})
    assert isinstance(caught.value, CaptureMismatch)
    line = str(caught.value)
    assert "\n" not in line and "[1, 3, 4]" in line and "[2, 3, 4]" in line, line
    assert not list((tmp_path / "store").rglob("*.safetensors"))
    write("2,3,4")
    ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32", store=store,
                  metadata={})
    write(None)
    ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32", store=store,
                  metadata={})
    write("2,3,x")
    with pytest.raises(CaptureMismatch, match="not layer ids"):
        ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32", store=store,
                      metadata={})


def test_ingest_retries_a_cut_file_or_a_bad_checksum(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    _engine_file(path, IDS)
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])
    with pytest.raises(CaptureIncomplete, match="not whole"):
        ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32",
                      store=Store(tmp_path / "store"), metadata={})
    _engine_file(path, IDS, sha="0" * 64)
    with pytest.raises(CaptureIncomplete, match="checksum"):
        ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32",
                      store=Store(tmp_path / "store"), metadata={})


def test_ingest_stores_whole_checked_files_by_content(tmp_path: Path) -> None:
    path = tmp_path / "e.safetensors"
    hidden = _engine_file(path, IDS)
    store = Store(tmp_path / "store")
    got = ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32", store=store,
                        metadata={"engine": "vllm test"})
    blob = store.path(got.stored.path).read_bytes()
    assert got.stored.sha256 == hashlib.sha256(blob).hexdigest() == Path(got.stored.path).stem
    assert store.verify(got.stored.path, got.stored.sha256)
    assert torch.equal(load_file(str(store.path(got.stored.path)))["hidden_states"], hidden)
    again = ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="float32", store=store,
                          metadata={"engine": "vllm test"})
    assert again.stored == got.stored  # the same content, the same file
    assert store.leftovers() == []


def test_wait_whole_waits_for_the_stock_connectors_lock(tmp_path: Path) -> None:
    import fcntl
    import threading

    path = tmp_path / "e.safetensors"
    lock = open(f"{path}.lock", "w")  # noqa: SIM115 - held across the thread below
    fcntl.flock(lock, fcntl.LOCK_EX)
    _engine_file(path, IDS)
    threading.Timer(0.3, lock.close).start()
    ingest.wait_whole(path, timeout=5)  # returns once the writer lets go
    with pytest.raises(CaptureIncomplete, match="did not appear"):
        ingest.wait_whole(tmp_path / "never.safetensors", timeout=0.2)


@pytest.mark.parametrize(("engine", "code"), [(torch.bfloat16, "BF16"), (torch.float32, "F32")])
def test_auto_keeps_the_engines_dtype(tmp_path: Path, engine: torch.dtype, code: str) -> None:
    """The default ``auto``: a bf16 engine's file is stored at bf16 (not widened to
    float32), its values bit for bit; a float32 engine's stays float32."""
    path = tmp_path / "e.safetensors"
    hidden = _engine_file(path, IDS, hidden=torch.randn(len(IDS), 3, 8).to(engine))
    store = Store(tmp_path / "store")
    got = ingest.ingest(path, input_ids=IDS, layers=[2, 3, 4], dtype="auto", store=store,
                        metadata={})
    tensors, meta = files.read(store.path(got.stored.path))
    assert tensors["hidden_states"].dtype == code and meta["dtype"] == got.dtype
    assert got.dtype == {"BF16": "bfloat16", "F32": "float32"}[code]
    assert tensors["hidden_states"].data == hidden.contiguous().view(torch.uint8).numpy().tobytes()
    engine_bytes = path.stat().st_size
    assert got.stored.bytes < engine_bytes + 1024  # the engine's size, plus a header


def test_the_plan_says_which_dtype_applies() -> None:
    from synthq.capture.plan import Plan, auto_dtype

    assert auto_dtype({"torch_dtype": "bfloat16"}, None)[0] == "bfloat16"
    assert auto_dtype({"dtype": "bfloat16"}, "float32")[0] == "float32"  # the files win
    assert auto_dtype(None, None)[0] == "float32"
    dtype, why = auto_dtype({"dtype": "bfloat16"}, None)
    line = Plan(10, 1000, [2, 4, 5, 8], dtype, 64, 10**12, why).line()
    assert "4 layers × 64 × 2 B: bfloat16, auto: the engine's own" in line, line
    assert "set with --dtype" in Plan(10, 1000, [2], "float16", 64, 10**12).line()
