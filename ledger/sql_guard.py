"""The walls around read-only SQL on a ledger: a locked DuckDB connection, a statement check done by
DuckDB's own parser, and limits on what one statement may spend.

The first wall is DuckDB's own: once the views are defined, the connection's external access is
turned off with only the ledger's table folders allowed (``allowed_directories``), extensions can
neither be installed nor loaded, and the configuration is locked, so no statement can turn any of it
back on. Outside those folders DuckDB itself refuses to read or write anything (the private keys,
``/etc``, the home folder, the commit log and the signed checkpoints included).

DuckDB has no read-only access mode for files: inside the allowed folders it could write (a
``COPY ... TO`` a forged Parquet file), and a loaded extension does its own I/O past
``allowed_directories`` (``sqlite_scan('/any/file.db', 't')``). The second wall is the statement
check, made over DuckDB's parse of the text, never over the text itself (a regular expression over
the text was defeated by ``sqlite_scan/**/(`` and ``name--x⏎(``, which DuckDB accepts):

* ``con.extract_statements`` gives each statement's type whatever comments surround its words: one
  statement, a ``SELECT`` (``PIVOT``, ``SUMMARIZE``, ``DESCRIBE``, ``SHOW``, ``VALUES``, ``FROM`` ...
  are parsed as selects), or an ``EXPLAIN [ANALYZE]`` of one; everything else is refused.
* ``json_serialize_sql`` gives a SELECT's parse tree: every table function, function call and table
  reference, by the name DuckDB will look up (lower case, comments and quotes gone, schema apart).
  Each is checked against an allow-list:

  - table functions: an explicit list (``TABLE_FUNCTIONS``: ranges, ``unnest``, JSON walkers,
    DuckDB's catalogue listings, the Parquet readers and ``glob`` (file names), which the lock
    confines to the ledger's folders), plus the table macros the views define (``config_at``);
    everything else is refused by name (``read_text``, ``read_csv``, ``read_blob``, ``query``,
    ``enable_logging``, ``sqlite_scan``, ``ducklake_*`` ...).
  - scalar, aggregate and window functions: **an allow-list derived once per process** from a plain
    connection's built-in functions (``duckdb_functions()``: scalar, aggregate, macro) minus the few
    that act (``ACTING_FUNCTIONS``). Chosen over a list of refused names because a name the list's
    author did not think of is refused, not allowed: an extension's function (``sqlite_attach``,
    ``postgres_query``, ``ducklake_*``), a future DuckDB's new acting function, and a function by an
    unexpected spelling all fail closed. The cost is that a mistyped function name is refused as
    "not allowed here" rather than answered by DuckDB's "did you mean".
  - table references: a plain name (a view), never a path (``FROM '/etc/passwd'``, ``'x.db'``:
    DuckDB's replacement scans would read the file), in this connection's own catalogs only.

  duckdb 1.5 hands a ``PIVOT`` without ``IN`` back as its parts with no text (an enum made of the
  pivoted values, then the select), which ``json_serialize_sql`` cannot read: such a statement is
  checked over DuckDB's tokens instead (``duckdb.tokenize``, comments gone): every word called as a
  function must not be a refused table function, an acting function or an extension's, and no
  string may follow ``FROM``/``JOIN`` (a file read by name).

The third wall is the limits (``QueryLimits``): a statement stopped after ``timeout_s`` (a timer
calls ``con.interrupt()``: duckdb 1.5 has no statement timeout setting), DuckDB's ``memory_limit``,
and spills to a folder of the reader's own (``SpillFolder``) bounded by ``max_temp_directory_size``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import msgspec

from runledger.ledger.duck import one_row
from runledger.schemas.durable import process_running

_T = TypeVar("_T")

_PIVOT = re.compile(r"(PIVOT|PIVOT_WIDER)\b", re.IGNORECASE)
_EXPLAIN_DEPTH = 4  # EXPLAIN of EXPLAIN does not parse; a bound all the same

# Table functions a statement may call: they read nothing but the ledger's files (the lock confines
# the Parquet readers and glob to the table folders) and DuckDB's own catalogue of this connection.
TABLE_FUNCTIONS = frozenset(
    {
        "range",
        "generate_series",
        "unnest",
        "repeat",
        "repeat_row",
        "json_each",
        "json_tree",
        "read_parquet",
        "parquet_scan",
        "parquet_metadata",
        "parquet_schema",
        "parquet_file_metadata",
        "parquet_kv_metadata",
        "glob",
        "duckdb_views",
        "duckdb_tables",
        "duckdb_columns",
        "duckdb_types",
        "duckdb_functions",
        "duckdb_keywords",
        "duckdb_schemas",
        "pg_timezone_names",
        "icu_calendar_names",
        "histogram_values",
    }
)
# Built-in functions callable from a SELECT that act instead of computing: write_log writes into
# DuckDB's log (a file, once logging is on), json_execute_serialized_sql runs SQL the check never
# saw, the sequence functions change state, current_setting shows settings a secret may sit in.
ACTING_FUNCTIONS = frozenset(
    {
        "write_log",
        "json_execute_serialized_sql",
        "nextval",
        "currval",
        "setval",
        "current_setting",
        "getenv",
        "query",
        "query_table",
        "enable_logging",
        "disable_logging",
        "truncate_duckdb_logs",
        "enable_profiling",
        "disable_profiling",
        "checkpoint",
        "force_checkpoint",
    }
)
# Functions the binder rewrites rather than looks up (not in duckdb_functions()): unnest in a select list.
_SPECIAL_FUNCTIONS = frozenset({"unnest", "unlist"})
# Extensions' functions (the catalog scanners and DuckLake open files with their own I/O): refused
# by the allow-list anyway; named here for the token check of an expanded PIVOT.
_EXTENSION_PREFIXES = ("sqlite_", "postgres_", "ducklake_", "mysql_", "iceberg_", "delta_")
_OWN_CATALOGS = frozenset({"", "memory", "system", "temp"})
_PATH_CHARACTERS = frozenset("/\\.:*?")
_FROM_WORDS = frozenset({"from", "join", "pivot", "unpivot", "using"})


class RefusedStatement(ValueError):
    """A statement the read-only walls refuse, or one that does not parse: its one-line reason."""


class StatementStopped(ValueError):
    """A statement stopped by a limit (``QueryLimits``): its one-line reason."""


# ------------------------------------------------------------------------------------- the lock


def lock_connection(
    con: duckdb.DuckDBPyConnection,
    allowed: Iterable[Path],
    *,
    limits: QueryLimits | None = None,
    spill: Path | None = None,
) -> None:
    """Turn off the connection's access to anything but the ``allowed`` folders, and lock that;
    ``limits``: DuckDB's memory and spill limits set first (spilling into ``spill``), locked with it.

    Call it after the views are defined (defining them needs nothing, but their queries read the
    folders, which stay allowed). Costs well under a millisecond (``bench/bench_query_lock.py``).
    """
    con.execute(lock_sql(allowed, limits=limits, spill=spill))


def lock_sql(allowed: Iterable[Path], *, limits: QueryLimits | None = None, spill: Path | None = None) -> str:
    """``lock_connection`` as SQL text, for an init file read by DuckDB's own shell."""
    folders = ", ".join(_literal(f"{p.resolve().as_posix().rstrip('/')}/") for p in allowed)
    bounds = limits_sql(limits, spill) if limits is not None else ""
    return (
        bounds + f"SET allowed_directories = [{folders}];\n"
        "SET enable_external_access = false;\n"
        "SET autoinstall_known_extensions = false;\n"
        "SET autoload_known_extensions = false;\n"
        "SET allow_community_extensions = false;\n"
        "SET lock_configuration = true;\n"
    )


# ----------------------------------------------------------------------------------- the limits

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SPILL_LIMIT = "10GB"
_MAX_DEFAULT_MEMORY_BYTES = 2 * 2**30
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.IGNORECASE)


def default_memory_limit() -> str:
    """2 GiB or a quarter of the machine's memory, whichever is smaller (a laptop survives it)."""
    try:
        ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a system without sysconf: the cap
        ram_bytes = 4 * _MAX_DEFAULT_MEMORY_BYTES
    return f"{min(_MAX_DEFAULT_MEMORY_BYTES, ram_bytes // 4) // 2**20}MiB"


class QueryLimits(msgspec.Struct, frozen=True):
    """What one statement may spend: seconds (``timeout_s``; None: no timer), memory and spill (DuckDB
    sizes: ``2GB``, ``512MiB``)."""

    timeout_s: float | None = DEFAULT_TIMEOUT_S
    memory_limit: str = ""  # "": default_memory_limit()
    spill_limit: str = DEFAULT_SPILL_LIMIT

    def memory(self) -> str:
        return self.memory_limit or default_memory_limit()


def query_limits(
    timeout_s: float | None = None, memory: str | None = None, spill: str | None = None
) -> QueryLimits:
    """``QueryLimits`` from command-line options (None: the default), or ValueError in one line."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"--timeout {timeout_s:g}: give seconds above 0")
    return QueryLimits(
        timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
        memory_limit=_size(memory, "--memory-limit") if memory is not None else "",
        spill_limit=_size(spill, "--spill-limit") if spill is not None else DEFAULT_SPILL_LIMIT,
    )


def _size(text: str, option: str) -> str:
    found = _SIZE.fullmatch(text.strip())
    if found is None or float(found.group(1)) <= 0:
        raise ValueError(f"{option} {text!r}: give a size such as 512MB or 2GB")
    return f"{found.group(1)}{found.group(2)}"


def limits_sql(limits: QueryLimits, spill: Path | None) -> str:
    """DuckDB's settings for ``limits``, spilling into ``spill`` (made by DuckDB when first needed:
    its parent must exist); set before the lock, which freezes them."""
    lines = [
        f"SET memory_limit = {_literal(limits.memory())};\n",
        f"SET max_temp_directory_size = {_literal(limits.spill_limit)};\n",
    ]
    if spill is not None:
        lines.append(f"SET temp_directory = {_literal(spill.as_posix())};\n")
    return "".join(lines)


class SpillFolder:
    """One connection's spill folder, ``<area>/spill-<pid>-<hex>``. DuckDB makes it when a statement
    first spills, deletes its files when the statement ends (stopped or not) and the folder when the
    connection closes; what is left by a statement is removed after it (``clear``), and a folder whose
    process is gone (killed mid-spill) is removed when the next one is made. The folder itself stays
    while its connection is open: DuckDB keeps its handle, and spills into a removed one fail."""

    def __init__(self, area: Path) -> None:
        self.area = area
        self.path = area / f"spill-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    @classmethod
    def under(cls, area: Path) -> SpillFolder:
        """A new spill folder's name under ``area`` (made now if missing), dead processes' removed."""
        area.mkdir(parents=True, exist_ok=True)
        remove_dead_spills(area)
        return cls(area)

    def clear(self) -> None:
        """Remove what a statement left (normally nothing: DuckDB deletes its spill files)."""
        if not self.path.is_dir():
            return
        for left in self.path.iterdir():
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)

    def remove(self) -> None:
        """Remove the folder (after its connection closed)."""
        shutil.rmtree(self.path, ignore_errors=True)


def remove_dead_spills(area: Path) -> list[Path]:
    """Remove the spill folders under ``area`` whose process is no longer alive; the ones removed."""
    removed = []
    for folder in area.glob("spill-*-*"):
        pid = folder.name.split("-")[1]
        if pid.isdecimal() and not process_running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def run_limited(con: duckdb.DuckDBPyConnection, timeout_s: float | None, statement: Callable[[], _T]) -> _T:
    """``statement()`` on ``con``, interrupted after ``timeout_s`` seconds (StatementStopped): one
    statement's ``StatementTimer``, closed when it ends."""
    timer = StatementTimer(con)
    try:
        return timer.run(timeout_s, statement)
    finally:
        timer.close()


class StatementTimer:
    """Interrupts a statement on ``con`` that runs past its timeout (StatementStopped): one thread
    for all of a connection's statements, started with the first (a thread started per statement
    was ~0.4 ms here, and a one-shot ``ledger state`` asks seven).

    It interrupts only while the statement runs: one that ends as its time runs out is not cut
    short, and a later statement is never hit. The thread holds the connection only while a
    statement runs, so a reader dropped without ``close`` is collected as before; the thread ends
    with the timer (``close``, its collection, or the interpreter's exit: ``_stop_every_watch``).
    No such thread is left running, or woken, while the interpreter finalizes: one was seen to abort
    the process ("terminate called without an active exception", exit -6)."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self._con = con
        self._watch = _Watch()
        stop = weakref.finalize(self, self._watch.stop)
        stop.atexit = False  # (the exit's own stop runs first: _stop_every_watch)

    def run(self, timeout_s: float | None, statement: Callable[[], _T]) -> _T:
        if timeout_s is None:
            return statement()
        watch = self._watch
        mine = watch.begin(time.monotonic() + timeout_s, self._con)
        try:
            answer = statement()
        except duckdb.InterruptException:
            if watch.end(mine):
                raise StatementStopped(f"query stopped after {timeout_s:g} s (--timeout)") from None
            raise
        except BaseException:
            watch.end(mine)
            raise
        watch.end(mine)
        return answer

    def close(self) -> None:
        self._watch.stop()


class _Watch:
    """A ``StatementTimer``'s state and thread (which holds no reference to the timer)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()  # guards every field below
        # Each running statement: its deadline (time.monotonic) and its connection.
        self.due: dict[int, tuple[float, duckdb.DuckDBPyConnection]] = {}
        self.fired: set[int] = set()  # statements the timer interrupted
        self.count = 0
        self.closed = False
        self.thread: threading.Thread | None = None

    def begin(self, deadline: float, con: duckdb.DuckDBPyConnection) -> int:
        """A statement about to run on ``con``, to interrupt at ``deadline``: its number."""
        with self.changed:
            if self.closed:
                raise RuntimeError("statement timer closed")
            self.count += 1
            self.due[self.count] = (deadline, con)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="statement-timer", daemon=True)
                _WATCHES.add(self)
                self.thread.start()
            self.changed.notify()
            return self.count

    def end(self, statement: int) -> bool:
        """The statement's end (no interrupt after it); whether the timer interrupted it."""
        with self.changed:
            self.due.pop(statement, None)
            fired = statement in self.fired
            self.fired.discard(statement)
            self.changed.notify()
        return fired

    def _run(self) -> None:
        with self.changed:
            while not self.closed:
                if not self.due:
                    self.changed.wait()
                    continue
                statement, (due, con) = min(self.due.items(), key=lambda item: item[1][0])
                left = due - time.monotonic()
                if left > 0:
                    self.changed.wait(left)
                    continue
                del self.due[statement]
                self.fired.add(statement)
                con.interrupt()

    def stop(self) -> None:
        """End the thread and wait for it (bounded); not woken once the interpreter finalizes."""
        if sys.is_finalizing():
            return
        with self.changed:
            self.closed = True
            self.changed.notify()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=STOP_WAIT_S)
        _WATCHES.discard(self)


STOP_WAIT_S = 5.0  # a stopped timer's thread only leaves its loop: this is never reached
_WATCHES: weakref.WeakSet[_Watch] = weakref.WeakSet()  # the watches with a thread


@atexit.register
def _stop_every_watch() -> None:
    """At exit, before the interpreter finalizes: every timer's thread ended (a reader left open)."""
    for watch in list(_WATCHES):
        watch.stop()


def limit_error(error: duckdb.Error, limits: QueryLimits) -> str | None:
    """A DuckDB error a limit caused, as one line naming the option; None for any other error."""
    if not isinstance(error, duckdb.OutOfMemoryException):
        return None
    text = str(error)
    if "max_temp_directory_size" in text:
        return f"query stopped: it needed more than --spill-limit {limits.spill_limit} of spill"
    first = text.strip().splitlines()[0].split(" Error: ", 1)[-1]
    return f"query stopped: it needed more than --memory-limit {limits.memory()} ({first})"


# ------------------------------------------------------------------------------ the statement check


def read_only_statement(con: duckdb.DuckDBPyConnection, text: str) -> str:
    """The one read-only statement in ``text``, or RefusedStatement saying why not.

    Several statements are refused (one result each would have to be dropped but the last's).
    """
    statements = _parse(con, text)
    if not statements:
        raise RefusedStatement("empty query")
    if _is_expanded_pivot(text, statements):
        _check_tokens(con, text)
        return text
    for st in statements:
        _check(con, st, 0)
    if len(statements) > 1:
        raise RefusedStatement(
            f"{len(statements)} statements given; run one at a time (or several in `ledger shell`)"
        )
    return str(statements[0].query)


def split_statements(con: duckdb.DuckDBPyConnection, text: str) -> list[str]:
    """The statements of ``text`` in order (the shell runs each through the check on its own)."""
    parts = [str(st.query) for st in _parse(con, text)]
    if not all(part.strip() for part in parts):  # a duckdb 1.5 PIVOT's parts have no text: keep it whole
        return [text]
    return parts


def _parse(con: duckdb.DuckDBPyConnection, text: str) -> list[duckdb.Statement]:
    try:
        return list(con.extract_statements(text))
    except duckdb.Error as exc:  # DuckDB's errors keep their line breaks: the caret stays under the mistake
        raise RefusedStatement(str(exc).strip()) from None


def _is_expanded_pivot(text: str, statements: list[duckdb.Statement]) -> bool:
    """duckdb 1.5 hands a PIVOT without IN back as its parts: CREATE TYPE enums, then the SELECT,
    each with no text of its own (2.0 gives one MULTI statement). Nothing else parses that way."""
    if len(statements) < 2:
        return False
    *creates, select = statements
    return (
        select.type.name == "SELECT"
        and all(st.type.name == "CREATE" for st in creates)
        and not any(str(st.query).strip() for st in statements)
        and any(_word(text, tok) in ("pivot", "pivot_wider") for tok in _tokens(text))
    )


def _check(con: duckdb.DuckDBPyConnection, st: duckdb.Statement, depth: int) -> None:
    try:
        kind = st.type.name
    except ValueError:  # a statement type this duckdb's Python enum does not name (UPDATE EXTENSIONS)
        kind = "non-SELECT"
    query = str(st.query)
    if kind == "SELECT":
        _check_tree(con, query)
        return
    if kind == "MULTI" and _PIVOT.match(_skip_comments(query)):  # duckdb 2.0's PIVOT without IN
        _check_tokens(con, query)
        return
    if kind == "EXPLAIN" and depth < _EXPLAIN_DEPTH:
        # EXPLAIN ANALYZE runs what it explains: the statement inside must pass on its own.
        inner = _explained(query)
        parts = _parse(con, inner) if inner is not None else []
        if len(parts) == 1:
            _check(con, parts[0], depth + 1)
            return
        kind = "this EXPLAIN"
    raise RefusedStatement(f"refused: the ledger is read-only here ({kind} statements are not allowed)")


def _check_tree(con: duckdb.DuckDBPyConnection, query: str) -> None:
    """Every table function, function and table a SELECT names is one it may (its parse tree)."""
    tree = _serialized(con, query)
    if tree.get("error"):
        raise RefusedStatement(
            f"refused: DuckDB could not show this statement's parts ({tree.get('error_message')})"
        )
    for kind, name, where in _named_parts(tree):
        reason = _refusal(con, kind, name, where)
        if reason is not None:
            raise RefusedStatement(f"refused: {reason}")


def _serialized(con: duckdb.DuckDBPyConnection, query: str) -> dict[str, Any]:
    """DuckDB's parse tree of ``query`` (``json_serialize_sql``), on a cursor of ``con`` (a connection
    of its own, so a busy ``con`` does not matter; a new database would cost ~7 ms). The text goes in
    as a literal (a prepared parameter costs ~0.2 ms more), and a text checked before is not parsed
    again (the folds ask the same ones)."""
    text = _TREES.get(query)
    if text is None:
        with contextlib.closing(con.cursor()) as cursor:
            row = one_row(cursor.execute(f"SELECT json_serialize_sql({_literal(query)})"))
        if row is None:
            raise RefusedStatement("refused: DuckDB gave no parse tree for this statement")
        text = str(row[0])
        with _TREES_LOCK:
            if len(_TREES) >= _TREES_KEPT:
                _TREES.pop(next(iter(_TREES)), None)
            _TREES[query] = text
    parsed: dict[str, Any] = json.loads(text)
    return parsed


_TREES: dict[str, str] = {}  # statement text -> its parse tree's JSON, the newest ``_TREES_KEPT``
_TREES_KEPT = 512
_TREES_LOCK = threading.Lock()


def _named_parts(tree: Any) -> Iterator[tuple[str, str, str]]:
    """(kind, name, qualifier) of every table function, function, window function and table a
    parse tree names, however deep (subqueries, CTEs, lateral joins, lambdas, set operations)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind, cls = node.get("type"), node.get("class")
        if kind == "TABLE_FUNCTION" and isinstance(node.get("function"), dict):
            function = node["function"]
            yield "table function", str(function.get("function_name", "")), str(function.get("catalog", ""))
            stack.extend(v for k, v in function.items() if k != "function_name")
            stack.extend(v for k, v in node.items() if k != "function")
            continue
        if kind == "BASE_TABLE":
            yield "table", str(node.get("table_name", "")), str(node.get("catalog_name", ""))
        elif cls in ("FUNCTION", "AGGREGATE") and "function_name" in node:
            yield "function", str(node["function_name"]), str(node.get("catalog", ""))
        elif cls == "WINDOW" and kind == "WINDOW_AGGREGATE":  # (row_number, lag ... are DuckDB's own)
            yield "function", str(node.get("function_name", "")), str(node.get("catalog", ""))
        stack.extend(node.values())


def _refusal(con: duckdb.DuckDBPyConnection, kind: str, name: str, catalog: str) -> str | None:
    """Why the part is not allowed, or None."""
    lower, qualifier = name.lower(), catalog.lower()
    if qualifier not in _OWN_CATALOGS:
        return f"{kind} {name} in catalog {catalog} is not allowed here (the ledger's views are in memory)"
    if kind == "table":
        if _PATH_CHARACTERS & set(name):
            return (
                f"reading {name!r} by name is not allowed here (the ledger's tables are views: SHOW TABLES)"
            )
        return None
    if kind == "table function":
        if lower in TABLE_FUNCTIONS or lower in _view_macros(con):
            return None
        return f"table function {name}() is not allowed here"
    if lower in _builtin_functions() or lower in _view_macros(con):
        return None
    return f"function {name}() is not allowed here"


def _check_tokens(con: duckdb.DuckDBPyConnection, text: str) -> None:
    """The check of a statement DuckDB gives no parse tree of (a PIVOT without IN), over its tokens."""
    tokens = _tokens(text)
    words = [_word(text, tok, tokens[i + 1] if i + 1 < len(tokens) else None) for i, tok in enumerate(tokens)]
    for i, (tok, word) in enumerate(zip(tokens, words, strict=True)):
        following = words[i + 1] if i + 1 < len(words) else ""
        if following == "(" and tok[1] in (duckdb.token_type.identifier, duckdb.token_type.keyword):
            name = word.strip('"').lower()
            if _refused_call(con, name):
                raise RefusedStatement(f"refused: {name}() is not allowed here")
        if tok[1] == duckdb.token_type.string_const and i > 0 and words[i - 1] in _FROM_WORDS:
            raise RefusedStatement(f"refused: reading {word} by name is not allowed here")


def _refused_call(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether a word called as a function in a statement checked by tokens is refused."""
    if name in ACTING_FUNCTIONS or name.startswith(_EXTENSION_PREFIXES):
        return True
    return (
        name in _builtin_table_functions() and name not in TABLE_FUNCTIONS and name not in _view_macros(con)
    )


def _tokens(text: str) -> list[tuple[int, Any]]:
    try:
        return list(duckdb.tokenize(text))
    except duckdb.Error as exc:
        raise RefusedStatement(str(exc).strip()) from None


def _word(text: str, tok: tuple[int, Any], after: tuple[int, Any] | None = None) -> str:
    """A token's text, lower case (up to the next token; comments between them are dropped by
    ending the word at the first space, comment or parenthesis)."""
    end = after[0] if after is not None else len(text)
    piece = text[tok[0] : end]
    if piece.startswith(("'", '"')):
        close = piece.find(piece[0], 1)
        while close >= 0 and piece[close + 1 : close + 2] == piece[0]:  # a doubled quote inside
            close = piece.find(piece[0], close + 2)
        return piece[: close + 1] if close >= 0 else piece
    found = re.match(r"[^\s(/-]+|\(", piece)
    return found.group(0).lower() if found else piece.strip().lower()


def _explained(query: str) -> str | None:
    """The statement an ``EXPLAIN [ANALYZE] [(options)]`` explains (found over DuckDB's tokens, so
    comments anywhere between the words count for nothing), or None if the form is not known."""
    tokens = _tokens(query)
    words = [
        _word(query, tok, tokens[i + 1] if i + 1 < len(tokens) else None) for i, tok in enumerate(tokens)
    ]
    if not words or words[0] != "explain":
        return None
    i = 1
    if i < len(words) and words[i] in ("analyze", "analyse"):
        i += 1
    if i < len(words) and words[i] == "(":  # EXPLAIN (FORMAT json, ANALYZE) ...: options hold no parentheses
        close = words.index(")", i) if ")" in words[i:] else -1
        if close < 0 or "(" in words[i + 1 : close]:
            return None
        i = close + 1
    return query[tokens[i][0] :] if i < len(tokens) else None


@lru_cache(maxsize=1)
def _builtin_functions() -> frozenset[str]:
    """The scalar, aggregate and macro functions of a plain DuckDB (no extension loaded) but the
    acting ones."""
    return (_duckdb_names()[0] | _SPECIAL_FUNCTIONS) - ACTING_FUNCTIONS


def _builtin_table_functions() -> frozenset[str]:
    return _duckdb_names()[1]


@lru_cache(maxsize=1)
def _duckdb_names() -> tuple[frozenset[str], frozenset[str]]:
    """DuckDB's own (functions, table functions): kept for the pinned version (asking DuckDB costs
    ~15 ms a process), asked of any other once per process."""
    from runledger.ledger import duckdb_names

    if duckdb.__version__ == duckdb_names.DUCKDB_VERSION:
        return duckdb_names.FUNCTIONS, duckdb_names.TABLE_FUNCTIONS
    return duckdb_names.derived()


def _view_macros(con: duckdb.DuckDBPyConnection) -> frozenset[str]:
    """The macros the ledger's views define on ``con`` (``config_at``): the only functions on it that
    are not DuckDB's own (a statement cannot make one: CREATE is refused)."""
    rows = con.execute(
        "SELECT DISTINCT lower(function_name) FROM duckdb_functions() WHERE NOT internal "
        "AND function_type IN ('macro', 'table_macro') AND database_name IN ('memory', 'temp', 'system')"
    ).fetchall()
    return frozenset(name for (name,) in rows)


def _skip_comments(text: str) -> str:
    """``text`` without the white space and SQL comments in front of its first word."""
    i = 0
    while i < len(text):
        if text[i].isspace():
            i += 1
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end + 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = len(text) if end < 0 else end + 2
        else:
            break
    return text[i:]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
