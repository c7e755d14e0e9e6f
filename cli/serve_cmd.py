"""`ledger serve webhooks`: the GitHub webhook receiver, a producer onto the bus.

It writes events to the spool (``runledger.ingest.bus``); ``ledger ingest spool`` folds them into the
ledger. A mistake a user can fix is one line on stderr and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import SpoolOption, fail


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
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections", help="Open connections at most (the longest idle is closed to make room)."
        ),
    ] = 256,
    header_timeout_s: Annotated[
        float,
        typer.Option("--header-timeout-s", help="Seconds a connection may take to send a request head."),
    ] = 5.0,
    body_timeout_s: Annotated[
        float,
        typer.Option("--body-timeout-s", help="Seconds a request may take to send its body (then 408)."),
    ] = 10.0,
    max_unverified_mb: Annotated[
        int,
        typer.Option(
            "--max-unverified-mb", help="Bodies read before their signature is checked, together (then 503)."
        ),
    ] = 64,
    ack_timeout_s: Annotated[
        float,
        typer.Option(
            "--ack-timeout-s",
            help="Seconds to wait for a delivery to be on disk before answering 503, not 202.",
        ),
    ] = 5.0,
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
    """Receive GitHub webhooks at POST /webhook (Prometheus metrics at GET /metrics, JSON at /healthz).

    A delivery is answered 202 only once it is on disk (503 with Retry-After otherwise); a signed body
    re-sent under another delivery id, event or hook id is refused (409). See docs/security.md.

    Example: ledger serve webhooks --secret-file webhook.secret --port 8787
    """
    from runledger.ingest.bus import default_spool_dir
    from runledger.ingest.github_webhook import default_delivery_db, read_secret, receiver_sealer, serve
    from runledger.ingest.spool import SpoolLockedError

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
    if max_unverified_mb < max_body_mb:
        raise fail("--max-unverified-mb must be at least --max-body-mb (one body of the largest size)", 2)
    if max_connections < 1 or min(header_timeout_s, body_timeout_s, ack_timeout_s) <= 0:
        raise fail("--max-connections and the timeouts must be positive", 2)
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
            max_connections=max_connections,
            header_timeout_s=header_timeout_s,
            body_timeout_s=body_timeout_s,
            max_unverified_bytes=max_unverified_mb * 1024 * 1024,
            ack_timeout_s=ack_timeout_s,
        )
    except SpoolLockedError:
        raise fail(f"spool {where} already has a live writer; give the receiver its own --spool", 2) from None
