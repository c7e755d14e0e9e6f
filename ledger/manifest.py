"""A published ledger's tables as outside engines (Polars, DataFusion, Spark) read them: exactly the
files the signed manifest names, each checked against its SHA-256 first, with its hive partition.

``ledger publish DEST`` lays the live Parquet files out as ``DEST/data/<table>/<column>=<value>/
part-*.parquet`` and names each (path, bytes, SHA-256) in ``manifest.json``, signed by
``manifest.sig``. Two things make a plain ``read_parquet("DEST/data/metrics/**")`` wrong:

* a folder may hold files the manifest no longer names (merged away by a compaction, replaced by a
  redaction, left by an interrupted upload): a glob reads their rows twice, or rows erased;
* the partition column (``run_id``, ``stream_type``, ``repo_owner``, ``day``) is only in the
  folder name, never inside the file, and engines decode folder names differently (URL escapes,
  guessed types): here the value is taken from the manifest's path as it is, a string.

``open_published(DEST, log_key)`` verifies the checkpoint, the manifest's signature, digest and
origin (``runledger.ledger.remote``'s check, the one ``query --remote`` makes) and then every listed file's
size and SHA-256, refusing with ``RemoteError`` before any engine opens a file. ``table_files`` is
the pure part: a manifest's files per table, with their partition values.

A table with no rows has no file: the manifest names it under ``tables`` (every table the copy
publishes), and ``Published.empty(table)`` gives it as an empty Arrow table of the ledger's schema
for that table (its file columns, then its partition column), as ``ledger query`` answers it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from runledger.ledger.log_checkpoint import Checkpoint
from runledger.ledger.remote import RemoteError, Source, _manifest_files, _signed_manifest

__all__ = ["FolderSource", "Published", "TableFile", "listed_tables", "open_published", "table_files"]

_BLOCK_BYTES = 1 << 20
# DataFusion and Spark read these in a path as a pattern (Polars too, unless told glob=False).
_GLOB_CHARS = frozenset("*?[]{}\\")


@dataclass(frozen=True)
class TableFile:
    """One data file of the manifest: its path (relative to DEST), its table and hive partition."""

    path: str  # data/<table>/<column>=<value>/part-….parquet
    table: str
    partition: dict[str, str]  # {column: value}: the folder name's, a string, as the ledger wrote it
    sha256: str
    size_bytes: int


def _partition_of(rel: str) -> tuple[str, dict[str, str]]:
    """(table, {column: value}) of ``data/<table>/<column>=<value>/<file>``."""
    parts = PurePosixPath(rel).parts
    if len(parts) != 4 or parts[0] != "data" or "=" not in parts[2] or not parts[3].endswith(".parquet"):
        raise RemoteError(f"manifest path {rel!r} is not data/<table>/<column>=<value>/<file>.parquet")
    if _GLOB_CHARS & set(rel):
        raise RemoteError(f"manifest path {rel!r} has a glob character: an engine would read it as a pattern")
    column, _, value = parts[2].partition("=")
    return parts[1], {column: value}


def table_files(manifest: dict[str, Any]) -> dict[str, list[TableFile]]:
    """Each table's files as a (verified) manifest names them, sorted by path; RemoteError for a path
    outside ``data/``, one with no partition folder, or one listed under another table."""
    digests = _manifest_files(manifest)  # checks every path is under data/ with no '..'
    listed = {str(item["path"]): item for item in manifest["files"]}
    out: dict[str, list[TableFile]] = {}
    for rel in sorted(digests):
        table, partition = _partition_of(rel)
        if listed[rel].get("table", table) != table:
            raise RemoteError(f"manifest path {rel!r} is listed under table {listed[rel]['table']!r}")
        size_bytes = int(listed[rel]["bytes"])
        out.setdefault(table, []).append(TableFile(rel, table, partition, digests[rel], size_bytes))
    return out


def listed_tables(manifest: dict[str, Any], files: dict[str, list[TableFile]]) -> tuple[str, ...]:
    """Every table the copy publishes: the manifest's ``tables`` (those without files included), or,
    in a manifest written before it named them, the tables that have files. RemoteError for a name
    that is not a ledger table, or a file of a table the list leaves out."""
    from runledger.ledger.lake import lake_schema

    named = manifest.get("tables")
    if named is None:
        return tuple(sorted(files))
    if not isinstance(named, list) or not all(isinstance(name, str) for name in named):
        raise RemoteError("the manifest's tables is not a list of table names")
    for name in named:
        try:
            lake_schema(name)
        except KeyError:
            raise RemoteError(f"the manifest names table {name!r}, which a ledger does not have") from None
    unlisted = sorted(set(files) - set(named))
    if unlisted:
        raise RemoteError(f"the manifest has files of table {unlisted[0]!r} but does not list it")
    return tuple(named)


class FolderSource(Source):
    """A published copy in a local folder (``ledger publish DEST`` with DEST a folder)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).resolve()

    @property
    def name(self) -> str:
        return str(self.folder)

    def url_of(self, rel: str) -> str:
        return str(self._path(rel))

    def _path(self, rel: str) -> Path:
        path = PurePosixPath(rel)
        if path.is_absolute() or ".." in path.parts:
            raise RemoteError(f"{rel!r} is not a path inside {self.folder}")
        return self.folder / path

    def size_bytes(self, rel: str) -> int:
        try:
            return self._path(rel).stat().st_size
        except OSError as exc:
            raise RemoteError(f"cannot read {self.url_of(rel)}: {exc.strerror}") from None

    def stream(self, rel: str) -> Iterator[bytes]:
        try:
            with self._path(rel).open("rb") as handle:
                yield from iter(lambda: handle.read(_BLOCK_BYTES), b"")
        except OSError as exc:
            raise RemoteError(f"cannot read {self.url_of(rel)}: {exc.strerror}") from None


@dataclass(frozen=True)
class Published:
    """A published copy whose manifest and data files were verified, as of ``checkpoint``."""

    folder: Path
    checkpoint: Checkpoint
    manifest_log_size: int  # the log size the manifest is signed at
    tables: dict[str, list[TableFile]]  # the tables that have files
    listed: tuple[str, ...] = ()  # every table published, those without rows (no files) included

    def files(self, table: str) -> list[TableFile]:
        """The table's files, none for a published table without rows (RemoteError for a table the
        manifest does not name: a typo, or a table not published)."""
        if table not in self.tables and table not in self.listed:
            raise RemoteError(f"the manifest names no table {table!r}")
        return self.tables.get(table, [])

    def empty(self, table: str) -> pa.Table:
        """The table with no rows, with the columns and types its files have (its file columns,
        then its partition column as a string): what an engine reads for a table without files."""
        from runledger.ledger.lake import lake_schema

        self.files(table)  # a table the manifest names
        return lake_schema(table).empty_table()

    def paths(self, table: str) -> list[str]:
        """The table's files as local paths, for an engine that takes a list."""
        return [str(self.folder / f.path) for f in self.files(table)]

    def partitions(self, table: str) -> list[tuple[dict[str, str], list[str]]]:
        """The table's files grouped by partition: ({column: value}, [local paths]), one read each."""
        groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for f in self.files(table):
            groups.setdefault(tuple(sorted(f.partition.items())), []).append(str(self.folder / f.path))
        return [(dict(key), paths) for key, paths in groups.items()]


def _check_file(source: FolderSource, item: TableFile) -> None:
    """The file's size, then its SHA-256 (read in 1 MiB blocks), against the manifest's."""
    if source.size_bytes(item.path) != item.size_bytes or source.sha256(item.path) != item.sha256:
        raise RemoteError(f"{source.url_of(item.path)} does not match its SHA-256 in the signed manifest")


def open_published(folder: str | Path, log_key: str) -> Published:
    """The published copy in ``folder``, checked against the log key ``log_key`` (a note verifier
    key): the signed checkpoint and manifest, then every data file's size and SHA-256. RemoteError
    (one line) on the first thing that does not match; nothing is read by an engine before."""
    source = FolderSource(folder)
    checkpoint, manifest_size, manifest = _signed_manifest(source, log_key)
    tables = table_files(manifest)
    listed = listed_tables(manifest, tables)
    for files in tables.values():
        for item in files:
            _check_file(source, item)
    return Published(source.folder, checkpoint, manifest_size, tables, listed)
