"""A real, small tmpfs for the full-disk tests (tests/client/test_full_disk.py, tests/core/test_progress.py).

``small_fs`` is the pytest fixture: ``small_fs(size_kb)`` mounts a tmpfs of that size under the
test's tmp directory and returns its path; ``small_fs.grow(mount, size_kb)`` remounts it larger (the
space comes back); every mount is unmounted when the test ends. Mounting needs root: without it, or
where the kernel refuses, the test is skipped with the reason. A test module that uses it names this
module in its ``pytest_plugins`` (an imported fixture reads as an unused import to ruff).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


class SmallFs:
    """Mounts small tmpfs folders under ``root`` and remembers them, to unmount them all at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounts: list[Path] = []

    def __call__(self, size_kb: int) -> Path:
        """A fresh tmpfs of ``size_kb`` KB; skips the test if it cannot be mounted here."""
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        where = self.root / f"fs-{len(self.mounts)}"
        where.mkdir()
        done = _mount("-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where))
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip() or done.returncode}")
        self.mounts.append(where)
        return where

    def grow(self, mount: Path, size_kb: int) -> None:
        """Give ``mount`` (one of ours) ``size_kb`` KB in all: what it holds stays."""
        assert mount in self.mounts, f"{mount} is not a tmpfs this fixture mounted"
        done = _mount("-o", f"remount,size={size_kb}k", str(mount))
        assert done.returncode == 0, f"cannot grow {mount}: {done.stderr.strip()}"

    def unmount_all(self) -> None:
        # Lazy: a file some thread still holds open must not keep the mount (and the test) alive.
        for mount in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        self.mounts.clear()


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[SmallFs]:
    """Small real tmpfs mounts for this test only (see the module docstring)."""
    mounts = SmallFs(tmp_path)
    try:
        yield mounts
    finally:
        mounts.unmount_all()
