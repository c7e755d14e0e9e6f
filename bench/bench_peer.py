"""The peer workload through the client library, beside the same rows written straight to Parquet
with pyarrow, in one run (issue 26, "Measured").

The workload is the anchor tracker workload of ../shared/reference/anchors.md (``bench_ledger``'s
``make_workload``: N steps × (20 scalars + 48 layers × 5 router stats), every 100 steps 48 × 384
expert counts, a 60-key config changed twice), written the way a user writes it:

    run = runledger.init(run_id, config=config, spool=spool)
    for step ...:
        run.log({...20 scalars...}, step=step)
        run.log_router(step, counts=…, drop=…, aux_loss=…, z_loss=…, entropy=…, tokens=…, top_k=8)
    run.finish()
    ingest_spool(Ledger.create(ledger), spool)          # what `ledger ingest spool` does

End to end is ``init`` → the last event queryable in the ledger. Three stores: part files (the
ingest makes the ledger); a lake made in the timed span (``Ledger.create_on_lake``); and a lake made
before it, as ``ledger init --catalog`` makes one once for every run (the span opens it as
``ledger ingest spool`` does: ``Ledger.create``). The baseline is
``bench_ledger.pyarrow_ceiling`` over the same values (no envelope, validation, hashing, durability),
timed in the same process right after. Each size is run ``--repeat`` times; medians are printed.

    python -m bench.bench_peer [--steps 500 1000 2000] [--repeat 3] [--profile FILE]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_ledger import EXPERTS, LAYERS, TOP_K, Workload, _config, make_workload, pyarrow_ceiling

TOKENS = 4096


@dataclass
class PeerSteps:
    """The workload as a user's loop holds it: a dict of scalars and NumPy arrays per step."""

    scalars: list[dict[str, float]]
    router: list[dict[str, np.ndarray]]
    lr_changes: dict[int, float]  # step → the new lr (the config changes twice)


def peer_steps(w: Workload) -> PeerSteps:
    config = _config()
    lr = float(config["lr"])
    changes: dict[int, float] = {}
    scalars: list[dict[str, float]] = []
    router: list[dict[str, np.ndarray]] = []
    tokens_k = TOKENS * TOP_K
    for step in range(1, w.steps + 1):
        i = step - 1
        if step in (w.steps * 2 // 5, w.steps * 4 // 5):
            lr /= 2
            changes[step] = lr
        row = w.scalars[i]
        step_time = 0.5 + 0.01 * row[0]
        values = {
            "loss": w.loss[i],
            "grad_norm": w.grad_norm[i],
            "lr": lr,
            "tokens": TOKENS,
            "total_tokens": TOKENS * step,
            "tokens_per_second": 81_920.0 / step_time,
            "mfu": 22.7 + row[1] - 1,
            "step_time_s": step_time,
        }
        values |= {f"s{k}": row[k] for k in range(12)}
        scalars.append(values)
        drop = np.asarray(w.drop_rate[i])
        arrays = {
            "tokens": np.full(LAYERS, TOKENS),
            "dropped": np.floor(tokens_k * drop),
            "drop": drop,
            "aux_loss": np.asarray(w.aux_loss[i]),
            "z_loss": np.asarray(w.z_loss[i]),
            "entropy": np.asarray(w.entropy[i]),
        }
        counts = w.expert_counts.get(step)
        if counts is not None:
            arrays["counts"] = np.asarray(counts)
        router.append(arrays)
    return PeerSteps(scalars, router, changes)


@dataclass
class PeerTimes:
    log_s: float  # init → finish returned (every event durable in the spool)
    ingest_s: float  # spool → ledger
    cpu_s: float  # CPU seconds of the process (every thread) over both
    events: int
    metric_values: int

    @property
    def total_s(self) -> float:
        return self.log_s + self.ingest_s


PART_FILES, LAKE, LAKE_MADE_BEFORE = "part files", "lake", "lake, made before"


def run_peer(
    work: Path, steps: PeerSteps, run_id: str = "peer-run", batch_size: int = 5000, *, store: str = PART_FILES
) -> PeerTimes:
    """The client-library path, timed: init → log/log_router → finish → ingest_spool (``store``: a
    lake is on DuckLake with the embedded DuckDB-file catalog, as ``ledger init --catalog duckdb:…``)."""
    import runledger
    from ingest.spool_ingester import ingest_spool
    from ledger.store import Ledger

    spool, ledger_dir = work / "spool", work / "ledger"
    catalog = f"duckdb:{ledger_dir / 'catalog.ducklake'}"
    if store == LAKE_MADE_BEFORE:  # what `ledger init --catalog` does, once, before any run
        Ledger.create_on_lake(ledger_dir, catalog).close()
    n = len(steps.scalars)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    run = runledger.init(
        run_id,
        config=_config(),
        spool=spool,
        state_dir=work / "state",
        queue_size=2 * n + 64,  # nothing dropped: the drain is timed instead
        handle_signals=False,
        capture_exceptions=False,
    )
    for i in range(n):
        step = i + 1
        lr = steps.lr_changes.get(step)
        if lr is not None:
            run.config.update({"lr": lr}, cause="schedule", step=step)
        run.log(steps.scalars[i], step=step)
        r = steps.router[i]
        run.log_router(step, top_k=TOP_K, **r)
    run.finish()
    t1 = time.perf_counter()
    if run.dropped:
        raise RuntimeError(f"{run.dropped} events dropped: the bench needs a bigger queue")
    if store == LAKE:
        with Ledger.create_on_lake(ledger_dir, catalog) as ledger:
            stats = ingest_spool(ledger, spool, batch_size=batch_size)
    else:  # what `ledger ingest spool` runs
        with Ledger.create(ledger_dir) as ledger:
            stats = ingest_spool(ledger, spool, batch_size=batch_size)
    t2 = time.perf_counter()
    return PeerTimes(t1 - t0, t2 - t1, time.process_time() - cpu0, stats.accepted, stats.metric_values)


def values_of(w: Workload) -> int:
    counted = sum(1 for step in range(1, w.steps + 1) if step in w.expert_counts)
    return w.steps * (20 + LAYERS * 5) + counted * LAYERS * EXPERTS


def measure(work: Path, n_steps: int, repeat: int, *, store: str = PART_FILES) -> dict[str, Any]:
    w = make_workload(n_steps)
    steps = peer_steps(w)
    peers: list[PeerTimes] = []
    ceilings: list[float] = []
    ceiling_cpus: list[float] = []
    rows = 0
    for k in range(repeat):
        here = work / f"{n_steps}-{k}"
        here.mkdir(parents=True)
        peers.append(run_peer(here / "peer", steps, store=store))
        (here / "arrow").mkdir()
        cpu0 = time.process_time()
        ceiling_s, rows = pyarrow_ceiling(here / "arrow", w)
        ceiling_cpus.append(time.process_time() - cpu0)
        ceilings.append(ceiling_s)
        shutil.rmtree(here, ignore_errors=True)
    return {
        "store": store,
        "steps": n_steps,
        "values": values_of(w),
        "events": peers[0].events,
        "log_s": statistics.median(p.log_s for p in peers),
        "ingest_s": statistics.median(p.ingest_s for p in peers),
        "total_s": statistics.median(p.total_s for p in peers),
        "ceiling_s": statistics.median(ceilings),
        "ratio": statistics.median(c / p.total_s for c, p in zip(ceilings, peers, strict=True)),
        "cpu_s": statistics.median(p.cpu_s for p in peers),
        "ceiling_cpu_s": statistics.median(ceiling_cpus),
        "cpu_ratio": statistics.median(c / p.cpu_s for c, p in zip(ceiling_cpus, peers, strict=True)),
        "rows": rows,
    }


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        f"{'store':>17} {'steps':>6} {'values':>10} {'events':>7} {'log→durable s':>14} {'ingest s':>9} "
        f"{'end to end s':>13} {'pyarrow s':>10} {'client/pyarrow':>15}   "
        f"{'CPU s':>6} {'pyarrow CPU s':>14} {'CPU ratio':>10}"
    )
    for r in results:
        print(
            f"{r['store']:>17} {r['steps']:6,d} {r['values']:10,d} {r['events']:7,d} {r['log_s']:14.2f} {r['ingest_s']:9.2f} "
            f"{r['total_s']:13.2f} {r['ceiling_s']:10.2f} {r['ratio']:15.0%}   "
            f"{r['cpu_s']:6.2f} {r['ceiling_cpu_s']:14.2f} {r['cpu_ratio']:10.0%}"
        )
    print("client/pyarrow: the pyarrow time over the client library's end-to-end time (goal >= 50%);")
    print("CPU: process CPU seconds (all threads), the figure that a loaded machine disturbs least")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--lake",
        action="store_true",
        help="also into a ledger on DuckLake (DuckDB-file catalog), made in the timed span and before it",
    )
    parser.add_argument("--profile", type=Path, help="cProfile one client-library run of the largest size")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runledger-peer-"))
    try:
        if args.profile is not None:
            import cProfile

            steps = peer_steps(make_workload(max(args.steps)))
            profiler = cProfile.Profile()
            profiler.enable()
            times = run_peer(work / "profiled", steps, store=LAKE_MADE_BEFORE if args.lake else PART_FILES)
            profiler.disable()
            profiler.dump_stats(args.profile)
            print(f"profiled: log {times.log_s:.2f} s, ingest {times.ingest_s:.2f} s → {args.profile}")
            return
        stores = [PART_FILES, LAKE, LAKE_MADE_BEFORE] if args.lake else [PART_FILES]
        print_table([measure(work, n, args.repeat, store=store) for n in args.steps for store in stores])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
