"""How long a save stalls the training loop: ck.async_save against sync ck.save, DCP's async_save
and the floor (copying the same tensors into buffers allocated once), all measured in one run.

Usage: python benchmarks/bench_async.py [--gib 1 4] [--repeat 3] [--dir DIR] [--device cpu|cuda]
Prints, per size, the median stall of each path over --repeat saves after one warm-up save (so
buffers kept between saves are already there, as in a training run's steady state), the time
until the file is complete, and the ratios the goals are stated in: async stall / sync save
(goal <= 0.1) and async stall / DCP async stall (goal <= 0.5). One process, one gloo group of
one rank (DCP wants a process group).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckptools as ck


def _state(gib: float, device: str) -> dict[str, torch.Tensor]:
    n = max(1, int(gib * 1024 / 8))  # 8 MiB fp32 tensors, like a model's weight matrices
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(2048, 1024, generator=g).to(device) for i in range(n)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median(values: list[float]) -> float:
    return statistics.median(values)


def bench(gib: float, repeat: int, workdir: str, device: str) -> dict[str, float]:
    state = _state(gib, device)
    model = {"model": state, "step": 1}
    out: dict[str, list[float]] = {k: [] for k in ("sync", "ck_stall", "ck_done", "dcp_stall", "dcp_done", "floor")}
    # The floor: copy into buffers allocated (and faulted in) once; pinned for CUDA as ck does.
    floor_buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in state.items()}
    for b in floor_buffers.values():
        b.fill_(0)
    for i in range(repeat + 1):  # iteration 0 warms up (allocations, page cache, DCP planning)
        keep = i > 0
        _sync(device)
        t = time.perf_counter()
        ck.save(os.path.join(workdir, "sync.pt"), model)
        if keep:
            out["sync"].append(time.perf_counter() - t)

        _sync(device)
        t = time.perf_counter()
        handle = ck.async_save(os.path.join(workdir, "async.pt"), model)
        stall = time.perf_counter() - t
        handle.wait()
        if keep:
            out["ck_stall"].append(stall)
            out["ck_done"].append(time.perf_counter() - t)

        target = os.path.join(workdir, f"dcp{i}")
        _sync(device)
        t = time.perf_counter()
        future = dcp.async_save(model, checkpoint_id=target)
        stall = time.perf_counter() - t
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        if keep:
            out["dcp_stall"].append(stall)
            out["dcp_done"].append(time.perf_counter() - t)
        shutil.rmtree(target, ignore_errors=True)

        _sync(device)
        t = time.perf_counter()
        for k, v in state.items():
            floor_buffers[k].copy_(v, non_blocking=device == "cuda")
        _sync(device)
        if keep:
            out["floor"].append(time.perf_counter() - t)
    ck.release_staging_buffers()
    return {k: _median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under cwd)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--plot", help="also draw the stall per save of each method into this PNG")
    args = parser.parse_args()
    results = []
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=datetime.timedelta(600)
    )
    workdir = tempfile.mkdtemp(prefix="ckptools-bench-async-", dir=args.dir or os.getcwd())
    try:
        print(f"device {args.device}; torch {torch.__version__}; median of {args.repeat} saves after a warm-up")
        header = f"{'GiB':>5} {'sync save':>10} {'ck stall':>9} {'ck done':>8} {'DCP stall':>10} {'DCP done':>9}"
        print(header + f" {'floor':>7} {'ck/sync':>8} {'ck/DCP':>7} {'floor/sync':>10}")
        for gib in args.gib:
            r = bench(gib, args.repeat, workdir, args.device)
            results.append((gib, r))
            print(
                f"{gib:>5g} {r['sync']:>9.3f}s {r['ck_stall']:>8.3f}s {r['ck_done']:>7.2f}s {r['dcp_stall']:>9.3f}s "
                f"{r['dcp_done']:>8.2f}s {r['floor']:>6.3f}s {r['ck_stall'] / r['sync']:>7.3f}x "
                f"{r['ck_stall'] / r['dcp_stall']:>6.3f}x {r['floor'] / r['sync']:>9.3f}x",
                flush=True,
            )
        if args.plot:
            plot(results, args.repeat, args.device, args.plot)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        dist.destroy_process_group()


def plot(results: list, repeat: int, device: str, path: str) -> None:
    """How long training waits per save, per method and state size (a log scale: they differ 10-100x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [("sync", "ck.save (sync)"), ("dcp_stall", "DCP async_save"), ("ck_stall", "ck.async_save"),
               ("floor", "copy floor")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 3.4), constrained_layout=True)
    width = 0.8 / len(methods)
    for i, (key, label) in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(results))]
        bars = ax.bar(xs, [r[key] for _, r in results], width, label=label)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
    ax.set_xticks(range(len(results)), [f"{gib:g} GiB state" for gib, _ in results])
    ax.set_yscale("log")
    ax.set_ylabel("seconds training waits per save")
    ax.set_title(f"Stall per save on {device} (median of {repeat} after a warm-up)", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
