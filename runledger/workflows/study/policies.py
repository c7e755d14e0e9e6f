"""The study's accounting rules (``Policy``), their drop counts on one micro-batch's selection (through
``runledger.trainer.drop_accounting``), and their statistics over layers × steps (``summarise``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runledger.trainer import drop_accounting as da
from runledger.workflows.study.options import StudyOptions

# --- policies and their labels -----------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Policy:
    """One accounting rule: ``megatron`` (per-micro-batch capacity), ``pooled_wave`` (with shards,
    waves), ``dropless`` (no capacity), or ``trainer`` (the trainer's own measured drop)."""

    kind: str
    capacity_factor: float | None = None
    shards: int | None = None
    waves: int | None = None
    senders: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "megatron":
            return f"megatron cf={self.capacity_factor:g}"
        if self.kind == "pooled_wave":
            return (
                f"pooled-wave cf={self.capacity_factor:g} senders={self.senders} shards={self.shards} "
                f"waves={self.waves}"
            )
        return self.kind


def pooled_wave_policy(options: StudyOptions, cf: float, setup: tuple[int, int] | None = None) -> Policy:
    """The pooled-wave policy at ``cf`` for a (senders, shards) set-up (default: the headline, the
    first one)."""
    senders, shards = setup or options.pooled_wave[0]
    return Policy("pooled_wave", cf, shards, options.waves, senders)


def study_policies(options: StudyOptions) -> list[Policy]:
    out = [Policy("dropless")]
    for cf in options.capacity_factors:
        out.append(Policy("megatron", cf))
    for senders, shards in options.pooled_wave:
        for cf in options.capacity_factors:
            out.append(Policy("pooled_wave", cf, shards, options.waves, senders))
    return out


def count_drops(selection: torch.Tensor, top_k: int, policies: Sequence[Policy]) -> dict[Policy, int]:
    """Every policy's dropped assignments for one micro-batch's selection (one wave layout per
    shard count, shared by the sweep's capacity factors)."""
    out: dict[Policy, int] = {}
    layouts: dict[tuple[int, int, int], da.WaveLayout] = {}
    for policy in policies:
        if policy.kind == "dropless":
            out[policy] = da.dropless_dropped(selection)
        elif policy.kind == "megatron":
            assert policy.capacity_factor is not None
            out[policy] = da.capacity_dropped(selection, top_k, policy.capacity_factor)
        elif policy.kind == "pooled_wave":
            assert policy.capacity_factor is not None and policy.shards and policy.waves
            key = (policy.senders or policy.shards, policy.shards, policy.waves)
            if key not in layouts:
                layouts[key] = da.wave_layout(selection, top_k, policy.shards, policy.waves, key[0])
            out[policy] = da.pooled_wave_dropped_from_layout(layouts[key], policy.capacity_factor).total
    return out


# --- statistics ------------------------------------------------------------------------------


@dataclass
class Summary:
    """One policy's drop rate over layers × steps of one run."""

    run: str
    policy: str
    kind: str
    capacity_factor: float | None
    shards: int | None
    waves: int | None
    senders: int | None
    mean: float
    p50: float
    max: float
    mean_last_half: float
    samples: int


def summarise(run: str, policy: Policy, per_step: list[list[float]]) -> Summary:
    values = [v for layer_rates in per_step for v in layer_rates]
    half = per_step[len(per_step) // 2 :]
    last = [v for layer_rates in half for v in layer_rates]
    return Summary(
        run=run,
        policy=policy.label,
        kind=policy.kind,
        capacity_factor=policy.capacity_factor,
        shards=policy.shards,
        waves=policy.waves,
        senders=policy.senders,
        mean=statistics.fmean(values) if values else 0.0,
        p50=statistics.median(values) if values else 0.0,
        max=max(values) if values else 0.0,
        mean_last_half=statistics.fmean(last) if last else 0.0,
        samples=len(values),
    )
