"""Producer identity (signed envelopes, a registry kept in the log) and order (seq + hash chain) at
ingest: ``runledger.ledger.admission``, with real keys, a real spool and a real ledger."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger import admission, registry
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.verifier import verify_producer_signature
from runledger.schemas import Envelope, Event, decode_event, encode_event, make_event
from runledger.schemas.payloads import (
    Annotation,
    PolicyChanged,
    ProducerRevoked,
    ProducerRotated,
    ProducerScope,
    StepMetrics,
)
from runledger.schemas.signing import GENESIS, Sealer
from runledger.trainer.telemetry import Emitter
from tests.support.producers import SOURCE, Keys, commit, metric


def stored(root: Path) -> list[dict]:
    """Every stored event (canonical JSON, decoded), in commit order."""
    reader = Reader(root)
    try:
        texts = reader.sql('SELECT canonical FROM events ORDER BY "commit", ingest_position').rows
    finally:
        reader.close()
    return [json.loads(text) for (text,) in texts]


@pytest.fixture
def trainer_keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys", "trainer")


@pytest.fixture
def registered(tmp_path: Path, trainer_keys: Keys) -> Ledger:
    ledger = Ledger.create(tmp_path / "ledger")
    registry.register_producer(ledger, "trainer", trainer_keys.public, ProducerScope(sources=["trainer/"]))
    return ledger


def test_forged_event_with_a_real_id_from_an_unregistered_key_is_quarantined_and_the_real_one_lands(
    tmp_path: Path, registered: Ledger, trainer_keys: Keys
) -> None:
    real = trainer_keys.sealer().seal(metric(0, loss=1.0))
    mallory = Keys(tmp_path / "mallory", "trainer")  # same name, other key: another key id
    forged = mallory.sealer().seal(metric(0, id=real.id, loss=99.0))
    unsigned = metric(0, id=real.id, loss=98.0)
    assert forged.id == real.id and forged.key_id != real.key_id
    # The forgeries arrive first: with dedupe by (source, id) alone, the forgery would have won.
    start = registered.positions().get("spool:test", 0)
    records = [
        SourceRecord("spool:test", start + i, encode_event(e)) for i, e in enumerate([forged, unsigned, real])
    ]
    result = registered.commit(records)
    assert [q.code for _, q in result.quarantined] == ["unknown-key", "unsigned"]
    assert result.accepted == 1
    [event] = [e for e in stored(registered.root) if e["type"] == "runledger.step.metrics"]
    assert (event["id"], event["data"]["loss"], event["key_id"]) == (real.id, 1.0, real.key_id)
    verify_producer_signature(
        json.dumps(event, sort_keys=True, separators=(",", ":")).encode(), trainer_keys.public
    )


def test_bad_signature_out_of_scope_and_reserved_types_are_quarantined_with_distinct_reasons(
    tmp_path: Path, registered: Ledger, trainer_keys: Keys
) -> None:
    sealer = trainer_keys.sealer(chain=False)
    good = sealer.seal(metric(0))
    altered = msgspec.structs.replace(sealer.seal(metric(1)), step=7)  # changed after signing
    other_source = sealer.seal(metric(0, source="importer/wandb"))
    # A registry event on the bus: whoever can write to the topic must not register a key.
    sneaky = make_event(
        ProducerRevoked(key_id=good.key_id or ""),
        source=admission.REGISTRY_INGEST,
        stream=admission.REGISTRY_STREAM,
        seq=9,
    )
    refused = commit(registered, [good, altered, other_source, sneaky])
    assert refused == {altered.id: "bad-signature", other_source.id: "out-of-scope", sneaky.id: "reserved"}
    # The sneaky revocation changed nothing: the key still signs.
    assert commit(registered, [sealer.seal(metric(2))]) == {}


def test_policy_lets_named_sources_in_unsigned(registered: Ledger) -> None:
    annotation = make_event(
        Annotation(author="ann", text="hi"), source="people/ann", stream="r", run_id="r", seq=0
    )
    assert commit(registered, [annotation]) == {annotation.id: "unsigned"}
    registry.append_registry_event(registered, PolicyChanged(unsigned_sources=["people/"]))
    again = msgspec.structs.replace(annotation, id=uuid.uuid4().hex)
    assert commit(registered, [again]) == {}


def test_a_ledger_without_a_registry_admits_unsigned_and_signed_events_as_before(
    tmp_path: Path, trainer_keys: Keys
) -> None:
    ledger = Ledger.create(tmp_path / "plain")
    assert commit(ledger, [metric(0), trainer_keys.sealer().seal(metric(1))]) == {}
    assert registry.producers(ledger).registry is False


def test_revoked_keys_later_events_are_refused_while_its_earlier_ones_still_verify(
    registered: Ledger, trainer_keys: Keys
) -> None:
    sealer = trainer_keys.sealer()
    early = [sealer.seal(metric(i)) for i in range(2)]
    assert commit(registered, early) == {}
    registry.append_registry_event(registered, ProducerRevoked(key_id=sealer.key_id, reason="leaked"))
    late = sealer.seal(metric(2))
    assert commit(registered, [late]) == {late.id: "revoked-key"}
    # A fresh process (state rebuilt from the log) refuses it too.
    assert commit(Ledger.open(registered.root), [sealer.seal(metric(3))]) != {}
    kept = [e for e in stored(registered.root) if e["type"] == "runledger.step.metrics"]
    assert [e["id"] for e in kept] == [e.id for e in early]
    for event in kept:
        canonical = decode_event(json.dumps(event).encode())
        assert isinstance(canonical, Event)
        assert verify_producer_signature(canonical.canonical, trainer_keys.public) == sealer.key_id


def test_dropped_events_appear_as_a_gap_incident_with_the_count(
    tmp_path: Path, registered: Ledger, trainer_keys: Keys
) -> None:
    class GatedSpool(SpoolSink):
        """A real spool whose first emit waits, so the emitter's queue fills and it must drop."""

        def __init__(self, directory: Path, sealer: Sealer) -> None:
            super().__init__(directory, sealer=sealer)
            self.gate = threading.Event()

        def emit(self, envelope: Envelope) -> None:
            self.gate.wait(10)
            super().emit(envelope)

    sink = GatedSpool(tmp_path / "spool", trainer_keys.sealer())
    emitter = Emitter(sink, source=SOURCE, stream="r", run_id="r", attempt=1, queue_size=2)
    emitter.submit(StepMetrics(loss=0.0), step=0)
    time.sleep(0.05)  # the thread takes step 0 and waits in emit: two more fit in the queue
    accepted = [emitter.submit(StepMetrics(loss=float(step)), step=step) for step in range(1, 11)]
    assert sum(accepted) == 2 and emitter.dropped == 8
    sink.gate.set()
    assert emitter.close()
    emitter.submit(StepMetrics(loss=1.0), step=99)  # closed: refused, not counted
    sink.close()

    stats = ingest_spool(Ledger.open(registered.root), tmp_path / "spool")
    assert stats.quarantined == 0
    events = stored(registered.root)
    [incident] = [e for e in events if e["type"] == "ledger.incident"]
    assert incident["data"] | {"expected_prev": None, "got_prev": None, "event_id": None} == {
        "kind": "gap",
        "source": SOURCE,
        "expected_seq": 3,
        "got_seq": 11,
        "missing": 8,
        "expected_prev": None,
        "got_prev": None,
        "event_id": None,
    }
    # The chain is whole across the gap: the producer dropped before sealing, so prev links the
    # event after the gap to the last one it sent.
    assert incident["data"]["expected_prev"] == incident["data"]["got_prev"]
    assert (incident["stream"], incident["run_id"], incident["source"]) == (
        "r",
        "r",
        admission.INCIDENT_INGEST,
    )
    [dropped] = [e for e in events if e["type"] == "runledger.producer.dropped"]
    assert dropped["data"] | {"reason": None} == {
        "count": 8,
        "first_step": 3,
        "last_step": 10,
        "first_seq": 3,
        "last_seq": 10,
        "reason": None,
    }
    assert dropped["seq"] == 11 and dropped["key_id"] == trainer_keys.sealer().key_id


def test_a_fork_is_recorded_and_never_blocks(registered: Ledger, trainer_keys: Keys) -> None:
    sealer = trainer_keys.sealer()
    first = [sealer.seal(metric(i)) for i in range(3)]
    assert first[0].prev == GENESIS and first[1].prev != GENESIS
    other = trainer_keys.sealer().seal(metric(0, loss=5.0))  # a second producer reusing the source
    assert commit(registered, [*first, other]) == {}
    # Reopened (state from the log): the chain continues where it was, with no false incident.
    assert commit(Ledger.open(registered.root), [sealer.seal(metric(3))]) == {}
    incidents = [e["data"] for e in stored(registered.root) if e["type"] == "ledger.incident"]
    assert [(i["kind"], i["expected_seq"], i["got_seq"], i["missing"]) for i in incidents] == [
        ("fork", 3, 0, 0)
    ]


def test_a_retried_emit_keeps_its_place_in_the_chain(trainer_keys: Keys) -> None:
    sealer = trainer_keys.sealer()
    event = metric(0)
    assert sealer.seal(event).prev == sealer.seal(event).prev == GENESIS
    assert sealer.seal(metric(1)).prev != GENESIS


def test_the_trainers_sink_signs_with_the_key_named_by_the_environment(
    tmp_path: Path, trainer_keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runledger.ingest.spool import SpoolReader
    from runledger.schemas.signing import PRODUCER_KEY_ENV
    from runledger.trainer.telemetry import open_rank_sink

    key_file = tmp_path / "producer.key"
    key_file.write_text(trainer_keys.private)
    monkeypatch.setenv(PRODUCER_KEY_ENV, str(key_file))
    monkeypatch.delenv("RUNLEDGER_KAFKA_BOOTSTRAP", raising=False)
    sink = open_rank_sink(tmp_path / "spool", rank=0)
    for seq in range(2):
        sink.emit(metric(seq))
    sink.close()
    decoded = [decode_event(r.payload) for r in SpoolReader(tmp_path / "spool").read()]
    assert all(isinstance(e, Event) for e in decoded)
    first, second = (e.envelope for e in decoded if isinstance(e, Event))
    assert first.prev == GENESIS and second.prev is not None and second.prev != GENESIS
    for event in decoded:
        assert isinstance(event, Event)
        verify_producer_signature(event.canonical, trainer_keys.public)


def test_rotation_refuses_the_old_key_and_admits_the_new_one_with_the_same_scope(
    tmp_path: Path, registered: Ledger, trainer_keys: Keys
) -> None:
    new = Keys(tmp_path / "new", "trainer")
    old_id = trainer_keys.sealer().key_id
    new_id = new.sealer().key_id
    registry.append_registry_event(
        registered, ProducerRotated(old_key_id=old_id, public_key=new.public, key_id=new_id)
    )
    stale = trainer_keys.sealer(chain=False).seal(metric(0))
    fresh = new.sealer(chain=False).seal(metric(1))
    outside = new.sealer(chain=False).seal(metric(2, source="importer/x"))
    assert commit(registered, [stale, fresh, outside]) == {
        stale.id: "revoked-key",
        outside.id: "out-of-scope",
    }


def test_the_producers_commands_write_the_registry_into_the_log(tmp_path: Path, trainer_keys: Keys) -> None:
    from typer.testing import CliRunner

    from runledger.cli.main import app

    def invoke(*args: str | Path) -> tuple[int, str]:
        result = CliRunner().invoke(app, [str(a) for a in args])
        return result.exit_code, result.output

    ledger = tmp_path / "ledger"
    Ledger.create(ledger)
    public = tmp_path / "trainer.pub"
    public.write_text(trainer_keys.public)
    key_id = trainer_keys.sealer().key_id
    code, out = invoke("producers", "list", "--ledger", ledger)
    assert code == 0 and "no registry" in out
    code, out = invoke(
        "producers", "add", "trainer", "--public-key", public, "--source", "trainer/", "--ledger", ledger
    )
    assert code == 0 and key_id in out, out
    assert invoke("producers", "policy", "--allow-unsigned", "people/", "--ledger", ledger)[0] == 0
    code, out = invoke("producers", "revoke", key_id, "--reason", "leaked", "--ledger", ledger)
    assert code == 0, out
    code, out = invoke("producers", "revoke", key_id, "--ledger", ledger)
    assert code == 1 and "already revoked" in out
    code, out = invoke("producers", "revoke", "nobody+00000000", "--ledger", ledger)
    assert code == 1 and "no producer key" in out
    code, out = invoke("producers", "list", "--ledger", ledger, "--format", "json")
    assert code == 0 and json.loads(out) == [
        {
            "key_id": key_id,
            "name": "trainer",
            "status": "revoked",
            "sources": "trainer/",
            "streams": "*",
            "types": "*",
            "valid_from": None,
            "valid_until": None,
        }
    ]
    types = [e["type"] for e in stored(ledger)]
    assert types == ["ledger.producer.registered", "ledger.policy.changed", "ledger.producer.revoked"]
    code, out = invoke(
        "producers",
        "add",
        "x",
        "--public-key",
        tmp_path / "missing.pub",
        "--source",
        "x/",
        "--ledger",
        ledger,
    )
    assert code == 1 and "Traceback" not in out
