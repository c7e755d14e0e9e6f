"""Signed tree heads as C2SP tlog-checkpoint bodies inside C2SP signed-notes (Ed25519).

Wire format (byte-compatible with Go's golang.org/x/mod/sumdb/note and transparency-dev tooling)::

    <origin>\\n
    <tree size, decimal>\\n
    <base64 root hash>\\n
    \\n
    — <key name> <base64(4-byte key hash ‖ 64-byte Ed25519 signature)>\\n

The signature covers the body (the first three lines, trailing newline included). The signed-note
format, its keys, key hashes and key files are ``runledger.schemas.note``'s (producers sign their events with
the same keys); this module adds the checkpoint body.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass

from runledger.schemas.note import (
    CheckpointError,
    NoteSigner,
    NoteVerifier,
    check_note_text,
    decode_canonical_base64,
    open_note,
    sign_note,
)

__all__ = [
    "Checkpoint",
    "format_checkpoint",
    "note_signers",
    "parse_and_verify_checkpoint",
    "parse_checkpoint",
    "sign_checkpoint",
]

HASH_SIZE = 32
_DECIMAL = re.compile(r"0|[1-9][0-9]*")  # canonical: no sign, no leading zeros


@dataclass(frozen=True)
class Checkpoint:
    """A verified (or to-be-signed) tree head: which log, how many leaves, which root."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------------
# Checkpoints


def format_checkpoint(origin: str, size: int, root: bytes, extensions: tuple[str, ...] = ()) -> str:
    """The unsigned checkpoint body: origin, size and base64 root, one per line, then extensions."""
    if not origin or "\n" in origin:
        raise CheckpointError("origin must be a non-empty single line")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 64:
        raise CheckpointError(f"tree size must be an integer in [0, 2^64), got {size!r}")
    if not isinstance(root, bytes) or len(root) != HASH_SIZE:
        raise CheckpointError(f"root hash must be {HASH_SIZE} bytes")
    for ext in extensions:
        if not ext or "\n" in ext:
            raise CheckpointError("extension lines must be non-empty single lines")
    lines = [origin, str(size), base64.b64encode(root).decode(), *extensions]
    body = "".join(line + "\n" for line in lines)
    check_note_text(body, "checkpoint")
    return body


def sign_checkpoint(
    origin: str, size: int, root: bytes, private_key: str | NoteSigner, extensions: tuple[str, ...] = ()
) -> str:
    """Return the signed checkpoint note text for (origin, size, root)."""
    return sign_note(format_checkpoint(origin, size, root, extensions), private_key)


def parse_checkpoint(body: str) -> Checkpoint:
    """Parse an (already verified) checkpoint body; strict, so one tree head has one encoding."""
    if not body.endswith("\n"):
        raise CheckpointError("checkpoint body must end with a newline")
    lines = body[:-1].split("\n")
    if len(lines) < 3:
        raise CheckpointError("checkpoint body needs origin, size and root hash lines")
    origin, size_text, root_text, *extensions = lines
    if not origin:
        raise CheckpointError("checkpoint origin line is empty")
    if not _DECIMAL.fullmatch(size_text):
        raise CheckpointError(f"checkpoint size {size_text!r} is not a canonical decimal number")
    size = int(size_text)
    if size >= 1 << 64:
        raise CheckpointError("checkpoint size does not fit in 64 bits")
    root = decode_canonical_base64(root_text, "checkpoint root hash")
    if len(root) != HASH_SIZE:
        raise CheckpointError(f"checkpoint root hash has {len(root)} bytes, want {HASH_SIZE}")
    if any(not ext for ext in extensions):
        raise CheckpointError("checkpoint has an empty extension line")
    return Checkpoint(origin, size, root, tuple(extensions))


def parse_and_verify_checkpoint(
    text: str | bytes, public_key: str | NoteVerifier, origin: str | None = None
) -> Checkpoint:
    """Verify the signature on a checkpoint note and parse it.

    ``origin``, when given, must equal the checkpoint's origin line; always pass it when you know
    which log you expect, so that a validly signed head of another log is not accepted.
    Raises CheckpointError.
    """
    checkpoint = parse_checkpoint(open_note(text, public_key))
    if origin is not None and checkpoint.origin != origin:
        raise CheckpointError(f"checkpoint origin {checkpoint.origin!r} is not the expected {origin!r}")
    return checkpoint


def note_signers(text: str) -> list[str]:
    """The key ids (``<name>+<8 hex key hash>``) a signed note's signature lines claim, unverified:
    which key to check it with, and what to name when none of the keys at hand is one of them."""
    split = text.rfind("\n\n")
    signers = []
    for line in text[split + 2 :].splitlines() if split >= 0 else []:
        name, _, blob = line.removeprefix("— ").partition(" ")
        try:
            raw = base64.b64decode(blob, validate=True)
        except ValueError:
            continue
        if len(raw) >= 4 and name and line.startswith("— "):
            signers.append(f"{name}+{int.from_bytes(raw[:4], 'big'):08x}")
    return signers
