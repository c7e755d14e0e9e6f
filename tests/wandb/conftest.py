"""W&B in offline mode, confined to the test's tmp directory, with its network and telemetry off."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from runledger.ingest.wandb_mirror import offline_environment


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


@pytest.fixture
def client_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The client tests' fixture (RUNLEDGER_SPOOL / RUNLEDGER_STATE under tmp, no launcher
    variables), for the bridge tests here; imported when asked (the two conftests import each other)."""
    from tests.client.conftest import LAUNCH_VARS

    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    env = {"RUNLEDGER_SPOOL": str(tmp_path / "spool"), "RUNLEDGER_STATE": str(tmp_path / "state")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield dict(os.environ)
