"""``runledger.init``: the events a run makes, answered back through the ledger and its CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import runledger
from runledger.client import Placement
from runledger.schemas.payloads import StepMetrics
from tests.client.ledger_support import cli_json, events, ingest, metric_series, of_type
from tests.support.sinks import ListSink

REPO = Path(__file__).resolve().parents[2]


def _loss(step: int) -> float:
    return 3.0 * math.exp(-step / 17) + 0.25 * math.sin(step / 3) + 1.0


def test_a_run_round_trips_through_the_ledger(client_env: dict[str, str], tmp_path: Path) -> None:
    config = {"lr": 3e-4, "model": {"layers": 2, "experts": 4}, "tags": ["a", "b"]}
    rng = np.random.default_rng(3)
    counts_at: dict[int, np.ndarray] = {}
    with runledger.init("rt-1", config=config, repository="org/repo", name="round trip") as run:
        assert (run.rank, run.world_size, run.attempt) == (0, 1, 1)
        assert run.source == "trainer/rt-1/a1/rank0"
        for step in range(1, 31):
            values = {
                "loss": np.float32(_loss(step)),
                "lr": 3e-4 if step < 16 else 1.5e-4,
                "tokens": 4096,
                "total_tokens": 4096 * step,
                "eval": {"ppl": math.exp(_loss(step) / 2)},
                "is_best": step % 7 == 0,
                "note": "not a number",
            }
            if step == 16:
                assert run.config.update({"lr": 1.5e-4}, cause="halve lr", step=16)
            assert run.log(values, step=step)
            counts = rng.integers(0, 50, size=(2, 4))
            counts_at[step] = counts
            assert run.log_router(
                step, counts=counts, tokens=[100, 100], aux_loss=[0.01 * step, np.nan], top_k=2
            )
            if step % 10 == 0:
                assert run.checkpoint(step, tmp_path / f"ck{step}")
        run.annotate("looked fine", step=30, author="lena")
    assert run.ended and run.skipped == {"note": 30}

    ledger = tmp_path / "ledger"
    ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]))
    state = cli_json(ledger, "state", "rt-1", "--step", "15")
    assert state["config"] == config and state["attempt"] == 1
    assert state["last_checkpoint"]["step"] == 10
    later = cli_json(ledger, "state", "rt-1", "--step", "16")
    assert later["config"]["lr"] == 1.5e-4
    assert [c["cause"]["detail"] for c in later["config_changes"]] == ["halve lr"]

    series = metric_series(ledger, "rt-1")
    assert series["loss"] == {s: float(np.float32(_loss(s))) for s in range(1, 31)}
    assert series["eval/ppl"] == {s: math.exp(_loss(s) / 2) for s in range(1, 31)}
    assert series["is_best"] == {s: float(s % 7 == 0) for s in range(1, 31)}
    assert series["total_tokens"] == {s: 4096.0 * s for s in range(1, 31)}
    assert "note" not in series

    rows = cli_json(
        ledger,
        "query",
        "SELECT step, layer, tokens, dropped, token_drop_rate, expert_counts, aux_loss "
        "FROM moe_layer_stats WHERE run_id = 'rt-1' ORDER BY step, layer",
    )
    assert len(rows) == 60
    for row in rows:
        counts = counts_at[row["step"]][row["layer"]]
        assert row["expert_counts"] == counts.tolist()
        assert row["tokens"] == 100 and row["dropped"] == max(0, 200 - int(counts.sum()))
        assert row["token_drop_rate"] == pytest.approx(row["dropped"] / 200)
        assert row["aux_loss"] == (pytest.approx(0.01 * row["step"]) if row["layer"] == 0 else None)
    runs = cli_json(ledger, "runs")
    assert [(r["run_id"], r["status"], r["last_step"]) for r in runs] == [("rt-1", "finished", 30)]


def test_known_names_are_typed_and_aliases_never_collide(client_env: dict[str, str]) -> None:
    sink = ListSink()
    run = runledger.init("names-1", sink=sink, handle_signals=False)
    run.log({"lm loss": 2.5, "learning-rate": 1e-4, "grad-norm": 0.7, "router/aux_loss": 0.01}, step=1)
    run.log({"loss": 1.0, "train/loss": 1.1, "tokens": 2.5, "total_tokens": -3}, step=2)
    run.finish()
    first, second = (e.data for e in sink.of("step.metrics"))
    assert isinstance(first, StepMetrics) and isinstance(second, StepMetrics)
    assert (first.loss, first.lr, first.grad_norm, first.scalars) == (2.5, 1e-4, 0.7, {"aux_loss": 0.01})
    # "train/loss" would be "loss", which the row has already: both are kept, nothing overwritten.
    assert second.loss == 1.0 and second.scalars == {"train/loss": 1.1, "tokens": 2.5, "total_tokens": -3.0}


def test_a_client_process_never_imports_torch(client_env: dict[str, str], tmp_path: Path) -> None:
    script = (
        "import sys, numpy as np, runledger\n"
        "run = runledger.init('light-1', config={'a': 1})\n"
        "run.log({'loss': np.float64(1.5), 'x': 2}, step=1)\n"
        "run.log_router(1, counts=np.ones((2, 3)), drop=[0.0, 0.25], top_k=1)\n"
        "run.finish()\n"
        "heavy = [m for m in ('torch', 'megatron', 'jax', 'wandb') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=client_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert [e.type for e in events(Path(client_env["RUNLEDGER_SPOOL"]))] == [
        "runledger.run.started",
        "runledger.step.metrics",
        "runledger.moe.router_stats",
        "runledger.run.finished",
    ]


def test_torch_values_reach_the_host_in_one_transfer_per_call(client_env: dict[str, str]) -> None:
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    class HostCopies(TorchFunctionMode):
        """Counts the tensor methods that copy to the host."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", "")
            if name in ("tolist", "item", "cpu", "numpy", "__float__"):
                self.calls.append(name)
            return func(*args, **(kwargs or {}))

    sink = ListSink()
    run = runledger.init("torch-1", sink=sink, handle_signals=False)
    scalars = {f"s{i}": torch.tensor(float(i) / 3) for i in range(32)}
    counts = torch.randint(0, 100, (48, 384))
    with HostCopies() as copies:
        run.log({**scalars, "loss": torch.tensor(2.0, dtype=torch.bfloat16)}, step=1)
        log_copies = list(copies.calls)
        copies.calls.clear()
        run.log_router(1, counts=counts, drop=torch.rand(48) / 10, aux_loss=torch.rand(48), top_k=8)
        router_copies = list(copies.calls)
    run.finish()
    assert log_copies == ["tolist"]  # 33 tensors, one stacked copy
    assert router_copies == ["cpu", "numpy"]  # three per-layer tensors, one concatenated copy
    [metrics] = [e.data for e in sink.of("step.metrics")]
    assert metrics.loss == 2.0 and metrics.scalars["s31"] == pytest.approx(31 / 3)
    [router] = [e.data for e in sink.of("moe.router_stats")]
    assert [layer.expert_counts for layer in router.layers] == counts.tolist()


def test_hostile_values_are_refused_in_one_line_and_lose_nothing_else(client_env: dict[str, str]) -> None:
    sink = ListSink()
    run = runledger.init("hostile-1", sink=sink, handle_signals=False)
    deep: dict[str, object] = {"x": 1.0}
    for _ in range(50):
        deep = {"d": deep}
    with pytest.raises(ValueError, match="nest deeper"):
        run.log(deep, step=1)
    with pytest.raises(TypeError, match="mapping"):
        run.log([("loss", 1.0)], step=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative int"):
        run.log({"loss": 1.0}, step=-1)
    with pytest.raises(ValueError, match="layers × experts"):
        run.log_router(1, counts=np.ones(4))
    with pytest.raises(ValueError, match="has 3 layers"):
        run.log_router(1, counts=np.ones((2, 4)), drop=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match=r"within \[0, 1\]"):
        run.log_router(1, drop=[0.1, 1.5])
    with pytest.raises(ValueError, match="non-negative"):
        run.log_router(1, counts=-np.ones((2, 4)))
    with pytest.raises(ValueError, match="counts is not a numeric array"):
        run.log_router(1, counts=[[1, 2], [3]])
    with pytest.raises(ValueError, match="drop is not a numeric array"):
        run.log_router(1, drop=["a lot", "some"])
    assert run.log({"first": 1.0})  # the refused calls took no step: this is still step 0
    many = {f"metric_{i:05d}": float(i) for i in range(20_000)}
    odd = {"\ud800lone surrogate": 1.0, "ünïcødé/名前": 2.0, "": 3.0, "inf": float("inf"), "big": 2**70}
    assert run.log(many | odd, step=2)
    run.finish()
    first, metrics_event = sink.of("step.metrics")
    assert (first.step, first.data.scalars, metrics_event.step) == (0, {"first": 1.0}, 2)
    metrics = metrics_event.data
    assert len(metrics.scalars) == 20_000 + 5
    assert metrics.scalars["ünïcødé/名前"] == 2.0 and metrics.scalars["\ufffdlone surrogate"] == 1.0
    assert metrics.scalars["inf"] is None and metrics.scalars["big"] == float(2**70)
    assert [e.seq for e in sink.events] == list(range(len(sink.events)))  # nothing was lost on the way


def test_run_id_is_checked_and_a_relaunch_needs_resume(client_env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid"):
        runledger.init("../etc/passwd", handle_signals=False)
    with runledger.init("again-1", config={"a": 1}, handle_signals=False):
        pass
    with pytest.raises(runledger.RunExistsError, match="resume_from_step"):
        runledger.init("again-1", handle_signals=False)
    with pytest.raises(runledger.RunExistsError, match="nothing to resume"):
        runledger.init("never-ran", resume_from_step=3, handle_signals=False)
    with runledger.init("again-1", config={"a": 2}, resume_from_step=5, handle_signals=False) as run:
        assert run.attempt == 2
        run.log({"loss": 1.0})  # the step after the one resumed from
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    [resumed] = of_type(spool, "run.resumed")
    assert (resumed.attempt, resumed.step, resumed.data.previous_attempt) == (2, 5, 1)
    assert resumed.source == "trainer/again-1/a2/rank0" and resumed.seq == 0
    [metrics] = of_type(spool, "step.metrics")
    assert metrics.step == 6
    ledger = tmp_path / "ledger"
    ingest(ledger, spool)
    runs = cli_json(ledger, "runs")
    assert [(r["run_id"], r["attempts"]) for r in runs] == [("again-1", 2)]
    assert cli_json(ledger, "state", "again-1", "--step", "6")["config"] == {"a": 2}


def test_ranks_agree_on_the_attempt_and_rank_0_alone_sends_run_events(
    client_env: dict[str, str], tmp_path: Path
) -> None:
    script = (
        "import json, sys, runledger\n"
        "run = runledger.init('multi-1', config={'a': 1})\n"
        "sent = run.log({'loss': 1.0}, step=1)\n"
        "run.log_rank({'mem_gib': 10.0 + run.rank}, step=1, step_time_s=0.5)\n"
        "run.finish()\n"
        "print(json.dumps([run.rank, run.world_size, run.attempt, sent]))\n"
    )
    results = []
    for launch in ("job-1", "job-2"):  # two launches of the same run: attempts 1 and 2
        procs = []
        for rank in (1, 0):  # rank 1 first: it waits for rank 0 to number the launch
            env = client_env | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
            env |= {"RUNLEDGER_LAUNCH_ID": launch}
            code = script if launch == "job-1" else script.replace("config={'a': 1}", "resume_from_step=1")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
                )
            )
            time.sleep(0.3)
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            results.append(tuple(json.loads(out)))
    assert sorted(results) == [(0, 2, 1, True), (0, 2, 2, True), (1, 2, 1, False), (1, 2, 2, False)]
    spool = Path(client_env["RUNLEDGER_SPOOL"])
    rank1 = spool.with_name(spool.name + ".rank1")
    assert {e.type for e in events(rank1)} == {"runledger.rank.stats"}
    ledger = tmp_path / "ledger"
    ingest(ledger, spool, rank1)
    rows = cli_json(
        ledger, "query", "SELECT attempt, rank, step_time_s FROM rank_stats ORDER BY attempt, rank"
    )
    assert [(r["attempt"], r["rank"], r["step_time_s"]) for r in rows] == [
        (1, 0, 0.5),
        (1, 1, 0.5),
        (2, 0, 0.5),
        (2, 1, 0.5),
    ]


def test_placement_from_launcher_variables() -> None:
    assert Placement.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == Placement(3, 8, 1)
    assert Placement.from_env({"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"}) == Placement(1, 2, 0)
    assert Placement.from_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1"}) == Placement(
        5, 6, 1
    )
    assert Placement.from_env({}) == Placement(0, 1, 0)
    with pytest.raises(ValueError, match="not within"):
        Placement.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="not integers"):
        Placement.from_env({"RANK": "zero", "WORLD_SIZE": "4"})


class _HungSink(ListSink):
    """A bus that stops answering (a broker gone away) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def emit(self, envelope) -> None:  # type: ignore[no-untyped-def]
        self.release.wait(30)
        super().emit(envelope)


def test_a_hung_bus_never_holds_the_loop_beyond_the_stated_bounds(client_env: dict[str, str]) -> None:
    sink = _HungSink()
    run = runledger.init(
        "hung-1", sink=sink, queue_size=8, critical_timeout_s=0.3, flush_timeout_s=0.3, handle_signals=False
    )
    t0 = time.perf_counter()
    accepted = [run.log({"loss": float(i)}, step=i) for i in range(1, 2001)]
    logging_s = time.perf_counter() - t0
    assert sum(accepted) < 2000 and run.dropped == 2000 - sum(accepted)
    t0 = time.perf_counter()
    run.finish()
    finish_s = time.perf_counter() - t0
    # The stated bound: critical_timeout_s for run.finished, then about 3 × flush_timeout_s.
    assert finish_s < 0.3 + 3 * 0.3 + 1.0 and logging_s < 5.0
    sink.release.set()


def test_a_config_of_python_objects_is_recorded_as_json(client_env: dict[str, str]) -> None:
    sink = ListSink()
    config = {"dims": np.arange(3), "scale": np.float32(0.5), "root": Path("/data"), "bad": math.nan}
    with runledger.init("cfg-1", config=config, sink=sink, handle_signals=False) as run:
        run.config.update({"dims": np.arange(4)}, cause="grow")
    [started] = sink.of("run.started")
    assert started.data.config == {"dims": [0, 1, 2], "scale": 0.5, "root": "/data", "bad": None}
    [changed] = sink.of("config.changed")
    assert [(op.op, op.path, op.value) for op in changed.data.patch] == [("add", "/dims/3", 3)]
    assert changed.data.cause.detail == "grow" and changed.data.previous_hash == started.data.config_hash
