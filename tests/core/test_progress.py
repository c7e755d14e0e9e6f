"""Long work says how far it got, and a full disk or a refused server is one line (issues 24, 25).

* Progress: ``ingest spool``, ``simulate``, ``verify`` and ``ingest wandb`` print a line on stderr
  every ``$RUNLEDGER_PROGRESS_S`` seconds when stderr is not a terminal (0 here: every update), and
  ``ingest github`` against a server that refuses the connection says so in one line at once.
* A full disk: ``ingest spool`` and ``ingest wandb`` on a real 64-256 KB tmpfs mounted by the test
  (root only; skipped with the reason otherwise) end with one line naming the path, what is free and
  what to do, exit 1; once there is room again the same command completes and the ledger verifies.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.wandb_mirror import offline_environment

if TYPE_CHECKING:  # imported by pytest_plugins first, so that pytest rewrites its asserts
    from tests.support.small_fs import SmallFs

pytest_plugins = ("tests.support.small_fs",)  # the small_fs fixture

runner = CliRunner()
EVERY_UPDATE = {"RUNLEDGER_PROGRESS_S": "0"}
SMALL = ["--steps", "200", "--rank-stats-every", "100000", "--expert-counts-every", "100000"]


def _invoke(*args: str | Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args], env={"RUNLEDGER_PROGRESS_S": "off", **(env or {})})
    return result.exit_code, result.stdout, result.stderr


def _counts(stderr: str, pattern: str) -> list[tuple[int, ...]]:
    """The numbers of each stderr line that matches ``pattern`` (``{n}`` stands for a count);
    every stderr line must match it."""
    regex = re.compile("^" + pattern.replace("{n}", r"([\d,]+)") + r", [\d,]+/s, \d+ s$")
    lines = stderr.splitlines()
    assert lines, "no progress shown"
    found = []
    for line in lines:
        match = regex.match(line)
        assert match, line
        found.append(tuple(int(g.replace(",", "")) for g in match.groups()))
    return found


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """A 200-step simulated run on a spool: the spool, its event count and what simulate printed on stderr."""
    import json

    where = tmp_path_factory.mktemp("progress") / "spool"
    code, out, err = _invoke("simulate", "reference-535b", "--spool", where, *SMALL, env=EVERY_UPDATE)
    assert code == 0, err
    return where, json.loads(out)["events"], err


@pytest.fixture
def spool(simulated: tuple[Path, int, str]) -> tuple[Path, int]:
    return simulated[0], simulated[1]


def _anomalies(ledger: Path) -> int:
    """The ledger's anomaly events (``ledger.anomaly``: the simulated run's NaN crash is one)."""
    code, out, _ = _invoke(
        "query", "SELECT count(*) FROM events WHERE type = 'ledger.anomaly'", "--ledger", ledger, "-f", "csv"
    )
    assert code == 0
    found = int(out.split()[1])
    assert found > 0
    return found


def test_simulate_shows_progress(simulated: tuple[Path, int, str]) -> None:
    steps = [
        s for (s, total) in _counts(simulated[2], "simulate: {n} of {n} steps \\(\\d+%\\)") if total == 200
    ]
    assert steps == sorted(steps) and steps[-1] == 200


def test_ingest_spool_and_verify_show_progress(spool: tuple[Path, int], tmp_path: Path) -> None:
    where, events = spool
    ledger = tmp_path / "ledger"
    code, out, err = _invoke(
        "ingest", "spool", "--spool", where, "--ledger", ledger, "--batch-size", "250", env=EVERY_UPDATE
    )
    found = _anomalies(ledger)  # the run's events, and the detectors' findings in them (its NaN crash)
    assert code == 0 and out.startswith(f"ingested {events + found} events")
    read = [n for (n,) in _counts(err, "ingest spool: {n} records")]
    assert read == [min(250 * (i + 1), events) for i in range(len(read))] and read[-1] == events
    code, out, err = _invoke("verify", "--ledger", ledger, env=EVERY_UPDATE)
    assert code == 0 and out.startswith("OK: ")
    checked = _counts(err, "verify: {n} of {n} events \\(\\d+%\\)")
    total = events + found
    assert checked[-1] == (total, total) and all(n == total for _, n in checked)


def test_ingest_github_against_a_refused_connection_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on: connections to it are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    code, _, err = _invoke("ingest", "github", "octo/repo", "--base-url", url, "--spool", tmp_path / "spool")
    assert code == 1
    assert err.splitlines()[-1] == f"error: cannot reach {url}: Connection refused (ConnectionError)"
    assert "Traceback" not in err


# -- W&B ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real W&B offline run of 600 steps (three scalars a step), in its own W&B folders."""
    root = tmp_path_factory.mktemp("wandb")
    settings = offline_environment(root)
    Path(settings["WANDB_DIR"]).mkdir()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in settings.items():
            patch.setenv(key, value)
        for key in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT"):
            patch.delenv(key, raising=False)
        import wandb

        run = wandb.init(
            project="progress", dir=settings["WANDB_DIR"], settings=wandb.Settings(console="off")
        )
        for step in range(600):
            run.log({"loss": 1.0 / (step + 1), "lr": 1e-3, "grad_norm": step * 0.01}, step=step)
        run.finish()
        wandb.teardown()
        yield Path(settings["WANDB_DIR"])


def test_ingest_wandb_shows_progress(wandb_run: Path, tmp_path: Path) -> None:
    code, _, err = _invoke("ingest", "wandb", wandb_run, "--spool", tmp_path / "spool", env=EVERY_UPDATE)
    assert code == 0, err
    written = [n for (n,) in _counts(err, "ingest wandb: {n} events")]
    assert written == list(range(1, len(written) + 1)) and len(written) > 600


# -- a full disk ----------------------------------------------------------------------------------


SMALL_DISK_KB = 64  # a real tmpfs that fills at once
GROWN_KB = 16 * 1024  # room for the rerun

DISK_FULL = re.compile(
    r"^error: no space left on device writing (?P<path>\S+) \((?P<free>[\d,.]+ [KMG]?B) free of "
    r"(?P<size>[\d,.]+ [KMG]?B)\): free some space there \(or point the command at a larger disk\) "
    r"and run it again; what was stored before the disk filled is kept\n$"
)


def test_a_full_disk_under_ingest_spool_is_one_line_and_a_rerun_completes(
    spool: tuple[Path, int], small_fs: SmallFs
) -> None:
    where, events = spool
    small_disk = small_fs(SMALL_DISK_KB)
    ledger = small_disk / "ledger"
    code, _, err = _invoke("ingest", "spool", "--spool", where, "--ledger", ledger, "--batch-size", "100")
    assert code == 1
    found = DISK_FULL.match(err)
    assert found, err
    # The ledger, or the file inside it that the disk refused (the dedupe index, say).
    assert Path(found["path"]).is_relative_to(ledger) and found["size"] == "64 KB"
    small_fs.grow(small_disk, GROWN_KB)
    code, out, err = _invoke("ingest", "spool", "--spool", where, "--ledger", ledger)
    assert code == 0, err
    code, out, _ = _invoke("query", "SELECT count(*) FROM events", "--ledger", ledger, "-f", "csv")
    total = events + _anomalies(ledger)
    assert out == f"count_star()\n{total}\n"
    code, out, _ = _invoke("verify", "--ledger", ledger)
    assert code == 0 and out.startswith(f"OK: 2 streams, {total} events match")


def test_a_full_disk_under_ingest_wandb_is_one_line(wandb_run: Path, small_fs: SmallFs) -> None:
    small_disk = small_fs(SMALL_DISK_KB)
    spool = small_disk / "spool"
    code, _, err = _invoke("ingest", "wandb", wandb_run, "--spool", spool)
    assert code == 1
    found = DISK_FULL.match(err)
    assert found, err
    assert found["path"] == str(spool) and found["free"] == "0 B"
    small_fs.grow(small_disk, GROWN_KB)
    code, _, err = _invoke("ingest", "wandb", wandb_run, "--spool", small_disk / "spool-2")
    assert code == 0, err
