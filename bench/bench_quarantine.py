"""Benchmark quarantine through the Kafka ingester: how fast hostile records are turned away, beside
how fast valid events go in, measured in the same run on the same broker.

Run from the repository root::

    .venv/bin/python -m bench.bench_quarantine            # starts its own broker (~1-2 min)
    RUNLEDGER_KAFKA_BOOTSTRAP=host:port .venv/bin/python -m bench.bench_quarantine --records 40000

Three topics, one partition each, each folded into a fresh ledger by ``run_ingester`` with dead
letters on (a dead-letter envelope per quarantined record is part of the cost):

* valid: realistic step metrics (noisy floats, 8 free-form scalars), all accepted;
* hostile: the rejected items of tests/support/hostile.py up to ``--max-record`` bytes (deep nesting,
  numbers out of range, bad UTF-8, NaN literals, truncated JSON, tombstones, ...), round robin;
* mixed: valid events and hostile records alternating (50% garbage): valid events must still flow;
* the hostile topic again with dead letters off (``deadletter=None``): what the ledger side costs
  alone (kafka-python checksums every byte it produces in Python, so letters are not free).

Rates are taken between the first and the last ledger commit (so group join and the idle wait at
the end don't count): records/s, and of those, accepted events/s and quarantined records/s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from runledger.ingest.kafka_ingester import run_ingester
from runledger.ledger.store import CommitResult
from tests.support.hostile import corpus, valid_events
from tests.support.kafka import Broker, make_temp_broker_dir


def produce(bootstrap: str, topic: str, values: list[bytes | None]) -> float:
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks=1, linger_ms=20, batch_size=256 * 1024, max_request_size=4 << 20
    )
    t = time.monotonic()
    for value in values:
        producer.send(topic, value=value, key=b"bench")  # a key: tombstones need one
    producer.flush(300)
    producer.close()
    return time.monotonic() - t


def ingest(bootstrap: str, topic: str, dlq: str | None, ledger: Path, batch_max: int) -> dict[str, Any]:
    commits: list[tuple[float, int, int, int]] = []  # (time, records, accepted, quarantined)

    def on_commit(result: CommitResult) -> None:
        records = result.accepted - result.made + result.duplicates + result.skipped + len(result.quarantined)
        commits.append((time.monotonic(), records, result.accepted, len(result.quarantined)))

    stats = run_ingester(
        ledger,
        bootstrap,
        f"bench-{uuid.uuid4().hex[:6]}",
        [topic],
        idle_timeout_s=2.0,
        deadletter=dlq,
        batch_max=batch_max,
        on_commit=on_commit,
    )
    assert len(commits) >= 3, "too few commits to time: use more --records or a smaller --batch-max"
    # From the end of the first commit to the end of the last: the records of every commit but the first.
    seconds = commits[-1][0] - commits[0][0]
    later = commits[1:]
    return {
        "records": stats.records,
        "accepted": stats.accepted,
        "quarantined": stats.quarantined,
        "deadlettered": stats.deadlettered,
        "seconds": seconds,
        "records_per_s": sum(c[1] for c in later) / seconds,
        "accepted_per_s": sum(c[2] for c in later) / seconds,
        "quarantined_per_s": sum(c[3] for c in later) / seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20000, help="records per topic")
    ap.add_argument("--max-record", type=int, default=16 * 1024, help="largest hostile record used (bytes)")
    ap.add_argument("--batch-max", type=int, default=1000)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    started = time.monotonic()
    hostile = [h for h in corpus() if not h.accepted and (h.raw is None or len(h.raw) <= args.max_record)]
    kinds = sorted({h.code for h in hostile})
    n = args.records
    valid = [raw for _, raw in valid_events(n, run_id="bench-valid")]
    garbage: list[bytes | None] = [hostile[i % len(hostile)].raw for i in range(n)]
    mixed_valid = [raw for _, raw in valid_events(n // 2, run_id="bench-mixed")]
    mixed: list[bytes | None] = []
    for i in range(n // 2):
        mixed += [mixed_valid[i], hostile[i % len(hostile)].raw]
    print(
        f"workload: {n} records per topic; hostile mix: {len(hostile)} kinds of record "
        f"({', '.join(kinds)}), up to {args.max_record} bytes"
    )

    bootstrap = os.environ.get("RUNLEDGER_KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap:
        broker = Broker(make_temp_broker_dir("bench-q-"))
        bootstrap = broker.start()
    work = Path(tempfile.mkdtemp(prefix="bench-quarantine-"))
    figures: dict[str, Any] = {}
    try:
        tag = uuid.uuid4().hex[:8]
        topics = {name: f"bench.{name}.{tag}" for name in ("valid", "hostile", "mixed", "deadletter")}
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(t, 1, 1) for t in topics.values()])
        admin.close()
        for name, values in (("valid", valid), ("hostile", garbage), ("mixed", mixed)):
            produce(bootstrap, topics[name], values)
        for name in ("valid", "hostile", "mixed"):
            figures[name] = ingest(bootstrap, topics[name], topics["deadletter"], work / name, args.batch_max)
        figures["hostile_no_dlq"] = ingest(
            bootstrap, topics["hostile"], None, work / "no-dlq", args.batch_max
        )
        assert figures["valid"]["accepted"] == n and figures["hostile"]["quarantined"] == n
        assert figures["mixed"]["accepted"] == n // 2 and figures["mixed"]["quarantined"] == n // 2
        assert (
            figures["hostile_no_dlq"]["quarantined"] == n and figures["hostile_no_dlq"]["deadlettered"] == 0
        )
        assert all(
            f["deadlettered"] == f["quarantined"] for name, f in figures.items() if name != "hostile_no_dlq"
        )
    finally:
        if broker is not None:
            broker.stop()
            shutil.rmtree(broker.dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"{'topic':<26}{'records':>9}{'seconds':>9}{'records/s':>11}{'accepted/s':>12}{'quarantined/s':>15}"
    )
    labels = {
        "valid": "valid only",
        "hostile": "hostile only",
        "mixed": "mixed (50% garbage)",
        "hostile_no_dlq": "hostile, no dead letters",
    }
    for name, f in figures.items():
        print(
            f"{labels[name]:<26}{f['records']:>9}{f['seconds']:>9.2f}{f['records_per_s']:>11,.0f}"
            f"{f['accepted_per_s']:>12,.0f}{f['quarantined_per_s']:>15,.0f}"
        )
    valid, hostile_rate = figures["valid"]["records_per_s"], figures["hostile"]["records_per_s"]
    share = figures["mixed"]["accepted_per_s"] / figures["valid"]["accepted_per_s"]
    print(
        f"\nper record, a hostile one costs {valid / hostile_rate:.1f}x a valid one with its dead letter "
        f"({valid / figures['hostile_no_dlq']['records_per_s']:.1f}x without); with 50% garbage, valid "
        f"events go in at {share:.0%} of their clean rate (at most 50%: half the records are theirs). "
        f"Total {time.monotonic() - started:.0f} s."
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
