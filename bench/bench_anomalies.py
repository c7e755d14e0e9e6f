"""Detector cost per 1,000 steps at ingest (issue 44): the reference workload (``ledger simulate
reference-535b``) ingested from one spool into two fresh lake ledgers, one with the detectors
(``RULES_IN_FORCE``) and one without (``Ledger.anomaly_rules = ()``), alternating which goes first, in
the same run, so the machine's load cancels out of the ratio.

Per round, wall and CPU seconds of ``ingest_spool`` for each; printed: the medians, the difference
per 1,000 steps and the ratio, and the anomaly events recorded. Also the detectors alone: the
spool's events decoded once, then ``runledger.ledger.anomalies.derive`` timed over them (what the
commit round adds, without the events' own rows and leaves), with the rule set in force and, as its
baseline, set 1 (whose lasting conditions are reported at every step, not once per episode).

    python -m bench.bench_anomalies [--steps 2000] [--rounds 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.spool import SpoolReader
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.anomalies import RULE_SET_IN_FORCE, RULE_SETS, DetectorState, Rule, derive
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.schemas.codec import Event, decode_event


@dataclass
class Timings:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def add(self, wall_s: float, cpu_s: float) -> None:
        self.wall_s.append(wall_s)
        self.cpu_s.append(cpu_s)


def make_spool(work: Path, steps: int) -> Path:
    """The reference workload's events for ``steps`` steps, in a spool (made once)."""
    spool = work / f"spool-{steps}"
    if not spool.exists():
        result = CliRunner().invoke(
            app, ["simulate", "reference-535b", "--spool", str(spool), "--steps", str(steps)]
        )
        if result.exit_code != 0:
            raise SystemExit(f"simulate failed: {result.output.strip()}")
    return spool


def timed(run: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def ingest_once(work: Path, spool: Path, detectors: bool, batch_size: int) -> tuple[float, float, int]:
    """A fresh ledger ingesting the whole spool: (wall s, CPU s, anomaly events recorded)."""
    root = Path(tempfile.mkdtemp(prefix="ledger-", dir=work))
    try:
        ledger = Ledger.create(root)
        if not detectors:
            ledger.anomaly_rules = ()
        wall_s, cpu_s = timed(lambda: ingest_spool(ledger, spool, batch_size=batch_size))
        ledger.close()
        return wall_s, cpu_s, count_anomalies(root)
    finally:
        shutil.rmtree(root)


def count_anomalies(root: Path) -> int:
    reader = Reader(root)
    try:
        return int(reader.sql("SELECT count(*) FROM events WHERE type = 'ledger.anomaly'").rows[0][0])
    finally:
        reader.close()


def detectors_alone(spool: Path, rounds: int) -> dict[int, tuple[list[float], int, int]]:
    """Per rule set (the set in force and set 1): CPU seconds of ``derive`` over the spool's events
    per round, the events and the findings. The sets alternate within a round."""
    events = [
        e.envelope for r in SpoolReader(spool).read() if isinstance(e := decode_event(r.payload), Event)
    ]
    out: dict[int, tuple[list[float], int, int]] = {n: ([], len(events), 0) for n in (RULE_SET_IN_FORCE, 1)}
    for round_ in range(rounds):
        for number in sorted(out, reverse=round_ % 2 == 1):
            rules: tuple[Rule, ...] = RULE_SETS[number]
            start = time.process_time()
            found = sum(len(made) for _, made in derive(rules, DetectorState(), events))
            out[number][0].append(time.process_time() - start)
            out[number] = (out[number][0], len(events), found)
    return out


def per_thousand(seconds: float, steps: int) -> float:
    return seconds / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "runledger-bench-anomalies"
    )
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    spool = make_spool(args.work, args.steps)
    # Both ingests per round, their order alternated: load and warm caches fall on both alike.
    runs = {True: Timings(), False: Timings()}
    anomalies = 0
    for round_ in range(args.rounds):
        for detectors in (True, False) if round_ % 2 == 0 else (False, True):
            wall_s, cpu_s, found = ingest_once(args.work, spool, detectors, args.batch_size)
            runs[detectors].add(wall_s, cpu_s)
            anomalies = found if detectors else anomalies
    with_, without = runs[True], runs[False]
    print(f"reference-535b, {args.steps:,} steps, {args.rounds} rounds (medians), batch {args.batch_size:,}")
    for label, pick in (("wall", lambda t: t.wall_s), ("CPU", lambda t: t.cpu_s)):
        a, b = statistics.median(pick(with_)), statistics.median(pick(without))
        print(
            f"  ingest {label:4}: with detectors {a:7.2f} s, without {b:7.2f} s; "
            f"+{per_thousand(a - b, args.steps) * 1000:7.1f} ms per 1,000 steps, ratio {a / b:.3f}"
        )
    for number, (times, events, found) in detectors_alone(spool, args.rounds).items():
        alone = statistics.median(times)
        print(
            f"  detectors alone (CPU), rule set {number}: {alone:.3f} s over {events:,} events, "
            f"{per_thousand(alone, args.steps) * 1000:.1f} ms per 1,000 steps; {found} findings"
        )
    print(f"  anomaly events recorded at ingest: {anomalies}")


if __name__ == "__main__":
    main()
