"""The shared helpers: durable whole-file writes (runledger.schemas.durable) and config patches."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.ledger.projectors import PROJECTORS
from runledger.schemas import CATALOGUE
from runledger.schemas.config_patch import ConfigPatchError, apply_config_patch
from runledger.schemas.durable import fsync_dir, remove_dead_temporaries, write_durably
from runledger.schemas.payloads import PatchOp

# --------------------------------------------------------------------------- write_durably


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_write_creates_and_replaces_leaving_no_tmp(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert write_durably(path, '{"a": 1}\n') == path
    assert path.read_text() == '{"a": 1}\n'
    write_durably(path, b"\x00binary\xff")
    assert path.read_bytes() == b"\x00binary\xff"
    write_durably(str(path), "ü")  # str paths too; str data is UTF-8
    assert path.read_bytes() == "ü".encode()
    assert _siblings(path) == ["state.json"]


def test_mode_applies_from_creation(tmp_path: Path) -> None:
    old_umask = os.umask(0)
    try:
        private = write_durably(tmp_path / "secret", "s", mode=0o600)
        public = write_durably(tmp_path / "public", "p", mode=0o644)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644


def test_exclusive_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "id"
    write_durably(path, "first\n", exclusive=True)
    with pytest.raises(FileExistsError):
        write_durably(path, "second\n", exclusive=True)
    assert path.read_text() == "first\n"
    target = tmp_path / "elsewhere"
    (tmp_path / "link").symlink_to(target)  # a dangling symlink counts as existing, is not followed
    with pytest.raises(FileExistsError):
        write_durably(tmp_path / "link", "x", exclusive=True)
    assert not target.exists()
    assert _siblings(path) == ["id", "link"]


def test_failed_write_leaves_target_and_no_tmp(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("old\n")
    with pytest.raises(TypeError):
        write_durably(path, 42)  # type: ignore[arg-type]
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(OSError):
        write_durably(tmp_path / "a_dir", "x")  # os.replace onto a directory fails
    assert path.read_text() == "old\n"
    assert _siblings(path) == ["a_dir", "config.toml"]
    with pytest.raises(FileNotFoundError):
        write_durably(tmp_path / "missing" / "f", "x")  # the directory must exist


def test_fsync_dir(tmp_path: Path) -> None:
    fsync_dir(tmp_path)
    fsync_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")


# --------------------------------------------------------------------------- apply_config_patch


CONFIG = {"moe": {"capacity_factor": 1.0, "top_k": 2}, "optimizer": {"lr": 0.001}}


def test_the_temporaries_of_dead_writers_are_removed_and_no_other_file(tmp_path: Path) -> None:
    """A write killed before its rename leaves ``.<name>.<pid>.<hex>.tmp``: removed once its process
    is gone; a live process's (this one's), another program's file, and the targets stay."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(child.stdout)  # (ended: its id names no process now, unless the system gave it again)
    for name in (
        f".0000000005.json.{dead}.190bf850.tmp",
        f".0000000006.json.{os.getpid()}.0123abcd.tmp",
        ".notes.tmp",
        f".0000000007.json.{dead}.xyz.tmp",
        "0000000004.json",
    ):
        (tmp_path / name).write_text("{}")
    removed = remove_dead_temporaries(tmp_path)
    assert [p.name for p in removed] == [f".0000000005.json.{dead}.190bf850.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            f".0000000006.json.{os.getpid()}.0123abcd.tmp",
            ".notes.tmp",
            f".0000000007.json.{dead}.xyz.tmp",
            "0000000004.json",
        ]
    )


def test_patch_applies_without_touching_the_input() -> None:
    ops = [
        {"op": "replace", "path": "/moe/capacity_factor", "value": 1.25},
        {"op": "remove", "path": "/moe/top_k"},
        {"op": "copy", "from": "/optimizer/lr", "path": "/optimizer/max_lr"},
    ]
    new = apply_config_patch(CONFIG, ops)
    assert new == {"moe": {"capacity_factor": 1.25}, "optimizer": {"lr": 0.001, "max_lr": 0.001}}
    assert CONFIG == {"moe": {"capacity_factor": 1.0, "top_k": 2}, "optimizer": {"lr": 0.001}}


def test_patch_takes_the_event_structs() -> None:
    ops = [
        PatchOp(op="test", path="/moe/top_k", value=2),
        PatchOp(op="move", from_="/moe/top_k", path="/moe/k"),
    ]
    assert apply_config_patch(CONFIG, ops) == {
        "moe": {"capacity_factor": 1.0, "k": 2},
        "optimizer": {"lr": 0.001},
    }
    assert apply_config_patch(CONFIG, []) == CONFIG


@pytest.mark.parametrize(
    "ops",
    [
        [{"op": "test", "path": "/moe/top_k", "value": 3}],  # a failed test
        [{"op": "remove", "path": "/moe/missing"}],  # a missing key
        [{"op": "replace", "path": "/nowhere/deep", "value": 1}],  # a missing parent (pointer error)
        [{"op": "add", "path": "/moe/top_k/x", "value": 1}],  # into a scalar
        [{"op": "frobnicate", "path": "/moe"}],  # not an operation
    ],
)
def test_bad_patch_raises_one_error_type(ops: list[dict]) -> None:
    with pytest.raises(ConfigPatchError) as info:
        apply_config_patch(CONFIG, ops)
    assert isinstance(info.value, ValueError) and info.value.__cause__ is not None
    assert CONFIG["moe"] == {"capacity_factor": 1.0, "top_k": 2}


def test_every_event_type_has_a_projector() -> None:
    assert set(PROJECTORS) == set(CATALOGUE)
