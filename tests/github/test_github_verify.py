"""`ledger verify` over GitHub rows: what the projector makes is what is compared, and nothing else."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from ingest.bus import SpoolSink
from ingest.github_backfill import backfill
from ingest.spool_ingester import ingest_spool
from ledger.integrity import ADDED_COLUMNS, verify_ledger
from ledger.store import Ledger
from tests.support.github import FixtureGitHub


def _ledger(api: FixtureGitHub, tmp_path: Path) -> Path:
    sink = SpoolSink(tmp_path / "spool")
    backfill("octo-org/hello-world", sink, token=None, base_url=api.base_url, seconds_between_requests=None)
    sink.close()
    ledger = Ledger.create(tmp_path / "ledger")
    assert ingest_spool(ledger, tmp_path / "spool").accepted == 12
    assert verify_ledger(ledger.root).ok
    return ledger.root


def _github_parts(root: Path) -> list[Path]:
    return [p for p in sorted((root / "github").rglob("*.parquet")) if pq.read_metadata(p).num_rows]


def test_rows_written_before_the_fact_columns_still_verify(
    github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    root = _ledger(github_api_no_limits, tmp_path)
    for part in _github_parts(root):  # as a ledger written before org/fact/via existed holds them
        table = pq.read_table(part)
        pq.write_table(table.drop_columns(sorted(ADDED_COLUMNS["github"])), part)
    report = verify_ledger(root)
    assert report.ok, [p.line() for p in report.problems]


def test_a_dropped_column_or_an_edited_fact_is_still_reported(
    github_api_no_limits: FixtureGitHub, tmp_path: Path
) -> None:
    root = _ledger(github_api_no_limits, tmp_path)
    part = _github_parts(root)[0]
    table = pq.read_table(part)
    pq.write_table(table.drop_columns(["body"]), part)  # not a column added later: its loss is an edit
    dropped = verify_ledger(root)
    assert {p.kind for p in dropped.problems} == {"table-mismatch"}
    assert len(dropped.problems) == sum(1 for b in table["body"].to_pylist() if b is not None)

    facts = table["fact"].to_pylist()
    facts[0] = "issues/1/opened/2024-01-01T00:00:00Z"  # a forged fact: the view would merge it away
    pq.write_table(table.set_column(table.schema.get_field_index("fact"), "fact", [facts]), part)
    forged = verify_ledger(root)
    assert [(p.kind, p.stream_seq) for p in forged.problems] == [
        ("table-mismatch", table["stream_seq"][0].as_py())
    ]
