"""The safetensors layout, read and written without torch (capture workers need none).

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``) and the
tensors' bytes. Only what capture needs: read a file whole, convert float32 to
bfloat16/float16 or to float8 e4m3 with a per-tensor scale, write a file to bytes.

float8 (``--dtype float8_e4m3``, safetensors ``F8_E4M3``, torch's ``float8_e4m3fn``):
each value is stored as ``value / scale`` rounded to the nearest e4m3 number (ties to
even), ``scale = max |value| / 448`` over the whole tensor, kept beside it as the
``<name>_scale`` tensor (float32, shape [1]); :func:`hidden_states` multiplies it back.
A quarter of float32's bytes; e4m3 keeps 3 mantissa bits (a relative error up to 1/16).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Tensor", "read", "dumps", "convert", "convert_scaled", "hidden_states",
           "MAX_HEADER", "E4M3_MAX", "DTYPE_NAMES"]

#: A header larger than this is not a capture file (the connector's are < 1 KiB).
MAX_HEADER = 1 << 20
_NUMPY = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "BF16": np.uint16, "F8_E4M3": np.uint8}
_CODE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3": "F8_E4M3"}
#: safetensors' float codes → synthq's dtype names.
DTYPE_NAMES = {code: name for name, code in _CODE.items()}
#: The largest finite e4m3 (``e4m3fn``: no infinities, NaN only at 0x7F / 0xFF).
E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """The value of each of the 256 e4m3fn bytes (float32; NaN at 0x7F and 0xFF)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7.0))
    value[(exp == 15) & (man == 7)] = np.nan
    return (sign * value).astype(np.float32)


_E4M3 = _e4m3_table()
#: Bytes 0x00..0x7E: the non-negative finite values, in increasing order.
_E4M3_POS = _E4M3[:0x7F]


def _to_e4m3(values: np.ndarray) -> bytes:
    """``values`` (already scaled into [-448, 448]) as e4m3 bytes, nearest, ties to even."""
    a = np.minimum(np.abs(values.astype(np.float32)), E4M3_MAX).ravel()
    hi = np.clip(np.searchsorted(_E4M3_POS, a), 1, len(_E4M3_POS) - 1)
    lo = hi - 1
    d_lo, d_hi = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
    pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    pick = np.where(a <= _E4M3_POS[0], 0, pick)
    signed = pick.astype(np.uint8) | np.where(np.signbit(values.ravel()), 0x80, 0) \
        .astype(np.uint8)
    return signed.tobytes()


@dataclass(frozen=True, slots=True)
class Tensor:
    #: safetensors' dtype code (``F32``, ``BF16``, ``I64`` ...).
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def array(self) -> np.ndarray:
        """As numpy (bfloat16 and float8 widened to float32; a float8 tensor's scale is
        not applied here: :func:`hidden_states`)."""
        if self.dtype == "F8_E4M3":
            return _E4M3[np.frombuffer(self.data, dtype=np.uint8)].reshape(self.shape)
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


def convert_scaled(tensor: Tensor, dtype: str) -> tuple[Tensor, float | None]:
    """``tensor`` stored as ``dtype``, and its scale (float8; None for the others)."""
    if _CODE[dtype] != "F8_E4M3":
        return convert(tensor, dtype), None
    if tensor.dtype == "F8_E4M3":
        raise ValueError("a float8 tensor cannot be converted again (its scale is elsewhere)")
    values = tensor.array().astype(np.float32, copy=False)
    amax = float(np.max(np.abs(values))) if values.size else 0.0
    scale = amax / E4M3_MAX if amax > 0 and np.isfinite(amax) else 1.0
    return Tensor("F8_E4M3", tensor.shape, _to_e4m3(values / np.float32(scale))), scale


def hidden_states(tensors: dict[str, Tensor]) -> np.ndarray:
    """A capture file's ``hidden_states`` as float32, its float8 scale applied."""
    out = tensors["hidden_states"].array()
    scale = tensors.get("hidden_states_scale")
    return out * scale.array().astype(np.float32)[0] if scale is not None else out


def convert(tensor: Tensor, dtype: str) -> Tensor:
    """A float32 tensor stored as ``dtype`` (``float32``, ``bfloat16``, ``float16``; float8
    needs its scale: :func:`convert_scaled`)."""
    code = _CODE[dtype]
    if code == "F8_E4M3":
        raise ValueError("float8 is stored with a scale: use convert_scaled")
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
