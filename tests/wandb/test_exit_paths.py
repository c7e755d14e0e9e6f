"""The W&B bridge loses nothing on any way out (issue 42): each script runs in its own process with
``runledger.wandb.tee()`` as its first line and real W&B offline, and ends one way: ``wandb.finish()``,
interpreter exit without it (the Hugging Face Trainer and Lightning's ``WandbLogger`` never call
it), an uncaught exception, Ctrl-C (SIGINT) or SIGTERM. W&B's own reader of its offline ``.wandb``
file is the truth: the ingested ledger holds every row W&B holds, at the row's step metric, with the
same values, and ``run.finished``'s ``final_step`` (or the crash's ``last_step``) is W&B's last step.

The row the bridge holds last (waiting for an eval row at the same ``train/global_step``, or not yet
committed by W&B) is the one an exit used to drop: the Trainer's step 20, Lightning's step 31 and
its fourth validation."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runledger.ingest.wandb_import import find_offline_runs, read_records
from runledger.schemas import Envelope
from tests.client.ledger_support import cli_json, ingest, metric_series, of_type

pytest.importorskip("wandb")

SCRIPT_TIMEOUT_S = 300

# Train rows at ``step=``, eval rows at the train step through ``define_metric("eval/*", ...)``; the
# last row (25, no eval) is still uncommitted in W&B when the script ends.
EVAL_AT_TRAIN_STEP = """
import os, signal, sys
import runledger.wandb
runledger.wandb.tee()
import wandb

end = sys.argv[1]
wandb.init(project="exit-paths", config={"end": end})
wandb.define_metric("train/global_step")
wandb.define_metric("eval/*", step_metric="train/global_step")
for step in range(1, 26):
    wandb.log({"train/loss": 1.0 / step, "train/global_step": step}, step=step)
    if step % 10 == 0:
        wandb.log({"eval/loss": 2.0 / step, "train/global_step": step})
if end == "finish":
    wandb.finish()
elif end == "exception":
    raise RuntimeError("the script failed after its last log")
elif end == "sigint":
    os.kill(os.getpid(), signal.SIGINT)
elif end == "sigterm":
    os.kill(os.getpid(), signal.SIGTERM)
"""
EVAL_STEPS = list(range(1, 26))

# The Trainer: 20 steps, a row every step, eval every 10 steps, no wandb.finish().
HF_TRAINER = """
import runledger.wandb
runledger.wandb.tee()
import sys, torch, transformers

VOCAB = 64
class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, rows, seed):
        self.tokens = torch.randint(0, VOCAB, (rows, 16), generator=torch.Generator().manual_seed(seed))
    def __len__(self):
        return len(self.tokens)
    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}

torch.manual_seed(0)
config = transformers.GPT2Config(
    n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
)
args = transformers.TrainingArguments(
    output_dir="hf-out", max_steps=20, per_device_train_batch_size=4, logging_steps=1,
    eval_strategy="steps", eval_steps=10, report_to=["wandb"], use_cpu=True, save_strategy="no",
    run_name="hf-exit", disable_tqdm=True,
)
transformers.Trainer(
    model=transformers.GPT2LMHeadModel(config), args=args,
    train_dataset=RandomTokens(64, seed=1), eval_dataset=RandomTokens(8, seed=2),
).train()
"""

# Lightning's WandbLogger: 2 epochs of 16 batches, validation every 8 batches, no wandb.finish().
LIGHTNING = """
import runledger.wandb
runledger.wandb.tee()
import os, torch, lightning
from lightning.pytorch.loggers import WandbLogger

class Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss
    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
trainer = lightning.Trainer(
    max_epochs=2, log_every_n_steps=1, val_check_interval=8, accelerator="cpu",
    logger=WandbLogger(project="exit-paths", name="lightning", save_dir=os.environ["WANDB_DIR"]),
    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
)
trainer.fit(
    Tiny(),
    torch.utils.data.DataLoader(data, batch_size=4),
    torch.utils.data.DataLoader(data, batch_size=4),
)
"""


def _run_script(source: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The script in its own interpreter (the test's offline W&B and spool environment), in tmp."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )


def _wandb_rows(wandb_dir: Path) -> list[dict[str, Any]]:
    """W&B's history rows of the one run, as its own reader decodes them."""
    [wandb_file] = find_offline_runs(wandb_dir / "wandb")
    return [r["history"]["item"] for r in read_records(wandb_file) if r.get("type") == "history"]


def _expected_values(rows: list[dict[str, Any]], step_metric: str) -> dict[tuple[int, str], float]:
    """(ledger step, name) → value of every number W&B recorded; later rows at a step win."""
    expected: dict[tuple[int, str], float] = {}
    for row in rows:
        step = int(row[step_metric])
        for name, value in row.items():
            if not name.startswith("_") and isinstance(value, int | float):
                expected[(step, name)] = float(value)
    return expected


def _ledger_of(tmp_path: Path) -> tuple[Path, str, dict[str, dict[int, float | None]]]:
    """The spool folded into a ledger: (ledger, run id, every metric by name and step)."""
    spool, ledger = Path(os.environ["RUNLEDGER_SPOOL"]), tmp_path / "ledger"
    ingest(ledger, spool)
    [run] = cli_json(ledger, "runs")
    return ledger, run["run_id"], metric_series(ledger, run["run_id"])


def _assert_ledger_holds(
    series: dict[str, dict[int, float | None]], expected: dict[tuple[int, str], float]
) -> None:
    missing = {key: value for key, value in expected.items() if series.get(key[1], {}).get(key[0]) != value}
    assert not missing, f"W&B holds these (step, name) values, the ledger does not: {missing}"


def _ledger_steps(series: dict[str, dict[int, float | None]]) -> list[int]:
    return sorted(set().union(*(steps.keys() for steps in series.values())))


def _the_end(spool: Path) -> Envelope:
    """The run's one end: its ``run.finished`` or its ``run.crashed``."""
    [end] = of_type(spool, "run.finished") + of_type(spool, "run.crashed")
    return end


@pytest.mark.parametrize(
    ("end", "exit_code", "end_type", "crash_kind"),
    [
        ("finish", 0, "run.finished", None),
        ("exit", 0, "run.finished", None),
        ("exception", 1, "run.crashed", "exception"),
        ("sigint", -2, "run.crashed", "signal"),  # KeyboardInterrupt: Python dies of SIGINT
    ],
)
def test_every_way_out_keeps_the_last_row(
    end: str,
    exit_code: int,
    end_type: str,
    crash_kind: str | None,
    wandb_dir: Path,
    client_env: dict[str, str],
    tmp_path: Path,
) -> None:
    done = _run_script(EVAL_AT_TRAIN_STEP, tmp_path, end)
    assert done.returncode == exit_code, done.stderr[-3000:]
    assert "not recorded in the ledger" not in done.stderr  # the bridge swallowed no failure
    rows = _wandb_rows(wandb_dir)
    assert [int(r["train/global_step"]) for r in rows] == EVAL_STEPS  # W&B kept its uncommitted row 25
    _, _, series = _ledger_of(tmp_path)
    assert _ledger_steps(series) == EVAL_STEPS
    _assert_ledger_holds(series, _expected_values(rows, "train/global_step"))
    assert series["eval/loss"].keys() == {10, 20}
    finished = _the_end(Path(client_env["RUNLEDGER_SPOOL"]))
    assert finished.type.endswith(end_type) and finished.step == EVAL_STEPS[-1]
    if crash_kind is None:
        assert finished.data.final_step == EVAL_STEPS[-1] and finished.data.status == "completed"
    else:
        assert finished.data.kind == crash_kind and finished.data.last_step == EVAL_STEPS[-1]


def test_sigterm_keeps_every_row_wandb_keeps(
    wandb_dir: Path, client_env: dict[str, str], tmp_path: Path
) -> None:
    """SIGTERM's default action kills the process before wandb-core has written every row it was
    sent (W&B's file may stop short); the ledger run's crash capture drains its queue first."""
    done = _run_script(EVAL_AT_TRAIN_STEP, tmp_path, "sigterm")
    assert done.returncode == -15, done.stderr[-3000:]
    rows = _wandb_rows(wandb_dir)
    _, _, series = _ledger_of(tmp_path)
    assert _ledger_steps(series) == EVAL_STEPS  # every step the script logged, row 25 too
    _assert_ledger_holds(series, _expected_values(rows, "train/global_step"))
    crashed = _the_end(Path(client_env["RUNLEDGER_SPOOL"]))
    assert crashed.data.kind == "signal" and crashed.data.signal == 15
    assert crashed.data.last_step == EVAL_STEPS[-1]


def test_hf_trainer_without_finish_keeps_its_last_step(
    wandb_dir: Path, client_env: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    done = _run_script(HF_TRAINER, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _wandb_rows(wandb_dir)
    wandb_steps = sorted({int(r["train/global_step"]) for r in rows})
    assert wandb_steps == list(range(1, 21))  # W&B's file: every step, 20 with its eval and final row
    ledger, run_id, series = _ledger_of(tmp_path)
    assert _ledger_steps(series) == wandb_steps
    _assert_ledger_holds(series, _expected_values(rows, "train/global_step"))
    assert series["eval/loss"].keys() == {10, 20} and 20 in series["train/loss"]
    finished = _the_end(Path(client_env["RUNLEDGER_SPOOL"]))
    assert finished.data.status == "completed" and finished.data.final_step == 20
    [run] = cli_json(ledger, "runs")
    assert run["run_id"] == run_id and run["last_step"] == 20


def test_lightning_without_finish_keeps_its_last_step_and_validation(
    wandb_dir: Path, client_env: dict[str, str], tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    done = _run_script(LIGHTNING, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _wandb_rows(wandb_dir)
    wandb_steps = sorted({int(r["trainer/global_step"]) for r in rows})
    validations = sorted(int(r["trainer/global_step"]) for r in rows if "val_loss" in r)
    assert wandb_steps == list(range(32)) and len(validations) == 4  # 2 epochs × 16 batches
    _, _, series = _ledger_of(tmp_path)
    assert _ledger_steps(series) == wandb_steps
    _assert_ledger_holds(series, _expected_values(rows, "trainer/global_step"))
    assert sorted(series["val_loss"]) == validations
    finished = _the_end(Path(client_env["RUNLEDGER_SPOOL"]))
    assert finished.data.status == "completed" and finished.data.final_step == wandb_steps[-1]
