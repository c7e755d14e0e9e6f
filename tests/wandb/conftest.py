"""W&B in offline mode, confined to the test's tmp directory, with its network and telemetry off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ingest.wandb_mirror import offline_environment


@pytest.fixture
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    settings = offline_environment(tmp_path)
    directory = Path(settings["WANDB_DIR"])
    directory.mkdir()
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)
    yield directory
    import wandb

    wandb.teardown()  # stop wandb's service so the next test starts from a clean process state
