"""`ledger replay`: a ledger rebuilt from the topic equals the live one."""

from __future__ import annotations

import threading
from pathlib import Path

from kafka import KafkaProducer

from runledger.ingest.kafka_ingester import run_ingester
from runledger.schemas import encode_event
from tests.support.kafka_clients import (
    check_ledger,
    consume_topic,
    produce_events,
    run_cli,
    table_fingerprint,
    workload,
)


def test_replay_equals_the_live_ledger(kafka_broker, make_topic, tmp_path: Path) -> None:
    topic = make_topic(partitions=3)
    events = workload(6, 300, config_every=25, moe_every=50)
    ledger = tmp_path / "live"
    # Two live ingesters in one group commit interleaved while the producer runs.
    threads = [
        threading.Thread(
            target=run_ingester,
            args=(ledger, kafka_broker.bootstrap, "live", [topic]),
            kwargs={"idle_timeout_s": 4, "deadletter": None, "batch_max": 700},
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    produce_events(kafka_broker.bootstrap, topic, events[: len(events) // 2], tmp_path / "spool")
    # Retried sends (the same bytes again) and a bad record, as a real topic would hold.
    raw = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, acks="all")
    for env in events[100:130]:
        raw.send(topic, value=encode_event(env), key=env.stream.encode())
    raw.send(topic, value=b"{truncated", key=b"run-00")
    raw.flush(30)
    raw.close()
    produce_events(kafka_broker.bootstrap, topic, events[len(events) // 2 :], tmp_path / "spool")
    for t in threads:
        t.join(120)
    check_ledger(ledger, events)

    replayed = tmp_path / "replayed"
    out = run_cli("replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topic, "--to", str(replayed))
    assert out.returncode == 0, out.stderr
    assert f"{len(events)} events" in out.stdout and "30 duplicates, 1 quarantined" in out.stdout
    live, again = table_fingerprint(ledger), table_fingerprint(replayed)
    assert live.keys() == again.keys()
    for name in live:
        assert live[name] == again[name], f"{name} differs between the live and replayed ledgers"
    assert len(live["events"]) == len(events) and live["quarantine"]

    # Rerunning into the same ledger resumes from its positions: nothing new.
    out = run_cli("replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topic, "--to", str(replayed))
    assert out.returncode == 0 and out.stdout.startswith("resumed 0 records"), out.stdout
    assert len(consume_topic(kafka_broker.bootstrap, topic)) == len(events) + 31


def test_replay_refuses_what_it_cannot_do(kafka_broker, tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    out = run_cli("replay", "--bootstrap", kafka_broker.bootstrap, "--to", str(occupied), "--topic", "x.y")
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"error: {occupied} exists and is not a ledger; replay needs a new (or empty) directory"
    ]
    out = run_cli(
        "replay",
        "--bootstrap",
        kafka_broker.bootstrap,
        "--to",
        str(tmp_path / "new"),
        "--topic",
        "no.such.topic",
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == ["error: topic 'no.such.topic' does not exist on the cluster"]
