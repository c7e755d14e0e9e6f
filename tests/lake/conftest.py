"""Fixtures: one lake per test on every catalog backend (SQLite file, PostgreSQL)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.lake.support import Postgres


@dataclass(frozen=True)
class Backend:
    kind: str
    catalog: str
    data: Path

    @property
    def many_processes(self) -> bool:
        """Every catalog kind offered takes writers in many processes (the DuckDB file is withdrawn)."""
        return True


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres | str]:
    # Not under pytest's tmp_path: the server runs as user postgres, which cannot enter root's 0700 folders.
    folder = Path(tempfile.mkdtemp(prefix="runledger-pg-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        server = Postgres(folder)
    except (RuntimeError, OSError) as exc:
        yield f"PostgreSQL unavailable: {exc}"
        shutil.rmtree(folder, ignore_errors=True)
        return
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    kind = request.param
    if kind == "sqlite":
        return Backend(kind, f"sqlite:{tmp_path / 'catalog.sqlite'}", tmp_path / "data")
    server = request.getfixturevalue("postgres")
    if isinstance(server, str):
        pytest.skip(server)
    return Backend(kind, f"postgres:{server.database()}", tmp_path / "data")
