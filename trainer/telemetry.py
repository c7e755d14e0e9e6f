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
  * routing entropy: mean over tokens of −Σᵢ pᵢ log pᵢ of the router's softmax (nats);
  * max load: the busiest expert's kept tokens over the mean kept tokens per expert (from the
    counts, on the host: ``runledger.schemas.step_payloads.max_load_of_counts``).

Everything a step reports (loss, squared gradient norm, the router block) is stacked into one
tensor, all-reduced once across ranks, and read with one ``.tolist()``: one device-to-host transfer.

The payloads are built by ``runledger.schemas.step_payloads`` and emitted by ``runledger.emitter``: the same
path the client library (``runledger.init``) uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

# The emitter and the step payloads live in the library, shared with ``runledger.init``'s clients;
# re-exported here for the trainer's callers.
from runledger.emitter import Emitter, open_rank_sink, rank_spool
from runledger.schemas.payloads import MoeLayerStats
from runledger.schemas.step_payloads import (
    StepReport,
    finite,
    layer_stats_from_arrays,
    max_load_of_counts,
    router_stats,
    step_metrics,
)
from runledger.trainer import model as model_lib
from runledger.trainer.config import TrainConfig

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

__all__ = [
    "Emitter",
    "RouterStats",
    "StepReport",
    "finite",
    "layer_stats",
    "mfu_percent",
    "open_rank_sink",
    "rank_spool",
    "router_stats",
    "step_metrics",
]

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

    def _install(self, index: int, router: TopKRouter) -> None:
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
        self, index: int, router: TopKRouter, logits: torch.Tensor, routing_map: torch.Tensor
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
    rows = np.asarray(flat, dtype=np.float64).reshape(num_layers, FIXED_COLS + num_experts)
    tokens = np.rint(rows[:, TOKENS]).astype(np.int64)
    counts = np.rint(rows[:, FIXED_COLS:]).astype(np.int64)
    dropped = np.maximum(0, tokens * top_k - counts.sum(axis=1))
    denom = np.maximum(1, tokens)
    return layer_stats_from_arrays(
        top_k=top_k,
        tokens=tokens,
        dropped=dropped,
        drop_rate=np.minimum(1.0, dropped / np.maximum(1, tokens * top_k)),
        counts=counts,
        aux_loss=rows[:, AUX] / denom,
        z_loss=rows[:, ZLOSS] / denom,
        entropy=rows[:, ENTROPY] / denom,
        max_load=max_load_of_counts(counts),
    )


def mfu_percent(cfg: TrainConfig, tokens_per_second: float, world_size: int) -> float:
    """Model FLOPs utilisation: tokens/s × FLOPs per token (``model.flops_per_token``) ÷ peak, in %."""
    peak = cfg.telemetry.peak_tflops * 1e12 * world_size
    return 100.0 * tokens_per_second * model_lib.flops_per_token(cfg) / peak if peak > 0 else 0.0
