"""The client library's tests: W&B offline confined to tmp (the W&B tests' own fixture), and a
client environment whose spool and attempt state live in the test's tmp directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.wandb.conftest import wandb_dir  # noqa: F401  (the same offline-W&B fixture)

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "JAX_PROCESS_ID",
    "JAX_NUM_PROCESSES",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "TORCHELASTIC_RUN_ID",
    "RUNLEDGER_LAUNCH_ID",
    "RUNLEDGER_KAFKA_BOOTSTRAP",
    "RUNLEDGER_PRODUCER_KEY",
)


@pytest.fixture
def client_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """RUNLEDGER_SPOOL / RUNLEDGER_STATE under tmp, no launcher variables: a single process."""
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    env = {"RUNLEDGER_SPOOL": str(tmp_path / "spool"), "RUNLEDGER_STATE": str(tmp_path / "state")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield {k: v for k, v in os.environ.items()}
