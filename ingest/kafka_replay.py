"""Rebuild a ledger from the Kafka topics alone.

Every partition of the topics is assigned by hand (no consumer group, nothing committed to Kafka),
read from the beginning up to the end offsets captured when the replay starts, and folded in with
the same ``Ledger.commit`` the live ingester uses. Because a stream lives in one partition and the
ledger keeps the first copy of every (source, id), the result holds the same events, with the same
``stream_seq`` in every stream, as the live ledger that ingested those offsets.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from ingest.kafka_config import COMMIT_BATCH_MAX, events_topic
from ingest.kafka_ingester import open_consumer, source_name
from ledger.admission import REGISTRY_INGEST, RegistryEntry
from ledger.store import CommitResult, Ledger, LedgerError, SourceRecord
from schemas.codec import MAX_EVENT_BYTES

log = logging.getLogger(__name__)


@dataclass
class ReplayStats:
    partitions: int = 0
    records: int = 0
    commits: int = 0
    accepted: int = 0
    duplicates: int = 0
    quarantined: int = 0
    metric_values: int = 0
    seconds: float = 0.0
    resumed: bool = False
    ledger_id: str = ""
    registry_events: int = 0  # registry and policy events put back (``registry``)

    def add(self, result: CommitResult) -> None:
        self.commits += result.commit is not None
        self.accepted += result.accepted
        self.duplicates += result.duplicates
        self.quarantined += len(result.quarantined)
        self.metric_values += result.metric_values


def _target(path: Path, ledger_id: str | None) -> tuple[Ledger, bool]:
    """A fresh ledger at ``path``, or the ledger already there (resumed); of ``ledger_id`` if given."""
    if (path / "LEDGER.json").exists():
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
) -> ReplayStats:
    """Fold every record now on ``topics`` into the ledger at ``to``; returns counts and the time taken.

    Records are judged exactly as the live ingester judges them (the same ``Ledger.commit``, with
    the same ``max_event_bytes``, under the same ``registry``: see the module doc), so a replayed
    ledger quarantines the same records for the same reasons; a record's content can never stop a
    replay."""
    started = time.monotonic()
    topics = list(topics or [events_topic()])
    ledger, resumed = _target(Path(to), ledger_id)
    stats = ReplayStats(resumed=resumed, ledger_id=ledger.ledger_id)
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
        partitions: list[TopicPartition] = []
        for topic in topics:
            ids = consumer.partitions_for_topic(topic)
            if not ids:
                raise LedgerError(f"topic {topic!r} does not exist on the cluster")
            partitions.extend(TopicPartition(topic, p) for p in sorted(ids))
        stats.partitions = len(partitions)
        consumer.assign(partitions)
        ends: dict[TopicPartition, int] = consumer.end_offsets(partitions)
        positions = ledger.positions()
        offsets = {tp: positions.get(source_name(tp.topic, tp.partition), 0) for tp in partitions}
        done = positions.get(REGISTRY_INGEST, 0)
        for entry in [e for e in sorted(registry, key=lambda e: e.position) if e.position >= done]:
            # Everything the live ledger had read from each partition before this registry event...
            targets = {
                tp: min(ends[tp], entry.after.get(source_name(tp.topic, tp.partition), 0))
                for tp in partitions
            }
            _read_until(
                consumer,
                ledger,
                offsets,
                targets,
                batch_max,
                stall_timeout_s,
                max_event_bytes,
                stats,
                on_commit,
            )
            # ...then the registry event itself, at its own position.
            result = ledger.commit(
                [SourceRecord(REGISTRY_INGEST, entry.position, entry.raw)], writer="kafka-replay"
            )
            if result.accepted != 1:
                reasons = "; ".join(q.reason for _, q in result.quarantined) or "not stored"
                raise LedgerError(f"registry event at position {entry.position} not replayed: {reasons}")
            stats.registry_events += 1
            if on_commit is not None:
                on_commit(result)
        _read_until(
            consumer, ledger, offsets, ends, batch_max, stall_timeout_s, max_event_bytes, stats, on_commit
        )
    finally:
        consumer.close(autocommit=False)
    stats.seconds = time.monotonic() - started
    return stats


def _read_until(
    consumer: Any,
    ledger: Ledger,
    offsets: dict[TopicPartition, int],
    targets: dict[TopicPartition, int],
    batch_max: int,
    stall_timeout_s: float,
    max_event_bytes: int,
    stats: ReplayStats,
    on_commit: Callable[[CommitResult], None] | None,
) -> None:
    """Commit each partition's records from ``offsets[tp]`` up to ``targets[tp]`` (exclusive), and
    leave ``offsets`` at the targets. Records fetched beyond a target are dropped here and read again
    by the next call (it seeks back)."""
    remaining: set[TopicPartition] = set()
    for tp in targets:
        if offsets[tp] < targets[tp]:
            consumer.seek(tp, offsets[tp])
            consumer.resume(tp)
            remaining.add(tp)
        else:
            consumer.pause(tp)
    progress = time.monotonic()
    while remaining:
        if time.monotonic() - progress > stall_timeout_s:
            left = sorted(f"{tp.topic}:{tp.partition}" for tp in remaining)
            raise LedgerError(f"replay stalled: nothing read for {stall_timeout_s:g} s from {left}")
        batch = consumer.poll(timeout_ms=500, max_records=batch_max)
        if batch:
            progress = time.monotonic()
        records: list[SourceRecord] = []
        for tp, msgs in batch.items():
            if tp not in remaining:
                continue
            target = targets[tp]
            source = source_name(tp.topic, tp.partition)
            records.extend(
                SourceRecord(source, m.offset, m.value or b"", tombstone=m.value is None)
                for m in msgs
                if offsets[tp] <= m.offset < target  # only up to the target (the end at the start)
            )
        for tp in list(remaining):
            if consumer.position(tp) >= targets[tp]:
                remaining.discard(tp)
                consumer.pause(tp)
        if records:
            stats.records += len(records)
            result = ledger.commit(records, writer="kafka-replay", max_event_bytes=max_event_bytes)
            stats.add(result)
            if on_commit is not None:
                on_commit(result)
    for tp in targets:
        offsets[tp] = max(offsets[tp], targets[tp])
