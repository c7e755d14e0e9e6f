"""A flood of incidents cannot slow every question (issue 42): ingest records one ``ledger.incident``
per event whose source skipped its ``seq`` (the record, kept), but ``ledger state`` and ``ledger
history`` read them in summary: one range per source and kind (how many, first..last seq, step and
time), and of a kind with many sources the few with the most incidents apart and the rest as one.

* A flood: 40 ranks numbered from one counter, so every rank event after a rank's first is a gap
  (2,360 incidents), on a ledger of part files and on a DuckLake lake: the state and the history show
  at most ``SOURCES_APART`` lines, whose counts and ranges are the incidents' raw rows (read with
  ``ledger query``) folded here, also as of an earlier step.
* A few incidents read as before: one gap of one source is the same line it always was; two gaps of
  one source are one range that counts both.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.fold import EVERY_STATE_TYPE, SOURCES_APART, STATE_TYPES
from runledger.ledger.history import history_counts
from runledger.ledger.live_page import RunFeed, _config_before
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.ledger.views import incident_range_facts, incident_ranges_query
from runledger.schemas import Envelope, config_hash, make_event
from runledger.schemas.launch import Provenance, launch_event, launch_fields
from runledger.schemas.payloads import RankStats, StepMetrics

RUN = "flood"
MAIN = f"trainer/{RUN}/a1/rank0"
RANKS, STEPS = 40, 60  # each rank reports every step from its start (step 1, 2 or 3)
GAPS = sum(STEPS - 1 - rank % 3 for rank in range(RANKS))  # each rank's events but its first: 2,321
runner = CliRunner()


def launch() -> Envelope:
    fields = launch_fields(
        config={"lr": 0.1},
        config_hash=config_hash({"lr": 0.1}),
        provenance=Provenance(host="h", git_commit=None, software={}),
        repository=None,
        world_size=RANKS,
        external={},
    )
    payload, _ = launch_event(fields, attempt=1)
    return make_event(payload, source=MAIN, stream=RUN, run_id=RUN, attempt=1, step=0, seq=0, id="start")


def metric(step: int, seq: int) -> Envelope:
    return make_event(
        StepMetrics(loss=1.0 / step), source=MAIN, stream=RUN, run_id=RUN, attempt=1, step=step, seq=seq
    )


def rank_event(rank: int, step: int, seq: int) -> Envelope:
    stats = RankStats(rank=rank, host=f"node-{rank}", step_time_s=1.0)
    source = f"trainer/{RUN}/a1/ranks/{rank:02d}"
    return make_event(stats, source=source, stream=RUN, run_id=RUN, attempt=1, step=step, seq=seq)


def flood_events() -> list[Envelope]:
    """Every step: the main source's metric, and one event of each rank that has started (rank r from
    step 1 + r % 3: so ranks differ in how many gaps they have), all ranks numbered from one shared
    counter (a rank's seq skips on every event after its first: one gap each)."""
    events, shared = [launch()], 0
    for step in range(1, STEPS + 1):
        events.append(metric(step, step))
        for rank in range(RANKS):
            if step >= 1 + rank % 3:
                shared += 1
                events.append(rank_event(rank, step, shared))
    return events


def ledger_of(where: Path, events: Sequence[Envelope], *, lake: bool) -> Path:
    """``events`` through a real spool into a new ledger of part files, or on a DuckLake lake."""
    sink = SpoolSink(where / "spool")
    for envelope in events:
        sink.emit(envelope)
    sink.close()
    root = where / "ledger"
    if lake:
        Ledger.create_on_lake(root, f"sqlite:{where / 'catalog.sqlite'}").close()
        ingest_spool(Ledger.open(root), where / "spool")
    else:
        ingest_spool(Ledger.create(root), where / "spool")
    return root


@pytest.fixture(scope="module", params=["parts", "lake"])
def flood(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ledger_of(
        tmp_path_factory.mktemp(f"flood-{request.param}"), flood_events(), lake=request.param == "lake"
    )


def cli(ledger: Path, *args: str) -> str:
    result = runner.invoke(app, [*args, "--ledger", str(ledger)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.stdout


def raw_incidents(ledger: Path, max_step: int | None = None) -> list[dict[str, Any]]:
    """The incidents as stored, one row per ``ledger.incident`` event (``ledger query``), decoded here."""
    where = "" if max_step is None else f" AND step <= {max_step}"
    rows = json.loads(
        cli(
            ledger,
            "query",
            f"SELECT step, time, canonical FROM events WHERE stream = '{RUN}' "
            f"AND type = 'ledger.incident'{where} ORDER BY stream_seq",
            "-f",
            "json",
            "--limit",
            "100000",
        )
    )
    return [{"step": r["step"], "time": r["time"], **json.loads(r["canonical"])["data"]} for r in rows]


def folded_here(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The raw gaps folded as the summary should: per source (in first-seen order, the most incidents
    first), the first ``SOURCES_APART - 1`` apart and the rest as one."""
    per: dict[str, list[dict[str, Any]]] = {}
    for row in raw:
        assert row["kind"] == "gap"
        per.setdefault(row["source"], []).append(row)
    ranked = sorted(per.values(), key=lambda rows: -len(rows))
    groups = [*([rows] for rows in ranked[: SOURCES_APART - 1]), ranked[SOURCES_APART - 1 :]]
    out = []
    for group in groups:
        rows = [row for rows in group for row in rows]
        out.append(
            {
                "sources": len(group),
                "source": min(rows[0]["source"] for rows in group),
                "last_source": max(rows[0]["source"] for rows in group),
                "incidents": len(rows),
                "count": sum(row["missing"] for row in rows),
                "first_seq": min(row["expected_seq"] for row in rows),
                "last_seq": max(row["got_seq"] - 1 for row in rows),
                "first_step": min(row["step"] for row in rows),
                "last_step": max(row["step"] for row in rows),
            }
        )
    return sorted(out, key=lambda fact: (fact["first_step"], fact["source"]))


def summary_of(facts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("sources", "source", "last_source", "incidents", "count", "first_seq", "last_seq")
    picked = [{k: f[k] for k in (*keys, "first_step", "last_step")} for f in facts if f["kind"] == "gap"]
    return sorted(picked, key=lambda fact: (fact["first_step"], fact["source"]))


def brief_line(fact: dict[str, Any]) -> str:
    """``ledger state``'s line for a range of many gaps (``folded_here``'s)."""
    where = fact["source"]
    if fact["sources"] > 1:
        where = f"{fact['sources']} sources ({fact['source']} … {fact['last_source']})"
    return (
        f"  incident: {fact['count']} events missing ({fact['incidents']:,} gaps) ({where}, steps "
        f"{fact['first_step']}..{fact['last_step']}, seq {fact['first_seq']}..{fact['last_seq']})"
    )


def history_line(fact: dict[str, Any]) -> str:
    """``ledger history``'s line for a range of many gaps (``folded_here``'s)."""
    where = fact["source"]
    if fact["sources"] > 1:
        where = f"{fact['sources']} sources ({fact['source']} … {fact['last_source']})"
    return (
        f"{fact['incidents']:,} gaps in {where}: {fact['count']:,} events missing "
        f"(seq {fact['first_seq']:,}–{fact['last_seq']:,}; steps {fact['first_step']:,}–{fact['last_step']:,})"
    )


def test_the_state_folds_thousands_of_gaps_into_a_few_ranges(flood: Path) -> None:
    raw = raw_incidents(flood)
    assert len(raw) == GAPS  # recorded one per event: the record is kept
    expected = folded_here(raw)
    # The ranks that started at step 1 have the most gaps: the first four of them stand apart.
    assert [f["source"] for f in expected if f["sources"] == 1] == [
        f"trainer/{RUN}/a1/ranks/{rank:02d}" for rank in (0, 3, 6, 9)
    ]
    state = json.loads(cli(flood, "state", RUN, "-f", "json"))
    assert summary_of(state["incidents"]) == expected
    assert len(state["incidents"]) == SOURCES_APART
    lines = [line for line in cli(flood, "state", RUN).splitlines() if line.startswith("  incident: ")]
    assert sorted(lines) == sorted(brief_line(fact) for fact in expected)


def test_an_earlier_step_counts_only_the_gaps_up_to_it(flood: Path) -> None:
    state = json.loads(cli(flood, "state", RUN, "--step", "30", "-f", "json"))
    assert summary_of(state["incidents"]) == folded_here(raw_incidents(flood, max_step=30))
    assert sum(f["incidents"] for f in state["incidents"]) == sum(30 - 1 - rank % 3 for rank in range(RANKS))


def test_the_history_tells_each_range_once(flood: Path) -> None:
    rows = json.loads(cli(flood, "history", RUN, "--all", "-f", "json"))
    told = [row["what"] for row in rows if row["kind"] == "ledger.incident"]
    assert sorted(told) == sorted(history_line(fact) for fact in folded_here(raw_incidents(flood)))
    reader = Reader(flood)
    try:  # a summarised history's title counts the incidents, not the lines that tell them
        assert history_counts(reader.history(RUN)) == f"1 attempt, {GAPS:,} incidents"
    finally:
        reader.close()


def test_the_sql_summary_is_the_fold_of_every_incident_decoded(flood: Path) -> None:
    """The Reader's state (incidents read in summary) equals the fold handed every incident event
    (``Reader.events`` with ``EVERY_STATE_TYPE``), and so do the ranges read from the events table."""
    reader = Reader(flood)
    try:
        every = reader._state(RUN, reader.events(RUN, EVERY_STATE_TYPE), step=40)
        assert reader.state(RUN, step=40).incidents == every.incidents
        # A ledger from before the state_events table: the same ranges from the events table.
        query, params = incident_ranges_query(RUN, state_table=False, attempt=1, step=40)
        assert incident_range_facts(reader.sql(query, params).records()) == every.incidents
    finally:
        reader.close()


def test_a_few_incidents_read_as_before(tmp_path: Path) -> None:
    other = f"trainer/{RUN}/a1/ranks/07"
    events = [
        launch(),
        *(metric(step, seq) for step, seq in [(1, 1), (2, 2), (3, 8), (4, 9), (5, 12)]),
        rank_event(7, 1, 0),
        rank_event(7, 4, 3),
    ]
    ledger = ledger_of(tmp_path, events, lake=False)
    table = cli(ledger, "state", RUN)
    # One gap of one source: the line it always was; two of one source: one range counting both.
    assert f"  incident: 2 events missing (a gap) ({other})\n" in table
    assert f"  incident: 7 events missing (2 gaps) ({MAIN}, steps 3..5, seq 3..11)\n" in table
    rows = json.loads(cli(ledger, "history", RUN, "--all", "-f", "json"))
    told = [row["what"] for row in rows if row["kind"] == "ledger.incident"]
    assert told == [
        f"2 gaps in {MAIN}: 7 events missing (seq 3–11; steps 3–5)",
        f"gap in {other}: 2 events missing (seq 1–2)",
    ]


def test_the_live_page_draws_no_marker_per_incident(flood: Path) -> None:
    """Each leaf of the stream is still one message (its ids stay contiguous), but an incident's is no
    marker: a flood would put one on the page's charts per event."""
    reader = Reader(flood)
    try:
        rows = reader.sql(
            "SELECT stream_seq, type, canonical FROM events WHERE stream = ? AND stream_seq < 200 "
            "ORDER BY stream_seq",
            [RUN],
        ).rows
        feed = RunFeed(RUN, _config_before(reader, RUN, 0), 0)
        kinds = {kind: feed.message(seq, canonical).text.split("\n")[1] for seq, kind, canonical in rows}
        assert _config_before(reader, RUN, 10**9) == {"lr": 0.1}  # past every incident of the run
    finally:
        reader.close()
    assert kinds["ledger.incident"] == "event: other"
    assert kinds["runledger.run.started"] == "event: marker"
    assert feed.config == {"lr": 0.1}  # the launch's config, the incidents read past


# -- the typed table (issue 42's last item) -------------------------------------------------------
# Each ``ledger.incident`` is also a typed ``ingest_incidents`` row, written by its projector at the
# commit, so the summary reads columns, not each event's JSON. A lake made before the table (its
# marker does not list it) folds the JSON as before, with the same answers.

INCIDENT_COLUMNS = (
    "kind",
    "source",
    "expected_seq",
    "got_seq",
    "missing",
    "expected_prev",
    "got_prev",
    "event_id",
)


def few_incidents() -> list[Envelope]:
    """Two gaps of the main source, one of a rank's."""
    return [
        launch(),
        *(metric(step, seq) for step, seq in [(1, 1), (2, 2), (3, 8), (4, 9), (5, 12)]),
        rank_event(7, 1, 0),
        rank_event(7, 4, 3),
    ]


def without_typed_table(ledger: Path, *, rows: int | None = None) -> None:
    """The ledger as a lake made before ``ingest_incidents`` is: the table not listed in its marker,
    and each incident event a ``state_events`` row too (as that lake's commits wrote them; ``rows``:
    only the first so many)."""
    from runledger.ledger.lake import LakeFolder, LakeTables

    lake = LakeFolder.read(ledger)
    assert lake is not None
    with LakeTables(lake.catalog, lake.data_path, create=False) as tables:
        tables.con.execute(OLD_STATE_ROWS + ("" if rows is None else f" ORDER BY stream_seq LIMIT {rows}"))
    marker = ledger / "LAKE.json"
    body = json.loads(marker.read_text())
    body["tables"] = [name for name in body["tables"] if name != "ingest_incidents"]
    marker.write_text(json.dumps(body))


OLD_STATE_ROWS = """
INSERT INTO lake.state_events (attempt, step, time, type, canonical, stream, stream_seq, run_id)
SELECT attempt, step, time, type, canonical, stream, stream_seq, coalesce(run_id, '_')
FROM lake.events WHERE type = 'ledger.incident'
"""


def test_the_typed_rows_are_the_incident_events_payloads(flood: Path) -> None:
    rows = json.loads(
        cli(
            flood,
            "query",
            f"SELECT * EXCLUDE (run_id) FROM ingest_incidents WHERE run_id = '{RUN}' ORDER BY stream_seq",
            "-f",
            "json",
            "--limit",
            "100000",
        )
    )
    events = json.loads(
        cli(
            flood,
            "query",
            "SELECT attempt, step, time, stream, stream_seq, canonical FROM events "
            f"WHERE stream = '{RUN}' AND type = 'ledger.incident' ORDER BY stream_seq",
            "-f",
            "json",
            "--limit",
            "100000",
        )
    )
    assert len(rows) == len(events) == GAPS
    for row, event in zip(rows, events, strict=True):
        data = json.loads(event.pop("canonical"))["data"]
        assert row == {**event, **{name: data.get(name) for name in INCIDENT_COLUMNS}}


def test_the_typed_summary_is_the_json_summary(flood: Path) -> None:
    reader = Reader(flood)
    try:
        every = reader._state(RUN, reader.events(RUN, EVERY_STATE_TYPE), step=40)
        for typed in (True, False):  # (their JSON: the events table's, as state_events keeps none)
            query, params = incident_ranges_query(
                RUN, state_table=typed, attempt=1, step=40, typed_table=typed
            )
            assert incident_range_facts(reader.sql(query, params).records()) == every.incidents
    finally:
        reader.close()


def test_an_older_lake_without_the_table_answers_the_same(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path, few_incidents(), lake=False)
    answers = [
        cli(ledger, "state", RUN),
        cli(ledger, "history", RUN, "--all"),
        cli(ledger, "state", RUN, "-f", "json"),
    ]
    assert "(2 gaps)" in answers[0] and "(a gap)" in answers[0]
    without_typed_table(ledger)
    reader = Reader(ledger)
    try:  # the table is not among the reader's names: its summary is the JSON's
        with pytest.raises(Exception, match="ingest_incidents"):
            reader.sql("SELECT count(*) FROM ingest_incidents")
    finally:
        reader.close()
    assert [
        cli(ledger, "state", RUN),
        cli(ledger, "history", RUN, "--all"),
        cli(ledger, "state", RUN, "-f", "json"),
    ] == answers
    # A table it does not list is not checked; its state_events' incidents are (the rows added
    # here by hand are a file no commit record names: a warning, not a problem).
    assert cli(ledger, "verify").splitlines()[-1].startswith("OK: ")


def test_verify_names_a_changed_typed_row(tmp_path: Path) -> None:
    from runledger.ledger.integrity import verify_ledger
    from runledger.ledger.lake import LakeFolder, LakeTables

    ledger = ledger_of(tmp_path, few_incidents(), lake=False)
    assert verify_ledger(ledger).ok
    marker = LakeFolder.read(ledger)
    assert marker is not None
    with LakeTables(marker.catalog, marker.data_path, create=False) as tables:
        tables.con.execute("UPDATE lake.ingest_incidents SET missing = missing + 1 WHERE kind = 'gap'")
    problems = verify_ledger(ledger).problems
    mismatched = [p for p in problems if p.kind == "table-mismatch"]
    assert mismatched and all("ingest_incidents rows differ" in p.detail for p in mismatched)


def test_migrate_derives_the_typed_rows_a_commit_writes(tmp_path: Path) -> None:
    """``ledger migrate`` gives an old ledger (no ``ingest_incidents``) the rows its incident events
    make: derived from its events table, they are the rows the commits of this code wrote."""
    import duckdb

    from runledger.ledger.lake import LakeFolder, LakeTables
    from runledger.ledger.lake_migrate import _derived_incidents, table_digests

    ledger = ledger_of(tmp_path, few_incidents(), lake=False)
    marker = LakeFolder.read(ledger)
    assert marker is not None
    con = duckdb.connect()
    with LakeTables(marker.catalog, marker.data_path, create=False) as lake, lake.reader() as stored:
        events = stored.execute("SELECT * FROM events").to_arrow_table()
        con.register("old_events", events)
        assert _derived_incidents(con)
        derived = con.execute('SELECT * FROM "old_ingest_incidents" ORDER BY stream_seq').fetchall()
        written = stored.execute("SELECT * FROM ingest_incidents ORDER BY stream_seq").fetchall()
        assert len(derived) == 3 and derived == written  # the main source's two gaps, the rank's one
        assert table_digests(con, '"old_ingest_incidents"', "ingest_incidents") == table_digests(
            stored, "ingest_incidents", "ingest_incidents"
        )
    con.close()


# -- the fold's scan (issue 42): ingest's incidents are typed rows, not state events ----------------
# ``state_events`` (what the fold scans) holds no ``ledger.incident``: with 2,321 incidents it holds
# the rows it holds with none. A lake made before the typed table keeps them there: without the table
# verify expects each there; with it (a lake written before, or migrated, then ingesting anew), each
# one kept there must be as the log says.


def test_the_fold_scans_no_incident(flood: Path) -> None:
    reader = Reader(flood)
    try:
        kinds = dict(reader.sql("SELECT type, count(*) FROM state_events GROUP BY type").rows)
        typed = reader.sql("SELECT count(*) FROM ingest_incidents").rows[0][0]
        decoded = reader.events(RUN)
    finally:
        reader.close()
    assert "ledger.incident" not in kinds and set(kinds) <= set(STATE_TYPES)
    assert typed == GAPS  # each incident a typed row: the state reads those
    assert [e.type for e in decoded] == ["runledger.run.started"]


def mismatched_tables(ledger: Path) -> list[str]:
    from runledger.ledger.integrity import verify_ledger

    return [p.detail for p in verify_ledger(ledger).problems if p.kind == "table-mismatch"]


def test_verify_checks_the_incidents_an_older_lakes_state_events_keeps(tmp_path: Path) -> None:
    from runledger.ledger.lake import LakeFolder, LakeTables

    ledger = ledger_of(tmp_path, few_incidents(), lake=False)
    marker = LakeFolder.read(ledger)
    assert marker is not None

    def edit(*statements: str) -> None:
        with LakeTables(marker.catalog, marker.data_path, create=False) as tables:
            for statement in statements:
                tables.con.execute(statement)

    # One incident's row as an older commit wrote it, beside the typed table: kept, and checked.
    edit(OLD_STATE_ROWS + " ORDER BY stream_seq LIMIT 1")
    assert mismatched_tables(ledger) == []
    edit("UPDATE lake.state_events SET step = step + 1 WHERE type = 'ledger.incident'")
    assert mismatched_tables(ledger) == ["state_events rows differ from what the event records"]
    # Without the typed table (a lake made before it) each incident must be there: one is missing.
    (tmp_path / "older").mkdir()
    older = ledger_of(tmp_path / "older", few_incidents(), lake=False)
    without_typed_table(older, rows=2)
    assert mismatched_tables(older) == ["state_events rows differ from what the event records"]
