"""The reference run's published facts: its shape, figures and dates, and what the simulator is asked.

Everything here is a constant of ../shared/reference/marin-535b.md (or a pure function of those
constants); the rest of the simulator builds its story and values from them.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType

# --- the run's shape and figures ------------------------------------------------------------------

REFERENCE_STEPS = 390_000
SWITCH_STEP = 81_716  # pooled-wave → ragged all-to-all (~3.77T tokens)
LAYERS, EXPERTS, TOP_K = 48, 384, 8
HIDDEN, SEQ_LENGTH = 6144, 4096
RACKS, GPUS_PER_RACK, GPUS_PER_HOST = 11, 72, 4
RANKS = RACKS * GPUS_PER_RACK  # 792
GLOBAL_BATCH_SEQUENCES = 11_264
TOKENS_PER_STEP = GLOBAL_BATCH_SEQUENCES * SEQ_LENGTH  # 46,137,344
DROP_RATE_POOLED = 0.0267
DROP_RATE_RAGGED = 0.00018
MFU_POOLED_PERCENT = 22.71
MFU_RAGGED_PERCENT = 22.87
ACTIVE_PARAMS = 23e9
PEAK_TFLOPS_PER_GPU = 2500.0  # GB200, dense BF16
# Model FLOPs per token: 6 · active parameters + attention (12 · layers · hidden · context).
FLOPS_PER_TOKEN = 6 * ACTIVE_PARAMS + 12 * LAYERS * HIDDEN * SEQ_LENGTH
REFERENCE_CHECKPOINT_EVERY = 1000
REFERENCE_CRASHES = 19
CHECKPOINT_BYTES = 7_490_000_000_000  # bf16 weights + fp32 master weights and Adam moments of 535B

# --- who, where and when --------------------------------------------------------------------------

RUN_ID = "moe-535b"
RUN_NAME = "moe-535b-a23b"
REPOSITORY = "openlab/moe-535b"
START = datetime(2026, 2, 2, 8, 0, tzinfo=UTC)
RUN_DAYS = 84.0  # ~3 months of wall clock, downtime included
SCENARIOS = ("reference-535b",)

# What every launch record says about the machine and the code besides its commit and job.
CLUSTER = "openlab-gb200"
PARALLELISM = MappingProxyType({"tp": 1, "pp": 1, "ep": 64, "dp": RANKS})
SOFTWARE = MappingProxyType({"torch": "2.9.1", "megatron-core": "0.16.1", "cuda": "12.9", "nccl": "2.27.7"})
WANDB_PROJECT = "openlab/moe-535b"

# The 24 free-form scalars beside StepMetrics' 8 fields: 32 per step, as the reference run logs.
SCALAR_NAMES = (
    "token_drop_rate",  # the trainer's layer means (telemetry.step_metrics)
    "aux_loss",
    "z_loss",
    "routing_entropy",
    "events_dropped",  # the trainer's own counters
    "skipped_steps",
    "sender_drop_rate",
    "receiver_drop_rate",
    "max_expert_load",
    "min_expert_load",
    "expert_load_cv",
    "expert_bias_abs_mean",
    "router_logit_max",
    "param_norm",
    "update_to_param_ratio",
    "tflops_per_gpu",
    "tokens_per_second_per_gpu",
    "memory_allocated_gib",
    "memory_reserved_gib",
    "dataloader_wait_s",
    "all_to_all_s",
    "optimizer_step_s",
    "consumed_samples",
    "data_mixture_progress",
)

USERS = ("lena-m", "raj-p", "sofia-r", "tom-w", "yuki-s", "ahmed-k", "mara-d")
BOT = "openlab-bot"

FLAKY_RANKS = (4 * 44 + 1, 4 * 141 + 2)  # two hosts that fail (and run slow) more than the others


@dataclass(frozen=True)
class SimOptions:
    steps: int = REFERENCE_STEPS
    metrics_every: int = 1
    expert_counts_every: int = 100
    rank_stats_every: int = 1000
    checkpoint_every: int | None = None  # None: 1,000 scaled to ``steps`` (at least 10)
    crashes: int = REFERENCE_CRASHES
    seed: int = 0
    run_id: str = RUN_ID
    # "": the reference run's repository for its run id, else the run's own (``own_repository``),
    # so a second simulated run in one ledger never rewrites the first one's PRs and commits.
    repository: str = ""

    def __post_init__(self) -> None:
        for name in ("steps", "metrics_every", "expert_counts_every", "rank_stats_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be at least 1")
        if self.crashes < 0:
            raise ValueError("crashes must be at least 0")
        if self.steps < 200:
            raise ValueError("steps must be at least 200 (the story needs room)")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.run_id):
            raise ValueError(f"run id {self.run_id!r}: letters, digits, '.', '_' and '-', at most 128")
        if not self.repository:
            object.__setattr__(self, "repository", own_repository(self.run_id))

    @property
    def github_salt(self) -> tuple[int, ...]:
        """Mixed into the seed of the GitHub story's ids (commit SHAs, delivery ids) and PR numbers:
        none for the reference run id (its bytes stay as they were), the run id's CRC-32 for any other,
        so two runs of one seed do not share commits."""
        return () if self.run_id == RUN_ID else (zlib.crc32(self.run_id.encode()),)

    @property
    def first_number(self) -> int:
        """The repository's first issue/PR number: 1201 for the reference run, else past it by a
        run-specific stride, so no simulated run reuses the reference run's PR numbers."""
        salt = self.github_salt
        return 1201 if not salt else 1201 + 1000 * (1 + salt[0] % 89)


def own_repository(run_id: str) -> str:
    """``openlab/moe-535b`` for the reference run id, ``openlab/<run id>`` for any other."""
    if run_id == RUN_ID:
        return REPOSITORY
    owner = REPOSITORY.split("/")[0]
    name = run_id[:100]  # GitHub's longest repository name
    return f"{owner}/{name}-run" if name.endswith(".git") else f"{owner}/{name}"


def at(steps: int, reference_step: float) -> int:
    """The step of a reference-run position in a run of ``steps`` steps."""
    return max(1, round(reference_step * steps / REFERENCE_STEPS))


def host_of(rank: int) -> str:
    """The rank's host: 4 GPUs per tray, 18 trays per NVL72 rack."""
    rack, local = divmod(rank, GPUS_PER_RACK)
    return f"gb200-r{rack:02d}-n{local // GPUS_PER_HOST:02d}"


_START_TS = START.timestamp()


def when(t: float) -> datetime:
    """The moment ``t`` seconds after the run's start."""
    return datetime.fromtimestamp(_START_TS + t, UTC)
