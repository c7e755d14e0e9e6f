"""A lake catalog holding hostile rows (issue 40): whoever controls the catalog database (a PostgreSQL
operator, whoever can write the SQLite file) is not trusted by a reader. Rows are written straight
into DuckLake's own tables, then every entrance (``ledger query``, ``ledger state``, ``ledger
verify``, ``Reader.sql``) must answer in one line or ignore the row: never read a file outside the
lake's data path, never run SQL carried by a name or a path, never change a file."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import duck
from runledger.ledger.lake import Catalog
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import Ledger
from tests.lake.support import Postgres

runner = CliRunner()
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "200"}
SECRET = "SECRET-ROW-OUTSIDE-THE-LAKE"
PASSWD = "root:x:0:0"  # a line of /etc/passwd, were it ever printed
# ``ledger verify`` lists the lake's files through DuckLake (ledger/stored_files.py) and hashes and reads
# each path the catalog gives, unchecked: it reads a file outside the data path (a byte-identical copy
# there verifies OK; a foreign file's rows are echoed in its report).
COUNT = "SELECT count(*) AS n, count(*) FILTER (WHERE id = '" + SECRET + "') AS secret FROM events"


@dataclass(frozen=True)
class Lake:
    """A lake ledger folder (``tmp/ledger``) beside a folder it must never read (``tmp/secret``)."""

    tmp: Path
    catalog: Catalog

    @property
    def folder(self) -> Path:
        return self.tmp / "ledger"

    @property
    def secret(self) -> Path:
        return self.tmp / "secret"


def _cli(*args: str | Path) -> tuple[int, str, str, BaseException | None]:
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    exception = None if isinstance(result.exception, SystemExit) else result.exception
    return result.exit_code, result.stdout, result.stderr, exception


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small run's events on a spool, ingested into each test's lake."""
    root = tmp_path_factory.mktemp("hostile-spool")
    assert _cli("simulate", "reference-535b", "--spool", root / "spool", *SMALL)[0] == 0
    return root / "spool"


@pytest.fixture(scope="module")
def sqlite_lake(spool: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run ingested once into a lake with a SQLite catalog in its folder (copied per test)."""
    folder = tmp_path_factory.mktemp("hostile-sqlite") / "ledger"
    assert _cli("ingest", "spool", "--spool", spool, "--ledger", folder)[0] == 0
    return folder


@pytest.fixture(params=["sqlite", "postgres"])
def lake(request: pytest.FixtureRequest, tmp_path: Path, spool: Path, sqlite_lake: Path) -> Lake:
    """One lake per test, on a SQLite catalog and (when the project's server starts) PostgreSQL,
    with a Parquet file of secret rows planted beside it."""
    tmp = tmp_path
    if request.param == "sqlite":
        shutil.copytree(sqlite_lake, tmp / "ledger")
        catalog = Catalog.parse(f"sqlite:{tmp / 'ledger' / 'catalog.sqlite'}")
    else:
        server = request.getfixturevalue("postgres")
        if isinstance(server, str):
            pytest.skip(server)
        assert isinstance(server, Postgres)
        catalog = Catalog.parse(f"postgres:{server.database()}")
        Ledger.create_on_lake(tmp / "ledger", catalog.spec).close()
        assert _cli("ingest", "spool", "--spool", spool, "--ledger", tmp / "ledger")[0] == 0
    made = Lake(tmp, catalog)
    made.secret.mkdir()
    events = next((made.folder / "data").rglob("events/**/*.parquet"))
    rows = pq.read_table(events)
    rows = rows.set_column(rows.schema.get_field_index("id"), "id", pa.array([SECRET] * rows.num_rows))
    pq.write_table(rows, made.secret / "events.parquet")
    pq.write_table(  # a delete file that, were it read, would delete every row of a file
        pa.table(
            {"file_path": pa.array([str(events)] * rows.num_rows), "pos": pa.array(range(rows.num_rows))}
        ),
        made.secret / "deletes.parquet",
    )
    return made


@contextmanager
def _catalog(lake: Lake) -> Iterator[duckdb.DuckDBPyConnection]:
    """The catalog's own tables attached as ``c``, writable, as its operator holds them."""
    kind = "sqlite" if lake.catalog.kind == "sqlite" else "postgres"
    con = duck.connect(extensions=[f"{kind}_scanner"])
    target = lake.catalog.target.replace("'", "''")
    con.execute(f"ATTACH '{target}' AS c (TYPE {kind})")
    try:
        yield con
    finally:
        con.close()


def _write(lake: Lake, statement: str, params: list[object] | None = None) -> None:
    with _catalog(lake) as con:
        con.execute(statement, params or [])


def _first_events_file(lake: Lake) -> int:
    with _catalog(lake) as con:
        row = con.execute(
            "SELECT min(f.data_file_id) FROM c.ducklake_data_file f JOIN c.ducklake_table t "
            "ON t.table_id = f.table_id WHERE t.table_name = 'events' AND f.end_snapshot IS NULL"
        ).fetchone()
    assert row is not None and row[0] is not None
    return int(row[0])


def _set_file_path(lake: Lake, path: str, relative: bool) -> None:
    _write(
        lake,
        "UPDATE c.ducklake_data_file SET path = ?, path_is_relative = ? WHERE data_file_id = ?",
        [path, relative, _first_events_file(lake)],
    )


def _tree(tmp: Path) -> dict[str, tuple[int, int]]:
    """Every file beside the ledger (under ``tmp``) and every data file of the lake, by size and
    mtime: none may change (the ledger's own bookkeeping files may)."""
    out = {}
    for path in tmp.rglob("*"):
        inside = path.relative_to(tmp).parts[0] == "ledger"
        if path.is_file() and (not inside or (tmp / "ledger" / "data") in path.parents):
            stat = path.stat()
            out[str(path.relative_to(tmp))] = (stat.st_size, stat.st_mtime_ns)
    return out


def _baseline(lake: Lake) -> int:
    reader = Reader(lake.folder)
    try:
        n, secret = reader.sql(COUNT).rows[0]
    finally:
        reader.close()
    assert secret == 0 and n > 0
    return int(n)


@pytest.fixture(params=["read", "verify"])
def entrance(request: pytest.FixtureRequest) -> str:
    """Which entrances a case goes through: the readers (``Reader.sql``, ``ledger query``, ``ledger
    state``) or ``ledger verify``."""
    return str(request.param)


def _assert_safe(lake: Lake, entrance: str, events_at_most: int, *, whole: bool = False) -> None:
    """Each entrance: an answer without the secret rows and with no more events than the lake holds
    (``whole``: exactly as many), or a one-line error (verify: its report); never a traceback, never
    a changed file, never a file SQL was made to write."""
    before = _tree(lake.tmp)
    if entrance == "read":
        _assert_reader_safe(lake, events_at_most, whole)
    commands: list[tuple[str, ...]] = (
        [
            ("query", COUNT, "-f", "csv"),
            ("query", "SELECT * FROM events", "-f", "csv", "--full"),
            ("state", "latest", "-f", "json"),
        ]
        if entrance == "read"
        else [("verify",)]
    )
    for args in commands:
        code, out, err, exception = _cli(*args, "--ledger", lake.folder)
        shown = f"{args[0]}: exit {code}\n{out}\n{err}"
        assert exception is None, f"{shown}\n{exception!r}"
        assert (
            "Traceback (most recent call last)" not in err
            and SECRET not in out + err
            and PASSWD not in out + err
        ), shown
        if code != 0 and args[0] != "verify":  # (verify's report lists each problem on a line)
            assert len(err.strip().splitlines()) == 1, shown
        if args[0] == "query" and code == 0 and args[1] == COUNT:
            n, secret = (int(v) for v in out.strip().splitlines()[1].split(","))
            assert secret == 0 and (n == events_at_most if whole else n <= events_at_most), shown
    assert not list(lake.tmp.rglob("pwned*")), "SQL carried by the catalog ran"
    assert _tree(lake.tmp) == before, "a file changed"


def _assert_reader_safe(lake: Lake, events_at_most: int, whole: bool) -> None:
    try:
        reader = Reader(lake.folder)
    except QueryError as exc:
        assert "\n" not in str(exc) and SECRET not in str(exc)
        return
    try:
        n, secret = reader.sql(COUNT).rows[0]
        assert secret == 0 and (n == events_at_most if whole else n <= events_at_most)
        assert SECRET not in str(reader.sql("SELECT * FROM events").rows)
    except QueryError as exc:
        assert "\n" not in str(exc) and SECRET not in str(exc)
    finally:
        reader.close()


def test_an_absolute_path_outside_the_data_path_is_never_read(lake: Lake, entrance: str) -> None:
    events = _baseline(lake)
    for outside in (lake.secret / "events.parquet", Path("/etc/passwd")):
        _set_file_path(lake, str(outside), relative=False)
        _assert_safe(lake, entrance, events)
    with pytest.raises(QueryError, match=r"ducklake_data_file row of table 'events' names '/etc/passwd'"):
        Reader(lake.folder)


def test_a_relative_path_climbing_out_of_the_data_path_is_never_read(lake: Lake, entrance: str) -> None:
    events = _baseline(lake)
    events_folder = next((lake.folder / "data").rglob("events/**/*.parquet")).parent
    climb = os.path.relpath(lake.secret / "events.parquet", events_folder)
    assert climb.startswith("../")
    for path in (climb, "./" + climb, climb.replace("events.parquet", "*.parquet")):
        _set_file_path(lake, path, relative=True)
        _assert_safe(lake, entrance, events)
    with pytest.raises(QueryError, match=r"not a plain file under the data path"):
        Reader(lake.folder)


@pytest.mark.parametrize(
    "path",
    [
        "x']); COPY (SELECT 42) TO 'TMP/pwned.csv'; --.parquet",
        "x'], hive_partitioning = false); COPY (SELECT 1) TO 'TMP/pwned2.csv'; --",
        "*.parquet",
        "../*/*.parquet",
        "**/*.parquet",
        "ducklake-?.parquet",
        "[a-z]*.parquet",
        "ok.parquet\n; COPY (SELECT 1) TO 'TMP/pwned3.csv'",
    ],
    ids=["quote", "quote-hive", "star", "up-star", "double-star", "question", "bracket", "newline"],
)
def test_a_path_with_quotes_globs_or_a_newline_runs_and_expands_nothing(
    lake: Lake, entrance: str, path: str
) -> None:
    events = _baseline(lake)
    _set_file_path(lake, path.replace("TMP", str(lake.tmp)), relative=True)
    _assert_safe(lake, entrance, events)


def test_a_table_or_schema_name_carrying_sql_runs_nothing(lake: Lake, entrance: str) -> None:
    events = _baseline(lake)
    pwned = f"COPY (SELECT 1) TO '{lake.tmp}/pwned.csv'"
    _write(
        lake,
        "UPDATE c.ducklake_table SET table_name = ? WHERE table_name = 'metrics'",
        [f'metrics"; {pwned}; --'],
    )
    _write(
        lake,
        "UPDATE c.ducklake_schema SET schema_name = ? WHERE schema_name = 'main'",
        [f"main'; {pwned}; --"],
    )
    _assert_safe(lake, entrance, events, whole=True)
    # and through the path of a table with deletions (a view is made per such table, by its name)
    _write(
        lake,
        "INSERT INTO c.ducklake_delete_file (delete_file_id, table_id, begin_snapshot, end_snapshot, "
        "data_file_id, path, path_is_relative, format, delete_count, file_size_bytes, footer_size) "
        "SELECT (SELECT coalesce(max(delete_file_id), 0) + 1 FROM c.ducklake_delete_file), f.table_id, "
        "f.begin_snapshot, NULL, f.data_file_id, 'gone.parquet', true, 'parquet', 1, 100, 10 "
        "FROM c.ducklake_data_file f JOIN c.ducklake_table t ON t.table_id = f.table_id "
        "WHERE t.table_name LIKE 'metrics\"%' AND f.end_snapshot IS NULL ORDER BY f.data_file_id LIMIT 1",
    )
    _assert_safe(lake, entrance, events, whole=True)


def test_a_delete_file_outside_the_data_path_is_never_read(lake: Lake, entrance: str) -> None:
    events = _baseline(lake)
    for path, relative in (
        (str(lake.secret / "deletes.parquet"), False),
        ("../../../../secret/deletes.parquet", True),
    ):
        _write(lake, "DELETE FROM c.ducklake_delete_file")
        _write(
            lake,
            "INSERT INTO c.ducklake_delete_file (delete_file_id, table_id, begin_snapshot, end_snapshot, "
            "data_file_id, path, path_is_relative, format, delete_count, file_size_bytes, footer_size) "
            "SELECT 900001, table_id, begin_snapshot, NULL, data_file_id, ?, ?, 'parquet', record_count, "
            "100, 10 FROM c.ducklake_data_file WHERE data_file_id = ?",
            [path, relative, _first_events_file(lake)],
        )
        _assert_safe(lake, entrance, events, whole=True)  # (a read of it would delete a file's rows)
    with pytest.raises(QueryError, match=r"ducklake_delete_file row of table 'events'"):
        Reader(lake.folder)


@pytest.mark.parametrize("data_path", ["/", "SECRET"])
def test_the_catalogs_data_path_moved_is_ignored(lake: Lake, entrance: str, data_path: str) -> None:
    events = _baseline(lake)
    moved = str(lake.secret) + "/" if data_path == "SECRET" else data_path
    _write(lake, "UPDATE c.ducklake_metadata SET value = ? WHERE key = 'data_path'", [moved])
    _assert_safe(lake, entrance, events, whole=True)


def _twin_outside(lake: Lake, relative: bool) -> None:
    """The first events file's row pointed at a byte-identical copy of it outside the data path (its
    name and SHA-256 those the commit log records): reading it would answer as the lake does."""
    with _catalog(lake) as con:
        row = con.execute(
            "SELECT f.path, t.path FROM c.ducklake_data_file f JOIN c.ducklake_table t "
            "ON t.table_id = f.table_id WHERE f.data_file_id = ?",
            [_first_events_file(lake)],
        ).fetchone()
    assert row is not None
    file_path, table_path = str(row[0]), str(row[1])
    original = lake.folder / "data" / "main" / table_path / file_path
    copy = lake.secret / original.name
    shutil.copyfile(original, copy)
    table_folder = lake.folder / "data" / "main" / table_path
    _set_file_path(lake, os.path.relpath(copy, table_folder) if relative else str(copy), relative)


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_a_copy_outside_the_data_path_is_refused_by_readers(lake: Lake, relative: bool) -> None:
    _twin_outside(lake, relative)
    with pytest.raises(QueryError, match=r"ducklake_data_file row of table 'events' .* not a plain file"):
        Reader(lake.folder)
    code, _, err, exception = _cli("query", "SELECT count(*) FROM events", "--ledger", lake.folder)
    assert exception is None and code == 1 and "not a plain file under the data path" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_verify_reports_a_copy_outside_the_data_path(lake: Lake, relative: bool) -> None:
    _twin_outside(lake, relative)
    code, out, err, exception = _cli("verify", "--ledger", lake.folder)
    assert exception is None and code == 1, out + err
    assert "outside the data path" in out + err or "not a plain file" in out + err
