"""The files a lake commit writes: one per partition value of each table, each holding exactly that
value's rows, metrics sorted as the lake's merge sorts them and every other table in the order given
(events in stream order), whatever the mix of partitions, chunks and nulls in one commit."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from runledger.ledger.compaction import SORTED_TABLES
from runledger.ledger.lake import LakeTables, _by_partition, lake_schema

METRIC_KEYS = list(SORTED_TABLES["metrics"])


def _one_filter_per_value(
    table: pa.Table, column: str, keys: list[str]
) -> list[tuple[object, list[dict[str, object]]]]:
    """The reference: the whole table sorted, then one filter per partition value (``str`` order)."""
    if keys:
        table = table.sort_by([(k, "ascending") for k in keys])
    out = []
    for value in sorted(set(table.column(column).to_pylist()), key=str):
        values = table.column(column)
        rows = table.filter(pc.is_null(values) if value is None else pc.equal(values, value))
        out.append((value, rows.to_pylist()))
    return out


def _random_metrics(rng: random.Random, rows: int, runs: list[str | None], null_names: bool) -> pa.Table:
    names = ["loss", "lr", "grad/norm", "Z", "", *([None] if null_names else [])]
    table = pa.table(
        {
            "name": pa.array([rng.choice(names) for _ in range(rows)], pa.string()),
            "attempt": pa.array([rng.randint(0, 2) for _ in range(rows)], pa.int64()),
            "step": pa.array([rng.randint(0, 30) for _ in range(rows)], pa.int64()),
            "stream": pa.array([rng.choice(["s1", "s0"]) for _ in range(rows)], pa.string()),
            "stream_seq": pa.array([rng.randint(0, 5) for _ in range(rows)], pa.int64()),
            "row": pa.array(range(rows), pa.int64()),  # tells rows that tie on every key apart
            "run_id": pa.array([rng.choice(runs) for _ in range(rows)], pa.string()),
        }
    )
    cut = rng.randint(0, rows)  # two chunks, as a commit's row buffer gives them
    return pa.concat_tables([table.slice(0, cut), table.slice(cut)])


def test_one_pass_split_matches_a_filter_per_partition_value() -> None:
    rng = random.Random(39)
    partitions: list[list[str | None]] = [["a"], ["b", "a", "_"], ["x", None], [None], ["2026-12-06", "b"]]
    for case in range(200):
        runs = partitions[case % len(partitions)]
        table = _random_metrics(rng, rng.randint(1, 200), runs, null_names=case % 7 == 0)
        for keys in ([], METRIC_KEYS):
            got = [(value, rows.to_pylist()) for value, rows in _by_partition(table, "run_id", keys)]
            assert got == _one_filter_per_value(table, "run_id", keys), (case, runs, keys)


def test_a_table_of_one_partition_and_no_sort_is_written_as_given() -> None:
    table = _random_metrics(random.Random(1), 50, ["only"], null_names=False)
    [(value, rows)] = _by_partition(table, "run_id", [])
    assert value == "only" and rows is table


def _events(streams: list[tuple[str, str]]) -> pa.Table:
    schema = lake_schema("events")
    columns = {
        "stream": [s for s, _ in streams],
        "stream_seq": list(range(len(streams))),
        "id": [f"e{i}" for i in range(len(streams))],
        "commit": [0] * len(streams),
        "canonical": ["x" * 16] * len(streams),
        "stream_type": [kind for _, kind in streams],
    }
    return pa.table({c: pa.array(v, type=schema.field(c).type) for c, v in columns.items()})


def test_a_commit_of_several_runs_writes_one_file_per_run_each_sorted(tmp_path: Path) -> None:
    rng = random.Random(7)
    metrics = _random_metrics(rng, 300, ["run-b", "run-a", "run-c"], null_names=False).drop_columns(["row"])
    events = _events([(f"s{i % 3}", ("run", "host")[i % 2]) for i in range(40)])
    with LakeTables(f"sqlite:{tmp_path / 'catalog.sqlite'}", tmp_path / "data") as lake:
        done = lake.commit({"metrics": metrics, "events": events}, {"s": (0, 40)}, {})
        assert done.ok
        files = [(item["table"], pq.read_table(item["path"])) for item in done.files]
        with lake.reader() as con:
            stored = con.execute("SELECT count(*) FROM metrics").fetchone()
    assert stored == (300,)
    metric_files = [rows for table, rows in files if table == "metrics"]
    assert sorted(rows.column("run_id")[0].as_py() for rows in metric_files) == ["run-a", "run-b", "run-c"]
    for rows in metric_files:
        assert rows.column("run_id").unique().to_pylist() == [rows.column("run_id")[0].as_py()]
        assert rows.to_pylist() == rows.sort_by([(k, "ascending") for k in METRIC_KEYS]).to_pylist()
    written = pa.concat_tables([rows.select(metrics.column_names) for rows in metric_files])
    order = [(k, "ascending") for k in metrics.column_names]
    assert written.sort_by(order).to_pylist() == metrics.sort_by(order).to_pylist()
    event_files = {rows.column("stream_type")[0].as_py(): rows for table, rows in files if table == "events"}
    assert sorted(event_files) == ["host", "run"]
    for kind, rows in event_files.items():  # each partition's events in the order given (stream order)
        want = events.filter(pc.equal(events.column("stream_type"), kind))
        assert rows.column("id").to_pylist() == want.column("id").to_pylist()
