"""The embedded bus: an on-disk, append-only event spool (one writer, many readers).

Layout of a spool directory::

    spool.id                      a random id: positions in the ledger are keyed by it
    writer.lock                   flock held by the one live writer
    positions.hwm                 the high-water mark: every position below it was handed out
    00000000000000000000.seg      segments, named by the index of their first record
    00000000000000012345.seg

A segment starts with the 8-byte magic ``RLSPOOL1``; then records, each
``u32 length | u32 crc32(length bytes ‖ payload) | payload`` (little-endian). A record's position
is its index: the count of records before it in the whole spool. Each record goes to the OS whole as
it is appended (no buffer of the process holds it: a full disk refuses it then, never later
unseen). Writes are fsynced at a bounded interval (``fsync_interval_s``; the fsync itself in a
background thread, off the caller's path) and on ``sync()``; a crash of the machine can lose at
most that window, and a torn tail is never mistaken for a record: the CRC covers the length.

Readers never crash on damage: bytes that do not parse as a record are returned as one corrupt
record (with the reason) and reading resumes at the next valid record. An incomplete tail is
damage only once no writer holds the lock; while one does, it is a write in progress.

Positions are never handed out twice. The writer raises the high-water mark (durably) with every
fsync and starts at or above it, so deleting segments (after ingest, say) never makes a new record
reuse a position the ledger holds; readers hand on a live writer's records only below the mark (a
dead writer's, once they raised it: ``raise_high_water``). A closed segment holds exactly the
positions up to the next segment's name: entries beyond that (garbage, a record added to it) are
marked ``beyond`` and take no position. Resynchronising is linear: a reader keeps each segment's
entry offsets between reads, and a long candidate record is checked from prefix checksums.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import mmap
import os
import struct
import threading
import time
import uuid
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

from runledger.schemas.durable import fsync_dir, write_durably

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
    # An entry past the last position its segment's writer handed out (garbage or a record added
    # to a closed segment): it has no position of its own; ``index`` is then the next position.
    beyond: bool = False


HIGH_WATER_FILE = "positions.hwm"


def high_water(directory: Path) -> int:
    """The spool's high-water mark: every position below it was handed out (and its record flushed)
    by some writer; no writer hands one out again, even after every segment is gone. 0 if none."""
    try:
        text = (directory / HIGH_WATER_FILE).read_text().strip()
    except FileNotFoundError:
        return 0
    return int(text) if text.isdigit() else 0  # written whole by write_durably: never torn


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


def _parse_at(data: bytes | memoryview | mmap.mmap, offset: int) -> tuple[bytes, int] | str:
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


def _segment_entries(data: bytes | mmap.mmap) -> Iterator[tuple[int, bytes | None, str | None, int]]:
    """Every record or damaged stretch of a segment. A bare prefix of the magic holds none."""
    for offset, end, corrupt in _entries(data):
        yield offset, (None if corrupt is not None else bytes(data[offset + HEADER.size : end])), corrupt, end


def _entries(data: bytes | mmap.mmap, start: int = 0) -> Iterator[tuple[int, int, str | None]]:
    """(offset, end, corruption) of every record or damaged stretch of a segment from ``start``
    (0: the segment's beginning, whose magic is checked)."""
    if start == 0:
        head = bytes(data[: len(MAGIC)])
        if head != MAGIC:
            if not MAGIC.startswith(head) or len(data) > len(MAGIC):
                yield 0, len(data), "segment has no spool header"
            return
        start = len(MAGIC)
    yield from _scan(data, start)


def _scan(data: bytes | mmap.mmap, start: int) -> Iterator[tuple[int, int, str | None]]:
    """(offset, end, corruption) for every record or damaged stretch from ``start``."""
    offset = start
    size = len(data)
    prefix = _PrefixCrc(data)  # shared by every resync of this scan
    while offset < size:
        parsed = _parse_at(data, offset)
        if not isinstance(parsed, str):
            yield offset, parsed[1], None
            offset = parsed[1]
            continue
        nxt = _resync(data, offset, prefix)
        yield offset, nxt, f"{parsed} at byte {offset}"
        offset = nxt


# A record with an empty payload: its CRC covers only the 4 zero bytes of its length.
_EMPTY_CRC = zlib.crc32(b"\x00\x00\x00\x00")


def _resync(data: bytes | mmap.mmap, offset: int, prefix: _PrefixCrc | None = None) -> int:
    """The first offset after ``offset`` where a whole valid record starts (else the end): linear in
    the damaged stretch. The first few offsets are tried one by one; then windows of offsets, each
    window's lengths read at once, and only the offsets whose length fits are checked (a stretch of
    zeros holds none). A stretch crafted so that every offset claims a long record that fits still
    costs a checksum of that length per offset, as it did before; a long one is checked from the
    segment's prefix checksums (``_PrefixCrc``) at a cost that does not grow with its length."""
    prefix = prefix if prefix is not None else _PrefixCrc(data)
    size = len(data)
    near = min(size, offset + 1 + 64)
    for candidate in range(offset + 1, near):  # close by, one offset at a time: most damage is short
        if not isinstance(_parse_at(data, candidate), str):
            return candidate
    lo = near
    window = 1024
    while lo < size:
        hi = min(size, lo + window)
        for candidate in _candidates(data, lo, hi):
            if prefix.may_be_record(candidate) and not isinstance(_parse_at(data, candidate), str):
                return candidate
        lo = hi
        window = min(window * 2, 1 << 20)
    return size


# CRC-32 arithmetic (zlib's crc32_combine, in Python): the checksum of any stretch of a segment from
# two prefix checksums, so a candidate record claiming megabytes is refuted without reading them.
_POLY = 0xEDB88320
_LONG = 64 * 1024  # candidates longer than this are checked arithmetically first
_PREFIX_STEP = 64 * 1024  # a prefix checksum kept every this many bytes


def _multmodp(a: int, b: int) -> int:
    """a(x)·b(x) modulo the CRC polynomial (reflected bit order)."""
    product, m = 0, 1 << 31
    while True:
        if a & m:
            product ^= b
            if not a & (m - 1):
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n_tables() -> list[list[list[int]]]:
    """For each k: x^(2^k) as 4 byte tables, so multiplying by it is 4 look-ups."""
    powers = [1 << 30]  # x^1
    for _ in range(31):
        powers.append(_multmodp(powers[-1], powers[-1]))
    return [[[_multmodp(power, v << (8 * j)) for v in range(256)] for j in range(4)] for power in powers]


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: what shifting a checksum past n bytes multiplies it by."""
    tables = _x2n_tables()
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            t = tables[k & 31]
            p = t[0][p & 255] ^ t[1][(p >> 8) & 255] ^ t[2][(p >> 16) & 255] ^ t[3][p >> 24]
        n >>= 1
        k += 1
    return p


class _PrefixCrc:
    """Checksums of a segment's prefixes, kept every ``_PREFIX_STEP`` bytes as they are needed."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.data = data
        self.steps = [0]  # crc32 of data[: i * _PREFIX_STEP]

    def at(self, offset: int) -> int:
        """crc32 of ``data[:offset]``."""
        step = offset // _PREFIX_STEP
        while len(self.steps) <= step:
            i = len(self.steps) - 1
            chunk = self.data[i * _PREFIX_STEP : (i + 1) * _PREFIX_STEP]
            self.steps.append(zlib.crc32(chunk, self.steps[i]))
        return zlib.crc32(self.data[step * _PREFIX_STEP : offset], self.steps[step])

    def may_be_record(self, offset: int) -> bool:
        """False when the record claimed at ``offset`` (its length fits) cannot be valid; a long
        one is judged from prefix checksums, a short one is left to ``_parse_at``."""
        length, crc = HEADER.unpack_from(self.data, offset)
        if length <= _LONG:
            return True
        start, end = offset + HEADER.size, offset + HEADER.size + length
        shift = _x8nmodp(length)
        # crc(length ‖ payload) = crc(length)·x^8L ⊕ crc(payload); crc(payload) = P[end] ⊕ P[start]·x^8L
        expected = _multmodp(shift, zlib.crc32(length.to_bytes(4, "little")) ^ self.at(start)) ^ self.at(end)
        return expected == crc


def _candidates(data: bytes | mmap.mmap, lo: int, hi: int) -> list[int]:
    """The offsets in [lo, hi) where a record could start: its length fits in what follows it."""
    size = len(data)
    hi = min(hi, size - HEADER.size + 1)
    if hi <= lo:
        return []
    chunk = bytes(data[lo : hi + HEADER.size - 1])  # every header that starts in the window
    if not chunk.strip(b"\x00"):
        return []  # all zeros: a zero length needs a non-zero CRC
    found: list[int] = []
    for align in range(4):
        words = (len(chunk) - align) // 4
        for i, (length,) in enumerate(struct.iter_unpack("<I", chunk[align : align + 4 * words])):
            at = lo + align + 4 * i
            if at >= hi or length > MAX_RECORD or length > size - at - HEADER.size:
                continue
            if length == 0 and HEADER.unpack_from(data, at)[1] != _EMPTY_CRC:
                continue
            found.append(at)
    found.sort()
    return found


# Readers hold the writer lock for a moment too (to see whether a writer lives, to raise the mark
# for a dead writer's records): a writer starting then waits that moment out instead of failing.
LOCK_WAIT_S = 0.5


def _lock_within(handle: BinaryIO, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


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
        if not _lock_within(self._lock, LOCK_WAIT_S):
            self._lock.close()
            raise SpoolLockedError(f"spool {self.directory} already has a live writer") from None
        self.fsync_interval_s = fsync_interval_s
        self.segment_bytes = segment_bytes
        self._last_sync = time.monotonic()
        self._syncing: threading.Thread | None = None
        self._high_water_lock = threading.Lock()  # the fsync thread and sync() both raise the mark
        self._high_water = high_water(self.directory)
        # Never below the mark: positions the ledger may hold are not handed out again, even when
        # the segments that held them were deleted.
        self.next_index = max(self._recover(), self._high_water)
        self._open_segment(self.next_index)

    def _recover(self) -> int:
        """Count the records already there. A damaged tail stays for readers to quarantine."""
        segments = _segments(self.directory)
        if not segments:
            return 0
        base = segments[-1]
        with _mapped(_segment_path(self.directory, base)) as data:
            return base + sum(1 for _ in _entries(data))

    def _raise_high_water(self, position: int) -> None:
        """Persist that every position below ``position`` is handed out (its record flushed)."""
        with self._high_water_lock:
            if position <= self._high_water:
                return
            write_durably(self.directory / HIGH_WATER_FILE, f"{position}\n")
            self._high_water = position

    def _open_segment(self, base: int) -> None:
        # A new segment on every open: never append after bytes that a crash may have torn. A
        # segment already named ``base`` holds no record (else the count would have passed it).
        path = _segment_path(self.directory, base)
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self._segment_base = base
        self._segment_size = 0
        self._write_whole(MAGIC)
        self.sync()
        fsync_dir(self.directory)

    def append(self, payload: bytes) -> int:
        """Append one record; returns its index. Durable within ``fsync_interval_s``."""
        record = _encode(payload)
        if self._segment_size + len(record) > self.segment_bytes and self._segment_size > len(MAGIC):
            self.sync()
            self._file.close()
            self._open_segment(self.next_index)
        self._write_whole(record)
        index = self.next_index
        self.next_index += 1
        if time.monotonic() - self._last_sync >= self.fsync_interval_s:
            self._sync_in_background()
        return index

    def _write_whole(self, data: bytes) -> None:
        """``data`` into the segment whole (the OS has it), or none of it. Unbuffered on purpose: a
        record ``append`` returned for is never held in a buffer of this process, where a disk that
        fills up, then an exit, would lose it uncounted (the emitter counted it as on the bus). A
        short write (the disk filled mid-record) is cut back off and raised as ENOSPC, so the
        caller's retry appends after whole records only, never after a torn one."""
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                count = self._file.write(view[written:])
                if not count:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                written += count
        except BaseException:
            if written:
                os.ftruncate(self._file.fileno(), self._segment_size)
                self._file.seek(self._segment_size)
            raise
        self._segment_size += written

    def _sync_in_background(self) -> None:
        """The interval's fsync, off the caller's path: an fsync can take hundreds of ms on a busy
        disk, and ``append`` sits on a training loop's emit path. The bytes are with the OS already; a
        thread fsyncs a duplicate of the file descriptor (still valid if the segment is closed
        meanwhile). While one is in flight the next interval waits for it (at most one at a time)."""
        if self._syncing is not None and self._syncing.is_alive():
            return
        self._file.flush()
        fd = os.dup(self._file.fileno())
        self._last_sync = time.monotonic()
        flushed = self.next_index

        def fsync_and_close() -> None:
            try:
                os.fsync(fd)
                with contextlib.suppress(OSError):  # a full disk: the next interval tries again
                    self._raise_high_water(flushed)
            finally:
                os.close(fd)

        self._syncing = threading.Thread(target=fsync_and_close, name="spool-fsync", daemon=True)
        self._syncing.start()

    def sync(self) -> None:
        """Make everything appended so far durable (flush + fsync)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()
        # The records are durable now, whatever the mark does: a mark that cannot be written (a full
        # disk has room left in the segment's last block, none for a new file) only makes readers
        # wait for it, so it must not make the caller think its records were refused.
        with contextlib.suppress(OSError):
            self._raise_high_water(self.next_index)

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


def raise_high_water(directory: Path, position: int) -> bool:
    """Raise the high-water mark to ``position`` for records a dead writer left (a reader is about
    to hand them on), under the writer lock so no writer runs meanwhile. False if a writer holds it
    (or the mark cannot be written now); True too for a spool no writer can write (read-only)."""
    try:
        with open(directory / "writer.lock", "a+b") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                if position > high_water(directory):
                    write_durably(directory / HIGH_WATER_FILE, f"{position}\n")
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError as exc:
        return exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    return True


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


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[bytes | mmap.mmap]:
    """A segment's bytes, mapped (read on demand) rather than read whole."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            yield b""
            return
        with mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ) as data:
            yield data


@dataclass
class _SegmentIndex:
    """Where each entry (record or damaged stretch) of one segment lies, as far as it was scanned:
    kept between reads, so the next read resumes at its byte offset instead of re-scanning (and
    re-resynchronising) the segment from its start."""

    size: int = 0  # the segment's size when scanned
    offsets: array[int] = field(default_factory=lambda: array("q"))  # 8 bytes an entry
    ends: array[int] = field(default_factory=lambda: array("q"))
    corrupt: dict[int, str] = field(default_factory=dict)  # entry number -> why it is damaged
    _slots: tuple[tuple[int, int, int], list[int | None]] | None = None  # ``slots``, once worked out
    numbers: list[int] = field(default_factory=list)  # with ``slots``: each position's entry number

    def extend(self, data: bytes | mmap.mmap) -> None:
        """Scan what was appended since (a damaged tail is scanned again: it may have been a write
        in progress)."""
        last = len(self.offsets) - 1
        if last >= 0 and (last in self.corrupt or self.ends[last] > len(data)):
            self.corrupt.pop(last, None)
            start = self.offsets.pop()
            self.ends.pop()
        else:
            start = self.ends[-1] if self.ends else 0
        for offset, end, corrupt in _entries(data, start):
            if corrupt is not None:
                self.corrupt[len(self.offsets)] = corrupt
            self.offsets.append(offset)
            self.ends.append(end)
        self.size = len(data)

    def slots(self, base: int, following: int | None) -> list[int | None] | None:
        """Each entry's position, or None when that is ``base`` + its number (the usual case). A
        closed segment holds exactly ``following - base`` positions: when it has more entries
        (garbage or a record added to it), the damaged stretches, then the trailing records, are the
        ones beyond (None in the list); they never take the next segment's positions."""
        count = len(self.offsets)
        if following is None or count <= following - base:
            return None
        key = (base, following, count)
        if self._slots is not None and self._slots[0] == key:
            return self._slots[1]
        extra = count - (following - base)
        beyond = set(sorted(self.corrupt, reverse=True)[:extra])
        trailing = [i for i in range(count - 1, -1, -1) if i not in beyond][: extra - len(beyond)]
        beyond.update(trailing)
        slots: list[int | None] = []
        position = base
        for i in range(count):
            slots.append(None if i in beyond else position)
            position += i not in beyond
        self._slots = (key, slots)
        self.numbers = [i for i, slot in enumerate(slots) if slot is not None]
        return slots


class SpoolReader:
    """Reads a spool from any index. Safe beside a live writer. Keeps where each segment's entries
    lie, so reading a spool batch after batch is linear in its size (damage included)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no spool at {self.directory}")
        self.id = spool_id(self.directory)
        self._indexes: dict[int, _SegmentIndex] = {}

    def high_water(self) -> int:
        """The spool's high-water mark (``high_water``): positions below it were handed out."""
        return high_water(self.directory)

    def _index(self, base: int, data: bytes | mmap.mmap) -> _SegmentIndex:
        index = self._indexes.get(base)
        if index is None or len(data) < index.size:
            index = _SegmentIndex()  # new, or shrunk (replaced): scanned afresh
        if len(data) != index.size or not index.offsets:
            index.extend(data)
        # Only the segment being read is kept: memory stays one segment's entry list.
        self._indexes = {base: index}
        return index

    def read(
        self, start: int = 0, limit: int | None = None, *, beyond: bool = False
    ) -> Iterator[SpoolRecord]:
        """Records with index >= ``start``, in order, at most ``limit`` of them. ``beyond``: also the
        entries a closed segment holds past its last position (``SpoolRecord.beyond``), each yielded
        at least once by the read that yields the position after it (a read never stops before one)."""
        segments = _segments(self.directory)
        live = writer_alive(self.directory)
        # A live writer's records are read up to its high-water mark only: the mark is durable
        # before anyone reads them, so no position a reader handed on is ever handed out again.
        bound = high_water(self.directory) if live else None
        produced = 0
        for i, base in enumerate(segments):
            following = segments[i + 1] if i + 1 < len(segments) else None
            if following is not None and following <= start:
                continue
            try:
                mapped = _mapped(_segment_path(self.directory, base))
                data = mapped.__enter__()
            except FileNotFoundError:
                continue  # deleted since it was listed
            try:
                for record in self._segment_records(base, following, data, start, live, beyond):
                    if record is None:
                        return  # an incomplete tail while the writer lives is a write in progress
                    if not record.beyond:
                        if limit is not None and produced >= limit:
                            return
                        if bound is not None and record.index >= bound:
                            return
                        produced += 1
                    yield record
            finally:
                mapped.__exit__(None, None, None)

    def _segment_records(
        self,
        base: int,
        following: int | None,
        data: bytes | mmap.mmap,
        start: int,
        live: bool,
        beyond: bool,
    ) -> Iterator[SpoolRecord | None]:
        """One segment's records from ``start`` (None: stop here, a write in progress)."""
        index = self._index(base, data)
        slots = index.slots(base, following)
        if slots is None:
            first = max(0, start - base)  # dense: an entry's number is its position - base
        else:  # just after the entry of the position before ``start`` (beyond entries included)
            first = index.numbers[start - base - 1] + 1 if start > base else 0
        for n in range(first, len(index.offsets)):
            position = base + n if slots is None else slots[n]
            offset, end = index.offsets[n], index.ends[n]
            corrupt = index.corrupt.get(n)
            if corrupt is not None and following is None and live and end >= len(data):
                yield None
                return
            whole = data[offset:end] if corrupt is not None else data[offset + HEADER.size : end]
            if position is None:
                assert slots is not None and following is not None
                if beyond:
                    after = next((s for s in slots[n + 1 :] if s is not None), following)
                    yield SpoolRecord(after, bytes(whole), corrupt or _BEYOND, base, offset, True)
            else:
                yield SpoolRecord(position, bytes(whole), corrupt, base, offset)


_BEYOND = "a record past the last position of its segment (never handed out by its writer)"


# --- a producer's last drop count, kept beside the spool ------------------------------------------

PENDING_DIR = "pending"  # <spool>/pending/<source>.<hash>.json, one file per producer source
PENDING_BYTES = 4096  # one page, reserved at the producer's start and overwritten in place at its end
STALE_RESERVATION_S = 60.0  # an unlocked reservation this old was left by a producer that died


class PendingEvent(msgspec.Struct, kw_only=True):
    """A pending file's content. ``reserved``: made at the producer's start, nothing to record.
    ``pending``: ``event`` is an event the bus refused at the producer's end (its drop report),
    exactly the bytes the bus would have taken (sealed, if the producer signs); ``spool_next``: the
    spool's next position then (every record of that producer in the spool is below it)."""

    version: int = 1
    source: str
    state: Literal["reserved", "pending"]
    event: str | None = None
    spool_next: int | None = None


_pending_decoder = msgspec.json.Decoder(PendingEvent)


def pending_path(directory: Path, source: str) -> Path:
    """The pending file of ``source`` in the spool ``directory`` (readable name, hashed for uniqueness)."""
    readable = "".join(c if c.isalnum() or c in "._-" else "_" for c in source)[:100]
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    return Path(directory) / PENDING_DIR / f"{readable}.{digest}.json"


def _padded(content: PendingEvent) -> bytes:
    """The file's bytes: the JSON padded with spaces to ``PENDING_BYTES`` (longer: as it is)."""
    text = msgspec.json.encode(content)
    return text + b" " * (PENDING_BYTES - 1 - len(text)) + b"\n" if len(text) < PENDING_BYTES else text


class PendingSlot:
    """A producer's pending file: created full size at its start (while there is space), open and
    locked (``flock``) for its life, so an ingester knows it is in use. At its end either ``release``
    (nothing left to record: the file goes) or ``hold`` (the event the bus refused: written over the
    reserved bytes in place, which needs no new block on a full disk, and fsynced)."""

    def __init__(self, path: Path, source: str, fd: int | None = None) -> None:
        self.path = path
        self.source = source
        self._fd: int | None = fd

    @classmethod
    def reserve(cls, directory: str | os.PathLike[str], source: str) -> PendingSlot:
        """Create (or take over) ``source``'s file at full size; OSError if there is no room."""
        path = pending_path(Path(directory), source)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, _padded(PendingEvent(source=source, state="reserved")))
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours alone: just created
        return cls(path, source, fd)

    def hold(self, event: bytes, spool_next: int | None) -> None:
        """Keep ``event`` for the next ingest of the spool: in place when it fits the reservation,
        else as a new file (which needs space). Durable when it returns; OSError if not written."""
        content = PendingEvent(
            source=self.source, state="pending", event=event.decode(), spool_next=spool_next
        )
        data = _padded(content)
        try:
            if self._fd is not None and len(data) == os.fstat(self._fd).st_size:
                os.pwrite(self._fd, data, 0)
                os.fsync(self._fd)
            else:
                write_durably(self.path, data)
        finally:
            self._close()  # unlocked: the ingester may take it now

    def release(self) -> None:
        """Nothing left to record: the file goes (removing needs no space)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._close()
        with contextlib.suppress(OSError):
            fsync_dir(self.path.parent)

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


@dataclass(frozen=True)
class PendingFile:
    """A pending file an ingester may take: its producer is gone (the file is not locked)."""

    path: Path
    raw: bytes  # the event's bytes, or the whole file's when it does not parse
    spool_next: int | None = None
    damaged: str | None = None  # why the file is not a readable pending event


def pending_files(directory: str | os.PathLike[str]) -> list[PendingFile]:
    """The spool's pending events whose producers are gone, oldest name first; files that do not
    parse come back ``damaged`` (to be quarantined, not passed over); a reservation left unlocked
    for ``STALE_RESERVATION_S`` (its producer died without an end) is removed here."""
    found: list[PendingFile] = []
    for path in sorted((Path(directory) / PENDING_DIR).glob("*.json")):
        taken = _read_unlocked(path)
        if taken is None:
            continue  # in use, or gone meanwhile
        data, age_s = taken
        try:
            content = _pending_decoder.decode(data)
        except msgspec.DecodeError as exc:
            found.append(PendingFile(path, data, damaged=f"pending file {path.name} does not parse: {exc}"))
            continue
        if content.state == "pending" and content.event is not None:
            found.append(PendingFile(path, content.event.encode(), content.spool_next))
        elif content.state == "reserved" and age_s > STALE_RESERVATION_S:
            remove_pending(path)
    return found


def _read_unlocked(path: Path) -> tuple[bytes, float] | None:
    """The file's bytes and age in seconds, if no producer holds its lock; None otherwise."""
    try:
        with open(path, "rb") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            return handle.read(), time.time() - os.fstat(handle.fileno()).st_mtime
    except FileNotFoundError:
        return None


def remove_pending(path: Path) -> None:
    """A pending file the ledger now holds (or a stale reservation): removed, durably."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with contextlib.suppress(OSError):
        fsync_dir(path.parent)
