"""``gloo``: weight sync across hosts over a private gloo process group (CPU tensors).

The logic lives in the torch.distributed modules (:mod:`wtransfer.engines.torch_distributed.backend`); this module names
the gloo flavour. Its options: :class:`GlooInitOptions` (trainer ``init_info``) and :class:`GlooOptions`
(workers), or ``wtransfer show engine gloo``.
"""

from __future__ import annotations

from wtransfer.engines.torch_distributed.options import GlooInitOptions, GlooOptions
from wtransfer.engines.torch_distributed.sender import TorchDistributedSender
from wtransfer.engines.torch_distributed.trainer import TorchDistributedTrainer
from wtransfer.engines.torch_distributed.worker import TorchDistributedWeightTransferEngine


class GlooTrainer(TorchDistributedTrainer):
    """Trainer side of ``gloo``: rank 0 of the side group, hosting its authenticated rendezvous store."""

    backend = "gloo"
    distributed_backend = "gloo"
    init_options_cls = GlooInitOptions
    sender_cls = TorchDistributedSender  # a sharded trainer's every rank sends its own shards


class GlooWeightTransferEngine(TorchDistributedWeightTransferEngine):
    """Worker side of ``gloo``: joins the trainer's side group and receives packed buckets."""

    distributed_backend = "gloo"
    options_cls = GlooOptions
    trainer_cls = GlooTrainer


__all__ = ["GlooInitOptions", "GlooOptions", "GlooTrainer", "GlooWeightTransferEngine"]
