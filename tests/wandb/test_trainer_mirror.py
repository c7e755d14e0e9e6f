"""The trainer's W&B mirror, end to end with the real wandb library in offline mode.

The trainer (tiny CPU MoE) mirrors to W&B while it emits to a spool; the spool goes into one ledger,
the offline W&B run is imported into a second ledger, and the two must tell the same story.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from runledger.ingest.bus import SpoolSink
from runledger.ingest.spool_ingester import ingest_spool
from runledger.ingest.wandb_import import find_offline_runs, import_offline_run
from runledger.ingest.wandb_mirror import WandbMirror
from runledger.ledger.query import Reader
from runledger.ledger.store import Ledger
from runledger.schemas import Envelope, config_hash
from runledger.trainer import mirror as mirror_lib
from runledger.trainer.config import resolved
from runledger.trainer.loop import schedule_config_change, train
from tests.support.trainer import ROOT, read_spool, tiny_config, tiny_config_file

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*:UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore:.*:DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore:.*:DeprecationWarning:torch"),
]

STEP_FIELDS = ("loss", "grad_norm", "lr", "tokens", "total_tokens", "tokens_per_second", "mfu", "step_time_s")


def to_ledger(spool: Path, root: Path) -> Reader:
    """The spool folded into a new ledger, and a reader of it (as every command reads it)."""
    ingest_spool(Ledger.create(root), spool)
    return Reader(root)


def series(reader: Reader, run_id: str, name: str) -> list[tuple[int, float]]:
    rows = reader.sql(
        "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? ORDER BY step", [run_id, name]
    ).rows
    return [(int(step), value) for step, value in rows]


def externals(reader: Reader, run_id: str) -> list[tuple[int, str, dict[str, str]]]:
    rows = reader.sql(
        "SELECT attempt, kind, external FROM attempts WHERE run_id = ? ORDER BY attempt", [run_id]
    ).rows
    return [(attempt, kind, json.loads(external)) for attempt, kind, external in rows]


def imported(run_dir: str | Path, spool: Path) -> list[Envelope]:
    sink = SpoolSink(spool)
    import_offline_run(run_dir, sink)
    sink.close()
    return read_spool(spool)


def integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def test_trained_run_round_trips_through_wandb(wandb_dir: Path, tmp_path: Path) -> None:
    config = tiny_config_file(tmp_path, "run.steps=10", "moe.capacity_factor=1.0", run_id="mirrored")
    mirror = WandbMirror(project="runledger-tests", directory=wandb_dir)
    assert isinstance(mirror, mirror_lib.Mirror)  # the trainer's protocol, without importing wandb
    sink = SpoolSink(tmp_path / "spool")
    change = {"optimizer.lr": 1e-3, "moe.capacity_factor": 0.5}
    result = train(
        config,
        sink,
        mirror=mirror,
        progress=schedule_config_change(config, 6, change),
        handle_signals=False,
    )
    sink.close()
    assert (result.status, result.final_step, mirror.failures) == ("completed", 10, 0)

    # Ledger 1, from the trainer: its launch records the W&B run.
    trained = to_ledger(tmp_path / "spool", tmp_path / "ledger-trained")
    [(attempt, kind, external)] = externals(trained, "mirrored")
    assert (attempt, kind) == (1, "start") and external == result.external
    assert external["wandb_run_id"] == "mirrored" and external["wandb_project"] == "runledger-tests"
    assert Path(external["wandb_dir"]).parent == wandb_dir / "wandb"

    # Ledger 2, from W&B's offline files alone.
    [wandb_file] = find_offline_runs(external["wandb_dir"])
    events = imported(wandb_file.parent, tmp_path / "spool-wandb")
    from_wandb = to_ledger(tmp_path / "spool-wandb", tmp_path / "ledger-wandb")

    for name in STEP_FIELDS:  # every step's metrics, as the trainer computed them
        ours = series(trained, "mirrored", name)
        assert [s for s, _ in ours] == list(range(1, 11)), name
        assert series(from_wandb, "mirrored", name) == ours, name
    # Router stats: W&B's run-level keys are the ledger's step scalars; per-layer ones its layer rows.
    for wandb_name, ledger_name in [
        ("router/token_drop_rate", "token_drop_rate"),
        ("router/aux_loss", "aux_loss"),
        ("router/z_loss", "z_loss"),
        ("router/entropy", "routing_entropy"),
    ]:
        assert series(from_wandb, "mirrored", wandb_name) == series(trained, "mirrored", ledger_name)
    layers = trained.sql(
        "SELECT step, layer, token_drop_rate, aux_loss FROM moe_layer_stats "
        "WHERE run_id = 'mirrored' ORDER BY step, layer"
    ).rows
    assert {layer for _, layer, _, _ in layers} == {0, 1}
    for layer in (0, 1):
        mine = [(s, d) for s, n, d, _ in layers if n == layer]
        assert series(from_wandb, "mirrored", f"router/layer{layer}/token_drop_rate") == mine
        mine = [(s, a) for s, n, _, a in layers if n == layer]
        assert series(from_wandb, "mirrored", f"router/layer{layer}/aux_loss") == mine
    assert any(rate > 0 for _, rate in series(trained, "mirrored", "token_drop_rate"))  # drops happen

    # The config at launch and after the live change (at the same step), as the trainer resolved it.
    # wandb's reader gives an integral float back as an int (1.0 → 1), so compare modulo that.
    configs = (
        "SELECT coalesce(step, 0), cause, config FROM configs WHERE run_id = 'mirrored' ORDER BY stream_seq"
    )
    our_configs = [(step, cause, json.loads(c)) for step, cause, c in trained.sql(configs).rows]
    their_configs = [(step, cause, json.loads(c)) for step, cause, c in from_wandb.sql(configs).rows]
    assert [(step, cause) for step, cause, _ in our_configs] == [(0, "start"), (6, "file_edit")]
    assert [(step, cause) for step, cause, _ in their_configs] == [(0, "start"), (6, "api")]
    for (_, _, mine), (_, _, logged) in zip(our_configs, their_configs, strict=True):
        assert logged.keys() == mine.keys()
        assert config_hash(integral_floats_as_ints(logged)) == config_hash(integral_floats_as_ints(mine))
    assert result.config is not None and our_configs[-1][2] == resolved(result.config)
    assert (
        our_configs[-1][2]["moe"]["capacity_factor"] == their_configs[-1][2]["moe"]["capacity_factor"] == 0.5
    )
    accepted = "SELECT count(*) FROM config_changes WHERE run_id = 'mirrored' AND hash_matches"
    assert trained.sql(accepted).rows == from_wandb.sql(accepted).rows == [(1,)]

    # The end: finished with exit code 0, and the summary the trainer wrote.
    ends = "SELECT status, total_tokens FROM run_ends WHERE run_id = 'mirrored'"
    assert from_wandb.sql(ends).rows == trained.sql(ends).rows == [("completed", result.total_tokens)]
    summary = next(e.data.values for e in events if e.type == "runledger.run.summary")
    assert summary["status"] == "completed" and summary["final_step"] == 10
    assert summary["total_tokens"] == result.total_tokens and summary["exit_code"] == 0


def test_resume_continues_the_same_wandb_run(wandb_dir: Path, tmp_path: Path) -> None:
    config = tiny_config_file(
        tmp_path, "run.steps=8", "checkpoint.interval=3", "debug.crash_at_step=5", run_id="resumed"
    )
    spool = tmp_path / "spool"
    outcomes = []
    for attempt in (1, 2):
        sink = SpoolSink(spool)
        result = train(
            config,
            sink,
            resume_from="latest" if attempt == 2 else None,
            mirror=WandbMirror(project="runledger-tests", directory=wandb_dir),
            handle_signals=False,
        )
        sink.close()
        outcomes.append((result.status, result.exit_code, result.start_step, result.final_step))
    assert outcomes == [("crashed", 1, 0, 4), ("completed", 0, 3, 8)]

    ledger = to_ledger(spool, tmp_path / "ledger")
    launches = externals(ledger, "resumed")
    assert [(attempt, kind) for attempt, kind, _ in launches] == [(1, "start"), (2, "resume")]
    first, second = (external for _, _, external in launches)
    assert first["wandb_run_id"] == second["wandb_run_id"] == "resumed"
    assert first["wandb_project"] == second["wandb_project"] == "runledger-tests"
    assert first["wandb_dir"] != second["wandb_dir"]  # offline, each attempt writes its own file

    # The crashed attempt still finished its W&B run, with the crash's exit code and summary.
    crashed = imported(first["wandb_dir"], tmp_path / "spool-a1")
    finished = crashed[-1].data
    assert (finished.status, finished.final_step) == ("failed", 4)
    summary = crashed[-2].data.values
    assert (summary["status"], summary["crash_kind"], summary["exit_code"]) == ("crashed", "exception", 1)
    resumed = imported(second["wandb_dir"], tmp_path / "spool-a2")
    steps = [e.step for e in resumed if e.type == "runledger.step.metrics"]
    assert steps == [4, 5, 6, 7, 8] and resumed[-1].data.status == "completed"
    assert [e.data.loss for e in resumed if e.type == "runledger.step.metrics"] == [
        v for _, v in series(ledger, "resumed", "loss")[3:]
    ]


class ExplodingMirror:
    """A mirror whose start fails, noisily, with a secret in its message."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.calls: list[str] = []

    def start(
        self, run_id: str, config: Any, *, name: str | None = None, fork: tuple[str, int] | None = None
    ) -> tuple[str, str | None]:
        self.calls.append("start")
        raise ConnectionError(f"cannot reach W&B\n  with api_key={self.secret}\n  (key {self.secret})")

    @property
    def external(self) -> dict[str, str]:
        return {}

    def log(self, step: int, values: Any) -> None:
        self.calls.append("log")

    def config_update(self, values: Any) -> None:
        self.calls.append("config_update")

    def summary(self, values: Any) -> None:
        self.calls.append("summary")

    def finish(self, exit_code: int = 0) -> None:
        self.calls.append("finish")


def test_a_mirror_that_cannot_start_does_not_stop_training(
    wandb_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The real WandbMirror with a mode wandb refuses: trains anyway, and the ledger says why.
    sink = SpoolSink(tmp_path / "spool")
    cfg = tiny_config(tmp_path, "run.steps=3", run_id="no-wandb")
    with caplog.at_level("WARNING", logger="runledger.trainer.mirror"):
        result = train(cfg, sink, mirror=WandbMirror(mode="bogus", directory=wandb_dir), handle_signals=False)
    sink.close()
    assert (result.status, result.final_step) == ("completed", 3)
    [(attempt, _, external)] = externals(to_ledger(tmp_path / "spool", tmp_path / "ledger"), "no-wandb")
    assert attempt == 1
    assert list(external) == ["wandb_error"] and external["wandb_error"].startswith("ValidationError: ")
    assert "\n" not in external["wandb_error"] and "training goes on" in caplog.text
    assert not list((wandb_dir / "wandb").glob("*run-*"))

    # The error recorded is one line, without the secret (from the environment or the message).
    secret = "0123456789abcdef" * 2 + "01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    exploding = ExplodingMirror(secret)
    active, external = mirror_lib.start(exploding, "r", {}, None)
    assert active is None and exploding.calls == ["start", "finish"]
    message = external["wandb_error"]
    assert message.startswith("ConnectionError: cannot reach W&B with api_key=***")
    assert secret not in message and "\n" not in message and len(message) <= 300


def test_cli_train_with_wandb(wandb_dir: Path, tmp_path: Path) -> None:
    from runledger.cli.main import app

    config = tiny_config_file(tmp_path, run_id="from-cli")
    spool = tmp_path / "spool"
    args = ["train", str(config), "--spool", str(spool), "--steps", "2", "--log-every", "0", "--wandb"]
    result = CliRunner().invoke(app, args, env={"WANDB_PROJECT": "from-env"})
    assert result.exit_code == 0, result.output
    assert "W&B run from-cli in from-env" in result.output
    [started] = [e for e in read_spool(spool) if e.type == "runledger.run.started"]
    assert started.data.external["wandb_run_id"] == "from-cli"
    assert started.data.external["wandb_project"] == "from-env"
    [wandb_file] = find_offline_runs(started.data.external["wandb_dir"])
    assert wandb_file.name == "run-from-cli.wandb"

    # The standalone entry point (what torchrun launches) has the options too.
    help_text = subprocess.run(
        [sys.executable, "-m", "runledger.cli.train_cmd", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=os.environ | {"COLUMNS": "200"},
        check=True,
    ).stdout
    assert all(option in help_text for option in ("--wandb", "--wandb-project", "--wandb-entity"))


def test_a_fork_with_wandb_is_a_wandb_fork_of_its_parent(wandb_dir: Path, tmp_path: Path) -> None:
    """``ledger train --wandb --fork-from``: the W&B run is W&B's own fork of the parent's (its
    ``fork_from``), so W&B's record holds the branch point, and importing it gives the ledger's line."""
    from runledger.cli.main import app
    from runledger.trainer.checkpoint import step_dir

    config = tiny_config_file(tmp_path, "run.steps=8", "checkpoint.interval=4")
    spool = tmp_path / "spool"

    def train_cli(run_id: str, *extra: str) -> None:
        args = [
            "train",
            str(config),
            "--spool",
            str(spool),
            "--log-every",
            "0",
            "--wandb",
            "--run-id",
            run_id,
        ]
        args += ["--set", f"checkpoint.dir={tmp_path / run_id}", *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output

    train_cli("hero", "--stop-at", "5")
    train_cli("hero-lr2", "--fork-from", str(step_dir(tmp_path / "hero", 4)))
    [started] = [e for e in read_spool(spool) if e.type == "runledger.run.started" and e.run_id == "hero-lr2"]
    assert (started.data.parent_run, started.data.fork_step) == ("hero", 4)
    [fork_file] = [f for f in find_offline_runs(started.data.external["wandb_dir"]) if "hero-lr2" in f.name]
    [from_wandb] = [
        e for e in imported(fork_file, tmp_path / "imported") if e.type == "runledger.run.started"
    ]
    assert (from_wandb.run_id, from_wandb.data.parent_run, from_wandb.data.fork_step) == (
        "hero-lr2",
        "hero",
        4,
    )
