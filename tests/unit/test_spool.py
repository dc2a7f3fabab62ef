"""The spool of ``--features stream`` (synthq.capture.spool): its bytes never pass its
bound, whatever is reserved, written or removed; a full disk under it is one line and
takes nothing from the count; ``--spool SIZE`` is read as bytes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from synthq.capture import spool as spool_mod
from synthq.capture.spool import Spool
from synthq.capture.store import Store
from synthq.core.errors import HandBack, UserError
from synthq.training.config import parse_size


def test_the_bound_holds_over_reservations_and_files(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "spool", 1000)
    sp.scan({})
    assert sp.reserve(600)
    assert not sp.reserve(500)  # 600 + 500 > 1000
    sp.store.local.reserved = 600
    stored = sp.store.put(b"x" * 550)  # the file takes its reservation's place
    assert (sp.root / stored.path).stat().st_size == 550
    assert sp.used == 550 and sp.reserved == 0
    assert sp.reserve(450) and not sp.reserve(1)
    sp.store.local.reserved = 450
    with pytest.raises(spool_mod._Full):  # over its reservation and the bound: not written
        sp.store.put(b"y" * 451)
    assert sorted(p.name for p in sp.root.rglob("*") if p.is_file()) == [Path(stored.path).name]
    sp.unreserve(450)
    assert sp.remove(stored.path) == 550 and sp.used == 0
    assert not (sp.root / stored.path).exists()
    assert sp.high_water <= 1000


def test_scan_keeps_the_named_files_and_removes_the_rest(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "spool", 10_000)
    sp.scan({})
    kept = sp.store.put(b"a" * 10)
    orphan = sp.store.put(b"b" * 20)
    (sp.root / "ab").mkdir(exist_ok=True)
    (sp.root / "ab" / "x.safetensors.1.tmp").write_bytes(b"half")
    missing = sp.scan({kept.path: 10, "cd/gone.safetensors": 5})
    assert missing == ["cd/gone.safetensors"]
    assert (sp.root / kept.path).is_file() and not (sp.root / orphan.path).exists()
    assert not list(sp.root.glob("*/*.tmp"))
    assert sp.used == 10


def test_a_full_disk_under_the_spool_is_one_line(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sp = Spool(tmp_path / "spool", 1000)
    sp.scan({})

    def full(self: Store, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Store, "put", full)
    assert sp.reserve(100)
    sp.store.local.reserved = 100
    with pytest.raises(UserError) as err:
        sp.store.put(b"z" * 100)
    assert str(err.value).startswith(f"the disk under the spool {sp.root} is full")
    assert "\n" not in str(err.value)
    assert sp.used == 0 and not sp.held
    # Which folder, how many bytes the file needed; the run is handed back, not failed.
    assert "needed 100 bytes" in str(err.value) and "rerun the same `synthq train`" in \
        str(err.value)
    assert isinstance(err.value, HandBack)


def test_spool_sizes() -> None:
    assert parse_size("2G") == 2 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("1000") == 1000
    with pytest.raises(UserError, match="--spool must be a size"):
        parse_size("lots")
