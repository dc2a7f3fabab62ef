"""PostgreSQL advisory-lock keys that more than one module takes.

The dispatcher computes each server's room under :data:`DISPATCH`, and the
adaptive controller (:mod:`synthq.adaptive`) writes a server's limit under the
same one, so a dispatch never reads a limit half-moved. The key is here, not in
either of them, so that neither imports the other for it.
"""

from __future__ import annotations

import hashlib

__all__ = ["DISPATCH"]

#: Serializes dispatchers (room per server, worker capacity) and the limit's writes.
DISPATCH = int.from_bytes(hashlib.sha256(b"synthq:dispatch").digest()[:8], "big", signed=True)
