"""`ledger simulate reference-535b`: a scaled run of the reference story, through the CLI, into a real ledger.

The run is 2,000 steps, so every position of the 390,000-step reference is scaled by 2,000/390,000
(the dispatcher switch at step 81,716 lands at 419); its values must still follow the published
figures, its crashes and resumes appear in the history, and the switch is blamed on its PR.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from typer.testing import CliRunner

from runledger.cli.main import app
from runledger.ledger.query import Reader
from runledger.workflows import simulate as sim
from tests.support.kafka import broker_fixture

pytestmark = pytest.mark.slow  # a 2,000-step run is emitted and ingested once per module
runner = CliRunner()
STEPS = 2000
RUN = "moe-535b"


def _simulate(spool: Path, *args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["simulate", "reference-535b", "--spool", str(spool), *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Reader]:
    root = tmp_path_factory.mktemp("simulate")
    emitted = _simulate(root / "spool", "--steps", str(STEPS))
    result = runner.invoke(
        app, ["ingest", "spool", "--spool", str(root / "spool"), "--ledger", str(root / "ledger")]
    )
    assert result.exit_code == 0, result.output
    reader = Reader(root / "ledger")
    # The run's events and the detectors' findings in them (its NaN crashes: ledger.anomaly events).
    [(found,)] = reader.sql("SELECT count(*) FROM events WHERE type = 'ledger.anomaly'").rows
    [(nan_crashes,)] = reader.sql("SELECT count(*) FROM crashes WHERE kind = 'nonfinite_loss'").rows
    assert found == nan_crashes > 0
    assert f"ingested {emitted['events'] + found} events" in result.output.replace(",", "")
    assert "0 quarantined" in result.output
    return emitted, reader


def test_drop_rate_follows_the_published_figures_and_changes_at_the_switch(
    run: tuple[dict[str, Any], Reader],
) -> None:
    emitted, reader = run
    switch = emitted["switch_step"]
    assert switch == sim.at(STEPS, sim.SWITCH_STEP) == 419
    rows = reader.sql(
        "SELECT step >= ? AS ragged, avg(token_drop_rate), avg(CAST(sender_drops AS DOUBLE)) "
        "FROM moe_layer_stats WHERE run_id = ? GROUP BY 1 ORDER BY 1",
        [switch, RUN],
    ).rows
    (_, pooled, pooled_sender), (_, ragged, ragged_sender) = rows
    assert pooled == pytest.approx(sim.DROP_RATE_POOLED, rel=0.05)  # 2.67%
    assert ragged == pytest.approx(sim.DROP_RATE_RAGGED, rel=0.15)  # 0.018%
    assert pooled_sender > 0 and ragged_sender == 0  # no sender pools without capacity limits
    # Layers differ (not one constant copied 48 times), and so do steps.
    per_layer = [
        r[0]
        for r in reader.sql(
            "SELECT avg(token_drop_rate) FROM moe_layer_stats WHERE run_id = ? AND step < ? GROUP BY layer",
            [RUN, switch],
        ).rows
    ]
    assert len(per_layer) == sim.LAYERS
    assert max(per_layer) / min(per_layer) > 1.3
    mfu = dict(
        reader.sql(
            "SELECT step >= ?, avg(value) FROM metrics WHERE run_id = ? AND name = 'mfu' GROUP BY 1",
            [switch, RUN],
        ).rows
    )
    assert mfu[False] == pytest.approx(sim.MFU_POOLED_PERCENT, abs=0.1)
    assert mfu[True] == pytest.approx(sim.MFU_RAGGED_PERCENT, abs=0.1)


def test_values_are_realistic(run: tuple[dict[str, Any], Reader]) -> None:
    _, reader = run
    # Loss falls (a data-scaling power law from ~6 at step 1 to ~1.9), never flat: 200-step means decrease.
    blocks = [
        r[0]
        for r in reader.sql(
            "SELECT avg(value) FROM metrics WHERE run_id = ? AND name = 'loss' GROUP BY (step - 1) // 200 "
            "ORDER BY (step - 1) // 200",
            [RUN],
        ).rows
    ]
    assert len(blocks) == STEPS // 200
    assert all(a > b for a, b in itertools.pairwise(blocks))
    first = reader.sql("SELECT value FROM metrics WHERE run_id = ? AND name = 'loss' AND step = 1", [RUN])
    assert 4 < first.rows[0][0] < 12 and 1.6 < blocks[-1] < 2.1
    names = reader.sql("SELECT count(DISTINCT name) FROM metrics WHERE run_id = ?", [RUN]).rows[0][0]
    assert names == 32
    # The canonical series holds one value per step; the superseded attempts' values stay in metrics_all.
    per_step, steps, superseded = reader.sql(
        "SELECT count(*), count(DISTINCT step), "
        "(SELECT count(*) FROM metrics_all WHERE run_id = ? AND name = 'loss' AND superseded) "
        "FROM metrics WHERE run_id = ? AND name = 'loss'",
        [RUN, RUN],
    ).rows[0]
    assert per_step == steps == STEPS and superseded > 0
    # Expert counts every 100 steps: skewed, and they add up to tokens · k − dropped.
    counts = reader.sql(
        "SELECT step, layer, tokens * top_k - dropped, list_sum(expert_counts), "
        "list_max(expert_counts) / list_min(expert_counts) "
        "FROM moe_layer_stats WHERE run_id = ? AND len(expert_counts) > 0",
        [RUN],
    ).rows
    assert len(counts) == (STEPS // 100) * sim.LAYERS
    assert all(kept == total for _, _, kept, total, _ in counts)
    assert all(skew > 1.2 for *_, skew in counts)


def test_crashes_and_resumes_appear_in_the_history(run: tuple[dict[str, Any], Reader]) -> None:
    emitted, reader = run
    kinds = [item.kind for item in reader.history(RUN)]
    assert kinds.count("run.crashed") == emitted["crashes"] == sim.REFERENCE_CRASHES
    assert kinds.count("run.resumed") == sim.REFERENCE_CRASHES
    assert kinds.count("config.changed") == 7
    by_kind = dict(reader.sql("SELECT kind, count(*) FROM crashes WHERE run_id = ? GROUP BY 1", [RUN]).rows)
    assert set(by_kind) == {"exception", "signal", "oom", "nonfinite_loss"}
    # The flaky host is the one that fails most: what the lab asked its cluster.
    host, crashes = reader.sql(
        "SELECT host, count(*) FROM crashes WHERE run_id = ? GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 1", [RUN]
    ).rows[0]
    assert host in {sim.host_of(r) for r in sim.FLAKY_RANKS} and crashes >= 3
    result = runner.invoke(app, ["history", RUN, "--ledger", str(reader.root), "--limit", "0"])
    assert result.exit_code == 0, result.output
    # Months of history on one screen: each crash beside the resume that followed it.
    assert result.output.count("crash → resume") == sim.REFERENCE_CRASHES
    assert "resumed as attempt 2 from step" in result.output
    full = runner.invoke(app, ["history", RUN, "--ledger", str(reader.root), "--all", "--limit", "0"])
    assert full.output.count("resumed from checkpoint step") == sim.REFERENCE_CRASHES


def test_the_switch_is_blamed_on_its_pr(run: tuple[dict[str, Any], Reader]) -> None:
    emitted, reader = run
    switch = emitted["switch_step"]
    blame = reader.blame(RUN, "moe.dispatcher", step=switch + 5)
    assert blame["value"] == "ragged_all_to_all"
    assert blame["set_by"]["kind"] == "config.changed" and blame["set_by"]["step"] == switch
    (pr,) = blame["pull_requests"]
    assert "ragged all-to-all" in pr["title"] and pr["merged"]
    assert blame["set_by"]["cause"]["commit"] == blame["commit"]
    before = reader.blame(RUN, "moe.dispatcher", step=switch - 1)
    assert before["value"] == "pooled_wave" and before["set_by"]["kind"] == "start"
    # Every attempt runs a squash-merge commit of a PR on main.
    relations = reader.sql("SELECT pr_relation FROM attempt_commits WHERE run_id = ?", [RUN]).rows
    assert len(relations) == sim.REFERENCE_CRASHES + 1
    assert {r[0] for r in relations} == {"merge_commit"}


def _segments(spool: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(spool.glob("*.seg"))}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    args = ["--steps", "400", "--crashes", "3", "--rank-stats-every", "200"]
    a = _simulate(tmp_path / "a", *args)
    b = _simulate(tmp_path / "b", *args)
    _simulate(tmp_path / "c", *args, "--seed", "1")
    assert a["events"] == b["events"] > 0
    assert _segments(tmp_path / "a") == _segments(tmp_path / "b")
    assert _segments(tmp_path / "a") != _segments(tmp_path / "c")


def test_usage_mistakes(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["simulate", "reference-535b", "--bus", "kafka", "--spool", str(tmp_path / "s")],
        env={"RUNLEDGER_KAFKA_BOOTSTRAP": ""},
    )
    assert result.exit_code == 2 and "--bootstrap" in result.output
    result = runner.invoke(
        app, ["simulate", "reference-535b", "--steps", "10", "--spool", str(tmp_path / "s")]
    )
    assert result.exit_code == 2 and "at least 200" in result.output
    result = runner.invoke(
        app, ["simulate", "reference-535b", "--run-id", "a b", "--spool", str(tmp_path / "s")]
    )
    assert result.exit_code == 2 and "run id" in result.output


@pytest.fixture(scope="module")
def kafka_bootstrap() -> Iterator[str]:
    broker = broker_fixture()
    yield next(broker).bootstrap
    with contextlib.suppress(StopIteration):
        next(broker)


@pytest.mark.kafka
def test_through_kafka(tmp_path: Path, kafka_bootstrap: str) -> None:
    """--bus kafka: the same stream through a real broker, rebuilt into a ledger by `ledger replay`."""
    prefix = f"simulate{uuid.uuid4().hex[:8]}."
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(prefix + "events", 2, 1)])
    admin.close()
    env = {"RUNLEDGER_KAFKA_TOPIC_PREFIX": prefix}
    args = ["--steps", "300", "--crashes", "2", "--rank-stats-every", "150", "--bus", "kafka"]
    result = runner.invoke(
        app,
        [
            "simulate",
            "reference-535b",
            *args,
            "--bootstrap",
            kafka_bootstrap,
            "--spool",
            str(tmp_path / "out"),
        ],
        env=env,
    )
    assert result.exit_code == 0, result.output
    emitted = json.loads(result.stdout)
    if (tmp_path / "out").is_dir():  # what the producer spooled and could not hand over on close
        drained = runner.invoke(
            app,
            ["kafka", "drain-spool", "--spool", str(tmp_path / "out"), "--bootstrap", kafka_bootstrap],
            env=env,
        )
        assert drained.exit_code == 0, drained.output
    replayed = runner.invoke(
        app, ["replay", "--bootstrap", kafka_bootstrap, "--to", str(tmp_path / "l")], env=env
    )
    assert replayed.exit_code == 0, replayed.output
    reader = Reader(tmp_path / "l")
    assert reader.sql("SELECT count(*) FROM events").rows[0][0] == emitted["events"]
    assert reader.sql("SELECT count(*) FROM quarantine").rows[0][0] == 0
    pooled = reader.sql(
        "SELECT avg(token_drop_rate) FROM moe_layer_stats WHERE run_id = ? AND step < ?",
        [RUN, emitted["switch_step"]],
    ).rows[0][0]
    assert pooled == pytest.approx(sim.DROP_RATE_POOLED, rel=0.1)
