"""The ledger's log key: where its private half lives, and the public half a lake records.

The log key signs the ledger's checkpoints, its published log and its redaction records. Its private
file lives with the ledger, in ``<ledger>/.keys`` (``default_keys``: made with mode 0700, key files
0600), never in the current directory; nothing that copies a ledger (``ledger publish``, ``views``,
``migrate``) reads that folder, as each copies only the tables and files it names.

A ledger on DuckLake records its log key's public half (the note vkey) in the lake's shared state
(``LOG_KEY_STATE``) when ``ledger init`` makes it, or at the first ``checkpoint``, ``publish`` or
``redact``. Every host that joins the lake signs with that key: a host without it is told which key
to bring and where to put it (``missing_key_line``), and a host holding another key is told both
fingerprints (``other_key_line``), before anything is signed.

The defaults before keys lived with the ledger kept them beside it: ``.runledger/ledger`` and
``.runledger/keys``. A ledger folder ``.runledger/ledger`` whose own ``.keys`` holds no private key,
beside a ``.runledger/keys`` that holds one, uses that folder (``old_layout_keys`` says when, so the
command can say so); any other ledger's default is its own ``.keys``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runledger.schemas.note import (
    CheckpointError,
    NoteSigner,
    key_stem,
    parse_private_key,
    parse_public_key,
    public_key_of,
)
from runledger.schemas.signing import key_id_of

if TYPE_CHECKING:
    from runledger.ledger.store import Ledger

__all__ = [
    "KEYS_DIR",
    "LOG_KEY_STATE",
    "LogKey",
    "default_keys",
    "fingerprint",
    "log_key_in",
    "missing_key_line",
    "old_layout_keys",
    "other_key_line",
    "private_keys",
    "record_log_key",
    "recorded_log_key",
]

KEYS_DIR = ".keys"  # in the ledger folder: hidden, and never a table or file a copy names
OLD_LAYOUT = (".runledger", "ledger")  # the default ledger before: .runledger/ledger beside...
OLD_KEYS_NAME = "keys"  # ... .runledger/keys
LOG_KEY_STATE = "log_key"  # the lake state key holding the log key's vkey
# A pseudo-source fence (``ledger/...``, never a position): of two hosts recording at once, one wins.
LOG_KEY_FENCE = "ledger/log-key"


@dataclass(frozen=True)
class LogKey:
    """A private key file and the vkey of its public half."""

    path: Path
    vkey: str

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.vkey)


def fingerprint(vkey: str) -> str:
    """``<name>+<8 hex key hash>``: how a note key is named in signatures and in our one-line errors."""
    return key_id_of(parse_public_key(vkey))


def _holds_private_key(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.key"))


def old_layout_keys(ledger: Path) -> Path | None:
    """The sibling ``keys`` folder of the layout before (``.runledger/ledger`` + ``.runledger/keys``)
    when it is the one to use: the ledger's own ``.keys`` holds no private key and it holds one."""
    if (ledger.parent.name, ledger.name) != OLD_LAYOUT or _holds_private_key(ledger / KEYS_DIR):
        return None
    old = ledger.parent / OLD_KEYS_NAME
    return old if _holds_private_key(old) else None


def default_keys(ledger: Path) -> Path:
    """The key folder a command uses when not given one: ``<ledger>/.keys`` (or ``old_layout_keys``)."""
    return old_layout_keys(ledger) or ledger / KEYS_DIR


def private_keys(folder: Path) -> list[LogKey]:
    """Every private key file in ``folder`` (``*.key``), in name order; a one-line ValueError for a
    file that is not a note private key."""
    found = []
    for path in sorted(folder.glob("*.key")) if folder.is_dir() else ():
        try:
            signer: NoteSigner = parse_private_key(path.read_text())
        except (CheckpointError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not a private key: {exc}") from None
        found.append(LogKey(path, public_key_of(signer)))
    return found


def log_key_in(folder: Path, vkey: str) -> LogKey | None:
    """The private key file in ``folder`` whose public half is ``vkey``, if there is one."""
    return next((key for key in private_keys(folder) if key.vkey == vkey), None)


# ----------------------------------------------------------------- the lake's record
def recorded_log_key(ledger: Ledger) -> str | None:
    """The log key's vkey the ledger's lake records; None for a lake that records none yet (made
    before keys were recorded, or by an ingest without ``ledger init``) and for part files."""
    if ledger.lake is None:
        return None
    value = ledger.lake.state().get(LOG_KEY_STATE)
    return value if isinstance(value, str) else None


def record_log_key(ledger: Ledger, vkey: str) -> str:
    """Record ``vkey`` as the ledger's log key unless the lake records one already; the key recorded
    (another host's, when it recorded first). A ledger of part files records nothing: ``vkey``."""
    parse_public_key(vkey)  # never record what is not a key
    if ledger.lake is None:
        return vkey
    recorded = recorded_log_key(ledger)
    if recorded is not None:
        return recorded
    # One fenced commit of the state key alone: of two racing hosts the engine lets one through.
    done = ledger.lake.commit({}, {LOG_KEY_FENCE: (0, 1)}, {LOG_KEY_STATE: vkey}, writer="log-key")
    winner = vkey if done.ok else recorded_log_key(ledger)
    if winner is None:  # the fence moved in the commit that recorded a key: never without one
        raise ValueError(f"the lake of ledger {ledger.ledger_id} fenced its log key but records none")
    return winner


# ----------------------------------------------------------------- what a host is told
def missing_key_line(ledger_id: str, vkey: str, folder: Path) -> str:
    """The one line for a host whose key folder lacks the ledger's log key: which key, and where to."""
    target = folder / f"{key_stem(parse_public_key(vkey).name)}.key"
    return (
        f"ledger {ledger_id} signs with log key {fingerprint(vkey)} (public key {vkey}), which is not in "
        f"{folder}: copy its private key file from a host that has it to {target} (mode 0600), or pass "
        "--keys DIR holding it"
    )


def other_key_line(ledger_id: str, vkey: str, keys: list[LogKey], folder: Path) -> str:
    """The one line for a host whose log key is not the ledger's: both fingerprints, and the way out."""
    held = ", ".join(key.fingerprint for key in keys)
    target = folder / f"{key_stem(parse_public_key(vkey).name)}.key"
    return (
        f"the log key in {folder} is {held}, not ledger {ledger_id}'s log key {fingerprint(vkey)}: "
        f"copy that key's private file from a host that has it to {target}, or pass --keys DIR holding it"
    )
