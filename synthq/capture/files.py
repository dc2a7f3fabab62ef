"""The safetensors layout, read and written without torch (capture workers need none).

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``) and the
tensors' bytes. Only what capture needs: read a file whole, convert float32 to
bfloat16/float16, write a file to bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Tensor", "read", "dumps", "convert", "MAX_HEADER", "DTYPE_NAMES"]

#: A header larger than this is not a capture file (the connector's are < 1 KiB).
MAX_HEADER = 1 << 20
_NUMPY = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "BF16": np.uint16}
_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
#: safetensors' float codes → synthq's dtype names.
DTYPE_NAMES = {code: name for name, code in _CODE.items()}


@dataclass(frozen=True, slots=True)
class Tensor:
    #: safetensors' dtype code (``F32``, ``BF16``, ``I64`` ...).
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def array(self) -> np.ndarray:
        """As numpy (bfloat16 widened to float32)."""
        if self.dtype == "BF16":
            raw = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return raw.view(np.float32).reshape(self.shape)
        return np.frombuffer(self.data, dtype=np.dtype(_NUMPY[self.dtype]).newbyteorder("<")) \
            .reshape(self.shape)


def read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor of a file and its metadata; ValueError when it is not whole."""
    blob = Path(path).read_bytes()
    if len(blob) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > MAX_HEADER or 8 + size > len(blob):
        raise ValueError("the header runs past the file")
    header = json.loads(blob[8:8 + size])
    body = blob[8 + size:]
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, Tensor] = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= len(body) or info["dtype"] not in _NUMPY:
            raise ValueError(f"tensor {name!r} is cut or of an unknown dtype")
        shape = tuple(int(n) for n in info["shape"])
        width = np.dtype(_NUMPY[info["dtype"]]).itemsize
        if int(np.prod(shape, dtype=np.int64)) * width != end - start:
            raise ValueError(f"tensor {name!r}: its bytes do not match its shape")
        tensors[name] = Tensor(info["dtype"], shape, body[start:end])
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def convert(tensor: Tensor, dtype: str) -> Tensor:
    """A float32 tensor stored as ``dtype`` (``float32``, ``bfloat16``, ``float16``)."""
    code = _CODE[dtype]
    if tensor.dtype == code:
        return tensor
    values = tensor.array().astype(np.float32, copy=False)
    if code == "BF16":  # round to nearest even, as torch does
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        data = rounded.astype("<u2").tobytes()
    elif code == "F16":
        data = values.astype("<f2").tobytes()
    else:
        data = values.astype("<f4").tobytes()
    return Tensor(code, tensor.shape, data)


def dumps(tensors: dict[str, Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file's bytes (tensors in name order, 8-byte aligned header)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(tensors[n].data for n in sorted(tensors))
