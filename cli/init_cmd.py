"""`ledger init`: a lab's ledger, its log key and its producer registry, before the first event.

The ledger is created empty; the log key (``NAME.key``, owner-only, and ``NAME.pub``) signs its log
checkpoints (``ledger checkpoint``); the registry starts as one ``ledger.policy.changed`` event, so
from the first event on only registered producers (``ledger producers add``) and the sources named
by ``--allow-unsigned`` are admitted. Run again, it changes nothing and says so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.merkle_cmd import DEFAULT_KEYS, KeyDir
from cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, plural, user_errors

if TYPE_CHECKING:
    from ledger.store import Ledger


def init(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = DEFAULT_KEYS,
    name: Annotated[
        str, typer.Option(help="The log key's name (appears in checkpoint signatures).")
    ] = "runledger",
    allow_unsigned: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-unsigned",
            help="Source prefix whose events may come unsigned, by whole segments (repeatable; * for any).",
        ),
    ] = None,
    actor: Annotated[
        str | None, typer.Option("--actor", help="Who set the ledger up (kept in the event).")
    ] = None,
    catalog: Annotated[
        str | None,
        typer.Option(
            "--catalog",
            help="Put the ledger on DuckLake with this catalog: duckdb:PATH (one process), sqlite:PATH "
            "(one host) or postgres:DSN (many hosts). A folder on another host joins the same lake.",
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="With --catalog: where the lake's Parquet files go, a folder or s3://bucket/prefix "
            "(server and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...; default: LEDGER/data).",
        ),
    ] = None,
) -> None:
    """Create a ledger, its log key and its producer registry (before the first event).

    Example: ledger init --ledger .runledger/ledger --keys .runledger/keys
    """
    from ledger.registry import RegistryRaced, append_registry_event, registry_entries
    from ledger.store import Ledger
    from schemas.note import write_keypair
    from schemas.payloads import PolicyChanged

    with user_errors(ledger):
        existing = _existing(ledger)
        if existing is not None and (registry_entries(existing) or existing.last_commit >= 0):
            # Set up already, or in use: a policy now would start refusing what it admits today.
            registry = "its registry started" if registry_entries(existing) else "no registry yet"
            console.print(
                f"a ledger already exists at {ledger} (id {existing.ledger_id}, {registry}): nothing changed",
                highlight=False,
            )
            return
        key_path = keys / f"{name}.pub"
        created_key = not key_path.exists()
        if created_key:
            write_keypair(keys, name)
        if data is not None and catalog is None:
            raise fail("--data needs --catalog", 2)
        if existing is not None:
            store = existing
        elif catalog is not None:
            store = Ledger.create_on_lake(ledger, catalog, data)
            if store.last_commit >= 0:  # a lake another folder set up: this one joins it as it is
                console.print(
                    f"joined ledger {store.ledger_id} on {catalog} from {ledger} "
                    f"({plural(store.last_commit + 1, 'commit')} so far): nothing changed",
                    highlight=False,
                )
                return
        else:
            store = Ledger.create(ledger)
        try:
            append_registry_event(store, PolicyChanged(unsigned_sources=allow_unsigned or [], actor=actor))
        except RegistryRaced:
            if catalog is None:
                raise
            # Another folder set the same new lake up at the same time, and its policy landed first.
            console.print(
                f"joined ledger {store.ledger_id} on {catalog} from {ledger}: another folder set it up "
                "at the same time, with its own policy (`ledger producers list` shows it): nothing changed",
                highlight=False,
            )
            return
    made = "created" if existing is None else "set up"
    key_said = f"log key {key_path} (new)" if created_key else f"log key {key_path} (kept)"
    unsigned = ", ".join(allow_unsigned or []) or "none"
    console.print(
        f"{made} ledger {ledger} (id {store.ledger_id}); {key_said}; registry started "
        f"(sources allowed unsigned: {unsigned}; add producers with `ledger producers add`)",
        highlight=False,
    )


def _existing(path: Path) -> Ledger | None:
    """The ledger at ``path`` if there is one; None if the place is free; a one-line error if it is
    something else (a file, or a folder holding other things)."""
    from ledger.store import Ledger

    if (path / "LEDGER.json").is_file() or (path / "LAKE.json").is_file():
        return Ledger.open(path)
    if path.exists() and not path.is_dir():
        raise fail(f"{path} is a file, not a ledger folder")
    if path.is_dir() and any(path.iterdir()):
        raise fail(f"{path} holds other files and no ledger (LEDGER.json): choose an empty or new folder")
    return None
