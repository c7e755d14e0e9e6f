"""On the model: hooks on the routers keep each micro-batch's top-k selection before dropping; per step,
every policy's per-layer drop rate is counted and the expert bias updated (``DropCollector``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from runledger.trainer import drop_accounting as da
from runledger.workflows.study.options import StudyError, StudyOptions
from runledger.workflows.study.policies import Policy, count_drops

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter


class DropCollector:
    """Hooks on a model's routers (installed by ``train(on_model=...)``) and the per-step callback.

    ``series[policy]`` is, per step, the list of per-layer drop rates."""

    def __init__(self, options: StudyOptions, policies: Sequence[Policy]) -> None:
        self.options = options
        self.policies = list(policies)
        self.series: dict[Policy, list[list[float]]] = {p: [] for p in [*self.policies, Policy("trainer")]}
        self.steps: list[int] = []
        self.routers: list[TopKRouter] = []
        self._selections: dict[int, list[torch.Tensor]] = {}
        self.accounting_s = 0.0

    def install(self, model: torch.nn.Module) -> None:
        from runledger.trainer import model as model_lib

        self.routers = model_lib.routers(model)
        for index, router in enumerate(self.routers):
            _enable_expert_bias(router)
            self._wrap_routing(index, router)

    def _wrap_routing(self, index: int, router: TopKRouter) -> None:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        original = router.routing  # the bound method
        tcfg = router.config
        experts = tcfg.num_moe_experts

        def routing(logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
            # The router's own selection before any capacity is applied (expert bias included).
            with torch.no_grad():
                _, selection = topk_routing_with_score_function(
                    logits.detach().reshape(-1, experts).float(),
                    tcfg.moe_router_topk,
                    use_pre_softmax=tcfg.moe_router_pre_softmax,
                    num_groups=tcfg.moe_router_num_groups,
                    group_topk=tcfg.moe_router_group_topk,
                    scaling_factor=tcfg.moe_router_topk_scaling_factor,
                    score_function=tcfg.moe_router_score_function,
                    expert_bias=router.expert_bias,
                )
            self._selections.setdefault(index, []).append(selection.bool())
            return original(logits, padding_mask=padding_mask)

        router.routing = routing  # instance attribute: this router only

    def on_step(self, report: Any) -> None:
        """``train(progress=...)``: count this step's drops, then update the expert bias."""
        started = time.perf_counter()
        k = self.options.top_k
        per_policy: dict[Policy, list[float]] = {p: [] for p in self.policies}
        for layer in range(len(self.routers)):
            selections = self._selections.pop(layer, [])
            tokens = sum(s.shape[0] for s in selections)
            dropped = dict.fromkeys(self.policies, 0)
            for selection in selections:
                for policy, n in count_drops(selection, k, self.policies).items():
                    dropped[policy] += n
            for policy in self.policies:
                per_policy[policy].append(da.drop_rate(dropped[policy], tokens, k))
        for policy, rates in per_policy.items():
            self.series[policy].append(rates)
        self.series[Policy("trainer")].append([layer.token_drop_rate for layer in report.layers])
        self.steps.append(report.step)
        self._update_expert_bias()
        self.accounting_s += time.perf_counter() - started

    @torch.no_grad()
    def _update_expert_bias(self) -> None:
        # Megatron's rule (moe_utils.get_updated_expert_bias), on one process: no all-reduce needed.
        for router in self.routers:
            counts = router.local_tokens_per_expert
            offset = counts.mean() - counts
            router.expert_bias += torch.sign(offset) * self.options.expert_bias_rate
            counts.zero_()


def _enable_expert_bias(router: TopKRouter) -> None:
    """Turn on Megatron's aux-loss-free expert bias on a built router (the trainer's config has no
    switch for it): the config flag and the two buffers its constructor would have made."""
    if router.config.moe_router_score_function != "sigmoid":
        # Megatron adds the bias to sigmoid scores only; with softmax it would silently do nothing.
        raise StudyError("the expert bias needs moe.score_function = 'sigmoid'")
    experts = router.config.num_moe_experts
    device = router.weight.device
    router.config.moe_router_enable_expert_bias = True
    router.enable_expert_bias = True
    for name, persistent in (("local_tokens_per_expert", False), ("expert_bias", True)):
        if name in router.__dict__:
            del router.__dict__[name]  # the constructor stored None as a plain attribute
        router.register_buffer(
            name, torch.zeros(experts, dtype=torch.float32, device=device), persistent=persistent
        )
