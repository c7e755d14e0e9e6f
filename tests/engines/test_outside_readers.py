"""Polars, DataFusion and Spark read a published ledger from its signed manifest (never a glob) and
agree with `ledger query` on every table, value by value (issue 26: every outside engine reads it).

The engines' code is docs/outside_engines.md's, run as it is. The reference is the ledger's own
reader (``Reader.sql``, what ``ledger query`` runs) on the physical table; ``salts``, which
``ledger query`` does not expose, against DuckDB over the ledger's own ``salts`` folder. Then the
attacks: a listed file changed (a flipped byte, a truncation, a changed manifest) is refused before
any engine reads, and a file in DEST that the manifest does not name (an old file a compaction
replaced) is not read, where a glob would read its rows twice.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import duck
from runledger.ledger.lake import LAKE_MARKER
from runledger.ledger.manifest import Published, listed_tables, open_published, table_files
from runledger.ledger.parquet_schemas import TABLES
from runledger.ledger.publish import publish
from runledger.ledger.query import Reader
from runledger.ledger.remote import RemoteError
from runledger.ledger.store import SALTS, Ledger
from tests.engines.ledger_site import Site, build_site

DOC = Path(__file__).resolve().parents[2] / "docs" / "outside_engines.md"
ALL_TABLES = [*TABLES, SALTS.name]
PHYSICAL = {"metrics": "_metrics", "moe_layer_stats": "_moe_layer_stats", "github": "_github"}
SPARK_START_S = 180  # a cold JVM on a loaded 2-core machine: 15-40 s seen

Rows = tuple[list[str], list[dict[str, Any]]]


# -------------------------------------------------------------------------------- the site, once


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    """A ledger as `ledger init` makes one (a lake), published."""
    return build_site(tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def published(site: Site) -> Published:
    return open_published(site.dest, site.log_key)


def _reference(root: Path, table: str) -> Rows:
    """The table's rows as the ledger answers them."""
    if table == SALTS.name and (root / LAKE_MARKER).exists():  # the lake's own table, at its newest snapshot
        with Ledger.open(root) as ledger:
            assert ledger.lake is not None
            with ledger.lake.reader() as lake:
                rel = lake.execute(f"SELECT * FROM {SALTS.name}")
                columns = [d[0] for d in rel.description or []]
                return columns, [dict(zip(columns, row, strict=True)) for row in rel.fetchall()]
    if table == SALTS.name:  # a side table: not a view of `ledger query`; read as the views read tables
        con = duck.connect()
        con.execute("SET TimeZone = 'UTC'")
        glob = (root / table / "*" / "*.parquet").as_posix()
        rel = con.execute(
            f"SELECT * FROM read_parquet('{glob}', hive_partitioning = true, "
            f"hive_types = {{'{SALTS.partition}': VARCHAR}}, union_by_name = true)"
        )
        columns = [d[0] for d in rel.description or []]
        return columns, [dict(zip(columns, row, strict=True)) for row in rel.fetchall()]
    result = Reader(root).sql(f"SELECT * FROM {PHYSICAL.get(table, table)}")
    return result.columns, result.records()


@pytest.fixture(scope="module")
def expected(site: Site) -> dict[str, Rows]:
    return {table: _reference(site.root, table) for table in ALL_TABLES}


# -------------------------------------------------------------------------------- comparing


_NAN = ("float", "nan")


def _value(value: Any) -> Any:
    """A hashable, typed form of one value: 1, 1.0 and True stay apart; instants compare in UTC."""
    if value is None:
        return None
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return _NAN if math.isnan(value) else ("float", value)
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, bytes | bytearray | memoryview):
        return ("bytes", bytes(value))
    if isinstance(value, datetime):
        assert value.tzinfo is not None, f"a timestamp without its time zone: {value!r}"
        return ("instant", value.astimezone(UTC))
    if isinstance(value, date):
        return ("date", value)
    if isinstance(value, list | tuple):
        return ("list", tuple(_value(v) for v in value))
    if isinstance(value, dict):
        return ("struct", tuple(sorted((k, _value(v)) for k, v in value.items())))
    raise TypeError(f"no comparison for {type(value).__name__}: {value!r}")


def _multiset(columns: list[str], rows: list[dict[str, Any]]) -> Counter[tuple[Any, ...]]:
    order = sorted(columns)
    return Counter(tuple(_value(row[c]) for c in order) for row in rows)


def assert_same_rows(table: str, got: Rows, want: Rows) -> None:
    """Same columns, and the same rows as a multiset (order-independent), value by value."""
    (got_cols, got_rows), (want_cols, want_rows) = got, want
    assert want_rows, f"{table}: the reference has no rows: this would compare nothing"
    assert sorted(got_cols) == sorted(want_cols), f"{table}: columns differ"
    got_set, want_set = _multiset(got_cols, got_rows), _multiset(want_cols, want_rows)
    missing, extra = want_set - got_set, got_set - want_set
    assert not missing and not extra, (
        f"{table}: {sum(missing.values())} rows missing, {sum(extra.values())} extra; "
        f"e.g. missing {next(iter(missing), None)}, extra {next(iter(extra), None)}"
    )


# -------------------------------------------------------------------------------- the docs' code


def doc_blocks() -> dict[str, str]:
    """docs/outside_engines.md's python blocks that follow a ``<!-- tested: NAME -->`` line."""
    found = re.findall(r"<!-- tested: ([\w-]+) -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    return dict(found)


def doc_namespace(name: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(doc_blocks()[name], f"{DOC}:{name}", "exec"), namespace)
    return namespace


def test_the_docs_have_each_engines_tested_block() -> None:
    assert set(doc_blocks()) == {"polars", "datafusion", "spark-session", "spark"}


# -------------------------------------------------------------------------------- the engines


def polars_rows(published: Published, table: str) -> Rows:
    pytest.importorskip("polars", reason="polars is not installed (pip install polars)")
    frame = doc_namespace("polars")["polars_table"](published, table)
    return list(frame.columns), frame.rows(named=True)


@pytest.mark.parametrize("table", ALL_TABLES)
def test_polars_reads_every_table_as_ledger_query_does(
    published: Published, expected: dict[str, Rows], table: str
) -> None:
    assert_same_rows(table, polars_rows(published, table), expected[table])


@pytest.fixture(scope="module")
def datafusion_ctx() -> Any:
    datafusion = pytest.importorskip(
        "datafusion", reason="datafusion is not installed (pip install datafusion)"
    )
    return datafusion.SessionContext()


@pytest.mark.parametrize("table", ALL_TABLES)
def test_datafusion_reads_every_table_as_ledger_query_does(
    datafusion_ctx: Any, published: Published, expected: dict[str, Rows], table: str
) -> None:
    frame = doc_namespace("datafusion")["datafusion_table"](datafusion_ctx, published, table)
    got = (frame.schema().names, frame.to_pylist())
    assert_same_rows(table, got, expected[table])


def _start_spark() -> Any:
    """The docs' SparkSession, started in a thread so that a JVM that never answers fails the test
    after SPARK_START_S instead of hanging it."""
    started: dict[str, Any] = {}

    def start() -> None:
        try:
            started.update(doc_namespace("spark-session"))
        except BaseException as exc:  # said in the failure below
            started["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(SPARK_START_S)
    if "error" in started:
        pytest.fail(f"Spark did not start: {started['error']!r}")
    if "spark" not in started:
        pytest.fail(f"Spark did not start within {SPARK_START_S} s")
    return started["spark"]


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark; needs Java 17+)")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java 17+ on PATH")
    session = _start_spark()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def _spark_value(value: Any) -> Any:
    """PySpark's collect() gives naive datetimes in the process's local time: the instant they are."""
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.astimezone(UTC)
    if isinstance(value, list):
        return [_spark_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _spark_value(v) for k, v in value.items()}
    return value


@pytest.mark.slow  # a JVM: 15-40 s to start here
@pytest.mark.parametrize("table", ALL_TABLES)
def test_spark_reads_every_table_as_ledger_query_does(
    spark: Any, published: Published, expected: dict[str, Rows], table: str
) -> None:
    frame = doc_namespace("spark")["spark_table"](spark, published, table)
    rows = [_spark_value(row.asDict(recursive=True)) for row in frame.collect()]
    assert_same_rows(table, (list(frame.columns), rows), expected[table])


def test_ledger_query_counts_what_the_reference_holds(site: Site, expected: dict[str, Rows]) -> None:
    """The reference is what the CLI answers: `ledger query -f json` counts the same rows."""
    union = " UNION ALL ".join(f"SELECT '{t}' AS t, count(*) AS n FROM {PHYSICAL.get(t, t)}" for t in TABLES)
    result = CliRunner().invoke(app, ["query", union, "--ledger", str(site.root), "-f", "json"])
    assert result.exit_code == 0, result.output
    counts = {row["t"]: row["n"] for row in json.loads(result.stdout)}
    assert counts == {t: len(expected[t][1]) for t in TABLES}
    assert min(counts.values()) > 0


# -------------------------------------------------------------------------------- attacks


@pytest.fixture()
def copy(site: Site, tmp_path: Path) -> Path:
    """A copy of the published folder that a test may damage."""
    return Path(shutil.copytree(site.dest, tmp_path / "site"))


def _data_file(folder: Path, table: str) -> str:
    manifest = json.loads((folder / "manifest.json").read_bytes())
    return max((f for f in manifest["files"] if f["table"] == table), key=lambda f: f["bytes"])["path"]


def test_a_flipped_byte_is_refused_before_any_engine_reads(site: Site, copy: Path) -> None:
    rel = _data_file(copy, "metrics")
    path = copy / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the digest tells
    path.write_bytes(bytes(data))
    with pytest.raises(RemoteError) as refused:
        open_published(copy, site.log_key)
    assert str(refused.value) == f"{path} does not match its SHA-256 in the signed manifest"


def test_a_truncated_or_missing_file_is_refused(site: Site, copy: Path) -> None:
    path = copy / _data_file(copy, "events")
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(RemoteError, match="does not match its SHA-256"):
        open_published(copy, site.log_key)
    path.unlink()
    with pytest.raises(RemoteError, match=f"cannot read {re.escape(str(path))}: No such file"):
        open_published(copy, site.log_key)


def test_a_changed_manifest_or_another_key_is_refused(site: Site, copy: Path, tmp_path: Path) -> None:
    manifest = copy / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc["files"] = [f for f in doc["files"] if f["table"] != "quarantine"]  # hide a table
    manifest.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    with pytest.raises(
        RemoteError, match=re.escape("manifest.json is not the manifest signed in manifest.sig")
    ):
        open_published(copy, site.log_key)
    other = build_site(tmp_path / "other")  # a log of its own: its key does not open this one
    with pytest.raises(RemoteError, match="bad signature"):
        open_published(site.dest, other.log_key)


def test_a_file_the_manifest_does_not_name_is_not_read(site: Site, tmp_path: Path) -> None:
    """An old file the lake's merge replaced, back in DEST (a mirror's, an interrupted clean-up's): a
    glob reads its rows twice; the manifest's readers do not read it."""
    pl = pytest.importorskip("polars", reason="polars is not installed (pip install polars)")
    root, dest = Path(shutil.copytree(site.root, tmp_path / "ledger")), tmp_path / "site"
    publish(root, dest, site.private_key)
    before = {p: p.read_bytes() for p in (dest / "data" / "events").rglob("*.parquet")}
    with Ledger.open(root) as ledger:
        assert ledger.compact()["files_merged"] > 0
    publish(root, dest, site.private_key)  # deletes the replaced files from DEST
    stale = sorted(p for p in before if not p.exists())
    assert stale, "the merge replaced no published file"
    for path in stale:
        path.write_bytes(before[path])  # back where a glob finds them
    published = open_published(dest, site.log_key)
    assert not {str(p) for p in stale} & set(published.paths("events"))
    want = _reference(root, "events")
    assert_same_rows("events", polars_rows(published, "events"), want)
    globbed = pl.read_parquet(str(dest / "data" / "events" / "*" / "*.parquet"), hive_partitioning=True)
    assert globbed.height > len(want[1])  # the attack is real: a glob reads the stale rows too


def test_table_files_refuses_paths_an_engine_would_misread() -> None:
    def manifest(path: str) -> dict[str, Any]:
        return {"files": [{"path": path, "table": "metrics", "bytes": 1, "sha256": "0" * 64}]}

    assert table_files(manifest("data/metrics/run_id=run-a/part-1.parquet"))["metrics"][0].partition == {
        "run_id": "run-a"
    }
    for path, why in [
        ("data/metrics/run_id=run-*/part-1.parquet", "glob character"),
        ("data/metrics/run_id=run-a/../../x/part-1.parquet", "not under data/"),
        ("data/metrics/part-1.parquet", "is not data/<table>/<column>=<value>/<file>.parquet"),
        ("data/metrics/run-a/part-1.parquet", "is not data/<table>/<column>=<value>/<file>.parquet"),
        ("elsewhere/metrics/run_id=a/part-1.parquet", "not under data/"),
        ("data/events/stream_type=run/part-1.parquet", "listed under table 'metrics'"),
    ]:
        with pytest.raises(RemoteError, match=re.escape(why)):
            table_files(manifest(path))


def test_a_table_without_rows_is_listed_and_read_as_empty_with_its_columns(tmp_path: Path) -> None:
    """A table with no rows publishes no file: the manifest lists it, and an engine gets it empty,
    with the columns and types `ledger query` answers it with."""
    pl = pytest.importorskip("polars", reason="polars is not installed (pip install polars)")
    small = build_site(tmp_path, one_run=True)
    published = open_published(small.dest, small.log_key)
    for table in ("github", "quarantine", "moe_layer_stats"):
        assert table in published.listed and published.files(table) == [], table
        empty = published.empty(table)
        reference = Reader(small.root).arrow(f"SELECT * FROM {PHYSICAL.get(table, table)}")
        assert (empty.num_rows, reference.num_rows) == (0, 0), table
        assert empty.schema.names == reference.schema.names, table
        assert pl.from_arrow(empty).columns == reference.schema.names
    assert published.files("metrics"), "a table with rows still has its files"
    with pytest.raises(RemoteError, match="the manifest names no table 'metric'"):
        published.files("metric")


def test_a_manifests_table_list_is_checked() -> None:
    files = {"files": [{"path": "data/metrics/run_id=a/part-1.parquet", "bytes": 1, "sha256": "0" * 64}]}
    found = table_files(files)
    assert listed_tables(files, found) == ("metrics",)  # a manifest written before it listed them
    assert listed_tables({**files, "tables": ["metrics", "github"]}, found) == ("metrics", "github")
    for tables, why in [
        (["github"], "has files of table 'metrics' but does not list it"),
        (["metrics", "no_such"], "names table 'no_such', which a ledger does not have"),
        ("metrics", "is not a list of table names"),
    ]:
        with pytest.raises(RemoteError, match=re.escape(why)):
            listed_tables({**files, "tables": tables}, found)


def test_the_lake_merged_files_replace_the_published_ones(site: Site, tmp_path: Path) -> None:
    """A ledger on DuckLake: the lake's merge replaces its commits' files; the next publish names the
    merged files, deletes the replaced ones from DEST, and every engine still reads each row once."""
    root, dest = Path(shutil.copytree(site.root, tmp_path / "ledger")), tmp_path / "site"
    publish(root, dest, site.private_key)
    before = set(open_published(dest, site.log_key).paths("events"))
    with Ledger.open(root) as ledger:
        merged = ledger.compact()
    assert merged["files_after"] < merged["files_before"], merged
    result = publish(root, dest, site.private_key)
    assert (result.events, result.entries) == (0, 1)  # no new event: the snapshot entry naming the manifest
    published = open_published(dest, site.log_key)
    after = set(published.paths("events"))
    gone = before - after
    assert gone and after - before, "the merged files replace the commits' files"
    assert not any(Path(p).exists() for p in gone), "the replaced files are deleted from DEST"
    for table in ("events", "metrics", SALTS.name):
        assert_same_rows(table, polars_rows(published, table), _reference(root, table))
    verified = CliRunner().invoke(app, ["verify", "--remote", f"file://{dest}", "--log-key", site.log_key])
    assert verified.exit_code == 0, verified.output
