"""A flood of incidents cannot slow every question (issue 42): ``state`` and ``history`` at a
40,000-step ledger with 3 incidents and with ~30,000, both in one run, each beside its baseline.

The flood is the issue's: 792 ranks whose rank-stat events (every 1,000 steps) are numbered from one
shared counter, so each rank's own ``seq`` skips on every event and the ledger records one
``ledger.incident`` (a gap) per event: 40 × 792 − 792 = 30,888 incidents. The quiet ledger has the
same events with each rank numbering its own, and 3 gaps made by hand.

Per ledger, the median of ``--rounds`` calls of:

* ``state`` (library): ``Reader.state``; and the baseline beside it, the path before the change:
  every state event and incident read with ``EVERY_STATE_TYPE`` (each incident decoded in Python:
  from the ``events`` table, as ``state_events`` now holds none) and folded;
* ``state, summary of the JSON`` / ``of typed rows``: the summary spelled out here (``FOLD_TYPES``
  events + one GROUP BY over the incidents: ``runledger.ledger.views.incident_ranges_query``) over
  the ``events`` table's JSON or over the ``ingest_incidents`` table's columns; ``Reader._state``
  adds the Reader's own ranges first, so these count the GROUP BY twice (compare them with each other);
* the state's two reads apart: its state events (``Reader.events``: the fold's scan) and its
  incident ranges (``Reader.incident_ranges``: the GROUP BY);
* ``history`` (library): ``Reader.history``; the baseline: one history item per incident event;
* ``ledger state`` / ``ledger history`` (the CLI in this process, table output to a string).

Ledgers are built once under ``--work`` (default /tmp/runledger-bench-incidents) and reused.

Measured (2026-12-06, a shared 2-core machine at load ~9, so wall times are loose; medians of 5,
wall / CPU ms): before, the code of commit f06e49e (every incident decoded and listed); after, this
change with the Reader reading incidents in summary. 3 incidents → 30,888:

    before  Reader.state      18 / 17  →  707 / 462     ledger state (CLI)    258 / 160  →  3,070 / 1,979
            Reader.history    40 / 35  →  794 / 508     ledger history (CLI)  411 / 222  →  1,305 /   807
    after   Reader.state      31 / 27  →  151 / 136     ledger state (CLI)    190 / 188  →    447 /   291
            Reader.history    49 / 45  →  182 / 132     ledger history (CLI)  282 / 191  →    602 /   323

(state lines: 3 → 30,888 before, 1 → 5 after). What the flood still cost was DuckDB reading the
incidents' canonical JSON from ``state_events`` (~20 ms) and parsing it (~40 ms CPU).

Measured again (2026-12-06, the same shared machine at load ~4.7, medians of 7, wall / CPU ms) after
the typed table: each ``ledger.incident`` is also an ``ingest_incidents`` row (its projector, at the
commit), and the Reader folds those columns (the JSON only on a lake made before the table). 3
incidents → 30,888, fresh ledgers (``--work`` empty):

    Reader.state      38 / 36  →   61 /  58     ledger state (CLI)    421 / 227  →  738 / 304
    Reader.history    91 / 48  →   94 /  63     ledger history (CLI)  546 / 320  →  512 / 276
    summary of the JSON, state    41 / 38  →  164 / 108;  of typed rows  40 / 40  →  132 /  79
    summary of the JSON, history 125 / 65  →  193 / 133;  of typed rows  58 / 45  →  264 /  90

so the flood costs Reader.state 1.6x and Reader.history 1.3x (CPU) of the quiet ledger's, against
5.0x and 2.9x before the table. What it still costs: the flood's 30,888 incident events are still
``state_events`` rows (the fold's reads skip them by type, ~5 ms), and the GROUP BY of 30,888 typed
rows (~10 ms). (Before this date ``build`` looked for ``LEDGER.json``, which a lake has not, so every
run re-emitted into the old spool and rebuilt: now it looks for ``LAKE.json``.)

Measured again (2026-12-06, the same machine at load ~20 — wall times are meaningless there, CPU ms
loose; medians of 7) after ingest's incidents left ``state_events`` (``runledger.ledger.fold.STATE_TYPES``:
a commit writes them to ``ingest_incidents`` only), on fresh ledgers and, in the run after, on ledgers
written before (their ``state_events`` still holding the 30,888), CPU ms, 3 incidents → 30,888:

                                   fresh ledgers        written before
    state events (the fold's scan)  11.8 →  15.2          12.6 →  22.2
    incident ranges (the GROUP BY)   9.3 →  32.9           7.4 →  30.7
    Reader.state                    83.4 → 103.4 (1.24x)  78.1 → 104.0 (1.33x)
    Reader.history                  95.8 → 121.0 (1.26x)  79.4 → 117.9 (1.48x)

so the fold's scan no longer grows with the incidents; what a flood still costs is the GROUP BY's
read of 30,888 typed rows (11 columns from each commit's file: ~10 ms of Parquet decoding on an idle
core, more under load), which only a summary the writer keeps could remove (not done: see issue 42).

    python -m bench.bench_incidents [--steps 40000] [--rounds 7] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.fold import EVERY_STATE_TYPE, FOLD_TYPES, RANGE_KINDS, RunState, with_incident_ranges
from runledger.ledger.history import HistoryItem, incident_items
from runledger.ledger.lake import LAKE_MARKER
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.ledger.views import incident_range_facts, incident_ranges_query
from runledger.schemas import catalogue as c
from runledger.schemas import config_hash, make_event
from runledger.schemas import payloads as p
from runledger.schemas.launch import Provenance, launch_event, launch_fields

RUN_ID = "flood"
RANKS = 792
RANK_EVERY = 1000  # rank-stat events every this many steps (the reference run's rhythm)
CHECKPOINT_EVERY = 500
T0 = datetime(2026, 1, 1, tzinfo=UTC)
QUIET_GAPS = (1_000, 2_000, 3_000)  # the quiet ledger's three hand-made gaps: metric seqs skipped


def _launch(source: str) -> Any:
    fields = launch_fields(
        config={"lr": 3e-4, "moe": {"capacity_factor": 1.25}},
        config_hash=config_hash({"lr": 3e-4, "moe": {"capacity_factor": 1.25}}),
        provenance=Provenance(host="node-000", git_commit=None, software={}),
        repository=None,
        world_size=RANKS,
        external={},
    )
    payload, _ = launch_event(fields, attempt=1)
    return make_event(payload, source=source, stream=RUN_ID, run_id=RUN_ID, attempt=1, step=0, seq=0, time=T0)


def emit_run(sink: SpoolSink, steps: int, *, flood: bool) -> int:
    """A ``steps``-step run: one metrics event a step (rank 0's source, seq 1, 2, …), a checkpoint
    every 500 steps, and every 1,000 steps one rank-stat event from each of 792 rank sources; with
    ``flood`` those ranks share one counter (a gap per event), else each counts its own and rank 0
    skips three seqs. Returns the events emitted."""
    main = f"trainer/{RUN_ID}/a1/rank0"
    sink.emit(_launch(main))
    seq, shared, emitted = 0, 0, 1
    own = dict.fromkeys(range(RANKS), 0)
    for step in range(1, steps + 1):
        at = T0 + timedelta(seconds=step)
        seq += 2 if not flood and step in QUIET_GAPS else 1
        env: dict[str, Any] = {"stream": RUN_ID, "run_id": RUN_ID, "attempt": 1, "step": step, "time": at}
        sink.emit(make_event(p.StepMetrics(loss=1.0 / step), source=main, seq=seq, **env))
        emitted += 1
        if step % CHECKPOINT_EVERY == 0:
            seq += 1
            sink.emit(make_event(p.CheckpointSaved(path=f"ckpt/{step}"), source=main, seq=seq, **env))
            emitted += 1
        if step % RANK_EVERY:
            continue
        for rank in range(RANKS):
            shared += 1
            own[rank] += 1
            rank_seq = shared if flood else own[rank]
            stats = p.RankStats(rank=rank, host=f"node-{rank // 8:03d}", step_time_s=1.0)
            sink.emit(make_event(stats, source=f"trainer/{RUN_ID}/a1/ranks/{rank}", seq=rank_seq, **env))
            emitted += 1
    return emitted


def build(work: Path, steps: int, *, flood: bool) -> Path:
    """The ledger (built once, then reused)."""
    name = f"{'flood' if flood else 'quiet'}-{steps}"
    root = work / name / "ledger"
    if (root / LAKE_MARKER).exists():  # (a lake's marker: ``LEDGER.json`` named none, so each run rebuilt)
        return root
    spool = work / name / "spool"
    sink = SpoolSink(spool)
    emitted = emit_run(sink, steps, flood=flood)
    sink.close()
    started = time.perf_counter()
    stats = ingest_spool(Ledger.create(root), spool)
    print(
        f"built {name}: {emitted:,} events, {stats.accepted:,} accepted in {time.perf_counter() - started:.0f} s"
    )
    return root


def median_ms(call: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """The median wall time and the median CPU time (this process, every thread: DuckDB's too) of
    ``call``, in ms: the machine may be shared, and then the CPU time says more of the work."""
    call()  # warm: the first call opens files and fills DuckDB's caches
    wall, cpu = [], []
    for _ in range(rounds):
        started, started_cpu = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return statistics.median(wall) * 1000, statistics.median(cpu) * 1000


def summary_state(reader: Reader, run_id: str, *, typed: bool = False) -> RunState:
    """The state as a Reader that reads incidents in summary makes it: the fold over ``FOLD_TYPES``
    and one GROUP BY over the incidents (``runledger.ledger.views.incident_ranges_query``), spelled out here
    (the ranges a Reader that already does so added are left out first); ``typed``: over the
    ``ingest_incidents`` table's columns, else over ``state_events``' JSON."""
    state = reader._state(run_id, reader.events(run_id, FOLD_TYPES))
    query, params = incident_ranges_query(
        run_id, state_table=typed, attempt=state.attempt, step=state.step, typed_table=typed
    )
    ranges = incident_range_facts(reader.sql(query, params).records())
    own = [fact for fact in state.incidents if fact["kind"] not in RANGE_KINDS]
    state.incidents = with_incident_ranges(own, ranges)
    return state


def summary_history(reader: Reader, run_id: str, *, typed: bool = False) -> list[HistoryItem]:
    items = reader._history(run_id, reader.events(run_id, FOLD_TYPES))
    query, params = incident_ranges_query(run_id, state_table=typed, typed_table=typed)
    items = [item for item in items if item.kind != c.LEDGER_INCIDENT]
    items += incident_items(incident_range_facts(reader.sql(query, params).records()))
    return sorted(items, key=lambda item: item.time)


def cli_ms(root: Path, command: str, rounds: int) -> tuple[float, float]:
    """``ledger <command> RUN`` in this process, its table printed to a string."""
    runner = CliRunner()

    def call() -> None:
        result = runner.invoke(app, [command, RUN_ID, "--ledger", str(root)], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output

    return median_ms(call, rounds)


def measure(root: Path, rounds: int) -> dict[str, Any]:
    reader = Reader(root)
    try:
        return _measure(reader, root, rounds)
    finally:
        reader.close()


def _measure(reader: Reader, root: Path, rounds: int) -> dict[str, Any]:
    state, every = reader.state(RUN_ID), reader._state(RUN_ID, reader.events(RUN_ID, EVERY_STATE_TYPE))
    assert summary_state(reader, RUN_ID).incidents == every.incidents, "the two paths disagree"
    assert summary_state(reader, RUN_ID, typed=True).incidents == every.incidents, "the typed table disagrees"
    counted = sum(fact.get("incidents", 1) for fact in every.incidents)
    return {
        "incidents": counted,
        "state lines": len(state.incidents),
        "Reader.state": median_ms(lambda: reader.state(RUN_ID), rounds),
        "state, every incident decoded": median_ms(
            lambda: reader._state(RUN_ID, reader.events(RUN_ID, EVERY_STATE_TYPE)), rounds
        ),
        "state, summary of the JSON": median_ms(lambda: summary_state(reader, RUN_ID), rounds),
        "state, summary of typed rows": median_ms(lambda: summary_state(reader, RUN_ID, typed=True), rounds),
        "state events (the fold's scan)": median_ms(lambda: reader.events(RUN_ID), rounds),
        "incident ranges (the GROUP BY)": median_ms(lambda: reader.incident_ranges(RUN_ID), rounds),
        "Reader.history": median_ms(lambda: reader.history(RUN_ID), rounds),
        "history, every incident decoded": median_ms(
            lambda: reader._history(RUN_ID, reader.events(RUN_ID, EVERY_STATE_TYPE)), rounds
        ),
        "history, summary of the JSON": median_ms(lambda: summary_history(reader, RUN_ID), rounds),
        "history, summary of typed rows": median_ms(
            lambda: summary_history(reader, RUN_ID, typed=True), rounds
        ),
        "ledger state (CLI, in process)": cli_ms(root, "state", max(1, rounds // 2)),
        "ledger history (CLI, in process)": cli_ms(root, "history", max(1, rounds // 2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--work", type=Path, default=Path("/tmp/runledger-bench-incidents"))
    args = parser.parse_args()
    results = {
        kind: measure(build(args.work, args.steps, flood=kind == "flood"), args.rounds)
        for kind in ("quiet", "flood")
    }
    steps = f"at {args.steps:,} steps, median ms"
    print(f"{steps:34} {'3 incidents: wall':>18} {'cpu':>8} {'flood: wall':>14} {'cpu':>8}")
    for name in results["quiet"]:
        quiet, flood = results["quiet"][name], results["flood"][name]
        if isinstance(quiet, tuple) and isinstance(flood, tuple):
            print(f"{name:34} {quiet[0]:>18,.1f} {quiet[1]:>8,.1f} {flood[0]:>14,.1f} {flood[1]:>8,.1f}")
        else:
            print(f"{name:34} {quiet:>18,} {'':>8} {flood:>14,}")


if __name__ == "__main__":
    main()
