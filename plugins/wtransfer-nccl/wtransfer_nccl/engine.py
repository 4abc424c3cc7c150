"""The NCCL weight-transfer engine: wtransfer's packed broadcast, on CUDA devices over NCCL.

Everything about the protocol (rendezvous, manifest vote, bucket planning, packing,
buffer rotation, timeouts, version semantics) is wtransfer's own torch.distributed code,
the same the ``gloo`` engine runs. This module only supplies what differs on a GPU:

* a ``ProcessGroupNCCL`` per channel, each on a ``PrefixStore`` over the trainer's
  authenticated rendezvous store (:mod:`wtransfer.engines.channel.rendezvous`, not torch's
  ``TCPStore``), bound to an explicit device, never the default process group;
* receive and send buffers on the device, one dedicated CUDA stream per buffer, both
  created once per engine and reused every round (fresh streams per call leaked memory
  in vllm#52950);
* packing and unpacking of a buffer run on that buffer's stream, the transport waits for
  it, and the buffer is not reused until its stream is done; a final device
  synchronisation happens before a round is reported finished;
* every wait is bounded by the round's ``timeout_s`` and none blocks in CUDA: NCCL's
  ``Work.wait()`` only orders streams, and ``torch.cuda.synchronize()`` or ``.item()`` would
  block forever on a collective whose peer died. wtransfer polls ``Work.is_completed()`` and a
  CUDA event instead, and when the deadline passes it aborts the communicators and raises
  :class:`~wtransfer.TransferTimeoutError`. The group's own timeout is set well past that
  deadline, and its asynchronous error handling off, so NCCL's watchdog never tears the
  (vLLM) worker process down first: a dead trainer costs one failed round, not the server.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from wtransfer import TransferTimeoutError, WTransferError
from wtransfer.engines import (
    TorchDistributedBackend,
    TorchDistributedInitOptions,
    TorchDistributedOptions,
    TorchDistributedSender,
    TorchDistributedTrainer,
    TorchDistributedWeightTransferEngine,
)
from wtransfer.engines.wire import MIB
from wtransfer.options import option

logger = logging.getLogger("wtransfer")

SYNC_POLL_S = 0.0002


@contextlib.contextmanager
def _async_error_handling_off() -> Iterator[None]:
    """Build a group whose NCCL errors and timeouts are reported to its waiters, not acted on.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is read when a ``ProcessGroupNCCL`` is constructed; its
    default makes the watchdog kill the whole process on a remote error or timeout. wtransfer
    handles both itself (polled waits, abort, ``TransferError``), so only its own groups are
    built with 0; the variable is restored at once and the process's other groups keep theirs.
    (Another thread constructing an NCCL group at this very moment would see 0 too: the
    environment is the only knob torch offers.)
    """
    name = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


class NCCLUnavailableError(WTransferError, RuntimeError):
    """This process cannot run NCCL (no CUDA device, or a torch build without NCCL)."""


def nccl_unavailable_reason() -> str | None:
    """Why NCCL cannot run here, or ``None`` if it can."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return f"no CUDA device is available (torch {torch.__version__}, torch.cuda.is_available() is False)"
    if not dist.is_available() or not dist.is_nccl_available():
        return f"this torch build ({torch.__version__}) has no NCCL support"
    return None


def require_nccl(side: str) -> None:
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise NCCLUnavailableError(
            f"The nccl engine cannot create its {side} side: {reason}. On CPU-only machines use "
            f"wtransfer's built-in engines instead: 'shm' (same host, shared memory) or 'gloo' "
            f"(across hosts, torch.distributed over TCP)."
        )


@dataclass(frozen=True)
class NCCLOptions(TorchDistributedOptions):
    """Worker options of ``nccl``: ``max_buffer_bytes`` and the CUDA device."""

    device: int | None = option(None, doc="CUDA device index this worker uses (default: the current device)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device is not None and self.device < 0:
            raise ValueError(f"'device' must be a CUDA device index (>= 0), got {self.device}")


class NCCLBackend(TorchDistributedBackend):
    """CUDA and NCCL specifics behind wtransfer's torch.distributed backend hooks."""

    distributed_backend = "nccl"
    host_waits = False  # NCCL's Work.wait() returns at once: poll against our own deadline; the
    # group's own timeout (transport_timeout_s) then lies past that deadline, so the watchdog never acts
    _device_index: int | None = None
    _streams: list[Any] | None = None

    def device(self) -> Any:
        import torch

        if self._device_index is None:
            # the worker's parsed options; the trainer has none and uses the current device
            device = getattr(getattr(self, "options", None), "device", None)
            self._device_index = torch.cuda.current_device() if device is None else device
        return torch.device("cuda", self._device_index)

    def make_process_group(self, store: Any, rank: int, size: int, timeout_s: float) -> Any:
        import torch
        from torch._C._distributed_c10d import ProcessGroupNCCL

        device = self.device()
        torch.cuda.set_device(device)
        options = ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        with _async_error_handling_off():
            group = ProcessGroupNCCL(store, rank, size, options)
        if hasattr(group, "bound_device_id"):
            group.bound_device_id = device  # eager init on this device, no guessing
        return group

    def release_groups(self, groups: list[Any], failed: bool) -> None:
        """After a failed round, abort the communicators: a broadcast whose peer is gone would
        otherwise stay queued on the device, and the group's destructor would wait for it."""
        if failed:
            for group in groups:
                try:
                    group.abort()
                except Exception as exc:  # the round already failed; say so, do not mask it
                    logger.warning("aborting an NCCL group after a failed round raised: %s", exc)
        super().release_groups(groups, failed)

    def allocate(self, nbytes: int, count: int) -> list[Any]:
        """Device buffers, plus one stream per buffer; both live as long as the engine."""
        import torch

        buffers = super().allocate(nbytes, count)
        if self._streams is None or len(self._streams) != count:
            self._streams = [torch.cuda.Stream(device=self.device()) for _ in range(count)]
        return buffers

    @contextlib.contextmanager
    def slot_stream(self, slot: int) -> Iterator[None]:
        """Pack or unpack buffer ``slot`` on its own stream; the transport then waits for that stream."""
        import torch

        assert self._streams is not None, "allocate() creates the streams"
        stream = self._streams[slot]
        current = torch.cuda.current_stream(self.device())
        stream.wait_stream(current)  # the buffer's last transport (and the caller's writes) came first
        with torch.cuda.stream(stream):
            yield
        current.wait_stream(stream)

    def packed_from(self, slot: int, tensors: list[Any]) -> None:
        """Source tensors the slot's stream copies from stay allocated until it is past them,
        even if the trainer drops them now (a materialised shard, a held small tensor)."""
        assert self._streams is not None
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(self._streams[slot])

    def synchronize(self, timeout_s: float) -> None:
        """Once per round, after the last bucket: nothing of the round is still in flight.

        Every buffer's stream was joined into the current one, so one event recorded there
        covers the round. Polled, never ``torch.cuda.synchronize()``: that has no timeout."""
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device()))
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"the device did not finish the round's transfers within {timeout_s:g} s "
                    f"(a peer died or stalled mid-collective)"
                )
            time.sleep(SYNC_POLL_S)


class NCCLWeightTransferEngine(NCCLBackend, TorchDistributedWeightTransferEngine):
    """Worker side of the NCCL engine (one per inference worker process and GPU).

    ``WeightTransferConfig.options``: ``device`` (CUDA index, default the current device),
    ``max_buffer_bytes`` (refuse larger buffer rings at init). ``receive_weights`` ends with
    a device synchronisation, so the weights are in place before ``finish_weight_update``.
    """

    options_cls = NCCLOptions

    def __init__(self, config: Any, parallel_config: Any = None) -> None:
        require_nccl("worker")
        super().__init__(config, parallel_config)


@dataclass(frozen=True)
class NCCLInitOptions(TorchDistributedInitOptions):
    """Trainer ``init_info`` of NCCL: the shared torch.distributed keys, with NCCL's defaults.

    gloo's ``local_address``/``interface`` choose a gloo device; NCCL picks its own
    (``NCCL_SOCKET_IFNAME``), so there are no keys of its own. NCCL runs its own channels
    inside one communicator: one group is enough.
    """

    bucket_bytes: int = option(32 * MIB)
    num_buffers: int = option(4)
    channels: int = option(1)


class NCCLSender(NCCLBackend, TorchDistributedSender):
    """Another rank of a sharded (FSDP2) trainer: broadcasts its own shards from its own GPU.

    wtransfer's torch.distributed sender (the protocol the ``gloo`` engine runs and tests on CPU):
    the workers build an NCCL group with every sending rank, and each rank streams its bytes of
    every bucket on it, so nothing is gathered. Its device is the current CUDA device (FSDP's
    ``torch.cuda.set_device(local_rank)``). Every rank and every worker needs a GPU of its own:
    NCCL refuses two ranks of one group on one device.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_nccl("sharded sender")
        super().__init__(*args, **kwargs)


class NCCLTrainer(NCCLBackend, TorchDistributedTrainer):
    """Trainer side of the NCCL engine (rank 0): broadcasts packed buckets from its GPU; with a
    sharded source, the other ranks send their own shards (:class:`NCCLSender`)."""

    backend = "nccl"
    init_options_cls = NCCLInitOptions
    sender_cls = NCCLSender

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_nccl("trainer")
        super().__init__(*args, **kwargs)



NCCLWeightTransferEngine.trainer_cls = NCCLTrainer
