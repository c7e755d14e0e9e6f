"""Canonical bytes: the one byte form of a JSON value that hashes, Merkle leaves and config hashes use.

Defined once and kept stable across runledger versions:
  * the value is the event as JSON (after decoding any producer's encoding to plain JSON values);
  * object keys sorted by their UTF-8 bytes, no insignificant whitespace, UTF-8 output;
  * integers in decimal, floats in the shortest form that round-trips a float64 (msgspec's encoder);
  * non-finite floats do not exist in JSON and are encoded as ``null``.
Because it is computed from the generic JSON value, not from runledger's typed structs, adding a
field with a default to a payload type never changes the canonical bytes of events already stored.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder()


def canonical_bytes(value: Any) -> bytes:
    """Canonical JSON bytes of a JSON-like value (dicts, lists, str, int, float, bool, None, Structs)."""
    # Structs are first turned into builtins so that their key order is sorted too.
    return _encoder.encode(msgspec.to_builtins(value))


def canonicalize_json(raw: bytes) -> bytes:
    """Re-encode arbitrary JSON bytes canonically (raises msgspec.DecodeError on non-JSON)."""
    return canonical_json_value(_decoder.decode(raw))


def canonical_json_value(value: Any) -> bytes:
    """Canonical bytes of a value as a generic JSON decode gives it (dicts, lists, str, int, float,
    bool, None): ``canonical_bytes`` without its ``to_builtins`` pass."""
    return _encoder.encode(value)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_hash(config: Any) -> str:
    """The hash that names a resolved config: SHA-256 of its canonical bytes, hex."""
    return sha256_hex(canonical_bytes(config))
