"""Vetting a legacy (pre-1.6) torch file before ``torch.load`` reads it, without torch."""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any, cast

from ..errors import CheckpointFormatError, UnsafeCheckpointError
from .dtypes import STORAGE_ITEMSIZE
from .parsed import Global, StorageRef
from .pickles import PickleReader, loads


class _LegacyReader(PickleReader):
    """The strict reader for the pickles of a legacy (pre-1.6) file, noting storage sizes."""

    def __init__(self, data: bytes, path: str, sizes: dict[str, int]) -> None:
        super().__init__(data, path)
        self._sizes = sizes

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type, key, location, numel, view metadata) since torch 0.4.
        if (
            isinstance(pid, tuple)
            and len(pid) == 6
            and pid[0] == "storage"
            and isinstance(pid[1], Global)
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            itemsize = STORAGE_ITEMSIZE.get(pid[1].name, ("", 1))[1]
            key = str(pid[2])
            self._sizes[key] = max(self._sizes.get(key, 0), pid[4] * itemsize)
            return StorageRef(pid[1], key, str(pid[3]), pid[4])
        raise CheckpointFormatError(f"{self._path}: unexpected persistent id {pid!r} in a legacy torch file")


LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class _Bounded:
    """A read-only view of a file whose reads never ask for more bytes than are left.

    ``f.read(n)`` on a real file allocates ``n`` bytes before reading; a pickle opcode can
    claim n = 4 GiB in a 10-byte file.
    """

    def __init__(self, handle: IO[bytes], size: int) -> None:
        self._f, self._size = handle, size

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self._size - self._f.tell())
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def readline(self, limit: int = -1) -> bytes:
        return self._f.readline(limit)


def _next_pickle(handle: IO[bytes], size: int, path: str) -> bytes:
    """The bytes of the pickle starting at the handle's position, after checking it is complete.

    ``pickletools.genops`` walks the opcodes without building anything, so a length that points
    past the end of the file is found before any unpickler allocates it.
    """
    import pickletools

    start = handle.tell()
    try:
        for _ in pickletools.genops(cast(IO[bytes], _Bounded(handle, size))):  # read() and tell() suffice
            pass
    except (ValueError, EOFError, pickle.UnpicklingError, UnicodeDecodeError, OverflowError, struct.error) as err:
        if start == 0 and size == 0:
            raise CheckpointFormatError(
                f"{path} is empty (0 bytes): a save that never finished, or a copy cut short; pick another file"
            ) from err
        if start == 0:
            handle.seek(0)
            first = handle.read(8)
            if first[:1] != b"\x80":  # neither a zip nor a pickle of protocol 2+, as torch writes
                raise CheckpointFormatError(
                    f"{path} is not a torch checkpoint, or is corrupt: it starts with bytes {first.hex(' ')}, "
                    "neither a zip (PK) nor a pickle"
                ) from err
        raise CheckpointFormatError(
            f"{path} is truncated, corrupt or not a torch checkpoint (pickle at byte {start}: {err})"
        ) from err
    end = handle.tell()
    handle.seek(start)
    return handle.read(end - start)


def check_non_zip(handle: IO[bytes], size: int, path: str = "checkpoint") -> None:
    """Vet a non-zip torch file before ``torch.load`` reads it, decoding no tensor data.

    ``torch.load`` unpickles such a file as the legacy (pre-1.6) format: it reads one pickle
    (the magic number) and, if that matches, four more, then allocates every storage at the size
    the pickles claim before reading its bytes. Every pickle it would read is checked to be
    complete, and the storage sizes claimed are checked against the file's size, so a few hostile
    bytes cannot make it allocate gigabytes.

    Raises:
        UnsafeCheckpointError: a pickle names a global outside the allowlist.
        CheckpointFormatError: a pickle is cut short or corrupt, or the storages claimed do not
            fit in the file.
    """
    handle.seek(0)
    sizes: dict[str, int] = {}
    try:
        if loads(_next_pickle(handle, size, path), path) != LEGACY_MAGIC:
            return  # not a torch file: torch.load stops at "invalid magic number"
        for _ in range(2):  # the protocol version, system information
            loads(_next_pickle(handle, size, path), path)
        main = _next_pickle(handle, size, path)
        _LegacyReader(main, path, sizes).load()
        _next_pickle(handle, size, path)  # the storage keys
    except (UnsafeCheckpointError, CheckpointFormatError):
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError, struct.error) as err:  # fmt: skip
        raise CheckpointFormatError(f"{path}: legacy torch file is corrupt ({type(err).__name__}: {err})") from err
    claimed = sum(sizes.values())
    if claimed > size:
        raise CheckpointFormatError(
            f"{path} claims {claimed} bytes of tensor data but holds {size} bytes in all "
            "(truncated or forged legacy torch file); re-save it or pick another file"
        )
