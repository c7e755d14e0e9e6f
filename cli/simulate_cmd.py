"""`ledger simulate reference-535b`: emit the reference run's event stream (runledger.workflows.simulate).

A producer, like `ledger train`: the events go to the bus (the spool, or Kafka with ``--bus kafka``),
and `ledger ingest spool` (or `ledger ingest kafka`) folds them into a ledger. Prints what it emitted
as JSON, with ``undelivered``: the events Kafka did not take before the end, left in the outage spool
(``undelivered_spool``) for ``deliver_with`` (`ledger kafka drain-spool …`); when there are any, it
says so on stderr and exits 3.
"""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.kafka_cmd import BootstrapOption, kafka_errors, undelivered_exit, undelivered_of
from runledger.cli.output import SpoolOption, fail, print_json, progress

if TYPE_CHECKING:  # imported where used: the bus is slow to import
    from runledger.ingest.bus import EventSink


class Scenario(enum.StrEnum):
    reference_535b = "reference-535b"


class Bus(enum.StrEnum):
    spool = "spool"
    kafka = "kafka"


def simulate(
    scenario: Annotated[Scenario, typer.Argument(help="The run to simulate.")],
    steps: Annotated[
        int, typer.Option("--steps", help="Steps; a shorter run keeps the story at scaled positions.")
    ] = 390_000,
    metrics_every: Annotated[
        int, typer.Option("--metrics-every", help="Steps between step-metrics / router-stats events.")
    ] = 1,
    expert_counts_every: Annotated[
        int, typer.Option("--expert-counts-every", help="Steps between per-expert token counts.")
    ] = 100,
    rank_stats_every: Annotated[
        int, typer.Option("--rank-stats-every", help="Steps between the 792 per-rank stats events.")
    ] = 1000,
    checkpoint_every: Annotated[
        int | None,
        typer.Option(
            "--checkpoint-every", help="Steps between checkpoints (default: 1000 scaled to --steps)."
        ),
    ] = None,
    crashes: Annotated[int, typer.Option("--crashes", help="Crashes (each followed by a resume).")] = 19,
    seed: Annotated[int, typer.Option("--seed", help="Every id, time and value follows from it.")] = 0,
    run_id: Annotated[str, typer.Option("--run-id", help="The run's id.")] = "moe-535b",
    bus: Annotated[Bus, typer.Option("--bus", help="Where the events go.")] = Bus.spool,
    spool: SpoolOption = None,
    bootstrap: BootstrapOption = None,
) -> None:
    """Emit a faithful event stream of a reference training run (metrics, router stats, crashes,
    resumes, config changes and the repository's GitHub activity) through the bus.

    With --bus kafka, events Kafka has not taken when the run ends stay in the outage spool: the
    summary counts them (undelivered) and names the command that sends them, and the exit status is 3.
    """
    from runledger.ingest.bus import SpoolSink, default_spool_dir, open_sink
    from runledger.ingest.spool import SpoolLockedError
    from runledger.workflows.simulate import SimOptions
    from runledger.workflows.simulate import simulate as run_simulation

    try:
        options = SimOptions(
            steps=steps,
            metrics_every=metrics_every,
            expert_counts_every=expert_counts_every,
            rank_stats_every=rank_stats_every,
            checkpoint_every=checkpoint_every,
            crashes=crashes,
            seed=seed,
            run_id=run_id,
        )
    except ValueError as exc:
        raise fail(str(exc), 2) from None
    if bus is Bus.kafka and not bootstrap:
        raise fail("--bus kafka needs --bootstrap (or RUNLEDGER_KAFKA_BOOTSTRAP)", 2)
    spool_dir = spool if spool is not None else default_spool_dir()
    started = time.perf_counter()
    with kafka_errors(), progress("simulate", "steps") as report:
        try:
            sink: EventSink = SpoolSink(spool_dir) if bus is Bus.spool else open_sink(spool_dir, bootstrap)
        except SpoolLockedError as exc:
            raise fail(str(exc)) from None
        try:
            stats = run_simulation(sink, options, progress=report)
        finally:
            sink.close()
    undelivered = undelivered_of(sink)
    print_json(
        {
            "scenario": scenario.value,
            "run_id": run_id,
            "bus": bus.value,
            "spool": str(Path(spool_dir)),
            "events": stats.events,
            "values": stats.values,
            "steps_emitted": stats.steps_emitted,
            "attempts": stats.attempts,
            "crashes": stats.crashes,
            "switch_step": stats.switch_step,
            "by_type": stats.by_type,
            "seconds": round(time.perf_counter() - started, 3),
            **(undelivered.summary() if undelivered else _NOTHING_UNDELIVERED),
        }
    )
    if undelivered and undelivered.events:
        raise undelivered_exit(f"simulated {stats.events} events", undelivered)


# The spool bus is the bus itself: nothing waits off it.
_NOTHING_UNDELIVERED = {"undelivered": 0, "undelivered_spool": None, "deliver_with": None}
