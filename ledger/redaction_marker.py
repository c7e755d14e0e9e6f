"""A redacted event's marker: the text that replaces its canonical bytes in the ``events`` table, and
the digest its public log entry carries. Only the standard library: a reader (``runledger.ledger.query``,
``runledger.ledger.views``) tells a marker from an event without importing the redaction's writer
(``runledger.ledger.redaction``, which re-exports these names; issue 41)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["REDACTED_PREFIX", "entry_digest", "entry_matches", "is_redacted", "marker", "read_marker"]

REDACTED_PREFIX = '{"redacted":'  # a real event's canonical JSON never starts so (its keys are fixed)


def is_redacted(canonical: str | None) -> bool:
    """Whether an ``events`` row's canonical column holds a redaction marker, not an event."""
    return canonical is not None and canonical.startswith(REDACTED_PREFIX)


def marker(record_id: str, reason: str, entry_sha256: str, salted: bool, signed: Any) -> str:
    """The text that replaces a redacted event's canonical bytes: which record erased it and why,
    and what its public log entry carries (so a publish after the redaction writes the same entry)."""
    body = {
        "record": record_id,
        "reason": reason,
        ("salted_sha256" if salted else "sha256"): entry_sha256,
        "key_id": signed.get("key_id"),
        "sig": signed.get("signature"),
    }
    return json.dumps({"redacted": body}, sort_keys=True, separators=(",", ":"))


def read_marker(canonical: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(canonical)["redacted"]
    return body


def entry_digest(canonical: bytes, salt: bytes | None) -> str:
    """The digest a public log entry carries for an event: salted when the event has a salt."""
    return hashlib.sha256((salt or b"") + canonical).hexdigest()


def entry_matches(entry: dict[str, Any], canonical: bytes, salt: bytes | None) -> bool:
    """Whether a published event entry commits to ``canonical`` (with its ``salt``, for an entry that
    carries ``salted_sha256``; an older entry carries the unsalted ``sha256``)."""
    if "salted_sha256" in entry:
        return salt is not None and entry_digest(canonical, salt) == entry["salted_sha256"]
    return entry_digest(canonical, None) == entry.get("sha256")
