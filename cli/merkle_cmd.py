"""Tamper-evidence commands: `ledger keys init`, `checkpoint`, `verify`, `prove inclusion|consistency`.

A "checkpoint" here is a log checkpoint: a signed tree head (C2SP tlog-checkpoint in a signed note,
``runledger.ledger.log_checkpoint``) of one event stream's Merkle tree, not a model checkpoint.
"""

from __future__ import annotations

import base64
import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.output import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_LEDGER,
    FetchTimeoutOption,
    LedgerOption,
    OutputOption,
    console,
    err_console,
    fail,
    fetch_timeout_s,
    plural,
    print_json,
    progress,
    user_errors,
)

if TYPE_CHECKING:
    from runledger.ledger.log_key import LogKey
    from runledger.ledger.store import Ledger

# Default: the ledger's own key folder (``key_dir``), never the current directory's.
KeyDir = Annotated[
    Path | None,
    typer.Option(
        "--keys", envvar="RUNLEDGER_KEYS", help="Key directory (default: LEDGER/.keys).", show_default=False
    ),
]
_SAID_OLD_LAYOUT: set[Path] = set()  # key folders of the layout before, already said (once a process)


def key_dir(keys: Path | None, ledger: Path) -> Path:
    """``--keys`` when given, else the ledger's own (``runledger.ledger.log_key.default_keys``): said once, in
    a note, when that is a key folder of the layout before, beside the ledger."""
    from runledger.ledger.log_key import KEYS_DIR, default_keys

    if keys is not None:
        return keys
    found = default_keys(ledger)
    if found != ledger / KEYS_DIR and found not in _SAID_OLD_LAYOUT:
        _SAID_OLD_LAYOUT.add(found)
        err_console.print(
            f"note: using the key folder {found} beside the ledger (where keys were kept before); move "
            f"its files to {ledger / KEYS_DIR} to keep them with the ledger",
            highlight=False,
            markup=False,
        )
    return found


def _log_signing_key(ledger: Path | Ledger, keys: Path, name: str | None) -> str:
    """The private key a `ledger checkpoint`, `publish` or `redact` signs with: the ledger's log key,
    as its lake records it, from ``keys`` (``--name`` may only name that one); on a lake that records
    none yet (and on part files), chosen without guessing and then recorded (``_chosen_key``). A key
    folder without the ledger's key, or holding another, is one line naming the keys. ``ledger``: its
    folder, or the ledger open already (left open)."""
    from runledger.ledger.log_key import private_keys, recorded_log_key
    from runledger.ledger.store import Ledger

    found = private_keys(keys)
    with contextlib.nullcontext(ledger) if isinstance(ledger, Ledger) else Ledger.open(ledger) as opened:
        recorded = recorded_log_key(opened)
        if recorded is None:
            chosen = _chosen_key(opened, found, keys, name)
            return _as_the_ledgers(opened, chosen, keys)
        held = [k for k in _log_key_candidates(opened, found) if name is None or _key_name(k.vkey) == name]
        ours = next((k for k in held if k.vkey == recorded), None)
        if ours is None:
            raise fail(_wrong_key_line(opened.ledger_id, recorded, held, keys))
    return ours.path.read_text().strip()


def _key_name(vkey: str) -> str:
    from runledger.schemas.note import parse_public_key

    return parse_public_key(vkey).name


def _wrong_key_line(ledger_id: str, recorded: str, held: list[LogKey], keys: Path) -> str:
    from runledger.ledger.log_key import missing_key_line, other_key_line

    return (
        other_key_line(ledger_id, recorded, held, keys)
        if held
        else missing_key_line(ledger_id, recorded, keys)
    )


def _log_key_candidates(opened: Ledger, found: list[LogKey]) -> list[LogKey]:
    """The keys of ``found`` that may be a log key: not a producer key of the ledger."""
    from runledger.ledger.registry import producers

    registered = set(producers(opened).keys)
    return [key for key in found if key.fingerprint not in registered]


def _chosen_key(opened: Ledger, found: list[LogKey], keys: Path, name: str | None) -> LogKey:
    """The log key of a ledger whose lake records none, chosen without guessing: a key file is named
    after its key (``NAME.key``), producer keys of the ledger are never it, and among several the one
    that signed the ledger's checkpoints so far (or ``--name``) is; otherwise a one-line error."""
    from runledger.ledger.log_checkpoint import note_signers
    from runledger.ledger.stream_checkpoints import CHECKPOINTS

    if not found:
        raise fail(f"no .key key in {keys} (create one with `ledger keys init` or `ledger init`)")
    candidates = _log_key_candidates(opened, found)
    if name is not None:
        candidates = [k for k in candidates if _key_name(k.vkey) == name]
    if len(candidates) > 1:
        notes = (opened.root / CHECKPOINTS).glob("*.txt")
        signed = {s for note in notes for s in note_signers(note.read_text())}
        candidates = [k for k in candidates if k.fingerprint in signed] or candidates
    if len(candidates) != 1:
        names = ", ".join(k.path.name for k in (candidates or found))
        why = "several log keys" if candidates else "no log key (producer keys of this ledger are not)"
        raise fail(f"{why} in {keys}: {names}; pass --name NAME (the log key's name)")
    return candidates[0]


def _as_the_ledgers(opened: Ledger, key: LogKey, keys: Path) -> str:
    """``key``'s private text once the lake records it as the ledger's log key (recorded now when it
    records none); a one-line error naming both keys when it records another."""
    from runledger.ledger.log_key import other_key_line, record_log_key

    recorded = record_log_key(opened, key.vkey)
    if recorded != key.vkey:
        raise fail(other_key_line(opened.ledger_id, recorded, [key], keys))
    return key.path.read_text().strip()


def checked_log_key(ledger: Path, key_file: Path) -> str:
    """A private key file given by name (``ledger redact --key``): its text, when it is the ledger's
    log key (recorded as it when the lake records none yet); otherwise one line naming both keys."""
    from runledger.ledger.log_key import LogKey
    from runledger.ledger.store import Ledger
    from runledger.schemas.note import parse_private_key, public_key_of

    try:
        text = key_file.read_text()
        vkey = public_key_of(parse_private_key(text))
    except OSError as exc:
        raise fail(f"cannot read key {key_file}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a malformed key file
        raise fail(f"bad key {key_file}: {exc}") from None
    with Ledger.open(ledger) as opened:
        return _as_the_ledgers(opened, LogKey(key_file, vkey), key_file.parent)


def _public_keys(keys: Path) -> list[tuple[Path, str]]:
    """Every public key of the folder: its ``.pub`` files, and the public half of each ``.key`` file
    without one (a host brings only the ledger's private key file)."""
    from runledger.schemas.note import CheckpointError, parse_private_key, public_key_of

    if not keys.is_dir():
        return []
    found = [(path, path.read_text().strip()) for path in sorted(keys.glob("*.pub"))]
    for path in sorted(keys.glob("*.key")):
        try:
            vkey = public_key_of(parse_private_key(path.read_text()))
        except (CheckpointError, UnicodeDecodeError):
            continue  # not a key: nothing to verify with (signing with it says so)
        if all(text != vkey for _, text in found):
            found.append((path, vkey))
    return found


def keys_init(
    name: Annotated[str, typer.Option(help="Key name (appears in signature lines).")] = "runledger",
    keys: KeyDir = None,
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Create a key pair: NAME.key (owner-only, never printed) and NAME.pub (publish it), in --keys
    (default: the ledger's own key folder, LEDGER/.keys, made owner-only).

    Example: ledger keys init --name ci --keys ci-keys
    """
    from runledger.schemas.note import write_keypair

    keys = key_dir(keys, ledger)
    with user_errors():
        try:
            private, public = write_keypair(keys, name)
        except FileExistsError:
            raise fail(f"a key named {name} already exists in {keys}") from None
    console.print(f"private key: {private} (mode {oct(os.stat(private).st_mode & 0o777)})")
    console.print(f"public key:  {public}")


def checkpoint(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = None,
    name: Annotated[
        str | None, typer.Option("--name", help="The log key's name, when the folder holds several keys.")
    ] = None,
) -> None:
    """Sign a log checkpoint of each stream's current size and root (publish the files under <ledger>/_checkpoints).

    The key is the ledger's log key (its lake records it), from --keys (default: LEDGER/.keys).
    Example: ledger checkpoint
    """
    from runledger.ledger.store import Ledger
    from runledger.ledger.stream_checkpoints import sign_checkpoints

    with user_errors(ledger), Ledger.open(ledger) as opened:  # (once: the key is found in it, then signed)
        written = sign_checkpoints(opened, _log_signing_key(opened, key_dir(keys, ledger), name))
    console.print(f"signed {plural(len(written), 'stream checkpoint')} in {ledger / '_checkpoints'}")


# `ledger verify` exits 3 when it found nothing wrong but could not check every signed checkpoint.
UNVERIFIED_EXIT = 3


def verify(
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = None,
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="Public key file (the log checkpoints' signer).")
    ] = None,
    remote: Annotated[
        str | None,
        typer.Option(
            "--remote",
            help="Check a published copy at this URL or s3://bucket/prefix instead (needs --log-key).",
        ),
    ] = None,
    log_key: Annotated[
        str | None,
        typer.Option("--log-key", help="With --remote: the log's public key (a vkey or a .pub file)."),
    ] = None,
    witness: Annotated[
        list[str] | None,
        typer.Option("--witness", help="With --remote: a witness's cosignature vkey (repeat)."),
    ] = None,
    quorum: Annotated[
        int | None,
        typer.Option("--quorum", help="With --remote: valid cosignatures required (default: all)."),
    ] = None,
    state: Annotated[
        Path | None,
        typer.Option(
            "--state",
            help="With --remote: the last verified checkpoint (default under .runledger/remote-verify).",
        ),
    ] = None,
    fetch_timeout: FetchTimeoutOption = DEFAULT_FETCH_TIMEOUT_S,
) -> None:
    """Check the whole ledger against its Merkle trees and latest log checkpoints; name every bad event.

    With --remote URL --log-key VKEY: check a copy published by `ledger publish` (signature, witness
    quorum, consistency with the last checkpoint verified from here, every new entry, every new data
    file), in bounded memory and only what is new since the last run (state kept in --state), all
    within --fetch-timeout seconds (redirects followed only to the same server; each data file read no
    further than the bytes the signed manifest gives it). An
    s3://bucket/prefix copy is read with the server and credentials of AWS_ENDPOINT_URL,
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION.

    Exit status: 0 all checked and OK; 1 a problem found, or a checkpoint signed by none of the keys
    tried (said as that, with the signer's and the tried keys' names: with --keys DIR each checkpoint is
    checked with the key it names, and never with a producer key of the ledger); 3 nothing wrong
    found, but signed log checkpoints are on disk that were not checked (no public key: pass
    --public-key or --keys).

    Example: ledger verify --ledger .runledger/demo/ledger   (its log key is in <ledger>/.keys)
    """
    if remote is not None:
        _verify_remote(remote, log_key, witness or [], quorum, state, fetch_timeout_s(fetch_timeout))
        return
    from runledger.ledger.integrity import verify_ledger
    from runledger.ledger.stream_checkpoints import CHECKPOINTS

    with user_errors(ledger), progress("verify", "events") as shown:
        if public_key is not None:
            tried = [(public_key, public_key.read_text().strip())]
        else:  # every key of the folder is tried: each checkpoint is checked with the one it names
            keys = key_dir(keys, ledger)
            tried = _public_keys(keys)
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


def _vkey(text: str) -> str:
    """A public key given inline or as a .pub file, checked (exit 2 with one line if it is not one)."""
    from runledger.schemas.note import CheckpointError, parse_public_key

    key = Path(text).read_text().strip() if Path(text).is_file() else text
    try:
        parse_public_key(key)
    except CheckpointError as exc:
        raise fail(f"bad key: {exc}", 2) from None
    return key


def _verify_remote(
    url: str,
    log_key: str | None,
    witnesses: list[str],
    quorum: int | None,
    state: Path | None,
    timeout_s: float,
) -> None:
    from runledger.ledger.monitor import MonitorError
    from runledger.ledger.remote import default_state_path, verify_remote
    from runledger.ledger.witness import parse_cosignature_key
    from runledger.schemas.note import CheckpointError

    if log_key is None:
        raise fail("--remote needs --log-key VKEY (the published log's public key)", 2)
    key = _vkey(log_key)
    try:
        for vkey in witnesses:
            parse_cosignature_key(vkey)
        report = verify_remote(
            url,
            key,
            state or default_state_path(url),
            witnesses=witnesses,
            quorum=len(witnesses) if quorum is None else quorum,
            deadline_s=timeout_s,
        )
    except (MonitorError, CheckpointError) as exc:
        raise fail(f"FAILED {exc}") from None
    if report.old_size == report.size:
        console.print(f"OK {report.origin}: size {report.size}, nothing new", highlight=False, markup=False)
        return
    since = "from nothing" if report.old_size is None else f"since size {report.old_size}"
    console.print(
        f"OK {report.origin}: size {report.size}; {plural(report.entries, 'new entry', 'new entries')} "
        f"and {plural(report.files, 'data file')} checked {since}",
        highlight=False,
        markup=False,
    )


def _leaf_bytes(ledger: Path, doc: dict) -> bytes:
    """The canonical bytes of the event a proof is for: the leaf the verifier hashes itself."""
    from runledger.ledger.merkle import leaf_hash
    from runledger.ledger.query import Reader

    with Reader(ledger) as reader:
        rows = reader.sql(
            "SELECT canonical FROM events WHERE stream = ? AND stream_seq = ?",
            [doc["stream"], doc["leaf_index"]],
        ).rows
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
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="json (the stream's tree) or tlog-proof (C2SP, the published whole-ledger log; needs --published).",
        ),
    ] = "json",
    published: Annotated[
        Path | None,
        typer.Option("--published", help="With --format tlog-proof: the DEST folder `ledger publish` wrote."),
    ] = None,
    salt_out: Annotated[
        Path | None,
        typer.Option(
            "--salt-out",
            help="With --format tlog-proof: write the event's salt (hex) its entry's digest needs.",
        ),
    ] = None,
) -> None:
    """Inclusion proof of one event in its stream's tree at the latest log checkpoint (RFC 6962 shape).

    The proof carries the leaf's bytes (the event's canonical JSON, in "leaf"), so the verifier
    hashes the leaf itself and reads the event's id, source and stream from it. With --format
    tlog-proof --published DEST: an offline proof (c2sp.org/tlog-proof@v1) of the event's entry in
    the published whole-ledger log at its published checkpoint; check it with `ledger verify-proof`.

    Example: ledger prove inclusion run-a-42 -o proof.json --leaf-out leaf.json
    """
    if fmt == "tlog-proof":
        _prove_tlog(ledger, event_id, source, published, output, leaf_out)
        if salt_out is not None:
            _write_atomically(salt_out, _salt_hex_of(ledger, event_id, source).encode())
        return
    if fmt != "json":
        raise fail(f"--format is json or tlog-proof, not {fmt!r}", 2)
    from runledger.ledger.integrity import prove_inclusion as prove

    with user_errors(ledger):
        doc = prove(ledger, event_id, source)
        leaf = None if "redacted" in doc else _leaf_bytes(ledger, doc)
    if leaf is None:  # its bytes are gone (`ledger redact`): the proof carries the recorded leaf hash
        if leaf_out is not None:
            raise fail(f"event {event_id} is redacted ({doc['redacted']}): it has no leaf bytes to write")
    else:
        doc["leaf"] = leaf.decode("utf-8")
    if leaf_out is not None and leaf is not None:
        with user_errors():
            tmp = leaf_out.with_name(leaf_out.name + f".{os.getpid()}.part")
            tmp.write_bytes(leaf)
            tmp.replace(leaf_out)
    print_json(doc, output)


def _write_atomically(path: Path, data: bytes) -> None:
    with user_errors():
        tmp = path.with_name(path.name + f".{os.getpid()}.part")
        tmp.write_bytes(data)
        tmp.replace(path)


def _prove_tlog(
    ledger: Path,
    event_id: str,
    source: str | None,
    dest: Path | None,
    output: Path | None,
    leaf_out: Path | None,
) -> None:
    from runledger.ledger.remote import RemoteError, prove_published

    if dest is None:
        raise fail("--format tlog-proof needs --published DEST (the folder `ledger publish` wrote)", 2)
    with user_errors(ledger):
        try:
            text = prove_published(ledger, dest, event_id, source)
        except (RemoteError, OSError) as exc:
            raise fail(str(exc)) from None
        leaf = _leaf_bytes_of(ledger, event_id, source) if leaf_out is not None else b""
    if leaf_out is not None:
        _write_atomically(leaf_out, leaf)
    if output is None:
        typer.echo(text, nl=False)
    else:
        _write_atomically(output, text.encode())


def _salt_hex_of(ledger: Path, event_id: str, source: str | None) -> str:
    """The event's salt in hex ("" for an event stored before salts)."""
    from runledger.ledger.redaction import find_event, salt_of, stored_rows
    from runledger.ledger.store import Ledger

    with user_errors(ledger), Ledger.open(ledger) as opened:
        stored = stored_rows(opened)
        target = find_event(stored, event_id, source)
        salt = salt_of(stored, target.stream, target.stream_seq)
    return salt.hex() if salt else ""


def _leaf_bytes_of(ledger: Path, event_id: str, source: str | None) -> bytes:
    from runledger.ledger.query import Reader

    where, params = ("id = ? AND source = ?", [event_id, source]) if source else ("id = ?", [event_id])
    with Reader(ledger) as reader:
        rows = reader.sql(f"SELECT canonical FROM events WHERE {where}", params).rows
    return str(rows[0][0]).encode()


def verify_proof(
    proof: Annotated[
        Path,
        typer.Argument(help="A .tlog-proof file written by `ledger prove inclusion --format tlog-proof`."),
    ],
    log_key: Annotated[str, typer.Option("--log-key", help="The log's public key (a vkey or a .pub file).")],
    origin: Annotated[
        str | None,
        typer.Option("--origin", help="The log's origin the proof must be for (runledger/<ledger id>)."),
    ] = None,
    leaf: Annotated[
        Path | None,
        typer.Option(
            "--leaf", help="The event's canonical bytes: checked against the SHA-256 the entry commits to."
        ),
    ] = None,
    salt: Annotated[
        str | None,
        typer.Option(
            "--salt", help="With --leaf: the event's salt, hex or a file (`prove inclusion --salt-out`)."
        ),
    ] = None,
) -> None:
    """Check a C2SP tlog-proof offline: the checkpoint's signature, then the entry's inclusion in it.

    Exit status 1 with one line if any part does not check. Example: ledger verify-proof e.tlog-proof --log-key log.pub
    """
    import json

    from runledger.ledger.redaction import entry_matches
    from runledger.ledger.remote import RemoteError, verify_tlog_proof

    key = _vkey(log_key)
    with user_errors():
        text = proof.read_text()
        try:
            proven = verify_tlog_proof(text, key, origin)
            entry = json.loads(proven.entry)
            if leaf is not None and not entry_matches(entry, leaf.read_bytes(), _salt_arg(salt)):
                raise RemoteError(f"{leaf} is not the event the proven entry commits to")
        except (RemoteError, ValueError) as exc:
            raise fail(f"FAILED {exc}") from None
    what = f"event {entry.get('id')} ({entry.get('type')}, {entry.get('stream')} #{entry.get('stream_seq')})"
    console.print(
        f"OK: entry {proven.index} of {proven.checkpoint.origin} at size {proven.checkpoint.size} is "
        f"{what if entry.get('t') == 'event' else entry.get('t')}",
        highlight=False,
        markup=False,
    )


def _salt_arg(salt: str | None) -> bytes | None:
    """``--salt``: hex, or a file holding it; None when not given or empty (an unsalted event)."""
    if salt is None:
        return None
    text = Path(salt).read_text().strip() if Path(salt).is_file() else salt.strip()
    try:
        return bytes.fromhex(text) or None
    except ValueError:
        raise fail(f"--salt {salt!r} is not hex (nor a file holding hex)", 2) from None


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
    from runledger.ledger.integrity import prove_consistency as prove

    with user_errors(ledger):
        doc = prove(ledger, stream, from_size, to_size)
    print_json(doc, output)
