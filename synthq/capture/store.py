"""synthq's store of captured hidden states: content-addressed files, written whole.

A file's name is its own sha256 (``<root>/ab/abcd….safetensors``). It is written
under a temporary name in the same folder, fsynced, renamed into place and the
folder fsynced: a kill at any moment leaves whole files or temporary ones
(``*.tmp``), never a half file under a final name. Writing the same content
twice is harmless (the rename replaces equal bytes).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Store", "Stored"]


@dataclass(frozen=True, slots=True)
class Stored:
    #: Relative to the store's root.
    path: str
    sha256: str
    bytes: int


class Store:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, relative: str) -> Path:
        return self.root / relative

    def put(self, data: bytes) -> Stored:
        """Store ``data`` whole under its sha256; returns where."""
        digest = hashlib.sha256(data).hexdigest()
        relative = f"{digest[:2]}/{digest}.safetensors"
        final = self.root / relative
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return Stored(relative, digest, len(data))

    def verify(self, relative: str, sha256: str) -> bool:
        """The file is there and its bytes hash to ``sha256``."""
        path = self.root / relative
        if not path.is_file():
            return False
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest() == sha256

    def free_bytes(self) -> int:
        """Free space where the store lives (its nearest existing folder)."""
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        return shutil.disk_usage(probe).free

    def leftovers(self) -> list[Path]:
        """Temporary files of writes that a kill cut short (never counted)."""
        return sorted(self.root.glob("*/*.tmp")) if self.root.exists() else []


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
