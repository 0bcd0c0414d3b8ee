"""How long `CheckpointManager.snapshot` stalls the loop, against the copy floor and a sync save.

Usage: python benchmarks/bench_snapshot.py [--gib 1] [--repeat 5] [--dir DIR]
One process. Per round, interleaved: the floor (copying the same tensors into host buffers
allocated and faulted in once), a snapshot into node memory (/dev/shm), and a sync `manager.save`
to --dir (disk); then restores: from the snapshot, from the disk file (page cache dropped where
possible is not attempted: a warm read, the best case for disk), and the floor of a restore
(copying the tensors back from buffers). Prints medians and the ratios the goals are stated in:
snapshot stall / floor (goal <= 1.1 on CPU), for ``blocking=True`` (the file whole in node memory on
return) and ``blocking=False`` (the state copied into host buffers on return, written behind).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import ckptools as ck


def _state(gib: float) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * 1024 / 8))  # 8 MiB fp32 tensors, like a model's weight matrices
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(2048, 1024, generator=g) for i in range(n)}


def _module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    for key, value in state.items():
        setattr(module, key.split(".")[0], torch.nn.Linear(value.shape[1], value.shape[0], bias=False))
    return module


def bench(gib: float, repeat: int, workdir: str) -> dict[str, float]:
    state = _state(gib)
    memory = tempfile.mkdtemp(prefix="ckptools-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    manager = ck.CheckpointManager(os.path.join(workdir, "run"), keep_last=1, snapshot_dir=memory)
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    for b in buffers.values():
        b.fill_(0)
    keys = ("floor", "snapshot", "snapshot_async", "save", "restore_mem", "restore_disk")
    times: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(repeat + 1):  # round 0 warms up (allocations, page cache)
        keep = i > 0
        started = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        floor = time.perf_counter() - started  # also the floor of a restore: the same copy, reversed
        started = time.perf_counter()
        manager.snapshot({"model": state}, 2 * i + 1)
        snap = time.perf_counter() - started
        started = time.perf_counter()
        manager.snapshot({"model": state}, 2 * i + 1, blocking=False)  # the same step: replaced in place
        snap_async = time.perf_counter() - started
        manager.wait()
        started = time.perf_counter()
        manager.save({"model": state}, 2 * i)
        save = time.perf_counter() - started
        target = {"model": _module(state)}  # restored in place: every tensor is copied into it
        started = time.perf_counter()
        ck.load(manager.snapshots()[-1][1], target)
        mem = time.perf_counter() - started
        started = time.perf_counter()
        ck.load(manager.checkpoints()[-1][1], target)
        disk = time.perf_counter() - started
        if keep:
            for key, value in (("floor", floor), ("snapshot", snap), ("snapshot_async", snap_async), ("save", save),
                               ("restore_mem", mem), ("restore_disk", disk)):  # fmt: skip
                times[key].append(value)
    shutil.rmtree(memory, ignore_errors=True)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, nargs="+", default=[1.0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="a folder on the disk the durable saves go to")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="ckptools-bench-snapshot-", dir=args.dir)
    os.environ.setdefault("CKPTOOLS_KEEPER_GRACE", "1")
    try:
        for gib in args.gib:
            m = bench(gib, args.repeat, workdir)
            print(
                f"{gib:g} GiB, median of {args.repeat}: floor {m['floor']:.3f} s, snapshot {m['snapshot']:.3f} s "
                f"({m['snapshot'] / m['floor']:.2f}x the floor; goal <= 1.1), snapshot(blocking=False) stall "
                f"{m['snapshot_async']:.3f} s ({m['snapshot_async'] / m['floor']:.2f}x), "
                f"sync save to disk {m['save']:.3f} s "
                f"({m['save'] / m['snapshot']:.1f}x the snapshot); restore from memory {m['restore_mem']:.3f} s, "
                f"from disk (warm) {m['restore_disk']:.3f} s",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
