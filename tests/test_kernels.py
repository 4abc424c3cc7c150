"""The compiled helpers (``wtransfer/engines/rounds/_kernels.c``) against what numpy computes, element for element:
a delta round's one-pass gathering (trainer) and patching (worker), and the copies past the caches."""

from __future__ import annotations

from typing import Any

import pytest

numpy = pytest.importorskip("numpy")

from wtransfer.engines.rounds.kernels import compiled  # noqa: E402
from wtransfer.engines.rounds.manifest import POSITION_BLOCK  # noqa: E402

DTYPES = ["uint8", "int16", "int32", "int64"]  # the integer views of 1-, 2-, 4- and 8-byte elements
N = 3 * POSITION_BLOCK + 13  # a short last block, and a tail shorter than 8 bytes for every size


@pytest.fixture
def kernel() -> Any:
    built = compiled()
    assert built is not None, ("wtransfer/engines/rounds/_kernels.c was not built (no C compiler at install?): "
                               "its callers fall back to numpy; reinstall with `pip install -e .` where gcc runs")
    return built


def _changed(dtype: str, seed: int, count: int) -> tuple[Any, Any, Any]:
    """New bits, a base, and the sorted indices where they differ: random ones plus every edge (the first and last
    element, both sides of each block boundary, both sides of an 8-byte word boundary), each with its own bit."""
    rng = numpy.random.default_rng(seed)
    info = numpy.iinfo(dtype)
    new = rng.integers(info.min, info.max, size=N, dtype=dtype, endpoint=True)
    edges = {0, 1, 7, 8, N - 1, N - 2} | {b * POSITION_BLOCK + d for b in range(1, 4) for d in (-1, 0)}
    where = numpy.array(sorted(set(rng.choice(N, count, replace=False).tolist()) | {e for e in edges if e < N}))
    base = new.copy()
    bits = numpy.left_shift(numpy.ones(where.size, dtype=dtype), rng.integers(0, 8 * base.itemsize, where.size,
                                                                               dtype=dtype))
    base[where] ^= bits  # one bit each, the sign bit included
    return new, base, where


def _expected(new: Any, where: Any) -> tuple[Any, Any, Any]:
    blocks = -(-new.size // POSITION_BLOCK)
    return new[where], (where & 0xFFFF).astype(numpy.uint16), numpy.bincount(where >> 16, minlength=blocks)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [0, 3000, N], ids=["none-but-edges", "few", "all"])
def test_gather_finds_exactly_the_elements_numpy_finds_chunk_by_chunk(kernel: Any, dtype: str, count: int) -> None:
    new, base, where = _changed(dtype, seed=count, count=min(count, N))
    before = base.copy()
    blocks = -(-N // POSITION_BLOCK)
    counts = numpy.zeros(blocks, dtype=numpy.uint32)
    values, lows = [], []
    cuts = [0, 5, POSITION_BLOCK + 3, 2 * POSITION_BLOCK, N]  # chunks that start mid-word and mid-block
    for begin, end in zip(cuts, cuts[1:]):
        out_values = numpy.full(end - begin, 0x55, dtype=dtype)
        out_lows = numpy.full(end - begin, 0x55, dtype=numpy.uint16)
        found = kernel.gather(new[begin:end], base[begin:end], out_values, out_lows, counts, new.itemsize, begin)
        values.append(out_values[:found])
        lows.append(out_lows[:found])
    want_values, want_lows, want_counts = _expected(new, where)
    numpy.testing.assert_array_equal(numpy.concatenate(values), want_values)
    numpy.testing.assert_array_equal(numpy.concatenate(lows), want_lows)
    numpy.testing.assert_array_equal(counts, want_counts)
    numpy.testing.assert_array_equal(base, before)  # the base is only read


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["from-base", "in-place"])
def test_place_writes_the_payload_over_the_base_span_by_span(kernel: Any, dtype: str, in_place: bool) -> None:
    new, base, where = _changed(dtype, seed=7, count=5000)
    values, lows, counts = _expected(new, where)
    counts = counts.astype(numpy.uint32)
    value = base.copy() if in_place else numpy.zeros_like(base)
    ends = numpy.concatenate([numpy.zeros(1, dtype=numpy.int64), numpy.cumsum(counts, dtype=numpy.int64)])
    for first, last in [(0, 1), (1, 3), (3, 4)]:  # spans of whole blocks; the last one short
        begin, end = first * POSITION_BLOCK, min(N, last * POSITION_BLOCK)
        lo, hi = ends[first], ends[last]
        kernel.place(value[begin:end], None if in_place else base[begin:end], values[lo:hi], lows[lo:hi],
                     counts[first:last], new.itemsize)
    numpy.testing.assert_array_equal(value, new)


def test_place_refuses_a_position_past_its_block_and_sizes_that_do_not_fit(kernel: Any) -> None:
    base = numpy.zeros(POSITION_BLOCK + 10, dtype=numpy.int16)
    value = base.copy()
    counts = numpy.array([0, 1], dtype=numpy.uint32)
    values = numpy.array([7], dtype=numpy.int16)
    with pytest.raises(ValueError, match="past the end of its block"):  # the short last block has 10 elements
        kernel.place(value, base, values, numpy.array([10], dtype=numpy.uint16), counts, 2)
    kernel.place(value, base, values, numpy.array([9], dtype=numpy.uint16), counts, 2)
    assert value[-1] == 7 and not value[:-1].any()
    with pytest.raises(ValueError, match="do not fit"):  # two counted, one value
        kernel.place(value, base, values, numpy.array([9], dtype=numpy.uint16), numpy.array([1, 1], numpy.uint32), 2)
    with pytest.raises(ValueError, match="element size 3"):
        kernel.place(value, base, values, numpy.array([9], dtype=numpy.uint16), counts, 3)
    with pytest.raises(ValueError, match="do not fit"):  # a base of another length
        kernel.place(value, base[:-1], values, numpy.array([9], dtype=numpy.uint16), counts, 2)
    with pytest.raises(ValueError, match="do not fit"):  # a count for one block of two
        kernel.place(value, base, values, numpy.array([9], dtype=numpy.uint16), counts[:1], 2)
    with pytest.raises(ValueError, match="out of range"):
        kernel.gather(base, value, numpy.empty_like(base), numpy.empty(base.size, numpy.uint16), counts, 2, 2**63 - 5)
    with pytest.raises(ValueError, match="too small"):  # room for fewer changes than elements
        kernel.gather(base, value, numpy.empty(4, numpy.int16), numpy.empty(4, numpy.uint16), counts, 2, 0)
    with pytest.raises(ValueError, match="against"):
        kernel.gather(base, value[:-1], numpy.empty_like(base), numpy.empty(base.size, numpy.uint16), counts, 2, 0)


@pytest.mark.parametrize("size", [0, 1, 15, 16, 63, 64, 65, 4095, 1 << 20, (1 << 20) + 37])
def test_stream_copy_copies_every_byte_and_nothing_beside(kernel: Any, size: int) -> None:
    """Every alignment of the destination against the 16-byte stores (an unaligned head, whole 64-byte strides, a
    tail), and sources at odd offsets: exactly the bytes asked for change. On x86-64 the streamed stores must be
    what ran (a plain memcpy would pass the rest of this test too)."""
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        assert kernel.streams == 1, "stream_copy was built without SSE2: its copies do not go past the caches"
    rng = numpy.random.default_rng(size)
    source = rng.integers(0, 256, size + 64, dtype=numpy.uint8)
    for at in (0, 1, 7, 15, 16, 33):
        into = numpy.full(size + 64, 0xA5, dtype=numpy.uint8)
        kernel.stream_copy(into[at : at + size], source[3 : 3 + size])
        numpy.testing.assert_array_equal(into[at : at + size], source[3 : 3 + size])
        assert (into[:at] == 0xA5).all() and (into[at + size :] == 0xA5).all(), f"bytes outside the copy changed at {at}"
    with pytest.raises(ValueError, match="bytes into"):
        kernel.stream_copy(numpy.empty(8, numpy.uint8), source[:9])
    read_only = numpy.zeros(8, dtype=numpy.uint8)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="read-write"):
        kernel.stream_copy(read_only, source[:8])
