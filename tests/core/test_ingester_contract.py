"""One contract, every ingester: the same tests run against the spool ingester (``ingest_spool``),
the Kafka consumer-group ingester (``run_ingester``) and the Kafka replay (``replay``), the way
eventsourcing runs one abstract test case against every backend (and ``tests/kafka/
test_sink_contract.py`` runs one against every event sink). All three run ``runledger.ingest.ingester``'s loop:
read a batch, commit it with its source positions in the same ledger commit, count, repeat.

The contract, on a small source (two runs' events, an exact copy of one of them, and hostile records
in the middle, in batches of ``BATCH`` records so that it takes several commits):
  * every event lands exactly once, every hostile record is quarantined once, at the source
    position it was read from (``spool:<id>`` at its index, ``kafka:<topic>:<partition>`` at its
    offset), and the records after them land too: nothing a record holds stops the ingester;
  * the stats agree with what the ledger holds (events, quarantine rows, metric rows, commits), and
    every record read is counted once as accepted, duplicate, skipped or quarantined;
  * a second run over the same source reads nothing and adds nothing: where to read comes from the
    ledger (the Kafka group ingester runs under a new group each time, with no Kafka offsets);
  * a crash between read and commit (the ledger's commit raises once, before it commits the batch
    or after) loses nothing and duplicates nothing: the restart reads exactly what had not been
    committed, and the ledger ends as if nothing had happened.

The spool ingester always runs; the two Kafka ones need the real broker (marked ``kafka``; one
broker for this module, started by ``tests.support.kafka.broker_fixture``, or the external one that
``RUNLEDGER_TEST_KAFKA_BOOTSTRAP`` names). ``-m "not kafka"`` runs the spool part alone.
"""

from __future__ import annotations

import contextlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.ingester import IngestStats
from runledger.ingest.spool import SpoolReader, SpoolWriter
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.query import Reader
from runledger.ledger.store import CommitResult, Ledger
from runledger.schemas import encode_event
from tests.support.kafka import broker_fixture, unique_topic_name
from tests.support.kafka_clients import workload

BATCH = 4  # records per read: the source below takes several commits

# What no ingester may stop on; each is quarantined with its own reason.
HOSTILE = [
    b"not json {",
    b"",
    b"\xff\xfe\x00 binary \x80",
    b"[" * 50_000,  # nested far too deep
    b'{"source": "x", "id": "y", "type": "runledger.no.such.type"}',
]
GOOD = workload(2, 5, prefix="contract")  # 2 streams x (start, 5 steps, finish): 14 events
Position = tuple[str, int]  # (ingest source, position in it), as the ledger names a record's origin


def source_records() -> list[tuple[str, bytes]]:
    """The source, in order, each record with its stream (the Kafka key; "" for hostile records):
    the events, the hostile records in the middle, and an exact copy of the first event at the end."""
    good = [(env.stream, encode_event(env)) for env in GOOD]
    middle = len(good) // 2
    return [*good[:middle], *(("", raw) for raw in HOSTILE), *good[middle:], good[0]]


class Backend(ABC):
    """One ingester and its source: put records on the source, run the ingester once."""

    name: str

    @abstractmethod
    def publish(self, records: Sequence[tuple[str, bytes]]) -> list[Position]:
        """Put ``records`` on the source, in order; where each one is, as the ledger names it."""

    @abstractmethod
    def ingest(self, ledger: Path) -> IngestStats:
        """One run of the ingester from the source into the ledger at ``ledger`` (made if need be)."""


class SpoolBackend(Backend):
    name = "spool"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def publish(self, records: Sequence[tuple[str, bytes]]) -> list[Position]:
        with SpoolWriter(self.directory) as writer:
            indexes = [writer.append(raw) for _, raw in records]
        source = f"spool:{SpoolReader(self.directory).id}"
        return [(source, index) for index in indexes]

    def ingest(self, ledger: Path) -> IngestStats:
        return ingest_spool(Ledger.create(ledger), self.directory, batch_size=BATCH)


class KafkaBackend(Backend):
    """A two-partition topic; a stream's records go to one partition (hostile ones to partition 0)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.runs = 0

    def publish(self, records: Sequence[tuple[str, bytes]]) -> list[Position]:
        from kafka import KafkaProducer

        streams = sorted({stream for stream, _ in records if stream})
        producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
        try:
            futures = [
                producer.send(
                    self.topic,
                    value=raw,
                    key=stream.encode() or None,
                    partition=streams.index(stream) % 2 if stream else 0,
                )
                for stream, raw in records
            ]
            producer.flush(30)
            sent = [future.get(timeout=30) for future in futures]
        finally:
            producer.close()
        return [(f"kafka:{self.topic}:{md.partition}", md.offset) for md in sent]


class KafkaGroupBackend(KafkaBackend):
    name = "kafka-group"

    def ingest(self, ledger: Path) -> IngestStats:
        from runledger.ingest.kafka_ingester import run_ingester

        self.runs += 1  # a new group each run: nothing to resume from but the ledger's positions
        return run_ingester(
            ledger,
            self.bootstrap,
            f"contract-{self.topic}-{self.runs}",
            [self.topic],
            batch_max=BATCH,
            idle_timeout_s=2,
            deadletter=None,
        )


class KafkaReplayBackend(KafkaBackend):
    name = "kafka-replay"

    def ingest(self, ledger: Path) -> IngestStats:
        from runledger.ingest.kafka_replay import replay

        return replay(self.bootstrap, ledger, [self.topic], batch_max=BATCH)


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    broker = broker_fixture()
    yield next(broker).bootstrap
    with contextlib.suppress(StopIteration):
        next(broker)


@pytest.fixture
def contract_topic(request: pytest.FixtureRequest) -> Iterator[str]:
    from kafka import KafkaAdminClient

    bootstrap = request.getfixturevalue("kafka_bootstrap")
    name = unique_topic_name("ingester-contract")
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="runledger-tests")
    try:
        admin.create_topics(
            {name: {"num_partitions": 2, "replication_factor": 1, "configs": {}}}, wait_for_metadata=True
        )
        yield name
        with contextlib.suppress(Exception):
            admin.delete_topics([name], raise_errors=False)
    finally:
        admin.close()


@pytest.fixture(
    params=[
        "spool",
        pytest.param("kafka-group", marks=pytest.mark.kafka),
        pytest.param("kafka-replay", marks=pytest.mark.kafka),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "spool":
        return SpoolBackend(tmp_path / "spool")
    # Looked up only here, so the spool backend needs no broker.
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    topic = request.getfixturevalue("contract_topic")
    kind = KafkaGroupBackend if request.param == "kafka-group" else KafkaReplayBackend
    return kind(bootstrap, topic)


def holdings(root: Path) -> dict[str, Any]:
    """What the ledger holds: its events (id and origin), quarantine rows, metric rows, commits."""
    reader = Reader(root)
    return {
        "events": reader.sql("SELECT id, ingest_source, ingest_position FROM events ORDER BY id").rows,
        "quarantine": [
            (source, position, bytes(raw), reason)
            for source, position, raw, reason in reader.sql(
                "SELECT ingest_source, ingest_position, raw, reason FROM quarantine "
                "ORDER BY ingest_source, ingest_position"
            ).rows
        ],
        "metrics": reader.sql("SELECT count(*) FROM metrics").rows[0][0],
        "commits": len(Ledger.open(root).commit_paths()),
    }


def assert_landed_once(root: Path, records: Sequence[tuple[str, bytes]], where: Sequence[Position]) -> None:
    """Every event once, at the position of its first copy; every hostile record quarantined once,
    with its bytes, at its own position; nothing else."""
    first: dict[str, Position] = {}
    for (_, raw), position in zip(records, where, strict=True):
        if raw not in HOSTILE:
            first.setdefault(json.loads(raw)["id"], position)
    held = holdings(root)
    assert [(i, s, p) for i, s, p in held["events"]] == sorted((i, *pos) for i, pos in first.items())
    assert len(held["events"]) == len(GOOD)
    hostile = sorted((*pos, raw) for (_, raw), pos in zip(records, where, strict=True) if raw in HOSTILE)
    assert [(s, p, raw) for s, p, raw, _ in held["quarantine"]] == hostile
    assert all(reason for *_, reason in held["quarantine"]), "a quarantined record without its reason"


def assert_counts_add_up(stats: IngestStats) -> None:
    """Each record read is counted once, as exactly one of the four outcomes."""
    assert stats.accepted - stats.made + stats.duplicates + stats.skipped + stats.quarantined == stats.records
    assert stats.commits <= stats.batches


class CrashingCommit(Exception):
    pass


class TestIngesterContract:
    def test_the_source_lands_exactly_once_and_the_stats_agree_with_the_ledger(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        records = source_records()
        where = backend.publish(records)
        root = tmp_path / "ledger"
        stats = backend.ingest(root)
        assert_landed_once(root, records, where)
        held = holdings(root)
        assert stats.records == len(records)
        assert (stats.accepted, stats.duplicates, stats.skipped) == (len(GOOD), 1, 0)
        assert stats.quarantined == len(held["quarantine"]) == len(HOSTILE)
        assert stats.accepted == len(held["events"])
        assert stats.metric_values == held["metrics"] > 0
        assert stats.commits == held["commits"]  # one ingester made every commit there is
        assert stats.batches >= math.ceil(len(records) / BATCH) > 1
        assert_counts_add_up(stats)

    def test_hostile_records_are_quarantined_and_do_not_stop_the_ingester(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        # Hostile records first and alone (whole batches of them), then the events.
        records = [("", raw) for raw in HOSTILE] + [(env.stream, encode_event(env)) for env in GOOD]
        where = backend.publish(records)
        root = tmp_path / "ledger"
        stats = backend.ingest(root)
        assert (stats.quarantined, stats.accepted, stats.duplicates) == (len(HOSTILE), len(GOOD), 0)
        assert_landed_once(root, records, where)
        reasons = [reason for *_, reason in holdings(root)["quarantine"]]
        assert len(set(reasons)) == len(HOSTILE), f"expected a reason of its own for each: {reasons}"
        assert_counts_add_up(stats)

    def test_a_second_run_over_the_same_source_reads_nothing_and_adds_nothing(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        records = source_records()
        where = backend.publish(records)
        root = tmp_path / "ledger"
        backend.ingest(root)
        before = holdings(root)
        again = backend.ingest(root)
        assert (again.records, again.accepted, again.quarantined, again.duplicates) == (0, 0, 0, 0)
        assert (again.commits, again.metric_values) == (0, 0)
        assert holdings(root) == before
        assert_landed_once(root, records, where)

    @pytest.mark.parametrize("when", ["before", "after"])
    def test_a_crash_between_read_and_commit_loses_nothing_and_duplicates_nothing(
        self, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
    ) -> None:
        """The ledger's commit raises once, at the second batch: ``before`` it commits that batch (the
        batch was read, never committed) or ``after`` (committed, but the ingester never heard)."""
        records = source_records()
        where = backend.publish(records)
        root = tmp_path / "ledger"
        real_commit = Ledger.commit
        calls: list[int] = []
        committed: list[tuple[int, CommitResult]] = []  # (records in the batch, what the ledger did)

        def crashing_commit(self: Ledger, batch: Any, **kwargs: Any) -> CommitResult:
            calls.append(len(batch))
            if len(calls) == 2 and when == "before":
                raise CrashingCommit("between read and commit")
            result = real_commit(self, batch, **kwargs)
            committed.append((len(batch), result))
            if len(calls) == 2:
                raise CrashingCommit("after the commit, before the ingester heard of it")
            return result

        monkeypatch.setattr(Ledger, "commit", crashing_commit)
        with pytest.raises(CrashingCommit):
            backend.ingest(root)
        monkeypatch.setattr(Ledger, "commit", real_commit)
        assert len(committed) == (1 if when == "before" else 2)

        stats = backend.ingest(root)  # the restart
        assert_landed_once(root, records, where)
        # It read again exactly what had not been committed, and nothing that had.
        assert stats.records + sum(n for n, _ in committed) == len(records)
        assert stats.accepted + sum(r.accepted for _, r in committed) == len(GOOD)
        assert stats.quarantined + sum(len(r.quarantined) for _, r in committed) == len(HOSTILE)
        assert stats.duplicates + sum(r.duplicates for _, r in committed) == 1
        assert stats.skipped == 0
        assert_counts_add_up(stats)


def test_backends_are_the_ones_named(backend: Backend) -> None:
    """Guard against the parametrisation silently testing one ingester twice."""
    expected = {"spool": SpoolBackend, "kafka-group": KafkaGroupBackend, "kafka-replay": KafkaReplayBackend}
    assert type(backend) is expected[backend.name]
