"""AdamW with fp32 master weights, and the learning-rate schedule.

Megatron's own optimizer allocates on "cuda", so the trainer keeps a small one of its own that
runs on both devices: AdamW over fp32 parameters (the model's own under fp32; fp32 copies of
them under bf16, written back after each step), weight decay on matrices only (as nanoGPT).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from runledger.trainer.config import OptimizerConfig, TrainConfig


class MasterAdamW:
    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig) -> None:
        # Tensors, not Parameters: under fp32 ``master`` is this same list, and otherwise plain copies.
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:
            self.master = [p.detach().float().clone() for p in self.params]
        else:
            self.master = self.params
        decay = [m for m, p in zip(self.master, self.params, strict=True) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.master, self.params, strict=True) if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            foreach=True,
        )

    def set_hyper(self, *, lr: float, weight_decay: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.param_groups[0]["weight_decay"] = weight_decay  # group 0 holds the matrices

    def grads_to_master(self) -> list[torch.Tensor]:
        """The gradients the optimizer will use (fp32), after the model's backward."""
        if self.mixed:
            for m, p in zip(self.master, self.params, strict=True):
                m.grad = None if p.grad is None else p.grad.float()
        return [m.grad for m in self.master if m.grad is not None]

    def step(self) -> None:
        self.opt.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.mixed:
            for m in self.master:
                m.grad = None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"opt": self.opt.state_dict()}
        if self.mixed:
            state["master"] = [m.detach().cpu() for m in self.master]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["opt"])
        if self.mixed and "master" in state:
            with torch.no_grad():
                for m, saved in zip(self.master, state["master"], strict=True):
                    m.copy_(saved)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``optimizer.lr`` over ``schedule.warmup_steps``, then decay to ``min_lr``
    by ``schedule.decay_steps`` (default: run.steps). ``step`` is 1-based."""
    peak, floor = cfg.optimizer.lr, cfg.optimizer.min_lr
    warm = cfg.schedule.warmup_steps
    if warm > 0 and step <= warm:
        return peak * step / warm
    if cfg.schedule.decay == "constant":
        return peak
    total = cfg.schedule.decay_steps or cfg.run.steps
    frac = min(1.0, max(0.0, (step - warm) / max(1, total - warm)))
    if cfg.schedule.decay == "linear":
        return peak - frac * (peak - floor)
    return floor + 0.5 * (1.0 + math.cos(math.pi * frac)) * (peak - floor)
