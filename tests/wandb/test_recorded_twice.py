"""One run recorded twice: bridged live through ``runledger.wandb.tee`` and later imported from W&B's
file (``ledger ingest wandb``), or two processes claiming one run id with different state dirs. Both
records are kept, the second launch of the attempt is a ``duplicate-launch`` incident (with a
warning), and the views never fan out: ``metrics`` returns each (run, attempt, step, name) once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import runledger
from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from tests.client.ledger_support import cli_json, ingest
from tests.support.wandb_files import close_wandb_files

wandb = pytest.importorskip("wandb")
import runledger.wandb as bridge  # noqa: E402

STEPS = 12


@pytest.fixture
def teed(wandb_dir: Path, client_env: dict[str, str]) -> Iterator[bridge.Tee]:
    tee = bridge.tee()
    try:
        yield tee
    finally:
        bridge.untee()


def _fan_out(ledger: Path, run_id: str) -> list[Any]:
    return cli_json(
        ledger,
        "query",
        "SELECT attempt, step, name, count(*) AS n FROM metrics "
        f"WHERE run_id = '{run_id}' GROUP BY ALL HAVING count(*) > 1",
    )


def _incidents(ledger: Path) -> list[Any]:
    return cli_json(
        ledger,
        "query",
        "SELECT json_extract_string(canonical, '$.data.kind') AS kind, "
        "json_extract_string(canonical, '$.data.expected_prev') AS first_launch FROM events "
        "WHERE type = 'ledger.incident' ORDER BY seq",
    )


def test_a_bridged_run_imported_again_is_one_run(
    teed: bridge.Tee,
    wandb_dir: Path,
    client_env: dict[str, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = wandb.init(project="twice", config={"lr": 1e-3})
    for i in range(STEPS):
        wandb.log({"train/loss": 3.0 - i / 10, "lr": 1e-3})
    wandb.finish()
    close_wandb_files()
    imported = tmp_path / "imported"
    result = CliRunner().invoke(app, ["ingest", "wandb", str(wandb_dir / "wandb"), "--spool", str(imported)])
    assert result.exit_code == 0, result.output
    ledger = tmp_path / "ledger"
    with caplog.at_level(logging.WARNING, logger="runledger.ledger"):
        ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]), imported)
    assert any("duplicate launch" in r.getMessage() for r in caplog.records)

    assert _fan_out(ledger, run.id) == []
    rows = cli_json(ledger, "query", f"SELECT count(*) AS n FROM metrics WHERE run_id = '{run.id}'")
    assert rows == [{"n": STEPS * 3}]  # train/loss (kept as logged), loss (its typed field), lr
    recorded = cli_json(
        ledger, "query", f"SELECT count(*) AS n FROM metrics_recorded WHERE run_id = '{run.id}'"
    )
    assert recorded == [{"n": STEPS * 3 * 2}]  # both records are kept
    [attempt] = cli_json(ledger, "query", f"SELECT attempt, external FROM attempts WHERE run_id = '{run.id}'")
    assert attempt["attempt"] == 1
    launches = cli_json(ledger, "query", f"SELECT count(*) AS n FROM launches WHERE run_id = '{run.id}'")
    assert launches == [{"n": 2}]
    [incident] = _incidents(ledger)
    assert incident["kind"] == "duplicate-launch" and incident["first_launch"].startswith("trainer/")
    [summary] = cli_json(ledger, "runs")
    assert summary["attempts"] == 1 and summary["last_step"] == STEPS - 1


def test_two_processes_claiming_one_run_id_never_fan_out(tmp_path: Path) -> None:
    spools = []
    for name in ("a", "b"):  # different state dirs: each believes it is attempt 1 of run "shared"
        sink = SpoolSink(tmp_path / f"spool-{name}")
        run = runledger.init(
            "shared",
            state_dir=tmp_path / f"state-{name}",
            sink=sink,
            handle_signals=False,
            capture_exceptions=False,
        )
        for step in range(5):
            run.log({"loss": 1.0 + step, "tokens": 100}, step=step)
        run.finish()
        close_wandb_files()
        sink.close()
        spools.append(tmp_path / f"spool-{name}")
    ledger = tmp_path / "ledger"
    ingest(ledger, *spools)
    assert _fan_out(ledger, "shared") == []
    rows = cli_json(ledger, "query", "SELECT count(*) AS n FROM metrics WHERE run_id = 'shared'")
    assert rows == [{"n": 10}]  # loss and tokens, at 5 steps, once
    [incident] = _incidents(ledger)
    assert incident["kind"] == "duplicate-launch"
    state = cli_json(ledger, "state", "shared")
    assert len(state["attempts"]) == 1
