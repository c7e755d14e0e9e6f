"""Encoding events for the bus and decoding (validating) them at the ledger's door.

``decode_event`` never raises on bad input: it returns a ``Quarantined`` with the raw bytes, the
reason and a short reason code, so an ingester can keep going and lose nothing.

Limits on what the door accepts, checked before anything is parsed:

* ``MAX_EVENT_BYTES`` (8 MiB): a longer record is quarantined as ``too-large`` without being parsed.
  Ingesters take ``max_event_bytes`` to change it (``Ledger.commit``, ``ingest_spool``,
  ``run_ingester``, ``replay``).
* ``MAX_DEPTH`` (64): arrays and objects nested deeper than 64 levels (the envelope object is level
  1, ``data`` level 2) are quarantined as ``too-deep``. JSON decoders and encoders recurse once per
  level, so without a bound a few kilobytes of ``[`` exhaust the interpreter's stack. The check
  costs two ``bytes.count`` calls for an ordinary event; only a record holding more than 64 ``[``
  and ``{`` in all is scanned (strings removed, then a running sum over the brackets left).
* integers in the envelope fit what the ledger stores (``runledger.schemas.envelope``).

JSON the door accepts as it is (the canonical bytes are computed from the decoded value): duplicate
object keys (the last one wins, as in the canonical bytes), ``-0.0``, numbers that underflow to 0.
Rejected: ``NaN``/``Infinity`` literals, numbers beyond float64 (``1e309``), a UTF-8 BOM, invalid
UTF-8, lone surrogate escapes, raw control characters in strings; each with msgspec's message.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from runledger.schemas.canonical import canonical_json_value
from runledger.schemas.catalogue import CATALOGUE, TYPE_OF_STRUCT, EventType
from runledger.schemas.envelope import (
    MAX_ATTRIBUTE_CHARS,
    SPECVERSION,
    Envelope,
    WireEnvelope,
    new_event_id,
    utc_now,
)

MAX_EVENT_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 64
MAX_REASON_CHARS = 2000

# Reason codes (``Quarantined.code``): what kind of rejection, for dead letters and dashboards.
EMPTY = "empty"  # no bytes, or only whitespace
TOMBSTONE = "tombstone"  # a Kafka record with a null value
TOO_LARGE = "too-large"  # longer than the maximum event size
TOO_DEEP = "too-deep"  # nested deeper than MAX_DEPTH
DECODE = "decode"  # not JSON
ENVELOPE = "envelope"  # JSON, but not a valid envelope
UNKNOWN_TYPE = "unknown-type"
UNKNOWN_VERSION = "unknown-version"
SCHEMA = "schema"  # the payload (or a rule across envelope and payload) fails validation
CORRUPT = "corrupt"  # the bus itself says the bytes are damaged
UNSTORABLE = "unstorable"  # valid, but the ledger could not turn it into rows (see Ledger.commit)
CONFLICT = "conflict"  # its (source, id) is already in the ledger with different bytes (Ledger.commit)
STREAM_RUN_MISMATCH = "stream-run-mismatch"  # names a run but lives on another stream (Ledger.commit)

_generic_decoder = msgspec.json.Decoder()
_wire_decoder = msgspec.json.Decoder(WireEnvelope)  # (only to say where bad JSON is: ``_undecodable``)
_payload_types: dict[tuple[str, int], type[msgspec.Struct]] = {
    (t.name, v): s for t in CATALOGUE.values() for v, s in t.versions.items()
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
    """Bytes the ledger keeps aside: the reason (a sentence) and ``code`` (one of the codes above).
    ``source``/``id``/``type``/``stream`` are the record's own attributes where they were readable."""

    raw: bytes
    reason: str
    source: str | None = None
    id: str | None = None
    type: str | None = None
    stream: str | None = None
    code: str = ""


def refused_event(env: Envelope, raw: bytes, code: str, reason: str) -> Quarantined:
    """A decoded event the ledger refuses (a conflict, a bad signature, …): its bytes, the reason and
    the event's own attributes."""
    return Quarantined(
        raw=raw, reason=reason, code=code, source=env.source, id=env.id, type=env.type, stream=env.stream
    )


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
    """Wrap a payload in an envelope; its type and schema version come from the catalogue.

    Raises ValueError for an event that names a run but not as its stream (``stream_run_mismatch``)."""
    mismatch = stream_run_mismatch(stream, run_id)
    if mismatch is not None:
        raise ValueError(mismatch)
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


def stream_run_mismatch(stream: str, run_id: str | None) -> str | None:
    """Why an event's ``stream`` and ``run_id`` disagree, or None when they agree.

    ``run_id`` is authoritative: an event that names a run lives on that run's stream (its Merkle
    tree), so the tree a leaf is in and the run's SQL partitions always hold the same events. An
    event without a run (GitHub events on ``owner/repo``, a run-less annotation) may use any stream."""
    if run_id is None or stream == run_id:
        return None
    return f"stream {stream[:200]!r} is not the stream of run {run_id!r} (a run's events live on stream = run_id)"


def encode_event(envelope: Envelope) -> bytes:
    """The JSON bytes that travel on the bus (CloudEvents structured mode)."""
    return _encoder.encode(envelope)


def decode_event(raw: bytes, *, max_bytes: int = MAX_EVENT_BYTES) -> Event | Quarantined:
    """Validate raw bytes into an ``Event``, or say exactly why not. Never raises on any input."""
    if type(raw) is not bytes:  # bytearray, memoryview: one form for every check below
        raw = bytes(raw)
    size = len(raw)
    if size == 0:
        return _quarantine(raw, "empty record", EMPTY)
    if size > max_bytes:
        return _quarantine(
            raw, f"record of {size} bytes exceeds the maximum event size of {max_bytes} bytes", TOO_LARGE
        )
    if too_deep(raw):
        return _quarantine(raw, f"nested deeper than {MAX_DEPTH} levels", TOO_DEEP)
    try:
        return _decode(raw)
    except RecursionError:  # belt: the depth check above should make this unreachable
        return _quarantine(raw, "nested too deeply to decode (RecursionError)", TOO_DEEP)
    except Exception as exc:  # belt: OverflowError, ValueError, ... from any layer
        return _quarantine(raw, f"undecodable: {type(exc).__name__}: {exc}", DECODE)


def _decode(raw: bytes) -> Event | Quarantined:
    # The JSON is parsed once, to generic values: the canonical bytes are encoded from them, and the
    # envelope and its payload are converted from them (the bytes were read three times: the typed
    # envelope, its typed payload, the generic value; 4,004 peer events 222-241 -> 178-182 ms).
    try:
        value = _generic_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        return _undecodable(raw, exc)
    try:
        wire = msgspec.convert(value, Envelope)
    except msgspec.ValidationError as exc:  # JSON all the same: say so, and keep what is readable
        return _envelope_rejected(raw, value, exc)
    refused = _envelope_refused(raw, wire)
    if refused is not None:
        return refused
    event_type = CATALOGUE[wire.type]
    try:
        payload = msgspec.convert(wire.data, _payload_types[(wire.type, wire.schema_version)])
    except msgspec.ValidationError as exc:
        return _quarantine(raw, f"data: {exc}".replace("`$", "`$.data", 1), SCHEMA, wire)
    payload = event_type.upcast(wire.schema_version, payload)
    if _needs_run_id(wire):
        return _quarantine(raw, f"{wire.type} needs run_id", SCHEMA, wire)
    envelope = msgspec.structs.replace(wire, data=payload)
    # Canonical bytes come from the generic JSON value as produced, not from the typed structs
    # (== canonicalize_json(raw) == canonical_bytes(the decoded value)).
    return Event(envelope=envelope, canonical=canonical_json_value(value))


def _undecodable(raw: bytes, exc: msgspec.DecodeError) -> Quarantined:
    """Why bytes are not JSON, said where the typed decoders find it: in the envelope, in the
    payload (``$.data.loss``: a schema error), or in a member no struct reads (the generic decoder's
    path names no field)."""
    if not raw.strip(b" \t\r\n"):
        return _quarantine(raw, "empty record (whitespace only)", EMPTY)
    try:
        wire = _wire_decoder.decode(raw)
    except msgspec.DecodeError as bad:  # (a ValidationError too: JSON up to the field that failed)
        return _quarantine(raw, f"envelope: {bad}", DECODE)
    refused = _envelope_refused(raw, wire)
    if refused is not None:
        return refused
    try:
        msgspec.json.decode(wire.data, type=_payload_types[(wire.type, wire.schema_version)])
    except msgspec.DecodeError as bad:
        return _quarantine(raw, f"data: {bad}".replace("`$", "`$.data", 1), SCHEMA, wire)
    if _needs_run_id(wire):
        return _quarantine(raw, f"{wire.type} needs run_id", SCHEMA, wire)
    return _quarantine(raw, f"json: {exc}", DECODE, wire)


def _needs_run_id(wire: Envelope | WireEnvelope) -> bool:
    """A runledger event (not an annotation) that names no run."""
    return wire.run_id is None and wire.type.startswith("runledger.") and wire.type != "runledger.annotation"


def _envelope_refused(raw: bytes, wire: Envelope | WireEnvelope) -> Quarantined | None:
    """Why a well-typed envelope is refused (its specversion, time, type or schema version), or None."""
    if wire.specversion != SPECVERSION:
        return _quarantine(raw, f"envelope: unsupported specversion {wire.specversion!r}", ENVELOPE, wire)
    if wire.time.tzinfo is None:
        return _quarantine(raw, "envelope: time has no UTC offset", ENVELOPE, wire)
    if wire.time.year in (1, 9999) and not _fits_utc(wire.time):
        return _quarantine(raw, "envelope: time is out of range once in UTC", ENVELOPE, wire)
    event_type: EventType | None = CATALOGUE.get(wire.type)
    if event_type is None:
        return _quarantine(raw, f"unknown event type {wire.type!r}", UNKNOWN_TYPE, wire)
    if (wire.type, wire.schema_version) not in _payload_types:
        known = sorted(event_type.versions)
        return _quarantine(
            raw,
            f"unknown schema_version {wire.schema_version} of {wire.type} (known: {known})",
            UNKNOWN_VERSION,
            wire,
        )
    return None


def nesting_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in JSON text (``{}`` is 1); brackets inside strings don't
    count. For malformed text, an upper bound of how deep a decoder gets before it gives up."""
    return _running_max(_structure(bytes(raw)))


def too_deep(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """``nesting_depth(raw) > limit``, cheaply: a record with at most ``limit`` openers is never
    scanned, and a shallow one with many openers is settled by stripping innermost pairs."""
    if len(raw) <= _COUNT_BELOW:  # two counts beat a translate on small records
        openers = raw.count(b"{")
        if b"[" in raw:
            openers += raw.count(b"[")
        if openers <= limit:
            return False
    marks = _structure(bytes(raw))
    if marks.count(b"{") <= limit:
        return False
    inner = marks
    for _ in range(limit):  # each pass strips every innermost "{}": balanced text empties in depth passes
        shorter = inner.replace(b"{}", b"")
        if not shorter:
            return False
        if len(shorter) == len(inner) or (len(inner) > 1024 and 4 * len(shorter) > 3 * len(inner)):
            break  # unbalanced, or a long narrow chain: the running sum is exact and quicker
        inner = shorter
    return _running_max(marks) > limit


_COUNT_BELOW = 4096
_OPEN_CLOSE = bytes.maketrans(b"[]", b"{}")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')


def _structure(text: bytes) -> bytes:
    """The text's brackets outside strings, as "{" and "}" (arrays and objects alike)."""
    if b"\\" in text:  # drop escapes, so that the quotes left are the strings' own
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only '"' and brackets stay. Dropping two adjacent quotes never changes which brackets lie
    # inside a string (the quotes before each bracket keep their parity), so most strings go here;
    # those with brackets inside go by taking every other piece between quotes.
    marks = text.translate(_OPEN_CLOSE, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in marks:
        marks = b"".join(marks.split(b'"')[::2])
    return marks


def _running_max(marks: bytes) -> int:
    """The deepest point of a sequence of "{" and "}": the maximum of its running sum."""
    if not marks:
        return 0
    import numpy as np  # here, not at the top: `import schemas` stays quick for the CLI and the client

    steps = 124 - np.frombuffer(marks, dtype=np.int8)  # "{" (123) -> +1, "}" (125) -> -1
    return max(0, int(np.cumsum(steps, dtype=np.int64).max()))


def _fits_utc(time: datetime) -> bool:
    try:
        time.astimezone(UTC)
    except OverflowError:
        return False
    return True


def _envelope_rejected(raw: bytes, value: Any, exc: msgspec.ValidationError) -> Quarantined:
    """JSON that is not an envelope: tell which field failed, and keep the record's
    ``id``/``source``/``type``/``stream`` when they are readable strings (for finding who sent it)."""
    attrs: dict[str, str] = {}
    if isinstance(value, dict):
        for name in ("source", "id", "type", "stream"):
            attr = value.get(name)
            if isinstance(attr, str) and 0 < len(attr) <= MAX_ATTRIBUTE_CHARS:
                attrs[name] = attr
    return _quarantine(raw, f"envelope: {exc}", ENVELOPE, None, **attrs)


def _quarantine(
    raw: bytes, reason: str, code: str, wire: Envelope | WireEnvelope | None = None, **attrs: str
) -> Quarantined:
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 1] + "…"
    if wire is not None:
        attrs = {"source": wire.source, "id": wire.id, "type": wire.type, "stream": wire.stream}
    return Quarantined(raw=raw, reason=reason, code=code, **attrs)


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
