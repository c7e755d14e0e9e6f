"""Encoding events for the bus and decoding (validating) them at the ledger's door.

``decode_event`` never raises on bad input: it returns a ``Quarantined`` with the raw bytes and the
reason, so an ingester can keep going and lose nothing.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import msgspec

from runledger.schemas.canonical import canonical_bytes
from runledger.schemas.catalogue import CATALOGUE, TYPE_OF_STRUCT, EventType
from runledger.schemas.envelope import SPECVERSION, Envelope, WireEnvelope, new_event_id, utc_now

_wire_decoder = msgspec.json.Decoder(WireEnvelope)
_generic_decoder = msgspec.json.Decoder()
_payload_decoders: dict[tuple[str, int], msgspec.json.Decoder] = {
    (t.name, v): msgspec.json.Decoder(s) for t in CATALOGUE.values() for v, s in t.versions.items()
}
_encoder = msgspec.json.Encoder()


class Event(msgspec.Struct, frozen=True):
    """A valid event: the envelope with its payload upcast to the newest version, and its canonical bytes."""

    envelope: Envelope
    canonical: bytes

    @property
    def payload(self) -> msgspec.Struct:
        return self.envelope.data


class Quarantined(msgspec.Struct, frozen=True):
    raw: bytes
    reason: str
    source: str | None = None
    id: str | None = None
    type: str | None = None
    stream: str | None = None


def make_event(
    payload: msgspec.Struct,
    *,
    source: str,
    stream: str,
    seq: int,
    run_id: str | None = None,
    attempt: int | None = None,
    step: int | None = None,
    subject: str | None = None,
    type: str | None = None,
    id: str | None = None,
    time: datetime | None = None,
) -> Envelope:
    """Wrap a payload in an envelope; its type and schema version come from the catalogue."""
    type_name = type or TYPE_OF_STRUCT[payload.__class__]
    event_type = CATALOGUE[type_name]
    return Envelope(
        specversion=SPECVERSION,
        id=id or new_event_id(),
        source=source,
        type=type_name,
        time=time or utc_now(),
        subject=subject,
        stream=stream,
        run_id=run_id,
        attempt=attempt,
        step=step,
        seq=seq,
        schema_version=event_type.latest,
        data=payload,
    )


def encode_event(envelope: Envelope) -> bytes:
    """The JSON bytes that travel on the bus (CloudEvents structured mode)."""
    return _encoder.encode(envelope)


def decode_event(raw: bytes) -> Event | Quarantined:
    """Validate raw bytes into an ``Event``, or say exactly why not."""
    try:
        wire = _wire_decoder.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError subclass
        return _quarantine(raw, f"envelope: {exc}")
    if wire.specversion != SPECVERSION:
        return _quarantine(raw, f"envelope: unsupported specversion {wire.specversion!r}", wire)
    if wire.time.tzinfo is None:
        return _quarantine(raw, "envelope: time has no UTC offset", wire)
    event_type: EventType | None = CATALOGUE.get(wire.type)
    if event_type is None:
        return _quarantine(raw, f"unknown event type {wire.type!r}", wire)
    decoder = _payload_decoders.get((wire.type, wire.schema_version))
    if decoder is None:
        known = sorted(event_type.versions)
        return _quarantine(
            raw, f"unknown schema_version {wire.schema_version} of {wire.type} (known: {known})", wire
        )
    try:
        payload = decoder.decode(wire.data)
    except msgspec.DecodeError as exc:
        return _quarantine(raw, f"data: {exc}".replace("`$", "`$.data", 1), wire)
    payload = event_type.upcast(wire.schema_version, payload)
    if wire.run_id is None and wire.type.startswith("runledger.") and wire.type != "runledger.annotation":
        return _quarantine(raw, f"{wire.type} needs run_id", wire)
    envelope = Envelope(**(msgspec.structs.asdict(wire) | {"data": payload}))
    # Canonical bytes come from the generic JSON value as produced, not from the typed structs.
    canonical = canonical_bytes(_generic_decoder.decode(raw))
    return Event(envelope=envelope, canonical=canonical)


def _quarantine(raw: bytes, reason: str, wire: WireEnvelope | None = None) -> Quarantined:
    if wire is None:
        return Quarantined(raw=raw, reason=reason)
    return Quarantined(
        raw=raw, reason=reason, source=wire.source, id=wire.id, type=wire.type, stream=wire.stream
    )


def export_json_schemas(directory: Path) -> list[Path]:
    """Write one JSON Schema per event type and version (envelope included) for other languages."""
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for event_type in CATALOGUE.values():
        for version, struct in event_type.versions.items():
            envelope_schema = msgspec.json.schema(Envelope)
            payload_schema = msgspec.json.schema(struct)
            schema = {
                "$schema": "https://json-schema.org/draft/2020-12/schema",
                "title": f"{event_type.name} v{version}",
                "description": event_type.doc,
                "allOf": [envelope_schema],
                "properties": {
                    "type": {"const": event_type.name},
                    "schema_version": {"const": version},
                    "data": payload_schema,
                },
            }
            path = directory / f"{event_type.name}.v{version}.json"
            path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
            written.append(path)
    return written
