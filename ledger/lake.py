"""The ledger's tables in a DuckLake: one engine transaction per ledger commit, one snapshot per reader.

``LakeTables`` stores the tables of ``runledger.ledger.parquet_schemas.TABLES`` (plus their hive partition
column, partitioned by it) in a DuckLake (DuckDB's lakehouse format; duckdb 1.5.5 with the extension
wheels ``runledger.ledger.duck`` loads). Its catalog is a SQLite file (one host: writers retry "database is
locked" with a bounded backoff) or a PostgreSQL DSN (many writers on many hosts); its data files are
Parquet under ``data_path``. (A DuckDB-file catalog is not offered: DuckDB's file lock lets one process
hold it, so checkpoint, publish and redact could not run beside a writer.)

It is the storage layer *under* the ledger's commit logic (decode, admission, projection, Merkle state
stay in ``runledger.ledger.store``):

* ``commit(tables, positions, state)``: every table's rows, each source's position, the writer's state
  and a ``ledger_commits`` row in ONE transaction = one snapshot. Positions are fenced: each source has
  a one-row fence table (``ledger_fence_<digest>``) that a commit deletes and re-inserts, so two racing
  copies of one ingester conflict in the engine and the loser gets ``stale`` (nothing of it lands);
  writers of different sources touch different fence tables and never conflict. (DuckLake conflicts
  at table level when one transaction inserts into a table another deleted from, so one shared
  positions table updated in place would serialise every writer.) On a SQLite catalog, where
  writers' transactions take turns (``CommitTurns``) and cannot race, a fence moves by adding a row
  (its position: its largest) and the writer's own small tables keep their rows in the catalog
  (``WRITER_INLINED_ROWS``): a commit writes a data file only for the ledger's tables and its record.
* ``reader(snapshot)``: a DuckDB connection where every table is one snapshot.
* ``maintain()``: DuckLake's own merge / expire / clean-up.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import duckdb
import msgspec

from runledger.ledger.duck import column_type, connect, one_row
from runledger.ledger.parquet_schemas import SIDE_TABLES, TABLES, Table
from runledger.schemas.durable import fsync_dir

if TYPE_CHECKING:  # issue 41: pyarrow is imported where a write or a schema uses it, not by a reader
    import logging

    import pyarrow as pa


def _log() -> logging.Logger:
    """The writer's logger (``logging`` imported by the writer alone: a reader's import skips it)."""
    import logging

    return logging.getLogger(__name__)


__all__ = [
    "Catalog",
    "LakeCommit",
    "LakeError",
    "LakeFolder",
    "LakeReader",
    "LakeTables",
    "Queryable",
    "lake_schema",
    "open_snapshot",
]

CatalogKind = Literal["sqlite", "postgres"]
ALIAS = "lake"
POSITIONS = "ledger_positions"
STATE = "ledger_state"
COMMITS = "ledger_commits"
FENCE_PREFIX = "ledger_fence_"
# The fence of the ledger's commit numbers (a pseudo-source): every ledger commit moves it from its
# number to the next, so writers on any host commit one after another, each on the one before.
COMMIT_FENCE = "ledger/commit"
ID_FENCE = "ledger/id"  # moved once, by the commit that names the ledger the lake holds
ID_KEY = "ledger_id"  # the state key of that name
ID_OPTION = "runledger_ledger_id"  # ... and its row in the catalog's own ``ducklake_metadata``
# Its row there once every table's column bounds were checked (``lake_stats``): every writer since
# sets them right after each commit that may leave them wrong, so a lake needs the whole check once.
BOUNDS_OPTION = "runledger_bounds_checked"
_PSEUDO_SOURCES = "ledger/%"  # fences of the ledger's own, not sources: read_positions leaves them out
# SQLite catalog: "database is locked" under concurrency (duckdb/ducklake#128). Bounded retries.
LOCKED_RETRIES = 60
LOCKED_BACKOFF_S = (0.01, 0.5)  # first and largest sleep; doubled each try, with jitter
CONFLICT_RETRIES = 20
# The writer's own small tables (positions, state, each source's fence) keep their rows in the
# catalog (DuckLake's data inlining, set per table): a commit then writes no Parquet file for them and
# a fence's move deletes a catalog row, not a file (each such file cost the commit ~25 ms in its
# COMMIT and the fence's DELETE read it back: ~20 ms). Set on a table once it is committed (DuckLake
# refuses the option on a table of the same transaction): its first rows are a file, the rest inline.
# ledger_commits is not (a row holds a whole commit record); nor is any ledger table (read as files).
WRITER_INLINED_ROWS = 10_000
INIT_RACE_RETRIES = 10  # attaching a new catalog that another writer is initializing (``_lost_init_race``)
# Rows per Parquet row group, the ledger's files and the lake's merges alike ("": every other table).
# ledger_commits: a row holds a whole commit record (~700 B an event: 3.5 MB for 5,000 events); its
# merge held every row in one group (+180 MB for 60 commits, ~780 MB for the full reference run).
# The long narrow tables (tens of bytes a row, millions of rows) take the part files' merged row
# groups: a file's footer then lists ~1/8 the row groups, and each reader's open parses it. Not
# moe_layer_stats (~200 B a row and expert counts): at 128k rows the full run's ingest peaked at
# 941-1,007 MB, over the 1 GB budget.
ROW_GROUP_ROWS = {
    "": 16_384,
    "events": 4_096,
    "quarantine": 1_024,
    "ledger_commits": 8,
    **dict.fromkeys(("metrics", "rank_stats", "salts"), 128 * 1024),
}
# The lake's merges compress as the ledger's own files (DuckDB's default, snappy: events 1.8x larger).
PARQUET_COMPRESSION = "zstd"
# A merge rewrites the files below this size with their neighbours. DuckLake's default (512 MB) had
# each merge of the full reference run rewrite the whole of moe_layer_stats again (161 → 301 → 440 →
# 515 MB; 12, 22, 44 and 78 s, ingest +13%); at 128 MB a file is rewritten about once.
TARGET_FILE_BYTES = 128_000_000
# The writer's light merge (``merge_small_files``) rewrites only the files below this size: the few-row
# files a commit leaves in most tables (GitHub, launches, state events, its own record). Between two
# full merges a one-shot reader opened each of them (the reference run, 23 commits after its last
# merge: ``ledger state`` read 17 GitHub and 24 state-event files; ~0.3 ms each). A commit's files of
# the big tables (events, metrics, MoE stats: MBs each) are above it and wait for the full merge.
SMALL_FILE_BYTES = 256_000
MERGED_PREFIX = "merged:"  # a state key naming a file the lake's merge wrote (its table, SHA-256)
# The writer's DuckDB instance keeps at most this much (its merges spill beyond it). Without a limit,
# DuckDB's merge during ingest took the process from 613 MB (no maintenance) to 1,317 MB at 100,000
# steps of the reference run and 1,842 MB at 390,000 (part files: 653 MB); with 256 MB, 773 MB at
# 100,000 steps. 128 MB crashed DuckDB 1.5.5 (SIGSEGV) in the same ingest: not lower.
WRITER_MEMORY = "256MB"
ORPHAN_MIN_AGE_S = 3600.0  # a data file no snapshot names is deleted by maintenance once this old
# Every wait for a lock file beside a SQLite catalog ends: a commit's turn is held from BEGIN to
# COMMIT, the maintenance lock exclusively for one merge (78 s at most in the full reference run).
LOCK_WAIT_S = 600.0
MAINTAIN_WAIT_S = 30.0  # a SQLite catalog's maintenance waits this long for a gap between statements  # an engine conflict that is not a fence (a concurrent maintain()): redo

T = TypeVar("T")


DUCKDB_FILE_REFUSED = (
    "a DuckDB-file catalog is held by one process, so checkpoint, publish and redact beside a writer "
    "cannot run: use sqlite:PATH (one host) or postgres:DSN (many hosts)"
)


class LakeError(RuntimeError):
    """A user-facing problem with a lake (bad catalog spec, unreachable catalog...)."""


class Catalog(msgspec.Struct, frozen=True):
    """Where the DuckLake catalog lives: ``sqlite:PATH`` or ``postgres:DSN``. One class per kind
    (``SqliteCatalog``, ``PostgresCatalog``), as DuckLake keeps one metadata manager per kind: what
    differs between them is said here once, and the lake's code asks the catalog, never its kind."""

    target: str  # a file path, or a libpq DSN ("dbname=ledger host=127.0.0.1 port=5432 user=postgres")
    kind: ClassVar[CatalogKind]
    extensions: ClassVar[tuple[str, ...]]  # the DuckDB extensions that attach it
    # SQLite lets one writer at a time: writers take turns around their transactions (``CommitTurns``),
    # move their fences in turn and keep the writer's own tables inlined in the catalog.
    writers_take_turns: ClassVar[bool] = False

    @staticmethod
    def parse(spec: str) -> Catalog:
        """``postgres:DSN`` / ``sqlite:PATH``; a bare path ending in .sqlite/.sqlite3/.db is SQLite.
        A DuckDB-file catalog (``duckdb:PATH``, a bare ``.ducklake``/``.duckdb`` path) is refused."""
        for kind in _CATALOG_KINDS:
            if spec.startswith(kind.kind + ":"):
                target = spec[len(kind.kind) + 1 :]
                if not target:
                    raise LakeError(f"catalog {spec!r}: nothing after {kind.kind}:")
                return kind(target)
        if not spec:
            raise LakeError("catalog: empty (give sqlite:PATH or postgres:DSN)")
        suffix = Path(spec).suffix
        if suffix in {".sqlite", ".sqlite3", ".db"}:
            return SqliteCatalog(spec)
        if spec.startswith("duckdb:") or suffix in {".ducklake", ".duckdb", ""}:
            raise LakeError(f"catalog {spec!r}: {DUCKDB_FILE_REFUSED}")
        raise LakeError(f"catalog {spec!r}: give sqlite:PATH or postgres:DSN")

    @property
    def spec(self) -> str:
        """The ``kind:target`` text ``parse`` reads back."""
        return f"{self.kind}:{self.target}"

    @property
    def shown(self) -> str:
        """The spec as a message may show it: a DSN's password left out."""
        return re.sub(r"(password\s*=\s*)\S+", r"\1***", self.spec)

    def uri(self) -> str:
        return f"ducklake:{self.kind}:{self.target}"

    @property
    def file(self) -> Path | None:
        """The catalog's file on this host; None for a server."""
        return None

    def beside(self, suffix: str) -> Path | None:
        """A lock file of the lake's own beside the catalog's file; None for a server (its hosts share
        no folder: the server's own locks serve)."""
        return None

    def in_folder(self, folder: Path) -> Catalog:
        """The catalog with its file named from ``folder`` (a ledger's marker keeps it so when it is
        inside); a server's as it is."""
        return self

    def resolved_in(self, folder: Path) -> Catalog:
        """The catalog with a relative file named from ``folder`` joined to it (``in_folder``'s inverse)."""
        return self

    def attach_options(self) -> str:
        """What DuckLake's ATTACH is given for this kind, after the lake's own options."""
        return ""

    def newest_snapshot(
        self, con: duckdb.DuckDBPyConnection, snapshot: int | None
    ) -> tuple[int, bool] | None:
        """(the newest snapshot id, whether ``snapshot`` is still there) read from the catalog's own
        ``ducklake_snapshot`` table without attaching the lake (attaching it, asking, detaching cost
        ~45 ms of every read command); None where only DuckLake can be asked."""
        return None

    def cleanup_cutoff(self, keep_s: float) -> str:
        """``older_than`` for ``ducklake_cleanup_old_files``: files scheduled for deletion before it go."""
        return _timestamptz(datetime.now(UTC) - timedelta(seconds=keep_s))

    def compact_storage(self, cur: duckdb.DuckDBPyConnection) -> None:
        """Rewrite the catalog's storage so rows it deleted leave it, not only its tables; waits
        ``VACUUM_BUSY_S`` at most for a reader's hold, then a LakeError."""
        raise NotImplementedError


class SqliteCatalog(Catalog, frozen=True):
    """A SQLite file: the embedded catalog of a ledger on one host."""

    kind: ClassVar[CatalogKind] = "sqlite"
    extensions: ClassVar[tuple[str, ...]] = ("ducklake", "sqlite_scanner")
    writers_take_turns: ClassVar[bool] = True

    @property
    def file(self) -> Path:
        return Path(self.target)

    def beside(self, suffix: str) -> Path:
        return Path(self.target + suffix)

    def in_folder(self, folder: Path) -> Catalog:
        with contextlib.suppress(ValueError):
            return SqliteCatalog(Path(self.target).resolve().relative_to(folder.resolve()).as_posix())
        return self

    def resolved_in(self, folder: Path) -> Catalog:
        return self if self.file.is_absolute() else SqliteCatalog(str(folder / self.target))

    def attach_options(self) -> str:
        # WAL (kept in the file): readers never wait for a commit, writers only for each other's.
        # Set by DuckDB's own SQLite: a second SQLite library in this process would drop the
        # first's POSIX locks on the file whenever it closed it (SQLite's "multiple copies" hazard).
        return ", METADATA_PARAMETERS MAP {'JOURNAL_MODE': 'wal'}"

    def newest_snapshot(
        self, con: duckdb.DuckDBPyConnection, snapshot: int | None
    ) -> tuple[int, bool] | None:
        # (a SQLite file through DuckDB's own SQLite, never Python's: see ``attach_options``)
        con.execute(f"ATTACH {_literal(self.target)} AS _lake_catalog (TYPE sqlite, READ_ONLY)")
        try:
            row = one_row(
                con.execute(
                    "SELECT max(snapshot_id), count(*) FILTER (WHERE snapshot_id = ?) "
                    "FROM _lake_catalog.ducklake_snapshot",
                    [snapshot],
                )
            )
        finally:
            con.execute("DETACH _lake_catalog")
        if row is None or row[0] is None:
            raise LakeError(f"{self.target} is not a lake catalog (no snapshot)")
        return int(row[0]), bool(row[1])

    def cleanup_cutoff(self, keep_s: float) -> str:
        # DuckLake 1.5.5 compares a SQLite catalog's stored schedule times as text ('2026-12-02
        # 14:37:18+00') with the parameter's ISO text ('2026-12-02T13:37:24'), so every file scheduled
        # on the parameter's date or before goes, however recent: measured here, a cleanup with
        # ``now() - 1 hour`` deleted files scheduled a second before, and pinned readers then counted
        # 0 rows in them. So the cutoff is the day before the true one: nothing younger than
        # ``keep_s`` goes, and a file goes at most a day late.
        cutoff = datetime.now(UTC) - timedelta(seconds=keep_s)
        return _timestamptz(cutoff.replace(hour=12, minute=0, second=0, microsecond=0) - timedelta(days=1))

    def compact_storage(self, cur: duckdb.DuckDBPyConnection) -> None:
        # VACUUM (its WAL checkpointed before and after) by another process's SQLite: DuckDB's runs
        # no statement that returns nothing, and a second SQLite library in this one would drop
        # DuckDB's locks on the file.
        try:
            done = subprocess.run(
                [sys.executable, "-c", _VACUUM_SQLITE, self.target, str(VACUUM_BUSY_S)],
                capture_output=True,
                text=True,
                timeout=VACUUM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise LakeError(
                _erasure_pending(self, f"VACUUM did not finish in {VACUUM_TIMEOUT_S} s")
            ) from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            if "database or disk is full" in last:  # VACUUM writes a whole copy of the file first
                raise LakeError(
                    _erasure_pending(self, "VACUUM found no room for its copy", "there is space for it")
                ) from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.target)
            raise LakeError(_erasure_pending(self, f"VACUUM failed ({last})"))


class PostgresCatalog(Catalog, frozen=True):
    """A PostgreSQL database: the catalog of a lake many hosts write."""

    kind: ClassVar[CatalogKind] = "postgres"
    extensions: ClassVar[tuple[str, ...]] = ("ducklake", "postgres_scanner")

    def compact_storage(self, cur: duckdb.DuckDBPyConnection) -> None:
        # The two statistics tables rewritten by VACUUM FULL (the server's WAL and backups are its
        # operator's), through a connection of its own made with PostgreSQL's lock_timeout (a
        # server-side bound: VACUUM FULL waits for every lock on the table, a reader's included).
        dsn = with_lock_timeout(self.target, VACUUM_BUSY_S)
        cur.execute(f"ATTACH {_literal(dsn)} AS _lake_vacuum (TYPE postgres)")
        try:
            for table in ("ducklake_file_column_stats", "ducklake_table_column_stats"):
                try:
                    cur.execute(
                        f"CALL postgres_execute('_lake_vacuum', 'VACUUM FULL {table}', use_transaction => false)"
                    )
                except duckdb.Error as exc:
                    if "lock timeout" not in str(exc):
                        raise
                    held = f"VACUUM FULL {table} waited {VACUUM_BUSY_S:g} s for a reader's lock"
                    raise LakeError(_erasure_pending(self, held)) from None
        finally:
            cur.execute("DETACH _lake_vacuum")


_CATALOG_KINDS: tuple[type[Catalog], ...] = (PostgresCatalog, SqliteCatalog)


def _timestamptz(moment: datetime) -> str:
    return f"TIMESTAMPTZ '{moment.strftime('%Y-%m-%d %H:%M:%S.%f')}+00'"


class LakeCommit(msgspec.Struct):
    """What one ``commit`` did: the snapshot it made and the data files it added, or why not."""

    commit_id: str
    snapshot: int | None  # None: nothing committed (stale, or an empty commit)
    stale: dict[str, int] = msgspec.field(default_factory=dict)  # source -> its stored next position
    files: list[dict[str, Any]] = msgspec.field(default_factory=list)  # table, path, bytes, rows, sha256
    rows: int = 0
    retries: int = 0  # "database is locked" / engine conflicts retried

    @property
    def ok(self) -> bool:
        return self.snapshot is not None

    def record(self) -> dict[str, Any]:
        """The commit record naming the snapshot (what the log will carry)."""
        return {"commit_id": self.commit_id, "snapshot": self.snapshot, "files": self.files}


class _Stale(Exception):
    def __init__(self, stored: dict[str, int]) -> None:
        super().__init__(f"positions moved: {stored}")
        self.stored = stored


def _spec(name: str) -> Table:
    return TABLES[name] if name in TABLES else SIDE_TABLES[name]


# Folder values a hive reader (DuckDB's, Spark's) reads as NULL, in any case.
_HIVE_NULL_NAMES = frozenset({"NULL", "__HIVE_DEFAULT_PARTITION__"})


def _path_value(value: Any) -> str:
    """A partition value as its folder's name: as the part-file store writes it where it is a
    plain name, escaped where it is not (a slash, a percent sign, a dot folder, a NUL). A name a hive
    reader takes for NULL (``ducklake_add_data_files`` recorded run ``NULL``'s files as NULL, and
    DuckLake's scan then answered NULL for its rows) has every character escaped."""
    text = "_" if value is None or value == "" else str(value)
    if text.upper() in _HIVE_NULL_NAMES:
        return "".join(f"%{byte:02X}" for byte in text.encode())
    if "/" in text or "%" in text or "\0" in text or text in (".", ".."):
        return urllib.parse.quote(text, safe="")
    return text


_last_uuid7 = [0, 0]  # (unix ms, counter) of the last name made in this process


def _uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562: unix ms, then a counter, then random bits), increasing in this process.
    DuckLake names its files so: sorted by name, a table's files are in the order they were written,
    which readers of raw files (``ledger verify``'s fold) rely on."""
    now_ms = time.time_ns() // 1_000_000
    last_ms, counter = _last_uuid7
    counter = counter + 1 if now_ms <= last_ms else 0
    now_ms = max(now_ms, last_ms)
    if counter > 0xFFF:  # 4,096 names in one millisecond: borrow the next one
        now_ms, counter = now_ms + 1, 0
    _last_uuid7[:] = [now_ms, counter]
    tail = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    return uuid.UUID(int=(now_ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | tail)


def _unlink(written: list[tuple[str, Path]]) -> None:
    """Delete files a commit wrote and no snapshot names (it failed, or was stale)."""
    for _name, path in written:
        path.unlink(missing_ok=True)


def _conformed(name: str, table: pa.Table) -> pa.Table:
    """``table`` with exactly the lake table's columns and types, as ``INSERT … BY NAME`` takes it:
    an absent column is nulls, an unknown one is refused (a file with it would not be added)."""
    from runledger.ledger.compaction import conform  # (the writer's: a reader's import skips it)

    schema = lake_schema(name)
    unknown = sorted(set(table.column_names) - set(schema.names))
    if unknown:
        raise LakeError(f"table {name} has no column {', '.join(unknown)}")
    return conform(table, schema)


def _write_synced(rows: pa.Table, path: Path, table: str) -> None:
    """Rows of ``table`` as a Parquet file, written and fsynced with the folder that names it (made if new)."""
    import pyarrow.parquet as pq

    made = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        rows,
        path,
        compression=PARQUET_COMPRESSION,
        row_group_size=ROW_GROUP_ROWS.get(table, ROW_GROUP_ROWS[""]),
    )
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    for folder in (path.parent, path.parent.parent) if made else (path.parent,):
        fsync_dir(folder)


def _by_partition(table: pa.Table, column: str, sort_keys: Sequence[str]) -> list[tuple[Any, pa.Table]]:
    """``table``'s rows as (partition value, rows) pairs, values in ``str`` order, each pair's rows
    sorted by ``sort_keys`` (stably: rows that tie keep their order, as events keep stream order).
    One pass for every partition: one sort and at most one ``take`` (a ``filter`` per value scanned
    the whole table once each); a table of one partition that needs no sort is given back as it is."""
    import numpy as np  # (numpy comes with pyarrow; only a commit's write path needs it)
    import pyarrow.compute as pc

    values = pc.dictionary_encode(table.column(column).combine_chunks())
    partitions: list[Any] = values.dictionary.to_pylist()
    if values.null_count:
        partitions.append(None)  # null rows: the code after every value's
    if len(partitions) == 1 and not sort_keys:
        return [(partitions[0], table)]
    # The partition of each row, as its value's place in ``str`` order (the files' write order).
    place = np.empty(len(partitions), np.int64)
    place[sorted(range(len(partitions)), key=lambda i: str(partitions[i]))] = np.arange(len(partitions))
    rows_place = place[values.indices.fill_null(len(partitions) - 1).to_numpy()]
    order = _sort_order(table, sort_keys)
    if len(partitions) > 1:
        order = order[np.argsort(rows_place[order], kind="stable")]
    ordered = table if np.array_equal(order, np.arange(table.num_rows)) else table.take(order)
    counts = np.bincount(rows_place, minlength=len(partitions))
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    by_place = sorted(partitions, key=str)
    return [(by_place[i], ordered.slice(int(starts[i]), int(counts[i]))) for i in range(len(partitions))]


def _sort_order(table: pa.Table, sort_keys: Sequence[str]) -> Any:
    """Row indices (a NumPy array) that sort ``table`` stably by ``sort_keys``, ascending. Strings are
    ranked through their dictionary and the keys sorted as integers (NumPy's ``lexsort``: ~6x faster
    than Arrow's ``sort_indices`` on the metrics' names); a key with nulls or of another type is
    sorted by Arrow (nulls last), as ``Table.sort_by`` would."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if not sort_keys:
        return np.arange(table.num_rows)
    keys = [table.column(k) for k in sort_keys]
    simple = all(
        k.null_count == 0 and (pa.types.is_integer(k.type) or pa.types.is_string(k.type)) for k in keys
    )
    if not simple:
        return pc.sort_indices(table, sort_keys=[(k, "ascending") for k in sort_keys]).to_numpy()
    ranks = []
    for key in keys:
        if pa.types.is_string(key.type):
            encoded = pc.dictionary_encode(key.combine_chunks())
            rank = np.empty(len(encoded.dictionary), np.int64)
            rank[pc.sort_indices(encoded.dictionary).to_numpy()] = np.arange(len(encoded.dictionary))
            ranks.append(rank[encoded.indices.to_numpy()])
        else:
            ranks.append(key.to_numpy())
    return np.lexsort(ranks[::-1])  # (the last key given to lexsort is the primary one)


def lake_schema(name: str) -> pa.Schema:
    """A ledger table's columns in the lake: its file columns, then its hive partition column (as a
    hive-partitioned glob reader sees them today)."""
    import pyarrow as pa

    spec = _spec(name)
    if spec.partition in spec.schema.names:
        return spec.schema
    return spec.schema.append(pa.field(spec.partition, pa.string()))


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def fence_table(source: str) -> str:
    return FENCE_PREFIX + hashlib.sha256(source.encode()).hexdigest()[:20]


def _is_locked(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "database is locked" in text or "database is busy" in text or "sqlite_busy" in text


def first_line(exc: BaseException) -> str:
    """An error's first line (its type's name when it says nothing)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_conflict(exc: BaseException) -> bool:
    return "conflict" in str(exc).lower()


def _lost_to_another(exc: BaseException) -> bool:
    """Whether a transaction making tables or columns failed because another writer made them: a
    conflict at COMMIT, or (PostgreSQL catalog) the other's COMMIT landing between this one's look
    for what is missing and its BEGIN, so its CREATE met the table ("already exists", 1 CI run)."""
    if not isinstance(exc, duckdb.Error):
        return False
    return _is_conflict(exc) or (isinstance(exc, duckdb.CatalogException) and "already exists" in str(exc))


def _lost_init_race(text: str) -> bool:
    """DuckLake's ATTACH of a new PostgreSQL catalog creates its tables; two writers attaching it at
    once: the second's CREATE meets the first's ("duplicate key value violates unique constraint").
    On a new SQLite catalog, the second's probe of the tables can meet the first's lock mid-creation
    and end its transaction ("Failed to probe DuckLake metadata: Current transaction is aborted",
    seen once in a CI run of two ingesters creating one ledger): attached again, it finds them."""
    if "Failed to probe DuckLake metadata" in text:
        return "transaction is aborted" in text or "locked" in text
    return "Failed to initialize DuckLake" in text and ("duplicate key" in text or "already exists" in text)


class MaintenanceLock:
    """On a SQLite catalog, statements and ``maintain()`` take turns (a no-op on other catalogs).

    DuckLake 1.5.5 on SQLite: a statement read while ``ducklake_merge_adjacent_files`` runs beside it
    sometimes answers as if the table were empty (count 0 in about 1 of 30 pinned readers here, no
    error raised); on PostgreSQL the same test never did. And a merge cannot flush while commits
    land more often than it lasts. A SQLite catalog is on one host, so a file lock beside it lets
    every statement and every commit hold it shared and maintenance exclusive."""

    def __init__(self, catalog: Catalog) -> None:
        self.path = catalog.beside(".maintain.lock")

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with _file_lock(self.path, fcntl.LOCK_SH, "the maintenance lock (a merge holds it)"):
            yield

    @contextlib.contextmanager
    def exclusive(self, wait_s: float = MAINTAIN_WAIT_S) -> Iterator[bool]:
        """Yields whether it was taken within ``wait_s`` (statements are short: between them)."""
        if self.path is None:
            yield True
            return
        with open(self.path, "a+b") as handle:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        yield False
                        return
                    time.sleep(0.02)
                    continue
                yield True
                return


class CommitTurns:
    """On a SQLite catalog, writers' transactions take turns (a no-op on other catalogs).

    SQLite lets one writer at a time anyway, and a DuckLake COMMIT that found another's write lock
    failed its flush with "database is locked"; the next transaction on that DuckDB instance then
    crashed in ``ducklake_add_data_files`` (SIGSEGV, DuckDB 1.5.5: 8 of 40 three-writer races here).
    A file lock beside the catalog, held from BEGIN to COMMIT, keeps every flush alone."""

    def __init__(self, catalog: Catalog) -> None:
        self.path = catalog.beside(".commit.lock")

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        with _file_lock(self.path, fcntl.LOCK_EX, "the commit turn (another writer's transaction holds it)"):
            yield


@contextlib.contextmanager
def _file_lock(path: Path | None, operation: int, what: str) -> Iterator[None]:
    """``flock(operation)`` held on the file at ``path`` (made if new) for the block; none if no path.
    Waits at most ``LOCK_WAIT_S``, then a LakeError names ``what`` and the file."""
    if path is None:
        yield
        return
    with open(path, "a+b") as handle:
        wait_for_flock(handle, operation, LOCK_WAIT_S, f"{what}, {path}")
        yield


def wait_for_flock(handle: Any, operation: int, wait_s: float, what: str) -> None:
    """``flock(operation)`` on ``handle``, polled (1 ms doubling to 50 ms) for at most ``wait_s``;
    then a LakeError saying what was waited on."""
    deadline = time.monotonic() + wait_s
    sleep_s = 0.001
    while True:
        try:
            fcntl.flock(handle, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LakeError(f"waited {wait_s:g} s for {what}: it was never free") from None
            time.sleep(sleep_s)
            sleep_s = min(0.05, sleep_s * 2)


def retry_locked(attempt: Callable[[], T]) -> T:
    """``attempt()``, again after "database is locked" (a SQLite catalog that a writer holds for a
    moment), with the same bounded backoff as a writer."""
    sleep_s, cap_s = LOCKED_BACKOFF_S
    for _ in range(LOCKED_RETRIES):
        try:
            return attempt()
        except duckdb.Error as exc:
            if not _is_locked(exc):
                raise
        time.sleep(sleep_s * (0.5 + random.random()))
        sleep_s = min(cap_s, sleep_s * 2)
    return attempt()


# Run as ``python -c`` on a SQLite catalog: its WAL emptied into it, the file rewritten without the
# pages deleted rows left, the WAL emptied again. A checkpoint waits up to VACUUM_BUSY_S for readers;
# one still held then (a reader's open transaction) leaves the old pages in the file or the WAL: exit 3.
VACUUM_TIMEOUT_S = 120
# How long a catalog's compaction waits for a reader's hold: a SQLite checkpoint's busy timeout,
# PostgreSQL's lock_timeout for VACUUM FULL (without it, one session idle in a transaction that read
# the statistics tables kept a redaction waiting for as long as it stayed).
VACUUM_BUSY_S = 30.0
# The catalog's own ``ducklake_metadata`` row set while its storage may still hold erased rows (set
# before a compaction, deleted once one succeeds): the next writer or ``maintain`` compacts it again.
VACUUM_OPTION = "runledger_vacuum_pending"
_VACUUM_SQLITE = """
import contextlib, sqlite3, sys
busy_s = float(sys.argv[2])
with contextlib.closing(sqlite3.connect(sys.argv[1], timeout=busy_s)) as db:
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("VACUUM")
    busy = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()[0][0]
if busy:
    sys.exit(f"a reader held the catalog's WAL for {busy_s:g} s")
"""


def _erasure_pending(catalog: Catalog, what: str, until: str = "no reader holds it") -> str:
    return (
        f"lake catalog {catalog.shown}: {what}, so erased rows may still be in its storage: "
        f"`ledger compact` (or the next commit) erases them once {until}"
    )


def with_lock_timeout(dsn: str, seconds: float) -> str:
    """The libpq connection string ``dsn`` (keywords, or a URI) whose sessions also set PostgreSQL's
    ``lock_timeout``: added to the ``options`` it has (its own settings kept), else as its ``options``."""
    from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

    setting = f"-c lock_timeout={int(seconds * 1000)}"
    if dsn.startswith(("postgres://", "postgresql://")):
        parts = urlsplit(dsn)
        query = parse_qsl(parts.query, keep_blank_values=True)
        had = any(key == "options" for key, _ in query)
        query = [(k, f"{v} {setting}" if k == "options" else v) for k, v in query]
        query += [] if had else [("options", setting)]
        return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))
    found = re.search(r"\boptions\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn)
    if found is None:
        return f"{dsn} options='{setting}'"
    value = found.group(1)
    inner = value[1:-1] if value.startswith("'") else value
    return f"{dsn[: found.start(1)]}'{inner} {setting}'{dsn[found.end(1) :]}"


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


# ----------------------------------------------------------------- an s3:// data path
S3_SECRET = "runledger_lake"
S3_LARGEST_FILE = "64GiB"  # / 10,000 parts: 6.9 MB a part (a merged file is TARGET_FILE_BYTES at most)
S3_UPLOAD_THREADS = 4  # parts uploading at once (httpfs's default: 50, each a part in memory)
_GLOB_CHARS = frozenset("*?[{")  # read_blob takes a glob: a path with these is read by pyarrow instead
_PROBE = "runledger-probe-"  # no DuckLake file starts so: listing it answers nothing, in one request


def is_s3(data_path: str) -> bool:
    """Whether the lake's data files are objects on an S3-compatible server (else a local folder)."""
    return data_path.startswith("s3://")


def _s3_config(data_path: str) -> Any:
    """The server and credentials of an ``s3://bucket/prefix`` data path (the AWS_* variables)."""
    from runledger.ledger.publish_dest import DestError, S3Config, parse_s3_url

    try:
        parse_s3_url(data_path)
        return S3Config.from_env()
    except DestError as exc:
        raise LakeError(f"lake data {data_path}: {exc}") from None


def connect_data(
    catalog: Catalog, data_path: str, *, probe: bool = False, memory_limit: str | None = None
) -> duckdb.DuckDBPyConnection:
    """A connection with the catalog's extensions and, for an ``s3://`` data path, ``httpfs`` and the
    S3 secret from the AWS_* variables (``probe``: the server is asked once, so missing credentials,
    a missing bucket or a dead server are one LakeError line now rather than a failed commit later)."""
    from runledger.ledger.duck import ExtensionMissing

    if "://" in data_path and not is_s3(data_path):
        raise LakeError(f"lake data {data_path}: give a local folder or s3://bucket/prefix")
    if not is_s3(data_path):
        return connect(extensions=catalog.extensions, memory_limit=memory_limit)
    config = _s3_config(data_path)
    try:
        con = connect(extensions=[*catalog.extensions, "httpfs"], memory_limit=memory_limit)
    except ExtensionMissing as exc:
        raise LakeError(f"lake data {data_path}: {exc}") from None
    try:
        from runledger.ledger.duck_s3 import create_s3_secret

        create_s3_secret(con, config, S3_SECRET)
        # An upload holds one part in memory per file written (httpfs: the largest file / the most
        # parts, 800 GB / 10,000 = 80 MB by default): the lake's merge, writing several files at
        # once, ran out of the writer's 256 MB. Parts of ~7 MB (S3's least is 5 MiB) stream within it.
        con.execute(f"SET GLOBAL s3_uploader_max_filesize = '{S3_LARGEST_FILE}'")
        con.execute(f"SET GLOBAL s3_uploader_thread_limit = {S3_UPLOAD_THREADS}")
        if probe:
            _probe_s3(con, data_path, config)
    except BaseException:
        con.close()
        raise
    return con


def _probe_s3(con: duckdb.DuckDBPyConnection, data_path: str, config: Any) -> None:
    """One listing under the data path (one request: no key matches), its failure in one line."""
    try:
        con.execute("SELECT count(*) FROM glob(?)", [data_path.rstrip("/") + "/" + _PROBE + "*"]).fetchall()
    except duckdb.Error as exc:
        raise LakeError(f"lake data {data_path}: {_s3_problem(str(exc), config)}") from None


def _s3_problem(text: str, config: Any) -> str:
    """What an httpfs error says about the server, in words (its own first line last)."""
    first = " ".join(text.strip().splitlines()[0].split())[:300] if text.strip() else "failed"
    server = config.endpoint or "AWS S3"
    if "Could not connect" in text or "connect" in text.lower():
        return f"{server} is unreachable (AWS_ENDPOINT_URL): {first}"
    if not config.access_key:  # versitygw answers an unsigned listing 404, AWS 403
        unsigned = "refused an unsigned request: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        return f"{server} {unsigned} ({first})"
    if "403" in text or "401" in text:
        return f"{server} refused the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY): {first}"
    if "404" in text:
        return f"no such bucket at {server} ({first})"
    return first


def _s3_sha256(con: duckdb.DuckDBPyConnection, url: str) -> str | None:
    """The SHA-256 of an object's bytes as read back from the server (None: it is gone, merged and
    deleted by maintenance meanwhile)."""
    if _GLOB_CHARS.intersection(url):
        return _s3_sha256_arrow(url)
    try:
        rows = con.execute("SELECT filename, sha256(content) FROM read_blob(?)", [url]).fetchall()
    except duckdb.Error as exc:
        if "404" in str(exc) or "No files found" in str(exc):
            return None
        raise
    found = [digest for name, digest in rows if name == url]
    return str(found[0]) if len(found) == 1 else None


def _s3_sha256_arrow(url: str) -> str | None:
    from runledger.ledger.publish_dest import parse_s3_url

    bucket, key = parse_s3_url(url)
    s3 = _s3_config(url).filesystem()
    digest = hashlib.sha256()
    try:
        with s3.open_input_stream(f"{bucket}/{key}") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


def fetch_object(url: str, target: Path) -> str:
    """Download an ``s3://`` object to ``target`` (through ``target``.tmp, fsynced, then renamed), a
    MiB at a time. Returns the SHA-256 of the bytes fetched; LakeError (one line) if it is gone."""
    from runledger.ledger.publish_dest import parse_s3_url

    bucket, key = parse_s3_url(url)
    s3 = _s3_config(url).filesystem()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with s3.open_input_stream(f"{bucket}/{key}") as stream, open(tmp, "wb") as out:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except (FileNotFoundError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise LakeError(f"lake object {url}: {' '.join(str(exc).split())[:200]}") from None
    os.replace(tmp, target)
    return digest.hexdigest()


# ----------------------------------------------------------------- a ledger folder on a lake
# A new ledger's catalog, in its folder (SQLite: many processes, no server).
EMBEDDED_CATALOG = "catalog.sqlite"
LAKE_MARKER = "LAKE.json"  # in a ledger folder whose tables are in a lake (``ledger migrate`` writes it)


def missing_catalog(catalog: str, folder: Path) -> str:
    """The one line for a ledger folder whose catalog is gone (never made again: see ``LakeTables``)."""
    return (
        f"no lake catalog at {Catalog.parse(catalog).shown}, which {folder / LAKE_MARKER} names: it is "
        "missing, and it is never recreated under a ledger that has commits (restore it from a backup)"
    )


def replaced_catalog(catalog: str, folder: Path, stored: str, named: str) -> str:
    """The one line for a ledger folder whose catalog holds another ledger (``stored``) than the one
    its ``LAKE.json`` names (``named``): it was replaced, and nothing is read from or written to it."""
    return (
        f"the lake catalog {Catalog.parse(catalog).shown} holds ledger {stored}, but {folder / LAKE_MARKER} "
        f"names ledger {named}: the catalog was replaced (restore this ledger's from a backup)"
    )


def attached_ledger_id(con: duckdb.DuckDBPyConnection) -> str | None:
    """The ledger id in the catalog of the lake attached on ``con`` as ``ALIAS`` (its own
    ``ducklake_metadata`` row ``ID_OPTION``), read from the catalog alone, no data file; None for a
    lake named before that row was kept."""
    row = one_row(
        con.execute(
            f"SELECT value FROM __ducklake_metadata_{ALIAS}.ducklake_metadata WHERE key = ?", [ID_OPTION]
        )
    )
    return str(row[0]) if row and row[0] is not None else None


class LakeFolder(msgspec.Struct, frozen=True):
    """A ledger folder whose tables live in a lake: the catalog, the data path, the ledger's id and
    the tables it keeps complete (as ``LEDGER.json``'s list: a table added later may be empty)."""

    folder: Path
    catalog: str
    data_path: str
    ledger_id: str
    tables: tuple[str, ...]

    @classmethod
    def read(cls, folder: Path) -> LakeFolder | None:
        """The folder's lake, or None when it holds none (then it is a ledger of part files, or nothing)."""
        try:
            obj = json.loads((folder / LAKE_MARKER).read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise LakeError(f"{folder / LAKE_MARKER}: unreadable ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("catalog"), str):
            raise LakeError(f"{folder / LAKE_MARKER}: no catalog named")
        data = str(obj.get("data_path") or folder / "data")
        if "://" not in data and not Path(data).is_absolute():
            data = str(folder / data)  # relative to the folder: a copied folder reads its own files
        catalog = obj["catalog"]
        parsed = Catalog.parse(catalog)
        if parsed.file is not None and not parsed.file.is_absolute():
            catalog = parsed.resolved_in(folder).spec
        file = Catalog.parse(catalog).file
        if file is not None and not file.is_file():
            raise LakeError(missing_catalog(catalog, folder))
        tables = tuple(t for t in obj.get("tables") or TABLES if t in TABLES)
        return cls(folder, catalog, data, str(obj.get("ledger_id") or "ledger"), tables)

    def _inside(self, path: str) -> str:
        with contextlib.suppress(ValueError):
            return Path(path).resolve().relative_to(self.folder.resolve()).as_posix()
        return path

    def relative_catalog(self) -> Catalog:
        """The catalog, its file named from the folder when it is inside it."""
        return Catalog.parse(self.catalog).in_folder(self.folder)

    def relative_data_path(self) -> str:
        """The data path, named from the folder when it is inside it."""
        return self.data_path if "://" in self.data_path else self._inside(self.data_path)

    def write(self) -> None:
        """The marker, with the catalog and data path relative to the folder when they are inside it."""
        from runledger.schemas.durable import write_durably

        catalog, data = self.relative_catalog().spec, self.relative_data_path()
        self.folder.mkdir(parents=True, exist_ok=True)
        body: dict[str, Any] = {"format": "runledger-lake/1", "catalog": catalog, "data_path": data}
        body |= {"ledger_id": self.ledger_id, "tables": list(self.tables)}
        write_durably(self.folder / LAKE_MARKER, json.dumps(body, indent=2) + "\n")


def checkpoint_snapshot(con: duckdb.DuckDBPyConnection, ledger_id: str, note: str) -> int:
    """The snapshot a signed stream checkpoint (``ledger checkpoint``'s note) pins: the commit that
    brought its stream to the checkpoint's size, whose Merkle head must have the checkpoint's root
    (so a checkpoint of another history names no snapshot). ``con``: ``open_snapshot``'s, newest."""
    from runledger.ledger.log_checkpoint import CheckpointError, parse_checkpoint
    from runledger.ledger.merkle import CompactRange

    try:
        cp = parse_checkpoint(note.split("\n\n", 1)[0] + "\n")
    except CheckpointError as exc:
        raise LakeError(f"not a checkpoint: {exc}") from None
    prefix = f"runledger/{ledger_id}/"
    if not cp.origin.startswith(prefix):
        raise LakeError(f"checkpoint of {cp.origin!r}: not a stream of ledger {ledger_id}")
    stream = cp.origin[len(prefix) :]
    rows = con.execute(
        # ``snapshot_id``: the snapshot that inserted the row (DuckLake's virtual column, kept through
        # merges), named even once that snapshot is expired (not a join with ``snapshots()``).
        f"SELECT s.value, s.snapshot_id FROM {ALIAS}.{STATE} s WHERE s.key = ? ORDER BY s.snapshot_id",
        [f"stream:{stream}"],
    ).fetchall()
    for value, snapshot in rows:
        head = json.loads(value)
        if head.get("size") != cp.size:
            continue
        if CompactRange.from_json(head["tree"]).root() != cp.root:
            raise LakeError(
                f"checkpoint {stream} at size {cp.size}: its root is not the lake's at that size "
                "(another history)"
            )
        return int(snapshot)
    raise LakeError(f"no snapshot of the lake has stream {stream} at size {cp.size}")


def open_snapshot(
    catalog: Catalog | str, data_path: str, snapshot: int | None = None
) -> tuple[duckdb.DuckDBPyConnection, int]:
    """A new connection with the lake attached read-only at one snapshot (``snapshot``, or the newest
    now) as ``lake``, its files read under ``data_path``: every statement on it, naming
    ``lake.<table>`` or not, sees that one moment.
    For a process that only reads (``ledger query``)."""
    spec = Catalog.parse(catalog) if isinstance(catalog, str) else catalog
    if spec.file is not None and not spec.file.exists():
        raise LakeError(f"no lake catalog at {spec.target}")
    con = connect_data(spec, data_path, probe=True)
    try:
        where = f"DATA_PATH {_literal(data_path)}, OVERRIDE_DATA_PATH true"
        known = spec.newest_snapshot(con, snapshot)
        if known is None:  # PostgreSQL: asked through DuckLake, then attached again pinned
            con.execute(f"ATTACH {_literal(spec.uri())} AS {ALIAS} (READ_ONLY, {where})")
            row = one_row(con.execute(f"FROM {ALIAS}.current_snapshot()"))
            found = one_row(
                con.execute(
                    f"SELECT count(*) FROM {ALIAS}.snapshots() WHERE snapshot_id = ?", [snapshot or 0]
                )
            )
            known = (int(row[0]) if row else 0, bool(found and found[0]))
            con.execute(f"DETACH {ALIAS}")
        newest, present = known
        if snapshot is None:
            snapshot = newest
        elif not 0 <= snapshot <= newest:
            raise LakeError(f"snapshot {snapshot}: the lake's snapshots are 0-{newest}")
        elif not present:
            raise LakeError(f"snapshot {snapshot} has expired (maintenance removed it)")
        con.execute(
            f"ATTACH {_literal(spec.uri())} AS {ALIAS} (READ_ONLY, SNAPSHOT_VERSION {int(snapshot)}, {where})"
        )
    except duckdb.Error as exc:
        con.close()
        raise LakeError(f"lake catalog {spec.target}: {str(exc).strip().splitlines()[0]}") from None
    except BaseException:
        con.close()
        raise
    return con, snapshot


# A catalog's file path must be plain: no glob (DuckDB would expand it) and no control character.
_UNPLAIN_PATH_CHARS = re.compile(r"[*?\[\]{}\\\x00-\x1f\x7f]")


def plain_file_under(data_path: str, path: str) -> bool:
    """Whether ``path`` (a data or delete file's full path, joined from the catalog's rows) is a plain
    file under ``data_path`` (a folder or an ``s3://`` prefix): no ``.``/``..``/empty folder, no glob
    or control character. The catalog's operator is not trusted: readers and verify read nothing else."""
    prefix = data_path.rstrip("/") + "/"
    if not path.startswith(prefix):
        return False
    rest = path[len(prefix) :]
    return not any(part in ("", ".", "..") for part in rest.split("/")) and not _UNPLAIN_PATH_CHARS.search(
        rest
    )


def live_at_snap(alias: str) -> str:
    """SQL: the catalog row ``alias`` is live at the snapshot bound as ``$snap``."""
    return (
        f"{alias}.begin_snapshot <= $snap AND ({alias}.end_snapshot IS NULL OR {alias}.end_snapshot > $snap)"
    )


def _joined(data_path: str, *parts: tuple[str, bool]) -> str:
    """A path DuckLake's catalog keeps in parts, each relative to the one before or not
    (``path_is_relative``): the data path, then the schema's folder, the table's, a file's."""
    full = data_path.rstrip("/") + "/"
    for part, relative in parts:
        full = full + part if relative else part
    return full


class TableFiles(msgspec.Struct, frozen=True):
    """One table's data files at a snapshot (full paths, in file order). ``partition``: the column
    whose value every file's folder names exactly as the catalog records it (``run_id=moe-535b``,
    plain characters only), so a reader may take it from the path (hive partitioning) and pass over
    the files a filter on it rules out without opening them; None where a path does not."""

    paths: list[str]
    partition: str | None = None
    ids: list[int] = msgspec.field(default_factory=list)  # each path's data_file_id in the catalog


class ColumnBounds(msgspec.Struct, frozen=True):
    """One column's statistics in one data file, as the catalog keeps them
    (``ducklake_file_column_stats``): its least and greatest value as text (None: no value), how many
    of its values are NULL, and how many are not (DuckLake's ``value_count``)."""

    min_value: str | None
    max_value: str | None
    nulls: int | None
    values: int | None

    def all_null(self) -> bool:
        """Whether the file holds no value of the column but NULL."""
        return self.min_value is None and self.max_value is None and self.values == 0


# The columns whose bounds in each data file a reader reads with a snapshot's file list, so that its
# own statements open only the files that can hold their rows, as DuckLake's own scan does
# (``runledger.ledger.query.Reader``: a run's last step past a step it reached, and its events admitted
# unsigned). Numbers and booleans only: DuckLake may keep a text bound cut to a prefix.
BOUNDED_COLUMNS: dict[str, tuple[str, ...]] = {"events": ("step", "authenticated")}


def file_bounds_sql(meta: str = "") -> str:
    """SQL over a catalog's own tables (``meta``: their schema with its dot, or "" where they are
    the database's) answering (data file id, column, min, max, nulls, values) for ``BOUNDED_COLUMNS``
    of every file live at the snapshot bound as ``$snap``."""
    wanted = " OR ".join(
        f"(t.table_name = '{table}' AND c.column_name IN ({', '.join(repr(c) for c in columns)}))"
        for table, columns in BOUNDED_COLUMNS.items()
    )
    return (
        "SELECT s.data_file_id, c.column_name, s.min_value, s.max_value, s.null_count, s.value_count "
        f"FROM {meta}ducklake_file_column_stats s "
        f"JOIN {meta}ducklake_data_file f ON f.data_file_id = s.data_file_id AND {live_at_snap('f')} "
        f"JOIN {meta}ducklake_table t ON t.table_id = f.table_id AND {live_at_snap('t')} "
        f"JOIN {meta}ducklake_column c ON c.table_id = s.table_id AND c.column_id = s.column_id "
        f"AND c.parent_column IS NULL AND {live_at_snap('c')} WHERE {wanted}"
    )


def file_bounds(rows: Sequence[Sequence[Any]]) -> dict[int, dict[str, ColumnBounds]]:
    """``file_bounds_sql``'s rows as data file id -> column -> its bounds."""
    out: dict[int, dict[str, ColumnBounds]] = {}
    for file_id, column, low, high, nulls, values in rows:
        out.setdefault(int(file_id), {})[str(column)] = ColumnBounds(
            None if low is None else str(low),
            None if high is None else str(high),
            None if nulls is None else int(nulls),
            None if values is None else int(values),
        )
    return out


_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _names_its_partition(path: str, column: str, value: str | None) -> bool:
    """Whether ``column=value`` is the one ``key=value`` folder on ``path``, with a plain value (no
    escaping for a hive reader to undo, not a word hive readers read as NULL, and no other folder
    for it to take as a partition)."""
    if value is None or not _PLAIN_VALUE.fullmatch(value) or value.upper() in _HIVE_NULL_NAMES:
        return False
    folders = [part for part in path.split("/")[:-1] if "=" in part]
    return folders == [f"{column}={value}"]


def snapshot_files(
    con: duckdb.DuckDBPyConnection, data_path: str, snapshot: int
) -> dict[str, TableFiles | None]:
    """Each ledger table's data files at ``snapshot``, read in one query from the catalog's own
    tables on ``con`` (the lake attached as ``lake``); None for a table DuckDB must read through
    DuckLake: a file of it carries deletions (only a redaction's, until its erasure ends), or rows
    are inlined in the catalog (another writer's setting; the ledger's writer inlines none)."""
    meta = f"__ducklake_metadata_{ALIAS}"

    rows = con.execute(
        f"SELECT t.table_name, s.path, s.path_is_relative, t.path, t.path_is_relative, f.path, "
        f"f.path_is_relative, EXISTS (SELECT 1 FROM {meta}.ducklake_delete_file d "
        f"WHERE d.data_file_id = f.data_file_id AND {live_at_snap('d')}), v.partition_value, f.data_file_id "
        f"FROM {meta}.ducklake_data_file f "
        f"JOIN {meta}.ducklake_table t ON t.table_id = f.table_id AND {live_at_snap('t')} "
        f"JOIN {meta}.ducklake_schema s ON s.schema_id = t.schema_id AND {live_at_snap('s')} "
        f"LEFT JOIN {meta}.ducklake_file_partition_value v "
        f"ON v.data_file_id = f.data_file_id AND v.partition_key_index = 0 "
        f"WHERE {live_at_snap('f')} ORDER BY t.table_name, f.data_file_id",
        {"snap": int(snapshot)},
    ).fetchall()
    inlined = {
        name
        for (name,) in con.execute(
            f"SELECT t.table_name FROM {meta}.ducklake_inlined_data_tables i "
            f"JOIN {meta}.ducklake_table t ON t.table_id = i.table_id AND {live_at_snap('t')}",
            {"snap": int(snapshot)},
        ).fetchall()
    }
    return table_files(data_path, rows, inlined)


def table_files(
    data_path: str, rows: Sequence[Sequence[Any]], inlined: set[str]
) -> dict[str, TableFiles | None]:
    """Each table's full paths and partition column from a snapshot's file rows (table, schema path,
    relative?, table path, relative?, file path, relative?, has deletions, first partition value, data
    file id), as the catalog lists them; None: a table with a file carrying deletions, or with rows
    inlined in the catalog (read through DuckLake)."""
    paths: dict[str, list[str]] = {}
    ids: dict[str, list[int]] = {}
    named: dict[str, bool] = {}  # table -> every file so far names its partition value
    columns: dict[str, str | None] = {}  # table -> its partition column (None: not a ledger table)
    out: dict[str, TableFiles | None] = dict.fromkeys(inlined)
    for (
        table,
        schema_path,
        schema_rel,
        table_path,
        table_rel,
        path,
        file_rel,
        deleted,
        value,
        file_id,
    ) in rows:
        if table in out:  # (None: read through DuckLake)
            continue
        if deleted:
            out[table] = None
            continue
        full = _joined(
            data_path, (schema_path, bool(schema_rel)), (table_path, bool(table_rel)), (path, bool(file_rel))
        )
        paths.setdefault(table, []).append(full)
        ids.setdefault(table, []).append(int(file_id))
        if table not in columns:
            columns[table] = _spec(table).partition if table in TABLES or table in SIDE_TABLES else None
        column = columns[table]
        named[table] = (
            named.get(table, True) and column is not None and _names_its_partition(full, column, value)
        )
    for table, listed in paths.items():
        if table not in out:
            out[table] = TableFiles(listed, columns[table] if named[table] else None, ids[table])
    return out


class LakeTables:
    """The ledger's tables in one DuckLake. One writer connection per instance (not thread-safe)."""

    def __init__(
        self,
        catalog: Catalog | str,
        data_path: str | Path,
        *,
        create: bool = True,
        name_new: str | None = None,
        new_catalog: bool = True,
    ) -> None:
        """``create``: make the ledger's tables the lake lacks. ``new_catalog``: whether a catalog
        that does not exist may be made (only while a ledger folder is being created); False: a
        missing catalog, or one holding no runledger tables, is a LakeError and nothing is made."""
        self.catalog = Catalog.parse(catalog) if isinstance(catalog, str) else catalog
        # A folder, or s3://bucket/prefix (kept a string so nothing assumes a local path).
        self.data_path = str(data_path)
        self.retries = 0  # every "database is locked" and engine conflict retried, over the instance
        self.maintenance = MaintenanceLock(self.catalog)
        self.turns = CommitTurns(self.catalog)
        self._fences: set[str] = set()  # sources whose fence table is known to exist
        self._inlined: set[str] = set()  # writer tables known to keep their rows in the catalog
        # (snapshot, source -> next position): the fences as this writer's last commit left them
        self._fences_at: tuple[int, dict[str, int]] | None = None
        self._folders: dict[str, Path] = {}  # table -> its data folder (``_table_folder``)
        self._bounds_at_risk: set[str] = set()  # tables the last transaction may leave short bounds
        self.name_new = name_new  # the ledger id a new lake is named in its creating transaction
        # (ledger commit n, snapshot s): no commit record above n existed at s (``records_after``)
        self._records_seen: tuple[int, int] | None = None
        self.named_now = False  # whether this instance created the lake and named it so
        self.new_catalog = new_catalog
        # A catalog is made only with a new ledger: attaching a missing one would make it empty.
        file = self.catalog.file
        if file is not None and not new_catalog and not file.is_file():
            raise LakeError(f"no lake catalog at {self.catalog.shown}")
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
        if "://" not in self.data_path:
            Path(self.data_path).mkdir(parents=True, exist_ok=True)
        self.con = self._retry(self._attach_writer)
        try:
            if not new_catalog:
                self._require_runledger_tables()
            if create:
                self._retry(self._create_tables)
                self._retry(self._add_columns)
                self._retry(self._check_bounds_once)
        except BaseException:  # (a damaged catalog attaches, then fails here): let go of its file now
            self.con.close()
            raise

    def _require_runledger_tables(self) -> None:
        """LakeError unless the attached catalog holds the writer's own tables (a catalog replaced
        by an empty or foreign one is refused, never filled)."""
        existing = self._retry(self._existing)
        if not {POSITIONS, STATE, COMMITS} <= existing:
            raise LakeError(f"lake catalog {self.catalog.shown} holds no runledger tables")

    def stored_ledger_id(self) -> str | None:
        """The ledger id the lake was named with (None: an unnamed lake): the catalog's own
        ``ID_OPTION`` row, read without a data file (a replaced catalog's files are elsewhere), else
        the state row of a lake named before that row was kept (then it is written)."""

        def ask_catalog() -> str | None:
            with contextlib.closing(self.con.cursor()) as cur:
                return attached_ledger_id(cur)

        def ask_state() -> str | None:
            with self.maintenance.shared(), contextlib.closing(self.con.cursor()) as cur:
                row = one_row(
                    cur.execute(f"SELECT arg_max(value, rowid) FROM {ALIAS}.{STATE} WHERE key = ?", [ID_KEY])
                )
            return str(json.loads(row[0])) if row and row[0] is not None else None

        found = self._retry(ask_catalog)
        if found is None:
            found = self._retry(ask_state)
            if found is not None:
                self.note_ledger_id(found)
        return found

    def note_ledger_id(self, ledger_id: str) -> None:
        """Keep the lake's ledger id in the catalog's own metadata (once), where ``stored_ledger_id``
        finds it without reading data files (DuckLake keeps rows it does not know there)."""
        self._retry(lambda: self._keep_option(ID_OPTION, ledger_id))

    def _drop_option(self, key: str) -> None:
        """No row ``key`` in the catalog's own ``ducklake_metadata`` (``_keep_option``'s undone)."""
        meta = f"__ducklake_metadata_{ALIAS}"
        with self.turns.turn(), contextlib.closing(self.con.cursor()) as cur:
            cur.execute(f"DELETE FROM {meta}.ducklake_metadata WHERE key = ?", [key])

    def _keep_option(self, key: str, value: str) -> None:
        """``key`` = ``value`` in the catalog's own ``ducklake_metadata``, unless a row has the key."""
        meta = f"__ducklake_metadata_{ALIAS}"
        with self.turns.turn(), contextlib.closing(self.con.cursor()) as cur:
            cur.execute(
                f"INSERT INTO {meta}.ducklake_metadata (key, value) SELECT ?, ? WHERE NOT EXISTS "
                f"(SELECT 1 FROM {meta}.ducklake_metadata WHERE key = ?)",
                [key, value, key],
            )

    # ----------------------------------------------------------------- connections
    def _attach_writer(self) -> duckdb.DuckDBPyConnection:
        # OVERRIDE_DATA_PATH: a lake folder copied or moved (its catalog names the old data path;
        # DuckLake keeps each file's path relative to it) is read and written where it is now.
        options = f"DATA_PATH {_literal(self.data_path)}, OVERRIDE_DATA_PATH true, DATA_INLINING_ROW_LIMIT 0"
        options += self.catalog.attach_options()
        if not self.new_catalog:  # (a PostgreSQL database without one would be given a new lake)
            options += ", CREATE_IF_NOT_EXISTS false"
        for tries in range(INIT_RACE_RETRIES + 1):
            con = connect_data(self.catalog, self.data_path, probe=True, memory_limit=WRITER_MEMORY)
            try:
                con.execute(f"ATTACH {_literal(self.catalog.uri())} AS {ALIAS} ({options})")
                return con
            except duckdb.Error as exc:
                con.close()
                text = str(exc)
                if "creating a new DuckLake is explicitly disabled" in text:
                    if self.catalog.file is not None:  # (the file is there: ``__init__`` checked)
                        raise LakeError(f"lake catalog {self.catalog.shown} holds no lake") from None
                    raise LakeError(f"no lake catalog at {self.catalog.shown}") from None
                if _lost_init_race(text) and tries < INIT_RACE_RETRIES:
                    time.sleep(0.05 * (tries + 1) * (0.5 + random.random()))
                    continue  # another writer initialized the new catalog first: it is there now
                raise
            except BaseException:
                con.close()
                raise
        raise AssertionError("unreachable")  # (the last try returns or raises)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> LakeTables:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _retry(
        self,
        attempt: Callable[[], T],
        *,
        on_conflict: bool = False,
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> T:
        """Run ``attempt``, again after "database is locked" (SQLite catalog) with a bounded
        exponential backoff, and after an engine conflict when ``on_conflict``."""
        sleep_s, cap_s = LOCKED_BACKOFF_S
        tries = 0
        started = time.monotonic()
        while True:
            try:
                return attempt()
            except duckdb.Error as exc:
                retryable = _is_locked(exc) or (on_conflict and _is_conflict(exc))
                limit = LOCKED_RETRIES if _is_locked(exc) else CONFLICT_RETRIES
                if not retryable:
                    raise
                if tries >= limit:  # (the same kind of error, so callers still tell a conflict)
                    waited = "a lock on" if _is_locked(exc) else "conflicting commits on"
                    raise type(exc)(
                        f"gave up after {tries} retries in {time.monotonic() - started:.1f} s waiting "
                        f"out {waited} lake catalog {self.catalog.shown}: {first_line(exc)}"
                    ) from exc
                self._rollback(con)
                tries += 1
                self.retries += 1
                time.sleep(sleep_s * (0.5 + random.random()))
                sleep_s = min(cap_s, sleep_s * 2)

    def _rollback(self, con: duckdb.DuckDBPyConnection | None = None) -> None:
        with contextlib.suppress(duckdb.Error, AttributeError):
            (con or self.con).execute("ROLLBACK")

    # ----------------------------------------------------------------- tables
    def _existing(self, con: duckdb.DuckDBPyConnection | None = None) -> set[str]:
        """The lake's tables now, from its catalog's own table (``duckdb_tables()`` lists every
        attached database's: ~20x slower)."""
        rows = (
            (con or self.con)
            .execute(
                f"SELECT table_name FROM __ducklake_metadata_{ALIAS}.ducklake_table WHERE end_snapshot IS NULL"
            )
            .fetchall()
        )
        return {r[0] for r in rows}

    def _create_tables(self) -> None:
        """Every ledger table and the writer-state tables, once (racing creators: one wins, the
        other's conflict is retried and then finds them). A new lake (no table yet) is named
        ``self.name_new`` in the same transaction: ``named_now`` says this one named it."""
        if not self._missing():
            return
        with self.maintenance.shared(), self.turns.turn():
            wanted = self._missing()  # again, in turn: another writer may have made them meanwhile
            if not wanted:
                return
            new_lake = len(wanted) == len(self._all_tables())
            self.con.execute("BEGIN")
            try:
                for name in wanted:
                    self._create_one(name)
                self.con.execute(f"CALL {ALIAS}.set_option('data_inlining_row_limit', 0)")
                if new_lake and self.name_new is not None:  # (one COMMIT where naming took a second)
                    moved = {ID_FENCE: (0, 1)}
                    made = self._in_transaction(
                        uuid.uuid4().hex, {}, [], moved, {ID_KEY: self.name_new}, "create", {}, None
                    )
                    self.named_now = True
                    if made is not None:  # a new lake holds no commit record
                        self._records_seen = (-1, made)
                else:
                    self.con.execute("COMMIT")
            except BaseException as exc:
                self._rollback()
                self.named_now = False
                if _lost_to_another(exc) and not self._missing():
                    return  # another process created them first
                raise

    def _missing_columns(self) -> list[tuple[str, str, str]]:
        """(table, column, DuckDB type) of each column a ledger table gained after this lake was
        made (``moe_layer_stats.max_load``): its rows before read NULL there."""
        meta = f"__ducklake_metadata_{ALIAS}"
        have = set(
            self.con.execute(
                f"SELECT t.table_name, c.column_name FROM {meta}.ducklake_table t "
                f"JOIN {meta}.ducklake_column c ON c.table_id = t.table_id "
                "WHERE t.end_snapshot IS NULL AND c.end_snapshot IS NULL AND c.parent_column IS NULL"
            ).fetchall()
        )
        tables = {t for t, _ in have}
        out = []
        for name in [*TABLES, *SIDE_TABLES]:
            for column in lake_schema(name) if name in tables else ():
                kind = column_type(column.type)
                if (name, column.name) not in have and kind is not None:
                    out.append((name, column.name, kind))
        return out

    def _add_columns(self) -> None:
        """ALTER TABLE … ADD COLUMN for each column the lake lacks, in turn, in one transaction (a
        racing writer's conflict is retried by ``_retry`` and then finds them added)."""
        if not self._missing_columns():
            return
        with self.maintenance.shared(), self.turns.turn():
            wanted = self._missing_columns()
            if not wanted:
                return
            self.con.execute("BEGIN")
            try:
                for table, column, kind in wanted:
                    self.con.execute(
                        f"ALTER TABLE {ALIAS}.{_quote(table)} ADD COLUMN {_quote(column)} {kind}"
                    )
                self.con.execute("COMMIT")
            except BaseException as exc:
                self._rollback()
                if _lost_to_another(exc) and not self._missing_columns():
                    return  # another writer added them first
                raise

    @staticmethod
    def _all_tables() -> list[str]:
        return [*TABLES, *SIDE_TABLES, POSITIONS, STATE, COMMITS]

    def _missing(self) -> list[str]:
        existing = self._existing()
        return [n for n in self._all_tables() if n not in existing]

    def _create_one(self, name: str) -> None:
        columns = {
            POSITIONS: "source VARCHAR, next_position BIGINT, commit_id VARCHAR",
            STATE: "key VARCHAR, value VARCHAR, commit_id VARCHAR",
            COMMITS: "commit_id VARCHAR, writer VARCHAR, time TIMESTAMPTZ, positions VARCHAR, "
            "rows BIGINT, info VARCHAR, ledger_commit BIGINT",
        }.get(name)
        if columns is not None:
            self.con.execute(f"CREATE TABLE {ALIAS}.{_quote(name)} ({columns})")
            return
        schema = lake_schema(name)
        types = [column_type(f.type) for f in schema]
        if None in types:  # (a type the mapping lacks: DuckDB's own from the Arrow schema)
            self.con.register("_lake_empty", schema.empty_table())
            try:
                self.con.execute(f"CREATE TABLE {ALIAS}.{_quote(name)} AS SELECT * FROM _lake_empty LIMIT 0")
            finally:
                self.con.unregister("_lake_empty")
        else:  # (~half the time of creating it from an empty Arrow table: 19 tables per new lake)
            columns = ", ".join(f"{_quote(f.name)} {kind}" for f, kind in zip(schema, types, strict=True))
            self.con.execute(f"CREATE TABLE {ALIAS}.{_quote(name)} ({columns})")
        partition = _spec(name).partition
        self.con.execute(f"ALTER TABLE {ALIAS}.{_quote(name)} SET PARTITIONED BY ({_quote(partition)})")

    # ----------------------------------------------------------------- commit
    def commit(
        self,
        tables: Mapping[str, pa.Table],
        positions: Mapping[str, tuple[int, int]],
        state: Mapping[str, Any],
        *,
        writer: str = "",
        info: Mapping[str, Any] | None = None,
        number: int | None = None,
        edits: Sequence[tuple[str, Sequence[Any]]] = (),
    ) -> LakeCommit:
        """Commit every table's rows, the positions (source -> (expected next, new next)) and the
        state (key -> JSON value) as one snapshot. If a source's stored next position is not the
        expected one (another writer got there first), nothing lands: ``stale`` names them.
        ``number``: the ledger's commit number, kept with ``info`` (``records_after`` reads them).
        ``edits``: statements (SQL, parameters) on rows stored before, run in the same transaction
        first (``ledger redact``'s deletes; ``erase_deleted`` then takes the bytes off the disk)."""
        for name in tables:
            if name not in TABLES and name not in SIDE_TABLES:
                raise LakeError(f"unknown table {name!r}")
        commit_id = uuid.uuid4().hex
        before = self.retries

        def attempt() -> int | None:
            # Local files are written (and fsynced) before the transaction begins, so the catalog's
            # write lock (SQLite) is held for metadata only; each attempt writes its own (adding one
            # file again after a rolled-back attempt crashed DuckDB 1.5.5: SIGSEGV, 10 of 25 races).
            written = [] if is_s3(self.data_path) else self._write_files(tables)
            try:
                return self._commit_once(
                    commit_id, tables, written, positions, state, writer, info or {}, number, edits
                )
            except BaseException:
                _unlink(written)  # no snapshot names them (a kill before here leaves orphans: harmless)
                raise

        try:
            # Beside maintenance, not through it: on a SQLite catalog a merge (one long DuckLake
            # transaction) cannot flush while commits land more often than it lasts (every retry
            # found the catalog moved: "database is locked", 1 test run in 5): it takes its turn.
            with self.maintenance.shared():
                snapshot = self._retry(attempt, on_conflict=True)
        except _Stale as stale:
            self._rollback()
            return LakeCommit(commit_id, None, stale=stale.stored, retries=self.retries - before)
        except duckdb.Error as exc:
            if not _is_conflict(exc):
                raise
            # The conflict outlived its retries: the fence tells whether someone else took it.
            stored = self.fence_positions(list(positions))
            moved = {s: stored.get(s, 0) for s, (want, _) in positions.items() if stored.get(s, 0) != want}
            if not moved:
                raise
            return LakeCommit(commit_id, None, stale=moved, retries=self.retries - before)
        result = LakeCommit(commit_id, snapshot, retries=self.retries - before)
        result.rows = sum(t.num_rows for t in tables.values())
        if (
            snapshot is not None
            and number is not None
            and positions.get(COMMIT_FENCE) == (number, number + 1)
        ):
            self._records_seen = (number, snapshot)  # (the fence: no record above ``number`` at it)
        if snapshot is not None:
            at_risk = self._bounds_at_risk
            if at_risk:
                self._retry(lambda: self._correct_bounds(at_risk))
            result.files = self._retry(lambda: self.added_files(snapshot))
        return result

    def _correct_bounds(
        self, tables: Collection[str] | None = None, con: duckdb.DuckDBPyConnection | None = None
    ) -> int:
        """DuckLake 1.5.5 can leave a table's column bounds short of its data (``lake_stats``)."""
        from runledger.ledger.lake_stats import LEDGER_TABLES, correct_bounds

        with self.turns.turn():
            return correct_bounds(con or self.con, ALIAS, LEDGER_TABLES if tables is None else tables)

    def _check_bounds_once(self) -> None:
        """Every table's bounds checked, once per lake (one written before writers kept them). A
        lake this instance has just made holds no file of a writer that did not keep them."""
        if _has_option(self.con, BOUNDS_OPTION):
            return
        if not self.named_now:
            self._correct_bounds()
        self._keep_option(BOUNDS_OPTION, "1")

    def _commit_once(
        self,
        commit_id: str,
        tables: Mapping[str, pa.Table],
        written: list[tuple[str, Path]],
        positions: Mapping[str, tuple[int, int]],
        state: Mapping[str, Any],
        writer: str,
        info: Mapping[str, Any],
        number: int | None,
        edits: Sequence[tuple[str, Sequence[Any]]],
    ) -> int | None:
        with self.turns.turn():
            self.con.execute("BEGIN")
            try:
                return self._in_transaction(
                    commit_id, tables, written, positions, state, writer, info, number, edits
                )
            except BaseException:
                self._rollback()  # a failed statement leaves the transaction open: never the next commit's
                raise

    def _in_transaction(
        self,
        commit_id: str,
        tables: Mapping[str, pa.Table],
        written: list[tuple[str, Path]],
        positions: Mapping[str, tuple[int, int]],
        state: Mapping[str, Any],
        writer: str,
        info: Mapping[str, Any],
        number: int | None,
        edits: Sequence[tuple[str, Sequence[Any]]] = (),
    ) -> int | None:
        con = self.con
        rows = 0
        inlined = self._inline_writer_tables(positions)
        for sql, params in edits:
            con.execute(sql, list(params))
        for name, table in sorted(tables.items()):
            if table.num_rows and is_s3(self.data_path):
                self._insert_by_engine(name, table)
            rows += table.num_rows
        for name, path in written:
            con.execute(f"CALL ducklake_add_data_files('{ALIAS}', ?, ?)", [name, str(path)])
        fenced = self._fence(positions)
        if rows == 0 and not positions and not state:
            con.execute("ROLLBACK")
            return None
        if positions:
            _insert_rows(con, POSITIONS, [[s, new, commit_id] for s, (_, new) in sorted(positions.items())])
        if state:
            _insert_rows(
                con, STATE, [[k, json.dumps(v, sort_keys=True), commit_id] for k, v in sorted(state.items())]
            )
        moved = {s: new for s, (_, new) in positions.items()}
        con.execute(
            f"INSERT INTO {ALIAS}.{COMMITS} VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                commit_id,
                writer,
                datetime.now(UTC),
                json.dumps(moved, sort_keys=True),
                rows,
                json.dumps(dict(info)),
                number,
            ],
        )
        con.execute(f"CALL {ALIAS}.set_commit_message(?, ?)", [writer, commit_id])
        from runledger.ledger.lake_stats import tables_at_risk  # (the writer's, as the modules below)

        self._bounds_at_risk = tables_at_risk(con, ALIAS, tables)
        con.execute("COMMIT")
        self._inlined |= inlined
        (snapshot,) = one_row(con.execute(f"FROM ducklake_last_committed_snapshot('{ALIAS}')")) or (None,)
        if snapshot is None:
            return None
        self._fences_at = (int(snapshot), fenced)
        return int(snapshot)

    def _inline_writer_tables(self, positions: Mapping[str, tuple[int, int]]) -> set[str]:
        """Inside the transaction: the inlining option set on each committed writer table this commit
        writes that lacks it (``WRITER_INLINED_ROWS``); the tables it holds after COMMIT. One catalog
        read while a table may lack it, none once every one is known to have it."""
        if not self.catalog.writers_take_turns:  # (deletes of inlined rows are not raced otherwise here)
            return set()
        wanted = {POSITIONS, STATE} | {fence_table(s) for s in positions}
        if wanted <= self._inlined:
            return set()
        meta = f"__ducklake_metadata_{ALIAS}"
        named = ", ".join(_literal(t) for t in sorted(wanted - self._inlined))
        # Live catalog rows: a table of this same transaction (a new lake's) is not there yet.
        rows = self.con.execute(
            f"SELECT t.table_name, EXISTS (SELECT 1 FROM {meta}.ducklake_metadata m WHERE m.scope = 'table' "
            "AND m.scope_id = t.table_id AND m.key = 'data_inlining_row_limit') "
            f"FROM {meta}.ducklake_table t WHERE t.end_snapshot IS NULL AND t.table_name IN ({named})"
        ).fetchall()
        self._inlined |= {str(table) for table, has in rows if has}
        setting = sorted(str(table) for table, has in rows if not has)
        for table in setting:
            try:
                self.con.execute(
                    f"CALL {ALIAS}.set_option('data_inlining_row_limit', {WRITER_INLINED_ROWS}, "
                    f"table_name => {_literal(table)})"
                )
            except duckdb.CatalogException:  # made by another writer after this transaction began
                raise duckdb.TransactionException(
                    f"conflict: {ALIAS}.{table} is newer than this transaction"
                ) from None
        return set(setting)

    def _write_files(self, tables: Mapping[str, pa.Table]) -> list[tuple[str, Path]]:
        """Each table's rows as one Parquet file per partition value, written by the ledger (pyarrow,
        zstd, fsynced with its folder) where DuckLake would put them; the commit then adds them
        (``ducklake_add_data_files``). Why not ``INSERT``: DuckDB's writer never fsyncs a data file
        before the catalog's COMMIT names it (strace here), so a host crash after a commit could leave
        the catalog naming bytes that never reached the disk. (table, path) in write order."""
        from runledger.ledger.compaction import SORTED_TABLES
        from runledger.ledger.file_writes import write_all

        out: list[tuple[str, Path]] = []
        writes: list[Callable[[], None]] = []
        try:
            for name, table in sorted(tables.items()):
                if not table.num_rows:
                    continue
                column = _spec(name).partition
                folder = self._table_folder(name)
                # Sorted as the lake's merge will sort (``_file_layout``), split by partition in one pass.
                parts = _by_partition(_conformed(name, table), column, SORTED_TABLES.get(name, ()))
                for value, rows in parts:
                    path = folder / f"{column}={_path_value(value)}" / f"ducklake-{_uuid7()}.parquet"
                    out.append((name, path))
                    writes.append(functools.partial(_write_synced, rows, path, name))
            write_all(writes)
        except BaseException:
            _unlink(out)
            raise
        return out

    def _table_folder(self, name: str) -> Path:
        """Where DuckLake keeps ``name``'s files: the data path, its schema's folder, its own."""
        known = self._folders.get(name)
        if known is None:  # every table's at once (one query where a commit's first files asked one each)
            meta = f"__ducklake_metadata_{ALIAS}"
            rows = self.con.execute(
                f"SELECT t.table_name, s.path, s.path_is_relative, t.path, t.path_is_relative "
                f"FROM {meta}.ducklake_table t JOIN {meta}.ducklake_schema s "
                "ON s.schema_id = t.schema_id AND s.end_snapshot IS NULL WHERE t.end_snapshot IS NULL"
            ).fetchall()
            for table, schema_path, schema_rel, table_path, table_rel in rows:
                self._folders[table] = Path(
                    _joined(self.data_path, (schema_path, schema_rel), (table_path, table_rel))
                )
            if name not in self._folders:
                raise LakeError(f"no table {name!r} in the lake")
            known = self._folders[name]
        return known

    def _insert_by_engine(self, name: str, table: pa.Table) -> None:
        view = f"_lake_rows_{name}"
        self.con.register(view, table)
        try:
            self.con.execute(f"INSERT INTO {ALIAS}.{_quote(name)} BY NAME SELECT * FROM {_quote(view)}")
        finally:
            self.con.unregister(view)

    def _fence(self, positions: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """Inside the transaction: check each source's stored next position and move it. A racing
        copy that moves the same fence conflicts at COMMIT (both delete its one row). Each fence's
        position after this commit (every one this writer knows of) is returned."""
        if self.catalog.writers_take_turns:
            return self._fence_in_turn(positions)
        stale: dict[str, int] = {}
        for source, (expected, new) in sorted(positions.items()):
            table = f"{ALIAS}.{fence_table(source)}"
            exists = self._fence_exists(source)
            if exists:
                # The row is deleted only where it holds the expected position: one statement, where
                # reading it first cost a second scan (~10 ms a source on a DuckDB-file catalog).
                try:
                    deleted = one_row(
                        self.con.execute(f"DELETE FROM {table} WHERE next_position = ?", [expected])
                    )
                except duckdb.CatalogException:  # made by another writer after this transaction began
                    raise duckdb.TransactionException(
                        f"conflict: {table} is newer than this transaction"
                    ) from None
                if not deleted or int(deleted[0]) != 1:
                    stale[source] = self._fenced(source)
                    continue
            elif expected != 0:
                stale[source] = 0
                continue
            else:
                try:
                    self.con.execute(f"CREATE TABLE {table} (source VARCHAR, next_position BIGINT)")
                except duckdb.CatalogException:  # ("already exists": another writer's, made meanwhile)
                    raise duckdb.TransactionException(
                        f"conflict: {table} was made by another writer during this transaction"
                    ) from None
            self.con.execute(f"INSERT INTO {table} VALUES (?, ?)", [source, new])
        if stale:
            raise _Stale(stale)
        return {s: new for s, (_, new) in positions.items()}

    def _fence_in_turn(self, positions: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """``_fence`` on a SQLite catalog, where every writer's transaction holds the commit turn
        (``CommitTurns``) from BEGIN to COMMIT, so no two overlap and none can race: a fence is
        checked and then moved by adding a row (its position is its rows' largest, as ``_fenced``
        and every reader take it; a writer of an earlier version, deleting the row that holds the
        expected position, still finds exactly one). Its stored position is read only when the
        lake moved since this writer's last commit (another writer's snapshot, or maintenance):
        otherwise it is the one this writer left (reading a fence scans the catalog: ~15 ms CPU)."""
        known = self._unmoved_fences()
        stale: dict[str, int] = {}
        for source, (expected, _new) in sorted(positions.items()):
            if source in known:
                stored = known[source]
            elif self._fence_exists(source):
                stored = self._fenced(source)
            else:
                stored = 0
            if stored != expected:
                stale[source] = stored
        if stale:
            raise _Stale(stale)
        for source, (expected, new) in sorted(positions.items()):
            table = f"{ALIAS}.{fence_table(source)}"
            if expected == 0 and not self._fence_exists(source):
                self.con.execute(f"CREATE TABLE {table} (source VARCHAR, next_position BIGINT)")
            self.con.execute(f"INSERT INTO {table} VALUES (?, ?)", [source, new])
        return known | {s: new for s, (_, new) in positions.items()}

    def _unmoved_fences(self) -> dict[str, int]:
        """The fences as this writer's last commit left them, if no snapshot came after it (read
        live, in the commit turn: nothing can come after it until COMMIT); else none known."""
        if self._fences_at is None:
            return {}
        at, fences = self._fences_at
        row = one_row(
            self.con.execute(f"SELECT max(snapshot_id) FROM __ducklake_metadata_{ALIAS}.ducklake_snapshot")
        )
        return dict(fences) if row is not None and row[0] == at else {}

    def _fence_exists(self, source: str) -> bool:
        """Whether the source's fence table exists (once made, it stays: remembered)."""
        if source in self._fences:
            return True
        # The catalog's own table (~1 ms; ``duckdb_tables()`` took 40-120 ms). It is read live, so a
        # fence another writer made after this transaction began is found there but cannot be deleted
        # from here (``_fence`` turns that into a conflict: the commit is tried again); one not found
        # there is not in this transaction's older view either (a commit makes each fence once).
        found = one_row(
            self.con.execute(
                f"SELECT 1 FROM __ducklake_metadata_{ALIAS}.ducklake_table WHERE table_name = ? AND end_snapshot IS NULL",
                [fence_table(source)],
            )
        )
        if found:
            self._fences.add(source)
        return found is not None

    def _fenced(self, source: str) -> int:
        row = one_row(self.con.execute(f"SELECT max(next_position) FROM {ALIAS}.{fence_table(source)}"))
        return int(row[0]) if row and row[0] is not None else 0

    def fence_positions(self, sources: list[str]) -> dict[str, int]:
        """Each source's fenced next position as of now (0: never committed)."""
        self._rollback()
        return {s: self._fenced(s) if self._fence_exists(s) else 0 for s in sources}

    # ----------------------------------------------------------------- what a snapshot holds
    def current_snapshot(self) -> int:
        """The newest snapshot id (through a cursor: safe beside a commit in another thread)."""

        def ask() -> int:
            with contextlib.closing(self.con.cursor()) as cur:
                row = one_row(cur.execute(f"FROM {ALIAS}.current_snapshot()"))
            return int(row[0]) if row else 0

        return self._retry(ask)

    def added_files(self, snapshot: int) -> list[dict[str, Any]]:
        """The data files ``snapshot`` added to the ledger's tables, with their SHA-256 (the bytes
        DuckDB will read), sorted by table and path. One query of the catalog's own tables, which
        answers even when maintenance has expired the snapshot meanwhile (a ``maintain(keep_s)``
        shorter than a commit); a file merged and deleted by then has no SHA-256 (None)."""
        # partial_max: a file the lake's merge wrote keeps its oldest row's snapshot as its own and
        # names the newest it holds; a record synced after a merge must not claim it as its commit's.
        return self._data_files("f.begin_snapshot = ? AND f.partial_max IS NULL", [snapshot])

    def _file_rows(
        self, where: str, params: list[Any], con: duckdb.DuckDBPyConnection | None = None
    ) -> list[tuple[str, str, int, int]]:
        """(table, full path, rows, bytes) of the ledger tables' data files the catalog's
        ``ducklake_data_file`` rows ``where`` names, sorted by table and path."""
        meta = f"__ducklake_metadata_{ALIAS}"
        rows = (
            (con or self.con)
            .execute(
                f"SELECT t.table_name, s.path, s.path_is_relative, t.path, t.path_is_relative, f.path, "
                f"f.path_is_relative, f.record_count, f.file_size_bytes FROM {meta}.ducklake_data_file f "
                f"JOIN {meta}.ducklake_table t ON t.table_id = f.table_id AND t.end_snapshot IS NULL "
                f"JOIN {meta}.ducklake_schema s ON s.schema_id = t.schema_id AND s.end_snapshot IS NULL "
                f"WHERE {where}",
                params,
            )
            .fetchall()
        )
        out = [
            (table, _joined(self.data_path, (sp, s_rel), (tp, t_rel), (path, f_rel)), int(count), int(size))
            for table, sp, s_rel, tp, t_rel, path, f_rel, count, size in rows
            if table in TABLES or table in SIDE_TABLES  # not the writer's own (positions, state, fences)
        ]
        return sorted(out)

    def _data_files(
        self, where: str, params: list[Any], con: duckdb.DuckDBPyConnection | None = None
    ) -> list[dict[str, Any]]:
        """``_file_rows`` as records with the SHA-256 of each file's bytes now (None: deleted
        meanwhile). ``con``: a cursor of its own (maintenance runs beside a commit in another thread)."""
        con = con or self.con
        out: list[dict[str, Any]] = []
        for table, full, count, size in self._file_rows(where, params, con):
            if is_s3(full):
                sha256 = _s3_sha256(con, full)
            else:
                sha256 = _sha256(Path(full)) if "://" not in full and Path(full).is_file() else None
            out.append({"table": table, "path": full, "bytes": size, "rows": count, "sha256": sha256})
        return out

    def records_after(self, number: int) -> list[tuple[dict[str, Any], str, int]]:
        """The ledger commits numbered above ``number`` as (info, commit id, snapshot), in order:
        what a writer on another host (or one killed after its commit) has not seen yet."""

        def ask() -> list[tuple[dict[str, Any], str, int]]:
            with contextlib.closing(self.con.cursor()) as cur:
                # The catalog's newest snapshot (~1 ms) first: where this instance already knows that
                # no record above ``number`` existed at it, the lake has not moved since (a scan
                # of the records table through DuckLake: ~14 ms, before every commit).
                row = one_row(
                    cur.execute(f"SELECT max(snapshot_id) FROM __ducklake_metadata_{ALIAS}.ducklake_snapshot")
                )
                newest = int(row[0]) if row and row[0] is not None else None
                if newest is not None and self._records_seen == (number, newest):
                    return []
                rows = cur.execute(
                    # the row's own snapshot (a virtual column): a join with ``snapshots()`` left
                    # out every commit whose snapshot had expired (a host an hour behind, or any
                    # commit before a redaction), and the next opener found a gap
                    f"SELECT c.info, c.commit_id, c.snapshot_id FROM {ALIAS}.{COMMITS} c "
                    "WHERE c.ledger_commit > ? ORDER BY c.ledger_commit",
                    [number],
                ).fetchall()
            if not rows and newest is not None:
                self._records_seen = (number, newest)
            return [(json.loads(info), cid, int(snap)) for info, cid, snap in rows]

        return self._retry(ask)

    def positions(self, snapshot: int | None = None) -> dict[str, int]:
        if snapshot is None:  # one statement sees one snapshot: no pinned reader to open
            return self._retry(lambda: self._newest(read_positions))
        with self.reader(snapshot) as con:
            return read_positions(con)

    def state(self, snapshot: int | None = None) -> dict[str, Any]:
        if snapshot is None:
            return self._retry(lambda: self._newest(read_state))
        with self.reader(snapshot) as con:
            return read_state(con)

    def _newest(self, read: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        """``read`` on a cursor of the writer's instance (its own transaction: committed data only)."""
        with self.maintenance.shared(), contextlib.closing(self.con.cursor()) as cur:
            cur.execute(f"USE {ALIAS}")
            return read(cur)

    # ----------------------------------------------------------------- readers
    @contextlib.contextmanager
    def reader(self, snapshot: int | None = None) -> Iterator[LakeReader]:
        """A connection whose every table (``events``, ``metrics``... unqualified) is one snapshot:
        ``snapshot``, or the newest when the reader opens. Closed on leaving the block."""
        pinned = self.current_snapshot() if snapshot is None else snapshot
        con = self._retry(lambda: self._attach_reader(pinned))
        try:
            yield LakeReader(con, pinned, self)
        finally:
            con.close()

    def _attach_reader(self, snapshot: int) -> duckdb.DuckDBPyConnection:
        con = connect_data(self.catalog, self.data_path)
        try:
            con.execute(
                f"ATTACH {_literal(self.catalog.uri())} AS snap "
                f"(READ_ONLY, SNAPSHOT_VERSION {int(snapshot)}, DATA_PATH {_literal(self.data_path)}, "
                "OVERRIDE_DATA_PATH true)"
            )
            con.execute("USE snap")
        except BaseException:
            con.close()
            raise
        return con

    # ----------------------------------------------------------------- maintenance
    def maintain(self, *, keep_s: float = 3600.0) -> dict[str, int]:
        """DuckLake's own compaction and clean-up: merge adjacent small files, expire snapshots older
        than ``keep_s`` and delete the files no remaining snapshot needs. A reader pinned at a
        snapshot younger than ``keep_s`` answers the same during and after it. Runs on its own
        cursor, so a commit may run beside it in another thread."""
        erased = self.erase_deleted()  # a redaction killed after its commit: finished here
        older = self.catalog.cleanup_cutoff(keep_s)
        stats = self._merge_recorded("lake maintenance", lambda: self._maintain(older, keep_s))
        if stats is None:
            return {
                "files_before": 0,
                "files_after": 0,
                "files_merged": 0,
                "files_written": 0,
                "snapshots_expired": 0,
                "files_deleted": 0,
                "orphans_deleted": 0,
            }
        stats["files_erased"] = erased["files_erased"]
        return stats

    def merge_small_files(self) -> dict[str, int]:
        """DuckLake's merge of the files below ``SMALL_FILE_BYTES`` alone, a fraction of ``maintain``'s
        work (the reference run's: ~1 s against a full merge's up to 78 s): no expiry and no clean-up,
        so the files it replaced stay on disk, named by the snapshots before it, until the next
        ``maintain``. Its files are recorded with their SHA-256 as the full merge's are. Answers
        never change; a reader opens fewer files."""
        self.erase_deleted()  # (as ``maintain``: a merge never meets a file with deleted rows)

        def merge() -> dict[str, int]:
            with contextlib.closing(self.con.cursor()) as cur:
                merged = self._merge_files(cur, below_bytes=SMALL_FILE_BYTES)
            return {"files_merged": merged[0], "files_written": merged[1]}

        stats = self._merge_recorded("the merge of small files", merge)
        return stats if stats is not None else {"files_merged": 0, "files_written": 0}

    def _merge_recorded(self, what: str, work: Callable[[], dict[str, int]]) -> dict[str, int] | None:
        """``work`` (a merge) under the maintenance lock, then its files recorded (``_record_merged``);
        None when statements never paused for it (skipped: the next turn tries again)."""
        start = self.current_snapshot()
        first_file = self._retry(self._next_file_id)
        with self.maintenance.exclusive() as mine:
            if not mine:
                _log().warning("%s skipped: statements never paused for %.0f s", what, MAINTAIN_WAIT_S)
                return None
            stats = work()
        # After the lock (a commit takes it shared): the merge's files named with their SHA-256.
        stats["merged_recorded"] = self._record_merged(start, first_file)
        return stats

    def _merge_files(self, cur: duckdb.DuckDBPyConnection, below_bytes: int | None = None) -> tuple[int, int]:
        """DuckLake's merge of adjacent files (those below ``below_bytes``; None: below the target
        size), laid out as the ledger's, with every bound corrected before and after it: (files
        merged, files written)."""
        self._retry(lambda: self._file_layout(cur), con=cur)
        # The merge packs values into the narrowest type the bounds allow: wrong ones corrupt them.
        self._retry(lambda: self._correct_bounds(con=cur), con=cur)
        # (Not `SET threads = 1`, which halved the merge's memory again: it is global, and on a
        # DuckDB-file catalog it deadlocked against a commit running in another thread.)
        merged = self._retry(lambda: _merge(cur, below_bytes), on_conflict=True, con=cur)
        # (and after it: a merged file's text bounds are cut anew, a shorter prefix for its min)
        self._retry(lambda: self._correct_bounds(con=cur), con=cur)
        return merged

    def _file_layout(self, cur: duckdb.DuckDBPyConnection) -> None:
        """The lake's merged files laid out as the ledger's own merged parts, set once in the catalog
        (older lakes: here). Row groups of ``ROW_GROUP_ROWS``: a merge holds a row group in memory,
        and DuckDB's default (122,880 rows) of events, ~10 KB each with a router's expert counts, is
        over a GB. Sorted as ``SORTED_TABLES`` (a metric's rows together, in step order): a question
        about one metric reads its row groups only. Compressed with ``PARQUET_COMPRESSION``; files of
        ``TARGET_FILE_BYTES`` at most, once merged."""
        from runledger.ledger.compaction import SORTED_TABLES

        rows = cur.execute(
            f"SELECT option_name, value, scope_entry FROM {ALIAS}.options() "
            "WHERE option_name IN ('parquet_row_group_size', 'parquet_compression', 'target_file_size')"
        ).fetchall()
        have = {(name, (entry or "").removeprefix("main.")): value for name, value, entry in rows}
        for table, size in ROW_GROUP_ROWS.items():
            if have.get(("parquet_row_group_size", table)) != str(size):
                scope = f", table_name => '{table}'" if table else ""
                cur.execute(f"CALL {ALIAS}.set_option('parquet_row_group_size', {size}{scope})")
        if have.get(("parquet_compression", "")) != PARQUET_COMPRESSION:
            cur.execute(f"CALL {ALIAS}.set_option('parquet_compression', '{PARQUET_COMPRESSION}')")
        if have.get(("target_file_size", "")) != str(TARGET_FILE_BYTES):
            cur.execute(f"CALL {ALIAS}.set_option('target_file_size', '{TARGET_FILE_BYTES}B')")
        meta = f"__ducklake_metadata_{ALIAS}"
        sorted_now = {
            name
            for (name,) in cur.execute(
                f"SELECT t.table_name FROM {meta}.ducklake_sort_info i JOIN {meta}.ducklake_table t "
                "ON t.table_id = i.table_id AND t.end_snapshot IS NULL WHERE i.end_snapshot IS NULL"
            ).fetchall()
        }
        for table, keys in SORTED_TABLES.items():
            if table not in sorted_now:
                order = ", ".join(f"{_quote(k)} ASC NULLS LAST" for k in keys)
                cur.execute(f"ALTER TABLE {ALIAS}.{_quote(table)} SET SORTED BY ({order})")

    def _next_file_id(self) -> int:
        with contextlib.closing(self.con.cursor()) as cur:
            row = one_row(
                cur.execute(
                    f"SELECT coalesce(max(data_file_id), -1) + 1 FROM __ducklake_metadata_{ALIAS}.ducklake_data_file"
                )
            )
        return int(row[0]) if row else 0

    def _record_merged(self, after: int, first_file: int) -> int:
        """Name each data file the lake's merge wrote (ids from ``first_file`` on, not added by a
        ledger commit after snapshot ``after``, still live) with its SHA-256 in the lake's state
        (``merged:<file name>``, one commit), so ``verify`` checks merged files' bytes as it checks a
        commit's. A merged file keeps its oldest row's snapshot as its own, so it is found by id.
        Killed before this, verify says they are unrecorded."""
        where = (
            "f.data_file_id >= ? AND f.end_snapshot IS NULL AND f.begin_snapshot NOT IN "
            f"(SELECT snapshot_id FROM {ALIAS}.snapshots() WHERE snapshot_id > ? AND commit_message IS NOT NULL)"
        )
        with contextlib.closing(self.con.cursor()) as cur:  # not the writer's: a commit may run beside
            files = self._retry(lambda: self._data_files(where, [first_file, after], cur), con=cur)
            named = {MERGED_PREFIX + Path(f["path"]).name: f for f in files if f["sha256"]}
            if not named:
                return 0
            commit_id = uuid.uuid4().hex
            rows = [
                [key, json.dumps(value, sort_keys=True), commit_id] for key, value in sorted(named.items())
            ]

            def record() -> None:
                with self.turns.turn():
                    cur.execute("BEGIN")
                    try:
                        _insert_rows(cur, STATE, rows)
                        cur.execute(f"CALL {ALIAS}.set_commit_message(?, ?)", ["maintain", commit_id])
                        cur.execute("COMMIT")
                    except BaseException:
                        self._rollback(cur)
                        raise

            with self.maintenance.shared():
                self._retry(record, on_conflict=True, con=cur)
        return len(named)

    def erase_deleted(self) -> dict[str, int]:
        """Take deleted rows' bytes off the disk. A ledger commit never deletes a row of a ledger
        table: only ``ledger redact`` does (``commit``'s ``edits``), and DuckLake keeps deleted rows
        in their data files for every snapshot before: a file with some rows deleted stays live with
        a delete file, one with all deleted leaves the newest snapshot only. So each live file with
        deletions is rewritten without those rows (``ducklake_rewrite_data_files``), every snapshot
        that still names an old file is expired (time travel to them ends: they hold the erased
        bytes), the old files are deleted now, the tables' statistics are taken again and the
        catalog's storage compacted (``_compact_catalog``); the new files are named with their
        SHA-256 as merged files are. Idempotent: ``maintain`` calls it first, so a redaction killed
        after its commit is finished then."""
        meta = f"__ducklake_metadata_{ALIAS}"
        done = {"files_erased": 0, "snapshots_expired": 0, "files_recorded": 0}
        with contextlib.closing(self.con.cursor()) as cur:
            # A lake where no data file ever ended or took deletions has nothing to erase: one cheap
            # read of the catalog's own tables (the full search joins DuckLake's snapshots: ~40 ms).
            if not self._retry(lambda: _any_file_ended_or_deleted(cur), con=cur):
                self._vacuum_if_pending(cur)
                return done
            held = self._retry(lambda: _files_with_deletions(cur), con=cur)
            ended = self._retry(lambda: _files_ended_by_a_commit(cur), con=cur)
            if not held and not ended:
                self._vacuum_if_pending(cur)
                return done
            every = _ids(held + ended)
            old = {path for _, path, _, _ in self._file_rows(f"f.data_file_id IN ({every})", [], cur)}
            start = self.current_snapshot()
            first_file = self._retry(self._next_file_id)
            tables = sorted({table for table, _ in held + ended})
            with self.maintenance.exclusive() as mine:
                if not mine:
                    raise LakeError(
                        f"erasing deleted rows: statements never paused for {MAINTAIN_WAIT_S:.0f} s"
                    )
                for table in sorted({table for table, _ in held}):
                    rewrite = f"CALL ducklake_rewrite_data_files('{ALIAS}', {_literal(table)}, delete_threshold => 0)"
                    self._retry(_call(cur, rewrite), on_conflict=True, con=cur)
                live = cur.execute(
                    f"SELECT data_file_id FROM {meta}.ducklake_data_file "
                    f"WHERE data_file_id IN ({every}) AND end_snapshot IS NULL"
                ).fetchall()
                if live:
                    raise LakeError(f"the lake's rewrite left {len(live)} file(s) with deleted rows live")
                # The table-level min/max DuckLake keeps per column are only ever widened: the
                # erased value may be one. Each text column's is taken again from the live files'
                # (before the expiry: a kill after it would leave nothing to find this by).
                self._retry(lambda: _restat_text_columns(cur, tables), on_conflict=True, con=cur)
                versions = cur.execute(
                    f"SELECT s.snapshot_id FROM {ALIAS}.snapshots() s WHERE EXISTS (SELECT 1 FROM "
                    f"{meta}.ducklake_data_file f WHERE f.data_file_id IN ({every}) "
                    "AND s.snapshot_id >= f.begin_snapshot AND s.snapshot_id < f.end_snapshot) ORDER BY 1"
                ).fetchall()
                if versions:
                    listed = ", ".join(str(int(v)) for (v,) in versions)
                    expire = f"CALL ducklake_expire_snapshots('{ALIAS}', versions => [{listed}])"
                    self._retry(_call(cur, expire), on_conflict=True, con=cur)
                # Every file scheduled for deletion goes now (DuckLake deletes no single file): the
                # old ones, and those a maintenance turn kept for readers pinned within keep_s.
                cleanup = f"CALL ducklake_cleanup_old_files('{ALIAS}', cleanup_all => true)"
                self._retry(_call(cur, cleanup), con=cur)
                self._retry(lambda: self._compact_catalog(cur), con=cur)
        left = sorted(p for p in old if "://" not in p and Path(p).exists())
        if left:
            raise LakeError(f"erased rows are still on disk in {left[0]} (and {len(left) - 1} more)")
        done["files_erased"] = len(old)
        done["snapshots_expired"] = len(versions)
        done["files_recorded"] = self._record_merged(start, first_file)
        _log().info(
            "lake: erased deleted rows from %d file(s), expiring %d snapshot(s)", len(old), len(versions)
        )
        return done

    def _vacuum_if_pending(self, cur: duckdb.DuckDBPyConnection) -> None:
        """The catalog's storage compacted again where an erasure's last try could not
        (``VACUUM_OPTION``: a reader held it), when statements pause for it."""
        if not self._retry(lambda: _has_option(cur, VACUUM_OPTION), con=cur):
            return
        with self.maintenance.exclusive() as mine:
            if mine:
                self._compact_catalog(cur)

    def _compact_catalog(self, cur: duckdb.DuckDBPyConnection) -> None:
        """Rewrite a server's or SQLite file's storage so rows the catalog deleted leave it, not only
        its tables (a deleted file's column statistics hold values of its rows): a SQLite file is
        vacuumed (its WAL checkpointed before and after), PostgreSQL's statistics tables rewritten
        by ``VACUUM FULL``. What a server keeps elsewhere (PostgreSQL's WAL and backups) is its
        operator's to expire. Each waits ``VACUUM_BUSY_S`` at most for a reader's hold; then a
        LakeError, and ``VACUUM_OPTION`` stays set for the next writer or maintenance."""
        self._keep_option(VACUUM_OPTION, "1")
        self.catalog.compact_storage(cur)
        self._retry(lambda: self._drop_option(VACUUM_OPTION))

    def _maintain(self, older: str, keep_s: float) -> dict[str, int]:
        with contextlib.closing(self.con.cursor()) as cur:
            before = _file_count(cur)

            def call(sql: str) -> int:
                return len(cur.execute(sql).fetchall())

            merged = self._merge_files(cur)
            expired = self._retry(lambda: _expire(cur, keep_s), on_conflict=True, con=cur)
            cleaned = self._retry(
                lambda: call(f"CALL ducklake_cleanup_old_files('{ALIAS}', older_than => {older})"), con=cur
            )
            # Files no snapshot names: a killed commit's (written before its transaction). Only old
            # ones: a writer on another host may be about to add a file it has just written.
            orphan_age_s = max(float(keep_s), ORPHAN_MIN_AGE_S)
            orphans = self._retry(
                lambda: call(
                    f"CALL ducklake_delete_orphaned_files('{ALIAS}', "
                    f"older_than => now() - to_seconds({orphan_age_s}))"
                ),
                con=cur,
            )
            after = _file_count(cur)
        if orphans:
            _log().info(
                "lake maintenance deleted %d orphaned data files (older than %.0f s)", orphans, orphan_age_s
            )
        return {
            "files_before": before,
            "files_after": after,
            "files_merged": merged[0],
            "files_written": merged[1],
            "snapshots_expired": expired,
            "files_deleted": cleaned,
            "orphans_deleted": orphans,
        }


class LakeReader:
    """A pinned snapshot's connection. ``execute`` retries "database is locked" (a SQLite catalog is
    read on every statement, and a writer may hold it); the rest is the DuckDB connection's."""

    def __init__(self, con: duckdb.DuckDBPyConnection, snapshot: int, lake: LakeTables) -> None:
        self.con = con
        self.snapshot = snapshot
        self._lake = lake

    def execute(self, sql: str, params: object = None) -> duckdb.DuckDBPyConnection:
        with self._lake.maintenance.shared():
            return self._lake._retry(lambda: self.con.execute(sql, params), con=self.con)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.con, name)


Queryable = duckdb.DuckDBPyConnection | LakeReader


def _insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[list[Any]]) -> None:
    """``rows`` into a writer table in ONE statement: DuckLake writes a data file per INSERT, so
    ``executemany`` left a file per row (a commit's positions and stream heads: a file each)."""
    if not rows:
        return
    width = len(rows[0])
    values = ", ".join(["(" + ", ".join(["?"] * width) + ")"] * len(rows))
    con.execute(f"INSERT INTO {ALIAS}.{table} VALUES {values}", [v for row in rows for v in row])


def _merge(con: duckdb.DuckDBPyConnection, below_bytes: int | None = None) -> tuple[int, int]:
    """DuckLake's merge of adjacent files (those below ``below_bytes``; None: below the lake's target
    file size): (files it merged, files it wrote in their place)."""
    below = "" if below_bytes is None else f", max_file_size => {int(below_bytes)}"
    # (CALL: the same function read in a SELECT answered its counts and merged nothing that stayed)
    rows = con.execute(f"CALL ducklake_merge_adjacent_files('{ALIAS}'{below})").fetchall()
    return sum(int(row[2]) for row in rows), sum(int(row[3]) for row in rows)


def _expire(con: duckdb.DuckDBPyConnection, keep_s: float) -> int:
    """Expire the snapshots older than ``keep_s`` (never the newest), named by id: DuckLake 1.5.5's
    ``older_than`` on a SQLite catalog compares the stored times as text and expired snapshots
    seconds old (seen here), so the times are compared in DuckDB instead."""
    rows = con.execute(
        f"SELECT snapshot_id FROM {ALIAS}.snapshots() WHERE snapshot_time < now() - to_seconds(?) "
        f"AND snapshot_id < (SELECT max(snapshot_id) FROM {ALIAS}.snapshots()) ORDER BY 1",
        [float(keep_s)],
    ).fetchall()
    if not rows:
        return 0
    versions = ", ".join(str(int(r[0])) for r in rows)
    return len(con.execute(f"CALL ducklake_expire_snapshots('{ALIAS}', versions => [{versions}])").fetchall())


def _files_with_deletions(con: duckdb.DuckDBPyConnection) -> list[tuple[str, int]]:
    """(table, data file id) of each live data file of a ledger table that carries deletions (the
    writer's own tables, whose fences delete a row every commit, are not ledger tables)."""
    meta = f"__ducklake_metadata_{ALIAS}"
    rows = con.execute(
        f"SELECT DISTINCT t.table_name, f.data_file_id FROM {meta}.ducklake_delete_file d "
        f"JOIN {meta}.ducklake_data_file f ON f.data_file_id = d.data_file_id AND f.end_snapshot IS NULL "
        f"JOIN {meta}.ducklake_table t ON t.table_id = f.table_id AND t.end_snapshot IS NULL "
        "WHERE d.end_snapshot IS NULL ORDER BY 1, 2"
    ).fetchall()
    return [(str(t), int(i)) for t, i in rows if t in TABLES or t in SIDE_TABLES]


def _has_option(con: duckdb.DuckDBPyConnection, key: str) -> bool:
    """Whether the catalog's own ``ducklake_metadata`` has a row ``key`` (``LakeTables._keep_option``)."""
    meta = f"__ducklake_metadata_{ALIAS}"
    return one_row(con.execute(f"SELECT 1 FROM {meta}.ducklake_metadata WHERE key = ?", [key])) is not None


def _any_file_ended_or_deleted(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether any data file of the lake (any table's) ever left a snapshot or took a delete file:
    a superset of what ``erase_deleted`` looks for, read from the catalog's own tables."""
    meta = f"__ducklake_metadata_{ALIAS}"
    row = one_row(
        con.execute(
            f"SELECT EXISTS (SELECT 1 FROM {meta}.ducklake_data_file WHERE end_snapshot IS NOT NULL) "
            f"OR EXISTS (SELECT 1 FROM {meta}.ducklake_delete_file)"
        )
    )
    return bool(row and row[0])


def _restat_text_columns(con: duckdb.DuckDBPyConnection, tables: list[str]) -> None:
    """Each text column's table-level min/max (``ducklake_table_column_stats``) as the live data
    files' statistics give them: DuckLake widens them on insert and never narrows them on delete."""
    meta = f"__ducklake_metadata_{ALIAS}"
    live = (
        f"FROM {meta}.ducklake_file_column_stats f JOIN {meta}.ducklake_data_file d "
        "ON d.data_file_id = f.data_file_id AND d.end_snapshot IS NULL "
        "WHERE f.table_id = s.table_id AND f.column_id = s.column_id"
    )
    named = ", ".join(_literal(t) for t in tables)
    con.execute(
        f"UPDATE {meta}.ducklake_table_column_stats AS s SET "
        f"min_value = (SELECT min(f.min_value) {live}), max_value = (SELECT max(f.max_value) {live}) "
        f"WHERE s.table_id IN (SELECT table_id FROM {meta}.ducklake_table WHERE end_snapshot IS NULL "
        f"AND table_name IN ({named})) AND EXISTS (SELECT 1 FROM {meta}.ducklake_column c "
        "WHERE c.table_id = s.table_id AND c.column_id = s.column_id AND c.end_snapshot IS NULL "
        "AND lower(c.column_type) = 'varchar')"
    )


def _files_ended_by_a_commit(con: duckdb.DuckDBPyConnection) -> list[tuple[str, int]]:
    """(table, data file id) of each ledger-table file out of the newest snapshot that held rows a
    commit deleted, and that an older snapshot still names: all its rows deleted by a commit (a
    commit only adds files; maintenance, which also ends files, names no snapshot of its own), or
    rewritten without its deleted rows (it has a delete file)."""
    meta = f"__ducklake_metadata_{ALIAS}"
    rows = con.execute(
        f"SELECT t.table_name, f.data_file_id FROM {meta}.ducklake_data_file f "
        f"JOIN {meta}.ducklake_table t ON t.table_id = f.table_id AND t.end_snapshot IS NULL "
        f"LEFT JOIN {ALIAS}.snapshots() s ON s.snapshot_id = f.end_snapshot "
        "WHERE f.end_snapshot IS NOT NULL AND (s.commit_message IS NOT NULL OR EXISTS (SELECT 1 FROM "
        f"{meta}.ducklake_delete_file d WHERE d.data_file_id = f.data_file_id)) ORDER BY 1, 2"
    ).fetchall()
    return [(str(t), int(i)) for t, i in rows if t in TABLES or t in SIDE_TABLES]


def _call(con: duckdb.DuckDBPyConnection, sql: str) -> Callable[[], list[Any]]:
    """A statement to retry (``LakeTables._retry``), its rows fetched."""
    return lambda: con.execute(sql).fetchall()


def _ids(held: list[tuple[str, int]]) -> str:
    return ", ".join(str(i) for _, i in held)


def _file_count(con: duckdb.DuckDBPyConnection) -> int:
    """Data files in the newest snapshot (every table, the writer's own included)."""
    row = one_row(
        con.execute(
            f"SELECT count(*) FROM __ducklake_metadata_{ALIAS}.ducklake_data_file WHERE end_snapshot IS NULL"
        )
    )
    return int(row[0]) if row else 0


def read_positions(con: Queryable) -> dict[str, int]:
    """Each source's next position in a pinned reader (positions only move forward)."""
    rows = con.execute(
        f"SELECT source, max(next_position) FROM {POSITIONS} WHERE source NOT LIKE ? "
        "GROUP BY source ORDER BY source",
        [_PSEUDO_SOURCES],
    ).fetchall()
    return {s: int(n) for s, n in rows}


def read_state(con: Queryable) -> dict[str, Any]:
    """Each state key's newest value in a pinned reader. Newest: the highest row id, as DuckLake
    assigns row ids at commit in commit order and keeps them through compaction."""
    rows = con.execute(f"SELECT key, arg_max(value, rowid) FROM {STATE} GROUP BY key ORDER BY key").fetchall()
    return {k: json.loads(v) for k, v in rows}
