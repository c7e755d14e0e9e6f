"""``KafkaSink`` with a producer key, through a real broker: what lands on the topic is signed and
chained per source, and a ledger that registered the key admits it while a record written to the
topic by someone else, under a real event's id, is quarantined."""

from __future__ import annotations

from pathlib import Path

from runledger.ingest.kafka_sink import KafkaSink
from runledger.ledger.registry import register_producer
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import Event, decode_event, encode_event, make_event
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import ProducerScope, StepMetrics
from runledger.schemas.signing import GENESIS, Sealer, event_hash
from tests.support.kafka_clients import consume_topic


def test_kafka_sink_signs_and_chains_and_the_ledger_admits_only_the_real_producer(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=1)
    private, public = write_keypair(tmp_path / "keys", "trainer")
    sink = KafkaSink(
        kafka_broker.bootstrap, tmp_path / "spool", topic=topic, sealer=Sealer(private.read_text())
    )
    sources = ["trainer/r/a1/rank0", "trainer/r/a1/rank1"]
    try:
        for seq in range(5):
            for source in sources:
                envelope = make_event(
                    StepMetrics(loss=1.0 + seq), source=source, stream="r", run_id="r", step=seq, seq=seq
                )
                sink.emit(envelope)
        # Someone else writes to the topic under a real event's id, with their own key.
        mallory, _ = write_keypair(tmp_path / "mallory", "trainer")
        forged = Sealer(mallory.read_text()).seal(
            make_event(StepMetrics(loss=0.0), source=sources[0], stream="r", run_id="r", step=9, seq=5)
        )
        sink.emit_raw(encode_event(forged))
        sink.sync()
    finally:
        sink.close()

    records = consume_topic(kafka_broker.bootstrap, topic)
    decoded = [decode_event(r.value) for r in records]
    assert all(isinstance(e, Event) for e in decoded)
    # Each source's events link to its previous one: prev = that event's leaf hash.
    last = dict.fromkeys(sources, GENESIS)
    for event in decoded[:10]:
        assert isinstance(event, Event)
        assert event.envelope.prev == last[event.envelope.source]
        last[event.envelope.source] = event_hash(event.canonical)

    ledger = Ledger.create(tmp_path / "ledger")
    register_producer(ledger, "trainer", public.read_text(), ProducerScope(sources=["trainer/"]))
    result = ledger.commit([SourceRecord(f"kafka:{topic}:0", r.offset, r.value) for r in records])
    assert result.accepted == 10
    assert [(q.id, q.code) for _, q in result.quarantined] == [(forged.id, "unknown-key")]
    incidents = ledger.positions().get("ledger:incidents", 0)
    assert incidents == 0  # both chains whole
