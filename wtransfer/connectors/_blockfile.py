"""One KV block as one safetensors file: written atomically, checked before a byte reaches the cache.

A standard safetensors file (any reader opens it) holding one tensor ``"kv"`` of shape
``[num_layers, *block_shape]`` (one block of every layer, as its bytes lie in the cache layout) plus string metadata:
the layout, the model fingerprint, the block hash and a checksum of the data. The format is written and read here,
not through ``safetensors.torch``, so bytes go straight between a reused buffer and the file, with no per-block
allocation.

Checks on read, in order, each making the entry a *miss*, never a load: size against the header (truncation),
header and metadata against the expected layout and hash (wrong model, wrong layout, garbage), then the checksum
(bit rot, torn, zeroed or reordered pages). Writes go to a unique temporary name in the same directory and are
renamed into place, so readers see the whole file or nothing.

The checksum (``wsum64``) is two sums over the data as little-endian 64-bit words, modulo 2**64: ``sum(w[i])`` and
``sum((2*i + 1) * w[i])``. A change confined to one word is always caught (odd weights are invertible modulo
2**64), moved or swapped words change the weighted sum, random damage slips through with odds around 2**-64. It
runs at memory speed (faster than CRC-32), so checked loads cost what unchecked ones do. It guards against
accidents, not against an attacker who can write to the store.
"""

from __future__ import annotations

import json
import math
import os
import time
import stat
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from wtransfer.kvcache import KVCacheSpec

FORMAT = "wtransfer-kv-block-v1"
TENSOR_NAME = "kv"
MAX_HEADER_BYTES = 1 << 20
_HEADER_LEN = struct.Struct("<Q")
_TMP_COUNTER = iter(range(1 << 62))
_TMP_LOCK = threading.Lock()

# torch dtype name -> (safetensors dtype code, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
}


BLOCK_SUFFIX = ".safetensors"
"""Every block file's name ends so (one part of a block: ``.<part>of<parts>.safetensors``)."""
CORRUPT_SUFFIX = ".corrupt"
"""Appended to a block file found corrupt: moved aside, never read again, evicted first."""
TMP_SUFFIX = ".tmp"
"""A write in progress: ``<block file>.<pid>.<thread>.<n>.tmp``, renamed to the block file once whole."""


class BlockFileError(Exception):
    """A block file is missing, truncated, corrupt or from another layout; the message says which."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block file of one store must agree on (from the engine's KVCacheSpec)."""

    namespace: str
    model_fingerprint: str
    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    layout: str = "wtransfer"
    """The cache layout's name (:data:`wtransfer.kvcache.KV_LAYOUTS`): fixes the block's shape."""
    shard: int = 0
    num_shards: int = 1
    """Which part of each block this file holds (tensor-parallel workers each hold some heads)."""

    @classmethod
    def for_spec(cls, spec: KVCacheSpec) -> BlockLayout:
        from wtransfer.connectors._hashing import kv_namespace

        return cls(kv_namespace(spec), spec.model_fingerprint, tuple(spec.layer_names), spec.block_size,
                   spec.num_kv_heads, spec.head_size, spec.dtype, spec.layout, spec.shard, spec.num_shards)

    def file_suffix(self) -> str:
        """``.safetensors``, or ``.<shard>of<num_shards>.safetensors`` for one part of a block."""
        return BLOCK_SUFFIX if self.num_shards == 1 else f".{self.shard}of{self.num_shards}{BLOCK_SUFFIX}"

    @cached_property
    def shape(self) -> list[int]:
        from wtransfer.kvcache import KVCacheSpec

        spec = KVCacheSpec(self.layer_names, self.block_size, self.num_kv_heads, self.head_size, self.dtype,
                           self.model_fingerprint, self.layout)
        return [len(self.layer_names), *spec.block_shape]

    @cached_property
    def data_bytes(self) -> int:
        return math.prod(self.shape) * self._dtype_code()[1]

    @cached_property
    def file_bytes(self) -> int:
        """Size of one block file of this layout (header included; hashes are hex sha256)."""
        checksum = block_checksum(memoryview(bytes(self.data_bytes)))
        return _HEADER_LEN.size + len(self.header_bytes("0" * 64, checksum)) + self.data_bytes

    def _dtype_code(self) -> tuple[str, int]:
        try:
            return SAFETENSORS_DTYPES[self.dtype]
        except KeyError:
            raise ValueError(
                f"KV dtype {self.dtype!r} has no safetensors code; supported: {', '.join(SAFETENSORS_DTYPES)}"
            ) from None

    def metadata(self, block_hash: str, checksum: str) -> dict[str, str]:
        return {
            "format": FORMAT,
            "namespace": self.namespace,
            "model_fingerprint": self.model_fingerprint,
            "block_hash": block_hash,
            "layer_names": json.dumps(list(self.layer_names)),
            "block_size": str(self.block_size),
            "num_kv_heads": str(self.num_kv_heads),
            "head_size": str(self.head_size),
            "dtype": self.dtype,
            "layout": self.layout,
            **({"shard": f"{self.shard}/{self.num_shards}"} if self.num_shards != 1 else {}),
            "checksum": checksum,
        }

    def header_bytes(self, block_hash: str, checksum: str) -> bytes:
        header = {
            "__metadata__": self.metadata(block_hash, checksum),
            TENSOR_NAME: {"dtype": self._dtype_code()[0], "shape": self.shape, "data_offsets": [0, self.data_bytes]},
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes


_WEIGHTS: dict[int, object] = {}
_WEIGHTS_LOCK = threading.Lock()
_SCRATCH = threading.local()


def block_checksum(data: memoryview) -> str:
    """``"wsum64:<sum><weighted sum>"`` of ``data`` (see the module docstring); allocation-free after warm-up."""
    import numpy as np

    whole = data.nbytes // 8
    words = np.frombuffer(data, dtype="<u8", count=whole)
    if data.nbytes % 8:  # a last partial word, zero-padded
        tail = bytes(data[whole * 8 :]) + bytes(8 - data.nbytes % 8)
        words = np.concatenate([words, np.frombuffer(tail, dtype="<u8")])
    count = words.size
    weights = _WEIGHTS.get(count)
    if weights is None:
        with _WEIGHTS_LOCK:
            weights = _WEIGHTS.setdefault(count, np.arange(count, dtype=np.uint64) * np.uint64(2) + np.uint64(1))
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None or scratch.size < count:
        scratch = _SCRATCH.buffer = np.empty(count, dtype=np.uint64)
    weighted = scratch[:count]
    np.multiply(words, weights, out=weighted)
    plain_sum = int(np.add.reduce(words, dtype=np.uint64))
    weighted_sum = int(np.add.reduce(weighted, dtype=np.uint64))
    return f"wsum64:{plain_sum:016x}{weighted_sum:016x}"


def write_block_file(
    path: str, layout: BlockLayout, block_hash: str, payload: memoryview, *, fsync: bool = False
) -> int:
    """Write ``payload`` (the ``layout.shape`` tensor's bytes) to ``path`` atomically; return bytes written."""
    payload = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
    if payload.nbytes != layout.data_bytes:
        raise ValueError(f"block data has {payload.nbytes} bytes, the layout needs {layout.data_bytes}")
    header = layout.header_bytes(block_hash, block_checksum(payload))
    with _TMP_LOCK:
        serial = next(_TMP_COUNTER)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{serial}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb", buffering=0) as handle:
            handle.write(_HEADER_LEN.pack(len(header)))
            handle.write(header)
            handle.write(payload)
            if fsync:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return _HEADER_LEN.size + len(header) + payload.nbytes


def _parse_header(raw: bytes, path: str) -> dict[str, object]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlockFileError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BlockFileError(f"{path}: header is not a JSON object")
    return header


def _expect(actual: object, expected: object, what: str, path: str) -> None:
    if actual != expected:
        raise BlockFileError(f"{path}: {what} is {actual!r}, expected {expected!r}")


def open_regular(path: str) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file, without ever blocking.

    A plain ``open`` of a FIFO blocks until a writer appears, and a device node reads without end: anyone who can
    write into a shared store could stall every engine. ``O_NONBLOCK`` makes the open return at once, and ``fstat``
    on the descriptor (not the name, which could be swapped) refuses anything but a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                    stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}.get(stat.S_IFMT(mode), "not a file")
            raise BlockFileError(f"{path}: is {kind}, not a regular file")
        os.set_blocking(fd, True)  # a regular file: plain reads from here on
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def check_header(path: str, layout: BlockLayout, block_hash: str, refresh_s: float | None = None) -> tuple[int, str]:
    """Validate size and header without reading the data; ``(data_offset, checksum)`` or BlockFileError.

    ``refresh_s``: a valid file last modified longer ago gets its mtime set to now (its last use, for eviction),
    through the open file."""
    try:
        with open_regular(path) as handle:
            found = _check_open_header(handle, path, layout, block_hash)
            if refresh_s is not None and os.fstat(handle.fileno()).st_mtime < time.time() - refresh_s:
                try:
                    os.utime(handle.fileno())
                except OSError:
                    pass  # a read-only store: eviction then goes by save time
            return found
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise BlockFileError(f"{path}: cannot read ({exc})") from None


def _check_open_header(handle: object, path: str, layout: BlockLayout, block_hash: str) -> tuple[int, str]:
    size = os.fstat(handle.fileno()).st_size  # type: ignore[attr-defined]
    prefix = handle.read(_HEADER_LEN.size)  # type: ignore[attr-defined]
    if len(prefix) < _HEADER_LEN.size:
        raise BlockFileError(f"{path}: truncated ({size} bytes, no header)")
    (header_len,) = _HEADER_LEN.unpack(prefix)
    if header_len > MAX_HEADER_BYTES or _HEADER_LEN.size + header_len > size:
        raise BlockFileError(f"{path}: truncated or corrupt (header length {header_len}, file {size} bytes)")
    header = _parse_header(handle.read(header_len), path)  # type: ignore[attr-defined]
    meta = header.get("__metadata__")
    if not isinstance(meta, Mapping):
        raise BlockFileError(f"{path}: no wtransfer metadata in the header")
    expected = layout.metadata(block_hash, "")
    for key, value in expected.items():
        if key != "checksum":
            _expect(meta.get(key), value, f"header {key}", path)
    entry = header.get(TENSOR_NAME)
    if not isinstance(entry, Mapping):
        raise BlockFileError(f"{path}: no {TENSOR_NAME!r} tensor in the file")
    _expect(entry.get("dtype"), layout._dtype_code()[0], "tensor dtype", path)
    _expect(list(entry.get("shape", [])), layout.shape, "tensor shape", path)
    _expect(list(entry.get("data_offsets", [])), [0, layout.data_bytes], "tensor data offsets", path)
    data_offset = _HEADER_LEN.size + header_len
    if size != data_offset + layout.data_bytes:
        raise BlockFileError(f"{path}: truncated or padded ({size} bytes, expected {data_offset + layout.data_bytes})")
    checksum = meta.get("checksum")
    if not isinstance(checksum, str) or not checksum.startswith("wsum64:"):
        raise BlockFileError(f"{path}: header checksum {checksum!r} is not a wsum64 checksum")
    return data_offset, checksum


def read_block_file(path: str, layout: BlockLayout, block_hash: str, into: memoryview) -> None:
    """Fill ``into`` (the caller's reused buffer, ``layout.data_bytes`` long) with the block's data once every check
    passed; on BlockFileError its content is undefined."""
    if into.nbytes != layout.data_bytes:
        raise ValueError(f"read buffer has {into.nbytes} bytes, the layout needs {layout.data_bytes}")
    try:
        with open_regular(path) as handle:
            _, expected = _check_open_header(handle, path, layout, block_hash)
            got = 0
            while got < into.nbytes:
                count = handle.readinto(into[got:])
                if not count:
                    raise BlockFileError(f"{path}: truncated while reading ({got} of {into.nbytes} data bytes)")
                got += count
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise BlockFileError(f"{path}: disappeared before it could be loaded") from None
        raise BlockFileError(f"{path}: cannot read ({exc})") from None
    actual = block_checksum(into)
    if actual != expected:
        raise BlockFileError(f"{path}: data checksum mismatch ({actual}, the header says {expected})")
