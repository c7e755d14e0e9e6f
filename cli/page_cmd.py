"""`ledger serve page`: the run's page, live (a web page per run and an index of runs, over a local
ledger or a published copy of one). The work is in ``ledger.live_page``; this is a thin shell."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.output import DEFAULT_LEDGER, LedgerOption, console, fail, user_errors


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
) -> None:
    """Serve each run's page live: its curves, history, state and record, updated as the ledger commits.

    Read-only: / lists the runs, /runs/RUN is a run's page, /runs/RUN/events its live stream (SSE).
    Example: ledger serve page --ledger .runledger/demo/ledger --port 8790
    """
    from ledger.live_page import serve
    from ledger.store import Ledger

    if not 0 < port < 65536:
        raise fail(f"--port {port}: give 1..65535", 2)
    if max_clients < 1:
        raise fail("--max-clients must be at least 1", 2)
    if public_key is not None and not public_key.is_file():
        raise fail(f"public key file not found: {public_key}", 2)
    with user_errors(ledger):
        Ledger.open(ledger)  # a missing ledger is one line here, before listening
    console.print(f"live page over {ledger} at http://{host}:{port}/ (Ctrl-C stops)", highlight=False)
    try:
        serve(ledger, host, port, public_key_path=public_key, max_clients=max_clients)
    except OSError as exc:
        raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
