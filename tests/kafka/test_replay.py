"""`ledger replay`: a ledger rebuilt from the topic equals the live one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from kafka import KafkaProducer

from runledger.ingest.kafka_ingester import run_ingester
from runledger.ledger.integrity import prove_inclusion
from runledger.ledger.store import Ledger
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas import encode_event
from runledger.schemas.note import write_keypair
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


def test_a_replayed_ledger_verifies_against_checkpoints_signed_before_the_replay(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    """Issue 16: `replay --ledger-id` keeps the log's origin, so published checkpoints stay checkable;
    a replay without it is a new log, which the old checkpoints rightly do not verify."""
    topic = make_topic(partitions=2)
    events = workload(2, 40, config_every=10)
    live = tmp_path / "live"
    half = len(events) // 2
    produce_events(kafka_broker.bootstrap, topic, events[:half], tmp_path / "spool")
    run_ingester(live, kafka_broker.bootstrap, "live", [topic], idle_timeout_s=3, deadletter=None)
    private, public = write_keypair(tmp_path / "keys", "log")
    signed = sign_checkpoints(live, private.read_text().strip())  # published: kept by others
    produce_events(kafka_broker.bootstrap, topic, events[half:], tmp_path / "spool")
    ledger_id = Ledger.open(live).ledger_id

    def replay_and_verify(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        target = tmp_path / name
        out = run_cli(
            "replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topic, "--to", str(target), *extra
        )
        assert out.returncode == 0 and f"{len(events)} events" in out.stdout, out.stdout + out.stderr
        shutil.copytree(live / "_checkpoints", target / "_checkpoints")  # the checkpoints signed before
        return run_cli("verify", "--ledger", str(target), "--public-key", str(public))

    kept = replay_and_verify("replayed", "--ledger-id", ledger_id)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert (
        f"{len(signed)} signed checkpoint{'' if len(signed) == 1 else 's'} checked" in kept.stdout
        and kept.stdout.startswith("OK: ")
    )
    # The stand-alone verifier: an event of the rebuilt ledger against a checkpoint signed before.
    stream = events[0].stream
    proof = tmp_path / "proof.json"
    proof.write_text(json.dumps(prove_inclusion(tmp_path / "replayed", events[0].id)))
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "runledger.ledger.verifier",
            "inclusion",
            "--proof",
            str(proof),
            "--checkpoint",
            str(live / "_checkpoints" / f"{stream}.txt"),
            "--public-key",
            str(public),
            "--origin",
            f"runledger/{ledger_id}/{stream}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0 and checked.stdout.startswith("OK"), checked.stdout + checked.stderr

    renamed = replay_and_verify("new-log")
    assert renamed.returncode == 1 and "checkpoint: stream" in renamed.stdout, renamed.stdout
    # Resuming a replay into a ledger of another id is refused rather than mixing two logs.
    out = run_cli(
        "replay",
        "--bootstrap",
        kafka_broker.bootstrap,
        "--topic",
        topic,
        "--to",
        str(tmp_path / "new-log"),
        "--ledger-id",
        ledger_id,
    )
    assert out.returncode != 0 and f"not {ledger_id}" in out.stderr, out.stderr


def test_a_forged_record_under_a_real_id_is_a_conflict_live_and_in_replay(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    """Issue 16: the forgery is quarantined (the real event stays), its dead letter says `conflict`,
    a redelivery of the real bytes is a plain duplicate, and a replay judges them all the same."""
    topic, dlq = make_topic(partitions=1), make_topic(partitions=1)
    events = workload(1, 10)
    real = encode_event(events[3])
    forged = json.loads(real)
    forged["data"]["loss"] = 0.001
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, acks="all")
    for raw in [*(encode_event(e) for e in events), json.dumps(forged).encode(), real]:
        producer.send(topic, value=raw, key=events[0].stream.encode())
    producer.flush(30)
    producer.close()

    live = tmp_path / "live"
    stats = run_ingester(live, kafka_broker.bootstrap, "forged", [topic], idle_timeout_s=3, deadletter=dlq)
    assert (stats.accepted, stats.quarantined, stats.duplicates) == (len(events), 1, 1)
    [letter] = consume_topic(kafka_broker.bootstrap, dlq)
    headers = {k: v.decode() for k, v in letter.headers}
    assert headers["reason"] == json.loads(letter.value)["code"] == "conflict"
    assert headers["source.offset"] == str(len(events)) and events[3].id in letter.value.decode()

    out = run_cli(
        "replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topic, "--to", str(tmp_path / "again")
    )
    assert out.returncode == 0 and "1 duplicate, 1 quarantined" in out.stdout, out.stdout + out.stderr
    assert table_fingerprint(live) == table_fingerprint(tmp_path / "again")
    out = run_cli("verify", "--ledger", str(tmp_path / "again"))
    assert out.returncode == 0 and "WARNING: conflict: 1 quarantined record(s)" in out.stdout, out.stdout
