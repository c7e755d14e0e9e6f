"""Tamper evidence for a whole ledger: verify it, sign checkpoints, and prove inclusion/consistency.

What is checked by ``verify_ledger``:
  * the leaves each commit recorded, per stream, rebuild every commit's stored tree state;
  * the latest signed checkpoint of each stream (if any) matches the recorded leaves at its size,
    and the ledger only grew since (consistency);
  * every event row hashes to the leaf recorded at its ``stream_seq``: a changed event is named
    "modified", a missing one "removed", one the commits never recorded "inserted", rows out of
    their stream order within a part file "reordered" (a lake's files are pinned by SHA-256); its ``commit`` column must be the commit the log
    says appended it; every column of every file must read (damage anywhere is "unreadable");
  * every typed table equals what the events produce: an edited metric names its event;
  * every producer event is admitted again under the registry kept in the log as it stood when the
    event was stored (``runledger.ledger.admission.authenticate``): its key registered, not revoked before it,
    its scope covering it, its Ed25519 signature over its bytes good, or its source let in unsigned by
    the policy then; a failure is a ``producer`` problem naming the event. Its row's
    ``authenticated`` column must say the same.
  * a redacted event (its canonical bytes replaced by a marker, ``ledger.redaction``) is accepted
    only where a ``ledger.redaction`` record stored in the log names it, its recorded leaf and that
    marker; it is reported with its reason (``Report.redactions`` and a warning line), its typed rows
    and its salt must be gone, and with log keys given the record must be signed by one of them.
  * every ``ledger.anomaly`` event is what the detectors make when run again over the log in stream
    order (``runledger.ledger.anomaly_check``): a missing, extra or altered one is an ``anomaly`` problem.
Guarantee: tamper-evident, not tamper-proof. Someone who can rewrite the files *and* the commit
log can make a self-consistent forgery, but not one that matches a checkpoint signed and published
before the edit; that is why checkpoints must be kept by others.
"""

from __future__ import annotations

import base64
import bisect
import json
import os
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from runledger.ledger import duck, verifier
from runledger.ledger.admission import (
    REGISTRY_STREAM,
    REGISTRY_TYPES,
    RegistryTimeline,
    authenticate,
    is_own,
    load_state,
)
from runledger.ledger.anomaly_check import AnomalyCheck
from runledger.ledger.log_checkpoint import note_signers, parse_and_verify_checkpoint
from runledger.ledger.merkle import CompactRange, MerkleTree, leaf_hash, root_from_leaf_hashes
from runledger.ledger.parquet_schemas import ADDED_COLUMNS, TABLES
from runledger.ledger.projectors import FoldState, RowBuffer, rows_for_event
from runledger.ledger.redaction import is_redacted, read_marker
from runledger.ledger.store import SALTS, Ledger, LedgerError
from runledger.ledger.stored_files import StoredFile, StoredFiles
from runledger.ledger.stream_checkpoints import checkpoint_path, origin_of
from runledger.schemas import Event, decode_event
from runledger.schemas.catalogue import LEDGER_INCIDENT, LEDGER_REDACTION
from runledger.schemas.codec import CONFLICT
from runledger.schemas.durable import process_running
from runledger.schemas.note import NoteVerifier, parse_public_key
from runledger.schemas.signing import SignatureError, key_id_of, verify_canonical


@dataclass(frozen=True)
class Problem:
    stream: str
    # modified | removed | inserted | reordered | table-mismatch | checkpoint | unreadable | log | producer
    # | key (a checkpoint not signed by any key tried: a mix-up of keys, or a signer not trusted)
    # | redaction (a redaction record not signed by a log key tried, or whose event still holds its payload)
    # | anomaly (an anomaly event missing, extra or altered against the detectors re-run over the log)
    kind: str
    detail: str
    stream_seq: int | None = None
    event_id: str | None = None

    def line(self) -> str:
        where = f" event {self.event_id}" if self.event_id else ""
        seq = f" (#{self.stream_seq})" if self.stream_seq is not None else ""
        return f"{self.kind}: stream {self.stream}{where}{seq}: {self.detail}"


@dataclass
class Report:
    streams: int = 0
    events: int = 0
    checkpoints: int = 0
    problems: list[Problem] = field(default_factory=list)
    # Not tampering, but never silent: e.g. conflicting records the ledger quarantined.
    warnings: list[str] = field(default_factory=list)
    # Events whose payload was erased by a signed redaction record (``ledger.redaction``): each as
    # stream, stream_seq, event_id, reason, actor, time, record id and the key that signed it.
    redactions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class RecordedStream:
    leaves: list[bytes] = field(default_factory=list)
    ids: RecordedIds = field(default_factory=lambda: RecordedIds())


class RecordedIds:
    """The (source, id) of each recorded leaf, read back from the commit record that appended it when
    asked (to name a problem): holding them all would cost about 200 bytes per event."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # the index of each appended run's first id
        self._where: list[tuple[Path, str]] = []  # its commit record and stream
        self._size = 0

    def append_run(self, path: Path, stream: str, count: int) -> None:
        self._starts.append(self._size)
        self._where.append((path, stream))
        self._size += count

    def __len__(self) -> int:
        return self._size

    def commit_of(self, index: int) -> int:
        """The commit that appended leaf ``index`` (from the log, not from the row's own column)."""
        run = bisect.bisect_right(self._starts, index) - 1
        return int(self._where[run][0].stem)

    def __getitem__(self, index: int) -> tuple[str, str]:
        if not 0 <= index < self._size:
            raise IndexError(index)
        run = bisect.bisect_right(self._starts, index) - 1
        path, stream = self._where[run]
        source, ident = json.loads(path.read_bytes())["appended"][stream]["ids"][index - self._starts[run]]
        return source, ident


def recorded_streams(ledger: Ledger, report: Report | None = None) -> dict[str, RecordedStream]:
    """Each stream's leaves as the commit log recorded them, checked against the stored tree states."""
    streams: dict[str, RecordedStream] = defaultdict(RecordedStream)
    # Each stream's tree over the leaves read so far, grown commit by commit: checking a commit's
    # stored state costs O(log n), not a rebuild of the whole tree (O(n) per commit, O(n²) in all).
    built: dict[str, CompactRange] = defaultdict(CompactRange)
    for path in ledger.commit_paths():
        record = json.loads(path.read_bytes())
        for stream, added in record.get("appended", {}).items():
            rec = streams[stream]
            if added["first"] != len(rec.leaves) and report is not None:
                report.problems.append(
                    Problem(
                        stream,
                        "log",
                        f"commit {record['commit']} starts at #{added['first']}, expected #{len(rec.leaves)}",
                    )
                )
            raw = base64.b64decode(added["leaves"])
            rec.leaves.extend(raw[i : i + 32] for i in range(0, len(raw), 32))
            rec.ids.append_run(path, stream, len(added["ids"]))
        if report is None:
            continue
        for stream, head in record.get("streams", {}).items():
            tree = CompactRange.from_json(head["tree"])
            rec = streams[stream]
            grown = built[stream]
            grown.extend(rec.leaves[grown.size :])
            if tree.size == grown.size:
                matches = tree.root() == grown.root()
            else:  # a head behind the leaves: only a damaged log has one
                matches = tree.size < len(rec.leaves) and tree.root() == root_from_leaf_hashes(
                    rec.leaves[: tree.size]
                )
            if not matches:
                report.problems.append(
                    Problem(
                        stream,
                        "log",
                        f"commit {record['commit']}'s tree (size {tree.size}) does not match "
                        "the leaves the log recorded",
                    )
                )
    return dict(streams)


# Event-row columns that are copies of the envelope inside the canonical bytes: verify checks each one
# against the bytes the Merkle leaf commits to, so editing a copy (what SQL filters on) is caught too.
ENVELOPE_COLUMNS = ("type", "schema_version", "time", "subject", "run_id", "attempt", "step", "seq")
_EVENT_COLUMNS = ("stream", "stream_seq", "source", "id", "canonical", *ENVELOPE_COLUMNS)


class EventRow(NamedTuple):
    seq: int
    source: str
    id: str
    canonical: str
    file: str
    envelope: tuple[Any, ...]  # the ENVELOPE_COLUMNS values as stored
    authenticated: bool | None = None  # the row's admission mark (None in files older than it)
    commit: int | None = None  # the row's commit column: must be the commit the log says appended it


# Event rows read at once: a few MB of canonical bytes, whatever the ledger's size.
_BATCH_ROWS = 2_000


def _event_batches(stored: StoredFiles, report: Report) -> Iterator[list[tuple[str, EventRow]]]:
    """(stream, row) of every event row, file by file in physical order, a batch at a time."""
    for file in stored.of("events"):
        rel = file.shown
        try:
            parquet = pq.ParquetFile(file.path)
            names = parquet.schema_arrow.names
            # Every column is read, used or not: damage anywhere in the file is "unreadable".
            for batch in _row_group_batches(parquet):
                cols = [batch.column(c).to_pylist() for c in _EVENT_COLUMNS]
                nulls = [None] * batch.num_rows
                marks = batch.column("authenticated").to_pylist() if "authenticated" in names else nulls
                commits = batch.column("commit").to_pylist() if "commit" in names else nulls
                yield [
                    (stream, EventRow(seq, source, ident, canonical, rel, tuple(envelope), mark, commit))
                    for (stream, seq, source, ident, canonical, *envelope), mark, commit in zip(
                        zip(*cols, strict=True), marks, commits, strict=True
                    )
                ]
        except Exception as exc:
            report.problems.append(Problem("?", "unreadable", f"{rel}: {' '.join(str(exc).split())[:200]}"))


_PRESENT, _MATCHED = 1, 2  # per recorded leaf: some row has its seq; a row has its bytes


@dataclass
class _StreamCheck:
    """What verify keeps of one stream while the event rows stream past: a byte per recorded leaf and
    the rows that are not what the log recorded (few, unless the ledger was tampered with)."""

    rec: RecordedStream
    marks: bytearray
    rows: int = 0
    file: str | None = None
    last_seq: int = -1
    reordered: list[Problem] = field(default_factory=list)
    suspects: list[EventRow] = field(default_factory=list)  # bytes differ, or a second row with the leaf's
    redactions: dict[int, Event] = field(default_factory=dict)  # seq -> the record that erased it
    redacted: list[int] = field(default_factory=list)  # the seqs whose row is a redaction marker named there
    # Part files keep stream order within a file. A lake's files are pinned by SHA-256 instead, and
    # DuckLake's merge keeps file order: after a redaction (its marked row in a newer file) not stream order.
    ordered: bool = True
    unrecorded: list[EventRow] = field(default_factory=list)
    edited: list[Problem] = field(default_factory=list)

    def problems(self, stream: str) -> list[Problem]:
        """In the order verify has always named them: reordering, then by seq, then rows never recorded."""
        by_seq: list[tuple[int, int, int, Problem]] = []
        for i, row in enumerate(self.suspects):
            kind = "inserted" if self.marks[row.seq] & _MATCHED else "modified"
            detail = f"bytes differ from the recorded leaf ({row.file})"
            by_seq.append((row.seq, 0, i, Problem(stream, kind, detail, row.seq, row.id)))
        for seq in (i for i, mark in enumerate(self.marks) if not mark):
            detail = "recorded in the log, missing from the data"
            by_seq.append((seq, 0, -1, Problem(stream, "removed", detail, seq, self.rec.ids[seq][1])))
        by_seq.extend((p.stream_seq or 0, 1, 0, p) for p in self.edited)
        unrecorded = sorted(self.unrecorded, key=lambda r: r.seq)
        return [
            *self.reordered,
            *(p for *_, p in sorted(by_seq, key=lambda x: x[:3])),
            *(
                Problem(stream, "inserted", f"never recorded by a commit ({r.file})", r.seq, r.id)
                for r in unrecorded
            ),
        ]


def _envelope_mismatches(row: EventRow, stream: str, event: Event) -> list[str]:
    """The stored copies of envelope attributes that differ from the event's own bytes."""
    env = event.envelope
    expected = {"stream": env.stream, "source": env.source, "id": env.id}
    stored = {"stream": stream, "source": row.source, "id": row.id}
    for name, value in zip(ENVELOPE_COLUMNS, row.envelope, strict=True):
        expected[name] = getattr(env, name)
        stored[name] = value
    return [name for name in expected if expected[name] != stored[name]]


def verify_ledger(
    root: str | Path,
    public_key: str | Sequence[str] | None = None,
    progress: Callable[[int, int | None], None] | None = None,
) -> Report:
    """Check the whole ledger (see the module's docstring), streaming: event rows are read a batch at
    a time and the per-step tables are compared on disk, so memory stays bounded (about 250 bytes per
    event for the log's leaves and ids, plus DuckDB's limit) whatever the ledger's size.
    ``progress(rows checked, events recorded)`` is called after each batch of event rows."""
    with Ledger.open(root) as ledger:
        return _verify(ledger, public_key, progress)


def _verify(
    ledger: Ledger, public_key: str | Sequence[str] | None, progress: Callable[[int, int | None], None] | None
) -> Report:
    with StoredFiles(ledger) as stored:  # (an S3 lake's objects are fetched for the check, then deleted)
        return _verify_stored(ledger, stored, public_key, progress)


def _verify_stored(
    ledger: Ledger,
    stored: StoredFiles,
    public_key: str | Sequence[str] | None,
    progress: Callable[[int, int | None], None] | None,
) -> Report:
    report = Report()
    _report_lake_files(stored, report)
    log_keys = LogKeys.of(ledger, public_key)
    recorded = recorded_streams(ledger, report)
    total = sum(len(rec.leaves) for rec in recorded.values())
    checked = 0
    timeline = _registry_timeline(stored, recorded.get(REGISTRY_STREAM))
    erased = _redaction_records(stored, recorded)
    checks: dict[str, _StreamCheck] = {}
    with _spill_folder() as spill:
        tables = _TableCheck(stored, Path(spill))
        anomalies = AnomalyCheck(_newest_record(ledger), Path(spill))
        for batch in _event_batches(stored, report):
            good: list[tuple[int, Event]] = []
            for stream, row in batch:
                check = checks.get(stream)
                if check is None:
                    rec = recorded.get(stream, RecordedStream())
                    check = checks[stream] = _StreamCheck(rec, bytearray(len(rec.leaves)))
                    check.redactions = erased.get(stream, {})
                    check.ordered = stored.lake is None
                event = _check_row(check, stream, row)
                if event is not None:
                    good.append((row.seq, event))
                    anomalies.add(stream, row.seq, check.rec.ids.commit_of(row.seq), event)
                    problem = _check_producer(timeline, check.rec, stream, row, event)
                    if problem is not None:
                        check.edited.append(problem)
            tables.add(good)
            checked += len(batch)
            if progress is not None:
                progress(checked, total)
        for stream in sorted(set(recorded) | set(checks)):
            report.streams += 1
            rec = recorded.get(stream, RecordedStream())
            check = checks.get(stream) or _StreamCheck(rec, bytearray(len(rec.leaves)))
            report.events += check.rows
            report.problems.extend(check.problems(stream))
            _report_redactions(stream, check, log_keys, report)
            _check_checkpoint(ledger, stream, rec, log_keys, report)
        tables.check(recorded, report)
        _check_anomalies(anomalies, checks, report)
    _check_erased_salts(stored, erased, report)
    _check_quarantine_count(ledger, stored, report)
    _report_conflicts(stored, report)
    return report


def _newest_record(ledger: Ledger) -> dict[str, Any] | None:
    paths = ledger.commit_paths()
    return json.loads(paths[-1].read_bytes()) if paths else None


def _check_anomalies(anomalies: AnomalyCheck, checks: dict[str, _StreamCheck], report: Report) -> None:
    """Every anomaly event re-derived from the log (``runledger.ledger.anomaly_check``): a missing,
    extra or altered one is an ``anomaly`` problem naming it, unless its row is named already (an
    edited or removed anomaly event is one problem, not two), or its stream is named broken before
    it: an event of the stream that fails its check is not seen by the detectors, so what they make
    of the rest of the stream (the windows) is not the log's; that first problem is the one to fix."""
    redacted = {check.rec.ids[seq][1] for check in checks.values() for seq in check.redacted}
    rows = [*report.problems, *(p for check in checks.values() for p in check.edited)]
    named = {p.event_id for p in rows if p.event_id is not None}
    broken_from: dict[str, int] = {}
    for p in rows:
        if p.stream_seq is not None:
            broken_from[p.stream] = min(p.stream_seq, broken_from.get(p.stream, p.stream_seq))
    for found in anomalies.problems(redacted):
        if found.event_id in named or found.since_seq >= broken_from.get(found.stream, found.since_seq + 1):
            continue
        report.problems.append(Problem(found.stream, "anomaly", found.detail, found.seq, found.event_id))


def _report_lake_files(stored: StoredFiles, report: Report) -> None:
    """On a lake: the listed files' bytes against their commit records, and deletions (a raw reader
    would still count rows DuckDB no longer shows). Part files are checked by their rows alone."""
    check = stored.lake
    if check is None:
        return
    for shown in check.altered:
        detail = f"{shown}: its bytes are not the SHA-256 its commit record names"
        report.problems.append(Problem("?", "modified", detail))
    for shown in check.deletions:
        report.problems.append(Problem("?", "removed", f"{shown}: rows deleted from the lake's table"))
    for named in check.outside:
        detail = (
            f"{named}: the lake catalog names a file that is not a plain file under the data path (not read)"
        )
        report.problems.append(Problem("?", "modified", detail))
    if check.unrecorded:
        report.warnings.append(
            f"lake snapshot {check.snapshot}: {len(check.unrecorded)} of {check.files} data files were "
            "written by the lake's own maintenance (merged), so no commit record names their SHA-256; "
            "their rows were checked like every other file's"
        )


SPILL_PREFIX = "runledger-verify-"


def _spill_folder() -> tempfile.TemporaryDirectory[str]:
    """The verifier's scratch folder in the temp directory, named with this process's id; the ones
    a killed verify left (their process is gone) are removed first."""
    sweep_dead_spills(Path(tempfile.gettempdir()))
    return tempfile.TemporaryDirectory(prefix=f"{SPILL_PREFIX}{os.getpid()}-")


def sweep_dead_spills(directory: Path) -> list[Path]:
    """Remove the scratch folders in ``directory`` of verifies whose process no longer runs (this
    user's only: a live or foreign process's folder is left alone). The folders removed."""
    removed = []
    for path in directory.glob(f"{SPILL_PREFIX}*-*"):
        pid = path.name[len(SPILL_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or process_running(int(pid)):
            continue
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        shutil.rmtree(path, ignore_errors=True)  # another verify may be sweeping it too
        removed.append(path)
    return removed


def _check_row(check: _StreamCheck, stream: str, row: EventRow) -> Event | None:
    """Check one event row against the log; the event when it is the one the log recorded there."""
    check.rows += 1
    if row.file != check.file:
        check.file, check.last_seq = row.file, row.seq
    elif check.ordered and row.seq < check.last_seq:
        check.reordered.append(
            Problem(stream, "reordered", f"out of stream order in {row.file}", row.seq, row.id)
        )
    check.last_seq = row.seq
    leaves = check.rec.leaves
    if not 0 <= row.seq < len(leaves):
        check.unrecorded.append(row)
        return None
    mark = check.marks[row.seq]
    if not mark & _MATCHED and _erased_here(check, row):
        check.marks[row.seq] = mark | _PRESENT | _MATCHED  # committed through its leaf, payload erased
        check.redacted.append(row.seq)
        return None
    if mark & _MATCHED or leaf_hash(row.canonical.encode()) != leaves[row.seq]:
        check.marks[row.seq] = mark | _PRESENT
        check.suspects.append(row)
        return None
    check.marks[row.seq] = mark | _PRESENT | _MATCHED
    decoded = decode_event(row.canonical.encode())
    if not isinstance(decoded, Event):
        return None
    edited = _envelope_mismatches(row, stream, decoded)
    if row.commit != check.rec.ids.commit_of(row.seq):
        detail = f"column commit differs from the commit log ({row.file})"
        check.edited.append(Problem(stream, "modified", detail, row.seq, decoded.envelope.id))
    if edited:
        detail = f"column {', '.join(edited)} differs from the event's bytes ({row.file})"
        check.edited.append(Problem(stream, "modified", detail, row.seq, decoded.envelope.id))
    return decoded


def _erased_here(check: _StreamCheck, row: EventRow) -> bool:
    """A row whose canonical bytes were replaced by a redaction marker, where a redaction record
    stored in the log names this very event, its leaf (as the log recorded it) and this marker."""
    if not is_redacted(row.canonical):
        return False
    record = check.redactions.get(row.seq)
    if record is None:
        return False
    d = record.envelope.data
    try:
        marked = read_marker(row.canonical)
    except (ValueError, KeyError, TypeError):
        return False
    return (
        d.event_id == row.id
        and d.event_source == row.source
        and d.leaf_sha256 == check.rec.leaves[row.seq].hex()
        and marked.get("record") == record.envelope.id
    )


def _redaction_records(
    stored: StoredFiles, recorded: dict[str, RecordedStream]
) -> dict[str, dict[int, Event]]:
    """Per stream, seq -> the ``ledger.redaction`` event that erased it: only records whose own
    bytes are the leaf the log recorded (a changed record is "modified" in the main pass)."""
    out: dict[str, dict[int, Event]] = defaultdict(dict)
    for file in stored.of("events"):
        try:
            parquet = pq.ParquetFile(file.path)
            for group in range(parquet.num_row_groups):
                types = parquet.read_row_group(group, columns=["type"])["type"]
                if not pc.any(pc.equal(types, LEDGER_REDACTION)).as_py():
                    continue
                rows = parquet.read_row_group(group, columns=["stream", "stream_seq", "type", "canonical"])
                rows = rows.filter(pc.equal(rows["type"], LEDGER_REDACTION))
                for stream, seq, text in zip(
                    *(rows[c].to_pylist() for c in ("stream", "stream_seq", "canonical")), strict=True
                ):
                    rec = recorded.get(stream)
                    if (
                        rec is None
                        or not 0 <= seq < len(rec.leaves)
                        or leaf_hash(text.encode()) != rec.leaves[seq]
                    ):
                        continue
                    decoded = decode_event(text.encode())
                    if isinstance(decoded, Event) and decoded.envelope.type == LEDGER_REDACTION:
                        d = decoded.envelope.data
                        out[d.stream][d.stream_seq] = decoded
        except Exception:
            continue  # named "unreadable" by the main pass
    return dict(out)


def _report_redactions(stream: str, check: _StreamCheck, log_keys: LogKeys, report: Report) -> None:
    """Each erased event as a redaction (with its reason) and a warning line; a record whose event
    still holds its payload, or one not signed by a log key tried, is a ``redaction`` problem."""
    for seq in sorted(check.redacted):
        record = check.redactions[seq]
        d, env = record.envelope.data, record.envelope
        signer, problem = _redaction_signer(record, log_keys)
        if problem:
            report.problems.append(Problem(stream, "redaction", problem, seq, d.event_id))
        report.redactions.append(
            {
                "stream": stream,
                "stream_seq": seq,
                "event_id": d.event_id,
                "event_type": d.event_type,
                "reason": d.reason,
                "actor": d.actor,
                "time": env.time.isoformat(),
                "record": env.id,
                "signed_by": signer,
            }
        )
        report.warnings.append(
            f"redacted: stream {stream} event {d.event_id} (#{seq}, {d.event_type}) by {d.actor} at "
            f"{env.time.isoformat()}: {d.reason} (record {env.id}, signed by {signer or 'nobody'})"
        )
    for seq in sorted(set(check.redactions) - set(check.redacted)):
        d = check.redactions[seq].envelope.data
        if 0 <= seq < len(check.marks) and check.marks[seq] & _MATCHED:
            detail = f"redaction record {check.redactions[seq].envelope.id} names it, but its payload is still stored"
            report.problems.append(Problem(stream, "redaction", detail, seq, d.event_id))


def _redaction_signer(record: Event, log_keys: LogKeys) -> tuple[str | None, str | None]:
    """(the key id the record is signed with, a problem or None). Checked when log keys are given."""
    key_id = record.envelope.key_id
    if not log_keys.keys:
        return key_id, None
    key = next((k for k in log_keys.keys if key_id_of(k) == key_id), None)
    if key is None:
        return (
            key_id,
            f"redaction record {record.envelope.id} is not signed by a log key tried ({log_keys.tried()})",
        )
    try:
        verify_canonical(record.canonical, key)
    except SignatureError as exc:
        return key_id, f"redaction record {record.envelope.id}: {exc}"
    return key_id, None


def _check_erased_salts(stored: StoredFiles, erased: dict[str, dict[int, Event]], report: Report) -> None:
    """A redacted event's salt must be gone with its payload (with both, a guess could be checked)."""
    keys = {(stream, seq) for stream, seqs in erased.items() for seq in seqs}
    if not keys:
        return
    for file in stored.of(SALTS.name):
        try:
            table = pq.read_table(file.path, columns=["stream", "stream_seq"])
        except Exception as exc:
            report.problems.append(Problem("?", "unreadable", f"{file.shown}: {exc}"[:240]))
            continue
        for stream, seq in zip(table["stream"].to_pylist(), table["stream_seq"].to_pylist(), strict=True):
            if (stream, seq) in keys:
                detail = f"the salt of a redacted event is still stored ({file.shown})"
                report.problems.append(Problem(stream, "redaction", detail, seq))


def _registry_timeline(stored: StoredFiles, rec: RecordedStream | None) -> RegistryTimeline:
    """The registry's past from its own stream's rows, each one only if its bytes are the leaf the
    log recorded (a changed registry row is reported "modified" by the main pass, never trusted)."""
    if rec is None or not rec.leaves:
        return RegistryTimeline([])
    found: dict[int, Event] = {}
    for file in stored.of("events"):
        try:
            table = _registry_rows(pq.ParquetFile(file.path))
        except Exception:
            continue  # named "unreadable" by the main pass
        for seq, text in zip(table["stream_seq"].to_pylist(), table["canonical"].to_pylist(), strict=True):
            canonical = text.encode()
            if 0 <= seq < len(rec.leaves) and leaf_hash(canonical) == rec.leaves[seq]:
                decoded = decode_event(canonical)
                if isinstance(decoded, Event) and decoded.envelope.type in REGISTRY_TYPES:
                    found[seq] = decoded
    return RegistryTimeline(
        (rec.ids.commit_of(seq), event.envelope.type, event.envelope.data)
        for seq, event in sorted(found.items())
    )


def _registry_rows(parquet: pq.ParquetFile) -> pa.Table:
    """The registry stream's rows of one events file, reading canonical bytes only of the row groups
    that hold some: a compacted run partition is GBs of other streams' events."""
    parts = []
    for group in range(parquet.num_row_groups):
        streams = parquet.read_row_group(group, columns=["stream"])["stream"]
        if not pc.any(pc.equal(streams, REGISTRY_STREAM)).as_py():
            continue
        rows = parquet.read_row_group(group, columns=["stream", "stream_seq", "canonical"])
        parts.append(rows.filter(pc.equal(rows["stream"], REGISTRY_STREAM)))
    schema = pa.schema([("stream", pa.string()), ("stream_seq", pa.int64()), ("canonical", pa.string())])
    return pa.concat_tables(parts) if parts else schema.empty_table()


def _row_group_batches(parquet: pq.ParquetFile, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """A file's rows ``_BATCH_ROWS`` at a time, one row group after another. ``iter_batches`` over all
    row groups at once buffers ahead: 1.2 GB of Arrow memory on a compacted reference-size partition,
    against a row group's worth this way."""
    for group in range(parquet.num_row_groups):
        yield from parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group], columns=columns)


def _check_producer(
    timeline: RegistryTimeline, rec: RecordedStream, stream: str, row: EventRow, event: Event
) -> Problem | None:
    """A stored producer event judged again under the registry of its commit (see the module doc)."""
    env = event.envelope
    if is_own(env):
        return None
    state = timeline.state_at(rec.ids.commit_of(row.seq))
    verdict = authenticate(state, env, event.canonical)
    if isinstance(verdict, tuple):
        code, reason = verdict
        return Problem(stream, "producer", f"{code}: {reason} ({row.file})", row.seq, env.id)
    stored = row.authenticated
    if stored != verdict.authenticated and not (stored is None and verdict.authenticated):
        detail = (
            f"column authenticated is {stored}, admission under the registry says {verdict.authenticated}"
        )
        return Problem(stream, "producer", f"{detail} ({row.file})", row.seq, env.id)
    return None


_CONFLICTS_LISTED = 20


def _report_conflicts(stored: StoredFiles, report: Report) -> None:
    """Records quarantined as conflicts (a stored event's (source, id) with other bytes: a forgery or
    a producer reusing ids) as one warning with their count and ids. The stored events stay, so the
    log is intact; a warning, not a problem."""
    ids: list[str] = []
    for file in stored.of("quarantine"):
        try:
            table = pq.read_table(file.path, columns=["reason", "event_source", "event_id"])
        except Exception:
            continue  # _check_quarantine_count names unreadable files
        table = table.filter(pc.starts_with(table["reason"], f"{CONFLICT}:"))
        ids.extend(
            f"({source}, {ident})"
            for source, ident in zip(
                table["event_source"].to_pylist(), table["event_id"].to_pylist(), strict=True
            )
        )
    if ids:
        more = f" and {len(ids) - _CONFLICTS_LISTED} more" if len(ids) > _CONFLICTS_LISTED else ""
        report.warnings.append(
            f"{CONFLICT}: {len(ids)} quarantined record(s) reuse a stored event's (source, id) with "
            f"different bytes (the stored events stay): {', '.join(ids[:_CONFLICTS_LISTED])}{more}"
        )


def _check_quarantine_count(ledger: Ledger, stored: StoredFiles, report: Report) -> None:
    """Quarantined records are outside the Merkle trees; the commit log still counts them, so a deleted
    (or planted) quarantine row shows as a count that differs from the log's."""
    logged = sum(
        json.loads(path.read_bytes()).get("counts", {}).get("quarantined", 0)
        for path in ledger.commit_paths()
    )
    rows = 0
    for file in stored.of("quarantine"):
        try:
            rows += pq.read_metadata(file.path).num_rows
        except Exception as exc:
            detail = f"{file.shown}: {' '.join(str(exc).split())[:200]}"
            report.problems.append(Problem("?", "unreadable", detail))
    if rows != logged:
        report.problems.append(
            Problem(
                "quarantine", "table-mismatch", f"{rows} quarantined rows, the commit log counts {logged}"
            )
        )


@dataclass
class LogKeys:
    """The public keys a verify may check log checkpoints with, and the ledger's producer keys
    (which never sign its checkpoints: a key of a producer's is refused as the log's signer)."""

    keys: list[NoteVerifier]
    producers: set[str]

    @classmethod
    def of(cls, ledger: Ledger, public_key: str | Sequence[str] | None) -> LogKeys:
        texts = [public_key] if isinstance(public_key, str) else list(public_key or [])
        producers = set(load_state(ledger).keys) if texts else set()
        return cls([parse_public_key(text) for text in texts], producers)

    def signer_of(self, note: str) -> NoteVerifier | None:
        """The key the note says signed it, among ours (matched by name and key hash, so a folder of
        several keys holds no ambiguity)."""
        claimed = set(note_signers(note))
        return next((key for key in self.keys if key_id_of(key) in claimed), None)

    def tried(self) -> str:
        return ", ".join(key_id_of(key) for key in self.keys)


def _check_checkpoint(
    ledger: Ledger, stream: str, rec: RecordedStream, log_keys: LogKeys, report: Report
) -> None:
    path = checkpoint_path(ledger.root, stream)
    if not path.exists() or not log_keys.keys:
        return
    note = path.read_text()
    key = log_keys.signer_of(note)
    # A key mix-up is said as one, never as tampering: which key signed, which keys were tried.
    signers = ", ".join(note_signers(note)) or "no readable signature line"
    if key is None:
        detail = f"{path.name} is signed by {signers}, none of the keys tried ({log_keys.tried()})"
        report.problems.append(Problem(stream, "key", detail))
        return
    if key_id_of(key) in log_keys.producers:
        detail = f"{path.name} is signed by {key_id_of(key)}, a producer key of this ledger, not a log key"
        report.problems.append(Problem(stream, "key", detail))
        return
    try:
        cp = parse_and_verify_checkpoint(note, key, origin=origin_of(ledger, stream))
    except ValueError as exc:
        report.problems.append(Problem(stream, "checkpoint", f"{path.name}: {exc}"))
        return
    report.checkpoints += 1
    if cp.size > len(rec.leaves):
        report.problems.append(
            Problem(
                stream,
                "checkpoint",
                f"signed size {cp.size} but the log holds only "
                f"{len(rec.leaves)} events: history was truncated",
            )
        )
    elif root_from_leaf_hashes(rec.leaves[: cp.size]) != cp.root:
        report.problems.append(
            Problem(
                stream,
                "checkpoint",
                f"the first {cp.size} events no longer match the signed checkpoint: history was rewritten",
            )
        )


def _sort_keys(table: str) -> list[str]:
    names = TABLES[table].schema.names
    return ["stream", "stream_seq", *[k for k in ("name", "layer") if k in names]]


# Tables with rows per step (millions in a long run): their expected rows are written to a spill file
# and compared with the stored ones by DuckDB (each distinct row counted +1 per expected copy and -1 per
# stored one; any count left names its event), which spills to disk past its memory limit. The other
# tables hold a row per state or GitHub event and are compared in memory.
_SPILLED = ("metrics", "moe_layer_stats", "rank_stats")
_DUCKDB_MEMORY = "256MB"
# Rows per comparison pass: a GROUP BY over every column of the reference run's 18.7M router rows ran
# out of the 256 MB (DuckDB could not spill it); a pass compares the rows of one stream_seq bucket.
_ROWS_PER_PASS = 2_000_000


class _TableCheck:
    """Every typed table must be exactly what its events produce: fed the good events batch by batch."""

    def __init__(self, stored: StoredFiles, spill: Path) -> None:
        self.stored, self.spill = stored, spill
        self.names = [n for n in stored.tables if n not in ("events", "quarantine")]
        self.fold = FoldState()
        # Ingest's incidents in ``state_events`` (issue 42; a commit of today writes none there): a
        # lake without ``ingest_incidents`` reads them there, so each must be there (None: every
        # one); one with it (written before, migrated, then ingesting anew) may keep those it has,
        # each exactly as the log says.
        self.incident_state_rows: set[tuple[str, int]] | None = set()
        if "state_events" in self.names:
            strict = "ingest_incidents" not in self.names
            self.incident_state_rows = None if strict else _stored_incident_keys(stored)
        self.expected: dict[str, list[pa.Table]] = defaultdict(list)
        self.writers = {
            name: pq.ParquetWriter(spill / f"{name}.parquet", _with_partition(name), compression="zstd")
            for name in self.names
            if name in _SPILLED
        }

    def add(self, events: Sequence[tuple[int, Event]]) -> None:
        buf = RowBuffer()
        for seq, event in events:
            rows_for_event(event, seq, buf, self.fold)
            if event.envelope.type == LEDGER_INCIDENT and self._incident_kept(event, seq):
                buf.add("state_events", event.envelope.run_id or "", _state_event_row(event, seq))
        for table, partition, data in buf.tables():
            if table not in self.names:
                continue  # a table this (older) ledger does not keep
            # Compared with the partition directory the store wrote the rows to, not the bare value.
            part_col = pa.array([stored_partition(partition)] * data.num_rows, pa.string())
            data = data.append_column(TABLES[table].partition, part_col)
            writer = self.writers.get(table)
            if writer is not None:
                writer.write_table(data)
            else:
                self.expected[table].append(data)

    def _incident_kept(self, event: Event, seq: int) -> bool:
        """Whether this ledger's ``state_events`` should hold the incident ``event`` (stream_seq ``seq``)."""
        keys = self.incident_state_rows
        return keys is None or (event.envelope.stream, seq) in keys

    def check(self, recorded: dict[str, RecordedStream], report: Report) -> None:
        for writer in self.writers.values():
            writer.close()
        for name in self.names:
            bad = self._spilled(name, report) if name in self.writers else self._in_memory(name, report)
            for stream, seq in sorted(bad, key=lambda x: (str(x[0]), x[1] if x[1] is not None else -1)):
                rec = recorded.get(stream)
                ident = rec.ids[seq][1] if rec and seq is not None and 0 <= seq < len(rec.ids) else None
                detail = f"{name} rows differ from what the event records"
                report.problems.append(Problem(str(stream), "table-mismatch", detail, seq, ident))

    def _spilled(self, name: str, report: Report) -> set[tuple[Any, Any]]:
        spec = TABLES[name]
        files = []
        stored_columns: set[str] = set()
        for file in self.stored.of(name):
            try:
                stored_columns |= set(pq.read_schema(file.path).names)
                files.append(file.path.as_posix())
            except Exception as exc:
                report.problems.append(Problem("?", "unreadable", f"{file.shown}: {exc}"[:240]))
        con = duck.connect()
        con.execute(f"SET memory_limit = '{_DUCKDB_MEMORY}'")
        con.execute(f"SET temp_directory = '{_sql_text((self.spill / 'duckdb').as_posix())}'")
        con.execute("SET preserve_insertion_order = false")
        want = f"read_parquet('{_sql_text((self.spill / f'{name}.parquet').as_posix())}')"
        types = con.execute(f"DESCRIBE SELECT * FROM {want}").fetchall()
        # Both sides as the expected rows' columns and types (a stored file may lack a column: NULLs).
        columns = ", ".join(f'CAST("{col}" AS {kind}) AS "{col}"' for col, kind, *_ in types)
        # (a column added after every stored file was written: NULL in all of them, as the events say)
        stored = ", ".join(
            f'CAST({_sql_name(col) if col in stored_columns | {spec.partition} else "NULL"} AS {kind}) AS "{col}"'
            for col, kind, *_ in types
        )
        if files and self.stored.lake is None:  # part files: the partition from the directory's name
            have = (
                f"SELECT {stored}, -1 AS _side FROM read_parquet(?, hive_partitioning = true, "
                f"hive_types = {{'{spec.partition}': VARCHAR}}, union_by_name = true)"
            )
            params: list[Any] | None = [files]
        elif files:  # a lake's: from the file's own column, as the store names an empty one
            part = f'"{spec.partition}"'
            have = (
                f"SELECT {stored}, -1 AS _side FROM (SELECT * REPLACE (coalesce(nullif({part}, ''), '_') "
                f"AS {part}) FROM read_parquet(?, hive_partitioning = false, union_by_name = true))"
            )
            params = [files]
        else:
            have, params = f"SELECT {columns}, -1 AS _side FROM {want} WHERE false", None
        want = f"SELECT {columns}, 1 AS _side FROM {want}"
        passes = max(
            1, -(-pq.ParquetFile(self.spill / f"{name}.parquet").metadata.num_rows // _ROWS_PER_PASS)
        )
        rows: set[tuple[Any, Any]] = set()
        try:
            for bucket in range(passes):
                where = f" WHERE coalesce(stream_seq, 0) % {passes} = {bucket}" if passes > 1 else ""
                rows.update(
                    con.execute(
                        "SELECT DISTINCT stream, stream_seq FROM ("
                        f"SELECT * EXCLUDE (_side), sum(_side) AS _copies FROM (SELECT * FROM ({want}){where} "
                        f"UNION ALL SELECT * FROM ({have}){where}) GROUP BY ALL) WHERE _copies <> 0",
                        params,
                    ).fetchall()
                )
        except duckdb.Error as exc:
            report.problems.append(Problem("?", "unreadable", f"{name}: {' '.join(str(exc).split())}"[:240]))
            return set()
        finally:
            con.close()
        return rows

    def _in_memory(self, name: str, report: Report) -> set[tuple[Any, Any]]:
        spec = TABLES[name]
        actual_parts = []
        older: dict[str, set[tuple[str, int]]] = defaultdict(set)  # added column → rows written before it
        for file in self.stored.of(name):
            try:
                data = pq.read_table(file.path, schema=spec.schema)
                absent = ADDED_COLUMNS.get(name, frozenset()) - set(pq.read_schema(file.path).names)
                partition = _partition_column(file, spec.partition, data.num_rows)
            except Exception as exc:
                report.problems.append(Problem("?", "unreadable", f"{file.shown}: {exc}"[:240]))
                continue
            rows = list(zip(data["stream"].to_pylist(), data["stream_seq"].to_pylist(), strict=True))
            for column in absent:
                older[column] |= set(rows)
            for column in ADDED_COLUMNS.get(name, frozenset()) - absent:  # a row migrated from before it
                nulls = data[column].is_null().to_pylist()
                older[column] |= {row for row, null in zip(rows, nulls, strict=True) if null}
            actual_parts.append(data.append_column(spec.partition, partition))
        schema = _with_partition(name)
        want = pa.concat_tables(self.expected[name]) if self.expected[name] else schema.empty_table()
        have = pa.concat_tables(actual_parts) if actual_parts else schema.empty_table()
        for column, keys in older.items():
            want = _blank(want, column, keys)
        order = [(k, "ascending") for k in _sort_keys(name)]
        want, have = want.sort_by(order), have.sort_by(order)
        if want.equals(have):
            return set()
        w = Counter(_row_tuples(want))
        h = Counter(_row_tuples(have))
        return {(r[0], r[1]) for r in (w - h) + (h - w)}


def _stored_incident_keys(stored: StoredFiles) -> set[tuple[str, int]]:
    """(stream, stream_seq) of the stored ``state_events`` rows that are a ``ledger.incident`` (written
    before ingest's incidents were kept out of that table); an unreadable file is told where its rows
    are compared."""
    keys: set[tuple[str, int]] = set()
    for file in stored.of("state_events"):
        try:
            rows = pq.read_table(file.path, columns=["type", "stream", "stream_seq"])
        except Exception:
            continue
        incidents = rows.filter(pc.equal(rows.column("type"), LEDGER_INCIDENT))
        streams, seqs = incidents.column("stream").to_pylist(), incidents.column("stream_seq").to_pylist()
        keys.update(zip(streams, seqs, strict=True))
    return keys


def _state_event_row(event: Event, stream_seq: int) -> dict[str, Any]:
    """The ``state_events`` row an older lake's commit wrote for an incident event."""
    env = event.envelope
    key = {"attempt": env.attempt, "step": env.step, "time": env.time, "stream": env.stream}
    return {**key, "stream_seq": stream_seq, "type": env.type, "canonical": event.canonical}


def _partition_column(file: StoredFile, column: str, rows: int) -> pa.Array:
    """A file's partition values: its directory's (part files) or its own column's (a lake's, an
    empty one named as the store names it)."""
    if file.partition is not None:
        return pa.array([file.partition] * rows, pa.string())
    values = pq.read_table(file.path, columns=[column])[column].to_pylist()
    return pa.array([stored_partition(v) for v in values], pa.string())


def _sql_text(text: str) -> str:
    return text.replace("'", "''")


def _sql_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _with_partition(name: str) -> pa.Schema:
    spec = TABLES[name]
    return spec.schema.append(pa.field(spec.partition, pa.string()))


# A file lacking a column other than ADDED_COLUMNS' is compared as it is, so dropping a column from a
# file is reported like any other edit.


def _blank(table: pa.Table, column: str, keys: set[tuple[str, int]]) -> pa.Table:
    """``table`` with ``column`` nulled in the rows whose (stream, stream_seq) is in ``keys``."""
    origin = zip(table["stream"].to_pylist(), table["stream_seq"].to_pylist(), strict=True)
    mask = pa.array([key in keys for key in origin], pa.bool_())
    index = table.schema.get_field_index(column)
    values = pc.if_else(mask, pa.nulls(table.num_rows, table.schema.field(index).type), table[column])
    return table.set_column(index, column, values)


def stored_partition(value: str | None) -> str:
    """The hive directory value a projector's partition is stored under: the store writes an empty
    one (a GitHub event naming no owner, an annotation without a run) as ``_``
    (``runledger.ledger.lake._path_value``)."""
    return value or "_"


def _row_tuples(table: pa.Table) -> list[tuple[Any, ...]]:
    cols = table.to_pydict()
    names = ["stream", "stream_seq", *[n for n in cols if n not in ("stream", "stream_seq")]]
    return [tuple(_hashable(cols[n][i]) for n in names) for i in range(table.num_rows)]


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# --------------------------------------------------------------------------- checkpoints and proofs


def _stream_tree(ledger: Ledger, stream: str) -> MerkleTree:
    recorded = recorded_streams(ledger).get(stream)
    if recorded is None:
        raise LedgerError(f"unknown stream {stream!r}")
    return MerkleTree.from_leaf_hashes(recorded.leaves)


def _signed_size(ledger: Ledger, stream: str) -> int | None:
    path = checkpoint_path(ledger.root, stream)
    if not path.exists():
        return None
    return int(path.read_text().splitlines()[1])


def prove_inclusion(root: str | Path, event_id: str, source: str | None = None) -> dict[str, Any]:
    from runledger.ledger.query import Reader

    # The reader first, then the ledger: a DuckDB-file lake catalog is attached once at a time.
    reader = Reader(root)
    params: list[Any] = [event_id]
    where = "id = ?"
    if source:
        where += " AND source = ?"
        params.append(source)
    try:
        found = reader.sql(
            f"SELECT stream, stream_seq, source, canonical FROM events WHERE {where}", params
        ).rows
    finally:
        reader.close()
    if not found:
        raise LedgerError(f"no event with id {event_id!r}")
    if len(found) > 1:
        raise LedgerError(f"{len(found)} events have id {event_id!r}; name one with --source")
    stream, seq, src, canonical = found[0]
    with Ledger.open(root) as ledger:
        tree = _stream_tree(ledger, stream)
        size = _signed_size(ledger, stream) or tree.size
    if seq >= size:
        raise LedgerError(
            f"event {event_id} (#{seq}) is newer than the signed checkpoint (size {size}); "
            "run `ledger checkpoint` first"
        )
    erased = is_redacted(canonical)  # its bytes are gone: the leaf the log recorded stands for them
    leaf = tree.leaf_hash(seq) if erased else leaf_hash(canonical.encode())
    extra: dict[str, Any] = {"redacted": read_marker(canonical)["reason"]} if erased else {}
    return (
        extra
        | verifier.inclusion_proof_document(
            stream=stream,
            event_id=event_id,
            leaf_index=seq,
            tree_size=size,
            audit_path=tree.inclusion_proof(seq, size),
            leaf_hash=leaf,
            root_hash=tree.root(size),
        )
        | {"source": src}
    )


def prove_consistency(
    root: str | Path, stream: str, old_size: int, new_size: int | None = None
) -> dict[str, Any]:
    with Ledger.open(root) as ledger:
        tree = _stream_tree(ledger, stream)
        new = new_size or _signed_size(ledger, stream) or tree.size
    if not 0 <= old_size <= new <= tree.size:
        raise LedgerError(f"sizes must satisfy 0 <= {old_size} <= {new} <= {tree.size}")
    return verifier.consistency_proof_document(
        stream=stream,
        first=old_size,
        second=new,
        consistency=tree.consistency_proof(old_size, new),
        first_root=tree.root(old_size),
        second_root=tree.root(new),
    )
