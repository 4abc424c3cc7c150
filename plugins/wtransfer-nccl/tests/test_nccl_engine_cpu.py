"""The NCCL engine module on a machine without CUDA: importable, and clear about why it cannot run."""

from __future__ import annotations

import pytest
import torch

from wtransfer.engines import TorchDistributedTrainer, TorchDistributedWeightTransferEngine
from wtransfer import WeightTransferConfig


def test_reuses_the_core_torch_distributed_engine(engine_module) -> None:
    assert issubclass(engine_module.NCCLWeightTransferEngine, TorchDistributedWeightTransferEngine)
    assert issubclass(engine_module.NCCLTrainer, TorchDistributedTrainer)
    assert engine_module.NCCLWeightTransferEngine.trainer_cls is engine_module.NCCLTrainer
    assert engine_module.NCCLWeightTransferEngine.distributed_backend == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_reason_without_cuda(engine_module) -> None:
    assert "no CUDA device" in engine_module.nccl_unavailable_reason()
    with pytest.raises(engine_module.NCCLUnavailableError, match="'shm'.*'gloo'"):
        engine_module.NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"))
