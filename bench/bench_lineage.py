"""Lineage across run ids (issue 44) at a lab's size: how a run's line costs as the runs grow.

A table of launches like a lab's: ``--runs`` runs in chains of ``--chain`` relaunches (each run
forked from the one before it at a step), in an in-memory DuckDB with the ledger's own view
definitions (``runledger.ledger.views.DERIVED_VIEWS``, from the lineage views on). It times the
line of one run in the middle of a chain as ``Reader.lineage`` asks it (``lineage_of``: only the
run's family is walked), the same rows from the ``lineage`` view, and the whole view, each beside
one grouped scan of the same launches measured in the same run (a ratio: the machine's load cancels).

    .venv/bin/python -m bench.bench_lineage                  # 20,000 runs in chains of 50
    .venv/bin/python -m bench.bench_lineage --runs 2000 --chain 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import duckdb

from runledger.ledger.views import DERIVED_VIEWS

LINEAGE_START = "-- Lineage across run ids"  # the first of the lineage views in DERIVED_VIEWS


def lab(runs: int, chain: int) -> duckdb.DuckDBPyConnection:
    """A connection holding ``runs`` launches in chains of ``chain``, and the lineage views over them."""
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE launches (run_id VARCHAR, attempt INT, time BIGINT, parent_run VARCHAR, "
        "fork_step BIGINT, stream_seq BIGINT)"
    )
    rows = [
        (f"r{i}", 1, i, f"r{i - 1}" if i % chain else None, 10 * (i % chain) if i % chain else None, i)
        for i in range(runs)
    ]
    con.executemany("INSERT INTO launches VALUES (?, ?, ?, ?, ?, ?)", rows)
    # (lineage_metrics reads `metrics`: one row stands in for it; its cost is not measured here)
    con.execute(
        "CREATE TABLE metrics AS SELECT 'r0' AS run_id, 1 AS attempt, 1 AS step, 1 AS time, "
        "'loss' AS name, 1.0 AS value, 'r0' AS stream, 1 AS stream_seq"
    )
    con.execute(DERIVED_VIEWS[DERIVED_VIEWS.index(LINEAGE_START) :])
    return con


def median_ms(con: duckdb.DuckDBPyConnection, query: str, rounds: int) -> float:
    times_s = []
    for _ in range(rounds):
        start = time.perf_counter()
        con.execute(query).fetchall()
        times_s.append(time.perf_counter() - start)
    return statistics.median(times_s) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--chain", type=int, default=50, help="relaunches per chain")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.runs < 1 or args.chain < 1 or args.rounds < 1:
        parser.error("--runs, --chain and --rounds must be at least 1")
    con = lab(args.runs, args.chain)
    middle = f"r{min(args.runs - 1, args.chain // 2)}"
    # The baseline: one grouped scan of the launches, as every lineage question starts with.
    base_ms = median_ms(
        con, "SELECT run_id, min(time), arg_min(parent_run, attempt) FROM launches GROUP BY 1", args.rounds
    )
    print(
        f"{args.runs:,} runs in chains of {args.chain}; baseline (grouped scan of launches): {base_ms:.1f} ms"
    )
    for what, query in (
        ("line of one run (lineage_of, as Reader.lineage)", f"SELECT * FROM lineage_of('{middle}')"),
        ("line of one run (the lineage view, filtered)", f"SELECT * FROM lineage WHERE run_id = '{middle}'"),
        ("every run's lineage (the whole view)", "SELECT count(*) FROM lineage"),
    ):
        took_ms = median_ms(con, query, args.rounds)
        print(f"  {what}: {took_ms:.1f} ms ({took_ms / base_ms:.1f}x the baseline)")


if __name__ == "__main__":
    main()
