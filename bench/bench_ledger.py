"""Ledger benchmarks, each figure printed beside its baseline from the same run.

1. decode+validate events/s (msgspec typed decoding) vs. plain `json.loads` (no validation).
2. The tracker workload of ../shared/reference/anchors.md (2,000 steps × (20 scalars + 48 layers × 5
   router stats) + every 100 steps 48 × 384 expert counts = 888,640 values, a 60-key config changed
   twice): emit → spool → ledger, then the anchor's queries; vs. the same rows written straight to
   Parquet with pyarrow (the ceiling for "values ingested per second").
3. A ledger of >= 10 million metric values: `state --step` latency and one metric's full series,
   vs. the same answers computed by a plain DuckDB scan of the Parquet files.

    python -m bench.bench_ledger [--big-values 10000000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.schemas import config_hash, decode_event, encode_event, make_event
from runledger.schemas import payloads as p

LAYERS, EXPERTS, TOP_K = 48, 384, 8


def _config() -> dict[str, Any]:
    return {f"key_{i:02d}": i * 0.5 for i in range(58)} | {"lr": 3e-4, "moe": {"capacity_factor": 1.15}}


def emit_run(sink: SpoolSink, run_id: str, steps: int, *, expert_every: int = 100) -> int:
    """Emit one run; returns the number of metric values (scalars + router stats + expert counts)."""
    config = _config()
    seq = 0

    def emit(payload: Any, step: int | None) -> None:
        nonlocal seq
        sink.emit(
            make_event(
                payload,
                source=f"trainer/{run_id}/rank0",
                stream=run_id,
                run_id=run_id,
                attempt=1,
                step=step,
                seq=seq,
            )
        )
        seq += 1

    emit(p.RunStarted(config=config, config_hash=config_hash(config), host="bench"), 0)
    values = 0
    for step in range(1, steps + 1):
        if step in (steps * 2 // 5, steps * 4 // 5):
            new = config | {"lr": config["lr"] / 2}
            emit(
                p.ConfigChanged(
                    patch=[p.PatchOp(op="replace", path="/lr", value=new["lr"])],
                    previous_hash=config_hash(config),
                    config_hash=config_hash(new),
                    cause=p.ChangeCause(kind="file_edit"),
                ),
                step,
            )
            config = new
        scalars = {f"s{i}": step * 1e-3 + i for i in range(12)}
        emit(
            p.StepMetrics(
                loss=10 / step,
                grad_norm=1.0,
                lr=config["lr"],
                tokens=4096,
                total_tokens=4096 * step,
                tokens_per_second=1e5,
                mfu=22.7,
                step_time_s=0.5,
                scalars=scalars,
            ),
            step,
        )
        values += 20
        with_counts = step % expert_every == 0
        layers = [
            p.MoeLayerStats(
                layer=layer,
                tokens=4096,
                top_k=TOP_K,
                dropped=int(4096 * TOP_K * 0.0267),
                token_drop_rate=0.0267,
                aux_loss=0.01,
                z_loss=0.001,
                routing_entropy=5.1,
                expert_counts=[85] * EXPERTS if with_counts else [],
            )
            for layer in range(LAYERS)
        ]
        emit(p.MoeRouterStats(layers=layers), step)
        values += LAYERS * 5 + (LAYERS * EXPERTS if with_counts else 0)
    return values


def bench_decode(n: int = 20000) -> None:
    layers = [
        p.MoeLayerStats(
            layer=i, tokens=4096, top_k=8, dropped=10, token_drop_rate=0.0003, expert_counts=[85] * EXPERTS
        )
        for i in range(4)
    ]
    raws = [
        encode_event(
            make_event(
                p.StepMetrics(loss=1.0, lr=1e-4, scalars={f"s{i}": 1.0 for i in range(12)}),
                source="s",
                stream="r",
                run_id="r",
                attempt=1,
                step=i,
                seq=i,
            )
        )
        for i in range(n)
    ]
    raws_moe = [
        encode_event(
            make_event(
                p.MoeRouterStats(layers=layers), source="s", stream="r", run_id="r", attempt=1, step=i, seq=i
            )
        )
        for i in range(n // 10)
    ]
    for label, batch in (("step metrics", raws), ("router stats (4 layers x 384 counts)", raws_moe)):
        t = time.perf_counter()
        for raw in batch:
            decode_event(raw)
        typed = len(batch) / (time.perf_counter() - t)
        t = time.perf_counter()
        for raw in batch:
            json.loads(raw)
        plain = len(batch) / (time.perf_counter() - t)
        print(
            f"  decode+validate {label:38s} {typed:>12,.0f} events/s   json.loads only: {plain:>12,.0f} events/s"
        )


def ingest_rate(work: Path, steps: int) -> tuple[Path, int, float, float]:
    spool, ledger_dir = work / "spool", work / "ledger"
    sink = SpoolSink(spool)
    t0 = time.perf_counter()
    values = emit_run(sink, "bench-run", steps)
    sink.close()
    t_emit = time.perf_counter() - t0
    t1 = time.perf_counter()
    ingest_spool(Ledger.create(ledger_dir), spool, batch_size=2000)
    t_ingest = time.perf_counter() - t1
    return ledger_dir, values, t_emit, t_ingest


def pyarrow_ceiling(work: Path, ledger_dir: Path) -> tuple[float, int]:
    """Write the very same metric and router rows straight to Parquet with pyarrow."""
    tables = {name: pq.read_table(ledger_dir / name) for name in ("metrics", "moe_layer_stats")}
    rows = {name: t.to_pylist() for name, t in tables.items()}
    t = time.perf_counter()
    for name, r in rows.items():
        pq.write_table(
            pa.Table.from_pylist(r, schema=tables[name].schema), work / f"{name}.parquet", compression="zstd"
        )
    return time.perf_counter() - t, sum(len(r) for r in rows.values())


def timed(fn: Any, repeat: int = 5) -> float:
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def disk_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def anchor_workload(work: Path) -> None:
    ledger_dir, values, t_emit, t_ingest = ingest_rate(work, 2000)
    t_ceiling, rows = pyarrow_ceiling(work, ledger_dir)
    reader = Reader(ledger_dir)
    one = timed(
        lambda: reader.sql("SELECT step, value FROM metrics WHERE run_id='bench-run' AND name='loss'")
    )
    layers = timed(
        lambda: reader.sql(
            "SELECT layer, step, token_drop_rate FROM moe_layer_stats "
            "WHERE run_id='bench-run' ORDER BY layer, step"
        )
    )
    cfg = timed(lambda: reader.state("bench-run", step=1200))
    cfg_sql = timed(lambda: reader.sql("SELECT config FROM config_at('bench-run', 1200)"))
    total = t_emit + t_ingest
    print(f"  values: {values:,} (anchor: 888,640)")
    print(f"  log until durable (emit to spool, fsynced)     {t_emit:8.2f} s")
    print(
        f"  emitted → queryable (emit + ingest)            {total:8.2f} s   = {values / total:>10,.0f} values/s"
    )
    print(
        f"  ingest spool → Parquet ledger                  {t_ingest:8.2f} s   = {values / t_ingest:>10,.0f} values/s"
    )
    print(
        f"  baseline: same {rows:,} rows straight to Parquet (pyarrow) {t_ceiling:6.2f} s"
        f"   = {values / t_ceiling:>10,.0f} values/s"
    )
    print(f"  one metric's series                            {one * 1e3:8.1f} ms")
    print(f"  48 per-layer series                            {layers * 1e3:8.1f} ms")
    print(
        f"  config value at step 1200 (state fold)         {cfg * 1e3:8.1f} ms   (SQL config_at: {cfg_sql * 1e3:.1f} ms)"
    )
    print(
        f"  disk (ledger)                                  {disk_mb(ledger_dir):8.1f} MB   (spool: {disk_mb(work / 'spool'):.1f} MB)"
    )
    print(
        "  anchors (same workload, measured here): MLflow sqlite 188.9 s / 4,705 values/s; "
        "MLflow file 56.6 s; W&B offline 2.9 s async, 308,612 values/s, no offline query API"
    )


def big_ledger(work: Path, target_values: int) -> None:
    steps = max(1, target_values // 260)  # 20 scalars + 48 × 5 router stats per step (+ counts every 100)
    ledger_dir, values, _t_emit, t_ingest = ingest_rate(work, steps)
    Ledger.open(ledger_dir).compact()
    reader = Reader(ledger_dir)
    n_metric_rows = reader.sql("SELECT count(*) FROM metrics_all").rows[0][0]
    n_layer_rows = reader.sql("SELECT count(*) FROM moe_layer_stats_all").rows[0][0]
    print(
        f"  ledger: {values:,} values ({n_metric_rows:,} metric rows + {n_layer_rows:,} router rows), "
        f"ingested in {t_ingest:.1f} s ({values / t_ingest:,.0f} values/s), {disk_mb(ledger_dir):.0f} MB"
    )
    step = steps * 3 // 5
    state = timed(lambda: reader.state("bench-run", step=step))
    con = duckdb.connect()
    glob = f"{ledger_dir}/events/*/*.parquet"

    def plain_state() -> None:
        # The same answer by a plain scan: the launch config plus every config patch up to the step.
        con.execute(
            f"SELECT canonical FROM read_parquet('{glob}') WHERE stream='bench-run' AND "
            f"type IN ('runledger.run.started','runledger.config.changed') AND step <= {step} "
            "ORDER BY stream_seq"
        ).fetchall()

    scan_state = timed(plain_state)
    series = timed(
        lambda: reader.sql("SELECT step, value FROM metrics WHERE run_id='bench-run' AND name='loss'")
    )
    mglob = f"{ledger_dir}/metrics/*/*.parquet"
    scan_series = timed(
        lambda: con.execute(f"SELECT step, value FROM read_parquet('{mglob}') WHERE name='loss'").fetchall()
    )
    print(
        f"  state --step {step}: {state * 1e3:8.1f} ms   plain DuckDB scan of events: {scan_state * 1e3:8.1f} ms"
    )
    print(
        f"  one metric's full series ({steps:,} points): {series * 1e3:8.1f} ms   "
        f"plain DuckDB scan: {scan_series * 1e3:8.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big-values", type=int, default=10_000_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runledger-bench-"))
    try:
        print("1. decoding")
        bench_decode()
        print("2. the anchor tracker workload (2,000 steps)")
        anchor_workload(work / "anchor")
        print(f"3. a ledger of >= {args.big_values:,} metric values")
        big_ledger(work / "big", args.big_values)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
