"""Tamper-evidence commands: `ledger keys init`, `checkpoint`, `verify`, `prove inclusion|consistency`.

A "checkpoint" here is a log checkpoint: a signed tree head (C2SP tlog-checkpoint in a signed note,
``runledger.ledger.log_checkpoint``) of one event stream's Merkle tree, not a model checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import (
    DEFAULT_LEDGER,
    LedgerOption,
    OutputOption,
    console,
    fail,
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
    """Create a key pair: NAME.key (owner-only, never printed) and NAME.pub (publish it)."""
    from runledger.ledger.log_checkpoint import write_keypair

    with user_errors():
        try:
            private, public = write_keypair(keys, name)
        except FileExistsError:
            raise fail(f"a key named {name} already exists in {keys}") from None
    console.print(f"private key: {private} (mode {oct(os.stat(private).st_mode & 0o777)})")
    console.print(f"public key:  {public}")


def checkpoint(ledger: LedgerOption = DEFAULT_LEDGER, keys: KeyDir = DEFAULT_KEYS) -> None:
    """Sign a log checkpoint of each stream's current size and root (publish the files under <ledger>/_checkpoints)."""
    from runledger.ledger.integrity import sign_checkpoints

    with user_errors():
        written = sign_checkpoints(ledger, _read_key(keys, ".key"))
    console.print(f"signed {len(written)} stream checkpoints in {ledger / '_checkpoints'}")


def verify(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = DEFAULT_KEYS,
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="Public key file (the log checkpoints' signer).")
    ] = None,
) -> None:
    """Check the whole ledger against its Merkle trees and latest log checkpoints; name every bad event."""
    from runledger.ledger.integrity import verify_ledger

    with user_errors():
        key = public_key.read_text().strip() if public_key else None
        if key is None and keys.is_dir() and list(keys.glob("*.pub")):
            key = _read_key(keys, ".pub")
        report = verify_ledger(ledger, key)
    for problem in report.problems:
        console.print(problem.line(), highlight=False, markup=False)
    status = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    console.print(
        f"{status}: {report.streams} streams, {report.events} events, "
        f"{report.checkpoints} signed checkpoints checked"
    )
    if not report.ok:
        raise typer.Exit(1)


def prove_inclusion(
    event_id: Annotated[str, typer.Argument(help="The event's id.")],
    source: Annotated[str | None, typer.Option(help="The event's source, if ids repeat.")] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    output: OutputOption = None,
) -> None:
    """Inclusion proof of one event in its stream's tree at the latest log checkpoint (RFC 6962 shape)."""
    from runledger.ledger.integrity import prove_inclusion as prove

    with user_errors():
        doc = prove(ledger, event_id, source)
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
    """Consistency proof between two sizes of a stream's tree (RFC 6962 shape)."""
    from runledger.ledger.integrity import prove_consistency as prove

    with user_errors():
        doc = prove(ledger, stream, from_size, to_size)
    print_json(doc, output)
