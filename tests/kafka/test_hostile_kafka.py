"""Trust on real input, through a real broker: the hostile corpus (tests/support/hostile.py) produced
with kafka-python and with Kafka's own Java console producer, a tombstone and a 5 MB garbage record
among valid events; the Kafka ingester and `ledger replay` both finish, every valid event lands
exactly once, every hostile record is quarantined with its own reason, and every dead letter was
delivered as a bounded JSON envelope (on a dead-letter topic that keeps Kafka's default 1 MB limit)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from kafka import KafkaProducer

from runledger.ingest.kafka_ingester import DEADLETTER_FORMAT, DEADLETTER_PREFIX_BYTES, run_ingester
from runledger.ingest.kafka_replay import replay
from runledger.ledger.query import Reader
from runledger.schemas.codec import MAX_EVENT_BYTES
from tests.support.hostile import ACCEPT, Hostile, corpus, valid_events
from tests.support.kafka import REPO_ROOT
from tests.support.kafka_clients import check_ledger, consume_topic, table_fingerprint

TOPIC_MAX_BYTES = 10 * 1024 * 1024  # accepts every corpus record (the largest is MAX_EVENT_BYTES + 1)
FIVE_MB_GARBAGE = Hostile("five-mb-garbage", b"<" + b"garbage " * 655_360 + b">", "decode", "malformed")
LIBS = REPO_ROOT / ".kafka" / "libs"


def _expect_outcomes(ledger: Path, expected: dict[int, Hostile | str], letters: list) -> None:
    """Every offset: a valid event landed under its id, or a hostile record got its outcome, with
    the reason in the quarantine table and a well-formed dead letter naming the same code."""
    reader = Reader(ledger)
    landed = {row[0] for row in reader.sql("SELECT id FROM events").rows}
    reasons = dict(reader.sql("SELECT ingest_position, reason FROM quarantine").rows)
    codes = {}
    for letter in letters:
        body = json.loads(letter.value)
        codes[body["source"]["offset"]] = body["code"]
    for offset, item in expected.items():
        if isinstance(item, str):  # a valid event's id
            assert item in landed and offset not in reasons, f"valid event at {offset}: {reasons.get(offset)}"
            continue
        if offset in reasons:
            item.check(codes[offset], reasons[offset])
        else:
            item.check(ACCEPT)
            assert item.id in landed, f"{item.name}: accepted but not in the ledger"
    assert sorted(reasons) == sorted(codes), "a quarantined record without its dead letter (or the reverse)"


def _check_letters(letters: list, raw_at: dict[int, bytes | None], topic: str) -> None:
    """Each dead letter is the bounded envelope: it parses, names its origin, and carries the raw
    bytes' length, hash and (base64) prefix."""
    for letter in letters:
        assert len(letter.value) < 1_000_000, "a dead letter must fit Kafka's default message size"
        headers = {k: v.decode() for k, v in letter.headers}
        body = json.loads(letter.value)
        assert body["format"] == DEADLETTER_FORMAT
        offset = body["source"]["offset"]
        assert body["source"] == {"topic": topic, "partition": 0, "offset": offset}
        assert headers["reason"] == body["code"] and headers["source.offset"] == str(offset)
        assert body["reason"] and headers["error"]
        raw = raw_at[offset] or b""
        assert body["raw"]["length"] == len(raw)
        assert body["raw"]["sha256"] == hashlib.sha256(raw).hexdigest()
        prefix = base64.b64decode(body["raw"]["prefix_base64"])
        assert prefix == raw[:DEADLETTER_PREFIX_BYTES] and body["raw"]["truncated"] == (
            len(raw) > len(prefix)
        )
        assert body["ledger"] == {"ingest_source": f"kafka:{topic}:0", "ingest_position": offset}


def test_hostile_corpus_from_kafka_python(kafka_broker, make_topic, tmp_path: Path) -> None:
    topic = make_topic(partitions=1, max_message_bytes=TOPIC_MAX_BYTES)
    dlq = make_topic(partitions=1, hint="deadletter")  # default max.message.bytes (1 MB)
    items = [*corpus(MAX_EVENT_BYTES), FIVE_MB_GARBAGE]
    before, after = valid_events(20), valid_events(20, start=20)
    producer = KafkaProducer(
        bootstrap_servers=kafka_broker.bootstrap,
        acks="all",
        max_request_size=TOPIC_MAX_BYTES,
        max_in_flight_requests_per_connection=1,
    )
    sends: list[tuple[object, Hostile | str, bytes | None]] = []
    for ident, raw in before:
        sends.append((producer.send(topic, value=raw, key=b"valid-run"), ident, raw))
    for item in items:
        sends.append((producer.send(topic, value=item.raw, key=item.name.encode()), item, item.raw))
    for ident, raw in after:
        sends.append((producer.send(topic, value=raw, key=b"valid-run"), ident, raw))
    producer.flush(120)
    expected: dict[int, Hostile | str] = {}
    raw_at: dict[int, bytes | None] = {}
    for future, what, raw in sends:
        offset = future.get(timeout=60).offset
        expected[offset], raw_at[offset] = what, raw
    producer.close()
    assert len(expected) == len(sends)

    ledger = tmp_path / "live"
    stats = run_ingester(
        ledger, kafka_broker.bootstrap, "hostile", [topic], idle_timeout_s=4, deadletter=dlq, batch_max=50
    )
    assert stats.records == len(sends)
    assert stats.accepted + stats.quarantined == len(sends) and stats.duplicates == 0
    assert stats.deadlettered == stats.quarantined
    assert stats.quarantined >= sum(not h.accepted for h in items)
    letters = consume_topic(kafka_broker.bootstrap, dlq)
    assert len(letters) == stats.quarantined
    _check_letters(letters, raw_at, topic)
    _expect_outcomes(ledger, expected, letters)
    check_ledger(ledger)  # exactly once, gap-free streams
    tombstone = next(offset for offset, what in expected.items() if getattr(what, "name", "") == "tombstone")
    reason = Reader(ledger).sql("SELECT reason FROM quarantine WHERE ingest_position = ?", [tombstone]).rows
    assert reason == [("tombstone (null value)",)]

    # A restart has nothing left to do (no record stops it, none is read twice).
    again = run_ingester(
        ledger, kafka_broker.bootstrap, "hostile-2", [topic], idle_timeout_s=2, deadletter=dlq
    )
    assert (again.accepted, again.quarantined, again.commits) == (0, 0, 0)

    # `ledger replay` rebuilds the same ledger from the topic: same events, same quarantine reasons.
    replayed = tmp_path / "replayed"
    rstats = replay(kafka_broker.bootstrap, replayed, [topic], batch_max=50)
    assert (rstats.accepted, rstats.quarantined) == (stats.accepted, stats.quarantined)
    live, again_fp = table_fingerprint(ledger), table_fingerprint(replayed)
    for name in live:
        assert live[name] == again_fp[name], f"{name} differs between the live and replayed ledgers"


def _console_lines(items: list[Hostile]) -> list[Hostile]:
    """The items a line-based producer can carry unchanged: one line each, valid UTF-8 (Java reads
    stdin as UTF-8 text), not too long for a quick test."""
    out = []
    for item in items:
        raw = item.raw
        if raw is None or b"\n" in raw or b"\r" in raw or len(raw) > 1_000_000 or raw.strip() == b"":
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(item)
    return out


@pytest.mark.skipif(shutil.which("java") is None, reason="the Java console producer needs java")
def test_hostile_corpus_from_the_java_console_producer(kafka_broker, make_topic, tmp_path: Path) -> None:
    if not list(LIBS.glob("kafka-tools-[0-9]*.jar")):
        pytest.skip("no kafka-tools jar in .kafka/libs (scripts/kafka.sh fetch brings it)")
    topic = make_topic(partitions=1, max_message_bytes=TOPIC_MAX_BYTES)
    dlq = make_topic(partitions=1, hint="deadletter")
    items = _console_lines(corpus(MAX_EVENT_BYTES))
    assert len(items) > 40
    before, after = valid_events(10, run_id="console-run"), valid_events(10, run_id="console-run", start=10)
    marker = "@@TOMBSTONE@@"
    tombstone = Hostile("tombstone", None, "tombstone", "tombstone (null value)")
    plan: list[tuple[bytes | None, Hostile | str]] = [(raw, ident) for ident, raw in before]
    plan += [(item.raw, item) for item in items] + [(None, tombstone)]
    plan += [(raw, ident) for ident, raw in after]
    stdin = b"\n".join(marker.encode() if raw is None else raw for raw, _ in plan) + b"\n"
    out = subprocess.run(
        [
            "java",
            "-cp",
            f"{LIBS}/*",
            "org.apache.kafka.tools.ConsoleProducer",
            "--bootstrap-server",
            kafka_broker.bootstrap,
            "--topic",
            topic,
            "--command-property",
            f"max.request.size={TOPIC_MAX_BYTES}",
            "--command-property",
            "acks=all",
            "--reader-property",
            f"null.marker={marker}",
        ],
        input=stdin,
        capture_output=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    # The broker holds exactly what was planned, in order (the producer is idempotent).
    records = consume_topic(kafka_broker.bootstrap, topic)
    assert [r.value for r in records] == [raw for raw, _ in plan]
    expected = {r.offset: what for r, (_, what) in zip(records, plan, strict=True)}
    raw_at = {r.offset: r.value for r in records}

    ledger = tmp_path / "live"
    stats = run_ingester(ledger, kafka_broker.bootstrap, "console", [topic], idle_timeout_s=4, deadletter=dlq)
    assert stats.accepted + stats.quarantined == len(plan) == stats.records
    letters = consume_topic(kafka_broker.bootstrap, dlq)
    assert len(letters) == stats.quarantined == stats.deadlettered
    _check_letters(letters, raw_at, topic)
    _expect_outcomes(ledger, expected, letters)
    check_ledger(ledger)

    replayed = tmp_path / "replayed"
    rstats = replay(kafka_broker.bootstrap, replayed, [topic])
    assert (rstats.accepted, rstats.quarantined) == (stats.accepted, stats.quarantined)
    assert table_fingerprint(ledger) == table_fingerprint(replayed)
