"""The one door to files: local paths and fsspec URLs (``s3://``, ``memory://``, ...).

Paths stay ``str`` throughout, because a URL run through ``pathlib.Path`` loses its ``//``.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any, Union

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import CheckpointFormatError, CheckpointNotFoundError

_CHUNK = 64 << 20
# Bytes processed by long copies, for the CLI's progress bar; None (the default) costs nothing.
_PROGRESS: ContextVar[Callable[[int], None] | None] = ContextVar("ckptools_progress", default=None)

PathLike = Union[str, "os.PathLike[str]"]

# Temporary files start with "." and carry this marker, so that neither the manager's listing
# nor a user's glob for "*.pt" mistakes a crash leftover for a checkpoint.
TMP_MARKER = ".ckptools-tmp-"


def _fspath(path: PathLike) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"expected a non-empty path or URL string, got {path!r}")
    return path


def get_filesystem(path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path inside it)`` for a local path or any fsspec URL."""
    return fsspec.core.url_to_fs(_fspath(path))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk, where rename and fsync give atomic, durable writes."""
    return isinstance(fs, LocalFileSystem)


def join(directory: PathLike, name: str) -> str:
    """Join a directory path or URL and a file name without mangling the URL."""
    directory = _fspath(directory)
    return directory.rstrip("/") + "/" + name if "://" in directory else os.path.join(directory, name)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (certain FUSE/NFS mounts) refuse fsync on a directory
    finally:
        os.close(fd)


def tmp_name(name: str) -> str:
    """A unique temporary name for ``name`` in the same directory."""
    return f".{name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"


def atomic_write(path: PathLike, write: Callable[[IO[bytes]], Any]) -> str:
    """Write a file so that readers see either the old file or the complete new one.

    Local disk: ``write`` streams into a temporary file in the *target* directory (a rename
    across filesystems, e.g. from $TMPDIR, is not atomic and fails), which is flushed, fsynced,
    renamed over ``path`` with ``os.replace`` and made durable with an fsync of the directory.
    Object stores have no rename, but a single PUT is atomic, so the payload is built in memory
    first and sent in one complete write.

    Args:
        path: destination path or URL.
        write: called once with a binary file object to write into.

    Returns:
        The path as a string.

    Raises:
        OSError: the write failed; the temporary file is removed and ``path`` is untouched.
    """
    path = _fspath(path)
    fs, fpath = get_filesystem(path)
    if not is_local(fs):
        buffer = io.BytesIO()
        write(buffer)
        fs.pipe_file(fpath, buffer.getvalue())
        return path
    directory, name = os.path.split(os.path.abspath(fpath))
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise NotADirectoryError(f"cannot write {path}: {directory} is not a directory")
        os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, tmp_name(name))
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        # BaseException too: a KeyboardInterrupt mid-write must not leave a temp file behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return path


def open_for_read(path: PathLike) -> tuple[Any, bool]:
    """Return something ``torch.load`` can read and whether it is a local path.

    Local files are passed as paths (so ``mmap=True`` works); remote files are read whole into
    memory, which is far faster than the many small seeks ``torch.load`` would issue remotely.

    Raises:
        CheckpointNotFoundError: nothing exists at ``path``.
        CheckpointFormatError: ``path`` is a directory.
    """
    path = _fspath(path)
    fs, fpath = get_filesystem(path)
    if is_local(fs):
        if not os.path.exists(fpath):
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the path")
        if os.path.isdir(fpath):
            raise CheckpointFormatError(f"{path} is a directory, not a checkpoint file; name a file inside it")
        return fpath, True
    try:
        data = fs.cat_file(fpath)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the URL") from err
    except IsADirectoryError as err:
        raise CheckpointFormatError(f"{path} is a directory, not a checkpoint file; name a file inside it") from err
    return io.BytesIO(data), False


def list_files(directory: PathLike) -> list[str]:
    """Names (not paths) of the files directly inside ``directory``; empty if it does not exist."""
    fs, fpath = get_filesystem(directory)
    try:
        entries = fs.ls(fpath, detail=True)
    except FileNotFoundError:
        return []
    return sorted(os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")


def remove(path: PathLike) -> None:
    """Delete one file (missing is fine: another process may have pruned it already)."""
    fs, fpath = get_filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(fpath)


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
        got = handle.readinto(view[: min(length, len(buffer))])
        if not got:
            raise CheckpointFormatError(f"{what} is cut short (truncated file)")
        crc = zlib.crc32(view[:got], crc)
        if out is not None:
            out.write(view[:got])
        length -= got
        report_progress(got)
    return crc
