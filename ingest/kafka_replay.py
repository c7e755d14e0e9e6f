"""Rebuild a ledger from the Kafka topics alone.

Every partition of the topics is assigned by hand (no consumer group, nothing committed to Kafka),
read from the beginning up to the end offsets captured when the replay starts, and folded in with
the same ``Ledger.commit``, in the same loop (``runledger.ingest.ingester``), as the live ingester. Because a
stream lives in one partition and the ledger keeps the first copy of every (source, id), the result
holds the same events, with the same ``stream_seq`` in every stream, as the live ledger that
ingested those offsets.

A replay into an existing ledger resumes from that ledger's positions (safe to interrupt and rerun).

``ledger_id`` keeps the log's identity: the new ledger takes the id of the ledger it replaces, so the
checkpoints signed before the replay (their origin is ``runledger/<ledger id>/<stream>``) still verify
against the rebuilt, identical trees. Without it the new ledger is a new log with a new id.

``registry`` keeps the producer registry and policy. They are the ledger's own events, written by
``ledger producers`` straight into the ledger and never on a topic (whoever can write to a topic must
not register a key), so a replay from the topics alone would lose them and then admit every record
unchecked. Given the old ledger or the file ``ledger producers export`` wrote, the replay commits each
registry event at the point the live ledger did: after every partition reached the offset it had
reached then (``RegistryEntry.after``). Records are admitted under the same registry, the registry
stream's tree is the same, and signed events verify as before. Incidents (gaps, forks) are recorded
again by admission as the records pass, with the same bytes when they meet the same causes in the
same order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from runledger.ingest.ingester import Ingester, IngestStats
from runledger.ingest.kafka_config import COMMIT_BATCH_MAX, events_topic
from runledger.ingest.kafka_ingester import open_consumer, source_name
from runledger.ledger.admission import REGISTRY_INGEST
from runledger.ledger.lake import LAKE_MARKER
from runledger.ledger.registry import RegistryEntry
from runledger.ledger.store import CommitResult, Ledger, LedgerError, SourceRecord
from runledger.schemas.codec import MAX_EVENT_BYTES

log = logging.getLogger(__name__)


def _target(path: Path, ledger_id: str | None) -> tuple[Ledger, bool]:
    """A fresh ledger at ``path``, or the ledger already there (resumed); of ``ledger_id`` if given."""
    if (path / LAKE_MARKER).exists() or (path / "LEDGER.json").exists():
        return Ledger.create(path, ledger_id), True  # an existing ledger: only checks the id
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise LedgerError(f"{path} exists and is not a ledger; replay needs a new (or empty) directory")
    return Ledger.create(path, ledger_id), False


def replay(
    bootstrap: str | None,
    to: str | Path,
    topics: Sequence[str] | None = None,
    *,
    batch_max: int = COMMIT_BATCH_MAX,
    connect_timeout_s: float = 15.0,
    stall_timeout_s: float = 120.0,
    on_commit: Callable[[CommitResult], None] | None = None,
    max_event_bytes: int = MAX_EVENT_BYTES,
    ledger_id: str | None = None,
    registry: Sequence[RegistryEntry] = (),
) -> IngestStats:
    """Fold every record now on ``topics`` into the ledger at ``to``; returns counts and the time taken.

    Records are judged exactly as the live ingester judges them (the same ``Ledger.commit``, with
    the same ``max_event_bytes``, under the same ``registry``: see the module doc), so a replayed
    ledger quarantines the same records for the same reasons; a record's content can never stop a
    replay."""
    stats = IngestStats()  # its clock starts now
    topics = list(topics or [events_topic()])
    ledger, stats.resumed = _target(Path(to), ledger_id)
    stats.ledger_id = ledger.ledger_id
    consumer, _ = open_consumer(
        bootstrap,
        connect_timeout_s=connect_timeout_s,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=batch_max,
        max_partition_fetch_bytes=8 << 20,
        fetch_max_bytes=64 << 20,
        client_id="runledger-replay",
    )
    try:
        replayer = _Replayer(
            ledger,
            consumer,
            _partitions(consumer, topics),
            stats=stats,
            batch_max=batch_max,
            stall_timeout_s=stall_timeout_s,
            max_event_bytes=max_event_bytes,
            on_commit=on_commit,
        )
        done = ledger.positions().get(REGISTRY_INGEST, 0)
        for entry in [e for e in sorted(registry, key=lambda e: e.position) if e.position >= done]:
            # Everything the live ledger had read from each partition before this registry event...
            replayer.read_until(
                {tp: min(end, entry.after.get(replayer.source(tp), 0)) for tp, end in replayer.ends.items()}
            )
            # ...then the registry event itself, at its own position.
            replayer.put_back(entry)
        replayer.read_until(replayer.ends)
    finally:
        consumer.close(autocommit=False)
    stats.seconds = time.monotonic() - stats.started
    return stats


def _partitions(consumer: Any, topics: Sequence[str]) -> list[TopicPartition]:
    """Every partition of ``topics``, or ``LedgerError`` for a topic the cluster does not have."""
    partitions: list[TopicPartition] = []
    for topic in topics:
        ids = consumer.partitions_for_topic(topic)
        if not ids:
            raise LedgerError(f"topic {topic!r} does not exist on the cluster")
        partitions.extend(TopicPartition(topic, p) for p in sorted(ids))
    return partitions


class _Replayer(Ingester):
    """``Ingester``'s loop over hand-assigned partitions, each up to a target offset: positions
    ``kafka:<topic>:<partition>`` at the record's offset, read from where the ledger's positions
    were when the replay started and then from where the replay's own commits left them."""

    def __init__(
        self,
        ledger: Ledger,
        consumer: Any,
        partitions: list[TopicPartition],
        *,
        stats: IngestStats,
        batch_max: int,
        stall_timeout_s: float,
        max_event_bytes: int,
        on_commit: Callable[[CommitResult], None] | None,
    ) -> None:
        super().__init__(
            ledger, writer="kafka-replay", max_event_bytes=max_event_bytes, stats=stats, on_commit=on_commit
        )
        self.consumer = consumer
        self.batch_max = batch_max
        self.stall_timeout_s = stall_timeout_s
        stats.partitions = len(partitions)
        consumer.assign(partitions)
        self.ends: dict[TopicPartition, int] = consumer.end_offsets(partitions)  # as the replay starts
        positions = ledger.positions()
        self.offsets = {tp: positions.get(self.source(tp), 0) for tp in partitions}  # next to commit
        self.targets: dict[TopicPartition, int] = {}
        self.remaining: set[TopicPartition] = set()
        self.progress = time.monotonic()

    @staticmethod
    def source(tp: TopicPartition) -> str:
        return source_name(tp.topic, tp.partition)

    def read_until(self, targets: dict[TopicPartition, int]) -> None:
        """Commit each partition's records from ``offsets[tp]`` up to ``targets[tp]`` (exclusive), and
        leave ``offsets`` at the targets. Records fetched beyond a target are dropped here and read
        again by the next call (it seeks back)."""
        self.targets, self.remaining = targets, set()
        for tp in targets:
            if self.offsets[tp] < targets[tp]:
                self.consumer.seek(tp, self.offsets[tp])
                self.consumer.resume(tp)
                self.remaining.add(tp)
            else:
                self.consumer.pause(tp)
        self.progress = time.monotonic()
        self.run()

    def read_batch(self) -> list[SourceRecord] | None:
        """One poll's records below the targets; None once every partition reached its target."""
        if not self.remaining:
            for tp in self.targets:
                self.offsets[tp] = max(self.offsets[tp], self.targets[tp])
            return None
        if time.monotonic() - self.progress > self.stall_timeout_s:
            left = sorted(f"{tp.topic}:{tp.partition}" for tp in self.remaining)
            raise LedgerError(f"replay stalled: nothing read for {self.stall_timeout_s:g} s from {left}")
        polled = self.consumer.poll(timeout_ms=500, max_records=self.batch_max)
        if polled:
            self.progress = time.monotonic()
        records: list[SourceRecord] = []
        for tp, msgs in polled.items():
            if tp not in self.remaining:
                continue
            start, target = self.offsets[tp], self.targets[tp]
            records.extend(
                SourceRecord(self.source(tp), m.offset, m.value or b"", tombstone=m.value is None)
                for m in msgs
                if start <= m.offset < target  # only up to the target (the end at the start)
            )
        for tp in list(self.remaining):
            if self.consumer.position(tp) >= self.targets[tp]:
                self.remaining.discard(tp)
                self.consumer.pause(tp)
        return records

    def put_back(self, entry: RegistryEntry) -> None:
        """A registry event, at its own position (counted in ``registry_events``, not ``accepted``)."""
        result = self.ledger.commit(
            [SourceRecord(REGISTRY_INGEST, entry.position, entry.raw)], writer="kafka-replay"
        )
        if result.accepted != 1:
            reasons = "; ".join(q.reason for _, q in result.quarantined) or "not stored"
            raise LedgerError(f"registry event at position {entry.position} not replayed: {reasons}")
        self.stats.registry_events += 1
        if self.on_commit is not None:
            self.on_commit(result)
