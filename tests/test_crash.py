"""Crash consistency: kill -9 in the middle of saves, and two jobs writing into one directory.

``make test`` runs a handful of kills; ``make stress`` runs the same audit with
``CKPTOOLS_KILLS=100`` (or more) and prints the counts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from _killer import kill_loop

import ckptools as ck
from ckptools.layouts.torch_io import verify_torch_file
from ckptools.storage import TMP_MARKER

KILLS = int(os.environ.get("CKPTOOLS_KILLS", "4"))
NUMEL = 50 * 2**20 // 4  # ~50 MB of float32, as a mid-sized model's state


def test_kill_minus_9_during_saves_loses_nothing(tmp_path):
    audit = kill_loop(str(tmp_path / "run"), kills=KILLS, numel=NUMEL, keep_last=3, seed=KILLS)
    print(f"\nkill -9 stress (local disk): {audit.summary()}")
    assert audit.problems == []
    assert audit.corrupt == 0 and audit.lost == 0
    assert audit.saves_completed > 0


@pytest.mark.slow  # a whole-run scenario: make interop (make test stays within its 5 minutes)
def test_kill_minus_9_during_background_saves_loses_nothing(tmp_path):
    # The writer overwrites its live tensor the moment each async save returns, so a snapshot
    # that missed a byte shows up as a checkpoint holding the wrong data.
    audit = kill_loop(str(tmp_path / "run"), kills=KILLS, numel=NUMEL, keep_last=3, seed=KILLS + 1, background=True)
    print(f"\nkill -9 stress (local disk, async saves): {audit.summary()}")
    assert audit.problems == []
    assert audit.corrupt == 0 and audit.lost == 0
    assert audit.saves_completed > 0


_TWO_WRITERS = """
import sys, torch, ckptools as ck
directory, tag, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
manager = ck.CheckpointManager(directory, keep_last=3)
for step in range(1, 16):
    manager.save({"w": torch.full((numel,), float(tag * 1000 + step)), "writer": tag}, step)
print("done", flush=True)
"""


def test_two_writers_in_one_directory_never_interleave(tmp_path):
    # A misconfigured second job pointed at the same directory: both save the same step names.
    numel = 1 << 20
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_WRITERS, str(tmp_path), str(tag), str(numel)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tag in (1, 2)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        # Neither job's save failed: neither deleted the other's file mid-write.
        assert proc.returncode == 0 and "done" in out, err
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if TMP_MARKER in n], names
    assert names, "both writers pruned everything"
    writers = set()
    for name in names:
        path = tmp_path / name
        verify_torch_file(path)
        ckpt = ck.load(path, restore_rng=False)
        step = int(name[5:15])
        # One writer's complete file, never a mix: the payload matches the writer recorded in it.
        assert torch.equal(ckpt["w"], torch.full((numel,), float(ckpt["writer"] * 1000 + step)))
        writers.add(ckpt["writer"])
    print(f"\ntwo writers: files left {names}, written by {sorted(writers)}")
