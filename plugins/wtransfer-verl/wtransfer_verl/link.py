"""The control plane between verl's actor rank 0 and its rollout workers: JSON frames over TCP.

verl runs the two sides of a sync at once and gives them nothing to talk through but the metadata
``prepare()`` returns. So the actor listens (on loopback unless told an address), and every rollout
worker connects and proves it holds the listener's token (an HMAC of a fresh nonce each way, so neither
side talks to an impostor; the token travels only inside verl's own metadata). Each wtransfer client call
is then one frame to every worker and one answer back from each.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import selectors
import socket
import time
from typing import Any

from wtransfer.engines.wire import ControlChannel, PeerClosedError
from wtransfer.errors import TransferError, TransferTimeoutError

HANDSHAKE_FRAME = 4 << 10
"""The largest frame a peer may send before it proved the token."""
FRAME = 64 << 20
"""The largest frame afterwards (a round's manifest)."""


def _proof(token: str, side: str, nonce: str) -> str:
    return hmac.new(token.encode(), f"{side}:{nonce}".encode(), hashlib.sha256).hexdigest()


class RolloutLinks:
    """The actor's end: a listener, then one channel per rollout worker; the wtransfer trainer's client."""

    def __init__(self, host: str, timeout_s: float) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"wtransfer-verl: host={host!r} is where rollout workers connect to, so it must be "
                             f"one address of the actor's host that they reach (e.g. its cluster IP), not a wildcard")
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        self._listener = socket.create_server((host, 0))
        self.address = {"host": host, "port": self._listener.getsockname()[1], "token": self.token}
        self.channels: dict[int, ControlChannel] = {}

    def accept(self, count: int) -> None:
        """Take ``count`` authenticated workers (ranks 0..count-1), dropping any that do not prove the token."""
        for channel in self.channels.values():
            channel.close()
        self.channels = {}
        deadline = time.monotonic() + self.timeout_s
        self._listener.settimeout(1.0)
        while len(self.channels) < count:
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"wtransfer-verl: {len(self.channels)} of {count} rollout workers joined within {self.timeout_s:.0f} s "
                    f"(ranks {sorted(self.channels)}); did every rollout worker run init_process_group?")
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            channel = ControlChannel(conn, f"rollout worker at {peer[0]}:{peer[1]}", max_frame=HANDSHAKE_FRAME)
            try:
                nonce = secrets.token_hex(16)
                channel.send({"nonce": nonce}, timeout=5.0)
                hello = channel.recv(5.0)
                rank = hello.get("rank")
                if not hmac.compare_digest(str(hello.get("proof", "")), _proof(self.token, "rollout", nonce)):
                    raise TransferError("did not prove the token")
                if not isinstance(rank, int) or not 0 <= rank < count or rank in self.channels:
                    raise TransferError(f"claimed rank {rank!r} of {count}")
                channel.send({"proof": _proof(self.token, "actor", str(hello.get("nonce", "")))}, timeout=5.0)
            except Exception:
                channel.close()  # a stranger, or a worker of another sync: it never reaches wtransfer
                continue
            channel.max_frame = FRAME
            self.channels[rank] = channel

    def alive(self) -> bool:
        """Whether every worker's connection is still open (a restarted worker closed its own)."""
        with selectors.DefaultSelector() as selector:
            for channel in self.channels.values():
                selector.register(channel.sock, selectors.EVENT_READ)
            if not self.channels:
                return False
            for key, _ in selector.select(timeout=0):
                try:
                    if not key.fileobj.recv(1, socket.MSG_PEEK):  # type: ignore[union-attr]
                        return False
                except OSError:
                    return False
        return True

    # -- the wtransfer trainer's client ------------------------------------------------------------
    def call(self, op: str, info: Any = None) -> list[dict[str, Any]]:
        """Send ``op`` to every worker, then wait (``timeout_s`` in all) for every answer; raise naming each
        worker that failed."""
        deadline = time.monotonic() + self.timeout_s
        for channel in self.channels.values():
            channel.send({"op": op, "info": info}, timeout=self.timeout_s)
        replies, failures = [], []
        for rank, channel in sorted(self.channels.items()):
            try:
                reply = channel.recv(max(0.0, deadline - time.monotonic()))
            except (PeerClosedError, TransferTimeoutError) as exc:
                failures.append(f"rollout worker {rank}: {exc}")
                continue
            if not reply.get("ok"):
                failures.append(f"rollout worker {rank}: {reply.get('error')}")
            replies.append(reply)
        if failures:
            raise TransferError(f"wtransfer-verl: {op} failed: " + "; ".join(failures))
        return replies

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        return self.call("init", init_info)

    def start_weight_update(self) -> list[dict[str, Any]]:
        return self.call("start")

    def update_weights(self, update_info: dict[str, Any]) -> list[dict[str, Any]]:
        return self.call("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> list[dict[str, Any]]:
        return self.call("finish", weight_version)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels = {}
        self._listener.close()


class ActorLink:
    """A rollout worker's end: one authenticated channel to the actor, serving its calls."""

    def __init__(self, address: dict[str, Any], rank: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        peer = f"verl actor at {address['host']}:{address['port']}"
        try:
            sock = socket.create_connection((address["host"], int(address["port"])), timeout=timeout_s)
        except OSError as exc:
            raise TransferError(f"wtransfer-verl: cannot reach the {peer} ({exc}); is the actor's rank 0 running "
                                f"init_process_group?") from exc
        self.channel = ControlChannel(sock, peer, max_frame=HANDSHAKE_FRAME)
        try:
            nonce = secrets.token_hex(16)
            challenge = self.channel.recv(timeout_s)
            self.channel.send({"rank": rank, "nonce": nonce,
                               "proof": _proof(address["token"], "rollout", str(challenge.get("nonce")))})
            answer = self.channel.recv(timeout_s)
            if not hmac.compare_digest(str(answer.get("proof", "")), _proof(address["token"], "actor", nonce)):
                raise TransferError(f"wtransfer-verl: the {peer} did not prove the token; nothing was sent to it")
        except BaseException:
            self.channel.close()
            raise
        self.channel.max_frame = FRAME

    def serve(self, handle: Any, until: str) -> None:
        """Answer the actor's calls with ``handle(op, info)`` until ``until`` succeeded. A call that fails is
        answered with its error and serving goes on: the actor decides (a refused delta round is sent again
        whole); an actor that gives up closes the connection, which ends this with :class:`PeerClosedError`."""
        failed: str | None = None  # this worker's last failed call, named if the actor then goes away
        while True:
            try:
                request = self.channel.recv(self.timeout_s)
            except TransferError as exc:
                if failed is None:
                    raise
                raise TransferError(f"{failed}; then {exc}") from exc
            op = request.get("op")
            try:
                result = handle(op, request.get("info")) or {}
            except Exception as exc:
                failed = f"{op} failed here: {type(exc).__name__}: {exc}"
                try:
                    self.channel.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"}, timeout=self.timeout_s)
                except (OSError, TransferError) as closed:
                    raise TransferError(f"{failed}; then {closed}") from closed
                continue
            self.channel.send({"ok": True, **result}, timeout=self.timeout_s)
            if op == until:
                return

    def close(self) -> None:
        self.channel.close()
