"""``moe.grouped_gemm``: Megatron-Core's grouped-GEMM experts as a trainer config key."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from runledger.trainer import cpu_compat
from runledger.trainer import model as model_lib
from runledger.trainer.config import (
    TINY_CPU,
    ConfigError,
    diff,
    load_config,
    pinned_changes,
    resolved,
    split_patch,
)

REFUSAL = "moe.grouped_gemm = true needs Transformer Engine or the grouped_gemm package; neither is installed"
NEITHER_INSTALLED = (
    importlib.util.find_spec("transformer_engine") is None
    and importlib.util.find_spec("grouped_gemm") is None
)
needs_neither = pytest.mark.skipif(
    not NEITHER_INSTALLED, reason="Transformer Engine or grouped_gemm is installed here"
)


def test_default_is_false_and_true_parses(tmp_path: Path) -> None:
    cfg = load_config(None)
    assert cfg.moe.grouped_gemm is False and resolved(cfg)["moe"]["grouped_gemm"] is False
    assert load_config(None, ["moe.grouped_gemm=true"]).moe.grouped_gemm is True
    path = tmp_path / "c.toml"
    path.write_text("[moe]\ngrouped_gemm = true\n")
    assert load_config(path).moe.grouped_gemm is True
    with pytest.raises(ConfigError, match="grouped_gemm"):
        load_config(None, ["moe.grouped_gemm='yes please'"])


def test_the_key_sets_megatrons_flag() -> None:
    cpu = torch.device("cpu")
    assert model_lib.transformer_config(load_config(None, TINY_CPU), cpu).moe_grouped_gemm is False
    on = load_config(None, [*TINY_CPU, "moe.grouped_gemm=true"])
    assert model_lib.transformer_config(on, cpu).moe_grouped_gemm is True


def test_a_live_change_is_refused_and_a_checkpoint_pins_it() -> None:
    old = load_config(None, ["run.run_id=r1"])
    new = load_config(None, ["run.run_id=r1", "moe.grouped_gemm=true", "optimizer.lr=1e-4"])
    allowed, refused = split_patch(diff(old, new))
    assert [op["path"] for op in allowed] == ["/optimizer/lr"]
    assert [op["path"] for op in refused] == ["/moe/grouped_gemm"]
    assert [op["path"] for op in pinned_changes(diff(old, new))] == ["/moe/grouped_gemm"]


@needs_neither
def test_refused_in_one_line_where_it_cannot_be_built() -> None:
    cfg = load_config(None, [*TINY_CPU, "moe.grouped_gemm=true"])
    assert cpu_compat.grouped_gemm_module(cfg) is None
    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError) as info:
            cpu_compat.check_supported(cfg, torch.device(device))
        assert str(info.value) == REFUSAL
    with pytest.raises(ConfigError) as info:  # build_model too, before Megatron's assert in GroupedMLP
        model_lib.build_model(cfg, torch.device("cpu"))
    assert str(info.value) == REFUSAL
    cpu_compat.check_supported(load_config(None, TINY_CPU), torch.device("cpu"))  # false: fine


def test_an_installed_grouped_gemm_is_still_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_compat, "_grouped_gemm_package_available", lambda: True)
    cfg = load_config(None, [*TINY_CPU, "moe.grouped_gemm=true"])
    assert cpu_compat.grouped_gemm_module(cfg) == "GroupedMLP"
    cpu_compat.check_supported(cfg, torch.device("cuda"))  # buildable there
    with pytest.raises(ConfigError) as info:
        cpu_compat.check_supported(cfg, torch.device("cpu"))
    assert str(info.value) == (
        "not possible on CPU: moe.grouped_gemm = true runs CUDA kernels (grouped GEMM); set it to false on CPU"
    )


@needs_neither
def test_ledger_train_refuses_with_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from runledger.cli.main import app

    config = tmp_path / "c.toml"
    config.write_text("[moe]\ngrouped_gemm = true\n")
    spool = tmp_path / "spool"
    args = ["train", str(config), "--spool", str(spool), "--steps", "1"]
    args += [f"--set={o}" for o in TINY_CPU] + ["--set=checkpoint.dir=" + str(tmp_path / "ck")]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert (result.exit_code, result.output) == (2, f"error: {REFUSAL}\n")
    assert not (tmp_path / "ck").exists()
    assert all(seg.read_bytes() == b"RLSPOOL1" for seg in spool.glob("*.seg"))  # no event: header only
