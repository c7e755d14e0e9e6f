"""Tamper-evidence commands: `ledger keys init`, `checkpoint`, `verify`, `prove inclusion|consistency`.

A "checkpoint" here is a log checkpoint: a signed tree head (C2SP tlog-checkpoint in a signed note,
``ledger.log_checkpoint``) of one event stream's Merkle tree, not a model checkpoint.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Annotated

import typer

from cli.output import (
    DEFAULT_LEDGER,
    LedgerOption,
    OutputOption,
    console,
    fail,
    plural,
    print_json,
    user_errors,
)

DEFAULT_KEYS = Path(".runledger/keys")
KeyDir = Annotated[Path, typer.Option("--keys", envvar="RUNLEDGER_KEYS", help="Key directory.")]


def _read_key(keys: Path, suffix: str) -> str:
    found = sorted(keys.glob(f"*{suffix}"))
    if not found:
        raise fail(f"no {suffix} key in {keys} (create one with `ledger keys init`)")
    return found[0].read_text().strip()


def keys_init(
    name: Annotated[str, typer.Option(help="Key name (appears in signature lines).")] = "runledger",
    keys: KeyDir = DEFAULT_KEYS,
) -> None:
    """Create a key pair: NAME.key (owner-only, never printed) and NAME.pub (publish it).

    Example: ledger keys init --name ci --keys .runledger/keys
    """
    from schemas.note import write_keypair

    with user_errors():
        try:
            private, public = write_keypair(keys, name)
        except FileExistsError:
            raise fail(f"a key named {name} already exists in {keys}") from None
    console.print(f"private key: {private} (mode {oct(os.stat(private).st_mode & 0o777)})")
    console.print(f"public key:  {public}")


def checkpoint(ledger: LedgerOption = DEFAULT_LEDGER, keys: KeyDir = DEFAULT_KEYS) -> None:
    """Sign a log checkpoint of each stream's current size and root (publish the files under <ledger>/_checkpoints).

    Example: ledger checkpoint --keys .runledger/keys
    """
    from ledger.integrity import sign_checkpoints

    with user_errors(ledger):
        written = sign_checkpoints(ledger, _read_key(keys, ".key"))
    console.print(f"signed {plural(len(written), 'stream checkpoint')} in {ledger / '_checkpoints'}")


# `ledger verify` exits 3 when it found nothing wrong but could not check every signed checkpoint.
UNVERIFIED_EXIT = 3


def verify(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = DEFAULT_KEYS,
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="Public key file (the log checkpoints' signer).")
    ] = None,
) -> None:
    """Check the whole ledger against its Merkle trees and latest log checkpoints; name every bad event.

    Exit status: 0 all checked and OK; 1 a problem found; 3 nothing wrong found, but signed log
    checkpoints are on disk that were not checked (no public key: pass --public-key or --keys).

    Example: ledger verify --public-key .runledger/demo/keys/demo.pub
    """
    from ledger.integrity import CHECKPOINTS, verify_ledger

    with user_errors(ledger):
        key = public_key.read_text().strip() if public_key else None
        if key is None and keys.is_dir() and list(keys.glob("*.pub")):
            key = _read_key(keys, ".pub")
        report = verify_ledger(ledger, key)
    for problem in report.problems:
        console.print(problem.line(), highlight=False, markup=False)
    for warning in report.warnings:
        console.print(f"WARNING: {warning}", style="yellow", highlight=False, markup=False)
    counted = f"{plural(report.streams, 'stream')}, {plural(report.events, 'event')}"
    signed = plural(report.checkpoints, "signed checkpoint")
    if not report.ok:
        console.print(
            f"FAILED ({plural(len(report.problems), 'problem')}): {counted}, {signed} checked",
            highlight=False,
        )
        raise typer.Exit(1)
    # Count the signed checkpoints on disk ourselves: the report only counts those it checked.
    on_disk = len(list((ledger / CHECKPOINTS).glob("*.txt")))
    unchecked = on_disk - report.checkpoints
    if unchecked > 0:
        if key is None:
            why = f"no public key (none given, none in {keys})"
        else:
            why = "their streams are not in the ledger"
        count = plural(on_disk, "signed checkpoint")
        if unchecked < on_disk:
            count = f"{unchecked} of {count}"
        console.print(
            f"UNVERIFIED: {count} in {ledger / CHECKPOINTS} not checked: {why}; pass --public-key PATH "
            f"(the signer's .pub file) or --keys DIR. Checked: {counted} against the ledger's own "
            "commit log only.",
            style="bold yellow",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(UNVERIFIED_EXIT)
    if on_disk == 0:
        console.print(
            f"OK: {counted} match the commit log; no signed checkpoints to check "
            "(sign one with `ledger checkpoint`)",
            highlight=False,
        )
        return
    console.print(f"OK: {counted}, {signed} checked", highlight=False)


def _leaf_bytes(ledger: Path, doc: dict) -> bytes:
    """The canonical bytes of the event a proof is for: the leaf the verifier hashes itself."""
    from ledger.merkle import leaf_hash
    from ledger.query import Reader

    rows = (
        Reader(ledger)
        .sql(
            "SELECT canonical FROM events WHERE stream = ? AND stream_seq = ?",
            [doc["stream"], doc["leaf_index"]],
        )
        .rows
    )
    want = base64.b64decode(doc["leaf_hash"])
    for (canonical,) in rows:
        raw = canonical.encode("utf-8")
        if leaf_hash(raw) == want:
            return raw
    raise fail(
        f"the stored bytes of event {doc['event_id']} no longer hash to its recorded leaf: "
        "run `ledger verify`"
    )


def prove_inclusion(
    event_id: Annotated[str, typer.Argument(help="The event's id.")],
    source: Annotated[str | None, typer.Option(help="The event's source, if ids repeat.")] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    output: OutputOption = None,
    leaf_out: Annotated[
        Path | None,
        typer.Option(
            "--leaf-out", help="Also write the leaf's bytes (the event's canonical JSON) to this file."
        ),
    ] = None,
) -> None:
    """Inclusion proof of one event in its stream's tree at the latest log checkpoint (RFC 6962 shape).

    The proof carries the leaf's bytes (the event's canonical JSON, in "leaf"), so the verifier
    hashes the leaf itself and reads the event's id, source and stream from it.

    Example: ledger prove inclusion run-a-42 -o proof.json --leaf-out leaf.json
    """
    from ledger.integrity import prove_inclusion as prove

    with user_errors(ledger):
        doc = prove(ledger, event_id, source)
        leaf = _leaf_bytes(ledger, doc)
    doc["leaf"] = leaf.decode("utf-8")
    if leaf_out is not None:
        with user_errors():
            tmp = leaf_out.with_name(leaf_out.name + f".{os.getpid()}.part")
            tmp.write_bytes(leaf)
            tmp.replace(leaf_out)
    print_json(doc, output)


def prove_consistency(
    stream: Annotated[str, typer.Argument(help="Stream (run id or owner/repo).")],
    from_size: Annotated[int, typer.Option("--from", help="The earlier tree size.")],
    to_size: Annotated[
        int | None,
        typer.Option("--to", help="The later size (default: the latest log checkpoint's, else the tree's)."),
    ] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    output: OutputOption = None,
) -> None:
    """Consistency proof between two sizes of a stream's tree (RFC 6962 shape).

    Example: ledger prove consistency run-a --from 100 -o proof.json
    """
    from ledger.integrity import prove_consistency as prove

    with user_errors(ledger):
        doc = prove(ledger, stream, from_size, to_size)
    print_json(doc, output)
