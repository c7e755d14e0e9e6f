from __future__ import annotations

from pathlib import Path

import pytest

from runledger.schemas import config_hash as schemas_config_hash
from runledger.trainer.config import (
    DEMO_CONFIG,
    LIVE_KEYS,
    ConfigError,
    ConfigSource,
    apply_patch,
    config_hash,
    diff,
    edit_config_file,
    load_config,
    pinned_changes,
    resolved,
    split_patch,
    write_config,
)


def _pointers(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        out |= _pointers(value, path) if isinstance(value, dict) else {path}
    return out


def test_resolved_has_every_key_and_hash_is_schemas_hash(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.run_id=r1"])
    tree = resolved(cfg)
    assert tree["moe"]["capacity_factor"] is None  # TOML has no null: absent means None
    assert config_hash(cfg) == schemas_config_hash(tree)
    assert _pointers(tree) >= LIVE_KEYS, "every live key names a real config key"


def test_toml_overrides_and_typos(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[moe]\ncapacity_factor = 1.25\n[run]\nrun_id = "x"\n')
    cfg = load_config(path, ["moe.top_k=1", "optimizer.lr=1e-3", "moe.capacity_factor=none"])
    assert (cfg.moe.top_k, cfg.optimizer.lr, cfg.moe.capacity_factor) == (1, 1e-3, None)
    path.write_text("[moe]\ncapacity_factr = 1.25\n")
    with pytest.raises(ConfigError, match="capacity_factr"):
        load_config(path)
    with pytest.raises(ConfigError, match="top_k"):
        load_config(None, ["moe.top_k=9"])


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.run_id=r1", "moe.capacity_factor=1.5"])
    write_config(tmp_path / "c.toml", cfg)
    assert load_config(tmp_path / "c.toml") == cfg


def test_live_and_refused_changes() -> None:
    old = load_config(None, ["run.run_id=r1"])
    new = load_config(
        None, ["run.run_id=r1", "optimizer.lr=1e-4", "moe.capacity_factor=1.0", "model.num_layers=3"]
    )
    allowed, refused = split_patch(diff(old, new))
    assert sorted(op["path"] for op in allowed) == ["/moe/capacity_factor", "/optimizer/lr"]
    assert [op["path"] for op in refused] == ["/model/num_layers"]
    changed = apply_patch(old, allowed)
    assert changed.optimizer.lr == 1e-4 and changed.moe.capacity_factor == 1.0
    assert changed.model.num_layers == 2
    assert [op["path"] for op in pinned_changes(diff(old, new))] == ["/model/num_layers"]


def test_source_pins_generated_run_id_and_sees_edits(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = "demo"\n[checkpoint]\ndir = "ck/{run_id}"\n')
    source = ConfigSource(path)
    first = source.load()
    assert first.run.run_id.startswith("demo-") and first.checkpoint.dir == f"ck/{first.run.run_id}"
    assert not source.changed()
    edit_config_file(path, {"moe.capacity_factor": 1.5})
    assert source.changed()
    second = source.load()
    assert diff(first, second) == [{"op": "replace", "path": "/moe/capacity_factor", "value": 1.5}]
    edit_config_file(path, {"moe.capacity_factor": None})
    assert source.load().moe.capacity_factor is None


def test_demo_config_loads() -> None:
    cfg = load_config(DEMO_CONFIG)
    assert cfg.moe.capacity_factor is not None and cfg.debug.crash_at_step is not None
    assert cfg.checkpoint.interval and cfg.debug.crash_at_step > cfg.checkpoint.interval


def test_edit_keeps_comments_and_layout(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("# my run\n[moe]\n# drops on purpose\ncapacity_factor = 1.0  # tuned\ntop_k = 2\n")
    edit_config_file(path, {"moe.capacity_factor": 1.5, "optimizer.lr": 1e-3, "moe.top_k": None})
    text = path.read_text()
    assert "# my run" in text and "# drops on purpose" in text and "capacity_factor = 1.5  # tuned" in text
    cfg = load_config(path)
    assert (cfg.moe.capacity_factor, cfg.optimizer.lr, cfg.moe.top_k) == (1.5, 1e-3, 2)  # top_k: default


def test_an_edits_author_is_recorded_only_with_that_edit(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("# my run\n[moe]\ncapacity_factor = 1.0  # tuned\n")
    source = ConfigSource(path)
    source.load()
    assert source.change_author is None
    edit_config_file(path, {"moe.capacity_factor": 1.25}, author="alice")
    assert source.load().moe.capacity_factor == 1.25 and source.change_author == "alice"
    assert "# my run" in path.read_text() and "capacity_factor = 1.25  # tuned" in path.read_text()
    # A hand edit that leaves [change] as it was is not alice's: it is recorded as unknown.
    path.write_text(path.read_text().replace("1.25", "1.5"))
    assert source.load().moe.capacity_factor == 1.5 and source.change_author is None
    # An edit made without an author removes the stale one rather than crediting it.
    edit_config_file(path, {"moe.capacity_factor": 2.0})
    assert "author" not in path.read_text() and source.load().moe.capacity_factor == 2.0
    assert source.change_author is None
    edit_config_file(path, {"moe.capacity_factor": 1.0}, author="bob")
    assert source.load().moe.capacity_factor == 1.0 and source.change_author == "bob"


def test_the_change_table_is_not_part_of_the_config(tmp_path: Path) -> None:
    plain, edited = tmp_path / "a.toml", tmp_path / "b.toml"
    plain.write_text("[moe]\ncapacity_factor = 1.0\n")
    edited.write_text('[moe]\ncapacity_factor = 1.0\n[change]\nauthor = "alice"\nat = "2026-12-01"\n')
    assert config_hash(load_config(plain)) == config_hash(load_config(edited))


def test_ledger_edit_records_the_author_through_the_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from runledger.cli.main import app

    path = tmp_path / "c.toml"
    path.write_text("[moe]\ncapacity_factor = 1.0\n")
    source = ConfigSource(path)
    source.load()
    runner = CliRunner()
    result = runner.invoke(app, ["edit", str(path), "moe.capacity_factor=1.25", "--author", "alice"])
    assert (result.exit_code, result.output) == (0, f"edited {path}: moe.capacity_factor=1.25 by alice\n")
    assert source.load().moe.capacity_factor == 1.25 and source.change_author == "alice"
    result = runner.invoke(app, ["edit", str(path), "moe.capacity_factor"], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert result.output == "error: override 'moe.capacity_factor' is not KEY=VALUE\n"
    assert source.load().moe.capacity_factor == 1.25  # nothing written
