"""The one envelope every event travels in: CloudEvents 1.0 attributes plus runledger's extensions.

CloudEvents attributes: ``id``, ``source``, ``specversion``, ``type``, ``time``, ``subject``,
``datacontenttype``. Extensions (lower-case alphanumerics, as CloudEvents requires of extension names
when they travel as Kafka headers): ``stream``, ``runid``-style names are avoided for readability in
JSON, so the structured JSON form carries them as plain members:

  stream          the total-order key: the run id for trainer events, ``owner/repo`` for GitHub events
  run_id          the run the event belongs to (None for repository events)
  attempt         the attempt (launch) of the run, 1-based; a resume starts a new attempt
  step            the training step the event refers to, or None
  seq             the producer's own sequence number (per ``source``), 0-based, gap-free per source
  schema_version  the version of the payload type named by ``type``

Producer identity and order (all optional, so events written before them still decode):

  key_id          the producer key that signed the event: ``<key name>+<8 hex key hash>`` (the
                  note-key form of ``runledger.schemas.note``)
  signature       base64 Ed25519 signature over the event's signing bytes: its canonical bytes
                  without the ``signature`` member (``runledger.schemas.signing``)
  prev            hex hash (the Merkle leaf hash) of the previous event of the same ``source``;
                  ``GENESIS`` (64 zeros) for a source's first; None: the producer keeps no chain
  attested        what the signer checked before signing, e.g. ``github-hmac-sha256`` (the
                  webhook receiver verified GitHub's HMAC on the delivery)

(``source``, ``id``) is unique: a second event with the same pair is a duplicate and is dropped.

Every integer attribute is bounded to what the ledger stores (Parquet int64; ``schema_version`` int32),
so a decoded envelope always fits its row: an out-of-range number is a validation error at the door,
never an overflow inside a commit. The limits on the raw bytes themselves (size, nesting depth) are in
``runledger.schemas.codec``.
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any

import msgspec

SPECVERSION = "1.0"

RunId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_ATTRIBUTE_CHARS = 1024  # id, source, type, stream

NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ATTRIBUTE_CHARS)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
SchemaVersion = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]


class Envelope(msgspec.Struct, kw_only=True, frozen=True):
    """An event as it travels on the bus. ``data`` is the payload (a typed Struct once decoded)."""

    specversion: str = SPECVERSION
    id: NonEmpty
    source: NonEmpty
    type: NonEmpty
    time: datetime
    subject: str | None = None
    datacontenttype: str = "application/json"
    stream: NonEmpty
    run_id: RunId | None = None
    attempt: Positive | None = None
    step: NonNegative | None = None
    seq: NonNegative
    schema_version: SchemaVersion
    key_id: NonEmpty | None = None
    signature: NonEmpty | None = None
    prev: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")] | None = None
    attested: NonEmpty | None = None
    data: Any = None


class WireEnvelope(Envelope, frozen=True):
    """The envelope as first decoded: the payload left as raw JSON until its type is known."""

    data: msgspec.Raw = msgspec.Raw(b"null")


def utc_now() -> datetime:
    return datetime.now(UTC)


def new_event_id() -> str:
    # Time-ordered prefix keeps ids roughly sortable; the random part keeps them unique.
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%f')}-{uuid.UUID(bytes=os.urandom(16)).hex[:16]}"
