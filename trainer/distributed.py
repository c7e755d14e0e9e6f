"""Process groups: a single process, or torchrun's ranks over gloo (CPU) or NCCL (GPU).

Two planes:
  * data: the default process group (gloo on CPU, NCCL on GPU) carries gradients and the one
    per-step stats all-reduce; Megatron's parallel_state carves it into TP / EP / DP groups.
  * control: a gloo group on host tensors carries the step-boundary flags (stop requested, config
    changed) and the broadcast of a live config patch from rank 0, so they never cost a
    device-to-host transfer and every rank applies a change at the same step.

Gradients are reduced here rather than by Megatron's DistributedDataParallel, whose buffers and
optimizer allocate on "cuda": dense parameters are summed over the data-parallel group, expert
parameters over the expert-data-parallel group, both scaled by 1/dp (each rank's loss is the mean
over its own micro-batch, the global loss their mean).
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runledger.trainer.config import ConfigError, TrainConfig


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp: int
    ep: int
    dp: int
    host: str
    control_group: Any = None  # gloo ProcessGroup (None when world_size == 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallelism(self) -> dict[str, int]:
        return {"tp": self.tp, "ep": self.ep, "dp": self.dp, "pp": 1}


def pick_device(cfg: TrainConfig) -> torch.device:
    want = cfg.run.device
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("run.device = 'cuda' but no CUDA device is visible")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def init_distributed(cfg: TrainConfig, device: torch.device) -> DistEnv:
    """Join (or create) the default process group and Megatron's model-parallel groups.

    Idempotent within a process: a second call reuses the process group and re-creates the
    model-parallel groups only when the sizes differ (tests build several models in one process).
    """
    from megatron.core import parallel_state as ps

    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, timeout=_dt.timedelta(minutes=10))
        else:
            # Alone: a private in-memory store, no port or environment needed.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    tp, ep = cfg.parallel.tp, cfg.parallel.ep
    dp = cfg.parallel.dp or world // tp
    if tp * dp != world:
        raise ConfigError(f"parallel.tp ({tp}) × parallel.dp ({dp}) must equal the world size ({world})")
    if (tp * dp) % ep:
        raise ConfigError(f"parallel.ep ({ep}) must divide tp × dp ({tp * dp})")
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tp
            and ps.get_expert_model_parallel_world_size() == ep
        )
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=ep,
            create_gloo_process_groups=False,
        )
    control = dist.new_group(backend="gloo") if world > 1 else None
    return DistEnv(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        device=device,
        tp=tp,
        ep=ep,
        dp=dp,
        host=socket.gethostname(),
        control_group=control,
    )


def shutdown() -> None:
    """Tear everything down (the end of a torchrun process; tests keep the group alive)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def sync_control(env: DistEnv, stop: bool, payload: Any = None) -> tuple[bool, Any]:
    """At a step boundary: (any rank asked to stop, rank 0's payload or None), same on every rank."""
    if env.world_size == 1:
        return stop, payload
    flags = torch.tensor([int(stop), int(env.is_main and payload is not None)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=env.control_group)
    stop_any, has_payload = bool(flags[0]), bool(flags[1])
    if has_payload:
        box = [payload if env.is_main else None]
        dist.broadcast_object_list(box, src=0, group=env.control_group)
        payload = box[0]
    else:
        payload = None
    return stop_any, payload


def broadcast_object(env: DistEnv, value: Any) -> Any:
    """Rank 0's value on every rank (run id, attempt number)."""
    if env.world_size == 1:
        return value
    box = [value if env.is_main else None]
    dist.broadcast_object_list(box, src=0, group=env.control_group)
    return box[0]


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier(group=env.control_group)


def is_expert(param: torch.Tensor) -> bool:
    # Megatron marks expert weights with ``allreduce = False`` (they are reduced over the
    # expert-data-parallel group, not the data-parallel one).
    return not getattr(param, "allreduce", True)


def _allreduce_coalesced(grads: Sequence[torch.Tensor], group: Any, scale: float) -> None:
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(reduced)


def reduce_gradients(params: Iterable[torch.Tensor], env: DistEnv) -> None:
    """Average gradients over data-parallel replicas (one coalesced all-reduce per group)."""
    if env.world_size == 1:
        return
    from megatron.core import parallel_state as ps

    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in params:
        if p.grad is not None:
            (expert if is_expert(p) else dense).append(p.grad)
    if ps.get_data_parallel_world_size() > 1:
        _allreduce_coalesced(dense, ps.get_data_parallel_group(), 1.0 / env.dp)
    if ps.get_expert_data_parallel_world_size() > 1:
        _allreduce_coalesced(expert, ps.get_expert_data_parallel_group(), 1.0 / env.dp)
    elif expert and env.dp > 1:
        for g in expert:  # each expert lives on one rank but saw every rank's tokens
            g.mul_(1.0 / env.dp)


def copies(param: torch.Tensor, env: DistEnv) -> int:
    """How many ranks hold an identical copy of this parameter (pipeline size 1)."""
    sharded_tp = bool(getattr(param, "tensor_model_parallel", False))
    shards = (env.tp if sharded_tp else 1) * (env.ep if is_expert(param) else 1)
    return max(1, env.world_size // shards)


def weighted_grad_sq(params: Sequence[torch.Tensor], env: DistEnv) -> torch.Tensor:
    """Σ ‖g‖² / copies over local parameters, on the device: summed over all ranks it is the
    squared global gradient norm, each distinct shard counted once."""
    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(copies(p, env), []).append(p.grad)
    total = torch.zeros((), dtype=torch.float32, device=env.device)
    for n, grads in groups.items():
        norms = torch._foreach_norm([g.float() for g in grads] if grads[0].dtype != torch.float32 else grads)
        total = total + torch.stack(norms).square().sum() / n
    return total


def allreduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size > 1:
        dist.all_reduce(tensor)
    return tensor
