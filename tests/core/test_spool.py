from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.ingest.spool import SpoolLockedError, SpoolReader, SpoolWriter


def test_append_and_read_back_across_segments(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path, segment_bytes=256) as w:
        indexes = [w.append(f"event-{i}".encode()) for i in range(100)]
    assert indexes == list(range(100))
    assert len(list(tmp_path.glob("*.seg"))) > 3
    records = list(SpoolReader(tmp_path).read())
    assert [r.payload for r in records] == [f"event-{i}".encode() for i in range(100)]
    assert [r.index for r in SpoolReader(tmp_path).read(start=95)] == [95, 96, 97, 98, 99]
    assert [r.index for r in SpoolReader(tmp_path).read(start=10, limit=3)] == [10, 11, 12]


def test_one_writer_only(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path), pytest.raises(SpoolLockedError):
        SpoolWriter(tmp_path)


def test_reopen_continues_numbering(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path) as w:
        w.append(b"a")
    with SpoolWriter(tmp_path) as w:
        assert w.append(b"b") == 1
    assert [r.payload for r in SpoolReader(tmp_path).read()] == [b"a", b"b"]


def test_corrupt_record_and_torn_tail_are_reported_not_fatal(tmp_path: Path) -> None:
    with SpoolWriter(tmp_path) as w:
        for i in range(10):
            w.append(f"record-{i:02d}".encode())
    seg = sorted(tmp_path.glob("*.seg"))[0]
    data = bytearray(seg.read_bytes())
    data[8 + 3 * 17 + 10] ^= 0xFF  # a payload byte of record 3 (8-byte header + 9-byte payload each)
    seg.write_bytes(bytes(data) + b"\x40\x00\x00\x00\x01")  # and a torn tail
    records = list(SpoolReader(tmp_path).read())
    corrupt = [r for r in records if r.corrupt]
    assert [r.corrupt.split(" at ")[0] for r in corrupt] == ["checksum mismatch", "truncated header"]
    good = [r.payload for r in records if not r.corrupt]
    assert good == [f"record-{i:02d}".encode() for i in range(10) if i != 3]
    # A new writer starts a fresh segment after the damage; nothing is overwritten.
    with SpoolWriter(tmp_path) as w:
        w.append(b"after")
    assert list(SpoolReader(tmp_path).read())[-1].payload == b"after"


def test_incomplete_tail_while_writer_lives_is_not_damage(tmp_path: Path) -> None:
    w = SpoolWriter(tmp_path)
    w.append(b"one")
    w.sync()
    seg = sorted(tmp_path.glob("*.seg"))[-1]
    with open(seg, "ab") as f:  # what a reader can see mid-write
        f.write(b"\x10\x00\x00\x00")
    assert [r.payload for r in SpoolReader(tmp_path).read()] == [b"one"]
    w.close()


def test_sigkill_loses_nothing_that_was_synced(tmp_path: Path) -> None:
    script = (
        "import sys, os, signal\n"
        "from runledger.ingest.spool import SpoolWriter\n"
        f"w = SpoolWriter({str(tmp_path)!r})\n"
        "for i in range(5000):\n"
        "    w.append(b'x' * 100)\n"
        "w.sync()\n"
        "print('synced', flush=True)\n"
        "for i in range(100000):\n"
        "    w.append(b'y' * 100)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and "synced" in proc.stdout
    records = list(SpoolReader(tmp_path).read())
    assert sum(1 for r in records if r.payload == b"x" * 100) == 5000
    assert all(r.corrupt is None or r is records[-1] for r in records)
    assert os.path.exists(tmp_path / "spool.id")


def test_a_long_record_right_after_damage_is_found(tmp_path: Path) -> None:
    """Resync judges a long candidate from prefix checksums: it must still find a real long record."""
    long_payload = bytes(range(256)) * 1200  # 300 KB
    with SpoolWriter(tmp_path) as w:
        w.append(b"short-0")
        w.append(b"short-1")
        w.append(long_payload)
        w.append(b"short-3")
    seg = sorted(tmp_path.glob("*.seg"))[0]
    data = bytearray(seg.read_bytes())
    data[8 + 8 + 7 + 9] ^= 0xFF  # record 1's payload: damaged, so reading resyncs onto the long record
    seg.write_bytes(bytes(data))
    records = list(SpoolReader(tmp_path).read())
    assert [r.corrupt is not None for r in records] == [False, True, False, False]
    assert records[2].payload == long_payload and records[3].payload == b"short-3"


def test_a_live_writers_records_are_read_up_to_its_high_water_mark(tmp_path: Path) -> None:
    """What a reader hands on is always below the durable mark, so no position it handed on is
    handed out again after a crash and a deletion."""
    w = SpoolWriter(tmp_path, fsync_interval_s=3600)
    w.append(b"one")
    w.sync()
    w.append(b"two")
    w._file.flush()  # on disk, but not yet covered by the mark
    assert [r.payload for r in SpoolReader(tmp_path).read()] == [b"one"]
    w.sync()
    assert [r.payload for r in SpoolReader(tmp_path).read()] == [b"one", b"two"]
    w.close()
