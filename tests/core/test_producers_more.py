"""Issue 16, second part: the registry survives a replay's way back in (export/read with the points of
the log it was made at), ``ledger verify`` judges every stored producer event again under the
registry of its commit, the ``authenticated`` mark, and each source's chain head kept with the
commit record (exactly once, across reopen and a crash). Real keys, real Parquet, real ledgers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger import admission, registry
from runledger.ledger.integrity import Problem, verify_ledger
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import Envelope, encode_event, make_event
from runledger.schemas.payloads import (
    Annotation,
    PolicyChanged,
    ProducerRevoked,
    ProducerScope,
)
from runledger.schemas.signing import GENESIS
from tests.support.producers import SOURCE, Keys, commit, metric


def note(text: str, *, source: str = "people/ann") -> Envelope:
    return make_event(Annotation(author="ann", text=text), source=source, stream="r", run_id="r", seq=0)


def _event_problems(problems: list[Problem], edited: Path) -> list[Problem]:
    """The problems that name events, once the lake's own check of the edited data file is seen
    among the others: a lake records each data file's checksum, so an edit is named twice."""
    files = [p for p in problems if p.event_id is None]
    assert files and all(edited.name in p.detail for p in files), [p.line() for p in files]
    return [p for p in problems if p.event_id is not None]


def rows(root: Path) -> list[dict]:
    """Every stored event row (id, type, authenticated, commit), in commit order."""
    reader = Reader(root)
    try:
        return reader.sql(
            'SELECT "commit", ingest_position, id, type, authenticated FROM events ORDER BY "commit", ingest_position'
        ).records()
    finally:
        reader.close()


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys", "trainer")


@pytest.fixture
def registered(tmp_path: Path, keys: Keys) -> Ledger:
    ledger = Ledger.create(tmp_path / "ledger")
    registry.register_producer(ledger, "trainer", keys.public, ProducerScope(sources=["trainer/"]))
    return ledger


# ------------------------------------------------------------------------------ authenticated mark


def test_each_row_says_how_admission_let_it_in(tmp_path: Path, keys: Keys) -> None:
    ledger = Ledger.create(tmp_path / "ledger")
    before = note("before any registry")
    assert commit(ledger, [before]) == {}
    registry.register_producer(ledger, "trainer", keys.public, ProducerScope(sources=["trainer/"]))
    registry.append_registry_event(ledger, PolicyChanged(unsigned_sources=["people/"]))
    signed, unsigned = keys.sealer().seal(metric(0)), note("let in by the policy")
    assert commit(ledger, [signed, unsigned]) == {}
    marks = {r["id"]: r["authenticated"] for r in rows(ledger.root)}
    assert (marks[before.id], marks[signed.id], marks[unsigned.id]) == (None, True, False)
    assert verify_ledger(ledger.root).ok


# ------------------------------------------------------------------------------ ledger verify


def test_verify_judges_every_producer_event_under_the_registry_of_its_commit(
    registered: Ledger, keys: Keys
) -> None:
    """A revoked key's earlier events still verify; nothing in the log is a false alarm."""
    sealer = keys.sealer()
    assert commit(registered, [sealer.seal(metric(i)) for i in range(3)]) == {}
    registry.append_registry_event(registered, ProducerRevoked(key_id=sealer.key_id, reason="leaked"))
    assert commit(registered, [sealer.seal(metric(3))]) != {}  # refused at ingest
    report = verify_ledger(registered.root)
    assert report.ok, [p.line() for p in report.problems]
    assert report.events == 2 + 3  # two registry events, three metrics


def test_verify_names_an_event_that_ingest_should_have_refused(
    registered: Ledger, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator whose ingest let a changed event in (here: admission switched off for one commit)
    writes a self-consistent log: the Merkle checks pass, the producer check does not."""
    sealer = keys.sealer(chain=False)
    good = sealer.seal(metric(0))
    altered = msgspec.structs.replace(sealer.seal(metric(1)), step=7)  # changed after signing
    mallory = Keys(registered.root.parent / "mallory", "trainer").sealer(chain=False).seal(metric(2))
    monkeypatch.setattr(admission, "authenticate", lambda *_: admission.SIGNED_IN)
    assert commit(registered, [good, altered, mallory]) == {}
    monkeypatch.undo()
    report = verify_ledger(registered.root)
    lines = [p.line() for p in report.problems]
    assert [(p.kind, p.event_id) for p in report.problems] == [
        ("producer", altered.id),
        ("producer", mallory.id),
    ], lines
    assert f"event {altered.id} (#1): bad-signature: bad signature for key {sealer.key_id}" in lines[0]
    assert f"unknown-key: signed by {mallory.key_id}, not a registered producer key" in lines[1]


def test_verify_names_an_edited_authenticated_mark(tmp_path: Path, registered: Ledger) -> None:
    """The mark is not in the leaf; verify recomputes it, so setting it to true in the Parquet (to
    hide "unauthenticated" from every answer) is caught and names the event."""
    registry.append_registry_event(registered, PolicyChanged(unsigned_sources=["people/"]))
    unsigned = note("unsigned, by policy")
    assert commit(registered, [unsigned]) == {}
    [path] = [
        p
        for p in (registered.root / "data" / "main" / "events").rglob("*.parquet")
        if unsigned.id in pq.read_table(p, columns=["id"]).column("id").to_pylist()
    ]
    table = pq.read_table(path)
    i = table.schema.get_field_index("authenticated")
    table = table.set_column(i, "authenticated", pa.array([True] * table.num_rows, pa.bool_()))
    pq.write_table(table, path)
    report = verify_ledger(registered.root)
    problems = _event_problems(report.problems, path)
    assert [(p.kind, p.event_id) for p in problems] == [("producer", unsigned.id)]
    assert "column authenticated is True, admission under the registry says False" in problems[0].detail


def test_verify_names_a_signature_changed_in_the_parquet(registered: Ledger, keys: Keys) -> None:
    sealer = keys.sealer()
    events = [sealer.seal(metric(i)) for i in range(2)]
    assert commit(registered, events) == {}
    [path] = [
        p
        for p in (registered.root / "data" / "main" / "events").rglob("*.parquet")
        if events[1].id in pq.read_table(p, columns=["id"]).column("id").to_pylist()
    ]
    table = pq.read_table(path)
    texts = table.column("canonical").to_pylist()
    sig = events[1].signature or ""
    forged = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    texts = [t.replace(sig, forged) for t in texts]
    table = table.set_column(table.schema.get_field_index("canonical"), "canonical", pa.array(texts))
    pq.write_table(table, path)
    report = verify_ledger(registered.root)
    # Named as changed (and its metric rows no longer what its recorded bytes say).
    assert [(p.kind, p.event_id) for p in _event_problems(report.problems, path)] == [
        ("modified", events[1].id),
        ("table-mismatch", events[1].id),
    ]


def test_a_ledger_without_a_registry_verifies_as_before(tmp_path: Path, keys: Keys) -> None:
    ledger = Ledger.create(tmp_path / "plain")
    assert commit(ledger, [metric(0), keys.sealer().seal(metric(1))]) == {}
    assert verify_ledger(ledger.root).ok


# ------------------------------------------------------------------------------ registry export


def test_the_registry_is_exported_with_the_points_of_the_log_it_was_made_at(
    tmp_path: Path, registered: Ledger, keys: Keys
) -> None:
    sealer = keys.sealer()
    assert commit(registered, [sealer.seal(metric(i)) for i in range(2)]) == {}
    registry.append_registry_event(registered, PolicyChanged(unsigned_sources=["people/"]))
    out = tmp_path / "registry.jsonl"
    result = CliRunner().invoke(
        app, ["producers", "export", "--out", str(out), "--ledger", str(registered.root)]
    )
    assert result.exit_code == 0 and result.output == f"wrote 2 registry events to {out}\n", result.output
    entries = registry.read_registry(out)
    assert [(e.position, e.after) for e in entries] == [(0, {}), (1, {"spool:test": 2})]
    assert entries == registry.read_registry(registered.root)  # the ledger itself reads the same
    # Committed again at those points into a new ledger, the registry's tree is the same.
    copy = Ledger.create(tmp_path / "copy")
    for entry in entries:
        records = [SourceRecord(admission.REGISTRY_INGEST, entry.position, entry.raw)]
        assert copy.commit(records).accepted == 1
    assert copy.stream_heads()["ledger:registry"].tree.root() == (
        registered.stream_heads()["ledger:registry"].tree.root()
    )


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"position": 0}',
        '{"position": "x", "after": {}, "event": "{}"}',
        json.dumps({"position": 0, "after": {}, "event": encode_event(note("x")).decode()}),
        "[" * 5000,
    ],
)
def test_a_bad_registry_file_is_one_clear_error(tmp_path: Path, line: str) -> None:
    path = tmp_path / "registry.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=r"registry.jsonl:1: not a registry"):
        registry.read_registry(path)


# ------------------------------------------------------------------------------ chain heads kept


def test_chain_heads_are_kept_with_the_commit_record_and_read_on_open(
    tmp_path: Path, registered: Ledger, keys: Keys
) -> None:
    sealer = keys.sealer()
    first = [sealer.seal(metric(i)) for i in range(3)]
    assert commit(registered, first) == {}
    record = registered.read_commit(registered.last_commit)
    saved = record["admission"]
    assert saved["heads"][SOURCE][0] == 2 and saved["registry"] is True
    assert [k["name"] for k in saved["keys"]] == ["trainer"]
    # The saved state is what scanning the whole events table finds (for the chained sources: the
    # scan also lists heads of sources that keep no chain, which admission never reads).
    scanned = admission.scan_state(registered, registered.last_commit)
    loaded = admission.load_state(Ledger.open(registered.root))
    assert (loaded.heads, loaded.keys.keys(), loaded.registry) == (
        {SOURCE: scanned.heads[SOURCE]},
        scanned.keys.keys(),
        scanned.registry,
    )
    # Opening reads the record, not the events: without the event files it still knows the heads.
    bare = tmp_path / "bare"
    shutil.copytree(registered.root, bare)
    for path in (bare / "data" / "main" / "events").rglob("*.parquet"):
        path.unlink()
    assert admission.load_state(Ledger.open(bare)).heads == loaded.heads
    # The chain continues after a reopen with no false incident; a skipped seq is a gap.
    reopened = Ledger.open(registered.root)
    assert commit(reopened, [sealer.seal(metric(3))]) == {}
    sealer.seal(metric(4))  # sealed, never sent
    assert commit(reopened, [sealer.seal(metric(5))]) == {}
    incidents = [r for r in rows(registered.root) if r["type"] == "ledger.incident"]
    assert len(incidents) == 1


_CRASH = """
import os, sys
from pathlib import Path
from runledger.ledger.lake import LakeTables
from runledger.ledger.store import Ledger, SourceRecord

root, feed, when = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
raws = [line.encode() for line in Path(sys.argv[4]).read_text().splitlines()]
real = LakeTables.commit

def crashing(self, *args, **kw):
    # killed at the commit point (the lake's transaction): before it ("before"), or right after it,
    # before the folder's copy of the record is written ("after")
    if when == "after":
        real(self, *args, **kw)
    os._exit(9)

LakeTables.commit = crashing
ledger = Ledger.open(root)
start = ledger.positions().get(feed, 0)
ledger.commit([SourceRecord(feed, start + i, raw) for i, raw in enumerate(raws)])
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_chain_heads_survive_a_crash_at_the_commit_point(
    tmp_path: Path, registered: Ledger, keys: Keys, when: str
) -> None:
    sealer = keys.sealer()
    assert commit(registered, [sealer.seal(metric(0))]) == {}
    batch = [sealer.seal(metric(i)) for i in (1, 2)]
    lines = tmp_path / "batch.jsonl"
    lines.write_text("".join(encode_event(e).decode() + "\n" for e in batch))
    died = subprocess.run(
        [sys.executable, "-c", _CRASH, str(registered.root), "spool:test", when, str(lines)],
        capture_output=True,
        timeout=120,
    )
    assert died.returncode == 9, died.stderr.decode()
    reopened = Ledger.open(registered.root)
    if when == "before":  # nothing committed: the batch again, with no fork or gap
        assert admission.load_state(reopened).heads[SOURCE][0] == 0
        assert commit(reopened, batch) == {}
    else:  # committed: the heads moved with it, exactly once
        assert admission.load_state(reopened).heads[SOURCE][0] == 2
    assert commit(reopened, [sealer.seal(metric(3))]) == {}
    kept = rows(registered.root)
    assert [r["type"] for r in kept].count("runledger.step.metrics") == 4
    assert "ledger.incident" not in {r["type"] for r in kept}
    assert verify_ledger(registered.root).ok


def test_a_ledger_from_before_the_saved_state_opens_and_scans_once(registered: Ledger, keys: Keys) -> None:
    sealer = keys.sealer()
    assert commit(registered, [sealer.seal(metric(0))]) == {}
    for path in registered.commit_paths():  # records as an older runledger wrote them
        record = json.loads(path.read_bytes())
        record.pop("admission", None)
        path.write_text(json.dumps(record))
    reopened = Ledger.open(registered.root)
    assert admission.load_state(reopened).heads[SOURCE][0] == 0  # scanned
    assert commit(reopened, [sealer.seal(metric(1))]) == {}
    assert "admission" in reopened.read_commit(reopened.last_commit)  # saved from then on
    assert verify_ledger(registered.root).ok


def test_a_gap_and_its_incident_are_the_same_bytes_when_met_again(tmp_path: Path, keys: Keys) -> None:
    """Incidents take their cause's time: a replay that meets the same gap writes the same leaf."""
    sealer = keys.sealer()
    events = [sealer.seal(metric(i)) for i in range(4)]
    roots = []
    for name in ("a", "b"):
        ledger = Ledger.create(tmp_path / name, ledger_id="same")
        registry.register_producer(ledger, "trainer", keys.public, ProducerScope(sources=["trainer/"]))
        assert commit(ledger, [events[0], events[3]]) == {}
        roots.append(ledger.stream_heads()["r"].tree.root())
    assert events[0].prev == GENESIS
    assert roots[0] == roots[1]


def test_verify_names_an_edited_commit_column(registered: Ledger, keys: Keys) -> None:
    """The row's commit column is not in the leaf either (SQL filters on it): verify checks it
    against the commit log that appended the leaf."""
    event = keys.sealer().seal(metric(0))
    assert commit(registered, [event]) == {}
    [path] = [
        p
        for p in (registered.root / "data" / "main" / "events").rglob("*.parquet")
        if event.id in pq.read_table(p, columns=["id"]).column("id").to_pylist()
    ]
    table = pq.read_table(path)
    i = table.schema.get_field_index("commit")
    table = table.set_column(i, "commit", pa.array([0] * table.num_rows, pa.int64()))  # "before the registry"
    pq.write_table(table, path)
    report = verify_ledger(registered.root)
    problems = _event_problems(report.problems, path)
    assert [(p.kind, p.event_id, p.detail.split(" (")[0]) for p in problems] == [
        ("modified", event.id, "column commit differs from the commit log")
    ]
