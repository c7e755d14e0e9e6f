"""The one loop every ingester runs, and the one stats class they all report.

Read a batch from the source -> commit it to the ledger with its source positions in the same
commit -> count -> repeat, until the source is drained or a stop is asked for.

Exactly once comes from ``Ledger.commit``: every record of a batch carries its position in its
source (``SourceRecord.source`` and ``.position``), and one commit stores the data and the new
positions atomically (the tracking record), skipping positions an earlier commit already covered.
So no ingester keeps offsets of its own that could disagree with the ledger: where to read next
comes from the ledger's positions (or, in a replay, from what the replay itself committed), and a
crash between read and commit only means the batch is read again.

An ingester (a subclass of ``Ingester``) supplies only what differs:

* ``read_batch``: how it reads its source, and how it names positions (``spool:<spool id>``,
  ``kafka:<topic>:<partition>``); it returns None once the source is drained or a stop is asked for;
* ``committed``: anything it does after a commit (the Kafka group ingester's dead letters and
  offset hints); nothing by default.

The ingesters: ``runledger.ingest.spool_ingester`` (the embedded spool), ``runledger.ingest.kafka_ingester`` (a Kafka
consumer group, until stopped or idle) and ``runledger.ingest.kafka_replay`` (every partition from the
beginning up to the end offsets captured at the start).
"""

from __future__ import annotations

import contextlib
import gc
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from runledger.ledger.store import CommitResult, Ledger, SourceRecord
from runledger.schemas.codec import MAX_EVENT_BYTES


@dataclass
class IngestStats:
    """What an ingester did: one class for all of them. A count an ingester has no use for stays 0.

    For every batch ``accepted - made + duplicates + skipped + quarantined == records``
    (``Ledger.commit`` places every record in exactly one of the four; ``made``: the events the
    ledger itself made of them, its incidents and anomalies, stored and counted in ``accepted``)."""

    # Every ingester.
    records: int = 0  # records read from the source (including ones the ledger already held)
    batches: int = 0  # batches handed to ``Ledger.commit``
    commits: int = 0  # ledger commits made (a batch with nothing new makes none)
    accepted: int = 0  # events stored
    made: int = 0  # of those, the ledger's own (ingest's incidents, the detectors' anomalies)
    duplicates: int = 0  # events the ledger held already (the same source and id)
    skipped: int = 0  # records at positions the ledger had already covered
    quarantined: int = 0  # records stored in the quarantine table, with a reason
    metric_values: int = 0  # metric rows the accepted events added
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # since ``started``, as of the end of the latest ``Ingester.run``
    # The spool ingester (``runledger.ingest.spool_ingester``).
    missing: int = 0  # spool positions that held no record (recorded as ``bus.positions_missing``)
    # The Kafka group ingester (``runledger.ingest.kafka_ingester``).
    polls: int = 0
    deadlettered: int = 0  # dead letters Kafka acknowledged
    consumer_restarts: int = 0  # consumers replaced after losing the group coordinator for too long
    assignments: list[list[str]] = field(default_factory=list)  # each assignment's "topic:partition"s
    # The replay (``runledger.ingest.kafka_replay``).
    partitions: int = 0
    resumed: bool = False  # into a ledger that was already there
    ledger_id: str = ""
    registry_events: int = 0  # registry and policy events put back (not counted in ``accepted``)

    def add(self, result: CommitResult, records: int) -> None:
        """Count one batch of ``records`` records and what the ledger made of it."""
        self.records += records
        self.batches += 1
        self.commits += result.commit is not None
        self.accepted += result.accepted
        self.made += result.made
        self.duplicates += result.duplicates
        self.skipped += result.skipped
        self.quarantined += len(result.quarantined)
        self.metric_values += result.metric_values


class Ingester(ABC):
    """The loop (``run``); a subclass says how it reads its source (``read_batch``)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        writer: str,
        max_event_bytes: int = MAX_EVENT_BYTES,
        stats: IngestStats | None = None,
        on_commit: Callable[[CommitResult], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.writer = writer  # names the ingester in each commit record
        self.max_event_bytes = max_event_bytes  # longer records are quarantined unread
        self.stats = stats if stats is not None else IngestStats()
        self.on_commit = on_commit

    @abstractmethod
    def read_batch(self) -> Sequence[SourceRecord] | None:
        """The next batch, each record named by its source and position; empty when nothing came
        this time (asked again), None when the source is drained or a stop was asked for."""

    def committed(self, batch: Sequence[SourceRecord], result: CommitResult) -> None:  # noqa: B027
        """After each commit, once it is counted: nothing by default (an optional hook)."""

    def run(self) -> IngestStats:
        """Read, commit, count, until ``read_batch`` says it is done. An exception (the ledger's, the
        source's) leaves the loop at once: the batch in hand is then either committed whole or not
        at all, and the next run reads from the ledger's positions."""
        while (batch := self.read_batch()) is not None:
            if batch:
                self.commit(batch)
        self.stats.seconds = time.monotonic() - self.stats.started
        return self.stats

    def commit(self, batch: Sequence[SourceRecord]) -> CommitResult:
        """One batch into the ledger, with its positions, in one commit; counted, then announced."""
        with gc_paused():
            result = self.ledger.commit(batch, writer=self.writer, max_event_bytes=self.max_event_bytes)
        self.stats.add(result, len(batch))
        self.committed(batch, result)
        if self.on_commit is not None:
            self.on_commit(result)
        return result


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for one commit, back on after it (if it was on).

    A commit keeps its batch's rows as Python objects until they become Arrow tables (the expert
    counts of 20,000 router events are ~1M lists), so the collector's full passes, each traversing
    every live object, ran several times a commit: ~8% of its CPU. What a commit drops is freed by
    reference counting as before; cycles, if any, wait for the next collection after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
