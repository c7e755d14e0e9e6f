"""Compaction: no answer, proof or verification changes when a lake that commits one event at a time
compacts itself; rows of an older file read under the table's schema."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pyarrow as pa

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


def _one_event_per_commit(root: Path, run: RunBuilder, *, maintain_every: int) -> Ledger:
    ledger = Ledger.create(root)
    ledger.maintain_every = maintain_every  # 0: the lake never compacts itself
    for i, raw in enumerate(run.events):
        ledger.commit([SourceRecord("spool:t", i, raw)])
    return ledger


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


def test_conform_reads_a_column_an_older_file_lacks_as_nulls() -> None:
    schema = TABLES["metrics"].schema
    older = pa.table({"name": ["loss"], "step": pa.array([3], pa.int32()), "value": [1.5]})
    rows = conform(older, schema)
    assert rows.schema == schema
    assert rows.to_pylist() == [{f.name: None for f in schema} | {"name": "loss", "step": 3, "value": 1.5}]
