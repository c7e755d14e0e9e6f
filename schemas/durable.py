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

Standard library only: imported by the catalogue (key files), the client, the trainer, the bus and the
ledger alike, so it sits at the bottom of the house, beside the catalogue (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

__all__ = ["fsync_dir", "remove_dead_temporaries", "write_durably"]

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
