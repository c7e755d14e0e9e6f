"""A SQLite lake's cheaper commit (issue 39): the writer's own tables keep their rows in the catalog
and a fence moves by adding a row, read back only when the lake moved since this writer's commit.
The guarantees stay: a writer whose source another writer moved gets ``stale`` and nothing lands."""

from __future__ import annotations

from pathlib import Path

from runledger.ledger.lake import ALIAS, COMMITS, POSITIONS, STATE, LakeTables, fence_table
from tests.lake.support import batch

META = f"__ducklake_metadata_{ALIAS}"


def _lake(folder: Path) -> LakeTables:
    return LakeTables(f"sqlite:{folder / 'catalog.sqlite'}", folder / "data")


def _live_files(lake: LakeTables, table: str) -> int:
    row = lake.con.execute(
        f"SELECT count(*) FROM {META}.ducklake_data_file f JOIN {META}.ducklake_table t "
        "ON t.table_id = f.table_id AND t.end_snapshot IS NULL WHERE t.table_name = ? AND f.end_snapshot IS NULL",
        [table],
    ).fetchone()
    return int(row[0]) if row else 0


def test_writer_tables_add_no_data_file_after_the_first_commit(tmp_path: Path) -> None:
    with _lake(tmp_path) as lake:
        for n in range(4):
            done = lake.commit(batch("s", 10 * n, 10, n), {"s": (10 * n, 10 * n + 10)}, {f"k{n}": n})
            assert done.ok
        writer_tables = [POSITIONS, STATE, fence_table("s")]
        files = {t: _live_files(lake, t) for t in writer_tables}
        for n in range(4, 8):
            assert lake.commit(batch("s", 10 * n, 10, n), {"s": (10 * n, 10 * n + 10)}, {f"k{n}": n}).ok
        assert {t: _live_files(lake, t) for t in writer_tables} == files
        assert lake.positions() == {"s": 80}
        assert lake.state() == {f"k{n}": n for n in range(8)}
        assert lake.fence_positions(["s"]) == {"s": 80}
        with lake.reader() as reader:
            counted = reader.execute("SELECT count(*) FROM events").fetchone()
        assert counted == (80,)


def test_a_source_moved_by_another_writer_is_stale_and_lands_nothing(tmp_path: Path) -> None:
    with _lake(tmp_path) as first, _lake(tmp_path) as second:
        assert first.commit(batch("s", 0, 5, 0), {"s": (0, 5)}, {}).ok
        assert second.commit(batch("s", 5, 5, 1), {"s": (5, 10)}, {}).ok
        # ``first`` last left the fence at 5: the lake moved since, so it reads the fence again.
        late = first.commit(batch("s", 5, 5, 2), {"s": (5, 10)}, {})
        assert not late.ok and late.stale == {"s": 10}
        assert first.commit(batch("s", 10, 5, 3), {"s": (10, 15)}, {}).ok
        # and ``second``, which knew 10, finds the fence moved on to 15
        assert second.commit(batch("s", 10, 5, 4), {"s": (10, 15)}, {}).stale == {"s": 15}
        with first.reader() as reader:
            rows = reader.execute('SELECT stream_seq, "commit" FROM events ORDER BY 1').fetchall()
        assert rows == [(s, 0) for s in range(5)] + [(s, 1) for s in range(5, 10)] + [
            (s, 3) for s in range(10, 15)
        ]
        assert first.positions() == {"s": 15}


def test_a_stale_first_commit_of_a_new_source_lands_nothing(tmp_path: Path) -> None:
    with _lake(tmp_path) as lake:
        done = lake.commit(batch("s", 3, 2, 0), {"s": (3, 5)}, {})
        assert not done.ok and done.stale == {"s": 0}
        assert lake.positions() == {}
        assert lake.commit(batch("s", 0, 5, 1), {"s": (0, 5)}, {}).ok
        assert lake.positions() == {"s": 5}


def _tables_touched(lake: LakeTables, snapshot: int) -> list[str]:
    """The tables a snapshot wrote, by name, from the catalog's own change list."""
    row = lake.con.execute(
        f"SELECT changes_made FROM {META}.ducklake_snapshot_changes WHERE snapshot_id = ?", [snapshot]
    ).fetchone()
    assert row is not None
    ids = [int(change.split(":")[1]) for change in str(row[0]).split(",") if "insert" in change]
    named = dict(
        lake.con.execute(
            f"SELECT table_id, table_name FROM {META}.ducklake_table WHERE end_snapshot IS NULL"
        ).fetchall()
    )
    return sorted(named[i] for i in ids)


def test_a_commit_writes_only_the_tables_it_holds_rows_for(tmp_path: Path) -> None:
    """DuckLake's COMMIT costs ~10 ms CPU a table written (SQLite catalog, docs/notes/one_format.md): a
    commit writes its data tables, its record and the writer's own tables it moves, never the others,
    and the 12th commit no more than the 2nd."""
    with _lake(tmp_path) as lake:
        touched = []
        for n in range(12):
            done = lake.commit(batch("s", 10 * n, 10, n), {"s": (10 * n, 10 * n + 10)}, {f"k{n}": n})
            assert done.ok and done.snapshot is not None
            touched.append(_tables_touched(lake, done.snapshot))
        expected = sorted(["events", "metrics", COMMITS, POSITIONS, STATE, fence_table("s")])
        assert touched[1] == touched[11] == expected
        # A commit that moves a source and holds no rows writes no data table.
        empty = lake.commit({}, {"s": (120, 121)}, {})
        assert empty.ok and empty.snapshot is not None
        assert _tables_touched(lake, empty.snapshot) == sorted([COMMITS, POSITIONS, fence_table("s")])
