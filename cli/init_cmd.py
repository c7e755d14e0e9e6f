"""`ledger init`: a lab's ledger, its log key and its producer registry, before the first event.

The ledger is created empty; the log key (``NAME.key``, owner-only, and ``NAME.pub``, in the ledger's
own key folder ``LEDGER/.keys`` unless ``--keys`` names another) signs its log checkpoints (``ledger
checkpoint``), and the lake records its public half (``runledger.ledger.log_key``); the registry starts as one
``ledger.policy.changed`` event, so from the first event on only registered producers (``ledger
producers add``) and the sources named by ``--allow-unsigned`` are admitted. Run again, it changes
nothing and says so in one line.

A folder on another host that joins the lake (the same ``--catalog``) makes no key of its own: it uses
the ledger's log key when its key folder holds it, and otherwise exits 1 with one line naming that
key and the path to copy it to.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.merkle_cmd import KeyDir, key_dir
from runledger.cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, plural, user_errors

if TYPE_CHECKING:
    from runledger.ledger.log_key import LogKey
    from runledger.ledger.store import Ledger


def init(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = None,
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
            help="Put the ledger on DuckLake with this catalog: sqlite:PATH (one host) or postgres:DSN "
            "(many hosts). A folder on another host joins the same lake.",
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

    Example: ledger init --ledger .runledger/ledger
    """
    from runledger.ledger.registry import RegistryRaced, append_registry_event, registry_entries
    from runledger.schemas.payloads import PolicyChanged

    if data is not None and catalog is None:
        raise fail("--data needs --catalog", 2)
    keys = key_dir(keys, ledger)
    # (Each ledger opened here is closed when init ends: an open one held the SQLite catalog's WAL
    # files beside it, so "init again changes nothing" was not true while the process lived.)
    with user_errors(ledger), contextlib.ExitStack() as opened:
        existing = _existing(ledger)
        if existing is not None:
            opened.callback(existing.close)
        if existing is not None and (registry_entries(existing) or existing.last_commit >= 0):
            # Set up already, or in use: a policy now would start refusing what it admits today.
            _say_exists(existing, ledger, keys, bool(registry_entries(existing)))
            return
        store = existing if existing is not None else _new_ledger(ledger, catalog, data)
        if existing is None:
            opened.callback(store.close)
        if existing is None and catalog is not None and store.last_commit >= 0:
            _say_joined(store, ledger, catalog, keys)  # a lake another folder set up: joined as it is
            return
        key, key_said = _the_log_key(store, keys, name)
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
    unsigned = ", ".join(allow_unsigned or []) or "none"
    console.print(
        f"{made} ledger {ledger} (id {store.ledger_id}); log key {key} ({key_said}); registry started "
        f"(sources allowed unsigned: {unsigned}; add producers with `ledger producers add`)",
        highlight=False,
    )


def _new_ledger(ledger: Path, catalog: str | None, data: str | None) -> Ledger:
    """The ledger made at ``ledger``: on ``catalog`` when given (or joined: another folder's lake),
    else a lake with its catalog in the folder."""
    from runledger.ledger.store import Ledger

    return Ledger.create(ledger) if catalog is None else Ledger.create_on_lake(ledger, catalog, data)


def _the_ledgers_key(store: Ledger, keys: Path) -> LogKey | None:
    """The ledger's log key from ``keys`` when its lake records one (a one-line error naming it and
    where to copy it when ``keys`` lacks it); None when the lake records none."""
    from runledger.ledger.log_key import log_key_in, missing_key_line, recorded_log_key

    recorded = recorded_log_key(store)
    if recorded is None:
        return None
    held = log_key_in(keys, recorded)
    if held is None:
        raise fail(missing_key_line(store.ledger_id, recorded, keys))
    return held


def _the_log_key(store: Ledger, keys: Path, name: str) -> tuple[Path, str]:
    """A new ledger's log key: the one its lake records (another folder's init got there first), or
    NAME's in ``keys`` (made now if missing) recorded as it. Returns the key file to show and how it
    came (new, kept, the ledger's)."""
    from runledger.ledger.log_key import LogKey, missing_key_line, record_log_key
    from runledger.schemas.note import key_stem, parse_private_key, public_key_of, write_keypair

    held = _the_ledgers_key(store, keys)
    if held is not None:
        return held.path, "the ledger's"
    private, public = keys / f"{key_stem(name)}.key", keys / f"{key_stem(name)}.pub"
    created = not public.exists()
    if created:
        write_keypair(keys, name)
    elif not private.is_file():
        raise fail(f"{public} has no private key beside it ({private}): bring it, or pass --keys DIR")
    key = LogKey(private, public_key_of(parse_private_key(private.read_text())))
    recorded = record_log_key(store, key.vkey)
    if recorded != key.vkey:  # another folder's init recorded its own key first: ours is no use
        if created:
            private.unlink(missing_ok=True)
            public.unlink(missing_ok=True)
        raise fail(missing_key_line(store.ledger_id, recorded, keys))
    return public, "new" if created else "kept"


def _say_exists(existing: Ledger, ledger: Path, keys: Path, registry_started: bool) -> None:
    """The one line of an init on a ledger that is set up or in use (its log key checked first)."""
    registry = "its registry started" if registry_started else "no registry yet"
    held = _the_ledgers_key(existing, keys)
    key = "" if held is None else f"; log key {held.path}, the ledger's"
    console.print(
        f"a ledger already exists at {ledger} (id {existing.ledger_id}, {registry}{key}): nothing changed",
        highlight=False,
    )


def _say_joined(store: Ledger, ledger: Path, catalog: str, keys: Path) -> None:
    """The one line of a folder joining a lake in use: with the ledger's log key, or told to bring it."""
    held = _the_ledgers_key(store, keys)
    if held is None:
        key = (
            "it records no log key yet: the first `ledger checkpoint` or `publish` on any host "
            "records the key it signs with"
        )
    else:
        key = f"log key {held.path} (the ledger's)"
    console.print(
        f"joined ledger {store.ledger_id} on {catalog} from {ledger} "
        f"({plural(store.last_commit + 1, 'commit')} so far): nothing changed; {key}",
        highlight=False,
    )


def _existing(path: Path) -> Ledger | None:
    """The ledger at ``path`` if there is one; None if the place is free; a one-line error if it is
    something else (a file, or a folder holding other things)."""
    from runledger.ledger.log_key import KEYS_DIR
    from runledger.ledger.store import Ledger

    if (path / "LEDGER.json").is_file() or (path / "LAKE.json").is_file():
        return Ledger.open(path)
    if path.exists() and not path.is_dir():
        raise fail(f"{path} is a file, not a ledger folder")
    # Its key folder may come first: a host joining a lake brings the ledger's log key before init.
    if path.is_dir() and any(p.name != KEYS_DIR for p in path.iterdir()):
        raise fail(f"{path} holds other files and no ledger (LEDGER.json): choose an empty or new folder")
    return None
