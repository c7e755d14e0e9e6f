"""The two walls around read-only SQL on a ledger: a locked DuckDB connection, and a statement check.

The first wall is DuckDB's own: once the views are defined, the connection's external access is
turned off with only the ledger's table folders allowed (``allowed_directories``), extensions can
neither be installed nor loaded, and the configuration is locked, so no statement can turn any of it
back on. Outside those folders DuckDB itself refuses to read or write anything (the private keys,
``/etc``, the home folder, the commit log and the signed checkpoints included).

DuckDB has no read-only access mode for files: inside the allowed folders it could write (a
``COPY ... TO`` a forged Parquet file). The second wall is the statement check: one statement, a
``SELECT`` (``PIVOT``, ``SUMMARIZE``, ``DESCRIBE``, ``SHOW``, ``VALUES``, ``FROM`` ... are parsed as
selects), or an ``EXPLAIN [ANALYZE]`` of one; everything else is refused before it runs, whatever
wraps it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import duckdb

# A PIVOT without IN parses as MULTI (DuckDB first makes an enum type of the pivoted values in this
# in-memory connection, then selects): read-only as far as the ledger goes.
_PIVOT = re.compile(r"(PIVOT|PIVOT_WIDER)\b", re.IGNORECASE)
_EXPLAIN = re.compile(r"EXPLAIN\b(\s+ANALY[SZ]E\b)?\s*", re.IGNORECASE)
_EXPLAIN_DEPTH = 4  # EXPLAIN of EXPLAIN does not parse; a bound all the same
# Table functions that act instead of reading, callable from a SELECT: duckdb 1.5's enable_logging
# writes its log files into any allowed folder, whatever lock_configuration says; query() and
# json_execute_serialized_sql run SQL built from strings the check cannot see. Refused by name
# anywhere in the text (quoted or schema-qualified too; a string that merely names one is refused as well).
_ACTING_FUNCTIONS = (
    "enable_logging",
    "disable_logging",
    "truncate_duckdb_logs",
    "enable_profiling",
    "disable_profiling",
    "checkpoint",
    "force_checkpoint",
    "query",
    "json_execute_serialized_sql",
)
_ACTING_CALL = re.compile(r'(?<![\w$])"?(' + "|".join(_ACTING_FUNCTIONS) + r')"?\s*\(', re.IGNORECASE)
# The catalog extensions a ledger on DuckLake loads (sqlite_scanner, postgres_scanner, ducklake) open
# databases with their own I/O, past allowed_directories: sqlite_scan('/any/file.db') would read any
# SQLite file on the machine. Their functions are refused by prefix (the lake is read through its views).
_FOREIGN_CALL = re.compile(r'(?<![\w$])"?((?:sqlite|postgres|ducklake)_\w*)"?\s*\(', re.IGNORECASE)


class RefusedStatement(ValueError):
    """A statement the read-only walls refuse, or one that does not parse: its one-line reason."""


def lock_connection(con: duckdb.DuckDBPyConnection, allowed: Iterable[Path]) -> None:
    """Turn off the connection's access to anything but the ``allowed`` folders, and lock that.

    Call it after the views are defined (defining them needs nothing, but their queries read the
    folders, which stay allowed). Costs well under a millisecond (``bench/bench_query_lock.py``).
    """
    con.execute(lock_sql(allowed))


def lock_sql(allowed: Iterable[Path]) -> str:
    """``lock_connection`` as SQL text, for an init file read by DuckDB's own shell."""
    folders = ", ".join(_literal(f"{p.resolve().as_posix().rstrip('/')}/") for p in allowed)
    return (
        f"SET allowed_directories = [{folders}];\n"
        "SET enable_external_access = false;\n"
        "SET autoinstall_known_extensions = false;\n"
        "SET autoload_known_extensions = false;\n"
        "SET allow_community_extensions = false;\n"
        "SET lock_configuration = true;\n"
    )


def read_only_statement(con: duckdb.DuckDBPyConnection, text: str) -> str:
    """The one read-only statement in ``text``, or RefusedStatement saying why not.

    Several statements are refused (one result each would have to be dropped but the last's).
    """
    acting = _ACTING_CALL.search(text) or _FOREIGN_CALL.search(text)
    if acting is not None:
        raise RefusedStatement(f"refused: the ledger is read-only here ({acting.group(1)}() is not allowed)")
    statements = _parse(con, text)
    if not statements:
        raise RefusedStatement("empty query")
    if _is_expanded_pivot(text, statements):
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
    if not _PIVOT.match(_skip_comments(text)) or len(statements) < 2:
        return False
    *creates, select = statements
    return (
        select.type.name == "SELECT"
        and all(st.type.name == "CREATE" for st in creates)
        and not any(str(st.query).strip() for st in statements)
    )


def _check(con: duckdb.DuckDBPyConnection, st: duckdb.Statement, depth: int) -> None:
    try:
        kind = st.type.name
    except ValueError:  # a statement type this duckdb's Python enum does not name (UPDATE EXTENSIONS)
        kind = "non-SELECT"
    query = str(st.query)
    if kind == "SELECT":
        return
    if kind == "MULTI" and _PIVOT.match(_skip_comments(query)):
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


def _explained(query: str) -> str | None:
    """The statement an ``EXPLAIN [ANALYZE] [(options)]`` explains, or None if the form is not known."""
    text = _skip_comments(query)
    found = _EXPLAIN.match(text)
    if found is None:
        return None
    rest = text[found.end() :]
    if rest.startswith("("):  # EXPLAIN (FORMAT json, ANALYZE) ...: options hold no parentheses
        close = rest.find(")")
        if close < 0 or "(" in rest[1:close]:
            return None
        rest = rest[close + 1 :]
    return rest


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
