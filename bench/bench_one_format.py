"""A new ledger on the one table format (DuckLake, embedded SQLite catalog: ``Ledger.create``) beside
the old format (part files: ``Ledger.create_part_files`` of commit 36b09ff, the last that had it,
run from a copy of that commit's files: ``bench.base_tree``), the baseline, in one run (issue 39,
"Measured").

For each size (events of the reference workload: ``ledger simulate reference-535b``, the whole
stream with rank stats and expert counts, the steps chosen to give about that many events):

1. ingest: ``ledger ingest spool`` into a new ledger of each format, a subprocess each (wall s,
   events/s, its own peak RSS from GNU time: ``bench.measure``); both ledgers must then hold the same
   events (count, distinct positions, a hash of every canonical event; ``DIFFERENT`` otherwise);
2. the one-shot CLI as whole processes: ``ledger query "SELECT count(*) FROM events"`` and
   ``ledger state RUN --step MID -f json``, the median of ``--repeat`` (5) runs each, outputs compared;
3. ``ledger checkpoint``, ``ledger publish DEST`` and ``ledger verify`` with one log key (a subprocess
   each: wall s and peak RSS; verify must exit 0).

    .venv/bin/python -m bench.bench_one_format                      # 20k and 100k events (~4 min quiet)
    .venv/bin/python -m bench.bench_one_format --events 20000       # one small size (~1 min)
    .venv/bin/python -m bench.bench_one_format --large              # adds 300k events (~+5 min)
    .venv/bin/python -m bench.bench_one_format --json figures.json  # the figures as JSON as well

The machine this was written on has 2 cores shared with other work: wall times are noisy (CPU s is
printed beside them); the ratio column (lake / part files, each pair measured back to back) is the
figure to read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.base_tree import BaseTree, unpack_base
from bench.bench_lake_ledger import CLI, ENV, ROOT, _run
from bench.measure import Measured, run_measured
from runledger.schemas.note import write_keypair
from runledger.workflows.simulate import RUN_ID

PART_FILES, LAKE = "part files", "lake (SQLite, embedded)"
EVENTS_SQL = (
    "SELECT count(*), count(DISTINCT (stream, stream_seq)), sum(hash(canonical)::HUGEINT) FROM events"
)
FORMATS = (PART_FILES, LAKE)
EVENTS_PER_STEP = 2.97  # `ledger simulate reference-535b --steps 7000`: 20,793 events (crashes re-emit steps)
DEFAULT_EVENTS = (20_000, 100_000)
LARGE_EVENTS = 300_000
LOG_KEY = "bench-log"
BASE = BaseTree(ROOT / ".base36")  # replaced in ``main`` by the baseline's unpacked files


@dataclass
class Size:
    """One size's figures: ``figures[format][name]`` (seconds, MB, events/s) and answers compared."""

    events_asked: int
    steps: int
    events: int = 0
    figures: dict[str, dict[str, float]] = field(default_factory=lambda: {f: {} for f in FORMATS})
    different: list[str] = field(default_factory=list)


# ----------------------------------------------------------------- making the ledgers
def make_spool(work: Path, steps: int) -> Path:
    """The reference workload's events for ``steps`` steps, in a spool (made once per size)."""
    spool = work / f"spool-{steps}"
    _run("simulate", "reference-535b", "--spool", spool, "--steps", str(steps))
    return spool


def new_ledger(work: Path, fmt: str, steps: int, base: BaseTree) -> Path:
    """A folder for a new ledger: the baseline made as part files beforehand by the baseline's code
    (its CLI opens a ledger that is there); the lake left for ``ledger ingest spool`` to make, as a
    new user's ingest does."""
    folder = work / f"{'files' if fmt == PART_FILES else 'lake'}-{steps}"
    if fmt == PART_FILES:
        base.create_part_files(folder)
    return folder


def measured(args: list[str | Path], what: str, fmt: str = LAKE) -> Measured:
    """A CLI subprocess timed by GNU time, the part files' by the baseline's code (``BASE``); a
    failure stops the bench with the command's output."""
    if fmt == PART_FILES:
        m = run_measured(BASE.python("-m", "runledger.cli.main", *args), env=BASE.env, cwd=BASE.folder)
    else:
        m = run_measured([*CLI, *map(str, args)], env=ENV, cwd=ROOT)
    if m.returncode != 0:
        raise RuntimeError(f"{what} exited {m.returncode}: {m.stdout.strip()[-2000:]}")
    return m


def _events(ledger: Path, fmt: str) -> str:
    """The events' count, distinct positions and a hash of every canonical event, as CSV."""
    return measured(["query", EVENTS_SQL, "-f", "csv", "--ledger", ledger], "events", fmt).stdout


# ----------------------------------------------------------------- the phases
def ingest(size: Size, spool: Path, ledgers: dict[str, Path], batch_size: int) -> None:
    """Phase 1: the spool into each new ledger; the same events must land in both."""
    answers = {}
    for fmt, ledger in ledgers.items():
        m = measured(
            ["ingest", "spool", "--spool", spool, "--ledger", ledger, "--batch-size", str(batch_size)],
            "ingest",
            fmt,
        )
        answers[fmt] = _events(ledger, fmt)
        size.events = int(answers[fmt].splitlines()[1].split(",")[0])  # (a header line, then the row)
        size.figures[fmt] |= {
            "ingest_s": m.seconds,
            "ingest_cpu_s": m.cpu_s,
            "ingest_events_per_s": size.events / m.seconds,
            "ingest_peak_rss_mb": m.peak_rss_mb,
            "ledger_mb": sum(p.stat().st_size for p in ledger.rglob("*") if p.is_file()) / 1e6,
        }
    if answers[LAKE] != answers[PART_FILES]:
        size.different.append("ingested events")


def one_shot(size: Size, ledgers: dict[str, Path], repeat: int) -> None:
    """Phase 2: the CLI's one-shot questions as whole processes (start-up included), median of
    ``repeat``, the formats interleaved so that a slow moment of the machine hits both alike."""
    questions = {
        "query_count_s": ["query", "SELECT count(*) FROM events", "-f", "csv"],
        "state_step_s": ["state", RUN_ID, "--step", str(size.steps // 2), "-f", "json"],
    }
    for name, args in questions.items():
        runs: dict[str, list[Measured]] = {fmt: [] for fmt in ledgers}
        for _ in range(repeat):
            for fmt, ledger in ledgers.items():
                runs[fmt].append(measured([*args, "--ledger", ledger], name, fmt))
        outputs = {fmt: done[-1].stdout for fmt, done in runs.items()}
        for fmt, done in runs.items():
            size.figures[fmt][name] = statistics.median(m.seconds for m in done)
            size.figures[fmt][name.removesuffix("_s") + "_cpu_s"] = statistics.median(m.cpu_s for m in done)
        if outputs[LAKE] != outputs[PART_FILES]:
            size.different.append(name)


def sign_publish_verify(size: Size, work: Path, ledgers: dict[str, Path]) -> None:
    """Phase 3: one log key per ledger; checkpoint, publish to a folder, verify (which must pass)."""
    for fmt, ledger in ledgers.items():
        keys = work / f"keys-{ledger.name}"
        write_keypair(keys, LOG_KEY)
        site = work / f"site-{ledger.name}"
        steps: dict[str, list[str | Path]] = {
            "checkpoint": ["checkpoint", "--ledger", ledger, "--keys", keys],
            "publish": ["publish", site, "--ledger", ledger, "--keys", keys],
            "verify": ["verify", "--ledger", ledger, "--keys", keys],
        }
        for name, args in steps.items():
            m = measured(args, name, fmt)
            size.figures[fmt] |= {
                f"{name}_s": m.seconds,
                f"{name}_cpu_s": m.cpu_s,
                f"{name}_peak_rss_mb": m.peak_rss_mb,
            }


def run_size(work: Path, events: int, batch_size: int, repeat: int) -> Size:
    size = Size(events, max(100, round(events / EVENTS_PER_STEP)))
    here = work / str(size.steps)
    here.mkdir()
    spool = make_spool(here, size.steps)
    ledgers = {fmt: new_ledger(here, fmt, size.steps, BASE) for fmt in FORMATS}
    ingest(size, spool, ledgers, batch_size)
    one_shot(size, ledgers, repeat)
    sign_publish_verify(size, here, ledgers)
    shutil.rmtree(here, ignore_errors=True)  # the next size needs the disk
    return size


# ----------------------------------------------------------------- printing
ROWS = (
    ("ingest s", "ingest_s", ".1f"),
    ("ingest CPU s", "ingest_cpu_s", ".1f"),
    ("ingest events/s", "ingest_events_per_s", ",.0f"),
    ("ingest peak RSS MB", "ingest_peak_rss_mb", ".0f"),
    ("ledger MB on disk", "ledger_mb", ".0f"),
    ("`ledger query` count(*) s (process)", "query_count_s", ".2f"),
    ("`ledger query` count(*) CPU s", "query_count_cpu_s", ".2f"),
    ("`ledger state --step` s (process)", "state_step_s", ".2f"),
    ("`ledger state --step` CPU s", "state_step_cpu_s", ".2f"),
    ("`ledger checkpoint` s", "checkpoint_s", ".2f"),
    ("`ledger checkpoint` CPU s", "checkpoint_cpu_s", ".2f"),
    ("`ledger publish` s (from scratch)", "publish_s", ".2f"),
    ("`ledger publish` CPU s", "publish_cpu_s", ".2f"),
    ("`ledger publish` peak RSS MB", "publish_peak_rss_mb", ".0f"),
    ("`ledger verify` s", "verify_s", ".2f"),
    ("`ledger verify` CPU s", "verify_cpu_s", ".2f"),
    ("`ledger verify` peak RSS MB", "verify_peak_rss_mb", ".0f"),
)


def print_size(size: Size) -> None:
    print(f"\n## {size.events:,} events ({size.steps:,} steps of reference-535b)")
    if size.different:
        print(f"DIFFERENT between the formats: {', '.join(size.different)}")
    print(f"| figure | {PART_FILES} (baseline) | {LAKE} | lake / part files |")
    print("|---|---|---|---|")
    for label, key, spec in ROWS:
        base, lake = size.figures[PART_FILES][key], size.figures[LAKE][key]
        ratio = f"{lake / base:.2f}x" if base else "-"
        print(f"| {label} | {base:{spec}} | {lake:{spec}} | {ratio} |", flush=True)


def as_json(sizes: list[Size]) -> list[dict[str, Any]]:
    return [
        {"events": s.events, "steps": s.steps, "different": s.different, "figures": s.figures} for s in sizes
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--events", type=int, nargs="+", default=list(DEFAULT_EVENTS), help="sizes, in events"
    )
    parser.add_argument("--large", action="store_true", help=f"also {LARGE_EVENTS:,} events (~5 min more)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each one-shot CLI question")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    if any(n < 1 for n in args.events) or args.repeat < 1 or args.batch_size < 1:
        parser.error("--events, --repeat and --batch-size must be positive")
    sizes_asked = [*args.events, *([LARGE_EVENTS] if args.large else [])]
    # Every ledger in a folder of its own, removed at the end whatever happens.
    work = Path(tempfile.mkdtemp(prefix="bench-one-format-"))
    sizes: list[Size] = []
    global BASE
    try:
        BASE = unpack_base(work / "base")  # the part-file format's code, run as subprocesses
        for events in sizes_asked:
            started = time.perf_counter()
            sizes.append(run_size(work, events, args.batch_size, args.repeat))
            print_size(sizes[-1])
            print(f"(this size took {time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + json.dumps(as_json(sizes)))
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(sizes), indent=1) + "\n")


if __name__ == "__main__":
    main()
