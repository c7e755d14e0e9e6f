"""The producer's last losses when the bus is still down at exit (issue 40): counted durably, recorded once.

A real 300 KB tmpfs holds the spool (``tests.support.small_fs``: needs root, else skipped with the
reason). A producer process fills it, keeps logging, and ends while it is still full (``finish``,
interpreter exit, an uncaught exception, or SIGKILL right after ``finish``). Its drop report waits
in the spool's ``pending/`` folder, in a file reserved full size at ``init``; once the space is back,
``ledger ingest spool`` records it as the producer's own ``runledger.producer.dropped``, and every
``log`` that returned True is either in the ledger or in that count: nothing acknowledged is lost
without a count. Ingesting again, or after an ingest killed between its commit and the removal of
the file, records it once."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import runledger
from runledger.ingest.spool import (
    PENDING_BYTES,
    PENDING_DIR,
    PendingSlot,
    SpoolReader,
    SpoolWriter,
    pending_files,
)
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.store import Ledger
from runledger.schemas.durable import write_durably
from runledger.schemas.note import write_keypair
from tests.client.ledger_support import cli_json

if TYPE_CHECKING:  # imported by pytest_plugins first, so that pytest rewrites its asserts
    from tests.support.small_fs import SmallFs

pytest_plugins = ("tests.support.small_fs",)  # the small_fs fixture

RUN = "exit-1"
STEPS = 600  # log calls in all: 20 before the disk fills, the rest after

# The producer: logs 20 steps (made durable), fills its disk, logs on, writes what each log call
# returned, then ends as argv[3] says while the disk is still full.
PRODUCER = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    import runledger

    fs, results, end = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]  # argv[4]: the calls in all
    run = runledger.init(
        "exit-1", queue_size=32, outage_wait_s=0.2, critical_timeout_s=0.5, flush_timeout_s=0.5,
        handle_signals=False,
    )
    ok = {}
    for step in range(20):
        ok[step] = run.log({"loss": float(step)}, step=step)
    assert run.emitter.flush(timeout=30)
    with open(fs / "filler", "wb", buffering=0) as handle:
        for _ in range(1000):  # 300 KB in 4 KB writes at most
            try:
                handle.write(bytes(4096))
            except OSError:
                break
    for step in range(20, int(sys.argv[4])):
        ok[step] = run.log({"loss": float(step)}, step=step)
    results.write_text(json.dumps(ok))
    if end == "finish":
        run.finish()
    elif end == "kill":
        run.finish()
        os.kill(os.getpid(), signal.SIGKILL)
    elif end == "crash":
        raise RuntimeError("the trainer fails while the disk is full")
    print("dropped", run.dropped)  # "exit": the interpreter's exit finishes the run
    """
)


def produce(fs: Path, tmp_path: Path, env: dict[str, str], end: str) -> dict[int, bool]:
    """Run the producer until it ends; what each of its ``log`` calls returned."""
    results = tmp_path / f"ok-{end}.json"
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER, str(fs), str(results), end, str(STEPS)],
        env={**env, "RUNLEDGER_SPOOL": str(fs / "spool")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = -signal.SIGKILL if end == "kill" else 1 if end == "crash" else 0
    assert done.returncode == expected, done.stderr
    assert "the report waits in" in done.stderr, done.stderr
    return {int(step): accepted for step, accepted in json.loads(results.read_text()).items()}


def events_of(ledger: Path, kind: str) -> list[dict[str, Any]]:
    rows = cli_json(
        ledger, "query", f"SELECT canonical FROM events WHERE stream = '{RUN}' AND type = '{kind}'"
    )
    return [json.loads(row["canonical"]) for row in rows]


def count_of(ledger: Path, kind: str) -> int:
    return len(events_of(ledger, kind))


def assert_every_accepted_log_is_recorded_or_counted(ledger: Path, ok: dict[int, bool]) -> dict[str, Any]:
    """The one drop report's count is exactly the refused calls, the accepted ones not in the
    ledger, and the lifecycle events not in it: nothing acknowledged was lost without a count."""
    [report] = events_of(ledger, "runledger.producer.dropped")
    rows = cli_json(ledger, "query", f"SELECT step FROM metrics WHERE run_id = '{RUN}' AND name = 'loss'")
    recorded = {row["step"] for row in rows}
    accepted = {step for step, yes in ok.items() if yes}
    refused = len(ok) - len(accepted)
    assert recorded <= accepted and refused > 0 and len(accepted) > 32
    started = count_of(ledger, "runledger.run.started")
    ended = count_of(ledger, "runledger.run.finished") + count_of(ledger, "runledger.run.crashed")
    lifecycle_lost = (1 - started) + (1 - ended)
    count = report["data"]["count"]
    assert count == refused + len(accepted - recorded) + lifecycle_lost
    assert ended == 0 and report["seq"] >= len(ok) + 2  # after the launch, the logs and the end
    assert report["data"]["first_seq"] <= len(ok) - refused and report["data"]["last_seq"] < report["seq"]
    return report


@pytest.mark.parametrize("end", ["finish", "exit", "crash", "kill"])
def test_bus_down_until_exit_the_report_waits_beside_the_spool_and_one_ingest_records_it(
    client_env: dict[str, str], small_fs: SmallFs, tmp_path: Path, end: str
) -> None:
    fs = small_fs(300)  # KB
    ok = produce(fs, tmp_path, client_env, end)
    [kept] = (fs / "spool" / PENDING_DIR).glob("*.json")
    assert kept.stat().st_size == PENDING_BYTES  # written in place: the reservation's own blocks

    (fs / "filler").unlink()  # the space comes back
    ledger = tmp_path / "ledger"
    first = ingest_spool(Ledger.create(ledger), fs / "spool")
    assert first.quarantined == 0 and not kept.exists()
    report = assert_every_accepted_log_is_recorded_or_counted(ledger, ok)
    assert report["source"] == f"trainer/{RUN}/a1/rank0"  # the producer's own event, not the ingester's

    again = ingest_spool(Ledger.create(ledger), fs / "spool")  # a second ingest: nothing new
    assert again.accepted == 0 and count_of(ledger, "runledger.producer.dropped") == 1
    state = cli_json(ledger, "state", RUN)
    [dropped] = [i for i in state["incidents"] if i["kind"] == "dropped"]
    assert dropped["count"] == report["data"]["count"]


def test_an_ingest_killed_between_its_commit_and_removing_the_file_records_the_report_once(
    client_env: dict[str, str], small_fs: SmallFs, tmp_path: Path
) -> None:
    fs = small_fs(300)  # KB
    ok = produce(fs, tmp_path, client_env, "finish")
    [kept] = (fs / "spool" / PENDING_DIR).glob("*.json")
    saved = tmp_path / "kept.json"
    shutil.copy2(kept, saved)
    (fs / "filler").unlink()
    ledger = tmp_path / "ledger"
    ingest_spool(Ledger.create(ledger), fs / "spool")
    # What a SIGKILL after the commit and before the unlink leaves: the event in the ledger, and
    # the file still there (put back, byte for byte).
    shutil.copy2(saved, kept)

    again = ingest_spool(Ledger.create(ledger), fs / "spool")
    assert (again.accepted, again.duplicates, again.quarantined) == (0, 1, 0)
    assert not kept.exists()
    assert_every_accepted_log_is_recorded_or_counted(ledger, ok)


def test_a_signed_producer_keeps_its_report_sealed_in_its_chain(
    client_env: dict[str, str], small_fs: SmallFs, tmp_path: Path
) -> None:
    private, _ = write_keypair(tmp_path / "keys", "trainer")
    fs = small_fs(300)  # KB
    ok = produce(fs, tmp_path, {**client_env, "RUNLEDGER_PRODUCER_KEY": str(private)}, "finish")
    (fs / "filler").unlink()
    ledger = tmp_path / "ledger"
    assert ingest_spool(Ledger.create(ledger), fs / "spool").quarantined == 0
    report = assert_every_accepted_log_is_recorded_or_counted(ledger, ok)
    assert report["key_id"] and report["signature"] and report["prev"]
    # The dropped seq numbers are a gap before the report, never a fork: it follows its chain.
    kinds = {e["data"]["kind"] for e in events_of(ledger, "ledger.incident")}
    assert kinds == {"gap"}


def test_a_reservation_is_left_alone_while_its_producer_lives_and_removed_once_stale(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    slot = PendingSlot.reserve(spool, "trainer/r/a1/rank0")
    assert slot.path.stat().st_size == PENDING_BYTES
    old = slot.path.stat().st_mtime - 3600
    os.utime(slot.path, (old, old))
    assert pending_files(spool) == [] and slot.path.exists()  # locked: its producer lives
    slot._close()  # the producer dies without an end: its lock goes with its descriptor
    assert pending_files(spool) == [] and not slot.path.exists()  # an hour old and unlocked: stale


def test_a_damaged_pending_file_is_quarantined_not_passed_over(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    SpoolWriter(spool).close()
    slot = PendingSlot.reserve(spool, "trainer/r/a1/rank0")
    slot.hold(b'{"not": "an event"}', None)
    slot.path.write_bytes(slot.path.read_bytes()[:40])  # torn
    stats = ingest_spool(Ledger.create(tmp_path / "ledger"), spool)
    assert stats.quarantined == 1 and not slot.path.exists()


def test_an_append_the_full_disk_cuts_short_leaves_no_torn_bytes_and_loses_no_accepted_record(
    small_fs: SmallFs,
) -> None:
    fs = small_fs(300)  # KB
    writer = SpoolWriter(fs / "spool")
    accepted = []
    payload = b"x" * 700  # not a divisor of a page: the disk fills in the middle of a record
    for i in range(1000):
        try:
            accepted.append(writer.append(payload + str(i).encode()))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            break
    else:
        raise AssertionError("the disk never filled up")
    with pytest.raises(OSError):  # the bus is still down: refused again, whole
        writer.append(payload)
    writer.close()  # an exit while the disk is full: nothing of ours sat in a buffer
    records = list(SpoolReader(fs / "spool").read())
    assert [r.index for r in records] == accepted and not any(r.corrupt for r in records)
    assert records[-1].payload == payload + str(len(accepted) - 1).encode()


def test_the_reservation_takes_the_report_in_place_on_a_full_disk(small_fs: SmallFs) -> None:
    fs = small_fs(300)  # KB
    slot = PendingSlot.reserve(fs / "spool", "trainer/r/a1/rank0")
    inode = slot.path.stat().st_ino
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as handle, pytest.raises(OSError):
        for _ in range(1000):
            handle.write(bytes(4096))
    with pytest.raises(OSError):  # full: a new file, as write_durably makes, is refused
        write_durably(fs / "spool" / "probe", b"{}")
    slot.hold(b'{"an": "event"}', 7)
    assert slot.path.stat().st_ino == inode and slot.path.stat().st_size == PENDING_BYTES
    [kept] = pending_files(fs / "spool")
    assert (kept.raw, kept.spool_next, kept.damaged) == (b'{"an": "event"}', 7, None)


def test_the_next_run_on_the_spool_hands_the_kept_report_to_the_bus(
    client_env: dict[str, str], small_fs: SmallFs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private, _ = write_keypair(tmp_path / "keys", "trainer")
    fs = small_fs(300)  # KB
    ok = produce(fs, tmp_path, {**client_env, "RUNLEDGER_PRODUCER_KEY": str(private)}, "finish")
    [kept] = (fs / "spool" / PENDING_DIR).glob("*.json")
    (fs / "filler").unlink()
    monkeypatch.setenv("RUNLEDGER_SPOOL", str(fs / "spool"))
    monkeypatch.setenv("RUNLEDGER_PRODUCER_KEY", str(private))
    later = runledger.init("exit-2", queue_size=32, handle_signals=False)
    later.log({"loss": 1.0}, step=0)
    later.finish()
    assert not kept.exists() and not list((fs / "spool" / PENDING_DIR).glob("*.json"))

    ledger = tmp_path / "ledger"
    for _ in range(2):  # the report came by the spool itself; a second ingest adds nothing
        assert ingest_spool(Ledger.create(ledger), fs / "spool").quarantined == 0
    report = assert_every_accepted_log_is_recorded_or_counted(ledger, ok)
    assert report["key_id"] and report["source"] == f"trainer/{RUN}/a1/rank0"
    positions = Ledger.create(ledger).positions()
    assert not [source for source in positions if source.endswith(":pending")]  # not by the pending door
