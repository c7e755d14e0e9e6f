"""`ledger edit` refuses what the run would refuse at its next step (issue 24): an unknown key, a
value of the wrong type (named with the key's type), an edit that leaves the config invalid.

Each refusal is one line, exit 2, and the watched file is left byte for byte; the trainer's own
loader (``runledger.trainer.config.load_config``, what the live run reads the file with) refuses the same
edit written straight into a copy of the file, so the command says before the edit what the run
would say after it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.trainer.config import DEMO_CONFIG, ConfigError, MoeConfig, load_config

runner = CliRunner()

MOE_KEYS = ", ".join(sorted(f for f in MoeConfig.__struct_fields__))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.toml"
    shutil.copyfile(DEMO_CONFIG, path)
    return path


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (
            "moe.capcity_factor=1.25",
            f"unknown config key 'moe.capcity_factor': moe has {MOE_KEYS}",
        ),
        ("moe.capacity_factor=abc", 'moe.capacity_factor expects a number or none, not "abc" (a string)'),
        ("moe.top_k=1.5", "moe.top_k expects an integer, not 1.5 (a number)"),
        ("optimizer.lr=[1, 2]", "optimizer.lr expects a number, not [1, 2] (a list)"),
        (
            "moe.drop_policy=sideways",
            "moe.drop_policy expects one of 'probs', 'position', not \"sideways\" (a string)",
        ),
        ("telemetry.enabled=maybe", 'telemetry.enabled expects true or false, not "maybe" (a string)'),
        ("optimizer.lr=none", "optimizer.lr cannot be none: it expects a number"),
        ("moe.top_k.deep=1", "unknown config key 'moe.top_k.deep': moe.top_k is a key, not a section"),
    ],
)
def test_unknown_keys_and_wrong_types_are_refused_with_the_keys_type(
    config: Path, change: str, line: str
) -> None:
    before = config.read_bytes()
    result = runner.invoke(app, ["edit", str(config), change, "--author", "alice"])
    assert result.exit_code == 2
    assert result.stderr == f"error: {line}\n"
    assert config.read_bytes() == before
    # What the run itself makes of the same change: its loader refuses it too.
    key, _, value = change.partition("=")
    with pytest.raises(ConfigError):
        load_config(config, [f"{key}={value}"])


def test_an_edit_that_leaves_the_config_invalid_is_refused(config: Path) -> None:
    before = config.read_bytes()
    top_k = load_config(config).moe.num_experts + 1
    result = runner.invoke(app, ["edit", str(config), f"moe.top_k={top_k}"])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {config}: the run would refuse this edit: moe.top_k must be within 1..moe.num_experts\n"
    )
    assert config.read_bytes() == before


def test_a_good_edit_is_written_and_a_restart_only_key_is_noted(config: Path) -> None:
    result = runner.invoke(app, ["edit", str(config), "moe.capacity_factor=1.5", "optimizer.lr=3e-4"])
    assert result.exit_code == 0, result.output
    assert result.stderr == f"edited {config}: moe.capacity_factor=1.5, optimizer.lr=3e-4 (author unknown)\n"
    cfg = load_config(config)
    assert (cfg.moe.capacity_factor, cfg.optimizer.lr) == (1.5, 3e-4)
    # An int where a float is expected is taken, as the run takes it; a key that needs a restart is
    # written (for the next launch) with a note that the live run refuses it.
    result = runner.invoke(app, ["edit", str(config), "optimizer.lr=1", "model.num_layers=4"])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "note: model.num_layers is not changeable while the run is live: a running run refuses it "
        "(needs a restart)\n"
        f"edited {config}: optimizer.lr=1, model.num_layers=4 (author unknown)\n"
    )
    assert load_config(config).model.num_layers == 4
