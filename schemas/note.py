"""C2SP signed-notes (Ed25519) and their note keys: the one key format of every producer and log.

A producer signs its events (``runledger.schemas.signing``) and the ledger signs its checkpoints
(``runledger.ledger.log_checkpoint``) with keys in this form, byte-compatible with Go's
golang.org/x/mod/sumdb/note and transparency-dev tooling.

Keys use note's text encodings:

* public (vkey):  ``<name>+<8 hex key hash>+<base64(0x01 ‖ public key)>``
* private (skey): ``PRIVATE+KEY+<name>+<8 hex key hash>+<base64(0x01 ‖ 32-byte seed)>``

``write_keypair`` writes a new pair as files, one key per line: ``<stem>.key`` (private, mode 0600)
and ``<stem>.pub``.

The key hash is SHA-256(key name ‖ 0x0A ‖ 0x01 ‖ 32-byte public key)[:4]; it lets a verifier pick
the right key when a note carries several signatures (e.g. witness cosignatures).

A signed note is its text (lines, each ending in a newline), a blank line, then one line per
signature::

    — <key name> <base64(4-byte key hash ‖ 64-byte Ed25519 signature)>\\n

The signature covers the text, its trailing newline included.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runledger.schemas.durable import write_durably

if TYPE_CHECKING:  # issue 41: cryptography (~50 ms) is imported by the functions that sign or check
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "ALG_ED25519",
    "SIGNATURE_SIZE",
    "CheckpointError",
    "NoteSigner",
    "NoteVerifier",
    "check_note_text",
    "decode_canonical_base64",
    "generate_keypair",
    "key_hash",
    "key_stem",
    "open_note",
    "parse_private_key",
    "parse_public_key",
    "public_key_of",
    "sign_note",
    "write_keypair",
]

ALG_ED25519 = 0x01
SIGNATURE_SIZE = 64
_SIG_PREFIX = "— "  # em dash U+2014 then a space
_MAX_NOTE_BYTES = 1 << 20  # checkpoints are tiny; refuse to parse megabytes of attacker input
_MAX_SIGNATURES = 100  # as in Go's note.Open


class CheckpointError(ValueError):
    """A checkpoint, note or key is malformed or does not verify. (One error for all three: the
    checkpoint functions of ``runledger.ledger.log_checkpoint`` raise it too, and callers catch it by this name.)"""


@dataclass(frozen=True)
class NoteVerifier:
    name: str
    key_hash: int
    public_key: Ed25519PublicKey

    def verify(self, message: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        if len(signature) != SIGNATURE_SIZE:
            return False
        try:
            self.public_key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True, repr=False)
class NoteSigner:
    name: str
    key_hash: int
    private_key: Ed25519PrivateKey

    def __repr__(self) -> str:
        # Never let a traceback or log line print key material.
        return f"NoteSigner(name={self.name!r}, key_hash={self.key_hash:08x})"


# --------------------------------------------------------------------------------------------------
# Keys


def _valid_key_name(name: str) -> bool:
    # As Go's note.isValidName, plus no control characters (they could never appear in a valid note).
    return bool(name) and "+" not in name and not any(c.isspace() or c < " " for c in name)


def decode_canonical_base64(text: str, what: str) -> bytes:
    """Standard base64 ``text``, decoded; CheckpointError (naming ``what``) unless it is valid and
    canonical."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise CheckpointError(f"{what} is not valid base64") from exc
    # Canonical encoding only: otherwise several texts would carry the same signed value.
    if base64.b64encode(raw).decode("ascii") != text:
        raise CheckpointError(f"{what} is not canonical base64")
    return raw


def key_hash(name: str, public_key: bytes) -> int:
    """note key hash: first 4 bytes (big-endian) of SHA-256(name ‖ '\\n' ‖ 0x01 ‖ public key)."""
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([ALG_ED25519]) + public_key).digest()
    return int.from_bytes(digest[:4], "big")


def _raw_public(key: Ed25519PublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _encode_vkey(name: str, public_key: bytes) -> str:
    blob = base64.b64encode(bytes([ALG_ED25519]) + public_key).decode()
    return f"{name}+{key_hash(name, public_key):08x}+{blob}"


def generate_keypair(name: str) -> tuple[str, str]:
    """Return (private_key_text, public_key_text) in note skey/vkey encoding for key ``name``."""
    if not _valid_key_name(name):
        raise CheckpointError(f"invalid key name {name!r}: must be non-empty, without spaces or '+'")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    seed = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    public = _raw_public(private.public_key())
    blob = base64.b64encode(bytes([ALG_ED25519]) + seed).decode()
    skey = f"PRIVATE+KEY+{name}+{key_hash(name, public):08x}+{blob}"
    return skey, _encode_vkey(name, public)


def write_keypair(directory: str | os.PathLike[str], name: str, stem: str | None = None) -> tuple[Path, Path]:
    """Generate a key pair and write ``<stem>.key`` (mode 0600) and ``<stem>.pub`` in ``directory``.

    Both are written with ``runledger.schemas.durable.write_durably(..., exclusive=True)``: the private file's
    temporary file is created with O_EXCL and mode 0o600 in a single open() (no window in which the
    key exists with wider permissions), and the finished file is linked into place only if no file
    of that name exists, so an existing key is never overwritten, nor a key left half written.
    ``stem`` defaults to the key name with unsafe filename characters replaced by '_' (``key_stem``).
    A missing ``directory`` is made with mode 0700. Returns (private_path, public_path).
    """
    skey, vkey = generate_keypair(name)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # a new key folder is its owner's alone
    stem = stem or key_stem(name)
    private_path = directory / f"{stem}.key"
    public_path = directory / f"{stem}.pub"
    if public_path.exists():
        raise FileExistsError(f"{public_path} already exists; refusing to overwrite a key")
    private_bytes, public_bytes = (skey + "\n").encode("ascii"), (vkey + "\n").encode("ascii")
    write_durably(private_path, private_bytes, mode=0o600, exclusive=True)
    write_durably(public_path, public_bytes, mode=0o644, exclusive=True)
    return private_path, public_path


def key_stem(name: str) -> str:
    """The file name (without ``.key``/``.pub``) ``write_keypair`` gives the key named ``name``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def public_key_of(signer: NoteSigner) -> str:
    """The vkey text of a private key's public half (what ``write_keypair`` puts in ``<stem>.pub``)."""
    return _encode_vkey(signer.name, _raw_public(signer.private_key.public_key()))


def parse_public_key(text: str) -> NoteVerifier:
    """Parse a vkey ``name+hash+base64(0x01 ‖ key)``; surrounding whitespace is ignored."""
    text = text.strip()
    parts = text.split("+", 2)  # the base64 part may itself contain '+'
    if len(parts) != 3:
        raise CheckpointError("malformed public key: want <name>+<hash>+<base64 key>")
    name, hash_hex, blob = parts
    if not _valid_key_name(name) or not re.fullmatch(r"[0-9a-f]{8}", hash_hex):
        raise CheckpointError("malformed public key: bad name or key hash")
    raw = decode_canonical_base64(blob, "public key")
    if len(raw) != 1 + 32 or raw[0] != ALG_ED25519:
        raise CheckpointError("public key is not an Ed25519 note key (0x01 ‖ 32 bytes)")
    if key_hash(name, raw[1:]) != int(hash_hex, 16):
        raise CheckpointError("public key hash does not match its name and key")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    return NoteVerifier(name, int(hash_hex, 16), Ed25519PublicKey.from_public_bytes(raw[1:]))


def parse_private_key(text: str) -> NoteSigner:
    """Parse an skey ``PRIVATE+KEY+name+hash+base64(0x01 ‖ seed)``."""
    parts = text.strip().split("+", 4)
    if len(parts) != 5 or parts[0] != "PRIVATE" or parts[1] != "KEY":
        raise CheckpointError("malformed private key: want PRIVATE+KEY+<name>+<hash>+<base64 seed>")
    _, _, name, hash_hex, blob = parts
    if not _valid_key_name(name) or not re.fullmatch(r"[0-9a-f]{8}", hash_hex):
        raise CheckpointError("malformed private key: bad name or key hash")
    raw = decode_canonical_base64(blob, "private key")
    if len(raw) != 1 + 32 or raw[0] != ALG_ED25519:
        raise CheckpointError("private key is not an Ed25519 note key (0x01 ‖ 32-byte seed)")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.from_private_bytes(raw[1:])
    # The hash names the public key; recompute it so a mislabelled key cannot sign under a wrong id.
    if key_hash(name, _raw_public(private.public_key())) != int(hash_hex, 16):
        raise CheckpointError("private key hash does not match its name and derived public key")
    return NoteSigner(name, int(hash_hex, 16), private)


# --------------------------------------------------------------------------------------------------
# Signed notes


def check_note_text(text: str, what: str) -> None:
    """CheckpointError (naming ``what``) if ``text`` holds a control character other than newline,
    or is not valid UTF-8 (lone surrogates)."""
    if any(c < " " and c != "\n" for c in text):
        raise CheckpointError(f"{what} contains control characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates
        raise CheckpointError(f"{what} is not valid UTF-8") from exc


def sign_note(text: str, private_key: str | NoteSigner) -> str:
    """Sign ``text`` (which must end with a newline) and return the note with one signature line."""
    signer = private_key if isinstance(private_key, NoteSigner) else parse_private_key(private_key)
    if not text.endswith("\n") or "\n\n" in text:
        raise CheckpointError("note text must end with a newline and contain no blank lines")
    check_note_text(text, "note text")
    signature = signer.private_key.sign(text.encode())
    blob = base64.b64encode(signer.key_hash.to_bytes(4, "big") + signature).decode()
    return f"{text}\n{_SIG_PREFIX}{signer.name} {blob}\n"


def open_note(note: str | bytes, public_key: str | NoteVerifier) -> str:
    """Verify a signed note against one key and return its text (body).

    As in Go's note.Open: signatures by other keys (name or key hash differ) are ignored, a
    signature claiming our key that does not verify is an error, and at least one must verify.
    """
    verifier = public_key if isinstance(public_key, NoteVerifier) else parse_public_key(public_key)
    if isinstance(note, bytes):
        if len(note) > _MAX_NOTE_BYTES:
            raise CheckpointError("note is too large")
        try:
            note = note.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError("note is not valid UTF-8") from exc
    if len(note) > _MAX_NOTE_BYTES:
        raise CheckpointError("note is too large")
    check_note_text(note, "note")
    split = note.rfind("\n\n")
    if split < 0:
        raise CheckpointError("malformed note: no blank line before the signatures")
    text, sigs = note[: split + 1], note[split + 2 :]
    if not sigs or not sigs.endswith("\n"):
        raise CheckpointError("malformed note: signature block must end with a newline")
    lines = sigs[:-1].split("\n")
    if len(lines) > _MAX_SIGNATURES:
        raise CheckpointError("malformed note: too many signatures")
    verified = False
    for line in lines:
        if not line.startswith(_SIG_PREFIX):
            raise CheckpointError("malformed note: signature line does not start with '— '")
        name, sep, blob = line[len(_SIG_PREFIX) :].partition(" ")
        if not sep or not _valid_key_name(name) or not blob:
            raise CheckpointError("malformed note: bad signature line")
        raw = decode_canonical_base64(blob, "signature")
        if len(raw) < 5:
            raise CheckpointError("malformed note: signature too short")
        if name != verifier.name or int.from_bytes(raw[:4], "big") != verifier.key_hash:
            continue  # someone else's signature (a witness, an old key): not ours to judge
        if len(raw) - 4 != SIGNATURE_SIZE:
            raise CheckpointError(
                f"signature by {name} has {len(raw) - 4} bytes, an Ed25519 signature has {SIGNATURE_SIZE}"
            )
        if not verifier.verify(text.encode(), raw[4:]):
            raise CheckpointError(f"invalid signature for key {name}+{verifier.key_hash:08x}")
        verified = True
    if not verified:
        raise CheckpointError(f"no signature by key {verifier.name}+{verifier.key_hash:08x}")
    return text
