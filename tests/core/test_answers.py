"""Answers that must not miss what happened (issue 24), through the CLI on a real simulated run.

A 200-step reference simulation (every position of the 390,000-step story scaled; a step spans
about eleven hours of the run's three months, so the PR behind a config change merges after the
step before it) is emitted to a spool and ingested into a real ledger once per module:

* ``history --from-step/--to-step`` and ``diff`` show the GitHub events that happened while the run
  was at those steps, the merge of the PR behind a change inside the range included;
* ``report latest`` and ``plot latest`` name the most recently started run, as the README says;
* a second simulated run (``--run-id``) has its own repository, commits and PR numbers, so the
  first run's ``blame`` keeps its PR line once both are in one ledger.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader

runner = CliRunner()
RUN = "moe-535b"
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]


def _cli(*args: str | Path) -> str:
    result = runner.invoke(app, [str(a) for a in args], env={"RUNLEDGER_PROGRESS_S": "off"})
    assert result.exit_code == 0, result.output
    return result.stdout


def _simulate_and_ingest(spool: Path, ledger: Path, *args: str) -> str:
    _cli("simulate", "reference-535b", "--spool", spool, *SMALL, *args)
    return _cli("ingest", "spool", "--spool", spool, "--ledger", ledger)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("answers")
    out = _simulate_and_ingest(root / "spool", root / "ledger")
    assert "0 quarantined" in out
    return root / "ledger"


@pytest.fixture(scope="module")
def change(ledger: Path) -> tuple[int, dict[str, Any], str]:
    """The live change to ``optimizer.grad_clip``: its step, the PR ``blame`` names for it, and that
    PR's merge line as ``ledger history --all`` prints it."""
    blame = Reader(ledger).blame(RUN, "optimizer.grad_clip")
    (pr,) = blame["pull_requests"]
    rows = json.loads(_cli("history", RUN, "--ledger", ledger, "--all", "-f", "json"))
    (merged,) = [r["what"] for r in rows if r["what"].startswith(f"PR #{pr['number']} merged (")]
    return blame["set_by"]["step"], pr, merged


def test_a_history_range_shows_the_merge_behind_a_change_inside_it(
    ledger: Path, change: tuple[int, dict[str, Any], str]
) -> None:
    step, pr, merged = change
    rows = json.loads(
        _cli("history", RUN, "--ledger", ledger, "--from-step", step - 1, "--to-step", step + 1, "-f", "json")
    )
    texts = [r["what"] for r in rows]
    assert merged in texts  # merged minutes before the change, hours after step - 1 ended
    changed = next(r for r in rows if r["kind"] == "config.changed")
    assert changed["step"] == step and f"PR #{pr['number']}" in changed["what"]
    assert texts.index(merged) < texts.index(changed["what"])
    # Only the range: every stepped row is inside it, and every GitHub row lies between the run's
    # first event at step - 1 and its last event at step + 1.
    assert all(step - 1 <= r["step"] <= step + 1 for r in rows if r["step"] is not None)
    start, end = Reader(ledger).step_window(RUN, step - 1, step + 1) or (None, None)
    assert start is not None and end is not None
    github = [r for r in rows if r["kind"] == "github"]
    assert github and all(start.isoformat() <= r["time"] <= end.isoformat() for r in github)


def test_diff_in_between_shows_the_github_events_too(
    ledger: Path, change: tuple[int, dict[str, Any], str]
) -> None:
    step, _pr, merged = change
    doc = json.loads(
        _cli("diff", RUN, "--ledger", ledger, "--from-step", step - 1, "--to-step", step + 1, "-f", "json")
    )
    texts = [e["text"] for e in doc["events"]]
    assert merged in texts
    assert any(e["kind"] == "config.changed" and e["step"] == step for e in doc["events"])
    table = _cli("diff", RUN, "--ledger", ledger, "--from-step", step - 1, "--to-step", step + 1, "--full")
    assert merged in table


def test_report_and_plot_take_latest(ledger: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    out = _cli("report", "latest", "--ledger", ledger, "-o", page, "--buckets", "100")
    assert out.startswith(f"wrote {page} (") and RUN in page.read_text()
    image = tmp_path / "loss.png"
    assert (
        _cli("plot", "latest", "loss", "--ledger", ledger, "-o", image, "--buckets", "100")
        == f"wrote {image}\n"
    )
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latest_in_a_ledger_without_runs_is_one_line(tmp_path: Path) -> None:
    from runledger.ledger.store import Ledger

    Ledger.create(tmp_path / "empty")
    result = runner.invoke(
        app, ["plot", "latest", "loss", "--ledger", str(tmp_path / "empty"), "-o", "x.png"]
    )
    assert result.exit_code == 1
    assert result.stderr == "error: the ledger has no runs yet, so no `latest` run\n"


def _blame_text(ledger: Path, run: str) -> str:
    return _cli("blame", run, "optimizer.grad_clip", "--ledger", ledger, "--full")


def test_a_second_simulated_run_keeps_the_first_runs_blame(ledger: Path, tmp_path: Path) -> None:
    both = tmp_path / "ledger"
    shutil.copytree(ledger, both)
    before = _blame_text(both, RUN)
    assert "  PR openlab/moe-535b#" in before
    # Another run id, and another length: its story's times and merges differ from the first's.
    out = _simulate_and_ingest(tmp_path / "spool", both, "--run-id", "moe-535b-rerun", "--steps", "300")
    assert "0 duplicates dropped, 0 quarantined" in out
    assert _blame_text(both, RUN) == before
    reader = Reader(both)
    (pr,) = reader.blame("moe-535b-rerun", "optimizer.grad_clip")["pull_requests"]
    assert pr["repo"] == "openlab/moe-535b-rerun"
    repos = dict(reader.sql("SELECT run_id, repository FROM attempts WHERE attempt = 1").rows)
    assert repos == {RUN: "openlab/moe-535b", "moe-535b-rerun": "openlab/moe-535b-rerun"}
    numbers = {
        repo: {
            n
            for (n,) in reader.sql(
                "SELECT DISTINCT number FROM github WHERE repo = ? AND number IS NOT NULL", [repo]
            ).rows
        }
        for repo in repos.values()
    }
    assert numbers["openlab/moe-535b"].isdisjoint(numbers["openlab/moe-535b-rerun"])
    shas = [
        {s for (s,) in reader.sql("SELECT git_commit FROM attempts WHERE run_id = ?", [run]).rows}
        for run in repos
    ]
    assert shas[0].isdisjoint(shas[1])  # no commit shared between the two runs' repositories
