"""Kafka's edges (issue 42): no event left silently on a dead bus, and a missing topic is an error.

* ``ledger simulate --bus kafka`` whose broker refuses: its events wait in the outage spool, the JSON
  summary counts them (``undelivered``, equal to what the spool holds) and names the command that
  sends them, and it exits 3; ``ledger kafka drain-spool`` with no broker exits 3 too; with one, it
  delivers them, and a run killed mid-way, a second and a third run, and a crash copy of the spool
  drained again leave every event exactly once in the ledger after ``ledger ingest kafka``.
* ``ledger ingest kafka`` on a topic that does not exist: one line naming the topic and the broker,
  exit 1, no ledger made; with ``--wait-for-topic`` and the topic created meanwhile, it ingests.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic

from runledger.ingest.kafka_config import answer_within
from runledger.ingest.kafka_ingester import topic_problem
from runledger.ingest.kafka_sink import UNDELIVERED_EXIT_CODE
from runledger.ingest.spool import SpoolReader
from runledger.ledger.query import Reader
from tests.support.kafka import free_ports, unique_topic_name
from tests.support.kafka_clients import (
    LEDGER_BIN,
    REPO,
    IngesterProc,
    check_ledger,
    ingest_args,
    produce_events,
    run_cli,
    wait_for,
    workload,
)

SIMULATE = ["simulate", "reference-535b", "--steps", "300", "--crashes", "2", "--rank-stats-every", "150"]


def spooled_events(spool: Path) -> list[tuple[str, str]]:
    """(source, id) of each event the outage spool holds, read back apart from the sink (nothing
    drained yet)."""
    records = [json.loads(record.payload) for record in SpoolReader(spool).read(0) if record.corrupt is None]
    return [(record["source"], record["id"]) for record in records]


def ledger_events(ledger: Path) -> list[tuple[str, str]]:
    return [(source, id) for source, id in Reader(ledger).sql("SELECT source, id FROM events").rows]


def drain_args(command: str, bootstrap: str, topic: str, spool: Path | None = None) -> list[str]:
    """The summary's drain command, pointed at the test's broker and topic (and another spool)."""
    words = shlex.split(command)
    assert words[:3] == ["ledger", "kafka", "drain-spool"], command
    options = dict(zip(words[3::2], words[4::2], strict=True))
    assert set(options) == {"--spool", "--bootstrap", "--topic"}, command
    options.update({"--bootstrap": bootstrap, "--topic": topic})
    if spool is not None:
        options["--spool"] = str(spool)
    return ["kafka", "drain-spool", *(item for pair in options.items() for item in pair)]


def kill_once_sending(args: list[str], bootstrap: str, topic: str, log: Path) -> None:
    """Run a drain and SIGKILL it once its first records are on the topic (unless it ended first)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
    with open(log, "wb") as out:
        proc = subprocess.Popen([LEDGER_BIN, *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            wait_for(
                lambda: proc.poll() is not None or sum(consumer.end_offsets(partitions).values()) > 0,
                60,
                "the first drained records",
                interval=0.01,
            )
        finally:
            proc.kill()
            proc.wait(30)
            consumer.close()


def test_undelivered_events_are_counted_then_drained_exactly_once(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    (refused,) = free_ports(1)
    dead = f"127.0.0.1:{refused}"
    spool = tmp_path / "outage-spool"
    out = run_cli(*SIMULATE, "--bus", "kafka", "--bootstrap", dead, "--spool", str(spool))
    assert out.returncode == UNDELIVERED_EXIT_CODE, out.stderr
    summary = json.loads(out.stdout)
    spooled = spooled_events(spool)
    assert summary["undelivered"] == len(spooled) == summary["events"] > 0
    assert summary["undelivered_spool"] == str(spool)
    assert f"--spool {spool.absolute()} --bootstrap {dead}" in summary["deliver_with"]
    said = out.stderr.strip().splitlines()[-1]
    assert said.startswith(f"error: simulated {summary['events']} events; {len(spooled)} events not on Kafka")
    assert summary["deliver_with"] in out.stderr

    # Still no broker: the drain says what is left and how to send it, and exits 3 as well.
    topic = make_topic(partitions=2)
    nowhere = drain_args(summary["deliver_with"], dead, topic)
    failed = run_cli(*nowhere, "--timeout", "1")
    assert failed.returncode == UNDELIVERED_EXIT_CODE, failed.stderr
    assert f"0 of {summary['events']} spooled events sent" in failed.stderr
    assert len(spooled_events(spool)) == summary["undelivered"]

    # A drain killed mid-way, then a second and a third run; a copy of the spool taken before
    # stands for a drain killed after Kafka's ack but before the spool recorded it.
    crash_copy = tmp_path / "spool-copy"
    shutil.copytree(spool, crash_copy)
    live = drain_args(summary["deliver_with"], kafka_broker.bootstrap, topic)
    kill_once_sending(live, kafka_broker.bootstrap, topic, tmp_path / "drain-killed.log")
    second = run_cli(*live)
    assert second.returncode == 0, second.stderr
    print(f"\nafter the kill: {second.stdout.strip()} (of {summary['events']})")
    third = run_cli(*live)
    assert third.returncode == 0, third.stderr
    assert third.stdout.strip() == f"sent 0 spooled events to {topic}"
    copy = run_cli(*drain_args(summary["deliver_with"], kafka_broker.bootstrap, topic, spool=crash_copy))
    assert copy.stdout.strip() == f"sent {summary['events']} spooled events to {topic}", copy.stderr

    ledger = tmp_path / "ledger"
    ingested = run_cli(
        "ingest",
        "kafka",
        *ingest_args(ledger, kafka_broker.bootstrap, "edges", topic, "--no-deadletter"),
        "--until-idle",
        "3",
    )
    assert ingested.returncode == 0, ingested.stderr
    assert ingested.stdout.startswith(f"ingested {summary['events']} events"), ingested.stdout
    held = ledger_events(ledger)
    assert len(held) == len(set(held)) == len(spooled) and set(held) == set(spooled)  # every event once


def test_missing_topic_is_one_line_or_waited_for(kafka_broker, tmp_path: Path) -> None:
    missing = unique_topic_name("missing")
    ledger = tmp_path / "ledger"
    out = run_cli("ingest", "kafka", *ingest_args(ledger, kafka_broker.bootstrap, "edges-missing", missing))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: topic {missing} does not exist on {kafka_broker.bootstrap} (PLAINTEXT); "
        f"`ledger kafka topic create {missing} --partitions 12` makes it, "
        "or --wait-for-topic SECONDS waits for it"
    ]
    assert not ledger.exists()  # nothing made for a topic that is not there

    # With a bounded wait, a topic that appears meanwhile (made by another thread) is ingested.
    events = workload(2, 40)
    args = ingest_args(ledger, kafka_broker.bootstrap, "edges-wait", missing, "--wait-for-topic", "90")
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=15000)
    # INFO: its assignments are in its log, should it not end (see IngesterProc.wait).
    proc = IngesterProc(
        [*args, "--until-idle", "3"], tmp_path / "ingest.log", env={"RUNLEDGER_LOG_LEVEL": "INFO"}
    )

    def create_and_produce() -> None:
        time.sleep(1.0)  # the ingester is starting: most often it is already waiting
        admin.create_topics([NewTopic(missing, 2, 1)])
        produce_events(kafka_broker.bootstrap, missing, events, tmp_path / "spool")

    maker = threading.Thread(target=create_and_produce)
    maker.start()
    try:
        maker.join(120)
        assert proc.wait(120) == 0, proc.output()
    finally:
        admin.delete_topics([missing])
        admin.close()
    assert f"ingested {len(events)} events" in proc.output()
    check_ledger(ledger, events)


@pytest.mark.parametrize(
    ("described", "problem"),
    [
        ({"error_code": 3, "partitions": []}, "does not exist"),
        ({"error_code": 29, "partitions": []}, "may not be described (not authorised)"),
        ({"error_code": 0, "partitions": []}, "has no partitions"),
        (
            {"error_code": 0, "partitions": [{"partition_index": 0}], "authorized_operations": ["DESCRIBE"]},
            "may not be read (not authorised)",
        ),
        ({"error_code": 5, "partitions": []}, None),  # no leader yet: the consumer waits for one
        ({"error_code": 0, "partitions": [{"partition_index": 0}], "authorized_operations": ["READ"]}, None),
    ],
)
def test_topic_problem_reads_kafkas_metadata_answer(described: dict, problem: str | None) -> None:
    """The topic states a single test broker cannot show (no ACLs there): what the metadata says."""
    assert topic_problem(described) == problem


def test_advice_asked_of_kafka_is_bounded_by_the_ingester() -> None:
    """The group-size check asks kafka-python, whose blocking calls wait on its IO thread without a
    bound of their own: the ingester waits a bounded time, then goes on without the answer."""
    assert answer_within(5, lambda: 3) == 3

    def refused() -> int:
        raise OSError("refused")

    with pytest.raises(OSError, match="refused"):
        answer_within(5, refused)
    never = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"no answer within 0\.3 s"):
            answer_within(0.3, lambda: int(never.wait(60)))
        assert time.monotonic() - started < 5
    finally:
        never.set()  # the left-behind thread ends


def test_a_client_run_says_how_many_events_wait_off_kafka(tmp_path: Path) -> None:
    """``runledger.init`` on a broker that refuses: every event the run took waits in its outage
    spool, and ``Run.undelivered`` says how many (what a script exits 3 on), equal to what the
    spool holds."""
    import runledger

    (refused,) = free_ports(1)
    run = runledger.init(
        run_id="offkafka",
        spool=tmp_path / "spool",
        state_dir=tmp_path / "runs",  # this test's attempts, not the working folder's .runledger/runs
        kafka_bootstrap=f"127.0.0.1:{refused}",
        handle_signals=False,
        flush_timeout_s=5,
    )
    for step in range(20):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run.finish()
    held = spooled_events(tmp_path / "spool")
    assert held, "a refused broker left nothing in the outage spool"
    assert run.undelivered == len(held)


def test_drain_spool_sends_the_drop_report_a_producer_kept_at_its_end_once(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    """A producer whose bus was still down at its end kept its drop report beside the spool
    (``runledger.ingest.spool.PendingSlot``); ``ledger kafka drain-spool`` sends it with the spooled events and
    removes the file; the ledger holds it once, after a second drain as after the first."""
    import runledger
    from runledger.ingest.spool import PENDING_DIR, PendingSlot

    # A real event's bytes stand for the report (made by a run on a spool of its own).
    made = runledger.init(
        run_id="kept", spool=tmp_path / "made", state_dir=tmp_path / "runs", handle_signals=False
    )
    made.log({"loss": 0.5}, step=0)
    made.finish()
    last = [r for r in SpoolReader(tmp_path / "made").read(0) if r.corrupt is None][-1].payload
    kept = json.loads(last)

    outage = tmp_path / "outage-spool"
    slot = PendingSlot.reserve(outage, kept["source"])
    slot.hold(last, None)
    topic = make_topic(partitions=1)
    for attempt in range(2):  # the second run finds nothing left
        out = run_cli(
            "kafka",
            "drain-spool",
            "--spool",
            str(outage),
            "--bootstrap",
            kafka_broker.bootstrap,
            "--topic",
            topic,
        )
        assert out.returncode == 0, out.stderr
        said = "and 1 kept drop report " if attempt == 0 else ""
        assert out.stdout.strip() == f"sent 0 spooled events {said}to {topic}"
        assert not list((outage / PENDING_DIR).glob("*.json"))

    ledger = tmp_path / "ledger"
    ingested = run_cli(
        "ingest",
        "kafka",
        *ingest_args(ledger, kafka_broker.bootstrap, "kept", topic, "--no-deadletter"),
        "--until-idle",
        "3",
    )
    assert ingested.returncode == 0, ingested.stderr
    assert ledger_events(ledger) == [(kept["source"], kept["id"])]
