"""A damaged ``.wandb`` file: wandb's own reader skips what it cannot decode ("skipped corrupt data");
``ledger ingest wandb`` imports what is readable, says what was skipped, and exits 1 unless told
``--accept-partial``. A damaged first record no longer refuses the run when ``--run-id`` names it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.wandb_import import find_offline_runs
from tests.client.ledger_support import of_type
from tests.support.wandb_files import close_wandb_files

wandb = pytest.importorskip("wandb")

ROWS = 600


@pytest.fixture
def wandb_file(wandb_dir: Path) -> Path:
    """A real offline run of ``ROWS`` history rows, as W&B wrote it."""
    run = wandb.init(project="damaged", config={"lr": 0.1})
    for i in range(ROWS):
        run.log({"train/loss": 1.0 / (i + 1), "iter": i})
    run.finish()
    close_wandb_files()
    [path] = find_offline_runs(wandb_dir / "wandb")
    return path


def _damaged(source: Path, target: Path, offset: int, size: int) -> Path:
    data = bytearray(source.read_bytes())
    data[offset : offset + size] = random.Random(5).randbytes(size)
    target.write_bytes(bytes(data))
    return target


def _ingest(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["ingest", "wandb", *args])
    return result.exit_code, result.stdout, result.stderr


def test_garbage_inside_the_file_is_reported_and_the_rest_imported(wandb_file: Path, tmp_path: Path) -> None:
    size = wandb_file.stat().st_size
    damaged = _damaged(wandb_file, tmp_path / f"{wandb_file.name}", size // 2, 5000)
    spool = tmp_path / "spool"
    code, out, err = _ingest(str(damaged), "--spool", str(spool))
    assert code == 1
    assert "skipped 1 damaged stretch" in " ".join(err.split()) and "--accept-partial" in err
    stats = json.loads(out)
    assert stats["partial"] and stats["skipped_stretches"] == 1 and stats["history_gaps"]
    assert 0 < stats["steps"] < ROWS  # what was readable is on the bus
    steps = [e.step for e in of_type(spool, "step.metrics")]
    assert len(steps) == stats["steps"] and steps[0] == 0 and steps[-1] == ROWS - 1
    [gap] = stats["history_gaps"]
    assert gap[0] + 1 not in steps and gap[1] in steps  # where the hole is

    code, out, err = _ingest(str(damaged), "--spool", str(tmp_path / "accepted"), "--accept-partial")
    assert code == 0, err
    assert json.loads(out)["steps"] == stats["steps"]

    clean_code, clean_out, _ = _ingest(str(wandb_file), "--spool", str(tmp_path / "clean"))
    assert clean_code == 0 and json.loads(clean_out)["steps"] == ROWS and not json.loads(clean_out)["partial"]


def test_a_damaged_first_record_is_imported_when_the_run_is_named(wandb_file: Path, tmp_path: Path) -> None:
    damaged = _damaged(wandb_file, tmp_path / wandb_file.name, 7, 200)  # the header and run records
    code, _, err = _ingest(str(damaged), "--spool", str(tmp_path / "refused"))
    assert code == 1 and "--run-id" in err  # says how to go on
    spool = tmp_path / "spool"
    code, out, err = _ingest(str(damaged), "--spool", str(spool), "--run-id", "rescued", "--accept-partial")
    assert code == 0, err
    stats = json.loads(out)
    assert stats["run_id"] == "rescued" and not stats["run_record"] and 0 < stats["steps"] < ROWS
    [started] = of_type(spool, "run.started")
    assert started.run_id == "rescued" and started.data.external["wandb_run_id"] == wandb_file.stem[4:]
    assert of_type(spool, "run.finished")  # the run's end survived
