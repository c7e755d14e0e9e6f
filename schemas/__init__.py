"""runledger's typed event catalogue: one envelope, one versioned payload type per event kind."""

from schemas.canonical import canonical_bytes, config_hash
from schemas.catalogue import CATALOGUE
from schemas.codec import Event, Quarantined, decode_event, encode_event, make_event
from schemas.envelope import Envelope

__all__ = [
    "CATALOGUE",
    "Envelope",
    "Event",
    "Quarantined",
    "canonical_bytes",
    "config_hash",
    "decode_event",
    "encode_event",
    "make_event",
]
