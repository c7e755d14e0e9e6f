"""`ledger migrate OLD NEW`: a ledger of part files into the DuckLake format (runledger.ledger.lake_migrate)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import console, disk_full_error, fail, plural, user_errors


def migrate(
    old: Annotated[
        Path, typer.Argument(help="The ledger to read (the old format: part files and _commits/).")
    ],
    new: Annotated[Path, typer.Argument(help="Folder of the new lake: its Parquet files go to NEW/data.")],
    catalog: Annotated[
        str | None,
        typer.Option(
            "--catalog",
            help="The lake's catalog: sqlite:PATH (one host) or postgres:DSN (many hosts) "
            "(default: sqlite:NEW/catalog.sqlite, in the new ledger's folder).",
        ),
    ] = None,
) -> None:
    """Copy a ledger into a DuckLake, one lake commit per ledger commit, and check that every table's
    rows, the positions and the stream heads are identical. When anything fails, NEW is left as it was.

    Example: ledger migrate .runledger/ledger .runledger/lake
    """
    from runledger.ledger.lake_migrate import MigrateError, migrate_into
    from runledger.schemas.durable import disk_full

    # The whole migration or nothing: migrate_into checks OLD before it makes NEW, and removes what it
    # made when a commit fails or the result differs, so a refusal is one line and leaves nothing.
    with user_errors(old):
        try:
            done = migrate_into(old, new, catalog)
        except MigrateError as exc:
            if disk_full(exc) is not None:  # (NEW is gone again: the line names the disk it was on)
                raise disk_full_error(exc, [new]) from None
            raise fail(str(exc)) from None
    console.print(
        f"migrated {plural(done.commits, 'commit')} ({plural(done.rows, 'row')}) into {new}: "
        "rows, positions and stream heads identical",
        highlight=False,
    )
