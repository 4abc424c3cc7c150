"""The compiled helpers (``_kernels.c``, built by ``pip install`` where a C compiler runs) and what runs where they
were not built: delta rounds' one-pass gathering and patching (:mod:`wtransfer.engines.rounds.delta`), and the copies
into a worker's model or staged copy that go past the caches (:func:`copy_out`)."""

from __future__ import annotations

from typing import Any

STREAM_AT_LEAST = 64 << 10
"""Copies of at least this many bytes go past the caches; a smaller one is a plain memcpy (it fills a few lines
that may well be read soon). Chosen, not measured."""


def compiled() -> Any:
    """The compiled helpers, or None where the C extension was not built (installed without a C compiler): every
    caller then takes its numpy path, with the same results."""
    global _COMPILED
    if _COMPILED is False:
        try:
            from wtransfer.engines.rounds import _kernels as kernel
        except ImportError:
            kernel = None
        _COMPILED = kernel
    return _COMPILED


_COMPILED: Any = False


def copy_out(dst: Any, src: Any) -> None:
    """``dst[:] = src`` (numpy byte arrays of one size) where ``dst`` is not read again soon: a worker's model or a
    staged copy, filled from a transport's buffer or the trainer's model. A plain store to memory that is not in the
    cache first reads the line it lands in; the compiled helper's non-temporal stores do not, so the copy moves two
    bytes through memory for each one copied instead of three (a plain memcpy where it was not built)."""
    kernel = compiled()
    if kernel is not None and dst.nbytes >= STREAM_AT_LEAST:
        kernel.stream_copy(dst, src)
    else:
        import numpy

        numpy.copyto(dst, src)
