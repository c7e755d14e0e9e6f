"""Telemetry: router statistics captured on the device, per-step metrics, MFU, and the background
emitter that hands events to the bus so the training loop never waits on it.

Router statistics (per MoE layer, summed over the step's micro-batches, on the device):
  * token-drop rate = dropped (token, expert) assignments ÷ (tokens · k). Megatron applies the
    capacity inside ``TopKRouter.routing`` (``apply_router_token_dropping``); a forward hook on each
    router sees the routing map after dropping, and the map before dropping is the router's own
    top-k selection recomputed from its logits (captured by wrapping the router's ``gating``);
  * per-expert token counts after drops (they sum to tokens · k − dropped);
  * aux loss: the coefficient-free switch load-balancing loss E · Σᵢ fᵢ · Pᵢ (fᵢ: share of the
    tokens · k assignments chosen for expert i before drops, Pᵢ: mean router probability of i),
    the quantity Megatron scales by ``moe_aux_loss_coeff``, reported whether or not it is trained on;
  * z loss: mean over tokens of logsumexp(logits)², likewise before its coefficient;
  * routing entropy: mean over tokens of −Σᵢ pᵢ log pᵢ of the router's softmax (nats).

Everything a step reports (loss, squared gradient norm, the router block) is stacked into one
tensor, all-reduced once across ranks, and read with one ``.tolist()``: one device-to-host transfer.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import torch

from runledger.ingest.bus import EventSink
from runledger.schemas import make_event
from runledger.schemas.envelope import utc_now
from runledger.schemas.payloads import MoeLayerStats, MoeRouterStats, ProducerDropped, StepMetrics
from runledger.schemas.signing import Sealer
from runledger.trainer import model as model_lib
from runledger.trainer.config import TrainConfig

log = logging.getLogger(__name__)

# Columns of one layer's row in the router accumulator: token count, the three token-weighted
# sums, then the per-expert kept counts. Drops are derived on the host: tokens · k − Σ counts.
TOKENS, AUX, ZLOSS, ENTROPY = range(4)
FIXED_COLS = 4


class RouterStats:
    """Hooks on every router that accumulate per-layer statistics on the device."""

    def __init__(self, model: torch.nn.Module, num_experts: int, top_k: int, device: torch.device) -> None:
        self.routers = model_lib.routers(model)
        self.num_layers = len(self.routers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.acc = torch.zeros(self.num_layers, FIXED_COLS + num_experts, dtype=torch.float32, device=device)
        self._handles: list[Any] = []
        self._logits: dict[int, torch.Tensor] = {}
        for index, router in enumerate(self.routers):
            self._install(index, router)

    def _install(self, index: int, router: torch.nn.Module) -> None:
        original = router.gating  # the bound method

        def gating(inp: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = original(inp)
            self._logits[index] = logits.detach()
            return logits

        router.gating = gating  # instance attribute: this router only, removed by close()

        def hook(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            logits = self._logits.pop(index, None)
            if logits is not None:
                self._accumulate(index, module, logits, output[1])

        self._handles.append(router.register_forward_hook(hook))

    @torch.no_grad()
    def _accumulate(
        self, index: int, router: torch.nn.Module, logits: torch.Tensor, routing_map: torch.Tensor
    ) -> None:
        # Few, whole-tensor ops: on a CPU each op costs microseconds whatever its size.
        tcfg = router.config
        e, k = self.num_experts, self.top_k
        logits = logits.reshape(-1, e).float()
        routing_map = routing_map.reshape(-1, e)
        tokens = logits.shape[0]
        if tcfg.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:  # Megatron's aux-loss scores for sigmoid routing: normalised sigmoids
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        if tcfg.moe_expert_capacity_factor is None and not tcfg.moe_pad_expert_input_to_capacity:
            chosen = routing_map  # nothing dropped: the map is the selection
        elif router.expert_bias is None and not tcfg.moe_router_num_groups:
            top = torch.topk(scores, k, dim=-1).indices  # the router's selection, recomputed
            chosen = torch.zeros_like(routing_map).scatter_(1, top, True)
        else:  # a selection with expert bias or groups: the router's own function
            from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

            _, chosen = topk_routing_with_score_function(
                logits,
                k,
                use_pre_softmax=tcfg.moe_router_pre_softmax,
                num_groups=tcfg.moe_router_num_groups,
                group_topk=tcfg.moe_router_group_topk,
                scaling_factor=tcfg.moe_router_topk_scaling_factor,
                score_function=tcfg.moe_router_score_function,
                expert_bias=router.expert_bias,
            )
        kept = (chosen & routing_map).sum(dim=0, dtype=torch.float32)  # padding slots are not tokens
        chosen_counts = kept if chosen is routing_map else chosen.sum(dim=0, dtype=torch.float32)
        # Token-weighted sums: aux = E·Σ f·P (f = chosen/(T·k), P = mean score) times T.
        aux = (chosen_counts * scores.sum(dim=0)).sum() * (e / (tokens * k))
        z = torch.logsumexp(logits, dim=-1).square().sum()
        softmax = scores if tcfg.moe_router_score_function == "softmax" else torch.softmax(logits, dim=-1)
        entropy = torch.special.entr(softmax).sum()  # Σ over tokens of −Σ p log p
        row = self.acc[index]
        row[TOKENS] += tokens
        row[AUX:] += torch.cat([torch.stack([aux, z, entropy]), kept])

    def take(self) -> torch.Tensor:
        """The step's accumulator, flattened (a copy), and a fresh one for the next step."""
        out = self.acc.flatten().clone()
        self.acc.zero_()
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for router in self.routers:
            router.__dict__.pop("gating", None)  # the class's method shows through again


def layer_stats(flat: list[float], num_layers: int, num_experts: int, top_k: int) -> list[MoeLayerStats]:
    """Host-side: the accumulator (after the all-reduce) as per-layer stats."""
    width = FIXED_COLS + num_experts
    out = []
    for layer in range(num_layers):
        row = flat[layer * width : (layer + 1) * width]
        tokens = round(row[TOKENS])
        counts = [round(c) for c in row[FIXED_COLS:]]
        dropped = max(0, tokens * top_k - sum(counts))
        denom = max(1, tokens)
        out.append(
            MoeLayerStats(
                layer=layer,
                tokens=tokens,
                top_k=top_k,
                dropped=dropped,
                token_drop_rate=min(1.0, dropped / max(1, tokens * top_k)),
                expert_counts=counts,
                aux_loss=_finite(row[AUX] / denom),
                z_loss=_finite(row[ZLOSS] / denom),
                routing_entropy=_finite(row[ENTROPY] / denom),
            )
        )
    return out


def _finite(x: float | None) -> float | None:
    """JSON has no NaN/Inf: they travel as null."""
    return x if x is not None and math.isfinite(x) else None


def mfu_percent(cfg: TrainConfig, tokens_per_second: float, world_size: int) -> float:
    """Model FLOPs utilisation: tokens/s × FLOPs per token (``model.flops_per_token``) ÷ peak, in %."""
    peak = cfg.telemetry.peak_tflops * 1e12 * world_size
    return 100.0 * tokens_per_second * model_lib.flops_per_token(cfg) / peak if peak > 0 else 0.0


@dataclass
class StepReport:
    """One step as the loop saw it (host floats): what progress callbacks and events are built from."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    total_tokens: int
    step_time_s: float
    tokens_per_second: float
    mfu: float
    layers: list[MoeLayerStats] = field(default_factory=list)
    scalars: dict[str, float | None] = field(default_factory=dict)

    @property
    def token_drop_rate(self) -> float | None:
        if not self.layers:
            return None
        return sum(layer.token_drop_rate for layer in self.layers) / len(self.layers)


def step_metrics(report: StepReport) -> StepMetrics:
    scalars = dict(report.scalars)
    if report.layers:
        n = len(report.layers)
        scalars["token_drop_rate"] = report.token_drop_rate
        for name in ("aux_loss", "z_loss", "routing_entropy"):
            values = [getattr(layer, name) for layer in report.layers]
            scalars[name] = None if None in values else sum(values) / n  # type: ignore[operator]
    return StepMetrics(
        loss=_finite(report.loss),
        grad_norm=_finite(report.grad_norm),
        lr=report.lr,
        tokens=report.tokens,
        total_tokens=report.total_tokens,
        tokens_per_second=_finite(report.tokens_per_second),
        mfu=_finite(report.mfu),
        step_time_s=report.step_time_s,
        scalars={k: _finite(v) for k, v in scalars.items()},
    )


def router_stats(report: StepReport) -> MoeRouterStats:
    return MoeRouterStats(layers=report.layers)


# --- the background emitter -------------------------------------------------------------------

PayloadLike = msgspec.Struct | Callable[[], msgspec.Struct]


class _Flush:
    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.done = threading.Event()


_STOP = object()


class Emitter:
    """Hands events to a sink from a background thread.

    The loop calls ``submit``: it enqueues (payload or payload factory, step, time) and returns.
    Queue full: a metrics event is dropped and counted (``dropped``); a lifecycle event
    (``critical=True``) waits for space for at most ``critical_timeout_s`` (it is rare, and losing it
    would break the run's lineage). Sequence numbers are assigned at ``submit``, so a dropped event
    leaves a gap in ``seq`` that ingest records as an incident (``runledger.ledger.admission``); and
    the emitter says why with a ``runledger.producer.dropped`` event (count, first and last step),
    queued as soon as there is room again, or at ``close``.
    """

    def __init__(
        self,
        sink: EventSink,
        *,
        source: str,
        stream: str,
        run_id: str,
        attempt: int,
        queue_size: int = 4096,
        critical_timeout_s: float = 30.0,
        start_seq: int = 0,
    ) -> None:
        self.sink = sink
        self.source = source
        self.stream = stream
        self.run_id = run_id
        self.attempt = attempt
        self.critical_timeout_s = critical_timeout_s
        self.seq = start_seq  # the next seq to assign (at submit)
        self.dropped = 0
        self._unreported: list[Any] = [0, None, None]  # drops not yet reported: count, first, last step
        self._seq_lock = threading.Lock()
        self.emitted = 0
        self.errors = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, queue_size))
        self._thread = threading.Thread(target=self._run, name=f"emitter-{source}", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, payload: PayloadLike, *, step: int | None, critical: bool = False) -> bool:
        """Enqueue one event; True if it was accepted."""
        if self._closed:
            return False
        with self._seq_lock:
            if self._unreported[0]:
                self._report_drops(wait=False)
            item = (payload, step, utc_now(), self.seq)
            self.seq += 1
        try:
            if critical:
                self._queue.put(item, timeout=self.critical_timeout_s)
            else:
                self._queue.put_nowait(item)
        except queue.Full:
            with self._seq_lock:
                self.dropped += 1
                tally = self._unreported
                tally[0] += 1
                if step is not None:
                    tally[1] = step if tally[1] is None else min(tally[1], step)
                    tally[2] = step if tally[2] is None else max(tally[2], step)
            if critical:
                log.error("emitter queue full for %.0fs: lifecycle event lost", self.critical_timeout_s)
            return False
        return True

    def _report_drops(self, *, wait: bool) -> None:
        """Queue a ``producer.dropped`` event for the drops not yet reported (under ``_seq_lock``);
        its seq is taken only if it was queued."""
        count, first, last = self._unreported
        report = ProducerDropped(count=count, first_step=first, last_step=last)
        try:
            if wait:
                self._queue.put((report, last, utc_now(), self.seq), timeout=self.critical_timeout_s)
            else:
                self._queue.put_nowait((report, last, utc_now(), self.seq))
        except queue.Full:
            return
        self.seq += 1
        self._unreported = [0, None, None]

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, _Flush):
                    if item.sync:
                        self._guarded(self.sink.sync)
                    item.done.set()
                    continue
                payload, step, when, seq = item
                self._emit(payload() if callable(payload) else payload, step, when, seq)
            except Exception:  # a bad payload must not kill the thread
                self.errors += 1
                log.exception("emitter: could not emit an event")
            finally:
                self._queue.task_done()

    def _emit(self, payload: msgspec.Struct, step: int | None, when: datetime, seq: int) -> None:
        envelope = make_event(
            payload,
            source=self.source,
            stream=self.stream,
            seq=seq,
            run_id=self.run_id,
            attempt=self.attempt,
            step=step,
            time=when,
        )
        for attempt in range(3):
            try:
                self.sink.emit(envelope)
                break
            except Exception:
                if attempt == 2:
                    raise  # counted by _run; its seq is a gap that ingest records
                time.sleep(0.05 * (attempt + 1))
        self.emitted += 1

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.errors += 1
            log.exception("emitter: sink call failed")

    def flush(self, *, sync: bool = True, timeout: float = 60.0) -> bool:
        """Wait until everything submitted so far was handed to the sink (and synced: durable)."""
        if self._closed or not self._thread.is_alive():
            return False
        marker = _Flush(sync)
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def close(self, timeout: float = 60.0) -> bool:
        """Flush, sync, stop the thread. The sink stays open (its owner closes it)."""
        if self._closed:
            return True
        with self._seq_lock:
            if self._unreported[0] and self._thread.is_alive():
                self._report_drops(wait=True)
        ok = self.flush(sync=True, timeout=timeout)
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return ok and not self._thread.is_alive()

    @property
    def pending(self) -> int:
        return self._queue.qsize()


def rank_spool(spool: str | Path | None, rank: int) -> Path:
    """The spool a rank writes to: the given one for rank 0, ``<spool>.rank<N>`` beside it for the
    others (a spool has one writer)."""
    from runledger.ingest.bus import default_spool_dir

    base = Path(spool) if spool is not None else default_spool_dir()
    return base if rank == 0 else base.with_name(f"{base.name}.rank{rank}")


def open_rank_sink(spool: str | Path | None, rank: int = 0, kafka_bootstrap: str | None = None) -> EventSink:
    """This rank's sink: Kafka if configured (every rank produces), else its own spool. With
    ``RUNLEDGER_PRODUCER_KEY`` set, every event is signed with that key and chained per source."""
    from runledger.ingest.bus import open_sink

    return open_sink(rank_spool(spool, rank), kafka_bootstrap, sealer=Sealer.from_env(chain=True))
