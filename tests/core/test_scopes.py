"""Producer scopes mean what they say: prefixes match whole path segments (``trainer/r5`` never admits
``trainer/r5-evil``), a scope can name runs, and a run's own key is kept to its run. Through
``ledger producers`` and ``ledger ingest spool`` with real keys, a real spool and a real ledger."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ledger.admission import scope_matches
from runledger.ledger.query import Reader
from runledger.ledger.registry import register_producer
from runledger.ledger.store import Ledger
from runledger.schemas import Envelope, make_event
from runledger.schemas.payloads import Annotation, StepMetrics, run_scope
from tests.support.producers import Keys


def invoke(*args: str | Path) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def metric(run: str, source: str, step: int = 0) -> Envelope:
    return make_event(
        StepMetrics(loss=1.0), source=source, stream=run, run_id=run, attempt=1, step=step, seq=step
    )


def ingest(tmp_path: Path, ledger: Path, events: list[Envelope], keys: Keys | None) -> dict[str, str]:
    """The events through a real spool and ``ledger ingest spool``; {source: quarantine code} refused."""
    spool = tmp_path / f"spool-{len(list(tmp_path.glob('spool-*')))}"
    sink = SpoolSink(spool, sealer=keys.sealer(chain=False) if keys else None)
    for event in events:
        sink.emit(event)
    sink.close()
    invoke("ingest", "spool", "--spool", spool, "--ledger", ledger)
    reader = Reader(ledger)
    try:
        quarantined = reader.sql("SELECT event_source, reason FROM quarantine").rows
    finally:
        reader.close()
    return {s: r.split(":")[0] for s, r in quarantined}  # reason: "<code>: <why>"


def stored_sources(ledger: Path) -> set[str]:
    reader = Reader(ledger)
    try:
        return {source for (source,) in reader.sql("SELECT source FROM events").rows}
    finally:
        reader.close()


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys", "trainer")


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    Ledger.create(tmp_path / "ledger")
    return tmp_path / "ledger"


def test_a_source_scope_does_not_admit_a_longer_name_beside_it(
    tmp_path: Path, ledger: Path, keys: Keys
) -> None:
    invoke(
        "producers",
        "add",
        "r5",
        "--public-key",
        keys.public_path,
        "--source",
        "trainer/r5",
        "--ledger",
        ledger,
    )
    own, evil = "trainer/r5/a1/rank0", "trainer/r5-evil/a1/rank0"
    refused = ingest(
        tmp_path, ledger, [metric("r5", own), metric("r5-evil", evil), metric("r5", "trainer/r5")], keys
    )
    assert refused == {evil: "out-of-scope"}
    assert {own, "trainer/r5"} <= stored_sources(ledger) and evil not in stored_sources(ledger)


def test_an_unsigned_source_does_not_admit_a_longer_name_beside_it(
    tmp_path: Path, ledger: Path, keys: Keys
) -> None:
    invoke(
        "producers", "add", "t", "--public-key", keys.public_path, "--source", "trainer/", "--ledger", ledger
    )
    invoke("producers", "policy", "--allow-unsigned", "trainer/unsigned", "--ledger", ledger)
    allowed, other = "trainer/unsigned/a1/rank0", "trainer/unsigned-2/a1/rank0"
    refused = ingest(tmp_path, ledger, [metric("u", allowed), metric("u2", other)], None)
    assert refused == {other: "unsigned"}
    assert allowed in stored_sources(ledger)


def test_a_scope_can_name_its_runs(tmp_path: Path, ledger: Path, keys: Keys) -> None:
    out = invoke(
        "producers",
        "add",
        "r5",
        "--public-key",
        keys.public_path,
        "--source",
        "trainer",
        "--run",
        "r5",
        "--ledger",
        ledger,
    )
    assert "runs r5" in out
    events = [
        metric("r5", "trainer/r5/a1/rank0"),
        metric("r6", "trainer/r6/a1/rank0"),
        metric("r5-x", "trainer/r5-x/a1"),
    ]
    refused = ingest(tmp_path, ledger, events, keys)
    assert refused == {"trainer/r6/a1/rank0": "out-of-scope", "trainer/r5-x/a1": "out-of-scope"}


def test_a_runs_own_key_cannot_write_into_another_run(tmp_path: Path, ledger: Path, keys: Keys) -> None:
    # What the demo registers for its trainer's key (``run_scope``): its run's sources and stream only.
    register_producer(Ledger.open(ledger), "demo-trainer", keys.public, run_scope("demo-1"))
    own = metric("demo-1", "trainer/demo-1/a1/rank0")
    other_run = metric("demo-2", "trainer/demo-2/a1/rank0")
    longer = metric("demo-10", "trainer/demo-10/a1/rank0")
    # Its own source, another stream: a run-less note there is refused by the scope's stream.
    runless = make_event(
        Annotation(author="x", text="y"), source="trainer/demo-1/a1/rank0", stream="elsewhere", seq=5
    )
    refused = ingest(tmp_path, ledger, [own, other_run, longer, runless], keys)
    assert refused == {
        "trainer/demo-2/a1/rank0": "out-of-scope",
        "trainer/demo-10/a1/rank0": "out-of-scope",
        "trainer/demo-1/a1/rank0": "out-of-scope",
    }
    assert "trainer/demo-1/a1/rank0" in stored_sources(ledger)


@pytest.mark.parametrize(
    ("value", "prefix", "covered"),
    [
        ("trainer/r5", "trainer/r5", True),
        ("trainer/r5/a1/rank0", "trainer/r5", True),
        ("trainer/r5/a1/rank0", "trainer/", True),
        ("trainer/r5-evil/a1", "trainer/r5", False),
        ("trainer/r5.1/a1", "trainer/r5", False),
        ("wandb-api:ent/proj/run", "wandb-api:", True),
        ("wandb-api:ent/proj/run", "wandb-api", True),
        ("wandb-apix:ent", "wandb-api", False),
        ("trainer/run-7/a1", "trainer/run-*", True),
        ("anything", "*", True),
        ("anything", "", False),
    ],
)
def test_scope_prefixes_cover_whole_segments(value: str, prefix: str, covered: bool) -> None:
    assert scope_matches(value, prefix) is covered


def test_type_prefixes_cover_whole_dotted_parts() -> None:
    assert scope_matches("github.issues", "github.", ".") and scope_matches("github.issues", "github", ".")
    assert not scope_matches("githubx.issues", "github", ".")
    assert not scope_matches("runledger.step.metrics", "runledger.st", ".")
