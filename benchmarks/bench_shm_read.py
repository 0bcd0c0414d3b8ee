"""Ways to read 1 GiB of a node-memory file into tensors that exist, against the copy floor.

Usage: python benchmarks/bench_shm_read.py [--gib 1] [--repeat 5] [--dir /dev/shm]

Why a restore from node memory is ~1.7x the copy floor (`bench_snapshot.py`) and what else was tried.
Interleaved, medians, each copy 8 MiB at a time (a model's tensors one by one): the floor (a torch
copy between two tensors faulted in before); a fresh
``mmap`` of the file copied into the destination (what ``torch.load(mmap=True)`` then an in-place
restore does: every page of the mapping is faulted in by the copy); the same mapping with
``MAP_POPULATE``; with ``madvise(MADV_POPULATE_READ)``; and ``preadv`` straight into the destination's
memory (no mapping at all).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

import torch

MADV_POPULATE_READ = 22  # linux/mman.h, Linux 5.14 on; not in Python 3.11's mmap module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm")
    args = p.parse_args()
    size = int(args.gib * (1 << 30)) // 8 * 8
    path = os.path.join(args.dir, f"ckptools-bench-shm-read-{os.getpid()}")
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, size) as m:
            filled = torch.frombuffer(m, dtype=torch.int64)
            filled.fill_(7)
            del filled
        dst = torch.ones(size // 8, dtype=torch.int64)
        src = torch.full((size // 8,), 2, dtype=torch.int64)
        into = memoryview(dst.numpy()).cast("B")
        chunk = (8 << 20) // 8  # copied 8 MiB at a time, as a restore copies a model's tensors one by one

        def copy(target: torch.Tensor, source: torch.Tensor) -> None:
            for at in range(0, target.numel(), chunk):
                target[at : at + chunk].copy_(source[at : at + chunk])

        def mapped(flags: int = mmap.MAP_SHARED, advice: int | None = None) -> None:
            with mmap.mmap(fd, size, flags=flags) as m:  # writable: torch.frombuffer warns on a read-only one
                if advice is not None:
                    m.madvise(advice)
                view = torch.frombuffer(m, dtype=torch.int64)
                copy(dst, view)
                del view

        def pread() -> None:
            done = 0
            while done < size:
                done += os.preadv(fd, [into[done : done + (1 << 30)]], done)

        ways = {
            "floor (torch copy, both faulted in)": lambda: copy(dst, src),
            "mmap, copy (torch.load(mmap=True)'s way)": mapped,
            "mmap with MAP_POPULATE, copy": lambda: mapped(mmap.MAP_SHARED | mmap.MAP_POPULATE),
            "mmap, MADV_POPULATE_READ, copy": lambda: mapped(advice=MADV_POPULATE_READ),
            "preadv into the destination": pread,
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(args.repeat + 1):
            for name, way in ways.items():
                started = time.perf_counter()
                way()
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - started)
        floor = statistics.median(times["floor (torch copy, both faulted in)"])
        for name, measured in times.items():
            median = statistics.median(measured)
            print(f"{name}: {median * 1e3:.1f} ms ({median / floor:.2f}x the floor), median of {args.repeat}")
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
