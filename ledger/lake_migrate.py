"""``ledger migrate OLD NEW``: a ledger of part files (the format before DuckLake) into a DuckLake.

The old ledger is read as plain files, never through ``Ledger``: its ``LEDGER.json`` (ledger id,
tables), its commit records (``_commits/``: positions, stream heads, admission state) and its Parquet
files (every ``*.parquet`` under a table's partition folders, as the old readers read them). So it
keeps working after the part-file writer, its compaction and its recovery are gone. A newest commit
whose writer died after its commit point is read as its recovery would have finished it (its
``removed`` files left out, its ``files`` read from their ``.tmp`` names), without touching OLD.

Each ledger commit becomes one lake commit (``LakeTables.commit``) with the same rows, the positions
it moved and its state (the stream heads it moved, the admission state). Compaction commits move no
row: their lake commit holds only the record. A compacted or redacted ledger no longer has each
commit's own part files, so rows are assigned to commits by their origin: ``events`` and
``quarantine`` carry ``commit``; every other table's row carries the (stream, stream_seq) of the event
it was projected from. A redaction's rewritten rows stay at their first commit (erased there too).

Everything is read and checked before the first lake commit: a damaged ledger (a missing commit
record, a missing or unreadable Parquet file, rows of no commit) is one ``MigrateError`` line and the
lake is left without commits. After the commits it checks: every table's rows identical (count and
an order-independent digest of every column), positions identical, and every stream head (size and
Merkle tree) identical; only then does NEW get its ``LAKE.json`` and the signed checkpoints.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from runledger.ledger.duck import connect, one_row
from runledger.ledger.lake import (
    COMMIT_FENCE,
    EMBEDDED_CATALOG,
    ID_FENCE,
    ID_KEY,
    LAKE_MARKER,
    Catalog,
    LakeError,
    LakeFolder,
    LakeTables,
    Queryable,
    first_line,
    lake_schema,
    read_positions,
    read_state,
)
from runledger.ledger.parquet_schemas import SALTS, TABLES, tables_of
from runledger.ledger.projectors import FoldState, RowBuffer, rows_for_event
from runledger.ledger.records import COMMITS, commit_record_paths
from runledger.ledger.redaction import REDACTED_PREFIX
from runledger.ledger.stream_checkpoints import CHECKPOINTS
from runledger.schemas import catalogue as c
from runledger.schemas.codec import Event, decode_event
from runledger.schemas.durable import disk_full

__all__ = ["MigrateError", "Migration", "OldLedger", "migrate", "migrate_into", "read_old", "table_digests"]

TAG = "__ledger_commit"  # the column that carries each row's ledger commit while migrating
OLD_MARKER = "LEDGER.json"  # a ledger of part files
OLD_FORMAT = "runledger-ledger"
COMPACT_WRITER = "compact"  # the old writer's compaction commits: records only, no row of their own
INCIDENTS = "ingest_incidents"  # a table no old ledger has: derived from its events (issue 42)


class MigrateError(RuntimeError):
    """The migration cannot start, or its result differs from the old ledger."""


@dataclass
class Migration:
    commits: int = 0  # ledger commits written as lake commits with rows
    skipped: int = 0  # compaction commits (no rows)
    rows: int = 0
    snapshots: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class OldLedger:
    """A ledger of part files as its files say: read once, checked whole, never written."""

    root: Path
    ledger_id: str
    tables: list[str]  # the tables it keeps complete (LEDGER.json's list)
    records: list[dict[str, Any]]  # every commit record, numbers 0..n in order
    files: dict[str, list[Path]]  # table (and salts) -> its live Parquet files

    @property
    def newest(self) -> dict[str, Any]:
        return self.records[-1]

    def positions(self) -> dict[str, int]:
        return {s: p for s, p in self.newest["positions"].items() if p}

    def stream_heads(self) -> dict[str, Any]:
        """Stream -> its head as the records hold it (``{"size", "tree"}``)."""
        return dict(self.newest.get("streams", {}))


def stream_key(stream: str) -> str:
    return f"stream:{stream}"


def _columns(name: str) -> str:
    return ", ".join(f'"{c}"' for c in lake_schema(name).names)


# ----------------------------------------------------------------- reading the old ledger
def read_old(root: Path) -> OldLedger:
    """The ledger of part files at ``root``, or a one-line ``MigrateError`` saying why it is none."""
    marker = root / OLD_MARKER
    if not marker.exists():
        if (root / LAKE_MARKER).exists():
            raise MigrateError(f"{root} is a ledger on DuckLake already: nothing to migrate")
        raise MigrateError(f"no ledger at {root} (no {OLD_MARKER})")
    meta = _json_file(marker)
    if meta.get("format") != OLD_FORMAT:
        raise MigrateError(f"{marker}: not a runledger ledger (format {meta.get('format')!r})")
    records = _commit_records(root)
    tables = tables_of(root)
    files = {name: _live_files(root, name, records) for name in [*tables, SALTS.name]}
    return OldLedger(root, str(meta.get("id") or "ledger"), tables, records, files)


def _json_file(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise MigrateError(f"{path}: unreadable ({str(exc).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise MigrateError(f"{path}: not a JSON object")
    return obj


def _commit_records(root: Path) -> list[dict[str, Any]]:
    """Every commit record, checked to be numbered 0, 1, ... with none missing."""
    paths = commit_record_paths(root)
    if not paths:
        raise MigrateError(f"{root / COMMITS}: no commit records (an empty or damaged ledger)")
    records: list[dict[str, Any]] = []
    for expected, path in enumerate(paths):
        if not path.stem.isdigit() or int(path.stem) != expected:
            raise MigrateError(
                f"{root / COMMITS}: commit record {expected:010d}.json is missing (found {path.name}): "
                "the ledger is damaged"
            )
        record = _json_file(path)
        if record.get("commit") != expected or not isinstance(record.get("positions"), dict):
            raise MigrateError(f"{path}: not the record of commit {expected}")
        records.append(record)
    return records


def _named_files(records: list[dict[str, Any]]) -> set[str]:
    """The files the records say are live at the end: each commit's ``files`` added, its ``removed``
    taken away (a compaction or a redaction replaces files), in commit order."""
    live: set[str] = set()
    for record in records:
        live -= set(record.get("removed", []))
        live |= set(record.get("files", []))
    return live


def _live_files(root: Path, name: str, records: list[dict[str, Any]]) -> list[Path]:
    """The table's files as a reader after the old writer's recovery sees them: every part file,
    less what the newest commit removed, plus what it named that is still under its .tmp name.
    A file a record names as live that is not there: the ledger is damaged."""
    newest = records[-1]
    removed = {root / rel for rel in newest.get("removed", [])}
    found = {p for p in (root / name).glob("*=*/*.parquet") if p not in removed}
    unfinished = set(newest.get("files", []))
    for rel in sorted(_named_files(records)):
        final = root / rel
        if Path(rel).parts[0] != name or final in found:
            continue
        tmp = final.with_name(final.name + ".tmp")
        if rel not in unfinished or not tmp.exists():
            raise MigrateError(f"{final}: a committed part file is missing: the ledger is damaged")
        found.add(tmp)
    return sorted(found)


# ----------------------------------------------------------------- staging its rows
def _old_view(con: duckdb.DuckDBPyConnection, old: OldLedger, name: str) -> bool:
    """``old_<name>``: the table's live files, partition column as text (as ledger readers see it)."""
    files = old.files.get(name, [])
    if not files:
        return False
    listed = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"
    # A .tmp file (an unfinished rename) does not sit in its partition's name: the partition column
    # comes from the folder, which hive_partitioning reads from the path either way.
    scan = (
        f"read_parquet({listed}, hive_partitioning = true, hive_types_autocast = false, union_by_name = true)"
    )
    # A column added to the table since the old files were written (``max_load``) is NULL in them,
    # typed as the lake stores it, so the digests of old and new rows compare like with like.
    stored = {str(row[0]) for row in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()}
    columns = ", ".join(
        f'"{c}"' if c in stored else f'CAST(NULL AS {kind}) AS "{c}"' for c, kind in _lake_types(con, name)
    )
    con.execute(f'CREATE OR REPLACE VIEW "old_{name}" AS SELECT {columns} FROM {scan}')
    return True


def _lake_types(con: duckdb.DuckDBPyConnection, name: str) -> list[tuple[str, str]]:
    """(column, DuckDB type) of the table as the lake stores it (``lake_schema``), in its order."""
    empty = lake_schema(name).empty_table()
    con.register("_lake_schema", empty)
    try:
        return [(str(r[0]), str(r[1])) for r in con.execute("DESCRIBE SELECT * FROM _lake_schema").fetchall()]
    finally:
        con.unregister("_lake_schema")


def _tagged(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """``tag_<name>``: its rows with the ledger commit each came from."""
    if "commit" in lake_schema(name).names:
        select = f'SELECT *, "commit" AS {TAG} FROM "old_{name}"'
    else:
        select = (
            f'SELECT t.*, e."commit" AS {TAG} FROM "old_{name}" t '
            'LEFT JOIN (SELECT stream, stream_seq, "commit" FROM old_events) e '
            "ON t.stream = e.stream AND t.stream_seq = e.stream_seq"
        )
    con.execute(f'CREATE TEMP TABLE "tag_{name}" AS {select} ORDER BY {TAG}')


def _untagged(con: duckdb.DuckDBPyConnection, name: str, numbers: set[int]) -> str | None:
    """Why some of the table's rows belong to no commit that holds rows (None: every row does)."""
    rows = con.execute(
        f'SELECT {TAG}, count(*) FROM "tag_{name}" GROUP BY {TAG} ORDER BY {TAG} NULLS FIRST'
    ).fetchall()
    for commit, count in rows:
        if commit is None:
            return f"{name}: {count} row(s) of no stored event (the ledger is damaged)"
        if int(commit) not in numbers:
            return f"{name}: {count} row(s) of commit {commit}, which has no commit record (the ledger is damaged)"
    return None


def _stage(con: duckdb.DuckDBPyConnection, old: OldLedger) -> list[str]:
    """Every table's rows read into the connection, each tagged with its commit; the tables present.
    Everything OLD holds is read here, before anything is written: a damaged file fails now."""
    present: list[str] = []
    try:
        present = [n for n in [*old.tables, SALTS.name] if _old_view(con, old, n)]
        if "events" not in present:
            raise MigrateError(f"{old.root}: no events files")
        if INCIDENTS not in old.tables and _derived_incidents(con):
            present.append(INCIDENTS)
        for name in ["events", *[n for n in present if n != "events"]]:
            _tagged(con, name)
    except duckdb.Error as exc:
        raise MigrateError(f"{old.root}: a Parquet file is unreadable ({first_line(exc)})") from None
    holding = {r["commit"] for r in old.records if r.get("writer") != COMPACT_WRITER}
    for name in present:
        problem = _untagged(con, name, holding)
        if problem is not None:
            raise MigrateError(problem)
    return present


def _derived_incidents(con: duckdb.DuckDBPyConnection) -> bool:
    """``old_ingest_incidents``: the typed incident rows (issue 42) the old ledger was made without,
    projected from its ``ledger.incident`` events as a commit projects them (redacted ones have none);
    False when it has no incident, so no rows to migrate."""
    # Projected by the projectors themselves, so ``verify`` finds exactly what a commit would write.
    found = con.execute(
        "SELECT canonical, stream_seq FROM old_events WHERE type = ? AND NOT starts_with(canonical, ?) "
        "ORDER BY stream, stream_seq",
        [c.LEDGER_INCIDENT, REDACTED_PREFIX],
    ).fetchall()
    buf, fold = RowBuffer(), FoldState()
    for canonical, stream_seq in found:
        event = decode_event(canonical.encode())
        if not isinstance(event, Event):
            raise MigrateError(f"{event.reason}: an incident event of the old ledger does not decode")
        rows_for_event(event, int(stream_seq), buf, fold)
    parts = [
        data.append_column("run_id", pa.repeat(pa.scalar(partition or "_", pa.string()), data.num_rows))
        for table, partition, data in buf.tables()
        if table == INCIDENTS
    ]
    if not parts:
        return False
    con.register("_derived_incidents", pa.concat_tables(parts).cast(lake_schema(INCIDENTS)))
    con.execute(f'CREATE OR REPLACE TEMP TABLE "old_{INCIDENTS}" AS SELECT * FROM _derived_incidents')
    con.unregister("_derived_incidents")
    return True


# ----------------------------------------------------------------- writing the lake
def _state_moved(record: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    prior = before or {"streams": {}, "admission": None}
    state = {
        stream_key(s): head
        for s, head in record.get("streams", {}).items()
        if prior["streams"].get(s) != head
    }
    if record.get("admission") is not None and record.get("admission") != prior.get("admission"):
        state["admission"] = record["admission"]
    return state


def _refuse_used(lake: LakeTables, folder: Path | None) -> None:
    """MigrateError unless ``lake`` holds no commit and ``folder`` nothing but that lake's own files."""
    if folder is not None:
        for marker in (LAKE_MARKER, OLD_MARKER):
            if (folder / marker).exists():
                raise MigrateError(f"{folder} is a ledger already ({marker}): migrate into a new folder")
        stray = _foreign_entry(folder, lake)
        if stray is not None:
            raise MigrateError(f"{folder} is not empty ({stray.name}): migrate into a new folder")
    if lake.positions() or lake.state().get(ID_KEY) is not None:
        raise MigrateError("the new lake already holds commits: migrate into an empty one")


def _foreign_entry(folder: Path, lake: LakeTables) -> Path | None:
    """The first entry of ``folder`` that is not the lake's catalog (and its lock and journal files)
    or its still empty data folder."""
    if not folder.is_dir():
        return None
    catalog = lake.catalog.file
    data = Path(lake.data_path) if "://" not in lake.data_path else None
    for entry in sorted(folder.iterdir()):
        beside_catalog = catalog is not None and entry.parent.resolve() == catalog.parent.resolve()
        if catalog is not None and beside_catalog and entry.name.startswith(catalog.name):
            continue
        if data is not None and entry.resolve() == data.resolve() and not any(entry.rglob("*.parquet")):
            continue
        return entry
    return None


def migrate(old_root: Path, lake: LakeTables, folder: Path | None = None) -> Migration:
    """Write every commit of the ledger at ``old_root`` into ``lake`` (an empty one), then check. With
    ``folder``: when nothing differs, it becomes the new ledger's folder (``LAKE.json`` and the old
    ledger's signed checkpoints), which ``Ledger`` and ``Reader`` open as any ledger on a lake."""
    old = read_old(old_root)
    _refuse_used(lake, folder)
    con = connect()
    try:
        present = _stage(con, old)
        result = _write_commits(con, old, lake, present)
        result.mismatches = check(con, old, lake, present)
    finally:
        con.close()
    if folder is not None and not result.mismatches:
        _copy_checkpoints(old.root, folder)
        # The tables the lake keeps complete: the old ledger's, and the incidents derived from its events.
        kept = tuple(name for name in TABLES if name in old.tables or name == INCIDENTS)
        LakeFolder(folder, lake.catalog.spec, lake.data_path, old.ledger_id, kept).write()
    return result


def _write_commits(
    con: duckdb.DuckDBPyConnection, old: OldLedger, lake: LakeTables, present: list[str]
) -> Migration:
    """The lake's naming commit, then one lake commit per ledger commit, in order."""
    result = Migration()
    named = lake.commit({}, {ID_FENCE: (0, 1)}, {ID_KEY: old.ledger_id}, writer="migrate")
    if not named.ok:
        raise MigrateError("the new lake already names a ledger: migrate into an empty one")
    before: dict[str, Any] | None = None
    for record in old.records:
        number = record["commit"]
        # A compaction moved no row: its lake commit holds only the record (the numbers stay dense,
        # so a writer opening the lake follows every record).
        compaction = record.get("writer") == COMPACT_WRITER
        tables = {} if compaction else {n: _rows_of(con, n, number) for n in present}
        tables = {n: t for n, t in tables.items() if t.num_rows}
        prior = (before or {}).get("positions", {})
        moved = {s: (prior.get(s, 0), p) for s, p in record["positions"].items() if prior.get(s, 0) != p}
        moved[COMMIT_FENCE] = (number, number + 1)
        done = lake.commit(
            tables,
            moved,
            _state_moved(record, before),
            writer=record.get("writer", ""),
            info={"ledger_commit": number, "time": record.get("time"), "record": record},
            number=number,
        )
        if not done.ok:
            raise MigrateError(f"commit {number}: the lake refused it (stale {done.stale})")
        before = record
        if compaction:
            result.skipped += 1
            continue
        result.commits += 1
        result.rows += done.rows
        assert done.snapshot is not None
        result.snapshots.append(done.snapshot)
    return result


def _rows_of(con: duckdb.DuckDBPyConnection, name: str, commit: int) -> pa.Table:
    table = con.execute(
        f'SELECT {_columns(name)} FROM "tag_{name}" WHERE {TAG} = ?', [commit]
    ).to_arrow_table()
    return table.cast(lake_schema(name))


def _copy_checkpoints(old_root: Path, folder: Path) -> None:
    """The old ledger's signed checkpoints (each stream's latest and every one signed): ``verify``
    checks the lake against them, since the ledger id (their origin) and every tree are the same."""
    signed = old_root / CHECKPOINTS
    if signed.is_dir():
        shutil.copytree(signed, folder / CHECKPOINTS, dirs_exist_ok=True)


# ----------------------------------------------------------------- checking
def table_digests(con: Queryable, relation: str, name: str) -> tuple[int, int]:
    """(rows, sum of every row's hash): order-independent, and a repeated row counts twice."""
    row = one_row(
        con.execute(
            f"SELECT count(*), coalesce(sum(hash(t)::HUGEINT), 0) FROM (SELECT {_columns(name)} FROM {relation}) t"
        )
    )
    assert row is not None
    return int(row[0]), int(row[1])


def check(con: duckdb.DuckDBPyConnection, old: OldLedger, lake: LakeTables, present: list[str]) -> list[str]:
    """What differs between the old ledger and the lake's newest snapshot (empty: nothing)."""
    problems: list[str] = []
    with lake.reader() as new:
        for name in present:
            old_digest = table_digests(con, f'"old_{name}"', name)
            new_digest = table_digests(new, f'"{name}"', name)
            if old_digest != new_digest:
                problems.append(
                    f"{name}: {old_digest[0]} rows before, {new_digest[0]} after, or their digests differ"
                )
        if read_positions(new) != old.positions():
            problems.append("positions differ")
        state = read_state(new)
    for stream, head in old.stream_heads().items():
        if state.get(stream_key(stream)) != head:
            problems.append(f"stream {stream}: head differs")
    return problems


# ----------------------------------------------------------------- a whole migration, or nothing
def migrate_into(old_root: Path, new: Path, catalog: str | None = None) -> Migration:
    """``ledger migrate OLD NEW``: OLD checked and read first, then NEW made (default catalog: SQLite
    in NEW, data in NEW/data) and filled. When anything fails, or the result differs, NEW is removed
    if this call made it, so nothing half-made is left claiming to be a ledger; a catalog outside NEW
    (PostgreSQL) keeps what was committed, and is refused as not empty by a second try."""
    read_old(old_root)  # before NEW is made: a folder that is no ledger leaves nothing behind
    if new.exists() and not new.is_dir():
        raise MigrateError(f"{new} is a file, not a folder: migrate into a new folder")
    for marker in (LAKE_MARKER, OLD_MARKER):
        if (new / marker).exists():
            raise MigrateError(f"{new} is a ledger already ({marker}): migrate into a new folder")
    held = sorted(new.iterdir()) if new.exists() else []
    if held:
        raise MigrateError(f"{new} is not empty ({held[0].name}): migrate into a new folder")
    made = not new.exists()
    spec = catalog or f"sqlite:{new / EMBEDDED_CATALOG}"
    try:
        Catalog.parse(spec)
        with LakeTables(spec, new / "data") as lake:
            done = migrate(old_root, lake, new)
        if done.mismatches:
            raise MigrateError(f"migrated, but the lake differs: {'; '.join(done.mismatches)}")
    except (LakeError, duckdb.Error) as exc:
        _remove_made(new, made)
        # (a full disk kept behind it: the command's line names the place and what to do)
        raise MigrateError(first_line(exc)) from (exc if disk_full(exc) else None)
    except BaseException:
        _remove_made(new, made)
        raise
    return done


def _remove_made(new: Path, made: bool) -> None:
    """What a failed ``migrate_into`` made in NEW, gone: the folder, or what it put in an empty one."""
    if made:
        shutil.rmtree(new, ignore_errors=True)
    elif new.is_dir():  # an empty folder given: empty again
        for entry in list(new.iterdir()):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
