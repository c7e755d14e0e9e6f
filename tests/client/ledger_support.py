"""Fold a spool into a ledger through the library, and read answers back through the ``ledger`` CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolReader
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.store import Ledger
from runledger.schemas import Envelope, Event, decode_event


def ingest(ledger: Path, *spools: Path) -> int:
    accepted = 0
    for spool in spools:
        with Ledger.create(ledger) as writer:
            stats = ingest_spool(writer, spool)
        assert stats.quarantined == 0
        accepted += stats.accepted
    return accepted


def cli_json(ledger: Path, *args: str) -> Any:
    result = CliRunner().invoke(app, [*args, "--ledger", str(ledger), "-f", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def metric_series(ledger: Path, run_id: str) -> dict[str, dict[int, float | None]]:
    rows = cli_json(
        ledger, "query", f"SELECT name, step, value FROM metrics WHERE run_id = '{run_id}' ORDER BY step"
    )
    out: dict[str, dict[int, float | None]] = {}
    for row in rows:
        out.setdefault(row["name"], {})[row["step"]] = row["value"]
    return out


def events(spool: Path) -> list[Envelope]:
    decoded = [decode_event(r.payload) for r in SpoolReader(spool).read()]
    assert all(isinstance(d, Event) for d in decoded), decoded
    return [d.envelope for d in decoded]  # type: ignore[union-attr]


def of_type(spool: Path, suffix: str) -> list[Envelope]:
    return [e for e in events(spool) if e.type.endswith(suffix)]
