"""Crash capture in real processes: the crash event is in the spool when the process is gone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.client.ledger_support import cli_json, events, ingest, of_type

PRELUDE = (
    "import math, sys, time, runledger\n"
    "run = runledger.init('crash-1', config={'lr': 0.1})\n"
    "for step in range(1, 4):\n"
    "    run.log({'loss': 1.0 / step}, step=step)\n"
)


def _run(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _crash(env: dict[str, str]):  # type: ignore[no-untyped-def]
    [crash] = of_type(Path(env["RUNLEDGER_SPOOL"]), "run.crashed")
    return crash


def test_an_exception_inside_the_context_manager(client_env: dict[str, str], tmp_path: Path) -> None:
    out = _run("with run:\n    raise RuntimeError('boom at 3')\n", client_env, tmp_path)
    assert out.returncode == 1 and "RuntimeError: boom at 3" in out.stderr
    crash = _crash(client_env)
    assert (crash.step, crash.data.kind, crash.data.exc_type, crash.data.exit_code) == (
        3,
        "exception",
        "RuntimeError",
        1,
    )
    assert "boom at 3" in crash.data.traceback and crash.data.last_step == 3
    assert "runledger.run.finished" not in [e.type for e in events(Path(client_env["RUNLEDGER_SPOOL"]))]
    ledger = tmp_path / "ledger"
    ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]))
    [state_crash] = cli_json(ledger, "state", "crash-1")["crashes"]
    assert state_crash["kind"] == "exception"


def test_an_uncaught_exception_without_the_context_manager(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    out = _run("raise KeyError('missing shard')\n", client_env, tmp_path)
    assert out.returncode == 1 and "KeyError" in out.stderr  # Python's own report still happens
    crash = _crash(client_env)
    assert (crash.data.kind, crash.data.exc_type) == ("exception", "KeyError")


def test_a_script_that_never_calls_finish_is_finished_at_exit(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    out = _run("", client_env, tmp_path)
    assert out.returncode == 0, out.stderr
    [finished] = of_type(Path(client_env["RUNLEDGER_SPOOL"]), "run.finished")
    assert (finished.data.status, finished.data.final_step) == ("completed", 3)


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)]
)
def test_a_signal_is_recorded_then_does_what_it_would_have_done(
    client_env: dict[str, str], tmp_path: Path, signum: int, code: int
) -> None:
    ready = tmp_path / "ready"
    script = PRELUDE + f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n"
    # As from a terminal: a suite started in the background (nohup, `&`) hands its children SIGINT
    # ignored, and an ignored signal stays ignored (the next test).
    proc = _started(script, client_env, tmp_path, ready, _default_signals)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    # SIGTERM: the default death by the signal; SIGINT: KeyboardInterrupt, after which Python
    # itself exits by SIGINT (as it does for any uncaught KeyboardInterrupt).
    assert proc.returncode == code, stderr
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in stderr
    crash = _crash(client_env)
    assert (crash.data.kind, crash.data.signal, crash.data.exit_code) == ("signal", signum, 128 + signum)
    assert crash.data.last_step == 3


def _started(
    script: str, env: dict[str, str], cwd: Path, ready: Path, preexec: Callable[[], None]
) -> subprocess.Popen[str]:
    """The script running in a child (``preexec`` sets its signals up), once it has made ``ready``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_an_ignored_signal_stays_ignored_and_is_no_crash(client_env: dict[str, str], tmp_path: Path) -> None:
    ready, go_on = tmp_path / "ready", tmp_path / "go-on"
    script = PRELUDE + (
        f"open({str(ready)!r}, 'w').close()\n"
        f"while not __import__('os').path.exists({str(go_on)!r}):\n    time.sleep(0.05)\n"
        "run.log({'loss': 0.1}, step=4)\nrun.finish()\n"
    )

    def ignore_sigint() -> None:  # as nohup or a non-interactive shell's `&` start a process
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = _started(script, client_env, tmp_path, ready, ignore_sigint)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    go_on.touch()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    assert of_type(spool, "run.crashed") == []
    [finished] = of_type(spool, "run.finished")
    assert finished.step == 4


def test_non_finite_loss_stop_and_skip(client_env: dict[str, str], tmp_path: Path) -> None:
    code = (
        "assert run.check_finite(0.5, step=4)\n"
        "assert not run.check_finite(float('inf'), step=4, policy='skip')\n"
        "run.check_finite(math.nan, step=5)\n"
    )
    out = _run(code, client_env, tmp_path)
    assert out.returncode == 1 and "NonFiniteError: non-finite loss (nan) at step 5" in out.stderr
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    [skipped] = of_type(spool, "step.skipped")
    assert (skipped.step, skipped.data.reason, skipped.data.value) == (4, "nonfinite_loss", "inf")
    [crash] = of_type(spool, "run.crashed")  # one crash, not a second one from the excepthook
    assert (crash.data.kind, crash.data.exc_type) == ("nonfinite_loss", "NonFiniteError")


def test_a_signal_landing_inside_submit_cannot_deadlock(client_env: dict[str, str], tmp_path: Path) -> None:
    # The handler runs on the thread it interrupted: here one that holds the emitter's lock, as the
    # loop does for a moment inside every ``log``. The crash must still be recorded, then the death.
    code = "with run.emitter._seq_lock:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n"
    out = _run("import os, signal\n" + code, client_env, tmp_path)
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert (_crash(client_env).data.kind, _crash(client_env).data.signal) == ("signal", signal.SIGTERM)


def test_a_forked_worker_inherits_the_hooks_but_not_the_run(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    # A data-loader worker forked from the training process: SIGTERM kills it at once, as before
    # runledger, and records nothing (the run, its emitter thread and its seq live in the parent).
    code = (
        "import os, signal\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
        "t0 = time.monotonic()\n"
        "os.kill(child, signal.SIGTERM)\n"
        "_, status = os.waitpid(child, 0)\n"
        "print(os.WIFSIGNALED(status) and os.WTERMSIG(status), round(time.monotonic() - t0))\n"
        "run.finish()\n"
    )
    out = _run(code, client_env, tmp_path)
    assert out.returncode == 0, out.stderr
    died_by, seconds = out.stdout.split()
    # Killed by the signal, and not after the run's bounded waits (10 s and more) for a thread it lacks.
    assert int(died_by) == signal.SIGTERM and int(seconds) < 5
    assert [e.type for e in events(Path(client_env["RUNLEDGER_SPOOL"]))][-1] == "runledger.run.finished"
    assert not of_type(Path(client_env["RUNLEDGER_SPOOL"]), "run.crashed")
