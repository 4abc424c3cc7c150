"""Node staging: one host copy of a round per node, shared by every worker of the node.

An atomic round is received into host memory and loaded into a model only once every worker has it
whole. A copy per *worker* would cost TP x the model per node, so a node's workers of one trainer share it:

* the first to start a round binds an abstract Unix socket named after the trainer's staging key and
  becomes the node's **stager**: it owns one anonymous ``memfd`` segment and writes the round into it;
* the others (**followers**) take part in the transport but keep nothing; when their receive ends they
  ask the stager whether the round landed whole, and get a read-only descriptor (``SCM_RIGHTS``) or why not.

At commit every worker copies from the same pages into its model. A dead stager closes the socket, so
followers fail at once. Both sides check the other's user id (``SO_PEERCRED``): abstract names are
visible host-wide. Without abstract sockets (not Linux) every worker stages for itself. An engine whose
transport already ends in such a copy hands it over instead (:func:`~wtransfer.engines.rounds.commit.adopt_staged`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from wtransfer.engines.channel.control import ControlChannel, PeerClosedError, stranger_uid
from wtransfer.engines.rounds.manifest import Manifest, TensorEntry
from wtransfer.engines.rounds.packing import align
from wtransfer.errors import TransferError, TransferTimeoutError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("wtransfer")

ELECTION_S = 10.0
"""How long a worker keeps trying to become the node's stager or reach the one that is: the other
worker may sit between ``bind`` and ``listen`` while a busy host runs something else."""


def staging_offsets(entries: tuple[TensorEntry, ...]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the staging segment (``ALIGN``-aligned) and the total size."""
    offsets, total = [], 0
    for entry in entries:
        offsets.append(total)
        total += align(entry.nbytes)
    return offsets, total


def create_memfd(size: int, label: str) -> int:
    """An owner-only shared-memory file descriptor of ``size`` bytes that has no name anywhere."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        import _posixshmem
        import secrets

        name = f"/{label}-{secrets.token_hex(8)}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        _posixshmem.shm_unlink(name)  # unlinked at once: the fd keeps it alive, nothing can leak
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_only_fd(fd: int) -> int:
    """A read-only descriptor of ``fd``'s memory, so the receiver can never map it writable (elsewhere a dup)."""
    if os.path.isdir("/proc/self/fd"):
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    return os.dup(fd)  # pragma: no cover - not Linux


MADV_POPULATE_WRITE = 23
"""Linux >= 5.14: fault every page in writable, its content unchanged (Python 3.11 has no name for it)."""
MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


@functools.cache
def _libc() -> Any:
    """libc's ``mmap``, ``munmap`` and ``madvise``, typed for 64-bit addresses and sizes."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def map_shared(fd: int, size: int, writable: bool) -> Any:
    """``size`` bytes of ``fd`` mapped shared, as a ctypes byte array for ``torch.frombuffer`` or ``numpy.frombuffer``,
    every page faulted in now so no round pays for it (writable ones with ``MADV_POPULATE_WRITE``: a page populated
    for reading still faults at its first write).

    The range is unmapped when the array and every view of it are gone, never before. Python's ``mmap`` is not used:
    its ``close()`` unmaps under live ``torch.frombuffer`` views (they hold no buffer export), and a view read after
    that crashed its process; and it keeps a duplicate descriptor, which would hold the memory as long as any view.
    :func:`release_shared` lets go of the memory while views live on."""
    import ctypes
    import weakref

    held = os.fstat(fd).st_size
    if held < size:  # libc maps past the end, and the first read there is a SIGBUS
        raise ValueError(f"cannot map {size} bytes of shared memory that holds {held}")
    libc = _libc()
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    flags = mmap.MAP_SHARED | (0 if writable else getattr(mmap, "MAP_POPULATE", 0))
    address = libc.mmap(None, size, prot, flags, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        code = ctypes.get_errno()
        raise OSError(code, f"mapping {size} bytes of shared memory failed: {os.strerror(code)}")
    if writable:
        libc.madvise(address, size, MADV_POPULATE_WRITE)  # an older kernel refuses: the first writes fault
    mapped = (ctypes.c_uint8 * size).from_address(address)
    mapped.unmap = weakref.finalize(mapped, libc.munmap, address, size)
    mapped.unmap.atexit = False  # at exit the process's memory goes anyway, and a thread may still read it
    return mapped


def release_shared(mapped: Any) -> None:
    """Drop this process's hold on ``mapped``'s shared pages now, though views of it may live on: the range becomes
    private zero pages in place, so a view kept past this (by a loader, or by the frames of an error that a report
    formats with its locals) reads zeros, and a late write (a receive shut down under it) stays its own, instead
    of crashing the process. No swap is reserved for them: a page costs memory only once written. The shared
    memory goes once no process maps it and its last descriptor is closed; the range goes with the last view."""
    import ctypes

    start = ctypes.addressof(mapped)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE
    address = _libc().mmap(start, len(mapped), mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if address != start:  # an older kernel may have unmapped the range already: never unmap what comes there next
        mapped.unmap.detach()
        code = ctypes.get_errno()
        logger.warning("could not turn a shared-memory mapping into zero pages in place (%s): it is never unmapped "
                       "now, and a view of it kept past its round may be unsafe to read", os.strerror(code))


class SharedSegment:
    """A mapped, pre-faulted ``memfd`` holding one staged round (the descriptor is kept to hand it on).
    Read-only where handed over so: a stray write faults instead of altering what another worker commits."""

    def __init__(self, fd: int, size: int, writable: bool = True) -> None:
        import torch

        self.fd = fd
        self.size = size
        self.writable = writable
        try:
            self.inode = os.fstat(fd).st_ino
            self._map: Any = map_shared(fd, max(size, 1), writable)
        except BaseException:
            os.close(fd)
            raise
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)[:size]

    @classmethod
    def create(cls, size: int) -> SharedSegment:
        return cls(create_memfd(max(size, 1), "wtransfer-staging"), size)

    @classmethod
    def handed_over(cls, current: SharedSegment | None, fds: list[int], size: int,
                    writable: bool) -> SharedSegment | None:
        """The segment in ``fds`` (all consumed) replacing ``current``; ``current`` when none came."""
        try:
            if not fds:
                return current
            if current is not None:
                current.close()
            return cls(fds.pop(), size, writable)
        finally:
            for fd in fds:
                os.close(fd)

    def views(self, manifest: Manifest, layout: tuple[list[int], int] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor of the round as a typed view of this segment, in manifest order."""
        offsets, total = layout or staging_offsets(manifest.entries)
        if total > self.size:
            raise TransferError(f"staging segment of {self.size} bytes is too small for a {total}-byte round")
        return {
            entry.name: self.data[offset : offset + entry.nbytes].view(entry.torch_dtype()).view(entry.shape)
            for entry, offset in zip(manifest.entries, offsets)
        }

    def close(self, release: bool = True) -> None:
        """Close the descriptor and let go of the memory: :func:`release_shared` gives the pages back now, and a view
        that outlives this reads zeros. ``release=False`` leaves the pages to the tensors still viewing them:
        ``shm``'s ``share_source`` keeps the trainer's own tensors here, which must outlive the trainer."""
        if self._map is not None and release:
            release_shared(self._map)
        self.data = None  # type: ignore[assignment]
        self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class NodeStaging:
    """This worker's handle on its node's staging for one trainer (one staging key)."""

    KEEP_OUTCOMES = 4

    def __init__(self, key: str) -> None:
        self.key = key
        self.segment: SharedSegment | None = None
        self._server: socket.socket | None = None
        self._channel: ControlChannel | None = None  # a follower's connection to the stager
        self._lock = threading.Condition()
        self._outcomes: dict[int, str | None] = {}  # round -> None (staged whole) or why not
        self._followers: set[ControlChannel] = set()  # the stager's connections, closed with it
        self._closed = False
        self._elect()

    @property
    def is_stager(self) -> bool:
        return self._channel is None

    # -- who stages ---------------------------------------------------------------------------
    def _elect(self) -> None:
        if not sys.platform.startswith("linux"):
            return  # no abstract sockets: stage privately
        name = f"\0wtransfer-stage-{self.key}"
        deadline = time.monotonic() + ELECTION_S
        pause = 0.001
        while True:
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.bind(name)
            except OSError as exc:
                server.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
            else:
                server.listen(64)
                self._server = server
                threading.Thread(target=self._accept_loop, name="wtransfer-stager", daemon=True).start()
                logger.debug("node staging %s: this worker stages for the node", self.key)
                return
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                client.connect(name)
            except OSError:  # the stager is between bind and listen, or going away: try again
                client.close()
                if time.monotonic() > deadline:
                    break
                time.sleep(pause)  # a busy host may deschedule the other worker for a while
                pause = min(pause * 2, 0.1)
                continue
            if (stranger := stranger_uid(client)) is not None:
                client.close()
                raise TransferError(
                    f"node staging {self.key}: this node's staging socket is held by a process of user id {stranger}, "
                    f"not this user ({os.getuid()}); refusing to take weights from it. Another user on this host "
                    f"may be squatting the trainer's staging name: use commit='streaming' or find that process"
                )
            self._channel = ControlChannel(client, "this node's stager")
            logger.debug("node staging %s: following this node's stager", self.key)
            return
        raise TransferError(f"node staging {self.key}: could neither stage nor reach this node's stager "
                            f"within {ELECTION_S:g} s")

    def rejoin_if_orphaned(self) -> None:
        """A follower whose stager is gone (between rounds) elects again before the next round."""
        if self._channel is None:
            return
        import select

        readable, _, _ = select.select([self._channel.sock], [], [], 0)
        if readable:
            with contextlib.suppress(TransferError):
                self._channel.read_ready()
                for fd in self._channel.take_fds():  # a stray reply's descriptor
                    os.close(fd)
                return  # a stray message: still connected
            self._channel.close()
            self._channel = None
            self._elect()

    # -- the stager ---------------------------------------------------------------------------
    def begin(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """Stager: a round starts; returns where each tensor goes (the segment grows if needed)."""
        layout = staging_offsets(manifest.entries)
        with self._lock:
            self._outcomes.pop(manifest.version, None)
            return self._segment_of(layout[1]).views(manifest, layout)

    def reserve(self, size: int) -> None:
        """Stager: have a pre-faulted segment of at least ``size`` bytes before the first round, so that round
        pays no page faults (the trainer says the size when its workers join). A follower does nothing."""
        if self.is_stager:
            with self._lock:
                self._segment_of(size)

    def _segment_of(self, size: int) -> SharedSegment:
        """The stager's writable segment, replaced by a larger one if it holds fewer than ``size`` bytes."""
        if self.segment is None or self.segment.size < size or not self.segment.writable:
            # (a follower elected stager maps its old stager's copy read-only: it stages anew)
            old, self.segment = self.segment, None
            if old is not None:
                old.close()
            self.segment = SharedSegment.create(size)
            logger.debug("node staging %s: %d-byte segment", self.key, size)
        return self.segment

    def settle(self, version: int, error: str | None) -> None:
        """Stager: round ``version`` landed whole (``error`` None) or failed; followers are told."""
        with self._lock:
            self._outcomes[version] = error
            for old in sorted(self._outcomes)[: -self.KEEP_OUTCOMES]:
                del self._outcomes[old]
            self._lock.notify_all()

    def _accept_loop(self) -> None:
        server = self._server
        while server is not None and not self._closed:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if (stranger := stranger_uid(conn)) is not None:  # abstract names are visible host-wide
                logger.warning("node staging %s: refused a connection from user id %d (only this user's "
                               "workers may map the staged weights)", self.key, stranger)
                conn.close()
                continue
            channel = ControlChannel(conn, "a follower")
            with self._lock:
                if self._closed:
                    channel.close()
                    return
                self._followers.add(channel)
            threading.Thread(target=self._serve, args=(channel,), name="wtransfer-stager-peer", daemon=True).start()

    def _serve(self, channel: ControlChannel) -> None:
        try:
            while not self._closed:
                try:
                    request = channel.recv(3600.0)
                except TransferTimeoutError:
                    continue
                version, timeout_s = request.get("version"), float(request.get("timeout_s", 300.0))
                with self._lock:
                    settled = self._lock.wait_for(
                        lambda: self._closed or version in self._outcomes
                        or any(v > version for v in self._outcomes), timeout_s)
                    staged, error, segment = version in self._outcomes, self._outcomes.get(version), self.segment
                    fd = read_only_fd(segment.fd) if staged and error is None and segment else -1
                try:
                    if not staged or segment is None:
                        why = "the stager timed out waiting for it" if not settled else "the stager moved on or closed"
                        channel.send({"ok": False, "version": version,
                                      "error": f"round {version} was not staged on this node: {why}"})
                    elif error is not None:
                        channel.send({"ok": False, "version": version, "error": error})
                    else:
                        channel.send({"ok": True, "version": version, "size": segment.size}, fds=[fd])
                finally:
                    if fd >= 0:
                        os.close(fd)
        except (PeerClosedError, TransferError, OSError, ValueError):
            pass
        finally:
            with self._lock:
                self._followers.discard(channel)
            channel.close()

    # -- a follower ---------------------------------------------------------------------------
    def await_staged(self, manifest: Manifest, timeout_s: float) -> dict[str, torch.Tensor]:
        """Follower: wait for the stager to have round ``manifest.version`` whole; its views."""
        assert self._channel is not None
        version = manifest.version
        try:
            self._channel.send({"op": "staged", "version": version, "timeout_s": timeout_s}, timeout=timeout_s)
            reply: dict[str, Any] = self._channel.recv(timeout_s + 5.0)
        except PeerClosedError as exc:
            self._channel.close()
            self._channel = None
            self._elect()  # the next round gets a stager again
            raise TransferError(f"this node's stager died during round {version}: {exc}") from exc
        fds = self._channel.take_fds()
        try:
            if reply.get("version") != version:
                raise TransferError(f"this node's stager answered for round {reply.get('version')!r}, not {version}")
            if not reply.get("ok"):
                raise TransferError(f"round {version} did not reach this node whole: {reply.get('error')}")
            if len(fds) != 1:
                raise TransferError(f"the node's stager sent {len(fds)} descriptors, expected one")
            if self.segment is not None and self.segment.inode == os.fstat(fds[0]).st_ino:
                os.close(fds.pop())  # the copy it maps already
            self.segment = SharedSegment.handed_over(self.segment, fds, int(reply["size"]), writable=False)
            assert self.segment is not None
            return self.segment.views(manifest)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Release the copy and every socket; a stager's followers see it close and elect anew."""
        with self._lock:
            self._closed = True
            followers, self._followers = list(self._followers), set()
            self._lock.notify_all()
        for channel in followers:
            with contextlib.suppress(OSError):
                channel.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
            self._server = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None

