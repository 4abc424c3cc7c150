"""``shm streaming``'s pipeline without wtransfer: a peer for ``wtransfer bench weights``.

Two processes share a ring of ``num_buffers`` buffers of ``bucket_bytes`` (a memfd, mapped and faulted in as the
engine maps its own). The bench's process copies the model's bytes into it bucket by bucket, in the engine's own
bucket plan; a helper process copies each bucket out into its own copy of the model, past the caches as the engine's
worker does (:func:`~wtransfer.engines.rounds.kernels.copy_out`). An 8-byte word over a socket
says "bucket k is in its buffer", another "that buffer is free". Nothing else runs: no manifest, no labels, no
checks. The engine's ratio to this peer is what wtransfer's own work costs a streamed round; this peer's ratio to
memcpy is what the machine allows a design that copies twice through a ring.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

RING_PIPELINE = "ring pipeline, same buckets (no wtransfer)"
_WORD = struct.Struct("q")


def _plan(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """The engine's bucket plan for tensors of ``sizes`` bytes: per bucket, (tensor, start, offset, length)."""
    from wtransfer.engines.rounds.manifest import TensorEntry
    from wtransfer.engines.rounds.packing import plan_buckets

    entries = tuple(TensorEntry(str(i), "uint8", (size,)) for i, size in enumerate(sizes))  # only sizes count
    return [[(p.index, p.start, p.offset, p.length) for p in b.pieces] for b in plan_buckets(entries, bucket_bytes)]


def _ring_views(fd: int, bucket_bytes: int, num_buffers: int, writable: bool) -> tuple[Any, list[Any]]:
    """The ring (``fd``, closed here) mapped and faulted in as the engine maps its own, and one view per buffer."""
    import numpy

    from wtransfer.engines.rounds.staging import map_shared

    ring = map_shared(fd, bucket_bytes * num_buffers, writable)
    os.close(fd)
    views = [numpy.frombuffer(ring, dtype=numpy.uint8, count=bucket_bytes, offset=i * bucket_bytes)
             for i in range(num_buffers)]
    for view in views:
        view.flags.writeable = writable
    return ring, views


def _helper(connection: Any, sizes: list[int], bucket_bytes: int, num_buffers: int, timeout_s: float) -> None:
    """The helper process: copy every bucket out of the ring, free its buffer; until the bench closes the socket."""
    import numpy

    from wtransfer.engines.rounds.kernels import copy_out

    channel = socket.socket(fileno=os.dup(connection.fileno()))
    connection.close()
    channel.settimeout(timeout_s)  # set-up only: between rounds it waits for as long as the bench runs other rows
    _, fds, _, _ = socket.recv_fds(channel, 1, 1)
    _ring, slots = _ring_views(fds[0], bucket_bytes, num_buffers, writable=False)
    models = [numpy.ones(size, dtype=numpy.uint8) for size in sizes]  # resident before the first round
    plan = _plan(sizes, bucket_bytes)
    channel.sendall(_WORD.pack(-1))
    channel.settimeout(None)  # the bench closing its end (or exiting) ends this loop
    while len(word := channel.recv(_WORD.size, socket.MSG_WAITALL)) == _WORD.size:
        (index,) = _WORD.unpack(word)
        slot = slots[index % num_buffers]
        for tensor, start, offset, length in plan[index]:
            copy_out(models[tensor][start : start + length], slot[offset : offset + length])
        channel.sendall(word)


class RingPipeline:
    """The peer: ``measure()`` moves the model through the ring once and returns GB/s; ``close()`` ends the helper.

    The helper starts here, from wtransfer's fork server as a pool's workers do, and allocates its copy of the
    model at once: it never counts in an engine's peak RSS, and one unmeasured round warms both sides."""

    def __init__(self, tensors: list[torch.Tensor], bucket_bytes: int, num_buffers: int,
                 timeout_s: float = 120.0) -> None:
        import multiprocessing

        from wtransfer._fork_server import worker_process
        from wtransfer.engines.rounds.manifest import tensor_bytes
        from wtransfer.engines.rounds.staging import create_memfd

        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise ValueError("the ring peer copies contiguous CPU tensors only")
        sources = [tensor_bytes(t).numpy() for t in tensors]
        self._sources = sources
        sizes = [int(s.nbytes) for s in sources]
        self._total = sum(sizes)
        self._plan = _plan(sizes, bucket_bytes)
        ours, theirs = multiprocessing.Pipe()
        self._process = worker_process(_helper, (theirs, sizes, bucket_bytes, num_buffers, timeout_s),
                                       name="wtransfer-ring-peer")
        self._ring: Any = None
        self._slots: list[Any] = []
        try:
            self._process.start()
            theirs.close()
            self._sock = socket.socket(fileno=os.dup(ours.fileno()))
            ours.close()
            self._sock.settimeout(timeout_s)
            fd = create_memfd(bucket_bytes * num_buffers, "wtransfer-ring-peer")
            try:
                socket.send_fds(self._sock, [b"r"], [fd])
            except BaseException:
                os.close(fd)
                raise
            self._ring, self._slots = _ring_views(fd, bucket_bytes, num_buffers, writable=True)
            self._recv()  # the helper's copy of the model is resident
            self.measure()
        except BaseException:
            self.close()
            raise

    def _recv(self) -> int:
        word = self._sock.recv(_WORD.size, socket.MSG_WAITALL)
        if len(word) != _WORD.size:
            raise RuntimeError("the ring peer's helper process exited")
        return int(_WORD.unpack(word)[0])

    def measure(self) -> float:
        import numpy

        busy = 0  # buckets handed over and not yet freed; the helper frees them in order
        start = time.perf_counter()
        for index, pieces in enumerate(self._plan):
            if busy == len(self._slots):
                self._recv()
                busy -= 1
            slot = self._slots[index % len(self._slots)]
            for tensor, begin, offset, length in pieces:
                numpy.copyto(slot[offset : offset + length], self._sources[tensor][begin : begin + length])
            self._sock.sendall(_WORD.pack(index))
            busy += 1
        for _ in range(busy):
            self._recv()
        return self._total / (time.perf_counter() - start) / 1e9

    def close(self) -> None:
        """End the helper and let go of the ring (unmapped with its last view: a failed ``measure()``'s traceback may
        still hold some)."""
        if hasattr(self, "_sock"):
            self._sock.close()  # the helper reads the end and returns
        if self._process.is_alive():
            self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._slots, self._ring = [], None
