"""Issue 16: a record under a stored event's (source, id) with other bytes is a conflict, never a silent
duplicate; an event whose stream is not the run it names is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.integrity import verify_ledger
from runledger.ledger.merkle import leaf_hash
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger, SourceRecord
from runledger.schemas import make_event
from runledger.schemas import payloads as p
from runledger.schemas.canonical import canonicalize_json
from runledger.schemas.codec import CONFLICT, STREAM_RUN_MISMATCH
from tests.support.factory import RunBuilder

runner = CliRunner()


def _run() -> RunBuilder:
    run = RunBuilder()
    run.start()
    for step in range(1, 4):
        run.step(step, loss=2.0 - step * 0.1)
    return run


def _forged(raw: bytes) -> bytes:
    """The same envelope (source, id included) with another payload: a forgery of a real event."""
    value = json.loads(raw)
    value["data"]["loss"] = 0.01
    return json.dumps(value).encode()


def _leaf_hex(raw: bytes) -> str:
    return leaf_hash(canonicalize_json(raw)).hex()


def _stored_canonical(root: Path, event_id: str) -> list[str]:
    return [r[0] for r in Reader(root).sql("SELECT canonical FROM events WHERE id = ?", [event_id]).rows]


def _quarantine(root: Path) -> list[tuple[str, str]]:
    return [tuple(r) for r in Reader(root).sql("SELECT reason, event_id FROM quarantine").rows]


def _commit(ledger: Ledger, raws: list[bytes], first: int) -> None:
    ledger.commit([SourceRecord("spool:t", first + i, raw) for i, raw in enumerate(raws)])


@pytest.mark.parametrize("when", ["same batch", "next batch", "after a restart", "by another writer"])
def test_a_forged_event_under_a_real_id_is_a_conflict_and_the_real_one_stays(
    tmp_path: Path, when: str
) -> None:
    run = _run()
    real = run.events[2]  # a step.metrics event
    forged = _forged(real)
    event_id = json.loads(real)["id"]
    root = tmp_path / "l"
    ledger = Ledger.create(root)
    other = Ledger.open(root)
    other.commit([])  # this writer has folded the (empty) ledger's ids before the real event lands
    if when == "same batch":
        result = ledger.commit(
            [SourceRecord("spool:t", i, raw) for i, raw in enumerate([*run.events, forged])]
        )
    else:
        _commit(ledger, run.events, 0)
        writer = {"next batch": ledger, "after a restart": Ledger.open(root), "by another writer": other}[
            when
        ]
        result = writer.commit([SourceRecord("spool:t", len(run.events), forged)])
    assert result.duplicates == 0
    [(_record, q)] = result.quarantined
    assert q.code == CONFLICT and q.id == event_id
    assert _stored_canonical(root, event_id) == [canonicalize_json(real).decode()]
    [(reason, quarantined_id)] = _quarantine(root)
    assert quarantined_id == event_id and reason.startswith(f"{CONFLICT}: ")
    assert _leaf_hex(real) in reason and _leaf_hex(forged) in reason  # stored and new hashes

    report = verify_ledger(root)
    assert report.ok, [pr.line() for pr in report.problems]
    [warning] = report.warnings
    assert (
        warning.startswith(f"{CONFLICT}: 1 quarantined") and f"(trainer/run-a/rank0, {event_id})" in warning
    )


def test_redelivered_identical_bytes_are_a_plain_duplicate(tmp_path: Path) -> None:
    run = _run()
    root = tmp_path / "l"
    _commit(Ledger.create(root), run.events, 0)
    # Same event, re-encoded with another key order and spacing: the same canonical bytes.
    again = json.dumps(json.loads(run.events[2]), indent=1, sort_keys=True).encode()
    result = Ledger.open(root).commit(
        [
            SourceRecord("spool:t", len(run.events), run.events[2]),
            SourceRecord("spool:t", len(run.events) + 1, again),
        ]
    )
    assert (result.accepted, result.duplicates, result.quarantined) == (0, 2, [])
    assert _quarantine(root) == []
    assert verify_ledger(root).warnings == []


def test_verify_and_query_show_conflicts_on_the_command_line(tmp_path: Path) -> None:
    run = _run()
    root = tmp_path / "l"
    _commit(Ledger.create(root), [*run.events, _forged(run.events[2])], 0)
    out = runner.invoke(app, ["verify", "--ledger", str(root)])
    assert out.exit_code == 0, out.output
    assert f"WARNING: {CONFLICT}: 1 quarantined record(s)" in out.output
    assert out.output.rstrip().splitlines()[-1].startswith("OK: ")
    out = runner.invoke(
        app,
        ["query", f"SELECT reason FROM quarantine WHERE reason LIKE '{CONFLICT}:%'", "--ledger", str(root)],
    )
    assert out.exit_code == 0 and CONFLICT in out.output


def test_make_event_refuses_a_run_event_on_another_stream() -> None:
    with pytest.raises(ValueError, match="is not the stream of run 'r'"):
        make_event(p.StepMetrics(loss=1.0), source="t", stream="q", run_id="r", attempt=1, step=1, seq=0)
    # Events without a run keep any stream: GitHub's owner/repo, a run-less annotation.
    make_event(p.Annotation(author="me", text="hi"), source="t", stream="notes", seq=0)


def test_ingest_quarantines_a_run_event_on_another_stream(tmp_path: Path) -> None:
    run = _run()
    value = json.loads(run.events[1])
    value["stream"] = "elsewhere"  # a hand-made record: make_event would refuse it
    root = tmp_path / "l"
    ledger = Ledger.create(root)
    result = ledger.commit(
        [SourceRecord("spool:t", i, raw) for i, raw in enumerate([json.dumps(value).encode()])]
    )
    [(_record, q)] = result.quarantined
    assert q.code == STREAM_RUN_MISMATCH
    [(reason, _id)] = _quarantine(root)
    assert reason.startswith(f"{STREAM_RUN_MISMATCH}: stream 'elsewhere' is not the stream of run 'run-a'")
    assert ledger.stream_heads() == {} and verify_ledger(root).ok
