"""Resuming with every rank reading the checkpoint vs rank 0 reading and broadcasting it.

Usage: python benchmarks/bench_broadcast.py [--gib 1] [--nproc 2 4] [--rounds 3]
For each process count, spawns a gloo group on 127.0.0.1, saves a --gib GiB model state once
(ck.save), then times ck.load(path, {"model": m}) with every rank reading the file and with
read="rank0" (rank 0 reads, the others receive over the group), barrier to barrier, median of
--rounds. Also prints each rank's peak RSS growth in its first load, a broadcast one (the
received checkpoint plus one 64 MiB bucket is the bound; the model itself exists before). The file is in the
page cache after the save, so "every rank reads" is the best case for it (a shared filesystem or
a cold node-local disk is slower); broadcast's cost is the transfer over the group.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(gib: float) -> torch.nn.Module:
    # Few, large parameters: 64 MiB each, like the big matrices of a real model.
    n = max(1, int(gib * 16))
    return torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(4096, 4096)) for _ in range(n)])


def _run(rank: int, world: int, port: int, gib: float, rounds: int, path: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))  # fmt: skip
    import ckptools as ck

    model = _model(gib)
    ck.save(path, {"model": model})
    # Peak memory: the first load of this process, a broadcast one (ru_maxrss is a high-water mark).
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ck.load(path, {"model": model}, read="rank0")
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    times: dict[str, list[float]] = {"every rank reads": [], "broadcast=True": []}
    for _ in range(rounds):
        for label, read in (("every rank reads", "each"), ("broadcast=True", "rank0")):
            dist.barrier()
            t = time.perf_counter()
            ck.load(path, {"model": model}, read=read)
            dist.barrier()
            times[label].append(time.perf_counter() - t)
    growths = [None] * world
    dist.all_gather_object(growths, growth * 1024)
    if rank == 0:
        queue.put({k: statistics.median(v) for k, v in times.items()} | {"rss": growths})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"resume of a {args.gib:g} GiB checkpoint, gloo on 127.0.0.1, {os.cpu_count()} CPUs; median of {args.rounds}")
    for world in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            queue = ctx.SimpleQueue()
            port = _port()
            path = os.path.join(tmp, "ckpt.pt")
            procs = [ctx.Process(target=_run, args=(r, world, port, args.gib, args.rounds, path, queue))
                     for r in range(world)]  # fmt: skip
            for p in procs:
                p.start()
            result = queue.get()
            for p in procs:
                p.join()
        every, bcast = result["every rank reads"], result["broadcast=True"]
        rss = ", ".join(f"{g / 2**30:.2f}" for g in result["rss"])
        print(f"  {world} processes: every rank reads {every:.2f} s, broadcast {bcast:.2f} s "
              f"({bcast / every:.2f}x); peak RSS growth per rank in a broadcast load, GiB: {rss}")  # fmt: skip


if __name__ == "__main__":
    main()
