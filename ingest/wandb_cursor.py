"""The online W&B import's resume cursor: per W&B run, how far its import went.

One JSON file (by default ``<spool>.wandb-cursors.json``, beside the spool the events went to),
replaced atomically and durably (``runledger.schemas.durable.write_durably``) on every save. The importer
saves a run's cursor only after the events it covers were handed to the sink and synced, so the
cursor never claims more than the bus holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from runledger.schemas.durable import write_durably


class CursorFileError(ValueError):
    """The cursor file exists but is not one this module wrote."""


class RunCursor(msgspec.Struct, kw_only=True):
    """Where the import of one W&B run stands: everything needed to emit its next event exactly as
    an uninterrupted import would have."""

    run_id: str
    next_step: int = 0  # scan history from here (W&B's _step)
    lifecycle_seq: int = 1  # RunStarted took 0
    history_seq: int = 0
    system_seq: int = 0
    system_until: float | None = None  # _timestamp of the last system sample imported
    attempt: int = 1
    attempt_starts: list[float] = []  # launch time (unix s) of each attempt, to date system samples
    prev_step: int | None = None
    prev_runtime_s: float | None = None
    prev_timestamp_s: float | None = None
    total_tokens: int | None = None
    done: bool = False


class CursorStore:
    """``{"version": 1, "runs": {"entity/project/run": RunCursor}}``, replaced durably on every save."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._runs: dict[str, RunCursor] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text() or "{}")
                runs = data.get("runs") or {}
                self._runs = {k: msgspec.convert(v, RunCursor) for k, v in runs.items()}
            except (ValueError, AttributeError, msgspec.ValidationError) as exc:
                raise CursorFileError(f"unreadable cursor file {self.path}: {exc}") from None

    def get(self, key: str) -> RunCursor | None:
        return self._runs.get(key)

    def save(self, key: str, cursor: RunCursor) -> None:
        self._runs[key] = cursor
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"version": 1, "runs": {k: msgspec.to_builtins(v) for k, v in sorted(self._runs.items())}}
        write_durably(self.path, json.dumps(body, indent=1) + "\n", mode=0o600)


def default_cursor_file(spool_dir: str | Path) -> Path:
    spool = Path(spool_dir)
    return spool.parent / f"{spool.name}.wandb-cursors.json"
