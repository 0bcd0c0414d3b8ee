"""ck.save / ck.load against torch.save (+fsync), cp + sync and torch.load on one state dict, in one run.

Usage: python benchmarks/bench_save.py [--gib 1.0] [--dir DIR] [--repeat 3] [--rest 5]
Prints wall time of each path and its ratio to the baseline (the median of --repeat runs: this
machine's disk is noisy, and the best of a few runs hides how often a write is slow). The saves
also get their ratio to ``cp`` + ``sync`` of the same file, the least a durable copy costs.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _interleaved(fns: dict, outputs: dict, repeat: int, rest: float) -> dict:
    """Median wall time of each write path, run in rotating order with ``rest`` seconds before
    each run: this machine's disk slows down after a few GiB written in a row, so a path always
    run right after another one's gigabyte would be charged for it. Each path writes a new file
    (its previous output is removed, and the removal synced, before the rest), as a
    CheckpointManager's numbered saves do; freeing a gigabyte costs this disk (mounted with
    ``discard``) about a second, which no path should be charged for another's."""
    names = list(fns)
    times: dict = {name: [] for name in names}
    for round_ in range(repeat):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(outputs[name])
            os.sync()
            time.sleep(rest)
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"  {name}: " + " ".join(f"{x:.2f}" for x in t))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (fp32 tensors of 8 MiB)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as cwd)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rest", type=float, default=5.0, help="seconds of rest before each write (see _interleaved)")
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
        source = os.path.join(workdir, "source.pt")
        ck.save(source, model_like)
        copy = os.path.join(workdir, "copy.pt")

        def cp_sync() -> None:
            subprocess.run(["cp", source, copy], check=True)
            subprocess.run(["sync"], check=True)

        writes = {"torch": torch_save_fsync, "ck": lambda: ck.save(ours, model_like), "cp": cp_sync}
        medians = _interleaved(writes, {"torch": base, "ck": ours, "cp": copy}, args.repeat, args.rest)
        t_torch, t_ck, t_cp = medians["torch"], medians["ck"], medians["cp"]
        t_load_torch = _best(lambda: torch.load(base, weights_only=True), args.repeat)
        t_load_ck = _best(lambda: ck.load(ours), args.repeat)
        t_verify = _best(lambda: ck.load(ours, verify=True), args.repeat)
        size = os.path.getsize(ours) / 2**30
        print(f"state: {n} x 8 MiB fp32 tensors, file {size:.2f} GiB, medians of {args.repeat} "
              f"(writes in rotating order, {args.rest:g} s of rest before each)")  # fmt: skip
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
