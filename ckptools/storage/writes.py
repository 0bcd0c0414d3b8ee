"""Atomic writes: local (a temporary file, fsync, rename, directory fsync), S3 (a streamed multipart
upload completed last), other object stores (one PUT), other remote filesystems (temporary name, move)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from typing import IO, Any, cast

import fsspec

from .paths import PathLike, fresh_tmp, fspath, fsync_dir, get_filesystem, is_local, is_object_store, tmp_name

__all__ = ["UPLOAD_PART", "atomic_write", "local_target", "publish", "streams_multipart"]


def atomic_write(path: PathLike, write: Callable[[IO[bytes]], Any], *, streamable: bool = False) -> str:
    """Write a file so that readers see either the old file or the complete new one.

    Local disk: ``write`` streams into a temporary file in the *target* directory (a rename
    across filesystems, e.g. from $TMPDIR, is not atomic and fails), which is flushed, fsynced,
    renamed over ``path`` with ``os.replace`` and made durable with an fsync of the directory.
    Object stores have no rename. On S3, when ``streamable`` (``write`` only writes forward, as
    ``torch.save`` does), the payload streams into a multipart upload that is completed only
    once everything is written and aborted on any failure (memory: about two 32 MiB parts);
    otherwise, and on other object stores (gcs, azure, ...), the payload is built in memory and
    sent in one complete write (a single PUT is atomic). Other remote filesystems
    (``memory://``, sftp, hdfs, ...) get the payload under a temporary name in the target
    directory, then a move onto ``path`` (a rename where the filesystem has one), so a write
    that fails midway never leaves a partial file at ``path``.

    Args:
        path: destination path or URL.
        write: called once with a binary file object to write into.
        streamable: ``write`` never seeks (it may then stream into an S3 multipart upload).

    Returns:
        The path as a string.

    Raises:
        OSError: the write failed; the temporary file is removed and ``path`` is untouched.
    """
    fs, fpath = get_filesystem(path)
    path = fspath(path)
    if not is_local(fs):
        _remote_write(fs, fpath, write, streamable=streamable)
        return path
    directory, name = local_target(fpath)
    tmp = fresh_tmp(directory, name)  # a killed earlier write's temporary goes first
    try:
        with open(tmp, "wb") as f:
            recorder = _WriteRecorder(f)
            try:
                write(recorder)  # type: ignore[arg-type]  # a file in all but name
            except Exception as err:
                # torch's zip writer reports a failed write() as "unexpected pos 704 vs 598";
                # the OS error underneath ("File too large", "No space left") is the news.
                if recorder.error is not None and recorder.error is not err:
                    raise recorder.error from err
                raise
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        # BaseException too: a KeyboardInterrupt mid-write must not leave a temp file behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    publish(tmp, directory, name)
    return path


def local_target(path: str) -> tuple[str, str]:
    """The directory a local write of ``path`` goes to (created if missing) and the file's name.

    Raises:
        NotADirectoryError: a file stands where the directory should be.
    """
    directory, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise NotADirectoryError(f"cannot write {path}: {directory} is not a directory")
        os.makedirs(directory, exist_ok=True)
    return directory, name


def publish(tmp: str, directory: str, name: str) -> None:
    """The commit of every local write: rename the complete, fsynced temporary file ``tmp`` over
    ``directory/name`` (atomic), then fsync the directory so that the rename survives a crash.
    The temporary file is removed if the rename fails."""
    try:
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


class _WriteRecorder:
    """A file wrapper that remembers the OSError of a failed ``write`` (see ``atomic_write``)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# Parts of a streamed multipart upload: S3 allows 10,000 parts of at least 5 MiB, so 32 MiB parts
# reach 312 GiB (a larger object needs a larger part size); a writer holds about two parts at once.
UPLOAD_PART = 32 << 20


def streams_multipart(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether writes to ``fs`` go through a multipart upload that is completed only on close()
    and can be aborted with discard(), and whose parts any client may upload: S3 (s3fs)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("s3", "s3a") for p in protocols)


def _stream_upload(fs: fsspec.AbstractFileSystem, fpath: str, write: Callable[[IO[bytes]], Any]) -> None:
    # torch.save writes front to back, so it streams into the upload: parts go out as they fill
    # and memory holds one or two parts, not a copy of the whole checkpoint. The upload is
    # completed only when everything was written: before that the object does not exist (a
    # reader sees the previous one), and on any failure it is aborted. A killed writer leaves an
    # incomplete upload, which S3 never shows as an object (a bucket lifecycle rule reaps those).
    f = fs.open(fpath, "wb", block_size=UPLOAD_PART)
    try:
        write(cast(IO[bytes], _PartSized(f)))  # write() is all torch.save calls
        f.close()  # completes the multipart upload (a small file goes as one PUT)
    except BaseException:
        with contextlib.suppress(Exception):
            f.discard()  # abort the multipart upload
        f.closed = True  # never commit later, from close() or the finaliser
        raise


class _PartSized:
    """Hands a file big writes in part-sized slices: torch writes a whole tensor record at once,
    which s3fs would buffer whole (and copy) before cutting it into parts."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), UPLOAD_PART):
            self._f.write(view[start : start + UPLOAD_PART])
        return len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _remote_write(
    fs: fsspec.AbstractFileSystem, fpath: str, write: Callable[[IO[bytes]], Any], *, streamable: bool
) -> None:
    if streamable and streams_multipart(fs):
        _stream_upload(fs, fpath, write)
        return
    # Other stores: the payload is built in memory and sent in one complete write.
    buffer = io.BytesIO()
    write(buffer)
    data = buffer.getvalue()
    if is_object_store(fs):
        fs.pipe_file(fpath, data)
        return
    parent, _, name = fpath.rpartition("/")
    tmp = f"{parent}/{tmp_name(name)}" if parent else tmp_name(name)
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, fpath)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(tmp)
        raise
