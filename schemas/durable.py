"""Durable whole-file writes: the one way runledger persists a file it replaces or creates whole.

``write_durably(path, data)``: the bytes go to a temporary file in the same directory (so the
rename cannot cross filesystems), which is flushed and fsynced, then renamed over ``path``
(``os.replace``: a reader sees the old file or the new one, never half of one), and finally the
directory is fsynced so the rename itself survives a crash. With ``exclusive=True`` the file is
created only if ``path`` does not exist yet (``os.link`` of the finished temporary file: atomic
create-if-absent, ``FileExistsError`` otherwise), so two racing creators agree on one content.

``fsync_dir(path)``: make a directory's entries (files created, renamed, removed) durable; also for
code that appends to its own files and fsyncs them itself.

``remove_dead_temporaries(folder)``: the temporary files of writes whose process was killed before
its rename (SIGKILL, power loss) are left behind; a later writer of the folder removes them.

``disk_full(exc)``: the full disk behind an error, however the writer that met it words it.

Standard library only: imported by the catalogue (key files), the client, the trainer, the bus and the
ledger alike, so it sits at the bottom of the house, beside the catalogue (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from pathlib import Path

__all__ = ["disk_full", "fsync_dir", "remove_dead_temporaries", "write_durably"]

# ``write_durably``'s temporary name: ``.<name>.<pid>.<8 hex>.tmp``.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so the entries created, renamed or removed in it are on disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    mode: int = 0o666,
    exclusive: bool = False,
) -> Path:
    """Write ``data`` (``str`` is UTF-8 encoded) as the whole content of ``path``, atomically and
    durably; returns ``path``. The directory must exist.

    ``mode`` is the new file's permission bits, as for ``os.open`` (the umask applies; a file that
    ``path`` replaces does not lend it its mode). The temporary file has that mode from its
    creation, so a private file (``mode=0o600``) is never readable by others, not even briefly.
    ``exclusive=True`` never replaces an existing ``path``: it raises ``FileExistsError`` instead
    (a symlink at ``path`` counts as existing and is not followed).
    On any error the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    # Hidden and ending in ".tmp": never matched by the globs that read these directories.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            os.link(tmp, target)  # fails if target exists; then the tmp file goes below
            tmp.unlink()
        else:
            os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)
    return target


def remove_dead_temporaries(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove ``write_durably``'s temporary files in ``folder`` whose writing process no longer runs
    (this host's process ids: a folder is written by processes of one host). Another file, or one
    of a live process (or of a process id taken again since), is left alone. The files removed."""
    removed = []
    for path in Path(folder).glob(".*.tmp"):
        found = _TEMPORARY.fullmatch(path.name)
        if found is None or process_running(int(found["pid"])):
            continue
        with contextlib.suppress(FileNotFoundError):  # (another writer may be removing it too)
            path.unlink()
            removed.append(path)
    return removed


def process_running(pid: int) -> bool:
    """Whether a process with id ``pid`` runs on this host (another user's counts; this one does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no process has
        return True
    return True


DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How DuckDB words a full disk (it keeps no errno): its own files' errors, and SQLite's SQLITE_FULL
# from a lake's embedded catalog.
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "database or disk is full")


def disk_full(exc: BaseException) -> BaseException | None:
    """The ENOSPC/EDQUOT ``OSError``, SQLite's ``SQLITE_FULL`` or DuckDB's full-disk error behind
    ``exc`` (itself, its cause or its context: a full disk often surfaces while closing a file after
    the first failure), or None."""
    import sqlite3

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        if isinstance(current, sqlite3.OperationalError) and (
            getattr(current, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
            or "database or disk is full" in str(current)
        ):
            return current
        # DuckDB's (its files and WAL, or a lake's SQLite catalog seen through DuckDB's sqlite
        # scanner): an IO error in words, no errno
        if type(current).__module__.startswith(("duckdb", "_duckdb")) and any(
            words in str(current) for words in DISK_FULL_WORDS
        ):
            return current
        # ``raise … from None`` (an error already said in one line) hides its context: so does this.
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return None


def disk_full_path(found: BaseException) -> str | None:
    """The file a full-disk error (``disk_full``'s) names: the operating system's (a copy's target,
    ``filename2``: ``shutil.copyfile`` names its source first), or DuckDB's in its text (``Could not
    write file "…"``); None where it names none (pyarrow's, a spool's)."""
    filename = getattr(found, "filename2", None) or getattr(found, "filename", None)
    if filename is None:
        named = re.search(r'file "([^"]+)"', str(found))
        filename = named.group(1) if named else None
    return None if filename is None else str(filename)
