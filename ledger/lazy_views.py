"""The ledger's views made on a reader's connection when a statement first names them (issue 41).

``runledger.ledger.views.named_views`` defines ~60 views and macros; DuckDB binds each as it is
made (it opens the files under it and binds every view it reads), ~70 ms for all of them on the demo
ledger, where ``SELECT count(*) FROM events`` then takes 1 ms. A ``LazyViews`` holds the same
statements and makes, before each statement, only those the statement's words name and the views
these read, in the text's order (each view after those it reads).

Names are found by their words, so a word that only looks like a view's name (in a comment, a
string, a column) makes a view for nothing, never one too few. A statement that looks at the
catalogue itself (``SHOW TABLES``, ``information_schema``, ``duckdb_views()`` …) gets every view,
and so does the retry of a statement DuckDB answered with "does not exist" (``make_all``), so a
name these words miss still answers, and a mistyped one gets DuckDB's "Did you mean …" over all.
"""

from __future__ import annotations

import re
import threading

import duckdb

# A statement starts at a line "CREATE …", or at the comment lines right above it.
_STATEMENT_START = re.compile(r"^(?:--[^\n]*\n)*CREATE ", re.MULTILINE)
_CREATED = re.compile(r'CREATE (?:OR REPLACE )?(?:VIEW|MACRO|SCHEMA IF NOT EXISTS) (\w+(?:\."?\w+"?)?)')
_WORD = re.compile(r"[a-z_][a-z0-9_]*")

# Words of a statement that reads the catalogue's own lists: every view must be there to be listed.
CATALOGUE_WORDS = frozenset(
    {
        "show",
        "describe",
        "information_schema",
        "pg_catalog",
        "sqlite_master",
        "duckdb_views",
        "duckdb_tables",
        "duckdb_columns",
        "duckdb_functions",
        "duckdb_dependencies",
        "duckdb_schemas",
        "duckdb_constraints",
        "duckdb_indexes",
        "duckdb_types",
        "pragma_show_tables",
        "pragma_show_tables_expanded",
    }
)


class LazyViews:
    """``sql``'s CREATE statements (``named_views``'s text), each made on ``con`` once it is needed."""

    def __init__(self, sql: str) -> None:
        self.statements: dict[str, str] = {}  # name -> its statement, in the text's order
        starts = [found.start() for found in _STATEMENT_START.finditer(sql)]
        if sql[: starts[0] if starts else len(sql)].strip():
            raise ValueError(f"not a CREATE statement of a view: {sql.strip()[:80]!r}")
        for start, end in zip(starts, [*starts[1:], len(sql)], strict=True):
            part = sql[start:end]
            made = _CREATED.search(part)
            if made is None:
                raise ValueError(f"not a CREATE statement of a view: {part.strip()[:80]!r}")
            self.statements[made.group(1).replace('"', "").lower()] = part
        self.reads: dict[str, frozenset[str]] = {
            name: self.named_in(text) - {name} for name, text in self.statements.items()
        }
        self.made: set[str] = set()
        self._making = threading.Lock()  # (a reader's threads take turns, but a view is made once)

    def named_in(self, text: str) -> frozenset[str]:
        """The views ``text`` names: its words that are views' names; with the word ``lake``, the
        schema and its ``lake.<table>`` views whose table it names."""
        words = set(_WORD.findall(text.lower()))
        named = {word for word in words if word in self.statements}
        if "lake" in words:
            named |= {f"lake.{word}" for word in words if f"lake.{word}" in self.statements}
        return frozenset(named)

    def needed_by(self, text: str) -> list[str]:
        """The views to make before ``text`` runs, in the order they must be made."""
        if CATALOGUE_WORDS & set(_WORD.findall(text.lower())):
            return [name for name in self.statements if name not in self.made]
        needed: set[str] = set()
        stack = list(self.named_in(text))
        while stack:
            name = stack.pop()
            if name not in needed and name not in self.made:
                needed.add(name)
                stack.extend(self.reads[name])
        return [name for name in self.statements if name in needed]

    def make_for(self, con: duckdb.DuckDBPyConnection, text: str) -> None:
        """Make on ``con`` the views ``text`` needs and it does not have yet."""
        self._make(con, self.needed_by(text))

    def make_all(self, con: duckdb.DuckDBPyConnection) -> bool:
        """Make every view not made yet; False when there was none left to make."""
        rest = [name for name in self.statements if name not in self.made]
        self._make(con, rest)
        return bool(rest)

    def _make(self, con: duckdb.DuckDBPyConnection, names: list[str]) -> None:
        with self._making:
            names = [name for name in names if name not in self.made]
            if names:
                con.execute("\n".join(self.statements[name] for name in names))
                self.made.update(names)
