"""Every DuckDB connection the project opens: offline, and with extensions only from pinned wheels.

DuckDB extensions cannot be downloaded here, and a ledger reader must never reach for the network on
its own. So every connection turns DuckDB's auto-install and auto-load off, points its extension
directory inside the project's own tree (nothing is read from or written to ``~/.duckdb``), and loads
an extension (``httpfs``, ``ducklake``, ``postgres_scanner``, ``sqlite_scanner``) straight from the
file its PyPI wheel (``duckdb-extension-<name>``) carries. Only binaries signed by DuckDB itself
load, whoever repackaged them; the wheels match exactly one DuckDB version (pyproject pins both).

DuckDB checks a signature by hashing the whole ~35 MB binary on every ``LOAD``: about 95 ms each,
most of a one-statement read of a lake (two extensions). So the check runs once per binary: after a
signed load succeeds, the file's identity (inode, size, change time: any rewrite, rename over or
``chmod`` changes the change time, which user space cannot set back) is noted in ``EXTENSION_DIR``,
and a connection whose every extension still has that identity loads them without the second check
(``allow_unsigned_extensions``). Such a connection runs user SQL only after ``runledger.ledger.sql_guard``'s lock
(external access off), which refuses every further ``LOAD``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

if TYPE_CHECKING:  # issue 41: a connection needs no pyarrow (``column_type`` imports it when asked)
    import pyarrow as pa

__all__ = ["EXTENSION_DIR", "ExtensionMissing", "connect", "extension_file", "load_extension"]

# Inside the checkout (git-ignored): DuckDB writes nothing there as long as nothing is INSTALLed, but
# a user's INSTALL in `ledger shell` would land here, never in the home folder.
EXTENSION_DIR = Path(__file__).resolve().parent.parent / ".duckdb" / "extensions"
CHECKED_FILE = EXTENSION_DIR / "signatures-checked.json"  # {name: [path, inode, size, ctime_ns]}

_OFFLINE = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
}


class ExtensionMissing(RuntimeError):
    """The wheel carrying a DuckDB extension is not installed, or carries another DuckDB version's."""


def one_row(result: duckdb.DuckDBPyConnection) -> tuple[Any, ...] | None:
    """A statement's first row (None: no row), its result read to the end. DuckDB's ``fetchone``
    leaves the result open, and the catalog's read transaction with it until the connection's next
    statement: an idle writer on a SQLite catalog then held its WAL, so no checkpoint could end it
    (a redaction's VACUUM waited out its 30 s busy timeout twice for each idle writer)."""
    rows = result.fetchall()
    return rows[0] if rows else None


def connect(
    database: str = ":memory:",
    *,
    read_only: bool = False,
    extensions: Sequence[str] = (),
    memory_limit: str | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection that never downloads anything, with ``extensions`` loaded from their wheels.
    ``memory_limit`` (DuckDB's, e.g. "256MB"): what it keeps beyond spills to a folder of its own
    under the system's temp folder (made only when needed, deleted by DuckDB on close), never to
    DuckDB's default ``.tmp`` in the working directory."""
    files = {name: extension_file(name) for name in extensions}
    checked = _checked_before(files)
    config: dict[str, str | bool | int | float | list[str]] = {
        **_OFFLINE,
        "extension_directory": EXTENSION_DIR.as_posix(),
        "allow_unsigned_extensions": checked,
    }
    if memory_limit is not None:
        config["memory_limit"] = memory_limit
        spill = f"runledger-duckdb-spill-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # (not made: DuckDB makes and deletes it)
        import tempfile  # (only a connection with a memory limit spills)

        config["temp_directory"] = os.path.join(tempfile.gettempdir(), spill)
    con = duckdb.connect(database, read_only=read_only, config=config)
    try:
        for name in extensions:
            load_extension(con, name)
    except BaseException:
        con.close()
        raise
    if files and not checked:
        _note_checked(files)
    return con


def _identity(path: Path) -> list[str | int]:
    st = path.stat()
    return [path.as_posix(), st.st_ino, st.st_size, st.st_ctime_ns]


def _checked_before(files: dict[str, Path]) -> bool:
    """Whether each file's signature was checked by a signed ``LOAD`` and the file is unchanged since."""
    if not files:
        return False
    try:
        noted = json.loads(CHECKED_FILE.read_bytes())
        return all(noted.get(name) == _identity(path) for name, path in files.items())
    except (OSError, ValueError, AttributeError):
        return False


def _note_checked(files: dict[str, Path]) -> None:
    """Note the files a signed ``LOAD`` accepted (best effort: unnoted, the next load checks again)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        try:
            noted = json.loads(CHECKED_FILE.read_bytes())
        except (OSError, ValueError):
            noted = {}
        noted |= {name: _identity(path) for name, path in files.items()}
        EXTENSION_DIR.mkdir(parents=True, exist_ok=True)
        tmp = CHECKED_FILE.with_name(f"{CHECKED_FILE.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(noted, indent=1))
        os.replace(tmp, CHECKED_FILE)  # a reader sees the old notes or the new, never half


def extension_file(name: str) -> Path:
    """The signed extension binary that the ``duckdb-extension-<name>`` wheel carries for this DuckDB."""
    try:
        module = importlib.import_module(f"duckdb_extension_{name}")
    except ImportError as exc:
        raise ExtensionMissing(
            f"DuckDB extension {name!r}: install the duckdb-extension-{name} wheel for duckdb "
            f"{duckdb.__version__} (pip install 'runledger[{'ledger' if name == 'httpfs' else 'operator'}]')"
        ) from exc
    (folder,) = module.__path__
    path = Path(folder) / "extensions" / f"v{duckdb.__version__}" / f"{name}.duckdb_extension"
    if not path.is_file():
        raise ExtensionMissing(
            f"DuckDB extension {name!r}: its wheel has no build for duckdb {duckdb.__version__} ({path.parent})"
        )
    return path


def load_extension(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Load extension ``name`` into ``con`` from its wheel (signature checked by DuckDB unless the
    connection was opened trusting files already checked: ``connect``)."""
    path = extension_file(name).as_posix().replace("'", "''")
    con.execute(f"LOAD '{path}'")


@functools.cache
def _duck_types() -> dict[pa.DataType, str]:
    """Arrow type -> DuckDB's name, built on first use (pyarrow is slow to import)."""
    import pyarrow as pa

    return {
        pa.int32(): "INTEGER",
        pa.int64(): "BIGINT",
        pa.float64(): "DOUBLE",
        pa.bool_(): "BOOLEAN",
        pa.string(): "VARCHAR",
        pa.binary(): "BLOB",
        pa.timestamp("us", tz="UTC"): "TIMESTAMPTZ",
    }


def column_type(kind: pa.DataType) -> str | None:
    """DuckDB's name for a ledger column's Arrow type, as DuckDB reads it from Parquet (None: a type
    the ledger's tables do not use)."""
    import pyarrow as pa

    if pa.types.is_list(kind):
        inner = column_type(kind.value_type)
        return None if inner is None else inner + "[]"
    return _duck_types().get(kind)
