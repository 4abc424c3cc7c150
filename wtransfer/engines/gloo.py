"""``gloo``: weight sync across hosts over a private gloo process group (CPU tensors).

The logic lives in the torch.distributed modules (:mod:`wtransfer.engines._td_backend`); this module names
the gloo flavour. Trainer ``init_info`` (:class:`GlooInitOptions`) adds ``master_address`` (default
``127.0.0.1``: set an address of the trainer's host the workers can reach; the rendezvous listens there
only), ``master_port`` (0: a free port), ``listen_address``, ``direct_min_bytes``, ``channels``,
``local_address`` and ``interface``; workers take ``max_buffer_bytes`` and ``local_address`` or
``interface`` (:class:`GlooOptions`). ``wtransfer show engine gloo`` prints both tables. A sharded
trainer's ranks each send their own shards (:mod:`wtransfer.engines._part_streams`).
"""

from __future__ import annotations

from wtransfer.engines._td_options import GlooInitOptions, GlooOptions
from wtransfer.engines._td_sender import TorchDistributedSender
from wtransfer.engines._td_trainer import TorchDistributedTrainer
from wtransfer.engines._td_worker import TorchDistributedWeightTransferEngine


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
