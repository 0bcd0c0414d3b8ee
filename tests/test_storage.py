from __future__ import annotations

import os
import time

import pytest

from ckptools import storage
from ckptools.errors import CheckpointFormatError, CheckpointLayoutError, CheckpointNotFoundError


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    storage.atomic_write(path, lambda f: f.write(b"old"))
    storage.atomic_write(path, lambda f: f.write(b"new contents"))
    assert path.read_bytes() == b"new contents"
    assert os.listdir(path.parent) == ["f.bin"]


def test_failed_write_keeps_old_file_and_no_temp(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"precious")

    def write(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        storage.atomic_write(path, write)
    assert path.read_bytes() == b"precious"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_temp_file_lives_in_target_directory(tmp_path):
    seen = []

    def write(f):
        seen.append(os.path.dirname(f.name))
        f.write(b"x")

    storage.atomic_write(tmp_path / "f.bin", write)
    assert seen == [str(tmp_path)]


def test_parent_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        storage.atomic_write(tmp_path / "file" / "f.bin", lambda f: f.write(b"x"))


def test_memory_filesystem_roundtrip_and_listing():
    url = "memory://storage-test/dir/f.bin"
    storage.atomic_write(url, lambda f: f.write(b"abc"))
    source, local = storage.open_for_read(url)
    with source:
        assert not local and source.read() == b"abc"
    assert storage.list_files("memory://storage-test/dir") == ["f.bin"]
    assert storage.list_files("memory://storage-test/none") == []
    storage.remove(url)
    storage.remove(url)  # already gone is fine
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        storage.open_for_read(url)


def test_open_for_read_errors(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        storage.open_for_read(tmp_path / "nope")
    with pytest.raises(CheckpointFormatError, match="is a directory"):
        storage.open_for_read(tmp_path)


def test_open_local_reads_a_regular_file_once_and_refuses_anything_else(tmp_path):
    """Issue 54: checks on the open descriptor, never on the path. A named pipe is refused at once (an
    open that waited for a writer hung every reader); a file of this user's own job (node memory's)
    is read only if it is no link and this user's."""
    path = tmp_path / "f.pt"
    path.write_bytes(b"PK\x03\x04rest")
    with storage.open_local(str(path)) as f:
        assert f.read(4) == b"PK\x03\x04" and f.name == str(path)
        assert storage.mapped_path(f) in (f"/proc/self/fd/{f.fileno()}", f"/dev/fd/{f.fileno()}", None)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "pipe.pt")
        started = time.monotonic()
        with pytest.raises(CheckpointLayoutError, match="pipe.pt is a named pipe"):
            storage.open_local(str(tmp_path / "pipe.pt"))
        assert time.monotonic() - started < 5
    with pytest.raises(CheckpointFormatError, match="is a directory"):
        storage.open_local(str(tmp_path))
    os.symlink(path, tmp_path / "link.pt")
    with storage.open_local(str(tmp_path / "link.pt")) as f:  # a path the user gave: its link is followed
        assert f.read(2) == b"PK"
    with pytest.raises(CheckpointLayoutError, match="link.pt is a symbolic link"):
        storage.open_local(str(tmp_path / "link.pt"), own=True)
    with pytest.raises(CheckpointLayoutError, match="symbolic link"):
        storage.open_for_read(storage.resolve(str(tmp_path / "link.pt")).as_own())
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # another user's file (only root can make one)
        os.chown(path, 4242, 4242)
        with pytest.raises(CheckpointLayoutError, match="belongs to uid 4242, not to you"):
            storage.open_local(str(path), own=True)
        storage.open_local(str(path)).close()  # a file the user named: whoever's it is


def test_join_keeps_urls():
    assert storage.join("s3://bucket/run/", "a.pt") == "s3://bucket/run/a.pt"
    assert storage.join("memory://x", "a.pt") == "memory://x/a.pt"
    assert storage.join("/tmp/run", "a.pt") == "/tmp/run/a.pt"


def test_copy_range_local_and_buffered_report_progress(tmp_path):
    import io

    data = os.urandom(300_000)
    (tmp_path / "src").write_bytes(data)
    seen = []
    with storage.progress_hook(seen.append), open(tmp_path / "src", "rb") as src:
        with open(tmp_path / "dst", "wb") as dst:
            dst.write(b"head")
            storage.copy_range(src, dst, 1000, 200_000)  # kernel copy between two files
            dst.write(b"tail")
        buffer = io.BytesIO(b"x")
        buffer.seek(0, os.SEEK_END)
        storage.copy_range(src, buffer, 5, 100)  # through a buffer
    assert (tmp_path / "dst").read_bytes() == b"head" + data[1000:201000] + b"tail"
    assert buffer.getvalue() == b"x" + data[5:105]
    assert sum(seen) == 200_100
    with open(tmp_path / "src", "rb") as src, pytest.raises(CheckpointFormatError, match="truncated"):
        storage.copy_range(src, io.BytesIO(), 299_000, 5000)


def test_abandoned_temp_files_are_told_from_live_writers(tmp_path):
    from ckptools.storage import STALE_TMP_SECONDS, is_abandoned_tmp
    from ckptools.storage import host as _host

    def leftover(owner: str, age: float = 0.0):
        path = tmp_path / f".ckpt-0000000001.pt.ckptools-tmp-{owner}-abcd1234"
        path.write_bytes(b"partial")
        stamp = time.time() - age
        os.utime(path, (stamp, stamp))
        return str(path)

    assert not is_abandoned_tmp(leftover(f"{_host()}-{os.getpid()}"))  # this very process is alive
    assert is_abandoned_tmp(leftover(f"{_host()}-{2**22 + 1}"))  # above pid_max: gone
    assert not is_abandoned_tmp(leftover(f"otherhost-{os.getpid()}"))  # another host: wait
    assert is_abandoned_tmp(leftover(f"otherhost-{os.getpid()}", age=STALE_TMP_SECONDS + 60))
    # A live pid that has not touched its file for an hour is a reused pid, not a writer.
    assert is_abandoned_tmp(leftover(f"{_host()}-{os.getpid()}", age=STALE_TMP_SECONDS + 60))


def test_failed_remote_write_leaves_nothing_at_the_target():
    # A filesystem that keeps half of a failed write where it was aimed (sftp, a FUSE mount):
    # ckptools aims it at a temporary name, so the target keeps its old content.
    from _faults import FlakyFileSystem, register_flaky

    register_flaky()
    storage.atomic_write("flaky://w/f.bin", lambda f: f.write(b"old"))
    FlakyFileSystem.fail_after = 10
    try:
        with pytest.raises(OSError, match="connection reset"):
            storage.atomic_write("flaky://w/f.bin", lambda f: f.write(b"x" * 100))
    finally:
        FlakyFileSystem.fail_after = None
    fs, inner = storage.get_filesystem("flaky://w/f.bin")
    assert fs.cat_file(inner) == b"old"
    assert storage.list_files("flaky://w") == ["f.bin"]


def test_crc32_is_zlibs_for_every_buffer_kind_and_continues_from_a_value():
    """Every checksum ckptools writes into a zip is checked by torch and zipfile with zlib's CRC-32."""
    import platform
    import zlib

    import numpy as np
    import torch

    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, size=3 * 1024 * 1024 + 17, dtype=np.uint8)
    for buffer in (data.tobytes(), memoryview(data.tobytes()), data, torch.from_numpy(data).numpy()[5:], b""):
        assert storage.crc32(buffer) == zlib.crc32(buffer)
    head, tail = data[:1000], data[1000:]
    assert storage.crc32(tail, storage.crc32(head)) == zlib.crc32(data)
    # The fast one is a dependency on the machines it ships wheels for: a missing install step is seen here.
    if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
        assert storage.FAST_CRC32
