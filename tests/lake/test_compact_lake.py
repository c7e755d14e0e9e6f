"""`ledger compact` on a lake (issue 39): the lake's own maintenance (merge adjacent files, expire
old snapshots, delete files no snapshot needs), said in one line in the lake's terms; answers and
verify unchanged; on a SQLite and a PostgreSQL catalog, and on an ``s3://`` data path where the
S3 server of tests/lake/test_s3.py can be built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.lake import ALIAS, LakeFolder, LakeTables
from tests.lake.conftest import Backend
from tests.lake.test_s3 import BUCKET, s3  # noqa: F401 (the module's S3 server, a fixture)

SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "400"}
SAME = "SELECT count(*), sum(stream_seq), count(DISTINCT stream) FROM events"
FIRST = re.compile(r"merged (\d+) files into (\d+), removed 0 files, expired 0 snapshots\n")
runner = CliRunner()


def _cli(*args: str | Path) -> str:
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("compact") / "spool"
    _cli("simulate", "reference-535b", "--spool", folder, *SMALL)
    return folder


@pytest.fixture(scope="module")
def routed_spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 steps with the router's expert counts (9,406 events, 47 MB): enough rows that the
    merge writes several objects at once (each upload held an 80 MB part: out of memory at 256 MB)."""
    folder = tmp_path_factory.mktemp("compact-routed") / "spool"
    _cli("simulate", "reference-535b", "--spool", folder, "--steps", "3000")
    return folder


def _live_files(root: Path) -> int:
    """Data files in the lake's newest snapshot, every table's, counted in its catalog."""
    folder = LakeFolder.read(root)
    assert folder is not None
    with LakeTables(folder.catalog, folder.data_path, new_catalog=False) as lake:
        row = lake.con.execute(
            f"SELECT count(*) FROM __ducklake_metadata_{ALIAS}.ducklake_data_file WHERE end_snapshot IS NULL"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _compact_twice(spool: Path, root: Path, catalog: str, data: str, batch_size: int = 100) -> None:
    """A ledger of ten commits compacted twice: the first merges what the commits wrote (the line's
    counts are the catalog's), the second only the one file naming the first's merged files (none where that row is inlined)."""
    _cli(
        "init",
        "--ledger",
        root,
        "--keys",
        root.parent / "keys",
        "--allow-unsigned",
        "*",
        "--catalog",
        catalog,
        "--data",
        data,
    )
    _cli("ingest", "spool", "--spool", spool, "--ledger", root, "--batch-size", str(batch_size))
    answer = _cli("query", SAME, "--ledger", root, "-f", "csv")
    before = _live_files(root)
    found = FIRST.fullmatch(_cli("compact", "--ledger", root))
    assert found, "compact's line"
    merged, written = int(found[1]), int(found[2])
    assert merged > written > 0
    # The state row naming the merged files: a file on PostgreSQL, inlined in a SQLite catalog (so the
    # second compact has nothing to merge there).
    sqlite = catalog.startswith("sqlite:")
    assert _live_files(root) == before - merged + written + (0 if sqlite else 1)
    second = "merged 0 files into 0" if sqlite else "merged 2 files into 1"
    assert _cli("compact", "--ledger", root) == f"{second}, removed 0 files, expired 0 snapshots\n"
    assert _cli("query", SAME, "--ledger", root, "-f", "csv") == answer
    assert _cli("verify", "--ledger", root).splitlines()[-1].startswith("OK: ")


def test_compact_on_a_lake_is_the_lakes_maintenance_in_one_line(
    backend: Backend, spool: Path, tmp_path: Path
) -> None:
    _compact_twice(spool, tmp_path / "ledger", backend.catalog, str(backend.data))


def test_compact_on_an_s3_lake_merges_within_the_writers_memory(
    s3: dict[str, str],  # noqa: F811
    routed_spool: Path,
    tmp_path: Path,
) -> None:
    """The writer's DuckDB keeps WRITER_MEMORY; the merge's uploads stream within it (parts of
    S3_LARGEST_FILE / 10,000 bytes, not httpfs's 80 MB)."""
    catalog, data = f"sqlite:{tmp_path / 'catalog.sqlite'}", f"s3://{BUCKET}/compact"
    _compact_twice(routed_spool, tmp_path / "ledger", catalog, data, batch_size=1000)
