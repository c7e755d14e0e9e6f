"""state/diff/blame/history read a run's state events from their own table (issue 11), and a long
history is summarised; answers are the same as from a scan of every event."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.history import HistoryItem, history_range, summarise_history
from runledger.ledger.lake import ColumnBounds
from runledger.ledger.query import Reader, _may_hold_false, _may_reach
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder

STEPS = 240


def _long_run() -> RunBuilder:
    """A run whose history is longer than a screen: a checkpoint every 5 steps, two crashes, changes."""
    run = RunBuilder()
    run.start()
    step = 0
    crashes = {90: 80, 170: 160}  # crash step → resume step
    while step < STEPS:
        step += 1
        if step in (40, 130):
            run.change(step, "lr", 0.001 / step)
        run.step(step, loss=10 / step)
        if step % 5 == 0:
            run.checkpoint(step)
        if step in crashes:
            run.crash(step)
            resume_at = crashes.pop(step)
            run.resume(resume_at)
            step = resume_at
    return run


def _ledger(root: Path, run: RunBuilder, commits: int = 7) -> Reader:
    ledger = Ledger.create(root)
    raws = run.events
    size = len(raws) // commits + 1
    for first in range(0, len(raws), size):  # several commits: several files per table
        ledger.commit(
            [SourceRecord("spool:t", i, raws[i]) for i in range(first, min(first + size, len(raws)))]
        )
    return Reader(root)


def _scanning(root: Path) -> Reader:
    """A reader that takes the run's state events from a scan of ``events``, as before issue 11."""
    reader = Reader(root)
    reader._state_table = False
    return reader


def _rows(items: list[HistoryItem]) -> list[tuple[object, ...]]:
    return [(i.time, i.step, i.attempt, i.kind, i.text) for i in items]


def test_state_table_gives_the_answers_of_a_full_scan(tmp_path: Path) -> None:
    fast = _ledger(tmp_path / "l", _long_run())
    slow = _scanning(tmp_path / "l")
    assert fast._state_table and fast.events("run-a") == slow.events("run-a")
    last = fast.last_step("run-a")
    assert last == STEPS
    for step in range(0, last + 1, 7):
        assert fast.state("run-a", step=step).to_dict() == slow.state("run-a", step=step).to_dict()
    assert fast.state("run-a").to_dict() == slow.state("run-a").to_dict()
    assert _rows(fast.history("run-a")) == _rows(slow.history("run-a"))
    diff_fast, diff_slow = fast.diff("run-a", 30, 200), slow.diff("run-a", 30, 200)
    assert diff_fast["config_patch"] == diff_slow["config_patch"] != []
    assert _rows(diff_fast["events"]) == _rows(diff_slow["events"])
    assert fast.blame("run-a", "lr", 150) == slow.blame("run-a", "lr", 150)
    # Past the last state event the step is checked against the run's last step, as before.
    for reader in (fast, slow):
        for bad in (-1, last + 1):
            try:
                reader.state("run-a", step=bad)
            except Exception as exc:
                assert f"step {bad} is out of range" in str(exc)
            else:
                raise AssertionError(f"step {bad} accepted")


def test_the_last_step_read_from_a_reached_step_is_the_runs_last_step(tmp_path: Path) -> None:
    """``last_step(reached=K)`` reads only rows at or above a step K an event holds: the same answer as
    the whole scan, for every state event's step, also when the run ended below its highest step (a
    resume went back) and its events arrived in several commits (files)."""
    run = RunBuilder()
    run.start()
    for step in range(1, 101):
        run.step(step, loss=1 / step)
        if step % 10 == 0:
            run.checkpoint(step)
    run.crash(100)
    run.resume(50)
    for step in range(51, 81):
        run.step(step, loss=1 / step)
    reader = _ledger(tmp_path / "l", run)
    assert reader.last_step("run-a") == 100
    reached = {e.step for e in reader.events("run-a") if e.step is not None}
    assert {50, 100} <= reached  # the resume and the crash
    # Both ways of listing a snapshot's files (DuckLake's, and the catalog read with sqlite3) know
    # each file's step bounds: only the files that can hold a step at or above K are read.
    for listed in (reader, Reader(tmp_path / "l", sqlite3_catalog=True)):
        assert {k: listed.last_step("run-a", reached=k) for k in reached} == {k: 100 for k in reached}
        assert listed.state("run-a").step == 100
        files = listed._files["events"]
        assert files is not None and len(files.paths) > 1
        read = listed._rows_within("events", "step", lambda bounds: _may_reach(bounds, 100))
        assert read is not None and 0 < sum(path in read for path in files.paths) < len(files.paths)


def test_a_files_bounds_say_whether_it_can_hold_a_row() -> None:
    """The catalog's bounds of a file's column (``ducklake_file_column_stats``: text min/max, NULLs,
    non-NULL values) rule a file out only when they are known."""
    step = ColumnBounds("10", "20", 0, 11)
    assert _may_reach(step, 20) and _may_reach(step, 5) and not _may_reach(step, 21)
    assert not _may_reach(ColumnBounds(None, None, 4, 0), 0)  # every step NULL
    assert _may_reach(ColumnBounds(None, None, None, None), 10**9)  # nothing known: read it
    assert _may_reach(ColumnBounds("1", "x", 0, 2), 5)  # not a number: read it
    assert _may_hold_false(ColumnBounds("false", "true", 0, 2))
    assert _may_hold_false(ColumnBounds("false", "false", 3, 2))
    assert not _may_hold_false(ColumnBounds("true", "true", 1, 5))
    assert not _may_hold_false(ColumnBounds(None, None, 7, 0))  # no registry: every row NULL
    assert _may_hold_false(ColumnBounds(None, None, None, None))


def test_long_history_is_summarised_and_a_range_is_shown_in_full(tmp_path: Path) -> None:
    reader = _ledger(tmp_path / "l", _long_run())
    items = reader.history("run-a")
    summary = summarise_history(items)
    assert len(items) > 50 and len(summary) < len(items) / 3
    notable = [i for i in items if not i.routine]
    assert [i for i in summary if i.kind != "routine"] == notable  # nothing notable is dropped, in order
    counted = sum(
        int(re.match(r"… (\d+) checkpoint", i.text).group(1)) for i in summary if i.kind == "routine"
    )
    assert counted == sum(i.kind == "checkpoint.saved" for i in items)
    assert {i.kind for i in notable} >= {"run.started", "run.resumed", "run.crashed", "config.changed"}
    short = items[:10]
    assert summarise_history(short) == short  # a history that fits is shown as it is

    in_range = history_range(items, 100, 120)
    assert in_range and all(100 <= i.step <= 120 for i in in_range)
    assert [i for i in items if i.step is not None and 100 <= i.step <= 120] == in_range

    runner = CliRunner()
    base = ["history", "run-a", "--ledger", str(tmp_path / "l"), "--format", "json"]
    shown = json.loads(runner.invoke(app, base).stdout)
    assert len(shown) == len(summary)
    every = json.loads(runner.invoke(app, [*base, "--all"]).stdout)
    assert len(every) == len(items)
    ranged = json.loads(runner.invoke(app, [*base, "--from-step", "100", "--to-step", "120"]).stdout)
    assert len(ranged) == len(in_range)


def test_a_months_long_history_fits_a_screen_with_each_crash_beside_its_resume() -> None:
    t0 = datetime(2026, 2, 1, tzinfo=UTC)
    items = [HistoryItem(t0, 0, 1, "run.started", "run started at commit abc")]
    for n in range(1, 31):  # 30 crashes, each resumed 500 steps back, with merges and checkpoints between
        at = n * 1000
        items += [
            HistoryItem(t0 + timedelta(hours=at), None, None, "github", f"PR #{n} merged (abc{n}) by x: fix"),
            HistoryItem(
                t0 + timedelta(hours=at), at - 200, n, "checkpoint.saved", "checkpoint saved (interval)"
            ),
            HistoryItem(t0 + timedelta(hours=at + 1), at + 99, n, "run.crashed", f"crash (oom): boom {n}"),
            HistoryItem(
                t0 + timedelta(hours=at + 2), at - 200, n + 1, "run.resumed", f"attempt {n + 1} resumed"
            ),
        ]
        if n % 10 == 0:
            items.append(HistoryItem(t0 + timedelta(hours=at + 3), at, n + 1, "config.changed", "lr 1 → 2"))
    items.append(
        HistoryItem(t0 + timedelta(hours=40_000), 40_000, 31, "run.crashed", "crash (exception): last")
    )

    summary = summarise_history(items, max_lines=40)
    assert len(summary) == 1 + 30 + 3 + 1 <= 40  # start, 30 crash+resume lines, 3 changes, the last crash
    fused = [i for i in summary if i.kind == "crash → resume"]
    assert len(fused) == 30
    assert (fused[0].step, fused[0].attempt) == (1099, 1)  # the crash's step and attempt
    assert fused[0].text == "resumed as attempt 2 from step 800 after crash (oom): boom 1"
    assert [i.kind for i in summary if i.kind not in ("crash → resume",)] == [
        "run.started",
        "config.changed",
        "config.changed",
        "config.changed",
        "run.crashed",  # a crash nothing resumed stays a crash
    ]
    assert not any(i.kind in ("github", "routine", "checkpoint.saved") for i in summary)
