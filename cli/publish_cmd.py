"""`ledger publish DEST` and `ledger monitor URL`: the ledger as a public tile log, and a follower of one.

DEST is a folder or ``s3://bucket/prefix`` (``runledger.ledger.publish_dest``; the S3 server and credentials
from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.merkle_cmd import (
    DEFAULT_FETCH_TIMEOUT_S,
    FetchTimeoutOption,
    KeyDir,
    _log_signing_key,
    fetch_timeout_s,
    key_dir,
)
from runledger.cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, plural, user_errors


@contextmanager
def _one_line(ledger: Path) -> Iterator[None]:
    """``user_errors``, and this module's own refusals (ValueError: PublishError, CheckpointError, a bad
    witness or quorum) as one line each, whatever ``user_errors`` does with them."""
    with user_errors(ledger):
        try:
            yield
        except ValueError as exc:
            raise fail(str(exc)) from None


def _destination(dest: str) -> str:
    """DEST as given (a folder, or s3://bucket/prefix), checked before anything is read or written."""
    from runledger.ledger.publish_dest import DestError, parse_s3_url

    if "://" not in dest:
        return dest
    if not dest.startswith("s3://"):
        raise fail(f"DEST {dest!r}: give a folder or s3://bucket/prefix", 2)
    try:
        parse_s3_url(dest)
    except DestError as exc:
        raise fail(str(exc), 2) from None
    return dest


def publish(
    dest: Annotated[
        str,
        typer.Argument(
            help="Folder to publish to (serve it with any static HTTP server), or s3://bucket/prefix "
            "(server and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)."
        ),
    ],
    ledger: LedgerOption = DEFAULT_LEDGER,
    keys: KeyDir = None,
) -> None:
    """Publish the ledger as one C2SP tlog-tiles log (checkpoint, tiles, bundles) plus its Parquet files and a signed manifest.

    Incremental and safe to kill: run it again after every ingest (a publish cut short, by a kill or
    a store that went away, is finished by the next). The trusted state (what was last published) is
    kept beside the ledger, never in DEST; so is its key folder (LEDGER/.keys, the default --keys),
    as only the log's own files and the tables' Parquet files are copied.
    Example: ledger publish site/log
    Example: AWS_ENDPOINT_URL=http://127.0.0.1:7070 ledger publish s3://public/runledger
    """
    from runledger.ledger.publish import publish as publish_log
    from runledger.ledger.store import Ledger
    from runledger.ledger.witness import WitnessRefused

    dest = _destination(dest)
    with _one_line(ledger), Ledger.open(ledger) as opened:  # (once: the key is found in it, then published)
        try:
            result = publish_log(opened, dest, _log_signing_key(opened, key_dir(keys, ledger), None))
        except WitnessRefused as exc:
            console.print(f"REFUSED BY A WITNESS: {exc}", style="bold red", highlight=False, markup=False)
            raise typer.Exit(1) from None
    for name, what in result.witnesses.items():
        console.print(f"witness {name}: {what}", highlight=False, markup=False)
    if result.repaired:
        console.print("finished the upload an earlier publish left half done", highlight=False)
    if result.entries == 0:
        console.print(f"up to date: {dest}/checkpoint is at size {result.size}", highlight=False)
        return
    console.print(
        f"published {plural(result.entries, 'entry', 'entries')} ({plural(result.events, 'event')}, "
        f"{plural(result.files_copied, 'data file')}): log size {result.old_size} -> {result.size}, "
        f"{dest}/checkpoint",
        highlight=False,
    )


def monitor(
    url: Annotated[str, typer.Argument(help="Base URL of a published log (where its checkpoint is).")],
    log_key: Annotated[str, typer.Option("--log-key", help="The log's public key: a vkey, or a .pub file.")],
    state: Annotated[
        Path, typer.Option("--state", help="Where the last accepted checkpoint is kept.")
    ] = Path(".runledger/monitor/state.json"),
    every: Annotated[float, typer.Option("--every", help="Seconds between checks (0: check once).")] = 0.0,
    times: Annotated[
        int, typer.Option("--times", help="How many checks with --every (0: until stopped).")
    ] = 0,
    witness: Annotated[
        list[str] | None, typer.Option("--witness", help="A witness's cosignature vkey (repeat for several).")
    ] = None,
    quorum: Annotated[
        int | None, typer.Option("--quorum", help="Valid cosignatures required (default: every --witness).")
    ] = None,
    entries: Annotated[
        bool,
        typer.Option(
            "--entries", help="Also walk every new entry and check new data files against the manifest."
        ),
    ] = False,
    fetch_timeout: FetchTimeoutOption = DEFAULT_FETCH_TIMEOUT_S,
) -> None:
    """Follow a published log: check each new checkpoint's signature and its consistency with the last one seen.

    Exit status 1 on a fork, a rollback or a bad signature. Example: ledger monitor http://127.0.0.1:8000/ --log-key log.pub
    """
    import time

    from runledger.ledger.monitor import MonitorError, check_log
    from runledger.ledger.witness import parse_cosignature_key
    from runledger.schemas.note import CheckpointError, parse_public_key

    key = Path(log_key).read_text().strip() if Path(log_key).is_file() else log_key
    try:
        parse_public_key(key)
        for vkey in witness or []:
            parse_cosignature_key(vkey)
    except CheckpointError as exc:
        raise fail(f"bad key: {exc}", 2) from None
    deadline_s = fetch_timeout_s(fetch_timeout)  # each look gets the whole budget
    done = 0
    while True:
        try:
            report = check_log(
                url,
                key,
                state,
                witnesses=witness or [],
                quorum=len(witness or []) if quorum is None else quorum,
                entries=entries,
                deadline_s=deadline_s,
            )
        except (MonitorError, CheckpointError) as exc:
            raise fail(f"REFUSED {exc}") from None
        grown = "first look" if report.old_size is None else f"{report.old_size} -> {report.size}"
        walked = f"; {plural(report.entries, 'new entry', 'new entries')}, {plural(report.files, 'data file')} checked"
        console.print(
            f"OK {report.origin}: size {report.size} ({grown}){walked if entries else ''}",
            highlight=False,
            markup=False,
        )
        done += 1
        if every <= 0 or (times and done >= times):
            return
        time.sleep(every)


witness_app = typer.Typer(
    help="The witnesses that must cosign each published checkpoint (C2SP tlog-witness).", no_args_is_help=True
)


def witness_add(
    name: Annotated[str, typer.Argument(help="Our name for the witness.")],
    url: Annotated[str, typer.Argument(help="Its base URL (add-checkpoint is posted under it).")],
    vkey: Annotated[str, typer.Argument(help="Its Ed25519 cosignature/v1 verifier key.")],
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Add a witness; every publish asks it to cosign (the quorum is all witnesses unless set).

    Example: ledger witness add w1 http://127.0.0.1:7380 'witness.example+1234abcd+BA...'
    """
    from runledger.ledger.store import Ledger
    from runledger.ledger.witness import add_witness

    with _one_line(ledger):
        Ledger.open(ledger)
        policy = add_witness(ledger, name, url, vkey)
    console.print(
        f"{plural(len(policy.witnesses), 'witness', 'witnesses')}, quorum {policy.quorum}", highlight=False
    )


def witness_quorum(
    quorum: Annotated[int, typer.Argument(help="How many witnesses must cosign a checkpoint.")],
    ledger: LedgerOption = DEFAULT_LEDGER,
) -> None:
    """Set how many witnesses must cosign before a checkpoint is published.

    Example: ledger witness quorum 2
    """
    from runledger.ledger.witness import set_quorum

    with _one_line(ledger):
        policy = set_quorum(ledger, quorum)
    console.print(f"quorum {policy.quorum} of {len(policy.witnesses)}", highlight=False)


def witness_list(ledger: LedgerOption = DEFAULT_LEDGER) -> None:
    """List the witnesses and the quorum.

    Example: ledger witness list
    """
    from runledger.ledger.witness import load_policy

    policy = load_policy(ledger)
    for w in policy.witnesses:
        console.print(f"{w.name}  {w.url}  {w.vkey}", highlight=False, markup=False)
    console.print(f"quorum {policy.quorum} of {len(policy.witnesses)}", highlight=False)
