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
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
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


@dataclass
class Workload:
    """The anchor workload's values, drawn before timing so emit and the pyarrow ceiling share them.

    Realistic, not constant: a noisy decaying loss, scalars that drift, per-layer drop rates and
    losses that vary by layer and step, expert counts drawn from a skewed multinomial — constants
    compress to nothing and flatter every writer.
    """

    steps: int
    expert_every: int
    loss: list[float]
    grad_norm: list[float]
    scalars: list[list[float]]  # steps × 12
    drop_rate: list[list[float]]  # steps × layers
    aux_loss: list[list[float]]
    z_loss: list[list[float]]
    entropy: list[list[float]]
    expert_counts: dict[int, list[list[int]]]  # step → layers × experts


def make_workload(steps: int, *, expert_every: int = 100, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    t = np.arange(1, steps + 1, dtype=np.float64)
    loss = 2.0 + 8.0 / np.sqrt(t) + rng.normal(0, 0.02, steps)
    grad_norm = np.abs(1.0 + rng.normal(0, 0.3, steps))
    scalars = t[:, None] * 1e-3 + np.arange(12)[None, :] + rng.normal(0, 0.05, (steps, 12))
    layer_bias = rng.uniform(0.5, 1.5, LAYERS)
    drop = np.clip(0.0267 * layer_bias[None, :] * (1 + rng.normal(0, 0.2, (steps, LAYERS))), 0, 1)
    aux = 0.01 * (1 + rng.normal(0, 0.05, (steps, LAYERS)))
    z = 0.001 * (1 + rng.normal(0, 0.1, (steps, LAYERS)))
    entropy = 5.1 + rng.normal(0, 0.05, (steps, LAYERS))
    tokens_k = 4096 * TOP_K
    popularity = rng.dirichlet(np.full(EXPERTS, 20.0), LAYERS)
    counts = {
        step: [rng.multinomial(tokens_k, popularity[layer]).tolist() for layer in range(LAYERS)]
        for step in range(expert_every, steps + 1, expert_every)
    }
    return Workload(
        steps,
        expert_every,
        loss.tolist(),
        grad_norm.tolist(),
        scalars.tolist(),
        drop.tolist(),
        aux.tolist(),
        z.tolist(),
        entropy.tolist(),
        counts,
    )


def emit_run(
    sink: SpoolSink, run_id: str, steps: int, *, expert_every: int = 100, workload: Workload | None = None
) -> int:
    """Emit one run; returns the number of metric values (scalars + router stats + expert counts)."""
    w = workload or make_workload(steps, expert_every=expert_every)
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
    tokens_k = 4096 * TOP_K
    for step in range(1, steps + 1):
        i = step - 1
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
        row = w.scalars[i]
        emit(
            p.StepMetrics(
                loss=w.loss[i],
                grad_norm=w.grad_norm[i],
                lr=config["lr"],
                tokens=4096,
                total_tokens=4096 * step,
                tokens_per_second=81_920.0 / (0.5 + 0.01 * row[0]),
                mfu=22.7 + row[1] - 1,
                step_time_s=0.5 + 0.01 * row[0],
                scalars={f"s{k}": row[k] for k in range(12)},
            ),
            step,
        )
        values += 20
        counts = w.expert_counts.get(step)
        drop, aux, z, ent = w.drop_rate[i], w.aux_loss[i], w.z_loss[i], w.entropy[i]
        layers = [
            p.MoeLayerStats(
                layer=layer,
                tokens=4096,
                top_k=TOP_K,
                dropped=int(tokens_k * drop[layer]),
                token_drop_rate=drop[layer],
                aux_loss=aux[layer],
                z_loss=z[layer],
                routing_entropy=ent[layer],
                expert_counts=counts[layer] if counts else [],
            )
            for layer in range(LAYERS)
        ]
        emit(p.MoeRouterStats(layers=layers), step)
        values += LAYERS * 5 + (LAYERS * EXPERTS if counts else 0)
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


def ingest_rate(work: Path, workload: Workload) -> tuple[Path, int, float, float]:
    spool, ledger_dir = work / "spool", work / "ledger"
    sink = SpoolSink(spool)
    t0 = time.perf_counter()
    values = emit_run(sink, "bench-run", workload.steps, workload=workload)
    sink.close()
    t_emit = time.perf_counter() - t0
    t1 = time.perf_counter()
    ingest_spool(Ledger.create(ledger_dir), spool, batch_size=2000)
    t_ingest = time.perf_counter() - t1
    return ledger_dir, values, t_emit, t_ingest


def pyarrow_ceiling(work: Path, w: Workload) -> tuple[float, int]:
    """The ceiling: build the same metric, router and event rows from Python and write them with pyarrow.

    No envelope, validation, hashing, signing or durability: what a tracker writing Parquet straight
    from the training loop would do. Event rows carry the payload as JSON, as the ledger's do.
    """
    t = time.perf_counter()
    names = ["loss", "grad_norm", "lr", "tokens", "total_tokens", "tokens_per_second", "mfu", "step_time_s"]
    names += [f"s{k}" for k in range(12)]
    metrics: dict[str, list[Any]] = {k: [] for k in ("step", "time", "name", "value", "stream_seq")}
    layers: dict[str, list[Any]] = {
        k: []
        for k in (
            "step",
            "time",
            "layer",
            "dropped",
            "token_drop_rate",
            "aux_loss",
            "z_loss",
            "entropy",
            "counts",
        )
    }
    events: dict[str, list[Any]] = {k: [] for k in ("seq", "type", "step", "time", "data")}
    tokens_k = 4096 * TOP_K
    seq = 0
    for step in range(1, w.steps + 1):
        i = step - 1
        now = datetime.now(UTC)
        row = w.scalars[i]
        step_time = 0.5 + 0.01 * row[0]
        values = [w.loss[i], w.grad_norm[i], 3e-4, 4096, 4096 * step, 81_920.0 / step_time, 22.7 + row[1] - 1]
        values += [step_time, *row]
        metrics["step"] += [step] * 20
        metrics["time"] += [now] * 20
        metrics["name"] += names
        metrics["value"] += values
        metrics["stream_seq"] += [seq] * 20
        events["seq"].append(seq)
        events["type"].append("step.metrics")
        events["step"].append(step)
        events["time"].append(now)
        events["data"].append(json.dumps(dict(zip(names, values, strict=True))))
        seq += 1
        counts = w.expert_counts.get(step)
        drop, aux, z, ent = w.drop_rate[i], w.aux_loss[i], w.z_loss[i], w.entropy[i]
        for layer in range(LAYERS):
            layers["step"].append(step)
            layers["time"].append(now)
            layers["layer"].append(layer)
            layers["dropped"].append(int(tokens_k * drop[layer]))
            layers["token_drop_rate"].append(drop[layer])
            layers["aux_loss"].append(aux[layer])
            layers["z_loss"].append(z[layer])
            layers["entropy"].append(ent[layer])
            layers["counts"].append(counts[layer] if counts else [])
        events["seq"].append(seq)
        events["type"].append("moe.router_stats")
        events["step"].append(step)
        events["time"].append(now)
        events["data"].append(
            json.dumps(
                [
                    {"layer": k, "drop": drop[k], "aux": aux[k], "z": z[k], "entropy": ent[k]}
                    | ({"counts": counts[k]} if counts else {})
                    for k in range(LAYERS)
                ]
            )
        )
        seq += 1
    rows = 0
    for name, cols in (("metrics", metrics), ("moe_layer_stats", layers), ("events", events)):
        table = pa.table(cols)
        rows += table.num_rows
        pq.write_table(table, work / f"{name}.parquet", compression="zstd")
    return time.perf_counter() - t, rows


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
    workload = make_workload(2000)
    ledger_dir, values, t_emit, t_ingest = ingest_rate(work, workload)
    t_ceiling, rows = pyarrow_ceiling(work, workload)
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
    print(f"  emitted → queryable vs the ceiling             {t_ceiling / total:8.0%}   (target >= 50%)")
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
    ledger_dir, values, _t_emit, t_ingest = ingest_rate(work, make_workload(steps))
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
    parser.add_argument("--anchor-only", action="store_true", help="only the anchor workload (section 2)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runledger-bench-"))
    try:
        if not args.anchor_only:
            print("1. decoding")
            bench_decode()
        print("2. the anchor tracker workload (2,000 steps)")
        anchor_workload(work / "anchor")
        if args.anchor_only:
            return
        print(f"3. a ledger of >= {args.big_values:,} metric values")
        big_ledger(work / "big", args.big_values)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
