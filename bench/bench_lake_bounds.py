"""What keeping a lake's column bounds right costs (``runledger.ledger.lake_stats``).

A lab of N runs (``bench.bench_many_runs``'s, 50 runs a commit) in one lake; then, each the best of
``--repeats``:

1. the whole check of every ledger table's bounds (``wrong_bounds``: what a writer runs once per
   lake, and ``ledger compact`` before and after its merge) beside a writer's open of the lake
   (``LakeTables``, which now also reads whether the lake was checked);
2. commit: one more commit of one run (a ledger commit: files, transaction, records) beside the
   pre-commit question it adds (``tables_at_risk``) alone, asked on the open writer.

    .venv/bin/python -m bench.bench_lake_bounds                  # 200 and 2,000 runs
    .venv/bin/python -m bench.bench_lake_bounds --runs 200
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.bench_many_runs import best_of, ingest, lab_run
from runledger.ledger.lake import ALIAS, LakeFolder, LakeTables
from runledger.ledger.lake_stats import tables_at_risk, wrong_bounds
from runledger.ledger.store import Ledger, SourceRecord


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def measure(runs: int, repeats: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-lake-bounds-"))
    try:
        root = tmp / "lab"
        figures: dict[str, Any] = {"runs": runs, **ingest(root, runs, 50)}
        folder = LakeFolder.read(root)
        assert folder is not None

        def open_with(create: bool) -> None:
            LakeTables(folder.catalog, folder.data_path, new_catalog=False, create=create).close()

        figures["writer_open_ms"] = _ms(best_of(repeats, lambda: open_with(True)))
        with LakeTables(folder.catalog, folder.data_path, new_catalog=False, create=False) as lake:
            figures["live_files"] = lake.con.execute(
                f"SELECT count(*) FROM __ducklake_metadata_{ALIAS}.ducklake_data_file WHERE end_snapshot IS NULL"
            ).fetchone()[0]  # type: ignore[index]
            figures["whole_check_ms"] = _ms(best_of(repeats, lambda: wrong_bounds(lake.con, ALIAS)))

        import random

        rng = random.Random(7)
        position = [figures["events"]]
        extra = [lab_run(runs + i, runs + repeats, rng, []) for i in range(repeats)]
        ledger = Ledger.open(root)
        at_risk_s: list[float] = []
        try:

            def one_commit() -> None:
                batch = extra.pop()
                ledger.commit(
                    [SourceRecord("spool:lab", position[0] + i, raw) for i, raw in enumerate(batch)]
                )
                position[0] += len(batch)

            figures["commit_ms"] = _ms(best_of(repeats, one_commit))
            lake = ledger.lake
            assert lake is not None
            tables = {
                name: lake.con.execute(f"SELECT * FROM {ALIAS}.{name} LIMIT 100").to_arrow_table()
                for name in ("metrics", "events")
            }
            at_risk_s.append(best_of(repeats, lambda: tables_at_risk(lake.con, ALIAS, tables)))
        finally:
            ledger.close()
        figures["at_risk_question_ms"] = _ms(at_risk_s[0])
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="200,2000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = [measure(int(n), args.repeats) for n in args.runs.split(",") if n]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
