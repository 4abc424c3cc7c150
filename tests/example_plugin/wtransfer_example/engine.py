"""A shared-memory engine with its own defaults: a real engine built on wtransfer's ``shm``.

It keeps ``shm``'s 4 MiB buckets but uses three buffers instead of four (a smaller ring
for hosts with little memory to spare). The transport, the manifest checks and the
timeouts are wtransfer's; the plugin only changes defaults, so it stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

from wtransfer.engines import SharedMemoryInitOptions, SharedMemoryTrainer, SharedMemoryWeightTransferEngine
from wtransfer.options import option


@dataclass(frozen=True)
class SmallModelInitOptions(SharedMemoryInitOptions):
    """shm's ``init_info``, with three buffers instead of four (its 4 MiB buckets and the docs kept)."""

    num_buffers: int = option(3)


class SmallModelTrainer(SharedMemoryTrainer):
    """Trainer side: shm's, with this plugin's defaults."""

    init_options_cls = SmallModelInitOptions


class ExampleEngine(SharedMemoryWeightTransferEngine):
    """Example engine shipped by the wtransfer-example distribution (shm, tuned for small models)."""

    trainer_cls = SmallModelTrainer
