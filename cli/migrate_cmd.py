"""`ledger migrate OLD NEW`: a ledger of today's format into the DuckLake format (ledger.lake_migrate)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.output import console, fail, plural, user_errors


def migrate(
    old: Annotated[
        Path, typer.Argument(help="The ledger to read (today's format: part files and _commits/).")
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
    rows, the positions and the stream heads are identical.

    Example: ledger migrate .runledger/ledger .runledger/lake
    """
    from ledger.lake import EMBEDDED_CATALOG, LakeError, LakeTables
    from ledger.lake_migrate import MigrateError
    from ledger.lake_migrate import migrate as run

    spec = catalog or f"sqlite:{new / EMBEDDED_CATALOG}"
    with user_errors(old):
        try:
            with LakeTables(spec, new / "data") as lake:
                done = run(old, lake, new)
        except (LakeError, MigrateError) as exc:
            raise fail(str(exc)) from None
    if done.mismatches:
        raise fail(f"migrated, but the lake differs: {'; '.join(done.mismatches)}")
    console.print(
        f"migrated {plural(done.commits, 'commit')} ({plural(done.rows, 'row')}) into {new}: "
        "rows, positions and stream heads identical",
        highlight=False,
    )
