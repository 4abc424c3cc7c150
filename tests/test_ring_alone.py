"""The ring-alone measurement of ``wtransfer bench sharded``: it must move the round's real
bytes, from the writer that holds each row, to the place one unsharded sender would put them."""

from __future__ import annotations

import torch

from wtransfer._bench.ring_alone import _rows_layout, run_fresh
from wtransfer.engines._packing import plan_buckets

SHAPES = [("a", [7, 3]), ("b", [5]), ("c", [1000, 700]), ("d", [3, 1, 2]), ("e", [2, 4096]), ("f", [])]


def _rows_of(shape: list[int], writers: int) -> list[set[int]]:
    """Element indices each writer holds under Shard(0), as torch.chunk splits the rows."""
    numel = 1
    for dim in shape:
        numel *= dim
    flat = torch.arange(numel).reshape(shape) if shape else torch.arange(1).reshape(())
    if not shape:
        return [{0}] + [set() for _ in range(writers - 1)]
    chunks = flat.chunk(writers, 0)
    return [set(chunks[w].flatten().tolist()) if w < len(chunks) else set() for w in range(writers)]


def test_every_byte_of_every_bucket_is_one_writers_and_goes_where_one_sender_packs_it() -> None:
    writers, bucket_bytes = 3, 1 << 20
    sizes, runs = _rows_layout(SHAPES, "bf16", writers, bucket_bytes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    buckets = plan_buckets(tuple(type("E", (), {"nbytes": n})() for n in sizes), bucket_bytes)  # type: ignore[arg-type]
    assert len(runs) == len(buckets)
    covered = [0] * sum(sizes)
    for bucket, bucket_runs in zip(buckets, runs):
        for writer, at, offset, length in bucket_runs:
            piece = next(p for p in bucket.pieces if p.offset <= offset < p.offset + p.length)
            tensor = piece.index
            # the run's bucket bytes are the piece's, at the same distance into the tensor
            assert at - starts[tensor] - piece.start == offset - piece.offset
            held = _rows_of(SHAPES[tensor][1], writers)[writer]
            for byte in range(at - starts[tensor], at - starts[tensor] + length, 2):  # bf16: 2 bytes an element
                assert byte // 2 in held, (SHAPES[tensor], writer, byte)
            for byte in range(at, at + length):
                covered[byte] += 1
    assert covered == [1] * sum(sizes)


def test_the_ring_alone_runs_with_several_writers_and_checks_where_every_run_went() -> None:
    for writers in (1, 2, 4):
        rate = run_fresh("4096x512,1000x700,64*64", "bf16", writers, 1 << 20, 4, 2)
        assert rate > 0
