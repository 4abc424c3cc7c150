"""Every trainer rank streams its own bytes of each bucket to the workers (gloo).

Over a network the ranks cannot share a buffer, so each rank broadcasts, bucket by bucket, the bytes it
holds, on process groups of its own with the workers: each byte leaves the trainer once, nothing is
gathered. Workers place every rank's bytes where one unsharded sender would have packed them, so
staging, the commit and the loaders do not change.

A round starts with each rank's layout: a header (protocol, tensor count, digest of the tensor list) and,
per tensor, the rows and byte columns it holds (:mod:`wtransfer.engines.rounds.shards`' picture). Workers check that the layouts
tile every tensor exactly once before they vote, so a mismatched rank stops the round before any byte
moves. Both sides derive everything else from the layouts and the bucket plan.

A rank's bytes of a one-piece bucket are sent in place; several pieces are packed into a buffer first.
Workers receive contiguous bytes in place, the rest through scratch, placed row by row.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from wtransfer.engines.channel.protocol import PROTOCOL_VERSION
from wtransfer.engines.rounds.manifest import TensorEntry
from wtransfer.engines.rounds.packing import Bucket, Piece, copy_tensor
from wtransfer.engines.rounds.shards import LocalPart, entries_digest, part_range, part_span, place_part
from wtransfer.errors import TransferError

if TYPE_CHECKING:
    import torch

    from wtransfer.engines.rounds.digests import RoundDigests

HEADER_WORDS = 4
"""int64 words of a layout's header: protocol version, tensors, and the tensor list's digest."""


def header(entries: tuple[TensorEntry, ...]) -> list[int]:
    high, low = struct.unpack(">qq", bytes.fromhex(entries_digest(entries)))
    return [PROTOCOL_VERSION, len(entries), high, low]


def layout_rows(parts: list[LocalPart | None]) -> list[int]:
    """``[rows, first, end]`` per tensor, in elements (``0, 0, 0``: this rank sends none of it)."""
    words: list[int] = []
    for part in parts:
        words += [0, 0, 0] if part is None else [part.rows, part.first, part.end]
    return words


@dataclass(frozen=True)
class Run:
    """One rank's bytes of one piece: its part's bytes ``low:high``."""

    piece: Piece
    low: int
    high: int
    width: int  # the part's byte geometry (see shards.part_span)
    first: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.high - self.low

    def contiguous_in_bucket(self) -> int | None:
        """The bucket offset these bytes start at, if they are one contiguous run there."""
        held = self.end - self.first
        row, column = divmod(self.low, held)
        start = row * self.width + self.first + column
        last_row, last_column = divmod(self.high - 1, held)
        stop = last_row * self.width + self.first + last_column + 1
        return self.piece.offset + start - self.piece.start if stop - start == self.nbytes else None


class RankLayout:
    """What one trainer rank holds of every tensor of a round, and so what it sends to each bucket."""

    def __init__(self, entries: tuple[TensorEntry, ...], words: list[int]) -> None:
        self.entries = entries
        self.geometry: list[tuple[int, int, int] | None] = []
        for index, entry in enumerate(entries):
            rows, first, end = words[3 * index : 3 * index + 3]
            if rows == 0:
                self.geometry.append(None)
                continue
            size = entry.nbytes // entry.numel if entry.numel else 0
            width = entry.numel // rows if rows > 0 and entry.numel % rows == 0 else -1
            if width <= 0 or not 0 <= first < end <= width:
                raise TransferError(f"{entry.name!r}: a trainer rank says it holds rows={rows}, columns "
                                    f"{first}:{end} of a {entry.numel}-element tensor")
            self.geometry.append((width * size, first * size, end * size))
        self.rows = [words[3 * i] for i in range(len(entries))]

    def runs(self, bucket: Bucket) -> list[Run]:
        runs = []
        for piece in bucket.pieces:
            geometry = self.geometry[piece.index]
            if geometry is None or not piece.length:
                continue
            low, high = part_span(piece.start, piece.start + piece.length, *geometry)
            if low < high:
                runs.append(Run(piece, low, high, *geometry))
        return runs


def check_tiling(layouts: list[RankLayout]) -> None:
    """Every byte of every tensor is sent by exactly one rank: same rows, column ranges that tile."""
    entries = layouts[0].entries
    for index, entry in enumerate(entries):
        held = [(layout.rows[index], layout.geometry[index]) for layout in layouts
                if layout.geometry[index] is not None]
        if not held:
            if entry.nbytes:
                raise TransferError(f"{entry.name!r}: no trainer rank sends it")
            continue
        if len({rows for rows, _ in held}) != 1:
            raise TransferError(f"{entry.name!r}: the trainer ranks split it along different dimensions")
        columns = sorted((geometry[1], geometry[2]) for _, geometry in held)
        width = held[0][1][0]
        at = 0
        for first, end in columns:
            if first != at:
                raise TransferError(f"{entry.name!r}: bytes {min(first, at)}:{max(first, at)} of each row are "
                                    f"{'sent by two trainer ranks' if first < at else 'sent by none'}")
            at = end
        if at != width:
            raise TransferError(f"{entry.name!r}: bytes {at}:{width} of each row are sent by no trainer rank")


def pack_runs(runs: list[Run], parts: list[LocalPart | None], buffer: torch.Tensor) -> torch.Tensor:
    """The bytes this rank sends for a bucket: in place for one run, else packed into ``buffer``."""
    if len(runs) == 1:
        run = runs[0]
        return part_range(parts[run.piece.index], run.low, run.high)  # type: ignore[arg-type]
    at = 0
    for run in runs:
        copy_tensor(buffer[at : at + run.nbytes], part_range(parts[run.piece.index], run.low, run.high))  # type: ignore[arg-type]
        at += run.nbytes
    return buffer[:at]


def place_runs(runs: list[Run], received: torch.Tensor, data: torch.Tensor | None = None,
               targets: list[torch.Tensor] | None = None) -> None:
    """Put one rank's bytes of a bucket (``received``, as :func:`pack_runs` sent them) into the bucket
    ``data``, or straight into each tensor's bytes ``targets`` (manifest order), saving a copy."""
    at = 0
    for run in runs:
        piece = run.piece
        if targets is not None:
            where = targets[piece.index][piece.start : piece.start + piece.length]
        else:
            assert data is not None
            where = data[piece.offset : piece.offset + piece.length]
        place_part(where, piece.start, run.width, run.first, run.end, received[at : at + run.nbytes])
        at += run.nbytes


def in_place(runs: list[Run], offset: int, data: torch.Tensor | None = None,
             targets: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Where a contiguous stream (bucket ``offset``) is received in place: in ``data``, or in its tensor's
    bytes ``targets`` (one run, so contiguous there too)."""
    nbytes = sum(run.nbytes for run in runs)
    if targets is None:
        assert data is not None
        return data[offset : offset + nbytes]
    piece = runs[0].piece
    start = piece.start + offset - piece.offset
    return targets[piece.index][start : start + nbytes]


def receive_plan(layouts: list[RankLayout], bucket: Bucket) -> list[tuple[int, list[Run], int | None]]:
    """Per sending rank of ``bucket``: (rank, its runs, bucket offset to receive in place or None)."""
    plan = []
    for rank, layout in enumerate(layouts):
        runs = layout.runs(bucket)
        if runs:
            plan.append((rank, runs, runs[0].contiguous_in_bucket() if len(runs) == 1 else None))
    return plan


def scratch_bytes(plans: list[list[tuple[int, list[Run], int | None]]]) -> int:
    """The scratch a worker needs per buffer: the most bytes of one bucket not received in place."""
    return max((sum(run.nbytes for _, runs, at in plan if at is None for run in runs) for plan in plans), default=0)


def hash_runs(digests: RoundDigests, runs: list[Run], sent: torch.Tensor, buffer: int, first_key: int = 0) -> None:
    """Hash one rank's bytes of a bucket (as sent) into each tensor's digest: keys ``first_key + index``."""
    at = 0
    for run in runs:
        digests.update(first_key + run.piece.index, sent[at : at + run.nbytes], buffer)
        at += run.nbytes
