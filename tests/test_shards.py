"""Trainer ranks writing their own shards produce exactly the buckets one unsharded sender packs.

Real DTensors over a real gloo group of 4 processes: row and column shards, uneven and empty
shards, 3-D tensors sharded along the middle dimension, a 2 x 2 HSDP mesh (only the first
replica writes), and plain tensors (rank 0 writes). Every rank writes its parts into zeroed
buckets of a plan with small buckets (so tensors split across buckets mid-row); the buckets are
summed over the ranks (each byte written by exactly one rank) and must equal what ``Packer``
packs from the whole tensors, byte for byte. A layout sharded along two tensor dimensions is
refused with its placements named.
"""

from __future__ import annotations

import json
import multiprocessing
import traceback
from pathlib import Path
from typing import Any

import pytest

from wtransfer._fork_server import worker_process

WORLD = 4


def _layouts_rank(rank: int, store: str, conn: Any) -> None:
    try:
        import datetime

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from wtransfer.engines.rounds.manifest import build_manifest, entry_for
        from wtransfer.engines.rounds.packing import Packer
        from wtransfer.engines.rounds.shards import UnsupportedPlacement, rank_parts, write_part
        from wtransfer.engines.rounds.staging import staging_offsets
        from wtransfer.engines.shm.round import segment_pieces

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        flat = init_device_mesh("cpu", (WORLD,))
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        generator = torch.Generator().manual_seed(7)

        def value(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
            return torch.randn(shape, generator=generator).to(dtype)

        whole = {
            "rows": value(37, 24),              # uneven rows: 10, 10, 10, 7
            "few_rows": value(2, 300),          # two ranks hold nothing
            "columns": value(40, 19, dtype=torch.float32),  # column shards 5, 5, 5, 4
            "middle": value(3, 11, 6),          # Shard(1) of a 3-D tensor
            "vector": value(1000),
            "scalar": value(),
            "plain": value(64, 8),              # not a DTensor: rank 0 writes it
            "hsdp_rows": value(50, 16),         # (Replicate, Shard(0)) on 2 x 2
            "hsdp_cols": value(9, 33),          # (Replicate, Shard(1)) on 2 x 2
            "one_row": value(1, 8),             # (Shard(0), Shard(1)) on 2 x 2: half the ranks hold nothing
        }
        placed = {
            "rows": distribute_tensor(whole["rows"], flat, [Shard(0)]),
            "few_rows": distribute_tensor(whole["few_rows"], flat, [Shard(0)]),
            "columns": distribute_tensor(whole["columns"], flat, [Shard(1)]),
            "middle": distribute_tensor(whole["middle"], flat, [Shard(1)]),
            "vector": distribute_tensor(whole["vector"], flat, [Shard(0)]),
            "scalar": distribute_tensor(whole["scalar"], flat, [Replicate()]),
            "plain": whole["plain"],
            "hsdp_rows": distribute_tensor(whole["hsdp_rows"], hsdp, [Replicate(), Shard(0)]),
            "hsdp_cols": distribute_tensor(whole["hsdp_cols"], hsdp, [Replicate(), Shard(1)]),
            "one_row": distribute_tensor(whole["one_row"], hsdp, [Shard(0), Shard(1)]),
        }
        manifest = build_manifest([entry_for(n, t) for n, t in whole.items()], 1)
        offsets, total = staging_offsets(manifest.entries)  # the staged round, as shm's ranks write it
        mine = torch.zeros(total, dtype=torch.uint8)
        parts = rank_parts(placed.items(), rank, manifest.entries)
        for entry, offset, part in zip(manifest.entries, offsets, parts):
            if part is not None and entry.nbytes:
                write_part(mine[offset : offset + entry.nbytes], 0, part)
        summed = mine.to(torch.int32)
        dist.all_reduce(summed)
        expected = torch.zeros(total, dtype=torch.uint8)  # one unsharded writer
        Packer(manifest, iter(whole.items())).pack_staged(segment_pieces(manifest)[0], expected)
        if not torch.equal(summed, expected.to(torch.int32)):
            wrong = [e.name for e, o in zip(manifest.entries, offsets)
                     if not torch.equal(summed[o : o + e.nbytes], expected[o : o + e.nbytes].to(torch.int32))]
            raise AssertionError(f"the ranks' parts differ from the unsharded round in {wrong} "
                                 f"(max {int(summed.max())}: a byte written twice?)")
        two_dims = distribute_tensor(value(8, 8), hsdp, [Shard(0), Shard(1)])
        try:
            rank_parts([("two_dims", two_dims)], rank)
        except UnsupportedPlacement as exc:
            conn.send_bytes(json.dumps(["ok", str(exc)]).encode())
        else:
            conn.send_bytes(json.dumps(["error", "a box sharded along two dimensions was accepted"]).encode())
        dist.destroy_process_group()
    except BaseException:
        conn.send_bytes(json.dumps(["error", traceback.format_exc()]).encode())


def test_every_rank_writing_its_shards_gives_the_unsharded_round_byte_for_byte(tmp_path: Path) -> None:
    store = str(tmp_path / "rendezvous")  # a file, not a probed port another process may take first
    pipes, processes = [], []
    for rank in range(WORLD):
        mine, theirs = multiprocessing.Pipe(duplex=False)
        process = worker_process(_layouts_rank, (rank, store, theirs), daemon=False)
        process.start()
        pipes.append(mine)
        processes.append(process)
    results = []
    for pipe in pipes:
        assert pipe.poll(120), "a rank sent nothing"
        results.append(json.loads(pipe.recv_bytes()))
    for process in processes:
        process.join(30)
    for status, text in results:
        assert status == "ok", text
        assert "Shard(dim=0), Shard(dim=1)" in text and "two_dims" in text, text


def test_a_plain_tensor_is_written_by_rank_0_only() -> None:
    import torch

    from wtransfer.engines.rounds.shards import local_part

    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    part = local_part("w", tensor, 0)
    assert part is not None and (part.rows, part.width, part.first, part.end) == (1, 12, 0, 12)
    assert local_part("w", tensor, 1) is None


def test_only_a_module_source_that_yields_its_module_as_is_is_written_by_the_ranks() -> None:
    """A subclass that changes what it yields (renames, casts, dies mid-walk) is read as it yields:
    rank 0 gathers. One that only adds behaviour keeps the ranks writing."""
    import torch

    from wtransfer.engines.rounds.shards import writes_shards_as_is
    from wtransfer.engines.rounds.source import ModuleSource

    class Logged(ModuleSource):
        note = "adds nothing to what is sent"

    class Renamed(ModuleSource):
        def __iter__(self):  # type: ignore[no-untyped-def]
            for name, tensor in super().__iter__():
                yield f"model.{name}", tensor

    class Described(ModuleSource):
        def metadata(self):  # type: ignore[no-untyped-def]
            return super().metadata()[:1]

    class Selected(ModuleSource):
        def named_tensors(self):  # type: ignore[no-untyped-def]
            yield from list(super().named_tensors())[:1]

    module = torch.nn.Linear(2, 2)
    assert writes_shards_as_is(ModuleSource(module)) and writes_shards_as_is(Logged(module))
    for changed in (Renamed, Described, Selected):
        assert not writes_shards_as_is(changed(module)), changed.__name__
    assert not writes_shards_as_is({"w": torch.zeros(2)})


def test_ranks_send_their_shards_only_where_the_backend_has_senders() -> None:
    """No sender class (nccl): rank 0 gathers. Checksums no longer force gathers (each rank hashes its part)."""
    import torch

    from wtransfer.engines import gloo, shm
    from wtransfer.engines.rounds.source import ModuleSource
    from wtransfer.engines.trainer.sharded import ranks_can_send as _ranks_can_send

    source = ModuleSource(torch.nn.Linear(2, 2))
    assert _ranks_can_send(shm.SharedMemoryTrainer.sender_cls, source)
    assert _ranks_can_send(gloo.GlooTrainer.sender_cls, source)
    assert not _ranks_can_send(None, source)


def test_a_part_that_is_not_the_rounds_tensor_is_refused() -> None:
    import torch

    from wtransfer.engines.rounds.manifest import TensorEntry
    from wtransfer.errors import TransferError
    from wtransfer.engines.rounds.shards import rank_parts

    named = [("w", torch.zeros(4, 2, dtype=torch.bfloat16))]
    assert rank_parts(named, 0, (TensorEntry("w", "bfloat16", (4, 2)),))[0] is not None
    # another floating dtype is a cast the round planned: the part is written in it
    assert rank_parts(named, 0, (TensorEntry("w", "float32", (4, 2)),))[0].wire == torch.float32
    for entries in [(TensorEntry("w", "int16", (4, 2)),), (TensorEntry("v", "bfloat16", (4, 2)),),
                    (TensorEntry("w", "bfloat16", (4, 3)),)]:
        with pytest.raises(TransferError):
            rank_parts(named, 0, entries)
