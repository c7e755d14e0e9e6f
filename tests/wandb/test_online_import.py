"""Online W&B import (``ledger ingest wandb ENTITY/PROJECT[/RUN]``) against a local W&B API stand-in.

The real ``wandb`` client (its public API through ``wandb-core``) talks HTTP to
``tests/support/wandb_api_server.py``, which answers from ``tests/fixtures/wandb_api/``; the events go
through a real spool into a real ledger, and the answers are read back with SQL.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolReader
from runledger.ingest.spool_ingester import IngestStats, ingest_spool
from runledger.ledger import registry
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.schemas import Event, decode_event
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import ProducerScope
from tests.support.wandb_api_server import FIXTURES, RecordedRun, WandbApiServer

PROJECT = "runledger-lab/moe-reference"
API_KEY = "local0test0key0" + "0" * 25
RESTARTED, LONG = "moe-ref-7b1x", "moe-ref-2c9k"


def fixture_rows(run: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / "runs" / run / "history.jsonl").read_text().splitlines()]


@pytest.fixture
def wandb_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WandbApiServer]:
    """The stand-in server, with wandb pointed at it the way a user would: WANDB_BASE_URL + WANDB_API_KEY."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # no ~/.netrc key from the machine
    for key in (
        "WANDB_MODE",
        "WANDB_ENTITY",
        "WANDB_PROJECT",
        "RUNLEDGER_PRODUCER_KEY",
        "RUNLEDGER_KAFKA_BOOTSTRAP",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, folder in (
        ("WANDB_DIR", "wandb"),
        ("WANDB_CONFIG_DIR", "wandb-config"),
        ("WANDB_CACHE_DIR", "wandb-cache"),
    ):
        (tmp_path / folder).mkdir()
        monkeypatch.setenv(key, str(tmp_path / folder))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    with WandbApiServer(api_key=API_KEY) as server:
        monkeypatch.setenv("WANDB_BASE_URL", server.base_url)
        monkeypatch.setenv("WANDB_API_KEY", API_KEY)
        yield server
    import wandb

    wandb.teardown()


def ingest(args: list[str]) -> Any:
    return CliRunner().invoke(app, ["ingest", "wandb", *args])


def outputs(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects the command printed, one per imported run."""
    decoder, found, text = json.JSONDecoder(), [], stdout.strip()
    while text:
        value, end = decoder.raw_decode(text)
        found.append(value)
        text = text[end:].strip()
    return found


def to_ledger(spool: Path, root: Path) -> tuple[IngestStats, Reader]:
    """The spool folded into a new ledger, and a reader of it (as every command reads it)."""
    stats = ingest_spool(Ledger.create(root), spool)
    return stats, Reader(root)


def spooled(spool: Path) -> list[Event]:
    decoded = [decode_event(r.payload) for r in SpoolReader(spool).read()]
    assert all(isinstance(d, Event) for d in decoded)
    return decoded  # type: ignore[return-value]


def test_project_import_pages_retries_429_maps_restart_and_skips_unreadable_runs(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    wandb_api.rate_limit(3, retry_after_s=1)
    result = ingest([PROJECT, "--spool", str(spool)])

    # Two runs were refused (deleted; forbidden): one line each, exit 1, and the others imported.
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        f"error: {PROJECT}/moe-ref-dl0d: cannot read the run: project.run run moe-ref-dl0d not found",
        f"error: {PROJECT}/moe-ref-priv: cannot read the run: permission denied",
    ]
    printed = {o["run_id"]: o for o in outputs(result.stdout)}
    assert sorted(printed) == [LONG, RESTARTED]
    assert printed[RESTARTED]["rows"] == 1200 and printed[RESTARTED]["attempts"] == 2
    assert printed[LONG]["rows"] == 1500 and printed[LONG]["skipped_values"] == 3  # three text samples
    assert all(o["finished"] and o["resumed_at_step"] is None for o in printed.values())

    # The client really was rate limited (and waited), and really paged runs and history.
    statuses = [s.status for s in wandb_api.seen]
    assert statuses.count(429) == 3 and statuses[3] == 200
    assert len(wandb_api.operations("Runs")) == 1  # 4 runs, 50 per page
    pages = [(s.variables["run"], s.variables["minStep"]) for s in wandb_api.operations("HistoryPage")]
    assert pages == [(RESTARTED, 0), (RESTARTED, 1000), (LONG, 0), (LONG, 1000)]

    stats, reader = to_ledger(spool, tmp_path / "ledger")
    assert stats.quarantined == 0
    assert reader.sql("SELECT DISTINCT run_id FROM events WHERE run_id IS NOT NULL ORDER BY 1").rows == [
        (LONG,),
        (RESTARTED,),
    ]
    # Every logged value, as W&B holds it; a loss W&B stored as "NaN" is null, which the metrics view
    # leaves out (that step's other values are there).
    for run in (RESTARTED, LONG):
        loss = dict(reader.sql("SELECT step, value FROM metrics WHERE run_id=? AND name='loss'", [run]).rows)
        expected = {r["_step"]: r["loss"] for r in fixture_rows(run)}
        nan_steps = [step for step, value in expected.items() if value == "NaN"]
        assert nan_steps == ([1337] if run == LONG else [])
        assert loss.keys() == expected.keys() - set(nan_steps)
        for step, value in loss.items():
            assert math.isclose(value, expected[step], rel_tol=1e-12), (run, step)
        drop = reader.sql(
            "SELECT count(*) FROM metrics WHERE run_id=? AND name='router/layer2/token_drop_rate'", [run]
        ).rows[0]
        assert drop == (len(expected),)

    # The restart: attempt 2 starts at the first row W&B kept after the relaunch (step 700; W&B refused
    # 601-699), launched at that row's time minus its runtime, with the W&B run URL in external.
    attempts = reader.sql(
        "SELECT attempt, kind, start_step, epoch(started_at), external FROM attempts WHERE run_id=? ORDER BY 1",
        [RESTARTED],
    ).rows
    rows = fixture_rows(RESTARTED)
    relaunch = rows[700]
    assert [(a, k, s) for a, k, s, _, _ in attempts] == [(1, "start", 0), (2, "resume", 699)]
    assert math.isclose(attempts[1][3], relaunch["_timestamp"] - relaunch["_runtime"], abs_tol=1e-3)
    external = json.loads(attempts[1][4]) if isinstance(attempts[1][4], str) else attempts[1][4]
    assert external["wandb_url"] == f"{wandb_api.base_url}/{PROJECT}/runs/{RESTARTED}"
    by_attempt = reader.sql(
        "SELECT attempt, min(step), max(step) FROM metrics WHERE run_id=? AND name='loss' GROUP BY 1 ORDER BY 1",
        [RESTARTED],
    ).rows
    assert by_attempt == [(1, 0, 699), (2, 700, 1199)]
    # System samples dated into the attempt that was live, run ends mapped from W&B's state.
    system = reader.sql(
        "SELECT attempt, count(*) FROM rank_stats WHERE run_id=? GROUP BY 1 ORDER BY 1", [RESTARTED]
    )
    assert [a for a, _ in system.rows] == [1, 2]
    ends = dict(reader.sql("SELECT run_id, status FROM run_ends").rows)
    assert ends == {RESTARTED: "completed", LONG: "failed"}  # W&B "finished" and "crashed"


def test_second_import_adds_nothing_and_a_fresh_reimport_is_all_duplicates(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    target = f"{PROJECT}/{LONG}"
    first, again = tmp_path / "first", tmp_path / "again"
    assert ingest([target, "--spool", str(first)]).exit_code == 0
    rerun = ingest([target, "--spool", str(first)])  # same cursor file: nothing left to import
    assert rerun.exit_code == 0 and outputs(rerun.stdout)[0]["events"] == 0
    # A re-import that forgot everything (another cursor file) makes the same ids and the same bytes.
    fresh = ingest([target, "--spool", str(again), "--cursor-file", str(tmp_path / "other.json")])
    assert fresh.exit_code == 0

    root = tmp_path / "ledger"
    stats_first = ingest_spool(Ledger.create(root), first)
    stats_again = ingest_spool(Ledger.open(root), again)
    assert stats_first.accepted == len(spooled(first)) and stats_first.quarantined == 0
    assert stats_again.accepted == 0 and stats_again.quarantined == 0
    assert stats_again.duplicates == stats_first.accepted


def test_an_interrupted_history_read_resumes_at_the_next_row(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    wandb_api.fail_history(LONG, after_pages=1)
    broken = ingest([f"{PROJECT}/{LONG}", "--spool", str(spool)])
    assert broken.exit_code == 1
    assert broken.stderr.strip().splitlines() == [
        f"error: {PROJECT}/{LONG}: history read failed after step 999: HTTP 400: history temporarily unavailable "
        "(run the import again to continue)"
    ]
    cursor = json.loads((tmp_path / "spool.wandb-cursors.json").read_text())["runs"][f"{PROJECT}/{LONG}"]
    assert cursor["next_step"] == 1000 and not cursor["done"]

    wandb_api.heal()
    resumed = ingest([f"{PROJECT}/{LONG}", "--spool", str(spool)])
    assert resumed.exit_code == 0, resumed.output
    [stats] = outputs(resumed.stdout)
    assert stats["resumed_at_step"] == 1000 and stats["rows"] == 500 and stats["finished"]

    events = spooled(spool)
    ids = [e.envelope.id for e in events]
    assert len(ids) == len(set(ids))  # nothing emitted twice
    ledger_stats, reader = to_ledger(spool, tmp_path / "ledger")
    assert ledger_stats.duplicates == 0 and ledger_stats.quarantined == 0
    lr_steps = reader.sql("SELECT count(DISTINCT step), min(step), max(step) FROM metrics WHERE name='lr'")
    assert lr_steps.rows == [(1500, 0, 1499)]
    # Each source's seq is contiguous across the two processes: no gap, no fork.
    for source in {e.envelope.source for e in events}:
        seqs = [e.envelope.seq for e in events if e.envelope.source == source]
        assert seqs == list(range(len(seqs))), source


def test_signed_import_is_admitted_by_its_registered_key_and_an_unregistered_key_is_quarantined(
    wandb_api: WandbApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered_key, registered_pub = write_keypair(tmp_path / "keys", "wandb-importer")
    stranger_key, _ = write_keypair(tmp_path / "keys", "stranger")
    root = tmp_path / "ledger"
    ledger = Ledger.create(root)
    registry.register_producer(
        ledger, "wandb-importer", registered_pub.read_text().strip(), ProducerScope(sources=["wandb-api:"])
    )

    monkeypatch.setenv("RUNLEDGER_PRODUCER_KEY", str(registered_key))
    signed = tmp_path / "signed"
    assert ingest([f"{PROJECT}/{RESTARTED}", "--spool", str(signed)]).exit_code == 0
    events = spooled(signed)
    assert {e.envelope.key_id for e in events} == {
        "wandb-importer+" + registered_pub.read_text().split("+")[1]
    }
    stats = ingest_spool(ledger, signed)
    assert stats.accepted == len(events) and stats.quarantined == 0

    monkeypatch.setenv("RUNLEDGER_PRODUCER_KEY", str(stranger_key))
    forged = tmp_path / "forged"
    result = ingest([f"{PROJECT}/{LONG}", "--spool", str(forged)])
    assert result.exit_code == 0
    stats = ingest_spool(Ledger.open(root), forged)
    assert stats.accepted == 0 and stats.quarantined == len(spooled(forged))
    reasons = Reader(root).sql("SELECT DISTINCT reason FROM quarantine").rows
    assert [r.split(":")[0] for (r,) in reasons] == ["unknown-key"]

    monkeypatch.setenv("RUNLEDGER_PRODUCER_KEY", str(tmp_path / "keys" / "missing.key"))
    missing = ingest([f"{PROJECT}/{LONG}", "--spool", str(tmp_path / "unused")])
    assert missing.exit_code == 2
    assert missing.stderr.startswith("error: cannot read producer key $RUNLEDGER_PRODUCER_KEY: No such file")


def test_hostile_history_rows_are_counted_not_fatal(wandb_api: WandbApiServer, tmp_path: Path) -> None:
    """Rows nobody here logged: deep nesting, a 64 KiB key, non-ASCII, W&B's media dicts, booleans,
    ±Infinity strings, a row without ``_step``: each is skipped or nulled, the rest lands."""
    fixtures = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, fixtures)
    history = fixtures / "runs" / LONG / "history.jsonl"
    rows = fixture_rows(LONG)[:40]
    deep: Any = 1.0
    for _ in range(200):
        deep = {"d": deep}
    rows[3]["media"] = {"_type": "image-file", "path": "media/images/sample_3.png", "sha256": "ab" * 32}
    rows[4]["nested"] = deep
    rows[5]["k" * 65536] = 2.5
    rows[6]["débit/échantillons ✓"] = 0.5
    rows[7]["grad_norm"] = "-Infinity"
    rows[8]["flag"] = True
    rows[9]["loss"] = "NaN"
    del rows[10]["_step"]
    history.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with WandbApiServer(fixtures, api_key=API_KEY) as hostile:
        spool = tmp_path / "spool"
        result = CliRunner(env={"WANDB_BASE_URL": hostile.base_url}).invoke(
            app, ["ingest", "wandb", f"{PROJECT}/{LONG}", "--spool", str(spool)]
        )
    assert result.exit_code == 0, result.output
    [stats] = outputs(result.stdout)
    assert stats["rows"] == 39  # the row without _step is not a step
    stats_ledger, reader = to_ledger(spool, tmp_path / "ledger")
    assert stats_ledger.quarantined == 0
    unicode = reader.sql("SELECT step, value FROM metrics WHERE name = 'débit/échantillons ✓'").rows
    assert unicode == [(6, 0.5)]
    steps = {
        e.envelope.step: e.envelope.data
        for e in spooled(spool)
        if e.envelope.type == "runledger.step.metrics"
    }
    assert steps[7].grad_norm is None and steps[9].loss is None  # "-Infinity" and "NaN" → null
    assert steps[7].loss == rows[7]["loss"] and steps[8].scalars["flag"] == 1.0  # a bool as 1/0, as bridged
    long_key = reader.sql("SELECT value FROM metrics WHERE step = 5 AND length(name) = 65536").rows
    assert long_key == [(2.5,)]


def test_argument_is_a_local_path_when_it_exists_else_a_wandb_path(
    wandb_api: WandbApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = ingest(["not a path/nor a project!"])  # neither a path that exists nor ENTITY/PROJECT[/RUN]
    assert bad.exit_code == 2
    assert bad.stderr.strip() == "error: no such directory: not a path/nor a project!"
    need_run = ingest([PROJECT, "--run-id", "x"])
    assert (
        need_run.exit_code == 2
        and need_run.stderr.strip() == "error: --run-id needs one run (ENTITY/PROJECT/RUN)"
    )
    local = tmp_path / "runledger-lab" / "moe-reference"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    offline = ingest([PROJECT])  # exists here as a directory: read as an offline run, not fetched
    assert offline.exit_code == 2
    assert offline.stderr.strip() == f"error: no W&B run (run-*.wandb) under {PROJECT}"
    assert wandb_api.operations("Runs") == []


def test_a_wrong_api_key_is_one_line(wandb_api: WandbApiServer, tmp_path: Path) -> None:
    result = CliRunner(env={"WANDB_API_KEY": "wrong0key0" + "0" * 30}).invoke(
        app, ["ingest", "wandb", PROJECT, "--spool", str(tmp_path / "spool")]
    )
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot connect to W&B: ")
    assert not (tmp_path / "spool").exists() or spooled(tmp_path / "spool") == []


def test_a_run_still_going_continues_on_the_next_import_exactly_as_one_import_of_the_whole_run(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    full = wandb_api.runs[LONG]
    wandb_api.runs[LONG] = RecordedRun(
        dict(full.node, state="running", historyKeys=dict(full.node["historyKeys"], lastStep=799)),
        full.history_lines[:800],
        full.event_lines[:30],
    )
    target, live = f"{PROJECT}/{LONG}", tmp_path / "live"
    early = ingest([target, "--spool", str(live)])
    assert early.exit_code == 0, early.output
    [stats] = outputs(early.stdout)
    assert (stats["rows"], stats["system_samples"], stats["finished"]) == (800, 30, False)

    wandb_api.runs[LONG] = full  # the run went on, then crashed
    later = ingest([target, "--spool", str(live)])
    [stats] = outputs(later.stdout)
    assert (stats["resumed_at_step"], stats["rows"], stats["system_samples"], stats["finished"]) == (
        800,
        700,
        29,
        True,
    )

    once = tmp_path / "once"
    assert ingest([target, "--spool", str(once), "--cursor-file", str(tmp_path / "once.json")]).exit_code == 0
    in_two = [r.payload for r in SpoolReader(live).read()]
    in_one = [r.payload for r in SpoolReader(once).read()]
    assert len(in_two) == len(in_one) == 1 + 1500 + 59 + 2
    assert set(in_two) ^ set(in_one) == set(), sorted(set(in_two) ^ set(in_one))[:2]  # the same bytes


def test_github_backfill_is_signed_by_the_same_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ledger ingest github`` goes through the same sink helper: signed with the configured key,
    admitted when it is registered for ``github`` sources."""
    from tests.support.github import FIXTURES as GITHUB_FIXTURES
    from tests.support.github import FixtureGitHub

    private, public = write_keypair(tmp_path / "keys", "github-backfill")
    ledger = Ledger.create(tmp_path / "ledger")
    registry.register_producer(
        ledger, "github-backfill", public.read_text().strip(), ProducerScope(sources=["github-backfill"])
    )
    monkeypatch.setenv("RUNLEDGER_PRODUCER_KEY", str(private))
    monkeypatch.delenv("RUNLEDGER_KAFKA_BOOTSTRAP", raising=False)
    routes = [
        r for r in json.loads((GITHUB_FIXTURES / "routes.json").read_text())["routes"] if not r.get("once")
    ]
    spool = tmp_path / "spool"
    with FixtureGitHub(routes=routes) as github:
        result = CliRunner(env={"GITHUB_TOKEN": ""}).invoke(
            app,
            [
                "ingest",
                "github",
                "octo-org/hello-world",
                "--base-url",
                github.base_url,
                "--spool",
                str(spool),
                "--request-interval",
                "0",
            ],
        )
    assert result.exit_code == 0, result.output
    events = spooled(spool)
    assert events and all(e.envelope.signature and e.envelope.prev is None for e in events)
    stats = ingest_spool(ledger, spool)
    assert stats.accepted == len(events) and stats.quarantined == 0


def test_an_unknown_project_a_broken_cursor_file_and_a_changed_run_id_are_one_line_each(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    unknown = ingest(["runledger-lab/no-such-project", "--spool", str(spool)])
    assert unknown.exit_code == 1 and unknown.stdout == ""
    assert unknown.stderr.strip() == (
        "error: runledger-lab/no-such-project: cannot list runs: Could not find project no-such-project"
    )

    cursor_file = tmp_path / "cursors.json"
    cursor_file.write_text('{"version": 1, "runs": {"a/b/c": {"run_id": 7}}}')
    broken = ingest([PROJECT, "--spool", str(spool), "--cursor-file", str(cursor_file)])
    assert broken.exit_code == 2
    [line] = broken.stderr.strip().splitlines()
    assert line.startswith(f"error: unreadable cursor file {cursor_file}: Expected `str`, got `int`")

    target = f"{PROJECT}/{RESTARTED}"
    assert ingest([target, "--spool", str(spool), "--run-id", "moe-a"]).exit_code == 0
    renamed = ingest([target, "--spool", str(spool), "--run-id", "moe-b"])
    assert renamed.exit_code == 1
    assert renamed.stderr.strip() == (
        f"error: {target} was imported as run 'moe-a'; import it again with --run-id moe-a "
        "(or a new --cursor-file and --spool)"
    )
    assert {e.envelope.run_id for e in spooled(spool)} == {"moe-a"}


def test_help_names_both_forms_with_an_example() -> None:
    result = CliRunner().invoke(app, ["ingest", "wandb", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Usage: ledger ingest wandb [OPTIONS] PATH|ENTITY/PROJECT[/RUN]" in result.output
    assert "Example: WANDB_API_KEY=… ledger ingest wandb my-team/moe-pretrain" in result.output
    assert "A local path that exists wins." in result.output


def test_the_library_pages_runs_and_history_in_the_sizes_asked(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    from runledger.ingest.bus import SpoolSink
    from runledger.ingest.wandb_cursor import CursorStore
    from runledger.ingest.wandb_online import import_online, open_api

    sink = SpoolSink(tmp_path / "spool")
    try:
        result = import_online(
            PROJECT, sink, CursorStore(tmp_path / "c.json"), api=open_api(), page_rows=300, per_page=3
        )
    finally:
        sink.close()
    assert [s.variables["cursor"] for s in wandb_api.operations("Runs")] == [None, "3"]  # 4 runs, 3 a page
    pages = [
        s.variables["minStep"] for s in wandb_api.operations("HistoryPage") if s.variables["run"] == RESTARTED
    ]
    assert pages == [0, 300, 600, 900]
    assert [(r.run_id, r.rows, r.attempts) for r in result.runs] == [(RESTARTED, 1200, 2), (LONG, 1500, 1)]
    assert len(result.errors) == 2
    assert len(spooled(tmp_path / "spool")) == sum(r.events for r in result.runs)


def test_a_restart_whose_runtime_w_and_b_carried_on_is_found_by_the_clock_gap(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    """W&B may continue ``_runtime`` across a resume; then only ``_timestamp`` jumping ahead of it
    (the process was down) shows the restart. A rewound ``_step`` is a restart too."""
    from runledger.ingest.wandb_cursor import RunCursor
    from runledger.ingest.wandb_online import RELAUNCH_GAP_S, _RunImport

    full = wandb_api.runs[LONG]
    rows = [json.loads(line) for line in full.history_lines]
    for row in rows[800:]:
        row["_timestamp"] += 3600.0  # an hour down; the runtime carried on from where it was
    wandb_api.runs[LONG] = RecordedRun(full.node, [json.dumps(r) for r in rows], full.event_lines)
    spool = tmp_path / "spool"
    result = ingest([f"{PROJECT}/{LONG}", "--spool", str(spool)])
    assert result.exit_code == 0, result.output
    assert outputs(result.stdout)[0]["attempts"] == 2
    _, reader = to_ledger(spool, tmp_path / "ledger")
    attempts = reader.sql(
        "SELECT attempt, start_step, epoch(started_at) FROM attempts WHERE run_id=? ORDER BY 1", [LONG]
    ).rows
    assert [(a, s) for a, s, _ in attempts] == [(1, 0), (2, 799)]
    assert math.isclose(attempts[1][2], rows[800]["_timestamp"] - rows[800]["_runtime"], abs_tol=1e-3)

    cursor = RunCursor(run_id="r", prev_step=10, prev_runtime_s=100.0, prev_timestamp_s=1000.0)
    assert _RunImport.is_relaunch(cursor, 11, 101.0, 1001.0) is False  # the next row
    assert _RunImport.is_relaunch(cursor, 11, 101.0, 1001.0 + RELAUNCH_GAP_S - 5) is False  # a slow step
    assert _RunImport.is_relaunch(cursor, 11, 101.0, 1002.0 + RELAUNCH_GAP_S) is True  # down, runtime carried
    assert _RunImport.is_relaunch(cursor, 11, 3.0, 2000.0) is True  # runtime from zero again
    assert _RunImport.is_relaunch(cursor, 7, 101.0, 1001.0) is True  # a rewind W&B kept


# -- define_metric step metrics: the same steps as the offline import and the bridge ---------------


def _offline_trainer_run(root: Path, steps: int, eval_every: int) -> Path:
    """A real W&B offline run logged as the Hugging Face Trainer logs: ``train/global_step`` is the
    step metric of everything (``define_metric("*", step_metric=…)``), an eval row follows some train
    rows at the same global step (W&B's step_sync puts the step into it). Returns its .wandb file."""
    from runledger.ingest.wandb_import import find_offline_runs
    from runledger.ingest.wandb_mirror import offline_environment

    settings = offline_environment(root)
    Path(settings["WANDB_DIR"]).mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in settings.items():
            patch.setenv(key, value)
        for key in ("WANDB_API_KEY", "WANDB_BASE_URL"):
            patch.delenv(key, raising=False)
        import wandb

        run = wandb.init(project="hf", config={"lr": 1e-4}, settings=wandb.Settings(console="off"))
        run.define_metric("train/global_step")
        run.define_metric("*", step_metric="train/global_step", step_sync=True)
        for step in range(1, steps + 1):
            run.log({"train/global_step": step, "train/loss": 3.0 - step / 100, "train/learning_rate": 1e-4})
            if step % eval_every == 0:
                run.log({"eval/loss": 3.2 - step / 100})  # no step given: step_sync adds it
        run.finish()
        wandb.teardown()
    [wandb_file] = find_offline_runs(Path(settings["WANDB_DIR"]) / "wandb")
    return wandb_file


def _run_config_metrics(metric_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run config's ``_wandb.m`` that wandb-core uploads for these ``metric`` records
    (``runmetric.ToRunConfigData``): by proto field number, "1" name or "2" glob name, "5" the step
    metric's 1-based index in the list (the step metric gets an entry of its own first)."""
    encoded: list[dict[str, Any]] = []
    index: dict[str, int] = {}

    def add(name: str, glob: bool, step_metric: str | None) -> None:
        if name in index:
            return
        index[name] = len(encoded)
        entry: dict[str, Any] = {"2" if glob else "1": name, "6": [3]}
        encoded.append(entry)
        if step_metric:
            add(step_metric, False, None)
            entry["5"] = index[step_metric] + 1

    for record in metric_records:
        glob = bool(record.get("glob_name"))
        add(record.get("glob_name") or record["name"], glob, record.get("step_metric"))
    return encoded


def _as_recorded(wandb_api: WandbApiServer, wandb_file: Path, *, rows: int | None, state: str) -> RecordedRun:
    """The offline run as W&B's server would hold it (its history rows, its config with ``_wandb.m``),
    served under the LONG run's name; ``rows``: only the first so many history rows so far."""
    from runledger.ingest.wandb_import import read_records

    records = list(read_records(wandb_file))  # a generator: read once
    history = [r["history"]["item"] for r in records if r.get("type") == "history"][:rows]
    metrics = [r["metric"] for r in records if r.get("type") == "metric"]
    node = dict(wandb_api.runs[LONG].node)
    config = json.loads(node["config"])
    config["_wandb"]["value"]["m"] = _run_config_metrics(metrics)
    keys = dict(node["historyKeys"], lastStep=history[-1]["_step"])
    node.update(config=json.dumps(config), state=state, historyKeys=keys, historyLineCount=len(history))
    return RecordedRun(node, [json.dumps(row) for row in history], [])


def _step_events(spool: Path) -> list[tuple[int | None, Any]]:
    return [
        (e.envelope.step, e.envelope.data)
        for e in spooled(spool)
        if e.envelope.type == "runledger.step.metrics"
    ]


def test_define_metric_steps_are_those_of_the_offline_import(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    from runledger.ingest.bus import SpoolSink
    from runledger.ingest.wandb_import import import_offline_run

    wandb_file = _offline_trainer_run(tmp_path / "offline", steps=30, eval_every=5)
    offline = tmp_path / "offline-spool"
    sink = SpoolSink(offline)
    try:
        import_offline_run(wandb_file, sink)
    finally:
        sink.close()
    wandb_api.runs[LONG] = _as_recorded(wandb_api, wandb_file, rows=None, state="finished")
    online = tmp_path / "online-spool"
    result = ingest([f"{PROJECT}/{LONG}", "--spool", str(online)])
    assert result.exit_code == 0, result.output
    assert outputs(result.stdout)[0]["rows"] == 30 + 6  # W&B's rows: the eval rows are rows there

    steps = _step_events(online)
    assert [step for step, _ in steps] == list(range(1, 31))  # train/global_step, one event a step
    evals = {step: data.scalars["eval/loss"] for step, data in steps if "eval/loss" in data.scalars}
    assert evals == {s: pytest.approx(3.2 - s / 100) for s in range(5, 31, 5)}  # merged into its step
    assert steps == _step_events(offline)  # the same steps and values as the offline import
    [end] = [e.envelope.data for e in spooled(online) if e.envelope.type == "runledger.run.finished"]
    assert end.final_step == 30


def test_define_metric_rows_of_a_step_not_complete_wait_for_the_next_import(
    wandb_api: WandbApiServer, tmp_path: Path
) -> None:
    wandb_file = _offline_trainer_run(tmp_path / "offline", steps=20, eval_every=5)
    target, live = f"{PROJECT}/{LONG}", tmp_path / "live"
    # So far W&B holds the train row of global step 10 but not yet its eval row: step 10 is held back.
    wandb_api.runs[LONG] = _as_recorded(wandb_api, wandb_file, rows=11, state="running")
    early = ingest([target, "--spool", str(live)])
    assert early.exit_code == 0, early.output
    assert [step for step, _ in _step_events(live)] == list(range(1, 10))
    wandb_api.runs[LONG] = _as_recorded(wandb_api, wandb_file, rows=None, state="finished")
    pages_before = len(wandb_api.operations("HistoryPage"))
    later = ingest([target, "--spool", str(live)])
    assert later.exit_code == 0, later.output
    # It read again from the last row it emitted (step 9's, W&B _step 9), for the step metric's last value.
    assert wandb_api.operations("HistoryPage")[pages_before].variables["minStep"] == 9

    once = tmp_path / "once"
    assert ingest([target, "--spool", str(once), "--cursor-file", str(tmp_path / "once.json")]).exit_code == 0
    in_two = [r.payload for r in SpoolReader(live).read()]
    in_one = [r.payload for r in SpoolReader(once).read()]
    assert sorted(in_two) == sorted(in_one)  # the same events, byte for byte, none twice
    steps = _step_events(live)
    assert [step for step, _ in steps] == list(range(1, 21))
    assert "eval/loss" in dict(steps)[10].scalars and "train/loss" in dict(steps)[10].scalars
