"""Setting a ledger up: `ledger init`, and several ingesters creating the same new ledger at once.

`ledger init` creates the ledger, its log key and its (empty) producer registry before the first
event, and says so in one line when they exist already. Three `ledger ingest spool` started
together on a ledger that does not exist yet all succeed, agree on one ledger id, and fold the
spool in once (real processes, released together by a barrier, a few rounds).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolWriter
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from tests.support.factory import RunBuilder

runner = CliRunner()
INGESTERS = 3
ROUNDS = 2


def _spool(directory: Path, steps: int = 5) -> int:
    run = RunBuilder()
    run.start()
    for step in range(1, steps + 1):
        run.step(step)
    with SpoolWriter(directory) as writer:
        for raw in run.events:
            writer.append(raw)
    return len(run.events)


def test_three_ingesters_create_one_new_ledger_together(tmp_path: Path) -> None:
    events = _spool(tmp_path / "spool")
    # Whole processes, started together (a fork of this process would inherit its DuckDB state: a
    # child that garbage-collects a parent's connection crashes).
    command = [
        sys.executable,
        "-m",
        "runledger.cli.main",
        "ingest",
        "spool",
        "--spool",
        str(tmp_path / "spool"),
    ]
    for round_ in range(ROUNDS):
        ledger = tmp_path / f"ledger-{round_}"
        procs = [
            subprocess.Popen(
                [*command, "--ledger", str(ledger)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for _ in range(INGESTERS)
        ]
        for proc in procs:
            output = proc.communicate(timeout=300)[0].decode()
            assert proc.returncode == 0, output
            assert "Traceback" not in output and ".tmp" not in output, output
        # Folded in once, into one ledger (one id: every opener read the same marker).
        assert Ledger.open(ledger).stream_heads()["run-a"].size == events
        assert not list(ledger.rglob("*.tmp"))


# --------------------------------------------------------------------------------------------------
# `ledger init`


def test_init_creates_the_ledger_its_log_key_and_registry(tmp_path: Path) -> None:
    ledger, keys = tmp_path / "ledger", tmp_path / "keys"
    done = runner.invoke(app, ["init", "--ledger", str(ledger), "--keys", str(keys)])
    assert done.exit_code == 0, done.output
    assert (ledger / "LAKE.json").is_file() and (ledger / "catalog.sqlite").is_file()  # a lake
    assert (keys / "runledger.key").read_text().startswith("PRIVATE+KEY+runledger+")
    assert (keys / "runledger.key").stat().st_mode & 0o777 == 0o600
    assert str(keys / "runledger.pub") in done.output
    # The registry is there from the start: the ledger no longer admits every unsigned source.
    listed = runner.invoke(app, ["producers", "list", "--ledger", str(ledger)])
    assert listed.exit_code == 0, listed.output
    policy = Reader(ledger).sql("SELECT count(*) FROM events WHERE type = 'ledger.policy.changed'").rows
    assert policy == [(1,)]
    # A checkpoint and a verify work before the first event.
    signed = runner.invoke(app, ["checkpoint", "--ledger", str(ledger), "--keys", str(keys)])
    assert signed.exit_code == 0, signed.output
    verified = runner.invoke(app, ["verify", "--ledger", str(ledger), "--keys", str(keys)])
    assert verified.exit_code == 0, verified.output


def _contents(*folders: Path) -> dict[Path, bytes]:
    """Every file's bytes, but the dedupe index's (derived, rebuilt from the commit log at will)."""
    return {
        p: p.read_bytes()
        for folder in folders
        for p in folder.rglob("*")
        if p.is_file() and "_index" not in p.parts
    }


def test_init_again_says_so_in_one_line_and_changes_nothing(tmp_path: Path) -> None:
    ledger, keys = tmp_path / "ledger", tmp_path / "keys"
    assert runner.invoke(app, ["init", "--ledger", str(ledger), "--keys", str(keys)]).exit_code == 0
    before = _contents(ledger, keys)
    again = runner.invoke(app, ["init", "--ledger", str(ledger), "--keys", str(keys)])
    assert again.exit_code == 0, again.output
    lines = [line for line in again.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "already" in lines[0] and str(ledger) in lines[0], again.output
    assert _contents(ledger, keys) == before


@pytest.mark.parametrize("what", ["file", "not-a-ledger"])
def test_init_refuses_a_path_that_is_not_a_ledger_in_one_line(tmp_path: Path, what: str) -> None:
    target = tmp_path / "there"
    if what == "file":
        target.write_text("x")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    done = runner.invoke(app, ["init", "--ledger", str(target), "--keys", str(tmp_path / "keys")])
    assert done.exit_code != 0
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.output, done.output
    assert not (tmp_path / "keys").exists()
