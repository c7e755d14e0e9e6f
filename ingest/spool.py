"""The embedded bus: an on-disk, append-only event spool (one writer, many readers).

Layout of a spool directory::

    spool.id                      a random id: positions in the ledger are keyed by it
    writer.lock                   flock held by the one live writer
    00000000000000000000.seg      segments, named by the index of their first record
    00000000000000012345.seg

A segment starts with the 8-byte magic ``RLSPOOL1``; then records, each
``u32 length | u32 crc32(length bytes ‖ payload) | payload`` (little-endian). A record's position
is its index: the count of records before it in the whole spool. Writes are flushed and fsynced at
a bounded interval (``fsync_interval_s``; the fsync itself in a background thread, off the caller's path)
and on ``sync()``; a crash can lose at most that window,
and a torn tail is never mistaken for a record: the CRC covers the length.

Readers never crash on damage: bytes that do not parse as a record are returned as one corrupt
record (with the reason) and reading resumes at the next valid record. An incomplete tail is
damage only once no writer holds the lock; while one does, it is a write in progress.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from schemas.durable import fsync_dir, write_durably

MAGIC = b"RLSPOOL1"
HEADER = struct.Struct("<II")
MAX_RECORD = 64 * 1024 * 1024


class SpoolLockedError(RuntimeError):
    pass


@dataclass(frozen=True)
class SpoolRecord:
    index: int
    payload: bytes
    corrupt: str | None = None  # why these bytes are not a valid record, if they are not
    segment: int = 0
    offset: int = 0


def spool_id(directory: Path) -> str:
    """The spool's stable id, created on first use."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "spool.id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            # Atomic create-if-absent: two first writers agree on one id.
            write_durably(path, uuid.uuid4().hex + "\n", exclusive=True)
        return path.read_text().strip()


def _segments(directory: Path) -> list[int]:
    return sorted(int(p.stem) for p in directory.glob("*.seg") if p.stem.isdigit())


def _segment_path(directory: Path, base: int) -> Path:
    return directory / f"{base:020d}.seg"


def _encode(payload: bytes) -> bytes:
    length = len(payload).to_bytes(4, "little")
    crc = zlib.crc32(payload, zlib.crc32(length))
    return length + crc.to_bytes(4, "little") + payload


def _parse_at(data: bytes | memoryview, offset: int) -> tuple[bytes, int] | str:
    """The record at ``offset`` and the offset after it, or why there is none."""
    if len(data) - offset < HEADER.size:
        return "truncated header"
    length, crc = HEADER.unpack_from(data, offset)
    if length > MAX_RECORD:
        return f"length {length} exceeds {MAX_RECORD}"
    end = offset + HEADER.size + length
    if end > len(data):
        return "truncated record"
    payload = bytes(data[offset + HEADER.size : end])
    if zlib.crc32(payload, zlib.crc32(length.to_bytes(4, "little"))) != crc:
        return "checksum mismatch"
    return payload, end


def _segment_entries(data: bytes) -> Iterator[tuple[int, bytes | None, str | None, int]]:
    """Every record or damaged stretch of a segment. A bare prefix of the magic holds none."""
    if data.startswith(MAGIC):
        yield from _scan(data, len(MAGIC))
    elif not MAGIC.startswith(data):
        yield 0, None, "segment has no spool header", len(data)


def _scan(data: bytes, start: int) -> Iterator[tuple[int, bytes | None, str | None, int]]:
    """(offset, payload, corruption, end) for every record or damaged stretch from ``start``."""
    offset = start
    while offset < len(data):
        parsed = _parse_at(data, offset)
        if not isinstance(parsed, str):
            yield offset, parsed[0], None, parsed[1]
            offset = parsed[1]
            continue
        # Resynchronise: the next offset where a whole valid record starts.
        nxt = offset + 1
        while nxt < len(data) and isinstance(_parse_at(data, nxt), str):
            nxt += 1
        yield offset, None, f"{parsed} at byte {offset}", nxt
        offset = nxt


class SpoolWriter:
    """Appends events to a spool. Only one writer per spool (enforced with a lock)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        fsync_interval_s: float = 0.2,
        segment_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.id = spool_id(self.directory)
        self._lock = open(self.directory / "writer.lock", "a+b")  # noqa: SIM115 - held for our life
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise SpoolLockedError(f"spool {self.directory} already has a live writer") from None
        self.fsync_interval_s = fsync_interval_s
        self.segment_bytes = segment_bytes
        self._last_sync = time.monotonic()
        self._syncing: threading.Thread | None = None
        self.next_index = self._recover()
        self._open_segment(self.next_index)

    def _recover(self) -> int:
        """Count the records already there. A damaged tail stays for readers to quarantine."""
        segments = _segments(self.directory)
        if not segments:
            return 0
        base = segments[-1]
        return base + sum(1 for _ in _segment_entries(_segment_path(self.directory, base).read_bytes()))

    def _open_segment(self, base: int) -> None:
        # A new segment on every open: never append after bytes that a crash may have torn. A
        # segment already named ``base`` holds no record (else the count would have passed it).
        path = _segment_path(self.directory, base)
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(MAGIC)
        self._segment_base = base
        self._segment_size = len(MAGIC)
        self.sync()
        fsync_dir(self.directory)

    def append(self, payload: bytes) -> int:
        """Append one record; returns its index. Durable within ``fsync_interval_s``."""
        record = _encode(payload)
        if self._segment_size + len(record) > self.segment_bytes and self._segment_size > len(MAGIC):
            self.sync()
            self._file.close()
            self._open_segment(self.next_index)
        self._file.write(record)
        self._segment_size += len(record)
        index = self.next_index
        self.next_index += 1
        if time.monotonic() - self._last_sync >= self.fsync_interval_s:
            self._sync_in_background()
        return index

    def _sync_in_background(self) -> None:
        """The interval's fsync, off the caller's path: an fsync can take hundreds of ms on a busy
        disk, and ``append`` sits on a training loop's emit path. The bytes reach the OS here; a
        thread fsyncs a duplicate of the file descriptor (still valid if the segment is closed
        meanwhile). While one is in flight the next interval waits for it (at most one at a time)."""
        if self._syncing is not None and self._syncing.is_alive():
            return
        self._file.flush()
        fd = os.dup(self._file.fileno())
        self._last_sync = time.monotonic()

        def fsync_and_close() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        self._syncing = threading.Thread(target=fsync_and_close, name="spool-fsync", daemon=True)
        self._syncing.start()

    def sync(self) -> None:
        """Make everything appended so far durable (flush + fsync)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._file.closed:
            return
        self.sync()
        if self._syncing is not None:
            self._syncing.join()
        self._file.close()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def writer_alive(directory: Path) -> bool:
    """True while some process holds the spool's writer lock."""
    path = directory / "writer.lock"
    if not path.exists():
        return False
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


class SpoolReader:
    """Reads a spool from any index. Safe beside a live writer."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no spool at {self.directory}")
        self.id = spool_id(self.directory)

    def read(self, start: int = 0, limit: int | None = None) -> Iterator[SpoolRecord]:
        """Records with index >= ``start``, in order, at most ``limit`` of them."""
        segments = _segments(self.directory)
        live = writer_alive(self.directory)
        produced = 0
        for i, base in enumerate(segments):
            following = segments[i + 1] if i + 1 < len(segments) else None
            if following is not None and following <= start:
                continue
            is_last = following is None
            data = _segment_path(self.directory, base).read_bytes()
            index = base
            for offset, payload, corrupt, end in _segment_entries(data):
                if corrupt is not None and is_last and live and end >= len(data):
                    return  # an incomplete tail while the writer lives is a write in progress
                if index >= start:
                    if limit is not None and produced >= limit:
                        return
                    if payload is None:
                        yield SpoolRecord(index, data[offset:end], corrupt, base, offset)
                    else:
                        yield SpoolRecord(index, payload, None, base, offset)
                    produced += 1
                index += 1
