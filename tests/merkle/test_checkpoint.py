"""Tests for runledger.ledger.log_checkpoint: signed-note compatibility with Go, strict parsing, tampering."""

from __future__ import annotations

import base64
import hashlib
import os
import stat
from pathlib import Path

import pytest

from runledger.ledger.log_checkpoint import (
    Checkpoint,
    format_checkpoint,
    parse_and_verify_checkpoint,
    parse_checkpoint,
    sign_checkpoint,
)
from runledger.ledger.merkle import EMPTY_ROOT, leaf_hash
from runledger.schemas.note import (
    CheckpointError,
    generate_keypair,
    key_hash,
    open_note,
    parse_private_key,
    parse_public_key,
    sign_note,
    write_keypair,
)

# Known answer from golang.org/x/mod/sumdb/note (package documentation / note_test.go):
# Ed25519 is deterministic, so signing the same text with the same key must give these exact bytes.
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
)
GO_SIG = "x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM="
GO_NOTE = GO_TEXT + "\n— PeterNeumann " + GO_SIG + "\n"

ORIGIN = "runledger.example/run-42"
ROOT = leaf_hash(b"some root")


@pytest.fixture(scope="module")
def keys() -> tuple[str, str]:
    return generate_keypair(ORIGIN)


@pytest.fixture(scope="module")
def signed(keys: tuple[str, str]) -> str:
    return sign_checkpoint(ORIGIN, 1234, ROOT, keys[0])


def test_go_note_known_answer() -> None:
    assert sign_note(GO_TEXT, GO_SKEY) == GO_NOTE
    assert open_note(GO_NOTE, GO_VKEY) == GO_TEXT
    assert open_note(GO_NOTE.encode(), GO_VKEY) == GO_TEXT
    assert parse_public_key(GO_VKEY).key_hash == 0xC74F20A3
    assert parse_private_key(GO_SKEY).key_hash == 0xC74F20A3


def test_key_hash_definition() -> None:
    raw = base64.b64decode(GO_VKEY.split("+", 2)[2])[1:]
    want = hashlib.sha256(b"PeterNeumann\n\x01" + raw).digest()[:4]
    assert key_hash("PeterNeumann", raw) == int.from_bytes(want, "big") == 0xC74F20A3


def test_round_trip(keys: tuple[str, str], signed: str) -> None:
    skey, vkey = keys
    assert skey.startswith(f"PRIVATE+KEY+{ORIGIN}+")
    assert vkey.startswith(f"{ORIGIN}+")
    body = f"{ORIGIN}\n1234\n{base64.b64encode(ROOT).decode()}\n"
    assert signed.startswith(body + "\n— " + ORIGIN + " ")
    assert signed.endswith("\n")
    sig = base64.b64decode(signed.rsplit(" ", 1)[1])
    assert len(sig) == 4 + 64
    assert parse_and_verify_checkpoint(signed, vkey) == Checkpoint(ORIGIN, 1234, ROOT)
    assert parse_and_verify_checkpoint(signed, vkey, origin=ORIGIN).size == 1234


def test_empty_tree_and_extensions(keys: tuple[str, str]) -> None:
    skey, vkey = keys
    cp = parse_and_verify_checkpoint(sign_checkpoint(ORIGIN, 0, EMPTY_ROOT, skey), vkey)
    assert (cp.size, cp.root) == (0, EMPTY_ROOT)
    ext = sign_checkpoint(ORIGIN, 7, ROOT, skey, extensions=("Timestamp: 1700000000",))
    assert parse_and_verify_checkpoint(ext, vkey).extensions == ("Timestamp: 1700000000",)


def test_wrong_key_rejected(signed: str) -> None:
    _, other_vkey = generate_keypair(ORIGIN)  # same name, different key: different key hash
    with pytest.raises(CheckpointError, match="no signature"):
        parse_and_verify_checkpoint(signed, other_vkey)
    _, other_name = generate_keypair("someone-else")
    with pytest.raises(CheckpointError, match="no signature"):
        parse_and_verify_checkpoint(signed, other_name)


def test_forged_key_hash_rejected(keys: tuple[str, str], signed: str) -> None:
    # An attacker's key relabelled with our name and key hash: the signature line matches our key
    # id, so the signature itself is checked and fails.
    evil_skey, _ = generate_keypair(ORIGIN)
    evil_signed = sign_checkpoint(ORIGIN, 1234, leaf_hash(b"evil"), evil_skey)
    our_id = base64.b64decode(signed.rsplit(" ", 1)[1])[:4]
    evil_sig = base64.b64decode(evil_signed.rsplit(" ", 1)[1])[4:]
    forged = evil_signed.rsplit(" ", 1)[0] + " " + base64.b64encode(our_id + evil_sig).decode() + "\n"
    with pytest.raises(CheckpointError, match="invalid signature"):
        parse_and_verify_checkpoint(forged, keys[1])


@pytest.mark.parametrize("length", [0, 1, 63, 65, 128])
def test_signature_of_another_size_rejected(keys: tuple[str, str], signed: str, length: int) -> None:
    head, blob = signed.rsplit(" ", 1)
    raw = base64.b64decode(blob)
    sig = (raw[4:] * 2)[:length]
    tampered = head + " " + base64.b64encode(raw[:4] + sig).decode() + "\n"
    with pytest.raises(CheckpointError):
        parse_and_verify_checkpoint(tampered, keys[1])


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("\n1234\n", "\n1235\n"),  # size
        ("\n1234\n", "\n01234\n"),  # non-canonical size
        (ORIGIN + "\n", "runledger.example/run-43\n"),  # origin
        ("run-42\n", "run-42 \n"),
    ],
)
def test_altered_body_rejected(keys: tuple[str, str], signed: str, old: str, new: str) -> None:
    tampered = signed.replace(old, new, 1)
    assert tampered != signed
    with pytest.raises(CheckpointError):
        parse_and_verify_checkpoint(tampered, keys[1])


def test_every_body_character_matters(keys: tuple[str, str], signed: str) -> None:
    body_len = signed.index("\n\n") + 1
    for i in range(body_len):
        ch = signed[i]
        repl = "A" if ch != "A" else "B"
        tampered = signed[:i] + repl + signed[i + 1 :]
        with pytest.raises(CheckpointError):
            parse_and_verify_checkpoint(tampered, keys[1])


def test_added_or_removed_lines_rejected(keys: tuple[str, str], signed: str) -> None:
    body, sigs = signed.split("\n\n", 1)
    for tampered in (
        body + "\nextra line\n\n" + sigs,
        body.rsplit("\n", 1)[0] + "\n\n" + sigs,  # root line removed
        body + "\n\n\n" + sigs,
        body + "\n" + sigs,  # no blank line
        body + "\n\n",  # no signature
        signed.rstrip("\n"),  # no final newline
        signed + "garbage\n",
        signed.replace("— ", "- ", 1),  # hyphen instead of em dash
        signed.replace("\n", "\r\n"),
    ):
        with pytest.raises(CheckpointError):
            parse_and_verify_checkpoint(tampered, keys[1])


def test_wrong_origin_rejected(keys: tuple[str, str], signed: str) -> None:
    with pytest.raises(CheckpointError, match="origin"):
        parse_and_verify_checkpoint(signed, keys[1], origin="runledger.example/other-run")


def test_other_signatures_ignored(keys: tuple[str, str], signed: str) -> None:
    # A witness cosignature (unknown key) next to ours does not affect verification.
    witness_skey, witness_vkey = generate_keypair("witness.example")
    cosigned = sign_note(signed.split("\n\n", 1)[0] + "\n", witness_skey)
    both = signed + cosigned.split("\n\n", 1)[1]
    assert parse_and_verify_checkpoint(both, keys[1]).size == 1234
    assert parse_and_verify_checkpoint(both, witness_vkey).size == 1234


def test_strict_body_parsing() -> None:
    root64 = base64.b64encode(ROOT).decode()
    parse_checkpoint(f"o\n0\n{root64}\n")
    for body in (
        f"o\n-1\n{root64}\n",
        f"o\n+1\n{root64}\n",
        f"o\n1.0\n{root64}\n",
        f"o\n{1 << 64}\n{root64}\n",
        f"\n1\n{root64}\n",
        f"o\n1\n{root64.rstrip('=')}\n",  # unpadded base64
        f"o\n1\n{base64.b64encode(ROOT[:31]).decode()}\n",
        f"o\n1\n{root64}",
        f"o\n1\n{root64}\n\nx\n",
        "o\n1\n",
    ):
        with pytest.raises(CheckpointError):
            parse_checkpoint(body)


def test_format_checkpoint_validates() -> None:
    for args in (("", 1, ROOT), ("a\nb", 1, ROOT), ("o", -1, ROOT), ("o", True, ROOT), ("o", 1, ROOT[:31])):
        with pytest.raises(CheckpointError):
            format_checkpoint(*args)  # type: ignore[arg-type]


def test_malformed_keys_rejected() -> None:
    bad_vkeys = [
        "",
        "PeterNeumann",
        "PeterNeumann+c74f20a3",
        "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong hash
        "PeterNeumann+C74F20A3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # upper-case hex
        "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
        "PeterNeumann+c74f20a3+AhpcAAAUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong algorithm
        "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10",  # truncated
    ]
    for vkey in bad_vkeys:
        with pytest.raises(CheckpointError):
            parse_public_key(vkey)
    for skey in ("", GO_VKEY, GO_SKEY.replace("c74f20a3", "c74f20a4"), GO_SKEY.replace("PRIVATE", "PUBLIC")):
        with pytest.raises(CheckpointError):
            parse_private_key(skey)
    with pytest.raises(CheckpointError):
        generate_keypair("has space")
    with pytest.raises(CheckpointError):
        generate_keypair("has+plus")


def test_signer_repr_hides_key() -> None:
    signer = parse_private_key(GO_SKEY)
    assert "AYEK" not in repr(signer)
    assert "c74f20a3" in repr(signer)


def test_write_keypair(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even with a permissive umask the private key must be 0600
    try:
        private_path, public_path = write_keypair(tmp_path / "keys", ORIGIN)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    assert private_path.name == "runledger.example_run-42.key"
    skey = private_path.read_text().strip()
    vkey = public_path.read_text().strip()
    assert parse_private_key(skey).name == ORIGIN
    cp = parse_and_verify_checkpoint(sign_checkpoint(ORIGIN, 3, ROOT, skey), vkey)
    assert cp.size == 3
    with pytest.raises(FileExistsError):
        write_keypair(tmp_path / "keys", ORIGIN)
    assert private_path.read_text().strip() == skey  # not overwritten
