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
   each: wall s and peak RSS; verify must exit 0);
4. docs/scale.md's analyst questions (``bench.bench_reference.questions``, the baseline's own copy of
   it for the part files): each through ``Reader`` beside a plain DuckDB scan of the same tables (for
   the lake: the same SQL on the attached DuckLake catalog, ``LakePlain``), in one subprocess per
   format (its peak RSS); each answer must agree with its plain scan (``DIFFERENT`` otherwise).

Replay (``ledger replay``) reads Kafka only; it is left out here (``bench.bench_reference --kafka``
measures it on the lake).

    .venv/bin/python -m bench.bench_one_format                      # 20k and 100k events (~4 min quiet)
    .venv/bin/python -m bench.bench_one_format --events 20000       # one small size (~1 min)
    .venv/bin/python -m bench.bench_one_format --large              # adds 300k events (~+5 min)
    nice -n 10 .venv/bin/python -m bench.bench_one_format --events 1100000 --repeat 3  # ~1.05M events
    nice -n 10 .venv/bin/python -m bench.bench_one_format --events --full --repeat 3  # the whole run
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
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from bench import bench_reference
from bench.base_tree import BaseTree, unpack_base
from bench.bench_lake_ledger import CLI, ENV, ROOT, _run
from bench.measure import Measured, run_measured
from runledger.ledger.lake import Catalog, LakeFolder, connect_data
from runledger.schemas.note import write_keypair
from runledger.workflows.simulate import REFERENCE_STEPS, RUN_ID

PART_FILES, LAKE = "part files", "lake (SQLite, embedded)"
EVENTS_SQL = (
    "SELECT count(*), count(DISTINCT (stream, stream_seq)), sum(hash(canonical)::HUGEINT) FROM events"
)
FORMATS = (PART_FILES, LAKE)
EVENTS_PER_STEP = 2.97  # `ledger simulate reference-535b --steps 7000`: 20,793 events (crashes re-emit steps)
DEFAULT_EVENTS = (20_000, 100_000)
LARGE_EVENTS = 300_000
FULL_RUN = -1  # ``--full``: the reference run's own steps (390,000: 1,111,034 events)
# The analysts' questions of docs/scale.md, asked in a process of their own: the part files' by the
# baseline's bench.bench_reference (its plain scan reads part files), the lake's by this one's with
# the plain scan reading the lake's tables (``LakePlain``). Prints {question: [api ms, plain ms, same]}.
QUESTIONS_SCRIPT = """import json, sys
from pathlib import Path
from bench import bench_reference
if sys.argv[4] == "lake":
    from bench.bench_one_format import LakePlain
    bench_reference.Plain = LakePlain
asked = bench_reference.questions(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
print(json.dumps(asked))
"""
LOG_KEY = "bench-log"
BASE = BaseTree(ROOT / ".base36")  # replaced in ``main`` by the baseline's unpacked files
# The baseline's code predates the one import name (issue 41): its packages are top-level folders of
# its tree (its ``runledger`` holds the client only), so its modules are named bare, spelled apart here
# because this checkout's own code must never name them so.
BASE_CLI = ".".join(("cli", "main"))
BASE_CREATE = "import sys; from {}.store import Ledger; Ledger.create_part_files(sys.argv[1]).close()".format(
    "ledger"
)
BASE_CREATE_TIMEOUT_S = 120


@dataclass
class Size:
    """One size's figures: ``figures[format][name]`` (seconds, MB, events/s) and answers compared."""

    events_asked: int
    steps: int
    events: int = 0
    switch_step: int = 0
    figures: dict[str, dict[str, float]] = field(default_factory=lambda: {f: {} for f in FORMATS})
    different: list[str] = field(default_factory=list)


class LakePlain(bench_reference.Plain):
    """bench_reference's plain DuckDB scans on a lake ledger: the same SQL, each table read from the
    lake's catalog attached read-only (no runledger view, fold or reader in between)."""

    def __init__(self, ledger: Path) -> None:
        lake = LakeFolder.read(ledger)
        if lake is None:
            raise SystemExit(f"{ledger}: not a lake ledger (no LAKE.json)")
        catalog = Catalog.parse(lake.catalog)
        self.root = ledger
        self.con: duckdb.DuckDBPyConnection = connect_data(catalog, lake.data_path)
        self.con.execute(f"ATTACH '{catalog.uri()}' AS plain_lake (READ_ONLY, DATA_PATH '{lake.data_path}')")

    def t(self, table: str) -> str:
        return f"plain_lake.{table}"


# ----------------------------------------------------------------- making the ledgers
def make_spool(work: Path, size: Size) -> Path:
    """The reference workload's events for the size's steps, in a spool (made once per size); the
    step of the dispatcher switch noted for the ``blame`` question."""
    spool = work / f"spool-{size.steps}"
    emitted = _run("simulate", "reference-535b", "--spool", spool, "--steps", str(size.steps))
    size.switch_step = int(json.loads(emitted)["switch_step"])
    return spool


def new_ledger(work: Path, fmt: str, steps: int, base: BaseTree) -> Path:
    """A folder for a new ledger: the baseline made as part files beforehand by the baseline's code
    (its CLI opens a ledger that is there); the lake left for ``ledger ingest spool`` to make, as a
    new user's ingest does."""
    folder = work / f"{'files' if fmt == PART_FILES else 'lake'}-{steps}"
    if fmt == PART_FILES:
        done = subprocess.run(
            base.python("-c", BASE_CREATE, folder),
            cwd=base.folder,
            env=base.env,
            capture_output=True,
            text=True,
            timeout=BASE_CREATE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the baseline's create_part_files failed: {done.stderr.strip()[-2000:]}")
    return folder


def measured(args: list[str | Path], what: str, fmt: str = LAKE) -> Measured:
    """A CLI subprocess timed by GNU time, the part files' by the baseline's code (``BASE``); a
    failure stops the bench with the command's output."""
    if fmt == PART_FILES:
        m = run_measured(BASE.python("-m", BASE_CLI, *args), env=BASE.env, cwd=BASE.folder)
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
            stem = name.removesuffix("_s")
            size.figures[fmt][name] = statistics.median(m.seconds for m in done)
            size.figures[fmt][stem + "_cpu_s"] = statistics.median(m.cpu_s for m in done)
            size.figures[fmt][stem + "_peak_rss_mb"] = max(m.peak_rss_mb for m in done)
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


QUESTION_KEYS: dict[str, str] = {}  # a question's figure key -> its label (the step asked named generically)


def _question_key(label: str, steps: int) -> str:
    """A figure key for a question: its label with the steps it asks about put generically."""
    mid = steps // 2
    generic = label.replace(f"{mid - 1000}..{mid + 1000}", "mid±1000").replace(f"--step {mid}", "--step mid")
    key = "q " + generic.removesuffix(" (ms)")
    QUESTION_KEYS[key] = generic
    return key


def analyst_questions(size: Size, ledgers: dict[str, Path]) -> None:
    """Phase 4: docs/scale.md's questions, one process per format (its peak RSS); every answer must
    agree with the plain scan of the same ledger (phase 1 showed both ledgers hold the same events)."""
    answers: dict[str, dict[str, list[Any]]] = {}
    for fmt, ledger in ledgers.items():
        args = [str(ledger), str(size.steps), str(size.switch_step), "lake" if fmt == LAKE else "files"]
        if fmt == PART_FILES:
            cmd = BASE.python("-c", QUESTIONS_SCRIPT, *args)
            m = run_measured(cmd, env=BASE.env, cwd=BASE.folder)
        else:
            m = run_measured([CLI[0], "-c", QUESTIONS_SCRIPT, *args], env=ENV, cwd=ROOT)
        if m.returncode != 0:
            raise RuntimeError(f"questions ({fmt}) exited {m.returncode}: {m.stdout.strip()[-2000:]}")
        answers[fmt] = json.loads(m.stdout.strip().splitlines()[-1])
        size.figures[fmt] |= {"questions_s": m.seconds, "questions_peak_rss_mb": m.peak_rss_mb}
        for label, (api_ms, plain_ms, same) in answers[fmt].items():
            key = _question_key(label, size.steps)
            size.figures[fmt] |= {f"{key} ms": api_ms, f"{key} plain ms": plain_ms}
            if not same:
                size.different.append(f"{fmt}: {label} disagrees with the plain scan")
    if set(answers[LAKE]) != set(answers[PART_FILES]):
        size.different.append("the questions asked")


def run_size(work: Path, events: int, batch_size: int, repeat: int) -> Size:
    steps = REFERENCE_STEPS if events == FULL_RUN else max(100, round(events / EVENTS_PER_STEP))
    size = Size(events, steps)
    here = work / str(size.steps)
    here.mkdir()
    spool = make_spool(here, size)
    ledgers = {fmt: new_ledger(here, fmt, size.steps, BASE) for fmt in FORMATS}
    # Each phase's figures printed as it ends: the full run takes hours on a shared machine.
    ingest(size, spool, ledgers, batch_size)
    print_phase(size, "ingest")
    shutil.rmtree(spool)  # the full run's spool and two ledgers do not fit the disk together
    one_shot(size, ledgers, repeat)
    print_phase(size, "one-shot CLI")
    analyst_questions(size, ledgers)
    print_phase(size, "questions")
    sign_publish_verify(size, here, ledgers)
    shutil.rmtree(here, ignore_errors=True)  # the next size needs the disk
    return size


# ----------------------------------------------------------------- printing
def print_phase(size: Size, phase: str) -> None:
    """The figures so far, one JSON line (a run stopped later still leaves these)."""
    print(f"after {phase} ({size.events:,} events): {json.dumps(size.figures)}", flush=True)


ROWS = (
    ("ingest s", "ingest_s", ".1f"),
    ("ingest CPU s", "ingest_cpu_s", ".1f"),
    ("ingest events/s", "ingest_events_per_s", ",.0f"),
    ("ingest peak RSS MB", "ingest_peak_rss_mb", ".0f"),
    ("ledger MB on disk", "ledger_mb", ".0f"),
    ("`ledger query` count(*) s (process)", "query_count_s", ".2f"),
    ("`ledger query` count(*) CPU s", "query_count_cpu_s", ".2f"),
    ("`ledger query` count(*) peak RSS MB", "query_count_peak_rss_mb", ".0f"),
    ("`ledger state --step` s (process)", "state_step_s", ".2f"),
    ("`ledger state --step` CPU s", "state_step_cpu_s", ".2f"),
    ("`ledger state --step` peak RSS MB", "state_step_peak_rss_mb", ".0f"),
    ("`ledger checkpoint` s", "checkpoint_s", ".2f"),
    ("`ledger checkpoint` CPU s", "checkpoint_cpu_s", ".2f"),
    ("`ledger publish` s (from scratch)", "publish_s", ".2f"),
    ("`ledger publish` CPU s", "publish_cpu_s", ".2f"),
    ("`ledger publish` peak RSS MB", "publish_peak_rss_mb", ".0f"),
    ("`ledger verify` s", "verify_s", ".2f"),
    ("`ledger verify` CPU s", "verify_cpu_s", ".2f"),
    ("`ledger verify` peak RSS MB", "verify_peak_rss_mb", ".0f"),
    ("analyst questions, whole process s", "questions_s", ".1f"),
    ("analyst questions, process peak RSS MB", "questions_peak_rss_mb", ".0f"),
)


def print_size(size: Size) -> None:
    print(f"\n## {size.events:,} events ({size.steps:,} steps of reference-535b)")
    if size.different:
        print(f"DIFFERENT between the formats: {', '.join(size.different)}")
    print(f"| figure | {PART_FILES} (baseline) | {LAKE} | lake / part files |")
    print("|---|---|---|---|")
    question_rows = [
        (f"{QUESTION_KEYS[key]}{plain}", f"{key}{plain} ms", ".1f")
        for key in QUESTION_KEYS
        for plain in ("", " plain")
        if f"{key}{plain} ms" in size.figures[LAKE]
    ]
    for label, key, spec in (*ROWS, *question_rows):
        base, lake = size.figures[PART_FILES].get(key, 0.0), size.figures[LAKE].get(key, 0.0)
        ratio = f"{lake / base:.2f}x" if base else "-"
        print(f"| {label} | {base:{spec}} | {lake:{spec}} | {ratio} |", flush=True)


def as_json(sizes: list[Size]) -> list[dict[str, Any]]:
    return [
        {"events": s.events, "steps": s.steps, "different": s.different, "figures": s.figures} for s in sizes
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--events", type=int, nargs="*", default=list(DEFAULT_EVENTS), help="sizes, in events"
    )
    parser.add_argument("--large", action="store_true", help=f"also {LARGE_EVENTS:,} events (~5 min more)")
    parser.add_argument(
        "--full", action="store_true", help=f"also the whole reference run ({REFERENCE_STEPS:,} steps)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="runs of each one-shot CLI question")
    parser.add_argument("--batch-size", type=int, default=5000)
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    if any(n < 1 for n in args.events) or args.repeat < 1 or args.batch_size < 1:
        parser.error("--events, --repeat and --batch-size must be positive")
    sizes_asked = [*args.events, *([LARGE_EVENTS] if args.large else []), *([FULL_RUN] if args.full else [])]
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
