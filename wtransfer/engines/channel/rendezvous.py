"""An authenticated key-value store for a side group's rendezvous, and the addresses it uses.

Not torch's ``TCPStore``: it answers anyone who connects (any key read or overwritten) and listens on
every interface. :class:`RendezvousServer` instead

* listens on one address (all interfaces only when a user asks for ``0.0.0.0``),
* makes every connection prove first that it holds the round's token (HMAC-SHA256 over both sides'
  nonces; the trainer proves it too, so a worker never talks to an impostor), dropping those that do
  not within :data:`AUTH_TIMEOUT_S` (see :data:`MAX_STRANGERS`),
* then serves ``set``/``get``/``wait``/``check``/``add``/``delete_key`` as JSON frames (values base64):
  all a gloo or NCCL group's rendezvous needs.

:func:`store` wraps either end in a ``torch.distributed.Store``. The token travels only inside
``init_info``, through the user's own client. :func:`local_address_for` picks the interface that
reaches the trainer (a host name often resolves to 127.0.0.1).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import logging
import secrets
import selectors
import socket
import threading
import time
from typing import Any

from wtransfer.engines.channel.control import MAX_FRAME, STRANGER_FRAME, ControlChannel
from wtransfer.errors import TransferError, TransferTimeoutError

logger = logging.getLogger("wtransfer")

AUTH_TIMEOUT_S = 5.0
"""How long a new connection has, in all, to authenticate before the server drops it."""
MAX_STRANGERS = 64
"""Connections authenticating at once. Strangers cost no thread (one selector serves every handshake) and at
most one read buffer (64 KiB) and one ``STRANGER_FRAME`` each; when one more arrives, one is shed: a silent one
before one that spoke, from the address holding the most slots, the oldest. Silent connections (a port scanner) thus cannot keep a worker, which
speaks at once, from joining; a worker that is shed all the same retries within its ``timeout_s``."""

WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")


def new_token() -> str:
    """A fresh 128-bit rendezvous secret (hex)."""
    return secrets.token_hex(16)


def _proof(token: str, side: str, client_nonce: str, server_nonce: str) -> str:
    message = f"wtransfer-rendezvous/{side}/{client_nonce}/{server_nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def resolve(host: str) -> str:
    """The IPv4/IPv6 address ``host`` names (addresses are returned as they are)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise TransferError(f"cannot resolve {host!r} ({exc})") from exc


def local_address_for(host: str, port: int) -> str:
    """This host's address on the route to ``host``: the one a peer there can reach us at."""
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, port))  # UDP: picks the route, sends nothing
        except OSError as exc:
            raise TransferError(f"no route from this host to {host}:{port} ({exc})") from exc
        return str(probe.getsockname()[0])


class KeyTable:
    """The store's contents: bytes by key, with waiting readers (thread-safe)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def wait(self, keys: list[str], timeout_s: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._closed or all(k in self._values for k in keys), timeout_s):
                missing = [k for k in keys if k not in self._values]
                raise TransferTimeoutError(f"rendezvous keys {missing} not set within {timeout_s:g} s")
            if self._closed and not all(k in self._values for k in keys):
                raise TransferError("the rendezvous was closed (its trainer shut down)")

    def close(self) -> None:
        """Wake every waiting reader: it raises (the trainer shut down), its thread is free to end."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        self.wait([key], timeout_s)
        with self._changed:
            return self._values[key]

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._values.get(key, b"0")) + amount
            self._values[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def delete(self, key: str) -> bool:
        with self._changed:
            return self._values.pop(key, None) is not None

    def __len__(self) -> int:
        with self._changed:
            return len(self._values)


class _Handshake:
    """One stranger's progress through the server's side of the handshake (driven by the accept loop)."""

    def __init__(self, conn: socket.socket, peer: str, token: str) -> None:
        self.channel = ControlChannel(conn, f"rendezvous peer {peer}", max_frame=STRANGER_FRAME)
        self.address = peer.rsplit(":", 1)[0]
        self.peer = peer
        self.token = token
        self.deadline = time.monotonic() + AUTH_TIMEOUT_S  # for the whole exchange: a trickle cannot stretch it
        self.client_nonce: str | None = None
        self.server_nonce = secrets.token_hex(16)

    def step(self) -> bool | None:
        """Read what arrived and answer: True once the peer proved the token, False if it failed, None meanwhile.
        Never blocks: the socket was reported readable, and each answer is a few hundred bytes."""
        for message in self.channel.read_ready():
            if self.client_nonce is None:
                nonce = message.get("nonce")
                if not isinstance(nonce, str) or not 16 <= len(nonce) <= 128:
                    return False
                self.client_nonce = nonce
                proof = _proof(self.token, "server", nonce, self.server_nonce)
                self.channel.send({"nonce": self.server_nonce, "proof": proof}, timeout=1.0)
                continue
            expected = _proof(self.token, "client", self.client_nonce, self.server_nonce)
            proof = message.get("proof")
            if not isinstance(proof, str) or not hmac.compare_digest(proof, expected):
                return False
            self.channel.send({"ok": True}, timeout=1.0)
            return True
        return None


class RendezvousServer:
    """The trainer's end: a :class:`KeyTable` served to authenticated peers on one address."""

    def __init__(self, address: str, port: int, token: str, timeout_s: float) -> None:
        self.table = KeyTable()
        self.token = token
        self.timeout_s = timeout_s
        host = resolve(address) if address not in WILDCARD_ADDRESSES else address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(128)
        except OSError as exc:
            self._sock.close()
            raise TransferError(
                f"cannot listen on {address}:{port} for the rendezvous ({exc}); 'master_address' must be an "
                f"address of this host that the workers can reach (or set 'listen_address' to the local "
                f"address to bind, '0.0.0.0' for every interface)"
            ) from exc
        self._sock.setblocking(False)
        self.address = host
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the accept loop through it
        self._thread = threading.Thread(target=self._accept_loop, name="wtransfer-rendezvous", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        """Accept and authenticate every connection in this one thread, never blocking on any peer; a peer
        that proved the token gets a thread of its own for its requests."""
        strangers: dict[socket.socket, _Handshake] = {}  # in arrival order
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            try:
                while not self._closed:
                    soonest = min((h.deadline for h in strangers.values()), default=time.monotonic() + 1.0)
                    for key, _events in selector.select(max(soonest - time.monotonic(), 0.0)):
                        if key.fileobj is self._wake_r:
                            return
                        if key.fileobj is self._sock:
                            self._accept(selector, strangers)
                            continue
                        conn = key.fileobj
                        handshake = strangers.get(conn)  # type: ignore[call-overload]
                        if handshake is None:
                            continue  # dropped earlier in this batch
                        try:
                            proved = handshake.step()
                        except TransferError:
                            proved = False
                        if proved is not None:
                            self._settle(selector, strangers, handshake, proved)
                    now = time.monotonic()
                    for handshake in [h for h in strangers.values() if h.deadline <= now]:
                        self._settle(selector, strangers, handshake, False)
            finally:
                for handshake in strangers.values():
                    handshake.channel.close()

    def _accept(self, selector: selectors.BaseSelector, strangers: dict[socket.socket, _Handshake]) -> None:
        try:
            conn, peer = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):  # the listening socket is gone
                self._closed = True
            elif exc.errno not in (errno.ECONNABORTED, errno.EPROTO, errno.ECONNRESET):
                logger.debug("wtransfer rendezvous: cannot accept a connection now (%s); retrying", exc)
                time.sleep(0.1)  # out of descriptors or memory for a moment: the peer waits in the backlog
            return  # a peer's own failure (reset, aborted) costs nothing: the next one is accepted
        conn.setblocking(False)
        handshake = _Handshake(conn, f"{peer[0]}:{peer[1]}", self.token)
        if len(strangers) >= MAX_STRANGERS:  # shed one: silent first, from the busiest address, the oldest
            silent = [h for h in strangers.values() if h.client_nonce is None] or list(strangers.values())
            counts: dict[str, int] = {}
            for other in silent:
                counts[other.address] = counts.get(other.address, 0) + 1
            busiest = max(counts, key=counts.__getitem__)
            oldest = next(h for h in silent if h.address == busiest)
            self._settle(selector, strangers, oldest, False, quiet=True)
        strangers[conn] = handshake
        selector.register(conn, selectors.EVENT_READ)

    def _settle(self, selector: selectors.BaseSelector, strangers: dict[socket.socket, _Handshake],
                handshake: _Handshake, proved: bool, quiet: bool = False) -> None:
        conn = handshake.channel.sock
        selector.unregister(conn)
        del strangers[conn]
        if not proved:
            if not quiet:
                logger.warning("wtransfer rendezvous: dropped a connection from %s that did not prove the token",
                               handshake.peer)
            handshake.channel.close()
            return
        with self._lock:
            if self._closed:
                handshake.channel.close()
                return
            self._connections.add(conn)
        handshake.channel.max_frame = MAX_FRAME
        threading.Thread(target=self._serve, args=(handshake.channel,), name="wtransfer-rendezvous-peer",
                         daemon=True).start()

    def _serve(self, channel: ControlChannel) -> None:
        try:
            while not self._closed:
                request = channel.recv(timeout=1e9)
                channel.send(self._answer(request), timeout=self.timeout_s)
        except TransferError:
            pass  # the peer left (or sent garbage): its connection ends here
        finally:
            with self._lock:
                self._connections.discard(channel.sock)
            channel.close()

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op, table = request.get("op"), self.table
        try:
            if op == "set":
                table.set(str(request["key"]), base64.b64decode(request["value"]))
                return {"ok": True}
            if op == "get":
                value = table.get(str(request["key"]), float(request["timeout_s"]))
                return {"value": base64.b64encode(value).decode()}
            if op == "wait":
                table.wait([str(k) for k in request["keys"]], float(request["timeout_s"]))
                return {"ok": True}
            if op == "check":
                return {"value": table.check([str(k) for k in request["keys"]])}
            if op == "add":
                return {"value": table.add(str(request["key"]), int(request["amount"]))}
            if op == "delete_key":
                return {"value": table.delete(str(request["key"]))}
            if op == "num_keys":
                return {"value": len(table)}
        except TransferTimeoutError as exc:
            return {"error": str(exc), "timeout": True}
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": f"bad {op!r} request: {exc}"}
        return {"error": f"unknown rendezvous operation {op!r}"}

    def close(self) -> None:
        """Stop listening and drop every connection (idempotent): the port is free once this returns."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        self.table.close()  # peers' threads waiting on a key are free to end
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)  # the loop never blocks on a peer: it returns at once
        for end in (self._sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                end.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _WrongToken(TransferError):
    """The peer at the rendezvous address is not the trainer of this init_info: retrying cannot help."""


class RendezvousClient:
    """A worker's authenticated connection to the trainer's :class:`RendezvousServer`."""

    def __init__(self, channel: ControlChannel, timeout_s: float) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, address: str, port: int, token: str, timeout_s: float,
                retry_s: float | None = None) -> RendezvousClient:
        """Connect and authenticate both ways, retrying for ``retry_s`` (default ``timeout_s``) while the trainer
        is not listening yet or drops the connection before it proved itself (it sheds the oldest strangers
        when flooded). A trainer that proves another token is refused at once."""
        retry_s = timeout_s if retry_s is None else retry_s
        deadline = time.monotonic() + retry_s
        where = f"{address}:{port}"
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((address, port), timeout=max(min(left, 5.0), 0.01))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                channel = ControlChannel(sock, f"the trainer's rendezvous at {where}")
            except OSError as exc:
                failure: Exception = exc
            else:
                try:
                    cls._handshake(channel, token, where, min(AUTH_TIMEOUT_S, max(left, 0.01)))
                    return cls(channel, timeout_s)
                except _WrongToken:
                    channel.close()
                    raise
                except TransferError as exc:  # dropped or stalled before the trainer proved itself: try again
                    channel.close()
                    failure = exc
            if time.monotonic() + 0.1 >= deadline:
                raise TransferTimeoutError(
                    f"cannot reach the trainer's rendezvous at {where} within {retry_s:g} s ({failure}); "
                    f"is the trainer running, and is 'master_address' an address of the trainer's host "
                    f"that this host can reach?"
                ) from failure
            time.sleep(0.1)

    @staticmethod
    def _handshake(channel: ControlChannel, token: str, where: str, timeout_s: float) -> None:
        client_nonce = secrets.token_hex(16)
        channel.send({"nonce": client_nonce}, timeout=timeout_s)
        reply = channel.recv(timeout=timeout_s)
        server_nonce = reply.get("nonce")
        expected = _proof(token, "server", client_nonce, str(server_nonce))
        if not isinstance(reply.get("proof"), str) or not hmac.compare_digest(reply["proof"], expected):
            raise _WrongToken(
                f"the rendezvous at {where} does not hold this round's token: it is not the trainer that "
                f"issued this init_info (or the init_info is stale, or another trainer listens on that port)"
            )
        channel.send({"proof": _proof(token, "client", client_nonce, str(server_nonce))}, timeout=timeout_s)
        if channel.recv(timeout=timeout_s).get("ok") is not True:
            raise _WrongToken(f"the rendezvous at {where} refused this worker's token")

    def _request(self, op: str, **fields: Any) -> Any:
        wait_s = float(fields.get("timeout_s", 0.0))
        with self._lock:
            self._channel.send({"op": op, **fields}, timeout=self.timeout_s)
            reply = self._channel.recv(timeout=wait_s + self.timeout_s)
        if "error" in reply:
            kind = TransferTimeoutError if reply.get("timeout") else TransferError
            raise kind(f"rendezvous {op}: {reply['error']}")
        return reply.get("value")

    # the same calls as KeyTable's, answered by the trainer's table
    def set(self, key: str, value: bytes) -> None:
        self._request("set", key=key, value=base64.b64encode(value).decode())

    def wait(self, keys: list[str], timeout_s: float) -> None:
        self._request("wait", keys=keys, timeout_s=timeout_s)

    def get(self, key: str, timeout_s: float) -> bytes:
        return base64.b64decode(self._request("get", key=key, timeout_s=timeout_s))

    def check(self, keys: list[str]) -> bool:
        return bool(self._request("check", keys=keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._request("add", key=key, amount=amount))

    def delete(self, key: str) -> bool:
        return bool(self._request("delete_key", key=key))

    def __len__(self) -> int:
        return int(self._request("num_keys"))

    def close(self) -> None:
        self._channel.close()


def store(table: KeyTable | RendezvousClient, timeout_s: float) -> Any:
    """A ``torch.distributed.Store`` over the trainer's table or a worker's connection to it.

    Keep the returned object referenced while any group built on it lives: torch holds only the C++ half
    ("Not implemented" from c10d once the Python object is collected).
    """
    import torch.distributed as dist

    class RendezvousStore(dist.Store):  # type: ignore[misc]
        """What process groups call; an error here surfaces as the group's RuntimeError."""

        def set(self, key: str, value: Any) -> None:
            table.set(key, value.encode() if isinstance(value, str) else bytes(value))

        def get(self, key: str) -> bytes:
            return table.get(key, timeout_s)

        def wait(self, keys: list[str], *_timeout: Any) -> None:
            table.wait(list(keys), timeout_s)

        def check(self, keys: list[str]) -> bool:
            return table.check(list(keys))

        def add(self, key: str, amount: int) -> int:
            return table.add(key, int(amount))

        def delete_key(self, key: str) -> bool:
            return table.delete(key)

        def num_keys(self) -> int:
            return len(table)

    return RendezvousStore()
