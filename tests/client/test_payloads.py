"""One payload builder for the trainer and the client: the same step gives the same event."""

from __future__ import annotations

import numpy as np
import pytest

from runledger.schemas.payloads import MoeLayerStats, StepMetrics
from runledger.schemas.step_payloads import (
    StepReport,
    layer_stats_from_arrays,
    ledger_names,
    metrics_from_values,
    step_metrics,
)


def _report() -> StepReport:
    layers = layer_stats_from_arrays(
        top_k=2,
        tokens=np.array([100, 100]),
        dropped=np.array([4, 0]),
        drop_rate=np.array([0.02, 0.0]),
        counts=np.array([[90, 106], [101, 99]]),
        aux_loss=np.array([1.01, 1.03]),
        z_loss=np.array([0.5, np.nan]),
        entropy=np.array([1.3, 1.2]),
    )
    return StepReport(
        step=7,
        loss=2.5,
        grad_norm=float("inf"),
        lr=3e-4,
        tokens=4096,
        total_tokens=2**60 + 1,  # above 2**53: must stay exact
        step_time_s=0.25,
        tokens_per_second=16384.0,
        mfu=41.0,
        layers=layers,
        scalars={"events_dropped": 0.0, "skipped_steps": 1.0},
    )


def test_the_trainers_step_event() -> None:
    report = _report()
    assert report.layers[1] == MoeLayerStats(
        layer=1,
        tokens=100,
        top_k=2,
        dropped=0,
        token_drop_rate=0.0,
        expert_counts=[101, 99],
        aux_loss=1.03,
        z_loss=None,
        routing_entropy=1.2,
    )
    assert step_metrics(report) == StepMetrics(
        loss=2.5,
        grad_norm=None,
        lr=3e-4,
        tokens=4096,
        total_tokens=2**60 + 1,
        tokens_per_second=16384.0,
        mfu=41.0,
        step_time_s=0.25,
        scalars={
            "events_dropped": 0.0,
            "skipped_steps": 1.0,
            "token_drop_rate": 0.01,
            "aux_loss": pytest.approx(1.02),
            "z_loss": None,
            "routing_entropy": pytest.approx(1.25),
        },
    )


def test_the_mirrors_wandb_row_maps_back_to_the_trainers_fields() -> None:
    """What runledger's own W&B mirror writes, teed back into the ledger, is the trainer's step again
    (its typed fields and layer means; the per-layer keys stay named scalars)."""
    pytest.importorskip("torch")
    from runledger.trainer.mirror import step_values

    report = _report()
    row = step_values(report)
    teed = metrics_from_values(row)
    trainer = step_metrics(report)
    for field in ("loss", "lr", "tokens", "total_tokens", "tokens_per_second", "mfu", "step_time_s"):
        assert getattr(teed, field) == getattr(trainer, field), field
    for name in ("token_drop_rate", "aux_loss", "routing_entropy", "events_dropped", "skipped_steps"):
        assert teed.scalars[name] == pytest.approx(trainer.scalars[name]), name
    assert teed.scalars["router/layer0/dropped"] == 4.0


def test_ledger_names_keep_both_when_an_alias_collides() -> None:
    assert ledger_names(["lm loss", "learning-rate"]) == {"lm loss": "loss", "learning-rate": "lr"}
    assert ledger_names(["train/loss", "loss"]) == {"train/loss": "train/loss", "loss": "loss"}
    assert ledger_names(["lm loss", "train/loss"]) == {"lm loss": "loss", "train/loss": "train/loss"}
