"""A shared-memory engine with its own defaults: a real engine built on wtransfer's ``shm``.

It keeps ``shm``'s 4 MiB buckets but uses three buffers instead of four (a smaller ring
for hosts with little memory to spare). The transport, the manifest checks and the
timeouts are wtransfer's; the plugin only changes defaults, so it stays small.
"""

from __future__ import annotations

from wtransfer.engines import MIB, SharedMemoryTrainer, SharedMemoryWeightTransferEngine


class SmallModelTrainer(SharedMemoryTrainer):
    """Trainer side: 4 MiB buckets, three buffers."""

    default_bucket_bytes = 4 * MIB
    default_num_buffers = 3


class ExampleEngine(SharedMemoryWeightTransferEngine):
    """Example engine shipped by the wtransfer-example distribution (shm, tuned for small models)."""

    trainer_cls = SmallModelTrainer
