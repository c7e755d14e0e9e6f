"""Client library overhead per logged step, beside ``wandb.log`` (offline) of the same values, in one run.

The reference shape: 32 scalars (``simulate.SCALAR_NAMES`` plus StepMetrics' fields) and the router
block of 48 MoE layers × 5 statistics (drop rate, dropped, aux loss, z loss, entropy) with the
expert counts as a 48 × 384 array. Values change every step (a decaying noisy loss, random routing).

* runledger: ``run.log(scalars)`` + ``run.log_router(step, counts=…, …)`` into a spool, as NumPy
  values and (if torch is installed) as torch tensors; the caller's time per step (what the training
  loop pays: the emitter thread builds and writes the events) and the end-to-end time per step
  including draining the queue to the spool (``finish``), with the number of events dropped (0: the
  queue kept up);
* W&B: ``wandb.log`` of the same values as one row (the 240 router numbers as ``router/layer{i}/…``
  keys, each layer's counts as an array, which W&B turns into a histogram), offline, caller time per
  step, and end-to-end including ``wandb.finish``.

* ``run.log`` of 4 scalars alone (``--logs`` calls), from 1 thread and from 16 threads logging to
  one run: the hot path's cost per call, what the emitter's one lock (``seq`` taken with the put,
  so threads never interleave the numbering) costs a single-threaded loop and how it holds up when
  16 threads contend for it.

    python -m bench.bench_client [--steps 300] [--logs 20000]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

warnings.filterwarnings("ignore")

LAYERS, EXPERTS, TOP_K = 48, 384, 8
TOKENS_PER_LAYER = 46_137_344 // 8  # the reference run's tokens per step, per data-parallel shard
WARMUP = 20


def scalar_names() -> list[str]:
    from runledger.workflows.simulate import SCALAR_NAMES

    fields = ["loss", "grad_norm", "lr", "tokens", "total_tokens", "tokens_per_second", "mfu", "step_time_s"]
    return fields + list(SCALAR_NAMES)  # 8 + 24 = 32


class Steps:
    """Realistic, changing values for each step (generated before timing starts)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        names = scalar_names()
        self.scalars: list[dict[str, float]] = []
        self.router: list[dict[str, np.ndarray]] = []
        for step in range(n):
            loss = 2.0 + 6.0 * math.exp(-step / 80) + rng.normal(0, 0.02)
            row = {name: float(rng.gamma(2.0, 0.5)) for name in names}
            row |= {"loss": loss, "lr": 3e-4 * min(1.0, (step + 1) / 50), "tokens": 46_137_344.0}
            row["total_tokens"] = 46_137_344.0 * (step + 1)
            self.scalars.append(row)
            share = rng.dirichlet(np.full(EXPERTS, 20.0), size=LAYERS)
            counts = np.minimum(
                np.rint(share * TOKENS_PER_LAYER * TOP_K), 1.25 * TOKENS_PER_LAYER * TOP_K / EXPERTS
            )
            kept = counts.sum(axis=1)
            self.router.append(
                {
                    "counts": counts,
                    "drop": 1 - kept / (TOKENS_PER_LAYER * TOP_K),
                    "aux_loss": 1.0 + rng.gamma(2.0, 0.005, LAYERS),
                    "z_loss": rng.gamma(3.0, 0.3, LAYERS),
                    "entropy": math.log(EXPERTS) - rng.gamma(2.0, 0.05, LAYERS),
                }
            )


def timed(n: int, call: Callable[[int], None], drain: Callable[[], None]) -> tuple[float, float]:
    """(caller µs per step, end-to-end µs per step including the drain), after ``WARMUP`` steps."""
    for i in range(WARMUP):
        call(i)
    t0 = time.perf_counter()
    for i in range(WARMUP, n):
        call(i)
    caller = time.perf_counter() - t0
    drain()
    total = time.perf_counter() - t0
    steps = n - WARMUP
    return 1e6 * caller / steps, 1e6 * total / steps


def bench_runledger(work: Path, steps: Steps, n: int, as_torch: bool) -> tuple[float, float, int]:
    import runledger

    scalars, router = steps.scalars, steps.router
    if as_torch:
        import torch

        scalars = [{k: torch.tensor(v) for k, v in row.items()} for row in scalars]
        router = [{k: torch.from_numpy(v) for k, v in r.items()} for r in router]
    tag = "torch" if as_torch else "numpy"
    run = runledger.init(
        f"bench-{tag}",
        config={"layers": LAYERS, "experts": EXPERTS},
        spool=work / f"spool-{tag}",
        state_dir=work / "state",
        queue_size=2 * n + 16,  # large enough that nothing is dropped: the drain is timed instead
        handle_signals=False,
    )

    def call(i: int) -> None:
        run.log(scalars[i], step=i)
        r = router[i]
        run.log_router(
            i,
            counts=r["counts"],
            drop=r["drop"],
            aux_loss=r["aux_loss"],
            z_loss=r["z_loss"],
            entropy=r["entropy"],
            top_k=TOP_K,
        )

    caller_us, total_us = timed(n, call, run.finish)
    return caller_us, total_us, run.dropped


def bench_plain_log(work: Path, threads: int, n: int) -> tuple[float, float, int]:
    """(caller µs per ``run.log`` of 4 scalars, end-to-end µs per call, dropped) with ``threads``
    threads sharing ``n`` calls on one run."""
    import threading

    import runledger

    run = runledger.init(
        f"bench-log-{threads}",
        spool=work / f"spool-log-{threads}",
        state_dir=work / "state",
        queue_size=n + 16,
        handle_signals=False,
    )
    per_thread = n // threads

    def work_of(k: int) -> None:
        for i in range(per_thread):
            run.log({"loss": 2.0, "lr": 3e-4, "grad_norm": 1.0, "i": float(i)}, step=k * per_thread + i)

    workers = [threading.Thread(target=work_of, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    caller = time.perf_counter() - t0
    run.finish()
    total = time.perf_counter() - t0
    calls = per_thread * threads
    return 1e6 * caller / calls, 1e6 * total / calls, run.dropped


def bench_wandb(work: Path, steps: Steps, n: int) -> tuple[float, float]:
    from runledger.ingest.wandb_mirror import offline_environment

    settings = offline_environment(work / "wandb")
    os.environ.update(settings)
    Path(settings["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)
    import wandb

    rows: list[dict[str, Any]] = []
    for scalars, r in zip(steps.scalars, steps.router, strict=True):
        row: dict[str, Any] = dict(scalars)
        for layer in range(LAYERS):
            prefix = f"router/layer{layer}/"
            row[prefix + "token_drop_rate"] = float(r["drop"][layer])
            row[prefix + "dropped"] = float(r["drop"][layer] * TOKENS_PER_LAYER * TOP_K)
            row[prefix + "aux_loss"] = float(r["aux_loss"][layer])
            row[prefix + "z_loss"] = float(r["z_loss"][layer])
            row[prefix + "entropy"] = float(r["entropy"][layer])
            row[prefix + "expert_counts"] = r["counts"][layer]  # W&B makes it a histogram
        rows.append(row)
    run = wandb.init(project="runledger-bench", config={"layers": LAYERS, "experts": EXPERTS})

    def call(i: int) -> None:
        run.log(rows[i], step=i)

    result = timed(n, call, run.finish)
    wandb.teardown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--logs", type=int, default=20_000, help="run.log calls of the plain-log lines")
    args = parser.parse_args()
    n = args.steps + WARMUP
    steps = Steps(n)
    print(
        f"per logged step: 32 scalars + {LAYERS} layers × 5 router stats + {LAYERS} × {EXPERTS} expert counts"
    )
    print(f"{args.steps} steps each (after {WARMUP} untimed), one process\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines: list[tuple[str, float, float, str]] = []
        caller, total, dropped = bench_runledger(work, steps, n, as_torch=False)
        lines.append(("runledger log+log_router (NumPy)", caller, total, f"{dropped} dropped"))
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
        else:
            caller, total, dropped = bench_runledger(work, steps, n, as_torch=True)
            lines.append(("runledger log+log_router (torch)", caller, total, f"{dropped} dropped"))
        plain = []
        for threads in (1, 16):
            caller, total, dropped = bench_plain_log(work, threads, args.logs)
            plain.append(
                (f"runledger log, 4 scalars, {threads} thread(s)", caller, total, f"{dropped} dropped")
            )
        caller, total = bench_wandb(work, steps, n)
        lines.append(("wandb.log offline (baseline)", caller, total, ""))
    width = max(len(line[0]) for line in lines)
    print(f"{'':{width}}  {'caller µs/step':>15} {'steps/s':>9}   {'end-to-end µs/step':>19} {'steps/s':>9}")
    for name, caller_us, total_us, note in lines:
        print(
            f"{name:{width}}  {caller_us:15,.0f} {1e6 / caller_us:9,.0f}   "
            f"{total_us:19,.0f} {1e6 / total_us:9,.0f}  {note}"
        )
    print(f"\nper run.log call ({args.logs:,} calls):")
    for name, caller_us, total_us, note in plain:
        print(
            f"{name:{width}}  {caller_us:15,.1f} {1e6 / caller_us:9,.0f}   "
            f"{total_us:19,.1f} {1e6 / total_us:9,.0f}  {note}"
        )
    base = lines[-1]
    for name, caller_us, total_us, _ in lines[:-1]:
        print(
            f"\n{name}: caller {base[1] / caller_us:.1f}× faster than wandb.log, "
            f"end-to-end {base[2] / total_us:.1f}×",
            end="",
        )
    print()


if __name__ == "__main__":
    main()
