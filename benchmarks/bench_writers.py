"""Who writes a DDP checkpoint: writers="rank0" against writers="all", with 1, 2 and 4 ranks, in one run.

Usage: python benchmarks/bench_writers.py [--gib 1] [--ranks 1 2 4] [--repeat 3] [--throttle-mib 0] [--dir DIR]

Each configuration launches N real processes (gloo on 127.0.0.1), each holding the same
``--gib`` GiB of DDP parameters (fp32, 8 MiB tensors; frozen but one, so DDP allocates no
gradient buckets for them), and times, per rank:

- the sync save (``ck.save``): from the call until every rank returned (the file is committed);
- the async stall (``ck.async_save``: until the call returns) and the async total (until ``wait()``);
- the same bytes copied with ``cp`` and made durable with ``sync`` (the floor; measured in the run).

Medians of ``--repeat`` runs (this machine's one disk is noisy). With ``--throttle-mib M`` every
writer process writes at most M MiB/s (a sleep per write call, in ckptools' file writes and in the
pwrite of every share): what a per-node link or disk limit does, and the only way a one-disk,
2-core machine can show how the write time scales with the number of writers. ``cp`` is then
throttled alike (M MiB/s).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _throttle(mib: float) -> None:
    """Cap this process's checkpoint writes at ``mib`` MiB/s (both writers' paths)."""
    if mib <= 0:
        return
    import ckptools.storage as storage
    import ckptools.write.zip_writer as zip_writer

    rate = mib * 2**20
    real_write = storage._WriteRecorder.write
    real_pwrite = zip_writer.os.pwrite

    def slow_write(self: Any, data: Any) -> int:
        started = time.perf_counter()
        n = real_write(self, data)
        time.sleep(max(0.0, n / rate - (time.perf_counter() - started)))
        return n

    def slow_pwrite(fd: int, data: Any, offset: int) -> int:
        started = time.perf_counter()
        n = real_pwrite(fd, data, offset)
        time.sleep(max(0.0, n / rate - (time.perf_counter() - started)))
        return n

    storage._WriteRecorder.write = slow_write  # type: ignore[method-assign]
    zip_writer.os = type(sys)("os_throttled")  # the module's own view of os, pwrite slowed
    zip_writer.os.__dict__.update(os.__dict__)
    zip_writer.os.pwrite = slow_pwrite  # type: ignore[attr-defined]


def _rank(rank: int, world: int, port: int, args: Any, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    import ckptools as ck

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    _throttle(args.throttle_mib)
    n = max(1, int(args.gib * 1024 / 8))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 2048, bias=False) for _ in range(n)]
    for layer in layers[1:]:
        layer.weight.requires_grad_(False)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    state = {"model": model, "step": 1}
    times: dict[str, list[float]] = {}
    # Each mode starts with a warm-up save (snapshot buffers allocated for that mode's shares,
    # page cache settled) that is not counted.
    for writers, i in ((w, i) for w in ("rank0", "all") for i in range(-1, args.repeat)):
        path = os.path.join(args.workdir, f"{writers}-{i}.pt")
        dist.barrier()
        t = time.perf_counter()
        ck.save(path, state, writers=writers)
        took = {f"sync {writers}": time.perf_counter() - t}
        dist.barrier()
        t = time.perf_counter()
        handle = ck.async_save(path + ".async", state, writers=writers)
        took[f"stall {writers}"] = time.perf_counter() - t
        handle.wait()
        took[f"async total {writers}"] = time.perf_counter() - t
        dist.barrier()
        if i >= 0:
            for key, seconds in took.items():
                times.setdefault(key, []).append(seconds)
        if rank == 0:
            for p in (path, path + ".async"):
                if i + 1 < args.repeat or writers == "rank0":
                    os.unlink(p)
    queue.put((rank, times))
    queue.close()
    queue.join_thread()  # delivered before os._exit, which would drop what the feeder still holds
    dist.barrier()
    os._exit(0)  # see the reference loop guide: no gloo teardown at exit


def _cp_sync(src: str, dst: str, throttle_mib: float) -> float:
    t = time.perf_counter()
    if throttle_mib > 0:
        subprocess.run(["dd", f"if={src}", f"of={dst}", "bs=8M", "status=none"], check=True)
        size = os.path.getsize(src)
        time.sleep(max(0.0, size / (throttle_mib * 2**20) - (time.perf_counter() - t)))
    else:
        subprocess.run(["cp", src, dst], check=True)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--throttle-mib", type=float, default=0.0, help="cap each writer at this many MiB/s")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(_HERE, "..", "tests"))
    from _dist import free_port

    args.workdir = tempfile.mkdtemp(prefix="ckptools-bench-writers-", dir=args.dir or os.getcwd())
    rows = []
    try:
        for world in args.ranks:
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
            for p in procs:
                p.start()
            results = dict(queue.get(timeout=3600) for _ in range(world))
            for p in procs:
                p.join(60)
            final = os.path.join(args.workdir, f"all-{args.repeat - 1}.pt")
            floor = statistics.median(_cp_sync(final, final + ".cp", args.throttle_mib) for _ in range(args.repeat))
            size = os.path.getsize(final) / 2**30
            for key in sorted(results[0], key=lambda k: (k.split()[-1] != "rank0", k)):
                # A collective save ends when its slowest rank returns; the stall is per rank: the worst.
                per_run = [max(results[r][key][i] for r in range(world)) for i in range(args.repeat)]
                rows.append((world, key, statistics.median(per_run), floor, size))
            for name in os.listdir(args.workdir):
                os.unlink(os.path.join(args.workdir, name))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    limit = f", each writer throttled to {args.throttle_mib:g} MiB/s" if args.throttle_mib else ""
    print(f"{args.gib:g} GiB of replicated state per rank{limit}; medians of {args.repeat}; worst rank per run")
    print(f"{'ranks':>5}  {'measure':<20}{'seconds':>9}{'x cp+sync':>11}{'file GiB':>10}")
    for world, key, t, floor, size in rows:
        print(f"{world:>5}  {key:<20}{t:>9.2f}{t / floor:>11.2f}{size:>10.2f}")
    for world in args.ranks:
        (floor,) = {r[3] for r in rows if r[0] == world}
        print(f"{world:>5}  {'cp + sync (floor)':<20}{floor:>9.2f}{1.0:>11.2f}")


if __name__ == "__main__":
    main()
