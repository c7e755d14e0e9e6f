"""Compaction: which files merge (fixed vectors), the sorted merge of metric files, and that no answer,
proof or verification changes when a lake that commits one event at a time compacts itself."""

from __future__ import annotations

import random
import sqlite3
from contextlib import closing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ledger import compaction
from ledger.compaction import level, merge_parts, tail_to_merge
from ledger.integrity import verify_ledger
from ledger.parquet_schemas import TABLES
from ledger.query import Reader
from ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder

MB = 1 << 20


def test_levels_are_size_classes_a_fanout_apart() -> None:
    assert [level(s) for s in (0, 1, MB, MB + 1, 8 * MB - 1, 8 * MB, 64 * MB)] == [0, 0, 0, 1, 1, 2, 3]


@pytest.mark.parametrize(
    ("sizes", "merged"),
    [
        ([], 0),
        ([1] * 7, 0),  # fewer than fanout small files: left alone
        ([1] * 8, 8),
        ([1] * 11, 11),  # the whole run of small files, not just eight
        ([200 * MB] + [1] * 7, 0),  # a big old file never joins a merge of small ones
        ([200 * MB] + [1] * 8, 8),
        ([2 * MB] * 7 + [1], 0),  # seven level-1 files wait for an eighth
        ([2 * MB] * 8 + [1], 9),  # eight merge, and the newer small file with them
        ([2 * MB] * 6 + [1] * 3, 0),
        ([1] * 8 + [2 * MB], 0),  # only a tail merges: small files behind a bigger one wait
        ([20 * MB] * 7 + [2 * MB] * 7 + [1] * 7, 0),
        ([20 * MB] * 7 + [2 * MB] * 7 + [1] * 8, 8),
    ],
)
def test_tail_to_merge(sizes: list[int], merged: int) -> None:
    assert tail_to_merge(sizes) == merged


def test_a_month_of_commits_keeps_a_few_files_per_level() -> None:
    sizes: list[int] = []
    most = 0
    for _ in range(5000):  # a commit a minute for three and a half days: 30 KB each
        sizes.append(30_000)
        while n := tail_to_merge(sizes):
            sizes[-n:] = [sum(sizes[-n:])]
        most = max(most, len(sizes))
    assert sum(sizes) == 5000 * 30_000
    assert most <= 8 * (1 + level(sum(sizes)))


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


def _metric_part(path: Path, rows: list[dict], schema: pa.Schema) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_sorted_merge_in_small_chunks_keeps_every_row_and_fills_missing_columns(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(compaction, "_SORT_CHUNK_ROWS", 7)  # many chunks, and names split across parts
    schema = TABLES["metrics"].schema
    rng = random.Random(3)
    names = [f"m{i:02d}" for i in range(13)] + ["é/ünïcode", ""]
    parts, every = [], []
    for k in range(4):
        rows = [
            {
                "attempt": rng.choice([1, 2, None]),
                "step": rng.randrange(100),
                "name": rng.choice([*names, None]),
                "value": rng.random(),
                "stream": "run-a",
                "stream_seq": rng.randrange(10_000),
            }
            for _ in range(rng.randrange(1, 40))
        ]
        if k == 2:  # an older file without some columns: they read as nulls
            part_schema = pa.schema([f for f in schema if f.name not in ("stream", "time")])
            rows = [{key: v for key, v in r.items() if key != "stream"} for r in rows]
            parts.append(_metric_part(tmp_path / f"p{k}.parquet", rows, part_schema))
            rows = [r | {"stream": None} for r in rows]
        else:
            parts.append(_metric_part(tmp_path / f"p{k}.parquet", rows, schema))
        every += [r | {"time": None} for r in rows]
    merge_parts(parts, "metrics", schema, tmp_path / "merged.parquet")
    merged = pq.read_table(tmp_path / "merged.parquet")
    assert merged.schema == schema
    got = merged.to_pylist()

    def key(r: dict) -> tuple:  # the sort order: each key ascending, nulls last
        return tuple(
            (False, r[k]) if r[k] is not None else (True,) for k in compaction.SORTED_TABLES["metrics"]
        )

    assert got == sorted(got, key=key)
    assert sorted(repr(sorted(r.items())) for r in got) == sorted(repr(sorted(r.items())) for r in every)
