"""A training job in miniature for the kill -9 tests: resume, then save through the manager forever.

Usage: python _crash_writer.py DIRECTORY NUMEL KEEP_LAST [async]

Prints ``ready STEP`` once resumed (STEP = 0 on a fresh start), then ``begin N`` before and
``saved N`` after each save, flushed, so the parent knows which steps had completed when it
killed the process. Checkpoint N holds ``w = base + N`` with ``base`` drawn from seed 0.

With ``async`` every save is ``blocking=False``; the live tensor is overwritten with garbage the
moment the call returns (the file must still hold ``base + N``), and ``saved N`` is printed
once the next save's call has returned, since that call finished save N first.
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
    background = sys.argv[4:] == ["async"]
    manager = ck.CheckpointManager(directory, keep_last=keep_last)
    ckpt = manager.restore({})
    step = 0 if ckpt is None else int(ckpt["step"])
    base = expected(numel, 0)
    live = base.clone()
    in_flight = None
    print(f"ready {step}", flush=True)
    while True:
        step += 1
        live.copy_(base).add_(step)
        print(f"begin {step}", flush=True)
        manager.save({"w": live, "step": step}, step, blocking=not background)
        if background:
            live.fill_(float("nan"))  # training moves on at once; the snapshot must not notice
            if in_flight is not None:
                print(f"saved {in_flight}", flush=True)
            in_flight = step
        else:
            print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
