"""`ledger redact EVENT`: erase one event's payload without breaking a proof.

Every event stays committed through digests that do not need its bytes: its per-stream Merkle leaf
(the leaf hashes the commit log recorded) and its public log entry's ``salted_sha256`` (SHA-256 of
a random per-event salt and its canonical bytes; ``sha256`` for events stored before salts). A
redaction, as one commit under the writer lock:

* changes the event's rows in the commit's lake transaction (``lake_edit``): its ``events`` row keeps
  the envelope columns and gets a marker (``{"redacted": {...}}``) in place of its canonical bytes;
  its rows in the typed tables and its salt are deleted; the deleted rows' bytes then leave the disk
  (``LakeTables.erase_deleted``; a kill before that is finished by the next writer);
* appends a ``ledger.redaction`` event (the event's ids, leaf hash, entry digest, reason and actor),
  signed with the log key, on the event's own stream: ``ledger verify`` accepts the marker only where
  such a record names the event and its leaf, and ``ledger state``/``history`` show it.

A ledger of the old format (part files) is refused as ``Ledger.open`` refuses it: ``ledger migrate``
first.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from runledger.ledger.admission import INCIDENT_INGEST, is_own
from runledger.ledger.compaction import conform
from runledger.ledger.lake import ALIAS, LakeTables, lake_schema
from runledger.ledger.merkle import leaf_hash
from runledger.ledger.parquet_schemas import TABLES
from runledger.ledger.projectors import FoldState, RowBuffer, rows_for_event
from runledger.ledger.redaction_marker import (  # (light: re-exported for the writer's importers)
    REDACTED_PREFIX as REDACTED_PREFIX,
)
from runledger.ledger.redaction_marker import entry_digest, is_redacted, marker, read_marker
from runledger.ledger.redaction_marker import entry_matches as entry_matches
from runledger.ledger.store import SALTS, CommitResult, LakeEdit, Ledger, LedgerError, SourceRecord
from runledger.schemas import catalogue as c
from runledger.schemas import payloads as p
from runledger.schemas.codec import Event, decode_event, encode_event, make_event
from runledger.schemas.signing import Sealer

MAX_REASON_CHARS = 2000


@dataclass(frozen=True)
class Target:
    """The event to redact, as its row in ``events`` holds it."""

    stream: str
    stream_seq: int
    source: str
    id: str
    type: str
    run_id: str | None
    attempt: int | None
    step: int | None
    canonical: str


@dataclass
class RedactionResult:
    commit: int
    record_id: str
    target: Target
    rewritten: int  # data files rewritten without the deleted rows
    salted: bool


Stored = Path | LakeTables  # where stored rows are read: a ledger folder of part files, or its lake


def _select(stored: Stored, table: str, columns: list[str], where: dict[str, Any]) -> list[dict[str, Any]]:
    """``columns`` of ``table``'s rows whose columns equal ``where``'s values (a list: any of them),
    from the part files (pyarrow) or from the lake's newest snapshot."""
    if isinstance(stored, LakeTables):
        clauses, params = [], []
        for column, value in where.items():
            values = value if isinstance(value, list) else [value]
            clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
            params += values
        sql = f"SELECT {', '.join(columns)} FROM {table} WHERE {' AND '.join(clauses)}"
        with stored.reader() as con:
            return con.execute(sql, params).to_arrow_table().to_pylist()
    files = sorted(str(p) for p in (stored / table).rglob("*.parquet"))
    if not files:
        return []
    wanted = None
    for column, value in where.items():
        term = ds.field(column).isin(value) if isinstance(value, list) else ds.field(column) == value
        wanted = term if wanted is None else wanted & term
    return ds.dataset(files, format="parquet").to_table(columns=columns, filter=wanted).to_pylist()


def stored_rows(ledger: Ledger) -> Stored:
    """Where ``ledger``'s rows are read (its open lake, or its folder)."""
    return ledger.lake if ledger.lake is not None else ledger.root


def find_event(stored: Stored, event_id: str, source: str | None = None) -> Target:
    """The one stored event with ``event_id`` (and ``source``); a LedgerError names what is wrong."""
    where: dict[str, Any] = {"id": event_id} | ({"source": source} if source is not None else {})
    columns = ["stream", "stream_seq", "source", "id", "type", "run_id", "attempt", "step", "canonical"]
    rows = _select(stored, "events", columns, where)
    if not rows:
        where_from = f" from source {source!r}" if source else ""
        raise LedgerError(f"no event with id {event_id!r}{where_from} in this ledger")
    if len(rows) > 1:
        raise LedgerError(f"{len(rows)} events have id {event_id!r}; name one with --source")
    return Target(**rows[0])


def salt_of(stored: Stored, stream: str, seq: int) -> bytes | None:
    rows = _select(stored, SALTS.name, ["salt"], {"stream": stream, "stream_seq": seq})
    values = [r["salt"] for r in rows if r["salt"] is not None]
    return values[0] if values else None


def redact(
    root: str | Path,
    event_id: str,
    *,
    reason: str,
    actor: str,
    private_key: str | None,
    source: str | None = None,
) -> RedactionResult:
    """Erase event ``event_id``'s payload and salt from the ledger's files, as one commit that also
    appends its signed ``ledger.redaction`` record (see the module's doc)."""
    reason, actor = reason.strip(), actor.strip()
    if not reason or not actor:
        raise LedgerError("a redaction needs a --reason and an --actor (both non-empty)")
    if len(reason) > MAX_REASON_CHARS:
        raise LedgerError(f"--reason is {len(reason)} characters; at most {MAX_REASON_CHARS}")
    sealer = Sealer(private_key, chain=False) if private_key else None
    ledger = Ledger.open(root)
    made: dict[str, Any] = {}

    def prepare(locked: Ledger) -> tuple[Sequence[SourceRecord], LakeEdit]:
        stored = locked.lake
        assert stored is not None  # (``commit_rewrite`` refuses a published copy before it prepares)
        target = find_event(stored, event_id, source)  # under the lock: no redaction races it
        if is_redacted(target.canonical):
            raise LedgerError(
                f"event {event_id} is redacted already ({read_marker(target.canonical)['reason']})"
            )
        decoded = decode_event(target.canonical.encode())
        if not isinstance(decoded, Event):
            raise LedgerError(f"event {event_id}'s stored bytes do not decode; run `ledger verify`")
        if is_own(decoded.envelope):
            raise LedgerError(
                f"event {event_id} is the ledger's own record ({target.type}): it cannot be redacted"
            )
        salt = salt_of(stored, target.stream, target.stream_seq)
        canonical = target.canonical.encode()
        digest = entry_digest(canonical, salt)
        record, raw = _record(locked, target, canonical, digest, salt is not None, reason, actor, sealer)
        signed = json.loads(canonical)
        text = marker(record.id, reason, digest, salt is not None, signed)
        made.update(target=target, record=record.id, salted=salt is not None)
        return [SourceRecord(INCIDENT_INGEST, record.seq, raw)], lake_edit(stored, target, text)

    with ledger:  # (a DuckDB-file catalog is free for the next opener once it returns)
        result: CommitResult = ledger.commit_rewrite(prepare, writer="redact")
    assert result.commit is not None  # a refused record raised
    return RedactionResult(result.commit, made["record"], made["target"], result.erased_files, made["salted"])


def _record(
    ledger: Ledger,
    target: Target,
    canonical: bytes,
    digest: str,
    salted: bool,
    reason: str,
    actor: str,
    sealer: Sealer | None,
) -> tuple[Any, bytes]:
    """The ``ledger.redaction`` event (its envelope, and its bytes), at the next position of the
    ledger's own incident source, on the redacted event's stream (its run, attempt and step)."""
    position = ledger.positions().get(INCIDENT_INGEST, 0)
    payload = p.LedgerRedaction(
        event_id=target.id,
        event_source=target.source,
        event_type=target.type,
        stream=target.stream,
        stream_seq=target.stream_seq,
        leaf_sha256=leaf_hash(canonical).hex(),
        entry_sha256=digest,
        salted=salted,
        reason=reason,
        actor=actor,
    )
    envelope = make_event(
        payload,
        source=INCIDENT_INGEST,
        stream=target.stream,
        seq=position,
        run_id=target.run_id,
        attempt=target.attempt,
        step=target.step,
        subject=target.source,
        id=f"redaction-{uuid.uuid4().hex}",
        time=datetime.now(UTC),
    )
    if sealer is not None:
        envelope = sealer.seal(envelope)
    return envelope, encode_event(envelope)


# ------------------------------------------------------------------------------------------ the lake edit

# Events the fold of a run's config reads (runledger.ledger.projectors.FoldState): erasing one changes the
# rows the attempt's later changes project (each ``configs`` row is a whole config, the erased
# secret included), so those tables are projected again for the stream, without it.
_FOLD_INPUTS = frozenset({c.RUN_STARTED, c.RUN_RESUMED, c.CONFIG_CHANGED})
_FOLD_READS = (c.RUN_STARTED, c.RUN_RESUMED, c.CONFIG_CHANGED, c.CONFIG_REJECTED)
FOLD_TABLES = ("configs", "config_changes")


def _refold(stored: Stored, target: Target) -> dict[str, dict[int, dict[str, Any]]]:
    """The fold tables' rows of the target's stream, projected again from its events without it
    (and without events redacted before): table -> stream_seq -> row (its partition in ``_part``)."""
    events = _select(
        stored, "events", ["stream_seq", "canonical"], {"stream": target.stream, "type": list(_FOLD_READS)}
    )
    buf, fold = RowBuffer(), FoldState()
    for row in sorted(events, key=lambda r: r["stream_seq"]):
        seq, text = row["stream_seq"], row["canonical"]
        if seq == target.stream_seq or is_redacted(text):
            continue
        decoded = decode_event(text.encode())
        if isinstance(decoded, Event):
            rows_for_event(decoded, seq, buf, fold)
    out: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in FOLD_TABLES}
    for name, partition, data in buf.tables():
        if name in out:
            for row in data.to_pylist():
                out[name][row["stream_seq"]] = row | {"_part": partition}
    return out


def lake_edit(lake: LakeTables, target: Target, text: str) -> LakeEdit:
    """The redaction on a lake, as one transaction's changes: the target's ``events`` row deleted
    and added again marked, its rows in the other tables and its salt deleted, and for an event the
    fold reads every fold-table row of its stream replaced by its projection without it. Only tables
    holding such rows are touched (a delete conflicts with a concurrent writer's insert into the
    same table: fewer tables, fewer retries)."""
    edit = LakeEdit([], {})
    refold = _refold(lake, target) if target.type in _FOLD_INPUTS else None
    one = {"stream": target.stream, "stream_seq": target.stream_seq}
    for table in [n for n in (*TABLES, SALTS.name) if n != "quarantine"]:
        if "stream_seq" not in lake_schema(table).names:
            continue
        where = {"stream": target.stream} if refold is not None and table in FOLD_TABLES else one
        clause = " AND ".join(f"{column} = ?" for column in where)
        if table == "events":
            rows = _lake_rows(lake, table, clause, list(where.values()))
            column = rows.schema.get_field_index("canonical")
            marked = pa.array([text] * rows.num_rows, pa.string())
            edit.rows[table] = rows.set_column(column, rows.schema.field(column), marked)
        elif not _select(lake, table, ["stream_seq"], where):
            continue
        edit.statements.append((f"DELETE FROM {ALIAS}.{table} WHERE {clause}", list(where.values())))
    for table, rows_by_seq in (refold or {}).items():
        partition = TABLES[table].partition
        rows = [
            {k: v for k, v in row.items() if k != "_part"} | {partition: row["_part"] or "_"}
            for _, row in sorted(rows_by_seq.items())
        ]
        if rows:  # (the stream's stored rows were deleted above)
            edit.rows[table] = pa.Table.from_pylist(rows, schema=lake_schema(table))
    return edit


def _lake_rows(lake: LakeTables, table: str, clause: str, params: list[Any]) -> pa.Table:
    """Rows as the ledger writes them (DuckDB answers its timestamps in zone ``Etc/UTC``)."""
    with lake.reader() as con:
        rows = con.execute(f"SELECT * FROM {table} WHERE {clause}", params).to_arrow_table()
    return conform(rows, lake_schema(table))
