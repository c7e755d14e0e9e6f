"""Read-only SQL holds: no statement writes a file or reads one outside the ledger's tables.

A corpus of write and escape attempts (grow it: every DuckDB statement type, the table functions
that touch files, statements nested in EXPLAIN / EXPLAIN ANALYZE / PREPARE / CTEs, several
statements, pragmas and settings) goes through the three entrances: ``Reader.sql``, ``ledger query``
and ``ledger shell --builtin``. Each attempt is refused with one line and writes nothing (the files
under the test's folder, the ledger included, are compared before and after); the queries people
run (the views, the README's examples) still answer.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from cli.main import app
from cli.shell_cmd import init_sql
from ledger.query import QueryError, Reader
from ledger.store import Ledger, SourceRecord
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


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A ledger with one run and a signed checkpoint; its log key in keys/ beside it."""
    base = tmp_path_factory.mktemp("doors").resolve()
    run = RunBuilder()
    run.start()
    for step in range(1, 13):
        run.step(step, loss=5 - step * 0.1)
    ledger = base / "ledger"
    Ledger.create(ledger).commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    assert runner.invoke(app, ["keys", "init", "--keys", str(base / "keys")]).exit_code == 0
    signed = runner.invoke(app, ["checkpoint", "--ledger", str(ledger), "--keys", str(base / "keys")])
    assert signed.exit_code == 0, signed.output
    (base / "outside").mkdir()
    return {
        "base": str(base),
        "ledger": str(ledger),
        "inside": str(ledger / "metrics" / "run_id=run-a" / "forged"),
        "outside": str(base / "outside"),
        "key": str(base / "keys" / "runledger.key"),
    }


def _files(base: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in base.rglob("*")}


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
            reader.sql(f"SELECT content FROM read_text('{link}')")
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
