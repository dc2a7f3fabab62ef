"""Compact binary forms of token ids and loss masks, as stored in SQL.

Token ids are little-endian int32 (4 bytes a token); a loss mask is one bit a
token (``numpy.packbits`` order, big-endian within each byte), with the token
count stored beside it to drop the padding bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pack_ids", "unpack_ids", "pack_mask", "unpack_mask"]


def pack_ids(ids: Sequence[int] | np.ndarray | None) -> bytes | None:
    if ids is None:
        return None
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes | None) -> np.ndarray | None:
    if data is None:
        return None
    return np.frombuffer(data, dtype="<i4")


def pack_mask(mask: Sequence[int] | np.ndarray) -> bytes:
    return np.packbits(np.asarray(mask, dtype=np.uint8)).tobytes()


def unpack_mask(data: bytes, length: int) -> np.ndarray:
    """The mask as ``uint8`` zeros and ones, ``length`` long."""
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=length)
