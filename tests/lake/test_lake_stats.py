"""A lake table's column bounds cover its data on every catalog (``runledger.ledger.lake_stats``).

DuckLake 1.5.5 left ``metrics.step`` without bounds when a table's first commit held one run's
rows without a step before another's with step 183,998; the next commit (step 1) set them to [1, 1]:
``max(step)`` answered 1, ``step > 100`` nothing, and the lake's merge stored 183,998 as 190. Found
by the verify property test in a fresh-clone CI; here as a fixed case, through the ledger's own
commit, query, compaction and verify, on a SQLite and a PostgreSQL catalog."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from runledger.ledger.integrity import verify_ledger
from runledger.ledger.lake import ALIAS, BOUNDS_OPTION, LakeFolder, LakeTables
from runledger.ledger.lake_stats import correct_bounds, tables_at_risk, wrong_bounds
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import config_hash, encode_event, make_event
from runledger.schemas import payloads as p
from tests.lake.conftest import Backend

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _metrics(run: str, step: int | None, seq: int) -> bytes:
    event = make_event(
        p.StepMetrics(tokens=238, step_time_s=1.5),
        source=f"trainer/{run}",
        seq=seq,
        time=T0,
        stream=run,
        run_id=run,
        attempt=1,
        id=f"{run}-{seq}",
        step=step,
    )
    return encode_event(event)


def _start(run: str) -> bytes:
    config = {"lr": 0.1}
    payload = p.RunStarted(config=config, config_hash=config_hash(config))
    return encode_event(
        make_event(
            payload, source=f"trainer/{run}", seq=0, time=T0, stream=run, run_id=run, attempt=1, id=f"{run}-0"
        )
    )


def _ledger(backend: Backend, root: Path) -> Ledger:
    ledger = Ledger.create_on_lake(root, backend.catalog, backend.data)
    # One commit, two runs: run "a" (first by partition) reports no step, run "b" step 183,998.
    first = [_start("a"), _metrics("a", None, 1), _start("b"), _metrics("b", 183_998, 1)]
    ledger.commit([SourceRecord("spool:x", i, raw) for i, raw in enumerate(first)])
    ledger.commit([SourceRecord("spool:x", 4, _metrics("b", 1, 2))])
    return ledger


def _answers(root: Path) -> tuple[object, object]:
    """What DuckDB answers from the lake attached as DuckLake (as any DuckDB user attaches it): the
    table's bounds are trusted there; the ledger's own readers read each file by its own footer."""
    folder = LakeFolder.read(root)
    assert folder is not None
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False, create=False) as lake:
        top = lake.con.execute(f"SELECT max(step) FROM {ALIAS}.metrics").fetchone()
        above = lake.con.execute(f"SELECT count(*) FROM {ALIAS}.metrics WHERE step > 100").fetchone()
    assert top is not None and above is not None
    return top[0], above[0]


def _steps(root: Path) -> list[int]:
    reader = Reader(root)
    try:
        rows = reader.sql("SELECT DISTINCT step FROM metrics WHERE step IS NOT NULL ORDER BY 1").rows
    finally:
        reader.close()
    return [row[0] for row in rows]


def test_a_first_commit_with_an_all_null_file_first_keeps_true_answers(
    backend: Backend, tmp_path: Path
) -> None:
    root = tmp_path / "l"
    _ledger(backend, root).close()
    assert _answers(root) == (183_998, 2)  # tokens and step_time_s of step 183,998
    folder = LakeFolder.read(root)
    assert folder is not None
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:
        assert wrong_bounds(lake.con, ALIAS) == []
        assert lake.maintain(keep_s=0)["files_merged"] > 0
    # The lake's merge packs values into the narrowest type the bounds allow: 183,998 stays itself.
    assert _steps(root) == [1, 183_998]
    assert _answers(root) == (183_998, 2)
    assert verify_ledger(root).ok


def _break_step_bounds(lake: LakeTables) -> None:
    """``metrics.step``'s bounds as DuckLake 1.5.5 left them: the second commit's alone."""
    meta = f"__ducklake_metadata_{ALIAS}"
    lake.con.execute(
        f"UPDATE {meta}.ducklake_table_column_stats SET min_value = '1', max_value = '1' "
        f"WHERE (table_id, column_id) IN (SELECT t.table_id, c.column_id FROM {meta}.ducklake_table t "
        f"JOIN {meta}.ducklake_column c USING (table_id) WHERE t.table_name = 'metrics' "
        "AND c.column_name = 'step' AND t.end_snapshot IS NULL AND c.end_snapshot IS NULL)"
    )


@pytest.mark.parametrize("old_lake", [True, False], ids=["written-before-the-fix", "checked"])
def test_short_bounds_are_found_and_set_before_a_merge_and_once_on_an_older_lake(
    backend: Backend, tmp_path: Path, old_lake: bool
) -> None:
    """Short bounds (as a lake written before this fix may hold them) are found; a lake never
    checked is checked when a writer first opens it; ``ledger compact`` checks before it merges."""
    root = tmp_path / "l"
    _ledger(backend, root).close()
    folder = LakeFolder.read(root)
    assert folder is not None
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:
        _break_step_bounds(lake)
        short = wrong_bounds(lake.con, ALIAS)
        assert [(w.table, w.old_min, w.old_max, w.new_min, w.new_max) for w in short] == [
            ("metrics", "1", "1", "1", "183998")
        ]
        if old_lake:
            meta = f"__ducklake_metadata_{ALIAS}"
            lake.con.execute(f"DELETE FROM {meta}.ducklake_metadata WHERE key = ?", [BOUNDS_OPTION])
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:  # a writer opens it
        assert len(wrong_bounds(lake.con, ALIAS)) == (0 if old_lake else 1)
    assert _answers(root) == ((183_998, 2) if old_lake else (1, 0))  # (1, 0): DuckDB trusts the bounds
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:
        assert lake.maintain(keep_s=0)["files_merged"] > 0
        assert wrong_bounds(lake.con, ALIAS) == []
    assert _steps(root) == [1, 183_998]
    assert _answers(root) == (183_998, 2)
    assert verify_ledger(root).ok


def test_bounds_wider_than_the_files_are_set_back_to_theirs(backend: Backend, tmp_path: Path) -> None:
    """DuckDB answers ``max(step)`` from the bounds themselves: wider ones are as wrong as short ones."""
    root = tmp_path / "l"
    _ledger(backend, root).close()
    folder = LakeFolder.read(root)
    assert folder is not None
    meta = f"__ducklake_metadata_{ALIAS}"
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:
        lake.con.execute(
            f"UPDATE {meta}.ducklake_table_column_stats SET min_value = '-5', max_value = '999999' "
            f"WHERE (table_id, column_id) IN (SELECT t.table_id, c.column_id FROM {meta}.ducklake_table t "
            f"JOIN {meta}.ducklake_column c USING (table_id) WHERE t.table_name = 'metrics' "
            "AND c.column_name = 'step' AND t.end_snapshot IS NULL AND c.end_snapshot IS NULL)"
        )
        assert _answers(root) == (999_999, 2)
        assert correct_bounds(lake.con, ALIAS) == 1
        assert wrong_bounds(lake.con, ALIAS) == []
    assert _answers(root) == (183_998, 2)


def test_the_lakes_merge_keeps_values_its_bounds_were_set_to_cover(backend: Backend, tmp_path: Path) -> None:
    """DuckLake 1.5.5 itself, on a table of its own in the ledger's catalog: bounds left short by a
    first commit (a NULL file, then 183,998) and a second (1) make its merge store 183,998 as 190;
    the same table with its bounds set first keeps it. (The day the first half fails, DuckLake no
    longer has the bug and ``lake_stats`` may go.)"""
    root = tmp_path / "l"
    _ledger(backend, root).close()
    folder = LakeFolder.read(root)
    assert folder is not None
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:
        con = lake.con
        for table in ("left_short", "set_right"):
            con.execute(f"CREATE TABLE {ALIAS}.{table} (step BIGINT, name VARCHAR)")
            con.execute(f"ALTER TABLE {ALIAS}.{table} SET SORTED BY (name, step)")
            con.execute("BEGIN")
            con.execute(f"INSERT INTO {ALIAS}.{table} VALUES (NULL, 'a')")
            con.execute(f"INSERT INTO {ALIAS}.{table} VALUES (183998, 'b')")
            con.execute("COMMIT")
            con.execute(f"INSERT INTO {ALIAS}.{table} VALUES (1, 'c')")
        assert correct_bounds(con, ALIAS, {"set_right"}) == 1
        con.execute(f"CALL ducklake_merge_adjacent_files('{ALIAS}')")
        steps = {
            table: con.execute(f"SELECT step FROM {ALIAS}.{table} WHERE name = 'b'").fetchall()
            for table in ("left_short", "set_right")
        }
    assert steps == {"left_short": [(190,)], "set_right": [(183_998,)]}


def test_a_commit_is_at_risk_only_where_it_gives_a_value_to_a_column_without_bounds(
    backend: Backend, tmp_path: Path
) -> None:
    """The question each commit asks: a list column (whose bounds are its element's) or a bounded
    column given values is no risk; a column all NULL so far (``events.subject`` here) given one is."""
    root = tmp_path / "l"
    ledger = _ledger(backend, root)
    note = make_event(
        p.Annotation(author="me", text="hi", tags=["a"]), source="t", seq=0, time=T0, stream="n", id="n1"
    )
    ledger.commit([SourceRecord("spool:x", 5, encode_event(note))])
    ledger.close()
    folder = LakeFolder.read(root)
    assert folder is not None
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:

        def at_risk(**columns: dict[str, list[object]]) -> set[str]:
            return tables_at_risk(lake.con, ALIAS, {name: pa.table(cols) for name, cols in columns.items()})

        assert at_risk(annotations={"tags": [["b"]], "text": ["x"]}, metrics={"step": [5]}) == set()
        assert at_risk(events={"subject": [None], "stream": ["r"]}) == set()
        assert at_risk(events={"subject": ["pull/1"]}) == {"events"}
        assert at_risk(run_ends={"status": ["ok"]}) == {"run_ends"}  # no rows yet: its first commit
