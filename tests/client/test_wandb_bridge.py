"""``runledger.wandb.tee()`` with the real wandb (offline): W&B's own file and the ledger agree."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runledger.ingest.wandb_import import find_offline_runs, read_records
from tests.client.ledger_support import cli_json, ingest, metric_series, of_type

wandb = pytest.importorskip("wandb")
import runledger.wandb as bridge  # noqa: E402

CONFIG: dict[str, Any] = {"model": {"layers": 4, "experts": 8}, "optimizer": {"lr": 3e-4}, "seed": 7}


@pytest.fixture
def teed(wandb_dir: Path, client_env: dict[str, str]) -> Iterator[bridge.Tee]:
    tee = bridge.tee()
    try:
        yield tee
    finally:
        bridge.untee()


def _wandb_run(
    wandb_dir: Path,
) -> tuple[dict[int, dict[str, Any]], dict[str, Any], dict[str, Any], int | None]:
    """W&B's record of the run, read back with wandb's own reader: (history rows by step, final
    config, explicitly set summary keys, exit code)."""
    [wandb_file] = find_offline_runs(wandb_dir / "wandb")
    rows: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    exit_code = None
    for record in read_records(wandb_file):
        kind = str(record.get("type"))
        body = record.get(kind) or {}
        if kind == "run":
            config = {k: v for k, v in (body.get("config", {}).get("update") or {}).items() if k != "_wandb"}
        elif kind == "config":
            config.update({k: v for k, v in (body.get("update") or {}).items() if k != "_wandb"})
        elif kind == "history":
            item = body["item"]
            rows[body["step"]["num"]] = {k: v for k, v in item.items() if not k.startswith("_")}
        elif kind == "summary":
            update = body.get("update") or {}
            if "_step" not in update:  # not the automatic last-row summary
                summary.update({k: v for k, v in update.items() if not k.startswith("_")})
        elif kind == "exit":
            exit_code = body.get("exit_code", 0)
    return rows, config, summary, exit_code


def _as_ledger_value(value: Any) -> Any:
    """What the ledger holds for a value W&B recorded (a number; NaN/inf as null)."""
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
        return None
    return float(value) if isinstance(value, bool | int | float) else "not recorded"


def test_every_logged_value_lands_in_the_ledger(
    teed: bridge.Tee, wandb_dir: Path, client_env: dict[str, str], tmp_path: Path
) -> None:
    rng = random.Random(11)
    run = wandb.init(project="bridge", config=CONFIG, name="teed run")
    for step in range(60):
        loss = 4.0 * math.exp(-step / 25) + rng.gauss(0, 0.02)
        row: dict[str, Any] = {
            "loss": loss,
            "lr": 3e-4 if step < 30 else 1e-4,
            "grad_norm": np.float32(1.0 / (step + 1)),
            "router/aux_loss": 0.01 + rng.random() / 100,  # as runledger's own mirror names them
            "router/layer0/token_drop_rate": rng.random() / 10,
            "nested": {"a": {"b": step}},  # W&B flattens it: "nested.a.b"
            "trainer/events_dropped": 0,
            "is_best": step % 10 == 0,
            "text": "a string",
        }
        if step == 17:
            row["loss"] = float("nan")
        if step == 30:
            wandb.config.update({"optimizer": {"lr": 1e-4}, "schedule": "cosine"}, allow_val_change=True)
        if step % 4 == 1:  # a row assembled over several calls
            wandb.log({"eval/ppl": math.exp(loss)}, commit=False)
        wandb.log(row)
    wandb.log({"late": 1.0}, step=100)
    wandb.log({"late2": 2.0}, step=100)
    wandb.log({"refused": 3.0}, step=50)  # below W&B's current step: W&B drops it
    wandb.log({"after": 4.0})
    wandb.config.batch = 32
    run.summary["best_loss"] = 1.25
    run.summary.update({"eval/final_ppl": np.float64(3.5)})
    wandb.finish()
    assert teed.errors == 0

    rows, config, summary, exit_code = _wandb_run(wandb_dir)
    assert exit_code == 0 and len(rows) == 61 and "refused" not in str(rows)
    ledger = tmp_path / "ledger"
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    ingest(ledger, spool)
    [ledger_run] = cli_json(ledger, "runs")
    run_id = ledger_run["run_id"]
    assert run_id == run.id and ledger_run["status"] == "finished"
    series = metric_series(ledger, run_id)
    compared = 0
    for step, row in rows.items():
        for key, value in row.items():  # every value under the name it was logged with
            expected = _as_ledger_value(value)
            if expected == "not recorded":
                assert key not in series or step not in series[key], key
                continue
            # A null typed field (a NaN loss) has no row in the metrics view; a null scalar has one.
            assert series.get(key, {}).get(step) == expected, (step, key)
            compared += step in series.get(key, {})
    assert compared > 60 * 6
    [nan_step] = [
        e.data for e in of_type(Path(client_env["RUNLEDGER_SPOOL"]), "step.metrics") if e.step == 17
    ]
    assert nan_step.loss is None and 17 not in series["loss"]  # the event says null; the view has no row
    assert series["router/aux_loss"][5] == rows[5]["router/aux_loss"] and "aux_loss" not in series
    assert series["nested.a.b"][7] == 7.0 and (series["router/layer0/token_drop_rate"][3] or 0) > 0
    # Every ledger value is one W&B recorded: nothing extra (no invented ``tokens = 0`` a step).
    recorded = sum(len(v) for v in series.values())
    assert recorded == compared and "tokens" not in series

    state = cli_json(ledger, "state", run_id)
    assert (
        state["config"] == config == CONFIG | {"optimizer": {"lr": 1e-4}, "schedule": "cosine", "batch": 32}
    )
    launch = of_type(spool, "run.started")[0].data
    assert launch.config == CONFIG and launch.external["wandb_run_id"] == run.id
    summaries = of_type(spool, "run.summary")
    assert summaries[-1].data.values == summary == {"best_loss": 1.25, "eval/final_ppl": 3.5}


def test_failed_and_resumed_runs(teed: bridge.Tee, wandb_dir: Path, client_env: dict[str, str]) -> None:
    run = wandb.init(project="bridge", id="resume-me", config={"a": 1})
    wandb.log({"loss": 1.0})
    wandb.finish(exit_code=3)
    run = wandb.init(project="bridge", id="resume-me", resume="allow", config={"a": 1})
    wandb.log({"loss": 0.5})
    wandb.finish()
    assert teed.errors == 0
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    finished = of_type(spool, "run.finished")
    assert [(e.attempt, e.data.status) for e in finished] == [(1, "failed"), (2, "completed")]
    [resumed] = of_type(spool, "run.resumed")
    assert resumed.run_id == run.id == "resume-me" and resumed.data.previous_attempt == 1


def test_untee_restores_wandb(wandb_dir: Path, client_env: dict[str, str]) -> None:
    from wandb.sdk import wandb_config, wandb_summary

    def current() -> list[Any]:
        return [
            wandb.init,
            wandb.Run.__dict__["log"],
            wandb.Run.__dict__["finish"],
            wandb.Run.__dict__["define_metric"],
            *(
                wandb_config.Config.__dict__[n]
                for n in ("update", "__setitem__", "__setattr__", "setdefaults")
            ),
            wandb_summary.SummaryDict.__dict__["update"],
        ]

    before = current()
    bridge.tee()
    assert all(a is not b for a, b in zip(before, current(), strict=True))
    with pytest.raises(RuntimeError, match="active already"):
        bridge.tee()
    bridge.untee()
    assert all(a is b for a, b in zip(before, current(), strict=True))
    bridge.untee()  # a second untee is harmless
    run = wandb.init(project="bridge")  # not recorded any more
    wandb.log({"loss": 1.0})
    wandb.finish()
    assert not Path(client_env["RUNLEDGER_SPOOL"]).exists()
    assert run.id


@pytest.mark.parametrize("end", ["finish", "crash"])
def test_the_ledger_runs_own_end_sends_the_rows_it_holds(
    end: str, teed: bridge.Tee, wandb_dir: Path, client_env: dict[str, str]
) -> None:
    """What the client's atexit hook (``finish``) and its excepthook and signal handler (``crash``)
    call when the script never calls ``wandb.finish``: the held rows go first, at their steps."""
    run = wandb.init(project="bridge", config={"a": 1})
    wandb.define_metric("eval/*", step_metric="train/global_step")
    wandb.log({"train/loss": 2.0, "train/global_step": 1}, step=1)
    wandb.log({"eval/loss": 3.0, "train/global_step": 1})  # commits row 1: held for more eval
    wandb.log({"train/loss": 1.0, "train/global_step": 2}, step=2)  # not committed by W&B yet
    [side] = teed.runs.values()
    if end == "finish":
        side.ledger.finish("completed")
    else:
        side.ledger.crash(RuntimeError("the script failed"))
    wandb.finish()
    assert teed.errors == 0
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    rows = [(e.step, e.data.scalars) for e in of_type(spool, "step.metrics")]
    assert rows == [
        (1, {"train/loss": 2.0, "train/global_step": 1.0, "eval/loss": 3.0}),
        (2, {"train/loss": 1.0, "train/global_step": 2.0}),
    ]
    [ended] = of_type(spool, "run.finished") + of_type(spool, "run.crashed")
    assert ended.step == 2 and run.id == ended.run_id


def test_a_wandb_fork_is_the_ledger_lineage_of_its_parent(
    teed: bridge.Tee, wandb_dir: Path, client_env: dict[str, str], tmp_path: Path
) -> None:
    """``wandb.init(fork_from="parent?_step=20")``: the teed run's launch names its parent and the
    fork step, so ``ledger history`` of the fork tells the parent's steps up to 20, then its own."""
    parent = wandb.init(project="bridge", config=CONFIG, name="parent")
    for step in range(30):
        wandb.log({"loss": 4.0 - step / 10})
    parent_id = parent.id
    wandb.finish()
    child = wandb.init(project="bridge", config=CONFIG, fork_from=f"{parent_id}?_step=20")
    assert child.starting_step == 21
    for _ in range(10):
        wandb.log({"loss": 1.0})
    child_id = child.id
    wandb.finish()
    assert teed.errors == 0
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    launches = {e.run_id: e.data for e in of_type(spool, "run.started")}
    assert (launches[child_id].parent_run, launches[child_id].fork_step) == (parent_id, 20)
    assert launches[parent_id].parent_run is None
    ledger = tmp_path / "ledger"
    ingest(ledger, spool)
    line = cli_json(
        ledger, "query", f"SELECT member, from_step, to_step FROM lineage_of('{child_id}') ORDER BY depth"
    )
    assert [(r["member"], r["from_step"], r["to_step"]) for r in line] == [
        (parent_id, None, 20),
        (child_id, 21, None),
    ]
