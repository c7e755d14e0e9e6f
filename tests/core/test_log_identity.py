"""Issue 16: a log's origin survives restore from a backup copy (and replay: tests/kafka/test_replay.py),
so checkpoints signed before stay checkable. The procedure tested is the one docs/merkle.md gives."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

import pytest

from runledger.ledger.integrity import verify_ledger
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from runledger.ledger.stream_checkpoints import checkpoint_path, sign_checkpoints
from runledger.schemas.note import write_keypair
from tests.support.factory import RunBuilder


def _records(raws: list[bytes], first: int = 0) -> list[SourceRecord]:
    return [SourceRecord("spool:t", first + i, raw) for i, raw in enumerate(raws)]


def _backup(ledger: Path, to: Path) -> None:
    """A consistent copy: under the writer lock, as `flock <ledger>/.writer.lock cp -a ...` takes it."""
    with open(ledger / ".writer.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.copytree(ledger, to, ignore=shutil.ignore_patterns(".writer.lock"))


def test_a_restored_backup_verifies_against_checkpoints_signed_before_and_after_it(tmp_path: Path) -> None:
    run = RunBuilder()
    run.start()
    for step in range(1, 41):
        run.step(step, loss=3.0 - step * 0.01)
    first, later = run.events[:20], run.events[20:]
    original = tmp_path / "ledger"
    Ledger.create(original).commit(_records(first))
    private, public = write_keypair(tmp_path / "keys", "log")
    key, pub = private.read_text().strip(), public.read_text().strip()
    sign_checkpoints(original, key)
    _backup(original, tmp_path / "backup")

    Ledger.open(original).commit(_records(later, len(first)))
    [latest] = sign_checkpoints(original, key)
    published = latest.read_text()  # signed after the backup was taken, and kept by others
    shutil.rmtree(original)  # the disk is lost

    restored = tmp_path / "restored"
    shutil.copytree(tmp_path / "backup", restored)
    report = verify_ledger(restored, pub)
    assert report.ok and report.checkpoints == 1, [p.line() for p in report.problems]

    # The checkpoint published after the backup names events the copy lacks: verify says so ...
    checkpoint_path(restored, run.run_id).write_text(published)
    [problem] = verify_ledger(restored, pub).problems
    assert problem.kind == "checkpoint" and "truncated" in problem.detail
    # ... until they are ingested again from the bus, from the positions the copy holds.
    result = Ledger.open(restored).commit(_records(run.events))
    assert (result.skipped, result.accepted) == (len(first), len(later))
    report = verify_ledger(restored, pub)
    assert report.ok and report.checkpoints == 1, [p.line() for p in report.problems]


def test_a_ledger_id_is_kept_checked_and_well_formed(tmp_path: Path) -> None:
    made = Ledger.create(tmp_path / "a", ledger_id="0123abcd-log.1")
    assert made.ledger_id == Ledger.open(tmp_path / "a").ledger_id == "0123abcd-log.1"
    assert Ledger.create(tmp_path / "a", ledger_id="0123abcd-log.1").ledger_id == "0123abcd-log.1"
    with pytest.raises(LedgerError, match=r"is ledger 0123abcd-log\.1, not other"):
        Ledger.create(tmp_path / "a", ledger_id="other")
    for bad in ["", "a/b", "a b", "x" * 65, "id\n"]:
        with pytest.raises(LedgerError, match="must be 1-64 of"):
            Ledger.create(tmp_path / "b", ledger_id=bad)
    assert not (tmp_path / "b").exists()
    assert Ledger.create(tmp_path / "c").ledger_id != Ledger.create(tmp_path / "d").ledger_id
