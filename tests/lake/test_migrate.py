"""`ledger migrate`: a copy of the committed ledger of the old format (tests/fixtures/part-files-ledger)
into a lake (SQLite and PostgreSQL catalogs), with identical rows, positions and stream heads; the
lake then takes new commits where the old ledger stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import typer
from typer.testing import CliRunner

from runledger.cli import migrate_cmd
from runledger.cli.main import app
from runledger.ledger.lake import EMBEDDED_CATALOG, LakeTables
from runledger.ledger.merkle import CompactRange
from runledger.ledger.parquet_schemas import TABLES, tables_of
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from tests.lake.support import Postgres

runner = CliRunner()
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "part-files-ledger" / "ledger"
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]

# cli/main.py registers `migrate` (the lines are in docs/ducklake.md); until then a group of its own.
migrate_app = typer.Typer()
migrate_app.command("migrate")(migrate_cmd.migrate)
migrate_app.command("noop", hidden=True)(lambda: None)


def _cli(target: typer.Typer, *args: str | Path) -> str:
    result = runner.invoke(target, [str(a) for a in args], env={"RUNLEDGER_PROGRESS_S": "off"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the committed ledger of the old format (a compaction and a redaction among its
    commits): the tests never write into the committed files."""
    root = tmp_path_factory.mktemp("migrate")
    shutil.copytree(FIXTURE, root / "ledger")
    return root / "ledger"


def _newest_record(old: Path) -> dict[str, Any]:
    """The old ledger's newest commit record, read as a file (nothing opens that format now)."""
    record: dict[str, Any] = json.loads(sorted((old / "_commits").glob("*.json"))[-1].read_bytes())
    return record


def _heads(record: dict[str, Any]) -> dict[str, tuple[int, bytes]]:
    """Each stream's size and Merkle root as a commit record holds them."""
    trees = {s: CompactRange.from_json(h["tree"]) for s, h in record["streams"].items()}
    return {s: (t.size, t.root()) for s, t in trees.items()}


def _same_rows(old: Path, lake: LakeTables) -> None:
    """Each table's rows, read apart from the migration's own check: pyarrow over the old files."""
    with lake.reader() as con:
        for name in tables_of(old):
            files = sorted(str(p) for p in (old / name).glob("*=*/*.parquet"))
            before = ds.dataset(files, format="parquet", partitioning="hive").to_table() if files else None
            rows = con.execute(f'SELECT * FROM "{name}"').to_arrow_table()
            assert rows.num_rows == (before.num_rows if before is not None else 0), name
            if before is not None and before.num_rows:
                cols = [c for c in before.column_names if c != TABLES[name].partition]
                key = [(c, "ascending") for c in cols if not pa.types.is_list(before.schema.field(c).type)]
                assert (
                    rows.select(cols).sort_by(key).to_pylist() == before.select(cols).sort_by(key).to_pylist()
                ), name


def test_migrate_into_an_embedded_lake_keeps_every_row(old: Path, tmp_path: Path) -> None:
    out = _cli(migrate_app, "migrate", old, tmp_path / "lake")
    commits = len(list((old / "_commits").glob("*.json")))
    assert out.startswith("migrated ") and "rows, positions and stream heads identical" in out
    compactions = sum('"writer": "compact"' in p.read_text() for p in (old / "_commits").glob("*.json"))
    assert commits >= 3 and compactions >= 1
    rows = sum(
        ds.dataset(sorted(str(p) for p in (old / name).glob("*=*/*.parquet")), format="parquet").count_rows()
        for name in [*tables_of(old), "salts"]  # the salts too (the published log's digests need them)
    )
    kept = commits - compactions  # every commit but the compactions
    lake_dir = tmp_path / "lake"
    assert (
        out
        == f"migrated {kept} commits ({rows} rows) into {lake_dir}: rows, positions and stream heads identical\n"
    )
    before = _newest_record(old)
    with LakeTables(f"sqlite:{tmp_path / 'lake' / EMBEDDED_CATALOG}", tmp_path / "lake" / "data") as lake:
        _same_rows(old, lake)
        assert lake.positions() == before["positions"]
    # the migrated ledger takes new commits where the old one stopped: numbers, heads and positions
    with Ledger.open(lake_dir) as moved:
        assert moved.last_commit == before["commit"]
        assert {s: (h.size, h.tree.root()) for s, h in moved.stream_heads().items()} == _heads(before)
    _cli(app, "simulate", "reference-535b", "--spool", tmp_path / "more", "--run-id", "moe-next", *SMALL)
    _cli(app, "ingest", "spool", "--spool", tmp_path / "more", "--ledger", lake_dir, "--batch-size", "500")
    with Ledger.open(lake_dir) as after:
        assert after.last_commit > before["commit"]
        kept = {s: size for s, (size, _) in _heads(before).items()}
        assert {s: h.size for s, h in after.stream_heads().items() if s in kept} == kept
    runs = Reader(lake_dir).sql("SELECT run_id FROM runs ORDER BY 1").rows
    assert runs == [("moe-next",), ("run-a",), ("run-b",)]


def test_migrate_into_a_postgres_catalog(old: Path, tmp_path: Path, postgres: Postgres | str) -> None:
    if isinstance(postgres, str):
        pytest.skip(postgres)
    dsn = postgres.database()
    out = _cli(migrate_app, "migrate", old, tmp_path / "lake", "--catalog", f"postgres:{dsn}")
    assert "identical" in out


def test_migrate_refuses_a_folder_that_is_no_ledger(tmp_path: Path) -> None:
    result = runner.invoke(migrate_app, ["migrate", str(tmp_path / "none"), str(tmp_path / "lake")])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "no ledger at" in result.output
