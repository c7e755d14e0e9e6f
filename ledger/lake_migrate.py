"""``ledger migrate OLD NEW``: a ledger of today's format (part files + ``_commits/``) into a DuckLake.

Each ledger commit becomes one lake commit (``LakeTables.commit``) with the same rows, the positions
it moved and its state (the stream heads it moved, the admission state). Compaction commits move no
row and are skipped. A compacted ledger no longer has each commit's own part files, so rows are
assigned to commits by their origin: ``events`` and ``quarantine`` carry ``commit``; every other
table's row carries the (stream, stream_seq) of the event it was projected from.

Then it checks: every table's rows identical (count and an order-independent digest of every
column), positions identical, and every stream head (size and Merkle tree) identical.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from ledger.duck import connect
from ledger.lake import (
    COMMIT_FENCE,
    ID_FENCE,
    ID_KEY,
    LakeFolder,
    LakeTables,
    Queryable,
    lake_schema,
    read_positions,
    read_state,
)
from ledger.parquet_schemas import SALTS, tables_of
from ledger.store import COMMITS, Ledger

__all__ = ["MigrateError", "Migration", "migrate", "table_digests"]

TAG = "__ledger_commit"  # the column that carries each row's ledger commit while migrating


class MigrateError(RuntimeError):
    """The migration cannot start, or its result differs from the old ledger."""


@dataclass
class Migration:
    commits: int = 0  # ledger commits written as lake commits
    skipped: int = 0  # compaction commits (no rows)
    rows: int = 0
    snapshots: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def stream_key(stream: str) -> str:
    return f"stream:{stream}"


def _columns(name: str) -> str:
    return ", ".join(f'"{c}"' for c in lake_schema(name).names)


def _old_view(con: duckdb.DuckDBPyConnection, root: Path, name: str) -> bool:
    """``old_<name>``: the table's live files, partition column as text (as ledger readers see it)."""
    files = sorted((root / name).glob("*=*/*.parquet"))
    if not files:
        return False
    listed = "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in files) + "]"
    con.execute(
        f'CREATE OR REPLACE VIEW "old_{name}" AS SELECT {_columns(name)} FROM read_parquet({listed}, '
        "hive_partitioning = true, hive_types_autocast = false, union_by_name = true)"
    )
    return True


def _tagged(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """``tag_<name>``: its rows with the ledger commit each came from."""
    if "commit" in lake_schema(name).names:
        select = f'SELECT *, "commit" AS {TAG} FROM "old_{name}"'
    else:
        select = (
            f'SELECT t.*, e."commit" AS {TAG} FROM "old_{name}" t '
            'JOIN (SELECT stream, stream_seq, "commit" FROM old_events) e '
            "ON t.stream = e.stream AND t.stream_seq = e.stream_seq"
        )
    con.execute(f'CREATE TEMP TABLE "tag_{name}" AS {select} ORDER BY {TAG}')


def _records(root: Path) -> Iterator[dict[str, Any]]:
    for path in sorted((root / COMMITS).glob("*.json")):
        yield json.loads(path.read_bytes())


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


def migrate(old: Path, lake: LakeTables, folder: Path | None = None) -> Migration:
    """Write every commit of the ledger at ``old`` into ``lake`` (an empty one), then check. With
    ``folder``: when nothing differs, it becomes the new ledger's folder (``LAKE.json``), which
    ``Reader`` and the read commands open as they open a ledger of part files."""
    ledger = Ledger.open(old)  # LedgerError when it is none
    if lake.positions():
        raise MigrateError("the new lake already holds commits: migrate into an empty one")
    names = tables_of(old)
    con = connect()
    present = [n for n in [*names, SALTS.name] if _old_view(con, old, n)]
    if "events" not in present:
        raise MigrateError(f"{old}: no events files")
    for name in present:
        _tagged(con, name)
    result = Migration()
    named = lake.commit({}, {ID_FENCE: (0, 1)}, {ID_KEY: ledger.ledger_id}, writer="migrate")
    if not named.ok:
        raise MigrateError("the new lake already names a ledger: migrate into an empty one")
    before: dict[str, Any] | None = None
    for record in _records(old):
        number = record["commit"]
        # A compaction moved no row: its lake commit holds only the record (the numbers stay dense,
        # so a writer opening the lake follows every record).
        compaction = record.get("writer") == "compact" or bool(record.get("removed"))
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
    result.mismatches = check(con, ledger, lake, present)
    con.close()
    if folder is not None and not result.mismatches:
        LakeFolder(folder, lake.catalog.spec, lake.data_path, ledger.ledger_id, tuple(names)).write()
    return result


def _rows_of(con: duckdb.DuckDBPyConnection, name: str, commit: int) -> pa.Table:
    table = con.execute(
        f'SELECT {_columns(name)} FROM "tag_{name}" WHERE {TAG} = ?', [commit]
    ).to_arrow_table()
    return table.cast(lake_schema(name))


def table_digests(con: Queryable, relation: str, name: str) -> tuple[int, int]:
    """(rows, sum of every row's hash): order-independent, and a repeated row counts twice."""
    row = con.execute(
        f"SELECT count(*), coalesce(sum(hash(t)::HUGEINT), 0) FROM (SELECT {_columns(name)} FROM {relation}) t"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def check(con: duckdb.DuckDBPyConnection, ledger: Ledger, lake: LakeTables, present: list[str]) -> list[str]:
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
        if read_positions(new) != {s: p for s, p in ledger.positions().items() if p}:
            problems.append("positions differ")
        state = read_state(new)
    for stream, head in ledger.stream_heads().items():
        if state.get(stream_key(stream)) != head.to_json():
            problems.append(f"stream {stream}: head differs")
    return problems
