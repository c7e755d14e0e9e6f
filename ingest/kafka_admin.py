"""Kafka topics for an operator: create one with N partitions, describe it (with a group's lag), add
partitions (``ledger kafka topic create|describe|add-partitions``).

A broker that auto-creates a topic gives it ``num.partitions`` (1 by default), so a second ingester
of the group sits idle; ``ledger kafka topic create --partitions N`` makes the topic first. Every
call is bounded: the admin client gives up after ``connect_timeout_s`` (``BrokerUnavailableError``)
and each request after the same time. Kafka never removes partitions, and a topic keeps its keys'
partition only while the count stays the same: ``add_partitions`` only ever raises the count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kafka import KafkaAdminClient, TopicPartition
from kafka import errors as kafka_errors
from kafka.admin import OffsetSpec
from kafka.errors import KafkaError

from runledger.ingest.kafka_config import (
    TopicUnavailableError,
    admin_client_for,
    client_kwargs,
)

T = TypeVar("T")
GROUP_WAIT_S = 10.0  # a new cluster makes its offsets topic (the group coordinator) on first use
RETRY_INTERVAL_S = 0.25


class TopicExistsError(RuntimeError):
    """The topic to create is there already, with another partition count (the message says which)."""


@dataclass(frozen=True)
class PartitionLag:
    """One partition: its end offset and, for a group, the offset the group committed (None: none)."""

    partition: int
    end_offset: int
    committed: int | None = None

    @property
    def lag(self) -> int | None:
        return None if self.committed is None else max(0, self.end_offset - self.committed)


@dataclass(frozen=True)
class TopicInfo:
    """What ``describe_topic`` found: the partition count, replication, and per partition the end
    offset (and the group's committed offset when a group was asked about)."""

    name: str
    replication_factor: int
    partitions: list[PartitionLag] = field(default_factory=list)
    group: str | None = None
    group_members: int | None = None


@contextlib.contextmanager
def admin_client(bootstrap: str | None, connect_timeout_s: float = 15.0) -> Iterator[KafkaAdminClient]:
    """An admin client on the cluster every runledger client uses (``client_kwargs``), closed after;
    ``BrokerUnavailableError`` when no broker answers within ``connect_timeout_s``."""
    with admin_client_for(client_kwargs(bootstrap), connect_timeout_s) as admin:
        yield admin


def _described(admin: KafkaAdminClient, topic: str) -> dict[str, object] | None:
    """The topic's metadata entry, or None when it does not exist (other problems raise)."""
    described = admin.describe_topics([topic])[0]
    code = int(described.get("error_code", 0))
    if code == kafka_errors.UnknownTopicOrPartitionError.errno:
        return None
    if code:
        raise TopicUnavailableError(
            f"topic {topic} cannot be described ({kafka_errors.for_code(code).__name__})"
        )
    return dict(described)


def _partition_ids(described: dict[str, object]) -> list[int]:
    partitions = described.get("partitions") or []
    assert isinstance(partitions, list)
    return sorted(int(p["partition_index"]) for p in partitions)


def _replication(described: dict[str, object]) -> int:
    partitions = described.get("partitions") or []
    assert isinstance(partitions, list)
    return max((len(p.get("replica_nodes") or []) for p in partitions), default=0)


def partition_count(admin: KafkaAdminClient, topic: str) -> int | None:
    """How many partitions ``topic`` has; None when it does not exist."""
    described = _described(admin, topic)
    return None if described is None else len(_partition_ids(described))


def create_topic(
    admin: KafkaAdminClient,
    topic: str,
    partitions: int,
    replication_factor: int,
    configs: dict[str, str] | None = None,
) -> tuple[bool, int]:
    """Make ``topic`` with ``partitions`` partitions (and topic ``configs``, e.g. retention.ms):
    (True, partitions) when made, (False, its count) when it was there with that count (its configs
    left as they are); ``TopicExistsError`` when it is there with another count."""
    # Look first: the broker's own "already exists" does not say with how many partitions.
    existing = partition_count(admin, topic)
    if existing is None:
        try:
            admin.create_topics(
                {
                    topic: {
                        "num_partitions": partitions,
                        "replication_factor": replication_factor,
                        "configs": dict(configs or {}),
                    }
                },
                wait_for_metadata=True,
            )
            return True, partitions
        except kafka_errors.TopicAlreadyExistsError:  # made by someone else meanwhile
            existing = partition_count(admin, topic) or 0
    if existing != partitions:
        raise TopicExistsError(
            f"topic {topic} exists with {existing} partition{'s' if existing != 1 else ''}, not {partitions}"
        )
    return False, existing


def add_partitions(admin: KafkaAdminClient, topic: str, total: int) -> tuple[int, int]:
    """Raise ``topic``'s partition count to ``total``: (before, after). Kafka cannot lower it, so a
    smaller ``total`` is a ``ValueError``; the same count changes nothing."""
    before = partition_count(admin, topic)
    if before is None:
        raise TopicUnavailableError(f"topic {topic} does not exist")
    if total < before:
        raise ValueError(f"topic {topic} has {before} partitions; Kafka cannot lower the count to {total}")
    if total > before:
        admin.create_partitions({topic: total})
        admin.wait_for_topics([topic])
    return before, total


def _retried(call: Callable[[], T], wait_s: float) -> T:
    """``call()``, asked again while the broker answers with a retriable error (no coordinator yet,
    one loading) for at most ``wait_s``; then that error."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call()
        except KafkaError as exc:
            if not exc.retriable or time.monotonic() >= deadline:
                raise
        time.sleep(RETRY_INTERVAL_S)


def group_member_count(admin: KafkaAdminClient, group: str, wait_s: float = GROUP_WAIT_S) -> int:
    """How many members the consumer group has now (0: none, or no such group)."""
    described = _retried(lambda: admin.describe_groups([group]), wait_s).get(group) or {}
    return len(described.get("members") or [])


def _committed_offsets(
    admin: KafkaAdminClient, group: str, topic: str, wait_s: float = GROUP_WAIT_S
) -> dict[int, int]:
    """The group's committed offsets on ``topic``, by partition (none committed: absent)."""
    offsets = _retried(lambda: admin.list_group_offsets({group: None}), wait_s).get(group) or {}
    return {
        tp.partition: int(om.offset) for tp, om in offsets.items() if tp.topic == topic and om.offset >= 0
    }


def _end_offsets(admin: KafkaAdminClient, topic: str, partitions: Sequence[int]) -> dict[int, int]:
    specs = {TopicPartition(topic, p): OffsetSpec.LATEST for p in partitions}
    found = admin.list_partition_offsets(specs)
    return {tp.partition: int(info.offset) for tp, info in found.items()}


def describe_topic(admin: KafkaAdminClient, topic: str, group: str | None = None) -> TopicInfo:
    """The topic's partitions with their end offsets, and with ``group`` its committed offsets and
    member count; ``TopicUnavailableError`` when the topic does not exist."""
    described = _described(admin, topic)
    if described is None:
        raise TopicUnavailableError(f"topic {topic} does not exist")
    ids = _partition_ids(described)
    ends = _end_offsets(admin, topic, ids) if ids else {}
    committed = _committed_offsets(admin, group, topic) if group else {}
    lags = [PartitionLag(p, ends.get(p, 0), committed.get(p)) for p in ids]
    members = group_member_count(admin, group) if group else None
    return TopicInfo(topic, _replication(described), lags, group, members)
