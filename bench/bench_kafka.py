"""Benchmark the Kafka bus end to end: producer → Kafka → ingester → queryable ledger.

Run from the repository root::

    .venv/bin/python -m bench.bench_kafka                   # starts its own broker (~2-3 min)
    RUNLEDGER_KAFKA_BOOTSTRAP=host:port .venv/bin/python -m bench.bench_kafka --runs 4 --steps 1000

Workload (scaled from the reference run, docs/kafka.md): per run, one StepMetrics per step with 20
scalars, a MoeRouterStats (48 layers × 384 expert counts, ~100 KB of JSON) every 100 steps, a config
change every 500 steps. Figures, all from the same run and topic:

* e2e: KafkaSink emitting as fast as it can while ``ledger ingest kafka`` (a separate process) folds
  the topic in; from the first emit until the ledger holds the last event: events/s, metric values/s
  (scalar rows; and with the expert counts);
* ingester alone: a fresh ledger ingesting the full topic (no producer competing for the 2 cores);
* ceiling: a bare kafka-python consumer reading the same topic and doing nothing;
* storing alone: ``Ledger.commit`` of the records the bare consumer read, no Kafka at all (decode
  included, in the ingester's batches): what a storing process fed by a reading one could reach;
* validation floor: the same consumer also validating each record (``decode_event``: JSON, envelope,
  payload schema, canonical bytes) and nothing else: what any ingester that refuses bad records
  pays before it stores anything;
* replay: ``runledger.ingest.kafka_replay.replay`` into a new ledger, metric values/s;
* freshness: a paced producer (``--rate`` events/s) with the ingester running; time from emit until
  ``Reader.sql`` sees the event, p50/p99 (polled every 20 ms, so add up to that).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from kafka import KafkaConsumer, TopicPartition  # noqa: E402
from kafka.admin import KafkaAdminClient, NewTopic  # noqa: E402

from runledger.ingest.kafka_config import COMMIT_BATCH_MAX  # noqa: E402
from runledger.ingest.kafka_ingester import run_ingester, source_name  # noqa: E402
from runledger.ingest.kafka_replay import replay  # noqa: E402
from runledger.ingest.kafka_sink import KafkaSink  # noqa: E402
from runledger.ledger.query import Reader  # noqa: E402
from runledger.ledger.store import Ledger, SourceRecord  # noqa: E402
from runledger.schemas import Envelope, make_event  # noqa: E402
from runledger.schemas.canonical import config_hash  # noqa: E402
from runledger.schemas.codec import decode_event  # noqa: E402
from runledger.schemas.payloads import (  # noqa: E402
    ChangeCause,
    ConfigChanged,
    MoeLayerStats,
    MoeRouterStats,
    PatchOp,
    RunStarted,
    StepMetrics,
)
from tests.support.kafka import Broker, make_temp_broker_dir  # noqa: E402

LAYERS, EXPERTS = 48, 384
SCALARS = [
    f"router/{name}" for name in ("entropy", "aux_loss", "z_loss", "drop_rate", "max_load", "min_load")
] + [f"train/s{i}" for i in range(6)]


def run_events(run_id: str, steps: int, moe_every: int, config_every: int) -> list[Envelope]:
    source, seq, out = f"bench/{run_id}", 0, []
    config: dict[str, Any] = {"optim": {"lr": 3e-4}, "moe": {"experts": EXPERTS, "layers": LAYERS}}

    def add(payload: Any, step: int) -> None:
        nonlocal seq
        out.append(
            make_event(payload, source=source, stream=run_id, seq=seq, run_id=run_id, attempt=1, step=step)
        )
        seq += 1

    add(RunStarted(config=config, config_hash=config_hash(config), host="bench"), 0)
    for step in range(1, steps + 1):
        add(
            StepMetrics(
                loss=2.5 - step * 1e-5,
                grad_norm=0.9,
                lr=config["optim"]["lr"],
                tokens=46_000_000,
                total_tokens=46_000_000 * step,
                tokens_per_second=2.3e6,
                mfu=22.7,
                step_time_s=20.0,
                scalars={name: step * 1e-3 + i for i, name in enumerate(SCALARS)},
            ),
            step,
        )
        if step % moe_every == 0:
            layers = [
                MoeLayerStats(
                    layer=layer,
                    tokens=4096 * 8,
                    top_k=8,
                    dropped=(step + layer) % 900,
                    token_drop_rate=((step + layer) % 900) / (4096 * 8 * 8),
                    expert_counts=[(step * 131 + layer * 17 + e * 7) % 2000 for e in range(EXPERTS)],
                    aux_loss=0.01,
                    z_loss=0.001,
                    routing_entropy=5.9,
                )
                for layer in range(LAYERS)
            ]
            add(MoeRouterStats(layers=layers), step)
        if step % config_every == 0:
            previous = config_hash(config)
            config = {**config, "optim": {"lr": config["optim"]["lr"] * 0.95}}
            add(
                ConfigChanged(
                    patch=[PatchOp(op="replace", path="/optim/lr", value=config["optim"]["lr"])],
                    previous_hash=previous,
                    config_hash=config_hash(config),
                    cause=ChangeCause(kind="api"),
                ),
                step,
            )
    return out


def interleave(runs: list[list[Envelope]]) -> list[Envelope]:
    out: list[Envelope] = []
    for i in range(max(len(r) for r in runs)):
        out.extend(r[i] for r in runs if i < len(r))
    return out


def values_of(events: list[Envelope]) -> tuple[int, int]:
    """(scalar metric values, expert-count values) carried by the events."""
    scalars = counts = 0
    for env in events:
        if isinstance(env.data, StepMetrics):
            scalars += 8 + len(env.data.scalars)
        elif isinstance(env.data, MoeRouterStats):
            counts += sum(len(layer.expert_counts) for layer in env.data.layers)
    return scalars, counts


def accepted(ledger: Path) -> int:
    total = 0
    for path in (ledger / "_commits").glob("*.json") if (ledger / "_commits").is_dir() else []:
        with contextlib.suppress(OSError, ValueError):  # a commit being renamed into place
            total += json.loads(path.read_bytes())["counts"]["accepted"]
    return total


def wait_until(predicate: Any, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step timed out")
        time.sleep(0.01)
    return time.monotonic()


def ingester_process(
    ledger: Path, bootstrap: str, topic: str, group: str, log: Path
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ledger"),
            "ingest",
            "kafka",
            "--ledger",
            str(ledger),
            "--bootstrap",
            bootstrap,
            "--group",
            group,
            "--topic",
            topic,
            "--no-deadletter",
            "--until-idle",
            "600",
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(60)


def bare_consume(
    bootstrap: str, topic: str, *, validate: bool = False, keep: list[SourceRecord] | None = None
) -> tuple[int, float]:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        max_poll_records=20000,
        max_partition_fetch_bytes=8 << 20,
        fetch_max_bytes=64 << 20,
    )
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
    consumer.assign(tps)
    consumer.seek_to_beginning()
    ends = consumer.end_offsets(tps)
    n, start = 0, time.perf_counter()
    while any(consumer.position(tp) < ends[tp] for tp in tps):
        for batch in consumer.poll(timeout_ms=500).values():
            n += len(batch)
            if keep is not None:  # outside the timed figure's purpose: only the bare run keeps them
                keep.extend(SourceRecord(source_name(r.topic, r.partition), r.offset, r.value) for r in batch)
            if validate:
                for record in batch:
                    decode_event(record.value)
    elapsed = time.perf_counter() - start
    consumer.close()
    return n, elapsed


def store_alone(records: list[SourceRecord], root: Path) -> float:
    """Seconds for the ledger to store ``records`` with no Kafka at all (decode included), in
    batches as the ingester commits them: what a storing process fed by a reading one could reach."""
    ledger = Ledger.create(root)
    start = time.perf_counter()
    for i in range(0, len(records), COMMIT_BATCH_MAX):
        ledger.commit(records[i : i + COMMIT_BATCH_MAX], writer="bench")
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def freshness(bootstrap: str, topic: str, work: Path, rate: float, seconds: float) -> dict[str, float]:
    ledger = work / "fresh-ledger"
    proc = ingester_process(ledger, bootstrap, topic, "bench-fresh", work / "fresh.log")
    sink = KafkaSink(bootstrap, work / "fresh-spool", topic=topic)
    runs = [iter(run_events(f"fresh-{i}", int(rate * seconds) + 10, 100, 500)) for i in range(4)]
    # Warm up: the ingester has joined its group once the first event is visible.
    warm = next(runs[0])
    sink.emit(warm)
    wait_until(lambda: accepted(ledger) >= 1, 120)
    emitted: dict[tuple[str, int], float] = {}
    seen: dict[tuple[str, int], float] = {}
    done = threading.Event()

    def watch() -> None:
        reader = Reader(ledger)
        while not done.is_set() or len(seen) < len(emitted):
            q0 = time.monotonic()
            rows = reader.sql("SELECT stream, max(seq) FROM events GROUP BY stream").rows
            now = time.monotonic()
            query_times.append(now - q0)
            tops = dict(rows)
            for key in list(emitted.keys() - seen.keys()):
                if tops.get(key[0], -1) >= key[1]:
                    seen[key] = now
            if done.is_set() and time.monotonic() - done_at[0] > 30:
                break
            time.sleep(0.02)

    done_at = [0.0]
    query_times: list[float] = []
    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < seconds:
        env = next(runs[i % 4])
        i += 1
        emitted[(env.stream, env.seq)] = time.monotonic()
        sink.emit(env)
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
    done_at[0] = time.monotonic()
    done.set()
    watcher.join()
    sink.close()
    stop(proc)
    lags = [seen[k] - t for k, t in emitted.items() if k in seen]
    return {
        "events": len(emitted),
        "visible": len(lags),
        "p50_ms": percentile(lags, 0.5) * 1000,
        "p99_ms": percentile(lags, 0.99) * 1000,
        "max_ms": max(lags) * 1000,
        "query_p50_ms": percentile(query_times, 0.5) * 1000,
        "query_p99_ms": percentile(query_times, 0.99) * 1000,
        "commits": len(list((ledger / "_commits").glob("*.json"))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6000, help="steps per run")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--rate", type=float, default=300.0, help="events/s for the freshness phase")
    ap.add_argument("--fresh-seconds", type=float, default=20.0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--lake",
        action="store_true",
        help="also the ingester alone into a ledger on DuckLake (SQLite catalog)",
    )
    args = ap.parse_args()

    started = time.monotonic()
    bootstrap = os.environ.get("RUNLEDGER_KAFKA_BOOTSTRAP")
    broker = None
    if not bootstrap:
        broker = Broker(make_temp_broker_dir("bench-"))
        bootstrap = broker.start()
    work = Path(tempfile.mkdtemp(prefix="bench-kafka-"))
    figures: dict[str, Any] = {}
    try:
        tag = uuid.uuid4().hex[:8]
        topic, fresh_topic = f"bench.events.{tag}", f"bench.fresh.{tag}"
        admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic(t, args.partitions, 1) for t in (topic, fresh_topic)])
        admin.close()

        events = interleave([run_events(f"run-{i:02d}", args.steps, 100, 500) for i in range(args.runs)])
        scalars, counts = values_of(events)
        print(
            f"workload: {len(events)} events, {scalars} scalar values, {counts} expert counts "
            f"({sum(isinstance(e.data, MoeRouterStats) for e in events)} router-stats events)"
        )

        # ---- e2e: producer and ingester process running together
        ledger = work / "live"
        proc = ingester_process(ledger, bootstrap, topic, "bench-live", work / "live.log")
        sink = KafkaSink(bootstrap, work / "spool", topic=topic)
        sink.emit(events[0])
        wait_until(lambda: accepted(ledger) >= 1, 120)  # group joined, ledger created
        t0 = time.monotonic()
        for env in events[1:]:
            sink.emit(env)
        sink.close(timeout_s=120)
        t_produced = time.monotonic()
        t_done = wait_until(lambda: accepted(ledger) >= len(events), 600)
        stop(proc)
        n_visible = Reader(ledger).sql("SELECT count(*) FROM events").rows[0][0]
        assert n_visible == len(events), (n_visible, len(events))
        e2e = t_done - t0
        figures["e2e"] = {
            "seconds": e2e,
            "events_per_s": (len(events) - 1) / e2e,
            "metric_values_per_s": scalars / e2e,
            "values_incl_expert_counts_per_s": (scalars + counts) / e2e,
            "producer_events_per_s": (len(events) - 1) / (t_produced - t0),
            "producer_outages": sink.stats.outages,
        }

        # ---- ingester alone on the full topic
        st = time.monotonic()
        stats = run_ingester(
            work / "alone", bootstrap, "bench-alone", [topic], idle_timeout_s=2.0, deadletter=None
        )
        alone = time.monotonic() - st - 2.0
        assert stats.accepted == len(events)
        figures["ingester_alone"] = {
            "seconds": alone,
            "events_per_s": stats.accepted / alone,
            "metric_values_per_s": stats.metric_values / alone,
            "commits": stats.commits,
        }

        # ---- the same, into a ledger on DuckLake (issue 26)
        if args.lake:
            Ledger.create_on_lake(work / "alone-lake", f"sqlite:{work / 'alone-lake.sqlite'}").close()
            st = time.monotonic()
            stats = run_ingester(
                work / "alone-lake",
                bootstrap,
                "bench-alone-lake",
                [topic],
                idle_timeout_s=2.0,
                deadletter=None,
            )
            lake_s = time.monotonic() - st - 2.0
            assert stats.accepted == len(events)
            figures["ingester_alone_lake"] = {"seconds": lake_s, "events_per_s": stats.accepted / lake_s}

        # ---- ceiling: a bare consumer doing nothing
        kept: list[SourceRecord] = []
        bare_consume(bootstrap, topic, keep=kept)  # untimed: the records, for "storing alone"
        n, secs = bare_consume(bootstrap, topic)
        figures["bare_consumer"] = {
            "events_per_s": n / secs,
            "metric_values_per_s": scalars * n / len(events) / secs,
        }
        n, secs = bare_consume(bootstrap, topic, validate=True)
        figures["validating_consumer"] = {"events_per_s": n / secs}
        secs = store_alone(kept, work / "stored")
        figures["storing_alone"] = {"events_per_s": len(kept) / secs}
        del kept

        # ---- replay
        rs = replay(bootstrap, work / "replayed", [topic])
        assert rs.accepted == len(events)
        figures["replay"] = {
            "seconds": rs.seconds,
            "events_per_s": rs.accepted / rs.seconds,
            "metric_values_per_s": rs.metric_values / rs.seconds,
        }

        # ---- freshness
        figures["freshness"] = freshness(bootstrap, fresh_topic, work, args.rate, args.fresh_seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if broker is not None:
            broker.stop()
            shutil.rmtree(broker.dir, ignore_errors=True)

    e, a, b, r, f = (figures[k] for k in ("e2e", "ingester_alone", "bare_consumer", "replay", "freshness"))
    print(
        f"e2e producer→queryable ledger: {e['events_per_s']:,.0f} events/s, "
        f"{e['metric_values_per_s']:,.0f} metric values/s ({e['values_incl_expert_counts_per_s']:,.0f}/s "
        f"with expert counts) over {e['seconds']:.1f} s; the producer alone emitted "
        f"{e['producer_events_per_s']:,.0f} events/s ({e['producer_outages']} false outages)"
    )
    print(
        f"ingester alone (topic already full): {a['events_per_s']:,.0f} events/s, "
        f"{a['metric_values_per_s']:,.0f} metric values/s, {a['commits']} commits"
    )
    if "ingester_alone_lake" in figures:
        lk = figures["ingester_alone_lake"]
        print(
            f"ingester alone into a ledger on DuckLake (SQLite catalog): {lk['events_per_s']:,.0f} events/s "
            f"({lk['events_per_s'] / a['events_per_s']:.0%} of the part-file ingester, "
            f"{lk['events_per_s'] / b['events_per_s']:.0%} of the bare consumer)"
        )
    v = figures["validating_consumer"]
    print(
        f"bare kafka-python consumer (ceiling): {b['events_per_s']:,.0f} events/s "
        f"(≙ {b['metric_values_per_s']:,.0f} metric values/s); the ingester reached "
        f"{a['events_per_s'] / b['events_per_s']:.0%} of it"
    )
    print(
        f"the same consumer validating each record and storing nothing: {v['events_per_s']:,.0f} events/s "
        f"({v['events_per_s'] / b['events_per_s']:.0%} of the bare consumer)"
    )
    print(
        f"the ledger storing the records the bare consumer read, with no Kafka at all (decode included, "
        f"batches of {COMMIT_BATCH_MAX:,}): {figures['storing_alone']['events_per_s']:,.0f} events/s "
        f"({figures['storing_alone']['events_per_s'] / b['events_per_s']:.0%} of the bare consumer): the most "
        f"a reading process feeding a storing one could reach"
    )
    print(
        f"ledger replay: {r['metric_values_per_s']:,.0f} metric values/s, {r['events_per_s']:,.0f} events/s "
        f"over {r['seconds']:.1f} s"
    )
    print(
        f"freshness at {args.rate:g} events/s: p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms, "
        f"max {f['max_ms']:.0f} ms ({f['visible']}/{f['events']} events seen; {f['commits']} commits; "
        f"the polling query itself took p50 {f['query_p50_ms']:.0f} ms, p99 {f['query_p99_ms']:.0f} ms)"
    )
    print(f"total bench time {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
