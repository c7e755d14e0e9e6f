"""runledger's typed event catalogue: one envelope, one versioned payload type per event kind."""

from runledger.schemas.canonical import canonical_bytes, config_hash
from runledger.schemas.catalogue import CATALOGUE
from runledger.schemas.codec import Event, Quarantined, decode_event, encode_event, make_event
from runledger.schemas.envelope import Envelope

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
