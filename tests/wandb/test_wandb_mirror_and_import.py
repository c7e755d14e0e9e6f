"""W&B mirror and offline-run import, with the real wandb library writing real offline runs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool import SpoolReader
from runledger.ingest.wandb_import import WandbImportError, find_offline_runs, import_offline_run
from runledger.ingest.wandb_mirror import WandbMirror
from runledger.schemas import Event, config_hash, decode_event
from tests.support.wandb_files import close_wandb_files

STEPS = 300
CHANGE_AT = 150
CONFIG: dict[str, Any] = {
    "model": {"layers": 4, "hidden": 256, "experts": 8, "top_k": 2},
    "optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]},
    "batch_tokens": 4096,
    "seed": 1234,
}


def loss_at(step: int) -> float:
    return 4.0 * math.exp(-step / 120) + 1.5 + 0.01 * math.sin(step)


def read(spool: Path) -> list[Event]:
    decoded = [decode_event(r.payload) for r in SpoolReader(spool).read()]
    assert all(isinstance(d, Event) for d in decoded), [getattr(d, "reason", "") for d in decoded]
    return decoded  # type: ignore[return-value]


def mirrored_run(
    wandb_dir: Path, run_id: str = "moe-tiny-0001", exit_code: int = 0
) -> tuple[str, dict[str, str]]:
    mirror = WandbMirror(project="runledger-tests", directory=wandb_dir)
    wandb_id, url = mirror.start(run_id, CONFIG, name="moe tiny")
    assert url is None  # offline runs have no URL
    for step in range(STEPS):
        if step == CHANGE_AT:
            mirror.config_update({"optimizer": dict(CONFIG["optimizer"], lr=1e-4), "lr_schedule": "cosine"})
        mirror.log(
            step,
            {
                "loss": loss_at(step),
                "lr": 3e-4 if step < CHANGE_AT else 1e-4,
                "grad_norm": 1.0 / (step + 1),
                "tokens": 4096,
                "total_tokens": 4096 * (step + 1),
                "mfu": 41.25,
                "moe/aux_loss": 0.01 * step,
            },
        )
    mirror.summary({"best_loss": min(loss_at(s) for s in range(STEPS)), "eval/ppl": 5.5})
    external = mirror.external
    mirror.finish(exit_code=exit_code)
    assert mirror.failures == 0
    return wandb_id, external


def test_mirror_then_import_round_trip(wandb_dir: Path, tmp_path: Path) -> None:
    wandb_id, external = mirrored_run(wandb_dir)
    assert wandb_id == "moe-tiny-0001" and external["wandb_run_id"] == wandb_id
    assert external["wandb_project"] == "runledger-tests" and "wandb_dir" in external
    [wandb_file] = find_offline_runs(wandb_dir)
    spool = tmp_path / "spool"
    sink = SpoolSink(spool)
    stats = import_offline_run(wandb_file.parent, sink)
    sink.close()
    events = [e.envelope for e in read(spool)]

    kinds = [e.type for e in events]
    assert kinds[0] == "runledger.run.started" and kinds[-2:] == [
        "runledger.run.summary",
        "runledger.run.finished",
    ]
    assert kinds.count("runledger.step.metrics") == STEPS and kinds.count("runledger.config.changed") == 1
    assert (stats.steps, stats.config_changes, stats.finished, stats.events) == (STEPS, 1, True, STEPS + 4)
    assert [e.seq for e in events] == list(range(len(events)))
    assert all(e.run_id == "moe-tiny-0001" and e.attempt == 1 and e.stream == "moe-tiny-0001" for e in events)
    assert len({(e.source, e.id) for e in events}) == len(events)

    started = events[0].data
    assert started.config == CONFIG and started.config_hash == config_hash(CONFIG)
    assert started.external["wandb_run_id"] == wandb_id and started.name == "moe tiny"
    assert started.software["wandb"]

    steps = [e for e in events if e.type == "runledger.step.metrics"]
    assert [e.step for e in steps] == list(range(STEPS))
    for e in steps[:: STEPS // 10]:
        m = e.data
        assert m.loss == loss_at(e.step) and m.grad_norm == 1.0 / (e.step + 1)
        assert (m.tokens, m.total_tokens, m.mfu) == (4096, 4096 * (e.step + 1), 41.25)
        assert m.scalars == {"moe/aux_loss": pytest.approx(0.01 * e.step)}
    assert steps[CHANGE_AT].data.lr == 1e-4 and steps[CHANGE_AT - 1].data.lr == 3e-4

    [change] = [e for e in events if e.type == "runledger.config.changed"]
    new_config = dict(CONFIG, optimizer=dict(CONFIG["optimizer"], lr=1e-4), lr_schedule="cosine")
    assert change.step == CHANGE_AT
    assert {(op.op, op.path) for op in change.data.patch} == {
        ("replace", "/optimizer"),
        ("add", "/lr_schedule"),
    }
    assert change.data.previous_hash == config_hash(CONFIG) and change.data.config_hash == config_hash(
        new_config
    )
    assert change.data.cause.kind == "api"

    summary, finished = events[-2].data, events[-1].data
    assert summary.values["eval/ppl"] == 5.5 and summary.values["best_loss"] == min(
        map(loss_at, range(STEPS))
    )
    assert not any(k.startswith("_") for k in summary.values)
    assert (finished.status, finished.final_step) == ("completed", STEPS - 1)
    assert finished.total_tokens == 4096 * STEPS


def test_importing_twice_gives_identical_events(wandb_dir: Path, tmp_path: Path) -> None:
    mirrored_run(wandb_dir, exit_code=1)
    [wandb_file] = find_offline_runs(wandb_dir)
    copies = []
    for name in ("a", "b"):
        sink = SpoolSink(tmp_path / name)
        import_offline_run(wandb_file, sink, run_id="imported-run")
        sink.close()
        copies.append([(e.envelope.source, e.envelope.id, e.canonical) for e in read(tmp_path / name)])
    assert copies[0] == copies[1]
    assert read(tmp_path / "a")[-1].envelope.data.status == "failed"


def test_odd_values_crashes_and_plain_wandb_runs(wandb_dir: Path, tmp_path: Path) -> None:
    import wandb

    run = wandb.init(
        project="plain", config={"lr": 0.1}, dir=str(wandb_dir), settings=wandb.Settings(console="off")
    )
    for step in range(20):
        run.log(
            {
                "loss": float("nan") if step == 5 else 1.0 / (step + 1),
                "inf_metric": math.inf,
                "note": "text is not a scalar",
                "nested": {"a": 1.5},
            },
            step=step,
        )
    run.finish()
    close_wandb_files()
    [wandb_file] = find_offline_runs(wandb_dir)
    sink = SpoolSink(tmp_path / "spool")
    stats = import_offline_run(wandb_file, sink)
    sink.close()
    steps = [e.envelope for e in read(tmp_path / "spool") if e.envelope.type == "runledger.step.metrics"]
    assert len(steps) == 20 and stats.skipped_values == 20  # the text, once per row
    assert steps[5].data.loss is None and steps[4].data.loss == 0.2
    assert steps[0].data.scalars == {"inf_metric": None, "nested.a": 1.5}

    # A crash: the file ends mid-run, without an exit record. Steps so far come in; no RunFinished.
    torn = tmp_path / "torn" / "run-torn.wandb"
    torn.parent.mkdir()
    data = wandb_file.read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    sink = SpoolSink(tmp_path / "torn-spool")
    stats = import_offline_run(torn, sink)
    sink.close()
    types = [e.envelope.type for e in read(tmp_path / "torn-spool")]
    assert not stats.finished and "runledger.run.finished" not in types
    assert types[0] == "runledger.run.started" and 0 < types.count("runledger.step.metrics") <= 20


def test_mirror_failures_do_not_stop_training(wandb_dir: Path) -> None:
    mirror = WandbMirror(project="runledger-tests", directory=wandb_dir)
    mirror.start("failing-mirror", {"a": 1})

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("W&B unreachable")

    mirror._run.log = broken
    mirror.log(1, {"loss": 1.0})
    mirror.log(2, {"loss": 1.0})
    assert mirror.failures == 2
    mirror.finish()
    strict = WandbMirror(project="runledger-tests", directory=wandb_dir, strict=True)
    strict.start("strict-mirror", {"a": 1})
    strict._run.log = broken
    with pytest.raises(ConnectionError):
        strict.log(1, {"loss": 1.0})
    strict.finish()


def test_what_is_not_a_wandb_run(tmp_path: Path) -> None:
    with pytest.raises(WandbImportError, match="no such directory"):
        find_offline_runs(tmp_path / "absent")
    with pytest.raises(WandbImportError, match="no W&B run"):
        find_offline_runs(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(WandbImportError, match=r"not a \.wandb file"):
        find_offline_runs(tmp_path / "notes.txt")
    garbage = tmp_path / "run-x.wandb"
    garbage.write_bytes(b"garbage, not a W&B transaction log")
    with pytest.raises(WandbImportError, match="could not read"):
        import_offline_run(garbage, SpoolSink(tmp_path / "spool"))


def test_cli_ingest_wandb(wandb_dir: Path, tmp_path: Path) -> None:
    mirrored_run(wandb_dir, run_id="cli-run")
    runner = CliRunner()
    spool = tmp_path / "spool"
    result = runner.invoke(
        app, ["ingest", "wandb", str(wandb_dir), "--run-id", "ledger-run-7", "--spool", str(spool)]
    )
    assert result.exit_code == 0, result.output
    assert {e.envelope.run_id for e in read(spool)} == {"ledger-run-7"}
    result = runner.invoke(
        app, ["ingest", "wandb", str(wandb_dir), "--run-id", "bad id!", "--spool", str(spool)]
    )
    assert result.exit_code == 2 and "run id" in result.stderr and "Traceback" not in result.output
