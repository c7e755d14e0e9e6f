"""A reader that lists a SQLite catalog's files with Python's sqlite3 (issue 41: no DuckDB extension
loaded to open a lake) answers exactly as the reader that lists them through DuckLake: the same files
at every snapshot, the same rows in every view, the same one-line errors (it steps aside for them),
deletions honoured (a snapshot with delete files is read through DuckLake), and the same locked door."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import query as query_module
from runledger.ledger.lake import ALIAS, Catalog, LakeFolder, connect_data, open_snapshot, snapshot_files
from runledger.ledger.lake_snapshot_files import sqlite_snapshot_files
from runledger.ledger.query import QueryError, Reader
from tests.lake.test_reader import VIEWS

SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200"}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A lake ledger (SQLite catalog in its folder) ingested in 250-event commits, and its snapshots."""
    root = tmp_path_factory.mktemp("lake-sqlite3")
    runner = CliRunner()
    for args in (
        ["simulate", "reference-535b", "--spool", str(root / "spool"), *SMALL],
        [
            "ingest",
            "spool",
            "--spool",
            str(root / "spool"),
            "--ledger",
            str(root / "lake"),
            "--batch-size",
            "250",
        ],
    ):
        done = runner.invoke(app, args, env=ENV)
        assert done.exit_code == 0, done.output
    marker = _marker(root / "lake")
    con, newest = open_snapshot(marker.catalog, marker.data_path)
    con.close()
    assert newest >= 3
    return root / "lake", list(range(1, newest + 1))


def _marker(folder: Path) -> LakeFolder:
    marker = LakeFolder.read(folder)
    assert marker is not None and marker.catalog.startswith("sqlite:")
    return marker


def _rows(reader: Reader, view: str) -> list[str]:
    result = reader.sql(f"SELECT * FROM {view}")
    return sorted(json.dumps(r, default=str, sort_keys=True) for r in result.records())


def _copy(folder: Path, tmp_path: Path) -> Path:
    copied = tmp_path / "copy"
    shutil.copytree(folder, copied)
    return copied


def _error(folder: Path, sqlite3_catalog: bool, **kwargs: Any) -> str:
    with pytest.raises(QueryError) as raised:
        Reader(folder, sqlite3_catalog=sqlite3_catalog, **kwargs)
    return str(raised.value)


def test_sqlite3_lists_the_files_ducklake_lists_at_every_snapshot(lake: tuple[Path, list[int]]) -> None:
    folder, snapshots = lake
    marker = _marker(folder)
    files = 0
    for snapshot in [*snapshots, None]:
        listed = sqlite_snapshot_files(marker, snapshot)
        assert listed is not None
        con, pinned = open_snapshot(marker.catalog, marker.data_path, snapshot)
        try:
            assert listed.snapshot == pinned
            assert listed.files == snapshot_files(con, marker.data_path, pinned)
        finally:
            con.close()
        files = sum(len(t.paths) for t in listed.files.values() if t is not None)
    assert files > len(marker.tables)  # (the newest snapshot: many files, over many tables)


def test_the_sqlite3_reader_answers_every_view_as_the_ducklake_reader(
    lake: tuple[Path, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, snapshots = lake
    for snapshot in (snapshots[1], None):
        through_ducklake = Reader(folder, snapshot=snapshot)
        expected = {view: _rows(through_ducklake, view) for view in VIEWS}
        through_ducklake.close()
        # A tripwire, not a stand-in: the sqlite3 reader must never attach the catalog through DuckLake.
        with monkeypatch.context() as patched:
            patched.setattr(query_module, "open_snapshot", _no_ducklake)
            reader = Reader(folder, snapshot=snapshot, sqlite3_catalog=True)
        try:
            assert reader.snapshot == through_ducklake.snapshot
            assert {view: _rows(reader, view) for view in VIEWS} == expected
            assert (
                reader.sql("SELECT count(*) FROM lake.events").rows
                == reader.sql("SELECT count(*) FROM events").rows
            )
        finally:
            reader.close()
    assert any(expected.values())


def _no_ducklake(*args: object, **kwargs: object) -> object:
    raise AssertionError("the sqlite3 reader attached the catalog through DuckLake")


def test_delete_files_are_read_through_ducklake_and_honoured(
    lake: tuple[Path, list[int]], tmp_path: Path
) -> None:
    folder = _copy(lake[0], tmp_path)
    marker = _marker(folder)
    before = Reader(folder).sql("SELECT count(*) FROM metrics").rows[0][0]
    gone = Reader(folder).sql("SELECT count(*) FROM metrics WHERE step % 7 = 0").rows[0][0]
    assert before > gone > 0
    # Deleted through DuckLake itself: its delete files, as a redaction leaves them until erasure.
    con = connect_data(Catalog.parse(marker.catalog), marker.data_path)
    try:
        con.execute(
            f"ATTACH 'ducklake:{marker.catalog}' AS {ALIAS} (DATA_PATH '{marker.data_path}', OVERRIDE_DATA_PATH true)"
        )
        con.execute(f"DELETE FROM {ALIAS}.metrics WHERE step % 7 = 0")
    finally:
        con.close()
    assert sqlite_snapshot_files(marker) is None  # (a delete file: DuckLake's path reads the snapshot)
    for sqlite3_catalog in (False, True):
        reader = Reader(folder, sqlite3_catalog=sqlite3_catalog)
        try:
            assert reader.sql("SELECT count(*) FROM metrics").rows[0][0] == before - gone
            assert reader.sql("SELECT count(*) FROM metrics WHERE step % 7 = 0").rows[0][0] == 0
        finally:
            reader.close()


def test_an_unusual_catalog_gets_ducklakes_own_one_line_error(
    lake: tuple[Path, list[int]], tmp_path: Path
) -> None:
    folder = _copy(lake[0], tmp_path)
    # a snapshot the lake never had
    assert sqlite_snapshot_files(_marker(folder), 10**6) is None
    assert _error(folder, True, snapshot=10**6) == _error(folder, False, snapshot=10**6)
    # a catalog that holds another ledger (LAKE.json names another id)
    marker_file = folder / "LAKE.json"
    saved = marker_file.read_text()
    marker_file.write_text(json.dumps(json.loads(saved) | {"ledger_id": "someone-else"}))
    assert sqlite_snapshot_files(_marker(folder)) is None
    assert "replaced" in _error(folder, True) and _error(folder, True) == _error(folder, False)
    marker_file.write_text(saved)
    # a damaged catalog file
    catalog = Path(_marker(folder).catalog.removeprefix("sqlite:"))
    for sidecar in (catalog.with_name(catalog.name + "-wal"), catalog.with_name(catalog.name + "-shm")):
        sidecar.unlink(missing_ok=True)
    catalog.write_bytes(b"not a database" * 100)
    assert sqlite_snapshot_files(_marker(folder)) is None
    assert _error(folder, True) == _error(folder, False)


def test_the_sqlite3_readers_door_is_as_locked(lake: tuple[Path, list[int]]) -> None:
    folder, _ = lake
    catalog = folder / "catalog.sqlite"
    reader = Reader(folder, sqlite3_catalog=True)
    refused = [
        f"COPY (SELECT 1) TO '{folder / 'x.csv'}'",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"ATTACH 'ducklake:sqlite:{catalog}' AS w",
        "INSTALL ducklake",
        "LOAD sqlite_scanner",
        "SET lock_configuration = false",
        f"SELECT * FROM sqlite_scan('{catalog}', 'ducklake_snapshot')",
    ]
    try:
        for statement in refused:
            with pytest.raises(QueryError, match="refused"):
                reader.sql(statement)
    finally:
        reader.close()
    assert not (folder / "x.csv").exists()
