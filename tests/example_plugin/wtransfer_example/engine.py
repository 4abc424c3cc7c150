"""A shared-memory engine tuned for small models: a real engine built on wtransfer's ``shm``.

Smaller default buckets and three buffers suit models of a few hundred MB, where a
64 MiB bucket would leave the ring mostly idle. The transport, the manifest checks and
the timeouts are wtransfer's; the plugin only changes defaults, so it stays small.
"""

from __future__ import annotations

from wtransfer.engines.shm import SharedMemoryTrainer, SharedMemoryWeightTransferEngine

MIB = 1 << 20


class SmallModelTrainer(SharedMemoryTrainer):
    """Trainer side: 4 MiB buckets, three buffers."""

    default_bucket_bytes = 4 * MIB
    default_num_buffers = 3


class ExampleEngine(SharedMemoryWeightTransferEngine):
    """Example engine shipped by the wtransfer-example distribution (shm, tuned for small models)."""

    trainer_cls = SmallModelTrainer
