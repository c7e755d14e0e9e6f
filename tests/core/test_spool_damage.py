"""A damaged spool loses nothing acknowledged, and every loss it cannot avoid is on the record.

Each test damages a real spool on disk the way a person or a crash would (garbage or an extra
record in a closed segment, a deleted segment, a segment of zeros, a torn last record, segments
deleted after ingest, two writers), then folds it in with ``ledger ingest spool`` and reads the
ledger back with ``ledger query``: every good record is there exactly once, and every stretch of
positions that holds no record any more is a ``bus.positions_missing`` event with its count.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

import runledger.ingest.spool as spool_module
from runledger.cli.main import app
from runledger.ingest.spool import HIGH_WATER_FILE, SpoolLockedError, SpoolReader, SpoolWriter, _encode
from tests.support.factory import RunBuilder

runner = CliRunner()


def _events(count: int, run_id: str = "run-a") -> list[bytes]:
    run = RunBuilder(run_id=run_id)
    run.start()
    for step in range(1, count):
        run.step(step, loss=10.0 - step * 0.01)
    return run.events


def _write(spool: Path, events: list[bytes], segment_bytes: int = 4096) -> list[int]:
    with SpoolWriter(spool, segment_bytes=segment_bytes) as writer:
        return [writer.append(raw) for raw in events]


def _segments(spool: Path) -> list[Path]:
    return sorted(spool.glob("*.seg"))


def _ingest(spool: Path, ledger: Path) -> str:
    result = runner.invoke(app, ["ingest", "spool", "--spool", str(spool), "--ledger", str(ledger)])
    assert result.exit_code == 0, result.output
    return result.output


def _query(ledger: Path, sql: str) -> list[dict]:
    result = runner.invoke(app, ["query", sql, "--ledger", str(ledger), "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@dataclass
class Facts:
    """What the ledger holds of the spool, read with one ``ledger query``."""

    ids: list[str]  # the trainer's events, in seq order
    missing: list[dict]  # the data of each bus.positions_missing event
    missing_streams: list[str]
    reasons: list[str]  # each quarantine row's reason, in position order


def _facts(ledger: Path) -> Facts:
    rows = _query(
        ledger,
        "SELECT 'id' AS k, id AS v, stream AS s, seq AS o FROM events WHERE source LIKE 'trainer/%' "
        "UNION ALL SELECT 'missing', canonical, stream, seq FROM events WHERE type = 'bus.positions_missing' "
        "UNION ALL SELECT 'quarantine', reason, '', ingest_position FROM quarantine ORDER BY k, o",
    )
    missing = [r for r in rows if r["k"] == "missing"]
    return Facts(
        ids=[r["v"] for r in rows if r["k"] == "id"],
        missing=[json.loads(r["v"])["data"] for r in missing],
        missing_streams=[r["s"] for r in missing],
        reasons=[r["v"] for r in rows if r["k"] == "quarantine"],
    )


def _ids(count: int) -> list[str]:
    return [f"run-a-{i}" for i in range(count)]


def test_garbage_after_a_middle_segment_keeps_the_next_segments_first_record(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    _write(spool, _events(60))
    segments = _segments(spool)
    assert len(segments) >= 3
    with open(segments[1], "ab") as handle:
        handle.write(b"\x17garbage written by hand\x00\x01")
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(60)  # the next segment's first record included
    assert len(facts.reasons) == 1 and facts.missing == []


def test_an_extra_record_in_a_middle_segment_takes_no_position_of_the_next(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    _write(spool, _events(60))
    segments = _segments(spool)
    stray = _events(1, run_id="run-stray")[0]
    with open(segments[1], "ab") as handle:
        handle.write(_encode(stray))
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(60)
    (reason,) = facts.reasons
    assert "past the last position" in reason  # kept, with its bytes, in the quarantine
    raw = _query(ledger, "SELECT raw FROM quarantine")[0]["raw"]
    assert "run-stray" in str(raw)


def test_garbage_inserted_inside_a_middle_segment_loses_no_record(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    _write(spool, _events(60))
    segment = _segments(spool)[1]
    records = [r for r in SpoolReader(spool).read() if r.segment == int(segment.stem)]
    cut = records[3].offset  # between two records
    data = segment.read_bytes()
    segment.write_bytes(data[:cut] + bytes(random.Random(7).randbytes(300)) + data[cut:])
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(60)
    assert len(facts.reasons) == 1 and facts.missing == []


def test_a_deleted_middle_segment_is_recorded_as_missing_positions(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    _write(spool, _events(60))
    segments = _segments(spool)
    first, following = int(segments[1].stem), int(segments[2].stem)
    segments[1].unlink()
    summary = _ingest(spool, ledger)
    lost = set(range(first, following))
    assert f"; {following - first} spool positions held no record (recorded)" in summary
    facts = _facts(ledger)
    assert facts.ids == [i for n, i in enumerate(_ids(60)) if n not in lost]
    (missing,) = facts.missing
    assert (missing["first"], missing["last"], missing["count"]) == (first, following - 1, following - first)
    # On the run's stream: it is part of the run's record. And a second ingest adds nothing.
    assert facts.missing_streams == ["run-a"]
    # ... which history and state tell.
    span = f"positions {first}–{following - 1}"
    history = runner.invoke(app, ["history", "run-a", "--ledger", str(ledger)], env={"COLUMNS": "250"})
    assert history.exit_code == 0 and f"{following - first} records missing from spool:" in history.output
    assert span in history.output
    state = runner.invoke(app, ["state", "run-a", "--ledger", str(ledger)], env={"COLUMNS": "250"})
    assert f"incident: {following - first} events missing from the bus (spool:" in state.output
    _ingest(spool, ledger)
    again = _facts(ledger)
    assert len(again.missing) == 1 and len(again.ids) == 60 - len(lost)


def test_segments_deleted_after_ingest_then_new_writes_are_all_ingested(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    events = _events(50)
    _write(spool, events[:30])
    _ingest(spool, ledger)
    for segment in _segments(spool):
        segment.unlink()  # the ledger holds them: an operator frees the disk
    indexes = _write(spool, events[30:])
    assert indexes[0] == 30  # the high-water mark: no position is handed out twice
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(50) and facts.missing == []


def test_the_high_water_mark_survives_every_segment_and_a_crash(tmp_path: Path) -> None:
    writer = SpoolWriter(tmp_path, fsync_interval_s=3600)
    for i in range(10):
        writer.append(b"x%d" % i)
    writer.sync()
    assert (tmp_path / HIGH_WATER_FILE).read_text().strip() == "10"
    writer.close()
    for segment in _segments(tmp_path):
        segment.unlink()
    with SpoolWriter(tmp_path) as again:
        assert again.append(b"next") == 10


def test_the_tail_of_a_spool_lost_below_its_high_water_mark_is_recorded(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    _write(spool, _events(60))
    last = _segments(spool)[-1]
    first = int(last.stem)
    last.unlink()  # the newest segment, with no writer to write after it
    _ingest(spool, ledger)
    facts = _facts(ledger)
    (missing,) = facts.missing
    assert (missing["first"], missing["last"]) == (first, 59)
    assert len(facts.ids) == first


def test_a_segment_of_zeros_is_quarantined_and_its_positions_recorded(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    _write(spool, _events(60))
    segments = _segments(spool)
    middle, following = int(segments[1].stem), int(segments[2].stem)
    segments[1].write_bytes(bytes(segments[1].stat().st_size))
    _ingest(spool, ledger)
    lost = set(range(middle, following))
    facts = _facts(ledger)
    assert facts.ids == [i for n, i in enumerate(_ids(60)) if n not in lost]
    assert ["no spool header" in r for r in facts.reasons] == [True]
    (missing,) = facts.missing
    assert (missing["first"], missing["last"], missing["count"]) == (middle + 1, following - 1, len(lost) - 1)


def test_a_torn_last_record_after_kill_9_loses_nothing_whole(tmp_path: Path) -> None:
    """kill -9 in the middle of an append: the record being written is torn (quarantined), the
    ones before it are all there, and its position is never handed out again, not even once the
    ledger has it and every segment is deleted."""
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    events = _events(40)
    script = (
        "import os, signal, sys\n"
        "from runledger.ingest.spool import SpoolWriter, _encode\n"
        f"w = SpoolWriter({str(spool)!r}, fsync_interval_s=3600)\n"
        "for line in sys.stdin.read().split():\n"
        "    w.append(bytes.fromhex(line))\n"
        "w.sync()\n"
        'w._file.write(_encode(b\'{"half": "written"}\')[:11])  # the kernel took part of the write\n'
        "w._file.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    stdin = "\n".join(raw.hex() for raw in events[:30])
    proc = subprocess.run(
        [sys.executable, "-c", script], input=stdin, text=True, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(30)
    assert ["truncated record" in r for r in facts.reasons] == [True]
    for segment in _segments(spool):
        segment.unlink()  # all of it is in the ledger
    with SpoolWriter(spool) as writer:  # the torn record's position 30 is taken: the ledger holds it
        assert [writer.append(raw) for raw in events[30:]] == list(range(31, 41))
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(40)
    assert len(facts.reasons) == 1 and facts.missing == []


def test_two_writers_never_share_a_position(tmp_path: Path) -> None:
    spool, ledger = tmp_path / "spool", tmp_path / "ledger"
    events = _events(30)
    script = (
        "from runledger.ingest.spool import SpoolLockedError, SpoolWriter\n"
        "try:\n"
        f"    SpoolWriter({str(spool)!r})\n"
        "except SpoolLockedError as exc:\n"
        "    print('refused:', exc)\n"
    )
    with SpoolWriter(spool) as first:
        for raw in events[:10]:
            first.append(raw)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert "refused:" in proc.stdout, proc.stdout + proc.stderr
        with pytest.raises(SpoolLockedError):
            SpoolWriter(spool)
    # One after the other, each continues where the last stopped, across ingests and deletions.
    _ingest(spool, ledger)
    with SpoolWriter(spool) as second:
        assert [second.append(raw) for raw in events[10:20]] == list(range(10, 20))
    _ingest(spool, ledger)
    for segment in _segments(spool):
        segment.unlink()
    with SpoolWriter(spool) as third:
        assert [third.append(raw) for raw in events[20:]] == list(range(20, 30))
    _ingest(spool, ledger)
    facts = _facts(ledger)
    assert facts.ids == _ids(30) and facts.missing == []


def test_reading_in_batches_resynchronises_each_damaged_stretch_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linear: batch after batch, the reader resumes at the byte offset it reached, so a damaged
    stretch is parsed once, not once per batch (counted, not timed)."""
    with SpoolWriter(tmp_path, segment_bytes=1 << 30) as writer:
        for i in range(400):
            writer.append(b"record-%04d" % i)
    segment = _segments(tmp_path)[0]
    data = segment.read_bytes()
    cut = len(spool_module.MAGIC) + 100 * (8 + 11)  # after record 99
    segment.write_bytes(data[:cut] + random.Random(3).randbytes(20_000) + data[cut:])
    calls = {"n": 0}
    real = spool_module._parse_at

    def counting(buffer, offset):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(buffer, offset)

    monkeypatch.setattr(spool_module, "_parse_at", counting)
    whole = list(SpoolReader(tmp_path).read())
    once = calls["n"]
    calls["n"] = 0
    reader, batched, start = SpoolReader(tmp_path), [], 0
    while chunk := list(reader.read(start, limit=10)):
        batched += chunk
        start = chunk[-1].index + 1
    assert [r.payload for r in batched] == [r.payload for r in whole]
    assert sum(1 for r in whole if r.corrupt) == 1 and len(whole) == 401
    assert calls["n"] <= once + 50  # about one pass, not one pass per batch (today: 40 passes)
