"""Many runs (issue 44): a simulated lab of N runs in one lake ledger, figures from one run.

The lab: most runs short (a launch, ~10 steps of loss with an eval loss every 5, an end), one in 500
long (1,000 steps), one in 10 crashed and relaunched from a checkpoint (a second attempt), one in
20 forked from an earlier run at a step (``parent_run``/``fork_step``), one in 20 with a tagged
note; ``moe.capacity_factor`` one of 1.0/1.25/1.5, start times spread over a year. Events are made
with the schema library (``make_event``) and committed ``--runs-per-commit`` runs at a time, as an
ingester would take a bus's batches.

For each size it reports:

1. ingest: events, commits, seconds;
2. files: the lake's data files (the catalog's live files, and the files in ``data/``) after ingest
   and after ``ledger compact``, and the partitions they sit in: a table is partitioned by run id,
   so the count grows with runs × tables whatever compaction merges;
3. ``ledger runs`` with three filters (config, since, status) and with a metric's best, through
   the command (CliRunner, a fresh reader each time), and the same statement on an open reader;
4. the cross-run question over ``run_summary`` ("best eval loss of every run with
   moe.capacity_factor = 1.25 since June");

each query beside the same SQL, under the same view definitions, over two baselines holding the same
rows: plain in-memory DuckDB tables (no files at all) and one Parquet file per table (a layout whose
file count does not grow with runs), as ratios, so the machine's load cancels out.

    .venv/bin/python -m bench.bench_many_runs                      # 2,000 and 20,000 runs
    .venv/bin/python -m bench.bench_many_runs --runs 2000          # a quick run
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import duckdb
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader
from runledger.ledger.run_search import RunFilter, parse_config_test, search_statement
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.views import DERIVED_VIEWS, stored_name
from runledger.schemas import config_hash, encode_event, make_event
from runledger.schemas import payloads as p

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FACTORS = (1.0, 1.25, 1.5)
# The tables the lab's runs fill; the baseline copies their rows (the rest are empty there too).
FILLED = ("launches", "configs", "metrics", "run_ends", "incidents", "annotations", "checkpoints")
SUMMARY_QUESTION = (
    "SELECT run_id, best_eval_loss FROM run_summary WHERE json_extract(config, '$.moe.capacity_factor') = '1.25' "
    "AND started_at >= '2026-06-01' ORDER BY best_eval_loss LIMIT 20"
)
RUNS_FILTERS = ["--config", "moe.capacity_factor=1.25", "--since", "2026-06-01", "--status", "finished"]


# -- the lab ---------------------------------------------------------------------------------------


class _Emitter:
    """One run's events in order, as its trainer would send them."""

    def __init__(self, run_id: str, start: datetime) -> None:
        self.run_id, self.start, self.seq, self.attempt = run_id, start, 0, 1
        self.events: list[bytes] = []

    def emit(self, payload: Any, step: int | None) -> None:
        env = make_event(
            payload,
            source=f"trainer/{self.run_id}/rank0",
            stream=self.run_id,
            run_id=self.run_id,
            attempt=self.attempt,
            step=step,
            seq=self.seq,
            id=f"{self.run_id}-{self.seq}",
            time=self.start + timedelta(seconds=self.seq * 10),
        )
        self.seq += 1
        self.events.append(encode_event(env))


def _config(rng: random.Random) -> dict[str, Any]:
    return {
        "lr": rng.choice((1e-4, 3e-4, 1e-3)),
        "moe": {"capacity_factor": rng.choice(FACTORS)},
        "seed": rng.randrange(1000),
    }


def _launch(run: _Emitter, config: dict[str, Any], parent: str | None, fork_step: int | None) -> None:
    run.emit(
        p.RunStarted(
            config=config,
            config_hash=config_hash(config),
            host="node-0",
            git_commit="a" * 40,
            git_dirty=False,
            name=f"sweep-{run.run_id}",
            parent_run=parent,
            fork_step=fork_step,
        ),
        fork_step or 0,
    )


def _train(run: _Emitter, steps: range, loss0: float) -> None:
    for s in steps:
        scalars: dict[str, float | None] = {"eval/loss": loss0 / (1 + s / 100) + 0.1} if s % 5 == 0 else {}
        run.emit(p.StepMetrics(loss=loss0 / (1 + s / 100), lr=1e-3, scalars=scalars), s)


def lab_run(index: int, runs: int, rng: random.Random, earlier: list[str]) -> list[bytes]:
    """Run ``index`` of ``runs``: short, long, relaunched, forked or noted, by the mix above; the
    runs' starts spread evenly over 2026."""
    run = _Emitter(f"r{index:06d}", T0 + timedelta(days=365 * index / runs))
    forked = index % 20 == 7 and bool(earlier)
    parent = rng.choice(earlier) if forked else None
    first = 5 if forked else 1
    _launch(run, _config(rng), parent, first - 1 if forked else None)
    steps = 1000 if index % 500 == 250 else 10
    loss0 = rng.uniform(3.0, 9.0)
    if index % 10 == 3:  # crashed, relaunched from its checkpoint at step 5
        _train(run, range(first, first + 8), loss0)
        run.emit(p.CheckpointSaved(path=f"/ckpt/{run.run_id}/5"), first + 4)
        run.emit(
            p.RunCrashed(kind="exception", exc_type="RuntimeError", message="boom", last_step=first + 7),
            first + 7,
        )
        run.attempt = 2
        cfg = _config(rng)
        run.emit(
            p.RunResumed(
                config=cfg,
                config_hash=config_hash(cfg),
                host="node-1",
                git_commit="b" * 40,
                git_dirty=False,
                from_checkpoint_step=first + 4,
                previous_attempt=1,
            ),
            first + 4,
        )
        _train(run, range(first + 5, first + steps), loss0)
    else:
        _train(run, range(first, first + steps), loss0)
    if index % 20 == 11:
        run.emit(p.Annotation(author="ada", text="worth a look", tags=["sweep", "look"]), first)
    if index % 7 != 5:  # the rest are still running
        run.emit(p.RunFinished(status="completed", final_step=first + steps - 1), first + steps - 1)
    return run.events


def lab_batches(runs: int, runs_per_commit: int, seed: int = 44) -> Iterator[list[bytes]]:
    rng = random.Random(seed)
    earlier: list[str] = []
    batch: list[bytes] = []
    for index in range(runs):
        batch.extend(lab_run(index, runs, rng, earlier))
        earlier.append(f"r{index:06d}")
        if (index + 1) % runs_per_commit == 0:
            yield batch
            batch = []
    if batch:
        yield batch


# -- measuring --------------------------------------------------------------------------------------


def best_of(repeats: int, work: Callable[[], Any]) -> float:
    """The fastest of ``repeats`` runs, in seconds (the least disturbed by the shared machine)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def ingest(root: Path, runs: int, runs_per_commit: int) -> dict[str, Any]:
    ledger, position, commits = Ledger.create(root), 0, 0
    started = time.perf_counter()
    with ledger:
        for batch in lab_batches(runs, runs_per_commit):
            ledger.commit([SourceRecord("spool:lab", position + i, raw) for i, raw in enumerate(batch)])
            position += len(batch)
            commits += 1
    return {"events": position, "commits": commits, "ingest_s": round(time.perf_counter() - started, 2)}


def file_counts(root: Path) -> dict[str, int]:
    """Parquet files under data/ and the partitions (folders) they are in."""
    files = list((root / "data").rglob("*.parquet"))
    return {"data_files": len(files), "partition_folders": len({f.parent for f in files})}


def compact(root: Path) -> dict[str, Any]:
    started = time.perf_counter()
    result = CliRunner().invoke(app, ["compact", "--ledger", str(root)], env={"RUNLEDGER_PROGRESS_S": "off"})
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    return {"compact_s": round(time.perf_counter() - started, 2), "compact_said": result.output.strip()}


def plain_copy(reader: Reader, folder: Path | None = None) -> duckdb.DuckDBPyConnection:
    """A baseline: the lake's rows under their stored names with the same derived views, so the
    same SQL answers the same question without the lake. ``folder`` None: plain in-memory DuckDB
    tables; else one Parquet file per table in ``folder`` (a bounded layout: what the lake's files
    would cost if their count did not grow with runs)."""
    import pyarrow.parquet as pq

    from runledger.ledger.parquet_schemas import TABLES

    con = duckdb.connect()
    for name in TABLES:
        stored = stored_name(name)
        table = reader.arrow(f"SELECT * FROM {stored}" + ("" if name in FILLED else " LIMIT 0"))
        if folder is None:
            con.register("_copy", table)
            con.execute(f'CREATE TABLE "{stored}" AS SELECT * FROM _copy')
            con.unregister("_copy")
            continue
        path = folder / f"{name}.parquet"
        pq.write_table(table, path)
        con.execute(f"CREATE VIEW \"{stored}\" AS SELECT * FROM read_parquet('{path}')")
    con.execute(DERIVED_VIEWS)
    return con


def _fetch(con: duckdb.DuckDBPyConnection, statement: str, params: list[Any]) -> list[Any]:
    return con.execute(statement, params).fetchall()


def runs_filter() -> RunFilter:
    return RunFilter(
        config=(parse_config_test("moe.capacity_factor=1.25"),),
        since=datetime(2026, 6, 1, tzinfo=UTC),
        status="finished",
    )


def queries(root: Path, repeats: int) -> dict[str, Any]:
    """``ledger runs`` and the cross-run question on the lake, each beside the plain baseline."""
    runner = CliRunner()

    def cli(*args: str) -> None:
        result = runner.invoke(app, ["runs", "--ledger", str(root), "--format", "csv", *args])
        if result.exit_code != 0:
            raise RuntimeError(result.output)

    filt = runs_filter()
    best = RunFilter(metric="eval/loss", metric_mode="min", limit=20)
    out: dict[str, Any] = {
        "cli_runs_3_filters_s": best_of(repeats, lambda: cli(*RUNS_FILTERS)),
        "cli_runs_metric_best_s": best_of(
            repeats, lambda: cli("--metric", "eval/loss", "--best", "min", "-n", "20")
        ),
    }
    reader = Reader(root)
    try:
        plain = plain_copy(reader)
        (root.parent / "few-files").mkdir(exist_ok=True)
        few = plain_copy(reader, root.parent / "few-files")
        for label, statement, params in [
            ("runs_3_filters", *search_statement(filt)),
            ("runs_metric_best", *search_statement(best)),
            ("run_summary_question", SUMMARY_QUESTION, []),
        ]:
            lake_s = best_of(repeats, partial(reader.sql, statement, params))
            plain_s = best_of(repeats, partial(_fetch, plain, statement, params))
            few_s = best_of(repeats, partial(_fetch, few, statement, params))
            same = sorted(map(tuple, reader.sql(statement, params).rows)) == sorted(
                plain.execute(statement, params).fetchall()
            )
            out[label] = {
                "lake_s": round(lake_s, 4),
                "plain_tables_s": round(plain_s, 4),
                "one_parquet_per_table_s": round(few_s, 4),
                "lake_over_plain": round(lake_s / plain_s, 2),
                "lake_over_one_file": round(lake_s / few_s, 2),
                "same_rows": same,
            }
        out["matching_runs"] = len(reader.sql(*search_statement(filt)).rows)
    finally:
        reader.close()
    out["cli_runs_3_filters_s"] = round(out["cli_runs_3_filters_s"], 3)
    out["cli_runs_metric_best_s"] = round(out["cli_runs_metric_best_s"], 3)
    return out


def measure(runs: int, runs_per_commit: int, repeats: int, keep: Path | None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-many-runs-"))
    root = (keep or tmp) / f"lab-{runs}"
    try:
        figures: dict[str, Any] = {"runs": runs, **ingest(root, runs, runs_per_commit)}
        print(f"{runs} runs ingested: {figures}", file=sys.stderr)
        figures["after_ingest"] = file_counts(root)
        figures.update(compact(root))
        figures["after_compact"] = file_counts(root)
        figures.update(queries(root, repeats))
        return figures
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", default="2000,20000", help="lab sizes, comma-separated (default 2000,20000)"
    )
    parser.add_argument("--runs-per-commit", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="leave the lakes in this folder")
    args = parser.parse_args()
    sizes = [int(n) for n in args.runs.split(",") if n]
    results = [measure(n, args.runs_per_commit, args.repeats, args.keep) for n in sizes]
    print(json.dumps(results, indent=2))
    if len(results) > 1:
        first, last = results[0], results[-1]
        growth = {
            key: round(last[key]["lake_s"] / first[key]["lake_s"], 2)
            for key in ("runs_3_filters", "runs_metric_best", "run_summary_question")
        }
        print(
            json.dumps({"runs_growth": round(last["runs"] / first["runs"], 1), "query_time_growth": growth})
        )


if __name__ == "__main__":
    main()
