"""Joining a trainer: the gloo rendezvous frees its port on close (a fixed-port trainer reconnects, a replacement
takes the port), silent connections cannot keep workers out, and a worker takes only init info its trainer made."""

from __future__ import annotations

import socket

import pytest
import torch

import wtransfer
from wtransfer.errors import TransferError
from wtransfer.local import LocalWorkerPool
from wtransfer.testing.models import build_model, digests
from wtransfer.testing.processes import loopback_port

SHAPES = [["a.weight", [64, 64]], ["a.bias", [64]]]


def test_a_fixed_port_trainer_reconnects_and_a_replacement_takes_the_same_port() -> None:
    """reconnect() of a gloo trainer with a fixed master_port failed with "Address already in use": close() left
    the accept thread blocked in accept(), holding the listening socket. Now the port is free once it returns."""
    port = loopback_port()
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


def test_every_worker_joins_while_silent_connections_flood_the_rendezvous() -> None:
    """96 connections that open the rendezvous port and say nothing (a port scanner), opened again whenever the
    trainer drops them, from before the trainer listens until after reconnect(). Before, 16 of them filled every
    handshake slot, the accept loop waited 5 s per connection, and create_trainer failed: "worker rank(s) ... did
    not join within 20 s". Now every worker joins both times and the rounds land bit-exact."""
    import threading
    import time

    port = loopback_port()
    stop = threading.Event()

    def scanner() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.settimeout(None)
                    while not stop.is_set():  # silent until the trainer drops it
                        sock.settimeout(0.5)
                        try:
                            if sock.recv(1) == b"":
                                break
                        except socket.timeout:
                            continue
            except OSError:
                pass
            stop.wait(0.2)

    model = build_model(SHAPES, "float32", random=True)
    init_info = {"world_size": 3, "timeout_s": 20, "master_address": "127.0.0.1", "master_port": port}
    scanners = [threading.Thread(target=scanner, daemon=True) for _ in range(96)]
    for thread in scanners:
        thread.start()
    try:
        with LocalWorkerPool(2, "wtransfer.testing.models:worker_model", backend="gloo",
                             factory_kwargs={"shapes": SHAPES, "dtype": "float32"}, timeout_s=30) as pool:
            started = time.monotonic()
            with wtransfer.create_trainer("gloo", client=pool, source=model, init_info=init_info) as trainer:
                joined_s = time.monotonic() - started
                assert trainer.send_weights()["version"] == 1
                started = time.monotonic()
                trainer.reconnect()
                rejoined_s = time.monotonic() - started
                with torch.no_grad():
                    model.get_parameter("a.bias").add_(1.0)
                assert trainer.send_weights()["version"] == 2
            assert pool.digests() == [digests(model)] * 2
        print(f"under 96 silent connections: joined in {joined_s:.1f} s, rejoined in {rejoined_s:.1f} s")
    finally:
        stop.set()
        for thread in scanners:
            thread.join(5)


class AlteringPool(LocalWorkerPool):
    """A control plane that changes the init_info on its way to the workers."""

    altered: dict = {}

    def init_weight_transfer_engine(self, init_info: dict) -> list:
        return super().init_weight_transfer_engine({**init_info, **self.altered})


@pytest.mark.parametrize("backend,commit,field,value", [
    ("shm", "atomic", "bucket_bytes", 1 << 40), ("shm", "streaming", "num_buffers", 10**6),
    ("gloo", "atomic", "num_buffers", 10**6), ("gloo", "streaming", "bucket_bytes", 1 << 40)])
def test_a_worker_refuses_init_info_its_trainer_did_not_make(backend: str, commit: str, field: str, value: int) -> None:
    """Before, a worker took bucket_bytes=1 TiB or num_buffers=10**6 from its control plane: shm committed the
    atomic round and failed a streaming one with "mmap length is greater than file size". Now it compares its init
    info with what the trainer announced when it joined and refuses by name; the same workers then join an
    unaltered trainer and hold its weights."""
    model = build_model(SHAPES, "float32", random=True)
    with AlteringPool(2, "wtransfer.testing.models:worker_model", backend=backend,
                      factory_kwargs={"shapes": SHAPES, "dtype": "float32"}, timeout_s=30) as pool:
        pool.altered = {field: value}
        before = pool.digests()
        with pytest.raises(TransferError, match=rf"{field}={value} \(the trainer's: \d+\)"):
            with wtransfer.create_trainer(backend, client=pool, source=model, commit=commit,
                                          init_info={"world_size": 3, "timeout_s": 10}) as trainer:
                trainer.send_weights()
        assert [s["weight_version"] for s in pool.stats()] == [0, 0] and pool.digests() == before  # untouched
        pool.altered = {}
        with wtransfer.create_trainer(backend, client=pool, source=model, commit=commit,
                                      init_info={"world_size": 3}) as trainer:
            trainer.send_weights()
        assert pool.digests() == [digests(model)] * 2


def test_a_loopback_port_for_a_later_server_is_one_no_bind_of_port_zero_can_take() -> None:
    """``vllm serve`` died with "Address already in use" on a port probed with bind(0): a neighbour's connection drew
    the same number from the ephemeral range before the server bound it. loopback_port() draws below that range."""
    from pathlib import Path

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.exists():
        pytest.skip("no ip_local_port_range to read: loopback_port() falls back to bind(0) here")
    low = int(ranges.read_text().split()[0])
    if low <= 1024:
        pytest.skip(f"the ephemeral range starts at {low}: there is no port below it to draw")
    port = loopback_port()
    assert 1024 <= port < low
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
