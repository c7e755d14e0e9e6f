"""Lineage across run ids (issue 44): a run relaunched under new run ids is one run to `history`,
`state`, `blame` and `diff` (each step from the run id that supplies it), and to SQL (`lineage`,
`lineage_metrics`); `--run-only` stops at the run id; a cycle of claimed parents is cut.

Three generations built from real events in a real lake ledger: run A (steps 1..100, lr changed at
step 40, capacity factor changed at step 80), B forked from A at step 60 (steps 61..150, capacity
factor changed at step 90), C resumed from B's checkpoint at step 120 under a new id (steps
121..170); and two runs that each claim the other as parent.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.wandb_import import branch_point, find_offline_runs, import_offline_run
from runledger.ingest.wandb_mirror import offline_environment
from runledger.ledger.query import Reader
from runledger.ledger.report import build_report
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import config_hash
from runledger.schemas import payloads as p
from tests.client.ledger_support import ingest
from tests.support.factory import RunBuilder
from tests.support.wandb_files import close_wandb_files

runner = CliRunner()
HOUR_S = 3_600


class Relaunch(RunBuilder):
    """A RunBuilder whose launch names the run it continues and the step it continues from."""

    def launch(self, hour: int, parent: str | None = None, fork_step: int | None = None) -> None:
        self.clock = hour * HOUR_S  # each run starts at its own hour after the factory's T0
        self._emit(
            p.RunStarted(
                config=self.config,
                config_hash=config_hash(self.config),
                host=f"node-{hour}",
                git_commit=self.run_id.lower() * 40,
                git_dirty=False,
                parent_run=parent,
                fork_step=fork_step,
            ),
            0 if fork_step is None else fork_step,
        )

    def train(self, steps: range) -> None:
        for s in steps:
            self._emit(p.StepMetrics(loss=1000.0 / (s + 1), lr=self.config["lr"]), s)


def _three_generations() -> list[Relaunch]:
    a = Relaunch("A", config={"lr": 0.001, "moe": {"capacity_factor": 1.0}})
    a.launch(0)
    a.train(range(1, 40))
    a.change(40, "lr", 0.002)
    a.train(range(40, 80))
    a.checkpoint(60)
    a.change(80, "moe", {"capacity_factor": 1.5})
    a.train(range(80, 101))
    a.crash(100)
    # B goes on from A's checkpoint at step 60: A's config there (lr 0.002, factor 1.0).
    b = Relaunch("B", config={"lr": 0.002, "moe": {"capacity_factor": 1.0}})
    b.launch(1, parent="A", fork_step=60)
    b.train(range(61, 90))
    b.change(90, "moe", {"capacity_factor": 1.25})
    b.train(range(90, 151))
    b.checkpoint(120)
    b.crash(150)
    c = Relaunch("C", config={"lr": 0.002, "moe": {"capacity_factor": 1.25}})
    c.launch(2, parent="B", fork_step=120)
    c.train(range(121, 171))
    # Two runs that each claim the other as parent, and one that claims itself.
    x = Relaunch("X", config={"lr": 0.1, "moe": {}})
    x.launch(3, parent="Y", fork_step=5)
    x.train(range(6, 11))
    y = Relaunch("Y", config={"lr": 0.2, "moe": {}})
    y.launch(4, parent="X", fork_step=7)
    y.train(range(8, 13))
    s = Relaunch("S", config={"lr": 0.3, "moe": {}})
    s.launch(5, parent="S", fork_step=3)
    s.train(range(4, 6))
    return [a, b, c, x, y, s]


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lineage") / "ledger"
    raws = [raw for run in _three_generations() for raw in run.events]
    Ledger.create(root).commit([SourceRecord("spool:lineage", i, raw) for i, raw in enumerate(raws)])
    return root


def invoke(ledger: Path, *args: str) -> str:
    result = runner.invoke(app, [*args, "--ledger", str(ledger)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def rows(ledger: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    reader = Reader(ledger)
    try:
        return [tuple(r) for r in reader.sql(sql, params).rows]
    finally:
        reader.close()


def test_the_lineage_view_lists_each_member_and_the_steps_it_supplies(ledger: Path) -> None:
    sql = (
        "SELECT member, depth, on_line, parent_run, fork_step, from_step, to_step "
        "FROM lineage WHERE run_id = ? ORDER BY depth"
    )
    line = [
        ("A", None, None, None, 60),
        ("B", "A", 60, 61, 120),
        ("C", "B", 120, 121, None),
    ]
    for run, top in (("A", 0), ("B", -1), ("C", -2)):
        assert rows(ledger, sql, [run]) == [
            (member, top + i, True, parent, fork, first, last)
            for i, (member, parent, fork, first, last) in enumerate(line)
        ]


def test_a_later_fork_takes_the_line_and_an_earlier_one_is_a_branch_off_it(tmp_path: Path) -> None:
    runs = _three_generations()[:3]
    side = Relaunch("D", config={"lr": 0.002, "moe": {"capacity_factor": 1.0}})
    side.launch(6, parent="A", fork_step=30)  # started last: A's line goes through D, not B
    side.train(range(31, 41))
    raws = [raw for run in [*runs, side] for raw in run.events]
    root = tmp_path / "ledger"
    Ledger.create(root).commit([SourceRecord("spool:fork", i, raw) for i, raw in enumerate(raws)])
    sql = "SELECT member, depth, on_line, from_step, to_step FROM lineage WHERE run_id = 'A' ORDER BY depth, member"
    assert rows(root, sql) == [
        ("A", 0, True, None, 30),
        ("B", 1, False, None, None),
        ("D", 1, True, 31, None),
        ("C", 2, False, None, None),
    ]
    # B's own line still runs through A and on to C.
    assert rows(root, "SELECT member FROM lineage WHERE run_id = 'B' AND on_line ORDER BY depth") == [
        ("A",),
        ("B",),
        ("C",),
    ]


def test_lineage_metrics_take_each_step_from_the_member_that_supplies_it(ledger: Path) -> None:
    sql = "SELECT member, min(step), max(step), count(*) FROM lineage_metrics WHERE run_id = ? AND name = 'loss' GROUP BY member ORDER BY member"
    supplied = [("A", 1, 60, 60), ("B", 61, 120, 60), ("C", 121, 170, 50)]
    for run in ("A", "B", "C"):
        assert rows(ledger, sql, [run]) == supplied
    # One row per step per metric: A's steps 61..100 were superseded by B's.
    once = "SELECT count(*), count(DISTINCT step) FROM lineage_metrics WHERE run_id = 'A' AND name = 'loss'"
    assert rows(ledger, once) == [(170, 170)]
    at = "SELECT member, value FROM lineage_metrics WHERE run_id = 'C' AND name = 'loss' AND step = ?"
    assert rows(ledger, at, [100]) == [("B", 1000.0 / 101)]


HISTORY_C = """\
history of C (lineage A → B (from step 60) → C (from step 120))
┌─────────────────────┬─────┬──────┬─────────┬──────────────────┬──────────────────────────────────────────────────────────────────────────────────────────────────────────────┐
│ time                │ run │ step │ attempt │ kind             │ what                                                                                                         │
├─────────────────────┼─────┼──────┼─────────┼──────────────────┼──────────────────────────────────────────────────────────────────────────────────────────────────────────────┤
│ 2026-11-01 00:00:01 │ A   │    0 │       1 │ run.started      │ run started at commit aaaaaaa, host node-0, world size 1, config ed2e76c7ac8e                                │
│ 2026-11-01 00:00:41 │ A   │   40 │       1 │ config.changed   │ config changed at step 40: lr 0.001 → 0.002 (file_edit config.toml)                                          │
│ 2026-11-01 00:01:22 │ A   │   60 │       1 │ checkpoint.saved │ checkpoint saved (interval): /ckpt/60                                                                        │
│ 2026-11-01 00:01:23 │ A   │   80 │       1 │ config.changed   │ config changed at step 80: moe.capacity_factor 1.0 → 1.5 (file_edit config.toml)                             │
│ 2026-11-01 00:01:45 │ A   │  100 │       1 │ run.crashed      │ crash (exception): RuntimeError boom on rank 0                                                               │
│ 2026-11-01 01:00:01 │ B   │   60 │       1 │ run.started      │ run started at commit bbbbbbb, host node-1, world size 1, config 5d8d7b4e7d0c; continues run A from step 60  │
│ 2026-11-01 01:00:31 │ B   │   90 │       1 │ config.changed   │ config changed at step 90: moe.capacity_factor 1.0 → 1.25 (file_edit config.toml)                            │
│ 2026-11-01 01:01:33 │ B   │  120 │       1 │ checkpoint.saved │ checkpoint saved (interval): /ckpt/120                                                                       │
│ 2026-11-01 01:01:34 │ B   │  150 │       1 │ run.crashed      │ crash (exception): RuntimeError boom on rank 0                                                               │
│ 2026-11-01 02:00:01 │     │  120 │       1 │ run.started      │ run started at commit ccccccc, host node-2, world size 1, config 7d1699871544; continues run B from step 120 │
└─────────────────────┴─────┴──────┴─────────┴──────────────────┴──────────────────────────────────────────────────────────────────────────────────────────────────────────────┘
"""

HISTORY_C_RUN_ONLY = """\
history of C
┌─────────────────────┬──────┬─────────┬─────────────┬──────────────────────────────────────────────────────────────────────────────────────────────────────────────┐
│ time                │ step │ attempt │ kind        │ what                                                                                                         │
├─────────────────────┼──────┼─────────┼─────────────┼──────────────────────────────────────────────────────────────────────────────────────────────────────────────┤
│ 2026-11-01 02:00:01 │  120 │       1 │ run.started │ run started at commit ccccccc, host node-2, world size 1, config 7d1699871544; continues run B from step 120 │
└─────────────────────┴──────┴─────────┴─────────────┴──────────────────────────────────────────────────────────────────────────────────────────────────────────────┘
"""


def test_history_tells_the_whole_lineage_and_names_each_other_run_id(ledger: Path) -> None:
    assert invoke(ledger, "history", "C") == HISTORY_C
    assert invoke(ledger, "history", "C", "--run-only") == HISTORY_C_RUN_ONLY
    # From the eldest the same story, the other run ids named: B's and C's lines.
    named = [line.split("│")[2].strip() for line in invoke(ledger, "history", "A").splitlines()[4:-1]]
    assert named == [""] * 5 + ["B"] * 4 + ["C"]
    # A step range of the lineage: the members' events in it.
    ranged = invoke(ledger, "history", "C", "--from-step", "85", "--to-step", "125")
    assert (
        ranged.splitlines()[0]
        == "history of C (lineage A → B (from step 60) → C (from step 120)), steps 85..125"
    )
    assert [line.split("│")[5].strip() for line in ranged.splitlines()[4:-1]] == [
        "run.crashed",
        "config.changed",
        "checkpoint.saved",
        "run.started",
    ]


STATE_C_100 = """\
C at step 100 (run B, attempt 1)
  commit: bbbbbbb
  config hash: 7d16998
  last checkpoint: none
  crashes so far: 0; config changes so far: 1
  GitHub events so far: 0
config
┌─────────────────────┬───────┐
│ key                 │ value │
├─────────────────────┼───────┤
│ lr                  │ 0.002 │
│ moe.capacity_factor │  1.25 │
└─────────────────────┴───────┘
"""

STATE_C_100_RUN_ONLY = """\
C at step 100 (attempt 1)
  commit: ccccccc
  config hash: 7d16998
  last checkpoint: none
  crashes so far: 0; config changes so far: 0
  GitHub events so far: 0
config
┌─────────────────────┬───────┐
│ key                 │ value │
├─────────────────────┼───────┤
│ lr                  │ 0.002 │
│ moe.capacity_factor │  1.25 │
└─────────────────────┴───────┘
"""


def test_state_at_a_step_is_read_in_the_run_id_that_supplies_it(ledger: Path) -> None:
    assert invoke(ledger, "state", "C", "--step", "100") == STATE_C_100
    assert invoke(ledger, "state", "C", "--step", "100", "--run-only") == STATE_C_100_RUN_ONLY
    # Step 85 of A's lineage is B's (A's own step 85 ran a factor B never saw).
    assert invoke(ledger, "state", "A", "--step", "85").splitlines()[0] == "A at step 85 (run B, attempt 1)"
    assert "moe.capacity_factor │   1.5" in invoke(ledger, "state", "A", "--step", "85", "--run-only")
    # The last step of A's lineage is C's; step 50 of C's lineage is A's, lr changed at 40.
    assert invoke(ledger, "state", "A").splitlines()[0] == "A at step 170 (run C, attempt 1)"
    state = json.loads(invoke(ledger, "state", "C", "--step", "50", "-f", "json"))
    assert (state["run_id"], state["step"], state["config"]["lr"]) == ("A", 50, 0.002)
    assert [ch["step"] for ch in state["config_changes"]] == [40]


BLAME_C_85 = """\
moe.capacity_factor = 1.0 at step 85 of C (read in run B)
  set by start at step 0 of run A (attempt 1, 2026-11-01 00:00:01+00:00)
  code: aaaaaaa
"""

BLAME_C_LR = """\
lr = 0.002 at step 170 of C
  set by config.changed at step 40 of run A (attempt 1, 2026-11-01 00:00:41+00:00) by unknown (file_edit: config.toml)
  code: aaaaaaa
  person: unknown
"""

BLAME_C_LR_RUN_ONLY = """\
lr = 0.002 at step 170 of C
  set by start at step 0 (attempt 1, 2026-11-01 02:00:01+00:00)
  code: ccccccc
"""


def test_blame_follows_a_value_a_relaunch_carried_over_to_where_it_was_set(ledger: Path) -> None:
    assert invoke(ledger, "blame", "C", "lr") == BLAME_C_LR
    assert invoke(ledger, "blame", "C", "moe.capacity_factor", "--step", "85") == BLAME_C_85
    assert invoke(ledger, "blame", "C", "lr", "--run-only") == BLAME_C_LR_RUN_ONLY
    # B's own change is B's; a value C's launch changed would be C's start (none here).
    answer = json.loads(invoke(ledger, "blame", "C", "moe.capacity_factor", "-f", "json"))
    assert (answer["value"], answer["value_from"], answer["set_by"]["run_id"]) == (1.25, "C", "B")
    assert (answer["set_by"]["kind"], answer["set_by"]["step"], answer["commit"]) == (
        "config.changed",
        90,
        "b" * 40,
    )


def test_diff_compares_two_steps_of_the_lineage(ledger: Path) -> None:
    out = invoke(ledger, "diff", "C", "--from-step", "50", "--to-step", "130").splitlines()
    assert out[:3] == [
        "C step 50 (run A, attempt 1) → step 130 (attempt 1)",
        "  moe.capacity_factor 1.0 → 1.25",
        "in between",
    ]
    kinds = [(line.split("│")[2].strip(), line.split("│")[5].strip()) for line in out[6:-1]]
    assert kinds == [
        ("A", "checkpoint.saved"),
        ("A", "config.changed"),
        ("A", "run.crashed"),
        ("B", "run.started"),
        ("B", "config.changed"),
        ("B", "checkpoint.saved"),
        ("", "run.started"),
    ]
    alone = invoke(ledger, "diff", "C", "--from-step", "50", "--to-step", "130", "--run-only").splitlines()
    assert alone[:2] == ["C step 50 (attempt 1) → step 130 (attempt 1)", "  config unchanged"]


def test_the_reader_follows_the_lineage_unless_told_not_to(ledger: Path) -> None:
    reader = Reader(ledger)
    try:
        assert reader.state("C", step=100).run_id == "B"
        assert reader.state("C", step=100, lineage=False).run_id == "C"
        assert {i.run_id for i in reader.history("C")} == {"A", "B", None}
        assert {i.run_id for i in reader.history("C", lineage=False)} == {None}
        assert reader.blame("C", "lr", lineage=False)["set_by"]["kind"] == "start"
        assert reader.diff("C", 50, 130, lineage=False)["from"]["run_id"] == "C"
    finally:
        reader.close()


def test_a_cycle_of_claimed_parents_is_cut_at_the_claim_no_run_can_make(ledger: Path) -> None:
    """X claims Y (started after X), Y claims X, S claims itself: a run cannot go on from one
    launched after it, so X's claim and S's are cut; each answers at once, never following a loop."""
    sql = (
        "SELECT run_id, member, depth, parent_run, fork_step, from_step, to_step FROM lineage "
        "WHERE run_id IN ('X', 'Y', 'S') ORDER BY run_id, depth"
    )
    expected = [
        ("S", "S", 0, None, None, None, None),
        ("X", "X", 0, None, None, None, 7),
        ("X", "Y", 1, "X", 7, 8, None),
        ("Y", "X", -1, None, None, None, 7),
        ("Y", "Y", 0, "X", 7, 8, None),
    ]
    assert rows(ledger, sql) == expected
    one = "SELECT run_id, member, depth, parent_run, fork_step, from_step, to_step FROM lineage_of(?) ORDER BY depth"
    assert [row for run in ("S", "X", "Y") for row in rows(ledger, one, [run])] == expected
    assert invoke(ledger, "history", "Y").splitlines()[0] == "history of Y (lineage X → Y (from step 7))"
    assert invoke(ledger, "state", "X", "--step", "9").splitlines()[0] == "X at step 9 (run Y, attempt 1)"
    assert invoke(ledger, "history", "S") == invoke(ledger, "history", "S", "--run-only")


def test_a_wandb_run_forked_from_another_continues_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B's ``fork_from`` (real wandb, offline) is the imported run's parent and fork step."""
    wandb = pytest.importorskip("wandb")
    for key, value in offline_environment(tmp_path).items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    try:
        parent = wandb.init(project="hero", id="wparent", config={"lr": 0.1})
        for step in range(10):
            parent.log({"loss": 10.0 - step}, step=step)
        parent.finish()
        child = wandb.init(project="hero", id="wchild", fork_from="wparent?_step=5", config={"lr": 0.05})
        for step in range(6, 12):
            child.log({"loss": 20.0 - step}, step=step)
        child.finish()
    finally:
        close_wandb_files()
    spool, root = tmp_path / "spool", tmp_path / "ledger"
    sink = SpoolSink(spool)
    try:
        for wandb_file in find_offline_runs(tmp_path / "wandb-runs"):
            import_offline_run(wandb_file, sink)
    finally:
        sink.close()
    ingest(root, spool)
    sql = "SELECT member, parent_run, fork_step, from_step, to_step FROM lineage WHERE run_id = 'wchild' ORDER BY depth"
    assert rows(root, sql) == [("wparent", None, None, None, 5), ("wchild", "wparent", 5, 6, None)]
    series = "SELECT step, member, value FROM lineage_metrics WHERE run_id = 'wparent' AND name = 'loss' ORDER BY step"
    assert rows(root, series) == [(s, "wparent", 10.0 - s) for s in range(6)] + [
        (s, "wchild", 20.0 - s) for s in range(6, 12)
    ]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"branch_point": {"run": "p1", "value": 60, "metric": "_step"}}, ("p1", 60)),
        ({"config": {"update": {"_wandb": {"branch_point": {"run_id": "p1", "step": 7.0}}}}}, ("p1", 7)),
        (
            {
                "config": {
                    "update": [
                        {"key": "_wandb", "value_json": '{"branch_point": {"run_id": "p1", "step": 3}}'}
                    ]
                }
            },
            ("p1", 3),
        ),
        ({"branch_point": {"run": "p1", "value": 2.5}}, ("p1", None)),  # not a whole step
        ({"branch_point": {"run": "p1", "value": -1}}, ("p1", None)),
        ({"branch_point": {"run": "me", "value": 4}}, (None, None)),  # resume_from: a rewind of itself
        ({"branch_point": {"run": "../x", "value": 4}}, (None, None)),  # not a ledger run id
        ({"config": {"update": [{"key": "_wandb", "value_json": "{not json"}]}}, (None, None)),
        ({"config": {"update": {"lr": 0.1}}}, (None, None)),
    ],
)
def test_wandb_branch_points_in_every_shape(
    record: dict[str, Any], expected: tuple[str | None, int | None]
) -> None:
    assert branch_point(record, "me") == expected


def test_the_report_lists_the_lineage_with_its_fork_steps(ledger: Path) -> None:
    reader = Reader(ledger)
    try:
        report = build_report(reader, ["C", "S"])
    finally:
        reader.close()
    assert report["title"] == "runledger report: C (lineage A → B (from step 60) → C (from step 120)), S"
    lineage = [
        (m["run_id"], m["parent_run"], m["fork_step"], m["from_step"], m["to_step"])
        for m in report["runs"][0]["lineage"]
    ]
    assert lineage == [("A", None, None, None, 60), ("B", "A", 60, 61, 120), ("C", "B", 120, 121, None)]
    assert [m["run_id"] for m in report["runs"][1]["lineage"]] == ["S"]
    # The curves' markers are the run id's own: C's launch only.
    assert [(m["kind"], m["step"]) for m in report["runs"][0]["markers"] if m["kind"] != "github"] == [
        ("run.started", 120)
    ]


def test_the_report_page_shows_the_lineage_table_in_a_browser(ledger: Path, tmp_path: Path) -> None:
    """The written report, opened offline in headless Chromium: a Lineage section with one row per
    member of C's line (S has none: its run alone is no lineage, and no section is added for it)."""
    from tests.web.test_report import open_offline

    page = tmp_path / "report.html"
    result = runner.invoke(app, ["report", "C", "S", "--ledger", str(ledger), "-o", str(page)])
    assert result.exit_code == 0, result.output
    driver = open_offline(page)
    try:
        rows = driver.execute_script(
            "const h = [...document.querySelectorAll('h2')].find(e => e.textContent === 'Lineage');"
            "if (!h) return null;"
            "let t = h.nextElementSibling; while (t && t.tagName !== 'TABLE') t = t.nextElementSibling;"
            "return [...t.querySelectorAll('tbody tr')].map(r => [...r.children].map(c => c.textContent));"
        )
    finally:
        driver.quit()
    assert rows is not None, "no Lineage section"
    assert [r[:6] for r in rows] == [
        ["C", "A", "", "", "", "60"],
        ["C", "B", "A", "60", "61", "120"],
        ["C", "C", "B", "120", "121", ""],
    ]
