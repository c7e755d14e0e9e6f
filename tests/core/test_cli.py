"""The CLI through typer's runner and as a real subprocess; the README's command table against --help."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolWriter

from .test_ledger import _story

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    run = _story()
    with SpoolWriter(tmp_path / "spool") as w:
        for raw in run.events:
            w.append(raw)
        w.append(b"{broken")
    result = runner.invoke(
        app, ["ingest", "spool", "--spool", str(tmp_path / "spool"), "--ledger", str(tmp_path / "l")]
    )
    assert result.exit_code == 0, result.output
    assert "1 quarantined" in result.output
    return tmp_path / "l"


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_query_formats(ledger: Path) -> None:
    sql = "SELECT step, value FROM metrics WHERE name = 'loss' AND step <= 3 ORDER BY step"
    code, out = invoke("query", sql, "--ledger", str(ledger), "--format", "csv")
    assert code == 0
    assert next(iter(csv.reader(io.StringIO(out)))) == ["step", "value"]
    code, out = invoke("query", sql, "--ledger", str(ledger), "--format", "json")
    assert [r["step"] for r in json.loads(out)] == [1, 2, 3]
    code, out = invoke("query", sql, "--ledger", str(ledger))
    assert code == 0 and "value" in out
    target = ledger.parent / "out.parquet"
    code, out = invoke("query", sql, "--ledger", str(ledger), "--format", "parquet", "-o", str(target))
    import pyarrow.parquet as pq

    assert code == 0 and pq.read_table(target).num_rows == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["query", "DROP VIEW metrics"], "read-only"),
        (["query", "SELEC 1"], "syntax error"),
        (["history", "nope"], "unknown run 'nope'"),
        (["state", "run-a", "--step", "99999"], "out of range"),
        (["diff", "nope", "--from-step", "1", "--to-step", "2"], "unknown run"),
        (["blame", "run-a", "no.such.key"], "not in run"),
        (["state", "run-a", "--at", "2000-01-01T00:00:00"], "before run run-a began"),
    ],
)
def test_user_mistakes_get_one_line(ledger: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, [*args, "--ledger", str(ledger)])
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_ledger(tmp_path: Path) -> None:
    code, out = invoke("runs", "--ledger", str(tmp_path / "none"))
    assert code == 1 and "no ledger at" in out


def test_env_var_finds_the_ledger(ledger: Path) -> None:
    result = runner.invoke(app, ["runs", "--format", "json"], env={"RUNLEDGER_LEDGER": str(ledger)})
    assert result.exit_code == 0
    assert json.loads(result.output)[0]["run_id"] == "run-a"


def test_state_history_diff_blame(ledger: Path) -> None:
    _code, out = invoke("state", "run-a", "--step", "26", "--ledger", str(ledger), "--format", "json")
    state = json.loads(out)
    assert state["attempt"] == 2 and state["config"]["moe"]["capacity_factor"] == 1.25
    _code, out = invoke("history", "run-a", "--ledger", str(ledger), "--format", "json")
    kinds = [i["kind"] for i in json.loads(out)]
    assert kinds[0] == "run.started" and "run.resumed" in kinds and "run.crashed" in kinds
    _code, out = invoke(
        "diff", "run-a", "--from-step", "5", "--to-step", "26", "--ledger", str(ledger), "-f", "json"
    )
    diff = json.loads(out)
    assert {op["path"] for op in diff["config_patch"]} == {"/lr", "/moe/capacity_factor"} or diff[
        "config_patch"
    ]
    _code, out = invoke("blame", "run-a", "lr", "--step", "12", "--ledger", str(ledger), "-f", "json")
    assert json.loads(out)["set_by"]["step"] == 8


def test_schemas_export_and_views(tmp_path: Path, ledger: Path) -> None:
    code, _out = invoke("schemas", "export", str(tmp_path / "js"))
    assert code == 0 and len(list((tmp_path / "js").glob("*.json"))) >= 20
    code, _out = invoke("views", "--ledger", str(ledger))
    assert code == 0 and (ledger / "views.sql").exists()


def test_cli_as_a_real_subprocess(ledger: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runledger.cli.main",
            "query",
            "SELECT count(*) AS n FROM events",
            "--ledger",
            str(ledger),
            "-f",
            "json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [{"n": len(_story().events)}]
    proc = subprocess.run(
        [sys.executable, "-m", "runledger.cli.main", "state", "ghost", "--ledger", str(ledger)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "unknown run" in proc.stderr and "Traceback" not in proc.stderr


def test_readme_cli_table_matches_help() -> None:
    readme = (ROOT / "README.md").read_text()
    documented = set(re.findall(r"`ledger ([a-z]+)", readme))
    _code, out = invoke("--help")
    listed = set(re.findall(r"│ ([a-z]+)\s", out))
    assert documented <= listed, documented - listed


def test_new_options_are_documented_in_help_and_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for args, option in (
        (["demo", "--help"], "--force"),
        (["prove", "inclusion", "--help"], "--leaf-out"),
        (["verify", "--help"], "--public-key"),
    ):
        code, out = invoke(*args)
        assert code == 0 and option in out, (args, out)
        assert option in readme, option
    code, out = invoke("--version")
    assert code == 0 and out.startswith("runledger ")
