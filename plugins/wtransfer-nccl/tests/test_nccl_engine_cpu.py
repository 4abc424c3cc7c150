"""The NCCL engine module on a machine without CUDA: importable, and clear about why it cannot run."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from wtransfer.engines import (
    TorchDistributedSender,
    TorchDistributedTrainer,
    TorchDistributedWeightTransferEngine,
    WeightSource,
)
from wtransfer import WeightTransferConfig


def test_reuses_the_core_torch_distributed_engine(engine_module) -> None:
    assert issubclass(engine_module.NCCLWeightTransferEngine, TorchDistributedWeightTransferEngine)
    assert issubclass(engine_module.NCCLTrainer, TorchDistributedTrainer)
    assert engine_module.NCCLWeightTransferEngine.trainer_cls is engine_module.NCCLTrainer
    assert engine_module.NCCLWeightTransferEngine.distributed_backend == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_reason_without_cuda(engine_module) -> None:
    assert "no CUDA device" in engine_module.nccl_unavailable_reason()
    with pytest.raises(engine_module.NCCLUnavailableError, match="'shm'.*'gloo'"):
        engine_module.NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"))


def test_a_sharded_trainers_other_ranks_send_their_own_shards_over_nccl(engine_module) -> None:
    """The NCCL trainer names a sender, so create_trainer() has every FSDP rank send its own shards
    (nothing gathered): wtransfer's torch.distributed sender with the NCCL backend in front."""
    sender = engine_module.NCCLTrainer.sender_cls
    assert sender is engine_module.NCCLSender and issubclass(sender, TorchDistributedSender)
    assert sender.__mro__.index(engine_module.NCCLBackend) < sender.__mro__.index(TorchDistributedSender)
    assert sender.distributed_backend == "nccl" and sender.host_waits is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_sharded_sender_without_cuda_says_why(engine_module) -> None:
    with pytest.raises(engine_module.NCCLUnavailableError, match="sharded sender.*no CUDA device"):
        engine_module.NCCLSender({}, 1, None, 10.0)


class _StallingSource(WeightSource):
    """A trainer that is alive but stops sending: its source blocks after ``after`` tensors."""

    def __init__(self, source, after: int) -> None:
        self.source, self.after = source, after
        self.stalled, self.resume = threading.Event(), threading.Event()

    def metadata(self):
        return self.source.metadata()

    def __iter__(self):
        for index, item in enumerate(self.source):
            if index == self.after:
                self.stalled.set()
                self.resume.wait(120)
            yield item


class _InProcessClient:
    """The worker side called directly from the trainer's client-call thread."""

    def __init__(self, engine, model) -> None:
        from wtransfer import module_loader

        self.engine, self.load = engine, module_loader(model)

    def init_weight_transfer_engine(self, init_info):
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self):
        self.engine.start_weight_update()

    def update_weights(self, update_info):
        self.engine.receive_weights(self.engine.parse_update_info(update_info), self.load)

    def finish_weight_update(self):
        self.engine.finish_weight_update()


def test_polled_waits_end_at_wtransfers_deadline_before_the_transports(engine_module) -> None:
    """The NCCL engine's wait discipline, run over gloo (the part of it a CPU can run).

    NCCL's ``Work.wait()`` does not block the host, so the NCCL backend sets ``host_waits =
    False`` and gives its group a timeout past wtransfer's (``transport_timeout_s``). A worker
    built with exactly those two choices on gloo must raise ``TransferTimeoutError`` when a live
    trainer goes silent, at ``timeout_s``, not at the group's timeout a minute later (where a
    blocking wait would end, and where NCCL's watchdog would kill the process).
    """
    from wtransfer import ParallelConfig, TransferTimeoutError
    from wtransfer.engines import ModuleSource, create_trainer
    from wtransfer.testing.models import matrix_model

    timed_out: list[tuple[float, BaseException]] = []

    class PolledGlooEngine(TorchDistributedWeightTransferEngine):
        host_waits = engine_module.NCCLBackend.host_waits
        transport_timeout_s = engine_module.NCCLBackend.transport_timeout_s

        def wait(self, *args, **kwargs):
            try:
                return super().wait(*args, **kwargs)
            except BaseException as exc:
                timed_out.append((time.monotonic(), exc))
                raise

    timeout_s = 3.0
    assert PolledGlooEngine.host_waits is False
    engine = PolledGlooEngine(WeightTransferConfig(backend="gloo"), ParallelConfig())
    assert engine.transport_timeout_s(timeout_s) >= timeout_s + 60
    target, trained = matrix_model(seed=0), matrix_model(seed=1)
    client = _InProcessClient(engine, target)
    source = _StallingSource(ModuleSource(trained), after=2)
    trainer = create_trainer(
        "gloo", client=client, source=source, commit="streaming",
        init_info={"world_size": 2, "timeout_s": timeout_s, "bucket_bytes": 64 * 1024},
    )
    outcome: list[BaseException] = []

    def send() -> None:
        try:
            trainer.send_weights()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    try:
        sender.start()
        assert source.stalled.wait(30), "the trainer never reached the stall"
        stalled_at = time.monotonic()
        deadline = stalled_at + timeout_s + 30
        while not timed_out and time.monotonic() < deadline:
            time.sleep(0.05)
        # Unblock the trainer now: a gloo group, unlike an aborted NCCL one, is destroyed only once
        # its pending broadcast ends, and the worker's call returns after that.
        source.resume.set()
        assert timed_out, "the worker still waits: its wait is bounded by the transport, not by timeout_s"
        failed_at, error = timed_out[0]
        assert isinstance(error, TransferTimeoutError), error
        assert failed_at - stalled_at < timeout_s + 10
        sender.join(60)
        assert engine.weights_torn  # streaming: some tensors landed before the stall
    finally:
        source.resume.set()
        sender.join(60)
        trainer.shutdown()
        engine.shutdown()
    assert outcome, "the trainer's round must fail too"


class _FailedQuietly:
    """What NCCL's Work is after a peer died, with async error handling off (as this engine
    builds its groups): completed, carrying the error, and ``wait()`` returns without raising.
    A stand-in: NCCL itself cannot run on a machine without GPUs."""

    def is_completed(self) -> bool:
        return True

    def exception(self) -> BaseException:
        return RuntimeError("NCCL error: remote process exited or there was a network error")

    def wait(self) -> bool:
        return True


def test_a_collective_that_completed_with_an_error_is_never_taken_for_a_received_bucket(engine_module) -> None:
    from wtransfer import TransferError

    class PolledGlooEngine(TorchDistributedWeightTransferEngine):
        host_waits = engine_module.NCCLBackend.host_waits

    engine = PolledGlooEngine(WeightTransferConfig(backend="gloo"))
    with pytest.raises(TransferError, match="receiving bucket 3 failed: NCCL error: remote process exited"):
        engine.wait(_FailedQuietly(), "receiving bucket 3", 5.0)
