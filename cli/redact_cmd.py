"""`ledger redact EVENT_ID`: erase one event's payload and salt; its proofs and log entries stay valid."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.merkle_cmd import KeyDir, _log_signing_key, checked_log_key, key_dir
from runledger.cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, user_errors


def redact(
    event_id: Annotated[str, typer.Argument(metavar="EVENT_ID", help="The id of the event to erase.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (kept in the signed redaction record).")],
    actor: Annotated[str, typer.Option("--actor", help="Who asks for it (kept in the record).")],
    key: Annotated[
        Path | None,
        typer.Option(
            "--key",
            help="The log's private key file (default: the ledger's log key in --keys, LEDGER/.keys).",
        ),
    ] = None,
    source: Annotated[str | None, typer.Option("--source", help="The event's source, if ids repeat.")] = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = None,
) -> None:
    """Remove an event's payload and salt from the ledger's files and append a signed redaction record.

    The event keeps its place: every inclusion and consistency proof, and every published log entry,
    still verifies; `ledger verify` reports the redaction and its reason, `ledger history` and
    `ledger state` mark it, and the next `ledger publish` removes the old files from DEST.
    Example: ledger redact evt-0042 --reason "API token in the config" --actor alice
    """
    from runledger.ledger.redaction import redact as redact_event

    with user_errors(ledger):
        if key is not None:
            private = checked_log_key(ledger, key)
        else:
            private = _log_signing_key(ledger, key_dir(keys, ledger), None)
        try:
            done = redact_event(
                ledger, event_id, reason=reason, actor=actor, private_key=private, source=source
            )
        except ValueError as exc:  # a malformed key file
            raise fail(f"bad key: {exc}") from None
    t = done.target
    console.print(
        f"redacted {t.type} {t.id} (stream {t.stream} #{t.stream_seq}) in commit {done.commit}: "
        f"{done.rewritten} file(s) rewritten, record {done.record_id}",
        highlight=False,
        markup=False,
    )
