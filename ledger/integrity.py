"""Tamper evidence for a whole ledger: verify it, sign checkpoints, and prove inclusion/consistency.

What is checked by ``verify_ledger``:
  * the leaves each commit recorded, per stream, rebuild every commit's stored tree state;
  * the latest signed checkpoint of each stream (if any) matches the recorded leaves at its size,
    and the ledger only grew since (consistency);
  * every event row hashes to the leaf recorded at its ``stream_seq``: a changed event is named
    "modified", a missing one "removed", one the commits never recorded "inserted", rows out of
    their stream order within a file "reordered";
  * every typed table equals what the events produce: an edited metric names its event.
Guarantee: tamper-evident, not tamper-proof. Someone who can rewrite the files *and* the commit
log can make a self-consistent forgery, but not one that matches a checkpoint signed and published
before the edit; that is why checkpoints must be kept by others.
"""

from __future__ import annotations

import base64
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from runledger.durable import write_durably
from runledger.ledger import verifier
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint, parse_private_key, sign_checkpoint
from runledger.ledger.merkle import CompactRange, MerkleTree, leaf_hash, root_from_leaf_hashes
from runledger.ledger.parquet_schemas import TABLES
from runledger.ledger.projectors import FoldState, RowBuffer, rows_for_event
from runledger.ledger.store import Ledger, LedgerError
from runledger.schemas import Event, decode_event

CHECKPOINTS = "_checkpoints"


@dataclass(frozen=True)
class Problem:
    stream: str
    kind: str  # modified | removed | inserted | reordered | table-mismatch | checkpoint | unreadable | log
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

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class RecordedStream:
    leaves: list[bytes] = field(default_factory=list)
    ids: list[tuple[str, str]] = field(default_factory=list)


def origin_of(ledger: Ledger, stream: str) -> str:
    return f"runledger/{ledger.ledger_id}/{stream}"


def checkpoint_path(root: Path, stream: str) -> Path:
    return root / CHECKPOINTS / (stream.replace("/", "~") + ".txt")


def recorded_streams(ledger: Ledger, report: Report | None = None) -> dict[str, RecordedStream]:
    """Each stream's leaves as the commit log recorded them, checked against the stored tree states."""
    streams: dict[str, RecordedStream] = defaultdict(RecordedStream)
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
            rec.ids.extend((s, i) for s, i in added["ids"])
        for stream, head in record.get("streams", {}).items():
            tree = CompactRange.from_json(head["tree"])
            rec = streams[stream]
            if report is not None and (
                tree.size > len(rec.leaves) or tree.root() != root_from_leaf_hashes(rec.leaves[: tree.size])
            ):
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


def _read_events(root: Path, report: Report) -> dict[str, list[EventRow]]:
    """Event rows per stream, in physical order."""
    rows: dict[str, list[EventRow]] = defaultdict(list)
    for path in sorted((root / "events").rglob("*.parquet")):
        rel = str(path.relative_to(root))
        try:
            table = pq.read_table(path, columns=list(_EVENT_COLUMNS))
        except Exception as exc:
            report.problems.append(Problem("?", "unreadable", f"{rel}: {' '.join(str(exc).split())[:200]}"))
            continue
        cols = [table.column(c).to_pylist() for c in _EVENT_COLUMNS]
        for stream, seq, source, ident, canonical, *envelope in zip(*cols, strict=True):
            rows[stream].append(EventRow(seq, source, ident, canonical, rel, tuple(envelope)))
    return rows


def _envelope_mismatches(row: EventRow, stream: str, event: Event) -> list[str]:
    """The stored copies of envelope attributes that differ from the event's own bytes."""
    env = event.envelope
    expected = {"stream": env.stream, "source": env.source, "id": env.id}
    stored = {"stream": stream, "source": row.source, "id": row.id}
    for name, value in zip(ENVELOPE_COLUMNS, row.envelope, strict=True):
        expected[name] = getattr(env, name)
        stored[name] = value
    return [name for name in expected if expected[name] != stored[name]]


def verify_ledger(root: str | Path, public_key: str | None = None) -> Report:
    ledger = Ledger.open(root)
    report = Report()
    recorded = recorded_streams(ledger, report)
    actual = _read_events(ledger.root, report)
    good_events: dict[str, list[tuple[int, Event]]] = {}
    for stream in sorted(set(recorded) | set(actual)):
        report.streams += 1
        rec = recorded.get(stream, RecordedStream())
        rows = actual.get(stream, [])
        report.events += len(rows)
        by_seq: dict[int, list[EventRow]] = defaultdict(list)
        last_in_file: dict[str, int] = {}
        for row in rows:
            seq, ident, rel = row.seq, row.id, row.file
            by_seq[seq].append(row)
            if rel in last_in_file and seq < last_in_file[rel]:
                report.problems.append(
                    Problem(stream, "reordered", f"out of stream order in {rel}", seq, ident)
                )
            last_in_file[rel] = seq
        events: list[tuple[int, Event]] = []
        for seq, expected_leaf in enumerate(rec.leaves):
            _source, ident = rec.ids[seq]
            found = by_seq.pop(seq, [])
            if not found:
                report.problems.append(
                    Problem(stream, "removed", "recorded in the log, missing from the data", seq, ident)
                )
                continue
            matching = [r for r in found if leaf_hash(r.canonical.encode()) == expected_leaf]
            for r in found:
                if r not in matching or matching.index(r) > 0:
                    kind = "modified" if not matching else "inserted"
                    report.problems.append(
                        Problem(stream, kind, f"bytes differ from the recorded leaf ({r.file})", seq, r.id)
                    )
            if matching:
                decoded = decode_event(matching[0].canonical.encode())
                if isinstance(decoded, Event):
                    events.append((seq, decoded))
                    edited = _envelope_mismatches(matching[0], stream, decoded)
                    if edited:
                        report.problems.append(
                            Problem(
                                stream,
                                "modified",
                                f"column {', '.join(edited)} differs from the event's bytes ({matching[0].file})",
                                seq,
                                decoded.envelope.id,
                            )
                        )
        for seq, extra in sorted(by_seq.items()):
            for r in extra:
                report.problems.append(
                    Problem(stream, "inserted", f"never recorded by a commit ({r.file})", seq, r.id)
                )
        good_events[stream] = events
        _check_checkpoint(ledger, stream, rec, public_key, report)
    _check_tables(ledger.root, good_events, recorded, report)
    _check_quarantine_count(ledger, report)
    return report


def _check_quarantine_count(ledger: Ledger, report: Report) -> None:
    """Quarantined records are outside the Merkle trees; the commit log still counts them, so a deleted
    (or planted) quarantine row shows as a count that differs from the log's."""
    logged = sum(
        json.loads(path.read_bytes()).get("counts", {}).get("quarantined", 0)
        for path in ledger.commit_paths()
    )
    stored = 0
    for path in sorted((ledger.root / "quarantine").rglob("*.parquet")):
        try:
            stored += pq.read_metadata(path).num_rows
        except Exception as exc:
            rel = path.relative_to(ledger.root)
            report.problems.append(Problem("?", "unreadable", f"{rel}: {' '.join(str(exc).split())[:200]}"))
    if stored != logged:
        report.problems.append(
            Problem(
                "quarantine", "table-mismatch", f"{stored} quarantined rows, the commit log counts {logged}"
            )
        )


def _check_checkpoint(
    ledger: Ledger, stream: str, rec: RecordedStream, public_key: str | None, report: Report
) -> None:
    path = checkpoint_path(ledger.root, stream)
    if not path.exists() or public_key is None:
        return
    try:
        cp = parse_and_verify_checkpoint(path.read_text(), public_key, origin=origin_of(ledger, stream))
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


def _check_tables(
    root: Path,
    events: dict[str, list[tuple[int, Event]]],
    recorded: dict[str, RecordedStream],
    report: Report,
) -> None:
    """Every typed table must be exactly what its events produce."""
    buf = RowBuffer()
    fold = FoldState()
    for stream in sorted(events):
        for seq, event in events[stream]:
            rows_for_event(event, seq, buf, fold)
    expected: dict[str, list[pa.Table]] = defaultdict(list)
    for table, partition, data in buf.tables():
        # Compared with the partition directory the store wrote the rows to, not the bare value.
        part_col = pa.array([stored_partition(partition)] * data.num_rows, pa.string())
        expected[table].append(data.append_column(TABLES[table].partition, part_col))
    for name, spec in TABLES.items():
        if name in ("events", "quarantine"):
            continue
        actual_parts = []
        older: dict[str, set[tuple[str, int]]] = defaultdict(set)  # added column → rows written before it
        for path in sorted((root / name).glob(f"{spec.partition}=*/*.parquet")):
            try:
                data = pq.read_table(path, schema=spec.schema)
                absent = ADDED_COLUMNS.get(name, frozenset()) - set(pq.read_schema(path).names)
            except Exception as exc:
                report.problems.append(Problem("?", "unreadable", f"{path.relative_to(root)}: {exc}"[:240]))
                continue
            if absent:
                keys = set(zip(data["stream"].to_pylist(), data["stream_seq"].to_pylist(), strict=True))
                for column in absent:
                    older[column] |= keys
            value = path.parent.name.split("=", 1)[1]
            actual_parts.append(
                data.append_column(spec.partition, pa.array([value] * data.num_rows, pa.string()))
            )
        schema = spec.schema.append(pa.field(spec.partition, pa.string()))
        want = pa.concat_tables(expected[name]) if expected[name] else schema.empty_table()
        have = pa.concat_tables(actual_parts) if actual_parts else schema.empty_table()
        for column, keys in older.items():
            want = _blank(want, column, keys)
        keys = [(k, "ascending") for k in _sort_keys(name)]
        want, have = want.sort_by(keys), have.sort_by(keys)
        if want.equals(have):
            continue
        w = Counter(_row_tuples(want))
        h = Counter(_row_tuples(have))
        bad = {(r[0], r[1]) for r in (w - h) + (h - w)}
        for stream, seq in sorted(bad, key=lambda x: (str(x[0]), x[1] if x[1] is not None else -1)):
            rec = recorded.get(stream)
            ident = rec.ids[seq][1] if rec and seq is not None and 0 <= seq < len(rec.ids) else None
            report.problems.append(
                Problem(
                    str(stream),
                    "table-mismatch",
                    f"{name} rows differ from what the event records",
                    seq,
                    ident,
                )
            )


# Columns a table gained after ledgers were written with it. A file written before lacks them (they
# read back as nulls), so its rows are compared without them; a file lacking any other column is
# compared as it is, so dropping a column from a file is reported like any other edit.
ADDED_COLUMNS: dict[str, frozenset[str]] = {"github": frozenset({"org", "fact", "via"})}


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
    (``runledger.ledger.store.Ledger._write_files``)."""
    return value or "_"


def _row_tuples(table: pa.Table) -> list[tuple[Any, ...]]:
    cols = table.to_pydict()
    names = ["stream", "stream_seq", *[n for n in cols if n not in ("stream", "stream_seq")]]
    return [tuple(_hashable(cols[n][i]) for n in names) for i in range(table.num_rows)]


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# --------------------------------------------------------------------------- checkpoints and proofs


def sign_checkpoints(root: str | Path, private_key: str) -> list[Path]:
    """Sign each stream's current (size, root); write the latest and keep every one signed."""
    ledger = Ledger.open(root)
    signer = parse_private_key(private_key)
    written = []
    for stream, head in sorted(ledger.stream_heads().items()):
        text = sign_checkpoint(origin_of(ledger, stream), head.size, head.tree.root(), signer)
        latest = checkpoint_path(ledger.root, stream)
        history = latest.with_suffix("") / f"{head.size:012d}.txt"
        history.parent.mkdir(parents=True, exist_ok=True)
        write_durably(history, text)
        write_durably(latest, text)
        written.append(latest)
    return written


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
    ledger = Ledger.open(root)
    from runledger.ledger.query import Reader

    reader = Reader(ledger.root)
    params: list[Any] = [event_id]
    where = "id = ?"
    if source:
        where += " AND source = ?"
        params.append(source)
    found = reader.sql(f"SELECT stream, stream_seq, source, canonical FROM events WHERE {where}", params).rows
    if not found:
        raise LedgerError(f"no event with id {event_id!r}")
    if len(found) > 1:
        raise LedgerError(f"{len(found)} events have id {event_id!r}; name one with --source")
    stream, seq, src, canonical = found[0]
    tree = _stream_tree(ledger, stream)
    size = _signed_size(ledger, stream) or tree.size
    if seq >= size:
        raise LedgerError(
            f"event {event_id} (#{seq}) is newer than the signed checkpoint (size {size}); "
            "run `ledger checkpoint` first"
        )
    leaf = leaf_hash(canonical.encode())
    return verifier.inclusion_proof_document(
        stream=stream,
        event_id=event_id,
        leaf_index=seq,
        tree_size=size,
        audit_path=tree.inclusion_proof(seq, size),
        leaf_hash=leaf,
        root_hash=tree.root(size),
    ) | {"source": src}


def prove_consistency(
    root: str | Path, stream: str, old_size: int, new_size: int | None = None
) -> dict[str, Any]:
    ledger = Ledger.open(root)
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
