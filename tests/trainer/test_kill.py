"""Kill real training processes (SIGKILL, then SIGTERM), resume, and audit the spool they wrote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runledger.schemas import Envelope
from runledger.trainer import checkpoint as ckpt
from tests.support.trainer import ROOT, assert_gap_free, data, read_spool, tiny_config_file


def _launch(config: Path, spool: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "runledger.cli.train_cmd",
        str(config),
        "--spool",
        str(spool),
        "--log-every",
        "0",
        *extra,
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _wait_for(spool: Path, proc: subprocess.Popen[bytes], pred, timeout: float = 120.0) -> list[Envelope]:
    """Poll the live spool (safe beside its writer) until ``pred`` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if spool.is_dir() and (events := read_spool(spool)) and pred(events):
            return events
        assert proc.poll() is None, f"trainer exited early ({proc.returncode})"
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out waiting for the trainer")


def _checkpoints(events: list[Envelope], attempt: int) -> list[int]:
    return [e.step for e in events if e.type == "runledger.checkpoint.saved" and e.attempt == attempt]


@pytest.mark.slow
def test_sigkill_then_sigterm_then_resume_loses_nothing(tmp_path: Path) -> None:
    config = tiny_config_file(
        tmp_path, "run.steps=1000", "checkpoint.interval=5", "debug.step_sleep_s=0.03", run_id="killed"
    )
    spool, log = tmp_path / "spool", tmp_path / "train.log"
    root = tmp_path / "ckpt"

    # Attempt 1: SIGKILL mid-run, two steps after its second checkpoint (step 10) was reported.
    proc = _launch(config, spool, log)
    _wait_for(spool, proc, lambda ev: any(e.type == "runledger.step.metrics" and e.step >= 12 for e in ev))
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    before = read_spool(spool)
    on_disk = ckpt.latest_step(root)
    assert on_disk is not None and on_disk >= max(_checkpoints(before, 1))

    # Attempt 2: resume, then SIGTERM: it checkpoints at the step boundary and records the signal.
    # Which step it lands on is timing; the assertions below hold for any (an interval step or not:
    # test_loop.py delivers the signal at both on purpose).
    proc = _launch(config, spool, log, "--resume")
    _wait_for(spool, proc, lambda ev: len(_checkpoints(ev, 2)) >= 1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    after_term = read_spool(spool)

    # Attempt 3: resume from the checkpoint of attempt 2's last step, and SIGTERM it once it runs.
    proc = _launch(config, spool, log, "--resume")
    events = _wait_for(
        spool, proc, lambda ev: any(e.type == "runledger.run.resumed" and e.attempt == 3 for e in ev)
    )
    signal_step = [e.step for e in after_term if e.attempt == 2 and e.type == "runledger.checkpoint.saved"][
        -1
    ]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    events = read_spool(spool)

    # Nothing that reached the spool before a kill is lost, and every source is gap-free.
    ids = {e.id for e in events}
    assert {e.id for e in before} <= ids and {e.id for e in after_term} <= ids
    seqs = assert_gap_free(events)
    assert set(seqs) == {f"trainer/killed/a{a}/rank0" for a in (1, 2, 3)}

    # Lineage: attempt 2 resumed from the newest checkpoint on disk at the kill, attempt 3 from the
    # checkpoint written on SIGTERM.
    started = [e for e in events if e.type == "runledger.run.started"]
    resumed = {e.attempt: e for e in events if e.type == "runledger.run.resumed"}
    assert [e.attempt for e in started] == [1]
    assert resumed[2].step == data(resumed[2])["from_checkpoint_step"] == on_disk
    assert data(resumed[2])["previous_attempt"] == 1
    assert (
        data(resumed[3])["from_checkpoint_step"] == signal_step and data(resumed[3])["previous_attempt"] == 2
    )
    assert data(resumed[2])["config_hash"] == data(started[0])["config_hash"]

    # Attempt 2 ended with the checkpoint of its last step, then its crash event, durably. The
    # crash records the signal; the checkpoint's reason is why it was written (docs/trainer.md): on
    # an interval step its interval checkpoint was written before the stop, and is not written or
    # recorded a second time; on any other step a "signal" checkpoint is.
    tail = [e for e in after_term if e.attempt == 2][-2:]
    assert [e.type for e in tail] == ["runledger.checkpoint.saved", "runledger.run.crashed"]
    crash = data(tail[1])
    assert (crash["kind"], crash["signal"], crash["exit_code"]) == ("signal", 15, 143)
    assert crash["last_step"] == signal_step == tail[0].step and crash["rank"] == 0 and crash["host"]
    on_interval = signal_step % 5 == 0
    assert data(tail[0])["reason"] == ("interval" if on_interval else "signal")
    assert ("already saved (interval checkpoint" in crash["message"]) == on_interval
    assert _checkpoints(after_term, 2).count(signal_step) == 1
    # Attempt 1 was SIGKILLed: no crash event could be written, and none was invented.
    assert not [e for e in events if e.attempt == 1 and e.type == "runledger.run.crashed"]
    # The superseded steps of attempt 1 are kept, beside attempt 2's re-run of them.
    a1_steps = {e.step for e in events if e.attempt == 1 and e.type == "runledger.step.metrics"}
    a2_steps = {e.step for e in events if e.attempt == 2 and e.type == "runledger.step.metrics"}
    assert a1_steps == set(range(1, max(a1_steps) + 1)) and min(a2_steps) == on_disk + 1
    assert max(a1_steps) >= 12 and on_disk >= 10 and on_disk % 5 == 0
    superseded = {s for s in a1_steps if s > on_disk}
    assert superseded <= a2_steps  # the same steps, trained twice, both recorded
    if on_disk == 10:  # the usual case: the kill came two or more steps after that checkpoint
        assert {11, 12} <= superseded


@pytest.mark.slow
def test_a_fork_sigkilled_before_its_own_first_checkpoint_resumes_from_its_origin(tmp_path: Path) -> None:
    """SIGKILL a fork between its fork step and its first checkpoint of its own: its attempt was
    registered before it trained, so ``--resume`` finds it a fork and goes on from the checkpoint it
    forked from (step 4), not from step 0, and every event the killed attempt spooled is kept."""
    config = tiny_config_file(
        tmp_path, "run.steps=40", "checkpoint.interval=4", "debug.step_sleep_s=0.03", run_id="hero"
    )
    spool, log = tmp_path / "spool", tmp_path / "train.log"
    parent = _launch(config, spool, log, "--set", f"checkpoint.dir={tmp_path / 'hero'}", "--stop-at", "5")
    assert parent.wait(timeout=300) == 0, log.read_text()
    origin = ckpt.step_dir(tmp_path / "hero", 4)
    fork_dir = tmp_path / "hero-lr2"
    args = ("--run-id", "hero-lr2", "--set", f"checkpoint.dir={fork_dir}", "--set", "checkpoint.interval=100")
    proc = _launch(config, spool, log, *args, "--fork-from", str(origin))

    def trained_past_the_fork(events: list[Envelope]) -> bool:
        return any(
            e.run_id == "hero-lr2" and e.type == "runledger.step.metrics" and (e.step or 0) >= 7
            for e in events
        )

    _wait_for(spool, proc, trained_past_the_fork)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not list(fork_dir.glob("step_*"))
    resumed = _launch(config, spool, log, *args, "--resume", "--stop-at", "9")
    assert resumed.wait(timeout=300) == 0, log.read_text()
    events = [e for e in read_spool(spool) if e.run_id == "hero-lr2"]
    [again] = [e for e in events if e.type == "runledger.run.resumed"]
    assert (again.attempt, again.data.from_checkpoint_step) == (2, 4)
    assert again.data.checkpoint_path == str(origin)
    assert_gap_free(events)
    steps = [e.step for e in events if e.type == "runledger.step.metrics" and e.attempt == 2]
    assert steps and steps[0] == 5 and steps[-1] == 9
