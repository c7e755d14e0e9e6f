"""W&B benchmarks (offline mode), each figure beside its baseline from the same run.

1. Mirror overhead: median step time of the same tiny Megatron-Core MoE run trained without and
   with ``--wandb`` (offline), alternating runs so both see the same machine load, after one
   untimed run (a process's first run is slower whatever it does).
2. The training thread's cost per logged step at the reference model's shape (48 layers × 384
   experts, top-8): ``WandbMirror.log`` of the trainer's W&B row beside building and emitting the
   ledger's own two events for that step (step metrics + router stats) into a spool.
3. Import: ``ledger ingest wandb`` of an offline run with many history rows, events/s, beside
   wandb's own reader (``wandb-core``) decoding the same file with nothing done to its records.

    python -m bench.bench_wandb [--rounds 4] [--steps 40] [--rows 20000]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")  # Megatron-Core's notes about Transformer Engine/Apex on CPU

from runledger.ingest.bus import SpoolSink  # noqa: E402
from runledger.ingest.wandb_import import find_offline_runs, import_offline_run, read_records  # noqa: E402
from runledger.ingest.wandb_mirror import WandbMirror, offline_environment  # noqa: E402
from runledger.schemas import make_event  # noqa: E402
from runledger.schemas.payloads import MoeLayerStats  # noqa: E402
from runledger.trainer.config import TINY_CPU, load_config, write_config  # noqa: E402
from runledger.trainer.loop import train  # noqa: E402
from runledger.trainer.mirror import step_values  # noqa: E402
from runledger.trainer.telemetry import StepReport, router_stats, step_metrics  # noqa: E402

WARMUP = 3  # first steps of each run left out (allocator, caches, W&B's first writes)


def offline_wandb(work: Path) -> None:
    """W&B offline, everything under ``work``, no network, no telemetry."""
    settings = offline_environment(work)
    os.environ.update(settings)
    Path(settings["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)


def step_time(work: Path, n: int, steps: int, mirrored: bool) -> list[float]:
    path = work / f"run{n}.toml"
    overrides = [
        *TINY_CPU,
        f"run.run_id=bench-{n}",
        f"run.steps={steps}",
        f"checkpoint.dir={work / f'ck{n}'}",
    ]
    write_config(path, load_config(None, overrides))
    times: list[float] = []
    sink = SpoolSink(work / f"spool{n}")
    mirror = WandbMirror("runledger-bench", directory=work / "wandb-runs") if mirrored else None
    try:
        train(path, sink, progress=lambda r: times.append(r.step_time_s), mirror=mirror)
    finally:
        sink.close()
    return times[WARMUP:]


def bench_mirror_overhead(work: Path, rounds: int, steps: int) -> tuple[float, float, int]:
    plain: list[float] = []
    mirrored: list[float] = []
    step_time(work, 1000, steps, False)  # untimed: the process's first model build and kernels
    for r in range(rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for on in order:
            (mirrored if on else plain).extend(step_time(work, 2 * r + on, steps, on))
    return statistics.median(plain), statistics.median(mirrored), len(plain)


def reference_report(step: int, rng: random.Random) -> StepReport:
    """A step of the 535B reference model as the loop reports it: 48 MoE layers × 384 experts, top-8."""
    layers = []
    tokens, top_k, experts = 4096 * 16, 8, 384
    for layer in range(48):
        counts = [rng.randrange(900, 1800) for _ in range(experts)]
        dropped = rng.randrange(0, 5000)
        layers.append(
            MoeLayerStats(
                layer=layer,
                tokens=tokens,
                top_k=top_k,
                dropped=dropped,
                token_drop_rate=dropped / (tokens * top_k),
                expert_counts=counts,
                aux_loss=rng.random() * 1e-2,
                z_loss=rng.random() * 1e-3,
                routing_entropy=5.0 + rng.random(),
            )
        )
    return StepReport(
        step=step,
        loss=2.0 + rng.random(),
        grad_norm=rng.random(),
        lr=3e-4,
        tokens=tokens,
        total_tokens=tokens * step,
        step_time_s=1.0,
        tokens_per_second=tokens * 1.0,
        mfu=40.0,
        layers=layers,
        scalars={"events_dropped": 0.0},
    )


def bench_log_cost(work: Path, steps: int) -> tuple[float, float, int]:
    rng = random.Random(0)
    reports = [reference_report(s, rng) for s in range(1, steps + 1)]
    mirror = WandbMirror("runledger-bench", directory=work / "wandb-runs", strict=True)
    mirror.start("bench-log-cost", {"model": {"num_layers": 48}})
    t0 = time.perf_counter()
    for report in reports:
        mirror.log(report.step, step_values(report))
    wandb_s = (time.perf_counter() - t0) / steps
    keys = len(step_values(reports[0]))
    mirror.finish()

    sink = SpoolSink(work / "spool-log-cost")
    common = {"source": "bench/rank0", "stream": "bench-log-cost", "run_id": "bench-log-cost", "attempt": 1}
    seq = 0
    t0 = time.perf_counter()
    for report in reports:
        for payload in (step_metrics(report), router_stats(report)):
            sink.emit(make_event(payload, **common, step=report.step, seq=seq))
            seq += 1
    ledger_s = (time.perf_counter() - t0) / steps
    sink.close()
    return wandb_s, ledger_s, keys


def bench_import(work: Path, rows: int) -> tuple[float, float, int, int]:
    import wandb

    run = wandb.init(project="runledger-bench", id="bench-import", dir=str(work / "wandb-runs"))
    rng = random.Random(1)
    for step in range(1, rows + 1):
        row = {"loss": 3.0 / step**0.1, "lr": 3e-4, "grad_norm": rng.random(), "tokens": 65536}
        row |= {f"router/layer{i}/token_drop_rate": rng.random() * 0.1 for i in range(16)}
        run.log(row, step=step)
    run.finish()
    wandb_file = next(f for f in find_offline_runs(work / "wandb-runs") if "bench-import" in f.name)

    t0 = time.perf_counter()
    records = sum(1 for _ in read_records(wandb_file))
    reader_s = time.perf_counter() - t0

    sink = SpoolSink(work / "spool-import")
    t0 = time.perf_counter()
    stats = import_offline_run(wandb_file, sink)
    import_s = time.perf_counter() - t0
    sink.close()
    return stats.events / import_s, records / reader_s, stats.events, records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4, help="run pairs for the mirror overhead")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--rows", type=int, default=20_000, help="history rows of the imported run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-wandb-") as tmp:
        work = Path(tmp)
        offline_wandb(work)
        plain, mirrored, n = bench_mirror_overhead(work, args.rounds, args.steps)
        print(f"1. step time, tiny MoE on CPU, median of {n} steps each (W&B offline)")
        print(
            f"   without mirror {1000 * plain:8.2f} ms/step   with --wandb {1000 * mirrored:8.2f} ms/step"
            f"   ({100 * (mirrored / plain - 1):+.1f}%)"
        )
        wandb_s, ledger_s, keys = bench_log_cost(work, 200)
        print("2. training-thread cost per logged step, reference shape (48 layers × 384 experts, top-8)")
        print(
            f"   WandbMirror.log ({keys} keys) {1e6 * wandb_s:8.0f} µs/step   "
            f"ledger's 2 events built + spooled (emitter thread) {1e6 * ledger_s:8.0f} µs/step"
        )
        events_s, records_s, events, records = bench_import(work, args.rows)
        print(f"3. import of an offline run with {args.rows:,} history rows × 20 keys")
        print(
            f"   ledger ingest wandb {events_s:10,.0f} events/s ({events:,} events)   "
            f"wandb-core reader alone {records_s:10,.0f} records/s ({records:,} records)"
        )


if __name__ == "__main__":
    main()
