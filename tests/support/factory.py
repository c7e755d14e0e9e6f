"""Synthetic runs for tests: a small, valid stream of trainer events with restarts and config changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonpatch

from runledger.schemas import config_hash, encode_event, make_event
from runledger.schemas import payloads as p

T0 = datetime(2026, 11, 1, tzinfo=UTC)


@dataclass
class RunBuilder:
    """Emits a run's events in order; keeps the live config like a trainer would."""

    run_id: str = "run-a"
    config: dict[str, Any] = field(default_factory=lambda: {"lr": 0.001, "moe": {"capacity_factor": 1.0}})
    attempt: int = 1
    seq: int = 0
    clock: int = 0
    events: list[bytes] = field(default_factory=list)
    applied: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)  # (attempt, step, config)
    source: str = ""  # the producer's source; default trainer/<run>/rank0

    def _emit(self, payload: Any, step: int | None, **kw: Any) -> bytes:
        self.clock += 1
        env = make_event(
            payload,
            source=self.source or f"trainer/{self.run_id}/rank0",
            stream=self.run_id,
            run_id=self.run_id,
            attempt=self.attempt,
            step=step,
            seq=self.seq,
            id=f"{self.run_id}-{self.seq}",
            time=T0 + timedelta(seconds=self.clock),
            **kw,
        )
        self.seq += 1
        raw = encode_event(env)
        self.events.append(raw)
        return raw

    def start(self, repository: str | None = None) -> None:
        self._emit(
            p.RunStarted(
                config=self.config,
                config_hash=config_hash(self.config),
                host="node-0",
                git_commit="a" * 40,
                git_dirty=False,
                repository=repository,
            ),
            0,
        )
        self.applied.append((self.attempt, 0, dict(self.config)))

    def step(self, step: int, loss: float = 1.0) -> None:
        self._emit(p.StepMetrics(loss=loss, lr=self.config["lr"], tokens=512, scalars={"aux": 0.1}), step)

    def change(self, step: int, key: str, value: Any) -> None:
        new = jsonpatch.apply_patch(self.config, [{"op": "replace", "path": f"/{key}", "value": value}])
        patch = jsonpatch.make_patch(self.config, new).patch
        self._emit(
            p.ConfigChanged(
                patch=[p.PatchOp(op=o["op"], path=o["path"], value=o.get("value")) for o in patch],
                previous_hash=config_hash(self.config),
                config_hash=config_hash(new),
                cause=p.ChangeCause(kind="file_edit", detail="config.toml"),
            ),
            step,
        )
        self.config = new
        self.applied.append((self.attempt, step, dict(new)))

    def checkpoint(self, step: int) -> None:
        self._emit(p.CheckpointSaved(path=f"/ckpt/{step}"), step)

    def crash(self, step: int) -> None:
        self._emit(
            p.RunCrashed(kind="exception", exc_type="RuntimeError", message="boom", last_step=step), step
        )

    def resume(self, from_step: int, config: dict[str, Any] | None = None) -> None:
        self.attempt += 1
        if config is not None:
            self.config = config
        self._emit(
            p.RunResumed(
                config=self.config,
                config_hash=config_hash(self.config),
                host="node-1",
                git_commit="b" * 40,
                git_dirty=True,
                from_checkpoint_step=from_step,
                previous_attempt=self.attempt - 1,
            ),
            from_step,
        )
        self.applied.append((self.attempt, from_step, dict(self.config)))
