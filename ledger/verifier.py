"""Stand-alone verifier for runledger proofs and signed checkpoints.

This file depends only on the Python standard library and ``cryptography`` (for Ed25519), so a third
party can copy it alone and check what a runledger operator hands out, without trusting runledger.

Usage::

    python -m runledger.ledger.verifier inclusion   --proof P.json --checkpoint C.txt --public-key K.pub \\
        [--origin ORIGIN] [--leaf LEAF.bin] [--producer-key PRODUCER.pub]
    python -m runledger.ledger.verifier consistency --proof P.json --checkpoint NEW.txt --public-key K.pub \\
        [--old-checkpoint OLD.txt | --old-size N --old-root B64] [--origin ORIGIN]

(or ``python verifier.py ...`` on a copy). It prints one line, ``OK: ...`` or ``FAIL: reason``, and
exits 0 or 1. ``--public-key`` is a file holding the log's note verifier key
(``<name>+<8 hex>+<base64>``) or that key itself.

* inclusion: verifies the checkpoint signature, checks that the proof is for the checkpoint's tree
  size and root, then verifies the RFC 9162 inclusion proof of the leaf at ``leaf_index``. The leaf
  is hashed here, SHA-256(0x00 ‖ leaf bytes), from the proof's ``leaf`` (the bytes as UTF-8 text) or
  ``--leaf FILE`` (both given: they must be the same bytes); ``leaf_hash``, if present, must equal it.
  The event id, source and stream printed are read from the leaf bytes themselves (a runledger
  event's canonical JSON), and the proof's ``event_id``/``source``/``stream`` must agree with them.
  Without leaf bytes only the leaf hash is verified: the OK line says which fields were NOT checked.
* producer signature (``--producer-key``, inclusion only, needs the leaf bytes): the event's
  ``signature`` must be an Ed25519 signature, by the producer key named in its ``key_id``, over its
  signing bytes: the leaf bytes without the ``"signature":"…",`` member (which must occur exactly
  once). ``verify_producer_signature`` does the same for any leaf; runledger's ingest uses it too.
* consistency: verifies the new checkpoint, then the RFC 9162 consistency proof from the old tree to
  it. The old tree should come from a checkpoint you kept earlier (``--old-checkpoint``, verified with
  the same key) or from values you recorded (``--old-size``/``--old-root``); otherwise the proof's own
  ``first``/``first_root`` are used and the OK line says so: compare them with what you saw before.

Proof JSON (hashes are standard base64)::

    inclusion:   {"leaf_index": int, "tree_size": int, "audit_path": [b64, ...], "leaf_hash": b64,
                  "root_hash": b64, "stream": str, "event_id": str, "source": str, "leaf": str}
    consistency: {"first": int, "second": int, "consistency": [b64, ...], "first_root": b64,
                  "second_root": b64, "stream": str}

Checkpoints are C2SP tlog-checkpoint bodies (origin, decimal size, base64 root) in a C2SP signed-note
with an Ed25519 signature line ``— <key name> <base64(4-byte key hash ‖ signature)>``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import hmac
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = [
    "VerificationError",
    "consistency_proof_document",
    "inclusion_proof_document",
    "main",
    "producer_signing_bytes",
    "verify_consistency_document",
    "verify_inclusion_document",
    "verify_producer_signature",
]

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()
_MAX_PROOF_HASHES = 128  # a 2^64-leaf tree needs at most 2*64; anything longer is garbage
_MAX_INPUT_BYTES = 1 << 20


class VerificationError(ValueError):
    """Any failed check; the message is printed after 'FAIL: '."""


# --------------------------------------------------------------------------------------------------
# RFC 6962 hashing and RFC 9162 proof verification (duplicated from runledger.ledger.merkle on purpose)


def _leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _incl_proof_size(index: int, size: int) -> int:
    inner = (index ^ (size - 1)).bit_length()
    return inner + (index >> inner).bit_count()


def verify_inclusion(leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> None:
    """RFC 9162 §2.1.3.2; raises VerificationError."""
    if not 0 <= index < size:
        raise VerificationError(f"leaf index {index} is not below tree size {size}")
    if len(proof) != _incl_proof_size(index, size):
        raise VerificationError(
            f"inclusion proof has {len(proof)} hashes, want {_incl_proof_size(index, size)}"
        )
    fn, sn, r = index, size - 1, leaf_hash
    for p in proof:
        if sn == 0:
            raise VerificationError("inclusion proof is too long")
        if fn & 1 or fn == sn:
            r = _node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = _node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerificationError("inclusion proof is too short")
    if not hmac.compare_digest(r, root):
        raise VerificationError("inclusion proof does not lead to the root hash")


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> None:
    """RFC 9162 §2.1.4.2 plus the trivial cases (equal sizes; old size 0); raises VerificationError."""
    if not 0 <= old_size <= new_size:
        raise VerificationError(f"old size {old_size} is not between 0 and new size {new_size}")
    if old_size == new_size or old_size == 0:
        if proof:
            raise VerificationError("consistency proof must be empty for these sizes")
        want = new_root if old_size == new_size else EMPTY_ROOT
        if not hmac.compare_digest(old_root, want):
            raise VerificationError("old root does not match (same size, or empty tree)")
        return
    inner = ((old_size - 1) ^ (new_size - 1)).bit_length()
    border = ((old_size - 1) >> inner).bit_count()
    shift = (old_size & -old_size).bit_length() - 1
    want_hashes = (0 if old_size == 1 << shift else 1) + inner - shift + border
    if len(proof) != want_hashes:
        raise VerificationError(f"consistency proof has {len(proof)} hashes, want {want_hashes}")
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise VerificationError("consistency proof is too long")
        if fn & 1 or fn == sn:
            fr = _node_hash(c, fr)
            sr = _node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = _node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise VerificationError("consistency proof is too short")
    if not hmac.compare_digest(fr, old_root):
        raise VerificationError("consistency proof does not lead to the old root")
    if not hmac.compare_digest(sr, new_root):
        raise VerificationError("consistency proof does not lead to the new root")


# --------------------------------------------------------------------------------------------------
# Signed-note checkpoints (duplicated from runledger.schemas.note and runledger.ledger.log_checkpoint, verification side only)


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes


def _b64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise VerificationError(f"{what} must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise VerificationError(f"{what} is not valid base64") from exc
    if base64.b64encode(raw).decode("ascii") != text:
        raise VerificationError(f"{what} is not canonical base64")
    return raw


def _b64_hash(text: object, what: str) -> bytes:
    raw = _b64(text, what)
    if len(raw) != HASH_SIZE:
        raise VerificationError(f"{what} has {len(raw)} bytes, want {HASH_SIZE}")
    return raw


def _valid_key_name(name: str) -> bool:
    return bool(name) and "+" not in name and not any(c.isspace() or c < " " for c in name)


def _parse_vkey(text: str) -> tuple[str, int, Ed25519PublicKey]:
    parts = text.strip().split("+", 2)
    if len(parts) != 3 or not _valid_key_name(parts[0]) or not re.fullmatch(r"[0-9a-f]{8}", parts[1]):
        raise VerificationError("malformed public key: want <name>+<8 hex>+<base64 key>")
    name, hash_hex, blob = parts
    raw = _b64(blob, "public key")
    if len(raw) != 33 or raw[0] != 0x01:
        raise VerificationError("public key is not an Ed25519 note key")
    digest = hashlib.sha256(name.encode() + b"\n" + raw).digest()
    if int.from_bytes(digest[:4], "big") != int(hash_hex, 16):
        raise VerificationError("public key hash does not match its name and key")
    return name, int(hash_hex, 16), Ed25519PublicKey.from_public_bytes(raw[1:])


def verify_checkpoint(note: str, public_key: str, origin: str | None = None) -> Checkpoint:
    """Verify the note signature by ``public_key`` (a vkey) and parse the checkpoint body."""
    name, key_id, key = _parse_vkey(public_key)
    if any(c < " " and c != "\n" for c in note):
        raise VerificationError("checkpoint contains control characters")
    split = note.rfind("\n\n")
    if split < 0 or not note.endswith("\n") or split + 2 >= len(note):
        raise VerificationError("malformed checkpoint note: no signature block")
    text, sigs = note[: split + 1], note[split + 2 : -1].split("\n")
    if len(sigs) > 100:
        raise VerificationError("malformed checkpoint note: too many signatures")
    verified = False
    for line in sigs:
        sig_name, sep, blob = line.removeprefix("— ").partition(" ")
        if not line.startswith("— ") or not sep or not _valid_key_name(sig_name):
            raise VerificationError("malformed signature line")
        raw = _b64(blob, "signature")
        if len(raw) < 5:
            raise VerificationError("malformed signature line: too short")
        if sig_name != name or int.from_bytes(raw[:4], "big") != key_id:
            continue  # another key's signature (e.g. a witness): ignored
        if len(raw) != 4 + 64:
            raise VerificationError(f"signature has {len(raw) - 4} bytes, want 64")
        try:
            key.verify(raw[4:], text.encode())
        except InvalidSignature as exc:
            raise VerificationError(f"invalid signature by key {name}") from exc
        verified = True
    if not verified:
        raise VerificationError(f"checkpoint is not signed by key {name}+{key_id:08x}")
    lines = text[:-1].split("\n")
    if len(lines) < 3 or not lines[0] or any(not line for line in lines):
        raise VerificationError("malformed checkpoint body")
    if not re.fullmatch(r"0|[1-9][0-9]{0,19}", lines[1]) or int(lines[1]) >= 1 << 64:
        raise VerificationError("malformed checkpoint tree size")
    checkpoint = Checkpoint(lines[0], int(lines[1]), _b64_hash(lines[2], "checkpoint root hash"))
    if origin is not None and checkpoint.origin != origin:
        raise VerificationError(f"checkpoint origin {checkpoint.origin!r} is not {origin!r}")
    return checkpoint


# --------------------------------------------------------------------------------------------------
# Proof documents


def _b64e(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def inclusion_proof_document(
    *,
    stream: str,
    event_id: str,
    leaf_index: int,
    tree_size: int,
    leaf_hash: bytes,
    audit_path: Sequence[bytes],
    root_hash: bytes,
    leaf: bytes | None = None,
) -> dict[str, Any]:
    """The JSON-ready inclusion proof dict this verifier reads (for the ledger to emit).

    ``leaf``: the leaf's bytes (an event's canonical JSON, UTF-8), carried as text so the verifier
    hashes the leaf itself and reads the event's id, source and stream from it.
    """
    doc: dict[str, Any] = {
        "leaf_index": leaf_index,
        "tree_size": tree_size,
        "audit_path": [_b64e(h) for h in audit_path],
        "leaf_hash": _b64e(leaf_hash),
        "root_hash": _b64e(root_hash),
        "stream": stream,
        "event_id": event_id,
    }
    if leaf is not None:
        doc["leaf"] = leaf.decode("utf-8")
    return doc


def consistency_proof_document(
    *,
    stream: str,
    first: int,
    second: int,
    consistency: Sequence[bytes],
    first_root: bytes,
    second_root: bytes,
) -> dict[str, Any]:
    """The JSON-ready consistency proof dict this verifier reads (for the ledger to emit)."""
    return {
        "first": first,
        "second": second,
        "consistency": [_b64e(h) for h in consistency],
        "first_root": _b64e(first_root),
        "second_root": _b64e(second_root),
        "stream": stream,
    }


def _int_field(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise VerificationError(f"proof field {key!r} must be an integer in [0, 2^64)")
    return value


def _hash_list(doc: dict[str, Any], key: str) -> list[bytes]:
    value = doc.get(key)
    if not isinstance(value, list) or len(value) > _MAX_PROOF_HASHES:
        raise VerificationError(f"proof field {key!r} must be a list of at most {_MAX_PROOF_HASHES} hashes")
    return [_b64_hash(h, f"{key}[{i}]") for i, h in enumerate(value)]


def _str_field(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key, "")
    if not isinstance(value, str):
        raise VerificationError(f"proof field {key!r} must be a string")
    return value


# Proof fields that name the event, and the member of the leaf's own JSON that must agree with each.
_BOUND_FIELDS = (("event_id", "id"), ("source", "source"), ("stream", "stream"))


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise VerificationError("the leaf's JSON repeats a key: not canonical event bytes")
    return dict(pairs)


_SIGNATURE_B64 = re.compile(r"[A-Za-z0-9+/]{86}==")


def producer_signing_bytes(leaf: bytes) -> tuple[bytes, str, bytes]:
    """(signing bytes, key_id, signature) of a signed event's canonical bytes (the leaf).

    In canonical JSON (keys sorted, no whitespace) the top-level ``signature`` member is followed by
    ``source`` and ``specversion``, so removing its text ``"signature":"<base64>",`` leaves exactly
    the canonical bytes the producer signed. The member must occur once: a copy nested in the
    payload makes the leaf ambiguous and it is refused."""
    try:
        value = json.loads(leaf.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise VerificationError(f"leaf is not an event: {exc}") from exc
    if not isinstance(value, dict):
        raise VerificationError("leaf is not an event object")
    signature, key_id = value.get("signature"), value.get("key_id")
    if not isinstance(signature, str) or not isinstance(key_id, str):
        raise VerificationError("event is unsigned (no key_id and signature)")
    if not _SIGNATURE_B64.fullmatch(signature):
        raise VerificationError("event signature is not 64 bytes of base64")
    member = b'"signature":"' + signature.encode() + b'",'
    if leaf.count(member) != 1:
        raise VerificationError("event signature member is missing or ambiguous in the leaf bytes")
    return leaf.replace(member, b"", 1), key_id, base64.b64decode(signature)


def verify_producer_signature(leaf: bytes, public_key: str) -> str:
    """Check a leaf's producer signature against the producer's note verifier key; its key_id."""
    name, key_hash, key = _parse_vkey(public_key)
    message, key_id, signature = producer_signing_bytes(leaf)
    if key_id != f"{name}+{key_hash:08x}":
        raise VerificationError(f"event is signed by {key_id}, not by {name}+{key_hash:08x}")
    try:
        key.verify(signature, message)
    except InvalidSignature as exc:
        raise VerificationError(f"producer signature of {key_id} does not verify") from exc
    return key_id


def _leaf_fields(leaf: bytes) -> dict[str, str]:
    """The event's id, source and stream as the leaf's bytes state them ({} if the leaf is not an event)."""
    try:
        value = json.loads(leaf.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {key: value[key] for _, key in _BOUND_FIELDS if isinstance(value.get(key), str)}


def _proof_leaf(doc: dict[str, Any], leaf_file: bytes | None) -> bytes | None:
    """The leaf bytes to hash: the proof's ``leaf`` text and/or the ``--leaf`` file (the same bytes)."""
    inline: bytes | None = None
    if "leaf" in doc:
        text = doc["leaf"]
        if not isinstance(text, str):
            raise VerificationError("proof field 'leaf' must be a string (the leaf's bytes as UTF-8 text)")
        try:
            inline = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise VerificationError("proof field 'leaf' is not valid UTF-8 text") from exc
    if inline is not None and leaf_file is not None and not hmac.compare_digest(inline, leaf_file):
        raise VerificationError("the --leaf file differs from the proof's leaf")
    return leaf_file if leaf_file is not None else inline


def verify_inclusion_document(
    doc: dict[str, Any], checkpoint: Checkpoint, leaf_data: bytes | None = None
) -> str:
    """Check an inclusion proof document against a verified checkpoint; returns an OK summary.

    The leaf is hashed here from its bytes (the proof's ``leaf``, or ``leaf_data`` from ``--leaf``);
    what the summary says about the event is read from those bytes, never from the proof's other
    fields, which must agree. Without leaf bytes, only the proof's ``leaf_hash`` is verified.
    """
    index, size = _int_field(doc, "leaf_index"), _int_field(doc, "tree_size")
    path = _hash_list(doc, "audit_path")
    claimed = _b64_hash(doc["leaf_hash"], "leaf_hash") if "leaf_hash" in doc else None
    leaf_bytes = _proof_leaf(doc, leaf_data)
    if leaf_bytes is not None:
        leaf = _leaf_hash(leaf_bytes)
        if claimed is not None and not hmac.compare_digest(leaf, claimed):
            raise VerificationError("SHA-256(0x00 ‖ leaf) differs from the proof's leaf_hash")
    elif claimed is not None:
        leaf = claimed
    else:
        raise VerificationError("proof has neither 'leaf' nor 'leaf_hash'")
    if size != checkpoint.size:
        raise VerificationError(f"proof is for tree size {size}, the checkpoint is for {checkpoint.size}")
    if "root_hash" in doc and not hmac.compare_digest(
        _b64_hash(doc["root_hash"], "root_hash"), checkpoint.root
    ):
        raise VerificationError("proof root_hash differs from the signed checkpoint root")
    fields = _leaf_fields(leaf_bytes) if leaf_bytes is not None else {}
    unchecked = []
    for proof_key, leaf_key in _BOUND_FIELDS:
        if proof_key not in doc:
            continue
        stated = _str_field(doc, proof_key)
        if leaf_bytes is None:
            unchecked.append(proof_key)
        elif leaf_key not in fields:
            raise VerificationError(f"proof names a {proof_key} but the leaf has no {leaf_key!r} to check it")
        elif fields[leaf_key] != stated:
            raise VerificationError(
                f"proof's {proof_key} {stated!r} is not the leaf's {leaf_key} {fields[leaf_key]!r}"
            )
    verify_inclusion(leaf, index, size, path, checkpoint.root)
    where = f"is leaf {index} of {checkpoint.origin!r} at size {size} (root {_b64e(checkpoint.root)})"
    if "id" in fields:
        what = f"event {fields['id']!r}"
        if "source" in fields:
            what += f" from {fields['source']!r}"
        if "stream" in fields:
            what += f" of stream {fields['stream']!r}"
        return f"{what} {where}"
    summary = f"leaf with hash {_b64e(leaf)} {where}"
    if leaf_bytes is None and isinstance(doc.get("redacted"), str):  # `ledger redact` erased its bytes
        summary += (
            f"; the proof says the event was redacted ({doc['redacted'][:200]}): only its leaf hash is proven"
        )
    if unchecked:
        summary += (
            f"; NOT checked: {', '.join(unchecked)} (the proof carries no leaf bytes: pass --leaf FILE)"
        )
    return summary


def verify_consistency_document(
    doc: dict[str, Any], checkpoint: Checkpoint, old: tuple[int, bytes] | None = None
) -> str:
    """Check a consistency proof document against a verified new checkpoint and a trusted old tree.

    ``old`` is the trusted (size, root); None falls back to the document's own first/first_root.
    """
    first, second = _int_field(doc, "first"), _int_field(doc, "second")
    path = _hash_list(doc, "consistency")
    first_root = _b64_hash(doc.get("first_root"), "first_root")
    if second != checkpoint.size:
        raise VerificationError(f"proof is to tree size {second}, the checkpoint is for {checkpoint.size}")
    if "second_root" in doc and not hmac.compare_digest(
        _b64_hash(doc["second_root"], "second_root"), checkpoint.root
    ):
        raise VerificationError("proof second_root differs from the signed checkpoint root")
    note = ""
    if old is not None:
        if old[0] != first:
            raise VerificationError(f"proof is from tree size {first}, the trusted old tree has {old[0]}")
        if not hmac.compare_digest(old[1], first_root):
            raise VerificationError("proof first_root differs from the trusted old root")
    else:
        note = " (old root taken from the proof file: compare it with a checkpoint you kept)"
    verify_consistency(first, second, first_root, checkpoint.root, path)
    return (
        f"stream {_str_field(doc, 'stream')!r}: {checkpoint.origin!r} at size {first} "
        f"(root {_b64e(first_root)}) is a prefix of size {second} (root {_b64e(checkpoint.root)}){note}"
    )


# --------------------------------------------------------------------------------------------------
# Command line


class _Parser(argparse.ArgumentParser):
    # Usage errors are failures too: one FAIL line and exit status 1, not argparse's status 2.
    def error(self, message: str) -> NoReturn:
        raise VerificationError(f"bad arguments: {message}")


def _read_text(path: str, what: str) -> str:
    try:
        data = Path(path).read_bytes()[: _MAX_INPUT_BYTES + 1]
    except OSError as exc:
        raise VerificationError(f"cannot read {what} {path!r}: {exc.strerror}") from exc
    if len(data) > _MAX_INPUT_BYTES:
        raise VerificationError(f"{what} {path!r} is too large")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VerificationError(f"{what} {path!r} is not UTF-8") from exc


def _read_key(arg: str) -> str:
    # A path to a .pub file, or the vkey itself pasted on the command line.
    if Path(arg).is_file():
        return _read_text(arg, "public key")
    if re.fullmatch(r"[^+\s]+\+[0-9a-f]{8}\+\S+", arg):
        return arg
    raise VerificationError(f"public key file {arg!r} not found")


def _read_json(path: str) -> dict[str, Any]:
    try:
        doc = json.loads(_read_text(path, "proof"))
    except json.JSONDecodeError as exc:
        raise VerificationError(f"proof {path!r} is not valid JSON: {exc.msg}") from exc
    if not isinstance(doc, dict):
        raise VerificationError(f"proof {path!r} must be a JSON object")
    return doc


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verifier", description="Verify runledger proofs against signed checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inc = sub.add_parser("inclusion", help="verify an inclusion proof")
    con = sub.add_parser("consistency", help="verify a consistency proof")
    for p in (inc, con):
        p.add_argument("--proof", required=True, help="proof JSON file")
        p.add_argument("--checkpoint", required=True, help="signed checkpoint file (the newer one)")
        p.add_argument("--public-key", required=True, help="note verifier key file, or the key itself")
        p.add_argument("--origin", help="expected checkpoint origin (recommended)")
    inc.add_argument(
        "--leaf", help="file with the leaf's bytes (the event's canonical JSON): hashed and read here"
    )
    inc.add_argument(
        "--producer-key", help="producer's public key file (or the key): check the event's signature"
    )
    con.add_argument("--old-checkpoint", help="earlier signed checkpoint you kept")
    con.add_argument("--old-size", type=int, help="trusted old tree size (with --old-root)")
    con.add_argument("--old-root", help="trusted old root hash, base64 (with --old-size)")
    return parser


def _run(argv: Sequence[str] | None) -> str:
    args = _build_parser().parse_args(argv)
    key = _read_key(args.public_key)
    checkpoint = verify_checkpoint(_read_text(args.checkpoint, "checkpoint"), key, args.origin)
    doc = _read_json(args.proof)
    if args.command == "inclusion":
        leaf = None
        if args.leaf is not None:
            try:
                leaf = Path(args.leaf).read_bytes()
            except OSError as exc:
                raise VerificationError(f"cannot read leaf {args.leaf!r}: {exc.strerror}") from exc
        summary = verify_inclusion_document(doc, checkpoint, leaf)
        if args.producer_key is not None:
            leaf_bytes = _proof_leaf(doc, leaf)
            if leaf_bytes is None:
                raise VerificationError("--producer-key needs the leaf bytes (the proof's leaf, or --leaf)")
            summary += (
                f"; signed by producer {verify_producer_signature(leaf_bytes, _read_key(args.producer_key))}"
            )
        return summary
    old: tuple[int, bytes] | None = None
    if args.old_checkpoint is not None:
        if args.old_size is not None or args.old_root is not None:
            raise VerificationError("give --old-checkpoint or --old-size/--old-root, not both")
        old_cp = verify_checkpoint(_read_text(args.old_checkpoint, "old checkpoint"), key, checkpoint.origin)
        old = (old_cp.size, old_cp.root)
    elif args.old_size is not None or args.old_root is not None:
        if args.old_size is None or args.old_root is None:
            raise VerificationError("--old-size and --old-root go together")
        old = (args.old_size, _b64_hash(args.old_root, "--old-root"))
    return verify_consistency_document(doc, checkpoint, old)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the verifier CLI; prints one OK/FAIL line and returns the exit status (0 or 1)."""
    try:
        summary = _run(argv)
    except VerificationError as exc:
        print(f"FAIL: {exc}")
        return 1
    except (ValueError, OverflowError) as exc:  # e.g. a bad Ed25519 point in an otherwise valid key
        print(f"FAIL: {exc}")
        return 1
    print(f"OK: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
