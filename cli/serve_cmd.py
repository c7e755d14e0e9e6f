"""`ledger serve webhooks`: the GitHub webhook receiver, a producer onto the bus.

It writes events to the spool (``ingest.bus``); ``ledger ingest spool`` folds them into the
ledger. A mistake a user can fix is one line on stderr and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.output import SpoolOption, fail
from ingest.bus import default_spool_dir
from ingest.spool import SpoolLockedError


def serve_webhooks(
    secret_file: Annotated[
        Path, typer.Option("--secret-file", help="File holding the webhook secret (never logged).")
    ],
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8787,
    spool: SpoolOption = None,
    delivery_db: Annotated[
        Path | None,
        typer.Option("--delivery-db", help="Seen-deliveries file (default: beside the spool)."),
    ] = None,
    max_body_mb: Annotated[int, typer.Option("--max-body-mb", help="Largest accepted payload.")] = 25,
    producer_key: Annotated[
        Path | None,
        typer.Option(
            "--producer-key",
            envvar="RUNLEDGER_PRODUCER_KEY",
            help="The receiver's private producer key (`ledger keys init`): every event is signed "
            "with it. Register its public key with `ledger producers add`.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Receive GitHub webhooks at POST /webhook (metrics at GET /metrics).

    Example: ledger serve webhooks --secret-file webhook.secret --port 8787
    """
    from ingest.github_webhook import default_delivery_db, read_secret, receiver_sealer, serve

    try:
        read_secret(secret_file)
    except FileNotFoundError:
        raise fail(f"secret file not found: {secret_file}", 2) from None
    except (OSError, ValueError) as exc:
        raise fail(str(exc) if isinstance(exc, ValueError) else f"cannot read {secret_file}", 2) from None
    if producer_key is not None:
        try:
            receiver_sealer(producer_key)  # checked here: a bad key is one line, before listening
        except FileNotFoundError:
            raise fail(f"producer key file not found: {producer_key}", 2) from None
        except OSError:
            raise fail(f"cannot read producer key {producer_key}", 2) from None
        except ValueError as exc:
            raise fail(f"producer key {producer_key}: {exc}", 2) from None
    if max_body_mb < 1:
        raise fail("--max-body-mb must be at least 1", 2)
    where = spool if spool is not None else default_spool_dir()
    try:
        serve(
            host,
            port,
            secret_file,
            where,
            delivery_db=delivery_db if delivery_db is not None else default_delivery_db(where),
            max_body_bytes=max_body_mb * 1024 * 1024,
            producer_key_file=producer_key,
        )
    except SpoolLockedError:
        raise fail(f"spool {where} already has a live writer; give the receiver its own --spool", 2) from None
