"""``<ledger>/views.sql`` names the ledger's files relative to its folder: a copied ledger, opened with
``duckdb -init views.sql`` from inside the copy, reads the copy, never the original."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from typer.testing import CliRunner

import runledger
from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ledger import duck
from tests.client.ledger_support import ingest


def _ledger_of(tmp_path: Path, name: str, steps: int) -> Path:
    sink = SpoolSink(tmp_path / f"spool-{name}")
    run = runledger.init(
        name, state_dir=tmp_path / f"state-{name}", sink=sink, handle_signals=False, capture_exceptions=False
    )
    for step in range(steps):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run.finish()
    sink.close()
    ledger = tmp_path / f"ledger-{name}"
    ingest(ledger, tmp_path / f"spool-{name}")
    return ledger


def _count_in(folder: Path, sql: str) -> int:
    """What ``duckdb -init views.sql`` started in ``folder`` answers (the duckdb package runs the file
    as the CLI would: relative paths resolve against the working directory)."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        con = duck.connect(extensions=["ducklake", "sqlite_scanner"])  # (stock DuckDB downloads them)
        con.execute((folder / "views.sql").read_text())
        row = con.execute(sql).fetchone()
        assert row is not None
        return int(row[0])
    finally:
        os.chdir(before)


def test_views_sql_of_a_copied_ledger_reads_the_copy(tmp_path: Path) -> None:
    original = _ledger_of(tmp_path, "original", steps=7)
    result = CliRunner().invoke(app, ["views", "--ledger", str(original)])
    assert result.exit_code == 0, result.output
    text = (original / "views.sql").read_text()
    # no absolute path in it: the catalog and the data are named from the folder
    assert str(tmp_path) not in text and "ATTACH 'ducklake:sqlite:catalog.sqlite'" in text

    copy = tmp_path / "moved" / "ledger"
    shutil.copytree(original, copy)
    assert _count_in(copy, "SELECT count(*) FROM metrics") == 7
    # The copy is its own: another ledger's files put in its place answer instead.
    shutil.rmtree(copy)
    shutil.copytree(_ledger_of(tmp_path, "other", steps=3), copy)
    shutil.copy(original / "views.sql", copy / "views.sql")
    assert _count_in(copy, "SELECT count(*) FROM metrics WHERE run_id = 'other'") == 3
    assert _count_in(copy, "SELECT count(*) FROM metrics WHERE run_id = 'original'") == 0
