"""Helpers for the Kafka client tests (producer, ingester, replay, sink contract): synthetic
workloads, reading a topic or a ledger back, the ``ledger`` CLI in a child process.

Plain functions and classes, no fixtures (the broker and topic fixtures are in
``tests/kafka/conftest.py``). Import from test modules: ``from tests.support.kafka_clients import ...``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition

from runledger.ledger.parquet_schemas import TABLES
from runledger.ledger.query import Reader
from runledger.schemas import Envelope, make_event
from runledger.schemas.canonical import config_hash
from runledger.schemas.payloads import (
    ChangeCause,
    ConfigChanged,
    MoeLayerStats,
    MoeRouterStats,
    PatchOp,
    RunFinished,
    RunStarted,
    StepMetrics,
)

REPO = Path(__file__).resolve().parents[2]
LEDGER_BIN = str(Path(sys.executable).parent / "ledger")  # the venv the tests run in
SCALAR_NAMES = [f"train/s{i:02d}" for i in range(12)]  # + 8 named fields ≈ 20 scalars per step


def synthetic_run(
    run_id: str,
    steps: int,
    *,
    config_every: int = 0,
    moe_every: int = 0,
    moe_layers: int = 4,
    moe_experts: int = 16,
    finish: bool = True,
) -> Iterator[Envelope]:
    """A run's events in order: start, per-step metrics, config changes, router stats, finish.

    Config changes alternate between replacing ``lr`` and adding a new key, so a change folded onto
    the wrong base config shows up as ``hash_matches = false``.
    """
    source = f"synthetic/{run_id}"
    seq = 0
    config: dict[str, Any] = {
        "model": {"layers": moe_layers, "experts": moe_experts},
        "optim": {"lr": 3e-4},
        "marks": {},
    }

    def ev(payload: Any, step: int | None) -> Envelope:
        nonlocal seq
        env = make_event(payload, source=source, stream=run_id, seq=seq, run_id=run_id, attempt=1, step=step)
        seq += 1
        return env

    yield ev(RunStarted(config=config, config_hash=config_hash(config), host="test"), 0)
    for step in range(1, steps + 1):
        yield ev(
            StepMetrics(
                loss=2.0 / step,
                grad_norm=1.0,
                lr=config["optim"]["lr"],
                tokens=4096,
                total_tokens=4096 * step,
                tokens_per_second=1e6,
                mfu=22.7,
                step_time_s=0.5,
                scalars={name: step * 0.001 + i for i, name in enumerate(SCALAR_NAMES)},
            ),
            step,
        )
        if config_every and step % config_every == 0:
            previous = config_hash(config)
            if (step // config_every) % 2:
                lr = config["optim"]["lr"] * 0.9
                ops = [PatchOp(op="replace", path="/optim/lr", value=lr)]
                config = {**config, "optim": {**config["optim"], "lr": lr}}
            else:
                ops = [PatchOp(op="add", path=f"/marks/m{step}", value=step)]
                config = {**config, "marks": {**config["marks"], f"m{step}": step}}
            yield ev(
                ConfigChanged(
                    patch=ops,
                    previous_hash=previous,
                    config_hash=config_hash(config),
                    cause=ChangeCause(kind="api", detail=f"step {step}"),
                ),
                step,
            )
        if moe_every and step % moe_every == 0:
            layers = [
                MoeLayerStats(
                    layer=layer,
                    tokens=4096,
                    top_k=8,
                    dropped=step % 7,
                    token_drop_rate=(step % 7) / (4096 * 8),
                    expert_counts=[(step * 31 + layer * 7 + e) % 997 for e in range(moe_experts)],
                    routing_entropy=3.2,
                )
                for layer in range(moe_layers)
            ]
            yield ev(MoeRouterStats(layers=layers), step)
    if finish:
        yield ev(RunFinished(status="completed"), steps)


def interleaved(runs: Sequence[Iterator[Envelope]]) -> Iterator[Envelope]:
    """Round-robin over several runs, so every partition sees several streams mixed."""
    iters = list(runs)
    while iters:
        for it in list(iters):
            try:
                yield next(it)
            except StopIteration:
                iters.remove(it)


def workload(n_runs: int, steps: int, prefix: str = "run", **kw: Any) -> list[Envelope]:
    return list(interleaved([synthetic_run(f"{prefix}-{i:02d}", steps, **kw) for i in range(n_runs)]))


# ---------------------------------------------------------------------------- reading back
def consume_topic(bootstrap: str, topic: str, *, timeout_s: float = 60.0) -> list[Any]:
    """Every record on the topic now, partition by partition (no group)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, max_poll_records=20000)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(tps)
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, "timed out reading the topic back"
            for batch in consumer.poll(timeout_ms=500).values():
                out.extend(batch)
        return out
    finally:
        consumer.close()


@dataclass
class LedgerCheck:
    events: int
    distinct: int
    streams: dict[str, int]


def check_ledger(path: Path, expected: Sequence[Envelope] | None = None) -> LedgerCheck:
    """Exactly-once and order: distinct (source, id), stream_seq gap-free, producer seq in order."""
    reader = Reader(path)
    total, distinct = reader.sql("SELECT count(*), count(DISTINCT (source, id)) FROM events").rows[0]
    assert total == distinct, f"{total - distinct} duplicate events in the ledger"
    streams: dict[str, int] = {}
    for stream, n, lo, hi, nd in reader.sql(
        "SELECT stream, count(*), min(stream_seq), max(stream_seq), count(DISTINCT stream_seq) "
        "FROM events GROUP BY stream"
    ).rows:
        assert (lo, hi, nd) == (0, n - 1, n), f"stream {stream}: stream_seq not gap-free"
        streams[stream] = n
    # Producer order within a stream: seq (per source) increases with stream_seq.
    bad = reader.sql(
        "SELECT stream, count(*) FROM (SELECT stream, seq, lag(seq) OVER (PARTITION BY stream, source "
        "ORDER BY stream_seq) AS prev FROM events) WHERE prev IS NOT NULL AND seq <= prev GROUP BY stream"
    ).rows
    assert not bad, f"events out of producer order: {bad}"
    if expected is not None:
        want: dict[str, int] = defaultdict(int)
        for env in expected:
            want[env.stream] += 1
        assert total == len(expected), f"ledger holds {total} events, expected {len(expected)}"
        assert streams == dict(want)
        ids = {r[0] for r in reader.sql("SELECT id FROM events").rows}
        assert ids == {e.id for e in expected}
    return LedgerCheck(total, distinct, streams)


def table_fingerprint(path: Path) -> dict[str, Any]:
    """What must match between a live ledger and its replay."""
    reader = Reader(path)
    out: dict[str, Any] = {
        "events": reader.sql(
            "SELECT stream, stream_seq, source, id, canonical FROM events ORDER BY stream, stream_seq"
        ).rows,
        "quarantine": reader.sql(
            "SELECT ingest_source, ingest_position, reason FROM quarantine ORDER BY 1, 2"
        ).rows,
    }
    for name in sorted(TABLES):
        if name in ("events", "quarantine"):
            continue
        physical = f"_{name}" if name in ("metrics", "moe_layer_stats") else name
        out[name] = reader.sql(
            f"SELECT stream, count(*) FROM {physical} GROUP BY stream ORDER BY stream"
        ).rows
    out["configs_content"] = reader.sql(
        "SELECT stream, stream_seq, config_hash FROM configs ORDER BY stream, stream_seq"
    ).rows
    return out


# ---------------------------------------------------------------------------- processes
class IngesterProc:
    """`ledger ingest kafka` in a child process (the real CLI), logs to a file."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._handle = open(log, "ab")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            [LEDGER_BIN, "ingest", "kafka", *args],
            stdout=self._handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})},  # SIGABRT: every thread's stack
            cwd=REPO,
        )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._handle.close()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(60)

    def wait(self, timeout: float) -> int:
        """Its exit status; past ``timeout`` it is killed (no ingester outlives its test) and
        TimeoutExpired raised, with the end of its log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                self.proc.send_signal(signal.SIGABRT)  # where it hangs, into its log (faulthandler)
                self.proc.wait(10)
            self.kill()
            exc.add_note(f"its log, last lines:\n{self.output()[-4000:]}")  # why it did not end
            raise
        finally:
            self._handle.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def ingest_args(
    ledger: Path, bootstrap: str, group: str, topic: str, *extra: str, until_idle: float | None = None
) -> list[str]:
    args = [
        "--ledger",
        str(ledger),
        "--bootstrap",
        bootstrap,
        "--group",
        group,
        "--topic",
        topic,
        "--session-timeout-ms",
        "6000",
        *extra,
    ]
    if until_idle is not None:
        args += ["--until-idle", str(until_idle)]
    return args


def run_cli(
    *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LEDGER_BIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def commit_count(ledger: Path) -> int:
    return len(list((ledger / "_commits").glob("*.json"))) if (ledger / "_commits").is_dir() else 0


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def broker_pid(broker: Any) -> int:
    return int((Path(broker.dir) / "broker.pid").read_text().split()[0])


def produce_events(bootstrap: str, topic: str, events: Sequence[Envelope], spool: Path, **kw: Any) -> Any:
    """Send through a KafkaSink and close it; returns the (closed) sink for its stats."""
    from runledger.ingest.kafka_sink import KafkaSink

    sink = KafkaSink(bootstrap, spool, topic=topic, **kw)
    for env in events:
        sink.emit(env)
    sink.close(timeout_s=60)
    assert sink.left_in_spool == 0
    return sink


def commit_summary(ledger: Path) -> tuple[int, set[str]]:
    """Events accepted so far and the writers that committed them (cheap: commit records only)."""
    accepted = 0
    writers: set[str] = set()
    for path in sorted((ledger / "_commits").glob("*.json")) if (ledger / "_commits").is_dir() else []:
        try:
            record = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue  # being renamed into place
        accepted += record["counts"]["accepted"]
        if record["counts"]["accepted"]:
            writers.add(record["writer"])
    return accepted, writers
