"""LakeTables under the ledger (issue 26), figures from one run.

1. Ingest: a `ledger simulate` spool ingested into a ledger (a lake on its embedded SQLite catalog,
   ``--batch-size`` events per commit): events/s of the whole ingest and of its lake commits alone
   (``LakeTables.commit``, timed). (The part-file store it was first measured beside is gone, issue
   39: those figures are in docs/ducklake.md.)
2. Writers: LakeTables commits of synthetic batches (events + one metric each) by 1, 2 and 4 writer
   processes, one source each, on a PostgreSQL catalog (and 1 on a SQLite file).
3. A `metrics`-style join (metrics ⋈ events) on the same rows: ``Reader.sql`` (its views over the
   pinned snapshot's files) vs the lake's own connection (DuckLake's scans).

    .venv/bin/python -m bench.bench_lake [--steps 2000] [--batch-size 1000] [--batches 8] [--rows 2000]

Needs PostgreSQL (scripts/postgres.sh installs and starts one).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.lake import LakeFolder, LakeTables
from runledger.ledger.query import Reader
from tests.lake.support import Postgres, commit_batches, spawn

# Reader's ``metrics`` is a view (each key once, runledger.ledger.views); the stored rows are ``metrics_recorded``.
JOIN = (
    "SELECT e.stream, count(*), sum(m.value) FROM {metrics} m "
    "JOIN events e ON m.stream = e.stream AND m.stream_seq = e.stream_seq GROUP BY 1 ORDER BY 1"
)


def _cli(*args: str | Path) -> None:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"RUNLEDGER_PROGRESS_S": "off"})
    if result.exit_code != 0:
        raise RuntimeError(result.output)


def _timed(owner: Any, name: str, spent: list[float]) -> Callable[[], None]:
    """Wrap ``owner.name`` to add each call's seconds to ``spent``; returns the undo."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def _median_ms(run: Callable[[], object], times: int = 5) -> float:
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        run()
        samples.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(samples), 1)


def _same_answers(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> bool:
    """Same groups and counts; sums equal but for float addition order."""
    return len(a) == len(b) and all(
        x[:2] == y[:2] and abs(x[2] - y[2]) <= 1e-9 * max(1.0, abs(x[2])) for x, y in zip(a, b, strict=True)
    )


def same_batches(work: Path, steps: int, batch_size: int) -> dict[str, float]:
    spool, ledger = work / "spool", work / "ledger"
    _cli("simulate", "reference-535b", "--spool", spool, "--steps", str(steps))
    commits: list[float] = []
    undo = _timed(LakeTables, "commit", commits)  # (the ingest runs in this process)
    started = time.perf_counter()
    try:
        _cli("ingest", "spool", "--spool", spool, "--ledger", ledger, "--batch-size", str(batch_size))
    finally:
        undo()
    ingest_s = time.perf_counter() - started
    reader = Reader(ledger)
    events = reader.sql("SELECT count(*) FROM events").rows[0][0]
    folder = LakeFolder.read(ledger)
    assert folder is not None
    # The join on the lake's own connection: DuckLake's scans, the catalog asked in each statement.
    with LakeTables(folder.catalog, folder.data_path, create=False) as lake, lake.reader() as con:
        lake_join = JOIN.format(metrics="metrics")
        lake_ms = _median_ms(lambda: con.execute(lake_join).fetchall())
        lake_rows = con.execute(lake_join).fetchall()
    reader_join = JOIN.format(metrics="metrics_recorded")
    reader_ms = _median_ms(lambda: reader.sql(reader_join))
    if not _same_answers([tuple(r) for r in reader.sql(reader_join).rows], [tuple(r) for r in lake_rows]):
        raise RuntimeError("the join's answers differ")
    reader.close()
    return {
        "events": events,
        "commits": len(commits),
        "ingest_events_per_s": round(events / ingest_s),
        "lake_commit_events_per_s": round(events / sum(commits)),
        "join_reader_pinned_ms": reader_ms,
        "join_lake_connection_ms": lake_ms,
    }


def _writers(catalog: str, data: Path, writers: int, batches: int, rows: int) -> float:
    LakeTables(catalog, data).close()
    started = time.monotonic()
    procs = [spawn("race", catalog, str(data), f"src{i}", str(batches), str(rows)) for i in range(writers)]
    for proc in procs:
        _out, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(err[-500:])
    return writers * batches * rows / (time.monotonic() - started)


def writers(work: Path, batches: int, rows: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    with LakeTables(f"sqlite:{work / 'd' / 'c.sqlite'}", work / "d" / "data") as lake:
        started = time.monotonic()
        commit_batches(lake, "src0", batches, rows)
        figures["sqlite_1_writer_events_per_s"] = round(batches * rows / (time.monotonic() - started))
    pg = Postgres(work / "pg")
    try:
        for n in (1, 2, 4):
            rate = _writers(f"postgres:{pg.database()}", work / f"p{n}", n, batches, rows)
            figures[f"postgres_{n}_writers_events_per_s"] = round(rate)
    finally:
        pg.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-lake-", dir="/tmp"))
    work.chmod(0o755)  # the PostgreSQL server runs as user postgres
    try:
        figures = same_batches(work, args.steps, args.batch_size) | writers(work, args.batches, args.rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
