"""Read-only SQL holds: no statement writes a file or reads one outside the ledger's tables.

A corpus of write and escape attempts (grow it: every DuckDB statement type, the table functions
that touch files, statements nested in EXPLAIN / EXPLAIN ANALYZE / PREPARE / CTEs, several
statements, pragmas and settings) goes through the three entrances: ``Reader.sql``, ``ledger query``
and ``ledger shell --builtin``. Each attempt is refused with one line and writes nothing (the files
under the test's folder, the ledger included, are compared before and after); the queries people
run (the views, the README's examples) still answer.

Every spelling DuckDB accepts of the functions that act or open files with their own I/O (comments
between a name and its parenthesis, quotes, schema qualification, case, nesting, strings built into
SQL) is refused by name, on a published copy's folder of part files (fetched by ``runledger.ledger.remote``
from a 127.0.0.1 server) and on a ledger on DuckLake (whose statements' connection loads no
scanner), through ``Reader.sql``, ``ledger query`` and ``RemoteCopy.sql``. A
statement runs under limits: stopped by ``--timeout``, ``--memory-limit`` or ``--spill-limit`` in
one line, its spill folder left empty.
"""

from __future__ import annotations

import gc
import http.server
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import duckdb
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.cli.shell_cmd import init_sql
from runledger.ledger.lake import Catalog, LakeFolder, connect_data
from runledger.ledger.query import SPILL_AREA, QueryError, Reader
from runledger.ledger.remote import RemoteCopy, fetch_copy
from runledger.ledger.sql_guard import QueryLimits, RefusedStatement, read_only_statement, remove_dead_spills
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder

runner = CliRunner()

# {inside}: a new file in a table folder (a forged Parquet file there changes every answer);
# {outside}: a folder beside the ledger; {key}: the ledger's log private key (`ledger keys init`);
# {ledger}: the ledger's root (its commit log and signed checkpoints are not tables).
WRITES = [
    "COPY (SELECT 1 AS loss) TO '{inside}.parquet'",
    "COPY (SELECT 1 AS loss) TO '{outside}/a.csv'",
    "COPY metrics TO '{inside}.csv' (FORMAT csv)",
    "EXPLAIN ANALYZE COPY (SELECT 1e9 AS value) TO '{inside}.parquet'",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{outside}/b.csv'",
    "explain analyze\ncopy (select 1) to '{inside}.parquet'",
    "/* note */ EXPLAIN ANALYZE COPY (SELECT 1) TO '{inside}.parquet'",
    "EXPLAIN (ANALYZE) COPY (SELECT 1) TO '{inside}.parquet'",
    "EXPLAIN (FORMAT json, ANALYZE) COPY (SELECT 1) TO '{inside}.parquet'",
    "EXPLAIN COPY (SELECT 1) TO '{inside}.parquet'",
    "/* a /* nested */ EXPLAIN SELECT 1 */ EXPLAIN ANALYZE COPY (SELECT 1) TO '{inside}.parquet'",
    "PREPARE p AS COPY (SELECT 1) TO '{inside}.parquet'",
    "EXECUTE p",
    "PREPARE p AS SELECT 1",
    "DEALLOCATE p",
    "SELECT 1; COPY (SELECT 1) TO '{inside}.parquet'",
    "COPY (SELECT 1) TO '{inside}.parquet'; SELECT 1",
    "WITH t AS (SELECT 1 AS x) SELECT * FROM t; COPY (SELECT 1) TO '{inside}.parquet'",
    "SELECT * FROM query('COPY (SELECT 1) TO ''{inside}.parquet''')",
    "EXPORT DATABASE '{inside}'",
    "EXPORT DATABASE '{outside}/db'",
    "IMPORT DATABASE '{outside}'",
    "ATTACH '{inside}.db' AS x",
    "ATTACH '{outside}/x.db' AS x",
    "ATTACH ':memory:' AS x",
    "DETACH memory",
    "USE memory",
    "COPY FROM DATABASE memory TO x",
    "CREATE TABLE t AS SELECT 1",
    "CREATE TEMP TABLE t AS SELECT 1",
    "CREATE VIEW v AS SELECT 1",
    "CREATE OR REPLACE VIEW metrics AS SELECT 1e9 AS value",
    "CREATE MACRO m() AS 1",
    "CREATE SEQUENCE s",
    "CREATE TYPE e AS ENUM ('a')",
    "CREATE SCHEMA s",
    "CREATE SECRET (TYPE s3, KEY_ID 'a', SECRET 'b')",
    "CREATE PERSISTENT SECRET s (TYPE s3, KEY_ID 'a', SECRET 'b')",
    "DROP SECRET s",
    "INSERT INTO metrics VALUES (1)",
    "UPDATE metrics SET value = 1e9",
    "DELETE FROM metrics",
    "MERGE INTO metrics USING (SELECT 1 AS step) s ON metrics.step = s.step WHEN MATCHED THEN DELETE",
    "ALTER VIEW metrics RENAME TO m2",
    "COMMENT ON VIEW metrics IS 'x'",
    "DROP VIEW metrics",
    "INSTALL httpfs",
    "FORCE INSTALL httpfs",
    "LOAD httpfs",
    "LOAD '{outside}/evil.duckdb_extension'",
    "UPDATE EXTENSIONS",
    "CREATE EXTENSION REPOSITORY evil",
    "CALL enable_logging(storage = 'file', storage_path = '{inside}')",
    "CALL pragma_version()",
    "CHECKPOINT",
    "VACUUM",
    "ANALYZE",
    "BEGIN TRANSACTION",
    "PRAGMA enable_profiling = 'json'",
    "PRAGMA profiling_output = '{outside}/profile.json'",
    "PRAGMA enable_checkpoint_on_shutdown",
    "SET enable_external_access = true",
    "SET allowed_directories = ['/']",
    "SET lock_configuration = false",
    "SET profiling_output = '{inside}.json'",
    "SET log_query_path = '{outside}/queries.log'",
    "SET temp_directory = '{outside}'",
    "SET VARIABLE v = 1",
    "RESET enable_external_access",
    "RESET ALL",
    "SELECT * FROM enable_logging()",
    # duckdb 1.5.5 wrote its log files into an allowed folder from a plain SELECT, configuration locked
    "SELECT * FROM enable_logging(storage = 'file', storage_path = '{inside}')",
    "SELECT * FROM main.\"enable_logging\"(storage = 'file', storage_path = '{inside}')",
    "SELECT * FROM query('SELECT * FROM enable_' || 'logging()')",
]
# Reads of files that are not the ledger's tables: DuckDB itself refuses them.
READS = [
    "SELECT * FROM read_text('{key}')",
    "SELECT * FROM read_blob('{key}')",
    "SELECT * FROM read_csv('{key}', header = false)",
    "SELECT * FROM read_csv_auto('/etc/passwd')",
    "SELECT * FROM read_json('{ledger}/LEDGER.json')",
    "SELECT * FROM read_json_auto('{ledger}/LEDGER.json')",
    "SELECT * FROM read_ndjson('{ledger}/LEDGER.json')",
    "SELECT * FROM read_text('{ledger}/_checkpoints/run-a.txt')",
    "SELECT * FROM read_text('{inside}/../../../keys/runledger.key')",
    "SELECT * FROM read_text('{ledger}/metrics/../LEDGER.json')",
    "SELECT * FROM read_parquet('{outside}/*.parquet')",
    "SELECT * FROM parquet_metadata('{outside}/x.parquet')",
    "SELECT * FROM parquet_schema('{outside}/x.parquet')",
    "SELECT * FROM sniff_csv('/etc/passwd')",
    "SELECT * FROM glob('{ledger}/**')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM read_text('/etc/hostname')",
    "SELECT * FROM '/etc/passwd'",
    "SELECT * FROM read_csv('https://example.com/a.csv')",
    "WITH k AS (SELECT * FROM read_text('{key}')) SELECT * FROM k",
    "EXPLAIN ANALYZE SELECT * FROM read_text('{key}')",
    "SELECT (SELECT content FROM read_text('{key}')) AS k FROM metrics",
]
# What people run: the views, the README's examples, the select-shaped statements.
LEGIT = [
    ("SELECT count(*) FROM metrics WHERE name = 'loss'", 12),
    ("SELECT count(*) FROM runs", 1),
    ("SELECT count(*) FROM events", 13),
    (
        "SELECT step, avg(value) FROM metrics WHERE run_id = 'run-a' AND name = 'loss' "
        "AND step BETWEEN 2 AND 5 GROUP BY step ORDER BY step",
        4,
    ),
    ("WITH t AS (SELECT DISTINCT step FROM metrics) SELECT count(*) FROM t", 12),
    ("PIVOT (SELECT step, name, value FROM metrics) ON name USING first(value)", 12),
    ("SELECT count(*) FROM (SUMMARIZE metrics)", None),
    ("DESCRIBE metrics", None),
    ("SHOW TABLES", None),
    ("FROM runs", 1),
    ("VALUES (1), (2)", 2),
    ("EXPLAIN SELECT count(*) FROM metrics", None),
    ("EXPLAIN ANALYZE SELECT count(*) FROM metrics", None),
    ("SELECT * FROM config_at('run-a', 5)", 1),
    (
        "SELECT count(*) FROM read_parquet('{ledger}/metrics/*/*.parquet', hive_partitioning = true, "
        "hive_types = {{'run_id': VARCHAR}}) WHERE name = 'loss'",
        12,
    ),
    ("SELECT count(*) FROM glob('{ledger}/metrics/*/*.parquet')", None),
]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _fetched(dest: Path, log_key: str, cache: Path) -> Path:
    """``dest`` (a published folder) served on 127.0.0.1 and fetched by ``fetch_copy``: the folder
    of part files a remote copy keeps, which ``Reader`` opens as a ledger."""

    def handler(*args: Any, **kwargs: Any) -> _Quiet:
        return _Quiet(*args, directory=str(dest), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        return fetch_copy(
            f"http://127.0.0.1:{server.server_address[1]}/", log_key, cache, deadline_s=60
        ).folder
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A remote copy of a ledger with one run and a signed checkpoint ("ledger"), the ledger itself
    on DuckLake ("lake"), and its log key in keys/ beside them."""
    base = tmp_path_factory.mktemp("doors").resolve()
    run = RunBuilder()
    run.start()
    for step in range(1, 13):
        run.step(step, loss=5 - step * 0.1)
    lake = base / "lake"
    records = [SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)]
    # The events on DuckLake, its catalog a SQLite file: what sqlite_scan would read.
    on_lake = Ledger.create_on_lake(lake, f"sqlite:{lake / 'catalog.sqlite'}")
    on_lake.commit(records)
    on_lake.close()
    del on_lake
    gc.collect()  # its index of seen events closes (SQLite folds its WAL in then), before any test looks
    assert runner.invoke(app, ["keys", "init", "--keys", str(base / "keys")]).exit_code == 0
    signed = runner.invoke(app, ["checkpoint", "--ledger", str(lake), "--keys", str(base / "keys")])
    assert signed.exit_code == 0, signed.output
    published = runner.invoke(
        app, ["publish", str(base / "dest"), "--keys", str(base / "keys"), "--ledger", str(lake)]
    )
    assert published.exit_code == 0, published.output
    vkey = (base / "keys" / "runledger.pub").read_text().strip()
    ledger = _fetched(base / "dest", vkey, base / "cache")
    # the signed checkpoints beside the copy's tables: real files a read must not reach
    shutil.copytree(lake / "_checkpoints", ledger / "_checkpoints")
    gc.collect()
    (base / "outside").mkdir()
    for folder in (
        ledger,
        lake,
        ledger.parent,
    ):  # the spill areas a reader and a remote copy make on first use
        (folder / SPILL_AREA).mkdir(exist_ok=True)
    return {
        "base": str(base),
        "ledger": str(ledger),
        "lake": str(lake),
        "catalog": str(lake / "catalog.sqlite"),
        "inside": str(ledger / "metrics" / "run_id=run-a" / "forged"),
        "outside": str(base / "outside"),
        "key": str(base / "keys" / "runledger.key"),
    }


def _files(base: Path) -> dict[str, tuple[int, int]]:
    """Each file's size and time of change, each folder's presence. Aside: the lake catalog's SQLite
    companions (``-shm``/``-wal``: made, written or removed by whoever opens the catalog, as a lake
    reader does to list its files), and folders' times (a new or removed file shows by its name)."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (0, 0)
        for p in base.rglob("*")
        if not p.name.endswith(("catalog.sqlite-shm", "catalog.sqlite-wal"))
    }


@pytest.fixture
def unchanged(place: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No file under the test's folder appears, changes or goes (the working folder is in it too)."""
    base = Path(place["base"])
    monkeypatch.chdir(base / "outside")  # where a relative path would write
    before = _files(base)
    yield
    assert _files(base) == before


def _filled(template: str, place: dict[str, str]) -> str:
    return template.format(**place)


def _one_refusal(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: "), output
    if len(lines) > 1:  # a mistake in the SQL (a parser or catalog error) keeps its caret under it
        assert "LINE 1:" in output and "^" in lines[-1], output
    return lines[0]


@pytest.fixture(scope="module")
def reader(place: dict[str, str]) -> Reader:
    return Reader(place["ledger"])  # one for the module: opening one defines every view (~0.3 s)


@pytest.mark.parametrize("template", WRITES + READS)
def test_reader_sql_refuses_and_writes_nothing(
    template: str, place: dict[str, str], reader: Reader, unchanged: None
) -> None:
    with pytest.raises(QueryError) as refused:
        reader.sql(_filled(template, place))
    message = str(refused.value)
    assert "\n" not in message or "LINE 1:" in message, message
    assert "PRIVATE+KEY" not in message


# Each `ledger query` opens the ledger anew: a sample of the corpus (grow the lists at their ends;
# the whole corpus goes through `Reader.sql` above and through one shell session below).
QUERY_SAMPLE = [WRITES[i] for i in (3, 10, 15, 50, 62)] + [READS[0]]


@pytest.mark.parametrize("template", QUERY_SAMPLE)
def test_ledger_query_refuses_in_one_line_and_writes_nothing(
    template: str, place: dict[str, str], unchanged: None
) -> None:
    result = runner.invoke(app, ["query", "--ledger", place["ledger"], _filled(template, place)])
    assert result.exit_code != 0, result.output
    _one_refusal(result.output)
    assert "PRIVATE+KEY" not in result.output


def test_builtin_shell_refuses_every_attempt_and_writes_nothing(
    place: dict[str, str], unchanged: None
) -> None:
    # One statement per line, each ended with ";" (a statement that already holds several keeps them
    # on its line: the shell runs them in order and stops the line at the first refusal).
    lines = [_filled(t, place).replace("\n", " ") + ";" for t in WRITES + READS]
    result = runner.invoke(
        app, ["shell", "--builtin", "--ledger", place["ledger"]], input="\n".join(lines) + "\n"
    )
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    refusals = [line for line in result.output.splitlines() if "error: " in line]
    assert len(refusals) == len(lines), result.output
    assert "PRIVATE+KEY" not in result.output


def test_a_symlink_in_a_table_folder_does_not_lead_out(place: dict[str, str], reader: Reader) -> None:
    """A copy of the ledger may hold a link placed to make its reader read their own key."""
    link = Path(place["inside"] + "-link.parquet")
    link.symlink_to(place["key"])
    try:
        with pytest.raises(QueryError, match="reads only the ledger's tables"):
            reader.sql(f"SELECT * FROM read_parquet('{link}')")
    finally:
        link.unlink()


def test_the_lock_cannot_be_undone_by_duckdb_itself(
    place: dict[str, str], reader: Reader, unchanged: None
) -> None:
    """Under the statement check: the reader's connection refuses on its own (the first wall)."""
    con = reader.con
    for template in (
        "SET enable_external_access = true",
        "RESET lock_configuration",
        "SET allowed_directories = ['/']",
        "SELECT * FROM read_text('{key}')",
        "COPY (SELECT 1) TO '{outside}/c.csv'",
        "EXPLAIN ANALYZE COPY (SELECT 1) TO '{outside}/d.parquet'",
        "ATTACH '{outside}/e.db'",
        "LOAD httpfs",
    ):
        with pytest.raises(duckdb.Error):
            con.execute(_filled(template, place)).fetchall()


@pytest.mark.parametrize(("template", "rows"), LEGIT)
def test_reads_people_run_still_answer(
    template: str, rows: int | None, place: dict[str, str], reader: Reader
) -> None:
    result = reader.sql(_filled(template, place))
    if rows is not None:
        count = result.rows[0][0] if result.columns[0].startswith("count") else len(result.rows)
        assert count == rows, result.rows
    else:
        assert result.rows


def test_ledger_query_and_the_folds_answer_through_the_lock(place: dict[str, str]) -> None:
    result = runner.invoke(
        app,
        [
            "query",
            "--ledger",
            place["ledger"],
            "-f",
            "csv",
            "SELECT count(*) FROM metrics WHERE name = 'loss'",
        ],
    )
    assert result.exit_code == 0 and result.output.splitlines()[-1] == "12", result.output
    done = runner.invoke(app, ["state", "run-a", "--step", "5", "--ledger", place["ledger"]])
    assert done.exit_code == 0, done.output


def test_duckdb_shell_init_file_locks_its_connection(place: dict[str, str], unchanged: None) -> None:
    """The init file DuckDB's own shell is started with defines the views and then the same lock."""
    con = duckdb.connect(":memory:")
    con.execute(init_sql(Path(place["ledger"])))
    assert con.execute("SELECT count(*) FROM metrics WHERE name = 'loss'").fetchall() == [(12,)]
    for template in ("SELECT * FROM read_text('{key}')", "COPY (SELECT 1) TO '{outside}/f.csv'"):
        with pytest.raises(duckdb.PermissionException):
            con.execute(_filled(template, place)).fetchall()
    with pytest.raises(duckdb.Error):
        con.execute("SET enable_external_access = true")


def test_key_file_is_where_the_corpus_looks(place: dict[str, str]) -> None:
    """The reads above aim at a real private key: a corpus aimed at nothing would prove nothing."""
    assert Path(place["key"]).read_text().startswith("PRIVATE+KEY")
    assert os.stat(place["key"]).st_mode & 0o777 == 0o600


# ------------------------------------------------------------------ every spelling, every entrance

# Each is refused by name whatever surrounds the name: {catalog} is the lake's own SQLite catalog
# (a real file sqlite_scan would read past DuckDB's lock), {inside} a table folder, {key} the key.
SPELLINGS = [
    "SELECT * FROM sqlite_scan/**/('{catalog}', 'ducklake_snapshot')",
    "SELECT * FROM sqlite_scan--x\n('{catalog}', 'ducklake_snapshot')",
    "SELECT * FROM \"sqlite_scan\"('{catalog}', 'ducklake_snapshot')",
    "SELECT * FROM main.sqlite_scan('{catalog}', 'ducklake_snapshot')",
    "SELECT * FROM system.main.SQLITE_SCAN('/etc/hostname', 'x')",
    "select * from Sqlite_Scan /* a */ ( '{catalog}' , 'ducklake_snapshot' )",
    "SELECT (SELECT count(*) FROM sqlite_scan('{catalog}', 'ducklake_snapshot')) AS n",
    "WITH s AS (SELECT * FROM sqlite_scan('{catalog}', 'ducklake_snapshot')) SELECT * FROM s",
    "SELECT * FROM range(1) r, LATERAL (SELECT * FROM sqlite_scan('{catalog}', 'ducklake_snapshot'))",
    "SELECT 1 WHERE 1 IN (SELECT count(*) FROM sqlite_scan('{catalog}', 'ducklake_snapshot'))",
    "SELECT 1 UNION ALL SELECT count(*) FROM sqlite_scan('{catalog}', 'ducklake_snapshot')",
    "EXPLAIN ANALYZE SELECT * FROM sqlite_scan/**/('{catalog}', 'ducklake_snapshot')",
    "EXPLAIN/**/ANALYZE SELECT * FROM sqlite_scan('{catalog}', 'ducklake_snapshot')",
    "SELECT * FROM sqlite_query('{catalog}', 'SELECT 1')",
    "SELECT sqlite_attach('{catalog}')",
    "SELECT * FROM postgres_scan/**/('host=127.0.0.1', 'public', 't')",
    "SELECT * FROM \"POSTGRES_QUERY\"('host=127.0.0.1', 'SELECT 1')",
    "SELECT * FROM ducklake_snapshots/**/('lake')",
    "SELECT * FROM main.ducklake_table_info('lake')",
    "SELECT * FROM enable_logging/**/(storage = 'file', storage_path = '{inside}')",
    "SELECT * FROM enable_logging--x\n(storage = 'file', storage_path = '{inside}')",
    "SELECT * FROM system.main.\"ENABLE_LOGGING\"(storage = 'file', storage_path = '{inside}')",
    "SELECT enable_logging(storage = 'file', storage_path = '{inside}')",
    "SELECT write_log('x')",
    "SELECT * FROM query/**/('SELECT 1')",
    "SELECT * FROM query_table('metrics')",
    "SELECT * FROM \"query\"('COPY (SELECT 1) TO ''{inside}.parquet''')",
    "SELECT * FROM query('SELECT * FROM sqlite_' || 'scan(''{catalog}'', ''ducklake_snapshot'')')",
    "SELECT json_execute_serialized_sql(json_serialize_sql('SELECT * FROM read_text(''{key}'')'))",
    "SELECT * FROM json_execute_serialized_sql/**/(json_serialize_sql('SELECT 1'))",
    "SELECT * FROM read_csv/**/('{key}')",
    "SELECT * FROM READ_TEXT--x\n('{key}')",
    "SELECT * FROM main.read_text('/etc/hostname')",
    "SELECT * FROM glob/**/('{ledger}/*')",
    "SELECT * FROM '{catalog}'",
    'SELECT * FROM "{key}"',
    "SELECT current_setting('allowed_directories')",
    "SELECT * FROM duckdb_settings()",
    "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM checkpoint()",
    "/**/COPY/**/(SELECT 1) TO '{inside}.parquet'",
    "--x\nATTACH '{catalog}' AS c (TYPE sqlite)",
    "/* */ INSTALL sqlite",
    "LOAD/**/sqlite_scanner",
    "SET/**/enable_external_access = true",
    "PRAGMA/**/enable_profiling",
    "CALL/**/sqlite_attach('{catalog}')",
    "PIVOT (SELECT * FROM sqlite_scan/**/('{catalog}', 'ducklake_snapshot')) ON name USING count(*)",
    "PIVOT '{catalog}' ON x USING count(*)",
]


@pytest.fixture(scope="module")
def lake_reader(place: dict[str, str]) -> Reader:
    return Reader(place["lake"])


def _one_line_refusal(message: str) -> None:
    assert message.startswith("refused"), message
    assert "\n" not in message, message
    assert "PRIVATE+KEY" not in message and "ducklake_snapshot\t" not in message


@pytest.mark.parametrize("template", SPELLINGS)
def test_every_spelling_is_refused_by_name_on_part_files_and_on_the_lake(
    template: str, place: dict[str, str], reader: Reader, lake_reader: Reader, unchanged: None
) -> None:
    statement = _filled(template, place)
    for each in (reader, lake_reader):
        with pytest.raises(QueryError) as refused:
            each.sql(statement)
        _one_line_refusal(str(refused.value))


def test_a_function_is_refused_by_the_name_duckdb_looks_up(reader: Reader) -> None:
    """The refusal names what DuckDB would call, however the text spelled it."""
    for spelled in ("sqlite_scan/**/", '"SQLITE_SCAN"', "main.Sqlite_Scan--x\n"):
        with pytest.raises(
            QueryError, match=r"^refused: table function sqlite_scan\(\) is not allowed here$"
        ):
            reader.sql(f"SELECT * FROM {spelled}('x.db', 't')")
    with pytest.raises(QueryError, match=r"^refused: function enable_logging\(\) is not allowed here$"):
        reader.sql("SELECT main.enable_logging/**/()")


SPELLING_SAMPLE = [SPELLINGS[i] for i in (0, 1, 12, 19, 27, 28, 41)]


@pytest.mark.parametrize("template", SPELLING_SAMPLE)
@pytest.mark.parametrize("which", ["ledger", "lake"])
def test_ledger_query_refuses_every_spelling_in_one_line(
    template: str, which: str, place: dict[str, str], unchanged: None
) -> None:
    statement = _filled(template, place)
    result = runner.invoke(app, ["query", "--ledger", place[which], "--", statement])
    assert result.exit_code != 0, result.output
    assert _one_refusal(result.output).startswith("error: refused"), result.output


def _copy(place: dict[str, str]) -> RemoteCopy:
    """A verified copy's folder as ``fetch_copy`` leaves it is a ledger's folder: the ledger itself."""
    return RemoteCopy(Path(place["ledger"]), cast(Any, None), 0, 0)


@pytest.mark.parametrize("template", [*SPELLING_SAMPLE, WRITES[0], READS[0]])
def test_remote_copy_refuses_every_spelling(template: str, place: dict[str, str], unchanged: None) -> None:
    with pytest.raises(QueryError) as refused:
        _copy(place).sql(_filled(template, place))
    _one_line_refusal(str(refused.value))


def test_the_lake_readers_connection_has_no_scanner_and_no_catalog(lake_reader: Reader) -> None:
    """The statements' connection over a lake loads no extension and attaches nothing: even a
    statement the check let through could not open the catalog."""
    con = lake_reader.con
    scanning = con.execute(
        "SELECT DISTINCT function_name FROM duckdb_functions() WHERE function_name SIMILAR TO "
        "'(sqlite|postgres|ducklake)_.*'"
    ).fetchall()
    assert scanning == [], scanning
    attached = {name for (name,) in con.execute("SELECT database_name FROM duckdb_databases()").fetchall()}
    assert attached <= {"memory", "system", "temp"}, attached
    with pytest.raises(duckdb.Error):
        con.execute("SELECT * FROM sqlite_scan('x.db', 't')")


LAKE_LEGIT = [
    ("SELECT count(*) FROM metrics WHERE name = 'loss'", 12),
    ("SELECT count(*) FROM runs", 1),
    ("SELECT count(*) FROM lake.events WHERE stream = 'run-a'", 13),
    ("SELECT * FROM config_at('run-a', 5)", 1),
    ("PIVOT (SELECT step, name, value FROM metrics) ON name USING first(value)", 12),
    ("EXPLAIN ANALYZE SELECT count(*) FROM metrics", None),
    ("SELECT count(*) FROM (SUMMARIZE metrics)", None),
]


@pytest.mark.parametrize(("template", "rows"), LAKE_LEGIT)
def test_reads_people_run_answer_on_the_lake_as_on_part_files(
    template: str, rows: int | None, place: dict[str, str], reader: Reader, lake_reader: Reader
) -> None:
    statement = _filled(template, place)
    on_lake = lake_reader.sql(statement)
    if rows is None:
        assert on_lake.rows
        return
    count = on_lake.rows[0][0] if on_lake.columns[0].startswith("count") else len(on_lake.rows)
    assert count == rows, on_lake.rows
    if not statement.startswith("SELECT count(*) FROM lake."):
        assert sorted(map(str, on_lake.rows)) == sorted(map(str, reader.sql(statement).rows))


def test_the_lake_views_leave_out_rows_a_delete_file_deletes(place: dict[str, str], tmp_path: Path) -> None:
    """A DuckLake delete (a redaction's, until its erasure rewrites the file) is a delete file the
    views apply by row position: the deleted rows are not there, the others are."""
    import shutil

    folder = tmp_path / "lake"
    shutil.copytree(place["lake"], folder)
    (folder / "LAKE.json").write_text((folder / "LAKE.json").read_text().replace(place["lake"], str(folder)))
    lake = LakeFolder.read(folder)
    assert lake is not None and str(folder) in lake.catalog
    before = Reader(folder)
    con = connect_data(Catalog.parse(lake.catalog), lake.data_path)
    try:
        con.execute(
            f"ATTACH 'ducklake:{lake.catalog}' AS w (DATA_PATH '{lake.data_path}', OVERRIDE_DATA_PATH true)"
        )
        con.execute("DELETE FROM w.metrics WHERE step IN (3, 4)")
    finally:
        con.close()
    assert list((folder / "data").rglob("*-delete.parquet")), "no delete file was written"
    after = Reader(folder)
    steps = "SELECT step FROM metrics WHERE name = 'loss' ORDER BY step"
    assert [s for (s,) in after.sql(steps).rows] == [1, 2, *range(5, 13)]
    assert [s for (s,) in before.sql(steps).rows] == list(range(1, 13))  # its snapshot, pinned


# ----------------------------------------------------------------------------------------- limits

ENDLESS = "SELECT count(*) FROM range(1000000000000)"
HUNGRY = "SELECT len(list(i)) FROM range(30000000) t(i)"  # a list aggregate cannot spill
SPILLING = (
    "SELECT sum(hash(i, s)) FROM (SELECT i, repeat('x', 20) AS s FROM range(1500000) t(i) ORDER BY random())"
)


def _spill_files(area: Path) -> list[Path]:
    return [p for p in area.rglob("*") if p.is_file()]


@pytest.mark.parametrize("which", ["ledger", "lake"])
def test_ledger_query_stops_a_statement_at_its_timeout_in_one_line(
    which: str, place: dict[str, str], unchanged: None
) -> None:
    result = runner.invoke(app, ["query", "--ledger", place[which], "--timeout", "1", ENDLESS])
    assert result.exit_code != 0, result.output
    assert _one_refusal(result.output) == "error: query stopped after 1 s (--timeout)"


def test_reader_and_remote_copy_stop_at_their_timeout(place: dict[str, str], unchanged: None) -> None:
    limits = QueryLimits(timeout_s=1)
    reader = Reader(place["ledger"], limits=limits)
    with pytest.raises(QueryError, match=r"^query stopped after 1 s \(--timeout\)$"):
        reader.sql(ENDLESS)
    assert reader.sql("SELECT count(*) FROM runs").rows == [(1,)]  # the next statement is not hit
    reader.close()
    with pytest.raises(QueryError, match=r"^query stopped after 1 s \(--timeout\)$"):
        _copy(place).sql(ENDLESS, limits=limits)


def test_a_memory_hungry_statement_is_stopped_by_the_memory_limit_in_one_line(
    place: dict[str, str], unchanged: None
) -> None:
    result = runner.invoke(app, ["query", "--ledger", place["ledger"], "--memory-limit", "32MB", HUNGRY])
    assert result.exit_code != 0, result.output
    line = _one_refusal(result.output)
    assert line.startswith("error: query stopped: it needed more than --memory-limit 32MB"), line
    with pytest.raises(QueryError, match=r"^query stopped: it needed more than --memory-limit 32MB"):
        _copy(place).sql(HUNGRY, limits=QueryLimits(memory_limit="32MB"))


def test_a_spill_goes_to_the_readers_own_folder_and_leaves_nothing(place: dict[str, str]) -> None:
    area = Path(place["ledger"]) / SPILL_AREA
    reader = Reader(place["ledger"], limits=QueryLimits(memory_limit="48MB"))
    assert reader.sql(SPILLING).rows[0][0] is not None
    assert _spill_files(area) == []
    with pytest.raises(QueryError, match=r"^query stopped: it needed more than --spill-limit 1MB of spill$"):
        Reader(place["ledger"], limits=QueryLimits(memory_limit="48MB", spill_limit="1MB")).sql(SPILLING)
    assert _spill_files(area) == []
    reader.close()
    assert not reader._spill.path.exists()


def test_a_spill_folder_left_by_a_killed_process_is_removed_at_the_next_start(place: dict[str, str]) -> None:
    dead_pid = _ended_pid()
    area = Path(place["ledger"]) / SPILL_AREA
    left = area / f"spill-{dead_pid}-0123456789ab"
    left.mkdir()
    (left / "duckdb_temp_storage_DEFAULT-0.tmp").write_bytes(b"x" * 1024)
    alive = area / f"spill-{os.getpid()}-0123456789ab"
    alive.mkdir()
    try:
        Reader(place["ledger"]).close()
        assert not left.exists() and alive.exists()
    finally:
        alive.rmdir()
    assert remove_dead_spills(area) == []


def _ended_pid() -> int:
    """The pid of a process that has ended (and been waited for: no process has it now)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize(
    ("option", "value"),
    [("--timeout", "0"), ("--timeout", "-3"), ("--memory-limit", "lots"), ("--spill-limit", "10 parsecs")],
)
def test_a_bad_limit_is_one_usage_line(option: str, value: str, place: dict[str, str]) -> None:
    result = runner.invoke(app, ["query", "--ledger", place["ledger"], option, value, "SELECT 1"])
    assert result.exit_code == 2, result.output
    assert _one_refusal(result.output).startswith(f"error: {option} "), result.output


def test_the_builtin_shell_takes_the_limits(place: dict[str, str], unchanged: None) -> None:
    result = runner.invoke(
        app,
        ["shell", "--builtin", "--ledger", place["ledger"], "--timeout", "1"],
        input=f"{ENDLESS};\nSELECT 42 AS answer;\n",
    )
    assert result.exit_code == 0, result.output
    assert "error: query stopped after 1 s (--timeout)" in result.output
    assert "42" in result.output


def test_the_duckdb_shell_init_file_sets_the_limits_before_its_lock(
    place: dict[str, str], tmp_path: Path
) -> None:
    text = init_sql(Path(place["ledger"]), limits=QueryLimits(memory_limit="48MB"), spill=tmp_path / "spill")
    con = duckdb.connect(":memory:")
    con.execute(text)
    assert con.execute("SELECT current_setting('temp_directory')").fetchone() == (str(tmp_path / "spill"),)
    with pytest.raises(duckdb.Error):
        con.execute("SET memory_limit = '64GB'")


def test_a_statement_seen_before_is_not_parsed_again(reader: Reader) -> None:
    """The folds ask the same statements again and again: DuckDB's parse tree of a text checked
    before is reused (the cost of each is measured by bench/bench_query_lock.py)."""
    from runledger.ledger import sql_guard

    text = "SELECT count(*) FROM metrics WHERE step > 3 -- asked twice"
    assert read_only_statement(reader.con, text) == text
    assert text in sql_guard._TREES
    sql_guard._TREES[text] = sql_guard._TREES[text].replace('"metrics"', '"a_kept_tree"')
    # the kept tree is the one checked: a table by that name is no refusal, a path would be
    assert read_only_statement(reader.con, text) == text
    sql_guard._TREES[text] = sql_guard._TREES[text].replace('"a_kept_tree"', '"/etc/passwd"')
    with pytest.raises(RefusedStatement, match="passwd"):
        read_only_statement(reader.con, text)
    sql_guard._TREES.pop(text)
