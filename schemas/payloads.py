"""Payload types of runledger's own events (trainer and people). One Struct per kind and version.

Field names are the public contract: JSON Schemas are exported from these classes
(``ledger schemas export DIR``) and the ledger's tables are filled from them.
Non-finite floats cannot travel in JSON: a NaN loss arrives as ``null`` and the event that reports
it (``runledger.step.skipped`` or ``runledger.run.crashed``) carries the text ``"nan"``/``"inf"``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from runledger.schemas.envelope import NonEmpty

Float = float | None
Count = Annotated[int, msgspec.Meta(ge=0)]


class Payload(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base of every payload. Unknown fields are tolerated so newer producers can add fields."""


class Launch(Payload, kw_only=True):
    """What every launch of a run records: the resolved config and where and what code ran it."""

    config: dict[str, Any]
    config_hash: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    git_commit: str | None = None
    git_dirty: bool | None = None
    git_branch: str | None = None
    repository: str | None = None  # "owner/name": joins the run to its GitHub stream
    host: str = ""
    cluster: str | None = None
    job_id: str | None = None
    world_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    parallelism: dict[str, int] = {}
    software: dict[str, str] = {}
    external: dict[str, str] = {}  # e.g. wandb_run_id, wandb_url


class RunStarted(Launch, kw_only=True):
    name: str | None = None
    parent_run: str | None = None
    fork_step: Count | None = None


class RunResumed(Launch, kw_only=True):
    from_checkpoint_step: Count
    checkpoint_path: str | None = None
    previous_attempt: Annotated[int, msgspec.Meta(ge=1)]


class StepMetricsV1(Payload, kw_only=True):
    """Version 1 (pre-release trainers): ``learning_rate`` and no free-form scalars."""

    loss: Float = None
    grad_norm: Float = None
    learning_rate: Float = None
    tokens: Count = 0
    tokens_per_second: Float = None
    step_time_s: Float = None


class StepMetrics(Payload, kw_only=True):
    loss: Float = None
    grad_norm: Float = None
    lr: Float = None
    tokens: Count = 0  # tokens consumed by this step
    total_tokens: Count | None = None
    tokens_per_second: Float = None
    mfu: Float = None  # percent: model FLOPs per second / peak FLOPs per second × 100
    step_time_s: Float = None
    scalars: dict[str, Float] = {}  # any other named scalar


class MoeLayerStats(msgspec.Struct, kw_only=True):
    layer: Count
    tokens: Count
    top_k: Annotated[int, msgspec.Meta(ge=1)]
    dropped: Count  # dropped (token, expert) assignments
    token_drop_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]  # dropped / (tokens * top_k)
    sender_drops: Count | None = None
    receiver_drops: Count | None = None
    expert_counts: list[Count] = []  # tokens routed to each expert (after drops)
    aux_loss: Float = None
    z_loss: Float = None
    routing_entropy: Float = None


class MoeRouterStats(Payload, kw_only=True):
    layers: list[MoeLayerStats]


class ChangeCause(msgspec.Struct, kw_only=True):
    kind: Literal["file_edit", "command", "commit", "api", "resume"]
    detail: str = ""
    actor: str | None = None
    commit: str | None = None


class PatchOp(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One RFC 6902 operation."""

    op: Literal["add", "remove", "replace", "move", "copy", "test"]
    path: str
    value: Any = msgspec.UNSET
    from_: str | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="from")


class ConfigChanged(Payload, kw_only=True):
    patch: list[PatchOp]
    previous_hash: str
    config_hash: str
    cause: ChangeCause


class ConfigRejected(Payload, kw_only=True):
    patch: list[PatchOp]
    reason: NonEmpty
    cause: ChangeCause


class CheckpointSaved(Payload, kw_only=True):
    path: str
    bytes: Count | None = None
    duration_s: Float = None
    reason: Literal["interval", "signal", "final", "manual"] = "interval"


class RunCrashed(Payload, kw_only=True):
    kind: Literal["exception", "nonfinite_loss", "signal", "oom"]
    exc_type: str | None = None
    message: str = ""
    traceback: str | None = None
    signal: int | None = None
    exit_code: int | None = None
    rank: Count = 0
    host: str = ""
    last_step: Count | None = None


class StepSkipped(Payload, kw_only=True):
    reason: NonEmpty
    value: str | None = None  # e.g. "nan", "inf": what JSON cannot carry as a number


class RunFinished(Payload, kw_only=True):
    status: Literal["completed", "stopped", "failed"]
    final_step: Count | None = None
    total_tokens: Count | None = None
    duration_s: Float = None


class Annotation(Payload, kw_only=True):
    author: NonEmpty
    text: NonEmpty
    tags: list[str] = []


class RankStats(Payload, kw_only=True):
    """Each rank's own view of a step: makes stragglers and the rank that died visible."""

    rank: Count
    host: str
    step_time_s: Float = None
    values: dict[str, Float] = {}


class RunSummary(Payload, kw_only=True):
    """Final values of a run (as W&B keeps them in its summary)."""

    values: dict[str, Any]
