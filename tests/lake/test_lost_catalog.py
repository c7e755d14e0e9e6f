"""A ledger whose lake catalog is lost or replaced (issue 39): every command says so in one line
naming the catalog and the folder, and nothing makes a new catalog under a ledger that has commits
(a new empty one made `verify` report every row "removed" and `ingest` redo its commit for ever).
Every redo of a commit beaten to the lake, and every wait for a lock beside a SQLite catalog, ends
with a line saying what it waited on."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import lake as lake_module
from runledger.ledger import store as store_module
from runledger.ledger.duck import connect
from runledger.ledger.lake import COMMIT_FENCE, EMBEDDED_CATALOG, LakeError, LakeFolder, LakeTables
from runledger.ledger.query import QueryError, Reader
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from tests.lake.conftest import Backend
from tests.lake.support import Postgres
from tests.support.factory import RunBuilder

SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "COLUMNS": "400"}
runner = CliRunner()


def _cli(*args: str | Path, code: int = 0) -> str:
    result = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lost") / "spool"
    _cli("simulate", "reference-535b", "--spool", folder, *SMALL)
    return folder


def _ledger(spool: Path, root: Path) -> Path:
    """A new ledger (the embedded catalog in its folder) holding the spool."""
    _cli("ingest", "spool", "--spool", spool, "--ledger", root, "--batch-size", "250")
    assert (root / EMBEDDED_CATALOG).is_file()
    return root


@pytest.mark.parametrize(
    "command",
    [
        ["verify"],
        ["ingest", "spool", "--spool", "SPOOL"],
        ["query", "SELECT count(*) FROM events"],
        ["state", "latest"],
        ["compact"],
    ],
)
def test_a_deleted_catalog_is_one_line_and_is_never_made_again(
    spool: Path, tmp_path: Path, command: list[str]
) -> None:
    root = _ledger(spool, tmp_path / "ledger")
    catalog = root / EMBEDDED_CATALOG
    catalog.unlink()
    args = [str(spool) if a == "SPOOL" else a for a in command]
    result = runner.invoke(app, [*args, "--ledger", str(root)], env=ENV)
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"error: no lake catalog at sqlite:{catalog}, which {root / 'LAKE.json'} names: it is missing, and "
        "it is never recreated under a ledger that has commits (restore it from a backup)\n"
    )
    assert not catalog.exists()  # nothing made in its place


def test_another_ledgers_catalog_is_refused_naming_both_ids(spool: Path, tmp_path: Path) -> None:
    root = _ledger(spool, tmp_path / "ledger")
    other = _ledger(spool, tmp_path / "other")
    mine = LakeFolder.read(root)
    theirs = LakeFolder.read(other)
    assert mine is not None and theirs is not None and mine.ledger_id != theirs.ledger_id
    shutil.copyfile(other / EMBEDDED_CATALOG, root / EMBEDDED_CATALOG)
    for args in (["verify"], ["ingest", "spool", "--spool", str(spool)]):
        result = runner.invoke(app, [*args, "--ledger", str(root)], env=ENV)
        assert result.exit_code == 1, result.output
        assert result.stderr == (
            f"error: {root}: the lake catalog sqlite:{root / EMBEDDED_CATALOG} holds ledger "
            f"{theirs.ledger_id}, but {root / 'LAKE.json'} names ledger {mine.ledger_id}: the catalog was "
            "replaced (restore this ledger's from a backup)\n"
        ), args


def test_a_reader_refuses_another_ledgers_catalog_naming_both_ids(spool: Path, tmp_path: Path) -> None:
    """The Reader (``query``, ``state``: no writer opened) checks the catalog's own ledger id
    against LAKE.json's before it answers with the other ledger's rows."""
    root = _ledger(spool, tmp_path / "ledger")
    other = _ledger(spool, tmp_path / "other")
    mine = LakeFolder.read(root)
    theirs = LakeFolder.read(other)
    assert mine is not None and theirs is not None and mine.ledger_id != theirs.ledger_id
    with contextlib.closing(Reader(root)) as reader:  # its own catalog: read as before
        assert reader.head.ledger_id == mine.ledger_id
    shutil.copyfile(other / EMBEDDED_CATALOG, root / EMBEDDED_CATALOG)
    line = (
        f"{root}: the lake catalog sqlite:{root / EMBEDDED_CATALOG} holds ledger {theirs.ledger_id}, but "
        f"{root / 'LAKE.json'} names ledger {mine.ledger_id}: the catalog was replaced (restore this "
        "ledger's from a backup)"
    )
    with pytest.raises(QueryError) as refused:
        Reader(root)
    assert str(refused.value) == line
    for args in (["query", "SELECT count(*) FROM events"], ["state", "latest"]):
        result = runner.invoke(app, [*args, "--ledger", str(root)], env=ENV)
        assert result.exit_code == 1, result.output
        assert result.stderr == f"error: {line}\n", args


def test_a_catalog_that_holds_no_lake_is_refused_and_left_as_it_was(spool: Path, tmp_path: Path) -> None:
    root = _ledger(spool, tmp_path / "ledger")
    (root / EMBEDDED_CATALOG).unlink()
    with LakeTables(f"sqlite:{root / EMBEDDED_CATALOG}", tmp_path / "elsewhere", create=False):
        pass  # a lake, but with no runledger table in it
    result = runner.invoke(app, ["verify", "--ledger", str(root)], env=ENV)
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"error: {root}: lake catalog sqlite:{root / EMBEDDED_CATALOG} holds no runledger tables\n"
    )


def test_commit_records_without_their_lake_marker_make_no_new_lake(spool: Path, tmp_path: Path) -> None:
    root = _ledger(spool, tmp_path / "ledger")
    (root / "LAKE.json").unlink()
    (root / EMBEDDED_CATALOG).unlink()
    with pytest.raises(LedgerError, match=r"holds commit records but no LAKE\.json"):
        Ledger.create(root)
    assert not (root / EMBEDDED_CATALOG).exists()


def _record(builder: RunBuilder, position: int) -> SourceRecord:
    return SourceRecord("spool:t", position, builder.events[position])


def test_a_commit_whose_fence_another_writer_moved_without_a_record_stops(
    backend: Backend, tmp_path: Path
) -> None:
    """A real second writer on the same catalog moves the ledger's commit fence with no commit
    record (as a foreign or replaced history would): each redo finds the fence moved again and no
    commit to take in, so the commit ends after LAKE_REDO_IDLE redos with the fence named."""
    run = RunBuilder(run_id="moe-lost")
    run.start()
    for step in range(1, 4):
        run.step(step, loss=1.0 / step)
    ledger = Ledger.create_on_lake(tmp_path / "ledger", backend.catalog, backend.data)
    assert ledger.commit([_record(run, 0)]).commit == 0
    with LakeTables(backend.catalog, backend.data, new_catalog=False) as second:
        assert second.commit({}, {COMMIT_FENCE: (1, 1000)}, {}, writer="second").ok
    with pytest.raises(LedgerError) as stopped:
        ledger.commit([_record(run, 1)])
    assert str(stopped.value).startswith(
        f"commit 1: the lake catalog {backend.catalog} moved its fences ({COMMIT_FENCE} at 1000) "
        f"{store_module.LAKE_REDO_IDLE} times with no commit record this ledger had not seen"
    )
    ledger.close()


def test_a_commit_turn_held_by_another_writer_is_waited_for_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer holding the commit turn of a SQLite catalog (its lock file, really held):
    the commit waits LOCK_WAIT_S, then one line names the turn and its file."""
    catalog = tmp_path / "catalog.sqlite"
    with LakeTables(f"sqlite:{catalog}", tmp_path / "data") as lake:
        monkeypatch.setattr(lake_module, "LOCK_WAIT_S", 0.5)
        with open(f"{catalog}.commit.lock", "a+b") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # a second open file: flock makes this one wait
            with pytest.raises(LakeError) as waited:
                lake.commit({}, {"s": (0, 1)}, {})
        assert str(waited.value) == (
            "waited 0.5 s for the commit turn (another writer's transaction holds it), "
            f"{catalog}.commit.lock: it was never free"
        )
        assert lake.commit({}, {"s": (0, 1)}, {}).ok  # free again: the same commit lands


def test_an_empty_postgres_database_in_place_of_the_catalog_is_refused_and_left_empty(
    postgres: Postgres | str, spool: Path, tmp_path: Path
) -> None:
    """A PostgreSQL catalog lost (its database emptied, or LAKE.json now naming an empty one): an
    ATTACH would have made a new lake in it; opening the ledger says the catalog is missing, and
    the database is left without a DuckLake table."""
    if isinstance(postgres, str):
        pytest.skip(postgres)
    first, empty = postgres.database(), postgres.database()
    root = tmp_path / "ledger"
    Ledger.create_on_lake(root, f"postgres:{first}", tmp_path / "data").close()
    marker = root / "LAKE.json"
    marker.write_text(marker.read_text().replace(first, empty))
    with pytest.raises(LedgerError) as refused:
        Ledger.open(root)
    assert str(refused.value) == (
        f"no lake catalog at postgres:{empty}, which {marker} names: it is missing, and it is never "
        "recreated under a ledger that has commits (restore it from a backup)"
    )
    with contextlib.closing(connect(extensions=["postgres_scanner"])) as con:
        con.execute(f"ATTACH '{empty}' AS pg (TYPE postgres, READ_ONLY)")
        made = con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE database_name = 'pg' AND table_name LIKE 'ducklake%'"
        ).fetchone()
    assert made == (0,)
