"""The CLI in everyday use (issue 15): tables like duckdb's, one output contract for every
row-printing command, SQL as DuckDB parses it, paths that lead to the ledger, the same words and
one-line errors everywhere, `latest`, and `ledger shell`.

Tables are pinned exactly at fixed terminal widths ($COLUMNS), as sqlite-utils tests its CLI.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.store import Ledger, SourceRecord

from .test_ledger import _story

runner = CliRunner()


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("everyday") / "ledger"
    run = _story()  # run-a: lr changed at 8, crash at 20, resume from 15, capacity factor 1.25 at 25
    Ledger.create(root).commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    return root


def invoke(*args: str | Path, columns: int | None = 80, input: str | None = None) -> tuple[int, str]:
    env = {"COLUMNS": str(columns) if columns else ""}
    result = runner.invoke(app, [str(a) for a in args], env=env, input=input)
    return result.exit_code, result.output


def one_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("error: ") and "Traceback" not in out
    return lines[0]


# -- 1. tables ------------------------------------------------------------------------------------

VALUES = (
    "SELECT * FROM (VALUES (1, 'short', NULL, ''), (22, 'a much longer piece of text', 'x', 'y')) "
    "t(n, text, maybe, empty)"
)


def test_table_fits_the_terminal_and_shows_null_apart_from_empty(ledger: Path) -> None:
    code, out = invoke("query", VALUES, "--ledger", ledger, columns=80)
    assert code == 0
    assert out == (
        "┌────┬─────────────────────────────┬───────┬───────┐\n"
        "│ n  │ text                        │ maybe │ empty │\n"
        "├────┼─────────────────────────────┼───────┼───────┤\n"
        "│  1 │ short                       │ NULL  │       │\n"
        "│ 22 │ a much longer piece of text │ x     │ y     │\n"
        "└────┴─────────────────────────────┴───────┴───────┘\n"
    )
    code, out = invoke("query", VALUES, "--ledger", ledger, columns=40)
    assert out == (
        "┌────┬─────────────────┬───────┬───────┐\n"
        "│ n  │ text            │ maybe │ empty │\n"
        "├────┼─────────────────┼───────┼───────┤\n"
        "│  1 │ short           │ NULL  │       │\n"
        "│ 22 │ a much longer … │ x     │ y     │\n"
        "└────┴─────────────────┴───────┴───────┘\n"
    )
    assert max(len(line) for line in out.splitlines()) == 40
    code, out = invoke("query", VALUES, "--ledger", ledger, columns=24)
    assert out == (
        "┌────┬─────────┬───────┐\n"
        "│ n  │ text    │ maybe │\n"
        "├────┼─────────┼───────┤\n"
        "│  1 │ short   │ NULL  │\n"
        "│ 22 │ a much… │ x     │\n"
        "└────┴─────────┴───────┘\n"
        "1 of 4 columns hidden (--format csv or json for all)\n"
    )


def test_table_rows_are_capped_with_the_total_shown(ledger: Path) -> None:
    sql = "SELECT range AS i FROM range(100)"
    code, out = invoke("query", sql, "--ledger", ledger)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3 + 40 + 1 + 1
    assert lines[-1] == "40 of 100 rows (--limit 0 for all)"
    code, out = invoke("query", sql, "--ledger", ledger, "--limit", "2")
    assert out == "┌───┐\n│ i │\n├───┤\n│ 0 │\n│ 1 │\n└───┘\n2 of 100 rows (--limit 0 for all)\n"
    code, out = invoke("query", sql, "--ledger", ledger, "--limit", "0")
    assert len(out.splitlines()) == 3 + 100 + 1 and "rows" not in out
    # Other formats write every row unless --limit is given.
    code, out = invoke("query", sql, "--ledger", ledger, "-f", "csv")
    assert len(out.splitlines()) == 101
    code, out = invoke("query", sql, "--ledger", ledger, "-f", "jsonl", "--limit", "3")
    assert out == '{"i": 0}\n{"i": 1}\n{"i": 2}\n'


def test_hashes_are_short_in_tables_unless_full(ledger: Path) -> None:
    sql = "SELECT repeat('a', 40) AS git_commit, repeat('0f', 32) AS config_hash, 'cafe' AS word"
    code, out = invoke("query", sql, "--ledger", ledger)
    assert out.splitlines()[3] == "│ aaaaaaa    │ 0f0f0f0     │ cafe │"
    code, out = invoke("query", sql, "--ledger", ledger, "--full")
    assert "a" * 40 in out and "0f" * 32 in out
    code, out = invoke("query", sql, "--ledger", ledger, "-f", "csv")
    assert "a" * 40 in out  # data formats carry the whole value
    code, out = invoke("state", "run-a", "--step", "26", "--ledger", ledger)
    assert code == 0 and "  commit: bbbbbbb (dirty)\n" in out
    _code, out = invoke("runs", "--ledger", ledger, columns=200)
    assert "│ bbbbbbb    │" in out and "b" * 40 not in out


# -- 2. one output contract -----------------------------------------------------------------------

ROW_COMMANDS = [
    ["query", "SELECT step, value FROM metrics WHERE name = 'loss' AND step <= 3 ORDER BY step"],
    ["runs"],
    ["history", "run-a"],
    ["state", "run-a", "--step", "26"],
    ["diff", "run-a", "--from-step", "5", "--to-step", "26"],
    ["blame", "run-a", "lr"],
    ["schemas", "list"],
]


@pytest.mark.parametrize("args", ROW_COMMANDS, ids=lambda a: a[0] if a[0] != "schemas" else "schemas list")
def test_every_format_is_honoured_by_every_row_command(ledger: Path, args: list[str], tmp_path: Path) -> None:
    where = [] if args[0] == "schemas" else ["--ledger", str(ledger)]
    code, out = invoke(*args, *where, "-f", "csv")
    assert code == 0, out
    header = next(csv.reader(io.StringIO(out)))
    assert "┌" not in out and len(header) >= 2
    code, out = invoke(*args, *where, "-f", "json")
    assert code == 0 and json.loads(out)
    code, out = invoke(*args, *where, "-f", "jsonl")
    lines = out.splitlines()
    assert code == 0 and lines and all(isinstance(json.loads(line), dict) for line in lines)
    assert list(json.loads(lines[0])) == header  # jsonl's keys are csv's columns
    target = tmp_path / "out.parquet"
    code, out = invoke(*args, *where, "-f", "parquet", "-o", target)
    assert code == 0, out
    assert pq.read_table(target).column_names == header
    # No --format: --output's extension decides.
    for suffix, check in ((".csv", lambda t: next(csv.reader(io.StringIO(t))) == header), (".jsonl", None)):
        path = tmp_path / f"out{suffix}"
        code, out = invoke(*args, *where, "-o", path)
        text = path.read_text()
        assert code == 0 and (check(text) if check else json.loads(text.splitlines()[0]))


def test_output_mistakes_are_one_line(ledger: Path, tmp_path: Path) -> None:
    sql = "SELECT 1 AS one"
    code, out = invoke("query", sql, "--ledger", ledger, "-o", tmp_path / "nowhere" / "x.csv")
    assert code == 2
    assert (
        one_error_line(out) == f"error: cannot write {tmp_path}/nowhere/x.csv: no folder {tmp_path}/nowhere"
    )
    code, out = invoke("blame", "run-a", "lr", "--ledger", ledger, "-o", tmp_path / "nowhere" / "b.parquet")
    assert code == 2 and "no folder" in one_error_line(out)
    code, out = invoke("query", sql, "--ledger", ledger, "-f", "parquet")
    assert code == 2 and one_error_line(out) == "error: --format parquet needs --output FILE"
    code, out = invoke("query", sql, "--ledger", ledger, "-o", tmp_path / "x.xlsx")
    assert code == 2 and "cannot tell the format from 'x.xlsx'" in one_error_line(out)
    code, out = invoke(
        "prove", "consistency", "run-a", "--from", "1", "--ledger", ledger, "-o", tmp_path / "no" / "p.json"
    )
    assert code == 2 and "no folder" in one_error_line(out)
    code, out = invoke("query", sql, "--ledger", ledger, "-f", "xml")
    assert code == 2 and "'xml' is not one of" in one_error_line(out)
    assert not list(tmp_path.iterdir())


def test_a_table_to_a_file_is_whole(ledger: Path, tmp_path: Path) -> None:
    target = tmp_path / "history.txt"
    code, _out = invoke("history", "run-a", "--ledger", ledger, "-o", target, columns=30)
    text = target.read_text()
    assert code == 0 and text.startswith("history of run-a\n┌")
    assert "config changed at step 25: moe.capacity_factor 1.0 → 1.25" in text  # not cut to 30 columns


# -- 3. SQL ---------------------------------------------------------------------------------------


def test_pivot_is_allowed(ledger: Path) -> None:
    sql = "PIVOT (SELECT step, name, value FROM metrics WHERE step <= 2) ON name USING first(value) ORDER BY step"
    code, out = invoke("query", sql, "--ledger", ledger, "-f", "json")
    assert code == 0, out
    assert [r["step"] for r in json.loads(out)] == [1, 2] and "loss" in json.loads(out)[0]


def test_several_statements_are_refused_not_reduced_to_the_last(ledger: Path) -> None:
    code, out = invoke("query", "SELECT 1 AS a; SELECT 2 AS b", "--ledger", ledger)
    assert code == 1
    assert one_error_line(out) == (
        "error: 2 statements given; run one at a time (or several in `ledger shell`)"
    )
    code, out = invoke("query", "SELECT 1; DROP VIEW metrics", "--ledger", ledger)
    assert code == 1 and "read-only" in one_error_line(out)


def test_parser_errors_keep_their_caret_under_the_mistake(ledger: Path) -> None:
    code, out = invoke("query", "SELECT step\nFORM metrics", "--ledger", ledger)
    assert code == 1 and "Traceback" not in out
    lines = out.splitlines()
    assert lines[0].startswith("error: Parser Error: syntax error at or near")
    context = next(i for i, line in enumerate(lines) if line.startswith("LINE 2: "))
    caret = lines[context + 1]
    assert lines[context][caret.index("^") :].startswith("metrics")


# -- 4. paths -------------------------------------------------------------------------------------


def test_missing_ledger_points_at_the_one_that_exists(
    ledger: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out = invoke("runs")
    assert code == 1
    assert one_error_line(out) == (
        "error: no ledger at .runledger/ledger (create one with `ledger ingest` or `ledger demo`)"
    )
    # After `make demo`: the default path is empty, the demo's ledger exists.
    demo = tmp_path / ".runledger" / "demo"
    demo.mkdir(parents=True)
    (demo / "ledger").symlink_to(ledger)
    code, out = invoke("runs")
    assert one_error_line(out) == (
        "error: no ledger at .runledger/ledger; did you mean --ledger .runledger/demo/ledger? "
        "(or export RUNLEDGER_LEDGER=.runledger/demo/ledger)"
    )
    # The demo's work folder given for its ledger: one level above.
    code, out = invoke("history", "latest", "--ledger", ".runledger/demo")
    assert "did you mean --ledger .runledger/demo/ledger?" in one_error_line(out)
    code, out = invoke("runs", "-f", "json", "--ledger", ".runledger/demo/ledger")
    assert code == 0 and json.loads(out)[0]["run_id"] == "run-a"


# -- 5. the answers -------------------------------------------------------------------------------


def test_diff_speaks_as_history_and_blame_do(ledger: Path) -> None:
    code, out = invoke(
        "diff", "run-a", "--from-step", "5", "--to-step", "26", "--ledger", ledger, columns=100
    )
    assert code == 0
    assert out.startswith(
        "run-a step 5 (attempt 1) → step 26 (attempt 2)\n  lr 0.001 → 0.0005\n  moe.capacity_factor 1.0 → 1.25\n"
    )
    code, out = invoke(
        "diff", "run-a", "--from-step", "5", "--to-step", "26", "--ledger", ledger, "-f", "csv"
    )
    assert out == (
        "op,key,change\n"
        "replace,lr,lr 0.001 → 0.0005\n"
        "replace,moe.capacity_factor,moe.capacity_factor 1.0 → 1.25\n"
    )
    code, out = invoke("diff", "run-a", "--from-step", "26", "--to-step", "28", "--ledger", ledger)
    assert "  config unchanged\n" in out


@pytest.mark.parametrize("command", ["diff", "history"])
def test_a_range_of_steps_the_wrong_way_round_is_a_usage_error_not_an_empty_answer(
    ledger: Path, command: str
) -> None:
    code, out = invoke(command, "run-a", "--from-step", "26", "--to-step", "5", "--ledger", ledger)
    assert (code, out) == (2, "error: --from-step 26 is after --to-step 5: give the earlier step first\n")
    code, out = invoke(command, "run-a", "--from-step", "-1", "--to-step", "5", "--ledger", ledger)
    assert code == 2 and "Invalid value for '--from-step'" in out


def test_blame_of_a_section_prints_json(ledger: Path) -> None:
    code, out = invoke("blame", "run-a", "moe", "--ledger", ledger)
    assert code == 0
    assert out.splitlines()[0] == 'moe = {"capacity_factor": 1.25} at step 30 of run-a'
    code, out = invoke("blame", "run-a", "lr", "--ledger", ledger)
    assert out.splitlines()[0] == "lr = 0.0005 at step 30 of run-a"


def test_latest_names_the_most_recently_started_run(ledger: Path) -> None:
    code, out = invoke("history", "latest", "--ledger", ledger, "-f", "json")
    assert code == 0 and json.loads(out)[0]["kind"] == "run.started"
    code, out = invoke("state", "latest", "--ledger", ledger, "-f", "json")
    assert json.loads(out)["run_id"] == "run-a"


def test_latest_in_an_empty_ledger_is_one_line(tmp_path: Path) -> None:
    Ledger.create(tmp_path / "empty")
    code, out = invoke("history", "latest", "--ledger", tmp_path / "empty")
    assert code == 1
    assert one_error_line(out) == "error: the ledger has no runs yet, so no `latest` run"


# -- 6. the same words everywhere -----------------------------------------------------------------


def _listed(help_text: str) -> list[str]:
    """The commands in a --help's Commands panel (never its options: --install-completion writes to $HOME)."""
    panel = help_text.split("─ Commands ─", 1)
    return re.findall(r"^│ ([a-z][a-z-]*) {2,}", panel[1], flags=re.MULTILINE) if len(panel) == 2 else []


def _commands(*group: str) -> list[list[str]]:
    """Every command under ``group`` (the app itself when empty), groups of groups included."""
    _code, out = invoke(*group, "--help", columns=200)
    found = []
    for name in _listed(out):
        _code, sub = invoke(*group, name, "--help", columns=200)
        found += _commands(*group, name) if _listed(sub) else [[*group, name]]
    return found


# Commands being written in parallel with this test (issue 15's lead merges them); each is to get
# its example too, and then leaves this set.
EXAMPLE_TO_COME = {"report", "plot", "simulate", "producers"}


def test_every_command_has_h_an_example_and_a_plain_usage_line() -> None:
    commands = _commands()
    assert ["query"] in commands and ["shell"] in commands and ["prove", "inclusion"] in commands
    without_example = set()
    for command in commands:
        code, out = invoke(*command, "-h", columns=200)
        assert code == 0, (command, out)
        usage = next(line for line in out.splitlines() if "Usage:" in line)
        assert "{" not in usage and "[[" not in usage, usage
        if "Example: ledger " not in out:
            without_example.add(command[0])
    assert without_example <= EXAMPLE_TO_COME, without_example - EXAMPLE_TO_COME


def test_argument_errors_are_one_line_like_every_other_error(ledger: Path) -> None:
    code, out = invoke("history")
    assert code == 2 and one_error_line(out) == "error: Missing argument 'RUN'. (see `ledger history -h`)"
    code, out = invoke("histroy", "run-a")
    assert code == 2 and "Did you mean 'history'?" in one_error_line(out)
    code, out = invoke("history", "run-a", "--limt", "3", "--ledger", ledger)
    assert code == 2 and "(Possible options: --limit)" in one_error_line(out)


def test_bootstrap_is_the_one_name_for_kafka_servers() -> None:
    for command in (["train"], ["ingest", "kafka"], ["replay"], ["kafka", "drain-spool"]):
        _code, out = invoke(*command, "-h", columns=200)
        assert "--bootstrap" in out and "--kafka " not in out, command


def test_version_and_completion() -> None:
    code, out = invoke("--version")
    assert code == 0 and re.fullmatch(r"runledger \S+\n", out)
    _code, out = invoke("--help", columns=200)
    assert "--install-completion" in out and "--show-completion" in out


# -- 7. ledger shell ------------------------------------------------------------------------------


def test_builtin_shell_runs_statements_in_order_and_stays_read_only(ledger: Path) -> None:
    session = "SELECT 1 AS a; SELECT 2\n  AS b;\nDROP VIEW metrics;\nSELECT count(*) AS n FROM runs;\n.quit\n"
    code, out = invoke("shell", "--builtin", "--ledger", ledger, input=session, columns=60)
    assert code == 0, out
    tables = re.findall(r"│ (\w+) │\n├", out)
    assert tables == ["a", "b", "n"]
    assert "│ 1 │" in out and "│ 2 │" in out
    assert "error: refused: the ledger is read-only here" in out
    code, out = invoke("shell", "--builtin", "--ledger", ledger, input=".tables\n")
    assert code == 0 and "metrics_all" in out and " _metrics" not in out


def test_third_party_warnings_stay_off_the_terminal_unless_verbose() -> None:
    import warnings

    from runledger.cli.output import third_party_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_warnings(verbose=False):
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
        assert seen == []
        with third_party_warnings(verbose=True):
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["Apex is not installed. Falling back to Torch Norm"]
    for command in ("train", "demo"):
        _code, out = invoke(command, "-h", columns=200)
        assert "--verbose" in out, command


def test_shell_opens_duckdbs_own_shell_on_the_views_when_on_path(ledger: Path, tmp_path: Path) -> None:
    # A stand-in `duckdb` binary that does what DuckDB's shell does with `-init FILE` and stdin.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "duckdb"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import sys, duckdb\n"
        "flag, init = sys.argv[1:]\n"
        "assert flag == '-init', sys.argv\n"
        "con = duckdb.connect()\n"
        "con.execute(open(init).read())\n"
        "for st in con.extract_statements(sys.stdin.read()):\n"
        "    print(con.execute(st.query).fetchall())\n"
    )
    fake.chmod(0o755)
    proc = subprocess.run(
        [sys.executable, "-m", "runledger.cli.main", "shell", "--ledger", str(ledger)],
        input="SELECT run_id, attempts FROM runs; SELECT count(*) FROM metrics WHERE name = 'loss';",
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[('run-a', 2)]\n[(30,)]\n"
