"""The Kafka ingester against a real broker: end to end, crashes, consumer groups, bad records."""

from __future__ import annotations

import ast
import base64
import importlib.util
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer

from runledger.ingest.kafka_ingester import run_ingester
from runledger.ingest.kafka_sink import KafkaSink
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import encode_event, make_event
from runledger.schemas.payloads import StepMetrics
from tests.support.kafka import free_ports
from tests.support.kafka_clients import (
    IngesterProc,
    check_ledger,
    commit_count,
    commit_summary,
    consume_topic,
    ingest_args,
    produce_events,
    run_cli,
    synthetic_run,
    wait_for,
    workload,
)


def test_end_to_end_producer_to_cli_query(kafka_broker, make_topic, tmp_path: Path) -> None:
    """KafkaSink → Kafka → `ledger ingest kafka` (until SIGTERM) → `ledger query` answers."""
    topic = make_topic(partitions=4)
    events = workload(8, 60, config_every=20, moe_every=20)
    ledger = tmp_path / "ledger"
    proc = IngesterProc(ingest_args(ledger, kafka_broker.bootstrap, "e2e", topic), tmp_path / "ingest.log")
    try:
        produce_events(kafka_broker.bootstrap, topic, events, tmp_path / "spool")
        wait_for(lambda: commit_summary(ledger)[0] >= len(events), 60, "the ingester to catch up")
    finally:
        rc = proc.terminate()  # graceful: commits the batch in hand, leaves the group
    assert rc == 0, proc.output()
    assert f"ingested {len(events)} events" in proc.output()
    check_ledger(ledger, events)

    out = run_cli(
        "query",
        "SELECT run_id, max(step) AS last, count(*) AS n FROM metrics GROUP BY run_id ORDER BY run_id",
        "--ledger",
        str(ledger),
        "--format",
        "json",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["run_id"] for r in rows] == [f"run-{i:02d}" for i in range(8)]
    assert all(r["last"] == 60 and r["n"] == 60 * 20 for r in rows)  # 20 scalars per step
    out = run_cli(
        "query",
        "SELECT count(*) FROM config_changes WHERE hash_matches",
        "--ledger",
        str(ledger),
        "--format",
        "csv",
    )
    assert out.stdout.split() == ["count_star()", str(8 * 3)]
    out = run_cli("runs", "--ledger", str(ledger), "--format", "csv")
    assert out.returncode == 0 and out.stdout.count("\nrun-") == 8


def test_sigkill_at_random_points_loses_and_duplicates_nothing(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    """~50k events; the ingester is SIGKILLed a dozen times mid-ingest and restarted."""
    topic = make_topic(partitions=4)
    events = workload(20, 2400, config_every=50, moe_every=100)
    assert len(events) > 49_000
    produce_events(kafka_broker.bootstrap, topic, events, tmp_path / "spool")
    ledger = tmp_path / "ledger"
    rng = random.Random(20240535)
    args = ingest_args(
        ledger, kafka_broker.bootstrap, "killme", topic, "--batch-max", "1000", "--instance-id", "k1"
    )
    kills_mid_ingest = 0
    for i in range(12):
        before = commit_count(ledger)
        proc = IngesterProc(args, tmp_path / f"ingest-{i}.log")
        # Let it start committing, then kill it at a random point (mid-poll, mid-commit, mid-rename).
        wait_for(lambda: commit_count(ledger) > before or proc.proc.poll() is not None, 60, "a commit")  # noqa: B023
        time.sleep(rng.uniform(0.0, 0.4))
        kills_mid_ingest += commit_summary(ledger)[0] < len(events)
        proc.kill()
    assert kills_mid_ingest >= 10, f"only {kills_mid_ingest} kills landed mid-ingest"
    final = IngesterProc([*args, "--until-idle", "3"], tmp_path / "ingest-final.log")
    assert final.wait(120) == 0, final.output()
    check = check_ledger(ledger, events)
    assert check.events == len(events)
    reader = Reader(ledger)
    assert reader.sql("SELECT count(*) FROM config_changes WHERE hash_matches IS NOT true").rows == [(0,)]
    assert reader.sql("SELECT count(*) FROM quarantine").rows == [(0,)]


def test_two_ingesters_share_a_group_and_survive_a_kill(kafka_broker, make_topic, tmp_path: Path) -> None:
    topic = make_topic(partitions=4)
    ledger = tmp_path / "ledger"
    planned = workload(12, 1500, config_every=50, moe_every=100)
    hold_at = 2 * len(planned) // 3
    events: list = []
    both_in_group = threading.Event()
    killed = threading.Event()

    def produce() -> None:
        sink = KafkaSink(kafka_broker.bootstrap, tmp_path / "spool", topic=topic)
        try:
            # Not before both ingesters hold partitions: a member that joins after the first two
            # thirds were consumed gets partitions with nothing left on them before the hold, and so
            # never commits (seen in CI: both assigned at the last generation, then 90 s of empty polls).
            both_in_group.wait(120)
            for i, env in enumerate(planned):
                if i == hold_at:
                    # The last third only once `a` is dead, however long the group took to give
                    # both ingesters work: the survivor must take over a's partitions mid-stream.
                    killed.wait(180)
                sink.emit(env)
                events.append(env)
                if len(events) % 100 == 0:
                    time.sleep(0.02)  # a steady stream over several seconds
        finally:
            sink.close(timeout_s=60)

    verbose = {"RUNLEDGER_LOG_LEVEL": "INFO"}  # group joins and assignments, should this fail
    a = IngesterProc(ingest_args(ledger, kafka_broker.bootstrap, "pair", topic), tmp_path / "a.log", verbose)
    # No --until-idle: b's idle clock would run while it waits for the group to assign it work.
    b = IngesterProc(ingest_args(ledger, kafka_broker.bootstrap, "pair", topic), tmp_path / "b.log", verbose)
    producer = threading.Thread(target=produce)
    producer.start()
    try:
        try:
            wait_for(
                lambda: bool(_assigned(a) and _assigned(b)), 90, "both ingesters to be assigned partitions"
            )
            both_in_group.set()
            wait_for(lambda: len(commit_summary(ledger)[1]) >= 2, 90, "both ingesters to commit")
        except pytest.fail.Exception:
            for proc in (a, b):  # each ingester's thread stacks into its log (faulthandler, SIGUSR1)
                proc.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            a.kill()
            b.kill()
            raise AssertionError(
                f"produced {len(events)} of {len(planned)}\na:\n{a.output()[-4000:]}\nb:\n{b.output()[-4000:]}"
            ) from None
        time.sleep(0.5)
        a.kill()
        killed.set()
        producer.join(120)
        wait_for(lambda: commit_summary(ledger)[0] >= len(planned), 180, "the survivor to ingest everything")
        assert b.terminate() == 0, b.output()
    finally:
        killed.set()
        a.kill()
        b.kill()
    assert len(events) == len(planned)
    assert len(commit_summary(ledger)[1]) == 2
    check_ledger(ledger, events)
    reader = Reader(ledger)
    assert reader.sql("SELECT count(*) FROM config_changes WHERE hash_matches IS NOT true").rows == [(0,)]


def _assigned(proc: IngesterProc) -> list[str]:
    """The partitions an ingester logged as its latest assignment (``assigned [...]; seeking …``)."""
    found = re.findall(r"assigned (\[[^\]]*\]); seeking", proc.output())
    return ast.literal_eval(found[-1]) if found else []


def test_until_idle_does_not_count_the_wait_for_partitions(kafka_broker, make_topic, tmp_path: Path) -> None:
    """A group member that stopped polling holds the join up: the ingester waits (that is not idle)."""
    topic = make_topic(partitions=1)
    events = workload(2, 50)
    produce_events(kafka_broker.bootstrap, topic, events, tmp_path / "spool")
    # The holder owns partition 0, then stalls: a rebalance waits for it until its max poll interval.
    holder = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_broker.bootstrap,
        group_id="idle",
        enable_auto_commit=False,
        max_poll_interval_ms=8000,
    )
    try:
        wait_for(
            lambda: bool(holder.poll(timeout_ms=200, max_records=1)) or bool(holder.assignment()),
            30,
            "the holder",
        )
        started = time.monotonic()
        stats = run_ingester(
            tmp_path / "ledger", kafka_broker.bootstrap, "idle", [topic], idle_timeout_s=1.5, deadletter=None
        )
        waited = time.monotonic() - started
    finally:
        holder.close()
    # Over five idle timeouts went by before the partition was handed over; the ingester stayed.
    assert waited > 7.5
    assert stats.accepted == len(events)
    check_ledger(tmp_path / "ledger", events)


def _mtime_ns(path: Path) -> int:
    return path.stat().st_mtime_ns


def test_a_dead_writers_leftover_files_do_not_change_the_config_fold(tmp_path: Path) -> None:
    """Two ingesters share a ledger; one dies between writing its files and its commit point."""
    run = list(synthetic_run("r1", 120, config_every=10))
    other = list(synthetic_run("r2", 3))

    def records(source: str, envs: list, start: int = 0) -> list[SourceRecord]:
        return [SourceRecord(source, start + i, encode_event(e)) for i, e in enumerate(envs)]

    root = tmp_path / "ledger"
    Ledger.create(root)
    survivor, dead = Ledger.open(root), Ledger.open(root)
    survivor.commit(records("kafka:t:0", run[:30]))
    dead.commit(records("kafka:t:1", other))  # another writer's commit: the survivor reloads configs
    # What the dead writer had written for the next stretch of the same stream when it was killed:
    # data files in the lake's folder that no catalog snapshot names (it died before its commit).
    scratch = Ledger.create(tmp_path / "scratch")
    scratch.commit(records("kafka:t:0", run[:30]))
    scratch.commit(records("kafka:t:0", run[30:90], 30))
    scratch.close()
    newest = max((tmp_path / "scratch" / "data").rglob("configs/run_id=r1/*.parquet"), key=_mtime_ns)
    orphan = root / "data" / "main" / "configs" / "run_id=r1" / f"ducklake-{uuid.uuid4()}.parquet"
    assert orphan.parent.is_dir(), "not the folder the lake keeps this partition's files in"
    shutil.copy(newest, orphan)
    survivor.commit(records("kafka:t:0", run[30:], 30))
    bad = Reader(root).sql("SELECT step FROM config_changes WHERE hash_matches IS NOT true").rows
    assert bad == [], f"changes folded onto the wrong config at steps {[r[0] for r in bad]}"


def test_malformed_records_are_quarantined_and_dead_lettered(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=1)
    dlq = make_topic(partitions=1, hint="deadletter")

    def metrics(step: int, **kw: object) -> bytes:
        env = make_event(
            StepMetrics(loss=1.0), source="bad-test", stream="r1", seq=step, run_id="r1", step=step
        )
        raw = json.loads(encode_event(env))
        raw.update(kw)
        return json.dumps(raw).encode()

    good1, good2 = metrics(0), metrics(5)
    bad = {
        1: (b"not json {", "decode"),
        2: (metrics(1, seq="seven"), "envelope"),
        3: (metrics(2, type="runledger.no.such.type"), "unknown-type"),
        4: (metrics(3, data={"tokens": -5}), "schema"),
    }
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, acks="all")
    sequence = [good1, bad[1][0], bad[2][0], bad[3][0], bad[4][0], good2, good1]  # good1 twice: a duplicate
    for raw in sequence:
        producer.send(topic, value=raw, key=b"r1")
    producer.flush(30)
    producer.close()

    ledger = tmp_path / "ledger"
    stats = run_ingester(ledger, kafka_broker.bootstrap, "bad", [topic], idle_timeout_s=3, deadletter=dlq)
    # Accepted: the two good events and the ledger's incident for the producer's seq gap (0, then 5:
    # seqs 1-3 were quarantined, 4 never sent; ledger/admission.py, tests/core/test_unchained_gaps.py).
    assert (stats.accepted, stats.quarantined, stats.duplicates, stats.deadlettered) == (3, 4, 1, 4)
    reader = Reader(ledger)
    types = reader.sql("SELECT type FROM events WHERE stream = 'r1' ORDER BY stream_seq").rows
    assert [t[0] for t in types] == ["runledger.step.metrics", "runledger.step.metrics", "ledger.incident"]
    rows = reader.sql("SELECT ingest_position, reason, raw FROM quarantine ORDER BY ingest_position").rows
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    assert [bytes(r[2]) for r in rows] == [bad[i][0] for i in range(1, 5)]
    assert "unknown event type" in rows[2][1]
    metrics_rows = (
        "SELECT stream_seq, seq FROM events WHERE type = 'runledger.step.metrics' ORDER BY stream_seq"
    )
    assert reader.sql(metrics_rows).rows == [(0, 0), (1, 5)]

    letters = consume_topic(kafka_broker.bootstrap, dlq)
    assert len(letters) == 4
    for rec in letters:
        headers = {k: v.decode() for k, v in rec.headers}
        offset = int(headers["source.offset"])
        letter = json.loads(rec.value)  # a bounded envelope: the raw bytes (a prefix of them) inside
        assert base64.b64decode(letter["raw"]["prefix_base64"]) == bad[offset][0]
        assert letter["raw"]["length"] == len(bad[offset][0]) and not letter["raw"]["truncated"]
        assert headers["reason"] == letter["code"] == bad[offset][1]
        assert headers["source.topic"] == topic and headers["source.partition"] == "0"
        assert headers["error"] and headers["failed.at"] and rec.key == b"r1"
        assert headers["consumer"].startswith("kafka-ingest:bad:")
    # Ingesting again is a no-op: nothing new in the ledger, nothing dead-lettered twice.
    again = run_ingester(ledger, kafka_broker.bootstrap, "bad-2", [topic], idle_timeout_s=2, deadletter=dlq)
    assert (again.accepted, again.quarantined, again.commits) == (0, 0, 0)
    assert len(consume_topic(kafka_broker.bootstrap, dlq)) == 4


def test_cli_errors_are_one_clear_line(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    nowhere = f"127.0.0.1:{port}"
    out = run_cli(
        "ingest", "kafka", "--bootstrap", nowhere, "--ledger", str(tmp_path / "l"), "--connect-timeout", "1"
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"error: no Kafka broker answered at {nowhere} (PLAINTEXT) within 1 s"
    ]
    out = run_cli(
        "ingest", "kafka", "--bootstrap", nowhere, "--ledger", str(tmp_path / "none"), "--no-create"
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"error: no ledger at {tmp_path / 'none'} (drop --no-create to make one)"
    ]
    out = run_cli("replay", "--bootstrap", nowhere, "--to", str(tmp_path / "r"), "--connect-timeout", "1")
    assert out.returncode != 0 and out.stderr.strip().startswith("error: no Kafka broker answered")
    out = run_cli("ingest", "kafka", "--ledger", str(tmp_path / "l"), env={"RUNLEDGER_KAFKA_BOOTSTRAP": ""})
    assert out.returncode != 0 and "RUNLEDGER_KAFKA_BOOTSTRAP" in out.stderr


TRAIN_TO_KAFKA = """
import json, sys
from runledger.trainer.config import load_config
from runledger.trainer.loop import train
from runledger.ingest.kafka_sink import KafkaSink
tiny = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
        "moe.num_experts=8", "moe.top_k=2", "moe.ffn_hidden_size=128", "data.micro_batch_size=8",
        "run.device='cpu'", "schedule.warmup_steps=5", "checkpoint.interval=0", "checkpoint.final=false"]
cfg = load_config(None, [*tiny, "run.run_id=via-kafka", "run.steps=12", "checkpoint.dir=" + sys.argv[3]])
sink = KafkaSink(sys.argv[1], sys.argv[2], topic=sys.argv[4])
result = train(cfg, sink, handle_signals=False)
sink.close(timeout_s=60)
print(json.dumps({"status": result.status, "emitted": result.events_emitted, "left": sink.left_in_spool}))
"""


def test_the_trainer_through_kafka_into_the_ledger(kafka_broker, make_topic, tmp_path: Path) -> None:
    """The real trainer (tiny CPU MoE run) → KafkaSink → Kafka → ingester → ledger."""
    if not all(importlib.util.find_spec(m) for m in ("torch", "megatron", "trainer")):
        pytest.skip("the trainer needs torch and megatron-core")  # checked without importing them here
    topic = make_topic(partitions=2)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            TRAIN_TO_KAFKA,
            kafka_broker.bootstrap,
            str(tmp_path / "spool"),
            str(tmp_path / "ck"),
            topic,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed" and result["left"] == 0
    ledger = tmp_path / "ledger"
    stats = run_ingester(
        ledger, kafka_broker.bootstrap, "trainer", [topic], idle_timeout_s=3, deadletter=None
    )
    assert stats.accepted == result["emitted"] and stats.quarantined == 0
    check_ledger(ledger)
    reader = Reader(ledger)
    assert reader.sql(
        "SELECT max(step), count(DISTINCT step) FROM metrics WHERE run_id = 'via-kafka'"
    ).rows == [(12, 12)]
    assert reader.sql("SELECT count(*) FROM moe_layer_stats WHERE run_id = 'via-kafka'").rows[0][0] > 0
    assert reader.sql("SELECT status FROM run_ends WHERE run_id = 'via-kafka'").rows == [("completed",)]
