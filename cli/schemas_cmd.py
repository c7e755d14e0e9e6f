"""`ledger schemas export`, `ledger schemas list`: the event catalogue."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from runledger.cli.output import Format, FormatOption, OutputOption, console, plural, print_rows, user_errors


def export_schemas(
    directory: Annotated[Path, typer.Argument(help="Where to write the JSON Schemas.")],
) -> None:
    """Write one JSON Schema per event type and version, for producers in other languages."""
    from runledger.schemas.codec import export_json_schemas

    with user_errors():
        written = export_json_schemas(directory)
    console.print(f"wrote {plural(len(written), 'schema')} to {directory}")


def list_schemas(fmt: FormatOption = Format.table, output: OutputOption = None) -> None:
    """The event types, their versions and what each records."""
    from runledger.schemas import CATALOGUE

    rows = [(t.name, ", ".join(map(str, sorted(t.versions))), t.doc) for t in CATALOGUE.values()]
    print_rows(["type", "versions", "what"], rows, fmt, output, title="event catalogue")
