"""Every adaptation Megatron-Core 0.16.1 needs to train on a CPU, in one place, applied only on CPU
and reversible (``apply``/``undo`` or the ``cpu_compat`` context manager).

What runs on CPU: one or more processes over gloo, the local (non-Transformer-Engine) layer spec,
the ``allgather`` token dispatcher, fp32 (bf16 works but is slow on CPU), expert parallelism.
What does not (checked by ``check_supported``):
  * the ``alltoall`` dispatcher: it creates ``torch.cuda.Stream`` objects in its constructor;
  * tensor parallelism with MoE: Megatron refuses MoE + TP without sequence parallelism
    (moe_layer.py), and the local spec's torch LayerNorm refuses sequence parallelism
    (torch_norm.py); the fused norms that allow it come from Transformer Engine or Apex (CUDA);
  * the Transformer Engine spec, and Megatron's own optimizer/DDP (they allocate on "cuda");
  * grouped-GEMM experts (``moe.grouped_gemm``): CUDA kernels, from Transformer Engine or the
    ``grouped_gemm`` package (``grouped_gemm_module`` says which one this install would build).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch

from runledger.trainer.config import ConfigError, TrainConfig


def _te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _grouped_gemm_package_available() -> bool:
    return importlib.util.find_spec("grouped_gemm") is not None


def _te_grouped_linear_available() -> bool:
    """Transformer Engine's grouped linears (TE >= 1.7), which ``TEGroupedMLP`` is made of."""
    try:
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    except ImportError:
        return False
    return TEColumnParallelGroupedLinear is not None


def grouped_gemm_module(cfg: TrainConfig) -> str | None:
    """The grouped-GEMM expert module Megatron-Core 0.16 builds for ``cfg.model.spec`` on this
    install, or None when it cannot build one. The Transformer Engine spec gives ``TEGroupedMLP``
    (TE >= 1.7), else the legacy ``GroupedMLP``; the local spec always gives ``GroupedMLP``, which
    needs the ``grouped_gemm`` package (megatron/core/models/backends.py, moe/experts.py)."""
    if cfg.model.spec == "transformer_engine" and _te_available() and _te_grouped_linear_available():
        return "TEGroupedMLP"
    if cfg.model.spec == "transformer_engine" and not _te_available():
        return None  # the TE spec itself cannot be built
    return "GroupedMLP" if _grouped_gemm_package_available() else None


def grouped_gemm_problem(cfg: TrainConfig) -> str | None:
    """Why ``moe.grouped_gemm = true`` cannot be built on this install (one line), or None."""
    if not cfg.moe.grouped_gemm or grouped_gemm_module(cfg) is not None:
        return None
    te, gg = _te_available(), _grouped_gemm_package_available()
    if not te and not gg:
        return "moe.grouped_gemm = true needs Transformer Engine or the grouped_gemm package; neither is installed"
    if cfg.model.spec == "local":  # TE is installed, the grouped_gemm package is not
        return (
            "moe.grouped_gemm = true with model.spec = 'local' needs the grouped_gemm package, which is "
            "not installed; Transformer Engine is: set model.spec = 'transformer_engine'"
        )
    return "moe.grouped_gemm = true with model.spec = 'transformer_engine' needs Transformer Engine installed"


class CpuCompat:
    """The process-wide patches. ``apply`` is idempotent; ``undo`` restores what was there."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any, bool]] = []  # (owner, name, old value, had it)
        self._rng_reset = False

    @property
    def applied(self) -> bool:
        return bool(self._saved) or self._rng_reset

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        had = hasattr(owner, name)
        self._saved.append((owner, name, getattr(owner, name, None), had))
        setattr(owner, name, value)

    def apply(self) -> None:
        if self.applied:
            return
        # Megatron allocates router buffers and moves router weights with
        # ``device=torch.cuda.current_device()``; pointing it at the CPU keeps them on the CPU.
        self._patch(torch.cuda, "current_device", _cpu_device)
        # 0.16.1 bug: moe_utils imports ``te_general_gemm`` only when Transformer Engine imports,
        # yet router_gating_linear reads the name unconditionally (NameError without TE).
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            self._patch(moe_utils, "te_general_gemm", None)

    def seed(self, seed: int) -> None:
        """Megatron's model-parallel RNG tracker keeps CUDA generator states; on CPU use its
        inference tracker, whose ``fork`` is a no-op (dropout then draws from torch's CPU RNG)."""
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
        self._rng_reset = True

    def undo(self) -> None:
        for owner, name, old, had in reversed(self._saved):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._saved.clear()
        if self._rng_reset:
            from megatron.core.tensor_parallel import random as mrandom

            # Leave no CPU-only tracker behind: the next seed() (CPU or CUDA) builds a fresh one.
            mrandom._CUDA_RNG_STATE_TRACKER = None
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
            self._rng_reset = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


_COMPAT = CpuCompat()


def apply(device: torch.device) -> CpuCompat:
    """Apply the patches when ``device`` is the CPU; on CUDA only the missing-TE name is filled."""
    if device.type == "cpu":
        _COMPAT.apply()
    elif not _te_available():
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None  # same 0.16.1 bug, GPU without Transformer Engine
    return _COMPAT


def undo() -> None:
    _COMPAT.undo()


@contextlib.contextmanager
def cpu_compat(device: torch.device | str = "cpu") -> Iterator[CpuCompat]:
    dev = torch.device(device)
    compat = apply(dev)
    try:
        yield compat
    finally:
        if dev.type == "cpu":
            undo()


def seed_rng(seed: int, device: torch.device) -> None:
    """Seed torch and Megatron's tensor-parallel RNG tracker in the way the device allows."""
    if device.type == "cpu":
        _COMPAT.seed(seed)
        return
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def transformer_config_kwargs(device: torch.device) -> dict[str, Any]:
    """TransformerConfig settings the device needs."""
    kwargs: dict[str, Any] = {
        # The local SequentialMLP's bias path adds in place to an autograd view (mlp.py:247) and
        # torch 2.13 refuses it; bias-free linears (as most current LLMs use) avoid that path.
        "add_bias_linear": False,
    }
    if device.type == "cpu":
        # Megatron's GPU initialisation path creates the weights on the current CUDA device.
        kwargs["use_cpu_initialization"] = True
    return kwargs


def causal_attention_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """The causal mask passed explicitly (True = masked): when none is given, the local
    DotProductAttention builds its default one on "cuda"."""
    ones = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1).view(1, 1, seq_length, seq_length)


def check_supported(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse, with the reason, the settings that cannot run on this device."""
    if problem := grouped_gemm_problem(cfg):  # on any device: this install cannot build the experts
        raise ConfigError(problem)
    if device.type == "cuda":
        if cfg.model.spec == "transformer_engine" and not _te_available():
            raise ConfigError("model.spec = 'transformer_engine' needs Transformer Engine installed")
        return
    problems = []
    if cfg.moe.dispatcher == "alltoall":
        problems.append("moe.dispatcher 'alltoall' creates CUDA streams; use 'allgather' on CPU")
    if cfg.parallel.tp > 1:
        problems.append(
            "parallel.tp > 1 with MoE needs sequence parallelism, which the CPU (local) layer "
            "spec's LayerNorm does not support"
        )
    if cfg.model.spec == "transformer_engine":
        problems.append("model.spec 'transformer_engine' needs CUDA")
    if cfg.parallel.backend == "nccl":
        problems.append("parallel.backend 'nccl' needs CUDA; use 'gloo'")
    if cfg.moe.grouped_gemm:
        problems.append("moe.grouped_gemm = true runs CUDA kernels (grouped GEMM); set it to false on CPU")
    if problems:
        raise ConfigError("not possible on CPU: " + "; ".join(problems))
