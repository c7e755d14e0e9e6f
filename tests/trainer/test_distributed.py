"""Two ranks over gloo on CPU under torchrun: expert parallelism 2 (data parallelism 2).

Megatron-Core on CPU allows this (the allgather dispatcher, the local spec); it does not allow
tensor parallelism with MoE (sequence parallelism is required and the local LayerNorm refuses it)
nor the alltoall dispatcher (CUDA streams): see ``runledger.trainer.cpu_compat``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.trainer import ROOT, assert_gap_free, data, read_spool, tiny_config_file


def _torchrun(config: Path, spool: Path, log: Path, *extra: str) -> int:
    port = 29400 + os.getpid() % 500
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
        "-m", "runledger.cli.train_cmd", str(config), "--spool", str(spool), "--log-every", "0", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        return subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=300
        ).returncode


@pytest.mark.slow
def test_two_ranks_expert_parallel_over_gloo(tmp_path: Path) -> None:
    config = tiny_config_file(
        tmp_path,
        "run.steps=14",
        "parallel.ep=2",
        "moe.capacity_factor=1.0",
        "checkpoint.interval=4",
        "checkpoint.final=true",
        "telemetry.rank_stats_interval=2",
        "debug.crash_at_step=7",  # rank 0 dies at step 7 of attempt 1
        run_id="two",
    )
    spool, log = tmp_path / "spool", tmp_path / "torchrun.log"
    assert _torchrun(config, spool, log) != 0
    assert _torchrun(config, spool, log, "--resume") == 0, log.read_text()[-3000:]

    main, other = read_spool(spool), read_spool(tmp_path / "spool.rank1")
    assert_gap_free(main)
    assert_gap_free(other)
    assert {e.source for e in other} == {"trainer/two/a1/rank1", "trainer/two/a2/rank1"}

    # Each rank recorded its own crash: rank 0 the injected one, rank 1 its lost peer.
    crashes = {e.data.rank: data(e) for e in main + other if e.type == "runledger.run.crashed"}
    assert set(crashes) == {0, 1}
    assert "injected crash at step 7" in crashes[0]["message"]
    assert crashes[1]["kind"] == "exception" and crashes[1]["last_step"] == 6 and crashes[1]["host"]

    # Rank 0 alone reports the run; every rank reports its own step time and host.
    started = next(e for e in main if e.type == "runledger.run.started")
    assert data(started)["world_size"] == 2 and data(started)["parallelism"] == {
        "tp": 1,
        "ep": 2,
        "dp": 2,
        "pp": 1,
    }
    assert not [e for e in other if e.type in ("runledger.step.metrics", "runledger.moe.router_stats")]
    rank_stats = [e for e in main + other if e.type == "runledger.rank.stats" and e.attempt == 2]
    assert {(e.data.rank, e.step) for e in rank_stats} == {(r, s) for r in (0, 1) for s in (6, 8, 10, 12, 14)}
    assert all(e.data.host and e.data.step_time_s > 0 for e in rank_stats)

    # Global metrics: both ranks' tokens, drops counted across ranks, loss falling.
    resumed = next(e for e in main if e.type == "runledger.run.resumed")
    assert (resumed.attempt, data(resumed)["from_checkpoint_step"]) == (2, 4)
    metrics = {e.step: data(e) for e in main if e.type == "runledger.step.metrics" and e.attempt == 2}
    assert sorted(metrics) == list(range(5, 15)) and metrics[5]["tokens"] == 2 * 8 * 64
    for event in (e for e in main if e.type == "runledger.moe.router_stats"):
        for layer in event.data.layers:
            assert layer.tokens == 2 * 8 * 64
            assert sum(layer.expert_counts) == layer.tokens * layer.top_k - layer.dropped
    first = next(data(e)["loss"] for e in main if e.type == "runledger.step.metrics")
    assert metrics[14]["loss"] < first - 1.0

    # The replicas stayed in sync: dense weights equal on both ranks, experts their own.
    final = tmp_path / "ckpt" / "step_00000014"
    shards = [torch.load(final / f"rank{r:05d}.pt", weights_only=False)["model"] for r in (0, 1)]
    dense = [k for k, v in shards[0].items() if isinstance(v, torch.Tensor) and "local_experts" not in k]
    experts = [k for k, v in shards[0].items() if isinstance(v, torch.Tensor) and "local_experts" in k]
    assert dense and experts
    assert all(torch.equal(shards[0][k], shards[1][k]) for k in dense)
    assert not any(torch.equal(shards[0][k], shards[1][k]) for k in experts)
