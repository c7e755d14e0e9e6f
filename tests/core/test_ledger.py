from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runledger.ingest.spool import SpoolWriter
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder


def _records(raws: list[bytes], source: str = "spool:t") -> list[SourceRecord]:
    return [SourceRecord(source, i, raw) for i, raw in enumerate(raws)]


def _story() -> RunBuilder:
    run = RunBuilder()
    run.start()
    for s in range(1, 21):
        if s == 8:
            run.change(8, "lr", 0.0005)
        run.step(s, loss=10 - s * 0.1)
        if s % 5 == 0:
            run.checkpoint(s)
    run.crash(20)
    run.resume(15)
    for s in range(16, 31):
        if s == 25:
            run.change(25, "moe", {"capacity_factor": 1.25})
        run.step(s, loss=5 - s * 0.1)
    return run


def _expected_config(run: RunBuilder, step: int) -> dict:
    starts = {a: s for a, s, _ in run.applied if True}
    starts = {}
    for attempt, s, _ in run.applied:
        starts.setdefault(attempt, s)
    below = [a for a, s in starts.items() if s < step]
    covering = max(below) if below else min(starts)
    return [c for a, s, c in run.applied if a == covering and s <= step][-1]


def test_commit_is_idempotent_and_positions_advance(tmp_path: Path) -> None:
    run = _story()
    ledger = Ledger.create(tmp_path / "l")
    first = ledger.commit(_records(run.events))
    again = ledger.commit(_records(run.events))
    assert first.accepted == len(run.events)
    assert (again.accepted, again.skipped, again.commit) == (0, len(run.events), None)
    assert ledger.positions() == {"spool:t": len(run.events)}
    # The same events from another source are duplicates by (source, id): dropped.
    other = ledger.commit(_records(run.events, source="kafka:t:0"))
    assert (other.accepted, other.duplicates) == (0, len(run.events))
    reader = Reader(tmp_path / "l")
    assert reader.sql("SELECT count(*) FROM events").rows == [(len(run.events),)]
    assert reader.sql("SELECT count(DISTINCT stream_seq), max(stream_seq) FROM events").rows == [
        (len(run.events), len(run.events) - 1)
    ]


def test_restart_lineage_keeps_superseded_steps(tmp_path: Path) -> None:
    run = _story()
    ledger = Ledger.create(tmp_path / "l")
    ledger.commit(_records(run.events))
    reader = Reader(tmp_path / "l")
    rows = reader.sql(
        "SELECT attempt, step, superseded FROM metrics_all WHERE name = 'loss' AND step BETWEEN 15 AND 17 "
        "ORDER BY step, attempt"
    ).rows
    assert rows == [(1, 15, False), (1, 16, True), (2, 16, False), (1, 17, True), (2, 17, False)]
    canonical = reader.sql("SELECT step, attempt FROM metrics WHERE name = 'loss' ORDER BY step").rows
    assert [s for s, _ in canonical] == list(range(1, 31))
    assert all(a == (1 if s <= 15 else 2) for s, a in canonical)
    assert reader.sql("SELECT count(*) FROM metrics_all WHERE name = 'loss' AND superseded").rows == [(5,)]


@pytest.mark.parametrize("step", [1, 7, 8, 15, 16, 24, 25, 30])
def test_state_at_step_is_the_patches_up_to_it(tmp_path: Path, step: int) -> None:
    run = _story()
    Ledger.create(tmp_path / "l").commit(_records(run.events))
    reader = Reader(tmp_path / "l")
    state = reader.state("run-a", step=step)
    assert state.config == _expected_config(run, step)
    assert state.attempt == (1 if step <= 15 else 2)
    sql = reader.sql("SELECT config FROM config_at('run-a', ?)", [step]).rows
    assert json.loads(sql[0][0]) == state.config
    assert len(state.crashes) == (1 if step > 15 else 0)
    assert state.last_checkpoint is not None or step < 5
    assert state.git_commit == ("a" * 40 if step <= 15 else "b" * 40)


def test_state_at_time_and_user_errors(tmp_path: Path) -> None:
    run = _story()
    Ledger.create(tmp_path / "l").commit(_records(run.events))
    reader = Reader(tmp_path / "l")
    from datetime import timedelta

    from tests.support.factory import T0

    early = reader.state("run-a", at=T0 + timedelta(seconds=10))
    assert early.attempt == 1 and early.step is not None and early.step < 10
    with pytest.raises(QueryError, match="unknown run"):
        reader.state("nope", step=1)
    with pytest.raises(QueryError, match="out of range"):
        reader.state("run-a", step=10_000)
    with pytest.raises(QueryError, match="read-only"):
        reader.sql("DELETE FROM events")
    with pytest.raises(QueryError, match="read-only"):
        reader.sql(f"COPY (SELECT 1) TO '{tmp_path}/x.csv'")


@st.composite
def run_scripts(draw: st.DrawFn) -> tuple[RunBuilder, list[int]]:
    run = RunBuilder(config={"lr": 0.1, "moe": {"capacity_factor": 1.0}, "log": 10})
    run.start()
    step = 0
    last_ckpt = 0
    for _ in range(draw(st.integers(1, 25))):
        action = draw(st.sampled_from(["step", "step", "step", "change", "ckpt", "restart"]))
        if action == "step":
            step += 1
            run.step(step)
        elif action == "change":
            key = draw(st.sampled_from(["lr", "log"]))
            run.change(step + 1, key, draw(st.integers(1, 1000)))
        elif action == "ckpt" and step > 0:
            run.checkpoint(step)
            last_ckpt = step
        elif action == "restart":
            run.crash(step)
            run.resume(last_ckpt)
            step = last_ckpt
    # Redeliveries: copies of earlier events arriving again later.
    order = list(range(len(run.events)))
    for _ in range(draw(st.integers(0, 10))):
        i = draw(st.integers(0, len(order) - 1))
        j = draw(st.integers(i, len(order)))
        order.insert(j, order[i])
    return run, order


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=run_scripts(), batch=st.integers(1, 7))
def test_any_interleaving_of_redeliveries_folds_to_the_same_state(tmp_path_factory, script, batch) -> None:
    run, order = script
    path = tmp_path_factory.mktemp("prop") / "l"
    ledger = Ledger.create(path)
    stream = [run.events[i] for i in order]
    records = _records(stream)
    for k in range(0, len(records), batch):
        ledger.commit(records[k : k + batch])
    ledger.commit(records)  # re-ingest: a no-op
    reader = Reader(path)
    assert reader.sql("SELECT count(*) FROM events").rows == [(len(run.events),)]
    canon = [r[0] for r in reader.sql("SELECT id FROM events ORDER BY stream_seq").rows]
    assert canon == [f"run-a-{i}" for i in range(len(run.events))]
    last = reader.last_step("run-a") or 0
    for step in range(0, last + 1):
        assert reader.state("run-a", step=step).config == _expected_config(run, step), step


def test_malformed_corpus_is_quarantined_while_valid_events_land(tmp_path: Path) -> None:
    run = _story()
    rng = random.Random(7)
    bad: list[bytes] = [b"", b"{", b"null", b"[]", b'{"id": 1}', "ünïcode".encode(), b"\xff\xfe"]
    for raw in rng.sample(run.events, 20):
        obj = json.loads(raw)
        mutation = rng.choice(["type", "version", "field", "trunc", "step"])
        if mutation == "type":
            obj["type"] = "runledger.unheard.of"
        elif mutation == "version":
            obj["schema_version"] = 42
        elif mutation == "field":
            obj["data"] = {"config": "not a dict"} if "config" in obj["data"] else {"loss": "NaN?"}
        elif mutation == "step":
            obj["step"] = "seven"
        obj["id"] = "bad-" + obj["id"]
        text = json.dumps(obj).encode()
        bad.append(text[: len(text) // 2] if mutation == "trunc" else text)
    mixed = list(run.events) + bad
    rng.shuffle(mixed)
    ledger = Ledger.create(tmp_path / "l")
    result = ledger.commit(_records(mixed))
    reader = Reader(tmp_path / "l")
    assert result.accepted == len(run.events)
    assert reader.sql("SELECT count(*) FROM quarantine").rows == [(len(bad),)]
    assert reader.sql("SELECT count(*) FROM quarantine WHERE reason = '' OR reason IS NULL").rows == [(0,)]
    raws = {r[0] for r in reader.sql("SELECT raw FROM quarantine").rows}
    assert raws == set(bad)


def test_compaction_changes_no_answer(tmp_path: Path) -> None:
    run = _story()
    ledger = Ledger.create(tmp_path / "l")
    for k in range(0, len(run.events), 3):
        ledger.commit(_records(run.events)[k : k + 3])
    queries = [
        "SELECT * FROM metrics ORDER BY step, name",
        "SELECT * EXCLUDE (commit) FROM events ORDER BY stream, stream_seq",
        "SELECT * FROM config_changes ORDER BY stream_seq",
        "SELECT * FROM attempts ORDER BY attempt",
    ]
    before = [Reader(tmp_path / "l").sql(q).rows for q in queries]
    result = ledger.compact()  # the lake's merge: the live files of its newest snapshot, fewer
    assert result["files_merged"] > result["files_written"] > 0
    assert result["files_after"] < result["files_before"]
    assert [Reader(tmp_path / "l").sql(q).rows for q in queries] == before
    # Ingest still works after compaction, and stays idempotent.
    assert ledger.commit(_records(run.events)).accepted == 0


def test_files_are_plain_hive_parquet(tmp_path: Path) -> None:
    run = _story()
    Ledger.create(tmp_path / "l").commit(_records(run.events))
    tables = tmp_path / "l" / "data" / "main"  # the lake's data folder: a folder per table
    files = sorted((tables / "metrics").glob("run_id=run-a/*.parquet"))
    assert files
    table = pq.read_table(files[0])
    assert {"attempt", "step", "name", "value"} <= set(table.column_names)
    import pyarrow.dataset as ds

    dataset = ds.dataset(tables / "metrics", format="parquet", partitioning="hive")
    assert "run-a" in set(dataset.to_table(columns=["run_id"]).column("run_id").to_pylist())


def test_spool_ingest_end_to_end(tmp_path: Path) -> None:
    run = _story()
    with SpoolWriter(tmp_path / "spool") as w:
        for raw in run.events:
            w.append(raw)
        w.append(b"not an event")
    ledger = Ledger.create(tmp_path / "l")
    stats = ingest_spool(ledger, tmp_path / "spool", batch_size=7)
    assert (stats.accepted, stats.quarantined) == (len(run.events), 1)
    assert ingest_spool(ledger, tmp_path / "spool").accepted == 0


def test_arrow_answers_what_sql_answers_and_refuses_the_same(tmp_path: Path) -> None:
    run = _story()
    Ledger.create(tmp_path / "l").commit(_records(run.events))
    reader = Reader(tmp_path / "l")
    q = "SELECT step, value FROM metrics WHERE run_id = ? AND name = 'loss' ORDER BY step"
    table = reader.arrow(q, ["run-a"])
    assert table.column_names == ["step", "value"]
    assert [tuple(r.values()) for r in table.to_pylist()] == reader.sql(q, ["run-a"]).rows
    assert table.num_rows == 30  # the canonical series: attempt 1's steps past the resume are superseded
    with pytest.raises(QueryError, match="read-only"):
        reader.arrow("DELETE FROM metrics")
    with pytest.raises(QueryError, match="2 statements"):
        reader.arrow("SELECT 1; SELECT 2")


def _commit_files(root: Path) -> dict[Path, Path]:
    """The data files the lake's newest commit added, by table and partition folder (their names
    are the lake's own, new each time)."""
    record = json.loads(sorted((root / "_commits").glob("*.json"))[-1].read_bytes())
    tables = root / "data" / "main"
    files = [Path(f["path"]) for f in record["lake_files"]]
    by_folder = {file.parent.relative_to(tables): file for file in files}
    assert len(by_folder) == len(files), files
    return by_folder


def test_rows_made_arrow_in_chunks_store_what_one_conversion_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit turns each group's rows into Arrow every CHUNK_ROWS rows (memory); with a chunk of 3
    rows, every table holds the same rows in the same order as with one conversion at the commit."""
    raws = _story().events
    Ledger.create(tmp_path / "whole").commit(_records(raws))
    monkeypatch.setattr("runledger.ledger.projectors.CHUNK_ROWS", 3)
    result = Ledger.create(tmp_path / "chunked").commit(_records(raws))
    assert result.accepted == len(raws) and result.metric_values == 35 * 4  # loss, lr, tokens, aux
    whole, chunked = _commit_files(tmp_path / "whole"), _commit_files(tmp_path / "chunked")
    assert sorted(whole) == sorted(chunked)  # the same tables and partitions, a file each
    filled = set()
    for folder, file in whole.items():
        expected = pq.read_table(file).to_pylist()
        got = pq.read_table(chunked[folder]).to_pylist()
        if folder.parts[0] == "salts":  # fresh random salts: the same rows but for the salt itself
            assert all(len(row.pop("salt")) == 16 for row in expected + got)
        assert got == expected, folder
        filled |= {folder.parts[0]} if expected else set()
    assert filled >= {"events", "metrics", "configs", "config_changes", "launches", "state_events"}
