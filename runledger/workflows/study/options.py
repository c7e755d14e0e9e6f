"""The token-drop study's options (``StudyOptions``), its one error, and the reference run's figures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The reference run's published figures (../shared/reference/marin-535b.md).
REFERENCE_POOLED_WAVE_CF = 1.15
REFERENCE_WAVES = 3
REFERENCE_POOLED_WAVE_RATE = 0.0267
REFERENCE_RAGGED_RATE = 0.00018


class StudyError(ValueError):
    """A study that cannot start (bad options, a used work folder): one line for the user."""


@dataclass(frozen=True)
class StudyOptions:
    """What the study trains and how it accounts. Defaults: the ~30-minute study on 2 CPU cores."""

    workdir: Path
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 2
    num_experts: int = 64
    top_k: int = 8
    ffn_hidden_size: int = 128
    seq_length: int = 4096
    micro_batch_size: int = 1
    steps: int = 250
    seed: int = 1234
    capacity_factors: tuple[float, ...] = (1.0, 1.15, 1.25, 1.5, 2.0)
    trained_capacity_factor: float = 1.15  # the run trained with Megatron's dropping on
    drop_policy: str = "probs"
    # Pooled-wave set-ups as (senders, shards): (1, 64) is 64-way expert parallelism seen from one
    # rank sending its whole 4,096-token micro-batch (the reference's per-rank shape).
    pooled_wave: tuple[tuple[int, int], ...] = ((1, 64), (1, 8))
    waves: int = REFERENCE_WAVES
    # Megatron's default moe_router_bias_update_rate is 1e-3, meant for runs of 10⁵ steps; a study
    # run of ~100 steps needs the bias to move by about the spread of the sigmoid scores (~0.05)
    # within ~10 steps, or the router collapses onto a few experts before the bias catches up.
    expert_bias_rate: float = 1e-2
    z_loss_coeff: float = 1e-3
    lr: float = 2e-3
    monte_carlo_samples: int = 8
    threads: int = 0

    @classmethod
    def quick(cls, workdir: Path, **changes: Any) -> StudyOptions:
        """A minute-scale study for tests: tiny model, 512-token context (4096 is too slow for a
        test on 2 cores), 16 experts top-4, a few steps."""
        base = dict(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            num_experts=16,
            top_k=4,
            ffn_hidden_size=32,
            seq_length=512,
            steps=6,
            pooled_wave=((1, 16), (4, 4)),
            monte_carlo_samples=4,
        )
        base.update(changes)
        return cls(workdir=workdir, **base)  # type: ignore[arg-type]

    def validate(self) -> None:
        tokens = self.seq_length * self.micro_batch_size
        if not 1 <= self.top_k <= self.num_experts:
            raise StudyError(f"top_k {self.top_k} must be between 1 and num_experts {self.num_experts}")
        if self.steps < 1:
            raise StudyError("steps must be ≥ 1")
        if not self.capacity_factors or any(cf <= 0 for cf in self.capacity_factors):
            raise StudyError("capacity factors must be positive")
        if self.trained_capacity_factor <= 0:
            raise StudyError("the trained capacity factor must be positive")
        if self.expert_bias_rate < 0:
            raise StudyError("the expert-bias rate must be ≥ 0")
        if self.waves < 1:
            raise StudyError("waves must be ≥ 1")
        if not self.pooled_wave:
            raise StudyError("at least one pooled-wave set-up (senders, shards) is needed")
        for senders, shards in self.pooled_wave:
            if shards < 1 or self.num_experts % shards:
                raise StudyError(f"{shards} shards must divide the experts ({self.num_experts})")
            if senders < 1 or tokens % senders:
                raise StudyError(f"{senders} senders must divide the tokens of a micro-batch ({tokens})")
        if self.drop_policy not in ("probs", "position"):
            raise StudyError(f"drop policy {self.drop_policy!r}: probs or position")
