"""SIGKILL the ingest process at random instants; after restarts the ledger holds every event once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from runledger.ingest.spool import SpoolWriter
from runledger.ledger.query import Reader
from tests.support.factory import RunBuilder


def test_sigkill_at_random_points_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    run = RunBuilder()
    run.start()
    for s in range(1, 40001):
        run.step(s)
    with SpoolWriter(tmp_path / "spool") as w:
        for raw in run.events:
            w.append(raw)
    ledger = tmp_path / "ledger"
    cmd = [
        sys.executable,
        "-m",
        "runledger.cli.main",
        "ingest",
        "spool",
        "--spool",
        str(tmp_path / "spool"),
        "--ledger",
        str(ledger),
        "--batch-size",
        "500",  # 80 lake commits: kills land before, inside and after the catalog transaction
    ]
    rng = random.Random(1234)
    kills = 0
    for _ in range(12):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(0.3, 1.2))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills >= 10
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900
    )  # (bounded: a 2-core CI machine under load)
    assert done.returncode == 0, done.stderr
    reader = Reader(ledger)
    n = len(run.events)
    assert reader.sql(
        "SELECT count(*), count(DISTINCT id), min(stream_seq), max(stream_seq) FROM events"
    ).rows == [(n, n, 0, n - 1)]
    assert reader.sql("SELECT count(*) FROM metrics WHERE name = 'loss'").rows == [(40000,)]
    assert not list(ledger.rglob("*.tmp"))


def test_a_commit_record_write_cut_short_leaves_nothing_once_a_writer_opens(tmp_path: Path) -> None:
    """A kill between a commit record's temporary file and its rename (the random kills above hit it
    about once in 20 runs) leaves ``_commits/.<n>.json.<pid>.<hex>.tmp``: the next writer to open the
    ledger removes it (and copies the record from the lake, as after any kill past the commit point)."""
    from runledger.ledger.store import Ledger, SourceRecord

    run = RunBuilder()
    run.start()
    run.step(1, loss=2.0)
    root = tmp_path / "ledger"
    made = Ledger.create(root)
    made.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    made.close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    left = root / "_commits" / f".0000000005.json.{int(dead.stdout)}.190bf850.tmp"
    left.write_text('{"half": ')
    with Ledger.open(root) as opened:
        assert opened.stream_heads()
    assert not list(root.rglob("*.tmp"))
