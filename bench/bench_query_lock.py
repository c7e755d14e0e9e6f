"""Benchmark the locked query connection (issue 25) beside the unlocked one it replaced.

``Reader`` now turns DuckDB's external access off (only the ledger's table folders allowed), turns
extension loading off and locks the configuration once its views are defined
(``runledger.ledger.sql_guard.lock_connection``), and checks each statement (an ``EXPLAIN``'s inner one too).
Measured in the same run, on one synthetic ledger (four metric rows a step), best of ``--repeat``
(before and after by turns):

* open: ``connect(root)`` (the views) alone, and followed by the lock;
* each query on both connections: a point lookup, an aggregate over every metric row, the
  ``state`` fold's read of a run's events;
* the statement check alone (``read_only_statement``), per statement;
* (issue 40) the check over DuckDB's parse tree (``json_serialize_sql``) beside the regular
  expressions it replaced (issue 25's check, kept below as ``regex_statement``: the baseline), for a
  statement seen before (its tree cached) and for a new text each time; and the limits' cost per
  statement (``run_limited``'s timer, and emptying the spill folder) on a trivial statement.

Run from the repository root::

    .venv/bin/python -m bench.bench_query_lock                  # 20,000 steps: 80,000 metric rows
    .venv/bin/python -m bench.bench_query_lock --steps 100000
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import duckdb

from runledger.ledger.parquet_schemas import tables_of
from runledger.ledger.sql_guard import (
    RefusedStatement,
    SpillFolder,
    lock_connection,
    read_only_statement,
    run_limited,
)
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.views import connect
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


# ------------------------------------------------ issue 25's check over the text: the baseline of issue 40

_OLD_PIVOT = re.compile(r"(PIVOT|PIVOT_WIDER)\b", re.IGNORECASE)
_OLD_EXPLAIN = re.compile(r"EXPLAIN\b(\s+ANALY[SZ]E\b)?\s*", re.IGNORECASE)
_OLD_ACTING = (
    "enable_logging|disable_logging|truncate_duckdb_logs|enable_profiling|disable_profiling|checkpoint|"
    "force_checkpoint|query|json_execute_serialized_sql"
)
_OLD_ACTING_CALL = re.compile(r'(?<![\w$])"?(' + _OLD_ACTING + r')"?\s*\(', re.IGNORECASE)
_OLD_FOREIGN_CALL = re.compile(r'(?<![\w$])"?((?:sqlite|postgres|ducklake)_\w*)"?\s*\(', re.IGNORECASE)


def regex_statement(con: duckdb.DuckDBPyConnection, text: str) -> str:
    """Issue 25's ``read_only_statement``: refusals by regular expression over the text (defeated by
    ``name/**/(``), then the statement types (an EXPLAIN's inner statement found by a regex too)."""
    acting = _OLD_ACTING_CALL.search(text) or _OLD_FOREIGN_CALL.search(text)
    if acting is not None:
        raise RefusedStatement(f"refused: ({acting.group(1)}() is not allowed)")
    statements = list(con.extract_statements(text))
    if not statements:
        raise RefusedStatement("empty query")
    for st in statements:
        _regex_check(con, st, 0)
    if len(statements) > 1:
        raise RefusedStatement("several statements")
    return str(statements[0].query)


def _regex_check(con: duckdb.DuckDBPyConnection, st: duckdb.Statement, depth: int) -> None:
    kind, query = st.type.name, str(st.query)
    if kind == "SELECT" or (kind == "MULTI" and _OLD_PIVOT.match(query.lstrip())):
        return
    if kind == "EXPLAIN" and depth < 4:
        found = _OLD_EXPLAIN.match(query.lstrip())
        parts = list(con.extract_statements(query.lstrip()[found.end() :])) if found else []
        if len(parts) == 1:
            _regex_check(con, parts[0], depth + 1)
            return
    raise RefusedStatement(f"refused: {kind}")


def per_call_us(repeat: int, calls: int, fn: Callable[[int], object]) -> float:
    """Best of ``repeat`` runs of ``calls`` calls of ``fn(i)``, per call, in µs."""
    return best_of(repeat, lambda: [fn(i) for i in range(calls)]) / calls * 1e6


def check_costs(con: duckdb.DuckDBPyConnection, sql: str, repeat: int, calls: int) -> tuple[float, ...]:
    """µs per check of ``sql``: regex and parser on the same text again and again, then on a new
    text each time (a numbered comment: DuckDB parses and serializes each)."""

    def old(i: int) -> str:
        return regex_statement(con, sql)

    def now(i: int) -> str:
        return read_only_statement(con, sql)

    def old_new_text(i: int) -> str:
        return regex_statement(con, f"{sql} -- {i}")

    def now_new_text(i: int) -> str:
        return read_only_statement(con, f"{sql} -- {time.perf_counter_ns()} {i}")

    return (
        per_call_us(repeat, calls, old),
        per_call_us(repeat, calls, now),
        per_call_us(1, calls, old_new_text),
        per_call_us(1, calls, now_new_text),
    )


def checks_and_limits(guarded: duckdb.DuckDBPyConnection, repeat: int, spill_area: Path) -> None:
    """Issue 40: the parser's check beside the regex baseline, and the limits' cost per statement."""
    calls = 1000
    print(f"\n{'statement check (per statement)':<40}{'regex (before)':>16}{'parser (now)':>14}")
    for label, sql in (
        ("aggregate", QUERIES["aggregate"]),
        ("EXPLAIN ANALYZE aggregate", "EXPLAIN ANALYZE " + QUERIES["aggregate"]),
    ):
        old, seen, old_fresh, fresh = check_costs(guarded, sql, repeat, calls)
        print(f"{label + ', seen before':<40}{old:>13.0f} µs{seen:>11.0f} µs")
        print(f"{label + ', new text':<40}{old_fresh:>13.0f} µs{fresh:>11.0f} µs")
    spill = SpillFolder.under(spill_area)
    trivial = "SELECT 42"

    def limited(_: int) -> object:
        try:
            return run_limited(guarded, 300.0, lambda: guarded.execute(trivial).fetchall())
        finally:
            spill.clear()

    bare = per_call_us(repeat, calls, lambda i: guarded.execute(trivial).fetchall())
    timed = per_call_us(
        repeat, calls, lambda i: run_limited(guarded, 300.0, lambda: guarded.execute(trivial).fetchall())
    )
    full = per_call_us(repeat, calls, limited)
    print(
        f"limits on `{trivial}`: {bare:.0f} µs bare, {timed:.0f} µs with the timer "
        f"(+{timed - bare:.0f}), {full:.0f} µs with the timer and the spill folder emptied (+{full - bare:.0f})"
    )


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
        checks_and_limits(guarded, args.repeat, Path(tmp) / "spill")


if __name__ == "__main__":
    main()
