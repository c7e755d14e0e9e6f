"""``KafkaSink``: the producer side of the Kafka bus, with a local outage spool.

Events go to ``runledger.events`` keyed by their ``stream`` (one stream, one partition, total order),
value = the structured CloudEvents JSON, plus ``ce_*`` headers (CloudEvents Kafka binding).

Delivery:
  * ``acks=all``; retries on, **idempotence off** and one request in flight per connection, so a
    retried batch never overtakes a later one. A retry may still write a record twice; the ledger
    drops the second copy by (envelope source, id), so duplicates on the topic are harmless.
  * Two modes. *direct*: ``emit`` hands the record to kafka-python's buffer and remembers it until
    the broker acks. *spooling*: ``emit`` appends to the outage spool (``runledger.ingest.spool``) and a
    background thread drains the spool to Kafka in order.
  * direct → spooling when the topic's metadata can't be had within ``max_block_ms``, when a send
    fails, when the oldest unacked record is older than ``stall_timeout_s`` (broker down or slow),
    or when more than ``max_unacked_bytes`` await acks. The switch writes every unacked record to the
    spool, in emit order, before any newer one, and aborts that producer.
  * spooling → direct once the drainer has had everything in the spool acked; the producer that
    drained becomes the direct one, so nothing sent after can overtake what was drained.
  * Order per stream survives: each producer instance delivers an in-order prefix of what it was
    given (one request in flight, retries keep their place, expiry is never reached because a stall
    is detected first) and every later instance starts from the first record not yet acked; so the
    first copy of every record lands in emit order, and the ledger keeps first copies.
  * The drained position (next spool index not yet acked) lives in ``kafka-drained.json`` in the
    spool directory, written after the broker acked. A crash in between re-sends a chunk: duplicates
    the ledger drops. The next ``KafkaSink`` on the same spool drains what is left before anything new.

Undelivered events: whatever ``close()`` could not hand to Kafka in its time stays in the spool, and
``undelivered()`` says how many, where, and the one command that sends them
(``ledger kafka drain-spool --spool … --bootstrap … --topic …``); a process that ends with some
exits ``UNDELIVERED_EXIT_CODE`` (3) after saying so, never 0.

Bounds: ``emit`` never waits on the network except for the topic's metadata on the very first send
(at most ``max_block_ms``, default 50 ms); otherwise it costs a buffer append, or a spool append
(which fsyncs at most every ``fsync_interval_s``), or, once per outage, writing the unacked records
(at most ``max_unacked_bytes``) to the spool. In direct mode a hard kill loses what was unacked:
at most ``stall_timeout_s`` of events (a few ms when the broker is healthy); ``sync()`` closes that
window (flushes the producer, or fsyncs the spool).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import shlex
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from kafka import KafkaProducer
from kafka import codec as kafka_codec
from kafka.errors import KafkaError

from runledger.ingest.kafka_config import client_kwargs, events_topic
from runledger.ingest.spool import SpoolReader, SpoolRecord, SpoolWriter
from runledger.schemas import Envelope, encode_event
from runledger.schemas.durable import write_durably
from runledger.schemas.signing import Sealer

log = logging.getLogger(__name__)

DRAINED_FILE = "kafka-drained.json"
# The exit status of a process that ends with events not on its bus (in the outage spool): not a
# failure of its own work, not success either (as `ledger verify`'s 3 for what it could not check).
UNDELIVERED_EXIT_CODE = 3
CONTENT_TYPE = b"application/cloudevents+json; charset=UTF-8"
# Headroom under max_request_size for the record batch framing, key and headers.
RECORD_OVERHEAD = 4096


def default_compression() -> str:
    """The best codec kafka-python can produce here: zstd/lz4 need their packages, gzip is built in."""
    if kafka_codec.has_zstd():
        return "zstd"
    if kafka_codec.has_lz4():
        return "lz4"
    return "gzip"


def ce_headers(specversion: str, id: str, source: str, type: str) -> list[tuple[str, bytes]]:
    """CloudEvents Kafka protocol binding headers for a structured-mode message."""
    return [
        ("content-type", CONTENT_TYPE),
        ("ce_specversion", specversion.encode()),
        ("ce_id", id.encode()),
        ("ce_source", source.encode()),
        ("ce_type", type.encode()),
    ]


class _Head(msgspec.Struct):
    """The envelope members a spooled record needs for its key and headers."""

    id: str = ""
    source: str = ""
    type: str = ""
    specversion: str = "1.0"
    stream: str = ""


_head_decoder = msgspec.json.Decoder(_Head)


def key_and_headers(raw: bytes) -> tuple[bytes | None, list[tuple[str, bytes]]]:
    """Key and headers recovered from the JSON bytes (records read back from the spool)."""
    try:
        head = _head_decoder.decode(raw)
    except msgspec.DecodeError:
        return None, [("content-type", CONTENT_TYPE)]  # the ledger will quarantine it, with the reason
    return (head.stream.encode() or None), ce_headers(head.specversion, head.id, head.source, head.type)


@dataclass
class _Pending:
    raw: bytes
    future: Any  # kafka-python FutureRecordMetadata
    sent: float  # time.monotonic() of the send
    spool_next: int | None = None  # set on the last record handed over from the spool


@dataclass
class SinkStats:
    emitted: int = 0
    sent_direct: int = 0
    spooled: int = 0  # appended to the outage spool (including unacked records moved there)
    drained: int = 0  # spooled records sent on to Kafka
    outages: int = 0  # direct → spooling switches
    recoveries: int = 0  # spooling → direct switches
    skipped_corrupt: int = 0  # torn spool records (a crash inside the fsync window) not sent
    last_outage_reason: str = ""


@dataclass(frozen=True)
class Undelivered:
    """Events a sink holds in its outage spool, not (yet) on Kafka: how many, where, and the one
    command that delivers them (``drain_command``)."""

    events: int
    spool_dir: Path
    bootstrap: str
    topic: str

    @property
    def drain_command(self) -> str:
        """``ledger kafka drain-spool`` with this spool, broker and topic (the spool as an absolute
        path, so the line works from any directory)."""
        return shlex.join(
            [
                "ledger",
                "kafka",
                "drain-spool",
                "--spool",
                str(self.spool_dir.absolute()),
                "--bootstrap",
                self.bootstrap,
                "--topic",
                self.topic,
            ]
        )

    def line(self) -> str:
        """One line for stderr: the count, where they wait, and how to send them."""
        noun = "event" if self.events == 1 else "events"
        return (
            f"{self.events} {noun} not on Kafka ({self.topic}): they wait in {self.spool_dir}; "
            f"deliver them with: {self.drain_command}"
        )

    def summary(self) -> dict[str, object]:
        """The fields a JSON summary carries: ``undelivered`` (count), ``undelivered_spool`` and
        ``deliver_with`` (null when nothing is left)."""
        left = self.events > 0
        return {
            "undelivered": self.events,
            "undelivered_spool": str(self.spool_dir) if left else None,
            "deliver_with": self.drain_command if left else None,
        }


def abort_producer(producer: KafkaProducer | None, join_s: float = 5.0) -> None:
    """Close without sending anything more: pending batches fail, only a request already on the wire
    may still land (it holds the oldest unacked records, so order is kept)."""
    if producer is None:
        return
    # kafka-python's close(timeout=0) flushes first and raises on anything pending, never reaching
    # its force close; so force the sender thread ourselves, then close.
    sender = getattr(producer, "_sender", None)
    if sender is not None:
        sender.force_close()
        sender.join(join_s)
    with contextlib.suppress(Exception):
        producer.close(timeout=0)


class KafkaSink:
    """An ``EventSink`` that writes to Kafka, falling back to a local spool while Kafka is away."""

    def __init__(
        self,
        bootstrap: str | None = None,
        outage_spool: str | Path = Path(".runledger/spool"),
        *,
        topic: str | None = None,
        linger_ms: int = 10,
        batch_size: int = 256 * 1024,
        compression: str | None = None,
        max_block_ms: int = 50,
        stall_timeout_s: float = 3.0,
        max_unacked_bytes: int = 32 * 1024 * 1024,
        connect_timeout_s: float = 2.0,
        drain_chunk: int = 2000,
        handover_max: int = 256,
        tail_bytes: int = 32 * 1024 * 1024,
        flush_timeout_s: float = 10.0,
        fsync_interval_s: float = 0.2,
        producer_config: dict[str, Any] | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self.topic = topic or events_topic()
        self.sealer = sealer  # signs (and chains) each envelope ``emit`` is given
        self.spool_dir = Path(outage_spool)
        self.stall_timeout_s = stall_timeout_s
        self.max_unacked_bytes = max_unacked_bytes
        self.connect_timeout_s = connect_timeout_s
        self.drain_chunk = drain_chunk
        self.handover_max = handover_max
        self.tail_bytes = tail_bytes
        self.flush_timeout_s = flush_timeout_s
        self.max_block_ms = max_block_ms
        self.stats = SinkStats()
        self.last_error = ""  # why the last connection attempt failed
        self._producer_kwargs: dict[str, Any] = {
            **client_kwargs(bootstrap),
            "acks": "all",
            "enable_idempotence": False,  # duplicates are dropped by the ledger on (source, id)
            "max_in_flight_requests_per_connection": 1,  # a retried batch can't overtake a later one
            "linger_ms": linger_ms,
            "batch_size": batch_size,
            "compression_type": compression or default_compression(),
            "max_block_ms": max_block_ms,
            "bootstrap_timeout_ms": int(connect_timeout_s * 1000),
            "client_id": f"runledger-sink-{os.getpid()}",
            **(producer_config or {}),
        }
        self.max_record_bytes = int(self._producer_kwargs.get("max_request_size", 1048576)) - RECORD_OVERHEAD

        self._lock = threading.Lock()  # mode, unacked records, spool appends, the spool's tail
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self.left_in_spool = 0  # after close(): events still in the spool, for the next start
        self._counted = False  # close() has counted left_in_spool
        self._writer = SpoolWriter(self.spool_dir, fsync_interval_s=fsync_interval_s, segment_bytes=16 << 20)
        self._reader = SpoolReader(self.spool_dir)
        self._drained = self._load_drained()  # next spool index not yet sent on (in memory)
        self._saved = self._drained  # what kafka-drained.json says: only ever acked records before it
        self._ack_to: int | None = None  # a handover's acked end, to be saved by the worker
        self._save_lock = threading.Lock()  # the worker and sync()/close() both save
        # The spool's newest records also in memory, so the drain rarely reads the disk back.
        self._tail: deque[tuple[int, bytes]] = deque()
        self._tail_size = 0
        self._unacked: deque[_Pending] = deque()
        self._unacked_bytes = 0
        self._retired: list[KafkaProducer] = []  # aborted off the caller's thread
        self._producer: KafkaProducer | None = None  # the direct-mode producer
        self._drain_producer: KafkaProducer | None = None
        self._direct = False
        if self._drained >= self._writer.next_index:
            # Nothing left over from an earlier life: try to go direct now, within connect_timeout_s.
            producer = self._connect()
            if producer is not None:
                self._producer, self._direct = producer, True
        if not self._direct:
            log.warning(
                "kafka sink starts spooling to %s (%d undrained events)",
                self.spool_dir,
                self._writer.next_index - self._drained,
            )
        self._worker = threading.Thread(target=self._run, name="runledger-kafka-sink", daemon=True)
        self._worker.start()
        # Close on interpreter exit before kafka-python's own atexit hook closes the producer under us.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            sink = ref()
            if sink is not None:
                sink.close(timeout_s=5.0)

        self._atexit = close_at_exit
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ producer API
    @property
    def direct(self) -> bool:
        """True while events go straight to Kafka; False while they go to the outage spool."""
        return self._direct

    def pending(self) -> int:
        """Events not yet acked by Kafka (in memory or in the spool)."""
        with self._lock:
            return len(self._unacked) + self._writer.next_index - self._drained

    def undelivered(self) -> Undelivered:
        """Events not on Kafka: after ``close()``, those it left in the outage spool (to be sent by
        ``Undelivered.drain_command`` or the next sink on this spool); before, ``pending()``."""
        events = self.left_in_spool if self._counted else self.pending()
        servers = ",".join(self._producer_kwargs["bootstrap_servers"])
        return Undelivered(events, self.spool_dir, servers, self.topic)

    def emit(self, envelope: Envelope) -> None:
        if self.sealer is not None:
            envelope = self.sealer.seal(envelope)
        self.emit_raw(
            encode_event(envelope),
            key=envelope.stream.encode(),
            headers=ce_headers(envelope.specversion, envelope.id, envelope.source, envelope.type),
        )

    def emit_raw(
        self, raw: bytes, *, key: bytes | None = None, headers: list[tuple[str, bytes]] | None = None
    ) -> None:
        """Send already-encoded event bytes (key and headers are derived from them when not given)."""
        if len(raw) > self.max_record_bytes:
            # Such a record could never be delivered, and in the spool it would block every later one.
            raise ValueError(
                f"event of {len(raw)} bytes exceeds the {self.max_record_bytes}-byte record limit"
            )
        with self._lock:
            if self._closed:
                raise RuntimeError("KafkaSink is closed")
            self.stats.emitted += 1
            if self._direct:
                assert self._producer is not None
                if key is None or headers is None:
                    key, headers = key_and_headers(raw)
                try:
                    future = self._producer.send(self.topic, value=raw, key=key, headers=headers)
                except KafkaError as exc:  # metadata timeout and the like: the broker is away
                    self._to_spool_locked(f"send failed: {exc}")
                else:
                    self._unacked.append(_Pending(raw, future, time.monotonic()))
                    self._unacked_bytes += len(raw)
                    self.stats.sent_direct += 1
                    if self._unacked_bytes > self.max_unacked_bytes:
                        self._to_spool_locked(f"more than {self.max_unacked_bytes} bytes unacked")
                    return
            self._spool_locked(raw)
        self._wake.set()

    def sync(self) -> None:
        """Return once every event emitted so far is acked by Kafka or fsynced in the spool."""
        with self._lock:
            producer = self._producer if self._direct else None
            marker = self._unacked[-1] if self._unacked else None
        if producer is not None and marker is not None:
            try:
                producer.flush(timeout=self.flush_timeout_s)
                ok = marker.future.is_done and marker.future.succeeded()
            except KafkaError:
                ok = False
            with self._lock:
                reason = self._trim_locked()
                if (reason or not ok) and self._direct and self._producer is producer:
                    self._to_spool_locked(reason or "flush did not complete in time")
        with self._lock:
            self._writer.sync()
        self._save_acked()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what can be delivered within ``timeout_s``; the rest stays spooled for the next start."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            self.sync()
        # While spooling, give the drainer the remaining time to catch up.
        while time.monotonic() < deadline and (not self._direct or self._unacked):
            if self._direct:
                with contextlib.suppress(Exception):
                    self.sync()
            else:
                self._wake.set()
                time.sleep(0.05)
        with self._lock:
            self._closed = True
            if self._direct and self._unacked:
                self._trim_locked()
                if self._unacked:
                    self._to_spool_locked("closing with unacked events")
        self._stop.set()
        self._wake.set()
        self._worker.join(max(1.0, deadline - time.monotonic()))
        abort_producer(self._drain_producer)
        for producer in self._retired:
            abort_producer(producer)
        if self._producer is not None:
            with contextlib.suppress(Exception):
                self._producer.close(timeout=max(0.5, deadline - time.monotonic()))
        self._save_acked()
        left = self.left_in_spool = self._writer.next_index - self._saved
        self._counted = True
        self._writer.close()
        atexit.unregister(self._atexit)
        if left:
            log.warning("kafka sink closed with %s", self.undelivered().line())

    def __enter__(self) -> KafkaSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ mode switches
    def _spool_locked(self, raw: bytes) -> None:
        index = self._writer.append(raw)
        self.stats.spooled += 1
        self._tail.append((index, raw))
        self._tail_size += len(raw)
        while self._tail_size > self.tail_bytes:  # the disk still has them
            self._tail_size -= len(self._tail.popleft()[1])

    def _to_spool_locked(self, reason: str) -> None:
        """direct → spooling: move every unacked record to the spool, in emit order."""
        if not self._direct:
            return
        self._direct = False
        if self._producer is not None:
            self._retired.append(self._producer)
        self._producer = None
        for pending in self._unacked:
            self._spool_locked(pending.raw)
        self.stats.outages += 1
        self.stats.last_outage_reason = reason
        log.warning(
            "kafka sink: %s; spooling %d unacked events to %s", reason, len(self._unacked), self.spool_dir
        )
        self._unacked.clear()
        self._unacked_bytes = 0
        self._wake.set()

    def _trim_locked(self) -> str | None:
        """Forget acked records at the head; the reason to leave direct mode, if there is one."""
        while self._unacked:
            head = self._unacked[0]
            if not head.future.is_done:
                if time.monotonic() - head.sent > self.stall_timeout_s:
                    return f"no ack for {self.stall_timeout_s:g} s"
                return None
            if head.future.failed():
                return f"send failed: {head.future.exception}"
            self._unacked.popleft()
            self._unacked_bytes -= len(head.raw)
            if head.spool_next is not None:
                self._ack_to = head.spool_next  # a handover is acked: the spool is drained up to here
        return None

    def _handover_locked(self, producer: KafkaProducer, end: int) -> None:
        """spooling → direct: send the last few spooled records with the drain producer and let
        direct mode track their acks; newer events follow them on the same producer."""
        now = time.monotonic()
        last: _Pending | None = None
        for index, raw in self._tail:
            if index < self._drained:
                continue
            key, headers = key_and_headers(raw)
            last = _Pending(raw, producer.send(self.topic, value=raw, key=key, headers=headers), now)
            self._unacked.append(last)
            self._unacked_bytes += len(raw)
            self.stats.drained += 1
        if last is not None:
            last.spool_next = end
        else:
            self._ack_to = end
        self._drained = end
        self._tail.clear()
        self._tail_size = 0
        self._producer, self._drain_producer = producer, None
        self._direct = True
        self.stats.recoveries += 1
        log.warning("kafka sink: broker is back; spool drained, sending directly again")

    # ------------------------------------------------------------------ background thread
    def _run(self) -> None:
        backoff = 0.2
        records: Iterator[SpoolRecord] | None = None
        while not self._stop.is_set():
            try:
                for producer in self._retired[:]:
                    abort_producer(producer)
                    self._retired.remove(producer)
                if self._direct:
                    with self._lock:
                        reason = self._trim_locked() if self._direct else None
                        if reason is not None:
                            self._to_spool_locked(reason)
                    self._save_acked()
                    if self._direct:
                        self._wake.wait(0.02)
                        self._wake.clear()
                    records = None
                    continue
                progressed, records = self._drain_step(records)
            except Exception as exc:  # the broker went away mid-drain, or worse: start over, later
                # Loud once per trouble, quiet while it lasts.
                (log.warning if backoff == 0.2 else log.info)(
                    "kafka sink: cannot deliver to %s (%s); retrying every <= 2 s", self.topic, exc
                )
                abort_producer(self._drain_producer)
                self._drain_producer, records = None, None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)  # short: the broker's return should be noticed soon
                continue
            backoff = 0.2
            if not progressed:
                self._wake.wait(0.05)
                self._wake.clear()

    def _drain_step(self, records: Iterator[SpoolRecord] | None) -> tuple[bool, Iterator[SpoolRecord] | None]:
        """Send the next chunk of the spool and wait for its acks; hand over to direct mode once
        only a few records are left (which the drain producer sends under the lock)."""
        if self._drain_producer is None:
            self._drain_producer = self._connect()
            if self._drain_producer is None:
                raise ConnectionError(self.last_error or "broker unreachable")
        producer = self._drain_producer
        with self._lock:
            end = self._writer.next_index
            in_memory = bool(self._tail) and self._tail[0][0] <= self._drained
            if end - self._drained <= self.handover_max and (in_memory or self._drained >= end):
                self._handover_locked(producer, end)
                return True, None
            chunk: list[tuple[int, bytes]] = []
            if in_memory:
                start = self._drained - self._tail[0][0]
                chunk = list(itertools.islice(self._tail, start, start + self.drain_chunk))
            else:
                self._writer.sync()  # the reader sees only what is flushed
        last = self._drained - 1
        if in_memory:
            records = None
            last = chunk[-1][0]
        else:
            if records is None:
                records = self._reader.read(self._drained)
            budget = 8 << 20
            for rec in records:
                last = rec.index
                if rec.corrupt is not None:
                    self.stats.skipped_corrupt += 1
                    log.warning(
                        "kafka sink: spool record %d is damaged (%s); skipped", rec.index, rec.corrupt
                    )
                elif len(rec.payload) > self.max_record_bytes:
                    self.stats.skipped_corrupt += 1
                    log.error("kafka sink: spool record %d is too large for Kafka; skipped", rec.index)
                else:
                    chunk.append((rec.index, rec.payload))
                    budget -= len(rec.payload)
                if len(chunk) >= self.drain_chunk or budget <= 0 or rec.index + 1 >= end:
                    break
            if last < self._drained:
                return False, None  # the iterator ran dry: read again from the drained position
        futures = []
        for _, raw in chunk:
            key, headers = key_and_headers(raw)
            futures.append(producer.send(self.topic, value=raw, key=key, headers=headers))
        producer.flush(timeout=self.flush_timeout_s)
        for future in futures:
            if not future.is_done or future.failed():
                raise ConnectionError(
                    f"drain send failed: {future.exception if future.is_done else 'timeout'}"
                )
        with self._lock:
            self._drained = last + 1
            while self._tail and self._tail[0][0] < self._drained:
                self._tail_size -= len(self._tail.popleft()[1])
        self.stats.drained += len(futures)
        log.debug("kafka sink: drained %d records up to spool index %d", len(futures), last)
        self._write_drained(self._drained)
        return True, records

    def _connect(self) -> KafkaProducer | None:
        """A producer whose topic metadata is known, or None within ``connect_timeout_s``."""
        deadline = time.monotonic() + self.connect_timeout_s
        try:
            producer = KafkaProducer(**self._producer_kwargs)
        except KafkaError as exc:
            self.last_error = str(exc)
            return None
        while time.monotonic() < deadline:
            try:
                producer.partitions_for(self.topic)  # waits at most max_block_ms per try
                self.last_error = ""
                return producer
            except KafkaError as exc:
                self.last_error = f"no metadata for topic {self.topic}: {exc}"
                time.sleep(0.05)
        abort_producer(producer)
        return None

    # ------------------------------------------------------------------ drained position
    def _drained_path(self) -> Path:
        return self.spool_dir / DRAINED_FILE

    def _load_drained(self) -> int:
        try:
            state = json.loads(self._drained_path().read_bytes())
        except (FileNotFoundError, ValueError):
            return 0
        if state.get("spool_id") != self._writer.id:
            return 0  # a different spool now lives here: all of it is new
        return min(int(state.get("next", 0)), self._writer.next_index)

    def _save_acked(self) -> None:
        """Persist a handover's end once its records are acked."""
        with self._lock:
            ack_to, self._ack_to = self._ack_to, None
        if ack_to is not None:
            self._write_drained(ack_to)

    def _write_drained(self, position: int) -> None:
        """Record that every spool record before ``position`` is acked by Kafka (after the ack)."""
        with self._save_lock:
            if position <= self._saved:
                return
            state = {"spool_id": self._writer.id, "next": position, "topic": self.topic}
            write_durably(self._drained_path(), json.dumps(state))
            self._saved = position
        # Segments whose every record is acked go (never the one being written).
        bases = sorted(int(p.stem) for p in self.spool_dir.glob("*.seg") if p.stem.isdigit())
        for base, following in itertools.pairwise(bases):
            if following <= position:
                (self.spool_dir / f"{base:020d}.seg").unlink(missing_ok=True)
