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
import hashlib
import hmac
import logging
import secrets
import socket
import threading
import time
from typing import Any

from wtransfer.engines._control import MAX_FRAME, STRANGER_FRAME, ControlChannel
from wtransfer.errors import TransferError, TransferTimeoutError

logger = logging.getLogger("wtransfer")

AUTH_TIMEOUT_S = 5.0
"""How long a new connection has, in all, to authenticate before the server drops it."""
MAX_STRANGERS = 16
"""Connections authenticating at once (the next waits in the backlog, at most ``AUTH_TIMEOUT_S``). With
``STRANGER_FRAME``-sized frames until proven, strangers cost at most 16 threads and about 1 MiB."""

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

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def wait(self, keys: list[str], timeout_s: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self._values for k in keys), timeout_s):
                missing = [k for k in keys if k not in self._values]
                raise TransferTimeoutError(f"rendezvous keys {missing} not set within {timeout_s:g} s")

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


class RendezvousServer:
    """The trainer's end: a :class:`KeyTable` served to authenticated peers on one address."""

    def __init__(self, address: str, port: int, token: str, timeout_s: float) -> None:
        self.table = KeyTable()
        self.token = token
        self.timeout_s = timeout_s
        self._strangers = threading.BoundedSemaphore(MAX_STRANGERS)
        host = resolve(address) if address not in WILDCARD_ADDRESSES else address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError as exc:
            self._sock.close()
            raise TransferError(
                f"cannot listen on {address}:{port} for the rendezvous ({exc}); 'master_address' must be an "
                f"address of this host that the workers can reach (or set 'listen_address' to the local "
                f"address to bind, '0.0.0.0' for every interface)"
            ) from exc
        self.address = host
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="wtransfer-rendezvous", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            # at most MAX_STRANGERS handshakes at once; one that waits too long is closed, no thread started
            if not self._strangers.acquire(timeout=AUTH_TIMEOUT_S):
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, f"{peer[0]}:{peer[1]}"), name="wtransfer-rendezvous-peer",
                daemon=True,
            ).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        channel = ControlChannel(conn, f"rendezvous peer {peer}", max_frame=STRANGER_FRAME)
        try:
            try:
                proved = self._authenticate(channel)
            finally:
                self._strangers.release()
            if not proved:
                logger.warning("wtransfer rendezvous: dropped a connection from %s that did not prove the token", peer)
                return
            channel.max_frame = MAX_FRAME
            while not self._closed:
                request = channel.recv(timeout=1e9)
                channel.send(self._answer(request), timeout=self.timeout_s)
        except TransferError:
            pass  # the peer left (or sent garbage): its connection ends here
        finally:
            with self._lock:
                self._connections.discard(conn)
            channel.close()

    def _authenticate(self, channel: ControlChannel) -> bool:
        deadline = time.monotonic() + AUTH_TIMEOUT_S  # for the whole exchange: a trickle cannot stretch it
        try:
            hello = channel.recv(timeout=AUTH_TIMEOUT_S)
            client_nonce = hello.get("nonce")
            if not isinstance(client_nonce, str) or not 16 <= len(client_nonce) <= 128:
                return False
            server_nonce = secrets.token_hex(16)
            channel.send({"nonce": server_nonce, "proof": _proof(self.token, "server", client_nonce, server_nonce)},
                         timeout=max(deadline - time.monotonic(), 0.001))
            answer = channel.recv(timeout=max(deadline - time.monotonic(), 0.001))
        except TransferError:
            return False
        expected = _proof(self.token, "client", client_nonce, server_nonce)
        proof = answer.get("proof")
        if not isinstance(proof, str) or not hmac.compare_digest(proof, expected):
            return False
        channel.send({"ok": True})
        return True

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
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop: blocked in accept() it holds the socket
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._thread is not threading.current_thread():
            self._thread.join(AUTH_TIMEOUT_S + 1)  # at most one stranger's wait for a handshake slot
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class RendezvousClient:
    """A worker's authenticated connection to the trainer's :class:`RendezvousServer`."""

    def __init__(self, channel: ControlChannel, timeout_s: float) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, address: str, port: int, token: str, timeout_s: float,
                retry_s: float | None = None) -> RendezvousClient:
        """Connect (retrying for ``retry_s``, default ``timeout_s``) and authenticate both ways."""
        retry_s = timeout_s if retry_s is None else retry_s
        deadline = time.monotonic() + retry_s
        where = f"{address}:{port}"
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection((address, port), timeout=max(min(left, 5.0), 0.01))
                break
            except OSError as exc:
                if time.monotonic() + 0.1 >= deadline:
                    raise TransferTimeoutError(
                        f"cannot reach the trainer's rendezvous at {where} within {retry_s:g} s ({exc}); "
                        f"is the trainer running, and is 'master_address' an address of the trainer's host "
                        f"that this host can reach?"
                    ) from exc
                time.sleep(0.1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = ControlChannel(sock, f"the trainer's rendezvous at {where}")
        try:
            client_nonce = secrets.token_hex(16)
            channel.send({"nonce": client_nonce}, timeout=AUTH_TIMEOUT_S)
            reply = channel.recv(timeout=AUTH_TIMEOUT_S)
            server_nonce = reply.get("nonce")
            expected = _proof(token, "server", client_nonce, str(server_nonce))
            if not isinstance(reply.get("proof"), str) or not hmac.compare_digest(reply["proof"], expected):
                raise TransferError(
                    f"the rendezvous at {where} does not hold this round's token: it is not the trainer that "
                    f"issued this init_info (or the init_info is stale)"
                )
            channel.send({"proof": _proof(token, "client", client_nonce, str(server_nonce))}, timeout=AUTH_TIMEOUT_S)
            if channel.recv(timeout=AUTH_TIMEOUT_S).get("ok") is not True:
                raise TransferError(f"the rendezvous at {where} refused this worker's token")
        except TransferError as exc:
            channel.close()
            if "token" in str(exc):
                raise
            raise TransferError(
                f"the rendezvous at {where} refused this worker ({exc}); the init_info's token is not the "
                f"running trainer's (stale init_info, or another trainer on that port)"
            ) from exc
        return cls(channel, timeout_s)

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
