"""Checkpoints and the run's attempt register, on a (shared) filesystem.

Layout of ``checkpoint.dir``::

    attempts/                every launch of the run (runledger.attempts): attempt-000001.json, …
    step_00000100/           a complete checkpoint (renamed into place only once every rank wrote)
        rank00000.pt         each rank's model shard, optimizer state, RNG states
        config.json          the resolved config at that step (checked before a resume loads it)
        COMPLETE             step, world size, time (written last, before the rename)
    latest                   the newest complete step (a convenience; the directories are the truth)
    .step_00000150.tmp/      an interrupted save: ignored, removed by the next save

A save is atomic: ranks write into a temporary directory, rank 0 renames it once all of them are
done. A SIGKILL mid-save leaves the previous checkpoint the latest one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from runledger import attempts as attempts_lib
from runledger.schemas.durable import fsync_dir, write_durably
from runledger.trainer.distributed import DistEnv, barrier

_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / "COMPLETE").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: Path) -> int | None:
    steps = complete_steps(root)
    return steps[-1] if steps else None


def save(
    root: Path, step: int, state: dict[str, Any], env: DistEnv, *, config: dict[str, Any] | None = None
) -> tuple[Path, int, float]:
    """Every rank calls this; returns (path, bytes written by this rank, seconds). ``config`` (the
    resolved config) is also written as ``config.json`` so a resume can check it before loading."""
    start = time.perf_counter()
    final = step_dir(root, step)
    tmp = root / f".step_{step:08d}.tmp"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an interrupted save
        tmp.mkdir()
    barrier(env)
    path = tmp / f"rank{env.rank:05d}.pt"
    # Streamed straight into the temporary directory (no per-file rename: the directory's rename
    # below is the atomic step); its entry becomes durable with rank 0's fsync of ``tmp``.
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    size = path.stat().st_size
    barrier(env)
    if env.is_main:
        if config is not None:
            write_durably(tmp / "config.json", json.dumps(config, indent=1))
        marker = {"step": step, "world_size": env.world_size, "time": time.time()}
        write_durably(tmp / "COMPLETE", json.dumps(marker))  # also fsyncs ``tmp``: every rank's file
        if final.exists():  # the same step saved again (a resumed attempt): the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        write_durably(root / "latest", f"{step}\n")
    barrier(env)
    return final, size, time.perf_counter() - start


def load(path: Path, env: DistEnv) -> dict[str, Any]:
    marker = path / "COMPLETE"
    if not marker.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint")
    meta = json.loads(marker.read_text())
    if meta.get("world_size") != env.world_size:
        raise CheckpointError(
            f"{path} was written by {meta.get('world_size')} ranks; this launch has {env.world_size}"
        )
    state: dict[str, Any] = torch.load(
        path / f"rank{env.rank:05d}.pt", map_location="cpu", weights_only=False
    )
    return state


def saved_config(path: Path) -> dict[str, Any] | None:
    """The resolved config a checkpoint was written under (None for one without it)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'} is not a config (a JSON object)")
    return config


def prune(root: Path, keep: int, protect: int | None = None) -> None:
    """Keep the newest ``keep`` complete checkpoints (0 keeps all). Rank 0 only."""
    if keep <= 0:
        return
    for step in complete_steps(root)[:-keep]:
        if step != protect:
            shutil.rmtree(step_dir(root, step), ignore_errors=True)


def resolve(root: Path, resume_from: str | int | Path) -> tuple[int, Path | None]:
    """(step, path) of the checkpoint to resume from. ``"latest"`` with none saved yet is step 0."""
    if isinstance(resume_from, int) or (isinstance(resume_from, str) and resume_from.isdigit()):
        step = int(resume_from)
        path = step_dir(root, step)
        if not (path / "COMPLETE").is_file():
            raise CheckpointError(f"no complete checkpoint for step {step} in {root}")
        return step, path
    if resume_from == "latest":
        step_or_none = latest_step(root)
        return (0, None) if step_or_none is None else (step_or_none, step_dir(root, step_or_none))
    path = Path(resume_from)
    match = _STEP_DIR.match(path.name)
    if not match or not (path / "COMPLETE").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint directory")
    return int(match.group(1)), path


# --- the attempt register ----------------------------------------------------------------------

ATTEMPTS_DIR = "attempts"  # runledger.attempts' register: one exclusively created file per attempt
LEGACY_ATTEMPTS = "attempts.json"  # the register of trainers before it (read, never written)


def _legacy_attempts(root: Path) -> list[dict[str, Any]]:
    path = root / LEGACY_ATTEMPTS
    if not path.is_file():
        return []
    records: list[dict[str, Any]] = json.loads(path.read_text())["attempts"]
    return records


def attempts(root: Path) -> list[dict[str, Any]]:
    """Every launch of the run, oldest first (each record has its ``attempt`` number)."""
    return _legacy_attempts(root) + attempts_lib.attempts_in(root / ATTEMPTS_DIR)


def register_attempt(root: Path, record: dict[str, Any]) -> int:
    """Register a launch durably and return its attempt number (1-based).

    Written before the launch emits anything, so a relaunch never reuses an attempt number (and
    with it an event source) even when the previous attempt died before its first checkpoint; two
    launches racing for one number cannot both take it (an exclusive create, ``runledger.attempts``).
    """
    after = max((int(r["attempt"]) for r in _legacy_attempts(root)), default=0)
    attempt, _ = attempts_lib.register_in(root / ATTEMPTS_DIR, record, after=after)
    return attempt
