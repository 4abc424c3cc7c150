"""A shared-memory engine with its own defaults: a real engine built on wtransfer's ``shm``.

It keeps ``shm``'s 4 MiB buckets but uses three buffers instead of four (a smaller ring
for hosts with little memory to spare). The transport, the manifest checks and the
timeouts are wtransfer's; the plugin only changes defaults, so it stays small.
"""

from __future__ import annotations

from dataclasses import dataclass

from wtransfer.engines import SharedMemoryTrainer, SharedMemoryWeightTransferEngine, TrainerInitOptions
from wtransfer.engines.wire import MIB
from wtransfer.options import option


@dataclass(frozen=True)
class SmallModelInitOptions(TrainerInitOptions):
    """The trainer's ``init_info`` defaults: 4 MiB buckets, three buffers (docs are the base's)."""

    bucket_bytes: int = option(4 * MIB)
    num_buffers: int = option(3)


class SmallModelTrainer(SharedMemoryTrainer):
    """Trainer side: shm's, with this plugin's defaults."""

    init_options_cls = SmallModelInitOptions


class ExampleEngine(SharedMemoryWeightTransferEngine):
    """Example engine shipped by the wtransfer-example distribution (shm, tuned for small models)."""

    trainer_cls = SmallModelTrainer
