"""Issue 16: `ledger replay --registry-from` keeps the producer registry and policy (they are never on
a topic), so a replayed ledger admits every record as the live one did, lists the same producers and
verifies against checkpoints signed before the replay."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from runledger.ingest.kafka_ingester import run_ingester
from runledger.ledger import registry
from runledger.ledger.lake import LAKE_MARKER
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas import make_event
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import Annotation, PolicyChanged, ProducerRevoked, ProducerScope, StepMetrics
from runledger.schemas.signing import Sealer
from tests.support.kafka_clients import produce_events, run_cli

SOURCE = "trainer/r/a1/rank0"


def _metric(step: int):
    return make_event(
        StepMetrics(loss=1.0 / (step + 1)),
        source=SOURCE,
        stream="r",
        run_id="r",
        attempt=1,
        step=step,
        seq=step,
    )


def _note(i: int):
    return make_event(
        Annotation(author="ann", text=f"note {i}"), source="people/ann", stream="r", run_id="r", seq=i
    )


def _admission(root: Path) -> tuple[dict[str, bool | None], list[tuple[str, str]]]:
    """{stored event id: authenticated} and sorted (event id, quarantine reason) of a ledger."""
    reader = Reader(root)
    marks = {str(i): a for i, a in reader.sql("SELECT id, authenticated FROM events").rows}
    refused = sorted((str(i), str(r)) for i, r in reader.sql("SELECT event_id, reason FROM quarantine").rows)
    return marks, refused


def test_a_replayed_ledger_keeps_the_registry_and_admits_the_same_way(
    kafka_broker, make_topic, tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    private, public = write_keypair(tmp_path / "keys", "trainer")
    trainer = Sealer(private.read_text())
    mallory = Sealer(write_keypair(tmp_path / "mallory", "trainer")[0].read_text())
    live = tmp_path / "live"
    spool = tmp_path / "spool"

    sent = 0

    def send(envelopes: list) -> None:
        nonlocal sent
        produce_events(kafka_broker.bootstrap, topic, envelopes, spool)
        sent += len(envelopes)

    def ingest() -> None:
        """Until the live ledger holds every record sent so far (a loaded machine can make one
        ingester run go idle early): each registry event must come after exactly these records."""
        deadline = time.monotonic() + 120

        def read() -> int:
            if not (live / LAKE_MARKER).exists():
                return 0
            return sum(n for s, n in Ledger.open(live).positions().items() if s.startswith("kafka:"))

        while read() < sent:
            assert time.monotonic() < deadline, "the live ingester did not catch up"
            run_ingester(live, kafka_broker.bootstrap, "live", [topic], idle_timeout_s=3, deadletter=None)

    # Before any registry: unsigned notes are admitted unchecked.
    send([*[trainer.seal(_metric(i)) for i in range(5)], _note(0)])
    ingest()
    ledger = Ledger.open(live)
    registry.register_producer(ledger, "trainer", public.read_text(), ProducerScope(sources=["trainer/"]))
    # Registered, no policy yet: an unsigned note and a forgery are refused, signed metrics land.
    send([*[trainer.seal(_metric(i)) for i in range(5, 10)], _note(1), mallory.seal(_metric(10))])
    ingest()
    registry.append_registry_event(ledger, PolicyChanged(unsigned_sources=["people/"]))
    send([trainer.seal(_metric(11)), _note(2)])
    ingest()
    registry.append_registry_event(ledger, ProducerRevoked(key_id=trainer.key_id, reason="rotated out"))
    send([trainer.seal(_metric(12))])
    ingest()

    log_private, log_public = write_keypair(tmp_path / "log", "log")
    signed = sign_checkpoints(live, log_private.read_text().strip())  # published before the replay
    marks, refused = _admission(live)
    assert sorted(r.split(":")[0] for _, r in refused) == ["revoked-key", "unknown-key", "unsigned"]
    assert sorted(v for v in marks.values() if v is not None) == [False] + [True] * 6
    export = tmp_path / "registry.jsonl"
    out = run_cli("producers", "export", "--out", str(export), "--ledger", str(live))
    assert out.returncode == 0 and out.stdout == f"wrote 3 registry events to {export}\n", (
        out.stdout + out.stderr
    )

    for name, registry_from in (("from-ledger", live), ("from-file", export)):
        target = tmp_path / name
        out = run_cli(
            "replay",
            "--bootstrap",
            kafka_broker.bootstrap,
            "--topic",
            topic,
            "--to",
            str(target),
            "--ledger-id",
            ledger.ledger_id,
            "--registry-from",
            str(registry_from),
        )
        assert out.returncode == 0 and "; 3 registry events kept" in out.stdout, out.stdout + out.stderr
        assert _admission(target) == (marks, refused), name
        listed = [
            run_cli("producers", "list", "--ledger", str(root), "--format", "json") for root in (live, target)
        ]
        assert listed[0].returncode == 0 and json.loads(listed[0].stdout) == json.loads(listed[1].stdout)
        shutil.copytree(live / "_checkpoints", target / "_checkpoints")
        verified = run_cli("verify", "--ledger", str(target), "--public-key", str(log_public))
        assert verified.returncode == 0 and verified.stdout.startswith("OK: "), (
            verified.stdout + verified.stderr
        )
        assert f"{len(signed)} signed checkpoints checked" in verified.stdout

    # Without the registry the replay is another ledger: everything admitted, nothing checked.
    bare = tmp_path / "bare"
    out = run_cli("replay", "--bootstrap", kafka_broker.bootstrap, "--topic", topic, "--to", str(bare))
    assert out.returncode == 0 and _admission(bare)[1] == []
