"""What the shared-memory ring allows on this host, with no engine in the way.

``wtransfer bench sharded`` compares shm's sharded trainers with one unsharded trainer. Whether
more writers *can* be faster on a given host is a question about the host, not the engine: the
same bytes are copied once into the ring and once out of it, whoever writes them, and a host
with fewer cores than busy processes may not fit more writers beside the reader. This module
measures that bound directly: the round's exact buckets (``plan_buckets`` on the model's shapes,
the engine's bucket size and buffer count), each tensor split by rows as ``Shard(0)`` splits it,
``writers`` processes copying their rows into the ring with single-threaded memcpy, and one
reader doing a worker's copies under the default atomic commit: every piece out of the ring to
its place in a staging copy, then, once the last bucket is in, every tensor from the staging
copy into the model. Between them, the least signalling the ring needs: each writer tells the
reader directly, with an 8-byte message, that its part of a bucket is written; the reader tells
the writers of the bucket that reuses a buffer, directly, that it is free. No JSON, no relay
through rank 0, no manifest, no Python per piece beyond the copy.

Run it beside the engine, in the same turns: its ratio (N writers vs its own single writer) is
what spreading the same writes over more processes costs or gains on this host when little
else happens. It is a reference, not a bound on the engine's own ratio: the engine's rounds
carry costs of their own in both designs, and a protocol signalling through shared memory
rather than messages would move the same bytes with fewer system calls.

Every run also checks where the bytes went: before each round every writer fills each of its
runs with a value of that run and round, and after it the reader checks every run of the
model it committed, so a run read from the wrong buffer, the wrong writer or an earlier round
fails the measurement.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import math
import mmap
import os
import select
import signal
import socket
import struct
import time
import traceback
from types import SimpleNamespace
from typing import Any

from wtransfer._bench.report import median_item
from wtransfer._fork_server import worker_process

_MESSAGE = struct.Struct("<q")  # a bucket index
_WAIT_S = 60.0


def _rows_layout(shapes: list[tuple[str, list[int]]], dtype: str, writers: int, bucket_bytes: int
                 ) -> tuple[list[int], list[list[tuple[int, int, int, int]]]]:
    """Tensor sizes, and for every bucket its runs ``(writer, destination byte, bucket byte,
    length)``: which writer holds each run of the bucket (``Shard(0)``: a contiguous run of rows
    per writer), and where it goes in the reader's destination (every tensor back to back)."""
    from wtransfer._bench.weights import DTYPES
    from wtransfer._dtypes import dtype_from_name
    from wtransfer.engines._packing import plan_buckets

    size = dtype_from_name(DTYPES[dtype]).itemsize
    nbytes = [size * math.prod(shape) for _, shape in shapes]
    starts = [0, *itertools.accumulate(nbytes)]
    buckets = plan_buckets(tuple(SimpleNamespace(nbytes=n) for n in nbytes), bucket_bytes)  # type: ignore[arg-type]
    runs: list[list[tuple[int, int, int, int]]] = []
    for bucket in buckets:
        mine: list[tuple[int, int, int, int]] = []
        for piece in bucket.pieces:
            shape = shapes[piece.index][1]
            rows = shape[0] if shape else 1
            row_bytes = nbytes[piece.index] // rows if rows else 0
            per = -(-rows // writers)  # torch.chunk's rows per shard
            for writer in range(writers):
                first = min(writer * per, rows) * row_bytes
                end = min((writer + 1) * per, rows) * row_bytes
                begin, stop = max(first, piece.start), min(end, piece.start + piece.length)
                if begin < stop:
                    mine.append((writer, starts[piece.index] + begin, piece.offset + begin - piece.start, stop - begin))
        runs.append(mine)
    return nbytes, runs


def _check_tiling(runs: list[list[tuple[int, int, int, int]]], total: int) -> None:
    """Every byte of the model is in exactly one run: none left out, none sent twice."""
    spans = sorted((at, at + length) for bucket in runs for _, at, _, length in bucket)
    reached = 0
    for begin, end in spans:
        if begin != reached:
            raise RuntimeError(f"ring alone: the layout {'skips' if begin > reached else 'repeats'} bytes at {reached}")
        reached = end
    if reached != total:
        raise RuntimeError(f"ring alone: the layout ends at byte {reached} of {total}")


def _fill(run: int, round_index: int) -> int:
    """The byte run ``run`` (counted over every bucket's runs in order) holds in round ``round_index``."""
    return (run * 7 + round_index * 13) % 251 + 1


class _Inbox:
    """Bucket indices arriving on several sockets, one message at a time."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self.sockets = sockets
        self.pending = {sock: b"" for sock in sockets}

    def next(self) -> tuple[socket.socket, int]:
        while True:
            for sock, data in self.pending.items():
                if len(data) >= _MESSAGE.size:
                    self.pending[sock] = data[_MESSAGE.size:]
                    return sock, _MESSAGE.unpack(data[: _MESSAGE.size])[0]
            ready, _, _ = select.select(self.sockets, [], [], _WAIT_S)
            if not ready:
                raise TimeoutError("ring alone: no message within 60 s")
            for sock in ready:
                data = sock.recv(1 << 16)
                if not data:
                    raise EOFError("ring alone: a peer died")
                self.pending[sock] += data


def _wait(sock: socket.socket, expected: bytes) -> None:
    """The next start-socket byte, which must be ``expected`` (bounded: no hang if a peer is stuck)."""
    ready, _, _ = select.select([sock], [], [], _WAIT_S)
    got = sock.recv(1) if ready else b""
    if got != expected:
        raise RuntimeError(f"ring alone: expected {expected!r} on the start socket, got {got!r}")


def _writer(me: int, runs: list[list[tuple[int, int, int, int]]], ring: Any, bucket_bytes: int, buffers: int,
            to_reader: socket.socket, start: socket.socket, rounds: int, clocks: Any) -> None:
    import numpy as np

    mine: dict[int, list[tuple[int, int, int]]] = {}
    fills: list[tuple[int, int, int]] = []  # (run number, first byte in source, length)
    held = number = 0
    for index, bucket in enumerate(runs):
        for writer, _, offset, length in bucket:
            if writer == me:
                mine.setdefault(index, []).append((held, (index % buffers) * bucket_bytes + offset, length))
                fills.append((number, held, length))
                held += length
            number += 1
    source = np.empty(max(held, 1), dtype=np.uint8)
    inbox = _Inbox([to_reader])
    for round_index in range(rounds):
        if round_index:
            _wait(start, b"f")  # the last round's clock stopped: refill now, untimed
        for number, at, length in fills:  # this round's bytes (memcpy's speed does not depend on them)
            source[at:at + length] = _fill(number, round_index)
        start.sendall(b"r")
        _wait(start, b"g")
        began, began_cpu = time.perf_counter(), time.process_time()
        free = set()
        for index in sorted(mine):
            while index >= buffers and index - buffers not in free:
                free.add(inbox.next()[1])
            for at, offset, length in mine[index]:
                ring[offset:offset + length] = source[at:at + length]
            to_reader.sendall(_MESSAGE.pack(index))
        clocks[round_index, me] = (began, time.process_time() - began_cpu)
        start.sendall(b"d")
    _wait(start, b"x")  # exiting closes our link: only once the reader needs nothing more from it


def _reader(runs: list[list[tuple[int, int, int, int]]], sizes: list[int], ring: Any, bucket_bytes: int,
            buffers: int, writers: list[socket.socket], start: socket.socket, rounds: int, clocks: Any) -> None:
    import numpy as np

    total = sum(sizes)
    destination = np.empty(max(total, 1), dtype=np.uint8)  # the node's staging copy
    model = np.empty(max(total, 1), dtype=np.uint8)
    tensors = list(zip(itertools.accumulate(sizes, initial=0), sizes))
    destination.fill(0)  # a worker's model and staging copy exist before its first round: no page
    model.fill(0)  # faults in a timed round
    who = [sorted({run[0] for run in bucket}) for bucket in runs]
    inbox = _Inbox(writers)
    for round_index in range(rounds):
        start.sendall(b"r")
        _wait(start, b"g")
        began, began_cpu = time.perf_counter(), time.process_time()
        written: dict[int, int] = {}
        for index, bucket in enumerate(runs):
            while written.get(index, 0) < len(who[index]):
                _, done = inbox.next()
                written[done] = written.get(done, 0) + 1
            base = (index % buffers) * bucket_bytes
            for _, at, offset, length in bucket:  # piece by piece, to its place, as a worker unpacks
                destination[at:at + length] = ring[base + offset:base + offset + length]
            if index + buffers < len(runs):
                for writer in who[index + buffers]:
                    writers[writer].sendall(_MESSAGE.pack(index))
        loaded, loaded_cpu = time.perf_counter(), time.process_time()
        for at, length in tensors:  # the commit: tensor by tensor, from the staging copy into the model
            model[at:at + length] = destination[at:at + length]
        clocks[round_index, len(writers)] = (began, loaded_cpu - began_cpu)
        clocks[round_index, len(writers) + 1] = (loaded, time.perf_counter() - loaded)
        start.sendall(b"d")
        number = 0  # untimed: every run holds what its writer wrote this round, at its place
        for bucket in runs:
            for writer, at, _, length in bucket:
                if not (model[at:at + length] == _fill(number, round_index)).all():
                    raise RuntimeError(f"ring alone: round {round_index + 1}, bytes {at}..{at + length} are not what "
                                       f"writer {writer} wrote there")
                number += 1
    start.sendall(b"r")  # the last round checked


def measure(model: str, dtype: str, writers: int, bucket_bytes: int, buffers: int, rounds: int
            ) -> list[dict[str, float]]:
    """Every round's figures (see :func:`_round_figures`): ``writers`` processes and one reader
    through a ring, as described above. Forks its processes (they use numpy only): call it from a
    process that runs no threads."""
    import numpy as np

    from wtransfer.testing.models import parse_model

    nbytes, runs = _rows_layout(parse_model(model), dtype, writers, bucket_bytes)
    total = sum(nbytes)
    _check_tiling(runs, total)
    ring = np.frombuffer(mmap.mmap(-1, bucket_bytes * buffers), dtype=np.uint8)
    ring[:] = 0
    # each round: (when it began there, CPU seconds since) for every writer's writes and the reader's
    # bucket phase, then (when it began, seconds) for the reader's commit; perf_counter is the host's
    # monotonic clock, one for every process (shared with the children: they write, the parent reads)
    clocks = np.frombuffer(mmap.mmap(-1, 16 * rounds * (writers + 2)), dtype=np.float64).reshape(
        rounds, writers + 2, 2)
    links = [socket.socketpair() for _ in range(writers)]  # reader end, writer end
    starts = [socket.socketpair() for _ in range(writers + 1)]  # ours, theirs
    children = []
    try:
        for me in range(writers + 1):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:  # keep only this process's ends: a peer that dies closes its sockets for everyone
                    keep = {starts[me][1]} | ({links[me][1]} if me < writers else {link[0] for link in links})
                    for sock in [s for pair in [*links, *starts] for s in pair]:
                        if sock not in keep:
                            sock.close()
                    if me < writers:
                        _writer(me, runs, ring, bucket_bytes, buffers, links[me][1], starts[me][1], rounds, clocks)
                    else:
                        _reader(runs, nbytes, ring, bucket_bytes, buffers, [link[0] for link in links],
                                starts[me][1], rounds, clocks)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                os._exit(code)
            children.append(pid)
        for link in links:
            link[0].close()
            link[1].close()
        for _, theirs in starts:
            theirs.close()
        seconds = []
        for _ in range(rounds):
            for ours, _ in starts:
                _wait(ours, b"r")
            began = time.perf_counter()
            for ours, _ in starts:
                ours.sendall(b"g")
            for ours, _ in starts:
                _wait(ours, b"d")
            seconds.append(time.perf_counter() - began)
            if len(seconds) < rounds:
                for ours, _ in starts[:writers]:
                    ours.sendall(b"f")
        _wait(starts[-1][0], b"r")  # the reader checked the last round
        for ours, _ in starts[:writers]:
            ours.sendall(b"x")
    finally:
        for pid in children:  # none is left behind, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
    cores = len(os.sched_getaffinity(0))
    return [_round_figures(total, wall, clocks[index], writers, cores) for index, wall in enumerate(seconds)]


def _round_figures(total: int, seconds: float, clocks: Any, writers: int, cores: int) -> dict[str, float]:
    """One round: its GB/s; ``bucket_busy``, the CPU seconds of every process per second of the
    bucket phase (how much of the host's cores the copies through the ring take while they run);
    ``commit_share``, the share of the round the reader spends alone on the commit; and
    ``gain_estimate``, how much faster than this round more writers could make it on this host
    if their copies cost the bucket phase the CPU they cost here.

    That estimate: the commit stays the reader's alone, whoever wrote; the bucket phase's CPU is
    spread perfectly over every core of this process's affinity, never below the reader's own
    part of it, which one process does in order. It is not a bound: CPU time counts the cycles a
    copy stalls on memory, and copies that overlap differently stall differently (two writers
    have used a few percent less CPU a byte than one on a 2-core host).
    """
    began = float(clocks[: writers + 1, 0].min())  # the first process to hear the go
    bucket_cpu = float(clocks[: writers + 1, 1].sum())  # the writers' writes and the reader's bucket phase
    reader_cpu = float(clocks[writers, 1])
    loaded, commit_seconds = (float(value) for value in clocks[writers + 1])
    bucket_seconds = loaded - began  # every writer's last write is before the reader loaded it
    shortest = commit_seconds + max(bucket_cpu / cores, reader_cpu)
    return {"gb_per_s": total / seconds / 1e9, "bucket_busy": bucket_cpu / bucket_seconds,
            "commit_share": commit_seconds / seconds, "gain_estimate": seconds / shortest, "cores": cores}


def _main(model: str, dtype: str, writers: int, bucket_bytes: int, buffers: int, rounds: int, conn: Any) -> None:
    conn.send_bytes(json.dumps(measure(model, dtype, writers, bucket_bytes, buffers, rounds)).encode())


def run_fresh(model: str, dtype: str, writers: int, bucket_bytes: int, buffers: int, rounds: int
              ) -> dict[str, float]:
    """The figures of the round with the median GB/s of ``rounds`` rounds (see :func:`_round_figures`:
    each from that one round, so they derive from one another), measured in a fresh process (so
    the forks carry no threads)."""
    mine, theirs = multiprocessing.Pipe(duplex=False)
    process = worker_process(_main, (model, dtype, writers, bucket_bytes, buffers, rounds, theirs), daemon=False)
    process.start()
    theirs.close()
    if not mine.poll(_WAIT_S * (rounds + 2)):
        process.kill()
        raise SystemExit(f"the ring alone with {writers} writer(s) sent no figures")
    try:
        figures = json.loads(mine.recv_bytes())
    except EOFError:
        raise SystemExit(f"the ring alone with {writers} writer(s) failed (exit code {process.exitcode})") from None
    process.join(30)
    return median_item(figures, lambda round_: round_["gb_per_s"])
