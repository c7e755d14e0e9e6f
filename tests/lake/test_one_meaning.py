"""One meaning per name (issue 39): the same SQL gets the same answer wherever SQL is answered:
``ledger query`` (``Reader.sql``), ``<ledger>/views.sql`` written by ``ledger views`` (a DuckDB
attaching the lake itself), the published copy's ``views.sql`` run by a plain DuckDB in DEST, and
``ledger query --remote`` over 127.0.0.1. The ledger holds what makes the names differ: one run
recorded twice (two producers, one run id: a duplicate launch), a crash and a retry from an earlier
checkpoint (superseded steps), per-layer router stats, a config change and a table with no rows."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import duck
from runledger.ledger.publish import publish
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import payloads as p
from runledger.schemas.note import write_keypair
from tests.merkle.test_remote_direct import serving as serving_ranges
from tests.merkle.test_remote_doors import serving
from tests.support.factory import RunBuilder

ENV = {"COLUMNS": "300", "RUNLEDGER_PROGRESS_S": "off"}
LAYERS = 3

# Counts and averages over every kind of name: de-duplicated views, the stored rows, derived views.
QUERIES = [
    "SELECT count(*), round(avg(value), 9) FROM metrics WHERE name = 'loss'",
    "SELECT run_id, count(*), round(sum(value), 9) FROM metrics GROUP BY run_id ORDER BY run_id",
    "SELECT count(*) FROM metrics_recorded",
    "SELECT count(*) FROM metrics_all WHERE superseded",
    "SELECT count(*) FROM _metrics",
    "SELECT count(*) FROM lake.metrics",
    "SELECT count(*), round(avg(token_drop_rate), 9) FROM moe_layer_stats",
    "SELECT layer, count(*), sum(dropped) FROM moe_layer_stats GROUP BY layer ORDER BY layer",
    "SELECT count(*) FROM moe_layer_stats_all",
    "SELECT count(*) FROM lake.moe_layer_stats",
    "SELECT type, count(*) FROM events GROUP BY type ORDER BY type",
    "SELECT run_id, count(*) FROM config_changes GROUP BY run_id ORDER BY run_id",
    "SELECT run_id, attempts, last_step, crashes FROM runs ORDER BY run_id",
    "SELECT run_id, attempt, count(*) FROM launches GROUP BY ALL ORDER BY ALL",
    "SELECT run_id, attempt, start_step FROM attempts ORDER BY ALL",
    "SELECT count(*) FROM annotations",
]


@dataclass
class Producer(RunBuilder):
    """A trainer process of its own: a second one claiming the same run id records the run twice."""

    def train(self, first: int, last: int) -> None:
        """Steps ``first``..``last``, each with its loss and every layer's router stats."""
        for step in range(first, last + 1):
            self.step(step, loss=1.0 / step + self.attempt / 1000)
            layers = [
                p.MoeLayerStats(
                    layer=layer,
                    tokens=512,
                    top_k=2,
                    dropped=(step * (layer + 1)) % 7,
                    token_drop_rate=((step * (layer + 1)) % 7) / 1024,
                )
                for layer in range(LAYERS)
            ]
            self._emit(p.MoeRouterStats(layers=layers), step)


def _commit(ledger: Ledger, spool: str, events: list[bytes]) -> None:
    ledger.commit([SourceRecord(f"spool:{spool}", i, raw) for i, raw in enumerate(events)])


@dataclass(frozen=True)
class Published:
    root: Path
    dest: Path
    log_key: str


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    """A lake (the default ledger) with a retried run and a run recorded twice, published to DEST."""
    tmp = tmp_path_factory.mktemp("one-meaning")
    ledger = Ledger.create(tmp / "ledger", ledger_id="one-meaning")
    retried = Producer(run_id="retried")
    retried.start()
    retried.train(1, 6)
    retried.change(3, "lr", 0.002)
    retried.checkpoint(4)
    retried.train(7, 9)
    retried.crash(9)
    retried.resume(4)  # steps 5..9 of attempt 1 are superseded by attempt 2's
    retried.train(5, 12)
    _commit(ledger, "retried", retried.events)
    for n, source in enumerate(["trainer/twin/host-a", "trainer/twin/host-b"]):
        twin = Producer(run_id="twin", source=source)
        twin.start()
        twin.train(1, 8)
        _commit(ledger, f"twin-{n}", twin.events)
    private, public = write_keypair(tmp / "keys", "runledger/one-meaning")
    publish(ledger.root, tmp / "site", private.read_text().strip())
    return Published(ledger.root, tmp / "site", public.read_text().strip())


def _answers(rows: list[Any]) -> list[str]:
    return [json.dumps(list(row), default=str) for row in rows]


def _by_reader(root: Path) -> list[list[str]]:
    reader = Reader(root)
    return [_answers(reader.sql(sql).rows) for sql in QUERIES]


def _by_duckdb_in(folder: Path, con: duckdb.DuckDBPyConnection) -> list[list[str]]:
    """What ``cd FOLDER && duckdb -init views.sql`` answers (relative paths resolve against the cwd)."""
    with contextlib.chdir(folder):
        con.execute((folder / "views.sql").read_text())
        answers = [_answers(con.execute(sql).fetchall()) for sql in QUERIES]
    con.close()
    return answers


def _by_query_remote(site: Published, url: str, cache: Path, *more: str) -> list[list[str]]:
    answers = []
    for sql in QUERIES:
        args = [
            "query",
            "--remote",
            url,
            "--log-key",
            site.log_key,
            "--cache",
            str(cache),
            *more,
            "-f",
            "json",
            sql,
        ]
        result = CliRunner().invoke(app, args, env=ENV)
        assert result.exit_code == 0, result.output
        answers.append(_answers([list(row.values()) for row in json.loads(result.stdout)]))
    return answers


def test_de_duplication_matters_here(published: Published) -> None:
    """The ledger is one where the stored rows and the de-duplicated views differ."""
    reader = Reader(published.root)
    recorded, once = (reader.sql(f"SELECT count(*) FROM {v}").rows[0][0] for v in ["_metrics", "metrics"])
    superseded = reader.sql("SELECT count(*) FROM moe_layer_stats_all WHERE superseded").rows[0][0]
    stored_stats = reader.sql("SELECT count(*) FROM _moe_layer_stats").rows[0][0]
    assert recorded > once > 0 and superseded == 5 * LAYERS
    assert stored_stats - superseded == reader.sql("SELECT count(*) FROM moe_layer_stats").rows[0][0]
    assert reader.sql("SELECT count(*) FROM launches WHERE run_id = 'twin'").rows == [(2,)]


def test_every_place_that_answers_sql_gives_the_same_answer(published: Published, tmp_path: Path) -> None:
    by_reader = _by_reader(published.root)
    assert CliRunner().invoke(app, ["views", "--ledger", str(published.root)], env=ENV).exit_code == 0
    # (the extensions a user INSTALLs once; here loaded from their wheels, offline)
    lake_shell = duck.connect(extensions=["ducklake", "sqlite_scanner"])
    by_views_sql = _by_duckdb_in(published.root, lake_shell)
    by_published = _by_duckdb_in(published.dest, duckdb.connect())
    with serving(published.dest) as (url, _):
        by_remote = _by_query_remote(published, url, tmp_path / "cache")
    for n, sql in enumerate(QUERIES):
        assert by_views_sql[n] == by_reader[n], f"ledger views' views.sql: {sql}"
        assert by_published[n] == by_reader[n], f"published views.sql: {sql}"
        assert by_remote[n] == by_reader[n], f"query --remote: {sql}"


def test_query_remote_direct_gives_the_same_answer(published: Published, tmp_path: Path) -> None:
    """``ledger query --remote --direct``: DuckDB reads the published files by URL (a server that
    answers Range requests: nginx, scripts/http.sh), through the same names."""
    by_reader = _by_reader(published.root)
    with serving_ranges(tmp_path / "nginx", published.dest) as server:
        by_direct = _by_query_remote(published, server.url, tmp_path / "cache", "--direct")
    for n, sql in enumerate(QUERIES):
        assert by_direct[n] == by_reader[n], f"query --remote --direct: {sql}"
