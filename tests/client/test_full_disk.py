"""The client library on a full disk: a real 300 KB tmpfs under ``RUNLEDGER_SPOOL`` (mounted by the
test, which needs root; skipped with the reason otherwise). Every event that does not reach the bus
is counted (``run.dropped``), ``log`` says False for it, one warning line says the bus is down, and
a ``runledger.producer.dropped`` event reports the loss as soon as the bus takes events again: the
ledger's ``history`` and ``state`` show it, with no producer key set. A disk still full at ``finish``
leaves the report in the spool's ``pending/`` folder, and the next ingest records it (more in
tests/client/test_exit_losses.py)."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import runledger
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ledger.store import Ledger
from tests.client.ledger_support import cli_json, ingest, of_type

if TYPE_CHECKING:  # imported by pytest_plugins first, so that pytest rewrites its asserts
    from tests.support.small_fs import SmallFs

pytest_plugins = ("tests.support.small_fs",)  # the small_fs fixture


def fill(fs: Path) -> Path:
    """Take every free byte of ``fs`` with one file; returns it (delete it to give the space back)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for _ in range(1000):  # 300 KB in 4 KB writes at most
            try:
                handle.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        else:
            raise AssertionError(f"{fs} never filled up")
    return filler


def log_until_refused(run: runledger.Run, ok: dict[int, bool], first: int) -> int:
    """Log from step ``first`` on until a call is refused (the queue is full: the bus stopped taking
    events); returns the next step. Bounded: the queue holds 32 events, the spool's buffer a few more."""
    step = first
    while step < first + 5000:
        ok[step] = run.log({"loss": float(step)}, step=step)
        step += 1
        if not ok[step - 1]:
            return step
        time.sleep(0.0005)  # the emitter thread gets to write what fits
    raise AssertionError("the bus never refused an event")


def wait_for(condition: object, what: str) -> None:
    for _ in range(200):  # 10 s at most
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def bus_messages(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("runledger") and r.levelno >= logging.WARNING]


def metric_steps(ledger: Path, run_id: str) -> set[int]:
    rows = cli_json(ledger, "query", f"SELECT step FROM metrics WHERE run_id = '{run_id}' AND name = 'loss'")
    return {row["step"] for row in rows}


def test_space_back_mid_run_every_lost_event_is_counted_reported_and_shown(
    client_env: dict[str, str],
    small_fs: SmallFs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="runledger")
    fs = small_fs(300)  # KB
    spool = fs / "spool"
    monkeypatch.setenv("RUNLEDGER_SPOOL", str(spool))
    run = runledger.init("disk-1", config={"lr": 0.1}, queue_size=32, outage_wait_s=0.2, handle_signals=False)
    ok: dict[int, bool] = {}
    for step in range(20):
        ok[step] = run.log({"loss": float(step)}, step=step)
    filler = fill(fs)
    step = log_until_refused(run, ok, 20)
    wait_for(lambda: bus_messages(caplog), "the bus-down warning")
    down = range(step, step + 40)
    for at in down:  # the bus is down and the queue full: waited for (0.2 s in all), then refused
        ok[at] = run.log({"loss": float(at)}, step=at)
    assert not any(ok[at] for at in down)
    step = down[-1]
    filler.unlink()  # the space comes back: the held events go out, then the report
    wait_for(lambda: run.log({"loss": -1.0}, step=step + 1), "the bus to take events again")
    for later in range(step + 2, step + 12):
        ok[later] = run.log({"loss": float(later)}, step=later)
    run.finish()

    refused = sorted(s for s, accepted in ok.items() if not accepted)
    assert refused and run.dropped >= len(refused)
    [warning] = bus_messages(caplog)  # one line for the outage, no traceback, no error
    assert "refused an event" in warning.getMessage() and "No space left on device" in warning.getMessage()
    assert not any(r.exc_info for r in caplog.records)

    ledger = tmp_path / "ledger"
    ingest(ledger, spool)
    recorded = metric_steps(ledger, "disk-1")
    assert recorded == {s for s, accepted in ok.items() if accepted} | {step + 1}  # nothing lost silently
    assert not recorded & set(refused)
    reports = [e.data for e in of_type(spool, "producer.dropped")]
    assert sum(r.count for r in reports) == run.dropped  # every drop reported, no producer key set
    assert all(r.first_seq is not None and r.last_seq is not None and r.reason for r in reports)
    assert (
        min(r.first_step for r in reports) <= refused[0] and max(r.last_step for r in reports) >= refused[-1]
    )

    state = cli_json(ledger, "state", "disk-1")
    lost = [i for i in state["incidents"] if i["kind"] == "dropped"]
    assert sum(i["count"] for i in lost) == run.dropped
    assert state["attempt"] == 1
    history = cli_json(ledger, "history", "disk-1", "--all")
    said = [h["what"] for h in history if h["kind"] == "producer.dropped"]
    assert said and all("lost by trainer/disk-1/a1/rank0" in text for text in said)
    assert "attempt finished: completed" in [h["what"] for h in history]  # the finish was not lost


def test_disk_full_until_finish_counts_every_refused_event_in_one_warning_and_one_error(
    client_env: dict[str, str],
    small_fs: SmallFs,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="runledger")
    fs = small_fs(300)  # KB
    spool = fs / "spool"
    monkeypatch.setenv("RUNLEDGER_SPOOL", str(spool))
    run = runledger.init(
        "disk-2",
        queue_size=32,
        outage_wait_s=0.2,
        critical_timeout_s=0.5,
        flush_timeout_s=0.5,
        handle_signals=False,
    )
    filler = fill(fs)
    ok: dict[int, bool] = {}
    step = log_until_refused(run, ok, 0)
    wait_for(lambda: bus_messages(caplog), "the bus-down warning")
    for at in range(step, step + 20):
        ok[at] = run.log({"loss": float(at)}, step=at)
    run.finish()  # the bus is still down: the finish and everything queued are dropped and counted

    refused = {s for s, accepted in ok.items() if not accepted}
    queued = len(ok) - len(refused)
    # At least every refused call, the finish, and the 32 events still queued behind the held one.
    assert queued > 32 and run.dropped >= len(refused) + 1 + 32
    warning, error = bus_messages(caplog)
    assert warning.levelno == logging.WARNING and "No space left on device" in warning.getMessage()
    said = error.getMessage()
    assert error.levelno == logging.ERROR and f"{run.dropped} dropped events not reported on the bus" in said
    assert f"the report waits in {run.emitter.kept_in}" in said and run.emitter.kept_in is not None
    assert not any(r.exc_info for r in caplog.records)

    filler.unlink()
    ledger = tmp_path / "ledger"
    stats = ingest_spool(Ledger.create(ledger), spool)  # what reached the disk, and the kept report
    assert stats.quarantined == 0 and not run.emitter.kept_in.exists()
    recorded = metric_steps(ledger, "disk-2")
    assert not recorded & refused  # a refused call was never recorded
    assert cli_json(ledger, "query", "SELECT count(*) AS n FROM run_ends WHERE run_id = 'disk-2'") == [
        {"n": 0}
    ]
    # The count the bus refused at close is in the ledger: with the steps there, every accepted call.
    [lost] = [i for i in cli_json(ledger, "state", "disk-2")["incidents"] if i["kind"] == "dropped"]
    assert lost["count"] == run.dropped
    accepted = {s for s, yes in ok.items() if yes}
    started = cli_json(ledger, "query", "SELECT count(*) AS n FROM runs WHERE run_id = 'disk-2'")[0]["n"]
    assert lost["count"] == len(refused) + len(accepted - recorded) + 1 + (1 - started)  # + finish, launch
