"""`ledger producers add|rotate|revoke|list|policy`: the producer registry, kept as events in the log.

Each command appends one ``ledger.producer.*`` or ``ledger.policy.changed`` event to the ledger
(``runledger.ledger.registry``; ingest judges events by them in ``runledger.ledger.admission``), so who was allowed to
write what, and when that changed, is on the record. A ledger with no such event admits unsigned
events from every source, as before.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import (
    DEFAULT_LEDGER,
    FormatOption,
    FullOption,
    LedgerOption,
    OutputOption,
    console,
    fail,
    print_rows,
    user_errors,
)

PublicKeyOption = Annotated[
    Path,
    typer.Option("--public-key", help="The producer's public key file (<name>.pub from `ledger keys init`)."),
]
ActorOption = Annotated[str | None, typer.Option("--actor", help="Who made this change (kept in the event).")]


def _public_key(path: Path) -> tuple[str, str]:
    """The key text and its key id; a malformed key is a user error."""
    from runledger.schemas.note import parse_public_key
    from runledger.schemas.signing import key_id_of

    text = path.read_text().strip()
    return text, key_id_of(parse_public_key(text))


def _known_key(ledger: Path, key_id: str) -> None:
    from runledger.ledger.registry import producers
    from runledger.ledger.store import Ledger

    keys = producers(Ledger.open(ledger)).keys
    if key_id not in keys:
        raise fail(f"no producer key {key_id} in the registry (see `ledger producers list`)")
    if keys[key_id].revoked:
        raise fail(f"producer key {key_id} is already revoked")


def add(
    name: Annotated[str, typer.Argument(help="The producer's name, e.g. trainer, github-webhook.")],
    public_key: PublicKeyOption,
    source: Annotated[
        list[str],
        typer.Option(
            "--source",
            help="Source prefix it may write, matched by whole segments: trainer/r5 covers "
            "trainer/r5/a1/rank0, not trainer/r5-evil (repeatable; * for any; end with * for a plain "
            "string prefix).",
        ),
    ],
    stream: Annotated[
        list[str] | None,
        typer.Option("--stream", help="Stream prefix, by whole segments (repeatable; default any)."),
    ] = None,
    run: Annotated[
        list[str] | None,
        typer.Option("--run", help="A run it may write (its stream; repeatable; default any run)."),
    ] = None,
    event_type: Annotated[
        list[str] | None,
        typer.Option("--type", help="Event type prefix, by whole dotted parts (repeatable; default any)."),
    ] = None,
    valid_from: Annotated[
        datetime | None, typer.Option("--valid-from", help="Events before this time are refused.")
    ] = None,
    valid_until: Annotated[
        datetime | None, typer.Option("--valid-until", help="Events after this time are refused.")
    ] = None,
    actor: ActorOption = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Register a producer key and what it may write. From then on, this ledger refuses unsigned events
    except from sources `ledger producers policy --allow-unsigned` names."""
    from runledger.ledger.registry import register_producer
    from runledger.ledger.store import Ledger
    from runledger.schemas.payloads import ProducerScope

    with user_errors(ledger):
        scope = ProducerScope(
            sources=source,
            streams=[*(stream or []), *(run or [])],
            types=event_type or [],
            valid_from=_utc(valid_from),
            valid_until=_utc(valid_until),
        )
        key_id = register_producer(Ledger.open(ledger), name, public_key.read_text(), scope, actor=actor)
    runs = f", runs {', '.join(run)}" if run else ""
    console.print(f"registered producer {name}: key {key_id}, sources {', '.join(source)}{runs}")


def rotate(
    key_id: Annotated[str, typer.Argument(help="The key id to replace (see `ledger producers list`).")],
    public_key: PublicKeyOption,
    actor: ActorOption = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Replace a producer's key with a new one of the same scope; the old key is refused from here on."""
    from runledger.ledger.registry import append_registry_event
    from runledger.ledger.store import Ledger
    from runledger.schemas.payloads import ProducerRotated

    with user_errors(ledger):
        _known_key(ledger, key_id)
        text, new_id = _public_key(public_key)
        payload = ProducerRotated(old_key_id=key_id, public_key=text, key_id=new_id, actor=actor)
        append_registry_event(Ledger.open(ledger), payload)
    console.print(f"rotated {key_id} -> {new_id}")


def revoke(
    key_id: Annotated[str, typer.Argument(help="The key id to revoke (see `ledger producers list`).")],
    reason: Annotated[str, typer.Option("--reason", help="Why (kept in the event).")] = "",
    actor: ActorOption = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Refuse a producer key's events from this point of the log on (its earlier events still verify)."""
    from runledger.ledger.registry import append_registry_event
    from runledger.ledger.store import Ledger
    from runledger.schemas.payloads import ProducerRevoked

    with user_errors(ledger):
        _known_key(ledger, key_id)
        append_registry_event(Ledger.open(ledger), ProducerRevoked(key_id=key_id, reason=reason, actor=actor))
    console.print(f"revoked {key_id}")


def policy(
    allow_unsigned: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-unsigned",
            help="Source prefix whose events may be unsigned, by whole segments: trainer/unsigned "
            "does not cover trainer/unsigned-2 (repeatable; * for any).",
        ),
    ] = None,
    actor: ActorOption = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Set which sources may send unsigned events (shown as unauthenticated); none given: no source."""
    from runledger.ledger.registry import append_registry_event
    from runledger.ledger.store import Ledger
    from runledger.schemas.payloads import PolicyChanged

    with user_errors(ledger):
        append_registry_event(
            Ledger.open(ledger), PolicyChanged(unsigned_sources=allow_unsigned or [], actor=actor)
        )
    allowed = ", ".join(allow_unsigned or []) or "none"
    console.print(f"sources allowed unsigned: {allowed}")


def list_producers(
    ledger: LedgerOption = DEFAULT_LEDGER,
    fmt: FormatOption = None,
    output: OutputOption = None,
    full: FullOption = False,
) -> None:
    """The producer registry as of the ledger's last commit, and its unsigned-source policy."""
    from runledger.ledger.registry import producers
    from runledger.ledger.store import Ledger

    with user_errors(ledger):
        state = producers(Ledger.open(ledger))
    columns = ["key_id", "name", "status", "sources", "streams", "types", "valid_from", "valid_until"]
    rows = [
        [
            key.key_id,
            key.name,
            "revoked" if key.revoked else "active",
            ",".join(key.scope.sources),
            ",".join(key.scope.streams) or "*",
            ",".join(key.scope.types) or "*",
            key.scope.valid_from,
            key.scope.valid_until,
        ]
        for key in state.keys.values()
    ]
    if state.registry:
        title = f"producers (unsigned allowed from: {', '.join(state.unsigned_sources) or 'no source'})"
    else:
        title = "producers (no registry: every source may send unsigned events)"
    print_rows(columns, rows, fmt, output, title=title, full=full)


def export(
    out: Annotated[
        Path, typer.Option("--out", help="The file to write (JSON lines, one registry event each).")
    ],
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Save the registry and policy events with the points of the log they were made at, for a
    backup and for `ledger replay --registry-from FILE` (a replay from Kafka alone would lose them)."""
    from runledger.ledger.registry import registry_entries, write_registry_file
    from runledger.ledger.store import Ledger

    with user_errors(ledger):
        count = write_registry_file(registry_entries(Ledger.open(ledger)), out)
    console.print(f"wrote {count} registry event{'' if count == 1 else 's'} to {out}")


def _utc(value: datetime | None) -> datetime | None:
    from datetime import UTC

    return value if value is None or value.tzinfo is not None else value.replace(tzinfo=UTC)
