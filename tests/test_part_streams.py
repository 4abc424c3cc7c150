"""Every trainer rank streaming its own bytes of each bucket rebuilds exactly the unsharded buckets.

No processes here: parts are cut from whole tensors the way ``Shard(0)``, ``Shard(1)`` and
``Shard(1)`` of a 3-D tensor cut them (uneven, one rank empty, a plain tensor rank 0 sends), each
rank's stream for every bucket is built as a sender builds it (``pack_runs``), and a worker's
side puts it back: in place where the layout says the bytes are contiguous in the bucket, else
through scratch (``place_runs``), into the bucket or straight into each tensor's bytes (a loader
with destinations). The buckets must equal ``Packer``'s byte for byte, or the tensors the
originals, with buckets
small enough that tensors split mid-row. The real transport is covered over gloo with FSDP2 in
``test_sharded_trainers.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from wtransfer.engines.rounds.manifest import build_manifest, entry_for  # noqa: E402
from wtransfer.engines.rounds.packing import Packer, plan_buckets  # noqa: E402
from wtransfer.engines.rounds.part_streams import (  # noqa: E402
    RankLayout,
    check_tiling,
    in_place,
    layout_rows,
    pack_runs,
    place_runs,
    receive_plan,
)
from wtransfer.engines.rounds.shards import LocalPart  # noqa: E402
from wtransfer.errors import TransferError  # noqa: E402

RANKS = 3


def _cut(tensor: torch.Tensor, dim: int, rank: int) -> LocalPart | None:
    """Rank ``rank``'s part of ``tensor`` sharded along ``dim`` as torch.chunk splits it."""
    chunks = torch.chunk(tensor, RANKS, dim=dim)
    if rank >= len(chunks) or chunks[rank].numel() == 0:
        return None
    start = sum(c.shape[dim] for c in chunks[:rank])
    rows = int(torch.tensor(tensor.shape[:dim]).prod()) if dim else 1
    inner = int(torch.tensor(tensor.shape[dim + 1 :]).prod()) if dim + 1 < tensor.dim() else 1
    size = chunks[rank].shape[dim]
    local = chunks[rank].contiguous().reshape(rows, size * inner)
    return LocalPart(rows, tensor.shape[dim] * inner, start * inner, (start + size) * inner, local)


def _whole(rank: int, tensor: torch.Tensor) -> LocalPart | None:
    return LocalPart(1, tensor.numel(), 0, tensor.numel(), tensor.reshape(1, -1)) if rank == 0 else None


def _tensors() -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    generator = torch.Generator().manual_seed(3)

    def value(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    tensors = {"rows": value(37, 24), "columns": value(40, 19, dtype=torch.float32), "middle": value(3, 11, 6),
               "few_rows": value(2, 300), "plain": value(64, 8), "large_rows": value(300, 64)}
    dims = {"rows": 0, "columns": 1, "middle": 1, "few_rows": 0, "plain": None, "large_rows": 0}
    return tensors, dims


def _parts(rank: int) -> list[LocalPart | None]:
    tensors, dims = _tensors()
    return [_whole(rank, t) if dims[n] is None else _cut(t, dims[n], rank) for n, t in tensors.items()]


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_streamed_parts_placed_by_a_worker_equal_the_packed_buckets(bucket_bytes: int) -> None:
    tensors, _ = _tensors()
    manifest = build_manifest([entry_for(n, t) for n, t in tensors.items()], 1)
    buckets = plan_buckets(manifest.entries, bucket_bytes)
    parts = [_parts(rank) for rank in range(RANKS)]
    layouts = [RankLayout(manifest.entries, layout_rows(p)) for p in parts]
    check_tiling(layouts)
    packer = Packer(manifest, iter(tensors.items()))
    in_place = scattered = 0
    for bucket in buckets:
        expected = torch.zeros(bucket_bytes, dtype=torch.uint8)
        packer.pack(bucket, expected)
        data = torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8)  # stale bytes of an earlier bucket
        for sender, runs, offset in receive_plan(layouts, bucket):
            sent = pack_runs(runs, parts[sender], torch.empty(bucket_bytes, dtype=torch.uint8)).clone()
            if offset is not None:
                data[offset : offset + sent.numel()] = sent
                in_place += 1
            else:
                place_runs(runs, sent, data)
                scattered += 1
        for piece in bucket.pieces:  # the alignment gaps between pieces carry nothing
            got, want = (b[piece.offset : piece.offset + piece.length] for b in (data, expected))
            assert torch.equal(got, want), f"bucket {bucket.index}: {manifest.entries[piece.index].name} differs"
    assert scattered and (in_place or len(buckets) == 1)  # small buckets exercise both ways of receiving


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_streamed_parts_placed_straight_into_the_tensors_equal_them(bucket_bytes: int) -> None:
    """A worker whose loader offers every tensor's destination skips the bucket."""
    tensors, _ = _tensors()
    manifest = build_manifest([entry_for(n, t) for n, t in tensors.items()], 1)
    parts = [_parts(rank) for rank in range(RANKS)]
    layouts = [RankLayout(manifest.entries, layout_rows(p)) for p in parts]
    received = {name: torch.full_like(t, 3) for name, t in tensors.items()}  # stale values
    targets = [r.view(-1).view(torch.uint8) for r in received.values()]
    ways, buckets = set(), plan_buckets(manifest.entries, bucket_bytes)
    for bucket in buckets:
        for sender, runs, offset in receive_plan(layouts, bucket):
            sent = pack_runs(runs, parts[sender], torch.empty(bucket_bytes, dtype=torch.uint8)).clone()
            if offset is not None:
                in_place(runs, offset, targets=targets).copy_(sent)
            else:
                place_runs(runs, sent, targets=targets)
            ways.add(offset is None)
    for name, tensor in tensors.items():
        assert torch.equal(received[name], tensor), f"{name} differs"
    assert True in ways and (False in ways or len(buckets) == 1)  # small buckets exercise both ways


def test_layouts_that_overlap_or_leave_a_gap_are_refused_before_any_byte_moves() -> None:
    tensors, _ = _tensors()
    manifest = build_manifest([entry_for(n, t) for n, t in tensors.items()], 1)
    parts = [_parts(rank) for rank in range(RANKS)]
    layouts = [RankLayout(manifest.entries, layout_rows(p)) for p in parts]
    with pytest.raises(TransferError, match="sent by two trainer ranks"):
        check_tiling([*layouts, layouts[1]])  # an HSDP replica that sends too
    with pytest.raises(TransferError, match="sent by no"):
        check_tiling(layouts[:2])  # a rank's bytes missing
    words = layout_rows(parts[0])
    words[0] = 5  # rows that do not divide the tensor
    with pytest.raises(TransferError, match="rows=5"):
        RankLayout(manifest.entries, words)
