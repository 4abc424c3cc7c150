"""Per-tensor digests of a round, computed while its bytes move, on a core of their own.

With ``checksums=True`` the trainer hashes every tensor's bytes as it packs them and sends the digests
after the data; each worker hashes what it unpacks and compares before the round can commit. Hashing runs
on a helper thread (XXH3 releases the GIL), costing a second core's time, not the round's.

The helper reads buffers the transport reuses: every job names its buffer, and
:meth:`RoundDigests.fence` must be called before a buffer is written again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from wtransfer.errors import TransferError

if TYPE_CHECKING:
    import torch


def combine(values: list[int]) -> int:
    """One digest for a tensor sent in parts by several ranks: XXH3 of their digests, in rank order."""
    if len(values) == 1:
        return values[0]
    import xxhash

    return int(xxhash.xxh3_64_intdigest(b"".join(v.to_bytes(8, "little") for v in values)))


class RoundDigests:
    """XXH3-64 of each key's bytes, fed in order (``update``), hashed on one helper thread."""

    def __init__(self, keys: int) -> None:
        import xxhash

        self._states = [xxhash.xxh3_64() for _ in range(keys)]
        self._jobs: queue.SimpleQueue[tuple[int, Any, int] | None] = queue.SimpleQueue()
        self._pending: dict[int, int] = {}  # buffer -> jobs not done
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="wtransfer-digests", daemon=True)
        self._thread.start()

    def update(self, key: int, data: torch.Tensor, buffer: int = -1) -> None:
        """Hash ``data`` (uint8, contiguous) into ``key``'s digest later: fence ``buffer`` before reusing it
        (-1: memory that stays as it is)."""
        if not data.numel():
            return
        if data.device.type != "cpu":  # a GPU transport's buffer: hashed from a host copy, taken now
            data = data.cpu()
        with self._done:
            self._pending[buffer] = self._pending.get(buffer, 0) + 1
        self._jobs.put((key, data, buffer))

    def update_pieces(self, pieces: Iterable[Any], data: torch.Tensor, buffer: int = -1) -> None:
        """Hash every piece of a bucket (``bucket.pieces``, :class:`wtransfer.engines.rounds.packing.Piece`; their bytes in ``data``) into its
        tensor's digest."""
        for piece in pieces:
            self.update(piece.index, data[piece.offset : piece.offset + piece.length], buffer)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            key, data, buffer = job
            try:
                if self._error is None:
                    self._states[key].update(data.numpy())  # a view: no copy, and the GIL is released
            except BaseException as exc:  # re-raised by fence()/digests() in the caller's thread
                self._error = exc
            finally:
                del data, job
                with self._done:
                    self._pending[buffer] -= 1
                    self._done.notify_all()

    def fence(self, buffer: int) -> None:
        """Wait until nothing still reads ``buffer``."""
        with self._done:
            self._done.wait_for(lambda: not self._pending.get(buffer))
        if self._error is not None:
            raise TransferError(f"hashing the round failed: {self._error}") from self._error

    def digests(self) -> list[int]:
        """Every key's digest, once every job is done; the helper thread then ends."""
        with self._done:
            self._done.wait_for(lambda: not any(self._pending.values()))
        self.close()
        if self._error is not None:
            raise TransferError(f"hashing the round failed: {self._error}") from self._error
        return [state.intdigest() for state in self._states]

    def close(self) -> None:
        """Stop the helper thread (idempotent); a round that failed drops its digests."""
        if self._thread.is_alive():
            self._jobs.put(None)

    def __enter__(self) -> RoundDigests:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def round_digests(keys: int, wanted: bool) -> AbstractContextManager[RoundDigests | None]:
    """``with round_digests(keys, wanted) as digests``: a round's digests, closed when it ends, or None."""
    return RoundDigests(keys) if wanted else nullcontext()


def as_words(values: list[int]) -> list[int]:
    """Unsigned 64-bit digests as signed words (an int64 tensor carries them)."""
    return [v - (1 << 64) if v >= 1 << 63 else v for v in values]


def from_words(words: list[int]) -> list[int]:
    return [w + (1 << 64) if w < 0 else w for w in words]


def check(names: list[str], sent: list[int], received: list[int]) -> None:
    """The trainer's digests against this worker's; raises naming the tensors that differ."""
    if len(sent) != len(received):
        raise TransferError(f"the trainer sent {len(sent)} digests for {len(received)} tensors")
    wrong = [name for name, a, b in zip(names, sent, received) if a != b]
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise TransferError(
            f"checksum mismatch for {', '.join(repr(n) for n in wrong[:3])}{more}: the bytes received differ from "
            f"the bytes the trainer sent (corrupted in transit, or overwritten while in flight); the round is not "
            f"committed where the commit is atomic")
