"""What every command shares: its options (--ledger, --spool, --format, --output, --limit, --full), its
output (rows as table, csv, json, jsonl or parquet; documents as JSON) and its one error path (``fail``,
``user_errors``).

The output contract, the same for every row-printing command: ``--format`` is one of ``Format``;
without it the format follows ``--output``'s extension (``.csv``, ``.json``, ``.jsonl``/``.ndjson``,
``.parquet``), else it is a table. A table on the terminal fits its width (cells cut with ``…``, the
columns that do not fit are counted), shows at most 40 rows (``--limit``; the total is shown),
prints NULL as ``NULL`` and an empty string as nothing, and git's 7-character short hashes
(``--full`` for whole hashes and cells). Other formats write every row unless ``--limit`` is given.
"""

from __future__ import annotations

import csv
import enum
import errno
import io
import json
import os
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_LEDGER = Path(".runledger/ledger")
DEMO_LEDGER = Path(".runledger/demo/ledger")  # where `make demo` (`ledger demo`) leaves its ledger


class Format(enum.StrEnum):
    table = "table"
    csv = "csv"
    json = "json"
    jsonl = "jsonl"
    parquet = "parquet"


FORMAT_BY_SUFFIX = {
    ".csv": Format.csv,
    ".json": Format.json,
    ".jsonl": Format.jsonl,
    ".ndjson": Format.jsonl,
    ".parquet": Format.parquet,
    ".txt": Format.table,
}
TABLE_ROWS_DEFAULT = 40  # rows a terminal table shows unless --limit says otherwise (as duckdb's CLI)


class Program:
    """Whether this process is the ``ledger`` program itself (set by ``runledger.cli.main``'s app when called
    as the program), not a test or a library calling the app: only the program is sure to hold no
    other connection to a lake's catalog, so only it reads a SQLite catalog with Python's sqlite3."""

    is_whole_process = False


# The one way every command finds its ledger.
LedgerOption = Annotated[
    Path,
    typer.Option("--ledger", envvar="RUNLEDGER_LEDGER", help="Ledger directory.", show_default=True),
]
SnapshotOption = Annotated[
    int | None,
    typer.Option(
        "--snapshot",
        help="A ledger on DuckLake: answer as of this lake snapshot (default: the newest).",
        show_default=False,
    ),
]
AtCheckpointOption = Annotated[
    Path | None,
    typer.Option(
        "--at-checkpoint",
        help="A ledger on DuckLake: answer as of the snapshot this signed stream checkpoint "
        "(_checkpoints/<stream>.txt) pins; its size and root must be the lake's.",
        show_default=False,
    ),
]
FormatOption = Annotated[
    Format | None,
    typer.Option(
        "--format",
        "-f",
        help="table, csv, json, jsonl or parquet (default: from --output's extension, else table).",
        show_default=False,
    ),
]
OutputOption = Annotated[
    Path | None,
    typer.Option("--output", "-o", help="Write to this file instead of stdout (needed for parquet)."),
]
LimitOption = Annotated[
    int | None,
    typer.Option(
        "--limit",
        "-n",
        min=0,
        help=f"At most N rows (0: all). Default: {TABLE_ROWS_DEFAULT} in a terminal table, else all.",
        show_default=False,
    ),
]
FullOption = Annotated[
    bool, typer.Option("--full", help="Whole hashes and cells in tables (no shortening, no fitting).")
]
DEFAULT_FETCH_TIMEOUT_S = (
    300.0  # runledger.ledger.monitor.DEFAULT_DEADLINE_S (not imported: the CLI loads lazily)
)
# The total time one remote command may take (connections, every read, all files together).
FetchTimeoutOption = Annotated[
    float,
    typer.Option(
        "--fetch-timeout",
        help="With --remote: seconds the whole check may take (a server that stalls or drips is cut off).",
    ),
]


def fetch_timeout_s(seconds: float) -> float:
    """``--fetch-timeout`` checked: exit 2 with one line unless it is a positive number of seconds."""
    if not seconds > 0 or seconds == float("inf"):
        raise fail(f"--fetch-timeout {seconds}: give a number of seconds above 0", 2)
    return seconds


# Where a producer command (ingest github/wandb, serve webhooks) puts its events: see runledger.ingest.bus.open_sink.
SpoolOption = Annotated[
    Path | None,
    typer.Option(
        "--spool", help="Spool directory the events go to (default: $RUNLEDGER_SPOOL or .runledger/spool)."
    ),
]


# Every C0/C1 control character as an escape; what a console line sends keeps its line breaks and tabs.
_CONTROL_ESCAPES = {chr(c): f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_TERMINAL_CONTROL = str.maketrans({ch: shown for ch, shown in _CONTROL_ESCAPES.items() if ch not in "\n\t"})


class LazyConsole:
    """rich's ``Console``, made when a command first prints through it: importing rich is ~22 ms,
    which a command that prints only plain text (a table, CSV, JSON) does not pay (issue 41)."""

    def __init__(self, *, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    @property
    def made(self) -> Console:
        """The Console itself (for rich's own objects that take one, as ``Progress``)."""
        if self._console is None:
            from rich.console import Console

            # Wide enough for history rows when stdout is not a terminal (pipes, CI logs).
            width = None if self._stderr or sys.stdout.isatty() else 160
            self._console = Console(stderr=self._stderr, soft_wrap=True, width=width)
        return self._console

    def print(self, *objects: Any, **options: Any) -> None:
        """rich's ``print``, each text's control characters shown as escapes (rich passes an ESC from
        a recorded value or a user's argument to the terminal); line breaks and tabs kept."""
        self.made.print(
            *(o.translate(_TERMINAL_CONTROL) if isinstance(o, str) else o for o in objects), **options
        )

    @property
    def is_terminal(self) -> bool:
        return self.made.is_terminal


console = LazyConsole(stderr=False)
err_console = LazyConsole(stderr=True)


def escape(text: str) -> str:
    """``text`` with rich's markup characters escaped (rich.markup.escape, imported when needed)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def print_lines(lines: Sequence[str]) -> None:
    """Plain lines on stdout, no markup read and no rich imported (the text as it is, control
    characters shown as escapes, as table cells show them)."""
    _write_text("".join(line.translate(_CONTROL) + "\n" for line in lines), None)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one clear line on stderr; the caller raises the returned Exit.

    The one way a command reports a mistake: ``raise fail("...")`` (exit 1), ``raise fail("...", 2)``
    for a usage mistake; ``user_errors()`` routes the library's own user errors here.
    """
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True)
    return typer.Exit(code)


@contextmanager
def user_errors(ledger: Path | None = None) -> Iterator[None]:
    """Turn the mistakes a user can make into one line and a non-zero exit, never a traceback.

    Given the command's ``ledger``, a missing ledger's line points at the ledger that does exist.
    """
    from runledger.ledger.duck import ExtensionMissing  # here, not at the top: pyarrow is slow to import
    from runledger.ledger.records import LedgerError
    from runledger.schemas.durable import disk_full

    try:
        yield
    except ExtensionMissing as exc:  # a wheel the command's extra brings (its line names the extra)
        raise fail(str(exc)) from None
    except LedgerError as exc:
        # (a lake's error in one line, a full disk behind it; or SQLite's "disk I/O error" where it
        # could not grow its shared-memory file on a disk with no room)
        if disk_full(exc) is not None or _io_error_on_a_full_disk(exc, ledger):
            raise disk_full_error(exc, _disk_candidates(ledger)) from None
        message = str(exc)
        hint = ledger_hint(ledger) if ledger is not None and message.startswith("no ledger at") else ""
        if hint:  # in place of "create one with …", which would make a second, empty ledger
            message = f"no ledger at {ledger}{hint}"
        raise fail(message) from None
    except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
        raise fail(f"{exc.strerror}: {exc.filename}") from None
    except ValueError as exc:
        raise fail(str(exc)) from None
    except Exception as exc:  # a full disk surfaces as OSError, SQLite's error, or in their context
        if disk_full(exc) is None:
            raise
        raise disk_full_error(exc, _disk_candidates(ledger)) from None


# Free space under which an I/O error without an errno (SQLite's, through DuckDB) is told as a full disk.
NEARLY_FULL_BYTES = 1 << 20


def _io_error_on_a_full_disk(exc: BaseException, ledger: Path | None) -> bool:
    if "disk I/O error" not in str(exc):
        return False
    usages = [_usage(place) for place in _disk_candidates(ledger)]
    return any(usage is not None and usage.free < NEARLY_FULL_BYTES for usage in usages)


def _disk_candidates(ledger: Path | None) -> list[Path]:
    """Where a command on ``ledger`` writes: its folder and, on a lake, the lake's local data folder
    and catalog file (pyarrow's write errors name no file)."""
    if ledger is None:
        return []
    out = [ledger]
    try:
        marker = json.loads((ledger / "LAKE.json").read_bytes())
    except (OSError, ValueError):
        return out
    data, catalog = str(marker.get("data_path") or ""), str(marker.get("catalog") or "")
    if data and "://" not in data:
        out.append(ledger / data if not Path(data).is_absolute() else Path(data))
    from runledger.ledger.lake import Catalog, LakeError  # (a full disk's line only: not on every start)

    try:
        file = Catalog.parse(catalog).file if catalog else None
    except LakeError:
        file = None
    if file is not None:
        out.append((file if file.is_absolute() else ledger / file).parent)
    return out


def ledger_hint(path: Path) -> str:
    """``; did you mean --ledger …/ledger?``: the ledger the user most likely meant, when one exists:
    one level below the path given (a demo's work folder), or the demo's (after `make demo`)."""
    for candidate in (path / "ledger", path / ".runledger" / "ledger", DEMO_LEDGER):
        is_ledger = (candidate / "LAKE.json").is_file() or (candidate / "LEDGER.json").is_file()
        if is_ledger and candidate.resolve() != path.resolve():
            return f"; did you mean --ledger {candidate}? (or export RUNLEDGER_LEDGER={candidate})"
    return ""


VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also show third-party warnings (Megatron's, PyTorch's).")
]


@contextmanager
def third_party_warnings(verbose: bool) -> Iterator[None]:
    """Keep library warnings (Megatron-Core's "Apex is not installed", PyTorch's deprecations) off
    the terminal unless ``--verbose``: they are about the libraries, not about what the user asked."""
    with warnings.catch_warnings():
        if not verbose:
            for category in (UserWarning, FutureWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category)
        yield


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 stream``, ``2 streams``, ``0 streams``: a count and its noun in the right number."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def short_hash(value: str | None, full: bool = False) -> str:
    """git's short form (7 hex digits) of a commit or SHA-256, unless ``full``."""
    if value is None:
        return "unknown"
    return value if full or not _HASH.fullmatch(value) else value[:7]


_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def resolve_format(fmt: Format | None, output: Path | None) -> Format:
    """--format if given, else what --output's extension says, else table; checks --output's folder."""
    if output is not None and not output.parent.is_dir():
        raise fail(f"cannot write {output}: no folder {output.parent}", 2)
    if fmt == Format.parquet and output is None:
        raise fail("--format parquet needs --output FILE", 2)
    if fmt is not None:
        return fmt
    if output is None:
        return Format.table
    found = FORMAT_BY_SUFFIX.get(output.suffix.lower())
    if found is None:
        raise fail(
            f"cannot tell the format from {output.name!r}: pass --format table|csv|json|jsonl|parquet", 2
        )
    return found


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def print_rows(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    fmt: Format | None,
    output: Path | None,
    *,
    title: str = "",
    limit: int | None = None,
    full: bool = False,
) -> None:
    """Rows in the output contract's format (see the module docstring), to stdout or ``output``."""
    fmt = resolve_format(fmt, output)
    total = len(rows)
    if limit is None and fmt == Format.table and output is None:
        limit = TABLE_ROWS_DEFAULT
    if limit:  # 0 and None: every row
        rows = rows[:limit]
    if fmt == Format.parquet:
        assert output is not None  # resolve_format refused parquet without --output
        _write_parquet(columns, rows, output)
        return
    if fmt == Format.table:
        width = None if full or output is not None else terminal_width()
        text = render_table(columns, rows, total=total, width=width, full=full, title=title)
    elif fmt == Format.csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([[_plain(v) for v in r] for r in rows])
        text = buffer.getvalue()
    elif fmt == Format.jsonl:
        text = "".join(_json_line(dict(zip(columns, r, strict=True))) + "\n" for r in rows)
    else:
        text = _json_line([dict(zip(columns, r, strict=True)) for r in rows]) + "\n"
    _write_text(text, output)


def _json_line(value: Any) -> str:
    return json.dumps(
        value, default=lambda v: _plain(v) if isinstance(v, datetime | date | bytes) else str(v)
    )


def _write_parquet(columns: Sequence[str], rows: Sequence[Sequence[Any]], output: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from runledger.schemas.durable import write_durably

    try:
        table = pa.table({c: [r[i] for r in rows] for i, c in enumerate(columns)})
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise fail(f"these rows do not fit a Parquet column ({exc}); use --format json or csv", 2) from None
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_durably(output, sink.getvalue().to_pybytes())
    err_console.print(f"wrote {plural(len(rows), 'row')} to {output}", highlight=False)


def terminal_width() -> int | None:
    """The width a table must fit: $COLUMNS, else the terminal's; None (no fitting) when piped."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


# -- tables ----------------------------------------------------------------------------------------

NULL = "NULL"  # as duckdb prints it; an empty string prints as nothing
MIN_CELL_WIDTH = 6  # a column is cut down to this before columns are hidden
# Every control character shown as an escape, never sent to the terminal (an ESC in a recorded value
# would otherwise move the cursor or clear the screen of whoever reads it).
_CONTROL = str.maketrans(
    {
        **_CONTROL_ESCAPES,
        "\n": "\\n",
        "\r": "\\r",
        "\t": "\\t",
    }
)


def _cell(value: Any, full: bool) -> str:
    kind = type(value)  # exact types first: this runs once per cell shown
    if kind is str:
        if not full and len(value) in (40, 64) and _HASH.fullmatch(value):
            return value[:7]
        return value.translate(_CONTROL) if _HAS_CONTROL(value) else value
    if kind is int or kind is float:
        return str(value)
    if value is None:
        return NULL
    if kind is bool:
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"), default=str).translate(_CONTROL)
    return str(_plain(value)).translate(_CONTROL)


_HAS_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]").search


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _numeric(rows: Sequence[Sequence[Any]], i: int) -> bool:
    """Whether column ``i`` holds numbers (right-aligned), judged by its first non-NULL value."""
    first = next((r[i] for r in rows if r[i] is not None), None)
    return isinstance(first, int | float) and not isinstance(first, bool)


def render_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    total: int | None = None,
    width: int | None = None,
    full: bool = False,
    title: str = "",
) -> str:
    """A box table like duckdb's CLI, as plain text: numbers right-aligned, cells cut with ``…`` so
    the table fits ``width`` (None: no limit), columns that still do not fit hidden and counted.

    Plain string work over the rows shown only: as cheap per row as CSV, whatever the total.
    """
    total = len(rows) if total is None else total
    cells = [[_cell(v, full) for v in r] for r in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    shown = list(range(len(columns)))
    if width is not None:
        shown, widths = _fit(widths, width)
    # (index, width, pad) per shown column: str.rjust for numbers, str.ljust for the rest.
    layout = [(i, widths[i], str.rjust if _numeric(rows, i) else str.ljust) for i in shown]
    lines = [title] if title else []
    bar = "─"
    lines.append("┌" + "┬".join(bar * (w + 2) for _i, w, _pad in layout) + "┐")
    lines.append("│ " + " │ ".join(_cut(columns[i], w).ljust(w) for i, w, _pad in layout) + " │")
    lines.append("├" + "┼".join(bar * (w + 2) for _i, w, _pad in layout) + "┤")
    for r in cells:
        lines.append("│ " + " │ ".join(pad(_cut(r[i], w), w) for i, w, pad in layout) + " │")
    lines.append("└" + "┴".join(bar * (w + 2) for _i, w, _pad in layout) + "┘")
    notes = []
    if len(rows) < total:
        notes.append(f"{len(rows)} of {total:,} rows (--limit 0 for all)")
    elif not rows:
        notes.append("0 rows")
    if len(shown) < len(columns):
        hidden = len(columns) - len(shown)
        notes.append(f"{hidden} of {plural(len(columns), 'column')} hidden (--format csv or json for all)")
    if notes:
        lines.append(", ".join(notes))
    return "\n".join(lines) + "\n"


def _fit(natural: list[int], width: int) -> tuple[list[int], list[int]]:
    """Column widths that fit ``width``: the widest are cut first, to no less than MIN_CELL_WIDTH;
    then columns are hidden from the right. Returns the shown column indexes and every width."""

    def room(n: int) -> int:  # characters left for n columns' text after borders and padding
        return width - (3 * n + 1)

    floor = [min(w, MIN_CELL_WIDTH) for w in natural]
    n = len(natural)
    while n > 1 and sum(floor[:n]) > room(n):
        n -= 1
    shown = list(range(n))
    budget = room(n)
    if sum(natural[:n]) <= budget:
        return shown, natural
    # The largest cap with sum(min(w, max(cap, floor))) within budget: cut only the widest columns.
    lo, hi = 0, max(natural[:n])
    while lo < hi:
        cap = (lo + hi + 1) // 2
        if sum(max(min(w, cap), f) for w, f in zip(natural[:n], floor, strict=False)) <= budget:
            lo = cap
        else:
            hi = cap - 1
    widths = [max(min(w, lo), f) for w, f in zip(natural, floor, strict=False)]
    return shown, widths


def print_json(value: Any, output: Path | None = None) -> None:
    """The one way a command prints a JSON document (stats, a state, a proof): indented, to stdout or --output."""
    import msgspec

    if output is not None:
        resolve_format(Format.json, output)
    _write_text(
        msgspec.json.format(msgspec.json.encode(value, enc_hook=str), indent=2).decode() + "\n", output
    )


def _write_text(text: str, output: Path | None) -> None:
    if output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        # Imported here: `schemas` brings NumPy, which a command that prints to stdout never needs.
        from runledger.schemas.durable import write_durably

        write_durably(output, text)


# -- a full disk -----------------------------------------------------------------------------------

# The options naming where a command writes: a full disk's line names the fullest of them.
WRITE_OPTIONS = ("--ledger", "--spool", "--to", "--output", "-o", "--workdir")
WRITE_ENV = {
    "--ledger": ("RUNLEDGER_LEDGER", ".runledger/ledger"),
    "--spool": ("RUNLEDGER_SPOOL", ".runledger/spool"),
}


def disk_full_error(exc: BaseException, candidates: Sequence[Path]) -> typer.Exit:
    """One line for a full disk (or an exceeded quota): where, how much is free, what to do. Exit 1.

    The path is the one the operating system named, else the candidate on the fullest filesystem
    (pyarrow's and a spool's write errors name no file)."""
    from runledger.schemas.durable import disk_full, disk_full_path  # (the package: not on --help's path)

    found = disk_full(exc)
    filename = None if found is None else disk_full_path(found)
    where = Path(filename) if filename else _fullest([Path(c) for c in candidates])
    quota = isinstance(found, OSError) and found.errno == errno.EDQUOT
    what = "disk quota exceeded" if quota else "no space left on device"
    free = _free_text(where) if where is not None else ""
    place = f" writing {where}{free}" if where is not None else ""
    return fail(
        f"{what}{place}: free some space there (or point the command at a larger disk) and run it "
        "again; what was stored before the disk filled is kept"
    )


def _fullest(paths: Sequence[Path]) -> Path | None:
    """The path (of ``paths``) whose filesystem has the least space free."""
    best: tuple[int, Path] | None = None
    for path in paths:
        usage = _usage(path)
        if usage is not None and (best is None or usage.free < best[0]):
            best = (usage.free, path)
    return best[1] if best else (paths[0] if paths else None)


def _usage(path: Path) -> Any:
    """``shutil.disk_usage`` of the nearest folder of ``path`` that exists, or None."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder)
            except OSError:
                return None
    return None


def _free_text(path: Path) -> str:
    usage = _usage(path)
    if usage is None:
        return ""
    return f" ({_bytes_text(usage.free)} free of {_bytes_text(usage.total)})"


def _bytes_text(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:,.0f} {unit}" if unit in ("B", "KB") else f"{count:,.1f} {unit}"
        count /= 1024  # type: ignore[assignment]
    return f"{count:,.1f} TB"


def write_paths(args: Sequence[str]) -> list[Path]:
    """The paths a command line names after its writing options (``--ledger X``, ``--spool=X``…),
    and the defaults of ``--ledger``/``--spool`` when not given: where a command may have filled a disk."""
    found: dict[str, str] = {}
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name in WRITE_OPTIONS:
            if sep:
                found[name] = value
            elif i + 1 < len(args):
                found[name] = args[i + 1]
    for option, (env, default) in WRITE_ENV.items():
        found.setdefault(option, os.environ.get(env) or default)
    return [Path(v) for v in found.values()]


class DiskFullGroup(TyperGroup):
    """The app's group: a full disk (ENOSPC, EDQUOT) in any command is one line naming where and
    what to do, never a traceback (the commands that know their path say it through ``user_errors``)."""

    def invoke(self, ctx: Any) -> Any:
        args = [*getattr(ctx, "protected_args", []), *ctx.args]  # the subcommand and its arguments
        try:
            return super().invoke(ctx)
        except Exception as exc:
            from runledger.schemas.durable import disk_full

            if disk_full(exc) is None:
                raise
            raise disk_full_error(exc, write_paths(args)) from None


# -- progress --------------------------------------------------------------------------------------

# Seconds between progress lines on stderr when it is not a terminal (a log, a pipe, CI); 0: every
# update, "off": none. On a terminal a rich progress bar is drawn instead.
PROGRESS_ENV = "RUNLEDGER_PROGRESS_S"
PROGRESS_EVERY_S = 5.0

# What a library loop calls with how far it got: (done, total or None when unknown).
ProgressCallback = Callable[[int, int | None], None]


@contextmanager
def progress(what: str, unit: str) -> Iterator[ProgressCallback]:
    """Progress of long work, the same in every command: yields ``report(done, total=None)`` for the
    library's loop to call. A rich bar on a terminal (gone when the work ends); otherwise one line
    every ``$RUNLEDGER_PROGRESS_S`` seconds (default 5) on stderr, e.g.
    ``ingest spool: 120,000 records, 24,000/s, 5 s`` or ``verify: 3,000 of 12,000 events (25%), …``."""
    if err_console.is_terminal:
        with _bar(what, unit) as report:
            yield report
        return
    yield _line_reporter(what, unit, _progress_interval())


def _progress_interval() -> float | None:
    text = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if text in ("off", "none", "no"):
        return None
    try:
        return max(0.0, float(text)) if text else PROGRESS_EVERY_S
    except ValueError:
        return PROGRESS_EVERY_S


def _line_reporter(what: str, unit: str, every_s: float | None) -> ProgressCallback:
    started = time.monotonic()
    last = [started]

    def report(done: int, total: int | None = None) -> None:
        now = time.monotonic()
        if every_s is None or now - last[0] < every_s:
            return
        last[0] = now
        err_console.print(
            progress_line(what, unit, done, total, now - started), highlight=False, markup=False
        )

    return report


def progress_line(what: str, unit: str, done: int, total: int | None, seconds: float) -> str:
    """``verify: 3,000 of 12,000 events (25%), 1,500/s, 2 s``."""
    count = f"{done:,} of {total:,} {unit}" if total else f"{done:,} {unit}"
    if total:
        count += f" ({100 * done / total:.0f}%)"
    rate = f", {done / seconds:,.0f}/s" if seconds > 0 else ""
    return f"{what}: {count}{rate}, {seconds:.0f} s"


@contextmanager
def _bar(what: str, unit: str) -> Iterator[ProgressCallback]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console.made, transient=True) as bar:
        task = bar.add_task(what, total=None)

        def report(done: int, total: int | None = None) -> None:
            bar.update(task, completed=done, total=total)

        yield report


def commits_counted(report: ProgressCallback) -> Callable[[Any], None]:
    """An ingester's ``on_commit`` that reports the records read so far (each record of a batch is
    accepted, a duplicate, skipped or quarantined: ``runledger.ledger.store.CommitResult``; the events
    the ledger made of them, ``made``, are not records read)."""
    read = [0]

    def on_commit(result: Any) -> None:
        read[0] += (
            result.accepted - result.made + result.duplicates + result.skipped + len(result.quarantined)
        )
        report(read[0], None)

    return on_commit
