"""A real Hugging Face ``transformers`` Trainer (tiny GPT-2 from a config, random tokens, CPU) reporting
to W&B offline through ``runledger.wandb.tee()``: the ledger's step is the Trainer's
``train/global_step`` (HF declares it with ``define_metric("*", step_metric=...)``), not W&B's row
counter, which also counts eval rows. W&B's own reader is the ground truth, and importing W&B's file
afterwards (``runledger.ingest.wandb_import``) says the same as the bridge did."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.bus import SpoolSink
from runledger.ingest.wandb_import import find_offline_runs, import_offline_run, read_records
from tests.client.ledger_support import cli_json, ingest, metric_series, of_type
from tests.support.wandb_files import close_wandb_files

wandb = pytest.importorskip("wandb")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import runledger.wandb as bridge  # noqa: E402

STEPS = 20
VOCAB = 64


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self, rows: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (rows, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


@pytest.fixture
def teed(wandb_dir: Path, client_env: dict[str, str]) -> Iterator[bridge.Tee]:
    tee = bridge.tee()
    try:
        yield tee
    finally:
        bridge.untee()


def _train(output_dir: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=10,
        report_to=["wandb"],
        use_cpu=True,
        save_strategy="no",
        run_name="hf-tiny",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=args,
        train_dataset=RandomTokens(64, seed=1),
        eval_dataset=RandomTokens(8, seed=2),
    )
    trainer.train()
    wandb.finish()
    close_wandb_files()


def _wandb_rows(wandb_dir: Path) -> list[dict[str, Any]]:
    """W&B's history rows, as its own reader decodes them."""
    [wandb_file] = find_offline_runs(wandb_dir / "wandb")
    return [r["history"]["item"] for r in read_records(wandb_file) if r.get("type") == "history"]


def test_trainer_steps_names_and_import_agree_with_wandb(
    teed: bridge.Tee, wandb_dir: Path, client_env: dict[str, str], tmp_path: Path
) -> None:
    _train(tmp_path / "hf-out")
    assert teed.errors == 0
    rows = _wandb_rows(wandb_dir)
    # W&B's row counter: train rows every 2 steps, an eval row at 10 and 20, HF's final row.
    assert len(rows) == 13 and rows[-1]["_step"] == 12
    expected: dict[tuple[int, str], Any] = {}
    for row in rows:
        step = row["train/global_step"]
        expected.update({(step, k): v for k, v in row.items() if not k.startswith("_")})

    spool = Path(client_env["RUNLEDGER_SPOOL"])
    bridged = of_type(spool, "step.metrics")
    assert [e.step for e in bridged] == list(range(2, STEPS + 1, 2))  # the Trainer's steps, once each
    [finished] = of_type(spool, "run.finished")
    assert finished.data.final_step == STEPS and finished.data.status == "completed"
    ledger = tmp_path / "ledger"
    ingest(ledger, spool)
    run_id = bridged[0].run_id
    series = metric_series(ledger, run_id)
    # Every value under the name HF logged it with, at the Trainer's step; eval rows beside their step.
    for (step, name), value in expected.items():
        assert series[name][step] == value, (step, name)
    assert series["eval/loss"].keys() == {10, 20}
    # The typed fields hold the same values (a report's loss chart), and nothing is invented.
    assert series["loss"] == series["train/loss"] and series["lr"] == series["train/learning_rate"]
    assert series["grad_norm"] == series["train/grad_norm"] and "tokens" not in series
    [run] = cli_json(ledger, "runs")
    assert run["last_step"] == STEPS
    config = cli_json(ledger, "state", run_id)["config"]
    assert config["max_steps"] == STEPS and "_name_or_path" in config  # `_` keys kept

    # The same run imported from W&B's file: the same steps, names and typed fields.
    imported_spool = tmp_path / "imported"
    [wandb_file] = find_offline_runs(wandb_dir / "wandb")
    sink = SpoolSink(imported_spool)
    try:
        stats = import_offline_run(wandb_file, sink)
    finally:
        sink.close()
    assert not stats.partial
    imported = of_type(imported_spool, "step.metrics")
    assert [(e.step, e.data) for e in imported] == [(e.step, e.data) for e in bridged]
    [imported_end] = of_type(imported_spool, "run.finished")
    assert imported_end.data.final_step == STEPS
