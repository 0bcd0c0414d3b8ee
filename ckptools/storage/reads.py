"""Reading: a file for torch.load, byte ranges copied or CRC-32-checked, the progress of long copies."""

from __future__ import annotations

import errno
import io
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any

from ..errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError
from .checksum import crc32
from .paths import Location, PathLike, fspath, get_filesystem, is_local
from .private import owner_name

__all__ = ["NODE_MARK", "RANGES_AT_ONCE", "RANGE_BYTES", "copy_range", "crc32_mapped", "crc32_range", "mapped_path",
           "open_for_read", "open_local", "pinned", "progress_hook", "ranged_reads", "report_progress"]  # fmt: skip

_CHUNK = 64 << 20
# The most a local file opened for reading buffers (`open_local`).
READ_BUFFER = 64 << 10


# The file that makes a folder ckptools' node memory (`ckptools.node`: the token of the ranks that share it).
NODE_MARK = ".node"

# Bytes processed by long copies, for the CLI's progress bar; None (the default) costs nothing.
_PROGRESS: ContextVar[Callable[[int], None] | None] = ContextVar("ckptools_progress", default=None)

# What a path names when it is no regular file, for the error that says so.
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def open_local(path: str, *, own: bool = False) -> IO[bytes]:
    """A local regular file opened for reading, once: every read of it goes through this handle
    (the zip reader's, torch's, the mapping of its storages: `mapped_path`), so that nothing read
    comes from another file put at ``path`` meanwhile. The checks are made on the open descriptor
    (``fstat``), never on the path. ``own=True`` (a file this user's job wrote: node memory's) refuses
    a symbolic link (``O_NOFOLLOW``) and a file that belongs to another user.

    A named pipe, a device or a socket is refused at once (it is opened without waiting for a
    writer): a reader would wait forever, or read without end. The buffer is Python's, but at most
    `READ_BUFFER`: Python buffers by the filesystem's block size, 2 MiB on a tmpfs with huge pages and
    4-16 MiB on Lustre or GPFS, and each small read after a seek would fill all of it (a snapshot's
    131 record headers on such a tmpfs: 262 MiB copied, 13 ms).

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        CheckpointFormatError: ``path`` is a directory (readers of folders ask `ckptools.layouts.detect`
            first, and never get here).
        CheckpointLayoutError: ``path`` is a named pipe, a device or a socket; with ``own``, a link or
            another user's file.

    Example: ``with open_local("/tmp/ckpt.pt") as f: magic = f.read(4)``
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    if own:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the path") from err
    except IsADirectoryError as err:  # Windows: a directory cannot be opened
        raise CheckpointFormatError(f"{path} is a directory, not a checkpoint file; name a file inside it") from err
    except OSError as err:
        if own and err.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link (EMLINK: FreeBSD)
            raise CheckpointLayoutError(
                f"{path} is a symbolic link where ckptools wrote a file of its own; it was not followed: remove it"
            ) from err
        raise
    try:
        info = os.fstat(fd)
        kind = stat.S_IFMT(info.st_mode)
        if kind != stat.S_IFREG:
            what = _KINDS.get(kind, "not a regular file")
            if kind == stat.S_IFDIR:
                raise CheckpointFormatError(f"{path} is {what}, not a checkpoint file; name a file inside it")
            raise CheckpointLayoutError(f"{path} is {what}, not a checkpoint file; name a regular file")
        if own and hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise CheckpointLayoutError(
                f"{path} belongs to {owner_name(info.st_uid)}, not to you, where only your own job writes; it was "
                "not read: remove it (its owner or root can)"
            )
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)  # no effect on a regular file's reads; said plainly all the same
        handle = open(fd, "rb", buffering=max(512, min(getattr(info, "st_blksize", READ_BUFFER), READ_BUFFER)))  # noqa: SIM115 - returned
    except BaseException:
        os.close(fd)
        raise
    handle.raw.name = path  # type: ignore[attr-defined]  # messages name the path, not the descriptor
    return handle


def mapped_path(handle: IO[bytes]) -> str | None:
    """A name that opens the very file ``handle`` holds open, for a reader that maps it by name
    (``torch.UntypedStorage.from_file``): ``/proc/self/fd/N`` on Linux, ``/dev/fd/N`` elsewhere. A
    rename or replacement of the file's path since it was opened changes nothing. None where the
    system has neither (the file is then read through ``handle``, not mapped).

    Example: ``with open_local(path) as f: torch.UntypedStorage.from_file(mapped_path(f), False, size)``
    """
    fd = handle.fileno()
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return f"{folder}/{fd}"
    return None


@contextmanager
def pinned(location: Location) -> Iterator[Location]:
    """Within the block, ``location`` (a local file) stands for the file it names now: it is opened
    once (`open_local`; where ``location.own``, only a file of this user's, no link), and the `Location` given
    names that open file (`mapped_path`), so that every reader that opens it again by name, in any
    layer, reads that same file, whatever is put at the path meanwhile. Messages name it as
    ``location`` does. A remote location, or a system with no name for an open file, is given as it is.

    Example: ``with pinned(resolve("/tmp/ckpt.pt")) as location: records = zip_records(location)``
    """
    if not location.local:
        yield location
        return
    handle = open_local(location.path, own=location.own)
    try:
        mapped = mapped_path(handle)
        yield location if mapped is None else Location(location.url, location.fs, mapped)
    finally:
        handle.close()


def open_for_read(path: PathLike, *, own: bool = False) -> tuple[IO[bytes], bool]:
    """An open binary handle on ``path`` and whether it is a local file; the caller closes it.

    A local file is opened once (`open_local`; ``own``, or a `Location` made
    `~ckptools.storage.Location.as_own`, reads only this user's own file, no link): every later read of it,
    torch's and the mapping's included, goes through that handle. A remote file is read whole into
    memory, which is far faster than the many small seeks ``torch.load`` would issue remotely.

    Raises:
        CheckpointNotFoundError: nothing exists at ``path``.
        CheckpointFormatError: ``path`` is a local directory (readers of folders never get here:
            `ckptools.layouts.detect` sends a folder to its layout).
        CheckpointLayoutError: ``path`` is a remote directory (a valid thing of another kind), or a
            local named pipe, device, socket, or (``own``) a link or another user's file.
    """
    own = own or getattr(path, "own", False)
    fs, fpath = get_filesystem(path)
    path = fspath(path)
    if is_local(fs):
        handle = open_local(fpath, own=own)
        if fpath != path:
            handle.raw.name = path  # type: ignore[attr-defined]  # a file:// URL is named as written
        return handle, True
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


def crc32_mapped(mapped: Any, start: int, length: int) -> int:
    """`crc32_range` of bytes already in memory (``mapped``: a buffer, e.g. a file's mapping), in the same
    pieces, each reported as progress; nothing is copied. The range must lie inside ``mapped``."""
    crc = 0
    for piece in range(start, start + length, _CHUNK):
        end = min(start + length, piece + _CHUNK)
        crc = crc32(mapped[piece:end], crc)
        report_progress(end - piece)
    return crc
