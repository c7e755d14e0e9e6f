"""``runledger.ledger.file_writes.write_all``: a commit's files written two at a time, its failure raised only
once every write has stopped (the caller then removes every file: none may still be appearing)."""

from __future__ import annotations

import threading
import time

import pytest

from runledger.ledger.file_writes import write_all


def test_every_write_runs_and_the_first_failure_is_raised_after_all_have_stopped() -> None:
    done: list[str] = []

    def slow() -> None:
        time.sleep(0.2)
        done.append("slow")

    def broken() -> None:
        raise OSError(28, "No space left on device")

    def quick() -> None:
        done.append("quick")

    with pytest.raises(OSError, match="No space left"):
        write_all([broken, slow, quick])
    assert sorted(done) == ["quick", "slow"]


def test_writes_overlap_on_two_threads() -> None:
    both = threading.Barrier(2, timeout=5)  # each write waits for the other: one at a time would time out
    write_all([both.wait, both.wait])


def test_no_write_and_one_write_run_on_the_callers_thread() -> None:
    seen: list[str] = []
    write_all([])
    write_all([lambda: seen.append(threading.current_thread().name)])
    assert seen == [threading.current_thread().name]
