"""A reader makes each view when a statement first needs it (issue 41, ``runledger.ledger.lazy_views``):
every view answers as it does when all are made at once, a statement that lists the catalogue sees
all of them, and a name the words miss still answers (the retry with every view made)."""

from __future__ import annotations

import gc
from pathlib import Path

import duckdb
import pytest

from runledger.ledger import duckdb_names
from runledger.ledger.lazy_views import LazyViews
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lazy") / "ledger"
    run = RunBuilder()
    run.start()
    for step in range(1, 9):
        run.step(step, loss=4 - step * 0.1)
    made = Ledger.create(root)
    made.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    made.close()
    del made
    gc.collect()
    return root


def _views_of(reader: Reader) -> LazyViews:
    views = reader._views
    assert views is not None  # a lake's reader
    return views


def test_a_statement_makes_only_the_views_it_reads(ledger: Path) -> None:
    reader = Reader(ledger)
    try:
        assert reader.sql("SELECT count(*) FROM events").rows[0][0] > 0
        assert _views_of(reader).made == {"events"}
        reader.sql("SELECT count(*) FROM metrics")
        made = _views_of(reader).made
        assert {"metrics", "metrics_all", "_metrics"} <= made and len(made) < len(
            _views_of(reader).statements
        )
    finally:
        reader.close()


def test_every_view_made_alone_answers_as_with_all_made(ledger: Path) -> None:
    """Each view's closure (the views its words name, and theirs) is enough to run it, on a fresh
    connection with no retry: a dependency the words missed would fail here."""
    eager = Reader(ledger)
    try:
        eager.con  # noqa: B018 (every view made)
        views = _views_of(eager)
        # The macros and their parameters: each is called with NULLs (binding it reads its views).
        macros = {
            name: (kind, len(parameters))
            for name, kind, parameters in eager.con.execute(
                "SELECT function_name, function_type, parameters FROM duckdb_functions() "
                "WHERE NOT internal AND database_name = 'memory'"
            ).fetchall()
        }
        assert macros, "the views define macros (lineage_of, code_between, ...)"
        for name in views.statements:
            if name == "lake":
                continue
            if name in macros:
                kind, count = macros[name]
                call = f"{name}({', '.join(['NULL'] * count)})"
                sql = f"SELECT * FROM {call} LIMIT 0" if kind == "table_macro" else f"SELECT {call}"
            else:
                sql = f"SELECT * FROM {name} LIMIT 0"
            lone = LazyViews("\n".join(views.statements.values()))
            con = duckdb.connect()
            try:
                lone.make_for(con, sql)
                con.execute(sql)  # no "does not exist": the closure was whole
            finally:
                con.close()
    finally:
        eager.close()


def test_macros_answer_through_the_reader(ledger: Path) -> None:
    reader = Reader(ledger)
    try:
        run = reader.sql("SELECT run_id FROM runs").rows[0][0]
        assert reader.sql("SELECT count(*) FROM lineage_of(?)", [run]).rows[0][0] >= 1
    finally:
        reader.close()


@pytest.mark.parametrize(
    "statement",
    [
        "SHOW TABLES",
        "SELECT count(*) FROM information_schema.tables",
        "SELECT count(*) FROM duckdb_views() WHERE NOT internal",
    ],
)
def test_a_statement_that_lists_the_catalogue_sees_every_view(ledger: Path, statement: str) -> None:
    lazy, eager = Reader(ledger), Reader(ledger)
    try:
        eager.con  # noqa: B018 (every view made)
        assert lazy.sql(statement).rows == eager.sql(statement).rows
    finally:
        lazy.close()
        eager.close()


def test_a_mistyped_name_is_told_from_every_view(ledger: Path) -> None:
    reader = Reader(ledger)
    try:
        with pytest.raises(QueryError, match='Did you mean "events"'):
            reader.sql("SELECT * FROM evnts")
    finally:
        reader.close()


def test_the_kept_function_names_are_the_installed_duckdbs() -> None:
    """The SQL door's allow-list reads DuckDB's names from ``duckdb_names`` for the pinned version:
    they must be what that DuckDB lists (after a change of the pin: python -m runledger.ledger.duckdb_names)."""
    assert duckdb.__version__ == duckdb_names.DUCKDB_VERSION
    assert duckdb_names.derived() == (duckdb_names.FUNCTIONS, duckdb_names.TABLE_FUNCTIONS)


def test_a_view_text_that_is_not_a_create_is_refused() -> None:
    with pytest.raises(ValueError, match="not a CREATE"):
        LazyViews("SELECT 1;\nCREATE VIEW a AS SELECT 1;")
