"""Kafka consumer-group failover into one DuckLake: two `ledger ingest kafka` processes, each with a
ledger folder of its own (separate "hosts") on the same lake, share a consumer group; one is
SIGKILLed mid-stream and the survivor, handed its partitions, resumes them where the dead one's last
lake commit left them. Every event lands once, read back through either folder."""

from __future__ import annotations

import ast
import itertools
import json
import re
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.kafka_sink import KafkaSink
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from tests.support.kafka_clients import IngesterProc, ingest_args, wait_for, workload

VERBOSE = {"RUNLEDGER_LOG_LEVEL": "INFO", "RUNLEDGER_PROGRESS_S": "off"}  # assignments, in the logs


def _records(folder: Path) -> list[dict[str, Any]]:
    """The folder's commit records, in commit order (one being renamed into place is left out)."""
    out = []
    for path in sorted((folder / "_commits").glob("*.json")) if (folder / "_commits").is_dir() else []:
        try:
            out.append(json.loads(path.read_bytes()))
        except (OSError, ValueError):
            continue
    return out


def _writers(*folders: Path) -> set[str]:
    """The writers whose commits accepted events, as far as these folders' records tell."""
    return {r["writer"] for f in folders for r in _records(f) if r["counts"]["accepted"]}


def _accepted(folder: Path) -> int:
    return sum(r["counts"]["accepted"] for r in _records(folder))


def _assigned(proc: IngesterProc) -> list[str]:
    """The partitions an ingester logged as its latest assignment (``assigned [...]; seeking …``)."""
    found = re.findall(r"assigned (\[[^\]]*\]); seeking", proc.output())
    return ast.literal_eval(found[-1]) if found else []


def test_a_killed_ingesters_partitions_resume_on_the_survivor_in_one_lake(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=4)
    catalog, data = f"sqlite:{tmp_path / 'cat.sqlite'}", tmp_path / "data"
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    for host in (host_a, host_b):
        Ledger.create_on_lake(host, catalog, data).close()

    planned = workload(8, 400, config_every=50, moe_every=100)
    assert len(planned) > 3000
    hold_at = 2 * len(planned) // 3
    produced: list = []
    both_in_group, killed = threading.Event(), threading.Event()
    producer_error: list[BaseException] = []

    def produce() -> None:
        try:
            sink = KafkaSink(kafka_broker.bootstrap, tmp_path / "spool", topic=topic)
            try:
                # Not before both hold partitions (a member that joins late may find its partitions
                # already drained and never commit); the last third only once `a` is dead, so the
                # survivor must take a's partitions over mid-stream.
                if not both_in_group.wait(120):
                    return
                for i, env in enumerate(planned):
                    if i == hold_at and not killed.wait(180):
                        return
                    sink.emit(env)
                    produced.append(env)
                    if len(produced) % 100 == 0:
                        time.sleep(0.02)  # a steady stream over a few seconds
            finally:
                sink.close(timeout_s=60)
                assert sink.left_in_spool == 0
        except BaseException as exc:  # surfaced by the test thread
            producer_error.append(exc)

    def args(host: Path) -> list[str]:
        # session timeout 6 s (ingest_args): a's partitions move to b that long after the kill
        return ingest_args(host, kafka_broker.bootstrap, "lake-pair", topic, "--batch-max", "200")

    a = IngesterProc(args(host_a), tmp_path / "a.log", VERBOSE)
    b = IngesterProc(args(host_b), tmp_path / "b.log", VERBOSE)
    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        try:
            wait_for(
                lambda: bool(_assigned(a) and _assigned(b)), 90, "both ingesters to be assigned partitions"
            )
            both_in_group.set()
            wait_for(lambda: len(_writers(host_a, host_b)) >= 2, 90, "both ingesters to commit")
        except pytest.fail.Exception:
            for proc in (a, b):  # thread stacks into the logs (faulthandler on SIGUSR1)
                if proc.proc.poll() is None:
                    proc.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(
                f"produced {len(produced)} of {len(planned)}\n"
                f"a:\n{a.output()[-4000:]}\nb:\n{b.output()[-4000:]}"
            ) from None
        assert a.proc.poll() is None and b.proc.poll() is None, "an ingester exited early"
        time.sleep(0.3)  # a little further into a's commits
        a.kill()
        killed.set()
        producer.join(120)
        assert not producer.is_alive(), "the producer did not finish"
        assert not producer_error, producer_error
        assert len(produced) == len(planned)
        wait_for(lambda: _accepted(host_b) >= len(planned), 180, "the survivor to ingest everything")
        rc = b.terminate()
        assert rc == 0, b.output()[-4000:]
    except BaseException:
        print(f"a:\n{a.output()[-3000:]}\nb:\n{b.output()[-3000:]}")
        raise
    finally:
        killed.set()
        both_in_group.set()
        a.kill()
        b.kill()
        producer.join(60)

    n = len(planned)
    ids = {e.id for e in planned}
    per_stream: dict[str, int] = defaultdict(int)
    for env in planned:
        per_stream[env.stream] += 1
    for host in (host_a, host_b):
        reader = Reader(host)
        rows = reader.sql(
            "SELECT count(*), count(DISTINCT id), count(DISTINCT (source, id)) FROM events "
            "WHERE stream NOT LIKE 'ledger:%'"
        ).rows
        assert rows == [(n, n, n)], (host.name, rows)
        assert {
            r[0] for r in reader.sql("SELECT id FROM events WHERE stream NOT LIKE 'ledger:%'").rows
        } == ids
        dense = reader.sql(
            "SELECT stream, count(*), count(DISTINCT stream_seq), min(stream_seq), max(stream_seq) "
            "FROM events GROUP BY stream"
        ).rows
        for stream, count, distinct, lo, hi in dense:
            assert (distinct, lo, hi) == (count, 0, count - 1), f"{host.name}: stream {stream} not dense"
        got = {stream: count for stream, count, *_ in dense if not stream.startswith("ledger:")}
        assert got == dict(per_stream)
        # spread over more than one partition, every event from this topic
        sources = {
            r[0]
            for r in reader.sql(
                "SELECT DISTINCT ingest_source FROM events WHERE stream NOT LIKE 'ledger:%'"
            ).rows
        }
        assert len(sources) >= 2 and all(s.startswith(f"kafka:{topic}:") for s in sources), sources
        assert reader.sql("SELECT count(*) FROM quarantine").rows == [(0,)]
        assert reader.sql("SELECT count(*) FROM config_changes WHERE hash_matches IS NOT true").rows == [(0,)]
        reader.close()

    # The survivor's folder holds every lake commit, numbered without a gap, by two ingesters.
    records = _records(host_b)
    assert [r["commit"] for r in records] == list(range(len(records)))
    assert sum(r["counts"]["accepted"] for r in records) == n
    writers = {r["writer"] for r in records if r["counts"]["accepted"]}
    assert len(writers) == 2 and all(w.startswith("kafka-ingest:lake-pair:") for w in writers), writers
    assert str(a.proc.pid) in " ".join(writers) and str(b.proc.pid) in " ".join(writers), writers
    # Each partition read once, in order: every commit's span starts right after the previous one's.
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for r in records:
        for source, (lo, hi) in r["covers"].items():
            spans[source].append((lo, hi, r["writer"]))
    for source, seq in spans.items():
        assert seq[0][0] == 0, (source, seq[0])
        for (_, prev_hi, _), (lo, _, _) in itertools.pairwise(seq):
            assert lo == prev_hi + 1, f"{source}: a gap or a re-read at {lo} after {prev_hi}"
    # A handover really happened: a partition a committed on, b committed on after it.
    a_name = next(w for w in writers if w.endswith(f":{a.proc.pid}"))
    b_name = next(w for w in writers if w.endswith(f":{b.proc.pid}"))
    moved = [
        s
        for s, seq in spans.items()
        if any(w == a_name for *_, w in seq)
        and any(w == b_name and lo > max(h for _, h, x in seq if x == a_name) for lo, _, w in seq)
    ]
    assert moved, {s: [(lo, hi, w[-8:]) for lo, hi, w in seq] for s, seq in spans.items()}
    assert sorted(_assigned(b)) == sorted(f"{topic}:{p}" for p in range(4)), _assigned(b)
