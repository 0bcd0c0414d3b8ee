"""Reading: a file for torch.load, byte ranges copied or CRC-32-checked, the progress of long copies."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any

from ..errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError
from .checksum import crc32
from .paths import PathLike, fspath, get_filesystem, is_local

__all__ = ["NODE_MARK", "RANGES_AT_ONCE", "RANGE_BYTES", "copy_range", "crc32_range", "open_for_read", "open_headers",
           "own_node_memory", "progress_hook", "ranged_reads", "report_progress"]  # fmt: skip

_CHUNK = 64 << 20
# The most a local file opened to read its headers buffers (`open_headers`).
READ_BUFFER = 64 << 10


# The file that makes a folder ckptools' node memory (`ckptools.node`: the token of the ranks that share it).
NODE_MARK = ".node"

# Bytes processed by long copies, for the CLI's progress bar; None (the default) costs nothing.
_PROGRESS: ContextVar[Callable[[int], None] | None] = ContextVar("ckptools_progress", default=None)


def open_headers(path: str) -> IO[bytes]:
    """A local file opened to read its headers (a zip's records, a safetensors header), buffered as
    Python does but by at most `READ_BUFFER`: Python buffers by the filesystem's block size, 2 MiB on
    a tmpfs with huge pages and 4-16 MiB on Lustre or GPFS, and each small read after a seek would
    fill all of it (a snapshot's 131 record headers on such a tmpfs: 262 MiB copied, 13 ms).

    Example: ``with open_headers("/tmp/ckpt.pt") as f: magic = f.read(4)``
    """
    return open(path, "rb", buffering=max(512, min(os.stat(path).st_blksize, READ_BUFFER)))


def own_node_memory(path: str) -> bool:
    """Whether ``path`` is a file in a ckptools node-memory folder that only this user can write:
    the folder holds `NODE_MARK`, and it and the file belong to this user, writable by no group or
    other user. Such a file was written by this user's job (a snapshot): its reader may trust it as
    it trusts the process's own memory (`ckptools.layouts.torch_io.load_file`).

    Example: ``own_node_memory("/dev/shm/ckptools-1a2b/ckpt-00000040.pt")``
    """
    if not hasattr(os, "geteuid"):
        return False
    me = os.geteuid()
    folder = os.path.dirname(os.path.abspath(path))
    try:
        stats = (os.stat(folder), os.lstat(path), os.lstat(os.path.join(folder, NODE_MARK)))
    except OSError:
        return False
    # lstat: a link in that folder could point anywhere; only the folder itself may be reached through one.
    return all(s.st_uid == me and not s.st_mode & 0o022 for s in stats) and all(
        stat.S_ISREG(s.st_mode) for s in stats[1:]
    )


def open_for_read(path: PathLike) -> tuple[Any, bool]:
    """Return something ``torch.load`` can read and whether it is a local path.

    Local files are passed as paths (so ``mmap=True`` works); remote files are read whole into
    memory, which is far faster than the many small seeks ``torch.load`` would issue remotely.

    Raises:
        CheckpointNotFoundError: nothing exists at ``path``.
        CheckpointFormatError: ``path`` is a local directory (readers of folders never get here:
            `ckptools.layouts.detect` sends a folder to its layout).
        CheckpointLayoutError: ``path`` is a remote directory (a valid thing of another kind).
    """
    fs, fpath = get_filesystem(path)
    path = fspath(path)
    if is_local(fs):
        if not os.path.exists(fpath):
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the path")
        if os.path.isdir(fpath):  # a caller that reads folders asks `layouts.detect` first
            raise CheckpointFormatError(f"{path} is a directory, not a checkpoint file; name a file inside it")
        return fpath, True
    try:
        data = _fetch(fs, fpath)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the URL") from err
    except IsADirectoryError as err:
        raise CheckpointLayoutError(f"{path} is a directory, not a checkpoint file; name a file inside it") from err
    return io.BytesIO(data), False


# A remote file larger than one range is fetched as ranged GETs of RANGE_BYTES, RANGES_AT_ONCE at a
# time (an object store serves each connection at a fraction of what it serves in parallel).
RANGE_BYTES = 16 << 20
RANGES_AT_ONCE = 8


def ranged_reads(fs: Any) -> bool:
    """Whether ``fs`` makes ranged reads concurrently (fsspec's async filesystems: s3fs, gcsfs,
    adlfs, HTTP)."""
    from fsspec.asyn import AsyncFileSystem

    return isinstance(fs, AsyncFileSystem)


def _fetch(fs: Any, fpath: str) -> bytes:
    """A remote file's bytes: one GET, or parallel ranged GETs where the filesystem makes them
    concurrently (`ranged_reads`)."""
    if not ranged_reads(fs):
        return fs.cat_file(fpath)  # type: ignore[no-any-return]
    size = int(fs.size(fpath))
    if size <= RANGE_BYTES:
        return fs.cat_file(fpath)  # type: ignore[no-any-return]
    starts = list(range(0, size, RANGE_BYTES))
    ends = [min(start + RANGE_BYTES, size) for start in starts]
    parts = fs.cat_ranges([fpath] * len(starts), starts, ends, batch_size=RANGES_AT_ONCE, on_error="raise")
    for part in parts:
        report_progress(len(part))
    if sum(len(part) for part in parts) != size:  # changed while it was read
        raise CheckpointFormatError(f"{fpath} changed size while it was read; read it again")
    return b"".join(parts)  # bytes: io.BytesIO reads it without another copy


@contextmanager
def progress_hook(callback: Callable[[int], None]) -> Iterator[None]:
    """Within the block, long copies and checks call ``callback(n_bytes)`` as they go."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def report_progress(n: int) -> None:
    """Tell the current progress hook (if any) that ``n`` more bytes were processed."""
    hook = _PROGRESS.get()
    if hook is not None:
        hook(n)


def copy_range(src: IO[bytes], dst: IO[bytes], start: int, length: int) -> None:
    """Append ``length`` bytes of ``src`` from ``start`` to ``dst``.

    Between two local files the kernel copies them (``copy_file_range``): no byte passes through
    Python. Otherwise (object stores, in-memory files, old kernels) through a buffer.

    Raises:
        CheckpointFormatError: ``src`` ends before ``start + length`` (a truncated file).
    """
    try:
        in_fd, out_fd = src.fileno(), dst.fileno()
        dst.flush()
        while length:
            sent = os.copy_file_range(in_fd, out_fd, min(length, _CHUNK), start)
            if not sent:
                raise CheckpointFormatError(f"{getattr(src, 'name', 'input')} ended early (truncated file)")
            start += sent
            length -= sent
            report_progress(sent)
    except (AttributeError, OSError, ValueError, NotImplementedError, io.UnsupportedOperation):
        pass  # not two local files (or an old kernel): the rest goes through a buffer
    finally:
        if hasattr(dst, "seek"):
            dst.seek(0, os.SEEK_END)  # the kernel moved the fd's offset behind Python's back
    src.seek(start)
    while length:
        chunk = src.read(min(length, _CHUNK))
        if not chunk:
            raise CheckpointFormatError(f"{getattr(src, 'name', 'input')} ended early (truncated file)")
        dst.write(chunk)
        length -= len(chunk)
        report_progress(len(chunk))


def crc32_range(handle: IO[bytes], start: int, length: int, *, what: str, out: IO[bytes] | None = None) -> int:
    """CRC-32 of ``length`` bytes of ``handle`` from ``start``, also written to ``out`` if given.

    Raises:
        CheckpointFormatError: the file ends first (``what`` names the record or tensor).
    """
    buffer = bytearray(min(length, _CHUNK) or 1)
    view = memoryview(buffer)
    handle.seek(start)
    crc = 0
    while length:
        got = handle.readinto(view[: min(length, len(buffer))])  # type: ignore[attr-defined]  # a binary file
        if not got:
            raise CheckpointFormatError(f"{what} is cut short (truncated file)")
        crc = crc32(view[:got], crc)
        if out is not None:
            out.write(view[:got])
        length -= got
        report_progress(got)
    return crc
