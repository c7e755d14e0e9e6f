"""`ledger serve page`: the run's page, live (a web page per run and an index of runs, over a local
ledger or a published copy of one). The work is in ``runledger.ledger.live_page``; this is a thin shell."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.output import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_LEDGER,
    LedgerOption,
    console,
    fail,
    fetch_timeout_s,
    user_errors,
)

if TYPE_CHECKING:
    from runledger.ledger.live_page import Witnesses


def serve_page(
    ledger: LedgerOption = DEFAULT_LEDGER,
    host: Annotated[
        str, typer.Option(help="Interface to listen on (127.0.0.1: this machine only).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8790,
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", help="Check the signed checkpoints' signatures with this key."),
    ] = None,
    max_clients: Annotated[
        int, typer.Option("--max-clients", help="Open live streams at most (the next is answered 503).")
    ] = 200,
    remote: Annotated[
        str | None,
        typer.Option(
            "--remote", help="Serve a copy published at this URL (`ledger publish`; needs --log-key)."
        ),
    ] = None,
    log_key: Annotated[
        str | None, typer.Option("--log-key", help="With --remote: the log's public key (vkey or .pub file).")
    ] = None,
    cache: Annotated[
        Path, typer.Option("--cache", help="With --remote: where the verified data files are kept.")
    ] = Path(".runledger/remote-cache"),
    witness: Annotated[
        list[str] | None,
        typer.Option(
            "--witness", help="A witness's cosignature vkey (or a file holding it); repeat for each witness."
        ),
    ] = None,
    quorum: Annotated[
        int | None,
        typer.Option("--quorum", help="Valid cosignatures required of the --witness keys (default: all)."),
    ] = None,
    fetch_timeout: Annotated[
        float,
        typer.Option(
            "--fetch-timeout",
            help="With --remote: seconds one look at the copy may take (its checkpoint, new entries and files).",
        ),
    ] = DEFAULT_FETCH_TIMEOUT_S,
) -> None:
    """Serve each run's page live: its curves, history, state and record, updated as the ledger commits.

    Read-only: / lists the runs, /runs/RUN is a run's page, /runs/RUN/events its live stream (SSE).
    With --remote URL --log-key VKEY: over a published copy; every second its checkpoint is fetched, and
    one that grew and verifies (signature, consistency with the last one seen, the new entries and data
    files) reaches the open pages. One that does not verify is shown as "not verified" and stops updates.
    With --witness VKEY (repeat) [--quorum N]: the cosignatures on the checkpoint the page answers from
    are checked against those keys; the page shows which verified and whether the quorum holds (over
    --remote, a checkpoint short of the quorum is not shown as current). With --remote, each look at
    the copy (and the download after it) must end within --fetch-timeout seconds; one that does not is
    "unreachable" and tried again.
    Example: ledger serve page --ledger .runledger/demo/ledger --port 8790
    Example: ledger serve page --remote https://example.org/log/ --log-key log.pub --witness w1.vkey --quorum 1
    """
    from runledger.ledger.live_page import serve
    from runledger.ledger.store import Ledger

    if not 0 < port < 65536:
        raise fail(f"--port {port}: give 1..65535", 2)
    if max_clients < 1:
        raise fail("--max-clients must be at least 1", 2)
    if public_key is not None and not public_key.is_file():
        raise fail(f"public key file not found: {public_key}", 2)
    witnesses = _witnesses(witness or [], quorum)
    if remote is not None:
        _serve_remote(
            remote, log_key, cache, host, port, max_clients, witnesses, fetch_timeout_s(fetch_timeout)
        )
        return
    with user_errors(ledger):
        Ledger.open(ledger)  # a missing ledger is one line here, before listening
    console.print(f"live page over {ledger} at http://{host}:{port}/ (Ctrl-C stops)", highlight=False)
    try:
        serve(ledger, host, port, public_key_path=public_key, max_clients=max_clients, witnesses=witnesses)
    except OSError as exc:
        raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _witnesses(given: list[str], quorum: int | None) -> Witnesses:
    """The --witness keys (inline or a file each) and --quorum, checked: one line and exit 2 if bad."""
    from runledger.ledger.live_page import Witnesses

    if quorum is not None and not given:
        raise fail("--quorum needs --witness VKEY (the keys whose cosignatures count)", 2)
    vkeys = [_key_text(v) for v in given]
    try:
        return Witnesses.of(vkeys, quorum)
    except ValueError as exc:
        raise fail(f"bad --witness/--quorum: {exc}", 2) from None


def _key_text(given: str) -> str:
    """A key given inline, or the contents of the file it names."""
    try:
        return Path(given).read_text().strip() if Path(given).is_file() else given.strip()
    except (OSError, UnicodeDecodeError):  # a name too long for a file, an unreadable file: not a file
        return given.strip()


def _serve_remote(
    url: str,
    log_key: str | None,
    cache: Path,
    host: str,
    port: int,
    max_clients: int,
    witnesses: Witnesses,
    timeout_s: float,
) -> None:
    from runledger.cli.merkle_cmd import _vkey
    from runledger.ledger.live_page import serve_published

    if log_key is None:
        raise fail("--remote needs --log-key VKEY (the published log's public key)", 2)
    if not url.startswith(("http://", "https://")):
        raise fail(f"--remote {url!r}: give an http:// or https:// URL", 2)
    key = _vkey(log_key)
    console.print(
        f"live page over the published copy {url} at http://{host}:{port}/ (Ctrl-C stops)", highlight=False
    )
    try:
        serve_published(
            url, key, cache, host, port, max_clients=max_clients, witnesses=witnesses, deadline_s=timeout_s
        )
    except OSError as exc:
        raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
