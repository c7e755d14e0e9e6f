"""The ledger on disk: a folder whose tables are in a DuckLake, and a copy of its commit records.

Layout (all paths relative to the ledger root)::

    LAKE.json                   the lake's catalog, data path and ledger id (``runledger.ledger.lake.LakeFolder``)
    catalog.sqlite              the embedded catalog (one host; PostgreSQL for many hosts is elsewhere)
    data/main/<table>/<partition>=<value>/*.parquet   the lake's data files
    _commits/0000000042.json    commit 42's record: positions, stream heads, the lake snapshot it made

A commit is atomic and exactly-once: one lake transaction holds every table's rows, the source
positions the commit covers, the stream heads it moves, its commit record and the commit-number
fence (``LakeTables.commit``). A writer on another host that committed that number first makes it
stale, and the commit is redone on its commits. The folder's copy of a record is written after the
lake commit; a writer killed in between leaves it to the next opener (``_sync_records``). Records
at positions the ledger already covers are skipped, so ingesting the same source again is a no-op.
Writers in one folder also serialise on an flock, so several ingesters (say, a Kafka consumer
group) can share one ledger.

A folder of the old format (part files under ``LEDGER.json``, written before DuckLake) is never
opened or written: ``ledger migrate`` turns it into a lake (``old_format_problem``). A folder whose
``LEDGER.json`` is a published copy's (``runledger.ledger.remote.fetch_copy``) opens read-only, for reads.

No record can stop a commit. ``decode_event`` turns any bytes into an event or a quarantined record;
and an event the ledger still cannot store (its projector raises, or its rows do not fit their
Parquet columns, or a partition value is no usable directory name) is quarantined too, with the
exception's class and message (code ``unstorable``), while the rest of the batch commits. Each
record's rows are built apart and only then appended, so a record that fails half-way leaves
nothing behind. Rows that fail only when the batch becomes Arrow tables (an int beyond int64...) send
the commit round once more, converting on their own the rows of each event in the (table,
partition) groups that failed, to quarantine the culprits; the usual batch pays nothing for this.
Only the environment (``OSError``: disk, permissions) aborts a commit, to be retried.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import fcntl
import json
import logging
import os
import re
import shlex
import time
import uuid
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from runledger.ledger.admission import (
    ADMISSION_REASONS,
    INCIDENT_INGEST,
    UNCHECKED,
    AdmissionRound,
    AdmissionState,
    admission_round,
)
from runledger.ledger.anomalies import (
    ANOMALY_INGEST,
    RULES_IN_FORCE,
    AnomalyRound,
    DetectorState,
    Rule,
    admitted_anomaly,
    anomaly_round,
)
from runledger.ledger.duck import one_row
from runledger.ledger.lake import (
    COMMIT_FENCE,
    EMBEDDED_CATALOG,
    ID_FENCE,
    ID_KEY,
    LAKE_MARKER,
    Catalog,
    LakeError,
    LakeFolder,
    LakeTables,
    first_line,
    missing_catalog,
    wait_for_flock,
)
from runledger.ledger.merkle import CompactRange, leaf_hash
from runledger.ledger.parquet_schemas import SALTS, SIDE_TABLES, TABLES, Table
from runledger.ledger.projectors import FoldState, RowBuffer, rows_for_event
from runledger.ledger.records import (  # (re-exported: light, for readers)
    COMMITS,
    LedgerError,
    StreamHead,
    commit_record_path,
    commit_record_paths,
    read_commit_record,
)
from runledger.ledger.seen_index import SeenIndex, record_digest, record_key, seen_key
from runledger.schemas.codec import (
    CONFLICT,
    CORRUPT,
    DECODE,
    EMPTY,
    ENVELOPE,
    MAX_EVENT_BYTES,
    MAX_REASON_CHARS,
    SCHEMA,
    STREAM_RUN_MISMATCH,
    TOMBSTONE,
    TOO_DEEP,
    TOO_LARGE,
    UNKNOWN_TYPE,
    UNKNOWN_VERSION,
    UNSTORABLE,
    Event,
    Quarantined,
    decode_event,
    refused_event,
    stream_run_mismatch,
)
from runledger.schemas.durable import disk_full, disk_full_path, remove_dead_temporaries, write_durably

log = logging.getLogger(__name__)

OLD_FORMAT = "runledger-ledger"  # LEDGER.json's "format" in a ledger of part files (``old_format_problem``)
# Every code a quarantined record can carry (``Quarantined.code``): the decoder's, the store's own and
# admission's. The one list the docs' dead-letter reasons are checked against (tests/core/test_docs_truth.py).
QUARANTINE_REASONS = (
    EMPTY,
    TOMBSTONE,
    TOO_LARGE,
    TOO_DEEP,
    DECODE,
    ENVELOPE,
    UNKNOWN_TYPE,
    UNKNOWN_VERSION,
    SCHEMA,
    CORRUPT,
    UNSTORABLE,
    CONFLICT,
    STREAM_RUN_MISMATCH,
    *ADMISSION_REASONS,
)
SALT_BYTES = 16
LEDGER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # it is part of every checkpoint's origin line
MAINTAIN_EVERY_COMMITS = 50  # a ledger on DuckLake: the lake's merge/expire/clean-up this often
# ... and between those, its merge of the small files this often (``LakeTables.merge_small_files``:
# the full reference run, 23 commits after its last full merge, had a reader open 17 GitHub and 24
# state-event files; ``ledger state`` took ~25 ms less on the same lake with them merged).
MERGE_SMALL_EVERY_COMMITS = 10
LAKE_KEEP_S = 3600.0  # ... keeping an hour of snapshots for --snapshot and pinned readers
# A commit another writer beat to the lake is redone on its commits: at most this often and this
# long, and only while each redo finds commits it had not seen (a fence moved by no commit record
# means the catalog is not this ledger's history: redoing would never end).
LAKE_REDO_LIMIT = 100
LAKE_REDO_S = 300.0
LAKE_REDO_IDLE = 3
# A writer waits this long for another writer's commit in the same folder (``.writer.lock``).
WRITER_LOCK_WAIT_S = 900.0


class _UnencodableBatch(Exception):
    """The batch's rows did not all convert to Arrow: redo it, checking on its own each record that
    has rows in ``suspects`` (the (table, partition) groups that failed; None: every group)."""

    def __init__(self, message: str, suspects: frozenset[tuple[str, str]] | None) -> None:
        super().__init__(message)
        self.suspects = suspects


_Careful = frozenset[tuple[str, str]] | None  # the groups to check record by record (None: all)


@dataclass(frozen=True)
class SourceRecord:
    """One record read from a bus: where it came from and its raw bytes."""

    source: str  # "spool:<spool id>" or "kafka:<topic>:<partition>"
    position: int  # its index/offset in that source
    raw: bytes
    corrupt: str | None = None  # the bus already knows these bytes are damaged, and why
    tombstone: bool = False  # a Kafka record whose value is null (``raw`` is then b"")


@dataclass
class CommitResult:
    commit: int | None
    accepted: int = 0  # events stored: the batch's, and those the ledger made of them (``made``)
    made: int = 0  # of ``accepted``, the ledger's own: ingest's incidents and the detectors' anomalies
    duplicates: int = 0
    skipped: int = 0  # at positions an earlier commit already covered
    quarantined: list[tuple[SourceRecord, Quarantined]] = field(default_factory=list)
    metric_values: int = 0
    files: list[str] = field(default_factory=list)  # the lake data files it added, as its record names them
    erased_files: int = 0  # on DuckLake, data files rewritten without rows a LakeEdit deleted


@dataclass
class _CommitWork:
    """One commit under way: what its events are checked against and what they add."""

    number: int  # the commit's number
    streams: dict[str, StreamHead]  # every stream's head as the commit moves it (a copy)
    admission: AdmissionRound
    anomalies: AnomalyRound  # the detectors: the anomaly events each admitted event causes
    staging: _Staging
    check: _Careful
    # The (source, id) keys the records name, looked up before the loop (None: the ledger stores no
    # event yet) …
    asked: set[bytes] | None
    known: dict[bytes, bytes]  # … and the leaf hashes of those stored already
    result: CommitResult = field(default_factory=lambda: CommitResult(commit=None))
    buf: RowBuffer = field(default_factory=RowBuffer)
    appended: dict[bytes, bytes] = field(default_factory=dict)  # this commit's keys and leaf hashes
    salts: dict[str, list[tuple[str, int, bytes]]] = field(default_factory=dict)  # stream type -> rows
    added: dict[str, dict[str, Any]] = field(default_factory=dict)  # per stream: first seq, leaves, ids


def stream_type(stream: str) -> str:
    return "repo" if "/" in stream else "run"


class Ledger:
    """A ledger directory. Open for reading anywhere; ``commit`` takes the writer lock."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._last_commit = -1
        self._folded_commit = -1  # the last commit whose ids and configs this instance has folded
        self._positions: dict[str, int] = {}
        self._streams: dict[str, StreamHead] = {}
        # (source, id) -> the Merkle leaf hash of the event stored under it: a repeat with the same
        # hash is a duplicate, with another hash a conflict. On disk (runledger.ledger.seen_index).
        self._index = SeenIndex(root)
        self._fold = FoldState(load_config=self._load_config)
        self._swept = False
        # Commit records never change once written: the newest one, parsed, is kept (a commit of
        # 20,000 events has a ~2 MB record, and each commit would otherwise parse it three times).
        self._newest_record: dict[str, Any] | None = None
        self._usable_partitions: set[tuple[str, str]] = set()
        self.ledger_id = "ledger"
        # runledger.ledger.admission's state as of a commit (it loads and keeps it)
        self.admission_state: AdmissionState | None = None
        # runledger.ledger.anomalies: the rule set in force and the detectors' state as of a commit
        self.anomaly_rules: tuple[Rule, ...] = RULES_IN_FORCE
        self.anomaly_state: DetectorState | None = None
        # A ledger on DuckLake (LAKE.json): its tables, positions and commit records are the lake's;
        # the folder keeps a copy of the records (``_sync_records``) and the dedupe index. None: a
        # published copy, opened for reads only.
        self.lake: LakeTables | None = None
        self.lake_folder: LakeFolder | None = None
        self.maintain_every = (
            MAINTAIN_EVERY_COMMITS  # (0: the lake never merges itself, not even small files)
        )
        self.merge_small_every = MERGE_SMALL_EVERY_COMMITS

    # ----------------------------------------------------------------- opening
    @classmethod
    def create(cls, root: str | Path, ledger_id: str | None = None) -> Ledger:
        """A new ledger at ``root`` (or the one already there): a lake with its catalog and data in
        the folder. ``ledger_id``: the id of the log it continues, e.g. when a replay rebuilds it:
        signed checkpoints name it in their origin (``runledger/<ledger id>/<stream>``), so keeping
        it keeps them checkable. Default: a new id."""
        root = Path(root)
        return cls.create_on_lake(root, f"sqlite:{root / EMBEDDED_CATALOG}", ledger_id=ledger_id)

    @classmethod
    def create_on_lake(
        cls, root: str | Path, catalog: str, data_path: str | Path | None = None, ledger_id: str | None = None
    ) -> Ledger:
        """A new ledger whose tables are in a DuckLake (``catalog``: duckdb:PATH, sqlite:PATH or
        postgres:DSN; data files under ``data_path``, default ROOT/data), or the one already there.
        Writers on other hosts open the same lake from folders of their own (the same catalog, data
        path and ledger id)."""
        root = Path(root)
        if ledger_id is not None and not LEDGER_ID.fullmatch(ledger_id):
            raise LedgerError(f"ledger id {ledger_id!r} must be 1-64 of A-Z a-z 0-9 . _ -")
        if (root / "LEDGER.json").exists():  # never a lake made into an old ledger or a copy
            raise LedgerError(_not_a_lake(root))
        opened: LakeTables | None = None
        if not (root / LAKE_MARKER).exists() and any((root / COMMITS).glob("*.json")):
            # Its catalog is named nowhere now: a new one would not hold these commits.
            raise LedgerError(
                f"{root} holds commit records but no {LAKE_MARKER}: restore it (it names the lake's "
                "catalog); a new lake is never made under a ledger that has commits"
            )
        if not (root / LAKE_MARKER).exists():
            root.mkdir(parents=True, exist_ok=True)
            data = str(data_path if data_path is not None else root / "data")
            try:
                chosen = ledger_id or uuid.uuid4().hex[:16]
                opened = LakeTables(catalog, data, name_new=chosen)  # a new lake is named as it is made
                known = chosen if opened.named_now else opened.state().get(ID_KEY)
                if known is None:  # a lake whose tables another creator made: name it (one wins a race)
                    named = opened.commit({}, {ID_FENCE: (0, 1)}, {ID_KEY: chosen}, writer="create")
                    known = chosen if named.ok else opened.state().get(ID_KEY)
                if ledger_id is not None and known != ledger_id:
                    raise LedgerError(f"the lake at {catalog} is ledger {known}, not {ledger_id}")
                opened.note_ledger_id(str(known))  # (a replaced catalog is told by it: ``_same_ledger``)
                LakeFolder(root, catalog, data, str(known), tuple(TABLES)).write()
            except (LakeError, duckdb.Error) as exc:
                if opened is not None:
                    opened.close()
                raise LedgerError(
                    f"lake {catalog}: {str(exc).strip().splitlines()[0]}"
                ) from exc  # (kept: a full disk behind it is told as one)
            except BaseException:
                if opened is not None:
                    opened.close()
                raise
        # the lake just made is kept open for the ledger (not attached a second time)
        ledger = cls._open_lake(root, opened) if opened is not None else cls.open(root)
        if ledger_id is not None and ledger.ledger_id != ledger_id:
            raise LedgerError(f"{root} is ledger {ledger.ledger_id}, not {ledger_id}")
        return ledger

    @classmethod
    def open(cls, root: str | Path) -> Ledger:
        """The ledger at ``root``: a lake, or a published copy (read-only). A ledger of the old
        format is refused in one line naming its ``ledger migrate`` command, and left as it is."""
        root = Path(root)
        marker = root / "LEDGER.json"
        if not marker.exists() and (root / LAKE_MARKER).exists():
            return cls._open_lake(root)
        if not marker.exists():
            raise LedgerError(f"no ledger at {root} (create one with `ledger ingest` or `ledger demo`)")
        meta = _folder_marker(root)
        if meta.get("format") == OLD_FORMAT:
            raise LedgerError(old_format_problem(root))
        ledger = cls(root)  # a published copy: its tables' files, and no commit of its own
        ledger.ledger_id = str(meta.get("id", "ledger"))
        ledger._load_head()
        return ledger

    @classmethod
    def _open_lake(cls, root: Path, lake: LakeTables | None = None) -> Ledger:
        folder: LakeFolder | None = None
        try:
            folder = LakeFolder.read(root)
            assert folder is not None
            if lake is not None and lake.data_path != str(folder.data_path):  # named otherwise there
                lake.close()
                lake = None
            if lake is None:  # never a new catalog: the folder's ledger has one, or it is lost
                lake = LakeTables(folder.catalog, folder.data_path, new_catalog=False)
            _same_ledger(lake, folder)
        except (LakeError, duckdb.Error) as exc:
            if lake is not None:
                lake.close()
            raise LedgerError(_lake_problem(root, folder, exc)) from exc
        (root / COMMITS).mkdir(exist_ok=True)
        ledger = cls(root)
        ledger.lake, ledger.lake_folder, ledger.ledger_id = lake, folder, folder.ledger_id
        try:
            ledger.sync_lake_records()  # beside a writer in this folder: after its records
        except (LakeError, duckdb.Error) as exc:  # a damaged SQLite catalog loads, and fails here
            lake.close()
            raise LedgerError(_lake_problem(root, folder, exc)) from exc
        ledger._load_head()
        return ledger

    def close(self) -> None:
        """Let go of the lake's catalog (a DuckDB-file catalog belongs to one process at a time) and
        of the seen index's SQLite file (left to the collector, its WAL is checkpointed whenever that
        runs)."""
        if self.lake is not None:
            self.lake.close()
        self._index.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync_lake_records(self) -> int:
        """Copy into the folder the lake's commit records it lacks (beside a writer in this folder:
        after its records). Returns how many."""
        with open(self.root / ".writer.lock", "a+b") as handle:
            _wait_for_writer(handle, self.root)
            # A record write a kill cut short left its temporary file (its record is copied below).
            remove_dead_temporaries(self.root / COMMITS)
            return self._sync_records()

    def _sync_records(self) -> int:
        """Copy into the folder the commit records of lake commits it lacks (another host's, or this
        one's when it was killed after its commit point), each with its snapshot and data files.
        Records are written in order and never change, so the folder is always a prefix of the lake."""
        assert self.lake is not None
        paths = self.commit_paths()
        newest = int(paths[-1].stem) if paths else -1
        copied = 0
        for info, commit_id, snapshot in self.lake.records_after(newest):
            record = info.get("record")
            if not isinstance(record, dict) or record.get("commit") != newest + 1:
                raise LedgerError(
                    f"lake commit {commit_id} is not ledger commit {newest + 1}: the lake's records have a gap"
                )
            record = record | _lake_named(commit_id, snapshot, self.lake.added_files(snapshot))
            write_durably(commit_record_path(self.root, newest + 1), json.dumps(record))
            newest += 1
            copied += 1
        return copied

    # ----------------------------------------------------------------- state
    def commit_paths(self) -> list[Path]:
        return commit_record_paths(self.root)

    def read_commit(self, number: int) -> dict[str, Any]:
        return read_commit_record(self.root, number)

    def _newest(self, paths: list[Path]) -> dict[str, Any]:
        """The newest commit record of ``paths`` (a sorted listing), parsed once."""
        number = int(paths[-1].stem)
        if self._newest_record is None or self._newest_record["commit"] != number:
            self._newest_record = json.loads(paths[-1].read_bytes())
        return self._newest_record

    def _load_head(self, paths: list[Path] | None = None) -> None:
        """Positions and stream heads as of the newest commit in ``paths`` (default: listed now)."""
        paths = self.commit_paths() if paths is None else paths
        if not paths or int(paths[-1].stem) == self._last_commit:
            return  # in memory already: this writer made or read that commit
        record = self._newest(paths)
        self._last_commit = record["commit"]
        self._positions = dict(record["positions"])
        self._streams = {s: StreamHead.from_json(h) for s, h in record["streams"].items()}

    def positions(self) -> dict[str, int]:
        """The next position to read from each source (everything before it is in the ledger)."""
        self._load_head()  # commit records only: another writer's files may still be renaming
        return dict(self._positions)

    def stream_heads(self) -> dict[str, StreamHead]:
        self._load_head()
        return dict(self._streams)

    @property
    def last_commit(self) -> int:
        return self._last_commit

    def _catch_up(self, paths: list[Path]) -> None:
        """Fold in commits other writers made since we last folded. Only under the writer lock,
        after ``_sync_records``: then the folder holds every record the lake committed."""
        self._load_head(paths)
        if self._last_commit > self._folded_commit:
            self._fold.configs.clear()  # another writer may have moved a run's config on
        self._index.catch_up(self._last_commit, self._commit_bytes)
        self._folded_commit = self._last_commit

    def _commit_bytes(self, number: int) -> bytes | None:
        try:
            return commit_record_path(self.root, number).read_bytes()
        except FileNotFoundError:
            return None

    def _load_config(self, run_id: str, attempt: int) -> dict[str, Any] | None:
        """The latest config of an attempt already in the ledger (for a change that follows it)."""
        assert self.lake is not None  # (only a commit folds, and only a lake commits)
        with self.lake.reader() as con:
            # the fold files events without an attempt under attempt 1 (see FoldState)
            attempt_is = "(attempt = ? OR attempt IS NULL)" if attempt == 1 else "attempt = ?"
            row = one_row(
                con.execute(
                    f"SELECT config FROM configs WHERE run_id = ? AND {attempt_is} ORDER BY stream_seq DESC LIMIT 1",
                    [run_id, attempt],
                )
            )
        return json.loads(row[0]) if row else None

    # ----------------------------------------------------------------- writing
    @contextlib.contextmanager
    def _writer_lock(self) -> Iterator[None]:
        lake = self._writable_lake()
        with open(self.root / ".writer.lock", "a+b") as handle:
            _wait_for_writer(handle, self.root)
            try:
                self._sync_records()  # what other hosts committed meanwhile
                paths = self.commit_paths()
                if not self._swept:  # a redaction killed after its commit point: the bytes go now
                    self._erase_deleted_once(lake)
                self._catch_up(paths)
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _writable_lake(self) -> LakeTables:
        """The lake a commit goes to; a published copy (no lake) is read-only: LedgerError."""
        if self.lake is None:
            raise LedgerError(f"{self.root} is a published copy of a ledger: it is read-only")
        return self.lake

    @contextlib.contextmanager
    def events_reader(self) -> Iterator[Any]:
        """A connection on which ``events`` is this ledger's events table at the lake's newest
        snapshot (``runledger.ledger.admission`` rebuilds its state from it)."""
        with self._writable_lake().reader() as con:
            yield con

    def _erase_deleted_once(self, lake: LakeTables) -> None:
        """Take off the disk the bytes of rows a committed redaction deleted, once per writer (a
        redaction killed after its catalog commit left them; nothing to do costs two catalog reads).
        A busy maintenance lock is left for the next writer, never failing this commit."""
        try:
            lake.erase_deleted()
        except (duckdb.Error, LakeError) as exc:
            log.warning("erasing a redaction's deleted rows: %s (left for the next writer)", exc)
            return
        self._swept = True

    def commit(
        self,
        records: Sequence[SourceRecord],
        *,
        writer: str = "",
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> CommitResult:
        """Validate, deduplicate and append records in one atomic commit. Idempotent per position.

        Never fails because of what a record holds: every record is accepted, a duplicate, or
        quarantined with a reason (``max_event_bytes``: longer records are quarantined unread)."""
        with self._writer_lock():
            check: _Careful = frozenset()  # the usual round: no event's rows converted on their own
            redos = _Redos()
            while True:
                try:
                    result = self._commit_locked(records, writer, max_event_bytes, check)
                    if result.commit is not None:
                        self._maintain_lake(result.commit)
                    return result
                except _LakeMoved as moved:
                    # Another writer committed first: take its commits and redo this one on them
                    # (what it covered is skipped as a replay is), a bounded number of times.
                    redos.note(self._last_commit + 1, moved.stale, self._sync_records(), self.lake)
                    self._catch_up(self.commit_paths())
                except _UnencodableBatch as exc:
                    # Again, converting on their own the rows of the groups that failed; and if
                    # that is not enough, every event's rows. The last round raises what it meets.
                    check = exc.suspects if not check and exc.suspects else None
                    log.warning("commit: %s; checking rows event by event", exc)

    def _commit_locked(
        self,
        records: Sequence[SourceRecord],
        writer: str,
        max_event_bytes: int,
        check: _Careful,
        edit: LakeEdit | None = None,
    ) -> CommitResult:
        number = self._last_commit + 1
        positions = dict(self._positions)
        streams = {s: StreamHead(h.size, h.tree.copy()) for s, h in self._streams.items()}
        now = datetime.now(UTC)
        day = now.strftime("%Y-%m-%d")
        fold_before = dict(self._fold.configs)
        admission = admission_round(
            self, positions
        )  # producer identity and order: runledger.ledger.admission
        asked, known = _stored_leaves(self._index, records, max_event_bytes)
        anomalies = anomaly_round(self, positions)  # findings recorded as events: runledger.ledger.anomalies
        work = _CommitWork(number, streams, admission, anomalies, _Staging(self._fold), check, asked, known)
        result, buf = work.result, work.buf
        try:
            # The records, each followed by the incidents and the anomalies it causes.
            for record in _with_incidents(records, admission, anomalies):
                if record.position < positions.get(record.source, 0):
                    result.skipped += 1
                    continue
                positions[record.source] = record.position + 1
                decoded = _decode_record(record, max_event_bytes)
                if isinstance(decoded, Event):
                    refused = self._take_event(decoded, record, work)
                    if refused is None:
                        continue  # stored, or a duplicate
                    decoded = refused
                result.quarantined.append((record, decoded))
                buf.add("quarantine", day, _quarantine_row(record, decoded, now, number))
            if edit is not None and result.accepted != len(records):
                reasons = "; ".join(q.reason for _, q in result.quarantined) or "not stored"
                raise LedgerError(f"the {writer} record was refused: {reasons}")
            if not buf.columns and positions == self._positions:
                return result
            try:
                tables = buf.tables()
            except Exception as exc:
                if check is None:
                    raise
                raise _UnencodableBatch(f"{type(exc).__name__}: {exc}", _failing_groups(buf)) from exc
            tables += _salt_tables(work.salts, number)
            return self._commit_to_lake(records, writer, tables, positions, work, edit)
        except BaseException:
            self._fold.configs = fold_before
            raise

    def _commit_to_lake(
        self,
        records: Sequence[SourceRecord],
        writer: str,
        tables: list[tuple[str, str, pa.Table]],
        positions: dict[str, int],
        work: _CommitWork,
        edit: LakeEdit | None = None,
    ) -> CommitResult:
        """The commit as one lake transaction: every table's rows, the positions moved, the stream
        heads moved, the commit record, and the commit-number fence (a writer on another host that
        committed this number first makes it stale: ``_LakeMoved``, and ``commit`` redoes it).
        ``edit``: changes to rows stored before, in the same transaction (``ledger redact``)."""
        assert self.lake is not None
        number, result, buf, streams = work.number, work.result, work.buf, work.streams
        # its files are the lake's: named below, once the snapshot is known
        record_json = self._record(number, datetime.now(UTC), writer, records, positions, [], work)
        moved = {
            s: (self._positions.get(s, 0), p) for s, p in positions.items() if self._positions.get(s, 0) != p
        }
        moved[COMMIT_FENCE] = (number, number + 1)
        state: dict[str, Any] = {f"stream:{s}": streams[s].to_json() for s in work.added}
        rows = _lake_tables(tables)
        for name, added in (edit.rows if edit is not None else {}).items():
            # first: rows stored before, so a file keeps its rows in stream order (``verify``)
            rows[name] = pa.concat_tables(
                [t for t in (added, rows.get(name)) if t is not None], promote_options="default"
            )
        done = self.lake.commit(
            rows,
            moved,
            state,
            writer=writer,
            info={"ledger_commit": number, "record": record_json},
            number=number,
            edits=edit.statements if edit is not None else (),
        )
        if not done.ok:
            raise _LakeMoved(done.stale)
        assert done.snapshot is not None
        record_json |= _lake_named(done.commit_id, done.snapshot, done.files)
        record_text = json.dumps(record_json)
        write_durably(commit_record_path(self.root, number), record_text)
        self._newest_record = record_json
        self._last_commit = self._folded_commit = number
        self._positions = positions
        work.admission.keep(number)
        work.anomalies.keep(self, number)
        self._streams = streams
        self._index_commit(number, record_text, work.appended.items())
        result.commit = number
        result.files = record_json["files"]
        result.metric_values = buf.rows("metrics")
        return result

    def _record(
        self,
        number: int,
        now: datetime,
        writer: str,
        records: Sequence[SourceRecord],
        positions: dict[str, int],
        files: list[str],
        work: _CommitWork,
    ) -> dict[str, Any]:
        """The commit record (before its commit point)."""
        return {
            "commit": number,
            "time": now.isoformat(),
            "writer": writer,
            "covers": _covered(records, self._positions),
            "positions": positions,
            "files": files,
            **_appended_record(work.streams, work.added, work.result),
            # Registry, policy and each source's chain head after this commit: stored at the same
            # commit point as the events that moved them (runledger.ledger.admission.load_state reads it).
            "admission": work.admission.state.to_json(),
            # The detectors' windows, at the same commit point (runledger.ledger.anomalies.load_state).
            "anomalies": work.anomalies.state.to_json(),
        }

    def _maintain_lake(self, number: int) -> None:
        """The lake's own compaction and clean-up every ``maintain_every`` commits, so that a ledger
        ingesting for months keeps a few files per partition, and its merge of the small files every
        ``merge_small_every`` commits between them, so that a reader opens a few files per table
        between two full merges too: a failure is logged, and the next turn tries again."""
        assert self.lake is not None
        if self.maintain_every <= 0:
            return
        full = (number + 1) % self.maintain_every == 0
        if not full and (self.merge_small_every <= 0 or (number + 1) % self.merge_small_every):
            return
        # The commit's Arrow buffers are freed by now but pyarrow's allocator keeps their pages: given
        # back before DuckDB's merge takes its own (the full run's peak: 998-1,030 MB → 896 MB).
        pa.default_memory_pool().release_unused()
        try:
            if full:
                self.lake.maintain(keep_s=LAKE_KEEP_S)
            else:
                self.lake.merge_small_files()
        except (duckdb.Error, OSError, LakeError) as exc:
            what = "maintenance" if full else "merge of small files"
            log.warning("lake %s after commit %d failed (%s); left for the next turn", what, number, exc)

    def _take_event(self, event: Event, record: SourceRecord, work: _CommitWork) -> Quarantined | None:
        """One valid event into the commit under way: stored (its rows added, its leaf appended) or
        a duplicate (None), or refused (why: a ``Quarantined``)."""
        env = event.envelope
        key = seen_key(env.source, env.id)
        leaf = leaf_hash(event.canonical)
        stored = work.appended.get(key)
        if stored is None and work.asked is not None:
            stored = work.known.get(key) if key in work.asked else self._index.get(key)
        refused = _refusal(event, record.raw, stored, leaf)
        if refused is None and stored is not None:
            work.result.duplicates += 1
            return None
        head = work.streams.get(env.stream)
        stream_seq = head.size if head is not None else 0
        if refused is None:
            # The ledger's own anomaly records are its own to admit (admission knows only its sources).
            own = admitted_anomaly(event, record.source)
            verdict = UNCHECKED if own else work.admission.check(event, record, leaf)
            if isinstance(verdict, Quarantined):
                refused = verdict
            else:
                refused = self._add_rows(
                    event,
                    stream_seq,
                    record,
                    work.number,
                    work.buf,
                    work.staging,
                    work.check,
                    verdict.authenticated,
                )
        if refused is None:
            work.appended[key] = leaf
            _append_leaf(work.streams, work.added, event, leaf, stream_seq)
            salts = work.salts.setdefault(stream_type(env.stream), [])
            salts.append((env.stream, stream_seq, os.urandom(SALT_BYTES)))
            work.result.accepted += 1
            work.result.made += record.source in (INCIDENT_INGEST, ANOMALY_INGEST)
            work.anomalies.see(event)
        return refused

    def _add_rows(
        self,
        event: Event,
        stream_seq: int,
        record: SourceRecord,
        commit: int,
        buf: RowBuffer,
        staging: _Staging,
        check: _Careful,
        authenticated: bool | None = None,
    ) -> Quarantined | None:
        """Add every row one event contributes to ``buf``, or none of them and say why not.

        The rows are built apart and appended only once all of them exist; the projector sees the
        fold state through an overlay, kept only if it succeeds. ``check``: the (table, partition)
        groups whose rows are converted to Arrow right here, to find the events a whole batch
        failed on (None: every group; empty: none, the usual case)."""
        env = event.envelope
        rows = staging.start()
        try:
            rows_for_event(event, stream_seq, rows, staging.fold)
            row = _event_row(event, stream_seq, commit, record)
            row["authenticated"] = authenticated
            rows.add("events", stream_type(env.stream), row)
            touched = rows.touched()
            for key in touched:
                if key not in self._usable_partitions:
                    _check_partition(*key)
                    self._usable_partitions.add(key)
            if check is None or not check.isdisjoint(touched):
                alone = RowBuffer()
                rows.replay(alone)
                alone.tables()
        except OSError:
            raise  # the environment, not the record: abort the commit (it is retried as a whole)
        except Exception as exc:
            return refused_event(
                env, record.raw, UNSTORABLE, f"ledger: cannot store this event: {type(exc).__name__}: {exc}"
            )
        try:
            rows.replay(buf)
        except Exception as exc:  # half-appended: only a round that checks every event first is sure
            if check is None:
                raise
            raise _UnencodableBatch(f"{type(exc).__name__}: {exc}", None) from exc
        staging.keep(self._fold)
        return None

    def _index_commit(self, number: int, record_text: str, entries: Iterable[tuple[bytes, bytes]]) -> None:
        """Add a durable commit's events to the dedupe index. A failure is only logged: the index
        is behind the log then, and the next writer lock adds them from the commit record."""
        try:
            self._index.add(number, record_digest(record_text.encode()), entries)
        except Exception as exc:
            log.warning(
                "dedupe index not updated for commit %d (%s); the next commit catches up", number, exc
            )

    # ----------------------------------------------------------------- rewriting, maintenance
    def commit_rewrite(
        self, prepare: Callable[[Ledger], tuple[Sequence[SourceRecord], LakeEdit]], *, writer: str
    ) -> CommitResult:
        """One commit, under the writer lock, that appends ``records`` and changes rows stored before:
        ``prepare`` (called under the lock, so it sees every commit) returns the records and a
        ``LakeEdit``, whose statements run in the commit's transaction; the deleted rows' bytes then
        leave the disk (``erase_deleted``). Every record must be stored, or nothing is (LedgerError)."""
        with self._writer_lock():
            lake = self._writable_lake()
            redos = _Redos()
            while True:
                records, edit = prepare(self)
                try:
                    result = self._commit_locked(records, writer, MAX_EVENT_BYTES, frozenset(), edit)
                except _LakeMoved as moved:  # another host committed first: prepare again on its commits
                    redos.note(self._last_commit + 1, moved.stale, self._sync_records(), self.lake)
                    self._catch_up(self.commit_paths())
                    continue
                finally:
                    self._fold.configs.clear()  # the rewrite may have changed the configs a later change builds on
                break
            if result.commit is not None:
                try:
                    result.erased_files = lake.erase_deleted()["files_erased"]
                except (duckdb.Error, LakeError) as exc:  # (committed: only the bytes' erasure is left)
                    # (from None: the line says what to run; a full disk's general line would say "run it again")
                    raise LedgerError(_erasure_stopped(result.commit, exc, lake.catalog)) from None
            return result

    def compact(self) -> dict[str, int]:
        """The lake's merge of small files, expiry and clean-up (``LakeTables.maintain``). No query's
        answer changes."""
        lake = self._writable_lake()
        try:
            return lake.maintain(keep_s=LAKE_KEEP_S)
        except (duckdb.Error, LakeError) as exc:  # (out of memory, a lock never free): one line
            # (a full disk kept behind it: the command's line names the place and what to do)
            raise LedgerError(_lake_problem(self.root, self.lake_folder, exc)) from (
                exc if disk_full(exc) else None
            )


@dataclass
class LakeEdit:
    """What a rewrite is on DuckLake (``ledger redact``): statements on rows stored before, run in
    the commit's transaction before its rows land, and rows the commit adds beside its records'
    (table -> rows with the lake's columns, partition column included)."""

    statements: list[tuple[str, list[Any]]]
    rows: dict[str, pa.Table]


class _Redos:
    """The redo budget of one commit beaten to the lake: ``note`` raises LedgerError, saying what it
    waited on, once it is spent (``LAKE_REDO_LIMIT`` redos, ``LAKE_REDO_S``) or once
    ``LAKE_REDO_IDLE`` redos in a row found no commit record they had not seen."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.count = 0
        self.idle = 0

    def note(self, number: int, stale: dict[str, int], synced: int, lake: LakeTables | None) -> None:
        self.count += 1
        self.idle = 0 if synced else self.idle + 1
        where = lake.catalog.shown if lake is not None else "the lake"
        fences = ", ".join(f"{source} at {at}" for source, at in sorted(stale.items()))
        if self.idle >= LAKE_REDO_IDLE:
            raise LedgerError(
                f"commit {number}: the lake catalog {where} moved its fences ({fences}) {self.idle} times "
                "with no commit record this ledger had not seen: it holds another history (was it replaced?)"
            )
        elapsed_s = time.monotonic() - self.started
        if self.count >= LAKE_REDO_LIMIT or elapsed_s >= LAKE_REDO_S:
            raise LedgerError(
                f"commit {number}: redone {self.count} times in {elapsed_s:.0f} s, each time another writer "
                f"had committed first to the lake catalog {where} (last: {fences}); try again when it is idle"
            )


class _LakeMoved(Exception):
    """Another writer committed to the lake first (its commit number, or a source's position)."""

    def __init__(self, stale: dict[str, int]) -> None:
        super().__init__(f"the lake moved on: {stale}")
        self.stale = stale


def _lake_tables(tables: list[tuple[str, str, pa.Table]]) -> dict[str, pa.Table]:
    """``RowBuffer.tables()``' (table, partition, rows) as one Arrow table per lake table, the
    partition a column again (the lake partitions by it)."""
    grouped: dict[str, list[pa.Table]] = {}
    for name, partition, data in tables:
        column = pa.repeat(pa.scalar(partition or "_", pa.string()), data.num_rows)
        grouped.setdefault(name, []).append(data.append_column(table_spec(name).partition, column))
    # A table of one group (a commit of one run) is that group's rows as they are, not a copy; the
    # lake's writer splits several groups again in one pass (``runledger.ledger.lake._by_partition``).
    return {
        name: parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")
        for name, parts in grouped.items()
    }


def _wait_for_writer(handle: Any, root: Path) -> None:
    """The folder's writer lock, waited for at most ``WRITER_LOCK_WAIT_S`` (LedgerError then)."""
    try:
        wait_for_flock(handle, fcntl.LOCK_EX, WRITER_LOCK_WAIT_S, f"the writer lock {root / '.writer.lock'}")
    except LakeError as exc:
        raise LedgerError(f"{exc} (another writer's commit in this folder held it)") from None


def _same_ledger(lake: LakeTables, folder: LakeFolder) -> None:
    """LakeError when the catalog the folder names holds another ledger (it was replaced)."""
    stored = lake.stored_ledger_id()
    if stored is not None and stored != folder.ledger_id:
        raise LakeError(
            f"the lake catalog {lake.catalog.shown} holds ledger {stored}, but {folder.folder / LAKE_MARKER} "
            f"names ledger {folder.ledger_id}: the catalog was replaced (restore this ledger's from a backup)"
        )


def _erasure_stopped(commit: int, exc: BaseException, catalog: Catalog) -> str:
    """One line: a rewrite's commit landed and the erasure of the old bytes after it did not; on a
    full disk, where, and the command that finishes it once there is room (running the rewrite again
    would be refused: it is recorded)."""
    full = disk_full(exc)
    if full is None:
        return f"commit {commit} is recorded, but {first_line(exc)}"
    where = disk_full_path(full)
    if where is None and catalog.file is not None and "database or disk is full" in str(full):
        where = str(catalog.file)  # (SQLite's words, through DuckDB, name no file)
    return (
        f"commit {commit} is recorded, but its erasure stopped: no space left on device"
        f"{f' writing {where}' if where else ''}: free some space there and run `ledger compact` to "
        "finish it (until then the erased rows may still be in the lake's files)"
    )


def _lake_problem(root: Path, folder: LakeFolder | None, exc: BaseException) -> str:
    """One line: the ledger folder, the catalog file when DuckDB's error came from it (a server's
    DSN is not shown: it may hold a password), and the error's first line. A catalog that is gone
    is the folder's own line (``missing_catalog``)."""
    if str(exc).startswith("no lake catalog at "):
        return (
            str(exc) if LAKE_MARKER in str(exc) or folder is None else missing_catalog(folder.catalog, root)
        )
    where = str(root)
    if isinstance(exc, duckdb.Error) and folder is not None:
        file = Catalog.parse(folder.catalog).file  # (``LakeFolder.read`` parsed it: it parses)
        if file is not None:  # (a server's DSN is not shown: it may hold a password)
            where += f": lake catalog {file}"
    return f"{where}: {str(exc).strip().splitlines()[0]}"


def _folder_marker(root: Path) -> dict[str, Any]:
    """``LEDGER.json`` of ``root`` (an old ledger's, or a published copy's), or a one-line LedgerError."""
    try:
        meta = json.loads((root / "LEDGER.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise LedgerError(f"{root / 'LEDGER.json'} is unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise LedgerError(f"{root / 'LEDGER.json'} is not a JSON object")
    return meta


def old_format_problem(root: Path) -> str:
    """The one line for a ledger of the old format (part files), which is never opened or written:
    the ``ledger migrate`` command that makes a lake of it, beside it."""
    shown = root if root.name else root.resolve()
    new = shown.with_name(f"{shown.name}-lake") if shown.name else Path("NEW")
    command = f"ledger migrate {shlex.quote(str(shown))} {shlex.quote(str(new))}"
    return (
        f"{shown} is a ledger of the old format (part files), which this version no longer opens or "
        f"writes: make it a lake with `{command}` (it is read, never changed) and use {new} from then on"
    )


def _not_a_lake(root: Path) -> str:
    """Why no lake is made at ``root``, which holds a ``LEDGER.json``: an old ledger, or a copy."""
    if _folder_marker(root).get("format") == OLD_FORMAT:
        return old_format_problem(root)
    return f"{root} is a published copy of a ledger (read-only): a new ledger needs a folder of its own"


def _lake_named(commit_id: str, snapshot: int, files: list[dict[str, Any]]) -> dict[str, Any]:
    """What a commit record on DuckLake adds once committed: the lake snapshot it made and the data
    files that snapshot added with their SHA-256 (the bytes DuckDB reads)."""
    return {
        "lake": {"commit_id": commit_id, "snapshot": snapshot},
        "files": [f["path"] for f in files],
        "lake_files": files,
    }


def table_spec(name: str) -> Table:
    """A table of the ledger: one of TABLES or of SIDE_TABLES."""
    return TABLES[name] if name in TABLES else SIDE_TABLES[name]


def _salt_tables(
    salts: dict[str, list[tuple[str, int, bytes]]], commit: int
) -> list[tuple[str, str, pa.Table]]:
    """The commit's salt rows, one table per stream type (as the events they belong to)."""
    out = []
    for partition, rows in sorted(salts.items()):
        streams, seqs, values = zip(*rows, strict=True)
        columns = [list(streams), list(seqs), [commit] * len(rows), list(values)]
        out.append(("salts", partition, pa.Table.from_arrays(columns, schema=SALTS.schema)))
    return out


def _with_incidents(
    records: Iterable[SourceRecord], admission: AdmissionRound, anomalies: AnomalyRound
) -> Iterator[SourceRecord]:
    """The commit's records, each followed by the incident events its admission check asked for and
    the anomaly events the detectors found in it."""
    for record in records:
        yield record
        for source, position, raw in admission.incidents():
            yield SourceRecord(source, position, raw)
        for source, position, raw in anomalies.records():
            yield SourceRecord(source, position, raw)


def _append_leaf(
    streams: dict[str, StreamHead],
    added: dict[str, dict[str, Any]],
    event: Event,
    leaf: bytes,
    stream_seq: int,
) -> None:
    """An admitted event's leaf onto its stream's tree, and into ``added`` (per stream: the first
    seq, the leaves and the (source, id) of each event the commit appends)."""
    env = event.envelope
    head = streams.get(env.stream)
    if head is None:
        head = streams[env.stream] = StreamHead(0, CompactRange())
    head.size += 1
    head.tree.append(leaf)
    log_ = added.setdefault(env.stream, {"first": stream_seq, "leaves": [], "ids": []})
    log_["leaves"].append(leaf)
    log_["ids"].append([env.source, env.id])


def _appended_record(
    streams: dict[str, StreamHead], added: dict[str, dict[str, Any]], result: CommitResult
) -> dict[str, Any]:
    """The commit record's ``streams`` (every stream's size and tree after the commit), ``appended``
    and ``counts``."""
    return {
        "streams": {s: h.to_json() for s, h in sorted(streams.items())},
        # The leaves this commit appended, so `ledger verify` can name a changed event.
        "appended": {
            s: {
                "first": a["first"],
                "leaves": base64.b64encode(b"".join(a["leaves"])).decode(),
                "ids": a["ids"],
            }
            for s, a in sorted(added.items())
        },
        "counts": {
            "accepted": result.accepted,
            "duplicates": result.duplicates,
            "quarantined": len(result.quarantined),
        },
    }


def _covered(records: Sequence[SourceRecord], before: dict[str, int]) -> dict[str, list[int]]:
    """Per source, the [first, last] positions this commit consumed."""
    spans: dict[str, list[int]] = {}
    for r in records:
        if r.position < before.get(r.source, 0):
            continue
        span = spans.setdefault(r.source, [r.position, r.position])
        span[0] = min(span[0], r.position)
        span[1] = max(span[1], r.position)
    return spans


def _event_row(event: Event, stream_seq: int, commit: int, record: SourceRecord) -> dict[str, Any]:
    env = event.envelope
    return {
        "stream": env.stream,
        "stream_seq": stream_seq,
        "source": env.source,
        "id": env.id,
        "type": env.type,
        "schema_version": env.schema_version,
        "time": env.time,
        "subject": env.subject,
        "run_id": env.run_id,
        "attempt": env.attempt,
        "step": env.step,
        "seq": env.seq,
        "commit": commit,
        "ingest_source": record.source,
        "ingest_position": record.position,
        "canonical": event.canonical,  # UTF-8 bytes: RowBuffer.tables() makes them one string column
    }


def _stored_leaves(
    index: SeenIndex, records: Sequence[SourceRecord], max_event_bytes: int
) -> tuple[set[bytes] | None, dict[bytes, bytes]]:
    """The keys the records name (as far as a glance tells; a record too long to be read names
    none), and the leaf hash of those stored already: fetched together before the records are read
    one by one. None for the keys when the ledger stores no event yet (a glance at every record of
    a new ledger's first batch was ~5% of its ingest)."""
    if index.empty:
        return None, {}
    glanced = (record_key(r.raw) for r in records if len(r.raw) <= max_event_bytes)
    asked = {key for key in glanced if key is not None}
    return asked, index.get_many(asked)


def _decode_record(record: SourceRecord, max_event_bytes: int) -> Event | Quarantined:
    if record.tombstone:
        return Quarantined(raw=record.raw, reason="tombstone (null value)", code=TOMBSTONE)
    if record.corrupt:
        return Quarantined(raw=record.raw, reason=f"bus: {record.corrupt}", code=CORRUPT)
    try:
        return decode_event(record.raw, max_bytes=max_event_bytes)
    except Exception as exc:  # decode_event never raises; a belt all the same
        return Quarantined(raw=record.raw, reason=f"undecodable: {type(exc).__name__}: {exc}", code=DECODE)


class _StagedRows(RowBuffer):
    """One event's rows, held back: ``add``/``add_many`` calls are recorded, and ``replay`` makes
    them on a real buffer. (Rows a projector writes to ``columns`` directly are merged in too.)"""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, str, str, Any]] = []

    def add(self, table: str, partition: str, row: dict[str, Any]) -> None:
        self.calls.append((False, table, partition, row))

    def add_many(self, table: str, partition: str, rows: dict[str, list[Any]]) -> None:
        self.calls.append((True, table, partition, rows))

    def touched(self) -> list[tuple[str, str]]:
        return [(table, partition) for _, table, partition, _ in self.calls] + list(self.columns)

    def replay(self, buf: RowBuffer) -> None:
        for many, table, partition, values in self.calls:
            if many:
                buf.add_many(table, partition, values)
            else:
                buf.add(table, partition, values)
        for key, cols in self.columns.items():
            into = buf.columns.setdefault(key, {name: [] for name in cols})
            for name, values in cols.items():
                into[name].extend(values)


class _Staging:
    """Where one event at a time waits (for one commit): its rows, and the fold-state changes its
    projector makes (``fold`` reads through to the ledger's configs; writes stay in ``overlay``)."""

    def __init__(self, live: FoldState) -> None:
        self.rows = _StagedRows()
        self.overlay: dict[tuple[str, int], dict[str, Any]] = {}
        self.fold = copy.copy(live)
        self.fold.configs = ChainMap(self.overlay, live.configs)  # type: ignore[assignment]

    def start(self) -> _StagedRows:
        self.rows.calls.clear()
        self.rows.columns.clear()
        self.overlay.clear()
        return self.rows

    def keep(self, live: FoldState) -> None:
        if self.overlay:
            live.configs.update(self.overlay)


def _failing_groups(buf: RowBuffer) -> frozenset[tuple[str, str]]:
    """The (table, partition) groups of ``buf`` whose rows don't convert to Arrow."""
    failing = set()
    for (table, partition), cols in buf.columns.items():
        try:
            pa.table(cols, schema=TABLES[table].schema)
        except Exception:
            failing.add((table, partition))
    return frozenset(failing)


_MAX_PARTITION_BYTES = 200  # a directory name is at most 255 bytes, ``<column>=`` included


def _check_partition(table: str, value: str) -> None:
    """A hive partition value must make one directory name: raise ValueError if it cannot."""
    encoded = value.encode("utf-8")  # UnicodeEncodeError (a ValueError) for lone surrogates
    if len(encoded) > _MAX_PARTITION_BYTES or "/" in value or "\0" in value:
        raise ValueError(f"{table} partition value {value[:80]!r} is not a usable directory name")


def _text(value: object, limit: int = MAX_REASON_CHARS) -> str | None:
    """A string that always fits a Parquet string column: bounded, and valid UTF-8."""
    if value is None:
        return None
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _quarantine_row(record: SourceRecord, q: Quarantined, now: datetime, commit: int) -> dict[str, Any]:
    """Every value sanitised: a quarantine row must always be storable, whatever the record held."""
    return {
        "time": now,
        "ingest_source": _text(record.source),
        "ingest_position": record.position,
        "reason": _text(q.reason) or "rejected",
        "event_source": _text(q.source),
        "event_id": _text(q.id),
        "event_type": _text(q.type),
        "stream": _text(q.stream),
        "raw": bytes(record.raw),
        "commit": commit,
    }


def _refusal(event: Event, raw: bytes, stored_leaf: bytes | None, leaf: bytes) -> Quarantined | None:
    """Why the ledger refuses a valid event before projecting it, or None: its stream is not the run
    it names, or its (source, id) is stored with other bytes (a conflict: the first one stays)."""
    env = event.envelope
    mismatch = stream_run_mismatch(env.stream, env.run_id)
    if mismatch is not None:
        reason, code = f"{STREAM_RUN_MISMATCH}: {mismatch}", STREAM_RUN_MISMATCH
    elif stored_leaf is not None and stored_leaf != leaf:
        reason = (
            f"{CONFLICT}: (source, id) already stored with different bytes; leaf SHA-256 of the "
            f"stored event {stored_leaf.hex()}, of this record {leaf.hex()}"
        )
        code = CONFLICT
    else:
        return None
    return refused_event(env, raw, code, reason)
