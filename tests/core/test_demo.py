"""The README's main job, shortened: the real trainer → spool → ledger → history path; and Ctrl-C."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader

ROOT = Path(__file__).resolve().parents[2]


def test_demo_end_to_end(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "demo",
            "--workdir",
            str(tmp_path / "demo"),
            "--steps",
            "40",
            "--crash-at",
            "30",
            "--change-at",
            "10",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "verify: OK" in result.output
    assert "(RuntimeError: injected crash at step 30" in result.output and "None" not in result.output
    reader = Reader(tmp_path / "demo" / "ledger")
    kinds = {r[0] for r in reader.sql("SELECT DISTINCT type FROM events").rows}
    assert {
        "runledger.run.started",
        "runledger.config.changed",
        "runledger.run.crashed",
        "runledger.run.resumed",
        "runledger.checkpoint.saved",
        "runledger.run.finished",
    } <= kinds
    attempts = reader.sql("SELECT attempt, start_step FROM attempts ORDER BY attempt").rows
    assert attempts == [(1, 0), (2, 20)]
    assert reader.sql("SELECT count(*) FROM metrics WHERE name = 'loss'").rows == [(40,)]
    # The folder is marked as the demo's own (a rerun may replace its outputs, nothing else).
    assert (tmp_path / "demo" / ".runledger-demo").is_file()
    # The demo prints the exact verify command, with its key; run as printed, it checks the signature.
    command = re.search(r"(ledger verify --ledger \S+ --public-key \S+)", result.output).group(1)
    verified = CliRunner().invoke(app, shlex.split(command)[1:])
    assert verified.exit_code == 0, verified.output
    # Two streams: the run's, and the ledger's own (the demo registers its trainer's producer key).
    assert "2 signed checkpoints checked" in verified.output
    # Without the key, verify does not say OK about what it skipped.
    unverified = CliRunner().invoke(
        app, ["verify", "--ledger", str(tmp_path / "demo" / "ledger"), "--keys", str(tmp_path / "none")]
    )
    assert unverified.exit_code == 3 and "UNVERIFIED" in unverified.output
    # Blame at the last step names the live change, not the resume that only carried it over.
    run_id = reader.sql("SELECT run_id FROM runs").rows[0][0]
    cf = reader.blame(run_id, "moe.capacity_factor")
    assert (cf["value"], cf["set_by"]["kind"], cf["set_by"]["step"]) == (1.25, "config.changed", 11)
    assert reader.blame(run_id, "moe.top_k")["set_by"]["kind"] == "start"


@pytest.mark.parametrize("signals", [1, 2], ids=["one Ctrl-C", "two Ctrl-Cs"])
def test_ctrl_c_stops_the_demo_with_130_and_a_consistent_ledger(tmp_path: Path, signals: int) -> None:
    work = tmp_path / "demo"
    demo = ["demo", "--workdir", str(work), "--steps", "400", "--crash-at", "390", "--change-at", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "runledger.cli.main", *demo],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        # Wait until training is under way: the demo edits its config file after step 2.
        config = work / "config.toml"
        deadline = time.monotonic() + 240
        while not (config.is_file() and "capacity_factor = 1.25" in config.read_text()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the demo did not reach step 2"
            time.sleep(0.1)
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out + err
    assert "interrupted by SIGINT" in err and "not resuming" in err
    assert "Traceback" not in err and "done in" not in out
    # Stopped, recorded, not resumed; the ledger holds it and verifies.
    reader = Reader(work / "ledger")
    types = [r[0] for r in reader.sql("SELECT type FROM events ORDER BY stream_seq").rows]
    assert "runledger.run.resumed" not in types and "runledger.run.finished" not in types
    assert reader.sql("SELECT kind, signal, exit_code FROM crashes").rows == [("signal", 2, 130)]
    run_id = reader.sql("SELECT run_id FROM runs").rows[0][0]
    texts = [i.text for i in reader.history(run_id) if i.kind == "run.crashed"]
    assert len(texts) == 1 and texts[0].startswith("interrupted by SIGINT") and "None" not in texts[0]
    verified = CliRunner().invoke(app, ["verify", "--ledger", str(work / "ledger")])
    assert verified.exit_code == 0, verified.output
