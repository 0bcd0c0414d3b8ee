"""What reading a snapshot costs: ckptools' reader alone, and a restore in place against the copy floor.

Usage: python benchmarks/bench_reader.py [--gib 1] [--pairs 10] [--dir /mnt/huge-tmpfs] [--against CHECKOUT]

A snapshot of ``--gib`` GiB (8 MiB fp32 tensors, as bench_snapshot.py's) is written into a folder of this
user's under ``--dir`` (default ``$CKPTOOLS_BENCH_MEMORY_DIR``, else ``/dev/shm``) with a ``.node`` token,
as node memory holds it. Then, in fresh processes (a restore's first mapping of the file is its cost):

- *reader*: ``ck.load(path)`` with nothing restored: the checks, the unpickler, the mapping; no tensor's
  bytes are touched (medians of 15 in each process);
- *restore*: ``ck.load(path, {"model": module})``, every tensor copied into a model that exists, against
  the floor (the same copy between two tensors faulted in before, measured on both sides), medians of 9.

``--against`` runs the same in alternate processes on another checkout (``git worktree add /tmp/old
<commit>``): this checkout's and the other's figures interleaved, pair by pair, so that the machine's
drift falls on both alike. Issue 54: the reader before and after the own-snapshot fast path was removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import gc, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch, ckptools as ck
from bench_snapshot import _copy_all, _module, _state
mode, path, gib = sys.argv[2], sys.argv[3], float(sys.argv[4])
if mode == "reader":
    times = []
    for i in range(18):
        gc.collect()
        started = time.perf_counter()
        tree = ck.load(path, restore_rng=False)
        took = time.perf_counter() - started
        del tree
        if i >= 3:
            times.append(took)
    print(statistics.median(times))
else:
    state = _state(gib)
    buffers = {k: torch.zeros_like(v) for k, v in state.items()}
    target = {"model": _module(state)}
    ratios, restores = [], []
    for i in range(11):
        before = _copy_all(state, buffers)
        gc.collect()
        started = time.perf_counter()
        ck.load(path, target, restore_rng=False)
        took = time.perf_counter() - started
        floor = (before + _copy_all(state, buffers)) / 2
        if i >= 2:
            ratios.append(took / floor)
            restores.append(took)
    print(statistics.median(restores), statistics.median(ratios))
"""


def _snapshot(gib: float, parent: str | None) -> tuple[str, str]:
    """A snapshot file in a node-memory folder of this user's: (folder, path)."""
    sys.path.insert(0, HERE)
    from bench_snapshot import _state

    import ckptools as ck

    folder = tempfile.mkdtemp(prefix="ckptools-bench-reader-", dir=parent)
    run = tempfile.mkdtemp(prefix="ckptools-bench-reader-run-")
    manager = ck.CheckpointManager(run, snapshot_dir=os.path.join(folder, "memory"))
    manager.snapshot({"model": _state(gib)}, 1, blocking=True)
    source = manager.snapshots()[-1][1]
    manager.close()
    path = os.path.join(folder, "kept", "ckpt-0000000001.pt")  # out of the keeper's reach: it would persist it
    os.mkdir(os.path.dirname(path), 0o700)
    shutil.copyfile(source, path)
    with open(os.path.join(os.path.dirname(path), ".node"), "w") as f:
        f.write("bench")
    shutil.rmtree(run, ignore_errors=True)
    return folder, path


def _run(checkout: str, mode: str, path: str, gib: float) -> list[float]:
    env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = subprocess.run([sys.executable, "-c", CHILD, os.path.join(checkout, "benchmarks"), mode, path, str(gib)],
                         env=env, cwd=checkout, capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--dir", default=None, help="where node memory is (default $CKPTOOLS_BENCH_MEMORY_DIR or /dev/shm)")
    p.add_argument("--against", default=None, help="another checkout, run in alternate processes")
    args = p.parse_args()
    parent = (
        args.dir or os.environ.get("CKPTOOLS_BENCH_MEMORY_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    folder, path = _snapshot(args.gib, parent)
    checkouts = {"this checkout": ROOT, **({"--against": os.path.abspath(args.against)} if args.against else {})}
    try:
        for mode in ("reader", "restore"):
            seen: dict[str, list[list[float]]] = {name: [] for name in checkouts}
            for _ in range(args.pairs if mode == "reader" else max(1, args.pairs * 2 // 3)):
                for name, checkout in checkouts.items():
                    seen[name].append(_run(checkout, mode, path, args.gib))
            for name, rows in seen.items():
                if mode == "reader":
                    values = [r[0] * 1000 for r in rows]
                    print(f"{mode:8s} {name}: median {statistics.median(values):.1f} ms over {len(rows)} processes "
                          f"(each a median of 15; {min(values):.1f}-{max(values):.1f} ms)")  # fmt: skip
                else:
                    ratios = [r[1] for r in rows]
                    print(f"{mode:8s} {name}: median {statistics.median(r[0] for r in rows) * 1000:.1f} ms, "
                          f"{statistics.median(ratios):.2f}x the floor ({min(ratios):.2f}-{max(ratios):.2f}x) "
                          f"over {len(rows)} processes")  # fmt: skip
            if len(checkouts) == 2:
                mine, other = seen["this checkout"], seen["--against"]
                differences = [(a[0] - b[0]) * 1000 for a, b in zip(mine, other)]
                middle = statistics.median(differences)
                print(f"{mode:8s} this checkout minus --against, pair by pair: median {middle:+.1f} ms "
                      f"({min(differences):+.1f} to {max(differences):+.1f})")  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
