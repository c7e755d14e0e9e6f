"""docs/stock_duckdb.md, run as it is: the extension wheels' files found, installed into a folder of the
test's own and loaded into a plain ``duckdb`` connection (no runledger code: runledger only makes and
publishes the ledger, and answers `ledger query` for the comparison), a ledger attached read-only, its
``views.sql`` run, and a published copy read from its manifest; each answer equals `ledger query`'s."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from tests.engines.ledger_site import Site, build_site

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "stock_duckdb.md"
SITE_PACKAGES = "/path/to/site-packages"
RUNNER = CliRunner()


def guide_block(name: str) -> str:
    """The code block that follows ``<!-- tested: NAME -->`` in the guide."""
    found = re.findall(
        rf"<!-- tested: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```", GUIDE.read_text(), re.S | re.M
    )
    assert len(found) == 1, f"docs/stock_duckdb.md has {len(found)} blocks marked {name!r}"
    return found[0]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    return build_site(tmp_path_factory.mktemp("stock"))


@pytest.fixture(scope="module")
def places(site: Site, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The guide's placeholder paths and what they are here."""
    extension_file = subprocess.run(
        [sys.executable, "-c", guide_block("find-file").strip().removeprefix("python -c ").strip('"')],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert Path(extension_file).is_file(), extension_file
    site_packages = extension_file.split("/duckdb_extension_ducklake/", 1)[0]
    return {
        SITE_PACKAGES: site_packages,
        "/path/to/extensions": str(tmp_path_factory.mktemp("extensions")),  # never ~/.duckdb
        "/path/to/ledger": str(site.root),
        "/path/to/site": str(site.dest),
    }


def placed(sql: str, places: dict[str, str]) -> str:
    for placeholder, path in places.items():
        sql = sql.replace(placeholder, path)
    return sql


def stock_connection(places: dict[str, str]) -> duckdb.DuckDBPyConnection:
    """A plain DuckDB connection with the guide's install block run (auto-install off: nothing downloaded)."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute(placed(guide_block("install"), places))
    return con


def ledger_answer(site: Site, sql: str) -> list[tuple[Any, ...]]:
    """`ledger query -f json`'s rows, as tuples in column order."""
    result = RUNNER.invoke(app, ["query", sql, "--ledger", str(site.root), "-f", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows, f"`ledger query {sql}` has no rows: the comparison would prove nothing"
    return [tuple(row.values()) for row in rows]


def test_the_guide_finds_the_file_of_each_wheel_it_names(places: dict[str, str]) -> None:
    for name in ("ducklake", "sqlite_scanner"):
        path = f"{places[SITE_PACKAGES]}/duckdb_extension_{name}/extensions/v{duckdb.__version__}/{name}.duckdb_extension"
        assert Path(path).is_file(), path
    assert f"v{duckdb.__version__}" in guide_block("install")  # the page names the pinned version


def test_a_ledger_attached_in_stock_duckdb_answers_as_ledger_query(
    site: Site, places: dict[str, str]
) -> None:
    con = stock_connection(places)
    got = con.execute(placed(guide_block("attach"), places)).fetchall()
    want = ledger_answer(
        site, "SELECT run_id, count(*) AS metric_rows FROM _metrics GROUP BY run_id ORDER BY run_id"
    )
    assert got == want
    with pytest.raises(duckdb.Error):  # READ_ONLY, as the guide says
        con.execute("DELETE FROM lake.metrics")


def test_extensions_loaded_by_path_attach_the_ledger_with_nothing_installed(
    site: Site, places: dict[str, str], tmp_path: Path
) -> None:
    # An empty extension directory: only the files LOADed by path can serve the ATTACH.
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    con.execute(f"SET extension_directory = '{tmp_path}'")
    con.execute(placed(guide_block("load"), places))
    assert con.execute(placed(guide_block("attach"), places)).fetchall() == ledger_answer(
        site, "SELECT run_id, count(*) AS metric_rows FROM _metrics GROUP BY run_id ORDER BY run_id"
    )
    assert not any(tmp_path.iterdir())  # nothing was installed


def test_the_ledgers_views_sql_in_stock_duckdb_answers_as_ledger_query(
    site: Site, places: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    views = RUNNER.invoke(app, ["views", "--ledger", str(site.root)])
    assert views.exit_code == 0, views.output
    con = stock_connection(places)
    monkeypatch.chdir(site.root)  # `cd <ledger> && duckdb -init views.sql`: its paths are the folder's
    con.execute((site.root / "views.sql").read_text())
    sql = guide_block("views").strip().rstrip(";")
    assert con.execute(sql).fetchall() == ledger_answer(site, sql)


def test_a_published_copy_read_from_its_manifest_answers_as_ledger_query(
    site: Site, places: dict[str, str]
) -> None:
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    got = con.execute(placed(guide_block("published"), places)).fetchall()
    want = ledger_answer(
        site, "SELECT run_id, count(*) AS metric_rows FROM _metrics GROUP BY run_id ORDER BY run_id"
    )
    assert got == want


def test_a_file_the_manifest_does_not_name_is_not_read(site: Site, places: dict[str, str]) -> None:
    # An old file left in DEST (a compaction merged it away): the guide's read ignores it, a glob would not.
    stray = site.dest / "data" / "metrics" / "run_id=run-a" / "ducklake-stray.parquet"
    listed = json.loads((site.dest / "manifest.json").read_text())["files"]
    first = next(f for f in listed if f["table"] == "metrics" and "run_id=run-a" in f["path"])
    stray.write_bytes((site.dest / first["path"]).read_bytes())
    try:
        con = duckdb.connect()
        got = dict(con.execute(placed(guide_block("published"), places)).fetchall())
        globbed = con.execute(
            f"SELECT count(*) FROM read_parquet('{site.dest}/data/metrics/run_id=run-a/*.parquet')"
        ).fetchone()
        assert globbed is not None and globbed[0] > got["run-a"]
    finally:
        stray.unlink()
