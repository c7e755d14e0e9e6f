"""Producer signatures and per-source hash chains on events.

A producer (a training rank, the webhook receiver, an importer) holds an Ed25519 key in the note-key
form of ``runledger.schemas.note`` (``write_keypair`` makes one; ``<stem>.key`` is private, ``<stem>.pub``
public). A ``Sealer`` sets, on each envelope before it goes on the bus:

* ``prev``: the hash of the previous event this sealer sealed for the same ``source`` (``GENESIS``
  for the first), when the sealer keeps chains (``chain=True``; producers whose ``seq`` is not a
  per-source counter, such as GitHub events with ``seq`` 0, seal without one);
* ``key_id`` and ``signature``: Ed25519 over the *signing bytes*, the event's canonical bytes
  without its ``signature`` member (``key_id``, ``prev`` and ``attested`` are signed too).

The hash of an event is its Merkle leaf hash, SHA-256(0x00 ‖ canonical bytes), hex: the same value
that names the event in the ledger's tree. Verification needs only the canonical bytes and the
public key (``verify_canonical``), so the stand-alone verifier and the ledger's admission share it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import msgspec

from runledger.schemas.canonical import canonical_bytes
from runledger.schemas.envelope import Envelope
from runledger.schemas.note import NoteSigner, NoteVerifier, parse_private_key, parse_public_key

PRODUCER_KEY_ENV = "RUNLEDGER_PRODUCER_KEY"  # path of a producer's private key file
GENESIS = "0" * 64  # ``prev`` of a source's first event
HMAC_CHECKED = "github-hmac-sha256"  # ``attested``: the receiver verified GitHub's X-Hub-Signature-256


def key_id_of(key: NoteSigner | NoteVerifier) -> str:
    """``<name>+<8 hex key hash>``: the name and hash parts of the key's note-key text."""
    return f"{key.name}+{key.key_hash:08x}"


def event_hash(canonical: bytes) -> str:
    """An event's hash for ``prev``: its Merkle leaf hash, SHA-256(0x00 ‖ canonical bytes), hex."""
    return hashlib.sha256(b"\x00" + canonical).hexdigest()


def signing_bytes(value: dict[str, Any]) -> bytes:
    """The bytes a producer signs: the event's canonical bytes without its ``signature`` member."""
    return canonical_bytes({k: v for k, v in value.items() if k != "signature"})


class Sealer:
    """Signs (and chains) a producer's envelopes with its private key. Thread-safe: one lock keeps
    each source's chain in the order its events are sealed, which must be the order they are sent."""

    def __init__(
        self, private_key: NoteSigner | str, *, chain: bool = True, attested: str | None = None
    ) -> None:
        self.signer = private_key if isinstance(private_key, NoteSigner) else parse_private_key(private_key)
        self.key_id = key_id_of(self.signer)
        self.chain = chain
        self.attested = attested  # set on every envelope sealed: what this producer checked first
        # source -> (id of the last event sealed, the prev it was given, its hash)
        self._last: dict[str, tuple[str, str, str]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never print key material
        return f"Sealer(key_id={self.key_id!r}, chain={self.chain})"

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, chain: bool = True, attested: str | None = None
    ) -> Sealer:
        return cls(Path(path).read_text(), chain=chain, attested=attested)

    @classmethod
    def from_env(cls, *, chain: bool = True, attested: str | None = None) -> Sealer | None:
        """The sealer of the key file named by ``RUNLEDGER_PRODUCER_KEY``, or None when unset."""
        path = os.environ.get(PRODUCER_KEY_ENV)
        return cls.from_file(path, chain=chain, attested=attested) if path else None

    def seal(self, envelope: Envelope) -> Envelope:
        """The envelope with ``key_id``, ``prev`` (when chaining), ``attested`` and ``signature``."""
        with self._lock:
            changes: dict[str, Any] = {"key_id": self.key_id, "signature": None}
            if self.attested is not None:
                changes["attested"] = self.attested
            last = self._last.get(envelope.source)
            if self.chain:
                # Sealing the last event again (a sink's retry) keeps its place in the chain.
                again = last is not None and last[0] == envelope.id
                changes["prev"] = last[1] if again else (last[2] if last else GENESIS)  # type: ignore[index]
            unsigned = msgspec.structs.replace(envelope, **changes)
            value = msgspec.to_builtins(unsigned)
            signature = self.signer.private_key.sign(signing_bytes(value))
            value["signature"] = base64.b64encode(signature).decode()
            if self.chain:
                self._last[envelope.source] = (
                    envelope.id,
                    changes["prev"],
                    event_hash(canonical_bytes(value)),
                )
            return msgspec.structs.replace(unsigned, signature=value["signature"])


class SignatureError(ValueError):
    """An event's producer signature is missing, malformed, or does not verify."""


class _Signed(msgspec.Struct):
    """The two members of a signed event that verification reads."""

    key_id: str | None = None
    signature: str | None = None


_signed_decoder = msgspec.json.Decoder(_Signed)


def verify_canonical(canonical: bytes, public_key: NoteVerifier | str) -> str:
    """Check the producer signature of an event given its canonical bytes (a leaf's content);
    returns the key id. The signing bytes are read as the stand-alone verifier reads them
    (``runledger.ledger.verifier.producer_signing_bytes``: the leaf without its one
    ``"signature":"…",`` member), with msgspec in place of the standard library's json for speed."""
    key = public_key if isinstance(public_key, NoteVerifier) else parse_public_key(public_key)
    try:
        signed = _signed_decoder.decode(canonical)
    except msgspec.DecodeError as exc:
        raise SignatureError(f"leaf is not an event: {exc}") from exc
    if signed.signature is None or signed.key_id is None:
        raise SignatureError("event is unsigned (no key_id and signature)")
    if signed.key_id != key_id_of(key):
        raise SignatureError(f"signed by {signed.key_id}, not by {key_id_of(key)}")
    member = b'"signature":"' + signed.signature.encode() + b'",'
    if len(signed.signature) != 88 or canonical.count(member) != 1:
        raise SignatureError("event signature is malformed, missing or ambiguous in the leaf bytes")
    try:
        raw = base64.b64decode(signed.signature, validate=True)
    except ValueError as exc:
        raise SignatureError(f"signature is not base64: {exc}") from exc
    if not key.verify(canonical.replace(member, b"", 1), raw):
        raise SignatureError(f"bad signature for key {signed.key_id}")
    return signed.key_id


__all__ = [
    "GENESIS",
    "HMAC_CHECKED",
    "PRODUCER_KEY_ENV",
    "Sealer",
    "SignatureError",
    "event_hash",
    "key_id_of",
    "signing_bytes",
    "verify_canonical",
]
