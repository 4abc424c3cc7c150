"""GPU tests for the NCCL engine. They skip cleanly on machines without CUDA (CI never has one).

NCCL refuses two ranks on one GPU, so with a single GPU these cover the CUDA-side pieces
(device buffers, per-buffer streams cached across rounds, packing/unpacking on those
streams) and the shared streaming path with CUDA tensors through gloo; a real trainer ->
worker round over NCCL needs two GPUs and the plugin installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from wtransfer import WeightTransferConfig
from wtransfer.testing.distributions import is_installed
from wtransfer.testing.processes import loopback_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1 << 20


def test_buffers_and_streams_live_on_the_device_and_are_cached(engine_module) -> None:
    engine = engine_module.NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"))
    first = engine.allocate(MIB, 3)
    streams = list(engine._streams)
    assert all(b.device.type == "cuda" and b.numel() == MIB for b in first)
    engine.allocate(MIB, 3)
    assert engine._streams == streams and all(a is b for a, b in zip(engine._streams, streams))
    engine.shutdown()
    engine.shutdown()


def test_packing_and_unpacking_on_per_buffer_streams_is_bit_exact(engine_module) -> None:
    from wtransfer.engines import ModuleSource, module_loader
    from wtransfer.engines.wire import Packer, Unpacker, build_manifest, plan_buckets, tensor_checksum
    from wtransfer.testing.models import matrix_model

    source_model = matrix_model(seed=1).cuda()
    target_model = matrix_model(seed=0).cuda()
    source = ModuleSource(source_model)
    manifest = build_manifest(source.metadata(), version=1)
    engine = engine_module.NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"))
    buffers = engine.allocate(MIB, 2)
    packer = Packer(manifest, iter(source))
    unpacker = Unpacker(manifest, module_loader(target_model))
    for bucket in plan_buckets(manifest.entries, MIB):
        slot = bucket.index % len(buffers)
        view = buffers[slot][: bucket.nbytes]
        with engine.slot_stream(slot):
            packer.pack(bucket, view)
        with engine.slot_stream(slot):
            unpacker.unpack(bucket, view)
    packer.drain()
    unpacker.finish()
    engine.synchronize(30.0)
    for (name, a), (_, b) in zip(source_model.named_parameters(), target_model.named_parameters()):
        assert tensor_checksum(a.detach()) == tensor_checksum(b.detach()), name
    engine.shutdown()


def test_gloo_round_with_a_cuda_resident_source() -> None:
    """The shared packed-streaming path (as the NCCL engine runs it) fed by CUDA tensors."""
    from wtransfer.engines import ModuleSource, create_trainer
    from wtransfer.engines.wire import tensor_checksum
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import matrix_model

    model = matrix_model(seed=3).cuda()
    with LocalWorkerPool(1, "wtransfer.testing.models:matrix_model", backend="gloo", timeout_s=60) as pool:
        trainer = create_trainer("gloo", client=pool, source=ModuleSource(model),
                                 init_info={"world_size": pool.world_size, "bucket_bytes": MIB})
        try:
            trainer.send_weights()
            expected = {n: tensor_checksum(p.detach().cpu()) for n, p in model.named_parameters()}
            assert pool.digests()[0] == expected
        finally:
            trainer.shutdown()


@contextmanager
def _nccl_pair() -> Iterator[tuple[torch.nn.Module, Any]]:
    """A trainer model on GPU 0 and one local worker on GPU 1 (its model on the host), over NCCL."""
    if not is_installed("wtransfer-nccl"):
        pytest.skip("pip install ./plugins/wtransfer-nccl first (workers find the engine by its entry point)")
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import matrix_model

    torch.cuda.set_device(0)
    model = matrix_model(seed=5).cuda()
    with LocalWorkerPool(1, "wtransfer.testing.models:matrix_model", backend="nccl",
                         engine_options={"device": 1}, timeout_s=120) as pool:
        yield model, pool


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: trainer and worker")
def test_trainer_and_worker_round_over_nccl() -> None:
    from wtransfer.engines import ModuleSource, create_trainer
    from wtransfer.engines.wire import tensor_checksum

    with _nccl_pair() as (model, pool):
        trainer = create_trainer("nccl", client=pool, source=ModuleSource(model),
                                 init_info={"world_size": pool.world_size, "bucket_bytes": 4 * MIB})
        try:
            for _ in range(3):  # buffers and streams are reused across rounds
                stats = trainer.send_weights()
            expected = {n: tensor_checksum(p.detach().cpu()) for n, p in model.named_parameters()}
            assert pool.digests()[0] == expected
            assert pool.stats()[0]["weight_version"] == 3
            assert stats["bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
        finally:
            trainer.shutdown()


def _nccl_conformance_ready() -> bool:
    return is_installed("wtransfer-nccl") and torch.cuda.is_available() and torch.cuda.device_count() >= 2


from wtransfer.testing.conformance import EngineConformance  # noqa: E402


@pytest.mark.skipif(not _nccl_conformance_ready(), reason="needs 2 GPUs and wtransfer-nccl installed")
class TestNCCLConformance(EngineConformance):
    """The same suite every engine passes; the trainer uses GPU 0, workers spread over the others."""

    engine = "nccl"
    num_workers = 1

    @pytest.fixture
    def engine_options(self):
        return {"device": 1}


def _touch_a_few(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_contiguous():  # the others stay as they were: unchanged tensors
                parameter.data.view(-1).view(torch.uint8)[::997].bitwise_xor_(1)  # 0.1 % of the bytes, any dtype


def _delta_rounds(backend: str, model: torch.nn.Module, pool, **init: object) -> None:
    """A full round, then two delta rounds from the CUDA-resident ``model``: bit-exact on the
    worker (a host model), each delta a fraction of the model's bytes on the wire."""
    from wtransfer.engines import ModuleSource, create_trainer
    from wtransfer.engines.wire import tensor_checksum

    trainer = create_trainer(backend, client=pool, source=ModuleSource(model), delta=True,
                             init_info={"world_size": pool.world_size, **init})
    try:
        assert trainer.send_weights()["delta"] == "full"
        for version in (2, 3):
            _touch_a_few(model)
            stats = trainer.send_weights()
            assert stats["delta"] == "delta" and stats["version"] == version, stats
            assert stats["wire_bytes"] < 0.1 * stats["bytes"], stats
            expected = {n: tensor_checksum(p.detach().cpu()) for n, p in model.named_parameters()}
            assert pool.digests()[0] == expected, f"round {version}"
    finally:
        trainer.shutdown()


def test_delta_rounds_from_a_cuda_resident_source_over_gloo() -> None:
    """delta=True with the trainer's model on the GPU: each tensor is copied to the host and encoded
    against the base there; the worker (a host model) rebuilds every round bit-exactly."""
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import matrix_model

    model = matrix_model(seed=3).cuda()
    with LocalWorkerPool(1, "wtransfer.testing.models:matrix_model", backend="gloo", timeout_s=60) as pool:
        _delta_rounds("gloo", model, pool, bucket_bytes=MIB)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: trainer and worker")
def test_delta_rounds_over_nccl() -> None:
    """The same over NCCL: the payloads cross in device buffers, the worker applies them to its
    host model."""
    with _nccl_pair() as (model, pool):
        _delta_rounds("nccl", model, pool, bucket_bytes=4 * MIB)


def _sharded_rank(rank: int, port: int, conn: Any) -> None:
    """One FSDP2 rank of a tied-embedding LM on GPU ``rank`` (NCCL training group); rank 0 also runs
    one worker on GPU 2 (its model on the host). Every rank sends its own shards; rank 0 reports
    whether the worker holds the unsharded state. Any failure is reported, not left to a timeout."""
    import datetime
    import json
    import traceback

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from wtransfer.engines import ModuleSource, create_trainer
    from wtransfer.engines.wire import tensor_checksum
    from wtransfer.local import LocalWorkerPool
    from wtransfer.testing.models import tied_lm

    report: dict[str, Any] = {"rank": rank}
    pool = None
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        model = tied_lm(seed=0).cuda()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if rank == 0:
            pool = LocalWorkerPool(1, "wtransfer.testing.models:tied_lm", backend="nccl",
                                   factory_kwargs={"seed": 1}, engine_options={"device": 2}, timeout_s=120)
        trainer = create_trainer("nccl", client=pool, source=ModuleSource(model), rank=rank,
                                 init_info={"world_size": 2, "bucket_bytes": MIB} if rank == 0 else None)
        rounds = []
        for step in range(2):  # a real optimizer step, then a round, twice
            ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(step)).cuda()
            model(ids).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            stats = trainer.send_weights()
            expected = {n: tensor_checksum(p.full_tensor().detach().cpu()) for n, p in model.named_parameters()}
            rounds.append({"wrote_shards": stats.get("wrote_shards"),
                           "exact": None if pool is None else pool.digests()[0] == expected})
        report["rounds"] = rounds
        trainer.shutdown()
    except BaseException:
        report["error"] = traceback.format_exc()[-3000:]
    finally:
        if pool is not None:
            pool.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.send_bytes(json.dumps(report).encode())


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs: NCCL wants one per rank (2 trainer ranks, 1 worker)")
def test_fsdp2_ranks_each_send_their_own_shards_over_nccl() -> None:
    """FSDP2 over NCCL on 2 GPUs, one worker on a third: every rank sends its own shards (no gather),
    and after each optimizer step the worker holds exactly the unsharded state."""
    import json
    import multiprocessing

    if not is_installed("wtransfer-nccl"):
        pytest.skip("pip install ./plugins/wtransfer-nccl first (workers find the engine by its entry point)")
    port = loopback_port()
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    try:
        for rank in range(2):
            mine, theirs = context.Pipe(duplex=False)
            process = context.Process(target=_sharded_rank, args=(rank, port, theirs))
            process.start()
            theirs.close()
            pipes.append(mine)
            processes.append(process)
        reports = []
        for rank, pipe in enumerate(pipes):
            assert pipe.poll(300), f"trainer rank {rank} sent no report"
            reports.append(json.loads(pipe.recv_bytes()))
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert [r.get("error") for r in reports] == [None, None], reports
    assert [r["wrote_shards"] for r in reports[0]["rounds"]] == [True, True]
    assert [r["exact"] for r in reports[0]["rounds"]] == [True, True]
    assert [r["wrote_shards"] for r in reports[1]["rounds"]] == [True, True]
