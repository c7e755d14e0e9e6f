"""Each lake table's column bounds kept covering its data files (a DuckLake 1.5.5 bug, worked around).

DuckDB trusts a DuckLake table's column bounds (``ducklake_table_column_stats``): it drops filters
they rule out, answers from them and packs values into the narrowest type they allow. DuckLake 1.5.5
leaves a column's bounds empty when a table's first commit adds several files and the first of them
holds the column all NULL; the next commit then sets them to its own rows' bounds alone. Found by the
verify property test: metrics of two runs in one first commit (one run's rows without a step), then
a step-1 commit: ``max(step)`` answered 1 over rows up to 183,998, ``WHERE step > 100`` answered
nothing, and ``ducklake_merge_adjacent_files`` stored step 183,998 as 190 (183,997 mod 256, plus 1).

The writer sets the bounds to those of the table's live files (which DuckLake records right) after
a commit that could have met the bug, and once when it opens a lake (a crash between a commit and
this; a lake written before it). Each write is a compare-and-set on the bounds it read, so a commit
landing in between (which only ever extends them) is read again, never overwritten.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runledger.ledger.parquet_schemas import SIDE_TABLES, TABLES

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

# DuckLake's column types whose bounds are compared as DuckDB values (BLOB, nested types: not set;
# a list's or struct's own fields are columns of their own, set by their type).
_DUCKDB_TYPES = {
    "int8": "TINYINT",
    "int16": "SMALLINT",
    "int32": "INTEGER",
    "int64": "BIGINT",
    "uint8": "UTINYINT",
    "uint16": "USMALLINT",
    "uint32": "UINTEGER",
    "uint64": "UBIGINT",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "varchar": "VARCHAR",
    "boolean": "BOOLEAN",
    "date": "DATE",
    "timestamp": "TIMESTAMP",
    "timestamptz": "TIMESTAMPTZ",
}
# The ledger's tables: rows only ever added by commits (and taken by a redaction). Not the writer's
# own: their fences delete rows every commit, which DuckLake's bounds never shrink for (nothing asks
# them a bound), and on SQLite their rows are inlined in the catalog, where files hold no bounds.
LEDGER_TABLES = frozenset(TABLES) | frozenset(SIDE_TABLES)
_CAS_TRIES = 5  # a compare-and-set that lost to another writer's commit reads the bounds again


@dataclass(frozen=True)
class BoundsFix:
    """One column's bounds as stored (``old_*``) and as its live files hold them (``new_*``)."""

    table: str
    table_id: int
    column_id: int
    old_min: str | None
    old_max: str | None
    new_min: str | None
    new_max: str | None


def _meta(alias: str) -> str:
    return f"__ducklake_metadata_{alias}"


def _names(tables: Collection[str]) -> str:
    return ", ".join("'" + name.replace("'", "''") + "'" for name in sorted(tables))


def tables_at_risk(con: duckdb.DuckDBPyConnection, alias: str, rows: Mapping[str, pa.Table]) -> set[str]:
    """Of the tables this commit adds ``rows`` to, those whose bounds it could leave short (read in
    its transaction, before the COMMIT): a table without bounds yet (its first commit) and one with
    a column that has no bounds (every row NULL so far) that this commit gives a value. A list's
    bounds are its element's (the list itself has none): given when the commit has a list there."""
    touched = {name for name, table in rows.items() if table.num_rows}
    if not touched:
        return set()
    meta = _meta(alias)
    found = con.execute(
        f"SELECT t.table_name, c.column_id, c.column_name, c.parent_column, c.column_type, "
        f"s.table_id IS NULL OR s.min_value IS NULL FROM {meta}.ducklake_table t "
        f"JOIN {meta}.ducklake_column c ON c.table_id = t.table_id AND c.end_snapshot IS NULL "
        f"LEFT JOIN {meta}.ducklake_table_column_stats s ON s.table_id = t.table_id AND s.column_id = c.column_id "
        f"WHERE t.end_snapshot IS NULL AND t.table_name IN ({_names(touched)})"
    ).fetchall()
    columns = {(str(t), int(i)): (str(n), p) for t, i, n, p, _, _ in found}

    def top_level(table: str, column_id: int) -> str:
        name, parent = columns[(table, column_id)]
        for _ in range(len(columns)):  # (a catalog naming a loop of parents: bounded)
            if parent is None or (table, int(parent)) not in columns:
                break
            name, parent = columns[(table, int(parent))]
        return name

    at_risk = set()
    for table, column_id, _, _, kind, empty in found:
        if not empty or kind not in _DUCKDB_TYPES or str(table) in at_risk:
            continue
        data, name = rows[str(table)], top_level(str(table), int(column_id))
        if name in data.column_names and data.column(name).null_count < data.num_rows:
            at_risk.add(str(table))
    return at_risk


def wrong_bounds(
    con: duckdb.DuckDBPyConnection, alias: str, tables: Collection[str] = LEDGER_TABLES
) -> list[BoundsFix]:
    """Every column (of ``tables``, default the ledger's) whose stored bounds are not the bounds of
    its table's live files, with the bounds that are. DuckDB takes them as exact (``max(step)`` is
    answered from them), so they are set to what the files hold, no wider. Each new bound is one of
    the strings DuckLake wrote for a file, chosen by comparing them as values of the column's type."""
    if not tables:
        return []
    meta = _meta(alias)
    where = f" AND t.table_name IN ({_names(tables)})"
    known = ", ".join(f"'{name}'" for name in _DUCKDB_TYPES)
    # The catalog's three tables are read once (MATERIALIZED: a SQLite or PostgreSQL catalog is
    # scanned whole by every reference), then each type's columns compared as that type.
    per_type = []
    for lake_type, sql_type in _DUCKDB_TYPES.items():
        lo, hi = f"TRY_CAST(b.lo AS {sql_type})", f"TRY_CAST(b.hi AS {sql_type})"
        usable_lo, usable_hi = f"{lo} IS NOT NULL", f"{hi} IS NOT NULL"
        if sql_type in ("FLOAT", "DOUBLE"):  # NaN is DuckLake's contains_nan, never a bound
            usable_lo += f" AND NOT isnan({lo})"
            usable_hi += f" AND NOT isnan({hi})"
        bounds = f"(SELECT * FROM b WHERE column_type = '{lake_type}')"
        if sql_type == "VARCHAR":
            # A long text's bounds are a prefix (min) and a prefix made larger (max), cut anew by
            # each file and merge: never exact, so only widened, as DuckLake's own commits do.
            bounds = (
                "(SELECT * FROM b WHERE column_type = 'varchar' UNION ALL SELECT table_id, column_id, "
                "min_value, max_value, column_type FROM stored WHERE column_type = 'varchar')"
            )
        per_type.append(
            f"SELECT s.table_name, s.table_id, s.column_id, s.min_value, s.max_value, f.lo, f.hi "
            f"FROM (SELECT * FROM stored WHERE column_type = '{lake_type}') s LEFT JOIN "
            f"(SELECT b.table_id, b.column_id, arg_min(b.lo, {lo}) FILTER ({usable_lo}) AS lo, "
            f"arg_max(b.hi, {hi}) FILTER ({usable_hi}) AS hi FROM {bounds} b "
            f"GROUP BY ALL) f USING (table_id, column_id) "
            f"WHERE TRY_CAST(f.lo AS {sql_type}) IS DISTINCT FROM TRY_CAST(s.min_value AS {sql_type}) "
            f"OR TRY_CAST(f.hi AS {sql_type}) IS DISTINCT FROM TRY_CAST(s.max_value AS {sql_type})"
        )
    rows = con.execute(
        f"WITH cols AS MATERIALIZED (SELECT t.table_id, t.table_name, c.column_id, c.column_type "
        f"FROM {meta}.ducklake_table t "
        f"JOIN {meta}.ducklake_column c ON c.table_id = t.table_id AND c.end_snapshot IS NULL "
        f"WHERE t.end_snapshot IS NULL AND c.column_type IN ({known}){where} "
        # (rows inlined in the catalog have no file stats: their table's bounds are DuckLake's)
        f"AND t.table_id NOT IN (SELECT table_id FROM {meta}.ducklake_inlined_data_tables)), "
        f"stored AS MATERIALIZED (SELECT s.table_id, s.column_id, s.min_value, s.max_value, "
        f"cols.table_name, cols.column_type "
        f"FROM {meta}.ducklake_table_column_stats s JOIN cols USING (table_id, column_id)), "
        f"b AS MATERIALIZED (SELECT fs.table_id, fs.column_id, fs.min_value AS lo, fs.max_value AS hi, "
        f"cols.column_type FROM {meta}.ducklake_file_column_stats fs "
        f"JOIN {meta}.ducklake_data_file f ON f.data_file_id = fs.data_file_id AND f.end_snapshot IS NULL "
        f"JOIN cols ON cols.table_id = fs.table_id AND cols.column_id = fs.column_id) "
        + " UNION ALL ".join(per_type)
    ).fetchall()
    return [
        BoundsFix(str(name), int(table_id), int(column_id), old_min, old_max, new_min, new_max)
        for name, table_id, column_id, old_min, old_max, new_min, new_max in rows
    ]


def correct_bounds(
    con: duckdb.DuckDBPyConnection, alias: str, tables: Collection[str] = LEDGER_TABLES
) -> int:
    """Set the bounds of ``tables`` (default the ledger's) that are not their live files' to theirs; the
    number of columns set. Each write sets the bounds only where they are still those read; one that
    another commit changed first is read again (bounded)."""
    from runledger.ledger.duck import one_row

    corrected = 0
    for _ in range(_CAS_TRIES):
        lost = False
        for w in wrong_bounds(con, alias, tables):
            row = one_row(
                con.execute(
                    f"UPDATE {_meta(alias)}.ducklake_table_column_stats SET min_value = ?, max_value = ? "
                    "WHERE table_id = ? AND column_id = ? "
                    "AND min_value IS NOT DISTINCT FROM ? AND max_value IS NOT DISTINCT FROM ?",
                    [w.new_min, w.new_max, w.table_id, w.column_id, w.old_min, w.old_max],
                )
            )
            if row and int(row[0]) == 1:
                corrected += 1
            else:
                lost = True
        if not lost:
            return corrected
    return corrected
