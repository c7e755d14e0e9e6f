"""The trainer numbers its attempts through the client library's register (``runledger.attempts``):
an exclusive create per attempt, so two launches racing for the next number never both get it.

The old register (a read-modify-write of ``attempts.json``) handed racing launches one number, and
with it one event source for two attempts. Launches race here as separate processes, released together.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from runledger.trainer import checkpoint as ckpt

LAUNCHES = 8


def _launch(root: str, start: multiprocessing.synchronize.Event, out: multiprocessing.Queue) -> None:
    start.wait(30)
    out.put(ckpt.register_attempt(Path(root), {"host": "h", "pid": 0, "from_step": 0}))


def test_racing_launches_get_distinct_attempt_numbers(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")  # (a fork of pytest would inherit its DuckDB state)
    start, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_launch, args=(str(tmp_path), start, out)) for _ in range(LAUNCHES)]
    for worker in workers:
        worker.start()
    start.set()
    numbers = sorted(out.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(30)
    assert numbers == list(range(1, LAUNCHES + 1))
    assert [r["attempt"] for r in ckpt.attempts(tmp_path)] == numbers


def test_a_checkpoint_dir_of_the_old_register_keeps_counting(tmp_path: Path) -> None:
    """A run launched by an older trainer (``attempts.json``) continues with the next number."""
    legacy = {"attempts": [{"attempt": 1, "host": "old"}, {"attempt": 2, "host": "old"}]}
    (tmp_path / "attempts.json").write_text(json.dumps(legacy))
    assert ckpt.register_attempt(tmp_path, {"host": "new"}) == 3
    assert [(r["attempt"], r["host"]) for r in ckpt.attempts(tmp_path)] == [
        (1, "old"),
        (2, "old"),
        (3, "new"),
    ]
