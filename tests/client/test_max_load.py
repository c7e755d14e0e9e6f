"""``max_load``, the fifth router stat (issue 39): ``Run.log_router(max_load=…)`` lands in
``moe_layer_stats.max_load`` of a new ledger (a lake), through the spool and ingest; an event
without it keeps its bytes and reads as null."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

import runledger
from runledger.ledger.lake import EMBEDDED_CATALOG, LAKE_MARKER
from runledger.schemas.canonical import canonical_bytes
from runledger.schemas.payloads import MoeLayerStats
from runledger.schemas.step_payloads import (
    StepReport,
    layer_stats_from_arrays,
    max_load_of_counts,
    step_metrics,
)
from tests.client.ledger_support import cli_json, ingest, of_type
from tests.support.sinks import ListSink

LOADS = {1: [1.25, 3.5, 1.0], 2: [2.0, 1.125, 7.75]}  # step → one max load per layer


def _layer_rows(ledger: Path, run_id: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = cli_json(
        ledger,
        "query",
        "SELECT step, layer, max_load, aux_loss FROM moe_layer_stats "
        f"WHERE run_id = '{run_id}' ORDER BY step, layer",
    )
    return rows


def test_log_router_max_load_lands_in_a_new_lake(client_env: dict[str, str], tmp_path: Path) -> None:
    counts = np.array([[10, 20, 30], [5, 5, 5], [0, 9, 3]])
    with runledger.init("ml-1", handle_signals=False) as run:
        for step, loads in LOADS.items():
            assert run.log_router(step, counts=counts, max_load=np.array(loads), top_k=1)
        # step 3: no max_load given (as every producer before issue 39): null, not a value
        assert run.log_router(3, counts=counts, aux_loss=[0.5, 0.25, 0.125], top_k=1)
        # step 4: a NaN travels as null like the other stats, the other layers keep theirs
        assert run.log_router(4, counts=counts, max_load=[np.nan, 1.5, 2.5], top_k=1)

    ledger = tmp_path / "ledger"
    ingest(ledger, Path(client_env["RUNLEDGER_SPOOL"]))
    # a new ledger is a lake with its catalog in the folder: the format this test is about
    assert (ledger / LAKE_MARKER).exists() and (ledger / EMBEDDED_CATALOG).exists()
    got = {(r["step"], r["layer"]): r["max_load"] for r in _layer_rows(ledger, "ml-1")}
    want: dict[tuple[int, int], float | None] = {
        (step, layer): load for step, loads in LOADS.items() for layer, load in enumerate(loads)
    }
    want |= {(3, layer): None for layer in range(3)}
    want |= {(4, 0): None, (4, 1): 1.5, (4, 2): 2.5}
    assert got == want


def test_an_event_without_max_load_keeps_its_bytes(client_env: dict[str, str]) -> None:
    """Leaving max_load out leaves it out of the event: the canonical bytes (the Merkle leaf) of a
    router event from a producer that does not measure it are those of an older producer's."""
    old_layer = (
        b'{"layer":0,"tokens":4,"top_k":1,"dropped":0,"token_drop_rate":0.0,"sender_drops":null,'
        b'"receiver_drops":null,"expert_counts":[1,3],"aux_loss":null,"z_loss":null,"routing_entropy":null}'
    )
    decoded = msgspec.json.decode(old_layer, type=MoeLayerStats)
    assert decoded.max_load is msgspec.UNSET
    assert msgspec.json.encode(decoded) == old_layer
    [rebuilt] = layer_stats_from_arrays(
        top_k=1,
        tokens=np.array([4]),
        dropped=np.array([0]),
        drop_rate=np.array([0.0]),
        counts=np.array([[1, 3]]),
    )
    assert canonical_bytes(rebuilt) == canonical_bytes(decoded)
    assert b"max_load" not in canonical_bytes(rebuilt)
    explicit_null = msgspec.json.decode(old_layer[:-1] + b',"max_load":null}', type=MoeLayerStats)
    assert explicit_null.max_load is None


def test_the_spool_event_carries_max_load_only_when_given(client_env: dict[str, str]) -> None:
    with runledger.init("ml-2", handle_signals=False) as run:
        run.log_router(1, counts=[[1, 3]], max_load=[1.5], top_k=1)
        run.log_router(2, counts=[[1, 3]], top_k=1)
    given, absent = of_type(Path(client_env["RUNLEDGER_SPOOL"]), "router_stats")
    assert [layer.max_load for layer in given.data.layers] == [1.5]
    assert [layer.max_load for layer in absent.data.layers] == [msgspec.UNSET]


def test_a_negative_max_load_is_refused_in_one_line(client_env: dict[str, str]) -> None:
    sink = ListSink()
    run = runledger.init("ml-3", sink=sink, handle_signals=False)
    with pytest.raises(ValueError, match=r"^max_load must be non-negative$"):
        run.log_router(1, counts=np.ones((2, 4)), max_load=[1.0, -0.5])
    with pytest.raises(ValueError, match="max_load has 3 layers, the others 2"):
        run.log_router(1, counts=np.ones((2, 4)), max_load=[1.0, 1.0, 1.0])
    assert run.log_router(1, counts=np.ones((2, 4)), max_load=[1.0, 1.0])  # the refused calls took no step
    run.finish()
    [event] = sink.of("moe.router_stats")
    assert event.step == 1 and [layer.max_load for layer in event.data.layers] == [1.0, 1.0]


def test_logged_names_for_max_load_map_to_the_ledgers(client_env: dict[str, str]) -> None:
    """``router/max_load`` and the mirror's ``router/load_imbalance`` are the step's ``max_load``."""
    sink = ListSink()
    run = runledger.init("ml-4", sink=sink, handle_signals=False)
    run.log({"router/max_load": 1.5}, step=1)
    run.log({"router/load_imbalance": 1.25}, step=2)
    run.log({"router/max_load": 1.5, "max_load": 2.0}, step=3)  # a collision keeps both names
    run.finish()
    scalars = [e.data.scalars for e in sink.of("step.metrics")]
    assert scalars == [{"max_load": 1.5}, {"max_load": 1.25}, {"router/max_load": 1.5, "max_load": 2.0}]


def test_max_load_of_counts_is_max_over_mean() -> None:
    counts = np.array([[10, 20, 30], [5, 5, 5], [0, 0, 0], [0, 0, 8]])
    loads = max_load_of_counts(counts)
    assert loads[:2].tolist() == [1.5, 1.0] and np.isnan(loads[2]) and loads[3] == 3.0


def _report(max_load: np.ndarray | None) -> StepReport:
    layers = layer_stats_from_arrays(
        top_k=1,
        tokens=np.array([6, 6]),
        dropped=np.array([0, 0]),
        drop_rate=np.array([0.0, 0.0]),
        counts=np.array([[2, 4], [3, 3]]),
        max_load=max_load,
    )
    return StepReport(1, 2.0, 1.0, 1e-3, 12, 12, 0.5, 24.0, 1.0, layers=layers)


def test_the_trainers_step_scalar_is_the_layer_mean_only_when_every_layer_has_it() -> None:
    assert step_metrics(_report(np.array([4 / 3, 1.0]))).scalars["max_load"] == pytest.approx(7 / 6)
    assert "max_load" not in step_metrics(_report(np.array([4 / 3, np.nan]))).scalars
    assert "max_load" not in step_metrics(_report(None)).scalars


def test_the_trainers_layer_stats_carry_max_load() -> None:
    pytest.importorskip("torch")
    from runledger.trainer.telemetry import FIXED_COLS, layer_stats

    experts, top_k = 4, 2
    rows = np.zeros((2, FIXED_COLS + experts))
    rows[:, 0] = [8, 0]  # tokens: the second layer routed none
    rows[0, FIXED_COLS:] = [2, 6, 4, 4]
    layers = layer_stats(rows.ravel().tolist(), 2, experts, top_k)
    assert [layer.max_load for layer in layers] == [1.5, None]


def test_the_mirrors_load_imbalance_is_the_trainers_max_load() -> None:
    """runledger's W&B mirror logs ``router/load_imbalance``; teed back it is the trainer's own
    ``max_load`` step scalar, to the bit."""
    pytest.importorskip("torch")
    from runledger.schemas.step_payloads import metrics_from_values
    from runledger.trainer.mirror import step_values

    counts = np.array([[2, 4, 7], [3, 3, 3]])
    report = _report(None)
    report.layers = layer_stats_from_arrays(
        top_k=1,
        tokens=counts.sum(axis=1),
        dropped=np.zeros(2),
        drop_rate=np.zeros(2),
        counts=counts,
        max_load=max_load_of_counts(counts),
    )
    teed = metrics_from_values(step_values(report))
    assert teed.scalars["max_load"] == step_metrics(report).scalars["max_load"] == (21 / 13 + 1.0) / 2
