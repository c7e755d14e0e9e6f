"""Trainer benchmarks on CPU, each figure beside its baseline from the same run.

1. Step time with telemetry on (router-stat hooks, the packed stats tensor, metric events through
   the emitter into a spool) vs. off (loss only), in alternating blocks of steps of the same tiny
   Megatron-Core MoE GPT; medians over all steps after each block's warm-up.
2. The emitter alone: events/s its thread hands to a spool (the trainer's own event mix).
3. Events/s the emitter sustains without slowing the loop: training with K extra router-stats
   events submitted per step to a second emitter, for growing K: the offered and emitted rates,
   drops, and the median step time beside the K = 0 baseline.

    python -m bench.bench_trainer [--rounds 4] [--steps 40] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

warnings.filterwarnings("ignore")  # Megatron-Core's notes about Transformer Engine/Apex on CPU

from runledger.ingest.bus import SpoolSink  # noqa: E402
from runledger.schemas.payloads import MoeLayerStats, MoeRouterStats, StepMetrics  # noqa: E402
from runledger.trainer.config import TINY_CPU, edit_config_file, load_config, write_config  # noqa: E402
from runledger.trainer.loop import train  # noqa: E402
from runledger.trainer.telemetry import Emitter, StepReport  # noqa: E402

SETTLE = 2  # steps after a switch left out (the file reload, hooks (un)installed, caches)
TINY = [*TINY_CPU, "moe.capacity_factor=1.0", "schedule.decay='constant'", "telemetry.peak_tflops=0.16"]
_runs = itertools.count()


def _config_file(work: Path, steps: int) -> Path:
    n = next(_runs)
    path = work / f"bench{n}.toml"
    overrides = [*TINY, f"run.run_id=bench-{n}", f"run.steps={steps}", f"checkpoint.dir={work / f'ck{n}'}"]
    write_config(path, load_config(None, overrides))
    return path


def _train(path: Path, progress: Callable[[StepReport], None]) -> None:
    """Train the run of ``path`` (watched: the progress callback may edit it), into a spool."""
    sink = SpoolSink(path.with_suffix(".spool"))
    try:
        train(path, sink, progress=progress)
    finally:
        sink.close()


def bench_step_time(work: Path, blocks: int, block: int) -> tuple[float, float, int]:
    """Telemetry switched on and off live (a config edit) every ``block`` steps, in one run, so
    both modes see the same model, allocator and background load."""
    times: dict[bool, list[float]] = {True: [], False: []}
    path = _config_file(work, 2 * blocks * block)

    def progress(report: StepReport) -> None:
        index, offset = divmod(report.step - 1, block)
        mode = index % 2 == 0  # even blocks on, odd blocks off
        if offset >= SETTLE:
            times[mode].append(report.step_time_s)
        if offset == block - 1:
            edit_config_file(path, {"telemetry.enabled": not mode})

    _train(path, progress)
    return statistics.median(times[True]), statistics.median(times[False]), len(times[True])


def _router_payload() -> MoeRouterStats:
    layer = MoeLayerStats(
        layer=0, tokens=512, top_k=2, dropped=40, token_drop_rate=0.04, expert_counts=[123] * 8, aux_loss=1.01
    )
    return MoeRouterStats(layers=[layer, layer])


def bench_emitter(work: Path, events: int) -> float:
    sink = SpoolSink(work / "emitter")
    emitter = Emitter(
        sink, source="bench/emitter", stream="bench", run_id="bench", attempt=1, queue_size=events + 1
    )
    metrics, router = StepMetrics(loss=2.0, lr=1e-3, tokens=512, scalars={"aux_loss": 1.0}), _router_payload()
    started = time.perf_counter()
    for i in range(events):
        emitter.submit(metrics if i % 2 else router, step=i)
    emitter.close()
    elapsed = time.perf_counter() - started
    sink.close()
    return emitter.emitted / elapsed


def bench_loaded_emitter(
    work: Path, ks: Sequence[int], rounds: int, block: int
) -> list[tuple[int, int, int, float]]:
    """One run (telemetry on); block after block, K extra router-stats events per step go to a
    second emitter (its own spool), drained at each block's end (between steps, outside step
    times). Rows: K, events emitted, events dropped, median step time."""
    sink = SpoolSink(work / "side")
    side = Emitter(sink, source="bench/side", stream="bench", run_id="bench", attempt=1, queue_size=4096)
    payload = _router_payload()
    schedule = [k for _ in range(rounds) for k in ks]
    times: dict[int, list[float]] = {k: [] for k in ks}
    emitted: dict[int, int] = dict.fromkeys(ks, 0)
    dropped: dict[int, int] = dict.fromkeys(ks, 0)
    mark = {"emitted": 0, "dropped": 0}

    def progress(report: StepReport) -> None:
        index, offset = divmod(report.step - 1, block)
        k = schedule[index]
        if offset >= SETTLE:
            times[k].append(report.step_time_s)
        for _ in range(k):
            side.submit(payload, step=report.step)
        if offset == block - 1:
            side.flush(sync=False)
            emitted[k] += side.emitted - mark["emitted"]
            dropped[k] += side.dropped - mark["dropped"]
            mark.update(emitted=side.emitted, dropped=side.dropped)

    _train(_config_file(work, len(schedule) * block), progress)
    side.close()
    sink.close()
    return [(k, emitted[k], dropped[k], statistics.median(times[k])) for k in ks]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8, help="block pairs (1) and rounds of K (3)")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 12-step blocks")
    args = parser.parse_args()
    rounds, steps = (3, 12) if args.quick else (args.rounds, args.steps)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _train(_config_file(work, 4), lambda report: None)  # import and first-build costs out

        on, off, n = bench_step_time(work, rounds, steps)
        print(
            f"1. step time, tiny MoE GPT on CPU ({n} steps per mode, {rounds} on/off block pairs in one run)"
        )
        print(f"   {'telemetry on':>16} {'telemetry off':>16} {'overhead':>10}")
        print(f"   {1000 * on:13.2f} ms {1000 * off:13.2f} ms {100 * (on / off - 1):+9.1f}%")

        rate = bench_emitter(work, 20_000)
        print("\n2. emitter alone: 20,000 events (step metrics + 2-layer router stats) into a spool")
        print(f"   {rate:13,.0f} events/s")

        print("\n3. K extra router-stats events per step on a second emitter, while training (one run)")
        print(
            "   events/s = K ÷ median step time: the rate the loop offers, all of it emitted unless dropped"
        )
        print(f"   {'K/step':>7} {'events/s':>10} {'emitted':>8} {'dropped':>8} {'step ms':>8} {'vs K=0':>7}")
        rows = bench_loaded_emitter(work, (0, 10, 50, 100, 200, 500, 1000), rounds, steps)
        base = rows[0][3]
        for k, emitted, dropped, median in rows:
            print(
                f"   {k:>7} {k / median:10,.0f} {emitted:>8} {dropped:>8} {1000 * median:8.2f} "
                f"{100 * (median / base - 1):+6.1f}%"
            )


if __name__ == "__main__":
    main()
