"""The ledger on DuckLake with a SQLite and a PostgreSQL catalog (issue 26), figures from one run.

1. Ingest: one `ledger simulate` spool per size, ingested by `ledger ingest spool` (a subprocess each,
   wall time and peak RSS by GNU time, ``bench.measure``) into ledgers on DuckLake with a SQLite and
   (when scripts/postgres.sh can start one) a PostgreSQL catalog. Every ledger must hold the same
   events as the first (checked; `DIFFERENT` otherwise). (The part-file ledger these were measured
   beside is gone, issue 39: its figures are in docs/ducklake.md.)
2. Questions (docs/scale.md's kind) through the CLI on the largest size: state, history, a metric
   series, the config blame; each a subprocess, the median of 3.
3. Writers: 1, 2 and 4 ingesters in separate folders, each with its own spool (its own run), on
   one lake (PostgreSQL, else SQLite): aggregate events/s beside one.

    .venv/bin/python -m bench.bench_lake_ledger [--steps 1000,4000] [--batch-size 5000] [--writer-steps 1000]

The full reference run (docs/scale.md: 390,000 steps, 1.1M events with rank stats and expert counts),
the embedded lake only:

    .venv/bin/python -m bench.bench_lake_ledger --steps 390000 --reference --lakes sqlite --writer-steps 0
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import run_measured
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from tests.lake.support import Postgres

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "RUNLEDGER_PROGRESS_S": "off"}
CLI = [sys.executable, "-m", "runledger.cli.main"]
SMALL = ["--rank-stats-every", "100000", "--expert-counts-every", "100000"]


def _run(*args: str | Path) -> str:
    done = subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or done.stdout)
    return done.stdout


REFERENCE = False  # --reference: the simulator's whole stream (rank stats, expert counts), not SMALL
LAKES = ("sqlite", "postgres")  # --lakes


def _spool(work: Path, steps: int, run_id: str = "moe-535b") -> Path:
    spool = work / f"spool-{run_id}-{steps}"
    if not spool.exists():
        extra = [] if REFERENCE else SMALL
        _run("simulate", "reference-535b", "--spool", spool, "--steps", steps, "--run-id", run_id, *extra)
    return spool


def _targets(work: Path, postgres: Postgres | None, tag: str) -> dict[str, Path]:
    """A fresh ledger folder per catalog kind; the first is the one the others are compared with."""
    out: dict[str, Path] = {}
    if "sqlite" in LAKES:
        Ledger.create_on_lake(work / f"sqlite-{tag}", f"sqlite:{work / f'sqlite-{tag}.sqlite'}").close()
        out["lake, SQLite"] = work / f"sqlite-{tag}"
    if postgres is not None and "postgres" in LAKES:
        Ledger.create_on_lake(work / f"pg-{tag}", f"postgres:{postgres.database()}").close()
        out["lake, PostgreSQL"] = work / f"pg-{tag}"
    if not out:
        raise SystemExit(f"--lakes {','.join(LAKES)}: no catalog to measure (sqlite, postgres)")
    return out


def _events(ledger: Path) -> list[tuple[object, ...]]:
    reader = Reader(ledger)
    try:
        return reader.sql(
            "SELECT count(*), count(DISTINCT (stream, stream_seq)), sum(hash(canonical)::HUGEINT) FROM events"
        ).rows
    finally:
        reader.close()


def ingest(
    work: Path, sizes: list[int], batch_size: int, postgres: Postgres | None
) -> dict[int, dict[str, Path]]:
    print("\n## 1. ledger ingest spool (a subprocess each; wall s, events/s, peak RSS)")
    print("| steps | events | ledger | s | events/s | peak RSS MB | vs the first |")
    print("|---|---|---|---|---|---|---|")
    made: dict[int, dict[str, Path]] = {}
    for steps in sizes:
        spool = _spool(work, steps)
        targets = _targets(work, postgres, str(steps))
        first = next(iter(targets))
        base_s = None
        answers = {}
        for name, ledger in targets.items():
            m = run_measured(
                [
                    *CLI,
                    "ingest",
                    "spool",
                    "--spool",
                    str(spool),
                    "--ledger",
                    str(ledger),
                    "--batch-size",
                    str(batch_size),
                ],
                env=ENV,
                cwd=ROOT,
            )
            if m.returncode != 0:
                raise RuntimeError(m.stdout)
            answers[name] = _events(ledger)
            events = int(answers[name][0][0])
            base_s = base_s or m.seconds
            same = "" if answers[name] == answers[first] else " DIFFERENT"
            print(
                f"| {steps:,} | {events:,} | {name}{same} | {m.seconds:.1f} | {events / m.seconds:,.0f} | "
                f"{m.peak_rss_mb:.0f} | {m.seconds / base_s:.2f}x |",
                flush=True,
            )
        made[steps] = targets
    return made


QUESTIONS = {
    "state at a step": ["state", "latest", "--step", "{mid}", "-f", "json"],
    "history (summary)": ["history", "latest"],
    "loss series": [
        "query",
        "SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step",
        "-f",
        "csv",
    ],
    "blame a config key": ["blame", "latest", "moe.capacity_factor", "--step", "{mid}"],
    "drop rate by layer": [
        "query",
        "SELECT layer, round(avg(token_drop_rate), 9) FROM moe_layer_stats GROUP BY 1 ORDER BY 1",
        "-f",
        "csv",
    ],
}


def questions(targets: dict[str, Path], steps: int) -> None:
    print(f"\n## 2. questions at {steps:,} steps (CLI subprocess, median of 3 s; same output checked)")
    names = list(targets)
    print("| question | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for question, template in QUESTIONS.items():
        args = [a.replace("{mid}", str(steps // 2)) for a in template]
        cells, outputs = [], {}
        for name, ledger in targets.items():
            times = []
            for _ in range(3):
                started = time.perf_counter()
                outputs[name] = _run(*args, "--ledger", ledger)
                times.append(time.perf_counter() - started)
            cells.append(f"{statistics.median(times):.2f}")
        same = all(o == outputs[names[0]] for o in outputs.values())
        print(f"| {question}{'' if same else ' DIFFERENT'} | " + " | ".join(cells) + " |", flush=True)
    print("\nIn process (`Reader(ledger)` opened, then the statement; median of 5 ms, after one untimed):")
    print("| statement | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for question, template in QUESTIONS.items():
        if template[0] != "query":
            continue
        cells = []
        for ledger in targets.values():
            times = []
            for i in range(6):
                started = time.perf_counter()
                reader = Reader(ledger)
                reader.sql(template[1])
                reader.close()
                if i:
                    times.append((time.perf_counter() - started) * 1000)
            cells.append(f"{statistics.median(times):.0f}")
        print(f"| {question} | " + " | ".join(cells) + " |", flush=True)


def writers(work: Path, steps: int, batch_size: int, postgres: Postgres | None) -> None:
    kind = "PostgreSQL" if postgres is not None else "SQLite"
    print(f"\n## 3. ingesters in separate folders on one lake ({kind}), {steps:,} steps each, own spool")
    print("| ingesters | events | wall s | aggregate events/s | vs one |")
    print("|---|---|---|---|---|")
    one = None
    for count in (1, 2, 4):
        lake_catalog = (
            f"postgres:{postgres.database()}"
            if postgres is not None
            else f"sqlite:{work / f'writers-{count}.sqlite'}"
        )
        data = work / f"writers-{count}-data"
        spools = [_spool(work, steps, f"run-{i}") for i in range(count)]
        folders = []
        for i in range(count):
            folder = work / f"writers-{count}-host-{i}"
            Ledger.create_on_lake(folder, lake_catalog, data).close()
            folders.append(folder)
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [
                    *CLI,
                    "ingest",
                    "spool",
                    "--spool",
                    str(s),
                    "--ledger",
                    str(f),
                    "--batch-size",
                    str(batch_size),
                ],
                env=ENV,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for s, f in zip(spools, folders, strict=True)
        ]
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(err.decode())
        wall = time.perf_counter() - started
        events = int(_events(folders[0])[0][0])
        rate = events / wall
        one = one or rate
        print(f"| {count} | {events:,} | {wall:.1f} | {rate:,.0f} | {rate / one:.2f}x |", flush=True)


def main() -> None:
    global REFERENCE, LAKES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,4000", help="sizes, comma-separated")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--writer-steps", type=int, default=1000)
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument(
        "--reference", action="store_true", help="the whole simulated stream (1.1M events at 390,000 steps)"
    )
    parser.add_argument("--lakes", default=",".join(LAKES), help="catalogs to measure: sqlite,postgres")
    args = parser.parse_args()
    REFERENCE, LAKES = args.reference, tuple(args.lakes.split(","))
    sizes = [int(s) for s in args.steps.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-lake-ledger-"))
    pg_dir = Path(tempfile.mkdtemp(prefix="runledger-pg-", dir="/tmp"))
    pg_dir.chmod(0o755)
    postgres = None
    if not args.no_postgres and "postgres" in LAKES:
        try:
            postgres = Postgres(pg_dir)
        except (RuntimeError, OSError) as exc:
            print(f"(no PostgreSQL: {exc})")
    try:
        made = ingest(work, sizes, args.batch_size, postgres)
        questions(made[sizes[-1]], sizes[-1])
        if args.writer_steps > 0:
            writers(work, args.writer_steps, args.batch_size, postgres)
    finally:
        if postgres is not None:
            postgres.stop()
        shutil.rmtree(pg_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
