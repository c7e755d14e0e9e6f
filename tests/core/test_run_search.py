"""Many runs (issue 44): `ledger runs` filters by run id or name, tag, status, config value, start
time and metric, and sorts; bad filter text is one line. Six runs built from real events in a lake.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.live_page import create_app
from runledger.ledger.run_search import parse_config_test, parse_time
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import config_hash
from runledger.schemas import payloads as p
from tests.support.factory import RunBuilder

runner = CliRunner()
DAY_S = 86_400


class LabRun(RunBuilder):
    """A RunBuilder with what a lab's runs also have: a name, a parent, eval losses, an end, notes."""

    def launch(self, day: int, name: str, parent: str | None = None, fork_step: int | None = None) -> None:
        self.clock = day * DAY_S  # each run starts on its own day after the factory's T0 (2026-11-01)
        self._emit(
            p.RunStarted(
                config=self.config,
                config_hash=config_hash(self.config),
                host="node-0",
                git_commit="c" * 40,
                git_dirty=False,
                name=name,
                parent_run=parent,
                fork_step=fork_step,
            ),
            0,
        )

    def train(self, steps: range, loss0: float, eval_every: int = 0) -> None:
        for s in steps:
            scalars: dict[str, float | None] = (
                {"eval/loss": loss0 - s * 0.05 + 0.2} if eval_every and s % eval_every == 0 else {}
            )
            self._emit(p.StepMetrics(loss=loss0 - s * 0.1, lr=0.001, scalars=scalars), s)

    def finish(self, step: int, status: Literal["completed", "stopped", "failed"] = "completed") -> None:
        self._emit(p.RunFinished(status=status, final_step=step), step)

    def note(self, step: int, *tags: str) -> None:
        self._emit(p.Annotation(author="ada", text="see this", tags=list(tags)), step)


def _lab() -> list[LabRun]:
    """Six runs: finished, crashed, resumed, forked, failed, and one whose factor is text."""
    a1 = LabRun("a1", config={"lr": 0.001, "moe": {"capacity_factor": 1.0}, "opt": "adam"})
    a1.launch(0, "alpha-base")
    a1.train(range(1, 11), 9.0, eval_every=5)
    a1.note(3, "baseline")
    a1.finish(10)
    a2 = LabRun("a2", config={"lr": 0.002, "moe": {"capacity_factor": 1.25}, "opt": "adam"})
    a2.launch(30, "alpha-cf125")
    a2.train(range(1, 8), 8.0, eval_every=5)
    a2.crash(7)
    a2.note(7, "sweep")
    b1 = LabRun("b1", config={"lr": 0.001, "moe": {"capacity_factor": 1.25}, "opt": "sgd", "dropless": True})
    b1.launch(60, "beta-hero")
    b1.train(range(1, 13), 7.0, eval_every=4)
    b1.crash(12)
    b1.resume(10)
    b1.train(range(11, 21), 6.5, eval_every=4)
    b1.note(15, "sweep", "hero")
    b2 = LabRun("b2", config={"lr": 0.001, "moe": {"capacity_factor": 1.5}, "opt": "sgd", "dropless": False})
    b2.launch(61, "beta-fork", parent="b1", fork_step=5)
    b2.train(range(6, 16), 6.0)
    b2.finish(15, "stopped")
    c1 = LabRun("c1", config={"lr": 0.003, "moe": {"capacity_factor": 1.25}, "opt": "adam"})
    c1.launch(90, "gamma")
    c1.train(range(1, 5), 9.5, eval_every=2)
    c1.finish(4, "failed")
    c2 = LabRun("c2", config={"lr": 0.003, "moe": {"capacity_factor": "1.25"}, "opt": "adam"})
    c2.launch(120, "gamma-text")
    c2.train(range(1, 3), 9.9)
    return [a1, a2, b1, b2, c1, c2]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many_runs") / "ledger"
    raws = [raw for run in _lab() for raw in run.events]
    Ledger.create(root).commit([SourceRecord("spool:lab", i, raw) for i, raw in enumerate(raws)])
    return root


def invoke(lab: Path, *args: str, columns: int = 200) -> tuple[int, str]:
    result = runner.invoke(app, ["runs", "--ledger", str(lab), *args], env={"COLUMNS": str(columns)})
    return result.exit_code, result.output


def csv_of(lab: Path, *args: str) -> str:
    code, out = invoke(lab, "--format", "csv", *args)
    assert code == 0, out
    return out


def ids(lab: Path, *args: str) -> list[str]:
    return [line.split(",")[0] for line in csv_of(lab, *args).splitlines()[1:]]


HEADER = "run_id,name,status,started_at,attempts,last_step,crashes,tags,git_commit,config_hash"
C40, B40 = "c" * 40, "b" * 40
ROWS = {
    "a1": f"a1,alpha-base,finished,2026-11-01T00:00:01+00:00,1,10,0,baseline,{C40},"
    "c3ddbeda6dc5cf78c809d45e1ed7263383cfecd81797acb8db435d9687332675",
    "a2": f"a2,alpha-cf125,crashed,2026-12-01T00:00:01+00:00,1,7,1,sweep,{C40},"
    "f0cb6a4a4ed9ab919ee107007602827d5a8d691736215314f426f4d7ecd145e5",
    "b1": f'b1,beta-hero,running,2026-12-31T00:00:01+00:00,2,20,1,"hero,sweep",{B40},'
    "b78b9c8614bad1198568086a5325016584e4e709fe08b8e39841d18753d584a5",
    "b2": f"b2,beta-fork,finished,2027-01-01T00:00:01+00:00,1,15,0,,{C40},"
    "7cc7742108fa34f137e4b5c579fd8d9e8c4e2ebdfbe674bf6d3bca88fcd51559",
    "c1": f"c1,gamma,crashed,2027-01-30T00:00:01+00:00,1,4,0,,{C40},"
    "e41925d8b9c17a2c5852e6f56a3fcbbfdb5afe1935d3ded4a782b4336ff1437c",
    "c2": f"c2,gamma-text,running,2027-03-01T00:00:01+00:00,1,2,0,,{C40},"
    "b09c605ab359226627f498d8545dc346494656d7f51a74863f671546f4dfad9c",
}


def expected(*run_ids: str, metric: dict[str, str] | None = None) -> str:
    """The exact CSV of these runs in this order (with ``metric``: run id → "value,step")."""
    header = HEADER + (",metric_value,metric_step" if metric is not None else "")
    rows = [ROWS[r] + (f",{metric[r]}" if metric is not None else "") for r in run_ids]
    return "\n".join([header, *rows]) + "\n"


# -- every filter -----------------------------------------------------------------------------------


def test_no_filter_lists_every_run_by_start_time(lab: Path) -> None:
    assert csv_of(lab) == expected("a1", "a2", "b1", "b2", "c1", "c2")


def test_name_matches_run_id_or_name_as_glob_or_substring(lab: Path) -> None:
    assert csv_of(lab, "--name", "gamma*") == expected("c1", "c2")
    assert csv_of(lab, "--name", "bet") == expected("b1", "b2")  # no glob characters: contains
    assert csv_of(lab, "--name", "a?") == expected("a1", "a2")  # the run id
    assert csv_of(lab, "--name", "zeta") == HEADER + "\n"


def test_tags_are_the_tags_of_a_runs_notes_and_all_must_match(lab: Path) -> None:
    assert csv_of(lab, "--tag", "sweep") == expected("a2", "b1")
    assert csv_of(lab, "--tag", "sweep", "--tag", "hero") == expected("b1")
    assert csv_of(lab, "--tag", "baseline") == expected("a1")


def test_status_is_the_newest_attempts(lab: Path) -> None:
    # b1 crashed and was resumed: running; c1 finished as "failed": crashed; b2 "stopped": finished.
    assert csv_of(lab, "--status", "running") == expected("b1", "c2")
    assert csv_of(lab, "--status", "crashed") == expected("a2", "c1")
    assert csv_of(lab, "--status", "finished") == expected("a1", "b2")


def test_config_values_compare_typed_on_a_dotted_path(lab: Path) -> None:
    assert csv_of(lab, "--config", "moe.capacity_factor=1.25") == expected(
        "a2", "b1", "c1"
    )  # not c2's "1.25"
    assert csv_of(lab, "--config", 'moe.capacity_factor="1.25"') == expected("c2")
    assert csv_of(lab, "--config", "moe.capacity_factor=1") == expected("a1")  # 1 = 1.0
    assert csv_of(lab, "--config", "moe.capacity_factor>1.25") == expected("b2")
    assert csv_of(lab, "--config", "moe.capacity_factor!=1.25") == expected("a1", "b2", "c2")
    assert csv_of(lab, "--config", "dropless=true") == expected("b1")
    assert csv_of(lab, "--config", "opt=adam", "--config", "lr>=0.002") == expected("a2", "c1", "c2")
    assert csv_of(lab, "--config", "no.such.key=1") == HEADER + "\n"


def test_since_and_until_bound_the_start_time(lab: Path) -> None:
    assert csv_of(lab, "--since", "2026-12-15", "--until", "2027-02-01") == expected("b1", "b2", "c1")
    assert csv_of(lab, "--since", "2027-01-01T00:00:01Z") == expected("b2", "c1", "c2")
    assert csv_of(lab, "--until", "2026-12-01T00:00:01+00:00") == expected("a1")


def test_metric_best_sorts_best_first_and_leaves_out_runs_without_it(lab: Path) -> None:
    best = {"b1": "5.7,20", "a2": "7.95,5", "a1": "8.7,10", "c1": "9.5,4"}
    assert csv_of(lab, "--metric", "eval/loss", "--best", "min") == expected(
        "b1", "a2", "a1", "c1", metric=best
    )
    highest = {"c1": "9.6,2", "a1": "8.95,5", "a2": "7.95,5", "b1": "7.0,4"}
    assert csv_of(lab, "--metric", "eval/loss", "--best", "max") == expected(
        "c1", "a1", "a2", "b1", metric=highest
    )


def test_metric_last_is_the_value_at_the_last_step(lab: Path) -> None:
    last = {"a1": "8.0,10", "b2": "4.5,15"}
    assert csv_of(lab, "--metric", "loss", "--last", "--name", "*-[bf]*") == expected("a1", "b2", metric=last)


def test_the_question_of_issue_44_in_one_command(lab: Path) -> None:
    """Best eval loss of every run with moe.capacity_factor = 1.25 since December."""
    out = csv_of(
        lab,
        "--config",
        "moe.capacity_factor=1.25",
        "--since",
        "2026-12-01",
        "--metric",
        "eval/loss",
        "--best",
        "min",
    )
    assert out == expected("b1", "a2", "c1", metric={"b1": "5.7,20", "a2": "7.95,5", "c1": "9.5,4"})


def test_sort_by_any_column_and_descending(lab: Path) -> None:
    assert csv_of(lab, "--sort", "last_step", "--desc") == expected("b1", "b2", "a1", "a2", "c1", "c2")
    assert csv_of(lab, "--sort", "name") == expected("a1", "a2", "b2", "b1", "c1", "c2")
    assert csv_of(lab, "--desc") == expected("c2", "c1", "b2", "b1", "a2", "a1")
    by_value = {"a1": "8.0,10", "a2": "7.3,7", "b1": "4.5,20"}
    out = csv_of(lab, "--metric", "loss", "--tag", "sweep", "--sort", "metric_value")
    assert out == expected("b1", "a2", metric=by_value)


def test_limit_and_the_table(lab: Path) -> None:
    code, out = invoke(lab, "--status", "running", "--limit", "1", columns=200)
    assert code == 0
    assert out == (
        "runs\n"
        "┌────────┬───────────┬─────────┬─────────────────────┬──────────┬───────────┬─────────┬────────────┬────────────┬─────────────┐\n"
        "│ run_id │ name      │ status  │ started_at          │ attempts │ last_step │ crashes │ tags       │ git_commit │ config_hash │\n"
        "├────────┼───────────┼─────────┼─────────────────────┼──────────┼───────────┼─────────┼────────────┼────────────┼─────────────┤\n"
        "│ b1     │ beta-hero │ running │ 2026-12-31 00:00:01 │        2 │        20 │       1 │ hero,sweep │ bbbbbbb    │ b78b9c8     │\n"
        "└────────┴───────────┴─────────┴─────────────────────┴──────────┴───────────┴─────────┴────────────┴────────────┴─────────────┘\n"
        "1 of 2 rows (--limit 0 for all)\n"
    )


# -- bad input: one line, exit 2 ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--sort", "nope"],
            "error: unknown column 'nope' to sort by; columns: run_id, name, status, started_at, attempts, "
            "last_step, crashes, tags, git_commit, config_hash",
        ),
        (
            ["--sort", "metric_value"],
            "error: unknown column 'metric_value' to sort by; columns: run_id, name, status, started_at, "
            "attempts, last_step, crashes, tags, git_commit, config_hash (metric_value and metric_step come "
            "with --metric)",
        ),
        (
            ["--config", "moe.capacity_factor"],
            "error: config filter 'moe.capacity_factor' is not KEY=VALUE (e.g. moe.capacity_factor=1.25)",
        ),
        (
            ["--config", "moe..x=1"],
            "error: config filter 'moe..x=1': key '' is not a config key (A-Z a-z 0-9 _ - / : @ +)",
        ),
        (
            ["--config", "x=[1, 2]"],
            "error: config value '[1, 2]' is a JSON list or object; compare one value at a time",
        ),
        (["--config", "x<true"], "error: config filter 'x<true': < compares numbers or text, not true"),
        (["--since", "June"], "error: time 'June' is not a date (2026-06-01), a date-time or an age (7d)"),
        (
            ["--until", "2026-13-01"],
            "error: time '2026-13-01' is not a date (2026-06-01), a date-time or an age (7d)",
        ),
        (
            ["--since", "2027-01-01", "--until", "2026-01-01"],
            "error: --since 2027-01-01T00:00:00+00:00 is not before --until 2026-01-01T00:00:00+00:00",
        ),
        (["--status", "dead"], "error: status 'dead' is not one of running, finished, crashed"),
        (["--best", "min"], "error: --best and --last need --metric NAME"),
        (
            ["--metric", "loss", "--best", "lowest"],
            "error: metric mode 'lowest' is not one of min, max, last",
        ),
        (["--metric", "loss", "--best", "min", "--last"], "error: --best and --last exclude each other"),
    ],
)
def test_bad_filter_input_is_one_line_and_exit_2(lab: Path, args: list[str], line: str) -> None:
    result = runner.invoke(app, ["runs", "--ledger", str(lab), *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.splitlines() == [line]


# -- the view behind it -----------------------------------------------------------------------------


def test_run_summary_answers_the_cross_run_question_in_one_query(lab: Path) -> None:
    query = (
        "SELECT run_id, status, parent_run, fork_step, best_eval_loss, final_loss FROM run_summary "
        "WHERE json_extract(config, '$.moe.capacity_factor') = '1.25' AND started_at >= '2026-12-01' "
        "ORDER BY best_eval_loss"
    )
    result = runner.invoke(app, ["query", "--ledger", str(lab), "--format", "csv", query])
    assert result.exit_code == 0, result.output
    assert result.output == (
        "run_id,status,parent_run,fork_step,best_eval_loss,final_loss\n"
        "b1,running,,,5.7,4.5\na2,crashed,,,7.95,7.3\nc1,crashed,,,9.5,9.1\n"
    )
    fork = runner.invoke(
        app,
        [
            "query",
            "--ledger",
            str(lab),
            "--format",
            "csv",
            "SELECT parent_run, fork_step FROM run_summary WHERE run_id = 'b2'",
        ],
    )
    assert fork.output == "parent_run,fork_step\nb1,5\n"


# -- the page's run index ---------------------------------------------------------------------------


def _listed(page: str) -> list[str]:
    return re.findall(r"<a href='/runs/([^']+)'>", page)


def test_the_page_index_searches_with_parsed_typed_parameters(lab: Path) -> None:
    with TestClient(create_app(lab, warm=False)) as client:
        assert _listed(client.get("/").text) == ["c2", "c1", "b2", "b1", "a2", "a1"]  # newest first
        running = client.get("/", params={"status": "running"})
        assert running.status_code == 200 and _listed(running.text) == ["b1", "c2"]
        assert "form-action 'self'" in running.headers["content-security-policy"]
        searched = client.get(
            "/", params=[("config", "moe.capacity_factor=1.25"), ("sort", "last_step"), ("desc", "1")]
        )
        assert _listed(searched.text) == ["b1", "a2", "c1"]
        assert "value='moe.capacity_factor=1.25'" in searched.text  # the form keeps the search
        assert _listed(client.get("/", params={"q": "gamma*", "since": "2027-02-01"}).text) == ["c2"]
        assert _listed(client.get("/", params={"tag": "hero"}).text) == ["b1"]
        # Text is a value, never SQL: a quote or a comment only fails to match.
        assert _listed(client.get("/", params={"q": "' OR 1=1 --"}).text) == []
        assert "form-action 'none'" in client.get("/runs/b1").headers["content-security-policy"]


@pytest.mark.parametrize(
    ("query", "line"),
    [
        ("status=dead", "status 'dead' is not one of running, finished, crashed"),
        (
            "sql=select+1",
            "unknown search parameter 'sql'; known: config, desc, q, since, sort, status, tag, until",
        ),
        ("config=moe", "config filter 'moe' is not KEY=VALUE (e.g. moe.capacity_factor=1.25)"),
        ("since=June", "time 'June' is not a date (2026-06-01), a date-time or an age (7d)"),
        (
            "sort=metric_value",
            "unknown column 'metric_value' to sort by; columns: run_id, name, status, started_at, attempts, "
            "last_step, crashes, tags, git_commit, config_hash (metric_value and metric_step come with --metric)",
        ),
    ],
)
def test_the_page_index_refuses_bad_search_in_one_line(lab: Path, query: str, line: str) -> None:
    with TestClient(create_app(lab, warm=False)) as client:
        answer = client.get("/?" + query)
        assert (answer.status_code, answer.text) == (400, line + "\n")


def test_an_age_counts_back_from_now_and_values_keep_their_json_type() -> None:
    now = datetime(2026, 6, 30, 12, tzinfo=UTC)
    assert parse_time("7d", now=now) == datetime(2026, 6, 23, 12, tzinfo=UTC)
    assert parse_time("90m", now=now) == datetime(2026, 6, 30, 10, 30, tzinfo=UTC)
    assert parse_time("2026-06-01") == datetime(2026, 6, 1, tzinfo=UTC)
    assert parse_time("2026-06-01T02:00+02:00") == datetime(2026, 6, 1, tzinfo=UTC)
    tests = [parse_config_test(text) for text in ("a.b=1", "a=1.5", "a=true", "a=null", 'a="1"', "a=adam")]
    assert [(t.path, t.op, t.value) for t in tests] == [
        (("a", "b"), "=", 1),
        (("a",), "=", 1.5),
        (("a",), "=", True),
        (("a",), "=", None),
        (("a",), "=", "1"),
        (("a",), "=", "adam"),
    ]
    assert parse_config_test("a == 2").op == "="
