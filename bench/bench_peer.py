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

End to end is ``init`` → the last event queryable in the ledger. Stores: a new ledger as
``ledger ingest spool`` makes one today (``Ledger.create``: a lake with its SQLite catalog in the
folder, made in the timed span; the default), part files (``Ledger.create_part_files``, the format
before DuckLake, made in the span: run by this bench as commit 36b09ff had it, the last with that
format, in a subprocess on a copy of that commit's files, ``bench.base_tree``), and with ``--lake`` a lake on a catalog named by hand made in the
span (``Ledger.create_on_lake``) and before it, as ``ledger init --catalog`` makes one once for every
run. The baseline is ``bench_ledger.pyarrow_ceiling`` over the same values (no envelope, validation,
hashing, durability), timed in the same process right after. Each size is run ``--repeat`` times;
medians are printed.

``max_load``, the fifth router stat of issue 39, is measured three ways (``--max-load``, any of them;
default ``off field``): ``off``, not logged; ``field``, through ``log_router(max_load=…)`` (its
router field, a ``moe_layer_stats.max_load`` column); ``scalars``, as a user had to log it before
that field existed, 48 named scalars a step (``router/max_load/L00`` … ``L47``, in the step's
``run.log``). With either of the last two the pyarrow baseline holds the same 48 values a step in its
per-layer table (a ``max_load`` column) and in its events' JSON. The part-file format predates the
field: its store is measured ``off`` and ``scalars`` only.

    python -m bench.bench_peer [--steps 500 1000 2000] [--repeat 3] [--max-load off field scalars]
                               [--stores new files] [--lake] [--profile FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.base_tree import unpack_base
from bench.bench_ledger import EXPERTS, LAYERS, TOP_K, Workload, _config, make_workload, pyarrow_ceiling
from runledger.ledger.projectors import STEP_SCALARS

TOKENS = 4096
MAX_LOAD_NAMES = [f"router/max_load/L{layer:02d}" for layer in range(LAYERS)]  # the workaround's scalars
MaxLoad = Literal["off", "field", "scalars"]  # how the 48 per-layer max loads are logged (the module's text)
MAX_LOAD_LABELS: dict[str, str] = {"off": "-", "field": "field", "scalars": "48 sc."}


@dataclass
class PeerSteps:
    """The workload as a user's loop holds it: a dict of scalars and NumPy arrays per step."""

    scalars: list[dict[str, float]]
    router: list[dict[str, np.ndarray]]
    lr_changes: dict[int, float]  # step → the new lr (the config changes twice)
    max_load: list[list[float]]  # steps × layers: the busiest expert's load over the mean load


def max_loads(w: Workload, seed: int = 1) -> list[list[float]]:
    """A max/mean expert load per step and layer that follows the layer's drop rate (a busier
    expert drops more), with noise: realistic values, not a constant that compresses to nothing."""
    rng = np.random.default_rng(seed)
    drop = np.asarray(w.drop_rate)
    loads: list[list[float]] = (1.0 + 4.0 * drop + rng.uniform(0.0, 0.05, drop.shape)).tolist()
    return loads


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
    return PeerSteps(scalars, router, changes, max_loads(w))


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
NEW_LEDGER = "new ledger (lake)"  # Ledger.create on a new folder: the embedded SQLite-catalog lake
STORE_CHOICES = {"new": NEW_LEDGER, "files": PART_FILES}  # --stores


def step_scalars(steps: PeerSteps, max_load: MaxLoad) -> list[dict[str, float]]:
    """Each step's ``run.log`` dict; with ``max_load`` "scalars" its 48 per-layer values as named scalars."""
    if max_load != "scalars":
        return steps.scalars
    return [
        values | dict(zip(MAX_LOAD_NAMES, loads, strict=True))
        for values, loads in zip(steps.scalars, steps.max_load, strict=True)
    ]


def run_peer(
    work: Path,
    steps: PeerSteps,
    run_id: str = "peer-run",
    batch_size: int = 5000,
    *,
    store: str = NEW_LEDGER,
    max_load: MaxLoad = "off",
) -> PeerTimes:
    """The client-library path, timed: init → log/log_router → finish → ingest_spool (``store``: a
    lake is on DuckLake with the embedded SQLite catalog, as ``ledger init --catalog sqlite:…``;
    NEW_LEDGER: what ``ledger ingest spool`` makes of a new folder; PART_FILES: the old format).
    ``max_load``: how each step logs the 48 per-layer max loads (``MaxLoad``)."""
    import runledger
    from runledger.ingest.spool_ingester import ingest_spool
    from runledger.ledger.store import Ledger

    spool, ledger_dir = work / "spool", work / "ledger"
    catalog = f"sqlite:{ledger_dir / 'catalog.sqlite'}"
    if store == LAKE_MADE_BEFORE:  # what `ledger init --catalog` does, once, before any run
        Ledger.create_on_lake(ledger_dir, catalog).close()
    n = len(steps.scalars)
    scalars = step_scalars(steps, max_load)  # the user's dicts, built before the clock starts
    loads = [np.asarray(row) for row in steps.max_load]  # (as a trainer holds them: one array a step)
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
        run.log(scalars[i], step=step)
        r = steps.router[i]
        if max_load == "field":
            run.log_router(step, top_k=TOP_K, max_load=loads[i], **r)
        else:
            run.log_router(step, top_k=TOP_K, **r)
    run.finish()
    t1 = time.perf_counter()
    if run.dropped:
        raise RuntimeError(f"{run.dropped} events dropped: the bench needs a bigger queue")
    if store == LAKE:
        with Ledger.create_on_lake(ledger_dir, catalog) as ledger:
            stats = ingest_spool(ledger, spool, batch_size=batch_size)
    elif store == PART_FILES:  # (this tree has no part files: ``measure_part_files`` runs the old one)
        raise ValueError("part files are measured by the baseline's own bench: measure_part_files")
    else:  # what `ledger ingest spool` runs (a new folder: the embedded lake; else the one there)
        with Ledger.create(ledger_dir) as ledger:
            stats = ingest_spool(ledger, spool, batch_size=batch_size)
    t2 = time.perf_counter()
    return PeerTimes(t1 - t0, t2 - t1, time.process_time() - cpu0, stats.accepted, stats.metric_values)


def values_of(w: Workload, max_load: MaxLoad = "off") -> int:
    counted = sum(1 for step in range(1, w.steps + 1) if step in w.expert_counts)
    per_step = 20 + LAYERS * 5 + (LAYERS if max_load != "off" else 0)
    return w.steps * per_step + counted * LAYERS * EXPERTS


SCALAR_NAMES = [*STEP_SCALARS, *(f"s{k}" for k in range(12))]  # the typed fields' rows, then named scalars


def _step_scalar_values(w: Workload, step: int) -> list[float]:
    """The 20 scalars of ``step`` as ``bench_ledger.pyarrow_ceiling`` builds them."""
    row = w.scalars[step - 1]
    step_time = 0.5 + 0.01 * row[0]
    head = [w.loss[step - 1], w.grad_norm[step - 1], 3e-4, 4096, 4096 * step, 81_920.0 / step_time]
    return [*head, 22.7 + row[1] - 1, step_time, *row]


def _layer_dicts(w: Workload, step: int, loads: list[float]) -> list[dict[str, Any]]:
    """The router event's JSON per layer, with the max load beside the other stats."""
    i, counts = step - 1, w.expert_counts.get(step)
    drop, aux, z, ent = w.drop_rate[i], w.aux_loss[i], w.z_loss[i], w.entropy[i]
    return [
        {"layer": k, "drop": drop[k], "aux": aux[k], "z": z[k], "entropy": ent[k], "max_load": loads[k]}
        | ({"counts": counts[k]} if counts else {})
        for k in range(LAYERS)
    ]


def pyarrow_ceiling_max_load(work: Path, w: Workload, max_load: list[list[float]]) -> tuple[float, int]:
    """``bench_ledger.pyarrow_ceiling`` with the 48 max loads a step: a ``max_load`` column in the
    per-layer table and a key in each router event's JSON (where a direct writer would put them)."""
    t = time.perf_counter()
    metrics: dict[str, list[Any]] = {k: [] for k in ("step", "time", "name", "value", "stream_seq")}
    layer_columns = ("step", "time", "layer", "dropped", "token_drop_rate", "aux_loss", "z_loss", "entropy")
    layers: dict[str, list[Any]] = {k: [] for k in (*layer_columns, "max_load", "counts")}
    events: dict[str, list[Any]] = {k: [] for k in ("seq", "type", "step", "time", "data")}
    tokens_k = TOKENS * TOP_K
    for step in range(1, w.steps + 1):
        i, now, seq = step - 1, datetime.now(UTC), 2 * (step - 1)
        values = _step_scalar_values(w, step)
        # the scalars: 20 metric rows and one event
        metrics["step"] += [step] * 20
        metrics["time"] += [now] * 20
        metrics["name"] += SCALAR_NAMES
        metrics["value"] += values
        metrics["stream_seq"] += [seq] * 20
        events["seq"].append(seq)
        events["type"].append("step.metrics")
        events["step"].append(step)
        events["time"].append(now)
        events["data"].append(json.dumps(dict(zip(SCALAR_NAMES, values, strict=True))))
        # the router: 48 layer rows (max load included) and one event
        counts, drop = w.expert_counts.get(step), w.drop_rate[i]
        layers["step"] += [step] * LAYERS
        layers["time"] += [now] * LAYERS
        layers["layer"] += list(range(LAYERS))
        layers["dropped"] += [int(tokens_k * d) for d in drop]
        layers["token_drop_rate"] += drop
        layers["aux_loss"] += w.aux_loss[i]
        layers["z_loss"] += w.z_loss[i]
        layers["entropy"] += w.entropy[i]
        layers["max_load"] += max_load[i]
        layers["counts"] += counts if counts else [[]] * LAYERS
        events["seq"].append(seq + 1)
        events["type"].append("moe.router_stats")
        events["step"].append(step)
        events["time"].append(now)
        events["data"].append(json.dumps(_layer_dicts(w, step, max_load[i])))
    rows = 0
    for name, cols in (("metrics", metrics), ("moe_layer_stats", layers), ("events", events)):
        table = pa.table(cols)
        rows += table.num_rows
        pq.write_table(table, work / f"{name}.parquet", compression="zstd")
    return time.perf_counter() - t, rows


def measure(
    work: Path, n_steps: int, repeat: int, *, store: str = NEW_LEDGER, max_load: MaxLoad = "off"
) -> dict[str, Any]:
    w = make_workload(n_steps)
    steps = peer_steps(w)
    peers: list[PeerTimes] = []
    ceilings: list[float] = []
    ceiling_cpus: list[float] = []
    rows = 0
    for k in range(repeat):
        here = work / f"{n_steps}-{k}"
        here.mkdir(parents=True)
        peers.append(run_peer(here / "peer", steps, store=store, max_load=max_load))
        (here / "arrow").mkdir()
        cpu0 = time.process_time()
        if max_load != "off":
            ceiling_s, rows = pyarrow_ceiling_max_load(here / "arrow", w, steps.max_load)
        else:
            ceiling_s, rows = pyarrow_ceiling(here / "arrow", w)
        ceiling_cpus.append(time.process_time() - cpu0)
        ceilings.append(ceiling_s)
        shutil.rmtree(here, ignore_errors=True)
    return {
        "store": store,
        "max_load": max_load,
        "steps": n_steps,
        "values": values_of(w, max_load),
        "events": peers[0].events,
        "metric_values": peers[0].metric_values,
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


BASELINE_TIMEOUT_S = 3600


def measure_part_files(work: Path, n_steps: int, repeat: int, *, max_load: MaxLoad) -> dict[str, Any]:
    """The part-file store's figures, measured by this bench as commit 36b09ff had it (the last with
    that format), in a subprocess on that commit's files: the same workload, client and pyarrow
    baseline, the format's own code."""
    folder = work / "base36"  # (unpacked once per bench run)
    if not (folder / "bench" / "bench_peer.py").exists():
        unpack_base(folder)
    args = ["--stores", "files", "--steps", str(n_steps), "--repeat", str(repeat)]
    args += ["--max-load", "on" if max_load == "scalars" else "off", "--json"]
    env = {**os.environ, "PYTHONPATH": str(folder)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_peer", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=BASELINE_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the baseline's bench_peer failed: {done.stderr.strip()[-2000:]}")
    (figures,) = json.loads(done.stdout.strip().splitlines()[-1])
    return dict(figures) | {"max_load": max_load}  # (that bench says it as a bool)


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        f"{'store':>17} {'max_load':>8} {'steps':>6} {'values':>10} {'events':>7} {'log→durable s':>14} {'ingest s':>9} "
        f"{'end to end s':>13} {'pyarrow s':>10} {'client/pyarrow':>15}   "
        f"{'CPU s':>6} {'pyarrow CPU s':>14} {'CPU ratio':>10}"
    )
    for r in results:
        print(
            f"{r['store']:>17} {MAX_LOAD_LABELS[r['max_load']]:>8} {r['steps']:6,d} {r['values']:10,d} {r['events']:7,d} {r['log_s']:14.2f} {r['ingest_s']:9.2f} "
            f"{r['total_s']:13.2f} {r['ceiling_s']:10.2f} {r['ratio']:15.0%}   "
            f"{r['cpu_s']:6.2f} {r['ceiling_cpu_s']:14.2f} {r['cpu_ratio']:10.0%}"
        )
    print("client/pyarrow: the pyarrow time over the client library's end-to-end time (goal >= 50%);")
    print("CPU: process CPU seconds (all threads), the figure that a loaded machine disturbs least")
    print("max_load: the 48 per-layer max loads not logged (-), through log_router's field (field), or as")
    print("48 named scalars a step (48 sc., the way before the field; the part-file format knows only this)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--lake",
        action="store_true",
        help="also into a ledger on DuckLake (SQLite catalog), made in the timed span and before it",
    )
    parser.add_argument(
        "--stores",
        nargs="+",
        choices=sorted(STORE_CHOICES),
        default=["new", "files"],
        help="new: a new ledger as `ledger ingest spool` makes one (the embedded lake); files: part files",
    )
    parser.add_argument(
        "--max-load",
        nargs="+",
        choices=["off", "field", "scalars"],
        default=["off", "field"],
        help="how the 48 per-layer max loads are logged: not (off), log_router's field, 48 named scalars",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--profile", type=Path, help="cProfile one client-library run of the largest size")
    args = parser.parse_args()
    if min(args.steps) < 1 or args.repeat < 1:
        parser.error("--steps and --repeat must be positive")
    loads: list[MaxLoad] = args.max_load
    work = Path(tempfile.mkdtemp(prefix="runledger-peer-"))
    try:
        if args.profile is not None:
            import cProfile

            steps = peer_steps(make_workload(max(args.steps)))
            profiler = cProfile.Profile()
            profiler.enable()
            store = LAKE_MADE_BEFORE if args.lake else STORE_CHOICES[args.stores[0]]
            times = run_peer(work / "profiled", steps, store=store, max_load=loads[-1])
            profiler.disable()
            profiler.dump_stats(args.profile)
            print(f"profiled: log {times.log_s:.2f} s, ingest {times.ingest_s:.2f} s → {args.profile}")
            return
        stores = [STORE_CHOICES[name] for name in args.stores] + (
            [LAKE, LAKE_MADE_BEFORE] if args.lake else []
        )
        results = [
            measure_part_files(work, n, args.repeat, max_load=with_loads)
            if store == PART_FILES
            else measure(work, n, args.repeat, store=store, max_load=with_loads)
            for n in args.steps
            for with_loads in loads
            for store in stores
            if not (store == PART_FILES and with_loads == "field")  # (the format predates the field)
        ]
        print_table(results)
        if args.json:
            print(json.dumps(results))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
