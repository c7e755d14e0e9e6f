"""Attempt numbers: a durable per-run counter, the one register of every producer.

runledger's own trainer keeps its register in the checkpoint dir (``<checkpoint.dir>/attempts/``,
``register_in``) and broadcasts rank 0's number over its process group. A client-library process may
have no process group yet (``runledger.init`` is often called before ``torch.distributed``/
``jax.distributed`` is up), so agreement goes through a directory every rank can see (``state_dir``;
a shared filesystem for multi-node runs):

  ``<state_dir>/<run_id>/attempt-000001.json``  one file per launch, created with an atomic
  create-if-absent (``write_durably(exclusive=True)``) by rank 0: two launches racing for the same
  number cannot both win, and the number is durable before any event of the attempt is emitted.

Rank 0 registers the launch under a *launch key* that all ranks of one launch share (torchrun's
``TORCHELASTIC_RUN_ID`` + restart count, SLURM's job/step/restart count, or ``RUNLEDGER_LAUNCH_ID``
/ ``launch_id=``); the other ranks wait (bounded) for the newest attempt with their key that was
registered recently, and take its number. A relaunch gets a new key and so a new attempt: it is
never appended to the previous attempt's history.

Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from runledger.schemas.durable import write_durably

DEFAULT_STATE_DIR = Path(".runledger/runs")
_NAME = re.compile(r"^attempt-(\d{6,})\.json$")


class AttemptError(RuntimeError):
    """The launch could not be numbered (e.g. rank 0 never registered it in time)."""


def default_state_dir() -> Path:
    return Path(os.environ.get("RUNLEDGER_STATE", DEFAULT_STATE_DIR))


def launch_key_from_env(env: dict[str, str] | None = None) -> str | None:
    """What every rank of one launch has in common, from the launcher's environment (None: nothing)."""
    e = os.environ if env is None else env
    if e.get("RUNLEDGER_LAUNCH_ID"):
        return f"runledger:{e['RUNLEDGER_LAUNCH_ID']}"
    if e.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{e['TORCHELASTIC_RUN_ID']}:{e.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if e.get("SLURM_JOB_ID"):
        parts = (e["SLURM_JOB_ID"], e.get("SLURM_STEP_ID", ""), e.get("SLURM_RESTART_COUNT", "0"))
        return "slurm:" + ":".join(parts)
    return None


def _run_dir(state_dir: Path, run_id: str) -> Path:
    return state_dir / run_id


def attempts(state_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The run's registered attempts, oldest first (each record has its ``attempt`` number)."""
    return attempts_in(_run_dir(state_dir, run_id))


def attempts_in(directory: Path) -> list[dict[str, Any]]:
    """The attempts registered in ``directory`` (one run's register), oldest first."""
    if not directory.is_dir():
        return []
    out = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match is None:
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # an unreadable record still holds its number: the scan below skips past it
        if isinstance(record, dict):
            out.append(record | {"attempt": int(match.group(1))})
    return sorted(out, key=lambda r: r["attempt"])


def _numbers(directory: Path) -> list[int]:
    return [int(m.group(1)) for p in directory.iterdir() if (m := _NAME.match(p.name))]


def register(state_dir: Path, run_id: str, record: dict[str, Any]) -> tuple[int, int]:
    """Rank 0: take the next attempt number for ``run_id`` durably; (attempt, attempts before it)."""
    return register_in(_run_dir(state_dir, run_id), record)


def register_in(directory: Path, record: dict[str, Any], *, after: int = 0) -> tuple[int, int]:
    """Take the next attempt number in the register ``directory`` durably, above ``after`` (the
    attempts an older register holds); (attempt, attempts in ``directory`` before it)."""
    directory.mkdir(parents=True, exist_ok=True)
    while True:
        taken = _numbers(directory)
        attempt = max(max(taken, default=0), after) + 1
        body = json.dumps(record | {"registered": time.time()}, sort_keys=True)
        try:
            write_durably(directory / f"attempt-{attempt:06d}.json", body, exclusive=True)
        except FileExistsError:
            continue  # another launch took it first: try the next number
        return attempt, len(taken)


def wait_for(state_dir: Path, run_id: str, launch_key: str, *, since: float, timeout_s: float) -> int:
    """Ranks other than 0: the attempt rank 0 registered for ``launch_key`` at or after ``since``
    (seconds since the epoch), polled for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        found = [
            r
            for r in attempts(state_dir, run_id)
            if r.get("launch_key") == launch_key and float(r.get("registered", 0)) >= since
        ]
        if found:
            return int(found[-1]["attempt"])
        if time.monotonic() >= deadline:
            raise AttemptError(
                f"rank 0 did not register launch {launch_key!r} of run {run_id!r} in {state_dir} "
                f"within {timeout_s:.0f}s (is state_dir on a filesystem every rank sees?)"
            )
        time.sleep(delay)
        delay = min(0.5, delay * 2)
