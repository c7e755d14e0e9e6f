"""kill -9 at each step of a lake commit (the default SQLite catalog, its writer tables inlined after
the first commit): `ledger ingest spool` runs in a process of its own that SIGKILLs itself at one
named point of its Nth commit (a wrapper the test puts around the writer's catalog connection or one
function: the code under test is unchanged), then the same command runs again to its end. Every
event lands exactly once, the folder's commit records are numbered without a gap, and verify passes.
Random-instant kills are tests/lake/test_writer.py's; these are the points a random kill rarely hits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.ingest.spool import SpoolWriter
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from tests.support.factory import RunBuilder

ROOT = Path(__file__).resolve().parents[2]
ENV = {"RUNLEDGER_PROGRESS_S": "off", "PYTHONPATH": str(ROOT)}
STEPS = 240

# The child: the ingest command, with one kill point set around the writer. ``sql:TEXT``: the
# writer's catalog connection is wrapped so that the Nth statement containing TEXT kills the
# process before (or after) DuckDB runs it; ``call:MODULE:ATTR``: the Nth call of that function.
CHILD = r"""
import importlib, os, signal, sys
point, when, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
seen = 0

def hit(phase):
    global seen
    if phase == when:
        if phase == "before":
            seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)

if point.startswith("sql:"):
    from runledger.ledger import lake
    text = point[4:]

    class Killing:
        def __init__(self, con):
            self._con = con

        def execute(self, sql, *args, **kwargs):
            matched = text in sql and (text != "COMMIT" or sql.strip() == "COMMIT")
            if matched:
                hit("before")
            out = self._con.execute(sql, *args, **kwargs)
            if matched and when == "after":
                global seen
                seen += 1
                hit("after")
            return out

        def __getattr__(self, name):
            return getattr(self._con, name)

    attach = lake.LakeTables._attach_writer
    lake.LakeTables._attach_writer = lambda self: Killing(attach(self))
else:
    _, module_name, attr = point.split(":")
    owner_name, _, name = attr.rpartition(".")
    module = importlib.import_module(module_name)
    owner = getattr(module, owner_name) if owner_name else module
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        hit("before")
        out = original(*args, **kwargs)
        if when == "after":
            global seen
            seen += 1
            hit("after")
        return out

    setattr(owner, name, wrapped)

import runpy
sys.argv = ["ledger", *sys.argv[4:]]
runpy.run_module("runledger.cli.main", run_name="__main__")  # as `python -m runledger.cli.main`
"""

# (point, before/after, which occurrence): from the files written to the commit record indexed.
KILL_POINTS = [
    ("call:runledger.ledger.lake:LakeTables._write_files", "after", 3),
    ("sql:set_option('data_inlining_row_limit'", "before", 1),  # the first commit inlines
    ("sql:set_option('data_inlining_row_limit'", "after", 1),
    ("sql:ducklake_add_data_files", "before", 3),
    ("sql:VALUES (?, ?)", "after", 3),  # a fence moved (its row added under the commit turn)
    ("sql:INSERT INTO lake.ledger_positions", "before", 3),
    ("sql:INSERT INTO lake.ledger_commits", "before", 3),
    ("sql:COMMIT", "before", 3),
    ("sql:COMMIT", "after", 3),  # committed in the catalog, no record in the folder yet
    ("call:runledger.ledger.store:write_durably", "after", 3),
    ("call:runledger.ledger.store:Ledger._index_commit", "before", 3),
]


def _spool(folder: Path) -> int:
    run = RunBuilder(run_id="run-kill")
    run.start()
    for step in range(1, STEPS + 1):
        run.step(step)
        if step == STEPS // 2:
            run.change(step, "lr", 0.0005)
    with SpoolWriter(folder) as writer:
        for raw in run.events:
            writer.append(raw)
    return len(run.events)


def _ledger(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runledger.cli.main", *map(str, args)],
        cwd=ROOT,
        env=os.environ | ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("point", "when", "nth"), KILL_POINTS, ids=[f"{p}-{w}-{n}" for p, w, n in KILL_POINTS]
)
def test_a_kill_at_each_step_of_a_commit_loses_and_repeats_nothing(
    tmp_path: Path, point: str, when: str, nth: int
) -> None:
    n = _spool(tmp_path / "spool")
    ledger = tmp_path / "ledger"
    ingest = [
        "ingest",
        "spool",
        "--spool",
        str(tmp_path / "spool"),
        "--ledger",
        str(ledger),
        "--batch-size",
        "40",
    ]
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    killed = subprocess.run(
        [sys.executable, str(child), point, when, str(nth), *ingest],
        cwd=ROOT,
        env=os.environ | ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, f"the kill point was never reached: {killed.stderr[-2000:]}"

    # The same command again, to its end: every event once, records without a gap, verify OK.
    again = _ledger(*ingest)
    assert again.returncode == 0, again.stderr
    reader = Reader(ledger)
    assert reader.sql(
        "SELECT count(*), count(DISTINCT id), min(stream_seq), max(stream_seq) FROM events WHERE stream = ?",
        ["run-kill"],
    ).rows == [(n, n, 0, n - 1)]
    assert reader.sql("SELECT count(*) FROM metrics WHERE name = 'loss'").rows == [(STEPS,)]
    with Ledger.open(ledger) as opened:
        numbers = [int(p.stem) for p in opened.commit_paths()]
    assert numbers == list(range(len(numbers)))
    verified = _ledger("verify", "--ledger", ledger)
    assert verified.returncode == 0 and verified.stdout.splitlines()[-1].startswith("OK: "), (
        verified.stdout + verified.stderr
    )
