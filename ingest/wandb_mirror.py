"""Mirror a live run to Weights & Biases (the producer side: the trainer's copy for W&B users).

``WandbMirror`` satisfies ``runledger.trainer.mirror.Mirror``: the trainer keeps the ledger as its record
and mirrors steps to W&B with the real ``wandb`` library, in whatever mode the environment selects
(``WANDB_MODE``: online, offline, disabled). ``start`` returns the W&B run id and URL (None offline)
for ``RunStarted.external``; ``log``, ``config_update``, ``summary`` and ``finish`` follow the run.
A W&B failure after ``start`` never stops training: it is logged and counted (``strict=True`` raises).
The other direction, an offline W&B run into the ledger, is ``runledger.ingest.wandb_import``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("runledger.wandb")

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_second", "mfu", "step_time_s")
COUNT_FIELDS = ("tokens", "total_tokens")
_NONFINITE = {"NaN", "nan", "Infinity", "-Infinity", "inf", "-inf"}


# -- mirror ------------------------------------------------------------------------------------


def offline_environment(root: str | Path) -> dict[str, str]:
    """Environment for W&B offline mode confined to ``root``: runs under ``root/wandb-runs``, its
    config, cache, data and artifact folders beside them, no network, console capture or telemetry.
    What an air-gapped cluster sets, and what the tests and benchmarks run W&B under."""
    base = Path(root)
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(base / "wandb-runs"),
        "WANDB_CONFIG_DIR": str(base / "wandb-config"),
        "WANDB_CACHE_DIR": str(base / "wandb-cache"),
        "WANDB_DATA_DIR": str(base / "wandb-data"),
        "WANDB_ARTIFACT_DIR": str(base / "wandb-artifacts"),
        "WANDB_SILENT": "true",
        "WANDB_QUIET": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_SAVE_CODE": "false",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
    }


def wandb_run_id_for(run_id: str) -> str:
    """A W&B run id for a ledger run id: the same when it fits W&B's 64 characters, else prefix + hash."""
    if len(run_id) <= 64:
        return run_id
    return f"{run_id[:47]}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


class WandbMirror:
    """Mirrors a run's config and step metrics to W&B. One W&B run per ledger run (attempts resume it)."""

    def __init__(
        self,
        project: str = "runledger",
        *,
        entity: str | None = None,
        mode: str | None = None,
        directory: str | Path | None = None,
        settings: Mapping[str, Any] | None = None,
        strict: bool = False,
    ) -> None:
        self.project = project
        self.entity = entity
        self.mode = mode  # None: WANDB_MODE (or wandb's default) decides
        self.directory = Path(directory) if directory is not None else None
        # Console capture would rewrite the trainer's stdout; the ledger has its own logs.
        # Keyword arguments for wandb.Settings: its pydantic model checks each one's type.
        self.settings: dict[str, Any] = {"console": "off", "save_code": False} | dict(settings or {})
        self.strict = strict
        self.failures = 0
        self._run: Any = None

    def start(
        self,
        run_id: str,
        config: Mapping[str, Any],
        *,
        name: str | None = None,
        fork: tuple[str, int] | None = None,
    ) -> tuple[str, str | None]:
        """Start (or, for a later attempt, resume) the W&B run; returns (wandb run id, url or None).
        ``fork`` (parent run id, step): a new run that goes on from the parent's step, as W&B's own
        ``fork_from`` (which W&B takes instead of ``resume``); W&B records it as the run's branch point,
        the lineage ``ledger ingest wandb`` reads back."""
        import wandb

        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            id=wandb_run_id_for(run_id),
            name=name or run_id,
            config=dict(config),
            dir=str(self.directory) if self.directory is not None else None,
            mode=self.mode,  # type: ignore[arg-type]
            resume=None if fork else "allow",
            fork_from=f"{wandb_run_id_for(fork[0])}?_step={fork[1]}" if fork else None,
            reinit="create_new",
            settings=wandb.Settings(**self.settings),
        )
        return str(self._run.id), self._run.url

    @property
    def external(self) -> dict[str, str]:
        """What the trainer puts into ``RunStarted.external``."""
        if self._run is None:
            return {}
        out = {"wandb_run_id": str(self._run.id), "wandb_project": str(self._run.project or self.project)}
        if self._run.entity:
            out["wandb_entity"] = str(self._run.entity)
        if self._run.url:
            out["wandb_url"] = str(self._run.url)
        if self._run.offline:
            out["wandb_dir"] = str(Path(self._run.dir).parent)
        return out

    def _guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self._run is None:
            raise RuntimeError("WandbMirror.start() was not called")
        try:
            fn(*args, **kwargs)
        except Exception:
            self.failures += 1
            if self.strict:
                raise
            if self.failures <= 3:  # say it, but do not flood the trainer's log
                log.warning("W&B %s failed (%d failures so far)", what, self.failures, exc_info=True)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        # commit=True writes the row now: W&B otherwise holds a step's row until the next step arrives,
        # and a config change made in between would land before the row it follows.
        self._guard("log", lambda: self._run.log(dict(values), step=step, commit=True))

    def config_update(self, values: Mapping[str, Any]) -> None:
        self._guard("config update", lambda: self._run.config.update(dict(values), allow_val_change=True))

    def summary(self, values: Mapping[str, Any]) -> None:
        self._guard("summary update", lambda: self._run.summary.update(dict(values)))

    def finish(self, exit_code: int = 0) -> None:
        if self._run is None:
            return
        self._guard("finish", lambda: self._run.finish(exit_code=exit_code))
        self._run = None
