"""`ledger verify --keys DIR` and `ledger checkpoint --keys DIR` on a folder of several keys, and a
killed verify's scratch folder.

A folder like the demo's holds the log key (``demo``) and the trainer's producer key
(``demo-trainer``): each key file is named after its key, each checkpoint names its signer, so the
right key is found by name and key hash, never guessed from the file order. A checkpoint that no
key tried signed is reported as that (which key signed it, which were tried), never as tampering;
a producer key of the ledger is never accepted as its log key.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.integrity import SPILL_PREFIX
from runledger.ledger.log_checkpoint import note_signers
from runledger.ledger.registry import register_producer
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.stream_checkpoints import sign_checkpoints
from runledger.schemas.note import write_keypair
from runledger.schemas.payloads import ProducerScope
from tests.support.factory import RunBuilder

runner = CliRunner()
TAMPER_WORDS = ("FAILED", "rewritten", "truncated", "invalid signature", "modified")


def _ledger(root: Path, steps: int = 6) -> Ledger:
    run = RunBuilder()
    run.start()
    for step in range(1, steps + 1):
        run.step(step)
    ledger = Ledger.create(root)
    ledger.commit([SourceRecord("spool:t", i, raw) for i, raw in enumerate(run.events)])
    return ledger


@pytest.fixture
def demo_like(tmp_path: Path) -> tuple[Path, Path]:
    """The demo's layout: ledger/ and keys/ with demo.{key,pub} (log) and demo-trainer.{key,pub}
    (the trainer's producer key, registered in the ledger); checkpoints signed with the log key."""
    keys = tmp_path / "keys"
    log_private, _ = write_keypair(keys, "demo")
    _, producer_public = write_keypair(keys, "demo-trainer")
    ledger = _ledger(tmp_path / "ledger")
    register_producer(
        ledger, "demo-trainer", producer_public.read_text(), ProducerScope(sources=["trainer/"])
    )
    sign_checkpoints(ledger.root, log_private.read_text())
    return ledger.root, keys


def _verify(*args: str | Path) -> tuple[int, str]:
    result = runner.invoke(app, ["verify", *(str(a) for a in args)])
    return result.exit_code, result.output


def test_verify_with_the_demos_own_keys_folder_is_ok(demo_like: tuple[Path, Path]) -> None:
    ledger, keys = demo_like
    code, out = _verify("--ledger", ledger, "--keys", keys)
    assert code == 0, out
    assert "OK:" in out and "2 signed checkpoints checked" in out, out


def test_a_folder_without_the_log_key_says_which_keys_were_tried_not_tampering(
    demo_like: tuple[Path, Path], tmp_path: Path
) -> None:
    ledger, keys = demo_like
    other = tmp_path / "other"
    write_keypair(other, "mallory")
    (other / "demo-trainer.pub").write_bytes((keys / "demo-trainer.pub").read_bytes())
    for how in (["--keys", other], ["--public-key", other / "mallory.pub"]):
        code, out = _verify("--ledger", ledger, *how)
        assert code == 1, out
        assert not any(word in out for word in TAMPER_WORDS), out
        signer = note_signers((ledger / "_checkpoints" / "run-a.txt").read_text())[0]
        assert signer.startswith("demo+") and signer in out, out  # which key signed it
        assert "mallory+" in out and "NOT VERIFIED" in out and "no tampering found" in out, out
        assert str(other / "mallory.pub") in out  # which key files were tried


def test_a_checkpoint_signed_with_a_producer_key_is_refused_as_the_logs(
    demo_like: tuple[Path, Path],
) -> None:
    ledger, keys = demo_like
    sign_checkpoints(ledger, (keys / "demo-trainer.key").read_text())  # a trainer's key holder re-signs
    code, out = _verify("--ledger", ledger, "--keys", keys)
    assert code == 1, out
    assert "a producer key of this ledger, not a log key" in out, out


def test_checkpoint_in_the_demos_keys_folder_signs_with_the_log_key(demo_like: tuple[Path, Path]) -> None:
    ledger, keys = demo_like
    (ledger / "_checkpoints" / "run-a.txt").unlink()  # as if never signed: no earlier signer to follow
    done = runner.invoke(app, ["checkpoint", "--ledger", str(ledger), "--keys", str(keys)])
    assert done.exit_code == 0, done.output
    signer = note_signers((ledger / "_checkpoints" / "run-a.txt").read_text())
    assert len(signer) == 1 and signer[0].startswith("demo+"), signer
    assert _verify("--ledger", ledger, "--keys", keys)[0] == 0


def test_checkpoint_with_two_unknown_keys_asks_which_in_one_line(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "ledger").root
    keys = tmp_path / "keys"
    write_keypair(keys, "lab-a")
    write_keypair(keys, "lab-b")
    done = runner.invoke(app, ["checkpoint", "--ledger", str(ledger), "--keys", str(keys)])
    lines = [line for line in done.output.splitlines() if line.strip()]
    assert done.exit_code != 0 and len(lines) == 1, done.output
    assert "lab-a.key" in lines[0] and "lab-b.key" in lines[0] and "--name" in lines[0]
    assert not (ledger / "_checkpoints" / "run-a.txt").exists()
    named = runner.invoke(
        app, ["checkpoint", "--ledger", str(ledger), "--keys", str(keys), "--name", "lab-b"]
    )
    assert named.exit_code == 0, named.output
    assert note_signers((ledger / "_checkpoints" / "run-a.txt").read_text())[0].startswith("lab-b+")
    # Later checkpoints follow the key that signed before, without --name.
    again = runner.invoke(app, ["checkpoint", "--ledger", str(ledger), "--keys", str(keys)])
    assert again.exit_code == 0, again.output


# --------------------------------------------------------------------------------------------------
# A killed verify leaves no scratch folder behind


def _spills(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{SPILL_PREFIX}*"))


def test_a_killed_verify_leaves_no_scratch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _ledger(tmp_path / "ledger", steps=800)  # long enough a verify to be caught in
    ledger = made.root
    made.close()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    # A process of its own whose temp folder is ``scratch`` (a fork of this one would inherit its
    # DuckDB state: a child that garbage-collects a parent's connection crashes).
    proc = subprocess.Popen(
        [sys.executable, "-m", "runledger.cli.main", "verify", "--ledger", str(ledger)],
        env={**os.environ, "TMPDIR": str(scratch)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not _spills(scratch) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _spills(scratch), "the verify ended before its scratch folder was seen"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _spills(scratch)  # SIGKILL runs no clean-up: the folder is there until the next verify
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code, out = _verify("--ledger", ledger)
    assert code == 0, out
    assert _spills(scratch) == []


def test_a_running_verifys_scratch_folder_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runledger.ledger.integrity import sweep_dead_spills

    live = tmp_path / f"{SPILL_PREFIX}{os.getppid()}-abc"  # a live process's (pytest's parent)
    live.mkdir()
    mine = tmp_path / f"{SPILL_PREFIX}{os.getpid()}-def"  # another verify of this very process
    mine.mkdir()
    other = tmp_path / f"{SPILL_PREFIX}x"  # not named by a process: not a verify's of this code
    other.mkdir()
    assert sweep_dead_spills(tmp_path) == []
    assert live.exists() and mine.exists() and other.exists()
