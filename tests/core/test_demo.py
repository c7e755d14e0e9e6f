"""The README's main job, shortened: the real trainer → spool → ledger → history path."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader


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
