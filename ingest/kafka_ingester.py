"""Fold Kafka topics into the ledger, exactly once, in a consumer group.

Where to read comes from the ledger, never from Kafka: on every partition assignment the consumer
seeks each partition to the ledger's next position for ``kafka:<topic>:<partition>`` (the beginning
if the ledger has none). Each poll batch is one ``Ledger.commit`` (the loop and its counts are
``runledger.ingest.ingester``'s, shared with the spool ingester and the replay), which stores the data and the new
positions atomically and skips positions already covered; so a crash anywhere, a rebalance, or two
ingesters briefly reading the same partition can neither lose nor duplicate a record. Kafka's own
committed offsets are written after each ledger commit only as a monitoring hint (consumer lag).

No record can stop the ingester: whatever a record holds (a null value, nothing, megabytes, deep
nesting, not JSON), the ledger accepts it or quarantines it with a reason (``Ledger.commit``).

Records the ledger quarantines are also announced on the dead-letter topic, as a bounded JSON
envelope (``deadletter_envelope``): the reason and its code, where the record came from, the raw
bytes' length and SHA-256 and their first ``DEADLETTER_PREFIX_BYTES`` (base64); headers repeat the
reason (``reason`` code, ``error`` text) and the origin (``source.topic``, ``source.partition``,
``source.offset``). The envelope always fits a default-sized Kafka message whatever the record's
size; the full raw bytes are in the ledger's ``quarantine`` table, which is the authoritative record.
The dead letter is sent after the ledger commit, so a crash in between can miss it (at most once).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as kafka_errors
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.structs import OffsetAndMetadata

from runledger.ingest.ingester import Ingester, IngestStats
from runledger.ingest.kafka_config import (
    COMMIT_BATCH_MAX,
    BrokerUnavailableError,
    TopicUnavailableError,
    admin_client_for,
    answer_within,
    client_kwargs,
    deadletter_topic,
    describe,
    events_topic,
)
from runledger.ledger.store import CommitResult, Ledger, SourceRecord
from runledger.schemas.codec import MAX_EVENT_BYTES, Quarantined

log = logging.getLogger(__name__)


def source_name(topic: str, partition: int) -> str:
    """The ledger's name for a Kafka partition."""
    return f"kafka:{topic}:{partition}"


DEADLETTER_FORMAT = "runledger.deadletter/1"
DEADLETTER_PREFIX_BYTES = 64 * 1024  # of the raw record, in the dead letter (base64: ~87 KiB)
_MAX_KEY_BYTES = 1024  # a longer original key is replaced by its length and hash


def reason_code(q: Quarantined) -> str:
    """A short, stable code for the dead-letter ``reason`` header (the full text goes in ``error``):
    ``empty``, ``tombstone``, ``too-large``, ``too-deep``, ``decode``, ``envelope``, ``unknown-type``,
    ``unknown-version``, ``schema``, ``corrupt`` or ``unstorable``."""
    if q.code:
        return q.code
    if q.reason.startswith("bus:"):
        return "corrupt"
    if q.reason.startswith("envelope:"):
        return "envelope"
    if q.reason.startswith("unknown event type"):
        return "unknown-type"
    if q.reason.startswith("unknown schema_version"):
        return "unknown-version"
    return "schema"


def deadletter_envelope(
    q: Quarantined,
    raw: bytes,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    consumer: str,
    failed_at: str,
    prefix_bytes: int = DEADLETTER_PREFIX_BYTES,
) -> bytes:
    """The dead letter's value: JSON that says what was rejected and why, bounded whatever the record
    (under 140 KB with the default prefix, escapes included). The whole record is in the quarantine
    table (``ingest_source`` = ``kafka:<topic>:<partition>``, ``ingest_position`` = the offset)."""
    prefix = raw[:prefix_bytes]
    letter: dict[str, object] = {
        "format": DEADLETTER_FORMAT,
        "reason": _bounded(q.reason, 4000),
        "code": reason_code(q),
        "source": {"topic": topic, "partition": partition, "offset": offset},
        "raw": {
            "length": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "prefix_base64": base64.b64encode(prefix).decode(),
            "prefix_length": len(prefix),
            "truncated": len(prefix) < len(raw),
        },
        "event": {
            name: _bounded(value, 1024)
            for name, value in (("source", q.source), ("id", q.id), ("type", q.type), ("stream", q.stream))
            if value is not None
        },
        "ledger": {"ingest_source": source_name(topic, partition), "ingest_position": offset},
        "failed_at": failed_at,
        "consumer": consumer,
    }
    if key is not None:
        letter["key"] = {"length": len(key), "sha256": hashlib.sha256(key).hexdigest()}
    return json.dumps(letter, ensure_ascii=True).encode()


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Seeker(ConsumerRebalanceListener):
    """Re-seeks every newly assigned partition to the ledger's next position."""

    def __init__(self, ingester: _GroupIngester) -> None:
        self.ingester = ingester

    def on_partitions_revoked(self, revoked: Any) -> None:
        # Nothing in hand: every batch is committed to the ledger before the next poll.
        log.info("partitions revoked: %s", sorted(f"{tp.topic}:{tp.partition}" for tp in revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.ingester.seek_from_ledger(list(assigned))
        self.ingester.assigned_at = time.monotonic()
        self.ingester.group_check_due = True  # checked after the callback: no admin call inside it


@dataclass
class _GroupSettings:
    """How the group ingester polls, when it stops, and how it replaces a consumer out of its group."""

    bootstrap: str | None
    topics: list[str]
    config: dict[str, Any]  # ``open_consumer``'s: a replacement consumer is opened the same way
    batch_max: int = COMMIT_BATCH_MAX
    poll_ms: int = 200
    idle_timeout_s: float | None = None
    session_timeout_s: float = 10.0
    group_lost_s: float = 10.0


class _GroupIngester(Ingester):
    """``Ingester``'s loop over a consumer group's poll batches: positions ``kafka:<topic>:<partition>``
    at the record's offset; after each commit, dead letters and a Kafka offset hint."""

    def __init__(
        self,
        ledger: Ledger,
        consumer: KafkaConsumer,
        settings: _GroupSettings,
        *,
        kwargs: dict[str, Any],
        deadletter: str | None,
        name: str,
        stop_event: threading.Event,
        max_event_bytes: int = MAX_EVENT_BYTES,
        on_commit: Callable[[CommitResult], None] | None = None,
        on_warning: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(ledger, writer=name, max_event_bytes=max_event_bytes, on_commit=on_commit)
        self.on_warning = on_warning or log.warning
        self.consumer = consumer
        self.settings = settings
        self.kwargs = kwargs
        self.deadletter = deadletter
        self.name = name
        self.stop_event = stop_event
        self._dlq: KafkaProducer | None = None
        self._gap_retried: dict[TopicPartition, int] = {}
        self._in_hand: dict[tuple[str, int], Any] = {}  # the batch's messages, by (source, position)
        self._offsets: dict[TopicPartition, OffsetAndMetadata] = {}  # the batch's offset hints
        self.assigned_at = 0.0  # monotonic time of the latest assignment (the idle clock restarts)
        self.last_data = time.monotonic()
        self.lost_since: float | None = None  # since when the consumer has been out of its group
        self.group_check_due = False  # a new assignment: compare the group's members with partitions
        self._warned: set[str] = set()  # each idle-members warning is said once

    def subscribe(self) -> None:
        self.consumer.subscribe(self.settings.topics, listener=_Seeker(self))

    def positions(self) -> dict[str, int]:
        # A fresh read-only handle: on the instance that commits, positions() also folds other
        # writers' event ids in, which fails while one of them is between its commit point and its
        # renames (see the note in docs/kafka_bus.md); reading the newest commit record is enough here.
        # On DuckLake: the lake's positions, committed by whichever host (a partition that moved here
        # from a failed ingester resumes where that one's last commit left it).
        if self.ledger.lake is not None:
            return self.ledger.lake.positions()
        return Ledger.open(self.ledger.root).positions()

    def seek_from_ledger(self, partitions: Sequence[TopicPartition]) -> None:
        positions = self.positions()
        for tp in partitions:
            pos = positions.get(source_name(tp.topic, tp.partition))
            if pos is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, pos)
        self.stats.assignments.append(sorted(f"{tp.topic}:{tp.partition}" for tp in partitions))
        log.info("assigned %s; seeking to ledger positions", self.stats.assignments[-1])

    def read_batch(self) -> list[SourceRecord] | None:
        """One poll: its records, [] when it brought none (or only a gap, re-read), None when a
        stop was asked for or the assigned partitions were idle for ``idle_timeout_s``."""
        if self.stop_event.is_set():
            return None
        polled = self.consumer.poll(timeout_ms=self.settings.poll_ms, max_records=self.settings.batch_max)
        self.stats.polls += 1
        if self.group_check_due:
            self._check_group_size()
        if not polled:
            if self._idle():
                return None
            self._watch_group()
            return []
        self.last_data = time.monotonic()
        self.lost_since = None
        return self._records(polled)

    def _check_group_size(self) -> None:
        """After an assignment: a group with more members than its topics have partitions leaves some
        members idle (Kafka gives a partition to one member only); say so once, with the fix. Only
        advice: a broker that does not answer in time is logged, never stops the ingester."""
        self.group_check_due = False
        group = str(self.settings.config["group_id"])
        try:
            members = answer_within(
                2 * self.settings.session_timeout_s,
                lambda: _group_members(self.kwargs, group, self.settings.session_timeout_s),
            )
        except (KafkaError, BrokerUnavailableError, TimeoutError) as exc:
            log.info("group size not checked: %s", exc)
            return
        counts = {
            topic: len(self.consumer.partitions_for_topic(topic) or ()) for topic in self.settings.topics
        }
        warning = idle_members_warning(group, members, counts)
        if warning is not None and warning not in self._warned:
            self._warned.add(warning)
            self.on_warning(warning)

    def _idle(self) -> bool:
        """Idle means: partitions in hand and nothing on them. Time spent joining the group, or since
        a rebalance handed over new partitions, does not count."""
        if not self.consumer.assignment():
            self.last_data = time.monotonic()
        if self.settings.idle_timeout_s is None:
            return False
        quiet_since = max(self.last_data, self.assigned_at)
        return time.monotonic() - quiet_since >= self.settings.idle_timeout_s

    def _watch_group(self) -> None:
        """kafka-python 3.0 can drop out of its group for good (no coordinator found again, or
        heartbeats stopped after a quick second rebalance; cf. dpkp/kafka-python#2373, #1310): the
        loop would spin on empty polls. A new consumer rejoins, as a restart would."""
        settings = self.settings
        if not _out_of_group(self.consumer, settings.session_timeout_s):
            self.lost_since = None
            return
        if self.lost_since is None:
            self.lost_since = time.monotonic()
            return
        if time.monotonic() - self.lost_since < settings.group_lost_s:
            return
        log.warning("out of the consumer group for %.0f s: replacing the consumer", settings.group_lost_s)
        try:
            fresh, _ = open_consumer(settings.bootstrap, **settings.config)
        except BrokerUnavailableError as exc:
            log.warning("%s; the old consumer stays, tried again in %.0f s", exc, settings.group_lost_s)
            self.lost_since = time.monotonic()
            return
        self.close_consumer()
        self.consumer = fresh
        self.subscribe()
        self.stats.consumer_restarts += 1
        self.lost_since = None

    def _records(self, polled: dict[TopicPartition, list[Any]]) -> list[SourceRecord]:
        """A poll batch's records at their offsets; kept in hand for the dead letters and the hints."""
        positions = self.positions()
        records: list[SourceRecord] = []
        self._in_hand, self._offsets = {}, {}
        for tp, msgs in polled.items():
            if not msgs:
                continue
            source = source_name(tp.topic, tp.partition)
            expected = positions.get(source)
            if expected is not None and msgs[0].offset > expected and self._gap_retried.get(tp) != expected:
                # The ledger would accept this and record the hole as covered: never commit across a
                # gap we did not see Kafka confirm. Re-read from the ledger's position once; if Kafka
                # still starts later (retention, transaction markers), the offsets truly don't exist.
                log.warning(
                    "%s: got offset %d, ledger expects %d; re-seeking", source, msgs[0].offset, expected
                )
                self._gap_retried[tp] = expected
                self.consumer.seek(tp, expected)
                continue
            for m in msgs:
                if m.value is None:  # a tombstone: its own reason, not "empty"
                    records.append(SourceRecord(source, m.offset, b"", tombstone=True))
                else:
                    records.append(SourceRecord(source, m.offset, m.value))
                self._in_hand[(source, m.offset)] = m
            self._offsets[tp] = OffsetAndMetadata(msgs[-1].offset + 1, "", -1)
        return records

    def committed(self, batch: Sequence[SourceRecord], result: CommitResult) -> None:
        """Dead letters for what the ledger quarantined, then the Kafka offset hint."""
        if result.quarantined and self.deadletter:
            self._dead_letter(result)
        with contextlib.suppress(KafkaError):  # only a hint; a rebalance may refuse it
            self.consumer.commit_async(self._offsets, callback=_ignore_commit_result)

    def _dead_letter(self, result: CommitResult) -> None:
        """Announce each quarantined record on the dead-letter topic. Never raises: the ledger's
        quarantine table already holds them, so a failed copy is logged and the ingester goes on."""
        assert self.deadletter is not None
        try:
            if self._dlq is None:
                self._dlq = KafkaProducer(
                    **self.kwargs,
                    acks="all",
                    enable_idempotence=False,
                    max_in_flight_requests_per_connection=1,
                    linger_ms=5,
                    # A burst of garbage is a burst of letters: big gzip batches send ~3x more per
                    # second than 16 KiB plain ones (kafka-python checksums every byte in Python).
                    batch_size=256 * 1024,
                    compression_type="gzip",
                    client_id=f"{self.name}-deadletter",
                )
            now = datetime.now(UTC).isoformat()
            sent = []
            for record, q in result.quarantined:
                msg = self._in_hand.get((record.source, record.position))
                value, key, headers = _letter(q, record, msg, consumer=self.name, failed_at=now)
                sent.append(self._dlq.send(self.deadletter, value=value, key=key, headers=headers))
            self._dlq.flush(timeout=30)
            delivered = sum(1 for future in sent if future.succeeded())
            self.stats.deadlettered += delivered
            if delivered < len(sent):
                failed = next(f.exception for f in sent if not f.succeeded())
                log.error(
                    "%d of %d dead letters not delivered (%s); the ledger's quarantine table holds them",
                    len(sent) - delivered,
                    len(sent),
                    failed,
                )
        except Exception as exc:
            log.error("dead-letter send failed (%s); the ledger's quarantine table still holds them", exc)

    def close_consumer(self) -> None:
        with contextlib.suppress(Exception):
            self.consumer.close(autocommit=False)  # leaves the group: partitions move at once

    def close(self) -> None:
        self.close_consumer()
        if self._dlq is not None:
            with contextlib.suppress(Exception):
                self._dlq.close(timeout=10)


def _letter(
    q: Quarantined, record: SourceRecord, msg: Any, *, consumer: str, failed_at: str
) -> tuple[bytes, bytes | None, list[tuple[str, bytes]]]:
    """A quarantined record's dead letter: its value, key and headers (``msg``: its Kafka message)."""
    topic = msg.topic if msg else record.source
    partition = msg.partition if msg else -1
    key = msg.key if msg else None
    value = deadletter_envelope(
        q,
        record.raw,
        topic=topic,
        partition=partition,
        offset=record.position,
        key=key,
        consumer=consumer,
        failed_at=failed_at,
    )
    headers = [
        ("reason", reason_code(q).encode()),
        ("error", q.reason.encode("utf-8", "replace")[:4000]),
        ("source.topic", topic.encode()),
        ("source.partition", str(partition).encode()),
        ("source.offset", str(record.position).encode()),
        ("failed.at", failed_at.encode()),
        ("consumer", consumer.encode()),
        ("content-type", b"application/json"),
    ]
    if q.stream:
        headers.append(("stream", q.stream.encode("utf-8", "replace")[:1024]))
    if key is not None and len(key) > _MAX_KEY_BYTES:
        key = None  # its length and hash are in the envelope
    return value, key, headers


def _group_members(kwargs: dict[str, Any], group: str, timeout_s: float) -> int:
    """How many members consumer group ``group`` has now (one DescribeGroups; its coordinator is
    known, since this consumer was just assigned through it)."""
    with admin_client_for(kwargs, timeout_s, "group-check") as admin:
        described = admin.describe_groups([group]).get(group) or {}
    return len(described.get("members") or [])


def idle_members_warning(group: str, members: int, topic_partitions: dict[str, int]) -> str | None:
    """The line an ingester says when its group has more members than its topics have partitions
    (the extra members get none and sit idle), or None. Kafka adds partitions to a topic only when
    asked (``ledger kafka topic add-partitions``), never by itself."""
    partitions = sum(topic_partitions.values())
    if members <= partitions:
        return None
    names = sorted(topic_partitions)
    topics = f"topic {names[0]} has" if len(names) == 1 else f"topics {', '.join(names)} have"
    idle = members - partitions
    return (
        f"consumer group {group} has {members} members but {topics} {partitions} "
        f"partition{'s' if partitions != 1 else ''}: {idle} {'sits' if idle == 1 else 'sit'} idle; "
        f"`ledger kafka topic add-partitions {names[0]} --partitions {members}` "
        f"(or kafka-topics --alter --partitions {members}) gives each one"
    )


def _ignore_commit_result(offsets: Any, response: Any) -> None:
    if isinstance(response, Exception):
        log.debug("offset hint not committed: %s", response)


def _out_of_group(consumer: KafkaConsumer, session_timeout_s: float) -> bool:
    """Whether the consumer has lost its group: it does not know the group coordinator, or no
    heartbeat has been answered for two session timeouts (the broker has dropped it by then).
    kafka-python's own bookkeeping, which no public API gives; a member that merely holds no
    partitions still heartbeats, so it is never "out"."""
    coordinator = getattr(consumer, "_coordinator", None)
    try:
        if coordinator is None:
            return False
        if coordinator.coordinator_unknown():
            return True
        heartbeat = coordinator.heartbeat
        answered = max(heartbeat.last_receive, heartbeat.last_reset)
        return bool(time.monotonic() - answered > 2 * session_timeout_s)
    except Exception:
        return False


def open_consumer(
    bootstrap: str | None, *, connect_timeout_s: float = 15.0, **config: Any
) -> tuple[KafkaConsumer, dict[str, Any]]:
    """A KafkaConsumer, or ``BrokerUnavailableError`` after ``connect_timeout_s``."""
    kwargs = client_kwargs(bootstrap)
    try:
        consumer = KafkaConsumer(
            **kwargs,
            bootstrap_timeout_ms=int(connect_timeout_s * 1000),
            allow_auto_create_topics=False,  # a reader must not create topics (with default partitions)
            **config,
        )
    except KafkaTimeoutError:
        raise BrokerUnavailableError(
            f"no Kafka broker answered at {describe(kwargs)} within {connect_timeout_s:g} s"
        ) from None
    return consumer, kwargs


# Topic-level metadata errors that mean "cannot be read", whatever a wait would bring.
_UNKNOWN_TOPIC = kafka_errors.UnknownTopicOrPartitionError.errno
_TOPIC_DENIED = kafka_errors.TopicAuthorizationFailedError.errno


def topic_problem(described: dict[str, Any]) -> str | None:
    """Why a topic (one entry of ``KafkaAdminClient.describe_topics``) cannot be read, or None.

    A retriable error (no leader elected yet, say) is not a problem: the consumer waits for it."""
    code = int(described.get("error_code", 0))
    if code == _UNKNOWN_TOPIC:
        return "does not exist"
    if code == _TOPIC_DENIED:
        return "may not be described (not authorised)"
    error = kafka_errors.for_code(code)
    if code and not error.retriable:
        return f"cannot be read ({error.__name__})"
    if not code and not described.get("partitions"):
        return "has no partitions"
    operations = described.get("authorized_operations") or []
    if operations and not {"READ", "ALL"} & set(operations):  # empty: the broker did not say
        return "may not be read (not authorised)"
    return None


def _topic_problems(admin: KafkaAdminClient, topics: Sequence[str]) -> dict[str, str]:
    """Each unreadable topic of ``topics`` with its problem (a metadata request, no auto-creation)."""
    problems: dict[str, str] = {}
    for described in admin.describe_topics(list(topics)):
        problem = topic_problem(described)
        if problem is not None:
            problems[str(described.get("name"))] = problem
    return problems


def check_topics(
    bootstrap: str | None,
    topics: Sequence[str],
    *,
    wait_s: float = 0.0,
    connect_timeout_s: float = 15.0,
    interval_s: float = 0.5,
) -> None:
    """Return once every topic exists, has partitions and may be read; else, after ``wait_s``,
    ``TopicUnavailableError`` naming the topic, its problem and the broker."""
    # Ask until the topics are readable or the bounded wait is over (one ask when not waiting).
    kwargs = client_kwargs(bootstrap)
    deadline = time.monotonic() + max(0.0, wait_s)
    with admin_client_for(kwargs, connect_timeout_s, "topic-check") as admin:
        while True:
            try:
                problems = answer_within(2 * connect_timeout_s, lambda: _topic_problems(admin, topics))
            except TimeoutError:
                raise BrokerUnavailableError(
                    f"Kafka at {describe(kwargs)} did not describe {', '.join(topics)} "
                    f"within {2 * connect_timeout_s:g} s"
                ) from None
            if not problems or time.monotonic() >= deadline:
                break
            time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
    if problems:
        waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
        said = "; ".join(f"topic {topic} {problem}" for topic, problem in sorted(problems.items()))
        raise TopicUnavailableError(f"{said} on {describe(kwargs)}{waited}")


def run_ingester(
    ledger_path: str | Path,
    bootstrap: str | None,
    group: str,
    topics: Sequence[str] | None = None,
    *,
    batch_max: int = COMMIT_BATCH_MAX,
    poll_ms: int = 200,
    stop_event: threading.Event | None = None,
    idle_timeout_s: float | None = None,
    create: bool = True,
    deadletter: str | None = "",
    session_timeout_ms: int = 10000,
    instance_id: str | None = None,
    connect_timeout_s: float = 15.0,
    on_commit: Callable[[CommitResult], None] | None = None,
    max_event_bytes: int = MAX_EVENT_BYTES,
    group_lost_s: float = 10.0,
    wait_for_topic_s: float = 0.0,
    on_warning: Callable[[str], None] | None = None,
) -> IngestStats:
    """Consume ``topics`` in consumer group ``group`` into the ledger until ``stop_event`` is set
    (or nothing arrived for ``idle_timeout_s`` while partitions were assigned: joining the group and
    each new assignment restart that clock). The batch in hand is always committed before return.

    ``deadletter``: "" means the default topic (``runledger.deadletter``), None disables it.
    ``instance_id``: static group membership: a restarted ingester with the same id takes its
    partitions back at once instead of after a rebalance (but a stopped one's partitions wait for
    ``session_timeout_ms`` before moving to the others).
    ``max_event_bytes``: longer records are quarantined (``too-large``) without being parsed.
    ``group_lost_s``: a consumer out of its group this long (no coordinator known, or no heartbeat
    answered) is closed and replaced by a new one (``stats.consumer_restarts``).
    ``wait_for_topic_s``: how long a missing or unreadable topic may take to appear before
    ``TopicUnavailableError`` (0: it must be there now); a subscription to a missing topic would
    otherwise wait forever and ingest nothing.
    ``on_warning``: told (once each) when the group has more members than the topics have
    partitions, so some members sit idle (default: logged).
    """
    topics = list(topics or [events_topic()])
    check_topics(bootstrap, topics, wait_s=wait_for_topic_s, connect_timeout_s=connect_timeout_s)
    ledger = Ledger.create(ledger_path) if create else Ledger.open(ledger_path)
    name = f"kafka-ingest:{group}:{socket.gethostname()}:{os.getpid()}"
    config: dict[str, Any] = dict(
        connect_timeout_s=connect_timeout_s,
        group_id=group,
        group_instance_id=instance_id,
        client_id=name,
        enable_auto_commit=False,  # positions live in the ledger; Kafka offsets are only a hint
        auto_offset_reset="earliest",
        max_poll_records=batch_max,
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=max(500, session_timeout_ms // 4),
        max_partition_fetch_bytes=4 << 20,
    )
    consumer, kwargs = open_consumer(bootstrap, **config)
    settings = _GroupSettings(
        bootstrap,
        topics,
        config,
        batch_max=batch_max,
        poll_ms=poll_ms,
        idle_timeout_s=idle_timeout_s,
        session_timeout_s=session_timeout_ms / 1000,
        group_lost_s=group_lost_s,
    )
    ingester = _GroupIngester(
        ledger,
        consumer,
        settings,
        kwargs=kwargs,
        deadletter=deadletter_topic() if deadletter == "" else deadletter,
        name=name,
        stop_event=stop_event or threading.Event(),
        max_event_bytes=max_event_bytes,
        on_commit=on_commit,
        on_warning=on_warning,
    )
    ingester.subscribe()
    try:
        return ingester.run()
    finally:
        ingester.close()
        ledger.close()
