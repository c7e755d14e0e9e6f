"""`ledger ingest spool` says why it quarantined records and how to admit them (issue 41).

A ledger made by `ledger init` has a producer registry, so unsigned events are refused: the ingest
names the reason with its count and the exact `ledger producers policy --allow-unsigned …` command;
that command, run as printed, admits the next unsigned events. Real spool, real ledger, the CLI.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.cli.quarantine_summary import QuarantineTally, summary_lines
from runledger.ingest.bus import SpoolSink
from runledger.ledger.store import CommitResult, SourceRecord
from runledger.schemas import Envelope, make_event
from runledger.schemas.codec import Quarantined
from runledger.schemas.payloads import StepMetrics

ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "400"}


def invoke(*args: str | Path) -> tuple[str, str]:
    """(stdout, stderr) of a command that must succeed."""
    result = CliRunner().invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == 0, result.output
    return result.stdout, result.stderr


def metric(source: str, step: int) -> Envelope:
    return make_event(
        StepMetrics(loss=1.0), source=source, stream="r5", run_id="r5", attempt=1, step=step, seq=step
    )


def spool_of(where: Path, events: list[Envelope], garbage: int = 0) -> Path:
    """A real spool holding ``events`` (unsigned) and ``garbage`` records that are not JSON."""
    sink = SpoolSink(where)
    for event in events:
        sink.emit(event)
    for _ in range(garbage):
        sink.emit_raw(b"not json")
    sink.close()
    return where


def test_unsigned_events_under_a_registry_name_the_reason_and_the_fix(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    invoke("init", "--ledger", ledger)
    events = [metric("trainer/r5/a1/rank0", s) for s in range(4)] + [metric("trainer/r5/a1/rank1", 0)]
    out, err = invoke("ingest", "spool", "--spool", spool_of(tmp_path / "s1", events, 2), "--ledger", ledger)
    assert out.startswith("ingested 0 events"), out
    assert "7 quarantined" in out
    lines = err.strip().splitlines()
    assert lines == [
        "quarantined: 5 unsigned, 2 decode (the quarantine table has each record and its reason)",
        "unsigned: this ledger's registry admits only signed events; from the next event on, allow them "
        f"with `ledger producers policy --allow-unsigned trainer/r5 --ledger {ledger}`, or sign them "
        "(producer key in $RUNLEDGER_PRODUCER_KEY) and `ledger producers add NAME --public-key KEY.pub "
        f"--source trainer/r5 --ledger {ledger}`",
    ]

    # The fix as printed admits the next unsigned events of that run.
    command = lines[1].split("`")[1]
    invoke(*shlex.split(command)[1:])
    later = [metric("trainer/r5/a2/rank0", s) for s in range(3)]
    out, err = invoke("ingest", "spool", "--spool", spool_of(tmp_path / "s2", later), "--ledger", ledger)
    assert out.startswith("ingested 3 events"), out
    assert err == ""


def test_nothing_quarantined_says_nothing_more(tmp_path: Path) -> None:
    out, err = invoke(
        "ingest",
        "spool",
        "--spool",
        spool_of(tmp_path / "s", [metric("t/r/a1/rank0", 0)]),
        "--ledger",
        tmp_path / "l",
    )
    assert out.startswith("ingested 1 event"), out
    assert err == ""


def test_the_policy_command_keeps_the_sources_allowed_now(tmp_path: Path) -> None:
    refused = [
        (
            SourceRecord("spool", i, b"{}"),
            Quarantined(raw=b"{}", reason="unsigned: x", source=f"github/acme/r{i}", code="unsigned"),
        )
        for i in range(2)
    ]
    tally = QuarantineTally()
    tally(CommitResult(commit=1, quarantined=refused))
    lines = summary_lines(tally, tmp_path, ["trainer"])
    assert lines[0].startswith("quarantined: 2 unsigned (")
    assert (
        "`ledger producers policy --allow-unsigned trainer --allow-unsigned github/acme --ledger" in lines[1]
    )
