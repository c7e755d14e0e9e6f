"""The examples under examples/ run as a user runs them; the ledger answers with what they logged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.client.ledger_support import cli_json, ingest, metric_series

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_example(name: str, env: dict[str, str], cwd: Path, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_numpy_example(client_env: dict[str, str], tmp_path: Path) -> None:
    printed = _run_example("numpy_loop.py", client_env, tmp_path, "--steps", "40", "--run-id", "np-ex")
    steps, end = printed[:-1], printed[-1]
    assert end == {"run_id": "np-ex", "attempt": 1} and len(steps) == 40
    ledger = tmp_path / "ledger"
    ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]))
    series = metric_series(ledger, "np-ex")
    for name in ("loss", "grad_norm", "lr", "eval/w_err"):
        assert series[name] == {s["step"]: s[name] for s in steps}, name
    assert cli_json(ledger, "state", "np-ex", "--step", "25")["config"]["lr"] == 0.05
    state = cli_json(ledger, "state", "np-ex", "--step", "26")
    assert state["config"]["lr"] == 0.02 and state["config"]["optimizer"] == {"name": "sgd", "momentum": 0.0}
    assert [a["text"] for a in state["annotations"]] == ["lr lowered by hand"]


def test_pytorch_example(client_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("torch")
    checkpoints = tmp_path / "ck"
    checkpoints.mkdir()
    args = ("--steps", "20", "--run-id", "torch-ex", "--checkpoint-dir", str(checkpoints))
    printed = _run_example("torch_loop.py", client_env, tmp_path, *args)
    steps = printed[:-1]
    assert printed[-1] == {"run_id": "torch-ex", "attempt": 1} and len(steps) == 20
    ledger = tmp_path / "ledger"
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    ingest(ledger, spool)
    series = metric_series(ledger, "torch-ex")
    for name in ("loss", "grad_norm", "lr"):
        assert series[name] == {s["step"]: s[name] for s in steps}, name
    state = cli_json(ledger, "state", "torch-ex", "--step", "11")
    assert state["config"]["lr"] == 0.01 and state["last_checkpoint"]["path"] == str(
        checkpoints / "step10.pt"
    )
    layers = cli_json(
        ledger,
        "query",
        "SELECT count(*) AS n, max(len(expert_counts)) AS experts, bool_and(tokens = 64) AS full "
        "FROM moe_layer_stats WHERE run_id = 'torch-ex'",
    )
    assert layers == [{"n": 40, "experts": 4, "full": True}]
    ranks = cli_json(ledger, "query", "SELECT count(*) AS n FROM rank_stats WHERE run_id = 'torch-ex'")
    assert ranks == [{"n": 20}]
