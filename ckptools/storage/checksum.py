"""CRC-32 (zip's, zlib's): the one function every checksum here goes through.

ISA-L's (the ``isal`` package, a dependency where it ships wheels) computes the same value as
`zlib.crc32` about seven times faster (27 against 4 GB/s on this project's CI machine, faster than a
memory copy), and releases the GIL as zlib does. That matters most for a snapshot's commit, which
checksums the whole state in the background of every step, on a core the step may need.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

__all__ = ["FAST_CRC32", "crc32"]

_crc32: Callable[[Any, int], int]
try:  # a platform without isal's wheels installs ckptools without it
    from isal.isal_zlib import crc32 as _crc32

    FAST_CRC32 = True  # for the benchmarks' reports: which implementation was measured
except ImportError:  # pragma: no cover - exercised where isal is absent
    _crc32 = zlib.crc32
    FAST_CRC32 = False


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of ``data`` (any buffer: bytes, memoryview, ndarray), continuing from ``value``.

    Example: ``crc32(b"hello") == zlib.crc32(b"hello")``; ``crc32(b"lo", crc32(b"hel"))`` too.
    """
    return _crc32(data, value)
