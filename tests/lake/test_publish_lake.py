"""A published lake is read back in every case: a table with no rows publishes no file, and still
answers (issue 39): as an empty relation with its schema in the signed manifest's table list, the
published views.sql, ``ledger query --remote`` and the page's copy (``serve page --remote``), while
``ledger verify --remote`` passes. The copy is served by a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import duckdb
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.live_page import PublishedWatch
from runledger.ledger.query import Reader
from tests.merkle.test_publish import Site
from tests.merkle.test_remote_doors import serving

ENV = {"COLUMNS": "300", "RUNLEDGER_PROGRESS_S": "off"}
STEPS = 20
# Tables a run of steps alone leaves without rows (and so without files) in the lake.
EMPTY = ["annotations", "moe_layer_stats", "quarantine", "github", "rank_stats"]


def _remote_json(url: str, site: Site, cache: Path, sql: str) -> list[dict[str, object]]:
    args = ["query", "--remote", url, "--log-key", site.vkey, "--cache", str(cache), "-f", "json", sql]
    result = CliRunner().invoke(app, args, env=ENV)
    assert result.exit_code == 0, result.output
    rows: list[dict[str, object]] = json.loads(result.stdout)
    return rows


def _published_site(tmp_path: Path) -> Site:
    site = Site(tmp_path)
    site.add(STEPS)
    site.publish()
    return site


def test_a_table_without_rows_is_listed_in_the_manifest_and_publishes_no_file(tmp_path: Path) -> None:
    site = _published_site(tmp_path)
    assert (site.root / "LAKE.json").exists()  # a new ledger is a lake
    manifest = json.loads((site.dest / "manifest.json").read_bytes())
    with_files = {f["table"] for f in manifest["files"]}
    assert set(EMPTY) <= set(manifest["tables"]) and not set(EMPTY) & with_files
    assert {"events", "metrics", "salts"} <= with_files <= set(manifest["tables"])


def test_query_remote_on_a_lake_with_empty_tables_answers_and_verify_remote_passes(tmp_path: Path) -> None:
    site = _published_site(tmp_path)
    with serving(site.dest) as (url, _):
        cache = tmp_path / "cache"
        for table in EMPTY:
            assert _remote_json(url, site, cache, f"SELECT count(*) AS n FROM {table}") == [{"n": 0}], table
        steps = _remote_json(url, site, cache, "SELECT count(DISTINCT step) AS n FROM metrics")
        assert steps == [{"n": STEPS}]
        args = ["verify", "--remote", url, "--log-key", site.vkey, "--state", str(tmp_path / "verify.json")]
        verified = CliRunner().invoke(app, args, env=ENV)
        assert verified.exit_code == 0, verified.output


def test_an_empty_table_has_its_schema_in_every_reader(tmp_path: Path) -> None:
    """The published views.sql (a plain DuckDB in DEST) and the remote copy describe an empty table
    with the columns and types ``ledger query`` gives it on the ledger itself."""
    site = _published_site(tmp_path)
    local = Reader(site.root)
    with contextlib.chdir(site.dest):
        plain = duckdb.connect()
        plain.execute((site.dest / "views.sql").read_text())
        for table in EMPTY:
            want = [tuple(r[:2]) for r in local.sql(f"DESCRIBE SELECT * FROM {table}").rows]
            got = [tuple(r[:2]) for r in plain.execute(f"DESCRIBE SELECT * FROM {table}").fetchall()]
            assert got == want and want, table
        plain.close()
    with serving(site.dest) as (url, _):
        described = _remote_json(url, site, tmp_path / "cache", "DESCRIBE SELECT * FROM annotations")
    assert [(r["column_name"], r["column_type"]) for r in described] == [
        tuple(r[:2]) for r in local.sql("DESCRIBE SELECT * FROM annotations").rows
    ]


def test_the_page_of_a_published_lake_opens_its_copy(tmp_path: Path) -> None:
    """``ledger serve page --remote``'s watch takes the verified copy and reads it, empty tables and all."""
    site = _published_site(tmp_path)
    with serving(site.dest) as (url, _):
        watch = PublishedWatch(url, site.vkey, tmp_path / "page-cache", poll_s=60.0)
        watch._open()
        assert watch.refused is None and watch.lost is None and watch.reader is not None
        assert watch.reader.sql("SELECT count(*) FROM annotations").rows == [(0,)]
        assert watch.reader.sql("SELECT count(DISTINCT step) FROM metrics").rows == [(STEPS,)]
