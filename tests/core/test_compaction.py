"""Compaction: no answer, proof or verification changes when a lake that commits one event at a time
compacts itself; rows of an older file read under the table's schema."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pyarrow as pa
import pytest

from runledger.ledger import lake as lake_module
from runledger.ledger.compaction import conform
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.parquet_schemas import TABLES
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder

MB = 1 << 20


def _story(steps: int = 60) -> RunBuilder:
    run = RunBuilder()
    run.start()
    for s in range(1, steps + 1):
        if s == 20:
            run.change(20, "lr", 0.0005)
        run.step(s, loss=10 - s * 0.1)
        if s % 10 == 0:
            run.checkpoint(s)
    run.crash(40)
    run.resume(30)
    for s in range(31, 45):
        run.step(s, loss=5 - s * 0.1)
    return run


QUERIES = [
    "SELECT * FROM metrics_all ORDER BY attempt, step, name",
    "SELECT * FROM moe_layer_stats_all ORDER BY attempt, step, layer",
    "SELECT * EXCLUDE (commit) FROM events ORDER BY stream, stream_seq",
    "SELECT * FROM config_changes ORDER BY stream_seq",
    "SELECT * FROM attempts ORDER BY attempt",
    "SELECT * FROM checkpoints ORDER BY stream_seq",
]


def _one_event_per_commit(
    root: Path, run: RunBuilder, *, maintain_every: int, merge_small_every: int = 0
) -> Ledger:
    ledger = Ledger.create(root)
    ledger.maintain_every = maintain_every  # 0: the lake never compacts itself
    ledger.merge_small_every = merge_small_every
    for i, raw in enumerate(run.events):
        ledger.commit([SourceRecord("spool:t", i, raw)])
    return ledger


def _live_files(root: Path) -> dict[str, tuple[int, int, str]]:
    """The newest snapshot's data files: path -> (size in bytes, table id, partition value)."""
    with closing(sqlite3.connect(root / "catalog.sqlite")) as catalog:
        rows = catalog.execute(
            "SELECT f.path, f.file_size_bytes, f.table_id, coalesce(p.partition_value, '') "
            "FROM ducklake_data_file f LEFT JOIN ducklake_file_partition_value p USING (data_file_id) "
            "WHERE f.end_snapshot IS NULL"
        ).fetchall()
    return {path: (int(size), int(table), str(part)) for path, size, table, part in rows}


def _live_data_files(root: Path) -> int:
    """How many data files the lake's newest snapshot reads (from its embedded SQLite catalog)."""
    with closing(sqlite3.connect(root / "catalog.sqlite")) as catalog:
        (count,) = catalog.execute(
            "SELECT count(*) FROM ducklake_data_file WHERE end_snapshot IS NULL"
        ).fetchone()
    return int(count)


def test_a_ledger_committing_one_event_at_a_time_compacts_itself_and_no_answer_changes(
    tmp_path: Path,
) -> None:
    run = _story(20)
    _one_event_per_commit(tmp_path / "plain", run, maintain_every=0)
    _one_event_per_commit(tmp_path / "auto", run, maintain_every=10)
    plain, auto = Reader(tmp_path / "plain"), Reader(tmp_path / "auto")
    for q in QUERIES:
        assert auto.sql(q).rows == plain.sql(q).rows, q
    assert auto.state("run-a", step=15) == plain.state("run-a", step=15)
    # The lake merged its small files as it went: its newest snapshot reads fewer of them.
    assert _live_data_files(tmp_path / "auto") < _live_data_files(tmp_path / "plain")
    report = verify_ledger(tmp_path / "auto")
    assert report.ok, report.problems
    # Ingest goes on after compactions, and stays idempotent.
    again = Ledger.open(tmp_path / "auto")
    assert again.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)]).accepted == 0


def test_the_writers_merge_of_small_files_leaves_big_files_and_every_answer_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two full merges the writer merges only the files below ``SMALL_FILE_BYTES`` (the
    few-row files each commit leaves): a file at or above it stays as it is, the small ones of each
    table's partition become one, and no answer or verification changes."""
    run = _story(20)
    _one_event_per_commit(tmp_path / "plain", run, maintain_every=0)
    light = _one_event_per_commit(tmp_path / "light", run, maintain_every=1000, merge_small_every=0)
    before = _live_files(tmp_path / "light")
    sizes = sorted(size for size, _, _ in before.values())
    below = sizes[len(sizes) // 2]  # (these files are KBs: half of them count as big here)
    monkeypatch.setattr(lake_module, "SMALL_FILE_BYTES", below)
    assert light.lake is not None
    stats = light.lake.merge_small_files()
    after = _live_files(tmp_path / "light")
    big = {path for path, (size, _, _) in before.items() if size >= below}
    assert big and big <= set(after)  # every big file is still live, as it was
    assert stats["files_merged"] > stats["files_written"] > 0 and stats["merged_recorded"] > 0
    written = set(after) - set(before)
    assert len(written) == stats["files_written"]
    # Of the files that were small, one per table and partition is left (written by the merge).
    small_left = [(t, part) for path, (_, t, part) in after.items() if path not in big]
    assert len(small_left) == len(set(small_left))
    plain, merged = Reader(tmp_path / "plain"), Reader(tmp_path / "light")
    for q in QUERIES:
        assert merged.sql(q).rows == plain.sql(q).rows, q
    assert merged.state("run-a") == plain.state("run-a")
    report = verify_ledger(tmp_path / "light")
    assert report.ok, report.problems


def test_a_ledger_merges_its_small_files_every_few_commits(tmp_path: Path) -> None:
    """The writer's own cadence: a merge of small files every ``merge_small_every`` commits between
    full merges (``maintain_every``); its readers open fewer files and answer the same."""
    run = _story(20)
    _one_event_per_commit(tmp_path / "plain", run, maintain_every=1000, merge_small_every=0)
    _one_event_per_commit(tmp_path / "light", run, maintain_every=1000, merge_small_every=5)
    assert _live_data_files(tmp_path / "light") < _live_data_files(tmp_path / "plain")
    plain, light = Reader(tmp_path / "plain"), Reader(tmp_path / "light")
    for q in QUERIES:
        assert light.sql(q).rows == plain.sql(q).rows, q
    report = verify_ledger(tmp_path / "light")
    assert report.ok, report.problems


def test_conform_reads_a_column_an_older_file_lacks_as_nulls() -> None:
    schema = TABLES["metrics"].schema
    older = pa.table({"name": ["loss"], "step": pa.array([3], pa.int32()), "value": [1.5]})
    rows = conform(older, schema)
    assert rows.schema == schema
    assert rows.to_pylist() == [{f.name: None for f in schema} | {"name": "loss", "step": 3, "value": 1.5}]
