"""A producer without a key keeps no hash chain, but still numbers its events one by one (``seq``): a
stretch of them that never reaches the ledger is a ``gap`` incident, as for a chained source
(``runledger.ledger.admission``), counted and shown by ``ledger state`` and ``ledger history``.

* Through the spool: a keyless trainer source whose events 10..14 never reached the bus (a producer
  that died in a bus outage with them in hand: nothing reported them) is ingested with the real
  spool ingester; the gap is one incident, across commits and a reopen too. A first event at any
  seq, a repeated or earlier seq, GitHub's constant seq 0 and the spool ingester's own
  ``bus.positions_missing`` events (numbered by bus position) are no gap.
* Through the client library on a real full disk (a tmpfs; root only, skipped otherwise): a keyless
  run's dropped events leave gaps in its seq numbers, each inside a drop report's range, and the
  gaps count every dropped event.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner

import runledger
from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger import admission
from runledger.ledger.store import Ledger
from runledger.schemas import Envelope, config_hash, make_event
from runledger.schemas.launch import Provenance, launch_event, launch_fields
from runledger.schemas.payloads import Annotation, BusPositionsMissing, StepMetrics

if TYPE_CHECKING:  # imported by pytest_plugins first, so that pytest rewrites its asserts
    from tests.support.small_fs import SmallFs

pytest_plugins = ("tests.support.small_fs",)  # the small_fs fixture

SOURCE = "trainer/keyless/a1/rank0"
runner = CliRunner()


def started(source: str = SOURCE, run: str = "keyless") -> Envelope:
    """The run's launch, its source's seq 0 (``ledger state`` answers for a run that started)."""
    fields = launch_fields(
        config={"lr": 0.1},
        config_hash=config_hash({"lr": 0.1}),
        provenance=Provenance(host="h", git_commit=None, software={}),
        repository=None,
        world_size=1,
        external={},
    )
    payload, _ = launch_event(fields, attempt=1)
    return make_event(
        payload, source=source, stream=run, run_id=run, attempt=1, step=0, seq=0, id=f"{run}-start"
    )


def metric(seq: int, source: str = SOURCE, run: str = "keyless", id: str | None = None) -> Envelope:
    return make_event(
        StepMetrics(loss=1.0 / (seq + 1)),
        source=source,
        stream=run,
        run_id=run,
        attempt=1,
        step=seq,
        seq=seq,
        id=id or f"{source}-{seq}",
    )


def spool_of(where: Path, envelopes: list[Envelope]) -> Path:
    """A real spool holding ``envelopes`` in order (the bus as the ledger reads it)."""
    sink = SpoolSink(where)
    for envelope in envelopes:
        sink.emit(envelope)
    sink.close()
    return where


def cli(ledger: Path, *args: str) -> str:
    result = runner.invoke(app, [*args, "--ledger", str(ledger)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def incidents(ledger: Path, run: str) -> list[dict[str, Any]]:
    facts: list[dict[str, Any]] = json.loads(cli(ledger, "state", run, "-f", "json"))["incidents"]
    return facts


def gap_facts(ledger: Path, run: str) -> list[tuple[str, int, int, int]]:
    return [
        (i["source"], i["count"], i["first_seq"], i["last_seq"])
        for i in incidents(ledger, run)
        if i["kind"] == "gap"
    ]


def test_a_stretch_a_keyless_producer_lost_is_a_gap_incident(tmp_path: Path) -> None:
    lost = range(10, 15)  # in the dead producer's hands when the bus went down: never sent
    sent = [started(), *(metric(seq) for seq in range(1, 21) if seq not in lost)]
    ledger = tmp_path / "ledger"
    stats = ingest_spool(Ledger.create(ledger), spool_of(tmp_path / "spool", sent))
    assert stats.accepted == len(sent) + 1  # its events, and the incident the ledger appended
    assert gap_facts(ledger, "keyless") == [(SOURCE, 5, 10, 14)]
    state = cli(ledger, "state", "keyless")
    assert f"  incident: 5 events missing (a gap) ({SOURCE})\n" in state
    history = json.loads(cli(ledger, "history", "keyless", "--all", "-f", "json"))
    said = [h["what"] for h in history if h["kind"] == "ledger.incident"]
    assert said == [f"gap in {SOURCE}: 5 events missing (seq 10–14)"]
    assert cli(ledger, "verify").startswith("OK: ")


def test_only_a_skip_past_the_highest_stored_seq_is_a_gap(tmp_path: Path) -> None:
    github = "github-test/octo/repo"
    events = [
        started(source="trainer/late/a2/rank0", run="late"),
        metric(3, source="trainer/late/a1/rank0", run="late"),  # a first event at any seq: no gap
        metric(4, source="trainer/late/a1/rank0", run="late"),
        started(),
        metric(1),
        metric(1, id="resent-1"),  # the same seq again
        metric(0, id="restarted-0"),  # an earlier seq (a restart numbering from 0 again)
        metric(2),
        *[
            make_event(Annotation(author="gh", text=f"note {i}"), source=github, stream="keyless", seq=0)
            for i in range(3)
        ],
    ]
    ledger = tmp_path / "ledger"
    ingest_spool(Ledger.create(ledger), spool_of(tmp_path / "spool", events))
    assert gap_facts(ledger, "keyless") == [] and gap_facts(ledger, "late") == []


def test_the_count_goes_on_across_commits_a_reopen_and_a_rebuilt_state(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    first = Ledger.create(ledger)
    ingest_spool(first, spool_of(tmp_path / "s1", [started(), *(metric(seq) for seq in range(1, 5))]))
    record = first.read_commit(first.last_commit)
    assert record["admission"]["seqs"][SOURCE] == 4  # kept with the commit that stored it
    # Reopened: the state comes from the commit record, and the next event past 4 + 1 is a gap.
    ingest_spool(Ledger.open(ledger), spool_of(tmp_path / "s2", [metric(7), metric(8)]))
    assert gap_facts(ledger, "keyless") == [(SOURCE, 2, 5, 6)]
    # A ledger whose record predates the count rebuilds it from the events table (scan_state).
    reopened = Ledger.open(ledger)
    scanned = admission.scan_state(reopened, reopened.last_commit)
    assert scanned.seqs[SOURCE] == 8
    old_record = reopened.read_commit(reopened.last_commit)
    del old_record["admission"]["seqs"]  # as a record written before unchained sources were counted
    assert admission.AdmissionState.from_json(old_record["admission"], old_record["commit"]).seqs == {}


def test_bus_positions_missing_are_numbered_by_position_not_counted(tmp_path: Path) -> None:
    def missing(first: int, last: int) -> Envelope:
        payload = BusPositionsMissing(
            source="spool:x", first=first, last=last, count=last - first + 1, reason="gone"
        )
        return make_event(
            payload, source="spool-ingest:x", stream="keyless", seq=last, id=f"pm-{first}-{last}"
        )

    events = [started(), missing(10, 19), metric(1), missing(50, 59), metric(2)]
    ledger = tmp_path / "ledger"
    ingest_spool(Ledger.create(ledger), spool_of(tmp_path / "spool", events))
    assert [i["kind"] for i in incidents(ledger, "keyless")] == ["positions-missing", "positions-missing"]


# -- through the client library, on a real full disk ---------------------------------------------


def _fill(fs: Path) -> Path:
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for _ in range(1000):  # 300 KB in 4 KB writes at most
            try:
                handle.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return filler
    raise AssertionError(f"{fs} never filled up")


def _wait_for(condition: Any, what: str) -> None:
    for _ in range(200):  # 10 s at most
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_keyless_runs_dropped_events_are_gaps_in_its_seq_numbers(
    small_fs: SmallFs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runledger")
    for key in ("RUNLEDGER_PRODUCER_KEY", "RUNLEDGER_KAFKA_BOOTSTRAP", "RANK", "WORLD_SIZE", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    spool = small_fs(300) / "spool"
    monkeypatch.setenv("RUNLEDGER_SPOOL", str(spool))
    monkeypatch.setenv("RUNLEDGER_STATE", str(tmp_path / "state"))
    run = runledger.init("keyless-disk", queue_size=32, outage_wait_s=0.2, handle_signals=False)
    for step in range(20):
        assert run.log({"loss": float(step)}, step=step)
    filler = _fill(spool.parent)
    step = 20
    while run.log({"loss": float(step)}, step=step) and step < 5000:  # until the bus refuses
        step += 1
        time.sleep(0.0005)
    for at in range(step + 1, step + 40):  # the bus is down: dropped and counted
        run.log({"loss": float(at)}, step=at)
    filler.unlink()
    _wait_for(lambda: run.log({"loss": -1.0}, step=step + 40), "the bus to take events again")
    run.finish()
    assert run.dropped > 0

    ledger = tmp_path / "ledger"
    ingest_spool(Ledger.create(ledger), spool)
    facts = incidents(ledger, "keyless-disk")
    gaps = [f for f in facts if f["kind"] == "gap"]
    reports = [f for f in facts if f["kind"] == "dropped"]
    assert sum(g["count"] for g in gaps) == run.dropped  # every dropped event's seq is a gap
    for gap in gaps:  # and each gap is a stretch a report says was lost
        assert any(r["first_seq"] <= gap["first_seq"] <= gap["last_seq"] <= r["last_seq"] for r in reports)
    assert all(g["source"] == "trainer/keyless-disk/a1/rank0" for g in gaps)
