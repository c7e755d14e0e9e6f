"""The producer registry as a ledger keeps it: registry and policy events written into the log
(``ledger producers add|rotate|revoke|policy``), read back (``ledger producers list``), and carried
across a replay (``ledger producers export``, ``ledger kafka replay --registry``).

What the registry *means* at ingest, and the state it is folded into, is ``runledger.ledger.admission``'s; this
module writes through the store (``Ledger.commit``), so it sits above both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from runledger.ledger.admission import (
    INCIDENT_INGEST,
    REGISTRY_INGEST,
    REGISTRY_STREAM,
    REGISTRY_TYPES,
    AdmissionState,
    ProducerKey,
    load_state,
)
from runledger.ledger.store import Ledger, LedgerError, SourceRecord
from runledger.schemas import payloads as p
from runledger.schemas.codec import Event, decode_event, encode_event, make_event
from runledger.schemas.note import parse_public_key
from runledger.schemas.signing import key_id_of

# ---------------------------------------------------------------------------------- registry writes


def append_registry_event(ledger: Ledger, payload: msgspec.Struct) -> str:
    """Append one registry or policy event to the ledger (the ledger's own record); its event id."""
    position = ledger.positions().get(REGISTRY_INGEST, 0)
    envelope = make_event(payload, source=REGISTRY_INGEST, stream=REGISTRY_STREAM, seq=position)
    result = ledger.commit(
        [SourceRecord(REGISTRY_INGEST, position, encode_event(envelope))], writer="producers"
    )
    if result.accepted != 1:
        if not result.quarantined:
            raise RegistryRaced("registry event not stored: another writer took its position")
        reasons = "; ".join(q.reason for _, q in result.quarantined)
        raise LedgerError(f"registry event not stored: {reasons}")
    return envelope.id


class RegistryRaced(LedgerError):
    """Another writer of the ledger (a folder on another host) stored a registry event at the
    position this one was written for, first: nothing of this one was stored."""


def register_producer(
    ledger: Ledger, name: str, public_key: str, scope: p.ProducerScope, *, actor: str | None = None
) -> str:
    """Register a producer key (note vkey text) with its scope; its key id."""
    verifier = parse_public_key(public_key)  # a malformed key is refused before anything is written
    key_id = key_id_of(verifier)
    payload = p.ProducerRegistered(
        name=name, public_key=public_key.strip(), key_id=key_id, scope=scope, actor=actor
    )
    append_registry_event(ledger, payload)
    return key_id


def producers(ledger: Ledger) -> AdmissionState:
    """The registry as of the ledger's last commit (for ``ledger producers list``)."""
    return load_state(ledger)


def describe(key: ProducerKey) -> dict[str, Any]:
    scope = json.loads(msgspec.json.encode(key.scope))
    return {
        "key_id": key.key_id,
        "name": key.name,
        "revoked": key.revoked,
        **scope,
        "public_key": key.public_key,
    }


# ---------------------------------------------------------------------------------- keeping it across replay


@dataclass(frozen=True)
class RegistryEntry:
    """One registry or policy event as a replay must put it back: its bytes, its position in
    ``REGISTRY_INGEST`` and where every other source stood when it was committed (``after``: next
    positions), so the rebuilt ledger admits every record under the same registry as the live one."""

    position: int
    raw: bytes
    after: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "after": self.after, "event": self.raw.decode()}


def registry_entries(ledger: Ledger) -> list[RegistryEntry]:
    """The ledger's registry and policy events, in log order, with the positions they came at."""
    from runledger.ledger.query import (
        Reader,  # (runledger.ledger.query reads through the store: imported when used)
    )

    # Through the one reader, so a lake (its rows in the catalog's files) and part files read alike.
    reader = Reader(ledger.root)
    try:
        rows = reader.sql(
            'SELECT "commit", ingest_position, canonical FROM events WHERE ingest_source = ?',
            [REGISTRY_INGEST],
        ).rows
    finally:
        reader.close()
    # Each entry carries where every other source stood at its commit (from the commit record).
    entries = []
    for commit, position, text in sorted(rows):
        positions = _commit_record(ledger, commit)["positions"]
        after = {s: n for s, n in positions.items() if s not in (REGISTRY_INGEST, INCIDENT_INGEST)}
        entries.append(RegistryEntry(position, text.encode(), after))
    return entries


def _commit_record(ledger: Ledger, commit: int) -> dict[str, Any]:
    """Commit ``commit``'s record; on a lake, a commit another host made since this folder last
    copied the lake's records is copied first (once)."""
    try:
        return ledger.read_commit(commit)
    except FileNotFoundError:
        if ledger.lake is None:
            raise
    ledger.sync_lake_records()
    return ledger.read_commit(commit)


def write_registry_file(entries: Iterable[RegistryEntry], path: Path) -> int:
    """Save the registry (``ledger producers export``): JSON lines, one entry each; how many."""
    lines = [json.dumps(entry.to_json(), sort_keys=True) for entry in entries]
    path.write_text("".join(line + "\n" for line in lines))
    return len(lines)


def read_registry(path: Path) -> list[RegistryEntry]:
    """The registry entries kept in a ledger directory or a file ``write_registry_file`` wrote.
    Raises ValueError naming the line for a file that is not one; each event is checked again by
    admission when committed (only the ledger's own registry source may carry them)."""
    if path.is_dir():
        return registry_entries(Ledger.open(path))
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            entry = RegistryEntry(
                int(obj["position"]),
                str(obj["event"]).encode(),
                {str(s): int(n) for s, n in dict(obj["after"]).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ValueError(f"{path}:{number}: not a registry entry ({type(exc).__name__}: {exc})") from None
        decoded = decode_event(entry.raw)
        if not isinstance(decoded, Event) or decoded.envelope.type not in REGISTRY_TYPES:
            raise ValueError(f"{path}:{number}: not a registry or policy event")
        entries.append(entry)
    return sorted(entries, key=lambda e: e.position)
