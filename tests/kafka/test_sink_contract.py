"""One contract, every event sink: the same tests run against ``SpoolSink`` (the embedded spool) and
``KafkaSink`` (a real broker), the way eventsourcing runs one abstract test case against every
backend. A producer holds an ``EventSink`` and must not care which one it has.

The contract:
  * events from several sources, then ``sync()``: every one arrives exactly once, byte for byte as
    ``encode_event`` made it, each source's events in emit order;
  * after ``sync()`` they are durable: readable while the sink is still open, and still there when
    the process dies right after ``sync()`` without closing anything;
  * ``close()`` is idempotent, and frees the storage for the next sink, which appends after it;
  * after ``close()``, ``sync()`` raises ``ValueError`` (both flush the closed spool file: not a
    dedicated error, pinned as it is) and ``emit()`` raises too (``ValueError`` from the spool,
    ``RuntimeError`` from ``KafkaSink``) instead of dropping the event.

Reading back: ``SpoolReader`` for the spool; for Kafka, every record of the test's topic (3
partitions, keyed by stream) in (partition, offset) order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.bus import SpoolSink
from runledger.ingest.kafka_sink import KafkaSink
from runledger.ingest.spool import SpoolReader
from runledger.schemas import Envelope, encode_event
from tests.support.kafka_clients import REPO, consume_topic, workload


class Backend:
    """One sink implementation and its storage: open a sink, read back what is durable."""

    name: str

    def open(self) -> SpoolSink | KafkaSink:
        raise NotImplementedError

    def open_expr(self) -> str:
        """A Python expression that opens the same sink in a child process."""
        raise NotImplementedError

    def read_back(self) -> list[bytes]:
        raise NotImplementedError


class SpoolBackend(Backend):
    name = "spool"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def open(self) -> SpoolSink:
        return SpoolSink(self.directory)

    def open_expr(self) -> str:
        return f"SpoolSink({str(self.directory)!r})"

    def read_back(self) -> list[bytes]:
        records = list(SpoolReader(self.directory).read())
        assert all(r.corrupt is None for r in records), [r.corrupt for r in records if r.corrupt]
        return [r.payload for r in records]


class KafkaBackend(Backend):
    name = "kafka"

    def __init__(self, bootstrap: str, topic: str, outage_spool: Path) -> None:
        self.bootstrap, self.topic, self.outage_spool = bootstrap, topic, outage_spool

    def open(self) -> KafkaSink:
        sink = KafkaSink(self.bootstrap, self.outage_spool, topic=self.topic)
        assert sink.direct, f"healthy broker, yet the sink starts spooling: {sink.last_error}"
        return sink

    def open_expr(self) -> str:
        return f"KafkaSink({self.bootstrap!r}, {str(self.outage_spool)!r}, topic={self.topic!r})"

    def read_back(self) -> list[bytes]:
        records = consume_topic(self.bootstrap, self.topic, timeout_s=30)
        return [r.value for r in sorted(records, key=lambda r: (r.partition, r.offset))]


@pytest.fixture(params=["spool", "kafka"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "spool":
        return SpoolBackend(tmp_path / "spool")
    # Looked up only here, so `-k spool` needs no broker.
    broker = request.getfixturevalue("kafka_broker")
    topic = request.getfixturevalue("make_topic")(partitions=3)
    return KafkaBackend(broker.bootstrap, topic, tmp_path / "outage-spool")


def by_source(raws: Sequence[bytes]) -> dict[str, list[bytes]]:
    """Each source's events, in the order given."""
    out: dict[str, list[bytes]] = defaultdict(list)
    for raw in raws:
        out[json.loads(raw)["source"]].append(raw)
    return dict(out)


def assert_arrived(got: Sequence[bytes], sent: Sequence[bytes]) -> None:
    """Exactly once, identical bytes, per-source emit order (the order across sources is free)."""
    assert len(got) == len(sent), f"{len(got)} events read back, {len(sent)} emitted"
    assert sorted(got) == sorted(sent), "the bytes read back differ from the bytes emitted"
    got_by, sent_by = by_source(got), by_source(sent)
    assert got_by.keys() == sent_by.keys()
    for source, events in sent_by.items():
        assert got_by[source] == events, f"{source}: events out of emit order"


def events(prefix: str, sources: int = 4, steps: int = 30) -> list[Envelope]:
    """Several sources (one stream each), interleaved: start, ``steps`` metrics, finish per source."""
    return workload(sources, steps, prefix=prefix)


CRASH_AFTER_SYNC = """
import json, os, sys
from runledger.ingest.bus import SpoolSink
from runledger.ingest.kafka_sink import KafkaSink
from schemas import encode_event
from tests.support.kafka_clients import workload
sink = {open_expr}
events = workload(3, 20, prefix="crash")
for env in events:
    sink.emit(env)
sink.sync()
sent = [encode_event(env).decode() for env in events]
# A KafkaSink whose flush failed moves the events to its outage spool (durable, but not on the topic).
sys.stdout.write(json.dumps({{"sent": sent, "direct": getattr(sink, "direct", True)}}))
sys.stdout.flush()
os._exit(0)  # die without close(): sync() alone must have made them durable
"""


class TestSinkContract:
    def test_every_event_arrives_once_in_source_order_with_identical_bytes(self, backend: Backend) -> None:
        sent = events("contract")
        assert len(by_source([encode_event(e) for e in sent])) == 4
        sink = backend.open()
        try:
            for env in sent:
                sink.emit(env)
            sink.sync()
            assert_arrived(backend.read_back(), [encode_event(e) for e in sent])
        finally:
            sink.close()
        assert_arrived(backend.read_back(), [encode_event(e) for e in sent])  # close adds nothing

    def test_emit_raw_bytes_arrive_unchanged(self, backend: Backend) -> None:
        # Bytes made elsewhere (a backfill, a spool being re-sent) go through untouched: a different
        # key order and spacing from what encode_event writes, so any re-encoding would show.
        raws = [
            json.dumps(json.loads(encode_event(env)), sort_keys=True, indent=1).encode()
            for env in events("raw", sources=2, steps=5)
        ]
        sink = backend.open()
        try:
            for raw in raws:
                sink.emit_raw(raw)  # both sinks have it (not part of the EventSink protocol)
            sink.sync()
        finally:
            sink.close()
        assert_arrived(backend.read_back(), raws)

    def test_synced_events_survive_a_crash_without_close(self, backend: Backend) -> None:
        script = CRASH_AFTER_SYNC.format(open_expr=backend.open_expr())
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout)
        assert result["direct"], "the child's sink fell back to its outage spool during sync()"
        sent = [s.encode() for s in result["sent"]]
        assert len(sent) == 3 * 22
        assert_arrived(backend.read_back(), sent)

    def test_close_is_idempotent_and_frees_the_storage_for_the_next_sink(self, backend: Backend) -> None:
        first = [encode_event(e) for e in events("first", sources=2, steps=5)]
        second = [encode_event(e) for e in events("second", sources=2, steps=5)]
        sink = backend.open()
        sink.sync()  # nothing emitted yet: harmless
        for raw in first:
            sink.emit_raw(raw)
        sink.close()
        sink.close()
        sink.close()
        assert_arrived(backend.read_back(), first)

        again = backend.open()  # the spool's writer lock was released
        try:
            for raw in second:
                again.emit_raw(raw)
            again.sync()
        finally:
            again.close()
        got = backend.read_back()
        assert_arrived(got, first + second)
        if backend.name == "spool":  # one total order: the next sink appends after the first
            assert got == first + second

    def test_after_close_sync_and_emit_raise_and_nothing_more_arrives(self, backend: Backend) -> None:
        sent = events("closed", sources=2, steps=3)
        sink = backend.open()
        for env in sent[:-1]:
            sink.emit(env)
        sink.close()
        # Both sinks end up flushing their closed spool file: Python's "flush of closed file".
        with pytest.raises(ValueError, match="closed file"):
            sink.sync()
        errors: tuple[type[Exception], ...] = (
            ValueError,
            RuntimeError,
        )  # spool: closed file; Kafka: closed sink
        with pytest.raises(errors, match="closed"):
            sink.emit(sent[-1])
        sink.close()  # still harmless after the failed calls
        assert_arrived(backend.read_back(), [encode_event(e) for e in sent[:-1]])


def test_backends_are_the_ones_named(backend: Backend) -> None:
    """Guard against the parametrisation silently testing one backend twice."""
    sink: Any = backend.open()
    try:
        expected = {"spool": "SpoolSink", "kafka": "KafkaSink"}[backend.name]
        assert type(sink).__name__ == expected
    finally:
        sink.close()
