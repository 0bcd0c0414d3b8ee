"""The stall judgement (ckptools.storage.Stall) without FUSE: a write in its final sync moves while the
page cache drains, and a save's look at the one in flight judges it as `wait` does."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from pathlib import Path

import pytest

import ckptools.storage.writes as writes
from ckptools.errors import StorageStalledError
from ckptools.storage import moved
from ckptools.write.writer_thread import BackgroundWriter


def _syncing_for(seconds: float):
    """A write that enters its sync at once and stays in it for ``seconds`` (an fsync of slow storage)."""

    def write() -> None:
        moved(syncing=True)
        time.sleep(seconds)
        moved()

    return write


@pytest.mark.parametrize("draining", [True, False])
def test_a_sync_whose_page_cache_drains_is_moving_for_the_look_and_for_wait_alike(monkeypatch, draining):
    """Bound 1 s, a sync of 3.5 s: while the kernel's dirty bytes go down it is not idle, for the skip's look
    (`BackgroundWriter.idle`) and for `join` (which waits it out); with nothing draining both call it stuck
    after the bound and `join` gives it up with a StorageStalledError (before 0.5 the look used the
    write's own last progress alone and called a draining sync stuck)."""
    monkeypatch.setenv("CKPTOOLS_STALL_TIMEOUT", "1")
    dirty = itertools.count(10**12, -(1 << 20)) if draining else itertools.repeat(10**9)
    lock = threading.Lock()

    def meminfo() -> int:
        with lock:
            return next(dirty)

    monkeypatch.setattr(writes, "_draining", meminfo)
    writer = BackgroundWriter("ckptools-test-sync")
    writer.start("/tmp/draining.pt", _syncing_for(3.5))
    looks = []
    for _ in range(5):
        time.sleep(0.4)
        looks.append(writer.idle())
    started = time.monotonic()
    writer.join()
    if draining:
        assert max(looks) < 1.0, looks
        assert writer.error is None and time.monotonic() - started > 0.5  # waited out, not given up
    else:
        assert looks[-1] > 1.0, looks
        assert isinstance(writer.error, StorageStalledError), writer.error
        assert "made no progress" in str(writer.error)


def test_a_warning_from_a_watched_read_names_the_callers_line(tmp_path):
    """The restore's choice runs in a watched thread (a stuck storage is an error within the bound): its
    warnings (here: the newest checkpoint damaged, skipped) still name the user's line, not threading's."""
    import warnings

    import torch

    import ckptools as ck

    manager = ck.CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        manager.save({"w": torch.full((1000,), float(step))}, step)
    newest = Path(manager.path_for(2))
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor's bytes
    newest.write_bytes(bytes(data))
    target = {"w": torch.zeros(1000)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        restored = manager.restore(target)
    assert restored is not None and torch.equal(target["w"], torch.full((1000,), 1.0))  # step 1 restored
    said = [(w.filename, w.lineno) for w in caught if "skipping damaged checkpoint" in str(w.message)]
    assert said == [(__file__, line)], [(w.filename, w.lineno, str(w.message)) for w in caught]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task/TID: Linux")
def test_a_thread_reading_a_mapped_cached_file_is_seen_moving(tmp_path):
    """A watched read of a mapped file whose pages the page cache (or node memory) holds reads by minor
    page faults alone, no system call and no major fault: `thread_io` counts them, so a long check of
    such a file (`ck.load(verify=True)` checksums the load's own mapping) is progress, not a stall."""
    import mmap

    from ckptools.storage.processes import thread_io

    path = tmp_path / "cached.bin"
    path.write_bytes(b"\1" * (64 << 20))  # in the page cache now
    ready, go, done, leave = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def read_mapped() -> None:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            ready.set()
            go.wait()
            assert sum(m[i] for i in range(0, len(m), mmap.PAGESIZE)) == len(m) // mmap.PAGESIZE  # every page
            done.set()
            leave.wait()

    thread = threading.Thread(target=read_mapped)
    thread.start()
    try:
        assert ready.wait(30)
        before = thread_io(thread.native_id)
        go.set()
        assert done.wait(30)
        after = thread_io(thread.native_id)
    finally:
        go.set()
        leave.set()
        thread.join()
    assert before is not None and after is not None
    # Counted, though the thread made no system call: its faults (a few with large folios, one per 2 MiB).
    assert after > before
