"""Small JSON control messages over a stream socket (length-prefixed frames, never pickle).

Used by ``shm`` and node staging; a frame may carry file descriptors (``SCM_RIGHTS``), so shared
memory is handed over without a name on disk.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import math
import os
import select
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from wtransfer.errors import TransferError, TransferTimeoutError

logger = logging.getLogger("wtransfer")

_HEADER = struct.Struct("!I")
_WORD = struct.Struct("!Iqq")
_WORD_FLAG = 1 << 31
"""Set in a header: a binary word follows (see ``_WORDS``), not a JSON frame of that length."""
_WORDS = ("bucket", "release")
"""The messages sent once per bucket of a ring round, through :meth:`ControlChannel.send_word`: a 20-byte binary
word (code: position + 1) that the receiver reads as ``{"op", "index", "slot"}``. Encoding and decoding them as
JSON took about 12 µs on a 2-core AMD EPYC, per message and twice per bucket."""
_WORD_CODES = {op: code for code, op in enumerate(_WORDS, 1)}
_POLL_MAX_MS = (1 << 31) - 1
MAX_FRAME = 64 << 20
"""The largest frame a known peer may send."""
STRANGER_FRAME = 4 << 10
"""The largest frame an unidentified peer may send (it is buffered before anyone knows who sent it)."""


def stranger_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket if it is another user's (None if it is
    this user's, or where unknown); abstract socket names are visible host-wide, so each side checks the other's."""
    if not hasattr(socket, "SO_PEERCRED"):  # pragma: no cover - not Linux
        return None
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid if uid != os.getuid() else None


def _recv_with_fds(sock: socket.socket, flags: int) -> tuple[bytes, list[int]]:
    """What has arrived (up to 64 KiB) and up to 4 descriptors that came with it; ``socket.recv_fds`` drops its
    ``flags`` before Python 3.12 (so MSG_DONTWAIT there would block)."""
    fds = array.array("i")
    data, ancillary, got, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * fds.itemsize),
                                               flags | getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if got & socket.MSG_CTRUNC:  # more descriptors than a frame may carry: the kernel closed the rest
        for fd in fds:
            os.close(fd)
        raise TransferError("a peer sent more than 4 descriptors with one message; protocol violation")
    return data, list(fds)


def _deadline(timeout: float | None) -> float:
    """When a wait of ``timeout`` seconds from now ends (None: never)."""
    return math.inf if timeout is None else time.monotonic() + timeout


class PeerClosedError(TransferError):
    """The other side closed the connection (it exited or was killed)."""


class ControlChannel:
    """One peer connection: ``send(dict)``, ``recv(timeout)``, and fd passing for set-up."""

    def __init__(self, sock: socket.socket, peer: str, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self.peer = peer
        self.max_frame = max_frame
        """The largest frame accepted (a larger one is a protocol violation, before it is buffered)."""
        self._buffer = bytearray()
        self._fds: list[int] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any], *, fds: list[int] | None = None, timeout: float | None = 30.0) -> None:
        """Send ``message`` as a JSON frame (with ``fds``, if given), waiting at most ``timeout`` seconds for room
        (None: for as long as it takes)."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        self._send(_HEADER.pack(len(payload)) + payload, fds, timeout)

    def send_word(self, op: str, index: int, slot: int, *, timeout: float | None = 30.0) -> None:
        """Send a per-bucket message (``op`` one of ``_WORDS``, signed 64-bit ``index`` and ``slot``) as a binary
        word; the receiver reads ``{"op": op, "index": index, "slot": slot}``."""
        try:
            word = _WORD.pack(_WORD_FLAG | _WORD_CODES[op], index, slot)
        except (KeyError, struct.error) as exc:
            raise ValueError(f"no control word {op!r} with index {index!r} and slot {slot!r}: the words are "
                             f"{', '.join(_WORDS)}, with signed 64-bit integers") from exc
        self._send(word, None, timeout)

    def _send(self, frame: bytes, fds: list[int] | None, timeout: float | None) -> None:
        """One system call when the socket has room (the usual case); a poll only when it has none."""
        view = memoryview(frame)

        def step() -> bool:
            nonlocal view, fds
            if fds:  # (socket.send_fds drops its flags before Python 3.12)
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = self.sock.sendmsg([view], rights, socket.MSG_DONTWAIT)
                fds = None  # they went with the first byte
            else:
                sent = self.sock.send(view, socket.MSG_DONTWAIT)
            view = view[sent:]
            return not view

        self._until_done(step, select.POLLOUT, timeout, "sending to {peer} timed out after {timeout:g} s",
                         "{peer} is gone")

    def _until_done(self, step: Callable[[], bool], event: int, timeout: float | None, timed_out: str,
                    gone: str) -> None:
        """Repeat ``step`` (system calls made with MSG_DONTWAIT) until it returns True. When it would block, wait for
        ``event``: at most ``timeout`` seconds in all from the first wait (None: for as long as it takes), then
        :class:`TransferTimeoutError` saying ``timed_out``. Any other socket error: :class:`PeerClosedError` saying
        ``gone``. Both are formatted (``{peer}``, ``{timeout}``) only when raised: the usual call pays for neither."""
        deadline = None
        try:
            self._untimed()
            while True:
                try:
                    if step():
                        return
                except BlockingIOError:
                    deadline = _deadline(timeout) if deadline is None else deadline
                    if not self._wait(event, deadline):
                        raise TransferTimeoutError(timed_out.format(peer=self.peer, timeout=timeout)) from None
        except TransferTimeoutError:
            raise
        except OSError as exc:
            raise PeerClosedError(f"{gone.format(peer=self.peer)} ({type(exc).__name__}: {exc})") from exc

    def _untimed(self) -> None:
        """Keep the socket blocking and without a timeout: Python polls before every call on a socket with one
        (and ``settimeout`` costs a system call of its own); this channel polls only when a call would block."""
        if self.sock.gettimeout() is not None:
            self.sock.settimeout(None)

    def _wait(self, event: int, deadline: float) -> bool:
        """Whether the socket became ready for ``event`` (or closed) before ``deadline``. A poll object per wait:
        one thread may wait to send while another waits to read, and one object cannot poll twice at once."""
        poller = select.poll()
        poller.register(self.sock.fileno(), event)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if poller.poll(_POLL_MAX_MS if left * 1000 >= _POLL_MAX_MS else max(1, math.ceil(left * 1000))):
                return True

    def _pop_frame(self) -> dict[str, Any] | None:
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        if size & _WORD_FLAG and 0 < size ^ _WORD_FLAG <= len(_WORDS):
            if len(self._buffer) < _WORD.size:
                return None
            _, index, slot = _WORD.unpack_from(self._buffer)
            del self._buffer[: _WORD.size]
            return {"op": _WORDS[(size ^ _WORD_FLAG) - 1], "index": index, "slot": slot}
        if size > self.max_frame:
            raise TransferError(f"{self.peer} sent a {size}-byte control frame; protocol violation")
        end = _HEADER.size + size
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[_HEADER.size : end])
        del self._buffer[:end]
        try:
            message = json.loads(payload)
        except ValueError as exc:
            raise TransferError(f"{self.peer} sent a malformed control message") from exc
        if not isinstance(message, dict):
            raise TransferError(f"{self.peer} sent a control message that is not an object")
        return message

    def _fill(self, timeout: float | None) -> None:
        """Read what has arrived, waiting at most ``timeout`` seconds for something (one system call when it is
        there already, a poll first only when it is not)."""
        received: list[tuple[bytes, list[int]]] = []

        def step() -> bool:
            received.append(_recv_with_fds(self.sock, socket.MSG_DONTWAIT))
            return True

        self._until_done(step, select.POLLIN, timeout,
                         "no message from {peer} within {timeout:g} s; it may be stuck or dead",
                         "lost the connection to {peer}")
        data, fds = received[0]
        self._fds.extend(fds)
        if not data:
            raise PeerClosedError(f"{self.peer} closed the connection (it exited or was killed)")
        self._buffer += data

    def recv(self, timeout: float | None) -> dict[str, Any]:
        """The next message, waiting at most ``timeout`` seconds (None: for as long as it takes)."""
        deadline = _deadline(timeout)
        while True:
            message = self._pop_frame()
            if message is not None:
                return message
            self._fill(None if timeout is None else max(deadline - time.monotonic(), 0.001))

    def read_ready(self) -> list[dict[str, Any]]:
        """Every complete message after the socket was reported readable (does not block)."""
        self._fill(0.5)
        return self.pending()

    def pending(self) -> list[dict[str, Any]]:
        """Complete messages already buffered (read together with earlier ones)."""
        messages = []
        while (message := self._pop_frame()) is not None:
            messages.append(message)
        return messages

    def take_fds(self) -> list[int]:
        fds, self._fds = self._fds, []
        return fds

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        with contextlib.suppress(OSError):
            self.sock.close()


class Listener:
    """A private Unix-socket listener: Linux abstract namespace (nothing on disk), else a 0700 dir."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._dir: str | None = None
        if sys.platform.startswith("linux"):
            self.sock.bind("\0" + tag)
            self.address = "@" + tag
        else:
            self._dir = tempfile.mkdtemp(prefix="wtransfer-")
            path = os.path.join(self._dir, "control")
            self.sock.bind(path)
            self.address = path
        self.sock.listen(64)

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> socket.socket | None:
        """The next connection, or None if it came from another user (refused, and logged)."""
        conn, _ = self.sock.accept()
        if (stranger := stranger_uid(conn)) is not None:
            logger.warning("wtransfer %s: refused a connection from user id %d (only this user's processes may "
                           "join)", self.tag, stranger)
            conn.close()
            return None
        return conn

    def close(self) -> None:
        """Stop listening; on non-Linux also remove the socket file and its directory."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._dir is not None:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
            self._dir = None


def connect(address: str, timeout: float, peer: str) -> ControlChannel:
    """Connect to a :class:`Listener` address (``@name`` = abstract namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    target = "\0" + address[1:] if address.startswith("@") else address
    sock.settimeout(timeout)
    try:
        sock.connect(target)
    except OSError as exc:
        sock.close()
        raise TransferError(
            f"cannot reach {peer} at {address!r} ({exc}); is the trainer running on this host "
            f"and still waiting for workers?"
        ) from exc
    if (owner := stranger_uid(sock)) is not None:  # the name is visible host-wide: anyone may hold it
        sock.close()
        raise TransferError(f"{peer} at {address!r} is run by user id {owner}, not by this user ({os.getuid()}); "
                            f"nothing was sent to it")
    return ControlChannel(sock, peer)
