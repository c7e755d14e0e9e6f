"""The training loop in-process: learning, live config, refusals, non-finite policy, crashes, resume."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from runledger.schemas.canonical import config_hash as schemas_hash
from runledger.schemas.envelope import Envelope
from runledger.trainer.checkpoint import CheckpointError, attempts, step_dir
from runledger.trainer.config import ConfigError, load_config
from runledger.trainer.loop import RunExistsError, SignalStop, _StopFlag, chain, schedule_config_change, train
from runledger.trainer.telemetry import StepReport
from tests.support.sinks import ListSink
from tests.support.trainer import assert_gap_free, data, tiny_config, tiny_config_file


def test_loss_falls_on_the_shipped_corpus(tmp_path: Path, sink: ListSink) -> None:
    cfg = tiny_config(tmp_path, "run.steps=60", "optimizer.lr=3e-3")
    result = train(cfg, sink)
    assert result.status == "completed" and result.final_step == 60
    losses = [loss for _, loss in result.losses]
    assert losses[0] > 5.0  # ln 256 ≈ 5.55: bytes start uniform
    assert sum(losses[-10:]) / 10 < losses[0] - 2.0
    started = sink.of("run.started")[0]
    assert started.attempt == 1 and started.seq == 0 and started.source == "trainer/tiny/a1/rank0"
    assert data(started)["config_hash"] == schemas_hash(data(started)["config"])
    assert data(started)["software"]["megatron-core"] == "0.16.1"
    metrics = sink.of("step.metrics")
    assert [e.step for e in metrics] == list(range(1, 61))
    assert all(data(e)["mfu"] > 0 and data(e)["tokens"] == 8 * 64 for e in metrics)
    assert sink.of("run.finished")[0].data.status == "completed"
    assert_gap_free(sink.events)


def test_counts_sum_to_assignments_minus_drops_in_a_run(tmp_path: Path, sink: ListSink) -> None:
    train(tiny_config(tmp_path, "run.steps=6", "moe.capacity_factor=1.0"), sink)
    stats = sink.of("moe.router_stats")
    assert len(stats) == 6
    for event in stats:
        for layer in event.data.layers:
            assert layer.tokens == 8 * 64
            assert sum(layer.expert_counts) == layer.tokens * layer.top_k - layer.dropped
            assert layer.token_drop_rate == pytest.approx(layer.dropped / (layer.tokens * layer.top_k))


def test_live_change_lands_at_the_step_with_its_patch(tmp_path: Path, sink: ListSink) -> None:
    path = tiny_config_file(tmp_path, "run.steps=12", "schedule.decay='constant'")
    changes = {"optimizer.lr": 1e-3, "moe.capacity_factor": 0.5}
    result = train(path, sink, progress=schedule_config_change(path, 7, changes))
    assert result.status == "completed"
    [changed] = sink.of("config.changed")
    assert changed.step == 7
    assert sorted(data(changed)["patch"], key=lambda op: op["path"]) == [
        {"op": "replace", "path": "/moe/capacity_factor", "value": 0.5},
        {"op": "replace", "path": "/optimizer/lr", "value": 1e-3},
    ]
    assert data(changed)["cause"]["kind"] == "file_edit"
    assert data(changed)["cause"]["actor"] is None  # edited without an author: unknown, not guessed
    launch = data(sink.of("run.started")[0])
    assert data(changed)["previous_hash"] == launch["config_hash"]
    assert data(changed)["config_hash"] == schemas_hash(
        load_config(path).__struct_config__ and _resolved(path)
    )
    lrs = {e.step: data(e)["lr"] for e in sink.of("step.metrics")}
    assert lrs[6] == pytest.approx(3e-3) and lrs[7] == pytest.approx(1e-3)  # default lr, then the new one
    drops = {e.step: sum(layer.dropped for layer in e.data.layers) for e in sink.of("moe.router_stats")}
    assert all(drops[s] == 0 for s in range(1, 7)) and all(drops[s] > 0 for s in range(7, 13))
    assert not sink.of("config.rejected")


def test_a_change_made_with_an_author_names_them(tmp_path: Path, sink: ListSink) -> None:
    path = tiny_config_file(tmp_path, "run.steps=4")
    train(path, sink, progress=schedule_config_change(path, 3, {"optimizer.lr": 1e-3}, author="alice"))
    [changed] = sink.of("config.changed")
    assert changed.step == 3 and data(changed)["cause"]["actor"] == "alice"
    assert data(changed)["patch"] == [{"op": "replace", "path": "/optimizer/lr", "value": 1e-3}]


def _resolved(path: Path) -> dict:
    from runledger.trainer.config import resolved

    return resolved(load_config(path))


def test_disallowed_change_is_refused_once_and_the_run_goes_on(tmp_path: Path, sink: ListSink) -> None:
    path = tiny_config_file(tmp_path, "run.steps=10")
    progress = chain(
        schedule_config_change(path, 4, {"model.num_layers": 3}),
        schedule_config_change(path, 7, {"telemetry.log_interval": 2}),  # allowed; num_layers still there
    )
    result = train(path, sink, progress=progress)
    assert result.status == "completed" and result.final_step == 10
    [rejected] = sink.of("config.rejected")
    assert rejected.step == 4
    assert data(rejected)["patch"] == [{"op": "replace", "path": "/model/num_layers", "value": 3}]
    assert "/model/num_layers" in data(rejected)["reason"]
    [changed] = sink.of("config.changed")
    assert changed.step == 7 and data(changed)["patch"][0]["path"] == "/telemetry/log_interval"
    assert [e.step for e in sink.of("step.metrics")][-2:] == [8, 10]


def test_nonfinite_loss_skip_policy_records_the_step(tmp_path: Path, sink: ListSink) -> None:
    cfg = tiny_config(
        tmp_path,
        "run.steps=6",
        "run.nonfinite_policy='skip'",
        "debug.crash_at_step=3",
        "debug.crash_kind='nan'",
    )
    result = train(cfg, sink)
    assert result.status == "completed" and result.skipped_steps == [3]
    [skipped] = sink.of("step.skipped")
    assert skipped.step == 3 and data(skipped) == {"reason": "nonfinite_loss", "value": "nan"}
    assert [e.step for e in sink.of("step.metrics")] == [1, 2, 4, 5, 6]
    assert all(loss == loss for _, loss in result.losses)  # the weights stayed finite


@pytest.mark.parametrize(
    ("extra", "kind", "exc_type"),
    [
        (["run.nonfinite_policy='stop'", "debug.crash_kind='nan'"], "nonfinite_loss", "NonFiniteLoss"),
        (["debug.crash_kind='exception'"], "exception", "RuntimeError"),
        (["debug.crash_kind='oom'"], "oom", "OutOfMemoryError"),
    ],
)
def test_crashes_become_durable_crash_events(
    tmp_path: Path, sink: ListSink, extra: list[str], kind: str, exc_type: str
) -> None:
    cfg = tiny_config(tmp_path, "run.steps=8", "debug.crash_at_step=4", *extra)
    result = train(cfg, sink)
    assert result.status == "crashed" and result.exit_code == 1
    crash = sink.events[-1]
    assert crash.type == "runledger.run.crashed" and crash.step == 3
    d = data(crash)
    assert (d["kind"], d["exc_type"], d["rank"], d["last_step"]) == (kind, exc_type, 0, 3)
    assert d["host"] and "Traceback" in d["traceback"]
    assert sink.syncs >= 1  # synced after the crash event was handed over
    assert not sink.of("run.finished")


@pytest.mark.parametrize(
    ("at_step", "saved"),
    [
        # SIGTERM during interval step 10: its interval checkpoint is written before the boundary
        # where the stop is honoured, and is the stop's checkpoint; nothing is saved twice.
        (10, [(5, "interval"), (10, "interval")]),
        # SIGTERM during step 12 (not an interval step): a checkpoint is written for the signal.
        (12, [(5, "interval"), (10, "interval"), (12, "signal")]),
    ],
    ids=["on-interval-step", "between-interval-steps"],
)
def test_sigterm_records_the_stop_and_checkpoints_once(
    tmp_path: Path, sink: ListSink, at_step: int, saved: list[tuple[int, str]]
) -> None:
    """SIGTERM delivered in-process, from the progress callback of step ``at_step`` (after that
    step's update, before its interval checkpoint): deterministic, unlike the kill test's timing."""
    assert threading.current_thread() is threading.main_thread()  # train installs its handler here
    cfg = tiny_config(tmp_path, "run.steps=20", "checkpoint.interval=5", "checkpoint.final=false")

    def sigterm(report: StepReport) -> None:
        if report.step == at_step:
            signal.raise_signal(signal.SIGTERM)

    result = train(cfg, sink, progress=sigterm)
    assert (result.status, result.exit_code, result.final_step) == ("signal", 143, at_step)
    assert [(e.step, data(e)["reason"]) for e in sink.of("checkpoint.saved")] == saved
    assert result.last_checkpoint is not None and result.last_checkpoint.name == f"step_{at_step:08d}"
    ckpt_event, crash = sink.events[-2:]
    assert ckpt_event.type == "runledger.checkpoint.saved" and ckpt_event.step == at_step
    assert crash.type == "runledger.run.crashed" and crash.step == at_step
    d = data(crash)
    assert (d["kind"], d["signal"], d["exit_code"], d["last_step"]) == ("signal", 15, 143, at_step)
    assert d["message"].startswith(f"SIGTERM: stopped at a step boundary after step {at_step}")
    assert ("its state was already saved (interval checkpoint" in d["message"]) == (at_step % 5 == 0)
    assert sink.syncs >= 1 and not sink.of("run.finished")
    assert_gap_free(sink.events)

    # The resume continues from the stop's checkpoint, whichever reason it was written for.
    again = ListSink()
    second = train(cfg, again, resume_from="latest", stop_at_step=at_step + 1)
    assert (second.status, second.start_step, second.final_step) == ("stopped", at_step, at_step + 1)
    [resumed] = again.of("run.resumed")
    assert data(resumed)["from_checkpoint_step"] == at_step


class _SignalOnEndSink(ListSink):
    """Sends SIGTERM when the attempt's end record arrives, i.e. while the trainer waits for it to be
    durable: the moment a user's second Ctrl-C most often lands. (Raised on the emitter's thread,
    the handler runs on the main thread once its wait returns.)"""

    def __init__(self, end_type: str) -> None:
        super().__init__()
        self.end_type = end_type

    def emit(self, envelope: Envelope) -> None:
        super().emit(envelope)
        if envelope.type == self.end_type:
            signal.raise_signal(signal.SIGTERM)


def test_a_second_signal_while_the_stop_is_recorded_records_it_once(tmp_path: Path) -> None:
    """CI once saw two ``run.crashed`` events for one Ctrl-C Ctrl-C: the second signal interrupted the
    flush of the first's record, and the handler recorded the stop again."""
    cfg = tiny_config(tmp_path, "run.steps=20", "checkpoint.interval=5", "checkpoint.final=false")
    sink = _SignalOnEndSink("runledger.run.crashed")

    def sigterm(report: StepReport) -> None:
        if report.step == 7:
            signal.raise_signal(signal.SIGTERM)

    result = train(cfg, sink, progress=sigterm)
    assert (result.status, result.exit_code, result.final_step) == ("signal", 143, 7)
    [crash] = sink.of("run.crashed")
    assert data(crash)["message"].startswith("SIGTERM: stopped at a step boundary after step 7")
    assert sink.syncs >= 1
    assert_gap_free(sink.events)


def test_a_signal_while_the_end_is_drained_neither_kills_the_run_nor_adds_a_crash(tmp_path: Path) -> None:
    """SIGTERM while ``run.finished`` is on its way: the drain runs under the trainer's handlers, so
    the process is not killed before the end is durable, and no crash is recorded after it."""
    cfg = tiny_config(tmp_path, "run.steps=6", "checkpoint.final=false")
    sink = _SignalOnEndSink("runledger.run.finished")
    outside: list[int] = []  # a signal after train() put the previous handler back lands here
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: outside.append(signum))
    try:
        result = train(cfg, sink)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert outside == []
    assert (result.status, result.exit_code, result.final_step) == ("completed", 0, 6)
    assert [e.type for e in sink.events][-1] == "runledger.run.finished" and not sink.of("run.crashed")


def test_the_stop_flag_asks_once_stops_twice_and_ignores_signals_once_the_end_is_recorded() -> None:
    flag = _StopFlag()
    flag(signal.SIGINT, None)
    assert (flag.requested, flag.signum, flag.forced) == (True, signal.SIGINT, None)
    with pytest.raises(SignalStop):
        flag(signal.SIGTERM, None)
    assert flag.forced == signal.SIGTERM
    flag.ending = True
    flag(signal.SIGINT, None)  # neither raises nor changes what was asked
    assert (flag.signum, flag.forced) == (signal.SIGINT, signal.SIGTERM)


def test_resume_continues_the_same_trajectory_and_records_lineage(tmp_path: Path) -> None:
    straight = ListSink()
    train(tiny_config(tmp_path / "a", "run.steps=16", run_id="straight"), straight)
    expected = {e.step: data(e)["loss"] for e in straight.of("step.metrics")}

    sink = ListSink()
    cfg = tiny_config(
        tmp_path / "b", "run.steps=16", "checkpoint.interval=5", "debug.crash_at_step=8", run_id="broken"
    )
    first = train(cfg, sink)
    assert first.status == "crashed" and first.last_checkpoint is not None
    with pytest.raises(RunExistsError):
        train(cfg, ListSink())  # a fresh start of a launched run is refused
    second = train(cfg, sink, resume_from="latest")
    # the refused launch registered no attempt: the resume is attempt 2
    assert (second.status, second.attempt, second.start_step, second.final_step) == ("completed", 2, 5, 16)
    [resumed] = sink.of("run.resumed")
    assert resumed.attempt == 2 and resumed.step == 5 and resumed.source == "trainer/broken/a2/rank0"
    assert data(resumed)["from_checkpoint_step"] == 5 and data(resumed)["previous_attempt"] == 1
    resumed_losses = {e.step: data(e)["loss"] for e in sink.of("step.metrics") if e.attempt == 2}
    assert sorted(resumed_losses) == list(range(6, 17))
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert_gap_free(sink.events)


def test_bf16_float16module_trains_with_fp32_master_weights(tmp_path: Path, sink: ListSink) -> None:
    import torch

    cfg = tiny_config(tmp_path, "run.steps=4", "model.precision='bf16'", "checkpoint.final=true")
    result = train(cfg, sink)
    assert result.status == "completed"
    losses = [loss for _, loss in result.losses]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
    state = torch.load(tmp_path / "ckpt" / "step_00000004" / "rank00000.pt", weights_only=False)
    weights = [v for v in state["model"].values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert weights and all(v.dtype == torch.bfloat16 for v in weights)
    assert all(m.dtype == torch.float32 for m in state["optimizer"]["master"])


def test_a_fork_goes_on_from_another_runs_checkpoint_under_a_new_run_id(tmp_path: Path) -> None:
    """``fork_from``: a new run id starts from another run's checkpoint (weights, optimizer, RNG,
    tokens), at its step: attempt 1, whose run.started names the parent and the step, and whose
    losses are the parent's own trajectory continued."""
    straight = ListSink()
    train(tiny_config(tmp_path / "a", "run.steps=12", run_id="straight"), straight)
    expected = {e.step: data(e)["loss"] for e in straight.of("step.metrics")}
    parent = train(
        tiny_config(tmp_path / "p", "run.steps=12", "checkpoint.interval=5", run_id="parent"),
        ListSink(),
        stop_at_step=6,
    )
    checkpoint = step_dir(parent.checkpoint_dir, 5)
    sink = ListSink()
    child_cfg = tiny_config(tmp_path / "c", "run.steps=12", "checkpoint.interval=5", run_id="child")
    child = train(child_cfg, sink, fork_from=checkpoint)
    assert (child.run_id, child.attempt, child.start_step, child.final_step) == ("child", 1, 5, 12)
    [started] = sink.of("run.started")
    assert (data(started)["parent_run"], data(started)["fork_step"], started.run_id) == ("parent", 5, "child")
    assert sink.of("run.resumed") == []
    losses = {e.step: data(e)["loss"] for e in sink.of("step.metrics")}
    assert sorted(losses) == list(range(6, 13))
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    # Its own checkpoints are its own: the fork saves into its directory (step 10), never the parent's.
    assert child.last_checkpoint == step_dir(child.checkpoint_dir, 10)
    assert sorted(p.name for p in parent.checkpoint_dir.glob("step_*")) == ["step_00000005"]
    assert_gap_free(sink.events)


def test_a_fork_is_refused_where_it_would_not_be_a_new_run(tmp_path: Path) -> None:
    parent = train(
        tiny_config(tmp_path / "p", "run.steps=6", "checkpoint.interval=5", run_id="parent"), ListSink()
    )
    checkpoint = step_dir(parent.checkpoint_dir, 5)
    own = tiny_config(tmp_path / "p", "run.steps=6", run_id="parent")
    with pytest.raises(RunExistsError):  # its own directory: launched before
        train(own, ListSink(), fork_from=checkpoint)
    with pytest.raises(ConfigError, match=r"a fork needs a new run\.run_id"):  # its own run id, elsewhere
        train(tiny_config(tmp_path / "q", "run.steps=6", run_id="parent"), ListSink(), fork_from=checkpoint)
    with pytest.raises(ConfigError, match="not with resume_from"):
        train(tiny_config(tmp_path / "r", run_id="r"), ListSink(), fork_from=checkpoint, resume_from="latest")
    with pytest.raises(ConfigError, match=r"cannot fork from .* pins: /model"):
        train(
            tiny_config(tmp_path / "s", "run.steps=6", "model.hidden_size=32", run_id="s"),
            ListSink(),
            fork_from=checkpoint,
        )
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        train(tiny_config(tmp_path / "t", run_id="t"), ListSink(), fork_from=tmp_path / "p")
    # Nothing was launched by a refusal.
    for name in ("q", "r", "s", "t"):
        assert not (tmp_path / name / "ckpt").exists() or attempts(tmp_path / name / "ckpt") == []


def test_a_resume_that_changes_what_the_checkpoint_pins_is_refused(tmp_path: Path) -> None:
    """Each checkpoint keeps the resolved config it was written under (``config.json``), and a resume
    is checked against it before anything loads: a model shape changed is one ConfigError."""
    cfg = tiny_config(tmp_path, "run.steps=6", "checkpoint.interval=5", run_id="pinned")
    first = train(cfg, ListSink())
    assert first.last_checkpoint is not None and (first.last_checkpoint / "config.json").is_file()
    changed = tiny_config(tmp_path, "run.steps=6", "model.hidden_size=32", run_id="pinned")
    with pytest.raises(ConfigError, match=r"cannot resume from .* pins: /model/hidden_size"):
        train(changed, ListSink(), resume_from="latest")
    assert len(attempts(tmp_path / "ckpt")) == 1  # the refusal registered no attempt
