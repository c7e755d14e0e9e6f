"""scripts/postgres.sh: the server it starts answers on loopback, and its mistakes are one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import duckdb
import pytest

from runledger.ledger.duck import connect
from tests.lake.support import PG_SCRIPT, Postgres


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(PG_SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_env_without_a_cluster_says_so_in_one_line(tmp_path: Path) -> None:
    out = _script("env", str(tmp_path))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"postgres.sh: error: no cluster started in {tmp_path} (run: scripts/postgres.sh start {tmp_path})"
    ]


def test_an_unknown_command_is_refused(tmp_path: Path) -> None:
    out = _script("begin", str(tmp_path))
    assert out.returncode == 1 and out.stderr.strip() == "postgres.sh: error: unknown command: begin"


def test_the_server_answers_on_loopback_and_its_dsn_works(postgres: Postgres | str) -> None:
    if isinstance(postgres, str):
        pytest.skip(postgres)
    assert _script("status", str(postgres.folder)).returncode == 0
    env = _script("env", str(postgres.folder)).stdout.strip()
    assert env == f"PG_DSN='{postgres.dsn}'" and "host=127.0.0.1" in env
    con = connect(extensions=["postgres_scanner"])
    con.execute(f"ATTACH '{postgres.dsn}' AS pg (TYPE postgres, READ_ONLY)")
    (answer,) = con.execute("SELECT * FROM postgres_query('pg', 'SELECT 6 * 7')").fetchone() or (None,)
    assert answer == 42
    with pytest.raises(duckdb.Error):  # read-only really is
        con.execute("CREATE TABLE pg.t (a INT)")
