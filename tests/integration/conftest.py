"""The integration tier's shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(params=["postgresql", "sqlite"])
def backend(request: pytest.FixtureRequest, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test once on PostgreSQL (the ``pg`` fixture) and once on SQLite (a migrated file
    under ``tmp_path``); the settings point at it. Yields the backend's name."""
    if request.param == "postgresql":
        request.getfixturevalue("pg")
    else:
        from support import TEST_ENV, _reset_process_state

        from synthq.store.migrate import upgrade

        url = f"sqlite:///{tmp_path / 'synthq.db'}"
        upgrade(url)
        monkeypatch.setenv("SYNTHQ_DATABASE_URL", url)
        monkeypatch.setenv("SYNTHQ_DATA_DIR", str(tmp_path / "data"))
        for key, value in TEST_ENV.items():
            monkeypatch.setenv(key, value)
        _reset_process_state()
    yield request.param
