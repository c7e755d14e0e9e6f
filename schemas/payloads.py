"""Payload types of runledger's own events (trainer and people). One Struct per kind and version.

Field names are the public contract: JSON Schemas are exported from these classes
(``ledger schemas export DIR``) and the ledger's tables are filled from them.
Non-finite floats cannot travel in JSON: a NaN loss arrives as ``null`` and the event that reports
it (``runledger.step.skipped`` or ``runledger.run.crashed``) carries the text ``"nan"``/``"inf"``.
"""

from __future__ import annotations

from datetime import datetime
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
    tokens: Count | None = None  # tokens consumed by this step (None: not reported, never invented)
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
    # Added later (issue 39): the busiest expert's tokens over the mean tokens per expert (1.0:
    # balanced). UNSET when not measured, so it is left out of the event: a producer that does not
    # give it emits the same bytes as before, and events without it read as null.
    max_load: Float | msgspec.UnsetType = msgspec.UNSET


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


# --- producers and the ledger's own record (see runledger.ledger.admission) -----------------------


class ProducerDropped(Payload, kw_only=True):
    """A producer had to drop events (its queue was full, the bus refused them, e.g. a full disk):
    how many, the steps they were for, why, and the range of ``seq`` numbers they used
    (``first_seq``..``last_seq``; events of that range the ledger holds were not lost). The dropped
    events' ``seq`` numbers were used, so ingest also sees the gap where the source is chained."""

    count: Annotated[int, msgspec.Meta(ge=1)]
    first_step: Count | None = None
    last_step: Count | None = None
    reason: str = "queue full"
    first_seq: Count | None = None  # added later: None in reports of older producers
    last_seq: Count | None = None


class BusPositionsMissing(Payload, kw_only=True):
    """Positions ``first``..``last`` of a bus source (``source``: ``spool:<spool id>``) hold no
    record any more: ``count`` records lost to a deleted or damaged segment, recorded by ingest
    instead of passing over them in silence."""

    source: NonEmpty
    first: Count
    last: Count
    count: Annotated[int, msgspec.Meta(ge=1)]
    reason: str = ""


class ProducerScope(msgspec.Struct, kw_only=True):
    """What a producer key may write. Each list holds prefixes matched by whole segments
    (``"trainer/r5"`` covers ``trainer/r5/a1/rank0``, not ``trainer/r5-evil``; ``"github."`` the
    ``github.*`` types; ``runledger.ledger.admission.scope_matches``); an empty list of streams or types means
    any; ``sources`` must name at least one prefix. ``run_scope`` is one run's."""

    sources: list[NonEmpty]
    streams: list[str] = []
    types: list[str] = []
    valid_from: datetime | None = None  # compared with the event's own ``time``
    valid_until: datetime | None = None


def run_scope(run_id: str, source: str = "trainer") -> ProducerScope:
    """The scope of a key made for one run: its sources under ``<source>/<run_id>`` (the trainer's
    ``trainer/<run>/a<n>/rank<r>``, the client's ``<source_prefix>/<run>/…``) and the run's stream."""
    return ProducerScope(sources=[f"{source}/{run_id}"], streams=[run_id])


class ProducerRegistered(Payload, kw_only=True):
    """A producer key joins the registry (``ledger producers add``)."""

    name: NonEmpty
    public_key: NonEmpty  # note vkey: <name>+<8 hex key hash>+<base64(0x01 ‖ key)>
    key_id: NonEmpty
    scope: ProducerScope
    actor: str | None = None


class ProducerRotated(Payload, kw_only=True):
    """A producer's key replaced by a new one with the same scope: the old key is revoked from here."""

    old_key_id: NonEmpty
    public_key: NonEmpty
    key_id: NonEmpty
    actor: str | None = None


class ProducerRevoked(Payload, kw_only=True):
    """A producer key is refused from this point of the log on; its earlier events still verify."""

    key_id: NonEmpty
    reason: str = ""
    actor: str | None = None


class PolicyChanged(Payload, kw_only=True):
    """The ledger's admission policy: sources (prefixes) whose events may arrive unsigned; they are
    accepted and shown as unauthenticated. ``["*"]``: any source."""

    unsigned_sources: list[str] = []
    actor: str | None = None


class LedgerIncident(Payload, kw_only=True):
    """What ingest saw wrong with a source's order, recorded instead of blocking: a ``gap`` (seq
    numbers missing before the event ``event_id``), or a ``fork`` (an event whose ``seq`` was already
    taken, or whose ``prev`` is not the hash of the source's last event), or a ``duplicate-launch``
    (a second launch of a run's attempt, e.g. one run bridged live and imported again:
    ``event_id`` is the second launch's id, ``expected_prev`` names the first as "source id")."""

    kind: Literal["gap", "fork", "duplicate-launch"]
    source: NonEmpty
    expected_seq: Count
    got_seq: Count
    missing: Count = 0
    expected_prev: str | None = None
    got_prev: str | None = None
    event_id: str | None = None


class LedgerAnomaly(Payload, kw_only=True):
    """What a detector found in the log, recorded at ingest (issue 44): a deterministic function of
    the events before it, so ``verify`` re-derives every one and an operator can neither forge nor
    hide one. ``rule`` and ``rule_version`` name the detector, ``params`` its parameters as run;
    ``metric`` what it watched (``loss``, ``layer.3.token_drop_rate``, ``rank.17.step_time_s``);
    ``value`` what it saw, ``baseline`` what it expected (None where no baseline applies, e.g. a
    non-finite value), ``score`` how far off (rule-specific: robust z-score, ratio). ``event_id`` is
    the event that tripped it; the envelope's run, attempt and step are that event's."""

    rule: NonEmpty  # loss-spike, non-finite, router-collapse, straggler, throughput-drop
    rule_version: Annotated[int, msgspec.Meta(ge=1)]
    params: dict[str, float] = {}
    metric: NonEmpty
    value: Float = None
    baseline: Float = None
    score: Float = None
    event_id: NonEmpty


Hex64 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class LedgerRedaction(Payload, kw_only=True):
    """An event's payload erased from the ledger's tables (``ledger redact``): which event, the
    digests it stays committed through (its Merkle leaf hash and its public log entry's digest, so
    every proof still verifies), who asked and why. The event's row keeps its envelope columns."""

    event_id: NonEmpty
    event_source: NonEmpty
    event_type: NonEmpty
    stream: NonEmpty
    stream_seq: Count
    leaf_sha256: Hex64  # RFC 6962 leaf hash of the erased canonical bytes (the per-stream tree's leaf)
    entry_sha256: Hex64  # the digest the public log's entry carries (salted or not, see ``salted``)
    salted: bool  # True: entry_sha256 = SHA-256(salt ‖ canonical bytes); the salt is erased too
    reason: NonEmpty
    actor: NonEmpty
