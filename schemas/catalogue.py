"""The event catalogue: every event type, its versions, and how an old version is upcast to the newest.

Compatibility is BACKWARD (as schema registries default to): the newest reader reads every older
version. An upcaster turns a decoded old payload into the newest Struct; the stored canonical bytes
stay those of the event as it was produced.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import msgspec

from runledger.schemas import github as gh
from runledger.schemas import payloads as p


class EventType(msgspec.Struct, frozen=True, dict=True):
    name: str
    versions: dict[int, type[msgspec.Struct]]
    upcasters: dict[int, Callable[[msgspec.Struct], msgspec.Struct]] = msgspec.field(default_factory=dict)
    doc: str = ""

    @cached_property  # read once per event decoded: a max() each time was ~6 µs an event
    def latest(self) -> int:
        return max(self.versions)

    @property
    def struct(self) -> type[msgspec.Struct]:
        return self.versions[self.latest]

    def upcast(self, version: int, payload: msgspec.Struct) -> msgspec.Struct:
        while version < self.latest:
            payload = self.upcasters[version](payload)
            version += 1
        return payload


def _step_metrics_v1_to_v2(old: msgspec.Struct) -> msgspec.Struct:
    assert isinstance(old, p.StepMetricsV1)
    return p.StepMetrics(
        loss=old.loss,
        grad_norm=old.grad_norm,
        lr=old.learning_rate,
        tokens=old.tokens,
        tokens_per_second=old.tokens_per_second,
        step_time_s=old.step_time_s,
    )


RUN_STARTED = "runledger.run.started"
RUN_RESUMED = "runledger.run.resumed"
STEP_METRICS = "runledger.step.metrics"
MOE_ROUTER_STATS = "runledger.moe.router_stats"
CONFIG_CHANGED = "runledger.config.changed"
CONFIG_REJECTED = "runledger.config.rejected"
CHECKPOINT_SAVED = "runledger.checkpoint.saved"
RUN_CRASHED = "runledger.run.crashed"
STEP_SKIPPED = "runledger.step.skipped"
RUN_FINISHED = "runledger.run.finished"
ANNOTATION = "runledger.annotation"
RANK_STATS = "runledger.rank.stats"
RUN_SUMMARY = "runledger.run.summary"
GITHUB_ISSUE = "github.issues"
GITHUB_ISSUE_COMMENT = "github.issue_comment"
GITHUB_PULL_REQUEST = "github.pull_request"
GITHUB_REVIEW = "github.pull_request_review"
GITHUB_REVIEW_COMMENT = "github.pull_request_review_comment"
GITHUB_PUSH = "github.push"
GITHUB_COMMIT = "github.commit"
GITHUB_RAW = "github.raw"
PRODUCER_DROPPED = "runledger.producer.dropped"
BUS_POSITIONS_MISSING = "bus.positions_missing"  # run-less when no run is known: not runledger.*
PRODUCER_REGISTERED = "ledger.producer.registered"
PRODUCER_ROTATED = "ledger.producer.rotated"
PRODUCER_REVOKED = "ledger.producer.revoked"
POLICY_CHANGED = "ledger.policy.changed"
LEDGER_INCIDENT = "ledger.incident"
LEDGER_REDACTION = "ledger.redaction"
LEDGER_ANOMALY = "ledger.anomaly"
# The ledger's own record: written by the ledger (``ledger producers``, ingest's incidents), never
# admitted from a bus (see runledger.ledger.admission).
LEDGER_TYPES = frozenset(
    {
        PRODUCER_REGISTERED,
        PRODUCER_ROTATED,
        PRODUCER_REVOKED,
        POLICY_CHANGED,
        LEDGER_INCIDENT,
        LEDGER_REDACTION,
        LEDGER_ANOMALY,
    }
)

CATALOGUE: dict[str, EventType] = {
    t.name: t
    for t in [
        EventType(RUN_STARTED, {1: p.RunStarted}, doc="A run's first launch: resolved config, code, place."),
        EventType(RUN_RESUMED, {1: p.RunResumed}, doc="A relaunch from a checkpoint: starts a new attempt."),
        EventType(
            STEP_METRICS,
            {1: p.StepMetricsV1, 2: p.StepMetrics},
            {1: _step_metrics_v1_to_v2},
            doc="One optimizer step's scalars.",
        ),
        EventType(MOE_ROUTER_STATS, {1: p.MoeRouterStats}, doc="Per-layer router statistics of one step."),
        EventType(CONFIG_CHANGED, {1: p.ConfigChanged}, doc="A live config change (RFC 6902 patch)."),
        EventType(CONFIG_REJECTED, {1: p.ConfigRejected}, doc="A config change the run refused, and why."),
        EventType(CHECKPOINT_SAVED, {1: p.CheckpointSaved}, doc="A checkpoint written at a step."),
        EventType(RUN_CRASHED, {1: p.RunCrashed}, doc="An exception, non-finite loss, signal or OOM."),
        EventType(STEP_SKIPPED, {1: p.StepSkipped}, doc="A step whose update was skipped, and why."),
        EventType(RUN_FINISHED, {1: p.RunFinished}, doc="The end of an attempt that did not crash."),
        EventType(ANNOTATION, {1: p.Annotation}, doc="A person's note on a run and step."),
        EventType(RANK_STATS, {1: p.RankStats}, doc="One rank's step time and host."),
        EventType(RUN_SUMMARY, {1: p.RunSummary}, doc="A run's summary values (e.g. from W&B)."),
        EventType(GITHUB_ISSUE, {1: gh.GitHubIssue}, doc="An issue opened, edited, closed, labelled…"),
        EventType(GITHUB_ISSUE_COMMENT, {1: gh.GitHubComment}, doc="A comment on an issue or PR."),
        EventType(GITHUB_PULL_REQUEST, {1: gh.GitHubPullRequest}, doc="A pull request event."),
        EventType(GITHUB_REVIEW, {1: gh.GitHubReview}, doc="A pull request review."),
        EventType(GITHUB_REVIEW_COMMENT, {1: gh.GitHubComment}, doc="A comment on a PR's diff."),
        EventType(GITHUB_PUSH, {1: gh.GitHubPush}, doc="Commits pushed to a ref."),
        EventType(GITHUB_COMMIT, {1: gh.GitHubCommit}, doc="A commit seen by a backfill."),
        EventType(GITHUB_RAW, {1: gh.GitHubRaw}, doc="Any other GitHub event, kept whole."),
        EventType(
            PRODUCER_DROPPED,
            {1: p.ProducerDropped},
            doc="A producer dropped events (full queue, bus down): count, steps, seq range, why.",
        ),
        EventType(
            BUS_POSITIONS_MISSING,
            {1: p.BusPositionsMissing},
            doc="Positions of a bus source that hold no record any more (a deleted or damaged segment).",
        ),
        EventType(PRODUCER_REGISTERED, {1: p.ProducerRegistered}, doc="A producer key and its scope."),
        EventType(PRODUCER_ROTATED, {1: p.ProducerRotated}, doc="A producer key replaced by a new one."),
        EventType(PRODUCER_REVOKED, {1: p.ProducerRevoked}, doc="A producer key refused from here on."),
        EventType(POLICY_CHANGED, {1: p.PolicyChanged}, doc="Which sources may be unsigned."),
        EventType(LEDGER_INCIDENT, {1: p.LedgerIncident}, doc="A gap or fork in a source's events."),
        EventType(
            LEDGER_REDACTION,
            {1: p.LedgerRedaction},
            doc="An event's payload erased (ledger redact): its digests, reason and actor, signed by the log key.",
        ),
        EventType(
            LEDGER_ANOMALY,
            {1: p.LedgerAnomaly},
            doc="A detector's finding (spike, NaN, router collapse), re-derived by verify.",
        ),
    ]
}

# The payload Struct → its type name, so producers can emit a Struct without naming its type.
TYPE_OF_STRUCT: dict[type[msgspec.Struct], str] = {
    t.struct: t.name for t in CATALOGUE.values() if t.name != GITHUB_REVIEW_COMMENT
}
