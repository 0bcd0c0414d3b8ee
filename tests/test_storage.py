from __future__ import annotations

import os

import pytest

from ckptools import storage
from ckptools.errors import CheckpointFormatError, CheckpointNotFoundError


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
