"""Router statistics against an independent count, and the background emitter's guarantees."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from runledger.schemas.payloads import Annotation, StepMetrics
from runledger.trainer import cpu_compat, distributed, telemetry
from runledger.trainer import model as model_lib
from runledger.trainer.data import Batches
from tests.support.sinks import ListSink
from tests.support.trainer import tiny_config


def _build(tmp_path: Path, *extra: str):
    cfg = tiny_config(tmp_path, *extra)
    device = torch.device("cpu")
    cpu_compat.apply(device)
    env = distributed.init_distributed(cfg, device)
    cpu_compat.seed_rng(cfg.run.seed, device)
    model = model_lib.build_model(cfg, device)
    return cfg, env, model


def _forward_with_independent_count(cfg, model, stats):
    """One forward; returns (stats rows, independent per-layer (dropped, kept per expert))."""
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    for i, router in enumerate(model_lib.routers(model)):
        handles.append(
            router.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
        )
    tokens, labels = Batches(cfg, dp_rank=0, device=torch.device("cpu")).get(step=1)
    mask = cpu_compat.causal_attention_mask(cfg.model.seq_length, torch.device("cpu"))
    model_lib.loss_fn(model, tokens, labels, mask)
    for h in handles:
        h.remove()
    rows = telemetry.layer_stats(stats.take().tolist(), stats.num_layers, cfg.moe.num_experts, cfg.moe.top_k)
    expected = []
    e, k, cf = cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.capacity_factor
    for i, router in enumerate(model_lib.routers(model)):
        hidden = inputs[i].reshape(-1, cfg.model.hidden_size).float()
        logits = hidden @ router.weight.float().t()
        chosen = torch.topk(logits, k, dim=-1).indices.flatten()
        counts = torch.bincount(chosen, minlength=e).tolist()
        t = hidden.shape[0]
        cap = math.ceil(t * k / e * cf) if cf is not None else t
        kept = [min(c, cap) for c in counts]
        expected.append((t, sum(counts) - sum(kept), kept))
    return rows, expected


@pytest.mark.parametrize("capacity", [None, 1.0, 0.5])
def test_drops_and_counts_match_an_independent_count(tmp_path: Path, capacity: float | None) -> None:
    cfg, _, model = _build(tmp_path, f"moe.capacity_factor={'none' if capacity is None else capacity}")
    stats = telemetry.RouterStats(model, cfg.moe.num_experts, cfg.moe.top_k, torch.device("cpu"))
    try:
        rows, expected = _forward_with_independent_count(cfg, model, stats)
    finally:
        stats.close()
    assert len(rows) == cfg.model.num_layers
    for row, (tokens, dropped, kept) in zip(rows, expected, strict=True):
        assert row.tokens == tokens == cfg.data.micro_batch_size * cfg.model.seq_length
        assert row.dropped == dropped
        assert row.expert_counts == kept
        assert sum(row.expert_counts) == tokens * cfg.moe.top_k - row.dropped
        assert row.token_drop_rate == pytest.approx(dropped / (tokens * cfg.moe.top_k))
        assert row.aux_loss is not None and row.aux_loss >= 1.0 - 1e-5  # E·Σ f·P is 1 when balanced
        assert 0.0 < row.routing_entropy <= math.log(cfg.moe.num_experts) + 1e-5
        assert row.z_loss is not None and row.z_loss > 0
        if capacity is None:
            assert row.dropped == 0
    if capacity == 0.5:
        assert all(row.dropped > 0 for row in rows)  # half the slots: drops are certain


def test_router_stats_close_removes_the_hooks(tmp_path: Path) -> None:
    cfg, _, model = _build(tmp_path)
    router = model_lib.routers(model)[0]
    stats = telemetry.RouterStats(model, cfg.moe.num_experts, cfg.moe.top_k, torch.device("cpu"))
    assert "gating" in router.__dict__ and router._forward_hooks
    stats.close()
    assert "gating" not in router.__dict__ and not router._forward_hooks


def test_flop_formula_is_stated_and_positive(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    d, f, e, k, v, s, layers = 64, 128, 8, 2, 256, 64, 2
    n_active = layers * (4 * d * d + k * 2 * d * f + d * e) + d * v
    assert model_lib.flops_per_token(cfg) == 6 * n_active + 12 * layers * s * d
    assert telemetry.mfu_percent(cfg, 1e5, 1) == pytest.approx(
        100 * 1e5 * model_lib.flops_per_token(cfg) / 0.16e12
    )


class GatedSink(ListSink):
    """Blocks in emit until released: a slow bus."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def emit(self, envelope) -> None:
        self.gate.wait(10)
        super().emit(envelope)


def _emitter(sink, **kw) -> telemetry.Emitter:
    return telemetry.Emitter(sink, source="trainer/r/a1/rank0", stream="r", run_id="r", attempt=1, **kw)


def test_full_queue_drops_metrics_without_blocking_and_reports_the_gap() -> None:
    sink = GatedSink()
    em = _emitter(sink, queue_size=2, critical_timeout_s=0.2)
    accepted = [em.submit(StepMetrics(loss=1.0), step=1)]
    time.sleep(0.05)  # the thread takes the first and blocks in emit
    t0 = time.perf_counter()
    accepted += [em.submit(StepMetrics(loss=float(i)), step=i) for i in range(2, 12)]
    assert time.perf_counter() - t0 < 0.1, "metrics submits never wait"
    t0 = time.perf_counter()
    assert not em.submit(Annotation(author="a", text="t"), step=None, critical=True)
    assert 0.15 < time.perf_counter() - t0 < 2, "a lifecycle event waits, but only a bounded time"
    assert sum(accepted) == 3 and em.dropped == 9
    sink.gate.set()
    assert em.close()
    # Dropped events keep their seq numbers (a gap ingest records) and a producer.dropped says why.
    assert [e.seq for e in sink.events] == [0, 1, 2, 12]
    report = sink.events[-1].data
    assert (report.count, report.first_step, report.last_step) == (9, 4, 11)
    assert sink.syncs >= 1


def test_emit_retries_a_failing_sink_and_builds_payloads_in_the_thread() -> None:
    class Flaky(ListSink):
        failures = 1

        def emit(self, envelope) -> None:
            if self.failures:
                self.failures -= 1
                raise OSError("bus hiccup")
            super().emit(envelope)

    sink = Flaky()
    em = _emitter(sink)
    built: list[str] = []

    def factory() -> StepMetrics:
        built.append(threading.current_thread().name)
        return StepMetrics(loss=2.0)

    em.submit(factory, step=3)
    em.submit(StepMetrics(loss=float("nan")), step=4)
    assert em.flush()
    assert built == ["emitter-trainer/r/a1/rank0"]
    assert [(e.seq, e.step) for e in sink.events] == [(0, 3), (1, 4)]
    assert em.close() and em.errors == 0
