"""``gloo``: weight sync across hosts over a private gloo process group (CPU tensors).

All the logic lives in :mod:`wtransfer.engines.torch_distributed`; this module only names
the gloo flavour. Trainer ``init_info`` adds ``master_address`` (default ``127.0.0.1``; use
an address the workers can reach) and ``master_port`` (default 0: a free port is picked).
"""

from __future__ import annotations

from wtransfer.engines.torch_distributed import TorchDistributedTrainer, TorchDistributedWeightTransferEngine


class GlooTrainer(TorchDistributedTrainer):
    """Trainer side of ``gloo``: rank 0 of the side group, hosting its ``TCPStore``."""

    backend = "gloo"
    distributed_backend = "gloo"


class GlooWeightTransferEngine(TorchDistributedWeightTransferEngine):
    """Worker side of ``gloo``: joins the trainer's side group and receives packed buckets."""

    distributed_backend = "gloo"
    trainer_cls = GlooTrainer
