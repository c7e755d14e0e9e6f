"""Benchmark the locked query connection (issue 25) beside the unlocked one it replaced.

``Reader`` now turns DuckDB's external access off (only the ledger's table folders allowed), turns
extension loading off and locks the configuration once its views are defined
(``ledger.sql_guard.lock_connection``), and checks each statement (an ``EXPLAIN``'s inner one too).
Measured in the same run, on one synthetic ledger (four metric rows a step), best of ``--repeat``
(before and after by turns):

* open: ``connect(root)`` (the views) alone, and followed by the lock;
* each query on both connections: a point lookup, an aggregate over every metric row, the
  ``state`` fold's read of a run's events;
* the statement check alone (``read_only_statement``), per statement.

Run from the repository root::

    .venv/bin/python -m bench.bench_query_lock                  # 20,000 steps: 80,000 metric rows
    .venv/bin/python -m bench.bench_query_lock --steps 100000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb

from ledger.parquet_schemas import tables_of
from ledger.sql_guard import lock_connection, read_only_statement
from ledger.store import Ledger, SourceRecord
from ledger.views import connect
from tests.support.factory import RunBuilder

QUERIES = {
    "point lookup": "SELECT value FROM metrics WHERE run_id = 'run-a' AND name = 'loss' AND step = 777",
    "aggregate": "SELECT name, avg(value), count(*) FROM metrics GROUP BY name ORDER BY name",
    "run's events": "SELECT canonical FROM events WHERE stream = 'run-a' ORDER BY stream_seq LIMIT 1000",
}


def build(root: Path, steps: int) -> None:
    run = RunBuilder()
    run.start()
    for s in range(1, steps + 1):
        run.step(s, loss=5 - s * 1e-5)
    ledger = Ledger.create(root)
    ledger.commit([SourceRecord("spool:bench", i, raw) for i, raw in enumerate(run.events)])


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def paired(repeat: int, before: Callable[[], object], after: Callable[[], object]) -> tuple[float, float]:
    """Best of each, the two run by turns (a shared machine's load falls on both alike)."""
    pairs = [(best_of(1, before), best_of(1, after)) for _ in range(repeat)]
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def locked(root: Path) -> duckdb.DuckDBPyConnection:
    con = connect(root)
    lock_connection(con, [root / name for name in tables_of(root)])
    return con


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-query-lock-") as tmp:
        root = Path(tmp) / "ledger"
        build(root, args.steps)
        print(f"ledger: {args.steps:,} steps, {4 * args.steps:,} metric rows; best of {args.repeat}")
        print(f"{'':<22}{'unlocked (before)':>20}{'locked (now)':>16}")
        before, after = paired(args.repeat, lambda: connect(root), lambda: locked(root))
        print(f"{'open (views [+ lock])':<22}{before * 1e3:>17.2f} ms{after * 1e3:>13.2f} ms")
        plain, guarded = connect(root), locked(root)
        for label, sql in QUERIES.items():
            before, after = paired(
                args.repeat,
                lambda sql=sql: plain.execute(sql).fetchall(),
                lambda sql=sql: guarded.execute(read_only_statement(guarded, sql)).fetchall(),
            )
            print(f"{label:<22}{before * 1e3:>17.2f} ms{after * 1e3:>13.2f} ms")
        checks = 1000
        check = best_of(
            args.repeat, lambda: [read_only_statement(guarded, QUERIES["aggregate"]) for _ in range(checks)]
        )
        explain = "EXPLAIN ANALYZE " + QUERIES["aggregate"]
        nested = best_of(args.repeat, lambda: [read_only_statement(guarded, explain) for _ in range(checks)])
        print(
            f"statement check: {check / checks * 1e6:.0f} µs a SELECT, {nested / checks * 1e6:.0f} µs an EXPLAIN ANALYZE"
        )


if __name__ == "__main__":
    main()
