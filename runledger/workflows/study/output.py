"""What the study hands back and leaves in its work folder: ``StudyResult``, ``results.json`` and the
figure."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runledger.workflows.study.collect import DropCollector
from runledger.workflows.study.options import (
    REFERENCE_POOLED_WAVE_CF,
    REFERENCE_POOLED_WAVE_RATE,
    StudyOptions,
)
from runledger.workflows.study.policies import Policy, Summary, pooled_wave_policy, summarise
from runledger.workflows.study.predictions import Prediction, Score


@dataclass
class StudyResult:
    study_id: str
    workdir: Path
    ledger: Path
    run_ids: list[str]
    preregistration: Path  # the signed checkpoint that covers the predictions
    prereg_size: int  # study-stream tree size it signs
    prereg_sha256: str
    predictions: list[Prediction]
    summaries: list[Summary]
    scores: list[Score]
    graded: list[dict[str, Any]]
    figure: Path | None
    report: Path | None
    results_json: Path
    durations_s: dict[str, float] = field(default_factory=dict)
    cross_check_layer_steps: int = 0


def write_results_json(
    result: StudyResult, options: StudyOptions, collectors: dict[str, DropCollector]
) -> None:
    data = {
        "study_id": result.study_id,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "runs": result.run_ids,
        "preregistration": {
            "path": str(result.preregistration),
            "sha256": result.prereg_sha256,
            "size": result.prereg_size,
        },
        "predictions": [asdict(p) for p in result.predictions],
        "summaries": [asdict(s) for s in result.summaries],
        "scores": [asdict(s) for s in result.scores],
        "graded": result.graded,
        "durations_s": result.durations_s,
        "accounting_s": {r: c.accounting_s for r, c in collectors.items()},
    }
    result.results_json.write_text(json.dumps(data, indent=1))


def plot_study(
    options: StudyOptions, collectors: dict[str, DropCollector], control_run: str, path: Path
) -> Path:
    """Drop rate vs capacity factor per policy (control run), and over training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    control = collectors[control_run]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    cfs = sorted(options.capacity_factors)
    lines: list[tuple[Any, str]] = [("megatron", "Megatron per-micro-batch capacity")] + [
        (st, f"pooled-wave, {st[1]} shards, {st[0]} sender(s), {options.waves} waves")
        for st in options.pooled_wave
    ]
    for setup, name in lines:
        policies = [
            Policy("megatron", c) if setup == "megatron" else pooled_wave_policy(options, c, setup)
            for c in cfs
        ]
        ys = [100 * summarise(control_run, p, control.series[p]).mean for p in policies]
        left.plot(cfs, ys, marker="o", label=name)
    left.axhline(0, color="grey", lw=0.8, label="dropless / ragged (0)")
    left.scatter(
        [REFERENCE_POOLED_WAVE_CF],
        [100 * REFERENCE_POOLED_WAVE_RATE],
        marker="*",
        s=150,
        color="black",
        zorder=5,
        label="reference: pooled-wave cf 1.15, 3 waves",
    )
    left.set_xlabel("capacity factor")
    left.set_ylabel("dropped assignments (% of tokens × k)")
    left.set_title("drop rate vs capacity factor (dropless run's router)")
    left.legend(fontsize=7)
    cf = REFERENCE_POOLED_WAVE_CF if REFERENCE_POOLED_WAVE_CF in options.capacity_factors else cfs[0]
    for run_id, c in collectors.items():
        suffix = run_id.rsplit("-", 1)[-1]
        for policy in (Policy("megatron", cf), pooled_wave_policy(options, cf)):
            ys = [100 * statistics.fmean(step) for step in c.series[policy]]
            right.plot(c.steps, ys, label=f"{suffix}: {policy.label}")
        if run_id != control_run:
            ys = [100 * statistics.fmean(step) for step in c.series[Policy("trainer")]]
            right.plot(c.steps, ys, ls="--", color="black", label=f"{suffix}: trainer measured")
    right.set_xlabel("step")
    right.set_ylabel("mean over layers (%)")
    right.set_title(f"over training steps (cf {cf:g})")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
