"""What ck.SeededDataset costs: µs per item against the same loop without it, and the reference
loop's step time with and without it (random augmentation in 2 DataLoader workers, under torchrun).

Usage: python benchmarks/bench_seeded.py [--items 20000] [--repeat 5] [--batch-sizes 1 16 64]
       [--nproc 2] [--steps-dataset 4096]
Per item: a DataLoader with ``num_workers=0`` (the cost lands on the measured process) over a
dataset whose ``__getitem__`` returns a row of a tensor and draws one number from each of torch,
python and numpy; the wrapper's cost is (wrapped - plain) / items, median of --repeat runs (the
difference of the medians). The wrapper saves and restores the process's three streams once per
batch and seeds them once per item, so the per-item cost falls with the batch size.
Step time: the reference loop (``examples/train_ddp.py --num-workers 2``, no saves) with
``--seeded-dataset`` and ``--no-seeded-dataset``, steps/s median of --repeat launches; goal: no
measurable change.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import ckptools as ck

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_ddp.py")


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i] * (torch.rand(()) + random.random() + float(np.random.rand()))


def seconds(items: int, batch_size: int, wrapped: bool) -> float:
    data = Rows(items)
    sampler = ck.ResumableDistributedSampler(data, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(ck.SeededDataset(data, sampler) if wrapped else data, batch_size=batch_size, sampler=sampler)
    started = time.perf_counter()
    for _ in sampler.track(loader):
        pass
    return time.perf_counter() - started


def per_item(items: int, repeat: int, batch_sizes: list[int]) -> None:
    print(f"per item, {items} items, num_workers=0, median of {repeat}:")
    print(f"{'batch':>6} {'plain µs/item':>14} {'wrapped µs/item':>16} {'wrapper µs/item':>16}")
    for batch_size in batch_sizes:
        plain, wrapped = [], []
        for _ in range(repeat):  # interleaved, so drift in the machine's speed hits both alike
            plain.append(seconds(items, batch_size, False))
            wrapped.append(seconds(items, batch_size, True))
        p, w = statistics.median(plain) / items * 1e6, statistics.median(wrapped) / items * 1e6
        print(f"{batch_size:>6} {p:>14.1f} {w:>16.1f} {w - p:>16.1f}")


def steps_per_second(seeded: bool, nproc: int, dataset: int) -> float:
    flag = "--seeded-dataset" if seeded else "--no-seeded-dataset"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", SCRIPT,
           "--ckpt-dir", os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_seeded"), "--resume", "none",
           "--save-every-steps", "0", "--num-workers", "2", "--dataset-size", str(dataset), "--epochs", "2",
           flag]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    found = re.search(r"\(([\d.]+) steps/s\)", out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        raise SystemExit(f"launch failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    return float(found.group(1))


def step_time(nproc: int, dataset: int, repeat: int) -> None:
    plain, seeded = [], []
    for _ in range(repeat):
        plain.append(steps_per_second(False, nproc, dataset))
        seeded.append(steps_per_second(True, nproc, dataset))
    p, s = statistics.median(plain), statistics.median(seeded)
    print(f"reference loop, {nproc} ranks, 2 workers each, {dataset} samples x 2 epochs, median of {repeat}:")
    print(f"  without SeededDataset {p:.1f} steps/s, with {s:.1f} steps/s: {s / p:.3f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps-dataset", type=int, default=4096)
    args = p.parse_args()
    torch.set_num_threads(1)
    per_item(args.items, args.repeat, args.batch_sizes)
    step_time(args.nproc, args.steps_dataset, args.repeat)


if __name__ == "__main__":
    main()
