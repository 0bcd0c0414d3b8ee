"""ck.save / ck.load against torch.save (+fsync), cp + sync and torch.load on one state dict, in one run.

Usage: python benchmarks/bench_save.py [--gib 1.0] [--dir DIR] [--repeat 3]
Prints wall time of each path and its ratio to the baseline (the median of --repeat runs: this
machine's disk is noisy, and the best of a few runs hides how often a write is slow). The saves
also get their ratio to ``cp`` + ``sync`` of the same file, the least a durable copy costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

import ckptools as ck


def _best(fn, repeat: int) -> float:
    """The median wall time of ``repeat`` runs (the name is kept for the callers below)."""
    times = []
    for _ in range(repeat):
        os.sync()  # every run starts with nothing of the previous ones still being written back
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (fp32 tensors of 8 MiB)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as cwd)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    n = max(1, int(args.gib * 1024 / 8))
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(2048, 1024) for i in range(n)}
    model_like = {"model": state, "step": 1}
    workdir = tempfile.mkdtemp(prefix="ckptools-bench-", dir=args.dir or os.getcwd())
    base, ours = os.path.join(workdir, "torch.pt"), os.path.join(workdir, "ck.pt")

    def torch_save_fsync() -> None:
        with open(base, "wb") as f:
            torch.save(model_like, f)
            f.flush()
            os.fsync(f.fileno())

    try:
        t_torch = _best(torch_save_fsync, args.repeat)
        t_ck = _best(lambda: ck.save(ours, model_like), args.repeat)
        copy = os.path.join(workdir, "copy.pt")

        def cp_sync() -> None:
            subprocess.run(["cp", ours, copy], check=True)
            subprocess.run(["sync"], check=True)

        t_cp = _best(cp_sync, args.repeat)
        t_load_torch = _best(lambda: torch.load(base, weights_only=True), args.repeat)
        t_load_ck = _best(lambda: ck.load(ours), args.repeat)
        t_verify = _best(lambda: ck.load(ours, verify=True), args.repeat)
        size = os.path.getsize(ours) / 2**30
        print(f"state: {n} x 8 MiB fp32 tensors, file {size:.2f} GiB, medians of {args.repeat}")
        print(f"{'operation':<44}{'seconds':>9}{'ratio':>8}")
        for name, t, ref in (
            ("torch.save + flush + fsync (baseline)", t_torch, t_torch),
            ("ck.save (atomic: temp, fsync, rename, dir fsync)", t_ck, t_torch),
            ("cp + sync of the same file (floor)", t_cp, t_torch),
            ("ck.save / cp + sync", t_ck, t_cp),
            ("torch.load(weights_only=True) (baseline)", t_load_torch, t_load_torch),
            ("ck.load", t_load_ck, t_load_torch),
            ("ck.load(verify=True) (CRC-32 of every record)", t_verify, t_load_torch),
        ):
            print(f"{name:<44}{t:>9.3f}{t / ref:>7.2f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
