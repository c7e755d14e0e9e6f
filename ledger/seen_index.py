"""The writer's dedupe index, on disk: every stored event's (source, id) and its Merkle leaf hash.

A commit asks it, for each valid record, whether its (source, id) is stored already, and with which
leaf hash: the same one makes the record a duplicate, another one a conflict.

It is a projection of the commit log, kept like one: SQLite holds the entries and the newest commit
they cover (``through``) in one transaction, and whoever holds the writer lock brings it up to date
from the commit records after ``through`` (each lists the (source, id) and leaf of what it appended).
So it never needs to be right on its own: a missing, unreadable or foreign index (one whose
``through`` record is not this log's) is rebuilt from the log. It lives on disk so that a writer's
memory does not grow with the ledger (a dict of the reference run's 1.1M events held ~185 MB, and a
writer opening the ledger read every commit record before its first commit).

Layout: ``_index/seen.sqlite`` (WAL mode) beside ``_commits/``; not part of the verified record.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger(__name__)

INDEX_DIR = "_index"
INDEX_FILE = "seen.sqlite"
_KEYS_PER_QUERY = 500  # under SQLite's oldest limit of 999 bound parameters
_CACHE_KIB = 16 * 1024  # SQLite's page cache: the index's whole share of the writer's memory

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS seen (key BLOB PRIMARY KEY, leaf BLOB NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BLOB NOT NULL) WITHOUT ROWID",
)


def seen_key(source: str, event_id: str) -> bytes:
    """The index's key for (source, id): 16 bytes of BLAKE2b. A collision (2^-64 odds at 2^32
    events) would refuse one event as a conflict, never drop it silently: it is quarantined."""
    return hashlib.blake2b(f"{source}\x00{event_id}".encode(), digest_size=16).digest()


class _Identity(msgspec.Struct):
    source: str
    id: str


_identity_decoder = msgspec.json.Decoder(_Identity)  # skips every other member unread


def record_key(raw: bytes) -> bytes | None:
    """The key of the (source, id) a raw record names, read without validating the rest (~1 µs for a
    small event); None if it names none. Only for fetching keys ahead: the full decode decides."""
    try:
        identity = _identity_decoder.decode(raw)
    except Exception:  # not JSON, nested too deep, no source: the full decode says why
        return None
    return seen_key(identity.source, identity.id)


def appended_entries(record: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """(key, leaf hash) of every event one commit record appended."""
    entries: list[tuple[bytes, bytes]] = []
    for added in record.get("appended", {}).values():
        leaves = base64.b64decode(added["leaves"])
        hashes = [leaves[i : i + 32] for i in range(0, len(leaves), 32)]
        keys = [seen_key(source, event_id) for source, event_id in added["ids"]]
        entries.extend(zip(keys, hashes, strict=True))
    return entries


def record_digest(raw: bytes) -> bytes:
    """What identifies a commit record's bytes: an index is this log's if its ``through`` matches."""
    return hashlib.blake2b(raw, digest_size=16).digest()


class SeenIndex:
    """The index of one ledger directory. Use only under the ledger's writer lock."""

    def __init__(self, root: Path) -> None:
        self.path = root / INDEX_DIR / INDEX_FILE
        self._db: sqlite3.Connection | None = None
        self._inode = -1
        self.through = -1  # the newest commit whose appended events are in the index
        self._digest: bytes | None = None  # its record's ``record_digest``
        self._checked = False  # whether ``through`` was checked against this log's record

    @property
    def empty(self) -> bool:
        """Whether no commit has added anything yet (caught up: the ledger stores no event)."""
        return self.through < 0

    def get(self, key: bytes) -> bytes | None:
        """The leaf hash stored under ``key``, or None."""
        assert self._db is not None
        row = self._db.execute("SELECT leaf FROM seen WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def get_many(self, keys: Iterable[bytes]) -> dict[bytes, bytes]:
        """The leaf hashes stored under any of ``keys`` (absent keys are left out). A query per
        ``_KEYS_PER_QUERY`` keys: one ``get`` per record was ~13 µs, a sixth of a commit's time."""
        assert self._db is not None
        ordered = sorted(set(keys))  # in key order, the B-tree's pages are visited once each
        found: dict[bytes, bytes] = {}
        for start in range(0, len(ordered), _KEYS_PER_QUERY):
            chunk = ordered[start : start + _KEYS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            found.update(self._db.execute(f"SELECT key, leaf FROM seen WHERE key IN ({marks})", chunk))
        return found

    def add(self, number: int, digest: bytes, entries: Iterable[tuple[bytes, bytes]]) -> None:
        """Entries appended by commit ``number`` (its record's ``digest``), in one transaction."""
        with self._transaction() as db:  # the entries and ``through`` together
            # Sorted keys touch the B-tree's pages in order.
            db.executemany("INSERT OR IGNORE INTO seen VALUES (?, ?)", sorted(entries))
            db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)", [("through", number), ("through_digest", digest)]
            )
        self.through, self._digest = number, digest

    def catch_up(self, last_commit: int, read: Callable[[int], bytes | None]) -> None:
        """Bring the index up to ``last_commit``: open it (or start it over), and add what each
        commit after ``through`` appended. ``read(n)``: commit ``n``'s record bytes, or None."""
        self._open()
        if not self._checked or self.through > last_commit:
            if not self._matches(read):
                self._start_over("it does not match the commit log")
            self._checked = True
        for number in range(self.through + 1, last_commit + 1):
            raw = read(number)
            if raw is None:  # numbers are consecutive: a gap is a log this index cannot follow
                raise FileNotFoundError(f"commit record {number} is missing")
            record = msgspec.json.decode(raw)  # ~1.5x json's speed on commit records
            self.add(number, record_digest(raw), appended_entries(record))

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ----------------------------------------------------------------- internals
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One explicit transaction (the connection is in autocommit mode: without it, every row
        of an ``executemany`` would be a transaction of its own)."""
        db = self._db
        assert db is not None
        db.execute("BEGIN")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _open(self) -> None:
        """Connect (again if the file was replaced by another writer's rebuild)."""
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            inode = -1
        if self._db is not None and inode == self._inode:
            return
        self.close()
        self._checked = False
        try:
            self._connect()
        except sqlite3.DatabaseError as exc:  # not a database, or damaged: the log rebuilds it
            if "disk is full" in str(exc):  # not damage: rebuilding would fill the disk again
                raise OSError(errno.ENOSPC, "no space left on device", str(self.path)) from exc
            log.warning("dedupe index %s unreadable (%s): rebuilding it from the commit log", self.path, exc)
            self.close()
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._connect()

    def _connect(self) -> None:
        self.path.parent.mkdir(exist_ok=True)
        # check_same_thread off: a Ledger may be opened in one thread and commit in another; the
        # writer lock keeps its use to one at a time.
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db = db
        # WAL + synchronous=NORMAL: a crash may lose the last transactions, never consistency;
        # what is lost is re-added from the log (``through`` is stored with the entries).
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
        for statement in _SCHEMA:
            db.execute(statement)
        meta = dict(db.execute("SELECT name, value FROM meta").fetchall())
        self.through = int(meta.get("through", -1))
        self._digest = meta.get("through_digest")
        self._inode = os.stat(self.path).st_ino

    def _matches(self, read: Callable[[int], bytes | None]) -> bool:
        if self.through < 0:
            return True
        raw = read(self.through)
        return raw is not None and record_digest(raw) == self._digest

    def _start_over(self, why: str) -> None:
        log.warning("dedupe index %s: %s; rebuilding it from the commit log", self.path, why)
        with self._transaction() as db:
            db.execute("DELETE FROM seen")
            db.execute("DELETE FROM meta")
        self.through = -1
        self._digest = None
