"""A lake snapshot's file list read from an embedded SQLite catalog with Python's own ``sqlite3``
(issue 41): no DuckDB extension is loaded to read it (DuckLake and the SQLite scanner cost ~95 ms
each to load, more than the query a ``ledger query`` runs).

It reads the catalog's documented tables (``ducklake_snapshot``, ``ducklake_metadata``,
``ducklake_schema``, ``ducklake_table``, ``ducklake_data_file``, ``ducklake_delete_file``,
``ducklake_file_partition_value``, ``ducklake_inlined_data_tables``) at one snapshot id, in one read
transaction, and answers the same list as ``runledger.ledger.lake.snapshot_files`` on an attached lake. Where
that list would not be plain files (a snapshot with delete files or inlined rows), or the catalog
says anything unusual (no such snapshot, another ledger's id, a damaged file), it answers None and
the caller reads through the extensions, which say why in their own words.

Only for a process that holds no other connection to the catalog (a ``ledger`` read command): a
second SQLite library in one process drops the first's POSIX locks on the file when it closes it
(see ``runledger.ledger.lake.LakeTables._attach_writer``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import msgspec

from runledger.ledger.lake import (
    ID_OPTION,
    Catalog,
    ColumnBounds,
    LakeFolder,
    TableFiles,
    file_bounds,
    file_bounds_sql,
    live_at_snap,
    plain_file_under,
    table_files,
)

BUSY_TIMEOUT_S = 5.0  # the longest a read waits on a writer's lock before reading through DuckLake

_FILES_SQL = (
    "SELECT t.table_name, s.path, s.path_is_relative, t.path, t.path_is_relative, f.path, "
    "f.path_is_relative, EXISTS (SELECT 1 FROM ducklake_delete_file d "
    f"WHERE d.data_file_id = f.data_file_id AND {live_at_snap('d')}), v.partition_value, f.data_file_id "
    "FROM ducklake_data_file f "
    f"JOIN ducklake_table t ON t.table_id = f.table_id AND {live_at_snap('t')} "
    f"JOIN ducklake_schema s ON s.schema_id = t.schema_id AND {live_at_snap('s')} "
    "LEFT JOIN ducklake_file_partition_value v "
    "ON v.data_file_id = f.data_file_id AND v.partition_key_index = 0 "
    f"WHERE {live_at_snap('f')} ORDER BY t.table_name, f.data_file_id"
)
_INLINED_SQL = (
    "SELECT t.table_name FROM ducklake_inlined_data_tables i "
    f"JOIN ducklake_table t ON t.table_id = i.table_id AND {live_at_snap('t')}"
)

_BOUNDS_SQL = file_bounds_sql()

FileRow = tuple[str, str, int, str, int, str, int, int, str | None, int]


class PinnedFiles(msgspec.Struct, frozen=True):
    """A snapshot and each table's data files at it, ``snapshot_files``'s answer (None: a table read
    through DuckLake; never one of the ledger's tables here, only the writer's own)."""

    snapshot: int
    files: dict[str, TableFiles | None]
    # the ``BOUNDED_COLUMNS``' bounds in each file (data file id -> column -> bounds)
    bounds: dict[int, dict[str, ColumnBounds]] = msgspec.field(default_factory=dict)


def sqlite_snapshot_files(lake: LakeFolder, snapshot: int | None = None) -> PinnedFiles | None:
    """``lake``'s files at ``snapshot`` (default: the newest), read with ``sqlite3``; None where the
    caller must read through DuckLake instead (see the module's text)."""
    file = Catalog.parse(lake.catalog).file
    if file is None or "://" in lake.data_path:
        return None
    try:
        with contextlib.closing(_read_only(file)) as db:
            # One read transaction: every table below is read as of one moment of the file.
            db.execute("BEGIN")
            try:
                return _pinned_files(db, lake, snapshot)
            finally:
                db.execute("COMMIT")
    except sqlite3.Error:
        return None  # (damaged, locked past the timeout, not a catalog: DuckLake's path says which)


def _read_only(path: Path) -> sqlite3.Connection:
    uri = path.resolve().as_uri() + "?mode=ro"
    return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)


def _pinned_files(db: sqlite3.Connection, lake: LakeFolder, snapshot: int | None) -> PinnedFiles | None:
    """The file list inside the read transaction, or None for anything but the plain case."""
    pinned = _known_snapshot(db, snapshot)
    if pinned is None or _catalog_ledger_id(db) not in (None, lake.ledger_id):
        return None
    params = {"snap": pinned}
    inlined = {str(name) for (name,) in db.execute(_INLINED_SQL, params).fetchall()}
    rows: list[FileRow] = db.execute(_FILES_SQL, params).fetchall()
    files = table_files(lake.data_path, rows, inlined)
    # A ledger table with deletions or inlined rows is read through DuckLake (as ``_pinned_views``
    # does), and so is a path that is not a plain file under the data path (DuckLake's path refuses it).
    if any(files.get(name, False) is None for name in lake.tables) or not _plain(lake.data_path, files):
        return None
    try:
        bounds = file_bounds(db.execute(_BOUNDS_SQL, params).fetchall())
    except sqlite3.Error:  # (bounds only spare reads: without them every file is read)
        bounds = {}
    return PinnedFiles(pinned, files, bounds)


def _plain(data_path: str, files: dict[str, TableFiles | None]) -> bool:
    return all(plain_file_under(data_path, p) for listed in files.values() if listed for p in listed.paths)


def _known_snapshot(db: sqlite3.Connection, snapshot: int | None) -> int | None:
    """``snapshot`` if the catalog still has it (default: its newest); None otherwise."""
    if snapshot is None:
        row = db.execute("SELECT max(snapshot_id) FROM ducklake_snapshot").fetchone()
    else:
        row = db.execute(
            "SELECT snapshot_id FROM ducklake_snapshot WHERE snapshot_id = ?", [int(snapshot)]
        ).fetchone()
    return int(row[0]) if row is not None and row[0] is not None else None


def _catalog_ledger_id(db: sqlite3.Connection) -> str | None:
    """The ledger id the catalog names (``runledger.ledger.lake.attached_ledger_id``'s row)."""
    row = db.execute("SELECT value FROM ducklake_metadata WHERE key = ?", [ID_OPTION]).fetchone()
    return str(row[0]) if row is not None and row[0] is not None else None
