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
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Tensor", "Entry", "NotWhole", "Malformed", "header", "tensors_of", "read",
           "nonfinite", "dumps", "convert", "convert_scaled", "hidden_states", "MAX_HEADER",
           "MAX_DIMS", "E4M3_MAX", "DTYPE_NAMES"]

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
    #: The raw bytes (a bytearray when read from a file: one buffer, not copied again).
    data: bytes | bytearray

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


class NotWhole(ValueError):
    """The file is shorter than its header says: cut, or still being written."""


class Malformed(ValueError):
    """The file is not a safetensors file synthq can take: a header that is not the
    layout's (not JSON, nested past reason, a shape whose element count passes the
    file, an unknown dtype)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor as the header declares it: its bytes at ``[start, end)`` of the body."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def header(fd: int, size: int) -> tuple[dict[str, Entry], dict[str, str], int]:
    """The tensors a file declares, its metadata and the offset of its body, from ``fd``
    (``size`` bytes, as ``fstat`` gave it): only the length and the header are read, so a
    file is judged by its header before any of its tensors' bytes is."""
    if size < 8:
        raise NotWhole("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", _pread(fd, 8, 0))
    if length > MAX_HEADER:
        raise Malformed(f"a header of {length:,} bytes, over the {MAX_HEADER:,} a capture "
                        "file's can be")
    if 8 + length > size:
        raise NotWhole("the header runs past the file")
    raw = _pread(fd, length, 8)
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past reason
        raise Malformed(f"the header is not JSON ({type(exc).__name__})") from None
    if not isinstance(parsed, dict):
        raise Malformed("the header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()):
        raise Malformed("the header's __metadata__ is not a map of strings")
    body = size - 8 - length
    entries = {str(name): _entry(str(name), info, body) for name, info in parsed.items()}
    return entries, {str(k): v for k, v in metadata.items()}, 8 + length


#: Dimensions a tensor of a capture file may have (hidden states have 3).
MAX_DIMS = 8


def _entry(name: str, info: object, body: int) -> Entry:
    """One header entry, checked with Python's integers: no element count overflows,
    and none may pass the body's bytes."""
    if not isinstance(info, dict) or info.get("dtype") not in _NUMPY:
        raise Malformed(f"tensor {name[:80]!r} has no dtype synthq reads")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            type(n) is int and n >= 0 for n in shape):
        raise Malformed(f"tensor {name[:80]!r} has no shape of up to {MAX_DIMS} sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            type(n) is int for n in offsets) or not 0 <= offsets[0] <= offsets[1]:
        raise Malformed(f"tensor {name[:80]!r} has no data_offsets [start, end]")
    width = np.dtype(_NUMPY[info["dtype"]]).itemsize
    start, end = offsets
    count = 0 if 0 in shape else 1
    for n in shape if count else ():
        count *= n
        if count * width > end - start:  # past its bytes already: never multiplied further
            break
    if count * width != end - start:
        raise Malformed(f"tensor {name[:80]!r}: its shape {shape[:MAX_DIMS]} does not "
                        f"match its {end - start:,} bytes")
    if end > body:
        raise NotWhole(f"tensor {name[:80]!r} is cut")
    return Entry(info["dtype"], tuple(shape), start, end)


def _pread(fd: int, n: int, offset: int) -> bytearray:
    """Exactly ``n`` bytes of ``fd`` at ``offset``, into one buffer (:class:`NotWhole` when
    the file ends first)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k == 0:
            raise NotWhole("the file ended before its header said")
        got += k
    return buf


def tensors_of(fd: int, entries: dict[str, Entry], body: int,
               names: list[str] | None = None) -> dict[str, Tensor]:
    """The tensors ``names`` (all: None) read from ``fd``, the body at offset ``body``."""
    return {name: Tensor(e.dtype, e.shape, _pread(fd, e.end - e.start, body + e.start))
            for name, e in entries.items() if names is None or name in names}


def read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor of a file and its metadata; ValueError (:class:`NotWhole`,
    :class:`Malformed`) when it is not whole or not the layout."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        entries, metadata, body = header(fd, os.fstat(fd).st_size)
        return tensors_of(fd, entries, body), metadata
    finally:
        os.close(fd)


def nonfinite(tensor: Tensor) -> int:
    """How many of a float tensor's values are NaN or infinite (read from the bits: no
    float copy of a bf16 tensor); an e4m3 byte 0x7F/0xFF is its NaN."""
    if tensor.dtype == "F8_E4M3":
        raw8 = np.frombuffer(tensor.data, dtype=np.uint8)
        return int(np.count_nonzero((raw8 & 0x7F) == 0x7F))
    bits = {"F32": ("<u4", 0x7F800000), "BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00)}
    if tensor.dtype not in bits:
        return 0
    code, exponent = bits[tensor.dtype]
    raw = np.frombuffer(tensor.data, dtype=code)
    return int(np.count_nonzero((raw & exponent) == exponent))


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
