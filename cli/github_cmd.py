"""`ledger serve webhooks`, `ledger ingest github`, `ledger ingest wandb`: producers onto the bus.

They write events to the bus (``runledger.ingest.bus.open_sink``: the spool, or Kafka when configured);
``ledger ingest spool`` folds them into the ledger. A mistake a user can fix is one line on stderr and
exit code 2; a failure outside their control (network, GitHub) exits 1.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from runledger.cli.output import fail
from runledger.ingest.bus import EventSink, default_spool_dir, open_sink
from runledger.ingest.spool import SpoolLockedError

SpoolOption = Annotated[
    Path | None,
    typer.Option(
        "--spool", help="Spool directory the events go to (default: $RUNLEDGER_SPOOL or .runledger/spool)."
    ),
]


def _open(spool: Path | None) -> EventSink:
    try:
        return open_sink(spool)
    except SpoolLockedError:
        where = spool if spool is not None else default_spool_dir()
        raise fail(
            f"spool {where} already has a live writer (another producer?); give this one its own --spool", 2
        ) from None
    except OSError as exc:
        raise fail(f"cannot open spool: {exc.strerror}: {exc.filename}", 2) from None


def _print(value: dict[str, Any]) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _parse_since(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise fail(f"--since {text!r} is not a date (use 2024-03-01 or 2024-03-01T12:00:00Z)", 2) from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _token(token_file: Path | None) -> str | None:
    """From --token-file, else $GITHUB_TOKEN: never from the command line, where `ps` would show it."""
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise fail(f"cannot read token file {token_file}: {exc.strerror}", 2) from None
        if not token:
            raise fail(f"token file {token_file} is empty", 2)
        return token
    return os.environ.get("GITHUB_TOKEN") or None


def register(app: typer.Typer, ingest_app: typer.Typer, serve_app: typer.Typer) -> None:
    @serve_app.command("webhooks")
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
    ) -> None:
        """Receive GitHub webhooks at POST /webhook (metrics at GET /metrics)."""
        from runledger.ingest.github_webhook import default_delivery_db, read_secret, serve

        try:
            read_secret(secret_file)
        except FileNotFoundError:
            raise fail(f"secret file not found: {secret_file}", 2) from None
        except (OSError, ValueError) as exc:
            raise fail(str(exc) if isinstance(exc, ValueError) else f"cannot read {secret_file}", 2) from None
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
            )
        except SpoolLockedError:
            raise fail(
                f"spool {where} already has a live writer; give the receiver its own --spool", 2
            ) from None

    @ingest_app.command("github")
    def ingest_github(
        repo: Annotated[str, typer.Argument(help="OWNER/REPO")],
        since: Annotated[
            str | None, typer.Option(help="Read objects updated since (overrides the cursor).")
        ] = None,
        base_url: Annotated[
            str, typer.Option("--base-url", help="API root (GitHub Enterprise: https://HOST/api/v3).")
        ] = "https://api.github.com",
        token_file: Annotated[
            Path | None, typer.Option("--token-file", help="File holding a token (default: $GITHUB_TOKEN).")
        ] = None,
        spool: SpoolOption = None,
        cursor_file: Annotated[
            Path | None, typer.Option("--cursor-file", help="Resume cursors (default: beside the spool).")
        ] = None,
        per_page: Annotated[int, typer.Option("--per-page", min=1, max=100)] = 100,
        request_interval: Annotated[
            float,
            typer.Option("--request-interval", help="Seconds between requests (GitHub asks for serial)."),
        ] = 0.25,
        max_rate_limit_wait: Annotated[
            float, typer.Option("--max-rate-limit-wait", help="Longest rate-limit wait, seconds.")
        ] = 900.0,
    ) -> None:
        """Backfill a repository's issues, PRs, reviews, comments and commits onto the bus."""
        from runledger.ingest.github_backfill import (
            BackfillError,
            JsonCursorStore,
            backfill,
            cursor_from_spool,
            default_cursor_file,
        )
        from runledger.ingest.github_events import valid_repo

        if not valid_repo(repo):
            raise fail(f"not a repository name: {repo!r} (expected OWNER/REPO)", 2)
        start = _parse_since(since) if since is not None else None
        token = _token(token_file)
        where = spool if spool is not None else default_spool_dir()
        try:
            store = JsonCursorStore(cursor_file if cursor_file is not None else default_cursor_file(where))
        except (OSError, ValueError) as exc:
            raise fail(f"unreadable cursor file: {exc}", 2) from None
        if start is None and not store.has(repo):
            # No cursor recorded: resume from the backfill events already on the spool, if any.
            for kind, value in cursor_from_spool(where, repo).items():
                store.set(repo, kind, value)
        sink = _open(spool)
        if token is None:  # said once nothing else can fail first, so an error stays one line
            typer.echo(
                "note: no token ($GITHUB_TOKEN or --token-file): anonymous, 60 requests/hour", err=True
            )
        try:
            stats = backfill(
                repo,
                sink,
                token=token,
                base_url=base_url,
                since=start,
                cursor_store=store,
                per_page=per_page,
                seconds_between_requests=request_interval or None,
                max_rate_limit_wait_s=max_rate_limit_wait,
            )
        except BackfillError as exc:
            raise fail(str(exc), exc.code) from None
        finally:
            sink.close()
        _print(stats.as_dict())

    @ingest_app.command("wandb")
    def ingest_wandb(
        directory: Annotated[Path, typer.Argument(help="W&B offline run directory (or its .wandb file).")],
        run_id: Annotated[
            str | None, typer.Option("--run-id", help="Ledger run id (default: the W&B run id).")
        ] = None,
        spool: SpoolOption = None,
    ) -> None:
        """Import a W&B offline run (wandb/offline-run-*) as ledger events."""
        from runledger.ingest.wandb_import import WandbImportError, find_offline_runs, import_offline_run

        try:
            files = find_offline_runs(directory)
        except WandbImportError as exc:
            raise fail(str(exc), 2) from None
        if run_id is not None and len(files) > 1:
            raise fail(f"{directory} holds {len(files)} runs; --run-id needs exactly one", 2)
        sink = _open(spool)
        try:
            for wandb_file in files:
                try:
                    stats = import_offline_run(wandb_file, sink, run_id=run_id)
                except WandbImportError as exc:
                    raise fail(str(exc), 2 if "run id" in str(exc) else 1) from None
                _print(stats.as_dict())
        finally:
            sink.close()
