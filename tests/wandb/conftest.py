"""W&B in offline mode, confined to the test's tmp directory, with its network and telemetry off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "wandb-runs"
    directory.mkdir()
    settings = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(directory),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_ARTIFACT_DIR": str(tmp_path / "wandb-artifacts"),
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
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    yield directory
    import wandb

    wandb.teardown()  # stop wandb's service so the next test starts from a clean process state
