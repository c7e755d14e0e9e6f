"""`ledger shell`: an interactive SQL shell on the ledger's views.

DuckDB's own shell when a ``duckdb`` binary is on PATH (``pip install duckdb-cli`` puts one in the
venv; also https://duckdb.org/docs/installation), started on an in-memory database with the views
defined by an init file, locked as ``ledger query``'s connection is (SQL reaches only the ledger's
tables), but without the statement check: it can write into the ledger's table folders (``COPY``)
and wherever its dot-commands are told to. Otherwise (or with
``--builtin``) a small read-only loop: statements end with ``;``, each printed as ``ledger query``
prints a table; ``.tables`` lists the views, ``.quit`` (or Ctrl-D) leaves.

Both run under ``--memory-limit`` and ``--spill-limit`` (set before the lock, which freezes them);
``--timeout`` stops a statement of the built-in shell only (DuckDB's shell has no timer: Ctrl-C there).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.ledger_cmd import MemoryLimitOption, SpillLimitOption, TimeoutOption, query_limits
from runledger.cli.output import (
    DEFAULT_LEDGER,
    Format,
    LedgerOption,
    err_console,
    fail,
    print_rows,
    user_errors,
)

if TYPE_CHECKING:
    from runledger.ledger.sql_guard import QueryLimits

PROMPT = "ledger> "
MORE = "   ...> "  # a statement continues until a line ends with ";"
HELP = ".tables  list the views    .quit  leave (or Ctrl-D)    end each SQL statement with ;"


def shell(
    ledger: LedgerOption = DEFAULT_LEDGER,
    builtin: Annotated[
        bool, typer.Option("--builtin", help="The built-in read-only shell even when `duckdb` is on PATH.")
    ] = False,
    timeout: TimeoutOption = None,
    memory_limit: MemoryLimitOption = None,
    spill_limit: SpillLimitOption = None,
) -> None:
    """An interactive SQL shell on the ledger's views: DuckDB's `duckdb` if on PATH, else a built-in one.

    Example: ledger shell   (then: SELECT * FROM runs;)
    """
    from runledger.ledger.query import Reader

    limits = query_limits(timeout, memory_limit, spill_limit)
    with user_errors(ledger):
        reader = Reader(ledger, limits=limits)
    binary = None if builtin else shutil.which("duckdb")
    if binary is not None:
        reader.close()  # (a DuckDB-file lake catalog is held by one process: the shell's)
        raise typer.Exit(_duckdb_shell(binary, reader.root, limits))
    try:
        _builtin_shell(reader)
    finally:
        reader.close()


def init_sql(root: Path, *, limits: QueryLimits | None = None, spill: Path | None = None) -> str:
    """DuckDB's shell's init file: the views, then the limits (``limits``, spilling into ``spill``)
    and the lock of ``ledger query``'s connection (SQL reaches only the ledger's tables). DuckDB's
    shell has no statement check, and its dot-commands (``.output``, ``.shell``) write where they
    are told: ``--builtin`` is the read-only one."""
    from runledger.ledger.lake import LakeFolder
    from runledger.ledger.parquet_schemas import tables_of
    from runledger.ledger.sql_guard import lock_sql
    from runledger.ledger.views import lake_init_sql, views_sql

    lake = LakeFolder.read(root)
    if lake is not None:  # the lake's data folder only (a remote data path: the lock allows no file)
        local = [Path(lake.data_path)] if "://" not in lake.data_path else []
        return lake_init_sql(lake) + lock_sql(local, limits=limits, spill=spill)
    lock = lock_sql([root / name for name in tables_of(root)], limits=limits, spill=spill)
    return "SET TimeZone = 'UTC';\n" + views_sql(root) + "\n" + lock


def _duckdb_shell(binary: str, root: Path, limits: QueryLimits) -> int:
    from runledger.ledger.query import SPILL_AREA, spill_folder

    spill = spill_folder(root / SPILL_AREA)
    with tempfile.TemporaryDirectory(prefix="runledger-shell-") as tmp:
        init = Path(tmp) / "views.sql"
        init.write_text(init_sql(root, limits=limits, spill=spill.path))
        # Ctrl-C belongs to DuckDB's shell (it cancels a query there); this process just waits.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return subprocess.run(
                [binary, "-init", str(init)],
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                check=False,
            ).returncode
        finally:
            signal.signal(signal.SIGINT, previous)
            spill.remove()


def _builtin_shell(reader) -> None:
    from runledger.ledger.sql_guard import RefusedStatement, split_statements
    from runledger.ledger.store import LedgerError

    err_console.print(f"runledger shell on {reader.root} (read-only). {HELP}", highlight=False)
    pending: list[str] = []
    while True:
        try:
            line = input(MORE if pending else PROMPT)
        except EOFError:
            return
        except KeyboardInterrupt:  # as in duckdb's shell: drop the statement being typed
            pending.clear()
            typer.echo()
            continue
        if not pending and line.strip().startswith("."):
            if _dot_command(reader, line.strip()):
                return
            continue
        pending.append(line)
        if not line.rstrip().endswith(";"):
            continue
        text = "\n".join(pending)
        pending.clear()
        try:  # several statements on a line run in order, as in duckdb's shell
            statements = split_statements(reader.con, text)
        except RefusedStatement:
            statements = [text]  # reader.sql reports the parser error with its caret
        for statement in statements:
            try:
                result = reader.sql(statement)
            except LedgerError as exc:
                fail(str(exc))  # printed; the shell goes on with the next line
                break
            print_rows(result.columns, result.rows, Format.table, None)


def _dot_command(reader, command: str) -> bool:
    """Run a dot-command; True: leave the shell."""
    name = command.split()[0]
    if name in (".quit", ".exit", ".q"):
        return True
    if name == ".tables":
        result = reader.sql(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal AND NOT starts_with(view_name, '_') "
            "ORDER BY view_name"
        )
        typer.echo("  ".join(row[0] for row in result.rows))
    elif name == ".help":
        typer.echo(HELP)
    else:
        fail(f"unknown command {name} ({HELP})")
    return False
