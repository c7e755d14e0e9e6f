"""LakeTables on every catalog backend: atomic multi-table commits, fenced positions, SIGKILLed
writers, racing and parallel writers, one snapshot per reader, maintenance under a pinned reader."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runledger.ledger.lake import (
    ORPHAN_MIN_AGE_S,
    LakeError,
    LakeReader,
    LakeTables,
    fence_table,
    with_lock_timeout,
)
from tests.lake.conftest import Backend
from tests.lake.support import batch, spawn

ROWS = 50


def _count(con: LakeReader, sql: str) -> int:
    row = con.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def _per_commit(lake: LakeTables) -> dict[int, tuple[int, int]]:
    """commit tag -> (events rows, metrics rows) in the newest snapshot."""
    with lake.reader() as con:
        events = dict(con.execute('SELECT "commit", count(*) FROM events GROUP BY 1').fetchall())
        metrics = dict(con.execute("SELECT attempt, count(*) FROM metrics GROUP BY 1").fetchall())
    return {k: (events.get(k, 0), metrics.get(k, 0)) for k in set(events) | set(metrics)}


def test_a_commit_lands_every_table_at_once_or_nothing(backend: Backend) -> None:
    with LakeTables(backend.catalog, backend.data) as lake:
        first = lake.commit(batch("s", 0, ROWS, 0), {"s": (0, ROWS)}, {"head": {"size": ROWS}})
        assert first.ok and first.rows == 2 * ROWS
        assert {f["table"] for f in first.files} == {"events", "metrics"}
        assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in first.files)
        # The second table's rows cannot be stored: the events already inserted must not land either.
        broken = batch("s", ROWS, ROWS, 1)
        broken["metrics"] = pa.table({"no_such_column": [1]})
        with pytest.raises(LakeError, match="table metrics has no column no_such_column"):
            lake.commit(broken, {"s": (ROWS, 2 * ROWS)}, {"head": {"size": 2 * ROWS}})
        assert _per_commit(lake) == {0: (ROWS, ROWS)}
        assert lake.positions() == {"s": ROWS}
        assert lake.state() == {"head": {"size": ROWS}}
        assert lake.commit(batch("s", ROWS, ROWS, 1), {"s": (ROWS, 2 * ROWS)}, {}).ok  # the writer goes on
        with lake.reader(first.snapshot) as con:
            assert _count(con, "SELECT count(*) FROM events") == ROWS


def test_every_data_file_is_fsynced_before_the_commit_names_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DuckDB's Parquet writer does not fsync: a commit on a local folder writes and fsyncs its own
    files (and their folders) before COMMIT, so a host crash after it loses no acknowledged row."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    with LakeTables(backend.catalog, backend.data) as lake:
        monkeypatch.setattr("runledger.ledger.lake.os.fsync", fsync)
        done = lake.commit(batch("s", 0, ROWS, 0), {"s": (0, ROWS)}, {})
        monkeypatch.undo()
    assert done.ok and len(done.files) >= 2
    for item in done.files:
        path = os.path.realpath(item["path"])
        assert path in synced and os.path.dirname(path) in synced, (path, synced)


def test_a_tables_files_sort_by_name_in_commit_order(backend: Backend) -> None:
    """Readers of raw files (verify's fold) take a table's files in name order as commit order:
    the ledger's own file names are UUIDv7s as DuckLake's are, increasing."""
    with LakeTables(backend.catalog, backend.data) as lake:
        snapshots = {}
        for i in range(5):
            done = lake.commit(batch("s", i * ROWS, ROWS, i), {"s": (i * ROWS, (i + 1) * ROWS)}, {})
            for item in done.files:
                snapshots[os.path.basename(item["path"])] = done.snapshot
    names = sorted(snapshots)
    assert [snapshots[n] for n in names] == sorted(snapshots[n] for n in names)
    assert all(n.startswith("ducklake-") and n[9:].split("-")[2].startswith("7") for n in names)


def test_a_replayed_batch_is_stale_and_lands_nothing(backend: Backend) -> None:
    with LakeTables(backend.catalog, backend.data) as lake:
        assert lake.commit(batch("s", 0, ROWS, 0), {"s": (0, ROWS)}, {}).ok
        again = lake.commit(batch("s", 0, ROWS, 0), {"s": (0, ROWS)}, {})
        assert not again.ok and again.stale == {"s": ROWS}
        assert _per_commit(lake) == {0: (ROWS, ROWS)}
        assert lake.positions() == {"s": ROWS}


def test_a_writer_killed_mid_commit_leaves_nothing_and_the_next_commit_lands(backend: Backend) -> None:
    LakeTables(backend.catalog, backend.data).close()  # tables made before the writer starts
    proc = spawn("write", backend.catalog, str(backend.data), "s", str(ROWS * 20))
    assert proc.stdout is not None
    done = [proc.stdout.readline() for _ in range(2)]  # two commits landed for sure
    assert all(line.strip().isdigit() for line in done), proc.stderr.read() if proc.stderr else ""
    time.sleep(random.uniform(0.0, 0.3))  # then somewhere inside a later commit
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with LakeTables(backend.catalog, backend.data) as lake:
        landed = _per_commit(lake)
        tags = sorted(landed)
        assert tags == list(range(len(tags))) and len(tags) >= 2
        assert all(counts == (ROWS * 20, ROWS * 20) for counts in landed.values())
        assert lake.positions() == {"s": len(tags) * ROWS * 20}
        n = len(tags)
        nxt = lake.commit(
            batch("s", n * ROWS * 20, ROWS, n), {"s": (n * ROWS * 20, n * ROWS * 20 + ROWS)}, {}
        )
        assert nxt.ok
        assert _per_commit(lake)[n] == (ROWS, ROWS)


def _finish(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_three_racing_copies_of_one_ingester_land_each_record_once(backend: Backend) -> None:
    LakeTables(backend.catalog, backend.data).close()
    batches = 6
    outs = _finish(
        [spawn("race", backend.catalog, str(backend.data), "s", str(batches), str(ROWS)) for _ in range(3)]
    )
    assert sum(o["mine"] for o in outs) == batches  # each batch committed by exactly one copy
    if backend.kind == "sqlite":  # writers take turns (CommitTurns): a lost race is stale, never locked
        assert [o["retries"] for o in outs] == [0, 0, 0]
    with LakeTables(backend.catalog, backend.data) as lake, lake.reader() as con:
        assert _count(con, "SELECT count(*) FROM events") == batches * ROWS
        assert _count(con, "SELECT count(DISTINCT stream_seq) FROM events") == batches * ROWS
        assert _count(con, "SELECT count(*) FROM metrics") == batches * ROWS
        assert lake.positions() == {"s": batches * ROWS}
        # A fence's position is its largest row: a SQLite writer (which holds the commit turn) moves it
        # by adding a row; a PostgreSQL writer replaces its one row.
        assert _count(con, f"SELECT max(next_position) FROM {fence_table('s')}") == batches * ROWS
        if backend.kind == "postgres":
            assert _count(con, f"SELECT count(*) FROM {fence_table('s')}") == 1


@pytest.mark.parametrize("writers", [2, 4])
def test_writers_of_separate_sources_all_land(backend: Backend, writers: int) -> None:
    LakeTables(backend.catalog, backend.data).close()
    batches = 4
    sources = [f"src{i}" for i in range(writers)]
    outs = _finish(
        [spawn("race", backend.catalog, str(backend.data), s, str(batches), str(ROWS)) for s in sources]
    )
    assert [o["mine"] for o in outs] == [batches] * writers
    with LakeTables(backend.catalog, backend.data) as lake, lake.reader() as con:
        by_stream = dict(con.execute("SELECT stream, count(*) FROM events GROUP BY 1").fetchall())
        assert by_stream == {s: batches * ROWS for s in sources}
        assert lake.positions() == {s: batches * ROWS for s in sources}
        assert lake.state() == {f"head:{s}": batches - 1 for s in sources}


def test_every_read_sees_one_snapshot_while_writers_commit_and_maintain_runs(backend: Backend) -> None:
    lake = LakeTables(backend.catalog, backend.data)
    stop = threading.Event()
    maintained_twice = threading.Event()  # the writer goes on until maintain has run beside it
    errors: list[BaseException] = []

    def write() -> None:  # a writer beside the readers (a thread: one process may hold the catalog)
        try:
            with LakeTables(backend.catalog, backend.data) as w:
                b = 0
                while not stop.is_set() and b < 2000 and (b < 15 or not maintained_twice.is_set()):
                    w.commit(batch("w", b * ROWS, ROWS, b), {"w": (b * ROWS, (b + 1) * ROWS)}, {})
                    b += 1
                    time.sleep(
                        0.1
                    )  # an ingester's pace (a commit per batch): maintain gets its turn at a SQLite catalog
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    diffs: list[int] = []
    joins: list[bool] = []
    seen: set[int] = set()  # the counts read: more than one, so reads overlapped the writer
    maintained = 0
    try:
        deadline = time.monotonic() + 240.0  # a hard stop only: the loop ends when the writer has
        while time.monotonic() < deadline and (thread.is_alive() or len(diffs) < 3):
            with lake.reader() as con:
                first = _count(con, "SELECT count(*) FROM events")
                diffs.append(
                    _count(con, "SELECT (SELECT count(*) FROM events) - (SELECT count(*) FROM events)")
                )
                joined = _count(
                    con, "SELECT count(*) FROM metrics m JOIN events e USING (stream, stream_seq)"
                )
                joins.append(joined == _count(con, "SELECT count(*) FROM metrics"))
                time.sleep(0.05)  # let the writer commit meanwhile: the reader's statements still agree
                diffs.append(_count(con, "SELECT count(*) FROM events") - first)
                seen.add(first)
            if len(diffs) % 4 == 0:
                lake.maintain(keep_s=0.5)
                maintained += 1
                if maintained >= 2:
                    maintained_twice.set()
    finally:
        stop.set()
        thread.join(timeout=120)
        lake.close()
    assert not errors, errors
    assert len(diffs) >= 3 and maintained >= 2
    assert set(diffs) == {0}
    assert all(joins)
    assert len(seen) >= 2


def test_maintain_deletes_old_orphans_only(backend: Backend) -> None:
    """A commit killed after writing its files leaves files no snapshot names: maintenance deletes
    them once older than ORPHAN_MIN_AGE_S (a writer elsewhere may be about to add a young one)."""
    with LakeTables(backend.catalog, backend.data) as lake:
        assert lake.commit(batch("s", 0, ROWS, 0), {"s": (0, ROWS)}, {}).ok
        old, young = (w for _name, w in lake._write_files(batch("s", ROWS, ROWS, 1))[:2])
        hours_ago = time.time() - ORPHAN_MIN_AGE_S - 60
        os.utime(old, (hours_ago, hours_ago))
        with lake.reader() as con:
            before = _count(con, "SELECT count(*) FROM events") + _count(con, "SELECT count(*) FROM metrics")
        stats = lake.maintain(keep_s=0)
        assert stats["orphans_deleted"] == 1, stats
        assert not old.exists() and young.exists()
        with lake.reader() as con:
            after = _count(con, "SELECT count(*) FROM events") + _count(con, "SELECT count(*) FROM metrics")
        assert after == before == 2 * ROWS


def test_maintain_merges_files_and_a_pinned_reader_answers_the_same(backend: Backend) -> None:
    with LakeTables(backend.catalog, backend.data) as lake:
        for b in range(12):
            assert lake.commit(batch("s", b * ROWS, ROWS, b), {"s": (b * ROWS, (b + 1) * ROWS)}, {}).ok
        question = "SELECT e.stream, sum(m.value), count(*) FROM metrics m JOIN events e USING (stream, stream_seq) GROUP BY 1"
        with lake.reader() as pinned:
            before = pinned.execute(question).fetchall()
            stats = lake.maintain()
            assert stats["files_after"] < stats["files_before"]
            assert stats["snapshots_expired"] == 0  # all younger than keep_s (an hour)
            assert pinned.execute(question).fetchall() == before
        with lake.reader() as fresh:
            assert fresh.execute(question).fetchall() == before
        assert lake.maintain(keep_s=0)["snapshots_expired"] > 0
        with lake.reader() as newest:
            assert newest.execute(question).fetchall() == before


def _shuffled_metrics(start: int, rows: int, tag: int) -> dict[str, pa.Table]:
    """``rows`` events and a metric each, the metrics' names and steps in no order (as a logger mixes them)."""
    tables = batch("s", start, rows, tag)
    schema = tables["metrics"].schema
    names = [("loss", "lr", "grad_norm")[(s * 7) % 3] for s in range(start, start + rows)]
    steps = list(reversed(range(start, start + rows)))
    tables["metrics"] = (
        tables["metrics"]
        .set_column(schema.get_field_index("name"), "name", pa.array(names))
        .set_column(schema.get_field_index("step"), "step", pa.array(steps, type=schema.field("step").type))
    )
    return tables


def test_metric_files_are_sorted_by_name_and_step_before_and_after_a_merge(backend: Backend) -> None:
    """As the ledger's own merged parts: a metric's rows lie together in step order, so a question
    about one metric reads its row groups only (the lake's sort order is set by maintenance), and
    compressed as them (zstd; DuckDB's merge would write snappy)."""
    order = ["name", "attempt", "step", "stream", "stream_seq"]

    def live_metric_files(lake: LakeTables) -> list[pa.Table]:
        rows = lake._file_rows("f.end_snapshot IS NULL", [])
        paths = [path for table, path, _, _ in rows if table == "metrics"]
        for path in paths:
            meta = pq.ParquetFile(path).metadata
            assert {meta.row_group(0).column(i).compression for i in range(meta.num_columns)} == {"ZSTD"}
        return [pq.read_table(path, columns=order) for path in paths]

    with LakeTables(backend.catalog, backend.data) as lake:
        for b in range(6):
            assert lake.commit(_shuffled_metrics(b * ROWS, ROWS, b), {"s": (b * ROWS, (b + 1) * ROWS)}, {}).ok
        assert len(live_metric_files(lake)) == 6
        for table in live_metric_files(lake):  # each commit's file
            assert table.to_pylist() == table.sort_by([(k, "ascending") for k in order]).to_pylist()
        lake.maintain(keep_s=0)
        merged = live_metric_files(lake)
        assert len(merged) == 1
        assert merged[0].to_pylist() == merged[0].sort_by([(k, "ascending") for k in order]).to_pylist()
        with lake.reader() as con:
            assert _count(con, "SELECT count(*) FROM metrics WHERE name = 'loss'") == 6 * ROWS // 3


@pytest.mark.parametrize(
    "spec", ["duckdb:/tmp/x/catalog.ducklake", "/tmp/x/catalog.ducklake", "/tmp/x/catalog.duckdb", "catalog"]
)
def test_a_duckdb_file_catalog_is_refused_in_one_line(spec: str, tmp_path: Path) -> None:
    """DuckDB's file lock lets one process hold such a catalog, so checkpoint, publish and redact
    could never run beside a writer: the kind is not offered, and nothing is made."""
    with pytest.raises(LakeError) as refused:
        LakeTables(spec, tmp_path / "data")
    assert str(refused.value) == (
        f"catalog {spec!r}: a DuckDB-file catalog is held by one process, so checkpoint, publish and "
        "redact beside a writer cannot run: use sqlite:PATH (one host) or postgres:DSN (many hosts)"
    )
    assert not (tmp_path / "data").exists() and not Path("/tmp/x").exists()


@pytest.mark.parametrize(
    ("dsn", "bounded"),
    [
        ("dbname=l host=h", "dbname=l host=h options='-c lock_timeout=2500'"),
        (
            "dbname=l options='-c search_path=s' host=h",
            "dbname=l options='-c search_path=s -c lock_timeout=2500' host=h",
        ),
        ("dbname=l options=-csearch_path=s", "dbname=l options='-csearch_path=s -c lock_timeout=2500'"),
        ("postgresql://u@h:5/l", "postgresql://u@h:5/l?options=-c%20lock_timeout%3D2500"),
        (
            "postgres://u@h/l?sslmode=disable&options=-c%20search_path%3Ds",
            "postgres://u@h/l?sslmode=disable&options=-c%20search_path%3Ds%20-c%20lock_timeout%3D2500",
        ),
    ],
)
def test_a_catalog_dsn_gains_a_lock_timeout_and_keeps_its_own_options(dsn: str, bounded: str) -> None:
    """The connection a catalog compaction uses on PostgreSQL (``VACUUM FULL``, bounded by the
    server's ``lock_timeout``): the user's DSN, keyword or URI form, with its own ``options`` kept."""
    assert with_lock_timeout(dsn, 2.5) == bounded
