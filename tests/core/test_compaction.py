"""Compaction after every commit: which files merge (fixed vectors), sorted metric files, and that no
answer, proof or verification changes when a ledger that commits one event at a time compacts itself."""

from __future__ import annotations

import os
import random
import threading
import time
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


def _one_event_per_commit(root: Path, run: RunBuilder, *, auto: bool) -> Ledger:
    ledger = Ledger.create(root)
    ledger.auto_compact = auto
    for i, raw in enumerate(run.events):
        ledger.commit([SourceRecord("spool:t", i, raw)])
    return ledger


def test_a_ledger_committing_one_event_at_a_time_compacts_itself_and_no_answer_changes(
    tmp_path: Path,
) -> None:
    run = _story()
    _one_event_per_commit(tmp_path / "plain", run, auto=False)
    _one_event_per_commit(tmp_path / "auto", run, auto=True)
    plain, auto = Reader(tmp_path / "plain"), Reader(tmp_path / "auto")
    for q in QUERIES:
        assert auto.sql(q).rows == plain.sql(q).rows, q
    assert auto.state("run-a", step=25) == plain.state("run-a", step=25)
    events = len(run.events)
    per_partition = [len(list(d.glob("*.parquet"))) for d in (tmp_path / "auto").glob("*/*=*")]
    assert max(per_partition) < 2 * compaction.COMPACT_FANOUT
    assert len(list((tmp_path / "plain" / "events").rglob("*.parquet"))) >= events
    report = verify_ledger(tmp_path / "auto")
    assert report.ok, report.problems
    # Ingest goes on after compactions, and stays idempotent.
    again = Ledger.open(tmp_path / "auto")
    assert again.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)]).accepted == 0


def test_merged_metric_files_are_sorted_by_name_then_step(tmp_path: Path) -> None:
    run = _story()
    _one_event_per_commit(tmp_path / "l", run, auto=True)
    merged = [p for p in (tmp_path / "l" / "metrics").rglob("*.parquet") if "-c" in p.name]
    assert merged
    for path in merged:
        rows = pq.read_table(path, columns=["name", "attempt", "step"]).to_pylist()
        keys = [(r["name"], r["attempt"], r["step"]) for r in rows]
        assert keys == sorted(keys)
        meta = pq.ParquetFile(path).metadata
        encodings = {
            meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i).encodings
            for i in range(meta.num_columns)
        }
        assert "DELTA_BINARY_PACKED" in encodings["step"]
        assert "BYTE_STREAM_SPLIT" in encodings["value"]


def test_a_failed_compaction_loses_nothing_and_the_next_commit_retries(tmp_path: Path, monkeypatch) -> None:
    run = _story(20)
    ledger = Ledger.create(tmp_path / "l")

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("ledger.store.merge_parts", broken)
    for i, raw in enumerate(run.events):
        assert ledger.commit([SourceRecord("spool:t", i, raw)]).accepted == 1
    assert not list((tmp_path / "l").rglob("*.tmp"))
    assert len(list((tmp_path / "l" / "events").rglob("*.parquet"))) == 1 + len(
        run.events
    )  # + the empty one of create
    monkeypatch.undo()
    ledger.commit([SourceRecord("spool:t", len(run.events), run.events[-1])])  # a duplicate: no commit
    before = Reader(tmp_path / "l").sql(QUERIES[0]).rows
    assert ledger.compact()["merged_partitions"] > 0
    assert Reader(tmp_path / "l").sql(QUERIES[0]).rows == before
    assert verify_ledger(tmp_path / "l").ok


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


def test_a_query_during_a_merge_waits_for_the_merged_file_instead_of_missing_its_rows(
    tmp_path: Path, monkeypatch
) -> None:
    run = _story(20)
    ledger = _one_event_per_commit(tmp_path / "l", run, auto=False)
    reader = Reader(tmp_path / "l")
    count = "SELECT count(*) FROM metrics_all"
    expected = reader.sql(count).rows
    real_replace = os.replace
    removed = threading.Event()

    def slow_replace(src, dst) -> None:  # the writer pauses between removing old files and the rename
        if "-c" in Path(dst).name:
            removed.set()
            time.sleep(0.5)
        real_replace(src, dst)

    monkeypatch.setattr("ledger.store.os.replace", slow_replace)
    merging = threading.Thread(target=ledger.compact)
    merging.start()
    assert removed.wait(10)
    assert not any("-c" in p.name for p in (tmp_path / "l" / "metrics").rglob("*.parquet"))
    assert reader.sql(count).rows == expected  # without waiting: only the rows of unmerged files
    merging.join()
    assert reader.sql(count).rows == expected


def test_a_merge_that_fails_after_its_commit_point_is_finished_by_the_next_commit(
    tmp_path: Path, monkeypatch
) -> None:
    run = _story(20)
    plain = _one_event_per_commit(tmp_path / "plain", run, auto=False)
    ledger = Ledger.create(tmp_path / "l")
    real_replace = os.replace
    failed: list[str] = []

    def failing_replace(src, dst) -> None:  # the first merged file cannot be renamed into place
        if "-c" in Path(dst).name and not failed:
            failed.append(str(dst))
            raise OSError("I/O error")
        real_replace(src, dst)

    monkeypatch.setattr("ledger.store.os.replace", failing_replace)
    for i, raw in enumerate(run.events):
        assert ledger.commit([SourceRecord("spool:t", i, raw)]).accepted == 1
    assert failed
    assert not list((tmp_path / "l").rglob("*.tmp"))  # finished by the commits that followed
    for q in QUERIES:
        assert Reader(tmp_path / "l").sql(q).rows == Reader(plain.root).sql(q).rows, q
    assert verify_ledger(tmp_path / "l").ok
