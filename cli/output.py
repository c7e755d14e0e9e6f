"""What every command shares: its options (--ledger, --spool, --format, --output), its output (rows as
table, csv, json or parquet; documents as JSON) and its one error path (``fail``, ``user_errors``)."""

from __future__ import annotations

import csv
import enum
import io
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import date, datetime
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.table import Table

DEFAULT_LEDGER = Path(".runledger/ledger")


class Format(enum.StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    parquet = "parquet"


# The one way every command finds its ledger.
LedgerOption = Annotated[
    Path,
    typer.Option("--ledger", envvar="RUNLEDGER_LEDGER", help="Ledger directory.", show_default=True),
]
FormatOption = Annotated[Format, typer.Option("--format", "-f", help="Output format.")]
OutputOption = Annotated[
    Path | None, typer.Option("--output", "-o", help="Write to this file (required for parquet).")
]
# Where a producer command (ingest github/wandb, serve webhooks) puts its events: see ingest.bus.open_sink.
SpoolOption = Annotated[
    Path | None,
    typer.Option(
        "--spool", help="Spool directory the events go to (default: $RUNLEDGER_SPOOL or .runledger/spool)."
    ),
]

# Wide enough for history rows when output is not a terminal (pipes, CI logs).
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear line on stderr; the caller raises the returned Exit.

    The one way a command reports a mistake: ``raise fail("...")`` (exit 1), ``raise fail("...", 2)``
    for a usage mistake; ``user_errors()`` routes the library's own user errors here.
    """
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the mistakes a user can make into one line and a non-zero exit, never a traceback."""
    from runledger.ledger.store import LedgerError  # here, not at the top: pyarrow is slow to import

    try:
        yield
    except LedgerError as exc:
        raise fail(str(exc)) from None
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        raise fail(f"{exc.strerror}: {exc.filename}") from None
    except ValueError as exc:
        raise fail(str(exc)) from None


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 stream``, ``2 streams``, ``0 streams``: a count and its noun in the right number."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _cell(value: Any) -> str:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(_plain(value))


def print_rows(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    fmt: Format,
    output: Path | None,
    *,
    title: str = "",
) -> None:
    if fmt == Format.parquet:
        if output is None:
            raise fail("--format parquet needs --output FILE", 2)
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({c: [r[i] for r in rows] for i, c in enumerate(columns)})
        pq.write_table(table, output)
        err_console.print(f"wrote {len(rows)} rows to {output}")
        return
    if fmt == Format.table:
        if output is not None:
            raise fail("--format table prints to the terminal; use csv or json with --output", 2)
        table = Table(title=title or None, show_lines=False)
        for c in columns:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*("" if v is None else _cell(v) for v in r))
        console.print(table)
        return
    buffer = io.StringIO()
    if fmt == Format.csv:
        writer = csv.writer(buffer)
        writer.writerow(columns)
        writer.writerows([[_plain(v) for v in r] for r in rows])
    else:
        records = [dict(zip(columns, (_plain(v) for v in r), strict=True)) for r in rows]
        buffer.write(json.dumps(records, default=str, indent=None) + "\n")
    _write_text(buffer.getvalue(), output)


def print_json(value: Any, output: Path | None = None) -> None:
    """The one way a command prints a JSON document (stats, a state, a proof): indented, to stdout or --output."""
    _write_text(
        msgspec.json.format(msgspec.json.encode(value, enc_hook=str), indent=2).decode() + "\n", output
    )


def _write_text(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        tmp = output.with_name(output.name + f".{os.getpid()}.part")
        tmp.write_text(text)
        tmp.replace(output)
