"""`ledger schemas export`, `ledger schemas list`: the event catalogue."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import (
    FormatOption,
    FullOption,
    LimitOption,
    OutputOption,
    console,
    plural,
    print_rows,
    user_errors,
)


def export_schemas(
    directory: Annotated[Path, typer.Argument(help="Where to write the JSON Schemas.")],
) -> None:
    """Write one JSON Schema per event type and version, for producers in other languages.

    Example: ledger schemas export schemas/json
    """
    from runledger.schemas.codec import export_json_schemas

    with user_errors():
        written = export_json_schemas(directory)
    console.print(f"wrote {plural(len(written), 'schema')} to {directory}")


def list_schemas(
    fmt: FormatOption = None, output: OutputOption = None, limit: LimitOption = None, full: FullOption = False
) -> None:
    """The event types, their versions and what each records.

    Example: ledger schemas list -f csv
    """
    from runledger.schemas import CATALOGUE

    rows = [(t.name, ", ".join(map(str, sorted(t.versions))), t.doc) for t in CATALOGUE.values()]
    print_rows(
        ["type", "versions", "what"], rows, fmt, output, title="event catalogue", limit=limit, full=full
    )
