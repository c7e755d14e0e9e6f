"""Every DuckDB connection the project opens: offline, and with extensions only from pinned wheels.

DuckDB extensions cannot be downloaded here, and a ledger reader must never reach for the network on
its own. So every connection turns DuckDB's auto-install and auto-load off, points its extension
directory inside the project's own tree (nothing is read from or written to ``~/.duckdb``), and loads
an extension (``httpfs``, ``ducklake``, ``postgres_scanner``, ``sqlite_scanner``) straight from the
file its PyPI wheel (``duckdb-extension-<name>``) carries. DuckDB's signature check stays on: only
binaries signed by DuckDB itself load, whoever repackaged them. The wheels match exactly one DuckDB
version (pyproject pins both).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import duckdb

__all__ = ["EXTENSION_DIR", "ExtensionMissing", "connect", "extension_file", "load_extension"]

# Inside the checkout (git-ignored): DuckDB writes nothing there as long as nothing is INSTALLed, but
# a user's INSTALL in `ledger shell` would land here, never in the home folder.
EXTENSION_DIR = Path(__file__).resolve().parent.parent / ".duckdb" / "extensions"

_OFFLINE = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
}


class ExtensionMissing(RuntimeError):
    """The wheel carrying a DuckDB extension is not installed, or carries another DuckDB version's."""


def connect(
    database: str = ":memory:", *, read_only: bool = False, extensions: Sequence[str] = ()
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection that never downloads anything, with ``extensions`` loaded from their wheels."""
    config: dict[str, str | bool | int | float | list[str]] = {
        **_OFFLINE,
        "extension_directory": EXTENSION_DIR.as_posix(),
    }
    con = duckdb.connect(database, read_only=read_only, config=config)
    for name in extensions:
        load_extension(con, name)
    return con


def extension_file(name: str) -> Path:
    """The signed extension binary that the ``duckdb-extension-<name>`` wheel carries for this DuckDB."""
    try:
        module = importlib.import_module(f"duckdb_extension_{name}")
    except ImportError as exc:
        raise ExtensionMissing(
            f"DuckDB extension {name!r}: install the duckdb-extension-{name} wheel for duckdb {duckdb.__version__}"
        ) from exc
    (folder,) = module.__path__
    path = Path(folder) / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
    if not path.is_file():
        raise ExtensionMissing(
            f"DuckDB extension {name!r}: its wheel has no build for duckdb {duckdb.__version__} ({path.parent})"
        )
    return path


def load_extension(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Load extension ``name`` into ``con`` from its wheel (signature checked by DuckDB)."""
    path = extension_file(name).as_posix().replace("'", "''")
    con.execute(f"LOAD '{path}'")
