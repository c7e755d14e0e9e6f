"""`ledger report` at growing run lengths: build time and file size, beside the raw points' size and
the time a plain DuckDB fetch of those raw points takes (the baseline, measured in the same run).

Each ledger holds the workload of bench.bench_ledger's ``emit_run`` (20 scalars, 48 layers × router
stats every step, 48 × 384 expert counts every ``--expert-every`` steps, two config changes). Going
through the ingester costs ~1 ms of CPU per step here (decoding 48 layers), so 390,000 steps would
take most of an hour on this 2-core machine: instead ``emit_run``'s launch and config changes are
committed through ``Ledger.commit`` and its per-step rows (``metrics``, ``moe_layer_stats``) are
written with pyarrow, vectorised, into the same partitions. That they are the very rows the ingester
makes is checked first, at 2,000 steps, against a ledger built the ordinary way (emit → commit).
The report reads nothing else at scale. The reference size is 390,000 steps × 48 layers; the issue
asks < 10 s and < 10 MB there.

    python -m bench.bench_report [--steps 20000,100000,390000] [--expert-every 1000]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.bench_ledger import EXPERTS, LAYERS, TOP_K, emit_run
from runledger.ledger.parquet_schemas import TABLES
from runledger.ledger.projectors import STEP_SCALARS
from runledger.ledger.query import Reader
from runledger.ledger.report import CURVES, build_report, render_html
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import Envelope, encode_event
from runledger.schemas import catalogue as c
from runledger.schemas.durable import write_durably

BATCH_RECORDS = 4000


class LedgerSink:
    """A sink for ``emit_run`` that commits the encoded events straight into a ledger, in batches."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.pending: list[SourceRecord] = []
        self.position = 0

    def emit(self, envelope: Envelope) -> None:
        self.pending.append(SourceRecord("bench:report", self.position, encode_event(envelope)))
        self.position += 1
        if len(self.pending) >= BATCH_RECORDS:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.ledger.commit(self.pending)
            self.pending = []


class RunEventsSink(LedgerSink):
    """Commits only the run's own events (launch, config changes): the per-step rows are bulk-written."""

    def emit(self, envelope: Envelope) -> None:
        if envelope.type not in (c.STEP_METRICS, c.MOE_ROUTER_STATS):
            super().emit(envelope)


def build_ledger(root: Path, steps: int, expert_every: int, *, through_ingest: bool = False) -> float:
    t = time.perf_counter()
    ledger = Ledger.create(root)
    sink = LedgerSink(ledger) if through_ingest else RunEventsSink(ledger)
    emit_run(sink, "bench-run", steps, expert_every=expert_every)  # type: ignore[arg-type]
    sink.flush()
    if not through_ingest:
        write_step_rows(root, steps, expert_every)
    ledger.compact()
    return time.perf_counter() - t


STEPS_PER_FILE = 50_000


def write_step_rows(root: Path, steps: int, expert_every: int) -> None:
    """``emit_run``'s metrics and router rows, as the projectors make them, straight to Parquet."""
    changes = np.array([steps * 2 // 5, steps * 4 // 5])
    names = [*STEP_SCALARS, *(f"s{i}" for i in range(12))]
    now = np.datetime64(datetime.now(UTC).replace(tzinfo=None), "us")  # stored as UTC

    def times(count: int) -> pa.Array:
        return pa.array(np.full(count, now), pa.timestamp("us", tz="UTC"))

    for part, first in enumerate(range(1, steps + 1, STEPS_PER_FILE)):
        step = np.arange(first, min(first + STEPS_PER_FILE, steps + 1), dtype=np.int64)
        changed = (step[:, None] >= changes[None, :]).sum(axis=1)  # config changes emitted so far
        # Event order: run.started (#0), then per step [config change], metrics, router stats.
        metrics_seq = 1 + 2 * (step - 1) + changed
        lr = 3e-4 / 2.0**changed
        columns = [
            10 / step,
            np.ones(len(step)),
            lr,
            np.full(len(step), 4096.0),
            4096.0 * step,
            np.full(len(step), 1e5),
            np.full(len(step), 22.7),
            np.full(len(step), 0.5),
        ]
        columns += [step * 1e-3 + i for i in range(12)]
        n = len(step)
        metrics = pa.table(
            {
                "attempt": np.ones(n * len(names), dtype=np.int64),
                "step": np.repeat(step, len(names)),
                "time": times(n * len(names)),
                "name": np.tile(np.array(names, dtype=object), n),
                "value": np.stack(columns, axis=1).reshape(-1),
                "stream": np.full(n * len(names), "bench-run", dtype=object),
                "stream_seq": np.repeat(metrics_seq, len(names)),
            },
            schema=TABLES["metrics"].schema,
        )
        rows = n * LAYERS
        with_counts = np.repeat(step % expert_every == 0, LAYERS)
        counts = pa.array([[85] * EXPERTS if w else [] for w in with_counts], pa.list_(pa.int64()))
        layers = pa.table(
            {
                "attempt": np.ones(rows, dtype=np.int64),
                "step": np.repeat(step, LAYERS),
                "time": times(rows),
                "layer": np.tile(np.arange(LAYERS, dtype=np.int32), n),
                "tokens": np.full(rows, 4096, dtype=np.int64),
                "top_k": np.full(rows, TOP_K, dtype=np.int32),
                "dropped": np.full(rows, int(4096 * TOP_K * 0.0267), dtype=np.int64),
                "token_drop_rate": np.full(rows, 0.0267),
                "sender_drops": pa.nulls(rows, pa.int64()),
                "receiver_drops": pa.nulls(rows, pa.int64()),
                "expert_counts": counts,
                "aux_loss": np.full(rows, 0.01),
                "z_loss": np.full(rows, 0.001),
                "routing_entropy": np.full(rows, 5.1),
                "stream": np.full(rows, "bench-run", dtype=object),
                "stream_seq": np.repeat(metrics_seq + 1, LAYERS),
            },
            schema=TABLES["moe_layer_stats"].schema,
        )
        for table, data in (("metrics", metrics), ("moe_layer_stats", layers)):
            directory = root / table / "run_id=bench-run"
            directory.mkdir(parents=True, exist_ok=True)
            pq.write_table(data, directory / f"part-bulk-{part}.parquet", compression="zstd")


def check_bulk_rows_equal_ingested(work: Path, steps: int = 2000, expert_every: int = 100) -> None:
    """The bulk-written rows equal, value for value, the rows the ingester makes from ``emit_run``."""
    readers = {}
    for through_ingest in (True, False):
        root = work / f"check-{through_ingest}"
        build_ledger(root, steps, expert_every, through_ingest=through_ingest)
        readers[through_ingest] = Reader(root)
    queries = (
        "SELECT attempt, step, name, value, stream_seq FROM metrics_all ORDER BY step, name",
        "SELECT * EXCLUDE (time, run_id) FROM moe_layer_stats_all ORDER BY step, layer",
        "SELECT step, config_hash FROM configs ORDER BY step",
    )
    for sql in queries:
        ingested, bulk = (readers[k].sql(sql).rows for k in (True, False))
        if ingested != bulk:
            raise SystemExit(f"bulk rows differ from ingested rows for: {sql}")
    print(
        f"  check: bulk-written rows == ingested rows at {steps:,} steps ({len(ingested):,} config rows, "
        "every metric and router row compared)"
    )


def raw_baseline(reader: Reader) -> tuple[float, float, int, int]:
    """Fetch every raw point the page draws (the curves and the per-layer drop rates), unreduced; and
    the size of those points as compact JSON ``[step,value],`` pairs. Returns (wall s, CPU s, points, bytes)."""
    names = ", ".join(f"'{name}'" for name, _ in CURVES)
    t, cpu = time.perf_counter(), time.process_time()  # as Arrow: Python tuples would measure Python
    curves = reader.con.sql(
        f"SELECT name, step, value FROM metrics_all WHERE name IN ({names})"
    ).to_arrow_table()
    layers = reader.con.sql("SELECT layer, step, token_drop_rate FROM moe_layer_stats").to_arrow_table()
    seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    size = reader.sql(
        f"SELECT (SELECT sum(length(step::VARCHAR) + length(value::VARCHAR) + 4) FROM metrics_all "
        f"WHERE name IN ({names})) + (SELECT sum(length(step::VARCHAR) + length(layer::VARCHAR) + "
        "length(token_drop_rate::VARCHAR) + 5) FROM moe_layer_stats)"
    ).rows[0][0]
    return seconds, cpu_seconds, curves.num_rows + layers.num_rows, int(size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default="20000,100000,390000", help="comma-separated run lengths")
    parser.add_argument("--expert-every", type=int, default=1000, help="steps between expert-count logs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runledger-bench-report-"))
    try:
        check_bulk_rows_equal_ingested(work)
        # Wall time and CPU time (all threads): on a shared machine the wall time includes waiting for a core.
        print(
            f"{'steps':>8} {'build ledger':>13} {'report build (CPU)':>20} {'report file':>12} "
            f"{'raw points':>12} {'raw JSON':>10} {'baseline: raw fetch (CPU)':>26}"
        )
        for steps in [int(s) for s in args.steps.split(",")]:
            root = work / f"ledger-{steps}"
            t_ledger = build_ledger(root, steps, args.expert_every)
            reader = Reader(root)
            t_raw, cpu_raw, points, raw_bytes = raw_baseline(reader)
            out = work / f"report-{steps}.html"
            t, cpu = time.perf_counter(), time.process_time()
            write_durably(out, render_html(build_report(Reader(root), ["bench-run"])))
            t_report, cpu_report = time.perf_counter() - t, time.process_time() - cpu
            print(
                f"{steps:>8,} {t_ledger:>11.1f} s {t_report:>8.2f} s ({cpu_report:5.2f} s) "
                f"{out.stat().st_size / 1e6:>9.2f} MB {points:>12,} {raw_bytes / 1e6:>7.1f} MB "
                f"{t_raw:>14.2f} s ({cpu_raw:5.2f} s)",
                flush=True,
            )
            shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
