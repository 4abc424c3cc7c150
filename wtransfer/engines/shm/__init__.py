"""``shm``: same-host weight sync through shared memory.

A round crosses one of two ways, as the trainer's commit mode asks:

**Staged** (atomic rounds, and every round of a sharded trainer): the trainer writes every tensor at
its place in one segment holding the whole round (pre-faulted, reused, grown when needed); every rank
of a sharded trainer writes its own shards there, nothing gathered. Each worker maps it read-only and
commits from it (:func:`~wtransfer.engines.rounds.commit.adopt_staged`): the node holds one host copy.

**Ring** (streaming and delta rounds): ``num_buffers`` buffers of ``bucket_bytes``. The trainer packs
bucket k into buffer ``k % num_buffers`` and announces it; workers load and release it, overlapping
the packing of the next.

Either memory is an anonymous owner-only ``memfd`` handed over a private Unix socket (``SCM_RIGHTS``):
nothing is named in ``/dev/shm``, so nothing leaks whoever is killed. Workers get read-only descriptors.

Per round each worker answers ``accept`` (or ``reject``, before any byte moves) and, once loaded,
``loaded``. Every wait is bounded by ``timeout_s``; a dead peer is noticed at once (its socket closes).
"""

from wtransfer.engines.shm.trainer import SharedMemoryInitOptions, SharedMemoryTrainer
from wtransfer.engines.shm.worker import SharedMemoryInitInfo, SharedMemoryWeightTransferEngine

__all__ = ["SharedMemoryInitInfo", "SharedMemoryInitOptions", "SharedMemoryTrainer", "SharedMemoryWeightTransferEngine"]
