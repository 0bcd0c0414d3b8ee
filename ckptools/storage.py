"""The one door to files: local paths and fsspec URLs (``s3://``, ``memory://``, ...).

Paths stay ``str`` throughout, because a URL run through ``pathlib.Path`` loses its ``//``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import socket
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any, Union, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import in_flight
from .errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError

_CHUNK = 64 << 20
# Bytes processed by long copies, for the CLI's progress bar; None (the default) costs nothing.
_PROGRESS: ContextVar[Callable[[int], None] | None] = ContextVar("ckptools_progress", default=None)

PathLike = Union[str, "os.PathLike[str]"]

# Temporary files start with "." and carry this marker, so that neither the manager's listing
# nor a user's glob for "*.pt" mistakes a crash leftover for a checkpoint.
TMP_MARKER = ".ckptools-tmp-"


class Location:
    """A path or URL resolved once: what was given, its filesystem, and the path inside it.

    Every function here takes a `Location` as readily as a string, and uses its filesystem
    instead of parsing the string again, the way httpx parses a URL once; ``str()`` and
    ``os.fspath()`` give back the path as the user wrote it, so messages name it unchanged.

    Examples:
        >>> loc = resolve("memory://ckpts/step-5.pt")
        >>> loc.url, loc.path, loc.local, loc.name
        ('memory://ckpts/step-5.pt', '/ckpts/step-5.pt', False, 'step-5.pt')
    """

    __slots__ = ("fs", "local", "path", "url")

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.url = url
        self.fs = fs
        self.path = path
        self.local = is_local(fs)

    @property
    def name(self) -> str:
        """The last part of the path (a file's name, a folder's name)."""
        return os.path.basename(self.path.rstrip("/"))

    def child(self, name: str) -> Location:
        """``name`` inside this folder, on the same filesystem: nothing is parsed or resolved again.

        Examples:
            >>> resolve("memory://ckpts").child("step-5.pt").url
            'memory://ckpts/step-5.pt'
        """
        return Location(join(self.url, name), self.fs, self.path.rstrip("/") + "/" + name)

    @property
    def absolute(self) -> Location:
        """The same local place named by its absolute path (what messages about a folder's files
        name); a remote location as it is.

        Examples:
            >>> import os
            >>> resolve("ckpts").absolute.url == os.path.abspath("ckpts")
            True
        """
        return Location(self.path, self.fs, self.path) if self.local else self

    @property
    def parent(self) -> Location:
        """The folder this path is in (``"."`` for a bare local name), on the same filesystem.

        Examples:
            >>> resolve("memory://ckpts/model.safetensors.index.json").parent.path
            '/ckpts'
        """
        url = self.url.rstrip("/")
        return Location(url.rsplit("/", 1)[0] if "/" in url else ".", self.fs, os.path.dirname(self.path.rstrip("/")))

    def __fspath__(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Location({self.url!r})"


def resolve(path: PathLike) -> Location:
    """Resolve a local path or an fsspec URL into a `Location`, once (a `Location` is returned as is).

    A path whose write is in flight in this process (`ckptools.in_flight`) is resolved once that
    write ended: every operation on it sees the file its caller already saved.
    """
    if isinstance(path, Location):
        return path
    url = fspath(path)
    in_flight.wait_for(url)  # a background write of this path in this process ends first
    fs, inner = fsspec.core.url_to_fs(url)
    return Location(url, fs, str(inner))


def fspath(path: PathLike) -> str:
    """``path`` as a non-empty ``str`` (an ``os.PathLike`` is converted; a URL stays as written)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"expected a non-empty path or URL string, got {path!r}")
    return path


def get_filesystem(path: PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path inside it)`` for a local path or any fsspec URL."""
    location = resolve(path)
    return location.fs, location.path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk, where rename and fsync give atomic, durable writes."""
    return isinstance(fs, LocalFileSystem)


def join(directory: PathLike, name: str) -> str:
    """Join a directory path or URL and a file name without mangling the URL."""
    directory = fspath(directory)
    return directory.rstrip("/") + "/" + name if "://" in directory else os.path.join(directory, name)


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (fsync of the directory; skipped where refused)."""
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


# Object stores: one PUT (or one completed multipart upload) makes an object appear whole or
# not at all, and they have no rename; every other fsspec filesystem gets temp name + move.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos"})


def host() -> str:
    """This machine's name as temporary names carry it (`tmp_name`)."""
    # Only characters that survive in a file name on every filesystem and never split the name.
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def tmp_name(name: str) -> str:
    """A unique temporary name for ``name`` in the same directory.

    It names its writer (host and pid), so a later save can tell a dead writer's leftover from
    the file a live writer is still filling (see `ckptools.leftovers.is_abandoned_tmp`).
    """
    return f".{name}{TMP_MARKER}{host()}-{os.getpid()}-{secrets.token_hex(4)}"


def _is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return bool(_OBJECT_STORES.intersection(protocols))


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
    tmp = os.path.join(directory, tmp_name(name))
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


def _streams_multipart(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether writes to ``fs`` go through a multipart upload that is completed only on close()
    and can be aborted with discard(): S3 (s3fs)."""
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
    if streamable and _streams_multipart(fs):
        _stream_upload(fs, fpath, write)
        return
    # Other stores: the payload is built in memory and sent in one complete write.
    buffer = io.BytesIO()
    write(buffer)
    data = buffer.getvalue()
    if _is_object_store(fs):
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
        data = fs.cat_file(fpath)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist; check the URL") from err
    except IsADirectoryError as err:
        raise CheckpointLayoutError(f"{path} is a directory, not a checkpoint file; name a file inside it") from err
    return io.BytesIO(data), False


def list_files(directory: PathLike) -> list[str]:
    """Names (not paths) of the files directly inside ``directory``; empty if it does not exist."""
    fs, fpath = get_filesystem(directory)
    if not is_local(fs):
        # s3fs and friends cache listings; another process (the job's other writer, a restarted
        # run) may have changed the directory since.
        fs.invalidate_cache(fpath)
    try:
        entries = fs.ls(fpath, detail=True)
    except FileNotFoundError:
        return []
    return sorted(os.path.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "file")


def file_size(path: PathLike) -> int:
    """Size in bytes of the file at ``path`` (a stat locally, one metadata request remotely)."""
    fs, fpath = get_filesystem(path)
    return os.path.getsize(fpath) if is_local(fs) else int(fs.size(fpath))


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
        got = handle.readinto(view[: min(length, len(buffer))])  # type: ignore[attr-defined]  # a binary file
        if not got:
            raise CheckpointFormatError(f"{what} is cut short (truncated file)")
        crc = zlib.crc32(view[:got], crc)
        if out is not None:
            out.write(view[:got])
        length -= got
        report_progress(got)
    return crc
