"""Slow and stuck storage (issue 68): the promises re-proved on a FUSE mount whose writes are throttled or
frozen (tests/_slowfs.py). Here: a checkpoint frozen midway moves nothing and prunes nothing until it is
whole; a throttled one is whole when it returns."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from _slowfs import slow_mount, why_not

import ckptools as ck

pytestmark = pytest.mark.skipif(why_not() is not None, reason=f"FUSE: {why_not()}")


RESTORE = """
import sys, torch, ckptools as ck
target = {"w": torch.zeros(1 << 20)}
step = ck.CheckpointManager(sys.argv[1], keep_last=2).restore(target)["step"]
print(step, torch.equal(target["w"], torch.full((1 << 20,), float(step))))
"""


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 20,), float(step)), "step": step}  # 4 MiB


def test_a_save_frozen_midway_moves_nothing_and_prunes_nothing_until_it_is_whole(tmp_path):
    """The storage stops while an async save of step 3 writes (keep_last=2): while it is stuck, the run's
    checkpoints are still steps 1 and 2, whole, the newest is step 2 for a restore in another manager, and
    no file of step 3 is there under its name; thawed, step 3 is whole and only then is step 1 pruned."""
    with slow_mount(tmp_path / "fs") as fs:
        run = fs.path / "run"
        manager = ck.CheckpointManager(run, keep_last=2)
        for step in (1, 2):
            manager.save(_state(step), step)
        fs.freeze()
        manager.save(_state(3), 3, blocking=False)
        time.sleep(1.0)  # the writer is inside a write the storage holds
        assert manager.pending is not None and not manager.pending.done()
        assert [s for s, _ in manager.checkpoints()] == [1, 2]
        assert not (run / os.path.basename(manager.path_for(3))).exists()
        # another process (a relaunch, a reader): this one's loads wait for its own save in flight
        reader = subprocess.run([sys.executable, "-c", RESTORE, str(run)], capture_output=True, text=True, timeout=120)
        assert reader.returncode == 0 and reader.stdout.split() == ["2", "True"], reader.stdout + reader.stderr
        fs.thaw()
        manager.wait()
        assert [s for s, _ in manager.checkpoints()] == [2, 3]
        assert torch.equal(ck.load(manager.path_for(3), verify=True)["w"], _state(3)["w"])
        manager.close()


def test_a_save_to_a_throttled_storage_is_whole_when_it_returns(tmp_path):
    """At 10 MB/s a 4 MiB save takes its time and returns whole: verified, the previous one kept."""
    with slow_mount(tmp_path / "fs") as fs:
        manager = ck.CheckpointManager(fs.path / "run", keep_last=2)
        manager.save(_state(1), 1)
        fs.throttle(10e6)
        started = time.monotonic()
        manager.save(_state(2), 2)
        took = time.monotonic() - started
        assert took >= 0.3, took  # 4 MiB at 10 MB/s: the throttle held the writes
        assert [s for s, _ in manager.checkpoints()] == [1, 2]
        assert ck.verify(manager.path_for(2)).startswith("torch zip, every record's CRC-32 matches")
        manager.close()
