"""``StatementTimer``: one thread bounds every statement of a connection (issue 41: a thread per
statement was ~0.4 ms of each one-shot read). A statement past its timeout is stopped in one line;
one that ends in time is never cut short, nor is the statement after a stopped one; ``close`` ends
the thread."""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import duckdb
import pytest

from runledger.ledger.sql_guard import StatementStopped, StatementTimer, run_limited

ENDLESS = "SELECT count(*) FROM range(1000000000000) a"  # minutes of work, no memory


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[Any]:
    return con.execute(sql).fetchall()


def _timer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "statement-timer"]


def test_a_statement_past_its_timeout_stops_and_the_next_runs_whole() -> None:
    con = duckdb.connect()
    timer = StatementTimer(con)
    with pytest.raises(StatementStopped, match=r"^query stopped after 0.3 s \(--timeout\)$"):
        timer.run(0.3, lambda: con.execute(ENDLESS).fetchall())
    # The same timer, a statement that takes its time but ends within its bound: not hit.
    assert timer.run(30, lambda: con.execute("SELECT count(*) FROM range(20000000)").fetchall()) == [
        (20_000_000,)
    ]
    timer.close()
    con.close()


def test_many_statements_share_one_thread_and_close_ends_it() -> None:
    con = duckdb.connect()
    before = len(_timer_threads())
    timer = StatementTimer(con)
    # Short timeouts that each statement beats: none is interrupted, and one thread served them all.
    for i in range(200):
        assert timer.run(5, lambda i=i: con.execute("SELECT ?", [i]).fetchall()) == [(i,)]
    assert len(_timer_threads()) == before + 1
    timer.close()
    assert len(_timer_threads()) == before
    with pytest.raises(RuntimeError, match="closed"):
        timer.run(5, lambda: con.execute("SELECT 1").fetchall())
    assert timer.run(None, lambda: con.execute("SELECT 1").fetchall()) == [(1,)]  # no bound: no timer
    con.close()


def test_an_error_or_an_interrupt_not_the_timers_passes_through() -> None:
    con = duckdb.connect()
    timer = StatementTimer(con)
    with pytest.raises(duckdb.CatalogException):
        timer.run(5, lambda: con.execute("SELECT * FROM no_such_table").fetchall())

    def interrupted_by_someone_else() -> None:
        threading.Timer(0.3, con.interrupt).start()
        con.execute(ENDLESS).fetchall()

    with pytest.raises(duckdb.InterruptException):  # not StatementStopped: the timer did not fire
        timer.run(60, interrupted_by_someone_else)
    assert timer.run(5, lambda: con.execute("SELECT 2").fetchall()) == [(2,)]
    timer.close()
    con.close()


def test_run_limited_is_one_statements_timer() -> None:
    con = duckdb.connect()
    before = len(_timer_threads())
    with pytest.raises(StatementStopped):
        run_limited(con, 0.3, lambda: con.execute(ENDLESS).fetchall())
    assert run_limited(con, 5, lambda: con.execute("SELECT 3").fetchall()) == [(3,)]
    assert len(_timer_threads()) == before  # each call's thread ended with it
    con.close()


def test_a_timer_dropped_without_close_lets_its_connection_and_thread_go() -> None:
    """A reader dropped without ``close`` (``Reader(root).sql(...)`` in one line) leaks neither its
    connection nor the timer's thread: the thread holds the connection only while a statement runs."""
    import gc
    import time
    import weakref

    before = len(_timer_threads())
    con = duckdb.connect()
    timer = StatementTimer(con)
    assert timer.run(5, functools.partial(_rows, con, "SELECT 4")) == [(4,)]
    assert len(_timer_threads()) == before + 1
    gone = weakref.ref(con)
    del con, timer
    gc.collect()
    assert gone() is None  # the connection was not kept by the idle thread
    for _ in range(200):  # bounded: the thread ends on the timer's collection
        if len(_timer_threads()) == before:
            break
        time.sleep(0.01)
    assert len(_timer_threads()) == before


def test_a_command_that_leaves_its_reader_open_exits_cleanly(tmp_path: Path) -> None:
    """``ledger runs`` leaves its reader to the interpreter's exit: the timer's thread must not wake
    while the interpreter finalizes (it aborted the process: exit -6, "terminate called without an
    active exception", 2 runs in 3 before ``_stop_every_watch``)."""
    from runledger.ledger.store import Ledger, SourceRecord
    from runledger.schemas import encode_event
    from tests.support.kafka_clients import workload

    events = workload(8, 60, config_every=20, moe_every=20)
    ledger = Ledger.create(tmp_path / "ledger")
    ledger.commit([SourceRecord("spool:x", i, encode_event(e)) for i, e in enumerate(events)])
    ledger.close()
    command = [
        sys.executable,
        "-m",
        "runledger.cli.main",
        "runs",
        "--ledger",
        str(ledger.root),
        "--format",
        "csv",
    ]
    for _ in range(5):
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr[-500:]
        assert done.stdout.count("\nrun-") == 8
