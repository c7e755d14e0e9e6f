"""The W&B bridge (``runledger.wandb.tee``) and the offline importer (``runledger.ingest.wandb_import``) record one
W&B run the same way: the same steps, every value under the name it was logged with, the same typed
fields, the same config (``_`` keys too), and no invented ``tokens``. Real wandb, offline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.bus import SpoolSink
from runledger.ingest.wandb_import import find_offline_runs, import_offline_run, read_records
from runledger.schemas import Envelope
from tests.client.ledger_support import of_type
from tests.support.wandb_files import close_wandb_files

wandb = pytest.importorskip("wandb")
import runledger.wandb as bridge  # noqa: E402


@pytest.fixture
def teed(wandb_dir: Path, client_env: dict[str, str]) -> Iterator[bridge.Tee]:
    tee = bridge.tee()
    try:
        yield tee
    finally:
        bridge.untee()


def _imported(wandb_dir: Path, tmp_path: Path) -> Path:
    [wandb_file] = find_offline_runs(wandb_dir / "wandb")
    spool = tmp_path / "imported"
    sink = SpoolSink(spool)
    try:
        import_offline_run(wandb_file, sink)
    finally:
        sink.close()
    return spool


def _history(wandb_dir: Path) -> list[dict[str, Any]]:
    [wandb_file] = find_offline_runs(wandb_dir / "wandb")
    return [r["history"]["item"] for r in read_records(wandb_file) if r.get("type") == "history"]


def _steps(spool: Path) -> list[tuple[int | None, Any]]:
    return [(e.step, e.data) for e in of_type(spool, "step.metrics")]


def _launch(spool: Path) -> Envelope:
    [started] = of_type(spool, "run.started")
    return started


def test_nanogpt_style_logging_follows_wandb_step_and_both_paths_agree(
    teed: bridge.Tee,
    wandb_dir: Path,
    client_env: dict[str, str],
    tmp_path: Path,
) -> None:
    # nanoGPT's train.py: one wandb.log per eval, no step=, no define_metric; its own "iter" is a value.
    wandb.init(project="owt", config={"n_layer": 2, "_private": {"seed": 3}, "batch_size": 8})
    for i, it in enumerate(range(0, 50, 10)):
        wandb.log(
            {"iter": it, "train/loss": 4.0 - i / 10, "val/loss": 4.1 - i / 10, "lr": 6e-4, "mfu": 12.5 + i}
        )
    wandb.finish()
    close_wandb_files()
    assert teed.errors == 0
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    bridged = _steps(spool)
    assert [step for step, _ in bridged] == [row["_step"] for row in _history(wandb_dir)] == [0, 1, 2, 3, 4]
    _, first = bridged[0]
    assert first.scalars["train/loss"] == 4.0 and first.loss == 4.0  # the name as logged, and the field
    assert first.lr == 6e-4 and first.mfu == 12.5 and first.tokens is None and "lr" not in first.scalars
    assert first.scalars["iter"] == 0 and first.scalars["val/loss"] == 4.1
    assert _launch(spool).data.config == {"n_layer": 2, "_private": {"seed": 3}, "batch_size": 8}

    imported = _imported(wandb_dir, tmp_path)
    assert _steps(imported) == bridged
    assert _launch(imported).data.config == _launch(spool).data.config


def test_a_step_metric_names_the_step_and_step_sync_places_the_eval_row(
    teed: bridge.Tee,
    wandb_dir: Path,
    client_env: dict[str, str],
    tmp_path: Path,
) -> None:
    run = wandb.init(project="custom", config={"a": 1})
    run.define_metric("trainer/step")
    run.define_metric("*", step_metric="trainer/step")
    for i in range(6):
        run.log({"trainer/step": 100 + 10 * i, "train/loss": 2.0 - i / 10, "train/grad_norm": 0.5})
        if i % 3 == 2:
            run.log({"eval/loss": 2.5 - i / 10})  # no step metric given: step_sync puts it at the last one
    run.finish()
    close_wandb_files()
    assert teed.errors == 0
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    bridged = _steps(spool)
    assert [step for step, _ in bridged] == [100, 110, 120, 130, 140, 150]
    evals = {step: data.scalars["eval/loss"] for step, data in bridged if "eval/loss" in data.scalars}
    assert evals == {120: 2.3, 150: 2.0}
    assert all(data.grad_norm == 0.5 and data.scalars["train/grad_norm"] == 0.5 for _, data in bridged)
    [end] = of_type(spool, "run.finished")
    assert end.data.final_step == 150
    assert len(_history(wandb_dir)) == 8  # W&B's row counter ran to 7: eval rows are rows there
    assert _steps(_imported(wandb_dir, tmp_path)) == bridged
