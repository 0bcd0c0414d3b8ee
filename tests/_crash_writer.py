"""A training job in miniature for the kill -9 tests: resume, then save through the manager forever.

Usage: python _crash_writer.py DIRECTORY NUMEL KEEP_LAST

Prints ``ready STEP`` once resumed (STEP = 0 on a fresh start), then ``begin N`` before and
``saved N`` after each save, flushed, so the parent knows which steps had completed when it
killed the process. Checkpoint N holds ``w = base + N`` with ``base`` drawn from seed 0.
"""

from __future__ import annotations

import sys

import torch

import ckptools as ck


def expected(numel: int, step: int) -> torch.Tensor:
    base = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    return base + step


def main() -> None:
    directory, numel, keep_last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    manager = ck.CheckpointManager(directory, keep_last=keep_last)
    ckpt = manager.restore({})
    step = 0 if ckpt is None else int(ckpt["step"])
    base = expected(numel, 0)
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        print(f"begin {step}", flush=True)
        manager.save({"w": base + step, "step": step}, step)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
