"""A fork from the command line (issue 44): ``ledger train --fork-from CHECKPOINT`` starts a new run
id from another run's checkpoint, and the ledger reads the two as one line: ``ledger history`` of
the fork names the run and step it goes on from, and SQL's ``lineage_of`` lists both."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader
from runledger.trainer.checkpoint import step_dir
from tests.client.ledger_support import ingest
from tests.support.trainer import tiny_config_file

runner = CliRunner()


def _train(tmp_path: Path, run_id: str, *extra: str) -> tuple[int, str]:
    args = ["train", str(_config(tmp_path)), "--spool", str(tmp_path / "spool"), "--log-every", "0"]
    args += ["--run-id", run_id, "--set", f"checkpoint.dir={tmp_path / run_id}", *extra]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    return result.exit_code, result.output


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "train.toml"
    return path if path.exists() else tiny_config_file(tmp_path, "run.steps=10", "checkpoint.interval=4")


def test_a_fork_from_the_cli_is_one_line_with_its_parent_in_the_ledger(tmp_path: Path) -> None:
    code, out = _train(tmp_path, "hero", "--stop-at", "5")
    assert code == 0, out
    code, out = _train(tmp_path, "hero-lr2", "--fork-from", str(step_dir(tmp_path / "hero", 4)))
    assert code == 0, out
    assert "run hero-lr2 attempt 1: completed at step 10" in out
    ingest(tmp_path / "ledger", tmp_path / "spool")
    history = runner.invoke(app, ["history", "hero-lr2", "--ledger", str(tmp_path / "ledger")])
    assert history.exit_code == 0, history.output
    assert "hero → hero-lr2 (from step 4)" in history.output
    assert "continues run hero from step 4" in history.output
    reader = Reader(tmp_path / "ledger")
    try:
        members = reader.sql("SELECT member FROM lineage_of(?) ORDER BY depth", ["hero-lr2"]).rows
    finally:
        reader.close()
    assert [m for (m,) in members] == ["hero", "hero-lr2"]


def test_a_fork_the_cli_refuses_is_one_line_and_launches_nothing(tmp_path: Path) -> None:
    code, out = _train(tmp_path, "hero", "--stop-at", "4")
    assert code == 0, out
    checkpoint = str(step_dir(tmp_path / "hero", 4))
    code, out = _train(tmp_path, "hero", "--fork-from", checkpoint)
    assert (code, out.splitlines()[-1].startswith("error: run 'hero' was launched before")) == (2, True)
    code, out = _train(tmp_path, "other", "--fork-from", checkpoint, "--resume")
    assert (code, out) == (
        2,
        "error: --fork-from starts a new run id from another run's checkpoint: not with --resume\n",
    )
    code, out = _train(tmp_path, "third", "--fork-from", str(tmp_path / "hero"))
    assert code == 2 and out.startswith("error: ") and "is not a complete checkpoint directory" in out
    assert not (tmp_path / "other").exists() and not (tmp_path / "third").exists()


def test_a_fork_from_a_damaged_checkpoint_config_is_one_line(tmp_path: Path) -> None:
    code, out = _train(tmp_path, "hero", "--stop-at", "4")
    assert code == 0, out
    checkpoint = step_dir(tmp_path / "hero", 4)
    for damage in (
        b"{not json",
        b"[1, 2]",
        b'{"run": {"run_id": "hero"}, "model": {"hidden_size": "wide"}}',
        b"\xff\xfe",
    ):
        (checkpoint / "config.json").write_bytes(damage)
        code, out = _train(tmp_path, "copy", "--fork-from", str(checkpoint))
        assert code == 2 and len(out.splitlines()) == 1 and out.startswith("error: "), (damage, out)
        assert "config.json" in out
    assert not (tmp_path / "copy").exists()


def test_a_fork_stopped_before_its_own_first_checkpoint_resumes_from_the_one_it_forked(
    tmp_path: Path,
) -> None:
    """A fork that ended (stopped, killed) before writing a checkpoint of its own resumes from the
    checkpoint it forked from, not from step 0 with fresh weights: its attempt 2 goes on at the fork
    step, and the ledger's line is hero → hero-lr2 from step 4, then hero-lr2's own resume."""
    code, out = _train(tmp_path, "hero", "--stop-at", "5")
    assert code == 0, out
    forked = str(step_dir(tmp_path / "hero", 4))
    code, out = _train(tmp_path, "hero-lr2", "--fork-from", forked, "--stop-at", "6")
    assert code == 0, out
    assert not list((tmp_path / "hero-lr2").glob("step_*"))  # no checkpoint of its own yet
    complete = Path(forked) / "COMPLETE"
    kept = complete.read_bytes()
    complete.unlink()  # the parent's checkpoint incomplete (rotated away, half copied): one line
    code, out = _train(tmp_path, "hero-lr2", "--resume")
    assert code == 2 and out.count("\n") == 1, out
    assert "has no checkpoint of its own, and the one it forked from" in out and "no longer complete" in out
    complete.write_bytes(kept)
    code, out = _train(tmp_path, "hero-lr2", "--resume")
    assert code == 0, out
    assert "run hero-lr2 attempt 2: completed at step 10" in out
    ingest(tmp_path / "ledger", tmp_path / "spool")
    reader = Reader(tmp_path / "ledger")
    try:
        launches = reader.sql(
            "SELECT attempt, kind, start_step, fork_step, parent_run FROM attempts WHERE run_id = ? ORDER BY attempt",
            ["hero-lr2"],
        ).rows
    finally:
        reader.close()
    assert launches == [(1, "start", 0, 4, "hero"), (2, "resume", 4, None, None)]
