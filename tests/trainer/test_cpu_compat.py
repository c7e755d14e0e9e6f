from __future__ import annotations

import pytest
import torch

from runledger.trainer import cpu_compat, distributed
from runledger.trainer.config import ConfigError, load_config


def test_apply_and_undo_restore_everything() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    cpu_compat.apply(torch.device("cpu"))
    distributed.init_distributed(
        load_config(None, ["run.device='cpu'"]), torch.device("cpu")
    )  # seed() needs groups
    was_applied = cpu_compat._COMPAT.applied
    cpu_compat.undo()  # start from the pristine state (other tests in this process applied it)
    original = torch.cuda.current_device
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    try:
        with cpu_compat.cpu_compat("cpu") as compat:
            assert torch.cuda.current_device() == torch.device("cpu")
            assert moe_utils.te_general_gemm is None
            compat.seed(7)
            assert mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED
        assert torch.cuda.current_device is original
        assert hasattr(moe_utils, "te_general_gemm") == had_gemm
        assert not mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED
        compat.apply()
        compat.apply()  # idempotent: one undo restores
        compat.undo()
        assert torch.cuda.current_device is original
    finally:
        if was_applied:
            cpu_compat.apply(torch.device("cpu"))


def test_causal_mask_masks_the_future() -> None:
    mask = cpu_compat.causal_attention_mask(4, torch.device("cpu"))
    assert mask.shape == (1, 1, 4, 4)
    assert mask[0, 0].tolist()[1] == [False, False, True, True]


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("moe.dispatcher='alltoall'", "CUDA streams"),
        ("parallel.tp=2", "sequence parallelism"),
        ("model.spec='transformer_engine'", "needs CUDA"),
        ("parallel.backend='nccl'", "nccl"),
    ],
)
def test_cpu_refuses_what_megatron_cannot_do_there(override: str, reason: str) -> None:
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match=reason):
        cpu_compat.check_supported(cfg, torch.device("cpu"))
