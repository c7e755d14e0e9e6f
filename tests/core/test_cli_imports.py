"""A fast CLI (issue 41): `ledger --help` imports no library a command needs, and `ledger query`
none of the producers' (the trainer, W&B, plotting, the web server, Kafka). Read from Python's own
import log (``-X importtime``), not timed: each failure names the modules and the CLI module that
brought each in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
# A heavy module, and every submodule of it.
NOT_FOR_HELP = (
    "numpy",
    "pyarrow",
    "duckdb",
    "pydantic",
    "runledger.ledger.store",
    "runledger.ledger.lake",
    "runledger.ledger.query",
    "torch",
    "wandb",
    "matplotlib",
    "uvicorn",
    "kafka",
    "trainer",
)
NOT_FOR_QUERY = ("torch", "wandb", "matplotlib", "uvicorn", "kafka", "trainer")
SMALL_RUN = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]


def _imports(*args: str) -> list[tuple[int, str]]:
    """(nesting depth, module) of every module the command imported, in Python's order (a module's
    own imports before it); the command must succeed."""
    return _imports_of(["-m", "runledger.cli.main", *args])


def _imports_of(argv: list[str]) -> list[tuple[int, str]]:
    """(nesting depth, module) of every module ``python <argv>`` imported; it must succeed."""
    env = dict(os.environ, COLUMNS="100", RUNLEDGER_PROGRESS_S="off")
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or line.endswith("| imported package"):
            continue
        name = line.rsplit("|", 1)[1]
        found.append(((len(name) - len(name.lstrip())) // 2, name.strip()))
    return found


def _brought_by(found: list[tuple[int, str]], index: int) -> str:
    """The outermost ``cli`` module (else the outermost module) whose import brought ``found[index]``."""
    depth, chain = found[index][0], [found[index][1]]
    for outer_depth, outer in found[index + 1 :]:
        if outer_depth < depth:
            depth = outer_depth
            chain.append(outer)
    from_cli = [name for name in chain if name.startswith("cli.")]
    return from_cli[-1] if from_cli else chain[-1]


def _heavy(found: list[tuple[int, str]], heavy: tuple[str, ...]) -> dict[str, str]:
    """Each heavy module imported -> the module that brought it in."""
    return {
        name: _brought_by(found, i)
        for i, (_, name) in enumerate(found)
        if any(name == h or name.startswith(h + ".") for h in heavy)
    }


def _top_level(modules: dict[str, str]) -> dict[str, str]:
    """The heavy modules named once each: a package, not its every submodule."""
    return {name: by for name, by in modules.items() if not any(name.startswith(o + ".") for o in modules)}


def test_help_imports_no_command_library() -> None:
    found = _imports("--help")
    assert any(name == "runledger.cli.output" for _, name in found)  # (the log is the CLI's)
    assert _top_level(_heavy(found, NOT_FOR_HELP)) == {}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small lake ledger, made by the CLI itself."""
    root = tmp_path_factory.mktemp("cli-imports")
    runner = CliRunner()
    env = {"RUNLEDGER_PROGRESS_S": "off"}
    made = runner.invoke(
        app, ["simulate", "reference-535b", "--spool", str(root / "spool"), *SMALL_RUN], env=env
    )
    assert made.exit_code == 0, made.output
    ingested = runner.invoke(
        app, ["ingest", "spool", "--spool", str(root / "spool"), "--ledger", str(root / "lake")], env=env
    )
    assert ingested.exit_code == 0, ingested.output
    assert (root / "lake" / "LAKE.json").is_file()
    return root / "lake"


def test_query_imports_no_producer_library(lake: Path) -> None:
    found = _imports("query", "SELECT count(*) FROM events", "--ledger", str(lake))
    assert _top_level(_heavy(found, NOT_FOR_QUERY)) == {}
    # The check can fail: the log shows what the command does import (DuckDB, by the reader), and
    # the program lists the lake's files with Python's sqlite3 (no DuckDB extension to load).
    assert _top_level(_heavy(found, ("duckdb", "runledger.ledger.query"))).keys() == {
        "duckdb",
        "runledger.ledger.query",
    }
    assert any(name == "runledger.ledger.lake_snapshot_files" for _, name in found)


# What the reader of a lake needs no part of: the writer (its admission checks bring cryptography)
# and the redaction's writer; nor pyarrow (the writers' schemas are built on first use).
NOT_FOR_READER = (
    "pyarrow",
    "numpy",
    "runledger.ledger.store",
    "runledger.ledger.admission",
    "runledger.ledger.redaction",
    "runledger.ledger.projectors",
    "runledger.ledger.seen_index",
    "cryptography",
)
READ_A_LAKE = """
import sys
from runledger.ledger.query import Reader
reader = Reader(sys.argv[1], sqlite3_catalog=True)
try:
    assert reader.sql("SELECT count(*) FROM events").rows[0][0] > 0
    reader.runs()
finally:
    reader.close()
"""


def test_reader_of_a_lake_imports_no_writer(lake: Path) -> None:
    found = _imports_of(["-c", READ_A_LAKE, str(lake)])
    assert _top_level(_heavy(found, NOT_FOR_READER)) == {}
    # The check can fail: the log holds the reader's own modules, the lake's listing among them.
    assert _top_level(_heavy(found, ("runledger.ledger.query", "runledger.ledger.records"))).keys() == {
        "runledger.ledger.query",
        "runledger.ledger.records",
    }


def test_query_on_a_lake_imports_no_writer(lake: Path) -> None:
    """`ledger query` itself (the program, its error mapping included) loads none of the writer."""
    found = _imports("query", "SELECT count(*) FROM events", "--ledger", str(lake))
    assert _top_level(_heavy(found, NOT_FOR_READER)) == {}


# What running one command needs no part of: the other commands' modules (the program registers only
# the command it runs: runledger.cli.main.run), typer's pydantic adapters (runledger.cli.typer_params),
# for a read of a lake pyarrow (the readers know the tables' columns as DuckDB types), and rich (~22 ms:
# a read prints plain text; rich draws a terminal's progress bars and styled lines).
NOT_FOR_ONE_COMMAND = (
    "rich",
    "pyarrow",
    "numpy",
    "pydantic",
    "typer._adapters",
    "runledger.cli.demo_cmd",
    "runledger.cli.ingest_cmd",
    "runledger.cli.simulate_cmd",
    "runledger.cli.train_cmd",
    "runledger.cli.study_cmd",
    "runledger.cli.publish_cmd",
    "runledger.cli.report_cmd",
)


@pytest.mark.parametrize("command", [["query", "SELECT count(*) FROM events"], ["state", "latest"]])
def test_a_command_on_a_lake_imports_no_other_command(lake: Path, command: list[str]) -> None:
    found = _imports(*command, "--ledger", str(lake))
    assert _top_level(_heavy(found, NOT_FOR_ONE_COMMAND)) == {}
    # The check can fail: the log holds the command's own module.
    assert _top_level(_heavy(found, ("runledger.cli.ledger_cmd",))).keys() == {"runledger.cli.ledger_cmd"}


def test_help_gets_the_whole_app() -> None:
    """The app's help and a group's help list every command: the whole app (each command's module)."""
    for args in (["--help"], ["ingest", "--help"]):
        found = _imports(*args)
        assert _top_level(_heavy(found, ("runledger.cli.demo_cmd",))).keys() == {"runledger.cli.demo_cmd"}


def test_signed_notes_import_cryptography_only_to_sign_or_check() -> None:
    # The writer's admission checks import the note keys' module; cryptography waits for a key.
    found = _imports_of(["-c", "import runledger.ledger.store"])
    assert any(name == "runledger.schemas.note" for _, name in found)
    assert _top_level(_heavy(found, ("cryptography",))) == {}
    with_a_key = "from runledger.schemas.note import generate_keypair; generate_keypair('k')"
    assert _top_level(_heavy(_imports_of(["-c", with_a_key]), ("cryptography",))).keys() == {"cryptography"}
