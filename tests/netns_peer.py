"""One side of a gloo weight sync across two network namespaces (run by ``test_gloo_hosts.py``).

``python netns_peer.py worker ADDRESS PORT OPTIONS_JSON``: a worker whose control plane is a
plain TCP socket on ADDRESS:PORT (JSON frames), as a serving process on another host has.
``python netns_peer.py trainer MASTER_ADDRESS WORKER_ADDRESS PORT ROUNDS INIT_INFO_JSON``: a
trainer whose client drives that worker over TCP. Both print JSON lines on stdout, which the
test reads (``{"event": ...}``).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

SHAPES = [["embed.weight", [2048, 1024]], ["layer.weight", [1024, 1024]], ["norm.weight", [1024]]]
"""12.6 MB of float32: a round lasts long enough on a throttled link to be cut mid-round."""


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def listeners() -> list[str]:
    """This namespace's listening TCP sockets as "address:port" (IPv4, from /proc)."""
    found = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                hex_address, hex_port = local.split(":")
                octets = [str(int(hex_address[i : i + 2], 16)) for i in (6, 4, 2, 0)]
                found.append(f"{'.'.join(octets)}:{int(hex_port, 16)}")
    return found


def worker(address: str, port: int, options: dict[str, Any]) -> None:
    import wtransfer
    from wtransfer.testing.models import digests, worker_model
    from wtransfer.engines.channel.control import ControlChannel

    model = worker_model(SHAPES, "float32")
    load = wtransfer.module_loader(model)
    engine = wtransfer.WeightTransferEngineFactory.create_engine(
        wtransfer.WeightTransferConfig(backend="gloo", options=options), wtransfer.ParallelConfig()
    )
    server = socket.create_server((address, port))
    say(event="listening")
    conn, _ = server.accept()
    channel = ControlChannel(conn, "the trainer's client")
    while True:
        try:
            request = channel.recv(timeout=600)
        except wtransfer.TransferError:
            break
        op, info = request["op"], request.get("info")
        started = time.monotonic()
        try:
            if op == "init":
                engine.init_transfer_engine(engine.parse_init_info(info))
            elif op == "start":
                engine.start_weight_update()
            elif op == "update":
                say(event="receiving")
                engine.receive_weights(engine.parse_update_info(info), load)
            elif op == "finish":
                engine.finish_weight_update()
            reply = {"ok": True}
        except Exception as exc:
            reply = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            say(event="error", op=op, type=type(exc).__name__, message=str(exc),
                seconds=time.monotonic() - started, weight_version=engine.weight_version)
        reply.update(weight_version=engine.weight_version, digests=digests(model))
        try:
            channel.send(reply)
        except wtransfer.TransferError:
            break
    engine.shutdown()
    say(event="done", weight_version=engine.weight_version)


class TcpClient:
    """The user's own WeightSyncClient: each call is one JSON request to the worker over TCP."""

    def __init__(self, address: str, port: int) -> None:
        from wtransfer.engines.channel.control import ControlChannel

        self.channel = ControlChannel(socket.create_connection((address, port), timeout=30), "the worker")
        self.last: dict[str, Any] = {}

    def call(self, op: str, info: Any = None) -> dict[str, Any]:
        self.channel.send({"op": op, "info": info})
        reply = self.channel.recv(timeout=600)
        self.last = reply
        if not reply["ok"]:
            raise RuntimeError(f"worker: {reply['type']}: {reply['message']}")
        return reply

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init", init_info)

    def start_weight_update(self) -> None:
        self.call("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        say(event="round_running", listeners=listeners())
        self.call("update", update_info)

    def finish_weight_update(self) -> None:
        self.call("finish")


def trainer(master_address: str, worker_address: str, port: int, rounds: int, init_info: dict[str, Any]) -> None:
    import wtransfer
    from wtransfer.testing.models import build_model, digests, mutate

    model = build_model(SHAPES, "float32", random=True, seed=7)
    client = TcpClient(worker_address, port)
    init_info = {"world_size": 2, "master_address": master_address, **init_info}
    started = time.monotonic()
    try:
        trainer = wtransfer.create_trainer("gloo", client=client, source=model, init_info=init_info)
    except Exception as exc:
        say(event="error", op="create_trainer", type=type(exc).__name__, message=str(exc),
            seconds=time.monotonic() - started)
        return
    with trainer:
        for index in range(rounds):
            mutate(model, index)
            started = time.monotonic()
            try:
                stats = trainer.send_weights()
            except Exception as exc:
                say(event="error", op="send_weights", type=type(exc).__name__, message=str(exc),
                    seconds=time.monotonic() - started, weight_version=client.last.get("weight_version"))
                return
            say(event="round", version=stats["version"], seconds=stats["seconds"],
                trainer_digests=digests(model), worker_digests=client.last["digests"],
                worker_version=client.last["weight_version"])
    say(event="done")


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "worker":
        worker(args[0], int(args[1]), json.loads(args[2]))
    else:
        trainer(args[0], args[1], int(args[2]), int(args[3]), json.loads(args[4]))
