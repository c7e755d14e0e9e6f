"""Benchmark `ledger query` output: a table of every row beside CSV and beside the rich Table the CLI
drew before (issue 15: 2,930 rows took 5.5 s as a table, 0.85 s as CSV), measured in the same run.

Run from the repository root::

    .venv/bin/python -m bench.bench_cli_table              # 3,000 rows of metrics_all
    .venv/bin/python -m bench.bench_cli_table --steps 7500 # 30,000 rows

The rows come from a real ledger (a synthetic run, four metrics a step) through ``Reader.sql``;
each renderer writes into memory at a fixed width of 200 columns, best of ``--repeat`` runs:

* csv: ``print_rows(..., Format.csv)``;
* table, every row: ``print_rows(..., Format.table, limit=0)`` (cut to the width);
* table, default: the first 40 rows and the total, what a terminal gets without ``--limit``;
* baseline: a ``rich.table.Table`` of every row printed by a rich Console (the old renderer).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from runledger.cli.output import Format, print_rows
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from tests.support.factory import RunBuilder


def build(root: Path, steps: int) -> Reader:
    run = RunBuilder()
    run.start()
    for s in range(1, steps + 1):
        run.step(s, loss=5 - s * 1e-4)
    Ledger.create(root).commit([SourceRecord("spool:bench", i, raw) for i, raw in enumerate(run.events)])
    return Reader(root)


def best_of(repeat: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=750, help="training steps (4 metric rows each)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ["COLUMNS"] = "200"
    with tempfile.TemporaryDirectory(prefix="bench-cli-table-") as tmp:
        reader = build(Path(tmp) / "ledger", args.steps)
        t = time.perf_counter()
        result = reader.sql("SELECT * FROM metrics_all ORDER BY step, name")
        query_s = time.perf_counter() - t
    columns, rows = result.columns, result.rows

    def ours(fmt: Format, limit: int | None) -> Callable[[], None]:
        def run() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                print_rows(columns, rows, fmt, None, limit=limit)

        return run

    def rich_table() -> None:
        table = Table()
        for c in columns:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*("" if v is None else str(v) for v in r))
        Console(file=io.StringIO(), width=200).print(table)

    print(f"{len(rows):,} rows x {len(columns)} columns (query {query_s * 1000:.0f} ms, not counted below)")
    figures = [
        ("csv", best_of(args.repeat, ours(Format.csv, None))),
        ("table, every row (--limit 0)", best_of(args.repeat, ours(Format.table, 0))),
        ("table, default (40 rows + total)", best_of(args.repeat, ours(Format.table, None))),
        ("baseline: rich Table, every row", best_of(max(1, args.repeat // 3), rich_table)),
    ]
    csv_s = figures[0][1]
    for name, seconds in figures:
        print(f"{name:<36} {seconds * 1000:9.1f} ms   {seconds / csv_s:6.2f}x csv")


if __name__ == "__main__":
    main()
