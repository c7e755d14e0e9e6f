"""`ledger verify` over GitHub rows: what the projector makes is what is compared, and nothing else."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from runledger.ingest.bus import SpoolSink
from runledger.ingest.github_backfill import backfill
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.integrity import ADDED_COLUMNS, verify_ledger
from runledger.ledger.lake_migrate import migrate_into
from runledger.ledger.store import Ledger
from tests.support.github import FixtureGitHub

OLD_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "part-files-ledger" / "ledger"  # (copied)


def _spool(api: FixtureGitHub, tmp_path: Path) -> Path:
    sink = SpoolSink(tmp_path / "spool")
    backfill("octo-org/hello-world", sink, token=None, base_url=api.base_url, seconds_between_requests=None)
    sink.close()
    return tmp_path / "spool"


def _ledger(api: FixtureGitHub, tmp_path: Path) -> Path:
    ledger = Ledger.create(tmp_path / "ledger")
    assert ingest_spool(ledger, _spool(api, tmp_path)).accepted == 12
    ledger.close()
    assert verify_ledger(ledger.root).ok
    return ledger.root


def _github_files(root: Path) -> list[Path]:
    """The github table's data files that hold rows: a lake's (under data/), or an old ledger's."""
    found = sorted((root / "data" / "main" / "github").rglob("*.parquet")) or sorted(
        (root / "github").rglob("*.parquet")
    )
    return [p for p in found if pq.read_metadata(p).num_rows]


def _rewrite(path: Path, table: pa.Table) -> None:
    """Write ``table`` over ``path`` as another program would: a new file renamed over the old."""
    forged = path.with_name("forged.tmp")
    pq.write_table(table, forged)
    forged.replace(path)


def test_rows_written_before_the_fact_columns_verify_once_migrated(tmp_path: Path) -> None:
    """A ledger of the old format written before org/fact/via existed (a copy of the committed one,
    its github files without those columns) verifies once migrated to a lake."""
    old = tmp_path / "old"
    shutil.copytree(OLD_FIXTURE, old)
    parts = _github_files(old)
    assert parts, "the old ledger holds no github rows"
    for part in parts:  # as a ledger written before org/fact/via existed holds them
        table = pq.read_table(part)
        pq.write_table(table.drop_columns(sorted(ADDED_COLUMNS["github"])), part)
    migrate_into(old, tmp_path / "lake", None)
    migrated = verify_ledger(tmp_path / "lake")
    assert migrated.ok, [p.line() for p in migrated.problems][:5]


def test_a_dropped_column_or_an_edited_fact_is_still_reported(
    github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    root = _ledger(github_api_no_limits, tmp_path)
    part = _github_files(root)[0]
    table = pq.read_table(part)
    _rewrite(part, table.drop_columns(["body"]))  # not a column added later: its loss is an edit
    dropped = verify_ledger(root)
    # The file's bytes are not the ones its commit recorded; each row whose body was lost is named.
    assert [p.kind for p in dropped.problems if p.kind != "table-mismatch"] == ["modified"]
    assert part.name in dropped.problems[0].detail
    mismatched = [p for p in dropped.problems if p.kind == "table-mismatch"]
    assert len(mismatched) == sum(1 for b in table["body"].to_pylist() if b is not None)

    facts = table["fact"].to_pylist()
    facts[0] = "issues/1/opened/2024-01-01T00:00:00Z"  # a forged fact: the view would merge it away
    _rewrite(part, table.set_column(table.schema.get_field_index("fact"), "fact", [facts]))
    forged = verify_ledger(root)
    assert [(p.kind, p.stream_seq) for p in forged.problems] == [
        ("modified", None),
        ("table-mismatch", table["stream_seq"][0].as_py()),
    ]
