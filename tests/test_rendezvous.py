"""The gloo rendezvous leaves nothing behind: a trainer on a fixed port (as behind a firewall) can reconnect, and a
replacement can take the same port, because closing the rendezvous frees it."""

from __future__ import annotations

import socket

import torch

import wtransfer
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.models import build_model, digests

SHAPES = [["a.weight", [64, 64]], ["a.bias", [64]]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_fixed_port_trainer_reconnects_and_a_replacement_takes_the_same_port() -> None:
    """reconnect() of a gloo trainer with a fixed master_port failed with "Address already in use": close() left
    the accept thread blocked in accept(), holding the listening socket. Now the port is free once it returns."""
    port = _free_port()
    model = build_model(SHAPES, "float32", random=True)
    init_info = {"world_size": 3, "timeout_s": 30, "master_address": "127.0.0.1", "master_port": port}
    with LocalWorkerPool(2, "wtransfer.testing.models:worker_model", backend="gloo",
                         factory_kwargs={"shapes": SHAPES, "dtype": "float32"}, timeout_s=30) as pool:
        trainer = wtransfer.create_trainer("gloo", client=pool, source=model, init_info=init_info)
        try:
            assert trainer.send_weights()["version"] == 1
            trainer.reconnect()
            with torch.no_grad():
                model.get_parameter("a.bias").add_(1.0)
            assert trainer.send_weights()["version"] == 2
        finally:
            trainer.shutdown()
        with wtransfer.create_trainer("gloo", client=pool, source=model, init_info=init_info) as replacement:
            with torch.no_grad():
                model.get_parameter("a.weight").add_(1.0)
            assert replacement.send_weights()["version"] == 3
        assert pool.digests() == [digests(model)] * 2
    with socket.socket() as sock:  # nothing listens there any more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
