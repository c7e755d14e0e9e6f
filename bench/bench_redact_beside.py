"""A redaction beside idle ledgers (the CI failure of 2026-12-07): ``ledger redact`` on a SQLite-catalog
lake with 0, 2 and 5 other ledgers of the same lake open and idle (an ingester between batches, a
live page's reader), each beside the 0 in the same run.

A redaction ends by compacting the catalog's storage (``LakeTables._compact_catalog``: a VACUUM
between two checkpoints of its WAL, which wait for every open read transaction). An idle ledger
held one while DuckDB's ``fetchone`` left its last result open, so each checkpoint waited out its
busy timeout (30 s): 6 threads redacting took 308 s, and one redaction beside 2 idle ledgers 61.3 s
(1.2 s alone). Per size, ``--rounds`` redactions, each on a fresh lake (its build not timed): the
median wall and the catalog's WAL before the redaction (whether a checkpoint by another process
found a reader in its way).

    python -m bench.bench_redact_beside [--rounds 3] [--work DIR]

Measured (2026-12-07, a shared 2-core machine while a CI run used both cores; medians of 3):

    idle ledgers  redact wall  checkpoint before
    0                  1.43 s  free
    2                  1.41 s  free
    5                  1.38 s  free
    baseline: beside 1 connection holding a read (as idle ledgers did): 61.58 s,
              recorded; erasure left pending (told in one line)

so idle ledgers no longer cost a redaction anything; a connection that holds a read still costs two
busy timeouts (``VACUUM_BUSY_S``), and the redaction now says its erasure is pending rather than
reporting it done (before the change, one redaction beside 2 idle ledgers took 61.3 s and said done).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runledger.ledger.query import Reader
from runledger.ledger.redaction import redact
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import payloads as p
from tests.support.factory import RunBuilder

_CHECKPOINT = (
    "import sqlite3, sys; db = sqlite3.connect(sys.argv[1], timeout=1); "
    "print(db.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchall()[0][0])"
)


def _lake(folder: Path) -> tuple[Path, Path, str]:
    """A lake of one run (200 steps and a note), on a SQLite catalog: (ledger, catalog, the note's id)."""
    run = RunBuilder(run_id="run-a")
    run.start()
    for step in range(1, 201):
        run.step(step)
        if step == 100:
            run._emit(p.Annotation(author="bench", text="a token in a note"), step)
    root, catalog = folder / "ledger", folder / "catalog.sqlite"
    with Ledger.create_on_lake(root, f"sqlite:{catalog}", folder / "data", ledger_id="bench") as ledger:
        ledger.commit([SourceRecord("spool:bench", i, raw) for i, raw in enumerate(run.events)])
    with Reader(root) as reader:
        note = str(reader.sql("SELECT id FROM events WHERE type = 'runledger.annotation'").rows[0][0])
    return root, catalog, note


def _checkpoint_free(catalog: Path) -> bool:
    out = subprocess.run(
        [sys.executable, "-c", _CHECKPOINT, str(catalog)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip() == "0"


def one_round(folder: Path, idle: int) -> tuple[float, bool]:
    """(the redaction's wall seconds, whether a checkpoint was free before it) beside ``idle`` ledgers."""
    root, catalog, note = _lake(folder)
    others = [Ledger.open(root) for _ in range(idle)]
    try:
        with Ledger.open(root) as writer:  # a commit by another ledger puts frames in the WAL
            writer.commit([])
        free = _checkpoint_free(catalog)
        started = time.perf_counter()
        redact(root, note, reason="bench", actor="bench", private_key=None)
        return time.perf_counter() - started, free
    finally:
        for other in others:
            other.close()


def held_round(folder: Path) -> tuple[float, str]:
    """The baseline: beside one connection left as a ledger's were before (its last ``fetchone``
    open, so its read transaction too): (wall seconds, how the redaction ended)."""
    from runledger.ledger.lake import ALIAS, LakeTables
    from runledger.ledger.store import LedgerError

    root, catalog, note = _lake(folder)
    with LakeTables(f"sqlite:{catalog}", folder / "data", create=False) as held:
        held.con.execute(f"SELECT key FROM __ducklake_metadata_{ALIAS}.ducklake_metadata").fetchone()
        with Ledger.open(root) as writer:
            writer.commit([])
        started = time.perf_counter()
        try:
            redact(root, note, reason="bench", actor="bench", private_key=None)
            ended = "erased"
        except LedgerError:
            ended = "recorded; erasure left pending (told in one line)"
        return time.perf_counter() - started, ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runledger-bench-redact-", dir=args.work))
    try:
        print(f"{'idle ledgers':<13} {'redact wall':>11}  checkpoint before")
        for idle in (0, 2, 5):
            walls, frees = [], []
            for n in range(args.rounds):
                wall, free = one_round(work / f"idle{idle}-{n}", idle)
                walls.append(wall)
                frees.append(free)
            state = "free" if all(frees) else f"busy {frees.count(False)} of {len(frees)}"
            print(f"{idle:<13} {statistics.median(walls):>9.2f} s  {state}")
        wall, ended = held_round(work / "held")
        print(f"baseline: beside 1 connection holding a read (as idle ledgers did): {wall:.2f} s, {ended}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
