"""float8 (e4m3) storage of captured hidden states with a per-tensor scale (issue 30
item 4): the bytes are torch's own ``float8_e4m3fn`` rounding, the scale comes back."""

from __future__ import annotations

import numpy as np
import torch

from synthq.capture import files


def _tensor(values: np.ndarray) -> files.Tensor:
    return files.Tensor("F32", values.shape, values.astype("<f4").tobytes())


def test_float8_bytes_are_torchs_e4m3fn_rounding() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(0, 3, 5000), rng.normal(0, 0.01, 500),
                             [0.0, -0.0, 448.0, -448.0, 1e-9, 0.5 + 1 / 32]]).astype(np.float32)
    values = values.reshape(-1, 1, 1)
    stored, scale = files.convert_scaled(_tensor(values), "float8_e4m3")
    assert scale is not None and np.isclose(scale, np.abs(values).max() / 448)
    want = torch.from_numpy(values / np.float32(scale)).to(torch.float8_e4m3fn)
    assert stored.data == want.view(torch.uint8).numpy().tobytes()


def test_float8_round_trip_within_e4m3_precision_and_a_quarter_of_the_bytes() -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(0, 2, (64, 4, 128)).astype(np.float32)
    stored, scale = files.convert_scaled(_tensor(values), "float8_e4m3")
    assert len(stored.data) == values.size  # 1 byte a value, against float32's 4
    blob = files.dumps({"hidden_states": stored, "hidden_states_scale": files.Tensor(
        "F32", (1,), np.float32(scale).tobytes())}, {})
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "f.safetensors").write_bytes(blob)
        tensors, _ = files.read(Path(d) / "f.safetensors")
        back = files.hidden_states(tensors)
        from safetensors.torch import load_file

        loaded = load_file(str(Path(d) / "f.safetensors"))  # torch reads it too
        assert loaded["hidden_states"].dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(
            (loaded["hidden_states"].float() * loaded["hidden_states_scale"][0]).numpy(), back)
    # e4m3: 3 mantissa bits, a relative error of at most 1/16 above the subnormals.
    big = np.abs(values) > 2 ** -6 * scale
    assert np.all(np.abs(back - values)[big] <= np.abs(values)[big] / 16 + 1e-7)
