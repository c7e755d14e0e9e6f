"""``ledger verify`` on a lake: it reads the files of the newest snapshot (as DuckLake lists them,
never a glob), checks each against the SHA-256 its commit record names, and names rows deleted
through the catalog, files rewritten on disk and tables changed by SQL; the lake's own merges and
the leftovers of killed transactions are no problem."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.lake import LakeFolder, LakeTables
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas.note import generate_keypair

runner = CliRunner()
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200"}


def _cli(*args: str | Path, code: int = 0) -> str:
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ledger on a lake (SQLite catalog in its folder), ingested in 250-event commits."""
    root = tmp_path_factory.mktemp("lake-verify")
    _cli("simulate", "reference-535b", "--spool", root / "spool", *SMALL)
    _cli("ingest", "spool", "--spool", root / "spool", "--ledger", root / "lake", "--batch-size", "250")
    return root / "lake"


@pytest.fixture
def lake(made: Path, tmp_path: Path) -> Path:
    """A copy of the lake folder (catalog and files inside it) for a test to damage."""
    copy = tmp_path / "lake"
    shutil.copytree(made, copy)
    return copy


def _tables(folder: Path) -> LakeTables:
    marker = LakeFolder.read(folder)
    assert marker is not None
    return LakeTables(marker.catalog, marker.data_path, create=False)


def _data_files(folder: Path, table: str) -> list[Path]:
    return sorted((folder / "data" / "main" / table).rglob("*.parquet"))


def _rewrite(path: Path, edit: pa.Table) -> None:
    """Write ``edit`` over ``path`` as another program would: a new file renamed over the old."""
    forged = path.with_name("forged.tmp")
    pq.write_table(edit, forged)
    forged.replace(path)


def test_a_lake_verifies(made: Path) -> None:
    assert _cli("verify", "--ledger", made).startswith("OK: ")
    report = verify_ledger(made)
    assert report.ok and report.events > 900 and not report.warnings


def test_a_file_rewritten_on_disk_is_named_with_the_row_it_changed(lake: Path) -> None:
    path = _data_files(lake, "events")[0]
    table = pq.read_table(path)
    canonical = table["canonical"].to_pylist()
    canonical[3] = canonical[3].replace('"step":', '"step": ', 1)  # same event, other bytes
    _rewrite(
        path, table.set_column(table.schema.get_field_index("canonical"), "canonical", pa.array(canonical))
    )
    out = _cli("verify", "--ledger", lake, code=1)
    assert "its bytes are not the SHA-256 its commit record names" in out
    assert path.name in out
    assert "modified: stream" in out


def test_the_same_rows_in_other_bytes_are_still_named(lake: Path) -> None:
    path = _data_files(lake, "metrics")[0]
    _rewrite(path, pq.read_table(path))  # every row as it was, written by pyarrow instead of DuckDB
    report = verify_ledger(lake)
    assert [p.kind for p in report.problems] == ["modified"]
    assert path.name in report.problems[0].detail


def test_rows_deleted_through_the_catalog_are_named(lake: Path) -> None:
    with _tables(lake) as tables:
        tables.con.execute("DELETE FROM lake.events WHERE stream_seq = 5")
    report = verify_ledger(lake)
    assert not report.ok
    assert any(p.kind == "removed" and "rows deleted" in p.detail for p in report.problems)


def test_a_metric_changed_by_sql_is_a_table_mismatch(lake: Path) -> None:
    with _tables(lake) as tables:
        tables.con.execute("UPDATE lake.metrics SET value = value + 1 WHERE step = 100")
    kinds = {p.kind for p in verify_ledger(lake).problems}
    assert {"removed", "table-mismatch"} <= kinds  # the old rows' deletion, and the new rows


def test_merged_files_and_leftovers_of_killed_transactions_are_no_problem(lake: Path) -> None:
    planted = lake / "data" / "main" / "events" / "stream_type=run" / "ducklake-leftover.parquet"
    shutil.copyfile(_data_files(lake, "events")[0], planted)  # a file no snapshot lists
    with _tables(lake) as tables:
        tables.con.execute("CALL ducklake_merge_adjacent_files('lake')")
    report = verify_ledger(lake)
    assert report.ok, [p.line() for p in report.problems]
    assert len(report.warnings) == 1 and "written by the lake's own maintenance" in report.warnings[0]
    # and a merged file is checked by its rows: a metric changed in one is found
    merged = next(p for p in _data_files(lake, "metrics") if p.stat().st_mtime >= planted.stat().st_mtime)
    table = pq.read_table(merged)
    values = pc.add(table["value"], pa.scalar(1.0))
    _rewrite(merged, table.set_column(table.schema.get_field_index("value"), "value", values))
    assert "table-mismatch" in {p.kind for p in verify_ledger(lake).problems}


def test_files_merged_by_maintenance_are_checked_by_their_bytes(lake: Path) -> None:
    """``ledger compact`` on a lake (``maintain``) names each merged file with its SHA-256: verify
    then warns of nothing and names a merged file whose bytes changed with its rows unchanged."""
    with _tables(lake) as tables:
        stats = tables.maintain()
    assert stats["files_after"] < stats["files_before"] and stats["merged_recorded"] > 0, stats
    report = verify_ledger(lake)
    assert report.ok and not report.warnings, ([p.line() for p in report.problems], report.warnings)
    merged = [
        p
        for p in _data_files(lake, "metrics")
        if any(n.startswith("_ducklake_internal_") for n in pq.read_schema(p).names)
    ]
    assert merged, "the merge wrote no metrics file"
    _rewrite(merged[0], pq.read_table(merged[0]))  # the same rows, other bytes
    problems = verify_ledger(lake).problems
    assert [p.kind for p in problems] == ["modified"], [p.line() for p in problems]
    assert merged[0].name in problems[0].detail


def test_signed_checkpoints_of_a_lake_verify(lake: Path) -> None:
    private, public = generate_keypair("lake-test")
    assert sign_checkpoints(lake, private)
    report = verify_ledger(lake, public)
    assert report.ok and report.checkpoints >= 2
