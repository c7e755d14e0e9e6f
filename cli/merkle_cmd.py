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
    progress,
    user_errors,
)

DEFAULT_KEYS = Path(".runledger/keys")
KeyDir = Annotated[Path, typer.Option("--keys", envvar="RUNLEDGER_KEYS", help="Key directory.")]


def _read_key(keys: Path, suffix: str) -> str:
    found = sorted(keys.glob(f"*{suffix}"))
    if not found:
        raise fail(f"no {suffix} key in {keys} (create one with `ledger keys init`)")
    return found[0].read_text().strip()


def _log_signing_key(ledger: Path, keys: Path, name: str | None) -> str:
    """The private key a `ledger checkpoint` signs with, chosen without guessing: a key file is named
    after its key (``NAME.key``), producer keys of the ledger are never it, and among several the
    one that signed the ledger's checkpoints so far (or ``--name``) is; otherwise a one-line error."""
    from ledger.integrity import CHECKPOINTS
    from ledger.log_checkpoint import note_signers
    from ledger.registry import producers
    from ledger.store import Ledger
    from schemas.note import parse_private_key
    from schemas.signing import key_id_of

    found = {path: parse_private_key(path.read_text()) for path in sorted(keys.glob("*.key"))}
    if not found:
        raise fail(f"no .key key in {keys} (create one with `ledger keys init` or `ledger init`)")
    registered = set(producers(Ledger.open(ledger)).keys)
    candidates = {p: k for p, k in found.items() if key_id_of(k) not in registered}
    if name is not None:
        candidates = {p: k for p, k in candidates.items() if k.name == name}
    if len(candidates) > 1:
        signed = {s for note in (ledger / CHECKPOINTS).glob("*.txt") for s in note_signers(note.read_text())}
        candidates = {p: k for p, k in candidates.items() if key_id_of(k) in signed} or candidates
    if len(candidates) != 1:
        names = ", ".join(p.name for p in (candidates or found))
        why = "several log keys" if candidates else "no log key (producer keys of this ledger are not)"
        raise fail(f"{why} in {keys}: {names}; pass --name NAME (the log key's name)")
    (path,) = candidates
    return path.read_text().strip()


def _public_keys(keys: Path) -> list[tuple[Path, str]]:
    return [(path, path.read_text().strip()) for path in sorted(keys.glob("*.pub"))] if keys.is_dir() else []


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


def checkpoint(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = DEFAULT_KEYS,
    name: Annotated[
        str | None, typer.Option("--name", help="The log key's name, when the folder holds several keys.")
    ] = None,
) -> None:
    """Sign a log checkpoint of each stream's current size and root (publish the files under <ledger>/_checkpoints).

    Example: ledger checkpoint --keys .runledger/keys
    """
    from ledger.integrity import sign_checkpoints

    with user_errors(ledger):
        written = sign_checkpoints(ledger, _log_signing_key(ledger, keys, name))
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

    Exit status: 0 all checked and OK; 1 a problem found, or a checkpoint signed by none of the keys
    tried (said as that, with the signer's and the tried keys' names: with --keys DIR each checkpoint is
    checked with the key it names, and never with a producer key of the ledger); 3 nothing wrong
    found, but signed log checkpoints are on disk that were not checked (no public key: pass
    --public-key or --keys).

    Example: ledger verify --public-key .runledger/demo/keys/demo.pub
    """
    from ledger.integrity import CHECKPOINTS, verify_ledger

    with user_errors(ledger), progress("verify", "events") as shown:
        # Every key of the folder is tried: each checkpoint is checked with the one it names.
        tried = [(public_key, public_key.read_text().strip())] if public_key else _public_keys(keys)
        key = [text for _, text in tried] or None
        report = verify_ledger(ledger, key, progress=shown)
    for problem in report.problems:
        console.print(problem.line(), highlight=False, markup=False)
    for warning in report.warnings:
        console.print(f"WARNING: {warning}", style="yellow", highlight=False, markup=False)
    counted = f"{plural(report.streams, 'stream')}, {plural(report.events, 'event')}"
    signed = plural(report.checkpoints, "signed checkpoint")
    if report.problems and all(problem.kind == "key" for problem in report.problems):
        files = ", ".join(str(path) for path, _ in tried)
        console.print(
            f"NOT VERIFIED ({plural(len(report.problems), 'checkpoint')} not signed by a log key tried: "
            f"{files}); no tampering found: {counted} match the commit log. Pass the log key with "
            "--public-key FILE",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(1)
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
